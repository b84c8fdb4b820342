"""A lean HTTP/2 server for the gRPC listeners: one `h2` connection per socket, driven from trio.

Why (docs/decisions.md, D20): at 1,000 Pylons whose statistics change every heartbeat, Hypercorn's
HTTP/2 protocol around `h2` (its event queues, a send task per connection, a task and a queue per
stream, two writes per heartbeat) was the largest share of the replica's CPU that was not our own
work. A gRPC listener needs far less than a general HTTP server: HTTP/2 only, one ASGI app that
always reads its requests (stargate/grpc_asgi.py), no request bodies to buffer, no HTTP/1.1.

What it serves, and how (each rule is tested in tests/unit/test_h2_server.py):

* **HTTP/2 only**: cleartext with prior knowledge, or TLS whose ALPN picked `h2`. A connection
  that opens with anything else gets one plain `HTTP/1.1 505` answer and is closed: gRPC cannot be
  spoken over HTTP/1.x (on Hypercorn the app answered it: 505 to a POST, 405 to a GET).
* **One task per request stream**, in the connection's nursery, running the ASGI app with an HTTP
  scope that offers the `http.response.trailers` extension. The connection's own task reads the
  socket and hands each stream its events; the app's `send` writes through the same `h2` state.
  An app that takes `DELIVER_EXTENSION` gets its request events by callback from the
  connection's task instead of waking for each in `receive()`.
* **Inbound flow control**: a stream's DATA is acknowledged (WINDOW_UPDATE, as `h2` batches them)
  when the app receives it, so a stream whose app stops reading holds back its own client only;
  the connection's window is opened wide at the start (`CONNECTION_WINDOW`), so it never stalls
  the other streams while each stream stays bounded by its own 64 KiB window.
* **Outbound flow control**: the app's `send` waits while the peer's window is closed.
* **Writes**: a write takes everything `h2` has queued, so whatever several tasks produced while
  one write was under way leaves in the next single write. On plain TCP a write the socket takes
  whole is one `write(2)` without a trip through the scheduler (stargate/socket_io.py).
* **A stream's end**: once the app has sent its trailers (or a final body) and returned, and the
  client has ended or reset its side, the stream is forgotten. An app that returns while the
  client is still sending resets the stream with NO_ERROR (RFC 9113, 8.1: stop sending), one
  that returns without a complete response with INTERNAL_ERROR. DATA arriving after that is
  dropped by `h2` (no crash, unlike Hypercorn 0.18's pgjones/hypercorn#329). A reset stream's
  app gets `http.disconnect`.
* **Leaving** (`H2Config.leave`): every connection gets GOAWAY (NO_ERROR, the last stream it
  started), its streams in flight finish, and it closes when none is left; a connection opened
  later is served its first stream, then gets the GOAWAY naming it. A graceful close ends our
  side and reads until the client closes (at most `CLOSE_SECONDS`), so a reset cannot swallow
  the GOAWAY.
* **Idle connections**: a connection with no stream for `H2Config.idle_timeout` (5 minutes) gets
  GOAWAY and is closed; one that never sends its preface is closed at the same timeout.
* **Stopping** (`serve_h2`'s `shutdown_trigger`): no new connections (the accept queue is emptied
  first, stargate/accept_queue.py), connections with no stream close, the others get
  `graceful_timeout` seconds, then are cancelled.
* **Errors**: a protocol error closes the connection with the GOAWAY `h2` chose; an app that raises
  resets its stream (INTERNAL_ERROR) if it had not ended it, and is logged; any other failure on
  a connection's own path is logged and closes that connection, never the listener.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import trio
from hyperframe.frame import GoAwayFrame

from stargate import accept_queue
from stargate.asgi import ASGIApp, ASGIMessage, ASGIScope
from stargate.socket_io import SocketReader, send_now

__all__ = [
    "CONNECTION_WINDOW",
    "DELIVER_EXTENSION",
    "IDLE_TIMEOUT_SECONDS",
    "H2Config",
    "serve_h2",
]

log = logging.getLogger(__name__)

DELIVER_EXTENSION = "stargate.deliver"
"""An ASGI extension of this server: `scope["extensions"][DELIVER_EXTENSION]["deliver"](callback)`
makes the server call `callback` with each of the stream's request events (the messages
`receive()` would return, in order, the ones already queued first) from the connection's own
task, as they arrive; the app then no longer calls `receive()`. The callback must not block; it
returns True after the last event it wants (the disconnect), and later events are dropped. DATA
is acknowledged once the callback has it. stargate/grpc_asgi.py takes it: a call then needs no
reader task, one task wake less per request message (docs/decisions.md, D20)."""

IDLE_TIMEOUT_SECONDS = 300.0
"""`H2Config.idle_timeout`'s default: 5 minutes without a stream (Hypercorn closed an idle HTTP/2
connection after 5 s, so a gateway polling ListModels every 10 s reconnected every time)."""

CONNECTION_WINDOW = 16 * 1024 * 1024
"""The connection-level receive window: wide, so one stream's unread data never stalls another
(each stream is bounded by its own initial window)."""

CLOSE_SECONDS = 1.0
"""A graceful close (idle, or every stream done after our GOAWAY) waits at most this long for
the client to read the GOAWAY and close its side."""

READ_SIZE = 65536
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HTTP_505 = (
    b"HTTP/1.1 505 HTTP Version Not Supported\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: 21\r\n"
    b"connection: close\r\n\r\n"
    b"gRPC requires HTTP/2\n"
)


@dataclass
class H2Config:
    """One listener's settings; `leave()` asks its connections to move on (GOAWAY).

    `idle_timeout`: a connection with no stream for this long (from its accept, or from its last
    stream's end) gets GOAWAY and is closed, so clients that connect and go quiet cannot pile
    up descriptors. A gRPC client reconnects by itself; a Pylon's registration stream is never
    idle. `graceful_timeout`: how long connections with streams in flight have once the server
    stops."""

    graceful_timeout: float = 5.0
    idle_timeout: float = IDLE_TIMEOUT_SECONDS
    max_requests_per_connection: int | None = None
    max_concurrent_streams: int = 100
    max_header_list_size: int = 65536
    tls_handshake_timeout: float = 10.0
    leaving: bool = field(default=False, init=False)
    _connections: set[_Connection] = field(default_factory=set, init=False, repr=False)

    def leave(self) -> None:
        """GOAWAY to every open connection and to every later one (idempotent)."""
        self.leaving = True
        for connection in list(self._connections):
            connection.go_away()


async def serve_h2(
    app: ASGIApp,
    sock: socket.socket,
    config: H2Config,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    *,
    ssl_context: ssl.SSLContext | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` over HTTP/2 on the bound, listening `sock` until `shutdown_trigger` returns and
    every connection has finished (at most `config.graceful_timeout` later)."""
    listener: trio.abc.Listener[Any] = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    if ssl_context is not None:
        listener = trio.SSLListener(listener, ssl_context, https_compatible=True)
    server = tuple(sock.getsockname()[:2])

    async def handle(stream: trio.abc.Stream) -> None:
        await _serve_connection(app, stream, config, server, ssl_context is not None)

    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as accepting:
            accepting.start_soon(
                functools.partial(trio.serve_listeners, handler_nursery=connections),
                handle,
                [listener],
            )
            task_status.started()
            await shutdown_trigger()
            await accept_queue.stop_new_connections(sock)
            accepting.cancel_scope.cancel()
        # Every connection gets GOAWAY: an idle one closes now, one whose first stream is still
        # on its way is served that stream; all of them within the graceful timeout.
        config.leave()
        connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout


async def _serve_connection(
    app: ASGIApp, stream: trio.abc.Stream, config: H2Config, server: tuple[Any, ...], tls: bool
) -> None:
    """One accepted connection, from its TLS handshake (if any) to its close."""
    client: tuple[Any, ...] = ()
    try:
        transport: trio.abc.Stream = stream
        if isinstance(stream, trio.SSLStream):
            with trio.move_on_after(config.tls_handshake_timeout) as timer:
                await stream.do_handshake()
            if timer.cancelled_caught:
                return
            transport = stream.transport_stream
        if not isinstance(transport, trio.SocketStream):
            return
        client = tuple(transport.socket.getpeername()[:2])
        connection = _Connection(app, stream, config, client, server, tls)
        config._connections.add(connection)
        try:
            await connection.run()
        finally:
            config._connections.discard(connection)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # the client went away during the handshake or before its address was read
    except Exception:
        # A bug here or in h2 ends this connection only, never the listener (and with it the
        # replica): its streams' apps have heard a disconnect.
        log.exception("HTTP/2 connection from %s failed; closed", client or "(unknown)")
    finally:
        # TLS: the listener is https_compatible, as Hypercorn's, so no close_notify is sent (nor
        # expected): clients frame by length and by HTTP/2's own GOAWAY.
        await trio.aclose_forcefully(stream)


class _Stream:
    """One request stream: the events waiting for the app's `receive`, and how far each side is."""

    __slots__ = (
        "app_done",
        "callback",
        "callback_done",
        "ended_local",
        "ended_remote",
        "events",
        "head",
        "id",
        "reset",
        "started",
        "trailers_expected",
        "wakeup",
    )

    def __init__(self, stream_id: int) -> None:
        self.id = stream_id
        # Request events not yet received, each with its flow-controlled length.
        self.events: collections.deque[tuple[ASGIMessage, int]] = collections.deque()
        self.wakeup: trio.Event | None = None
        # Set by an app that takes DELIVER_EXTENSION: events go to it as they arrive.
        self.callback: Callable[[ASGIMessage], bool] | None = None
        self.callback_done = False  # the callback has had its last event
        self.ended_remote = False  # the client ended its side (END_STREAM, trailers) or reset it
        self.ended_local = False  # we ended ours (END_STREAM sent, or reset)
        self.reset = False  # reset by either side: nothing more is sent or received
        self.app_done = False
        self.started = False  # the response head went out
        self.trailers_expected = False
        self.head: list[tuple[bytes, bytes]] = []

    def push(self, event: ASGIMessage, flow: int) -> None:
        self.events.append((event, flow))
        wakeup = self.wakeup
        if wakeup is not None:
            self.wakeup = None
            wakeup.set()


class _Connection:
    """One client connection: the reader loop, its streams' tasks, and the shared write path."""

    def __init__(
        self,
        app: ASGIApp,
        stream: trio.abc.Stream,
        config: H2Config,
        client: tuple[Any, ...],
        server: tuple[Any, ...],
        tls: bool,
    ) -> None:
        self.app = app
        self.stream = stream
        self.config = config
        self.client = client
        self.server = server
        self.scheme = "https" if tls else "http"
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(
                client_side=False,
                header_encoding=None,
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
            )
        )
        self.h2.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: config.max_concurrent_streams,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: config.max_header_list_size,
            },
        )
        self.streams: dict[int, _Stream] = {}
        self.write_lock = trio.Lock()
        self.pending: list[bytes] = []  # raw frames h2 keeps no record of (our GOAWAY)
        self.window_opened = trio.Event()
        self.nursery: trio.Nursery | None = None
        self.read_scope = trio.CancelScope()
        self.goaway_last: int | None = None  # set once our GOAWAY is queued: the last stream served
        self.broken = False
        self.requests = 0
        # Plain TCP is read with a wait for readability first, and written at once when the
        # socket takes it (stargate/socket_io.py).
        self.plain = stream.socket if isinstance(stream, trio.SocketStream) else None
        self.reader = SocketReader(self.plain, READ_SIZE) if self.plain is not None else None

    # ---- the connection's life ------------------------------------------------------------------

    async def run(self) -> None:
        try:
            first = b""
            with trio.move_on_after(self.config.idle_timeout):
                first = await self._receive()
            if not first:
                return
            if not (first.startswith(_PREFACE) or _PREFACE.startswith(first)):
                await self.stream.send_all(_HTTP_505)
                return
            self.h2.initiate_connection()
            self.h2.increment_flow_control_window(CONNECTION_WINDOW - 65535)
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                try:
                    self._idle_from(trio.current_time())
                    with self.read_scope:
                        await self._read_loop(first)
                    if self.read_scope.cancelled_caught and not self.streams and not self.broken:
                        self.go_away()  # idle (or done after our GOAWAY, sent already)
                        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_SECONDS):
                            await self.flush()
                            await self._drain()
                finally:
                    # The reader is done (EOF, a protocol error, or every stream finished after
                    # our GOAWAY): the apps still running hear a disconnect; the nursery waits.
                    for stream in list(self.streams.values()):
                        self._disconnect(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away: its streams' apps heard a disconnect

    async def _read_loop(self, data: bytes) -> None:
        while data:
            try:
                events = self.h2.receive_data(data)
            except h2.exceptions.ProtocolError as error:
                # h2 has queued its GOAWAY: send it, and close.
                log.debug("HTTP/2 protocol error from %s: %s", self.client, error)
                await self.flush()
                return
            for event in events:
                if self._handle(event):
                    await self.flush()
                    return
            await self.flush()
            data = await self._receive()

    async def _drain(self) -> None:
        """Before a graceful close: end our side, then read (and drop) until the client closes.

        Closing a socket with the client's frames unread (a SETTINGS ACK, a PING) sends a reset,
        and a client's kernel may then drop our GOAWAY before the client has read it.
        """
        if self.plain is not None:
            with contextlib.suppress(OSError):
                self.plain.shutdown(socket.SHUT_WR)
        while await self._receive():
            pass

    def _handle(self, event: h2.events.Event) -> bool:
        """Apply one `h2` event; True when the client ended the connection (GOAWAY)."""
        if isinstance(event, h2.events.DataReceived):
            stream = self.streams.get(event.stream_id)
            if stream is None or stream.reset or stream.app_done:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            else:
                self._deliver(
                    stream,
                    {"type": "http.request", "body": event.data, "more_body": True},
                    event.flow_controlled_length,
                )
        elif isinstance(event, h2.events.RequestReceived):
            self._start(event)
        elif isinstance(event, (h2.events.StreamEnded, h2.events.TrailersReceived)):
            stream = self.streams.get(event.stream_id)
            if stream is not None and not stream.ended_remote:
                stream.ended_remote = True
                self._deliver(stream, {"type": "http.request", "body": b"", "more_body": False})
                self._forget_if_done(stream)
        elif isinstance(event, h2.events.StreamReset):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                self._disconnect(stream)
                self._forget_if_done(stream)
        elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            self._wake_senders()
        elif isinstance(event, h2.events.ConnectionTerminated):
            return True
        return False

    def _start(self, event: h2.events.RequestReceived) -> None:
        stream_id = event.stream_id
        if self.goaway_last is not None and stream_id > self.goaway_last:
            # Sent before the client saw our GOAWAY: refused, so it may retry elsewhere.
            self._reset(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        method = path = authority = b""
        headers: list[tuple[bytes, bytes]] = []
        for name, value in event.headers or ():
            if name[:1] == b":":
                if name == b":method":
                    method = value
                elif name == b":path":
                    path = value
                elif name == b":authority":
                    authority = value
            else:
                headers.append((name, value))
        if authority:
            headers.insert(0, (b"host", authority))
        raw_path, _, query = path.partition(b"?")
        scope: ASGIScope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "2",
            "method": method.decode("ascii", "replace"),
            "scheme": self.scheme,
            "path": unquote(raw_path.decode("ascii", "replace")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": self.client,
            "server": self.server,
        }
        stream = _Stream(stream_id)
        self.read_scope.deadline = math.inf  # not idle while a stream is open
        scope["extensions"] = {
            "http.response.trailers": {},
            DELIVER_EXTENSION: {"deliver": functools.partial(self._take_over, stream)},
        }
        self.streams[stream_id] = stream
        if event.stream_ended is not None:
            stream.ended_remote = True
            self._deliver(stream, {"type": "http.request", "body": b"", "more_body": False})
        assert self.nursery is not None
        self.nursery.start_soon(self._run_app, stream, scope)
        self.requests += 1
        limit = self.config.max_requests_per_connection
        if self.config.leaving or (limit is not None and self.requests >= limit):
            # Leaving: a client that connects now is served once. Rotation: the connection's
            # last request; the client reconnects, perhaps to another replica.
            self.go_away(stream_id)

    def _deliver(self, stream: _Stream, event: ASGIMessage, flow: int = 0) -> None:
        """Hand `event` to the stream's app: queued for its `receive()`, or to its callback."""
        callback = stream.callback
        if callback is None:
            stream.push(event, flow)
            return
        if not stream.callback_done:
            try:
                stream.callback_done = callback(event)
            except Exception:
                log.exception("the app's request callback failed on HTTP/2 stream %d", stream.id)
                stream.callback_done = True
        if flow and not stream.reset:
            self.h2.acknowledge_received_data(flow, stream.id)

    def _take_over(self, stream: _Stream, callback: Callable[[ASGIMessage], bool]) -> None:
        """DELIVER_EXTENSION: from now on `callback` gets the stream's request events, first the
        ones already queued."""
        stream.callback = callback
        acknowledged = False
        while stream.events:
            event, flow = stream.events.popleft()
            self._deliver(stream, event, flow)
            acknowledged = acknowledged or flow > 0
        if acknowledged and self.nursery is not None:
            self.nursery.start_soon(self.flush)  # the WINDOW_UPDATE it may have queued

    async def _run_app(self, stream: _Stream, scope: ASGIScope) -> None:
        async def receive() -> ASGIMessage:
            while not stream.events:
                stream.wakeup = trio.Event()
                await stream.wakeup.wait()
            event, flow = stream.events.popleft()
            if flow and not stream.reset:
                # Acknowledged once the app has it: h2 sends WINDOW_UPDATE when enough is due.
                self.h2.acknowledge_received_data(flow, stream.id)
                await self.flush()
            return event

        send = functools.partial(self._send, stream)  # no extra frame per send: the acks' path
        try:
            await self.app(scope, receive, send)
        except Exception:
            log.exception("the app failed on HTTP/2 stream %d from %s", stream.id, self.client)
        finally:
            stream.app_done = True
            if not stream.reset and not (stream.ended_local and stream.ended_remote):
                # An app that ended without a complete response: INTERNAL_ERROR. One that answered
                # while the client is still sending: NO_ERROR asks it to stop (RFC 9113, 8.1).
                errors = h2.errors.ErrorCodes
                code = errors.NO_ERROR if stream.ended_local else errors.INTERNAL_ERROR
                self._disconnect(stream)
                self._reset(stream.id, code)
                # Shielded (the app may have been cancelled), bounded (the client may not read).
                with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_SECONDS):
                    await self.flush()
            self._forget_if_done(stream)

    # ---- sending ------------------------------------------------------------------------------

    async def _send(self, stream: _Stream, message: ASGIMessage) -> None:
        kind = message["type"]
        if stream.reset or stream.ended_local or self.broken:
            # The client is gone or the response is complete: dropped, as Hypercorn does.
            await trio.lowlevel.checkpoint()
            return
        if kind == "http.response.start":
            stream.head = [
                (b":status", str(message["status"]).encode()),
                *(
                    (bytes(name).lower(), bytes(value))
                    for name, value in message.get("headers", ())
                ),
            ]
            stream.trailers_expected = bool(message.get("trailers", False))
            await trio.lowlevel.checkpoint()
            return
        if kind == "http.response.body":
            self._send_head(stream)
            end = not message.get("more_body", False) and not stream.trailers_expected
            await self._send_data(stream, bytes(message.get("body", b"")), end)
            if end:
                stream.ended_local = True
            await self.flush()
            self._forget_if_done(stream)
            return
        if kind == "http.response.trailers":
            # Hypercorn's `more_trailers` (stargate/grpc_asgi.py `_Call._finish`): the trailers
            # end the stream as soon as the app sends them; a later empty message adds nothing.
            self._send_head(stream)
            headers = [(bytes(name).lower(), bytes(value)) for name, value in message["headers"]]
            self.h2.send_headers(stream.id, headers, end_stream=True)
            stream.ended_local = True
            await self.flush()
            self._forget_if_done(stream)
            return
        raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def _send_head(self, stream: _Stream) -> None:
        if not stream.started:
            stream.started = True
            self.h2.send_headers(stream.id, stream.head)

    async def _send_data(self, stream: _Stream, body: bytes, end: bool) -> None:
        """`body` as DATA frames within the peer's windows, waiting while they are closed."""
        view = memoryview(body)
        while True:
            if stream.reset or self.broken:
                return
            window = min(
                self.h2.local_flow_control_window(stream.id), self.h2.max_outbound_frame_size
            )
            if window > 0 or not view:
                chunk = view[:window]
                rest = view[len(chunk) :]
                self.h2.send_data(stream.id, bytes(chunk), end_stream=end and not rest)
                if not rest:
                    return
                view = rest
                continue
            opened = self.window_opened
            await self.flush()
            await opened.wait()

    def _wake_senders(self) -> None:
        self.window_opened.set()
        self.window_opened = trio.Event()

    def _reset(self, stream_id: int, code: h2.errors.ErrorCodes) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError):  # already closed on h2's side
            self.h2.reset_stream(stream_id, code)

    def _disconnect(self, stream: _Stream) -> None:
        """The stream is over for the client: its app hears `http.disconnect` once."""
        if not stream.reset:
            stream.reset = True
            stream.ended_remote = True
            self._deliver(stream, {"type": "http.disconnect"})
            self._wake_senders()  # a send waiting for its window sees the reset

    def _forget_if_done(self, stream: _Stream) -> None:
        """Forget a stream both sides are done with; after our GOAWAY, close with the last one."""
        if stream.app_done and (stream.ended_remote or stream.reset):
            self.streams.pop(stream.id, None)
            if not self.streams:
                if self.goaway_last is not None:
                    self.read_scope.cancel()
                else:
                    self._idle_from(trio.current_time())

    def _idle_from(self, now: float) -> None:
        """No stream since `now`: the connection closes at the idle timeout unless one starts."""
        self.read_scope.deadline = now + self.config.idle_timeout

    async def flush(self) -> None:
        """Write everything queued; a flush that waits behind another one takes what is left.

        On plain TCP, with no write under way and room in the socket's buffer (nearly always: a
        heartbeat's ack is 14 bytes), it is one `write(2)` at once, without yielding
        (stargate/socket_io.py `send_now`); whatever the socket did not take goes out with
        `send_all`, under the write lock, which is taken before any yield so a later flush
        cannot overtake it. So it is not always a checkpoint: the sender's next await is.
        """
        lock = self.write_lock
        if lock.locked():
            async with lock:
                await self._write(self._take())
            return
        data = self._take()
        if data:
            lock.acquire_nowait()  # held before any yield: a later flush cannot overtake this one
            try:
                await self._write(data)
            finally:
                lock.release()

    def _take(self) -> bytes:
        """Everything queued to be written: h2's frames, then our raw ones."""
        data = self.h2.data_to_send()
        if self.pending:
            data = data + b"".join(self.pending)
            self.pending.clear()
        return b"" if self.broken else data

    async def _write(self, data: bytes) -> None:
        if not data:
            return
        try:
            await send_now(self.stream, self.plain, data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._broken()
        except BaseException:
            self._broken()  # cancelled part-way: the connection's framing is lost
            raise

    def _broken(self) -> None:
        """The connection can no longer be written: stop reading too, and let the apps go."""
        self.broken = True
        self.read_scope.cancel()

    async def _receive(self) -> bytes:
        try:
            if self.reader is not None:
                return await self.reader.receive()
            return bytes(await self.stream.receive_some(READ_SIZE))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    # ---- leaving and stopping ----------------------------------------------------------------

    def go_away(self, last_stream_id: int | None = None) -> None:
        """GOAWAY(NO_ERROR) naming the last stream served: those finish, later ones are refused.

        Sent as a raw frame, not with h2's `close_connection()`, which would end the streams in
        flight on h2's side too.
        """
        if self.goaway_last is not None:
            return
        last = self.h2.highest_inbound_stream_id if last_stream_id is None else last_stream_id
        self.goaway_last = last
        self.pending.append(
            GoAwayFrame(
                stream_id=0, last_stream_id=last, error_code=h2.errors.ErrorCodes.NO_ERROR
            ).serialize()
        )
        if self.nursery is not None:
            self.nursery.start_soon(self.flush)
        if not self.streams:
            self.read_scope.cancel()
