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

import click
import trio

from stargate.clitools import (
    LISTEN_ADDRESS,
    POSITIVE_INT,
    comma_list,
    log_format_option,
    log_level_option,
    option,
    sectioned,
)
from stargate.config import ListenAddress
from stargate.logs import configure_logging
from stargate.pylon.bringup import CalibrationConfig
from stargate.pylon.config import (
    DEFAULT_HEALTH_PATHS,
    DEFAULT_LISTEN_ADDR,
    DEFAULT_STARGATE_PORT,
    ENGINE_STATS_STREAM_MODES,
    UPSTREAM_BACKENDS,
    BringupConfig,
    DialTarget,
    PylonConfig,
    PylonConfigError,
    RequestPathConfig,
    SideChannelConfig,
    parse_advertise_url,
    parse_dial_target,
    parse_upstream_url,
)
from stargate.pylon.sidecar import Pylon
from stargate.pylon.stats.admission import AdmissionConfig

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


def _advertise_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None or not value.strip():
        return None
    try:
        return parse_advertise_url(value)
    except PylonConfigError as error:
        raise click.BadParameter(str(error), ctx, param) from None


def _path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An engine path (`/...`); empty turns the side channel off."""
    if value is None or not value.strip():
        return None
    path = value.strip()
    if not path.startswith("/") or any(ch.isspace() for ch in path):
        raise click.BadParameter(f"{value!r} must be a path starting with '/'", ctx, param)
    return path


def _positive_finite(
    ctx: click.Context, param: click.Parameter, value: float | None
) -> float | None:
    """A finite number > 0 (click's FloatRange lets NaN and infinity through)."""
    if value is None:
        return None
    if not (value > 0 and math.isfinite(value)):
        raise click.BadParameter(f"must be a finite number > 0, got {value}", ctx, param)
    return value


PYLON_SECTIONS = {
    "Request path": (
        "http_listen_addr",
        "advertise_url",
        "pylon_upstream_backend",
        "pylon_priority_ceiling",
        "pylon_local_connect_failures_retryable",
        "require_streaming",
        "pylon_queue_mismatch_retry_enabled",
        "pylon_queue_mismatch_min_delta_ms",
        "pylon_queue_mismatch_tolerance_factor",
        "pylon_queue_mismatch_retry_after_ms",
    ),
    "Engine side channels": (
        "engine_stats_stream",
        "engine_stats_stream_path",
        "kv_cache_stats_path",
        "engine_metrics_path",
    ),
    "Bring-up": (
        "initial_input_tps",
        "do_calibration",
        "calibration_requests",
        "calibration_prompt_units",
        "calibration_max_concurrency",
        "calibration_max_steps",
        "bringup_calibration_timeout_ms",
        "bringup_canary_timeout_ms",
        "canary_interval_ms",
    ),
}


def _health_paths(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> tuple[str, ...]:
    paths = comma_list(ctx, param, value)
    for path in paths:
        if not path.startswith("/"):
            raise click.BadParameter(f"{path!r} must start with '/'", ctx, param)
    return tuple(dict.fromkeys(paths)) or DEFAULT_HEALTH_PATHS


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
    cls=sectioned(PYLON_SECTIONS),
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@option(
    "--upstream",
    envvar="STARGATE_PYLON_UPSTREAM",
    metavar="URL",
    required=True,
    callback=_upstream,
    help="Base URL of the inference engine (http:// or https://): the Pylon forwards the "
    "replicas' requests and health checks there.",
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
@option(
    "--http-listen-addr",
    envvar="STARGATE_PYLON_HTTP_LISTEN_ADDR",
    type=LISTEN_ADDRESS,
    default=str(DEFAULT_LISTEN_ADDR),
    help="Where the Pylon listens for the replicas' requests (HTTP/1.1 keep-alive), which it "
    "forwards to the engine and measures. Port 0 picks a free one. Use 0.0.0.0:PORT (with "
    "--advertise-url) when the replicas are on other hosts.",
)
@option(
    "--advertise-url",
    envvar="STARGATE_PYLON_ADVERTISE_URL",
    default=None,
    callback=_advertise_url,
    help="The URL registered as inference_server_url, where replicas reach this Pylon "
    "(http://HOST:PORT). [default: http://<--http-listen-addr>, a wildcard host replaced by the "
    "address this host's name resolves to (a Pod's IP)]",
)
@option(
    "--pylon-upstream-backend",
    envvar="STARGATE_PYLON_UPSTREAM_BACKEND",
    type=click.Choice(UPSTREAM_BACKENDS),
    default="dynamo",
    help="dynamo: write x-dynamo-request-priority (= ceiling - x-priority; a request without "
    "x-priority gets 0) and x-dynamo-request-strict-priority: 0 on every request to the engine; "
    "none: write neither. Inbound values of both are always stripped.",
)
@option(
    "--pylon-priority-ceiling",
    envvar="STARGATE_PYLON_PRIORITY_CEILING",
    type=click.IntRange(min=0, max=2**32 - 1),
    default=3600,
    help="The ceiling of the Dynamo priority mapping (--pylon-upstream-backend dynamo).",
)
@option(
    "--pylon-local-connect-failures-retryable",
    envvar="STARGATE_PYLON_LOCAL_CONNECT_FAILURES_RETRYABLE",
    is_flag=True,
    default=False,
    help="When the engine refuses the connection, answer the replica's request with a retryable "
    "503 (x-stargate-retryable: true, reason local_connect_failure), so it is retried on "
    "another backend; without it the 503 is final.",
)
@option(
    "--require-streaming",
    envvar="STARGATE_PYLON_REQUIRE_STREAMING",
    is_flag=True,
    default=False,
    help='Refuse chat completions and Responses requests without "stream": true (400), as the '
    "Rust Pylon does. Without it they are forwarded and counted in the queue, but yield no "
    "throughput samples (one JSON answer cannot separate prefill from decode).",
)
@option(
    "--pylon-queue-mismatch-retry-enabled",
    envvar="PYLON_QUEUE_MISMATCH_RETRY_ENABLED",
    type=click.BOOL,
    default=True,
    help="Queue admission: refuse a request with a retryable 429 queue_estimate_mismatch when "
    "the local queue estimate exceeds the replica's x-stargate-expected-queue-ms by more than "
    "the tolerance (the replica then tries another backend). Takes a value: "
    "--pylon-queue-mismatch-retry-enabled=false.",
)
@option(
    "--pylon-queue-mismatch-min-delta-ms",
    envvar="PYLON_QUEUE_MISMATCH_MIN_DELTA_MS",
    type=click.IntRange(min=0),
    default=25,
    help="Additive tolerance of queue admission: refused only above max(expected + this, "
    "ceil(expected x factor)) ms.",
)
@option(
    "--pylon-queue-mismatch-tolerance-factor",
    envvar="PYLON_QUEUE_MISMATCH_TOLERANCE_FACTOR",
    type=float,
    default=1.25,
    callback=_positive_finite,
    help="Multiplicative tolerance of queue admission; a finite number > 0.",
)
@option(
    "--pylon-queue-mismatch-retry-after-ms",
    envvar="PYLON_QUEUE_MISMATCH_RETRY_AFTER_MS",
    type=click.IntRange(min=0),
    default=None,
    help="Sent as x-stargate-retry-after-ms on a queue-mismatch 429. [default: not sent]",
)
@option(
    "--engine-stats-stream",
    envvar="STARGATE_PYLON_ENGINE_STATS_STREAM",
    type=click.Choice(ENGINE_STATS_STREAM_MODES),
    default="auto",
    help="The engine's NDJSON stats stream (per-request token counters; Dynamo and "
    "stargate mock-backend --engine-stats-stream serve it). auto: use it, and observe the "
    "requests instead once it answers 404/405/501 (vLLM, SGLang); required: never fall back; "
    "off: observe the requests from the start.",
)
@option(
    "--engine-stats-stream-path",
    envvar="STARGATE_PYLON_ENGINE_STATS_STREAM_PATH",
    default="/pylon/v1/stats/stream",
    callback=_path,
    help="Path of the engine stats stream on the engine.",
)
@option(
    "--kv-cache-stats-path",
    envvar="STARGATE_PYLON_KV_CACHE_STATS_PATH",
    default=None,
    callback=_path,
    help="Poll this engine path every second for KV-cache capacity, used and free tokens (JSON "
    "with model, kv_cache_capacity_tokens, kv_cache_used_tokens, kv_cache_free_tokens). "
    "[default: off]",
)
@option(
    "--engine-metrics-path",
    envvar="STARGATE_PYLON_ENGINE_METRICS_PATH",
    default="/metrics",
    callback=_path,
    help="Without --kv-cache-stats-path: read KV-cache capacity and usage from the engine's "
    "Prometheus metrics here (vLLM, SGLang), so pulsar's consider_kv_free_tokens works against "
    "real engines. An empty value turns it off.",
)
@option(
    "--initial-input-tps",
    envvar="STARGATE_PYLON_INITIAL_INPUT_TPS",
    type=float,
    default=None,
    callback=_positive_finite,
    help="Seed every model's last_mean_input_tps with this (as five samples, published at "
    "once); real samples then move it. Excludes --do-calibration. [default: none: 0 until five "
    "requests completed]",
)
@option(
    "--benchmark-pin-input-tps",
    envvar="STARGATE_PYLON_BENCHMARK_PIN_INPUT_TPS",
    is_flag=True,
    default=False,
    hidden=True,
    help="Keep the published input TPS at --initial-input-tps (benchmarks only).",
)
@option(
    "--do-calibration",
    envvar="STARGATE_PYLON_DO_CALIBRATION",
    is_flag=True,
    default=False,
    help="Measure each model's input TPS with a ramp of requests before advertising it. Only "
    "for a cluster's sole Pylon: the ramp loads the engine.",
)
@option(
    "--calibration-requests",
    envvar="STARGATE_PYLON_CALIBRATION_REQUESTS",
    type=POSITIVE_INT,
    default=5,
    help="Requests of the ramp's first step; doubled every step.",
)
@option(
    "--calibration-prompt-units",
    envvar="STARGATE_PYLON_CALIBRATION_PROMPT_UNITS",
    type=click.IntRange(min=256),
    default=4096,
    help="Largest calibration prompt (characters; the ramp starts at 256 and doubles).",
)
@option(
    "--calibration-max-concurrency",
    envvar="STARGATE_PYLON_CALIBRATION_MAX_CONCURRENCY",
    type=POSITIVE_INT,
    default=4,
    help="Largest concurrency of the ramp (step k runs k+1 requests at a time).",
)
@option(
    "--calibration-max-steps",
    envvar="STARGATE_PYLON_CALIBRATION_MAX_STEPS",
    type=POSITIVE_INT,
    default=8,
    help="The ramp stops after this many steps even if the engine never saturated (the Rust "
    "ramp is unbounded).",
)
@option(
    "--bringup-calibration-timeout-ms",
    envvar="STARGATE_PYLON_BRINGUP_CALIBRATION_TIMEOUT_MS",
    type=POSITIVE_INT,
    default=30000,
    help="A ramp step that takes longer means the engine is saturated: the ramp stops.",
)
@option(
    "--bringup-canary-timeout-ms",
    envvar="STARGATE_PYLON_BRINGUP_CANARY_TIMEOUT_MS",
    type=POSITIVE_INT,
    default=5000,
    help="Timeout of one canary request.",
)
@option(
    "--canary-interval-ms",
    envvar="STARGATE_PYLON_CANARY_INTERVAL_MS",
    type=click.IntRange(min=0),
    default=5000,
    help='Every this often, a canary ("1+1=", max_tokens 237) per model; a failure, or an answer '
    "that runs to max_tokens, makes the model INACTIVE until a canary passes. 0: no canaries.",
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
    http_listen_addr: ListenAddress,
    advertise_url: str | None,
    pylon_upstream_backend: str,
    pylon_priority_ceiling: int,
    pylon_local_connect_failures_retryable: bool,
    require_streaming: bool,
    pylon_queue_mismatch_retry_enabled: bool,
    pylon_queue_mismatch_min_delta_ms: int,
    pylon_queue_mismatch_tolerance_factor: float,
    pylon_queue_mismatch_retry_after_ms: int | None,
    engine_stats_stream: str,
    engine_stats_stream_path: str | None,
    kv_cache_stats_path: str | None,
    engine_metrics_path: str | None,
    initial_input_tps: float | None,
    benchmark_pin_input_tps: bool,
    do_calibration: bool,
    calibration_requests: int,
    calibration_prompt_units: int,
    calibration_max_concurrency: int,
    calibration_max_steps: int,
    bringup_calibration_timeout_ms: int,
    bringup_canary_timeout_ms: int,
    canary_interval_ms: int,
    log_level: str,
    log_format: str,
) -> None:
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
            request_path=RequestPathConfig(
                listen_addr=http_listen_addr,
                advertise_url=advertise_url,
                upstream_backend=pylon_upstream_backend,
                priority_ceiling=pylon_priority_ceiling,
                require_streaming=require_streaming,
                local_connect_failures_retryable=pylon_local_connect_failures_retryable,
                admission=AdmissionConfig(
                    enabled=pylon_queue_mismatch_retry_enabled,
                    min_delta_ms=pylon_queue_mismatch_min_delta_ms,
                    tolerance_factor=pylon_queue_mismatch_tolerance_factor,
                    retry_after_ms=pylon_queue_mismatch_retry_after_ms,
                ),
            ),
            side_channels=SideChannelConfig(
                engine_stats_stream=engine_stats_stream,
                engine_stats_stream_path=engine_stats_stream_path or "/pylon/v1/stats/stream",
                kv_cache_stats_path=kv_cache_stats_path,
                engine_metrics_path=engine_metrics_path,
            ),
            bringup=BringupConfig(
                initial_input_tps=initial_input_tps,
                pin_input_tps=benchmark_pin_input_tps,
                do_calibration=do_calibration,
                calibration=CalibrationConfig(
                    requests=calibration_requests,
                    prompt_units=calibration_prompt_units,
                    max_concurrency=calibration_max_concurrency,
                    step_timeout=bringup_calibration_timeout_ms / 1000,
                    max_steps=calibration_max_steps,
                ),
                canary_interval_ms=canary_interval_ms,
                canary_timeout_ms=bringup_canary_timeout_ms,
            ),
        )
    except PylonConfigError as error:
        raise click.UsageError(str(error)) from None
    code = trio.run(functools.partial(_main, config))
    _join_worker_threads()
    log.info("pylon stopped")
    sys.exit(code)
