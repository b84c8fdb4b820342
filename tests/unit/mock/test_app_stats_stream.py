"""The engine stats stream (`GET /pylon/v1/stats/stream`) of the mock backend's ASGI app, called
directly in virtual time: its lines for streamed, non-streamed and cancelled requests, the pings,
several subscribers, a subscriber that falls behind, and the end at shutdown."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from trio.testing import MockClock, wait_all_tasks_blocked

from stargate.mock.stats_stream import PING, StatsHub, finished_line, stats_line
from tests.unit.mock.asgi_client import Client, backend, call, start

CHAT: dict[str, Any] = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}
PATH = "/pylon/v1/stats/stream"


def subscriber(app: Any, **kw: Any) -> Client:
    return Client(app, "GET", PATH, **kw)


def progress(request_id: str, *steps: tuple[int, int]) -> list[dict[str, Any]]:
    """The stats lines of one request: its (processed, generated) steps, then finished."""
    lines: list[dict[str, Any]] = [
        {
            "v": 1,
            "type": "stats",
            "request_id": request_id,
            "model": "mock-model",
            "tokens_processed": processed,
            "tokens_generated": generated,
        }
        for processed, generated in steps
    ]
    lines.append(
        {"v": 1, "type": "stats", "request_id": request_id, "model": "mock-model", "finished": True}
    )
    return lines


def stats_of(client: Client) -> list[dict[str, Any]]:
    return [line for line in client.lines() if line["type"] == "stats"]


def test_the_lines_are_compact_ndjson() -> None:
    assert PING == b'{"v":1,"type":"ping"}\n'
    assert stats_line("r", "m", 3, 1) == (
        b'{"v":1,"type":"stats","request_id":"r","model":"m","tokens_processed":3,'
        b'"tokens_generated":1}\n'
    )
    assert finished_line("r", "m") == (
        b'{"v":1,"type":"stats","request_id":"r","model":"m","finished":true}\n'
    )
    with pytest.raises(ValueError):
        StatsHub(buffer=0)


async def test_off_by_default() -> None:
    answer = await call(backend(), "GET", PATH)
    assert answer.status == 404


async def test_a_stream_reports_arrival_prefill_each_token_and_the_end(
    autojump_clock: MockClock,
) -> None:
    app = backend(engine_stats_stream=True, ttft_ms=100, inter_token_ms=10, tokens=2)
    async with trio.open_nursery() as nursery:
        listener = await start(nursery, subscriber(app))
        assert listener.status == 200
        assert listener.response_headers["content-type"] == "application/x-ndjson"
        body = {**CHAT, "stream": True}
        headers = {"x-request-id": "r-1", "x-input-tokens": "7"}
        await call(app, "POST", "/v1/chat/completions", body, headers=headers)
        # Without x-request-id, the request is known by the mock's response id.
        answer = await call(app, "POST", "/v1/completions", {"model": "mock-model", "prompt": "x"})
        response_id = answer.json()["id"]
        await wait_all_tasks_blocked()
        listener.leave()
    lines = listener.lines()
    assert lines[0] == {"v": 1, "type": "ping"}
    assert stats_of(listener) == [
        *progress("r-1", (0, 0), (7, 0), (7, 1), (7, 2)),
        # Not streamed: with a listener, its tokens are reported one by one too.
        *progress(response_id, (0, 0), (1, 0), (1, 1), (1, 2)),
    ]
    # Each line is sent when it happens: arrival at 0, prefill and token 1 at the TTFT.
    times = [at for at, message in listener.messages[1:] if b'"r-1"' in message.get("body", b"")]
    assert times[0] == pytest.approx(0.0)
    assert times[1] == pytest.approx(0.1)
    assert times[-1] == pytest.approx(0.11)
    assert not listener.aborted


async def test_a_request_cancelled_in_the_queue_reports_its_end(autojump_clock: MockClock) -> None:
    app = backend(engine_stats_stream=True, ttft_ms=1000, tokens=1, max_num_seqs=1)
    async with trio.open_nursery() as nursery:
        listener = await start(nursery, subscriber(app))
        headers = {"x-input-tokens": "3"}
        await start(
            nursery,
            Client(app, "POST", "/v1/chat/completions", CHAT, {"x-request-id": "a", **headers}),
        )
        waiter = await start(
            nursery,
            Client(app, "POST", "/v1/chat/completions", CHAT, {"x-request-id": "b", **headers}),
        )
        waiter.leave()
        await trio.sleep(2)
        listener.leave()
    # a arrives and runs, b arrives, waits and leaves, then a's prefill and token at 1 s.
    assert stats_of(listener) == [
        *progress("a", (0, 0))[:1],
        *progress("b", (0, 0)),
        *progress("a", (3, 0), (3, 1)),
    ]


async def test_pings_every_five_seconds_and_several_subscribers(autojump_clock: MockClock) -> None:
    app = backend(engine_stats_stream=True)
    async with trio.open_nursery() as nursery:
        first = await start(nursery, subscriber(app))
        await trio.sleep(12)
        second = await start(nursery, subscriber(app))
        assert len(app.engine.stats) == 2
        await call(app, "POST", "/v1/chat/completions", CHAT)
        await wait_all_tasks_blocked()
        first.leave()
        second.leave()
    pings = [at for at, message in first.messages[1:] if PING in message.get("body", b"")]
    assert pings == pytest.approx([0.0, 5.0, 10.0])
    assert stats_of(first) == stats_of(second)
    # Arrival, prefill, all 16 tokens at once (no time passes), finished.
    assert [line.get("tokens_generated") for line in stats_of(first)] == [0, 0, 16, None]
    assert len(app.engine.stats) == 0


# Stuck from its first ping, or from its response head.
@pytest.mark.parametrize("stuck_after", [1, -1])
async def test_a_subscriber_that_falls_behind_is_disconnected(
    autojump_clock: MockClock, stuck_after: int
) -> None:
    app = backend(engine_stats_stream=True, ttft_ms=100, inter_token_ms=10, tokens=20)
    app.engine.stats.buffer = 8
    async with trio.open_nursery() as nursery:
        stuck = await start(nursery, subscriber(app, stuck_after=stuck_after))
        keeping_up = await start(nursery, subscriber(app))
        answer = await call(app, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
        await wait_all_tasks_blocked()
        assert stuck.done and stuck.aborted
        assert len(app.engine.stats) == 1
        keeping_up.leave()
    # The generation never waited for the stuck reader.
    assert answer.events()[-1][0] == pytest.approx(0.1 + 19 * 0.01)
    assert len(stats_of(keeping_up)) == 1 + 1 + 20 + 1
    assert not keeping_up.aborted


async def test_closing_the_hub_ends_the_streams_cleanly(autojump_clock: MockClock) -> None:
    app = backend(engine_stats_stream=True)
    async with trio.open_nursery() as nursery:
        listener = await start(nursery, subscriber(app))
        app.engine.stats.close()
        await wait_all_tasks_blocked()
        assert listener.done and not listener.aborted
        late = await call(app, "GET", PATH)  # after the close: a ping, then the end
    assert listener.messages[-1][1] == {"type": "http.response.body", "body": b""}
    assert late.lines() == [{"v": 1, "type": "ping"}]


async def test_embeddings_report_nothing(autojump_clock: MockClock) -> None:
    app = backend(engine_stats_stream=True)
    async with trio.open_nursery() as nursery:
        listener = await start(nursery, subscriber(app))
        await call(app, "POST", "/v1/embeddings", {"model": "mock-model", "input": "x"})
        await wait_all_tasks_blocked()
        listener.leave()
    assert stats_of(listener) == []
