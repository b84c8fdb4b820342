"""`stargate pylon`: the registration sidecar of one inference engine.

`pylon_command` is the click command the main `stargate` group registers. The process runs
`run_pylon` until SIGTERM or SIGINT, then closes every registration stream (the replicas drop the
engine's routes at once) and exits 0. Malformed flags are usage errors (exit 2).
"""

from __future__ import annotations

import functools
import logging
import math
import signal
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import click
import trio

from stargate.clitools import LISTEN_ADDRESS, NON_NEGATIVE_INT, POSITIVE_INT, log_settings
from stargate.config import parse_tunnel_protocol
from stargate.logs import configure_logging
from stargate.protocol.kv_events import parse_tcp_endpoint
from stargate.pylon.config import (
    DEFAULT_HEALTH_PATHS,
    DEFAULT_STARGATE_PORT,
    ENGINE_STATS_STREAM_MODES,
    PYLON_CONNECTIVITIES,
    UPSTREAM_BACKENDS,
    DialTarget,
    PylonConfig,
    PylonConfigError,
    parse_advertise_url,
    parse_dial_target,
    parse_upstream_url,
)
from stargate.pylon.sidecar import Pylon
from stargate.settings import Setting, Settings, SettingsCommand, ms_to_seconds

__all__ = ["pylon_command"]

log = logging.getLogger("stargate.pylon")

THREAD_JOIN_SECONDS = 2.0


def _stargates(values: tuple[str, ...]) -> tuple[DialTarget, ...]:
    targets = dict.fromkeys(parse_dial_target(value) for value in values)
    if not targets:
        raise ValueError("at least one address is required")
    return tuple(targets)


def _ca_file(value: Path | None) -> Path | None:
    """A readable file of PEM CA certificates, checked now: grpcio would only fail later, at
    every connection, with a TLS error that does not name the file."""
    if value is None:
        return None
    from cryptography import x509  # not needed by a plaintext Pylon

    try:
        x509.load_pem_x509_certificates(value.read_bytes())
    except OSError as error:
        raise ValueError(f"{value}: {error.strerror or error}") from None
    except ValueError:
        raise ValueError(f"{value}: no PEM CA certificate in it") from None
    return value


def _advertise_url(value: str | None) -> str | None:
    if value is None or not value.strip():
        return None
    return parse_advertise_url(value)


def _path(value: str | None) -> str | None:
    """An engine path (`/...`); empty turns the side channel off."""
    if value is None or not value.strip():
        return None
    path = value.strip()
    if not path.startswith("/") or any(ch.isspace() for ch in path):
        raise ValueError(f"{value!r} must be a path starting with '/'")
    return path


def _kv_events_endpoint(value: str | None) -> str | None:
    """`tcp://HOST:PORT`; empty: off."""
    if value is None or not value.strip():
        return None
    return parse_tcp_endpoint(value)


def _positive_finite(value: float | None) -> float | None:
    """A finite number > 0 (click's FloatRange lets NaN and infinity through)."""
    if value is None:
        return None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"must be a finite number > 0, got {value}")
    return value


def _health_paths(paths: tuple[str, ...]) -> tuple[str, ...]:
    for path in paths:
        if not path.startswith("/"):
            raise ValueError(f"{path!r} must start with '/'")
    return tuple(dict.fromkeys(paths)) or DEFAULT_HEALTH_PATHS


# `stargate pylon`: defaults are `PylonConfig`'s (and its parts') unless given. The README's flag
# table lists every one (tests/unit/test_flag_docs.py).
PYLON = Settings(
    PylonConfig,
    Setting(
        "--upstream",
        env="STARGATE_PYLON_UPSTREAM",
        to="upstream_url",
        metavar="URL",
        required=True,
        parse=parse_upstream_url,
        help="Base URL of the inference engine (http:// or https://): the Pylon forwards the "
        "replicas' requests and health checks there.",
    ),
    Setting(
        "--stargate",
        env="STARGATE_PYLON_STARGATE",
        to="stargates",
        kind="list",
        metavar="HOST:PORT",
        default=(f"127.0.0.1:{DEFAULT_STARGATE_PORT}",),
        parse=_stargates,
        help="Seed replica gRPC address(es) to watch with WatchStargates (HOST:PORT, [v6]:PORT or "
        "http(s)://HOST:PORT); repeatable or comma-separated. The Pylon registers with every "
        "replica the seeds announce, not with the seeds as such.",
    ),
    Setting(
        "--model-name",
        env="STARGATE_PYLON_MODEL_NAME",
        to="model_names",
        kind="list",
        parse=lambda names: tuple(dict.fromkeys(names)),
        help="A model to register (repeatable or comma-separated). Without it the models are read "
        "from the upstream's GET /v1/models and re-read every --model-refresh-ms.",
    ),
    Setting(
        "--model-refresh-ms",
        env="STARGATE_PYLON_MODEL_REFRESH_MS",
        to="model_refresh_ms",
        type=POSITIVE_INT,
        help="How often the upstream's GET /v1/models is re-read (without --model-name). Must be "
        "> 0.",
    ),
    Setting(
        "--inference-server-id",
        env="STARGATE_PYLON_INFERENCE_SERVER_ID",
        to="inference_server_id",
        default=None,
        parse=lambda value: (value or "").strip(),
        help="Identity of this engine on every replica; only one live registration per id is "
        "admitted. [default: HOSTNAME:UPSTREAM_PORT, e.g. node-7:8000]",
    ),
    Setting(
        "--cluster-id",
        env="STARGATE_PYLON_CLUSTER_ID",
        to="cluster_id",
        parse=str.strip,
        help="Cluster this engine belongs to (engines sharing one are balanced as a group); "
        "empty: the replica uses the inference server id.",
    ),
    Setting(
        "--min-update-interval-ms",
        env="STARGATE_PYLON_MIN_UPDATE_INTERVAL_MS",
        to="min_update_interval_ms",
        type=POSITIVE_INT,
        help="Heartbeat: the full registration is re-sent (and the upstream health probed) this "
        "often; sent to replicas as x-stargate-registration-heartbeat-ms. Must be > 0.",
    ),
    Setting(
        "--token-file",
        env="STARGATE_PYLON_TOKEN_FILE",
        to="token_file",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="File holding the bearer token sent as `authorization: Bearer <token>` on every "
        "registration stream (re-read on each reconnect; never logged).",
    ),
    Setting(
        "--upstream-health-path",
        env="STARGATE_PYLON_UPSTREAM_HEALTH_PATH",
        to="upstream_health_paths",
        kind="list",
        parse=_health_paths,
        help="Upstream health path(s), tried in order: the first that does not answer 404 decides "
        "(2xx = healthy, models ACTIVE; anything else or no answer = INACTIVE). Repeatable or "
        "comma-separated.",
    ),
    Setting(
        "--upstream-health-wait-ms",
        env="STARGATE_PYLON_UPSTREAM_HEALTH_WAIT_MS",
        to="upstream_health_wait_ms",
        type=NON_NEGATIVE_INT,
        help="At start, wait up to this long for the upstream to become healthy before "
        "registering (0: probe once and register either way; models stay INACTIVE until healthy).",
    ),
    Setting(
        "--stargate-ca-file",
        env="STARGATE_PYLON_STARGATE_CA_FILE",
        to="stargate_ca_file",
        type=click.Path(dir_okay=False, path_type=Path),
        parse=_ca_file,
        help="PEM CA certificate(s) that sign the replicas' TLS certificates (serve "
        "--tls-cert-path). With it the Pylon dials every replica, seeds and discovered ones, over "
        "TLS trusting these CAs; each replica's certificate must name its advertise address. "
        "Without it, plaintext (h2c) unless a seed is https://.",
    ),
    Setting(
        "--http-listen-addr",
        env="STARGATE_PYLON_HTTP_LISTEN_ADDR",
        to="request_path.listen_addr",
        type=LISTEN_ADDRESS,
        section="Request path",
        help="Where the Pylon listens for the replicas' requests (HTTP/1.1 keep-alive), which it "
        "forwards to the engine and measures. Port 0 picks a free one. Use 0.0.0.0:PORT (with "
        "--advertise-url) when the replicas are on other hosts.",
    ),
    Setting(
        "--advertise-url",
        env="STARGATE_PYLON_ADVERTISE_URL",
        to="request_path.advertise_url",
        parse=_advertise_url,
        section="Request path",
        help="The URL registered as inference_server_url, where replicas reach this Pylon "
        "(http://HOST:PORT). [default: http://<--http-listen-addr>, a wildcard host replaced by "
        "the address this host's name resolves to (a Pod's IP)]",
    ),
    Setting(
        "--pylon-upstream-backend",
        env="STARGATE_PYLON_UPSTREAM_BACKEND",
        to="request_path.upstream_backend",
        type=click.Choice(UPSTREAM_BACKENDS),
        section="Request path",
        help="dynamo: write x-dynamo-request-priority (= ceiling - x-priority; a request without "
        "x-priority gets 0) and x-dynamo-request-strict-priority: 0 on every request to the "
        "engine; none: write neither. Inbound values of both are always stripped.",
    ),
    Setting(
        "--pylon-priority-ceiling",
        env="STARGATE_PYLON_PRIORITY_CEILING",
        to="request_path.priority_ceiling",
        type=click.IntRange(min=0, max=2**32 - 1),
        section="Request path",
        help="The ceiling of the Dynamo priority mapping (--pylon-upstream-backend dynamo).",
    ),
    Setting(
        "--pylon-local-connect-failures-retryable",
        env="STARGATE_PYLON_LOCAL_CONNECT_FAILURES_RETRYABLE",
        to="request_path.local_connect_failures_retryable",
        kind="switch",
        section="Request path",
        help="When the engine refuses the connection, answer the replica's request with a "
        "retryable 503 (x-stargate-retryable: true, reason local_connect_failure), so it is "
        "retried on another backend; without it the 503 is final.",
    ),
    Setting(
        "--require-streaming",
        env="STARGATE_PYLON_REQUIRE_STREAMING",
        to="request_path.require_streaming",
        kind="switch",
        section="Request path",
        help='Refuse chat completions and Responses requests without "stream": true (400), as '
        "the Rust Pylon does. Without it they are forwarded and counted in the queue, but yield "
        "no throughput samples (one JSON answer cannot separate prefill from decode).",
    ),
    Setting(
        "--pylon-queue-mismatch-retry-enabled",
        env="PYLON_QUEUE_MISMATCH_RETRY_ENABLED",
        to="request_path.admission.enabled",
        type=click.BOOL,
        section="Request path",
        help="Queue admission: refuse a request with a retryable 429 queue_estimate_mismatch when "
        "the local queue estimate exceeds the replica's x-stargate-expected-queue-ms by more than "
        "the tolerance (the replica then tries another backend). Takes a value: "
        "--pylon-queue-mismatch-retry-enabled=false.",
    ),
    Setting(
        "--pylon-queue-mismatch-min-delta-ms",
        env="PYLON_QUEUE_MISMATCH_MIN_DELTA_MS",
        to="request_path.admission.min_delta_ms",
        type=NON_NEGATIVE_INT,
        section="Request path",
        help="Additive tolerance of queue admission: refused only above max(expected + this, "
        "ceil(expected x factor)) ms.",
    ),
    Setting(
        "--pylon-queue-mismatch-tolerance-factor",
        env="PYLON_QUEUE_MISMATCH_TOLERANCE_FACTOR",
        to="request_path.admission.tolerance_factor",
        type=float,
        parse=_positive_finite,
        section="Request path",
        help="Multiplicative tolerance of queue admission; a finite number > 0.",
    ),
    Setting(
        "--pylon-queue-mismatch-retry-after-ms",
        env="PYLON_QUEUE_MISMATCH_RETRY_AFTER_MS",
        to="request_path.admission.retry_after_ms",
        type=NON_NEGATIVE_INT,
        section="Request path",
        help="Sent as x-stargate-retry-after-ms on a queue-mismatch 429. [default: not sent]",
    ),
    Setting(
        "--engine-stats-stream",
        env="STARGATE_PYLON_ENGINE_STATS_STREAM",
        to="side_channels.engine_stats_stream",
        type=click.Choice(ENGINE_STATS_STREAM_MODES),
        section="Engine side channels",
        help="The engine's NDJSON stats stream (per-request token counters; Dynamo and "
        "stargate mock-backend --engine-stats-stream serve it). auto: use it, and observe the "
        "requests instead once it answers 404/405/501 (vLLM, SGLang); required: never fall back; "
        "off: observe the requests from the start.",
    ),
    Setting(
        "--engine-stats-stream-path",
        env="STARGATE_PYLON_ENGINE_STATS_STREAM_PATH",
        to="side_channels.engine_stats_stream_path",
        parse=lambda value: _path(value) or "/pylon/v1/stats/stream",
        section="Engine side channels",
        help="Path of the engine stats stream on the engine.",
    ),
    Setting(
        "--kv-cache-stats-path",
        env="STARGATE_PYLON_KV_CACHE_STATS_PATH",
        to="side_channels.kv_cache_stats_path",
        parse=_path,
        section="Engine side channels",
        help="Poll this engine path every second for KV-cache capacity, used and free tokens "
        "(JSON with model, kv_cache_capacity_tokens, kv_cache_used_tokens, "
        "kv_cache_free_tokens). [default: off]",
    ),
    Setting(
        "--engine-metrics-path",
        env="STARGATE_PYLON_ENGINE_METRICS_PATH",
        to="side_channels.engine_metrics_path",
        parse=_path,
        section="Engine side channels",
        help="Without --kv-cache-stats-path: read KV-cache capacity and usage from the engine's "
        "Prometheus metrics here (vLLM, SGLang), so pulsar's consider_kv_free_tokens works "
        "against real engines. An empty value turns it off.",
    ),
    Setting(
        "--kv-events-endpoint",
        env="STARGATE_PYLON_KV_EVENTS_ENDPOINT",
        to="side_channels.kv_events_endpoint",
        parse=_kv_events_endpoint,
        metavar="tcp://HOST:PORT",
        section="Engine side channels",
        help="Subscribe to the engine's KV events here (vLLM's ZMQ publisher, or stargate "
        "mock-backend --kv-events-endpoint) and send every replica the engine's cached prefix "
        "blocks, for precise prefix routing. [default: off]",
    ),
    Setting(
        "--kv-events-max-blocks",
        env="STARGATE_PYLON_KV_EVENTS_MAX_BLOCKS",
        to="side_channels.kv_events_max_blocks",
        type=POSITIVE_INT,
        section="Engine side channels",
        help="With --kv-events-endpoint: the block set is bounded to this many hashes; past it "
        "the oldest stored blocks are dropped (and removed on the replicas).",
    ),
    Setting(
        "--initial-input-tps",
        env="STARGATE_PYLON_INITIAL_INPUT_TPS",
        to="bringup.initial_input_tps",
        type=float,
        parse=_positive_finite,
        section="Bring-up",
        help="Seed every model's last_mean_input_tps with this (as five samples, published at "
        "once); real samples then move it. Excludes --do-calibration. [default: none: 0 until "
        "five requests completed]",
    ),
    Setting(
        "--benchmark-pin-input-tps",
        env="STARGATE_PYLON_BENCHMARK_PIN_INPUT_TPS",
        to="bringup.pin_input_tps",
        kind="switch",
        hidden=True,
        help="Keep the published input TPS at --initial-input-tps (benchmarks only).",
    ),
    Setting(
        "--do-calibration",
        env="STARGATE_PYLON_DO_CALIBRATION",
        to="bringup.do_calibration",
        kind="switch",
        section="Bring-up",
        help="Measure each model's input TPS with a ramp of requests before advertising it. Only "
        "for a cluster's sole Pylon: the ramp loads the engine.",
    ),
    Setting(
        "--calibration-requests",
        env="STARGATE_PYLON_CALIBRATION_REQUESTS",
        to="bringup.calibration.requests",
        type=POSITIVE_INT,
        section="Bring-up",
        help="Requests of the ramp's first step; doubled every step.",
    ),
    Setting(
        "--calibration-prompt-units",
        env="STARGATE_PYLON_CALIBRATION_PROMPT_UNITS",
        to="bringup.calibration.prompt_units",
        type=click.IntRange(min=256),
        section="Bring-up",
        help="Largest calibration prompt (characters; the ramp starts at 256 and doubles).",
    ),
    Setting(
        "--calibration-max-concurrency",
        env="STARGATE_PYLON_CALIBRATION_MAX_CONCURRENCY",
        to="bringup.calibration.max_concurrency",
        type=POSITIVE_INT,
        section="Bring-up",
        help="Largest concurrency of the ramp (step k runs k+1 requests at a time).",
    ),
    Setting(
        "--calibration-max-steps",
        env="STARGATE_PYLON_CALIBRATION_MAX_STEPS",
        to="bringup.calibration.max_steps",
        type=POSITIVE_INT,
        section="Bring-up",
        help="The ramp stops after this many steps even if the engine never saturated (the Rust "
        "ramp is unbounded).",
    ),
    Setting(
        "--bringup-calibration-timeout-ms",
        env="STARGATE_PYLON_BRINGUP_CALIBRATION_TIMEOUT_MS",
        to="bringup.calibration.step_timeout",
        type=POSITIVE_INT,
        default=30000,  # in ms; `CalibrationConfig.step_timeout` is in seconds
        parse=ms_to_seconds,
        section="Bring-up",
        help="A ramp step that takes longer means the engine is saturated: the ramp stops.",
    ),
    Setting(
        "--bringup-canary-timeout-ms",
        env="STARGATE_PYLON_BRINGUP_CANARY_TIMEOUT_MS",
        to="bringup.canary_timeout_ms",
        type=POSITIVE_INT,
        section="Bring-up",
        help="Timeout of one canary request.",
    ),
    Setting(
        "--canary-interval-ms",
        env="STARGATE_PYLON_CANARY_INTERVAL_MS",
        to="bringup.canary_interval_ms",
        type=NON_NEGATIVE_INT,
        section="Bring-up",
        help='Every this often, a canary ("1+1=", max_tokens 237) per model; a failure, or an '
        "answer that runs to max_tokens, makes the model INACTIVE until a canary passes. 0: no "
        "canaries.",
    ),
    Setting(
        "--backend-connectivity",
        env="STARGATE_PYLON_BACKEND_CONNECTIVITY",
        to="tunnel.connectivity",
        type=click.Choice(PYLON_CONNECTIVITIES),
        default="http",
        section="Tunnels",
        help="How the replicas reach this Pylon: http (its HTTP listener, registered as "
        "http://; our extension), direct (a QUIC listener on --quic-listen-addr, registered as "
        "quic://IP:PORT) or reverse (it dials the reverse tunnel listener each replica's ack "
        "names). direct and reverse are the Rust Pylon's; they must match the replicas.",
    ),
    Setting(
        "--tunnel-protocol",
        env="STARGATE_PYLON_TUNNEL_PROTOCOL",
        to="tunnel.protocol",
        default="raw-quic",
        parse=parse_tunnel_protocol,
        section="Tunnels",
        metavar="raw-quic|http3",
        help="Stream protocol inside the tunnel: raw-quic or http3 (alias h3). Must match the "
        "replicas.",
    ),
    Setting(
        "--quic-listen-addr",
        env="STARGATE_PYLON_QUIC_LISTEN_ADDR",
        to="tunnel.quic_listen_addr",
        type=LISTEN_ADDRESS,
        section="Tunnels",
        help="UDP address of the direct tunnel listener; a wildcard host is registered as this "
        "host's address. Port 0 picks a free one.",
    ),
    Setting(
        "--tls-cert-path",
        env="STARGATE_PYLON_TLS_CERT_PATH",
        to="tunnel.cert_path",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        section="Tunnels",
        help="Direct: the QUIC listener's certificate chain (PEM; with --tls-key-path; a "
        "self-signed one with SANs localhost and stargate without it). Reverse: the certificates "
        "trusted when dialing a replica.",
    ),
    Setting(
        "--tls-key-path",
        env="STARGATE_PYLON_TLS_KEY_PATH",
        to="tunnel.key_path",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        section="Tunnels",
        help="Private key (PEM) of --tls-cert-path.",
    ),
    Setting(
        "--quic-insecure",
        env="STARGATE_PYLON_QUIC_INSECURE",
        to="tunnel.insecure",
        kind="switch",
        section="Tunnels",
        help="Reverse: do not verify the replicas' QUIC certificates.",
    ),
    *log_settings("STARGATE_PYLON_LOG_LEVEL", "STARGATE_PYLON_LOG_FORMAT"),
    sections=("Request path", "Tunnels", "Engine side channels", "Bring-up"),
)


async def _watch_signals(
    signals: AsyncIterator[int], pylon: Pylon, scope: trio.CancelScope
) -> None:
    """The first signal stops the Pylon gracefully (registrations close at once, requests in
    flight finish); a second one exits at once."""
    from stargate.serving import watch_signals

    def stop_gracefully(sig: signal.Signals) -> None:
        log.info("received %s, closing registrations and finishing requests in flight", sig.name)
        pylon.stop()

    def exit_now(sig: signal.Signals) -> None:
        log.info("received %s again, exiting now", sig.name)
        scope.cancel()

    await watch_signals(signals, stop_gracefully, exit_now)


async def _main(config: PylonConfig) -> int:
    # Imported here so that `stargate --help` does not pay for Hypercorn's imports.
    from stargate.serving import SHUTDOWN_SIGNALS, StartupError

    pylon = Pylon(config)
    code = 0
    with trio.open_signal_receiver(*SHUTDOWN_SIGNALS) as signals:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_signals, signals, pylon, nursery.cancel_scope)
                await pylon.run()
                nursery.cancel_scope.cancel()
        except* StartupError as group:
            for error in group.exceptions:
                print(f"error: {error}", file=sys.stderr, flush=True)
            code = 1
    return code


def _join_worker_threads() -> None:
    """Join the Pylon's worker threads (normally gone already), so none outlives the program."""
    for thread in threading.enumerate():
        if thread.name.startswith("pylon-") and thread is not threading.current_thread():
            thread.join(THREAD_JOIN_SECONDS)
            if thread.is_alive():
                log.warning("worker thread %s did not stop", thread.name)


@click.command(
    "pylon",
    cls=SettingsCommand,
    settings=PYLON,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
def pylon_command(**values: Any) -> None:
    """Put one inference engine behind every Stargate replica, until SIGTERM or SIGINT.

    The Pylon listens for the replicas' requests (--http-listen-addr), forwards them to the
    engine and measures every one of them: queue, phases, input and output throughput, KV
    cache. It watches the seed replicas (WatchStargates), keeps one RegisterInferenceServer
    stream open to every replica they announce, and re-sends the engine's models with those
    stats every --min-update-interval-ms: ACTIVE while the engine's health endpoint answers 2xx
    (and its canary passes), INACTIVE otherwise. Streams that fail reconnect with a capped
    exponential backoff. SIGTERM closes the registrations, lets requests in flight finish, and
    exits 0.
    """
    configure_logging(values["log_level"], values["log_format"])
    try:
        config = PYLON.build(values)
    except PylonConfigError as error:
        raise click.UsageError(str(error)) from None
    code = trio.run(functools.partial(_main, config))
    _join_worker_threads()
    log.info("pylon stopped")
    sys.exit(code)
