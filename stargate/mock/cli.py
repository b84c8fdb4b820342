"""`stargate mock-backend`: run the mock OpenAI-compatible inference server.

It serves the OpenAI inference endpoints, `/v1/models`, `/health` and `/test-control`, and for
whatever watches an engine's load, vLLM's `/metrics` (always), `/kv-cache/stats` (with
`--kv-cache-tokens`) and the NDJSON `/pylon/v1/stats/stream` (with `--engine-stats-stream`).
With `--kv-events-endpoint` it also publishes its prefix cache's changes as vLLM's KV events on a
ZMQ PUB socket (`stargate/mock/kv_events.py`), bound before the server starts and closed when
it has drained.

`run_mock_backend` serves one `MockBackend` with Hypercorn's trio worker on a pre-bound socket
(`stargate/serving.py`, the same machinery as the replica's listeners); `mock_backend_command` is
the click command the main `stargate` group registers. SIGTERM or SIGINT stops accepting
connections and lets in-flight requests finish (for at most `SHUTDOWN_GRACE_SECONDS`); a second
signal exits at once. Both exit 0. The stats stream's subscribers are ended as the stop begins,
so that an endless stream does not hold it for the whole grace period."""

from __future__ import annotations

import functools
import ipaddress
import logging
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import click
import trio

from stargate.clitools import log_settings
from stargate.config import ListenAddress
from stargate.logs import configure_logging
from stargate.mock.app import MockBackend, MockBackendConfig, drop_filter
from stargate.settings import Setting, Settings, SettingsCommand

__all__ = ["SHUTDOWN_GRACE_SECONDS", "mock_backend_command", "run_mock_backend"]

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_SECONDS = 5.0


def _server_error_log() -> logging.Logger:
    """Hypercorn's error log for the mock, without the tracebacks of deliberate stream drops."""
    logger = logging.getLogger("stargate.mock.server")
    logger.addFilter(drop_filter)  # idempotent
    return logger


async def run_mock_backend(
    config: MockBackendConfig,
    *,
    app: MockBackend | None = None,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Bind `config.host:config.port`, report the bound port with `task_status.started(port)`,
    and serve until cancelled.

    With `shutdown_trigger`, returning from it starts a graceful stop: no new connections,
    in-flight requests get `SHUTDOWN_GRACE_SECONDS` to finish. `app` lets a caller keep a handle
    on the served `MockBackend` (one is created from `config` otherwise). Raises
    `stargate.serving.StartupError` if the address cannot be bound.
    """
    # Imported here so that `stargate --help` does not pay for Hypercorn's imports.
    from stargate.serving import bind_listener, hypercorn_config, serve_asgi

    backend = app if app is not None else MockBackend(config)
    sock = bind_listener("mock backend", ListenAddress(config.host, config.port))
    try:
        port: int = sock.getsockname()[1]
        server_config = hypercorn_config(SHUTDOWN_GRACE_SECONDS)
        server_config.errorlog = _server_error_log()
        trigger = shutdown_trigger if shutdown_trigger is not None else trio.sleep_forever

        async def stop_serving() -> None:
            await trigger()
            backend.engine.stats.close()

        publisher = backend.kv_events
        if publisher is not None:
            publisher.bind()
        try:
            async with trio.open_nursery() as publishing:
                if publisher is not None:
                    publishing.start_soon(publisher.run)
                async with trio.open_nursery() as nursery:
                    await nursery.start(serve_asgi, backend, sock, server_config, stop_serving)
                    log.info("mock backend listening on %s", ListenAddress(config.host, port))
                    task_status.started(port)
                publishing.cancel_scope.cancel()  # served and drained: nothing more to publish
        finally:
            if publisher is not None:
                publisher.close()
    finally:
        sock.close()


async def _watch_signals(
    signals: AsyncIterator[int], stop: trio.Event, cancel_scope: trio.CancelScope
) -> None:
    """The first signal stops accepting and lets in-flight requests finish; a second exits now."""
    from stargate.serving import watch_signals

    def finish(sig: signal.Signals) -> None:
        log.info("received %s, finishing in-flight requests", sig.name)
        stop.set()

    def exit_now(sig: signal.Signals) -> None:
        log.info("received %s again, exiting now", sig.name)
        cancel_scope.cancel()

    await watch_signals(signals, finish, exit_now)


async def _serve_until_signalled(config: MockBackendConfig) -> int:
    from stargate.serving import SHUTDOWN_SIGNALS, StartupError

    stop = trio.Event()
    code = 0
    with trio.open_signal_receiver(*SHUTDOWN_SIGNALS) as signals:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_signals, signals, stop, nursery.cancel_scope)
                port = await nursery.start(_serve, config, stop, nursery.cancel_scope)
                print(f"listening on http://{ListenAddress(config.host, port)}", flush=True)
        except* StartupError as group:
            for error in group.exceptions:
                print(f"error: {error}", file=sys.stderr, flush=True)
            code = 1
    return code


async def _serve(
    config: MockBackendConfig,
    stop: trio.Event,
    cancel_scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    await run_mock_backend(config, shutdown_trigger=stop.wait, task_status=task_status)
    cancel_scope.cancel()  # served and drained: stop watching for signals


def _ip_address(value: str) -> str:
    text = value.strip().removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise ValueError(f"{value!r} is not an IP address") from None


def _fraction(value: float) -> float:
    """Refuses NaN, which `click.FloatRange` lets through."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{value} is not a number between 0 and 1")
    return value


def _finite(value: float) -> float:
    """Refuses NaN and infinity, which `click.FloatRange(min=0)` lets through."""
    if not 0.0 <= value < float("inf"):
        raise ValueError(f"{value} is not a finite non-negative number")
    return value


def _engine_id(value: str) -> str:
    """Visible ASCII only: it is sent as a header value."""
    if not all(" " < char < "\x7f" for char in value):
        raise ValueError(f"{value!r} is not visible ASCII (no spaces or control characters)")
    return value


def _kv_events_endpoint(value: str | None) -> str | None:
    """`tcp://IP:PORT` or `tcp://*:PORT` (every interface); empty: off."""
    if value is None or not value.strip():
        return None
    from stargate.protocol.kv_events import parse_tcp_endpoint

    return parse_tcp_endpoint(value, bind=True)


def _models(models: tuple[str, ...]) -> tuple[str, ...]:
    """At least one; duplicates are dropped."""
    if not models:
        raise ValueError("at least one model ID is required")
    return tuple(dict.fromkeys(models))


# `stargate mock-backend`: defaults are `MockBackendConfig`'s. The README's flag table lists every
# one (tests/unit/test_flag_docs.py).
MOCK_BACKEND = Settings(
    MockBackendConfig,
    Setting(
        "--host",
        env="STARGATE_MOCK_HOST",
        to="host",
        parse=_ip_address,
        help="IP address to listen on (0.0.0.0 or :: for every interface).",
    ),
    Setting(
        "--port",
        env="STARGATE_MOCK_PORT",
        to="port",
        type=click.IntRange(min=0, max=65535),
        help="TCP port to listen on; 0 picks a free one. The bound address is printed to stdout "
        "as `listening on http://HOST:PORT` once the server accepts connections.",
    ),
    Setting(
        "--model",
        env="STARGATE_MOCK_MODEL",
        to="models",
        kind="list",
        parse=_models,
        help="A model ID to serve (repeatable or comma-separated); requests naming any other "
        "model get 400, and GET /v1/models lists these.",
    ),
    Setting(
        "--ttft-ms",
        env="STARGATE_MOCK_TTFT_MS",
        to="ttft_ms",
        type=click.FloatRange(min=0),
        help="Time to first token, in milliseconds (initial value of the `ttft_ms` knob).",
    ),
    Setting(
        "--inter-token-ms",
        env="STARGATE_MOCK_INTER_TOKEN_MS",
        to="inter_token_ms",
        type=click.FloatRange(min=0),
        help="Delay between streamed tokens, in milliseconds (initial `inter_token_ms` knob).",
    ),
    Setting(
        "--tokens",
        env="STARGATE_MOCK_TOKENS",
        to="tokens",
        type=click.IntRange(min=1),
        help="Tokens per answer; a request's max_tokens lowers it (initial `tokens` knob).",
    ),
    Setting(
        "--prefix-cache-blocks",
        env="STARGATE_MOCK_PREFIX_CACHE_BLOCKS",
        to="prefix_cache_blocks",
        type=click.IntRange(min=0),
        help="Capacity of the prefix-cache model, in blocks (LRU); 0 turns it off. With it on, a "
        "prompt's cached share cuts its time to first token (initial `prefix_cache_blocks` "
        "knob).",
    ),
    Setting(
        "--prefix-cache-speedup",
        env="STARGATE_MOCK_PREFIX_CACHE_SPEEDUP",
        to="prefix_cache_speedup",
        type=click.FloatRange(min=0, max=1),
        parse=_fraction,
        help="Share of the TTFT a fully cached prompt saves, from 0 to 1: TTFT = ttft_ms * (1 - "
        "cached share * this) (initial `prefix_cache_speedup` knob).",
    ),
    Setting(
        "--prefix-cache-block-chars",
        env="STARGATE_MOCK_PREFIX_CACHE_BLOCK_CHARS",
        to="prefix_cache_block_chars",
        type=click.IntRange(min=1),
        help="Characters per prefix-cache block (64 is about 16 tokens); only whole blocks are "
        "cached (initial `prefix_cache_block_chars` knob).",
    ),
    Setting(
        "--max-num-seqs",
        env="STARGATE_MOCK_MAX_NUM_SEQS",
        to="max_num_seqs",
        type=click.IntRange(min=0),
        help="Running slots (vLLM's max_num_seqs): at most this many requests generate at once; "
        "the others wait in a FIFO queue (a stream gets its response head at once). 0 = "
        "unlimited (initial `max_num_seqs` knob).",
    ),
    Setting(
        "--prefill-ms-per-token",
        env="STARGATE_MOCK_PREFILL_MS_PER_TOKEN",
        to="prefill_ms_per_token",
        type=click.FloatRange(min=0),
        parse=_finite,
        help="Prefill time per uncached prompt token, in milliseconds, added to the TTFT once the "
        "request runs (initial `prefill_ms_per_token` knob).",
    ),
    Setting(
        "--kv-cache-tokens",
        env="STARGATE_MOCK_KV_CACHE_TOKENS",
        to="kv_cache_tokens",
        type=click.IntRange(min=0),
        help="KV-cache capacity in tokens: a running request holds its prompt and output tokens, "
        "a request waits until they fit, one that can never fit gets 400, and the prefix cache "
        "lives in what is left. 0 = unlimited. Also serves GET /kv-cache/stats.",
    ),
    Setting(
        "--engine-stats-stream",
        env="STARGATE_MOCK_ENGINE_STATS_STREAM",
        to="engine_stats_stream",
        kind="switch",
        help="Serve GET /pylon/v1/stats/stream: NDJSON per-request progress (tokens processed and "
        "generated) and a ping every 5 s, for a router following the engine's load.",
    ),
    Setting(
        "--engine-id",
        env="STARGATE_MOCK_ENGINE_ID",
        to="engine_id",
        parse=_engine_id,
        hidden=True,
        help="Send this as x-mock-engine-id on every answer: which engine served a request, "
        "whatever router stands in front (benchmarks; empty: no header).",
    ),
    Setting(
        "--kv-events-endpoint",
        env="STARGATE_MOCK_KV_EVENTS_ENDPOINT",
        to="kv_events.endpoint",
        parse=_kv_events_endpoint,
        metavar="tcp://IP:PORT",
        help="Publish the prefix cache's changes as vLLM's KV events (BlockStored, BlockRemoved, "
        "AllBlocksCleared) on a ZMQ PUB socket bound here, for stargate pylon "
        "--kv-events-endpoint; the cache's blocks are then the router's prefix-chain blocks. "
        "[default: off]",
    ),
    Setting(
        "--kv-events-block-bytes",
        env="STARGATE_MOCK_KV_EVENTS_BLOCK_BYTES",
        to="kv_events.block_bytes",
        type=click.IntRange(min=1),
        help="With --kv-events-endpoint: bytes of the router's prompt stream per cache block; "
        "the router's --derive-affinity-key-block-bytes, so the published hashes are its chain.",
    ),
    Setting(
        "--kv-events-depth",
        env="STARGATE_MOCK_KV_EVENTS_DEPTH",
        to="kv_events.depth",
        type=click.IntRange(min=1),
        help="With --kv-events-endpoint: blocks of a prompt's chain at most (the router's "
        "--derive-affinity-key-depth); later blocks are never cached.",
    ),
    *log_settings("STARGATE_MOCK_LOG_LEVEL", "STARGATE_MOCK_LOG_FORMAT"),
)


@click.command(
    "mock-backend",
    cls=SettingsCommand,
    settings=MOCK_BACKEND,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
def mock_backend_command(**values: Any) -> None:
    """Run a mock OpenAI-compatible inference server for demos, tests and benchmarks.

    It serves POST /v1/chat/completions, /v1/completions, /v1/responses and /v1/embeddings
    (streaming and not), GET /v1/models and GET /health, with deterministic answers. GET/POST
    /test-control reads and changes its knobs at run time (latencies, health, injected failures,
    dropped streams, the prefix-cache and batching models) and reads its request and prefix-cache
    counters and its queues. Like a batching engine it can limit the requests running at once
    and the KV cache they hold, and it reports its load as vLLM does: GET /metrics (Prometheus,
    vLLM's metric names), GET /kv-cache/stats and GET /pylon/v1/stats/stream.
    """
    configure_logging(values["log_level"], values["log_format"])
    config = MOCK_BACKEND.build(values)
    sys.exit(trio.run(functools.partial(_serve_until_signalled, config)))
