"""`stargate pylon`: the registration sidecar of one inference engine.

`pylon_command` is the click command the main `stargate` group registers. The process runs
`run_pylon` until SIGTERM or SIGINT, then closes every registration stream (the replicas drop the
engine's routes at once) and exits 0. Malformed flags are usage errors (exit 2).
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import click
import trio

from stargate.clitools import (
    POSITIVE_INT,
    comma_list,
    log_format_option,
    log_level_option,
    option,
)
from stargate.logs import configure_logging
from stargate.pylon.config import (
    DEFAULT_HEALTH_PATHS,
    DEFAULT_STARGATE_PORT,
    DialTarget,
    PylonConfig,
    PylonConfigError,
    parse_dial_target,
    parse_upstream_url,
)
from stargate.pylon.sidecar import run_pylon

__all__ = ["pylon_command"]

log = logging.getLogger("stargate.pylon")

THREAD_JOIN_SECONDS = 2.0


def _upstream(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return parse_upstream_url(value)
    except PylonConfigError as error:
        raise click.BadParameter(str(error), ctx, param) from None


def _stargates(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> tuple[DialTarget, ...]:
    targets: dict[DialTarget, None] = {}
    for item in comma_list(ctx, param, value):
        try:
            targets[parse_dial_target(item)] = None
        except PylonConfigError as error:
            raise click.BadParameter(str(error), ctx, param) from None
    if not targets:
        raise click.BadParameter("at least one address is required", ctx, param)
    return tuple(targets)


def _ca_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """A readable file of PEM CA certificates, checked now: grpcio would only fail later, at
    every connection, with a TLS error that does not name the file."""
    if value is None:
        return None
    from cryptography import x509  # not needed by a plaintext Pylon

    try:
        x509.load_pem_x509_certificates(value.read_bytes())
    except OSError as error:
        raise click.BadParameter(f"{value}: {error.strerror or error}", ctx, param) from None
    except ValueError:
        raise click.BadParameter(f"{value}: no PEM CA certificate in it", ctx, param) from None
    return value


def _health_paths(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> tuple[str, ...]:
    paths = comma_list(ctx, param, value)
    for path in paths:
        if not path.startswith("/"):
            raise click.BadParameter(f"{path!r} must start with '/'", ctx, param)
    return tuple(dict.fromkeys(paths)) or DEFAULT_HEALTH_PATHS


async def _watch_signals(signals: AsyncIterator[int], cancel_scope: trio.CancelScope) -> None:
    """The first signal ends the Pylon (its registration streams close as the scope cancels)."""
    from stargate.serving import watch_signals

    def close_registrations(sig: signal.Signals) -> None:
        log.info("received %s, closing registrations", sig.name)
        cancel_scope.cancel()

    await watch_signals(signals, close_registrations)


async def _main(config: PylonConfig) -> int:
    # Imported here so that `stargate --help` does not pay for Hypercorn's imports.
    from stargate.serving import SHUTDOWN_SIGNALS

    with trio.open_signal_receiver(*SHUTDOWN_SIGNALS) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_signals, signals, nursery.cancel_scope)
            await run_pylon(config)
    return 0


def _join_worker_threads() -> None:
    """Join the Pylon's worker threads (normally gone already), so none outlives the program."""
    for thread in threading.enumerate():
        if thread.name.startswith("pylon-") and thread is not threading.current_thread():
            thread.join(THREAD_JOIN_SECONDS)
            if thread.is_alive():
                log.warning("worker thread %s did not stop", thread.name)


@click.command(
    "pylon",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@option(
    "--upstream",
    envvar="STARGATE_PYLON_UPSTREAM",
    metavar="URL",
    required=True,
    callback=_upstream,
    help="Base URL of the inference engine (http:// or https://), registered as its "
    "inference_server_url; replicas send requests and health checks there.",
)
@option(
    "--stargate",
    "stargates",
    envvar="STARGATE_PYLON_STARGATE",
    metavar="HOST:PORT",
    multiple=True,
    default=(f"127.0.0.1:{DEFAULT_STARGATE_PORT}",),
    callback=_stargates,
    help="Seed replica gRPC address(es) to watch with WatchStargates (HOST:PORT, [v6]:PORT or "
    "http(s)://HOST:PORT); repeatable or comma-separated. The Pylon registers with every "
    "replica the seeds announce, not with the seeds as such.",
)
@option(
    "--model-name",
    "model_names",
    envvar="STARGATE_PYLON_MODEL_NAME",
    multiple=True,
    callback=comma_list,
    help="A model to register (repeatable or comma-separated). Without it the models are read "
    "from the upstream's GET /v1/models and re-read every --model-refresh-ms.",
)
@option(
    "--model-refresh-ms",
    envvar="STARGATE_PYLON_MODEL_REFRESH_MS",
    type=POSITIVE_INT,
    default=5000,
    help="How often the upstream's GET /v1/models is re-read (without --model-name). Must be > 0.",
)
@option(
    "--inference-server-id",
    envvar="STARGATE_PYLON_INFERENCE_SERVER_ID",
    default=None,
    help="Identity of this engine on every replica; only one live registration per id is "
    "admitted. [default: HOSTNAME:UPSTREAM_PORT, e.g. node-7:8000]",
)
@option(
    "--cluster-id",
    envvar="STARGATE_PYLON_CLUSTER_ID",
    default="",
    help="Cluster this engine belongs to (engines sharing one are balanced as a group); "
    "empty: the replica uses the inference server id.",
)
@option(
    "--min-update-interval-ms",
    envvar="STARGATE_PYLON_MIN_UPDATE_INTERVAL_MS",
    type=POSITIVE_INT,
    default=1000,
    help="Heartbeat: the full registration is re-sent (and the upstream health probed) this "
    "often; sent to replicas as x-stargate-registration-heartbeat-ms. Must be > 0.",
)
@option(
    "--token-file",
    envvar="STARGATE_PYLON_TOKEN_FILE",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="File holding the bearer token sent as `authorization: Bearer <token>` on every "
    "registration stream (re-read on each reconnect; never logged).",
)
@option(
    "--upstream-health-path",
    "upstream_health_paths",
    envvar="STARGATE_PYLON_UPSTREAM_HEALTH_PATH",
    multiple=True,
    default=DEFAULT_HEALTH_PATHS,
    callback=_health_paths,
    help="Upstream health path(s), tried in order: the first that does not answer 404 decides "
    "(2xx = healthy, models ACTIVE; anything else or no answer = INACTIVE). Repeatable or "
    "comma-separated.",
)
@option(
    "--upstream-health-wait-ms",
    envvar="STARGATE_PYLON_UPSTREAM_HEALTH_WAIT_MS",
    type=click.IntRange(min=0),
    default=60000,
    help="At start, wait up to this long for the upstream to become healthy before "
    "registering (0: probe once and register either way; models stay INACTIVE until healthy).",
)
@option(
    "--stargate-ca-file",
    envvar="STARGATE_PYLON_STARGATE_CA_FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    callback=_ca_file,
    help="PEM CA certificate(s) that sign the replicas' TLS certificates (serve "
    "--tls-cert-path). With it the Pylon dials every replica, seeds and discovered ones, over TLS "
    "trusting these CAs; each replica's certificate must name its advertise address. Without "
    "it, plaintext (h2c) unless a seed is https://.",
)
@log_level_option("STARGATE_PYLON_LOG_LEVEL")
@log_format_option("STARGATE_PYLON_LOG_FORMAT")
def pylon_command(
    upstream: str,
    stargates: tuple[DialTarget, ...],
    model_names: tuple[str, ...],
    model_refresh_ms: int,
    inference_server_id: str | None,
    cluster_id: str,
    min_update_interval_ms: int,
    token_file: Path | None,
    upstream_health_paths: tuple[str, ...],
    upstream_health_wait_ms: int,
    stargate_ca_file: Path | None,
    log_level: str,
    log_format: str,
) -> None:
    """Register one inference engine with every Stargate replica, until SIGTERM or SIGINT.

    The Pylon watches the seed replicas (WatchStargates), keeps one RegisterInferenceServer
    stream open to every replica they announce, and re-sends the engine's models every
    --min-update-interval-ms: ACTIVE while the upstream's health endpoint answers 2xx, INACTIVE
    otherwise. Streams that fail reconnect with a capped exponential backoff.
    """
    configure_logging(log_level, log_format)
    try:
        config = PylonConfig(
            upstream_url=upstream,
            stargates=stargates,
            model_names=tuple(dict.fromkeys(model_names)),
            model_refresh_ms=model_refresh_ms,
            inference_server_id=(inference_server_id or "").strip(),
            cluster_id=cluster_id.strip(),
            min_update_interval_ms=min_update_interval_ms,
            token_file=token_file,
            upstream_health_paths=upstream_health_paths,
            upstream_health_wait_ms=upstream_health_wait_ms,
            stargate_ca_file=stargate_ca_file,
        )
    except PylonConfigError as error:
        raise click.UsageError(str(error)) from None
    code = trio.run(functools.partial(_main, config))
    _join_worker_threads()
    log.info("pylon stopped")
    sys.exit(code)
