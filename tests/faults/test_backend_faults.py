"""Faults of the backends behind a replica: resets mid-stream, hangs before the response head,
malformed HTTP, keep-alive connections closed under the replica's pool, refused connections and
failing health probes.

Real processes on loopback: a replica (`stargate serve`, round robin, a 1 s response-head
timeout), `stargate mock-backend` engines steered through `/test-control`, and, for the faults an
HTTP server library will not commit (bytes that are not HTTP, a keep-alive connection closed
right after a response that promised to keep it), a raw-socket backend (`RawBackend`).

Asserted for each fault: the client gets the documented answer (docs/data-plane.md: a retry on
another backend and a 200; a bare 502 or 503 when nothing is left; a streamed body that ends
without its final chunk, with the connection closed), never a hang; the replica never reuses a
dead upstream connection (the next request succeeds); a backend that refuses connections or
fails its health probe is taken out of rotation and comes back once it answers again
(docs/stale-routes.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.e2e.processes import MockBackendProcess, launch_mock_backend, wait_until
from tests.e2e.test_proxy import ProxyReplica, start_proxy_replica
from tests.faults.support import RawBackend, RawMode, Tally, metric_sum

pytestmark = pytest.mark.faults

MODEL = "model-a"
HEAD_TIMEOUT_MS = 1000
# Bound on any single answer here: a head timeout per attempt (at most 3 attempts), plus slack for
# a loaded machine. The point is "no hang", not latency.
ANSWER_WITHIN = 3 * HEAD_TIMEOUT_MS / 1000 + 4.0

Launch = Callable[..., MockBackendProcess]


def _headers(request_id: str) -> dict[str, str]:
    return {"x-request-id": request_id, "x-input-tokens": "1", "x-model": MODEL}


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def launch() -> Iterator[Launch]:
    """Start mock engines (`launch(*args)`); every one is stopped at teardown."""
    started: list[MockBackendProcess] = []

    def start(*args: str) -> MockBackendProcess:
        engine = launch_mock_backend("--model", MODEL, *args)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


@pytest.fixture
def raw() -> Iterator[RawBackend]:
    backend = RawBackend()
    yield backend
    backend.close()


def _replica(tmp_path: Path, *extra: str) -> ProxyReplica:
    lb_config = tmp_path / "lb.json"
    lb_config.write_text(json.dumps({"default": "round-robin"}))
    return start_proxy_replica(
        tmp_path,
        f"--lb-config-path={lb_config}",
        f"--proxy-response-header-timeout-ms={HEAD_TIMEOUT_MS}",
        "--health-check-timeout-ms=1000",
        *extra,
    )


def _post(replica: ProxyReplica, tally: Tally, request_id: str) -> httpx.Response:
    """One chat completion through the replica (counted as sent)."""
    tally.send()
    return httpx.post(
        f"{replica.base}/v1/chat/completions",
        headers=_headers(request_id),
        json=CHAT,
        timeout=ANSWER_WITHIN,
    )


def _served_by(replica: ProxyReplica, count: int, tally: Tally, prefix: str) -> list[str]:
    """`count` sequential requests that must all be 200; the backend that answered each."""
    served = []
    for index in range(count):
        response = _post(replica, tally, f"{prefix}-{index}")
        if response.status_code != 200:
            tally.lose()
        assert response.status_code == 200, (index, response.status_code, response.text)
        served.append(response.headers["x-inference-server-id"])
    return served


# ---- resets mid-stream ---------------------------------------------------------------------------


async def test_a_reset_mid_stream_ends_that_stream_only_and_the_next_request_succeeds(
    tmp_path: Path, launch: Launch, tally: Tally
) -> None:
    """The engine aborts 5 of 20 concurrent streams after 3 events (`drop_mid_stream`). Those 5
    clients get the head and the first events, then the body ends without its final chunk (httpx
    reports the incomplete chunked body): nothing hangs, nothing is retried after the head. The
    other 15 run to `[DONE]`, and every request afterwards is served on a sound connection."""
    engine = launch("--inter-token-ms", "30", "--tokens", "12")
    replica = await trio.to_thread.run_sync(_replica, tmp_path)
    try:
        replica.register("engine-a", engine.url, [MODEL])
        dropped = 5
        engine.control(drop_mid_stream={"count": dropped, "after_chunks": 3})
        tally.inject(dropped)
        results: dict[str, int] = {"done": 0, "truncated": 0}

        async def one(client: httpx.AsyncClient, index: int) -> None:
            tally.send()
            events: list[str] = []
            try:
                async with client.stream(
                    "POST",
                    "/v1/chat/completions",
                    headers=_headers(f"stream-{index}"),
                    json={**CHAT, "stream": True},
                ) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line)
            except httpx.RemoteProtocolError:
                assert "data: [DONE]" not in events
                assert len(events) == 3, events  # what the engine sent before it aborted
                results["truncated"] += 1
                return
            if events[-1:] == ["data: [DONE]"]:
                results["done"] += 1
            else:
                tally.lose()

        with trio.fail_after(30):
            async with (
                httpx.AsyncClient(base_url=replica.base, timeout=10) as client,
                trio.open_nursery() as nursery,
            ):
                for index in range(20):
                    nursery.start_soon(one, client, index)
        tally.notes.update(results)
        assert results == {"done": 20 - dropped, "truncated": dropped}
        assert _state(engine)["counters"]["dropped_streams"] == dropped
        # The aborted connections were not pooled: every later request succeeds.
        await trio.to_thread.run_sync(_served_by, replica, 20, tally, "after")
    finally:
        replica.close()


# ---- a hang before the response head -------------------------------------------------------------


async def test_a_backend_hanging_before_its_head_costs_one_head_timeout_then_recovers(
    tmp_path: Path, launch: Launch, tally: Tally
) -> None:
    """engine-a answers nothing for a minute (`response_delay_ms`); the head timeout is 1 s.
    Every request sent to it moves to engine-b after that timeout and gets a 200; with both
    engines hanging the client gets a bare 502 once its one connect retry is spent (no hang, no
    504; `--proxy-max-connect-retries=1`, since with more retries than backends the answer is the
    bare 503 "every candidate failed", which the malformed-answer test checks). Each
    timed-out upstream request is cancelled (the engines see their client go away, nothing stays
    in flight there), and once the engines answer again the next requests succeed on both: a
    head timeout neither demotes a backend nor leaves a dead connection in the pool."""
    engine_a = launch()
    engine_b = launch()
    # Outlier ejection off: engine-a's head timeouts (4 to 6 in a row here) would otherwise eject
    # it for 30 s (docs/outliers.md; tests/e2e/test_outliers.py tests that), and this test needs
    # it back in the round robin at once to show the timeouts left no dead pooled connection.
    replica = await trio.to_thread.run_sync(
        _replica, tmp_path, "--proxy-max-connect-retries=1", "--outlier-consecutive-failures=0"
    )
    try:
        replica.register("engine-a", engine_a.url, [MODEL], cluster_id="a")
        replica.register("engine-b", engine_b.url, [MODEL], cluster_id="b")
        engine_a.control(response_delay_ms=60_000)
        started = time.monotonic()
        served = _served_by(replica, 8, tally, "one-hangs")
        assert set(served) == {"engine-b"}
        hung = _state(engine_a)["counters"]["requests"]["chat_completions"]
        assert hung >= 3  # round robin sent about every other one there first
        tally.inject(hung)
        assert time.monotonic() - started < 8 * ANSWER_WITHIN

        engine_b.control(response_delay_ms=60_000)
        tally.inject(2)
        started = time.monotonic()
        both = _post(replica, tally, "both-hang")
        elapsed = time.monotonic() - started
        assert (both.status_code, both.content) == (502, b"")
        assert elapsed < ANSWER_WITHIN
        tally.notes["both_hanging_answered_after_s"] = round(elapsed, 2)

        for engine in (engine_a, engine_b):
            wait_until(partial(_idle, engine), 5, "no hung request left at the engine")
            engine.control(response_delay_ms=0)
        assert set(_served_by(replica, 6, tally, "recovered")) == {"engine-a", "engine-b"}
        metrics = replica.metrics()
        timed_out = metric_sum(metrics, "stargate_proxy_attempts_total", result="proxy_502")
        assert timed_out == hung + 2  # each hung attempt, and both attempts of the 502
    finally:
        replica.close()


# ---- malformed HTTP ------------------------------------------------------------------------------


async def test_malformed_answers_are_retried_elsewhere_or_a_bare_503(
    tmp_path: Path, launch: Launch, raw: RawBackend, tally: Tally
) -> None:
    """A backend answers bytes that are not HTTP and closes. With a healthy sibling every request
    is retried there (200); alone, the request gets the documented bare 503 (every candidate
    failed). When the backend answers HTTP again the next request succeeds on a new connection:
    the broken one was never pooled."""
    engine = launch()
    replica = await trio.to_thread.run_sync(_replica, tmp_path)
    try:
        raw.mode = "malformed"
        replica.register("raw", raw.url, [MODEL], cluster_id="raw")
        stream_b = replica.register("engine-b", engine.url, [MODEL], cluster_id="b")
        served = _served_by(replica, 10, tally, "retried")
        assert set(served) == {"engine-b"}
        assert raw.count("malformed") >= 4  # round robin sent about half there first
        tally.inject(raw.count("malformed"))

        stream_b.cancel()  # raw alone now
        wait_until(lambda: _alone(replica, tally), 5, "engine-b's routes to go")
        for index in range(3):
            tally.inject()
            answer = _post(replica, tally, f"alone-{index}")
            assert (answer.status_code, answer.content) == (503, b"")

        raw.mode = "ok"
        connections = raw.connections
        assert set(_served_by(replica, 5, tally, "healed")) == {"raw"}
        assert raw.connections > connections  # a new connection, not the broken one
    finally:
        replica.close()


def _state(engine: MockBackendProcess) -> dict[str, Any]:
    """The engine's `GET /test-control`: knobs, in-flight count and counters."""
    state: dict[str, Any] = httpx.get(f"{engine.url}/test-control", timeout=5).json()
    return state


def _idle(engine: MockBackendProcess) -> bool:
    in_flight: int = _state(engine)["in_flight"]
    return in_flight == 0


def _alone(replica: ProxyReplica, tally: Tally) -> bool:
    served = {_post(replica, tally, "probe").headers.get("x-inference-server-id") for _ in range(2)}
    return "engine-b" not in served


# ---- keep-alive connections closed under the pool ------------------------------------------------


@pytest.mark.parametrize("mode", ["close_after_response", "reset_after_response"])
async def test_keep_alive_connections_closed_between_requests_never_fail_a_request(
    tmp_path: Path, raw: RawBackend, tally: Tally, mode: RawMode
) -> None:
    """The backend answers a complete keep-alive response and closes the connection right after
    (FIN, or RST): every connection the replica pools is dead before its next request. The
    replica must find that out without failing the request (docs/data-plane.md, Retries: a stale
    reused connection is retried once on a fresh one): sequential and concurrent requests all
    get a 200, and each connection served exactly one request."""
    replica = await trio.to_thread.run_sync(_replica, tmp_path)
    try:
        raw.mode = mode
        replica.register("raw", raw.url, [MODEL])
        before = raw.connections
        _served_by(replica, 30, tally, "sequential")

        async def one(client: httpx.AsyncClient, index: int) -> None:
            tally.send()
            response = await client.post(
                "/v1/chat/completions", headers=_headers(f"concurrent-{index}"), json=CHAT
            )
            if response.status_code != 200:
                tally.lose()

        for _ in range(3):  # bursts, so pooled dead connections are picked concurrently
            async with (
                httpx.AsyncClient(base_url=replica.base, timeout=ANSWER_WITHIN) as client,
                trio.open_nursery() as nursery,
            ):
                for index in range(20):
                    nursery.start_soon(one, client, index)
        answered = raw.count(mode)
        tally.inject(answered)  # every answer closed its connection
        assert tally.lost == 0
        assert answered == 90  # each request reached the backend exactly once
        health = raw.count("health")
        assert raw.connections - before >= answered  # no connection served two requests
        tally.notes.update(connections=raw.connections - before, health_probes=health)
    finally:
        replica.close()


# ---- refused connections and failing probes: out of rotation, and back ---------------------------


async def test_a_dead_backend_is_demoted_and_comes_back_when_it_answers_again(
    tmp_path: Path, launch: Launch, tally: Tally
) -> None:
    """engine-a's process dies: the first request sent there finds the connection refused, is
    retried on engine-b (200), and demotes engine-a, so no later request tries it (at most one
    refused attempt in all). Restarted on the same port, engine-a passes its next health probe
    and is served again within a few probe intervals."""
    engine_a = launch()
    engine_b = launch()
    port = engine_a.url.rsplit(":", 1)[1]
    replica = await trio.to_thread.run_sync(_replica, tmp_path)
    try:
        replica.register("engine-a", engine_a.url, [MODEL], cluster_id="a")
        replica.register("engine-b", engine_b.url, [MODEL], cluster_id="b")
        assert set(_served_by(replica, 4, tally, "before")) == {"engine-a", "engine-b"}

        engine_a.stop()
        tally.inject()
        served = _served_by(replica, 20, tally, "outage")
        assert set(served) == {"engine-b"}
        refused = metric_sum(
            replica.metrics(),
            "stargate_proxy_attempts_total",
            inference_server_id="engine-a",
            result="proxy_502",
        )
        assert refused <= 1  # demoted (or unrouted by its probe) after the first refusal

        revived = launch("--port", port)
        revived_at = time.monotonic()
        assert revived.url == engine_a.url
        back_at = wait_until(
            lambda: "engine-a" in _served_by(replica, 2, tally, "back"), 10, "engine-a back"
        )
        assert set(_served_by(replica, 4, tally, "after")) == {"engine-a", "engine-b"}
        tally.notes.update(refused_attempts=refused, back_after_s=round(back_at - revived_at, 2))
    finally:
        replica.close()


async def test_a_backend_failing_its_health_probe_leaves_rotation_and_returns(
    tmp_path: Path, launch: Launch, tally: Tally
) -> None:
    """engine-a's `/health` answers 503 (`healthy: false`) while it still serves: the replica's
    own probe takes it out of rotation within about a probe interval, without the Pylon saying
    anything (docs/stale-routes.md), so every request goes to engine-b; alone, the model answers
    the documented bare 503 (registered, no active backend), never a 404. Healthy again, it is
    back in rotation within a few probe intervals."""
    engine_a = launch()
    engine_b = launch()
    replica = await trio.to_thread.run_sync(_replica, tmp_path)
    try:
        replica.register("engine-a", engine_a.url, [MODEL], cluster_id="a")
        stream_b = replica.register("engine-b", engine_b.url, [MODEL], cluster_id="b")
        engine_a.control(healthy=False)
        tally.inject()
        wait_until(
            lambda: set(_served_by(replica, 2, tally, "settle")) == {"engine-b"},
            10,
            "engine-a out of rotation",
        )
        assert set(_served_by(replica, 10, tally, "unhealthy")) == {"engine-b"}

        stream_b.cancel()
        wait_until(
            lambda: _post(replica, tally, "alone").status_code == 503, 5, "a 503 for the model"
        )
        answer = _post(replica, tally, "alone")
        assert (answer.status_code, answer.content) == (503, b"")

        engine_a.control(healthy=True)
        wait_until(lambda: _post(replica, tally, "healed").status_code == 200, 10, "engine-a back")
        assert set(_served_by(replica, 4, tally, "after")) == {"engine-a"}
    finally:
        replica.close()
