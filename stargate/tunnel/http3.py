"""The http3 exchange: the replica is the HTTP/3 client and the Pylon the HTTP/3 server, whichever
side dialed (docs/tunnels.md, "HTTP/3"). One request per request stream, as in raw-quic.

Both sides run aioquic's sans-IO `H3Connection` on the QUIC driver's `event_handler` hook. The
driver keeps the events of streams nobody claimed until the hook is set and then replays them in
order, which is what reverse mode needs: the replica sends its SETTINGS and QPACK streams before
its HandshakeAck, so they reach the Pylon before it starts its H3 server.

`_H3` subclasses `H3Connection` for three reasons:

* Role inversion. aioquic takes its HTTP role from the QUIC role, but in reverse mode the H3
  client runs on the QUIC server and its requests travel on server-initiated bidirectional
  streams (1, 5, 9...). aioquic's H3 never checks who opened a request stream, so those are
  served as they are. `_H3` takes the HTTP role as an argument. Only one thing still follows the
  QUIC role: deciding which unidirectional streams are ours (`_get_or_create_stream`).
* aioquic treats a response head without a valid `:status` as a connection error, which would
  fail every other request on the connection. `_H3` reads it as a 502, the raw-quic rule.
* No server push: no MAX_PUSH_ID is sent, as with the h3 crate.

Flow control is bounded in both directions:

* Receiving: a request stream's credit follows what the application consumed
  (`FlowQuic.consumed`): the bytes the H3 layer has parsed, minus the DATA payload nobody has
  read yet. So the replica buffers at most one stream window of an answer its client is slow to
  take, and the Pylon at most one window of a body the hop has not asked for yet. Once the hop
  asks, `read_body(limit)` holds the whole body, up to `limit`.
* Sending: in hook mode the driver applies no backpressure, and aioquic queues data without
  limit. So before each DATA frame, a sender waits while the stream's unsent backlog in aioquic
  is above the connection's `send_high_water`. The driver wakes no hook writer when packets
  leave, so this wait polls (every 1 ms at first, doubling up to 50 ms). A STOP_SENDING, a reset
  or a failure wakes it at once.

The hook gets no event when the connection closes under it (idle timeout, the peer's close), so
waiters recheck the connection every `CLOSE_POLL_SECONDS`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, Generic, Protocol, TypeVar

import trio
from aioquic.h3.connection import (
    ErrorCode,
    H3Connection,
    H3Stream,
    HeadersState,
    ProtocolError,
)
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic import events
from aioquic.quic.connection import stream_is_client_initiated, stream_is_unidirectional

from stargate.asgi import BodyTooLarge
from stargate.http_headers import HOP_BY_HOP, Headers
from stargate.logs import LoggedError
from stargate.tunnel.quic import QuicConnection
from stargate.tunnel.quic.flow import FlowQuic
from stargate.tunnel.raw_quic import TunnelRequestHead
from stargate.tunnel.response import StreamedResponse
from stargate.upstream import ResponseHeadTimeout, UpstreamProtocolError

__all__ = ["DATA_FRAME_BYTES", "Http3Hop", "Http3Link", "Http3Response", "Http3Sink", "serve_http3"]

log = logging.getLogger("stargate.tunnel")

DATA_FRAME_BYTES = 64 * 1024
"""The replica writes a request body as DATA frames of at most this size."""
CLOSE_POLL_SECONDS = 0.5
"""How often a waiting reader checks whether the connection has closed under it."""
BACKLOG_POLL_MIN = 0.001
BACKLOG_POLL_MAX = 0.05
H3_NO_ERROR = int(ErrorCode.H3_NO_ERROR)
H3_REQUEST_CANCELLED = int(ErrorCode.H3_REQUEST_CANCELLED)
"""The code of every reset and STOP_SENDING that abandons a request, from either side."""

_DROPPED_REQUEST = HOP_BY_HOP  # hop-by-hop headers and `host`
_DROPPED_RESPONSE = HOP_BY_HOP | {b"content-length"}  # the Rust Pylon never sends it over h3
_SEND_ERRORS = (ProtocolError, RuntimeError, ValueError)  # stream ended, reset or discarded


def _valid_status(value: bytes) -> bool:
    return len(value) == 3 and value.isdigit() and value[:1] != b"0" and value != b"101"


class _H3(H3Connection):
    """aioquic's H3 connection with an explicit HTTP role (see the module docstring)."""

    def __init__(self, quic: FlowQuic, *, http_client: bool) -> None:
        self._http_client = http_client
        self.bad_status: set[int] = set()
        """Response streams whose `:status` was missing or invalid (read as 502)."""
        super().__init__(quic)

    @property
    def failed(self) -> bool:
        """An H3 connection error happened; aioquic has closed the QUIC connection."""
        return self._is_done

    def _init_connection(self) -> None:
        # The base constructor derived both values from the QUIC role. They belong to the HTTP role.
        self._is_client = self._http_client
        self._max_push_id = None
        super()._init_connection()

    @contextmanager
    def _get_or_create_stream(self, stream_id: int) -> Iterator[H3Stream]:
        # aioquic's own method, except that "our unidirectional stream" follows the QUIC role.
        if stream_id not in self._stream:
            stream = H3Stream(stream_id)
            if stream_is_unidirectional(stream_id):
                if stream_is_client_initiated(stream_id) == self._quic.configuration.is_client:
                    stream.receiving_ended = True
                else:
                    stream.sending_ended = True
            self._stream[stream_id] = stream
        stream = self._stream[stream_id]
        try:
            yield stream
        finally:
            if stream.is_ended():
                self._stream.pop(stream_id)

    def _decode_headers(self, stream_id: int, frame_data: bytes | None) -> Headers:
        headers = super()._decode_headers(stream_id, frame_data)
        stream = self._stream.get(stream_id)
        if (
            not self._is_client
            or stream is None
            or stream.push_id is not None
            or stream.headers_recv_state is not HeadersState.INITIAL
        ):
            return headers
        # A response head comes out with a valid `:status` first and no other pseudo-header.
        status = next((value for name, value in headers if name == b":status"), None)
        if status is None or not _valid_status(status):
            self.bad_status.add(stream_id)
            status = b"502"
        return [(b":status", status), *((n, v) for n, v in headers if not n.startswith(b":"))]

    def end_stream(self, stream_id: int) -> None:
        """Send FIN alone, with no empty DATA frame."""
        with self._get_or_create_stream(stream_id) as stream:
            stream.finish_sending()
        self._quic.send_stream_data(stream_id, b"", end_stream=True)

    def abandon(self, stream_id: int, code: int, *, stop: bool) -> None:
        """Reset our sending side, and stop the receiving side if `stop`. The H3 state is dropped
        once the peer's side also ends."""
        with suppress(ValueError):
            self._quic.reset_stream(stream_id, code)
        if stop:
            with suppress(ValueError):
                self._quic.stop_stream(stream_id, code)
        stream = self._stream.get(stream_id)
        if stream is not None:
            stream.sending_ended = True
            if stream.is_ended():
                del self._stream[stream_id]


class _Stream:
    """One request stream: what the H3 layer delivered, and how our sending side stands."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.fin = False  # the peer's side ended cleanly
        self.failure: str | None = None  # the peer's reset, an H3 error, the link closed
        self.peer_stopped = False  # STOP_SENDING (aioquic reset our side)
        self.sent_fin = False
        self.lot = trio.lowlevel.ParkingLot()

    def deliver(self, data: bytes, ended: bool) -> None:
        if data:
            self.chunks.append(data)
            self.buffered += len(data)
        self.fin = self.fin or ended

    def done_writing(self) -> bool:
        return self.peer_stopped


_S = TypeVar("_S", bound=_Stream)


class _Endpoint(Generic[_S]):
    """The plumbing both sides share: event dispatch, credit, backpressure, abandoning."""

    def __init__(self, connection: QuicConnection, *, http_client: bool) -> None:
        self.connection = connection
        self.h3 = _H3(connection.quic, http_client=http_client)
        self.streams: dict[int, _S] = {}
        self._failed = False

    def _on_event(self, event: events.QuicEvent) -> None:
        """The driver's event handler: synchronous, in the endpoint's task."""
        touched: set[int] = set()
        for h3_event in self.h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived | DataReceived):
                self._on_h3_event(h3_event)
                touched.add(h3_event.stream_id)
        if isinstance(event, events.StreamReset | events.StopSendingReceived):
            touched.add(event.stream_id)
            state = self.streams.get(event.stream_id)
            if state is None:
                if isinstance(event, events.StreamReset):
                    self._on_untracked_reset(event.stream_id)
            else:
                if isinstance(event, events.StopSendingReceived):
                    state.peer_stopped = True
                elif state.failure is None:
                    state.failure = f"reset by the peer (code {event.error_code:#x})"
                self._on_peer_gone(state)
        elif isinstance(event, events.StreamDataReceived):
            touched.add(event.stream_id)
        if self.h3.failed and not self._failed:
            self._fail_all("HTTP/3 connection error")
        for stream_id in touched:
            if (state := self.streams.get(stream_id)) is not None:
                self._credit(state)
                state.lot.unpark_all()

    def _on_h3_event(self, event: H3Event) -> None:
        raise NotImplementedError

    def _on_peer_gone(self, state: _S) -> None:
        """The peer reset or stopped a stream we track."""

    def _on_untracked_reset(self, stream_id: int) -> None:
        """The peer reset a stream we do not track."""

    def _fail_all(self, reason: str) -> None:
        self._failed = True
        for state in self.streams.values():
            state.failure = state.failure or reason
            state.lot.unpark_all()

    def _failure(self, state: _S) -> str | None:
        if state.failure is not None:
            return state.failure
        if not self.connection.is_open:
            return f"QUIC connection closed: {self.connection.close_reason}"
        return None

    async def _wait(self, state: _S) -> None:
        """Wait for news on `state` (or for the next check of the connection)."""
        with trio.move_on_after(CLOSE_POLL_SECONDS):
            await state.lot.park()

    # Receiving: credit follows consumption.

    def _track(self, state: _S) -> None:
        self.streams[state.stream_id] = state
        self.connection.quic.consumed[state.stream_id] = 0

    def _forget(self, state: _S) -> None:
        self.streams.pop(state.stream_id, None)
        self.connection.quic.consumed.pop(state.stream_id, None)

    def _credit(self, state: _S) -> None:
        stream_id = state.stream_id
        quic = self.connection.quic
        stream = quic._streams.get(stream_id)
        if stream is None or stream_id not in quic.consumed:
            return
        h3_stream = self.h3._stream.get(stream_id)
        held = state.buffered + (len(h3_stream.buffer) if h3_stream is not None else 0)
        consumed = stream.receiver.starting_offset() - held
        if consumed > quic.consumed[stream_id]:
            quic.consumed[stream_id] = consumed

    def _take(self, state: _S) -> bytes:
        chunk = state.chunks.popleft()
        state.buffered -= len(chunk)
        self._credit(state)
        if self.connection.quic.credit_due(state.stream_id):
            self.connection.transmit_soon()
        return chunk

    # Sending: bounded by the unsent backlog.

    def _backlog(self, stream_id: int) -> int:
        stream = self.connection.quic._streams.get(stream_id)
        if stream is None or stream.sender._reset_error_code is not None:
            return 0
        return stream.sender._buffer_stop - stream.sender.highest_offset

    async def _writable(self, state: _S) -> bool:
        """Wait until `state` may take another DATA frame: True, or False once it cannot
        (stopped, failed, done). Cancellable; a checkpoint."""
        await trio.lowlevel.checkpoint()
        delay = BACKLOG_POLL_MIN
        while True:
            if state.done_writing() or self._failure(state) is not None:
                return False
            if self._backlog(state.stream_id) <= self.connection.send_high_water:
                return True
            with trio.move_on_after(delay):
                await state.lot.park()
            delay = min(2 * delay, BACKLOG_POLL_MAX)

    def _send(self, state: _S, data: bytes, *, end: bool) -> bool:
        """Queue one DATA frame (or FIN alone); False if the stream cannot send any more."""
        h3_stream = self.h3._stream.get(state.stream_id)
        if h3_stream is None or h3_stream.sending_ended:
            return False
        try:
            if data:
                self.h3.send_data(state.stream_id, data, end)
            elif end:
                self.h3.end_stream(state.stream_id)
        except _SEND_ERRORS:
            return False
        state.sent_fin = end
        self.connection.transmit_soon()
        return True

    def _abandon(self, state: _S, *, stop: bool = True) -> None:
        """Reset our side (and stop the peer's, if `stop` and it has not ended); forget it."""
        stop = stop and not state.fin and state.failure is None  # else it has ended already
        self.connection.flush()  # a reset discards what this turn queued and did not send yet
        self.h3.abandon(state.stream_id, H3_REQUEST_CANCELLED, stop=stop)
        self.connection.transmit()
        self._forget(state)


# ---------------------------------------------------------------------------- the replica's side


class _Exchange(_Stream):
    def __init__(self, stream_id: int) -> None:
        super().__init__(stream_id)
        self.head: Headers | None = None
        self.status = 0

    def done_writing(self) -> bool:
        # An early refusal wins over the rest of the upload (Rust's `ResponseFirst`).
        return self.peer_stopped or (self.head is not None and not 200 <= self.status < 300)


class Http3Link(_Endpoint[_Exchange]):
    """The replica's HTTP/3 client over one QUIC connection, in either QUIC role (a
    `TunnelLink`). Build it with `replica_side`."""

    def __init__(self, connection: QuicConnection) -> None:
        super().__init__(connection, http_client=True)
        self._closed = False

    @classmethod
    def replica_side(cls, connection: QuicConnection) -> Http3Link:
        """The H3 client on `connection`. It becomes the connection's event handler and sends
        its SETTINGS (control and QPACK streams) at once. Never waits."""
        link = cls(connection)
        connection.event_handler = link._on_event  # replays what was kept, then transmits
        return link

    @property
    def healthy(self) -> bool:
        """QUIC is open, the H3 layer has not failed, and the link was not closed."""
        return not self._closed and self.connection.is_open and not self.h3.failed

    @property
    def open_requests(self) -> int:
        """Requests in flight on this connection (their bidirectional streams not finished)."""
        return self.connection.open_request_streams

    def close(self) -> None:
        """Close the connection (H3_NO_ERROR) and fail every open exchange. Never waits."""
        self._closed = True
        self.connection.close(H3_NO_ERROR, "shutdown")
        self._fail_all("the tunnel link was closed")

    async def request(
        self,
        method: str,
        path_and_query: bytes,
        headers: Headers,
        body: bytes | bytearray,
        deadline: float,
    ) -> Http3Response:
        """Send one request on a new request stream and return once the final head arrives.

        `deadline` (trio time) covers opening the stream (aioquic holds a stream past the peer's
        MAX_STREAMS until more are granted), writing the body and the head. Past it:
        `ResponseHeadTimeout`. A reset, an H3 error or the connection closing before the head:
        `UpstreamProtocolError`. On any failure, cancellation included, the stream is reset and
        stopped. The response owns the stream: close it (`async with`)."""
        sent = False
        exchange: _Exchange | None = None
        try:
            with trio.move_on_at(deadline) as scope:
                await trio.lowlevel.checkpoint()
                exchange = self._open(method, path_and_query, headers, end=not body)
                sent = not body or await self._upload(exchange, body)
                await self._await_head(exchange, sent)
            if scope.cancelled_caught:
                raise ResponseHeadTimeout("quic request timed out", request_sent=sent)
            assert exchange is not None
            return Http3Response(self, exchange)
        except BaseException:
            if exchange is not None:
                self._abandon(exchange)
            raise

    def _open(
        self, method: str, path_and_query: bytes, headers: Headers, *, end: bool
    ) -> _Exchange:
        if not self.healthy:
            reason = self.connection.close_reason or "HTTP/3 connection failed"
            raise UpstreamProtocolError(
                f"cannot open an HTTP/3 tunnel stream: {reason}", request_sent=False
            )
        head = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", b"stargate"),
            (b":path", bytes(path_and_query)),
        ]
        for name, value in headers:
            lower = name.lower()  # HTTP/3 field names are lower-case
            if lower not in _DROPPED_REQUEST:
                head.append((lower, value.strip(b" \t")))
        exchange = _Exchange(self.connection.quic.get_next_available_stream_id())
        self._track(exchange)
        self.h3.send_headers(exchange.stream_id, head, end_stream=end)
        exchange.sent_fin = end
        self.connection.transmit_soon()
        return exchange

    async def _upload(self, exchange: _Exchange, body: bytes | bytearray) -> bool:
        """Write the body; True once its FIN is queued, False if the peer stopped it first."""
        view = memoryview(body)
        for start in range(0, len(view), DATA_FRAME_BYTES):
            if not await self._writable(exchange):
                return False
            end = start + DATA_FRAME_BYTES >= len(view)
            if not self._send(exchange, bytes(view[start : start + DATA_FRAME_BYTES]), end=end):
                return False
        return True

    async def _await_head(self, exchange: _Exchange, sent: bool) -> None:
        while exchange.head is None:
            failure = self._failure(exchange)
            if failure is not None:
                raise UpstreamProtocolError(
                    f"HTTP/3 tunnel stream failed before the response head: {failure}",
                    request_sent=sent,
                )
            if exchange.fin:
                raise UpstreamProtocolError(
                    "HTTP/3 tunnel stream ended before the response head", request_sent=sent
                )
            await self._wait(exchange)

    def _on_h3_event(self, event: H3Event) -> None:
        assert isinstance(event, HeadersReceived | DataReceived)
        exchange = self.streams.get(event.stream_id)
        bad_status = event.stream_id in self.h3.bad_status
        self.h3.bad_status.discard(event.stream_id)
        if exchange is None:
            return
        if isinstance(event, DataReceived):
            exchange.deliver(event.data, event.stream_ended)
            return
        if exchange.head is None:
            status = event.headers[0][1]  # `_H3` puts a valid `:status` first
            if status.startswith(b"1"):
                return  # an interim answer; the final one follows
            if bad_status:
                log.warning("HTTP/3 tunnel response missing or invalid :status header")
            exchange.status = int(status)
            exchange.head = event.headers[1:]
        exchange.fin = exchange.fin or event.stream_ended  # trailers are ignored

    async def _next_chunk(self, exchange: _Exchange) -> bytes | None:
        await trio.lowlevel.checkpoint()
        while True:
            if exchange.chunks:
                return self._take(exchange)
            if exchange.fin:
                if not exchange.sent_fin:  # the upload was cut short: end it
                    self._abandon(exchange, stop=False)
                self._forget(exchange)
                return None
            failure = self._failure(exchange)
            if failure is not None:
                raise UpstreamProtocolError(
                    f"HTTP/3 tunnel response body failed: {failure}", request_sent=True
                )
            await self._wait(exchange)


class Http3Response(StreamedResponse):
    """An answer whose head arrived on an HTTP/3 request stream (a `BackendResponse`): the body
    is its DATA. Closing it before the body is complete resets and stops the stream
    (H3_REQUEST_CANCELLED), and the Pylon then cancels its engine request."""

    __slots__ = ("_exchange", "_link")

    def __init__(self, link: Http3Link, exchange: _Exchange) -> None:
        assert exchange.head is not None
        super().__init__(exchange.status, exchange.head)
        self._link = link
        self._exchange = exchange

    async def _read(self) -> bytes | None:
        return await self._link._next_chunk(self._exchange)

    def _abandon(self) -> None:
        self._link._abandon(self._exchange)


# ------------------------------------------------------------------------------ the Pylon's side


class Http3Hop(Protocol):
    """What `serve_http3` forwards to: `stargate.pylon.hop.PylonHop`. The request is a
    `TunnelRequestHead`, which has the four attributes of the hop's `PylonRequest`
    (`stargate.pylon` imports this package, so this one cannot name that class)."""

    async def forward(
        self, request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Http3Sink
    ) -> None: ...


class _StreamGone(Exception):
    """The stream can no longer carry the answer (the peer stopped it, the connection closed)."""


class _Request(_Stream):
    def __init__(self, stream_id: int, headers: Headers) -> None:
        super().__init__(stream_id)
        self.headers = headers
        self.scope = trio.CancelScope()


class Http3Sink:
    """The Pylon's answer on one request stream (a hop `ResponseSink`): one HEADERS frame with
    `:status` (no `content-length`, no hop-by-hop), one DATA frame per `send`, FIN with the
    last one. Raises `_StreamGone` once the stream cannot carry it."""

    __slots__ = ("_request", "_server", "finished", "started")

    def __init__(self, server: _Http3Server, request: _Request) -> None:
        self._server = server
        self._request = request
        self.started = False
        self.finished = False

    async def start(self, status: int, headers: Headers, *, body_follows: bool) -> None:
        del body_follows  # the head is one frame either way; `send(more=False)` ends the stream
        await trio.lowlevel.checkpoint()
        self._server._send_head(self._request, status, headers)
        self.started = True

    async def send(self, data: bytes, *, more: bool) -> None:
        """Queue `data` once the stream's backlog allows it (cancellable wait)."""
        await self._server._send_body(self._request, data, end=not more)
        self.finished = not more


class _Http3Server(_Endpoint[_Request]):
    def __init__(self, connection: QuicConnection, hop: Http3Hop, nursery: trio.Nursery) -> None:
        super().__init__(connection, http_client=False)
        self._hop = hop
        self._nursery = nursery
        self.serving = True

    def _on_h3_event(self, event: H3Event) -> None:
        assert isinstance(event, HeadersReceived | DataReceived)
        request = self.streams.get(event.stream_id)
        if isinstance(event, DataReceived):
            if request is not None:
                request.deliver(event.data, event.stream_ended)
            return
        if request is None:
            # A new request, unless these are the trailers of one already answered.
            h3_stream = self.h3._stream.get(event.stream_id)
            if (
                not self.serving
                or event.push_id is not None
                or h3_stream is None
                or h3_stream.headers_recv_state is not HeadersState.AFTER_HEADERS
            ):
                return
            request = _Request(event.stream_id, event.headers)
            self._track(request)
            self._nursery.start_soon(self._serve, request)
        request.fin = request.fin or event.stream_ended

    def _on_peer_gone(self, state: _Request) -> None:
        state.scope.cancel()  # the replica gave up: stop the engine request

    def _on_untracked_reset(self, stream_id: int) -> None:
        # Reset before its head: aioquic answers that only on client-initiated streams (direct);
        # on the Pylon's side of a reverse connection, end our side here.
        h3_stream = self.h3._stream.get(stream_id)
        if (
            h3_stream is not None
            and h3_stream.headers_recv_state is HeadersState.INITIAL
            and not h3_stream.sending_ended
        ):
            self.h3.abandon(stream_id, H3_REQUEST_CANCELLED, stop=False)

    async def _serve(self, request: _Request) -> None:
        sid = request.stream_id
        target = next((value for name, value in request.headers if name == b":path"), b"/")
        path, _, query = target.partition(b"?")
        head = TunnelRequestHead(
            next(v for n, v in request.headers if n == b":method").decode("latin-1"),
            path.decode("latin-1") or "/",
            query,
            [(name, value) for name, value in request.headers if not name.startswith(b":")],
        )
        sink = Http3Sink(self, request)

        async def read_body(limit: int) -> bytes:
            return await self._read_body(request, limit)

        clean = False
        with request.scope:
            try:
                await self._hop.forward(head, read_body, sink)
            except LoggedError:
                pass  # StreamAborted: logged by the hop; the reset tells the replica
            except BodyTooLarge:
                log.warning("HTTP/3 tunnel stream %d: request body over the limit", sid)
            except _StreamGone:
                pass
            except Exception:
                log.exception("HTTP/3 tunnel stream %d failed", sid)
            else:
                clean = sink.finished
        if clean:
            if not request.fin and request.failure is None:  # the rest is not needed
                with suppress(ValueError):
                    self.connection.quic.stop_stream(sid, H3_NO_ERROR)
                self.connection.transmit()
            self._forget(request)
        else:
            self._abandon(request)

    async def _read_body(self, request: _Request, limit: int) -> bytes:
        await trio.lowlevel.checkpoint()
        parts: list[bytes] = []
        size = 0
        while True:
            while request.chunks:
                chunk = self._take(request)
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge
                parts.append(chunk)
            if request.fin:
                return b"".join(parts)
            failure = self._failure(request)
            if failure is not None:
                raise _StreamGone(failure)
            await self._wait(request)

    def _send_head(self, request: _Request, status: int, headers: Headers) -> None:
        head = [(b":status", str(status).encode())]
        for name, value in headers:
            lower = name.lower()
            if lower not in _DROPPED_RESPONSE:
                head.append((lower, value))
        h3_stream = self.h3._stream.get(request.stream_id)
        if request.peer_stopped or h3_stream is None or h3_stream.sending_ended:
            raise _StreamGone("the stream can no longer send")
        try:
            self.h3.send_headers(request.stream_id, head)
        except _SEND_ERRORS as error:
            raise _StreamGone(str(error)) from None
        self.connection.transmit_soon()

    async def _send_body(self, request: _Request, data: bytes, *, end: bool) -> None:
        if not data and not end:
            await trio.lowlevel.checkpoint()
            return
        if not await self._writable(request) or not self._send(request, data, end=end):
            raise _StreamGone(self._failure(request) or "the replica stopped the stream")


async def serve_http3(connection: QuicConnection, hop: Http3Hop) -> None:
    """Serve every HTTP/3 request the replica sends on `connection`, whatever its QUIC role: each
    goes to `hop.forward` in its own task. Returns once the connection has closed. Cancelled (or
    on return), it stops serving, closes the connection and cancels the requests in flight.

    A request's failure stays on its stream: an error from the hop (`StreamAborted` included)
    resets it (H3_REQUEST_CANCELLED, both ways). A stream that the replica resets or stops
    cancels its hop task. A complete answer sent before the whole body arrived stops the rest
    (STOP_SENDING, H3_NO_ERROR)."""
    async with trio.open_nursery() as nursery:
        server = _Http3Server(connection, hop, nursery)
        connection.event_handler = server._on_event  # replays what arrived before, in order
        try:
            await connection.wait_closed()
        finally:
            server.serving = False
            connection.close(H3_NO_ERROR, "HTTP/3 server stopped")
            nursery.cancel_scope.cancel()
