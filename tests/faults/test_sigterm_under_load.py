"""Fault: SIGTERM to a replica while 200 SSE streams and 500 short requests are in flight.

A replica proxies to three mock engines that generate slowly (150 ms per token), so at the
moment of SIGTERM every stream is mid-body and every short request is waiting for its answer.
The replica leaves for `--shutdown-delay-ms` (500 ms), then drains with a drain timeout far
longer than the streams. Meanwhile a prober opens a new connection every 50 ms.

Asserted, because a rolling restart must cost no request (docs/rolling-restarts.md):

* every request the replica accepted before SIGTERM completes: each stream to `data: [DONE]`,
  each short request with a 200 and its JSON body;
* a new connection after SIGTERM is either answered (during the leave phase: 200, with
  `Connection: close`) or refused (once the listener has closed), never reset or left unanswered,
  and the leave phase is visible on `/readyz` (503, `phase: leaving`);
* the process exits 0 (the drain finished before its deadline).
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.e2e.processes import MockBackendProcess, launch_mock_backend, wait_until
from tests.e2e.test_proxy import ProxyReplica, start_proxy_replica
from tests.faults.support import Tally

pytestmark = pytest.mark.faults

STREAMS = 200
SHORT = 500
ENGINES = 3  # round robin: at most 234 requests each, below the 256 connections per origin
INTER_TOKEN_MS = 150
STREAM_TOKENS = 30  # about 4.4 s per stream
SHORT_TOKENS = 28  # about 4 s per short (non-streaming) answer: all still in flight at SIGTERM
DELAY_MS = 500
DRAIN_TIMEOUT_MS = 30_000
MODEL = "model-a"


def _headers(request_id: str) -> dict[str, str]:
    return {"x-request-id": request_id, "x-input-tokens": "4", "x-model": MODEL}


def _chat(max_tokens: int | None = None, stream: bool = False) -> dict[str, object]:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


@pytest.fixture
def engines() -> Iterator[list[MockBackendProcess]]:
    started: list[MockBackendProcess] = []
    try:
        for _ in range(ENGINES):
            started.append(
                launch_mock_backend(
                    "--model",
                    MODEL,
                    "--inter-token-ms",
                    str(INTER_TOKEN_MS),
                    "--tokens",
                    str(STREAM_TOKENS),
                )
            )
        yield started
    finally:
        for engine in started:
            engine.stop()


def _mock_state(engines: list[MockBackendProcess]) -> tuple[int, int]:
    """(chat requests received, in flight) summed over the engines."""
    received = in_flight = 0
    for engine in engines:
        state = httpx.get(f"{engine.url}/test-control", timeout=5).json()
        received += state["counters"]["requests"]["chat_completions"]
        in_flight += state["in_flight"]
    return received, in_flight


@pytest.mark.timeout(180)
async def test_sigterm_with_streams_and_short_requests_in_flight_loses_nothing(
    tmp_path: Path, engines: list[MockBackendProcess], tally: Tally
) -> None:
    lb_config = tmp_path / "lb.json"
    lb_config.write_text(json.dumps({"default": "round-robin"}))
    replica: ProxyReplica = await trio.to_thread.run_sync(
        lambda: start_proxy_replica(
            tmp_path,
            f"--shutdown-delay-ms={DELAY_MS}",
            f"--shutdown-drain-timeout-ms={DRAIN_TIMEOUT_MS}",
            f"--lb-config-path={lb_config}",
            # 700 client connections at once: above the default cap (384), which would answer
            # the excess 503 too_many_connections before any SIGTERM (not this test's fault).
            "--max-client-connections=1000",
            "--log-level=warning",
        )
    )
    try:
        for index, engine in enumerate(engines):
            replica.register(f"engine-{index}", engine.url, [MODEL], cluster_id=f"c{index}")
        await _run(replica, engines, tally)
    finally:
        replica.close()


async def _run(replica: ProxyReplica, engines: list[MockBackendProcess], tally: Tally) -> None:
    outcomes: Counter[str] = Counter()
    stream_heads = 0
    heads_seen = trio.Event()
    sigterm_sent = trio.Event()
    exited = trio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    def lost(kind: str) -> None:
        outcomes[kind] += 1
        tally.lose()

    async def one_stream(client: httpx.AsyncClient, index: int) -> None:
        nonlocal stream_heads
        tally.send()
        lines: list[str] = []
        head = False
        try:
            async with client.stream(
                "POST",
                "/v1/chat/completions",
                headers=_headers(f"stream-{index}"),
                json=_chat(stream=True),
            ) as response:
                head = True
                stream_heads += 1
                if stream_heads == STREAMS:
                    heads_seen.set()
                if response.status_code != 200:
                    lost(f"stream status {response.status_code}")
                    return
                lines = [line async for line in response.aiter_lines() if line]
        except httpx.HTTPError as error:
            lost(f"stream {'after' if head else 'before'} head: {type(error).__name__}")
            return
        if lines[-1:] == ["data: [DONE]"]:
            outcomes["stream completed"] += 1
        else:
            lost("stream without [DONE]")

    async def one_short(client: httpx.AsyncClient, index: int) -> None:
        tally.send()
        try:
            response = await client.post(
                "/v1/chat/completions",
                headers=_headers(f"short-{index}"),
                json=_chat(max_tokens=SHORT_TOKENS),
            )
        except httpx.HTTPError as error:
            lost(f"short: {type(error).__name__}")
            return
        if response.status_code == 200 and response.json()["object"] == "chat.completion":
            outcomes["short completed"] += 1
        else:
            lost(f"short status {response.status_code}")

    async def prober() -> None:
        """A new connection every 50 ms from SIGTERM until the process has exited."""
        await sigterm_sent.wait()
        index = 0
        while not exited.is_set():
            index += 1
            tally.send()
            async with httpx.AsyncClient(base_url=replica.base, timeout=10) as fresh:
                try:
                    response = await fresh.post(
                        "/v1/chat/completions",
                        headers=_headers(f"probe-{index}"),
                        json=_chat(max_tokens=1),
                    )
                except httpx.ConnectError:
                    outcomes["probe refused"] += 1
                except httpx.HTTPError as error:
                    lost(f"probe: {type(error).__name__}")
                else:
                    if response.status_code == 200 and response.headers["connection"] == "close":
                        outcomes["probe answered"] += 1  # and told to move on
                    else:
                        lost(f"probe status {response.status_code}")
            await trio.sleep(0.05)

    async def readiness_watch() -> None:
        # The connection is opened (and used) before SIGTERM, so the check does not depend on
        # connecting within the leave phase: once, with 700 requests in flight on two loaded
        # cores, a fresh connection made after SIGTERM came after the listener had closed.
        # A signal is delivered asynchronously: a /readyz already on its way when SIGTERM is
        # sent may still be answered 200 (seen once in CI on Python 3.13 with 700 requests in
        # flight), so the watcher asks again until the leave phase shows, within that phase.
        with httpx.Client(base_url=replica.base, timeout=5) as watcher:
            await trio.to_thread.run_sync(lambda: watcher.get("/readyz"))
            await sigterm_sent.wait()
            deadline = trio.current_time() + DELAY_MS / 1000
            while True:
                response = await trio.to_thread.run_sync(lambda: watcher.get("/readyz"))
                if response.status_code != 200 or trio.current_time() >= deadline:
                    break
                await trio.sleep(0.02)
        assert response.status_code == 503
        assert response.json()["phase"] == "leaving"

    process = replica.process.process
    started = trio.current_time()
    async with (
        httpx.AsyncClient(base_url=replica.base, timeout=60, limits=limits) as client,
        trio.open_nursery() as nursery,
    ):
        for index in range(STREAMS):
            nursery.start_soon(one_stream, client, index)
        for index in range(SHORT):
            nursery.start_soon(one_short, client, index)
        nursery.start_soon(prober)
        nursery.start_soon(readiness_watch)

        # Every request has reached an engine and every stream has its head: all accepted.
        with trio.move_on_after(60):
            await heads_seen.wait()
        assert heads_seen.is_set(), (stream_heads, dict(outcomes))
        await trio.to_thread.run_sync(
            lambda: wait_until(
                lambda: _mock_state(engines)[0] == STREAMS + SHORT, 60, "all requests at engines"
            )
        )
        _, in_flight = await trio.to_thread.run_sync(_mock_state, engines)
        dispatched_after = trio.current_time() - started
        process.send_signal(signal.SIGTERM)
        tally.inject()
        sigterm_at = time.monotonic()
        sigterm_sent.set()
        code = await trio.to_thread.run_sync(lambda: process.wait(timeout=60))
        exit_after = time.monotonic() - sigterm_at
        exited.set()

    summary = dict(sorted(outcomes.items()))
    tally.notes.update(
        summary,
        in_flight_at_sigterm=in_flight,
        sigterm_after_s=round(dispatched_after, 2),
        exit_after_s=round(exit_after, 2),
    )
    assert in_flight >= STREAMS + SHORT // 2, (in_flight, summary)  # mostly still in flight
    assert code == 0, (code, summary, exit_after)
    assert outcomes["stream completed"] == STREAMS, summary
    assert outcomes["short completed"] == SHORT, summary
    assert outcomes["probe refused"] >= 1, summary  # the listener did close
    assert tally.lost == 0, summary
    assert exit_after < DRAIN_TIMEOUT_MS / 1000, exit_after
