"""The lean HTTP/2 server of the gRPC listeners (stargate/h2_server.py), driven by a hand-made
`h2` client over real sockets: each rule of the module's docstring."""

from __future__ import annotations

import functools
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
import trio
import trustme
from hyperframe.frame import DataFrame, Frame, GoAwayFrame

from stargate.h2_server import DELIVER_EXTENSION, H2Config, serve_h2

ASGIMessage = dict[str, Any]
App = Callable[
    [Any, Callable[[], Awaitable[ASGIMessage]], Callable[..., Awaitable[None]]], Awaitable[None]
]

REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/svc/Method"),
    (b":authority", b"localhost"),
    (b"content-type", b"application/grpc"),
]


class Client:
    """One HTTP/2 client connection, its events collected by `until`."""

    def __init__(self, stream: trio.abc.Stream, initial_window: int | None = None) -> None:
        self.stream = stream
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.h2.initiate_connection()
        if initial_window is not None:
            self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: initial_window})
        self.events: list[h2.events.Event] = []
        self.closed = False
        self._buffer = b""

    async def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            await self.stream.send_all(data)

    async def request(self, stream_id: int, body: bytes = b"", *, end: bool = True) -> None:
        self.h2.send_headers(stream_id, REQUEST, end_stream=not body and end)
        if body:
            await self.data(stream_id, body, end=end)
        await self.flush()

    async def data(self, stream_id: int, body: bytes, *, end: bool = False) -> None:
        """`body` in frames of the largest size the server takes."""
        size = self.h2.max_outbound_frame_size
        for start in range(0, len(body), size):
            last = start + size >= len(body)
            self.h2.send_data(stream_id, body[start : start + size], end_stream=end and last)
        await self.flush()

    async def until(
        self, done: Callable[[list[h2.events.Event]], bool], seconds: float = 5
    ) -> None:
        with trio.fail_after(seconds):
            while not done(self.events):
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:  # reset: closed with our frames unread
                    data = b""
                if not data:
                    self.closed = True
                    return
                self._buffer += data
                while len(self._buffer) >= 9:
                    size = 9 + int.from_bytes(self._buffer[:3], "big")
                    if len(self._buffer) < size:
                        break
                    frame, self._buffer = self._buffer[:size], self._buffer[size:]
                    self.events.extend(self._receive_frame(frame))
                await self.flush()

    def _receive_frame(self, frame: bytes) -> list[h2.events.Event]:
        """h2 closes a client connection on GOAWAY, where a real client reads its streams to their
        end: a GOAWAY is recorded here and kept from h2."""
        if frame[3] != GoAwayFrame.type:
            return self.h2.receive_data(frame)
        goaway, _ = Frame.parse_frame_header(memoryview(frame[:9]))
        goaway.parse_body(memoryview(frame[9:]))
        assert isinstance(goaway, GoAwayFrame)
        event = h2.events.ConnectionTerminated()
        event.error_code = h2.errors.ErrorCodes(goaway.error_code)
        event.last_stream_id = goaway.last_stream_id
        return [event]

    def of(self, kind: type[Any], stream_id: int | None = None) -> list[Any]:
        return [
            e
            for e in self.events
            if isinstance(e, kind)
            and (stream_id is None or getattr(e, "stream_id", None) == stream_id)
        ]

    def body(self, stream_id: int) -> bytes:
        return b"".join(e.data for e in self.of(h2.events.DataReceived, stream_id))


@asynccontextmanager
async def served(
    app: App, config: H2Config | None = None
) -> AsyncIterator[tuple[int, H2Config, trio.Event]]:
    config = config or H2Config(graceful_timeout=2.0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_h2, app, sock, config, stop.wait)
        yield port, config, stop
        stop.set()


@asynccontextmanager
async def client(port: int, initial_window: int | None = None) -> AsyncIterator[Client]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    c = Client(stream, initial_window)
    await c.flush()
    try:
        yield c
    finally:
        await stream.aclose()


async def echo(scope: Any, receive: Any, send: Any) -> None:
    """Answers 200, the request body back, then trailers."""
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [], "trailers": True})
    await send({"type": "http.response.body", "body": body, "more_body": False})
    await send({"type": "http.response.trailers", "headers": [(b"grpc-status", b"0")]})


def ended(stream_id: int) -> Callable[[list[h2.events.Event]], bool]:
    return lambda events: any(
        isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset)) and e.stream_id == stream_id
        for e in events
    )


async def test_a_call_gets_its_head_body_and_trailers() -> None:
    scopes: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scopes.append(scope)
        await echo(scope, receive, send)

    async with served(app) as (port, _, _), client(port) as c:
        await c.request(1, b"hello")
        await c.until(ended(1))
    assert c.body(1) == b"hello"
    (head, trailers) = c.of(h2.events.ResponseReceived, 1) + c.of(h2.events.TrailersReceived, 1)
    assert (b":status", b"200") in head.headers
    assert trailers.headers == [(b"grpc-status", b"0")]
    scope = scopes[0]
    assert (scope["method"], scope["path"], scope["http_version"]) == ("POST", "/svc/Method", "2")
    assert "http.response.trailers" in scope["extensions"]
    assert (b"content-type", b"application/grpc") in scope["headers"]
    assert scope["client"][0] == "127.0.0.1"


async def test_http_1_gets_a_plain_505_and_the_connection_closes() -> None:
    async with served(echo) as (port, _, _):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"POST /svc/Method HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        answer = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some(4096):
                answer += chunk
        await stream.aclose()
    assert answer.startswith(b"HTTP/1.1 505 ")
    assert answer.endswith(b"\r\n\r\ngRPC requires HTTP/2\n")


async def test_a_response_waits_for_the_clients_window() -> None:
    """Outbound flow control: with a 1,000-byte stream window only 1,000 bytes leave until the
    client opens the window."""
    size = 5000

    async def big(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x" * size, "more_body": False})

    async with served(big) as (port, _, _), client(port, initial_window=1000) as c:
        await c.until(lambda events: c.of(h2.events.SettingsAcknowledged) != [])
        await c.request(1)
        await c.until(lambda events: len(c.body(1)) >= 1000)
        with trio.move_on_after(0.3):
            await c.until(lambda events: len(c.body(1)) > 1000)
        assert len(c.body(1)) == 1000
        c.h2.increment_flow_control_window(size, stream_id=1)
        await c.flush()
        await c.until(ended(1))
    assert len(c.body(1)) == size


async def test_a_stream_whose_app_does_not_read_holds_back_only_itself() -> None:
    """Inbound flow control: DATA is acknowledged as the app receives it; the connection's window
    is wide, so another stream on the connection is served meanwhile."""
    release = trio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/slow":
            await release.wait()
        await echo(scope, receive, send)

    async with served(app) as (port, _, _), client(port) as c:
        await c.until(lambda events: c.of(h2.events.WindowUpdated, 0) != [])  # the wide window
        c.h2.send_headers(1, [(k, b"/slow" if k == b":path" else v) for k, v in REQUEST])
        sent = 0
        while c.h2.local_flow_control_window(1) > 0:
            chunk = min(c.h2.local_flow_control_window(1), c.h2.max_outbound_frame_size)
            c.h2.send_data(1, b"y" * chunk)
            sent += chunk
        await c.flush()
        assert sent == 65535  # the stream's window, not more
        await c.request(3, b"other")
        await c.until(ended(3))
        assert c.body(3) == b"other"
        assert c.of(h2.events.WindowUpdated, 1) == []  # nothing read yet, nothing acknowledged
        release.set()
        await c.until(lambda events: c.of(h2.events.WindowUpdated, 1) != [])


async def test_a_reset_stream_is_a_disconnect_for_its_app() -> None:
    heard: list[str] = []
    disconnected = trio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                heard.append("disconnect")
                disconnected.set()
                return

    async with served(app) as (port, _, _), client(port) as c:
        await c.request(1, b"part", end=False)
        await trio.sleep(0.05)
        c.h2.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
        await c.flush()
        with trio.fail_after(5):
            await disconnected.wait()
    assert heard == ["disconnect"]


async def test_an_app_that_raises_resets_its_stream_and_the_connection_serves_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/fail":
            raise RuntimeError("boom")
        await echo(scope, receive, send)

    async with served(app) as (port, _, _), client(port) as c:
        c.h2.send_headers(
            1, [(k, b"/fail" if k == b":path" else v) for k, v in REQUEST], end_stream=True
        )
        await c.flush()
        await c.until(ended(1))
        await c.request(3, b"after")
        await c.until(ended(3))
    (reset,) = c.of(h2.events.StreamReset, 1)
    assert reset.error_code == h2.errors.ErrorCodes.INTERNAL_ERROR
    assert c.body(3) == b"after"
    assert "boom" in caplog.text


async def test_data_after_the_trailers_is_dropped_and_the_connection_lives() -> None:
    """The server ended the call while the client was still sending (a gRPC error mid-stream):
    the late DATA crashes nothing (Hypercorn 0.18 went down on it, pgjones/hypercorn#329)."""

    async def early(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [], "trailers": True})
        await send({"type": "http.response.trailers", "headers": [(b"grpc-status", b"3")]})

    async with served(early) as (port, _, _), client(port) as c:
        await c.request(1, b"first", end=False)
        await c.until(ended(1))
        # Written raw: the client's h2 knows the stream is over (our RST_STREAM(NO_ERROR) asked
        # it to stop sending) and would refuse; a client that had not read it yet sends this.
        late = DataFrame(1, data=b"late" * 1000, flags=["END_STREAM"])
        await c.stream.send_all(late.serialize())
        await c.request(3)
        await c.until(ended(3))
    assert c.of(h2.events.TrailersReceived, 3)[0].headers == [(b"grpc-status", b"3")]
    assert c.of(h2.events.StreamReset, 1)[0].error_code == h2.errors.ErrorCodes.NO_ERROR


async def test_leaving_finishes_the_streams_in_flight_and_refuses_later_ones() -> None:
    release = trio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await release.wait()
        await echo(scope, receive, send)

    async with served(app) as (port, config, _), client(port) as c:
        await c.request(1, b"in flight")
        await trio.sleep(0.05)
        config.leave()
        await c.until(lambda events: c.of(h2.events.ConnectionTerminated) != [])
        (goaway,) = c.of(h2.events.ConnectionTerminated)
        assert (goaway.error_code, goaway.last_stream_id) == (h2.errors.ErrorCodes.NO_ERROR, 1)
        release.set()
        await c.until(ended(1))
        assert c.body(1) == b"in flight"
        await c.until(lambda events: False)  # then the server closes the connection
        assert c.closed


async def test_a_connection_opened_while_leaving_is_served_once() -> None:
    async with served(echo) as (port, config, _):
        config.leave()
        async with client(port) as c:
            await c.request(1, b"once")
            await c.until(ended(1))
            await c.until(lambda events: c.of(h2.events.ConnectionTerminated) != [])
    assert c.body(1) == b"once"
    assert c.of(h2.events.ConnectionTerminated)[0].last_stream_id == 1


async def test_rotation_names_the_last_request_of_a_connection() -> None:
    config = H2Config(max_requests_per_connection=2)
    async with served(echo, config) as (port, _, _), client(port) as c:
        await c.request(1, b"a")
        await c.until(ended(1))
        assert c.of(h2.events.ConnectionTerminated) == []
        await c.request(3, b"b")
        await c.until(ended(3))
        await c.until(lambda events: c.of(h2.events.ConnectionTerminated) != [])
    assert c.of(h2.events.ConnectionTerminated)[0].last_stream_id == 3
    assert c.body(3) == b"b"


async def test_stopping_closes_idle_connections_and_gives_busy_ones_the_graceful_time() -> None:
    release = trio.Event()
    ended_at: list[float] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        try:
            await release.wait()
            await echo(scope, receive, send)
        finally:
            ended_at.append(trio.current_time())

    config = H2Config(graceful_timeout=0.5)
    async with served(app, config) as (port, _, stop), client(port) as idle, client(port) as busy:
        await busy.request(1, b"busy")
        await idle.until(lambda events: idle.of(h2.events.RemoteSettingsChanged) != [])
        await trio.sleep(0.05)
        stopped_at = trio.current_time()
        stop.set()
        await idle.until(lambda events: False)
        assert idle.closed
        await busy.until(lambda events: busy.of(h2.events.ConnectionTerminated) != [])
        await busy.until(lambda events: False, seconds=5)
        assert busy.closed  # cut at the graceful deadline: the app never finished
    assert len(ended_at) == 1 and ended_at[0] - stopped_at < 2.0


async def test_an_app_that_takes_delivery_gets_every_event_in_order_from_the_connection() -> None:
    """DELIVER_EXTENSION: the events already queued first, then each as it arrives, called from
    the connection's task (not the app's); DATA is acknowledged once the callback has it."""
    taken: list[tuple[str, bytes, bool]] = []
    tasks: list[object] = []  # the task that called the callback, per event
    app_task: list[object] = []
    done = trio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await trio.sleep(0.1)  # the first DATA is queued by now
        assert not c.of(h2.events.WindowUpdated, 1)  # and not acknowledged

        app_task.append(trio.lowlevel.current_task())

        def callback(message: ASGIMessage) -> bool:
            tasks.append(trio.lowlevel.current_task())
            taken.append(
                (message["type"], message.get("body", b""), message.get("more_body", False))
            )
            if message["type"] == "http.disconnect":
                done.set()
                return True
            return False

        scope["extensions"][DELIVER_EXTENSION]["deliver"](callback)
        await done.wait()

    async with served(app) as (port, _, _), client(port) as c:
        await c.until(lambda events: c.of(h2.events.WindowUpdated, 0) != [])
        await c.request(1, b"a" * 40000, end=False)
        # Queued, then acknowledged when the app takes delivery (h2 acknowledges half a window
        # at a time, so each 40,000 bytes is one WINDOW_UPDATE).
        await c.until(lambda events: len(c.of(h2.events.WindowUpdated, 1)) == 1)
        await c.data(1, b"b" * 40000)
        await c.until(lambda events: len(c.of(h2.events.WindowUpdated, 1)) == 2)
        c.h2.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
        await c.flush()
        with trio.fail_after(5):
            await done.wait()
    bodies = b"".join(body for kind, body, _ in taken if kind == "http.request")
    assert bodies == b"a" * 40000 + b"b" * 40000
    assert taken[-1] == ("http.disconnect", b"", False)
    # The queued events are handed over in the app's own call; later ones by the connection.
    later = tasks[len(tasks) - len([t for t in taken if t[1].startswith(b"b")]) - 1 :]
    assert tasks[0] is app_task[0]
    assert app_task[0] not in later


async def test_an_idle_connection_gets_goaway_and_is_closed_at_the_idle_timeout() -> None:
    """From its accept, and again from its last stream's end; a stream in flight is no idle."""
    release = trio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/slow":
            await release.wait()
        await echo(scope, receive, send)

    # 1 s: long enough that a loaded CI machine handles the busy client's HEADERS first.
    config = H2Config(idle_timeout=1.0)
    async with served(app, config) as (port, _, _):
        async with client(port) as quiet:
            opened = trio.current_time()
            await quiet.until(lambda events: False)
            assert quiet.closed and 0.9 < trio.current_time() - opened < 5.0
            (goaway,) = quiet.of(h2.events.ConnectionTerminated)
            assert (goaway.error_code, goaway.last_stream_id) == (h2.errors.ErrorCodes.NO_ERROR, 0)
        async with client(port) as busy:
            busy.h2.send_headers(1, [(k, b"/slow" if k == b":path" else v) for k, v in REQUEST])
            await busy.flush()
            await trio.sleep(2.0)  # twice the idle timeout, with a stream in flight
            assert busy.of(h2.events.ConnectionTerminated) == []
            release.set()
            await busy.data(1, b"done", end=True)
            await busy.until(ended(1))
            ended_at = trio.current_time()
            await busy.until(lambda events: False)
            assert busy.closed and 0.9 < trio.current_time() - ended_at < 5.0
            assert busy.of(h2.events.ConnectionTerminated)[0].last_stream_id == 1


async def test_a_failure_in_one_connection_closes_it_and_the_listener_serves_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug on the connection's own path (here: h2 raising something unexpected) is contained."""
    from stargate import h2_server

    original = h2_server._Connection._handle
    calls = {"n": 0}

    def failing_once(self: Any, event: h2.events.Event) -> bool:
        if isinstance(event, h2.events.RequestReceived) and calls["n"] == 0:
            calls["n"] += 1
            raise RuntimeError("unexpected")
        return original(self, event)

    monkeypatch.setattr(h2_server._Connection, "_handle", failing_once)
    async with served(echo) as (port, _, _):
        async with client(port) as broken:
            await broken.request(1, b"x")
            await broken.until(lambda events: False)
            assert broken.closed
        async with client(port) as c:
            await c.request(1, b"still served")
            await c.until(ended(1))
    assert c.body(1) == b"still served"
    assert (
        "HTTP/2 connection from ('127.0.0.1', " in caplog.text and "failed; closed" in caplog.text
    )


@asynccontextmanager
async def served_tls(
    app: App, config: H2Config
) -> AsyncIterator[tuple[int, Callable[[list[str]], ssl.SSLContext]]]:
    """`app` served over TLS (ALPN h2, then http/1.1, as the replica's context offers); yields
    the port and a maker of client contexts offering the given ALPN protocols."""
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    server_context.set_alpn_protocols(["h2", "http/1.1"])

    def client_context(protocols: list[str]) -> ssl.SSLContext:
        context = ssl.create_default_context()
        ca.configure_trust(context)
        context.set_alpn_protocols(protocols)
        return context

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        serve = functools.partial(serve_h2, ssl_context=server_context)
        await nursery.start(serve, app, sock, config, stop.wait)
        yield sock.getsockname()[1], client_context
        stop.set()


async def test_over_tls_alpn_h2_is_served_and_http_1_gets_the_505() -> None:
    async with served_tls(echo, H2Config()) as (port, context):
        stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=context(["h2"]))
        c = Client(stream)
        await c.flush()
        await c.request(1, b"secret")
        await c.until(ended(1))
        assert c.body(1) == b"secret"
        await stream.aclose()

        # An HTTPS client: the server sends no close_notify (https_compatible, as Hypercorn's).
        stream = await trio.open_ssl_over_tcp_stream(
            "127.0.0.1", port, ssl_context=context(["http/1.1"]), https_compatible=True
        )
        await stream.send_all(b"POST /svc/Method HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        answer = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 505 ")


async def test_a_tls_client_that_never_finishes_its_handshake_is_closed() -> None:
    async with served_tls(echo, H2Config(tls_handshake_timeout=0.3)) as (port, _):
        stream = await trio.open_tcp_stream("127.0.0.1", port)  # no ClientHello
        with trio.fail_after(5):
            assert await stream.receive_some(4096) == b""
        await stream.aclose()
