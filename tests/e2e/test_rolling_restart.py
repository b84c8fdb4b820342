"""The leave phase of a shutdown (docs/rolling-restarts.md), with real processes on loopback:
after SIGTERM a replica serves on for `--shutdown-delay-ms` while telling clients to move on, then
stops accepting and drains. The whole-rollout check is tests/e2e/test_rollout.py."""

from __future__ import annotations

import queue
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import httpx
import pytest

from stargate.protocol import stargate_pb2 as pb
from stargate.protocol import stargate_pb2_grpc as pb_grpc
from tests.e2e.processes import MockBackendProcess, launch_mock_backend, wait_until
from tests.e2e.test_proxy import ProxyReplica, start_proxy_replica

HEADERS = {"x-request-id": "r", "x-input-tokens": "1", "x-model": "model-a"}
CHAT = {"model": "model-a", "messages": [{"role": "user", "content": "hi"}]}
DELAY_MS = 2500


@pytest.fixture(scope="module")
def backend() -> Iterator[MockBackendProcess]:
    started = launch_mock_backend("--model", "model-a")
    yield started
    started.stop()


@pytest.fixture(autouse=True)
def reset_backend(backend: MockBackendProcess) -> None:
    backend.control(reset=True)


def _replica(tmp_path: Path, backend: MockBackendProcess, *extra: str) -> ProxyReplica:
    replica = start_proxy_replica(tmp_path, f"--shutdown-delay-ms={DELAY_MS}", *extra)
    replica.register("backend-0", backend.url, ["model-a"])
    return replica


def _chat(client: httpx.Client, replica: ProxyReplica) -> httpx.Response:
    return client.post(f"{replica.base}/v1/chat/completions", headers=HEADERS, json=CHAT)


def _phase(replica: ProxyReplica) -> str:
    response = httpx.get(f"{replica.base}/readyz", timeout=5)
    phase: str = response.json()["phase"]
    assert response.status_code == (200 if phase == "ready" else 503)
    return phase


def test_leaving_replica_serves_keep_alive_and_new_connections_then_refuses(
    tmp_path: Path, backend: MockBackendProcess
) -> None:
    replica = _replica(tmp_path, backend)
    try:
        watch = pb_grpc.StargateControlPlaneStub(replica.channel).WatchStargates(
            pb.WatchStargatesRequest(), timeout=30
        )
        assert [s.advertise_addr for s in next(watch).stargates] != []  # announces itself
        with httpx.Client(timeout=10) as pooled:
            assert _chat(pooled, replica).status_code == 200  # a pooled keep-alive connection
            sigterm_at = time.monotonic()
            replica.process.process.send_signal(signal.SIGTERM)
            wait_until(lambda: _phase(replica) == "leaving", 2, "the leave phase")
            assert list(next(watch).stargates) == []  # no longer announced

            # On the kept-alive connection: answered normally, and told to close.
            during = _chat(pooled, replica)
            assert during.status_code == 200, during.text
            assert during.headers["connection"] == "close"
            # A new connection is still accepted and routed: routes and streams are intact.
            assert (
                httpx.post(
                    f"{replica.base}/v1/chat/completions", headers=HEADERS, json=CHAT, timeout=10
                ).status_code
                == 200
            )
            with pytest.raises(queue.Empty):  # the stream is still open: no end, no error
                replica.streams[0].next_event(timeout=0.5)

            # The registration stream ends (OK) only when the delay is over.
            assert replica.streams[0].finish(timeout=DELAY_MS / 1000 + 5) == grpc.StatusCode.OK
            assert time.monotonic() - sigterm_at >= DELAY_MS / 1000 - 0.2
        assert replica.process.process.wait(timeout=10) == 0
        with pytest.raises(httpx.ConnectError):
            _chat(httpx.Client(timeout=2), replica)
        log = replica.process.log
        assert "leaving: /readyz answers 503" in log
        assert "graceful shutdown complete" in log
    finally:
        replica.close()


def test_after_the_delay_new_connections_are_refused_not_404(
    tmp_path: Path, backend: MockBackendProcess
) -> None:
    replica = _replica(tmp_path, backend, "--shutdown-drain-timeout-ms=20000")
    backend.control(inter_token_ms=250, tokens=40)  # a 10 s stream keeps the replica draining
    try:
        with (
            httpx.Client(timeout=30) as client,
            client.stream(
                "POST",
                f"{replica.base}/v1/chat/completions",
                headers=HEADERS,
                json={**CHAT, "stream": True},
            ) as stream,
        ):
            chunks = stream.iter_bytes()
            next(chunks)
            replica.process.process.send_signal(signal.SIGTERM)
            wait_until(lambda: _phase(replica) == "leaving", 2, "the leave phase")

            def refused() -> bool:
                try:
                    with socket.create_connection(("127.0.0.1", replica.ports.http), 1):
                        return False
                except ConnectionRefusedError:
                    return True
                except TimeoutError:
                    # The SYN was dropped while the accept queue drained (docs/rolling-restarts.md,
                    # "Closing the listener"): not closed yet; the next try is refused.
                    return False

            wait_until(refused, DELAY_MS / 1000 + 3, "the listener to close")
            assert replica.process.process.poll() is None  # still draining the stream
            body = b"".join(chunks)  # the stream in flight completes
        assert body.rstrip().endswith(b"data: [DONE]")
        assert replica.process.process.wait(timeout=10) == 0
    finally:
        replica.close()


def test_http2_connections_get_a_graceful_goaway_while_leaving(
    tmp_path: Path, backend: MockBackendProcess
) -> None:
    replica = _replica(tmp_path, backend)
    try:
        with socket.create_connection(("127.0.0.1", replica.ports.http), timeout=5) as sock:
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            conn.send_headers(
                1,
                [
                    (":method", "GET"),
                    (":path", "/healthz"),
                    (":scheme", "http"),
                    (":authority", "replica"),
                ],
                end_stream=True,
            )
            sock.sendall(conn.data_to_send())
            events = _read_until(sock, conn, h2.events.StreamEnded)
            assert any(isinstance(e, h2.events.ResponseReceived) for e in events)
            replica.process.process.send_signal(signal.SIGTERM)
            goaway = _read_until(sock, conn, h2.events.ConnectionTerminated, timeout=3)[-1]
            assert isinstance(goaway, h2.events.ConnectionTerminated)
            assert goaway.error_code == 0  # NO_ERROR: go elsewhere, nothing failed
            assert goaway.last_stream_id == 1
        assert _phase(replica) == "leaving"  # the GOAWAY came during the leave phase
    finally:
        replica.close()


def _read_until(
    sock: socket.socket, conn: h2.connection.H2Connection, kind: type, timeout: float = 5
) -> list[h2.events.Event]:
    events: list[h2.events.Event] = []
    deadline = time.monotonic() + timeout
    while not any(isinstance(e, kind) for e in events):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        data = sock.recv(65536)
        assert data, "the connection closed before the event"
        events += conn.receive_data(data)
        sock.sendall(conn.data_to_send())
    return events


def test_sigint_skips_the_delay(tmp_path: Path, backend: MockBackendProcess) -> None:
    replica = _replica(tmp_path, backend, "--shutdown-delay-ms=30000")
    try:
        started = time.monotonic()
        replica.process.process.send_signal(signal.SIGINT)
        assert replica.process.process.wait(timeout=10) == 0
        assert time.monotonic() - started < 5
        assert "leaving:" not in replica.process.log
    finally:
        replica.close()


def test_a_second_signal_during_the_delay_forces_exit_1(
    tmp_path: Path, backend: MockBackendProcess
) -> None:
    replica = _replica(tmp_path, backend, "--shutdown-delay-ms=30000")
    try:
        replica.process.process.send_signal(signal.SIGTERM)
        wait_until(lambda: _phase(replica) == "leaving", 2, "the leave phase")
        replica.process.process.send_signal(signal.SIGTERM)
        assert replica.process.process.wait(timeout=10) == 1
        assert "forcing immediate exit" in replica.process.log
    finally:
        replica.close()


def test_nothing_else_cuts_the_delay_short(tmp_path: Path, backend: MockBackendProcess) -> None:
    """An idle replica (nothing in flight, every stream closed by its client) still leaves for
    the whole delay: the Service does not know it is going until the delay is over."""
    replica = _replica(tmp_path, backend)
    try:
        started = time.monotonic()
        replica.process.process.send_signal(signal.SIGTERM)
        wait_until(lambda: _phase(replica) == "leaving", 2, "the leave phase")
        replica.streams[0].close()  # the Pylon goes away during the delay
        time.sleep(DELAY_MS / 1000 - 0.8)
        assert replica.process.process.poll() is None
        assert _phase(replica) == "leaving"
        # The routes of a registration that ended while leaving are kept until the drain is over.
        with httpx.Client(timeout=10) as client:
            assert _chat(client, replica).status_code == 200
        assert replica.process.process.wait(timeout=10) == 0
        assert time.monotonic() - started >= DELAY_MS / 1000 - 0.2
        assert "registration ended while the replica shuts down; routes kept" in replica.process.log
    finally:
        replica.close()
