"""The `stargate` command line: flags and environment variables become config objects.

Every flag has help text and an explicit environment variable (named on the flag, not derived, so
renaming a command can never silently change it). Malformed values are click usage errors (exit
2) that name the flag; problems only visible at start-up, such as an occupied port, exit 1 with a
message naming the listener.
"""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from stargate import __version__
from stargate.config import (
    ConfigError,
    ListenAddress,
    ServeConfig,
    WarmupConfig,
    parse_listen_address,
    validate_metrics_prefix,
)

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])


class ListenAddressType(click.ParamType[ListenAddress]):
    """An `IP:port` listen address (`[v6]:port` for IPv6)."""

    name = "IP:PORT"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> ListenAddress:
        if isinstance(value, ListenAddress):
            return value
        try:
            return parse_listen_address(str(value))
        except ConfigError as error:
            self.fail(str(error), param, ctx)


class PositiveInt(click.ParamType[int]):
    """An integer that must be greater than 0 (the Rust parser's "value must be greater than 0")."""

    name = "INTEGER"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        number: int = click.INT.convert(value, param, ctx)
        if number <= 0:
            self.fail(f"value must be greater than 0, got {number}", param, ctx)
        return number


LISTEN_ADDRESS = ListenAddressType()
POSITIVE_INT = PositiveInt()
NON_NEGATIVE_INT = click.IntRange(min=0)
PORT = click.IntRange(min=0, max=65535)


def _metrics_prefix(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return validate_metrics_prefix(value)
    except ConfigError as error:
        raise click.BadParameter(str(error), ctx, param) from None


def _option(*names: str, envvar: str, **kwargs: Any) -> Callable[[F], F]:
    return click.option(*names, envvar=envvar, show_envvar=True, show_default=True, **kwargs)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="stargate")
def main() -> None:
    """stargate: an LLM request router replica (Pylon registration, OpenAI-compatible proxy)."""


@main.command()
@_option(
    "--stargate-id",
    envvar="STARGATE_ID",
    default=None,
    help="Identity of this replica in logs, discovery and /debug/state. [default: the hostname]",
)
@_option(
    "--http-listen-addr",
    envvar="STARGATE_HTTP_LISTEN_ADDR",
    type=LISTEN_ADDRESS,
    default="0.0.0.0:8000",
    help="HTTP listener: the OpenAI-compatible proxy and the /healthz and /readyz probes.",
)
@_option(
    "--listen-addr",
    envvar="STARGATE_LISTEN_ADDR",
    type=LISTEN_ADDRESS,
    default="0.0.0.0:50071",
    help="Control-plane gRPC listener that Pylons register with.",
)
@_option(
    "--metrics-port",
    envvar="STARGATE_METRICS_PORT",
    type=PORT,
    default=9090,
    help="Port of the Prometheus /metrics listener (always bound on 0.0.0.0).",
)
@_option(
    "--metrics-prefix",
    envvar="STARGATE_METRICS_PREFIX",
    default="stargate_",
    callback=_metrics_prefix,
    help="Prefix of every metric name (e.g. llm_request_router_).",
)
@_option(
    "--shutdown-drain-timeout-ms",
    envvar="STARGATE_SHUTDOWN_DRAIN_TIMEOUT_MS",
    type=NON_NEGATIVE_INT,
    default=30_000,
    help="After SIGTERM/SIGINT, how long in-flight requests and streams may take to finish "
    "before the process exits 1.",
)
@_option(
    "--readiness-warmup-ms",
    envvar="STARGATE_READINESS_WARMUP_MS",
    type=NON_NEGATIVE_INT,
    default=60_000,
    help="Upper bound of the readiness warmup: /readyz answers 503 until the backend count is "
    "stable or this deadline passes. 0 = ready at start.",
)
@_option(
    "--warmup-sample-interval-ms",
    envvar="STARGATE_WARMUP_SAMPLE_INTERVAL_MS",
    type=POSITIVE_INT,
    default=1_000,
    help="How often warmup samples the total active backend count. Must be > 0.",
)
@_option(
    "--warmup-stabilization-window",
    envvar="STARGATE_WARMUP_STABILIZATION_WINDOW",
    type=POSITIVE_INT,
    default=5,
    help="Consecutive equal, nonzero samples that end warmup early. Must be > 0.",
)
@_option(
    "--log-level",
    envvar="STARGATE_LOG_LEVEL",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    help="Minimum level of log lines written to stderr.",
)
def serve(
    stargate_id: str | None,
    http_listen_addr: ListenAddress,
    listen_addr: ListenAddress,
    metrics_port: int,
    metrics_prefix: str,
    shutdown_drain_timeout_ms: int,
    readiness_warmup_ms: int,
    warmup_sample_interval_ms: int,
    warmup_stabilization_window: int,
    log_level: str,
) -> None:
    """Run one replica until SIGTERM or SIGINT."""
    _configure_logging(log_level)
    config = ServeConfig(
        stargate_id=stargate_id or socket.gethostname(),
        http_listen_addr=http_listen_addr,
        listen_addr=listen_addr,
        metrics_port=metrics_port,
        metrics_prefix=metrics_prefix,
        shutdown_drain_timeout_ms=shutdown_drain_timeout_ms,
        warmup=WarmupConfig(
            warmup_ms=readiness_warmup_ms,
            sample_interval_ms=warmup_sample_interval_ms,
            stabilization_window=warmup_stabilization_window,
        ),
    )
    from stargate import runtime  # imported here so `--help` stays fast

    sys.exit(runtime.run(config))


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
