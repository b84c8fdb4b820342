"""Connections end when HTTP says so (docs/http-serving.md), whatever the replica served last.

A real replica and a real mock backend registered over a real registration stream; clients are
raw sockets (HTTP/1.1 and HTTP/1.0, with h11 only parsing the responses; h2c for the idle
timeout too), and nginx in front with its default `proxy_pass`, which speaks HTTP/1.0 to the
upstream. Real clock, loopback only.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import h11
import httpx
import pytest

from tests.e2e.nginx import nginx_in_front
from tests.e2e.processes import (
    MockBackendProcess,
    Ports,
    StargateProcess,
    launch,
    launch_mock_backend,
    stop,
    wait_until,
)
from tests.e2e.test_h2_streams import H2Conn, start_replica
from tests.fakes.pylon import PylonStream, registration

MODEL = "model-a"
PROXY_HEADERS = {"x-request-id": "conn-close", "x-input-tokens": "10", "x-model": MODEL}
CLOSED_WITHIN = 3.0  # "at once", with room for a shared, busy CI machine
KEEP_ALIVE_TIMEOUT = 5.0  # Hypercorn's default keep_alive_timeout, which the replica keeps


@dataclass(frozen=True)
class Answer:
    """One kind of answer the HTTP listener gives, and the request that produces it."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    status: int = 200
    ends_with: bytes = b""


def _proxied(model: str = MODEL) -> tuple[tuple[str, str], ...]:
    headers = {**PROXY_HEADERS, "x-model": model, "content-type": "application/json"}
    return tuple(headers.items())


def _chat(stream: bool, model: str = MODEL) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return json.dumps(body).encode()


ANSWERS = {
    "proxied SSE": Answer(
        "POST",
        "/v1/chat/completions",
        _proxied(),
        _chat(True),
        ends_with=b"data: [DONE]\n\n",
    ),
    "proxied JSON": Answer("POST", "/v1/chat/completions", _proxied(), _chat(False)),
    "proxy error": Answer(
        "POST",
        "/v1/chat/completions",
        _proxied("nobody-serves-this"),
        _chat(False, "nobody-serves-this"),
        status=404,
    ),
    "/healthz": Answer("GET", "/healthz"),
    "/v1/models": Answer("GET", "/v1/models"),
    "Quart 404": Answer("GET", "/no-such-page", status=404),
}


H2_ANSWERS = ["proxied SSE", "/healthz"]


def _request_bytes(answer: Answer, *, version: str, connection: str | None) -> bytes:
    lines = [f"{answer.method} {answer.path} HTTP/{version}", "Host: stargate.test"]
    lines += [f"{name}: {value}" for name, value in answer.headers]
    if answer.body:
        lines.append(f"Content-Length: {len(answer.body)}")
    if connection is not None:
        lines.append(f"Connection: {connection}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + answer.body


class RawClient:
    """One TCP connection; requests are written as raw bytes, responses parsed with h11."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.local_port: int = self.sock.getsockname()[1]
        self.h11 = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        self.sock.close()

    def request(
        self, answer: Answer, *, version: str = "1.1", connection: str | None = None
    ) -> None:
        if self.h11.our_state is h11.DONE:
            self.h11.start_next_cycle()
        # h11 only tracks the exchange (it always speaks HTTP/1.1); the bytes sent are ours.
        self.h11.send(
            h11.Request(method=answer.method, target=answer.path, headers=[("host", "t")])
        )
        self.h11.send(h11.EndOfMessage())
        self.sock.sendall(_request_bytes(answer, version=version, connection=connection))

    def response(self, timeout: float = 10.0) -> tuple[int, bytes]:
        """Read one complete response (for a close-delimited body, up to the server's close)."""
        self.sock.settimeout(timeout)
        status = 0
        body = b""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                try:
                    self.h11.receive_data(self.sock.recv(65536))
                except TimeoutError:
                    raise AssertionError(
                        f"the response did not end within {timeout} s (a body delimited by the"
                        " close ends only when the server closes)"
                    ) from None
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return status, body
            else:
                raise AssertionError(f"unexpected {event!r}")

    def wait_for_close(self, timeout: float) -> float:
        """Seconds until the server closes the connection; fail if it has not within `timeout`
        or sends anything more."""
        started = time.monotonic()
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open for {timeout} s") from None
        except ConnectionResetError:
            data = b""
        assert data == b"", f"unexpected bytes after the response: {data[:80]!r}"
        return time.monotonic() - started


def _check(answer: Answer, status: int, body: bytes) -> None:
    assert status == answer.status, body[:300]
    assert body.endswith(answer.ends_with), body[-300:]


# --- the replica ---------------------------------------------------------------------------------


@dataclass
class Replica:
    process: StargateProcess
    ports: Ports
    backend: MockBackendProcess

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"


@pytest.fixture(scope="module")
def backend() -> Iterator[MockBackendProcess]:
    started = launch_mock_backend("--model", MODEL)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def replica(
    tmp_path_factory: pytest.TempPathFactory, backend: MockBackendProcess
) -> Iterator[Replica]:
    logs = tmp_path_factory.mktemp("connection-close")
    ports, process = start_replica(
        lambda ports: launch(
            logs / f"replica-{ports.http}.log",
            "serve",
            *ports.args(),
            "--readiness-warmup-ms=0",
            "--disable-dns-discovery",
            "--registration-update-idle-timeout-ms=0",
        )
    )
    handle = Replica(process, ports, backend)
    channel = grpc.insecure_channel(f"127.0.0.1:{ports.grpc}")
    try:
        pylon = PylonStream(channel)
        pylon.exchange(registration("backend-0", backend.url, [MODEL]))

        def routable() -> bool:
            response = httpx.post(
                f"{handle.base}/v1/chat/completions",
                headers=PROXY_HEADERS,
                content=_chat(False),
                timeout=5,
            )
            return response.status_code == 200

        wait_until(routable, 15, "the backend to be routable")
        yield handle
        pylon.cancel()
    finally:
        channel.close()
        stop(process)


@pytest.fixture(autouse=True)
def reset_backend(backend: MockBackendProcess) -> None:
    backend.control(reset=True)


# --- Connection: close and HTTP/1.0 --------------------------------------------------------------


@pytest.mark.parametrize("name", ANSWERS)
def test_connection_close_is_answered_then_closed(replica: Replica, name: str) -> None:
    answer = ANSWERS[name]
    client = RawClient(replica.ports.http)
    try:
        client.request(answer, connection="close")
        _check(answer, *client.response())
        client.wait_for_close(CLOSED_WITHIN)
    finally:
        client.close()


@pytest.mark.parametrize("name", ANSWERS)
def test_http_1_0_is_answered_then_closed(replica: Replica, name: str) -> None:
    """HTTP/1.0 without keep-alive: the server must close (a streamed body ends only then)."""
    answer = ANSWERS[name]
    client = RawClient(replica.ports.http)
    try:
        client.request(answer, version="1.0")
        _check(answer, *client.response(timeout=CLOSED_WITHIN))
        client.wait_for_close(CLOSED_WITHIN)  # at once if the close delimited the body
    finally:
        client.close()


# --- keep-alive ----------------------------------------------------------------------------------


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(replica: Replica) -> None:
    """Whatever it served last; one connection per kind of answer (and two HTTP/2 ones), all
    idle at the same time.

    Each connection serves two requests first, so keep-alive itself is seen to work; its client
    then goes silent without closing (a client that vanished), and the server reaps it.
    """
    idle_for: dict[str, float] = {}
    failures: dict[str, BaseException] = {}

    def one(name: str) -> None:
        answer = ANSWERS[name]
        client = RawClient(replica.ports.http)
        try:
            for _ in range(2):
                client.request(answer)
                _check(answer, *client.response())
            idle_for[name] = client.wait_for_close(KEEP_ALIVE_TIMEOUT * 3)
        except BaseException as error:
            failures[name] = error
        finally:
            client.close()

    def one_h2(name: str) -> None:
        answer = ANSWERS[name]
        client = H2Conn(replica.ports.http)
        try:
            for _ in range(2):
                stream = client.start(
                    answer.path,
                    method=answer.method,
                    headers=answer.headers,
                    body=answer.body or None,
                )
                client.flush()
                client.read_until(lambda: client.finished(stream))  # noqa: B023
                _check(answer, client.statuses[stream], bytes(client.bodies[stream]))
            started = time.monotonic()
            client.read_to_eof(KEEP_ALIVE_TIMEOUT * 3)
            idle_for[f"h2c {name}"] = time.monotonic() - started
        except BaseException as error:
            failures[f"h2c {name}"] = error
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(name,)) for name in ANSWERS]
    threads += [threading.Thread(target=one_h2, args=(name,)) for name in H2_ANSWERS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == {}
    assert len(idle_for) == len(threads)
    for name, seconds in idle_for.items():
        # Not at once (the connection was kept alive), and about the timeout (5 s) later.
        assert KEEP_ALIVE_TIMEOUT - 1.5 <= seconds <= KEEP_ALIVE_TIMEOUT * 3, (name, seconds)


def _server_socket_states(server_port: int, client_port: int) -> set[str]:
    """TCP states (/proc/net/tcp hex codes) of the server's side of one loopback connection."""
    states = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].rsplit(":", 1)[1], 16)
        remote_port = int(fields[2].rsplit(":", 1)[1], 16)
        if (local_port, remote_port) == (server_port, client_port):
            states.add(fields[3])
    return states


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_a_client_vanishing_mid_stream_is_reaped(replica: Replica) -> None:
    """The server closes its side (no CLOSE_WAIT left behind) and cancels the upstream."""
    replica.backend.control(inter_token_ms=200, tokens=50)  # a 10 s stream
    answer = ANSWERS["proxied SSE"]
    client = RawClient(replica.ports.http)
    client.request(answer)
    client.sock.settimeout(10)
    assert client.sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    client.close()
    established_or_close_wait = {"01", "08"}

    def reaped() -> bool:
        states = _server_socket_states(replica.ports.http, client.local_port)
        return not states & established_or_close_wait

    wait_until(reaped, 5, "the server to close its side of the connection")

    def upstream_cancelled() -> bool:
        state = httpx.get(f"{replica.backend.url}/test-control", timeout=5).json()
        return bool(state["in_flight"] == 0)

    wait_until(upstream_cancelled, 5, "the upstream request to be cancelled")


# --- nginx in front ------------------------------------------------------------------------------


@pytest.fixture
def nginx(replica: Replica, tmp_path: Path) -> Iterator[int]:
    """nginx in front of the replica's HTTP port, as a child process; yields its port."""
    with nginx_in_front(tmp_path, replica.ports.http) as port:
        yield port


def test_an_sse_stream_through_nginx_ends_right_after_done(replica: Replica, nginx: int) -> None:
    """Without the fix nginx waited for its 60 s upstream read timeout after `data: [DONE]`."""
    replica.backend.control(inter_token_ms=50, tokens=5)
    done_at: float | None = None
    events = 0
    with httpx.stream(
        "POST",
        f"http://127.0.0.1:{nginx}/v1/chat/completions",
        headers=PROXY_HEADERS,
        content=_chat(True),
        timeout=10,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events += 1
            if line == "data: [DONE]":
                done_at = time.monotonic()
    ended_at = time.monotonic()
    assert done_at is not None and events >= 5
    assert ended_at - done_at < 1.0
