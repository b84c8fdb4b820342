"""HTTP/2 streams end however they end, and no client can end a listener (docs/http-serving.md).

Against a real replica (`python -m stargate serve` on loopback): a grpcio channel with 50 calls in
flight and h2c connections whose streams are reset early. Each run goes well past the 1000 streams
a connection's send scheduler holds (Hypercorn's priority tree, now stargate/h2_send_order.py),
which is where a leaked stream used to take the listener, and the replica, down. In process
(Hypercorn's trio worker via `serve_asgi`): the full scheduler, GOAWAY rotation, a failing
connection task and an app that fails mid-body.
"""

from __future__ import annotations

import functools
import logging
import select
import socket
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx
import pytest
import trio
from google.protobuf.message import Message
from h2.connection import ConnectionInputs, ConnectionState
from hypercorn.config import Config as HypercornConfig
from hypercorn.protocol.http_stream import HTTPStream

from stargate.asgi import ASGIReceive, ASGIScope, ASGISend, answer_lifespan
from stargate.config import ListenAddress
from stargate.grpc_asgi import GrpcApp, RpcContext, unary_unary
from stargate.h2_send_order import RoundRobin
from stargate.hypercorn_patches import h2 as h2_patches
from stargate.protocol import stargate_pb2 as pb
from stargate.protocol import stargate_pb2_grpc as pb_grpc
from stargate.serving import bind_listener, hypercorn_config, serve_asgi
from tests.e2e.processes import Ports, StargateProcess, wait_until

REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM
LIST_MODELS = "/stargate.StargateModelDiscovery/ListModels"
CHAT_BODY = b'{"model": "nobody-serves-this", "messages": []}'
PROXY_HEADERS = [
    ("content-type", "application/json"),
    ("x-request-id", "h2-streams"),
    ("x-input-tokens", "1"),
    ("x-model", "nobody-serves-this"),
]


# --- a blocking h2c client on a raw socket -------------------------------------------------------


class H2Conn:
    """HTTP/2 with prior knowledge over one socket, driven by hand: requests, resets and pings.

    `sync()` sends a PING and reads until its ACK; the server has then processed every frame
    sent before it (one connection's frames are handled in order).
    """

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.h2.initiate_connection()
        # h2 takes any GOAWAY it receives as the end of the connection and rejects every later
        # frame; RFC 9113 §6.8 lets the streams up to its last stream ID finish, so keep reading.
        machine = self.h2.state_machine
        machine._transitions = {  # type: ignore[misc]
            **machine._transitions,
            (ConnectionState.CLIENT_OPEN, ConnectionInputs.RECV_GOAWAY): (
                None,
                ConnectionState.CLIENT_OPEN,
            ),
        }
        self.statuses: dict[int, int] = {}
        self.bodies: dict[int, bytearray] = defaultdict(bytearray)
        self.ended: set[int] = set()
        self.resets: dict[int, int] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.closed = False
        self._pings = 0
        self._acked = 0
        self.flush()

    def close(self) -> None:
        self.sock.close()

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def start(
        self,
        path: str,
        *,
        method: str = "GET",
        headers: Sequence[tuple[str, str]] = (),
        body: bytes | None = None,
        end: bool = True,
    ) -> int:
        """Queue a request's HEADERS (and DATA); `end=False` leaves the request body open."""
        stream_id = self.h2.get_next_available_stream_id()
        request_headers = [
            (":method", method),
            (":scheme", "http"),
            (":path", path),
            (":authority", "stargate.test"),
            *headers,
        ]
        self.h2.send_headers(stream_id, request_headers, end_stream=end and body is None)
        if body is not None:
            self.h2.send_data(stream_id, body, end_stream=end)
        return stream_id

    def reset(self, stream_id: int) -> None:
        self.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)

    def sync(self, timeout: float = 10.0) -> None:
        self._pings += 1
        self.h2.ping(b"%08d" % self._pings)
        self.flush()
        self.read_until(lambda: self._acked == self._pings, timeout)

    def settle(self) -> None:
        """Two round trips: the server has handled everything sent so far, and also run the
        tasks that handling woke (trio runs them in random order with the next read)."""
        self.sync()
        self.sync()

    def finished(self, stream_id: int) -> bool:
        return stream_id in self.ended or stream_id in self.resets

    def read_until(self, done: Callable[[], bool], timeout: float = 10.0) -> None:
        """Read and handle frames until `done()`; fail if the server closes or `timeout` passes."""
        while not done():
            assert not self.closed, "the server closed the connection"
            ready, _, _ = select.select([self.sock], [], [], timeout)
            assert ready, f"nothing from the server for {timeout} s"
            self._receive()

    def read_to_eof(self, timeout: float = 10.0) -> None:
        while not self.closed:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            assert ready, f"the server kept the connection open for {timeout} s"
            self._receive()

    def _receive(self) -> None:
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        if not data:
            self.closed = True
            return
        for event in self.h2.receive_data(data):
            self._handle(event)
        self.flush()

    def _handle(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            assert event.stream_id is not None
            self.statuses[event.stream_id] = int(dict(event.headers)[":status"])
        elif isinstance(event, h2.events.DataReceived):
            assert event.stream_id is not None
            self.bodies[event.stream_id] += event.data
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            assert event.stream_id is not None
            self.ended.add(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            assert event.stream_id is not None
            self.resets[event.stream_id] = event.error_code
        elif isinstance(event, h2.events.PingAckReceived):
            self._acked += 1
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event


# --- against a real replica ----------------------------------------------------------------------


class _Exited(Exception):
    pass


def start_replica(launch_one: Callable[[Ports], StargateProcess]) -> tuple[Ports, StargateProcess]:
    """Start a replica on fresh loopback ports and wait until it answers `/healthz`.

    A port another process takes between `Ports.pick()` and the replica's bind (the machine is
    shared with other test runs) fails the start; that is retried with fresh ports.
    """
    for attempt in range(3):
        ports = Ports.pick()
        process = launch_one(ports)

        def up(process: StargateProcess = process, port: int = ports.http) -> bool:
            if process.process.poll() is not None:
                raise _Exited
            return httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200

        try:
            wait_until(up, 30, "the replica")
        except _Exited:
            if "failed to bind" in process.log and attempt < 2:
                continue
            raise AssertionError(f"the replica exited:\n{process.log[-3000:]}") from None
        return ports, process
    raise AssertionError("unreachable")


def _start_replica(start_stargate: Callable[..., StargateProcess]) -> tuple[Ports, StargateProcess]:
    return start_replica(
        lambda ports: start_stargate(
            "serve", *ports.args(), "--readiness-warmup-ms=0", "--disable-dns-discovery"
        )
    )


def _assert_still_serving(ports: Ports, process: StargateProcess) -> None:
    assert process.process.poll() is None, process.log[-3000:]
    response = httpx.get(f"http://127.0.0.1:{ports.http}/healthz", timeout=5)
    assert response.status_code == 200
    assert "Traceback" not in process.log, process.log[-3000:]


def test_1100_list_models_calls_50_in_flight_on_one_channel(
    start_stargate: Callable[..., StargateProcess],
) -> None:
    """grpcio ends each call with trailers; those streams used to wait in the priority tree for
    a turn the scheduler never gave them while newer calls kept arriving."""
    ports, process = _start_replica(start_stargate)
    total, in_flight = 1100, 50
    slots = threading.Semaphore(in_flight)
    lock = threading.Lock()
    errors: list[grpc.StatusCode] = []
    answered = 0
    all_done = threading.Event()

    def done(future: grpc.Future) -> None:
        nonlocal answered
        try:
            future.result()
        except grpc.RpcError as error:
            with lock:
                errors.append(error.code())
        with lock:
            answered += 1
            if answered == total:
                all_done.set()
        slots.release()

    with grpc.insecure_channel(f"127.0.0.1:{ports.discovery}") as channel:
        stub = pb_grpc.StargateModelDiscoveryStub(channel)
        for _ in range(total):
            assert slots.acquire(timeout=20), "a call got no answer"
            stub.ListModels.future(pb.ListModelsRequest(), timeout=20).add_done_callback(done)
        assert all_done.wait(30)
    assert errors == []
    _assert_still_serving(ports, process)


def test_1100_streams_reset_after_headers_and_data_on_one_connection(
    start_stargate: Callable[..., StargateProcess],
) -> None:
    """HEADERS + DATA + RST_STREAM before any response: each such stream used to stay in the
    priority tree, blocked, for the life of the connection."""
    ports, process = _start_replica(start_stargate)
    client = H2Conn(ports.http)
    try:
        for _ in range(1100):
            stream_id = client.start(
                "/v1/chat/completions",
                method="POST",
                headers=PROXY_HEADERS,
                body=CHAT_BODY,
                end=False,
            )
            client.reset(stream_id)
            client.settle()  # the server is done with this stream before the next one starts
        check = client.start("/healthz")
        client.flush()
        client.read_until(lambda: client.finished(check))
        assert client.statuses[check] == 200
    finally:
        client.close()
    _assert_still_serving(ports, process)


def test_2000_requests_with_mixed_early_resets_on_one_connection(
    start_stargate: Callable[..., StargateProcess],
) -> None:
    """Complete exchanges (proxied and Quart-served) interleaved with streams reset at every
    early point: after HEADERS, after part of the body, and racing the answer."""
    ports, process = _start_replica(start_stargate)
    client = H2Conn(ports.http)
    completed: list[int] = []
    try:
        for index in range(2000):
            kind = index % 5
            if kind == 0:  # complete: alternately the proxy's own 404 and Quart's /healthz
                if index % 10 == 0:
                    stream_id = client.start(
                        "/v1/chat/completions",
                        method="POST",
                        headers=PROXY_HEADERS,
                        body=CHAT_BODY,
                    )
                else:
                    stream_id = client.start("/healthz")
                client.flush()
                client.read_until(functools.partial(client.finished, stream_id))
                completed.append(stream_id)
                continue
            if kind == 1:  # reset after HEADERS, the body never sent
                stream_id = client.start(
                    "/v1/chat/completions", method="POST", headers=PROXY_HEADERS, end=False
                )
            elif kind in (2, 3):  # reset after part of the body, or all of it but its end
                stream_id = client.start(
                    "/v1/chat/completions",
                    method="POST",
                    headers=PROXY_HEADERS,
                    body=CHAT_BODY[:10] if kind == 2 else CHAT_BODY,
                    end=False,
                )
            else:  # a complete request, reset at once: the reset races the answer
                stream_id = client.start("/healthz")
            client.reset(stream_id)
            client.settle()
        for stream_id in completed:
            assert stream_id in client.ended, stream_id
            assert client.statuses[stream_id] in (200, 404), stream_id
        assert not set(completed) & set(client.resets)
    finally:
        client.close()
    _assert_still_serving(ports, process)


# --- in process ----------------------------------------------------------------------------------


class HoldingApp:
    """`/hold` answers once some connection has requested `/release`; `/fail` fails mid-body;
    anything else answers at once."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.clients: set[tuple[str, int]] = set()

    async def __call__(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        self.clients.add(scope["client"])
        path = scope["path"]
        if path == "/release":
            self.release.set()
        elif path == "/hold":
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if path == "/fail":
            await send({"type": "http.response.body", "body": b"partial", "more_body": True})
            raise RuntimeError("the app failed mid-body")
        await send({"type": "http.response.body", "body": path.encode()})


@asynccontextmanager
async def serving(app: Any, config: HypercornConfig | None = None) -> AsyncIterator[int]:
    """Serve `app` on 127.0.0.1 with Hypercorn's trio worker; yield the port."""
    sock = bind_listener("HTTP", ListenAddress("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_asgi, app, sock, config or hypercorn_config(2.0), stop.wait)
        try:
            yield port
        finally:
            stop.set()


async def in_thread(function: Callable[[], Any]) -> Any:
    with trio.fail_after(60):
        return await trio.to_thread.run_sync(function)


@pytest.fixture
def small_priority_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each connection's send scheduler (stargate/h2_send_order.py, which replaces Hypercorn's
    priority tree) holds stream 0 and two more (instead of 999)."""
    monkeypatch.setattr(h2_patches, "RoundRobin", functools.partial(RoundRobin, maximum_streams=3))


@pytest.mark.usefixtures("small_priority_tree")
async def test_a_full_priority_tree_refuses_the_stream() -> None:
    app = HoldingApp()

    def client(port: int) -> None:
        conn = H2Conn(port)
        try:
            held = [conn.start("/hold"), conn.start("/hold")]
            refused = conn.start("/hold")
            conn.sync()
            conn.read_until(lambda: conn.finished(refused))
            assert conn.resets == {refused: REFUSED}
            other = H2Conn(port)  # its own tree
            try:
                release = other.start("/release")
                other.flush()
                other.read_until(lambda: other.finished(release))
            finally:
                other.close()
            conn.read_until(lambda: all(conn.finished(stream) for stream in held))
            assert [conn.statuses[stream] for stream in held] == [200, 200]
            assert conn.ended >= set(held)
            again = conn.start("/again")  # the tree has room again on the same connection
            conn.flush()
            conn.read_until(lambda: conn.finished(again))
            assert (conn.statuses[again], bytes(conn.bodies[again])) == (200, b"/again")
        finally:
            conn.close()

    async with serving(app) as port:
        await in_thread(lambda: client(port))


async def test_rotation_sends_goaway_and_finishes_the_streams_in_flight() -> None:
    app = HoldingApp()
    config = hypercorn_config(2.0, rotate_connections=True)
    config.keep_alive_max_requests = 3

    def client(port: int) -> None:
        conn = H2Conn(port)
        try:
            served = [conn.start("/hold"), conn.start("/hold"), conn.start("/hold")]
            late = conn.start("/hold")  # sent before this client could see the GOAWAY
            conn.sync()
            conn.read_until(lambda: conn.goaway is not None and conn.finished(late))
            assert conn.goaway is not None
            assert conn.goaway.last_stream_id == served[-1]
            assert conn.goaway.error_code == h2.errors.ErrorCodes.NO_ERROR
            assert conn.resets == {late: REFUSED}
            assert not any(conn.finished(stream) for stream in served)
            other = H2Conn(port)
            try:
                release = other.start("/release")
                other.flush()
                other.read_until(lambda: other.finished(release))
            finally:
                other.close()
            conn.read_to_eof()  # the streams in flight finish, then the server closes
            for stream in served:
                assert stream in conn.ended
                assert (conn.statuses[stream], bytes(conn.bodies[stream])) == (200, b"/hold")
        finally:
            conn.close()

    async with serving(app, config) as port:
        await in_thread(lambda: client(port))


async def test_grpcio_reconnects_transparently_after_goaway() -> None:
    clients: set[tuple[str, int]] = set()

    async def list_models(request: pb.ListModelsRequest, context: RpcContext) -> Message:
        return pb.ListModelsResponse(model_ids=["model-a"])

    discovery = GrpcApp([unary_unary(LIST_MODELS, pb.ListModelsRequest, list_models)])

    async def app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "http":
            clients.add(scope["client"])
        await discovery(scope, receive, send)

    config = hypercorn_config(2.0, rotate_connections=True)
    config.keep_alive_max_requests = 5

    def calls(port: int) -> list[grpc.StatusCode]:
        errors: list[grpc.StatusCode] = []
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.StargateModelDiscoveryStub(channel)
            for _ in range(12):
                futures = [
                    stub.ListModels.future(pb.ListModelsRequest(), timeout=10) for _ in range(5)
                ]
                for future in futures:
                    try:
                        future.result()
                    except grpc.RpcError as error:
                        errors.append(error.code())
        return errors

    async with serving(app, config) as port:
        assert await in_thread(lambda: calls(port)) == []
    assert len(clients) >= 5  # 60 calls at most 5 to a connection: about 12 connections


async def test_an_app_failing_mid_body_resets_its_stream() -> None:
    """Without the reset the client would wait for the rest of the body forever."""

    def client(port: int) -> None:
        conn = H2Conn(port)
        try:
            failed = conn.start("/fail")
            conn.flush()
            conn.read_until(lambda: conn.finished(failed))
            assert conn.statuses[failed] == 200
            assert conn.resets == {failed: h2.errors.ErrorCodes.INTERNAL_ERROR}
            fine = conn.start("/fine")
            conn.flush()
            conn.read_until(lambda: conn.finished(fine))
            assert (conn.statuses[fine], bytes(conn.bodies[fine])) == (200, b"/fine")
        finally:
            conn.close()

    async with serving(HoldingApp()) as port:
        await in_thread(lambda: client(port))


@pytest.fixture
def failing_connection_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request for `/boom` raises inside Hypercorn's connection task (not in the app)."""
    original = HTTPStream.handle

    async def handle(self: HTTPStream, event: Any) -> None:
        if getattr(event, "raw_path", b"") == b"/boom":
            raise RuntimeError("a bug in the connection task")
        await original(self, event)

    monkeypatch.setattr(HTTPStream, "handle", handle)


def _http11_get(port: int, path: str) -> bytes:
    """Send one HTTP/1.1 GET and read until the server closes (or 10 s pass)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


@pytest.mark.usefixtures("failing_connection_task")
async def test_a_failing_connection_task_closes_only_its_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        async with serving(HoldingApp()) as port:
            assert await in_thread(lambda: _http11_get(port, "/boom")) == b""
            answer = await in_thread(lambda: _http11_get(port, "/still-serving"))
            assert answer.startswith(b"HTTP/1.1 200 ")
            assert b"\r\n/still-serving\r\n" in answer
    failures = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(failures) == 1, [record.getMessage() for record in failures]
    assert failures[0].name == "stargate.hypercorn_fixes"
    assert failures[0].levelno == logging.ERROR
    assert failures[0].exc_info is not None
    assert "a bug in the connection task" in caplog.text
