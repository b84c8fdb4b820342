"""Fixes for Hypercorn 0.18 bugs that a client could use to take a replica down, or that keep
connections open after HTTP says they end.

`apply()` installs the first thirteen once (four are not fixes but cut the cost of every request:
writes at once, the keep-alive timer, the head with the body, the disconnect hook), when
`stargate/serving.py` is imported; the last one wraps each served app
(`complete_response_before_disconnect`, applied by `serving.serve_asgi`). Each fix is small,
targeted at one upstream issue, and covered by a test that fails without it. What a client can
expect as a result is in docs/http-serving.md.

* pgjones/hypercorn#329: when HTTP/2 DATA arrives for a stream whose response is already complete,
  `H2Protocol._handle_events` raises `KeyError` in the connection task, and on the trio worker
  that ends the whole server. Any HTTP/2 (h2c) client can trigger it on any of our ports by
  sending a body the app answers before reading. The fix drops such DATA frames, still returning
  their bytes to the flow-control window so the connection's other streams keep flowing, and
  resets the stream with NO_ERROR (RFC 9113 §8.1) so the client stops sending.
* HTTP/2 back-pressure: `StreamBuffer.pop` releases a writer paused at the high-water mark
  whenever *the popped chunk* is small, including the zero-length pops made while the peer's
  flow-control window is 0. A client that stops reading therefore never pauses the app, and the
  server buffers the whole response in memory. The fix releases the writer only once *what is
  left in the buffer* is below the low-water mark.
* HTTP/2 stream lifecycle: Hypercorn takes a stream out of its per-connection priority tree (which
  holds at most 1000) and out of its send buffers only when its send task next picks that stream
  after the response is complete. A stream the client resets before any response is left blocked
  in the tree and is never picked again; and under steady load the tree's scheduler keeps picking
  newer streams, so finished ones (a gRPC answer ended by its trailers) wait for a turn that does
  not come. Either way the tree fills, and at the 1000th leftover `TooManyStreamsError`
  escapes the connection task and the listener's server exits. The fix ends every stream where it
  ends: END_STREAM is queued with the last byte handed to h2, trailers end the stream at once, and
  a reset by the client, a closed connection, or an app that stops before completing its response
  (whose client then gets RST_STREAM INTERNAL_ERROR rather than waiting forever) drop it too.
  PRIORITY frames for streams that are not open are ignored (RFC 9113 §5.3.2 deprecates that
  scheme) rather than parking placeholder streams in the tree.
* Full priority tree: should the tree still be full, the new stream is refused with RST_STREAM
  REFUSED_STREAM, which clients may retry, instead of raising.
* Contained connection failures: an exception escaping one connection's task reaches the nursery
  of the server (trio's `serve_listeners` handler nursery) and ends the listener, then the
  replica. Now it is logged once, with its traceback, and only that connection is closed.
* Graceful HTTP/2 rotation: on `keep_alive_max_requests` Hypercorn calls h2's
  `close_connection()`, which moves h2 to its CLOSED state: every stream still in flight, the
  request that hit the limit included, then fails. The fix sends GOAWAY naming the last stream it
  will serve, finishes the streams up to it, refuses later ones with REFUSED_STREAM, and closes
  the connection once they are done.
* A send racing the connection's close: Hypercorn's trio server serialises its socket writes
  with a lock, but `TCPServer._close` half-closes the socket (`send_eof`) outside it. A client
  that closes its connection once it has read an answer given before its request body was
  complete (the 408 for a stalled body, or any answer made without reading the body) makes the
  reading task close the connection while the app's task is still sending the end of that
  answer, and trio refuses the concurrent send with `BusyResourceError`: "Error in ASGI
  Framework" with a traceback, although the client had its answer (nearly every time with 32
  stalled bodies at once, tests/unit/test_http_limits.py). Only that close writes outside the
  lock, so the error means the connection is closing: the send is handled like one on a closed
  connection.
* HTTP/2 send order: streams take turns to send in round robin (`stargate/h2_send_order.py`)
  instead of through the RFC 7540 priority tree (deprecated by RFC 9113, unused by our clients),
  whose per-turn walk cost about 15% of the replica's CPU with a thousand Pylons heartbeating.
* Writes at once (`_write_at_once`, a cost rather than a bug): Hypercorn takes the send lock,
  opens a shielded cancel scope and calls trio's `send_all` for every write, two trips through
  the scheduler for what is nearly always one `send(2)`. A write the socket takes whole is now
  that one syscall; the rest goes the original way.
* A new connection closed unanswered at the drain (`_wait_for_first_request`): when a server
  stops accepting, Hypercorn ends every idle connection at once, and a connection accepted an
  instant before, whose request is still on its way, is idle too. Its client had connected and
  sent its request, and read a closed connection (or a reset) instead of an answer, during every
  rolling restart under load (tests/faults/test_sigterm_under_load.py). A connection that has not
  had a request yet now keeps its first-request deadline (the keep-alive timeout) through the
  drain; it is closed after its one answer, as every connection is then.
* Keep-alive timer (`_restart_idle_timers_at_once`, a cost): stopping and restarting a
  connection's idle timer, once each per request, went through an async lock and `nursery.start`;
  now neither waits.
* Head with the body (`_write_head_with_body`, a cost): an HTTP/1.1 head whose start message
  says `BODY_FOLLOWS` (stargate/asgi.py) is written with the next body message, one write.
* Disconnect hook (`_hook_disconnects`, not a fix): every HTTP exchange gets a `DisconnectHook`
  (stargate/asgi.py) in `scope["extensions"]`, fired where Hypercorn queues `http.disconnect`,
  so the proxy cancels its upstream work without a task per request waiting in `receive()`.
* `leave(config)` is not a fix but uses the rotation: during a shutdown's leave phase it tells
  every client of a listener to move on (docs/rolling-restarts.md).
* Responses complete before `http.disconnect` (`complete_response_before_disconnect`): Hypercorn
  delivers `http.disconnect` to the app from inside the app's final `send()`, before it has done
  its own bookkeeping for the finished response (close the connection for `Connection: close` or
  HTTP/1.0, start the keep-alive idle timer). An app that cancels its work on `http.disconnect`
  (the proxy, QuartTrio, the gRPC server) thereby cancels that bookkeeping, which runs in the
  app's task, so such connections were never closed. The wrapper holds that one `http.disconnect`
  back until the final `send()` has returned; a disconnect at any other time is passed on at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h11
import trio
from h2.stream import StreamState
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, RawData, Updated
from hypercorn.events import Event as IOEvent
from hypercorn.protocol.events import EndBody, EndData, StreamClosed, Trailers
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h2 import BUFFER_LOW_WATER, H2Protocol, StreamBuffer
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask
from hyperframe.frame import GoAwayFrame
from priority.priority import MissingStreamError, PriorityError, TooManyStreamsError

from stargate.asgi import (
    BODY_FOLLOWS,
    DISCONNECT_HOOK,
    ASGIApp,
    ASGIMessage,
    ASGIReceive,
    ASGIScope,
    ASGISend,
    DisconnectHook,
    disconnect_hook,
)
from stargate.h2_send_order import RoundRobin

__all__ = ["apply", "complete_response_before_disconnect", "leave"]

log = logging.getLogger(__name__)

_applied = False

# h2 states in which this side may still send on a stream (neither ended by us nor reset).
_SENDABLE = frozenset({StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE})


def apply() -> None:
    """Install the fixes (idempotent)."""
    global _applied
    if _applied:
        return
    _applied = True
    _fix_late_data()
    _fix_back_pressure()
    _fix_stream_lifecycle()
    _contain_connection_failures()
    _fix_send_during_close()
    _write_at_once()
    _hook_disconnects()
    _write_head_with_body()
    _restart_idle_timers_at_once()
    _send_in_turn()
    _wait_for_first_request()


# --- pgjones/hypercorn#329, refused streams, GOAWAY rotation: what the connection receives -------


def _fix_late_data() -> None:
    original = H2Protocol._handle_events

    async def handle_events(self: H2Protocol, events: list[h2.events.Event]) -> None:
        # One event at a time: an earlier event of the same batch may create the stream.
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                try:
                    self.connection.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
                    if event.stream_id not in self.stream_buffers:
                        # RFC 9113 §8.1: the response is complete; ask the client to stop sending.
                        self.connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)
                except h2.exceptions.ProtocolError:
                    pass  # h2 already considers the stream closed
                continue
            if isinstance(event, h2.events.RequestReceived):
                await _receive_request(self, event)
                continue
            await original(self, [event])
        # Always, as the original does: h2 may have queued frames (a RST_STREAM for DATA on a
        # stream it knows is closed) even for a batch that produced no events.
        await self._flush()

    H2Protocol._handle_events = handle_events  # type: ignore[method-assign]


@dataclass
class _Rotation:
    """An HTTP/2 connection that sent GOAWAY: it serves streams up to `last_stream_id`, then
    closes once `drained` (no stream left)."""

    last_stream_id: int
    drained: trio.Event = field(default_factory=trio.Event)


_rotations: weakref.WeakKeyDictionary[H2Protocol, _Rotation] = weakref.WeakKeyDictionary()
# Every HTTP/2 connection that has received a request, so `leave` can reach the idle ones.
_connections: weakref.WeakSet[H2Protocol] = weakref.WeakSet()


def leave(config: HypercornConfig) -> None:
    """Ask every client of the listener served with `config` to move to another server, without
    failing a request (the leave phase of a shutdown, docs/rolling-restarts.md).

    From now on every HTTP/1.1 answer carries `Connection: close` and the connection closes after
    it; every HTTP/2 connection gets the graceful GOAWAY of the rotation (streams in flight
    finish, and so does a request already on its way). The listener keeps accepting: a client
    that still connects is served the same way.
    """
    config.keep_alive_max_requests = 0
    for proto in list(_connections):
        if proto.config is config and not proto.closed and proto not in _rotations:
            proto.task_group.spawn(_rotate, proto)


async def _rotate(proto: H2Protocol) -> None:
    if proto not in _rotations and not proto.closed:
        await _begin_rotation(proto, proto.connection.highest_inbound_stream_id)


async def _receive_request(proto: H2Protocol, event: h2.events.RequestReceived) -> None:
    """Hypercorn's handling of a new stream, with the full tree and the rotation limit fixed."""
    stream_id = event.stream_id
    _connections.add(proto)
    if proto.context.terminated.is_set():  # shutting down: as Hypercorn does
        proto.connection.reset_stream(stream_id)
        proto.connection.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0})
        return
    rotation = _rotations.get(proto)
    if rotation is not None and stream_id > rotation.last_stream_id:
        _refuse(proto, stream_id)  # sent before the client saw our GOAWAY; it may retry
        return
    try:
        await proto._create_stream(event)
    except TooManyStreamsError:
        # Raised before the app was started for it: nothing else refers to the stream.
        proto.streams.pop(stream_id, None)
        proto.stream_buffers.pop(stream_id, None)
        log.warning(
            "HTTP/2 connection from %s: priority tree full, refusing stream %d",
            _address(proto.client),
            stream_id,
        )
        _refuse(proto, stream_id)
        return
    await proto.send(Updated(idle=False))
    if rotation is None and proto.keep_alive_requests >= proto.config.keep_alive_max_requests:
        await _begin_rotation(proto, stream_id)


def _refuse(proto: H2Protocol, stream_id: int) -> None:
    with contextlib.suppress(h2.exceptions.ProtocolError):
        proto.connection.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)


async def _begin_rotation(proto: H2Protocol, last_stream_id: int) -> None:
    """Send GOAWAY without h2's `close_connection()`, which would fail the streams in flight.

    h2 keeps no record of this GOAWAY, so it goes on sending and receiving on the open streams.
    """
    rotation = _Rotation(last_stream_id)
    _rotations[proto] = rotation
    goaway = GoAwayFrame(
        stream_id=0, last_stream_id=last_stream_id, error_code=h2.errors.ErrorCodes.NO_ERROR
    )
    await proto._flush()
    await proto.send(RawData(data=goaway.serialize()))
    # In the connection's own task group: neither a stream's app nor its cancellation is involved.
    proto.task_group.spawn(_close_when_drained, proto, rotation)


async def _close_when_drained(proto: H2Protocol, rotation: _Rotation) -> None:
    await rotation.drained.wait()
    if not proto.closed:
        await proto._flush()
        await proto.send(Closed())


def _check_drained(proto: H2Protocol) -> None:
    rotation = _rotations.get(proto)
    if rotation is not None and not proto.streams and not proto.stream_buffers:
        rotation.drained.set()


def _address(address: tuple[str, int] | None) -> str:
    return "unknown" if address is None else f"{address[0]}:{address[1]}"


# --- HTTP/2 back-pressure ------------------------------------------------------------------------


def _fix_back_pressure() -> None:
    async def pop(self: StreamBuffer, max_length: int) -> bytes:
        length = min(len(self.buffer), max_length)
        data = bytes(self.buffer[:length])
        del self.buffer[:length]
        if len(self.buffer) < BUFFER_LOW_WATER:  # upstream tests len(data): see the docstring
            await self._paused.set()
        if len(self.buffer) == 0:
            await self._is_empty.set()
        return data

    StreamBuffer.pop = pop  # type: ignore[method-assign]


# --- HTTP/2 stream lifecycle ---------------------------------------------------------------------


def _can_send(proto: H2Protocol, stream_id: int) -> bool:
    """Whether h2 still lets this side send on the stream."""
    stream = proto.connection.streams.get(stream_id)
    return stream is not None and stream.state_machine.state in _SENDABLE


def _forget(proto: H2Protocol, stream_id: int) -> StreamBuffer | None:
    """Take the stream off the send side: its buffer and its place in the priority tree."""
    buffer = proto.stream_buffers.pop(stream_id, None)
    with contextlib.suppress(MissingStreamError):
        proto.priority.remove_stream(stream_id)
    _check_drained(proto)
    return buffer


async def _release(proto: H2Protocol, stream_id: int) -> None:
    """Forget the stream, and wake an app task paused in its buffer's `push` or `drain`."""
    buffer = _forget(proto, stream_id)
    if buffer is not None:
        await buffer.close()


def _fix_stream_lifecycle() -> None:
    original_handle = H2Protocol.handle
    original_stream_send = H2Protocol.stream_send
    original_close_stream = H2Protocol._close_stream

    async def send_data(self: H2Protocol, stream_id: int) -> None:
        """The send task's turn for one stream (replaces Hypercorn's `_send_data`)."""
        buffer = self.stream_buffers.get(stream_id)
        if buffer is None:  # forgotten since the scheduler picked it
            with contextlib.suppress(MissingStreamError):
                self.priority.remove_stream(stream_id)
            return
        try:
            chunk_size = max(
                0,
                min(
                    self.connection.local_flow_control_window(stream_id),
                    self.connection.max_outbound_frame_size,
                ),
            )
            data = await buffer.pop(chunk_size)  # never yields: h2 gets `data` before anyone runs
            if buffer.complete:
                # The last byte: END_STREAM goes with it now, not on a later turn, which the
                # scheduler can postpone for as long as newer streams keep arriving.
                self.connection.send_data(stream_id, data, end_stream=True)
                _forget(self, stream_id)
            elif data:
                self.connection.send_data(stream_id, data)
            else:
                self.priority.block(stream_id)
                return
            await self._flush()
        except (h2.exceptions.ProtocolError, MissingStreamError):
            # The stream or the connection closed while this stream waited to send.
            await _release(self, stream_id)

    async def stream_send(self: H2Protocol, event: StreamEvent) -> None:
        if isinstance(event, EndBody | EndData):
            await _end_body(self, event.stream_id)
        elif isinstance(event, Trailers):
            await _send_trailers(self, event)
        else:
            await original_stream_send(self, event)

    async def close_stream(self: H2Protocol, stream_id: int) -> None:
        """The exchange is over (app finished, client reset, or connection closed)."""
        buffer = self.stream_buffers.get(stream_id)
        if buffer is not None:
            if self.closed or not _can_send(self, stream_id):
                await _release(self, stream_id)
            elif not buffer._complete:
                # The app stopped before completing its response (it failed mid-body, or before
                # its trailers): without a reset the client would wait for the rest forever.
                with contextlib.suppress(h2.exceptions.ProtocolError):
                    self.connection.reset_stream(stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
                await _release(self, stream_id)
                await self._flush()
            # Otherwise the response is complete with data still queued: the send task ends it.
        await original_close_stream(self, stream_id)
        _check_drained(self)

    async def handle(self: H2Protocol, event: IOEvent) -> None:
        await original_handle(self, event)
        if isinstance(event, Closed):
            # Streams whose app had finished but whose last bytes were still queued.
            for stream_id in list(self.stream_buffers):
                await _release(self, stream_id)
            _check_drained(self)

    async def priority_updated(self: H2Protocol, event: h2.events.PriorityUpdated) -> None:
        stream_id = event.stream_id
        if stream_id in self.stream_buffers:
            depends_on = event.depends_on if event.depends_on in self.stream_buffers else None
            with contextlib.suppress(PriorityError):
                self.priority.reprioritize(
                    stream_id=stream_id,
                    depends_on=depends_on,
                    weight=16 if event.weight is None else event.weight,
                    exclusive=bool(event.exclusive),
                )
        await self.has_data.set()

    H2Protocol._send_data = send_data  # type: ignore[method-assign]
    H2Protocol.stream_send = stream_send  # type: ignore[method-assign]
    H2Protocol._close_stream = close_stream  # type: ignore[method-assign]
    H2Protocol.handle = handle  # type: ignore[method-assign]
    H2Protocol._priority_updated = priority_updated  # type: ignore[method-assign]


async def _end_body(proto: H2Protocol, stream_id: int) -> None:
    """The app's response body is complete."""
    buffer = proto.stream_buffers.get(stream_id)
    if buffer is None:
        return  # ended already: reset, or closed by trailers
    buffer.set_complete()
    if buffer.buffer:
        # Data still queued: the send task sends END_STREAM with the last of it.
        with contextlib.suppress(MissingStreamError):
            proto.priority.unblock(stream_id)
        await proto.has_data.set()
        await buffer.drain()
        return
    # Everything is with h2 already (`pop` hands data over without yielding): end it here.
    with contextlib.suppress(h2.exceptions.ProtocolError):
        proto.connection.end_stream(stream_id)
    _forget(proto, stream_id)
    await proto._flush()


async def _send_trailers(proto: H2Protocol, event: Trailers) -> None:
    """Trailers end the stream: nothing can be sent on it afterwards."""
    stream_id = event.stream_id
    buffer = proto.stream_buffers.get(stream_id)
    if buffer is None:
        return
    if buffer.buffer:
        with contextlib.suppress(MissingStreamError):
            proto.priority.unblock(stream_id)
        await proto.has_data.set()
        await buffer.drain()
        if proto.stream_buffers.get(stream_id) is not buffer:
            return  # reset while its body drained
    with contextlib.suppress(h2.exceptions.ProtocolError):
        proto.connection.send_headers(stream_id, event.headers, end_stream=True)
    _forget(proto, stream_id)
    await proto._flush()


def _send_in_turn() -> None:
    """Streams take turns to send in round robin (stargate/h2_send_order.py), not through the
    RFC 7540 priority tree, whose per-turn cost was a sixth of the replica's CPU with a thousand
    Pylons (docs/performance.md)."""
    original_init = H2Protocol.__init__

    def init(self: H2Protocol, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.priority = RoundRobin()  # type: ignore[assignment]

    H2Protocol.__init__ = init  # type: ignore[method-assign]


# --- contained connection failures ---------------------------------------------------------------


def _contain_connection_failures() -> None:
    original_run = TCPServer.run

    async def run(self: TCPServer) -> None:
        peer = _peer(self.stream)
        try:
            await original_run(self)
        except* Exception as group:  # trio.Cancelled and KeyboardInterrupt are not Exceptions
            log.error(
                "closing the connection from %s after an unexpected error in its task",
                peer,
                exc_info=group,
            )
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self.stream.aclose()

    TCPServer.run = run  # type: ignore[method-assign]


def _fix_send_during_close() -> None:
    original_protocol_send = TCPServer.protocol_send

    async def protocol_send(self: TCPServer, event: IOEvent) -> None:
        try:
            await original_protocol_send(self, event)
        except trio.BusyResourceError:
            # Sends hold `send_lock`; only `_close`'s `send_eof` does not: the connection is
            # closing under this send, as if it had already closed (the original's handling).
            if not isinstance(event, RawData):
                raise
            await self.protocol.handle(Closed())

    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]


def _write_at_once() -> None:
    """Write a connection's bytes in one non-blocking `write` when the socket takes them all.

    Hypercorn's `protocol_send` takes the connection's send lock, opens a shielded cancel scope
    and calls trio's `send_all` for every write: two trips through the scheduler (the lock's
    checkpoint, and the one trio makes after a successful send) and four context managers, about
    30 us, for what is usually one `send(2)` the kernel completes at once. That is most of the
    per-chunk cost of a relayed SSE stream, and every response pays it twice (head, then body;
    docs/http-serving.md, "Writes"). When the lock is free and the stream is a plain TCP socket,
    this takes the lock without waiting, writes directly, and returns without yielding if the
    kernel took everything; what it did not take is sent as before (shielded, under the lock), so
    order and completeness are as before. An empty write (the end of a body framed by
    `content-length`) writes nothing. It is still a cancellation point, as the lock was; anything
    else (TLS, a busy lock, a closed or half-closed socket, events that are not writes) takes
    Hypercorn's path.
    """
    original_protocol_send = TCPServer.protocol_send

    async def protocol_send(self: TCPServer, event: IOEvent) -> None:
        stream: trio.abc.Stream = self.stream  # annotated as TLS; plain TCP is a SocketStream
        lock = self.send_lock
        if type(event) is not RawData or not isinstance(stream, trio.SocketStream) or lock.locked():
            await original_protocol_send(self, event)
            return
        sock = stream.socket
        fd = sock.fileno()
        if fd < 0 or sock.did_shutdown_SHUT_WR:
            await original_protocol_send(self, event)  # closed: the original's handling
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        data = event.data
        if not data:
            return
        closed = False
        lock.acquire_nowait()
        try:
            try:
                sent = os.write(fd, data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                with trio.CancelScope(shield=True):
                    await stream.send_all(memoryview(data)[sent:])
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            closed = True
        except trio.BusyResourceError:
            closed = True  # `_close` is half-closing the socket (`_fix_send_during_close`)
        finally:
            lock.release()
        if closed:
            await self.protocol.handle(Closed())

    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]


def _restart_idle_timers_at_once() -> None:
    """Restart and stop a connection's keep-alive timer without going through the scheduler.

    Hypercorn stops the timer when a request arrives and restarts it when the response is done:
    each under an async lock (a checkpoint, so a trip through the scheduler) and the restart
    with `nursery.start`, which waits for the new timer task to run up to its `started()`.
    Together about 45 us a request, for a replica and a bare app alike (docs/http-serving.md,
    "Keep-alive timer"). Neither needs to wait: the new task gets its cancel scope up front
    (`start_soon`), so cancelling it before it runs is the same as cancelling it after, and
    with no await between reading and replacing the handle there is nothing for the lock to
    serialise. The timer itself (`TCPServer._idle_timeout`) is unchanged.
    """

    async def run_in(scope: trio.CancelScope, action: Callable[[], Awaitable[None]]) -> None:
        if scope.cancel_called:
            return  # stopped or restarted before it ran
        with scope:
            await action()

    async def restart(
        self: TrioSingleTask, task_group: Any, action: Callable[[], Awaitable[None]]
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
        scope = self._handle = trio.CancelScope()
        task_group._nursery.start_soon(run_in, scope, action)

    async def stop(self: TrioSingleTask) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None

    TrioSingleTask.restart = restart  # type: ignore[method-assign]
    TrioSingleTask.stop = stop  # type: ignore[method-assign]


def _wait_for_first_request() -> None:
    """Through the drain, give a connection without a request yet its keep-alive timeout."""

    async def idle_timeout(self: TCPServer) -> None:
        with trio.move_on_after(self.config.keep_alive_timeout):
            await self.context.terminated.wait()
            if not _had_request(self):
                await trio.sleep_forever()  # until its first request stops this timer
        with trio.CancelScope(shield=True):
            await self._initiate_server_close()

    TCPServer._idle_timeout = idle_timeout  # type: ignore[method-assign]


def _had_request(server: TCPServer) -> bool:
    """Whether the connection has received a request (a complete request head) yet."""
    protocol = server.protocol.protocol
    if isinstance(protocol, H2Protocol):
        return bool(protocol.connection.highest_inbound_stream_id)
    connection = protocol.connection  # h11, or a WebSocket's (upgraded by a request)
    return not isinstance(connection, h11.Connection) or connection.their_http_version is not None


def _peer(stream: object) -> str:
    # A TLS connection (`trio.SSLStream`) has its socket on the stream it wraps.
    stream = getattr(stream, "transport_stream", stream)
    sock = getattr(stream, "socket", None)
    try:
        host, port = sock.getpeername()[:2]  # type: ignore[union-attr]
    except (AttributeError, OSError):
        return "unknown"
    return f"{host}:{port}"


def _write_head_with_body() -> None:
    """On HTTP/1.1, write a response head marked `BODY_FOLLOWS` (stargate/asgi.py) together with
    the body message the app sends next: one write, one TCP segment, instead of two.

    Hypercorn writes the head the moment the app sends `http.response.start`, so every response
    cost two writes, each a `send(2)` of some 25 us of kernel time on loopback (a third of what
    the replica adds to a request goes to syscalls; docs/http-serving.md, "Head with the body").
    The proxy sets the key only when it already holds body bytes to send right after the head,
    so nothing waits for it: a head whose first chunk has not arrived is written at once, as
    before. The held head is written with the next message of the exchange whatever it is (the
    body, its end, or the end of the exchange should the app stop first); HTTP/2 ignores the key.
    """
    original_app_send = HTTPStream.app_send
    original_send_h11_event = H11Protocol._send_h11_event
    original_stream_send = H11Protocol.stream_send

    async def app_send(self: HTTPStream, message: Any) -> None:
        if message is not None and message.get(BODY_FOLLOWS) is True:
            self.stargate_body_follows = True  # type: ignore[attr-defined]
        await original_app_send(self, message)

    async def send_h11_event(self: H11Protocol, event: Any) -> None:
        held: bytes | None = getattr(self, "stargate_head", None)
        if held is None:
            stream = self.stream
            if type(event) is h11.Response and getattr(stream, "stargate_body_follows", False):
                stream.stargate_body_follows = False  # type: ignore[union-attr]
                try:
                    data = self.connection.send(event)
                except h11.LocalProtocolError:
                    if self.connection.their_state != h11.ERROR:
                        raise
                    return
                self.stargate_head = data  # type: ignore[attr-defined]
                return
            await original_send_h11_event(self, event)
            return
        self.stargate_head = None  # type: ignore[attr-defined]
        try:
            data = self.connection.send(event) or b""
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            data = b""
        await self.send(RawData(data=held + data))

    async def stream_send(self: H11Protocol, event: StreamEvent) -> None:
        held: bytes | None = getattr(self, "stargate_head", None)
        if held is not None and isinstance(event, StreamClosed):
            self.stargate_head = None  # type: ignore[attr-defined]
            await self.send(RawData(data=held))  # the app ended before its body
        await original_stream_send(self, event)

    HTTPStream.app_send = app_send  # type: ignore[method-assign]
    H11Protocol._send_h11_event = send_h11_event  # type: ignore[method-assign]
    H11Protocol.stream_send = stream_send  # type: ignore[method-assign]


def _hook_disconnects() -> None:
    """Give every HTTP exchange a `DisconnectHook` (stargate/asgi.py) in its scope's extensions,
    fired where Hypercorn queues `http.disconnect` for the app.

    Not a fix of Hypercorn: it lets the proxy stop its upstream work when its client leaves
    without a second task per request waiting in `receive()` (docs/data-plane.md,
    "Cancellation"). Every message Hypercorn queues for the app still reaches `receive()`.
    """
    original_spawn_app = TaskGroup.spawn_app

    async def spawn_app(
        self: TaskGroup,
        app: Any,
        config: HypercornConfig,
        scope: Any,
        send: Callable[[Any], Awaitable[None]],
    ) -> Callable[[Any], Awaitable[None]]:
        if scope["type"] != "http":
            return await original_spawn_app(self, app, config, scope, send)
        hook = DisconnectHook()
        scope["extensions"][DISCONNECT_HOOK] = hook
        put = await original_spawn_app(self, app, config, scope, send)

        async def app_put(message: Any) -> None:
            if message["type"] == "http.disconnect":
                hook.fire()
            await put(message)

        return app_put

    TaskGroup.spawn_app = spawn_app  # type: ignore[method-assign]


# --- responses complete before http.disconnect ---------------------------------------------------


def complete_response_before_disconnect(app: ASGIApp) -> ASGIApp:
    """Wrap `app` so Hypercorn can finish a response before the app hears `http.disconnect`.

    While the `send()` that completes the response runs, an `http.disconnect` it produces is held
    back from `receive()` until that `send()` returns; nothing is shielded, so a shutdown can
    still cancel the app. Every other disconnect (a client leaving mid-stream) is delivered at
    once, so the proxy still cancels its upstream request within milliseconds.
    """

    async def wrapped(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        completing: trio.Event | None = None
        hook = disconnect_hook(scope)

        async def send_final(message: ASGIMessage) -> None:
            nonlocal completing
            if not _completes_response(message):
                await send(message)
                return
            completing = trio.Event()
            if hook is not None:
                hook.completing = True  # the same hold for the hook's callback
            try:
                await send(message)
            finally:
                completing.set()

        async def receive_held() -> ASGIMessage:
            message = await receive()
            if message["type"] == "http.disconnect" and completing is not None:
                await completing.wait()
            return message

        await app(scope, receive_held, send_final)

    return wrapped


def _completes_response(message: ASGIMessage) -> bool:
    kind = message["type"]
    if kind == "http.response.body":
        return not message.get("more_body", False)
    if kind == "http.response.trailers":
        return not message.get("more_trailers", False)
    return False
