"""Patches of Hypercorn's HTTP/2 protocol (`H2Protocol`, `StreamBuffer`): late DATA
(pgjones/hypercorn#329), back-pressure, the stream lifecycle, a full tree refusing the stream,
graceful GOAWAY rotation (and `leave`, which uses it), and the round-robin send order
(docs/http-serving.md, "The fixes, and why"; docs/performance.md, "Control plane").
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from h2.stream import StreamState
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, RawData, Updated
from hypercorn.events import Event as IOEvent
from hypercorn.protocol.events import EndBody, EndData, Trailers
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h2 import BUFFER_LOW_WATER, H2Protocol, StreamBuffer
from hyperframe.frame import GoAwayFrame
from priority.priority import MissingStreamError, PriorityError, TooManyStreamsError

from stargate.h2_send_order import RoundRobin
from stargate.hypercorn_patches import limits
from stargate.hypercorn_patches.state import (
    REFUSES_STREAMS,
    Rotation,
    listener,
    listener_if_any,
    log,
    rotation_of,
    set_rotation,
)

__all__ = [
    "close_stream",
    "handle",
    "handle_events",
    "init",
    "leave",
    "pop",
    "priority_updated",
    "send_data",
    "stream_send",
]

# h2 states in which this side may still send on a stream (neither ended by us nor reset).
_SENDABLE = frozenset({StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE})

Init = Callable[..., None]
HandleEvents = Callable[[H2Protocol, list[h2.events.Event]], Awaitable[None]]
Handle = Callable[[H2Protocol, IOEvent], Awaitable[None]]
StreamSend = Callable[[H2Protocol, StreamEvent], Awaitable[None]]
CloseStream = Callable[[H2Protocol, int], Awaitable[None]]


# --- the send order (a cost; docs/performance.md, "Control plane") --------------------------------


def init(original: Init) -> Init:
    """`H2Protocol.__init__`: streams take turns to send in round robin
    (stargate/h2_send_order.py), not through the RFC 7540 priority tree, whose per-turn cost was
    a sixth of the replica's CPU with a thousand Pylons."""

    def init(self: H2Protocol, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.priority = RoundRobin()  # type: ignore[assignment]

    return init


# --- what the connection receives: pgjones/hypercorn#329, refused streams, GOAWAY rotation -------


def handle_events(original: HandleEvents) -> HandleEvents:
    """`H2Protocol._handle_events`, one event at a time (an earlier event of the same batch may
    create the stream):

    * DATA for a stream whose response is already complete made Hypercorn raise `KeyError` in
      the connection task (pgjones/hypercorn#329). It is dropped, its bytes still returned to the
      flow-control window so the connection's other streams keep flowing, and the stream is reset
      with NO_ERROR (RFC 9113 §8.1) so the client stops sending.
    * A new stream (`_receive_request`, Hypercorn's handling with two fixes and a feature): a
      full tree refuses it with REFUSED_STREAM, the rotation limit sends a graceful GOAWAY instead
      of h2's `close_connection()`, and a connection admitted past the client-connection cap
      (`state.REFUSES_STREAMS`) gets REFUSED_STREAM for each stream and a GOAWAY naming stream 0.
    * Every other event goes to Hypercorn's own handling.
    """

    async def handle_events(self: H2Protocol, events: list[h2.events.Event]) -> None:
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

    return handle_events


def leave(config: HypercornConfig) -> None:
    """Ask every client of the listener served with `config` to move to another server, without
    failing a request (the leave phase of a shutdown, docs/rolling-restarts.md).

    From now on every HTTP/1.1 answer carries `Connection: close` and the connection closes after
    it; every HTTP/2 connection gets the graceful GOAWAY of the rotation (streams in flight
    finish, and so does a request already on its way). The listener keeps accepting: a client
    that still connects is served the same way.
    """
    config.keep_alive_max_requests = 0
    state = listener_if_any(config)
    if state is None:
        return
    for proto in list(state.h2_connections):
        if not proto.closed and rotation_of(proto) is None:
            proto.task_group.spawn(_rotate, proto)


async def _rotate(proto: H2Protocol) -> None:
    if rotation_of(proto) is None and not proto.closed:
        await _begin_rotation(proto, proto.connection.highest_inbound_stream_id)


async def _receive_request(proto: H2Protocol, event: h2.events.RequestReceived) -> None:
    """Hypercorn's handling of a new stream, with the full tree and the rotation limit fixed."""
    stream_id = event.stream_id
    listener(proto.config).h2_connections.add(proto)
    if proto.context.terminated.is_set():  # shutting down: as Hypercorn does
        proto.connection.reset_stream(stream_id)
        proto.connection.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0})
        return
    rotation = rotation_of(proto)
    if rotation is None and getattr(proto.app, REFUSES_STREAMS, False):
        # Admitted only to be told it is full (limits.py): this stream is refused, then GOAWAY
        # names stream 0, so nothing was processed and every request may be retried elsewhere
        # (RST_STREAM first: a client may take nothing after a GOAWAY); later streams are refused
        # below. The connection closes when the client leaves, or at its deadline: not at once,
        # since a close with the client's next frames (its SETTINGS ACK) unread would reset the
        # connection and could lose the GOAWAY before the client has read it.
        _refuse(proto, stream_id)
        await _begin_rotation(proto, 0)
        return
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
    rotation = Rotation(last_stream_id)
    set_rotation(proto, rotation)
    goaway = GoAwayFrame(
        stream_id=0, last_stream_id=last_stream_id, error_code=h2.errors.ErrorCodes.NO_ERROR
    )
    await proto._flush()
    await proto.send(RawData(data=goaway.serialize()))
    # In the connection's own task group: neither a stream's app nor its cancellation is involved.
    proto.task_group.spawn(_close_when_drained, proto, rotation)


async def _close_when_drained(proto: H2Protocol, rotation: Rotation) -> None:
    await rotation.drained.wait()
    if not proto.closed:
        await proto._flush()
        await proto.send(Closed())


def _check_drained(proto: H2Protocol) -> None:
    rotation = rotation_of(proto)
    if rotation is not None and not proto.streams and not proto.stream_buffers:
        rotation.drained.set()


def _address(address: tuple[str, int] | None) -> str:
    return "unknown" if address is None else f"{address[0]}:{address[1]}"


# --- back-pressure --------------------------------------------------------------------------------


async def pop(self: StreamBuffer, max_length: int) -> bytes:
    """`StreamBuffer.pop`, rewritten: a writer paused at the high-water mark is released once what
    is left in the buffer is below the low-water mark. Hypercorn released it whenever the popped
    chunk was small, including the zero-length pops made while the peer's flow-control window is
    0, so a client that stopped reading never paused the app, and the server buffered the whole
    response in memory."""
    length = min(len(self.buffer), max_length)
    data = bytes(self.buffer[:length])
    del self.buffer[:length]
    if len(self.buffer) < BUFFER_LOW_WATER:  # upstream tests len(data): see the docstring
        await self._paused.set()
    if len(self.buffer) == 0:
        await self._is_empty.set()
    return data


# --- the stream lifecycle -------------------------------------------------------------------------
#
# Hypercorn takes a stream out of its per-connection priority tree (which holds at most 1000) and
# out of its send buffers only when its send task next picks that stream after the response is
# complete. A stream the client resets before any response is left blocked in the tree and is
# never picked again; and under steady load the tree's scheduler keeps picking newer streams, so
# finished ones (a gRPC answer ended by its trailers) wait for a turn that does not come. Either
# way the tree fills, and at the 1000th leftover `TooManyStreamsError` escapes the connection
# task and the listener's server exits. These end every stream where it ends: END_STREAM is
# queued with the last byte handed to h2, trailers end the stream at once, and a reset by the
# client, a closed connection, or an app that stops before completing its response (whose client
# then gets RST_STREAM INTERNAL_ERROR rather than waiting forever) drop it too. PRIORITY frames
# for streams that are not open are ignored (RFC 9113 §5.3.2 deprecates that scheme) rather than
# parking placeholder streams in the tree.


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


async def send_data(self: H2Protocol, stream_id: int) -> None:
    """`H2Protocol._send_data`, rewritten: the send task's turn for one stream, which ends the
    stream with its last byte."""
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


def stream_send(original: StreamSend) -> StreamSend:
    """`H2Protocol.stream_send`: the end of a body and trailers end the stream at once; every
    other event goes to Hypercorn's own handling."""

    async def stream_send(self: H2Protocol, event: StreamEvent) -> None:
        if isinstance(event, EndBody | EndData):
            await _end_body(self, event.stream_id)
        elif isinstance(event, Trailers):
            await _send_trailers(self, event)
        else:
            await original(self, event)

    return stream_send


def close_stream(original: CloseStream) -> CloseStream:
    """`H2Protocol._close_stream`: the exchange is over (the app finished, the client reset the
    stream, or the connection closed). Two behaviours, in this order:

    1. The stream lifecycle: the stream leaves the send side (an app task paused in its buffer
       is woken); an app that stopped before completing its response has its stream reset with
       INTERNAL_ERROR (without it the client would wait for the rest forever); a response that is
       complete with data still queued is left to the send task, which ends it. Then Hypercorn's
       own close, and a rotating connection learns whether it has drained.
    2. On a limited listener (limits.py): a stream whose response is complete while its request
       body is not is reset with NO_ERROR, so the client may stop sending.

    2 reads the stream's h2 state as 1 and Hypercorn leave it: a stream 1 reset is closed, and
    gets no second reset.
    """

    async def close_stream(self: H2Protocol, stream_id: int) -> None:
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
        await original(self, stream_id)
        _check_drained(self)
        await limits.reset_answered_early(self, stream_id)

    return close_stream


def handle(original: Handle) -> Handle:
    """`H2Protocol.handle`: when the connection closes, the streams whose app had finished but
    whose last bytes were still queued leave the send side too."""

    async def handle(self: H2Protocol, event: IOEvent) -> None:
        await original(self, event)
        if isinstance(event, Closed):
            for stream_id in list(self.stream_buffers):
                await _release(self, stream_id)
            _check_drained(self)

    return handle


async def priority_updated(self: H2Protocol, event: h2.events.PriorityUpdated) -> None:
    """`H2Protocol._priority_updated`, rewritten: a PRIORITY frame for a stream that is not open
    is ignored instead of parking a placeholder stream in the tree (RFC 9113 §5.3.2 deprecates
    the scheme; a stream that depends on a missing one gets the default priority, as RFC 7540
    §5.3.1 asks)."""
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
