"""The Pylon's side channels (`collector.py`) in virtual time, against an engine played by
`httpx.MockTransport` (docs/pylon-data-path.md, "Side channels"): the stale sweep, the KV-cache
JSON poll, the engine's Prometheus metrics and the engine stats stream.

Each loop runs until cancelled, so the tests run it for a while of virtual time and then read
the real `StatsAggregator` it fed, and the requests the fake engine saw.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import trio
from trio.testing import MockClock

from stargate.pylon.collector import (
    engine_metrics_loop,
    engine_stream_loop,
    kv_cache_loop,
    sweep_loop,
)
from stargate.pylon.stats.aggregator import StatsAggregator, StatsConfig
from stargate.pylon.stats.engine_stream import EngineCounters
from stargate.routing.stats import ModelStats

MODEL = "model-a"
URL = "http://engine:8000/side-channel"

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class Engine:
    """An `httpx.MockTransport` engine: `answer(attempt number)` answers each request; the
    virtual instant of every request is kept."""

    def __init__(self, answer: Callable[[int], Awaitable[httpx.Response]]) -> None:
        self._answer = answer
        self.requests: list[httpx.Request] = []
        self.times: list[float] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.times.append(trio.current_time())
        return await self._answer(len(self.requests) - 1)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))


def make_stats(**config: Any) -> StatsAggregator:
    stats = StatsAggregator(StatsConfig(**config), lambda: 1_700_000_000_000)
    stats.set_models([MODEL])
    return stats


def snap(stats: StatsAggregator) -> ModelStats:
    return stats.snapshot(MODEL, trio.current_time())


def kv(stats: StatsAggregator) -> tuple[int, int, int]:
    s = snap(stats)
    return s.kv_cache_capacity_tokens, s.kv_cache_used_tokens, s.kv_cache_free_tokens


async def run_for(seconds: float, loop: Callable[[], Awaitable[None]]) -> None:
    with trio.move_on_after(seconds):
        await loop()


def gaps(times: list[float]) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(times)]


# ---- the stale sweep ---------------------------------------------------------------------------


async def test_the_sweep_runs_every_second(autojump_clock: MockClock) -> None:
    """`sweep_loop` calls `StatsAggregator.sweep` once a second with the current instant."""
    swept: list[float] = []

    class Recording(StatsAggregator):
        def sweep(self, now: float) -> None:
            swept.append(now)
            super().sweep(now)

    stats = Recording(StatsConfig(), lambda: 0)
    start = trio.current_time()
    await run_for(3.5, lambda: sweep_loop(stats))
    assert [now - start for now in swept] == [1.0, 2.0, 3.0]


# ---- the KV-cache JSON -------------------------------------------------------------------------


def kv_json(model: str, capacity: int, used: int, free: int, status: int = 200) -> httpx.Response:
    return httpx.Response(
        status,
        json={
            "model": model,
            "kv_cache_capacity_tokens": capacity,
            "kv_cache_used_tokens": used,
            "kv_cache_free_tokens": free,
            "extra": "ignored",
        },
    )


async def test_the_kv_json_is_polled_every_second_and_copied_verbatim(
    autojump_clock: MockClock,
) -> None:
    """Each poll's three figures replace the model's KV fields as they are (not checked against
    each other), with the `kv_cache_stats` label."""
    stats = make_stats()

    async def answer(attempt: int) -> httpx.Response:
        return kv_json(MODEL, 1000, 100 * attempt, 7)

    engine = Engine(answer)
    seen: list[tuple[int, int, int]] = []
    async with engine.client() as client, trio.open_nursery() as nursery:
        nursery.start_soon(run_for, 3.5, lambda: kv_cache_loop(client, URL, stats))
        for pause in (0.5, 1, 1):  # t = 0.5, 1.5, 2.5
            await trio.sleep(pause)
            seen.append(kv(stats))
    assert seen == [(1000, 0, 7), (1000, 100, 7), (1000, 200, 7)]
    assert [str(r.url) for r in engine.requests] == [URL] * 4
    assert gaps(engine.times) == [1.0, 1.0, 1.0]
    labels = snap(stats)
    assert labels.stats_capabilities == ("machine.kv_cache.http",)
    assert labels.stats_sources == ("kv_cache_stats",)


async def test_a_kv_json_for_another_model_is_refused(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A body naming a model this Pylon does not serve is a failed poll (logged), not data."""
    stats = make_stats()

    async def answer(attempt: int) -> httpx.Response:
        return kv_json("other-model", 1000, 10, 990)

    async with Engine(answer).client() as client:
        with caplog.at_level(logging.WARNING, "stargate.pylon.stats"):
            await run_for(0.5, lambda: kv_cache_loop(client, URL, stats))
    assert kv(stats) == (0, 0, 0) and snap(stats).stats_sources == ()
    assert "'other-model' is not one this Pylon serves" in caplog.text


async def test_failed_kv_polls_keep_the_last_good_values(autojump_clock: MockClock) -> None:
    """An error status, a body that is not the JSON, a missing figure, a poll slower than 1 s:
    the last good figures stay; the next good poll replaces them."""

    async def answer(attempt: int) -> httpx.Response:
        if attempt == 0:
            return kv_json(MODEL, 1000, 250, 750)
        if attempt == 1:  # an error status is not data, whatever its body
            return kv_json(MODEL, 9, 9, 9, status=500)
        if attempt == 2:
            return httpx.Response(200, text="not json")
        if attempt == 3:
            return httpx.Response(200, json={"model": MODEL, "kv_cache_capacity_tokens": 5})
        if attempt == 4:
            await trio.sleep(5)
            return kv_json(MODEL, 1, 1, 0)
        return kv_json(MODEL, 2000, 0, 2000)

    stats = make_stats()
    engine = Engine(answer)
    seen: list[tuple[int, int, int]] = []
    async with engine.client() as client, trio.open_nursery() as nursery:
        nursery.start_soon(run_for, 7, lambda: kv_cache_loop(client, URL, stats))
        for pause in (0.5, 1, 1, 1, 1, 2):  # t = 0.5, 1.5, 2.5, 3.5, 4.5, 6.5
            await trio.sleep(pause)
            seen.append(kv(stats))
    # polls at 0, 1, 2, 3, 4 (times out at 5), 6
    assert gaps(engine.times) == [1.0, 1.0, 1.0, 1.0, 2.0]
    assert seen == [(1000, 250, 750)] * 5 + [(2000, 0, 2000)]


async def test_a_kv_poll_that_times_out_is_logged_with_its_reason(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The failure log names what went wrong, also for an error without a message."""

    async def answer(attempt: int) -> httpx.Response:
        await trio.sleep(5)
        return kv_json(MODEL, 1, 1, 0)

    async with Engine(answer).client() as client:
        with caplog.at_level(logging.WARNING, "stargate.pylon.stats"):
            await run_for(1.5, lambda: kv_cache_loop(client, URL, make_stats()))
    (record,) = caplog.records
    assert record.getMessage() == f"KV-cache stats from {URL}: TooSlowError"


# ---- the engine's Prometheus metrics -----------------------------------------------------------

VLLM = f"""\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",num_gpu_blocks="1000"}} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.25
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 3.0
"""


def text(body: str, status: int = 200) -> Callable[[int], Awaitable[httpx.Response]]:
    async def answer(attempt: int) -> httpx.Response:
        return httpx.Response(status, text=body)

    return answer


async def test_vllm_metrics_become_the_kv_fields_every_second(autojump_clock: MockClock) -> None:
    """capacity = num_gpu_blocks x block_size, used = usage x capacity, free = the rest, with
    the `engine_metrics` label; read again every second."""
    stats = make_stats()
    engine = Engine(text(VLLM))
    async with engine.client() as client:
        await run_for(2.5, lambda: engine_metrics_loop(client, URL, stats))
    assert kv(stats) == (16_000, 4_000, 12_000)
    assert snap(stats).stats_capabilities == ("machine.kv_cache.prometheus",)
    assert snap(stats).stats_sources == ("engine_metrics",)
    assert gaps(engine.times) == [1.0, 1.0]


@pytest.mark.parametrize(
    "answer",
    [
        text("", status=404),  # no metrics endpoint
        text("", status=405),
        text("# TYPE http_requests_total counter\nhttp_requests_total 3\n"),  # not an engine's
        text('vllm:num_requests_running{model_name="model-a"} 1\n'),  # vLLM, but no KV figures
    ],
)
async def test_an_engine_without_known_metrics_is_asked_again_every_30_s(
    autojump_clock: MockClock, answer: Callable[[int], Awaitable[httpx.Response]]
) -> None:
    """No such metrics: the KV fields stay 0 and the endpoint is asked again after 30 s."""
    stats = make_stats()
    engine = Engine(answer)
    async with engine.client() as client:
        await run_for(65, lambda: engine_metrics_loop(client, URL, stats))
    assert gaps(engine.times) == [30.0, 30.0]
    assert kv(stats) == (0, 0, 0) and snap(stats).stats_sources == ()


async def test_an_engine_metrics_error_is_retried_after_a_second(
    autojump_clock: MockClock,
) -> None:
    """A failing endpoint (500) is not an engine without metrics: asked again every second."""
    engine = Engine(text("oops", status=500))
    async with engine.client() as client:
        await run_for(2.5, lambda: engine_metrics_loop(client, URL, make_stats()))
    assert gaps(engine.times) == [1.0, 1.0]


# ---- the engine stats stream -------------------------------------------------------------------


def stats_line(request_id: str, processed: int) -> bytes:
    event = {
        "v": 1,
        "type": "stats",
        "request_id": request_id,
        "model": MODEL,
        "tokens_processed": processed,
    }
    return json.dumps(event).encode() + b"\n"


def ndjson(*steps: tuple[float, bytes], then_hold: bool = True) -> httpx.Response:
    """A streamed 200 whose lines come after their delays; then it stays open (or ends)."""

    async def body() -> AsyncIterator[bytes]:
        for delay, chunk in steps:
            await trio.sleep(delay)
            yield chunk
        if then_hold:
            await trio.sleep_forever()

    return httpx.Response(200, content=body())


@pytest.mark.parametrize("status", [404, 405, 501])
async def test_auto_mode_falls_back_when_the_stream_is_unsupported(
    autojump_clock: MockClock, status: int
) -> None:
    """`auto`: 404, 405 or 501 before any event turns the OpenAI fallback on and ends the loop."""
    stats = make_stats(fallback_from_start=False)

    async def answer(attempt: int) -> httpx.Response:
        return httpx.Response(status)

    engine = Engine(answer)
    async with engine.client() as client:
        with trio.fail_after(60):
            await engine_stream_loop(client, URL, stats, required=False)
    assert stats.fallback_enabled
    (request,) = engine.requests
    assert request.method == "GET" and str(request.url) == URL
    assert request.headers["accept"] == "application/x-ndjson"


async def test_auto_mode_does_not_fall_back_on_other_errors(autojump_clock: MockClock) -> None:
    """A 500 (or a broken connection) is not "unsupported": the loop reconnects."""
    stats = make_stats(fallback_from_start=False)

    async def answer(attempt: int) -> httpx.Response:
        if attempt == 0:
            raise httpx.ConnectError("refused")
        return httpx.Response(500)

    engine = Engine(answer)
    async with engine.client() as client:
        await run_for(60, lambda: engine_stream_loop(client, URL, stats, required=False))
    assert not stats.fallback_enabled and len(engine.requests) > 10


async def test_required_mode_keeps_retrying_with_a_capped_backoff(
    autojump_clock: MockClock,
) -> None:
    """`required` never falls back: it reconnects after 0.1 s, doubling to 5 s (each delay with
    up to 20% jitter, never above the cap)."""
    stats = make_stats(fallback_from_start=False)

    async def answer(attempt: int) -> httpx.Response:
        return httpx.Response(404)

    engine = Engine(answer)
    async with engine.client() as client:
        await run_for(60, lambda: engine_stream_loop(client, URL, stats, required=True))
    assert not stats.fallback_enabled
    delays = gaps(engine.times)
    assert len(delays) > 10
    for attempt, delay in enumerate(delays):
        base = min(0.1 * 2**attempt, 5.0)
        assert 0.8 * base - 1e-9 <= delay <= min(1.2 * base, 5.0) + 1e-9, (attempt, delay)


async def test_auto_mode_keeps_the_stream_once_it_sent_an_event(autojump_clock: MockClock) -> None:
    """`auto` falls back only before any valid event: an engine that streamed and then answers
    404 (restarting) is reconnected to; an event resets the backoff to 0.1 s."""
    stats = make_stats(fallback_from_start=False)

    async def answer(attempt: int) -> httpx.Response:
        if attempt < 4:
            return httpx.Response(500)  # the backoff grows to 0.8 s
        if attempt == 4:
            return ndjson((0.5, stats_line("r1", 10)), then_hold=False)
        return httpx.Response(404)

    engine = Engine(answer)
    async with engine.client() as client:
        await run_for(30, lambda: engine_stream_loop(client, URL, stats, required=False))
    assert not stats.fallback_enabled
    assert len(engine.requests) > 10
    assert 0.08 <= engine.times[5] - (engine.times[4] + 0.5) <= 0.12


async def test_stream_events_reach_the_aggregator_and_bad_lines_are_skipped(
    autojump_clock: MockClock,
) -> None:
    """Valid events become `engine_counters` (the engine-stream label; an input TPS once five
    samples exist: 1000 tokens/s here); lines that are not valid events are dropped without
    ending the stream (one connection throughout)."""
    stats = make_stats(fallback_from_start=False)
    lines = [stats_line("r1", 1000 * k) for k in range(6)]
    garbage = [
        b"not json\n",
        b'{"v": 2, "type": "stats", "request_id": "r1", "model": "model-a"}\n',
        b'{"v": 1, "type": "stats", "request_id": "r1", "model": "model-a"}\n',
        b'{"v": 1, "type": "ping"}\n',
    ]
    other = stats_line("r2", 0)  # after the bad lines, in the same chunk
    steps = [(0.0, lines[0]), (0.0, b"".join([*garbage, other]))]
    steps += [(1.0, line) for line in lines[1:]]

    async def answer(attempt: int) -> httpx.Response:
        return ndjson(*steps)

    seen: list[tuple[str, int | None, float | None]] = []

    def on_event(event: EngineCounters) -> None:
        seen.append((event.request_id, event.tokens_processed, stats.input_tps(MODEL)))

    engine = Engine(answer)
    async with engine.client() as client:
        loop = lambda: engine_stream_loop(client, URL, stats, required=True, on_event=on_event)  # noqa: E731
        await run_for(30, loop)
    assert seen == [
        ("r1", 0, None),
        ("r2", 0, None),
        *[("r1", 1000 * k, None) for k in range(1, 5)],
        ("r1", 5000, pytest.approx(1000.0)),
    ]
    assert len(engine.requests) == 1
    assert snap(stats).stats_sources == ("engine_stats_stream",)
    assert snap(stats).last_mean_input_tps == pytest.approx(1000.0)
