"""Faults of the clients: heads that trickle in (slowloris), bodies that never arrive, bodies that
trickle, against a replica that keeps serving everyone else.

Real processes on loopback: a replica (`stargate serve --request-body-timeout-ms=1000`) with a
mock engine registered, slow clients on raw trio sockets, and a well-behaved client (httpx) that
keeps asking `/healthz` and a proxied chat completion while the slow ones hold their connections.

Asserted (docs/http-serving.md, "Limits" and "What a client can expect"):

* a head sent one byte a second is closed at the keep-alive timeout (5 s from the connection's
  start: Hypercorn's timer covers a connection until its head is complete), unanswered;
* a complete head whose body never arrives, or trickles in, is answered 408 with `Connection:
  close` and `x-stargate-error-code: request_body_timeout` once the body timeout has passed since
  the head (a trickle does not extend it), and the connection is then closed; each is counted in
  `stargate_http_request_body_timeouts_total` and none stays in flight;
* meanwhile every probe and every proxied request of the well-behaved client is answered 200
  within 2 s;
* a stalled body does not hold a graceful shutdown: after SIGTERM the replica exits 0 once the
  body timeout has answered it, long before the drain deadline.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.e2e.processes import MockBackendProcess, launch_mock_backend
from tests.e2e.test_proxy import ProxyReplica, start_proxy_replica
from tests.faults.support import Tally, metric_sum

pytestmark = pytest.mark.faults

MODEL = "model-a"
BODY_TIMEOUT = 1.0  # --request-body-timeout-ms, seconds
HEAD_TIMEOUT = 5.0  # Hypercorn's keep-alive timeout: a head must be complete within it
SLOWLORIS = 20
STALLED = 20
TRICKLING = 20
MARGIN = 2.5  # seconds of slack for a loaded machine, on every timing bound


@pytest.fixture
def engine() -> Iterator[MockBackendProcess]:
    started = launch_mock_backend("--model", MODEL)
    yield started
    started.stop()


def _replica(tmp_path: Path, engine: MockBackendProcess, *extra: str) -> ProxyReplica:
    replica = start_proxy_replica(
        tmp_path, f"--request-body-timeout-ms={int(BODY_TIMEOUT * 1000)}", *extra
    )
    replica.register("engine-a", engine.url, [MODEL])
    return replica


def _head(request_id: str, content_length: int) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: replica\r\n"
        f"x-request-id: {request_id}\r\nx-input-tokens: 1\r\nx-model: {MODEL}\r\n"
        f"content-type: application/json\r\ncontent-length: {content_length}\r\n\r\n"
    ).encode()


async def _read_until_closed(stream: trio.SocketStream, limit: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or `limit` seconds pass (False)."""
    received = b""
    with trio.move_on_after(limit):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:  # closed with unread input: a reset
                return received, True
            if not data:
                return received, True
            received += data
    return received, False


class Outcomes:
    """What the slow clients saw, checked against the documented behaviour as they finish."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.problems: list[str] = []
        self.closed_after: dict[str, list[float]] = {"slowloris": [], "stalled": [], "trickle": []}

    def bad(self, what: str) -> None:
        self.problems.append(what)
        self.tally.lose()


async def _slowloris(port: int, index: int, outcomes: Outcomes) -> None:
    """One byte of a head per second until the replica closes the connection."""
    outcomes.tally.send()
    head = _head(f"slowloris-{index}", 2)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    started = trio.current_time()
    async with stream:
        for byte in head[:-4]:  # never complete
            try:
                await stream.send_all(bytes([byte]))
            except trio.BrokenResourceError:
                break
            received, closed = await _read_until_closed(stream, 1.0)
            if closed or received:
                break
        else:
            outcomes.bad(f"slowloris {index}: sent the whole head without being closed")
            return
    elapsed = trio.current_time() - started
    outcomes.closed_after["slowloris"].append(elapsed)
    if received:
        outcomes.bad(f"slowloris {index}: answered {received[:40]!r}")
    if not HEAD_TIMEOUT - 1.0 <= elapsed <= HEAD_TIMEOUT + MARGIN:
        outcomes.bad(f"slowloris {index}: closed after {elapsed:.2f} s")


async def _stalled_body(port: int, index: int, outcomes: Outcomes, trickle: bool) -> None:
    """A complete head announcing 100 bytes, then no body (or one byte every 200 ms)."""
    kind = "trickle" if trickle else "stalled"
    outcomes.tally.send()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(_head(f"{kind}-{index}", 100))
        started = trio.current_time()
        if trickle:
            received = b""
            closed = False
            for _ in range(100):
                try:
                    await stream.send_all(b" ")
                except trio.BrokenResourceError:
                    break
                more, closed = await _read_until_closed(stream, 0.2)
                received += more
                if closed:
                    break
            if not closed:
                more, closed = await _read_until_closed(stream, MARGIN)
                received += more
        else:
            received, closed = await _read_until_closed(stream, BODY_TIMEOUT + MARGIN + 2)
    elapsed = trio.current_time() - started
    outcomes.closed_after[kind].append(elapsed)
    head, _, _ = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").lower().split("\r\n")
    if not lines[0].startswith("http/1.1 408"):
        outcomes.bad(f"{kind} {index}: answered {received[:60]!r}")
    elif "connection: close" not in lines or (
        "x-stargate-error-code: request_body_timeout" not in lines
    ):
        outcomes.bad(f"{kind} {index}: 408 without its headers: {lines}")
    if not closed:
        outcomes.bad(f"{kind} {index}: the connection stayed open after the 408")
    if not BODY_TIMEOUT - 0.2 <= elapsed <= BODY_TIMEOUT + MARGIN:
        outcomes.bad(f"{kind} {index}: closed {elapsed:.2f} s after the head")


async def _well_behaved(base: str, stop: trio.Event, outcomes: Outcomes) -> int:
    """`/healthz` and a proxied chat completion, alternately, until `stop`; each must be a 200
    within 2 s. Returns how many were sent."""
    sent = 0
    headers = {"x-request-id": "good", "x-input-tokens": "1", "x-model": MODEL}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        while not stop.is_set():
            for path in ("/healthz", "/v1/chat/completions"):
                sent += 1
                outcomes.tally.send()
                started = trio.current_time()
                try:
                    if path == "/healthz":
                        response = await client.get(path)
                    else:
                        response = await client.post(path, headers=headers, json=chat)
                except httpx.HTTPError as error:
                    outcomes.bad(f"good client {path}: {error!r}")
                    continue
                elapsed = trio.current_time() - started
                if response.status_code != 200 or elapsed > 2.0:
                    outcomes.bad(f"good client {path}: {response.status_code} in {elapsed:.2f} s")
            await trio.sleep(0.1)
    return sent


@pytest.mark.timeout(90)
async def test_slow_clients_are_cut_off_while_everyone_else_is_served(
    tmp_path: Path, engine: MockBackendProcess, tally: Tally
) -> None:
    replica = await trio.to_thread.run_sync(_replica, tmp_path, engine)
    try:
        port = replica.ports.http
        outcomes = Outcomes(tally)
        stop = trio.Event()
        good: list[int] = []

        async def good_client() -> None:
            good.append(await _well_behaved(replica.base, stop, outcomes))

        with trio.fail_after(HEAD_TIMEOUT + 3 * MARGIN + 10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(good_client)
                async with trio.open_nursery() as slow:
                    for index in range(SLOWLORIS):
                        slow.start_soon(_slowloris, port, index, outcomes)
                    for index in range(STALLED):
                        slow.start_soon(_stalled_body, port, index, outcomes, False)
                    for index in range(TRICKLING):
                        slow.start_soon(_stalled_body, port, index, outcomes, True)
                tally.inject(SLOWLORIS + STALLED + TRICKLING)
                stop.set()

        tally.notes.update(
            {
                f"{kind}_closed_after_s": [round(min(times), 2), round(max(times), 2)]
                for kind, times in outcomes.closed_after.items()
                if times
            },
            good_requests=good[0],
        )
        assert outcomes.problems == []
        assert good[0] >= 20  # the good client kept going the whole time
        metrics = await trio.to_thread.run_sync(replica.metrics)
        assert metric_sum(metrics, "stargate_http_request_body_timeouts_total") == (
            STALLED + TRICKLING
        )
        assert metric_sum(metrics, "stargate_proxy_requests_in_flight") == 0
    finally:
        replica.close()


@pytest.mark.timeout(60)
async def test_a_stalled_body_does_not_hold_a_graceful_shutdown(
    tmp_path: Path, engine: MockBackendProcess, tally: Tally
) -> None:
    drain_timeout = 20.0
    replica = await trio.to_thread.run_sync(
        lambda: _replica(
            tmp_path,
            engine,
            "--shutdown-delay-ms=0",
            f"--shutdown-drain-timeout-ms={int(drain_timeout * 1000)}",
        )
    )
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", replica.ports.http)
        async with stream:
            await stream.send_all(_head("stalled-at-shutdown", 100))
            tally.send()
            tally.inject()
            await trio.sleep(0.2)  # the head is in: a request in flight
            process = replica.process.process
            process.send_signal(signal.SIGTERM)
            tally.inject()
            started = time.monotonic()
            received, closed = await _read_until_closed(stream, BODY_TIMEOUT + MARGIN)
            code = await trio.to_thread.run_sync(lambda: process.wait(timeout=drain_timeout))
            elapsed = time.monotonic() - started
        tally.notes["exited_after_s"] = round(elapsed, 2)
        if not received.startswith(b"HTTP/1.1 408"):
            tally.lose()
        assert received.startswith(b"HTTP/1.1 408"), received[:80]
        assert closed
        assert code == 0
        assert elapsed < BODY_TIMEOUT + MARGIN + 2
    finally:
        replica.close()
