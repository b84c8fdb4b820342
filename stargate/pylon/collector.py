"""The Pylon's side channels to its engine: the loops that feed `StatsAggregator` besides the
requests it forwards (docs/pylon-data-path.md, "Side channels").

* `sweep_loop`: the stale sweep, every second.
* `engine_stream_loop`: the engine stats stream (NDJSON, `--engine-stats-stream`): per-request
  cumulative token counters. In `auto` mode an endpoint that answers 404, 405 or 501 before any
  valid event switches the Pylon to observing the requests themselves (the OpenAI fallback) for
  good; `required` never does; `off` never starts the stream (fallback from the start).
* `kv_cache_loop`: the engine's KV-cache JSON endpoint (`--kv-cache-stats-path`), every second.
* `engine_metrics_loop`: beyond the Rust Pylon, the engine's Prometheus metrics (vLLM, SGLang)
  for KV capacity and usage when no KV endpoint is configured; an endpoint that does not serve
  known metrics is asked again only every `METRICS_RETRY_SECONDS`.

Each loop runs until cancelled, in the Pylon's nursery; a failure is logged once (then at DEBUG
until it recovers) and never ends the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx
import trio

from stargate.pylon.backoff import Backoff
from stargate.pylon.stats.aggregator import StatsAggregator
from stargate.pylon.stats.engine_metrics import parse_engine_metrics
from stargate.pylon.stats.engine_stream import (
    EngineCounters,
    EngineEventError,
    NdjsonLines,
    parse_engine_event,
)
from stargate.pylon.stats.kv_cache import parse_kv_cache_stats

__all__ = [
    "KV_POLL_SECONDS",
    "METRICS_RETRY_SECONDS",
    "SWEEP_SECONDS",
    "engine_metrics_loop",
    "engine_stream_loop",
    "kv_cache_loop",
    "sweep_loop",
]

log = logging.getLogger("stargate.pylon.stats")

SWEEP_SECONDS = 1.0
KV_POLL_SECONDS = 1.0
KV_POLL_TIMEOUT_SECONDS = 1.0
METRICS_RETRY_SECONDS = 30.0
STREAM_BACKOFF_INITIAL_SECONDS = 0.1
STREAM_BACKOFF_CAP_SECONDS = 5.0
_UNSUPPORTED = frozenset({404, 405, 501})


class _Quiet:
    """Logs a failure once at WARNING, repeats at DEBUG, and the recovery once at INFO."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failing = False

    def failed(self, reason: object) -> None:
        level = logging.DEBUG if self.failing else logging.WARNING
        log.log(level, "%s: %s", self.what, reason)
        self.failing = True

    def ok(self) -> None:
        if self.failing:
            log.info("%s: working again", self.what)
            self.failing = False


async def sweep_loop(stats: StatsAggregator) -> None:
    """Finalize silent requests and clear stale output windows (`StatsAggregator.sweep`)."""
    while True:
        await trio.sleep(SWEEP_SECONDS)
        stats.sweep(trio.current_time())


async def kv_cache_loop(client: httpx.AsyncClient, url: str, stats: StatsAggregator) -> None:
    """Poll the KV-cache JSON endpoint every second; its values replace the model's KV fields
    until the next successful poll. A body naming a model the Pylon does not serve is refused."""
    quiet = _Quiet(f"KV-cache stats from {url}")
    while True:
        try:
            with trio.fail_after(KV_POLL_TIMEOUT_SECONDS):
                response = await client.get(url)
            response.raise_for_status()
            model, kv = parse_kv_cache_stats(response.content)
            if model not in stats.models:
                raise ValueError(f"model {model!r} is not one this Pylon serves")
            stats.kv_cache(
                model, kv.capacity_tokens, kv.used_tokens, kv.free_tokens, source="kv_cache_stats"
            )
            quiet.ok()
        except (httpx.HTTPError, trio.TooSlowError, ValueError) as error:
            quiet.failed(str(error) or type(error).__name__)
        await trio.sleep(KV_POLL_SECONDS)


async def engine_metrics_loop(client: httpx.AsyncClient, url: str, stats: StatsAggregator) -> None:
    """Read KV capacity and usage from the engine's Prometheus metrics every second, while the
    engine serves metrics this Pylon knows (vLLM or SGLang); else look again every
    `METRICS_RETRY_SECONDS` (an engine may be restarted with metrics on)."""
    quiet = _Quiet(f"engine metrics from {url}")
    while True:
        delay = KV_POLL_SECONDS
        try:
            with trio.fail_after(KV_POLL_TIMEOUT_SECONDS):
                response = await client.get(url)
            if response.status_code in _UNSUPPORTED:
                raise LookupError(f"not served ({response.status_code})")
            response.raise_for_status()
            found = 0
            for model in stats.models:
                metrics = parse_engine_metrics(response.text, model)
                if metrics is None:
                    raise LookupError("no vLLM or SGLang metrics in it")
                if metrics.kv is not None:
                    kv = metrics.kv
                    stats.kv_cache(
                        model,
                        kv.capacity_tokens,
                        kv.used_tokens,
                        kv.free_tokens,
                        source="engine_metrics",
                    )
                    found += 1
            if stats.models and not found:
                raise LookupError("no KV-cache capacity in them")
            quiet.ok()
        except LookupError as error:
            # Not an engine we know how to read: no KV figures from here, checked again later.
            if not quiet.failing:
                log.info("engine metrics from %s: %s; KV fields stay 0", url, error)
            quiet.failing = True
            delay = METRICS_RETRY_SECONDS
        except (httpx.HTTPError, trio.TooSlowError, ValueError) as error:
            quiet.failed(str(error) or type(error).__name__)
        await trio.sleep(delay)


async def engine_stream_loop(
    client: httpx.AsyncClient,
    url: str,
    stats: StatsAggregator,
    *,
    required: bool,
    on_event: Callable[[EngineCounters], None] | None = None,
) -> None:
    """Follow the engine stats stream, reconnecting with a capped backoff (0.1 s doubling to
    5 s). Without `required`, an endpoint that answers 404, 405 or 501 before any valid event
    turns the OpenAI fallback on and ends the loop."""
    backoff = Backoff(STREAM_BACKOFF_INITIAL_SECONDS, STREAM_BACKOFF_CAP_SECONDS)
    quiet = _Quiet(f"engine stats stream {url}")
    seen_event = False
    while True:
        try:
            async with client.stream(
                "GET", url, headers={"accept": "application/x-ndjson"}, timeout=None
            ) as response:
                if response.status_code in _UNSUPPORTED and not seen_event and not required:
                    log.info(
                        "engine stats stream %s answered %d: observing the requests instead",
                        url,
                        response.status_code,
                    )
                    stats.enable_fallback()
                    return
                response.raise_for_status()
                lines = NdjsonLines()
                async for chunk in response.aiter_bytes():
                    for line in lines.feed(chunk):
                        try:
                            event = parse_engine_event(line)
                        except EngineEventError as error:
                            log.debug("engine stats stream: dropped a line: %s", error)
                            continue
                        if not seen_event:
                            seen_event = True
                            log.info("engine stats stream %s: receiving events", url)
                        quiet.ok()
                        backoff.reset()
                        if isinstance(event, EngineCounters):
                            stats.engine_counters(
                                model=event.model,
                                request_id=event.request_id,
                                tokens_processed=event.tokens_processed,
                                tokens_generated=event.tokens_generated,
                                finished=event.finished,
                                now=trio.current_time(),
                            )
                            if on_event is not None:
                                on_event(event)
            quiet.failed("the stream ended")
        except httpx.HTTPError as error:
            quiet.failed(str(error) or type(error).__name__)
        await trio.sleep(backoff.next())
