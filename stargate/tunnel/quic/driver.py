"""`QuicConnection`: a trio driver over aioquic's sans-IO connection (docs/tunnels.md).

Who does what:

* The endpoint's task owns the UDP socket. For each datagram it calls `receive_datagram`
  (aioquic's `receive_datagram`, then every pending event is dispatched), and `transmit` once per
  batch of datagrams.
* The connection's own task (`run`, started by the endpoint in a nursery that outlives it) owns
  the timer: it sleeps until aioquic's `get_timer()`, calls `handle_timer`, dispatches events and
  transmits. `transmit` moves that deadline, so an application write that arms an earlier timer
  takes effect at once. `run` returns when the connection is terminated (idle timeout, the
  peer's close after its draining period, our close after its closing period).
* Application tasks call the async methods here and on `QuicStream`; every write ends with
  `transmit` (datagrams go out synchronously on the non-blocking socket).

The clock is `trio.current_time()` everywhere. Stream events go to the streams this side opened
or accepted; events of peer streams not accepted yet are kept, in arrival order, until
`accept_stream` claims their stream or an `event_handler` is installed (an HTTP/3 layer), which
then receives them all in their original order and every later event of an unclaimed stream.

A connection is "closing" from our `close`, the peer's CONNECTION_CLOSE or a local protocol error
on: from then on streams fail (readers get `StreamReset(0, "connection closed")`, writers
`StreamClosed`) and nothing new can be opened or accepted (`ConnectionClosed`).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable

import trio
from aioquic.quic import events
from aioquic.quic.connection import NetworkAddress

from .errors import ConnectFailed, ConnectionClosed
from .flow import FlowQuic
from .streams import QuicStream
from .tls import TunnelConfiguration

__all__ = ["SEND_HIGH_WATER", "EventHandler", "QuicConnection"]

logger = logging.getLogger("stargate.tunnel")

SEND_HIGH_WATER = 256 * 1024
"""Default bound on a stream's unsent backlog in aioquic before `send` waits."""

EventHandler = Callable[[events.QuicEvent], None]
StreamEvent = events.StreamDataReceived | events.StreamReset | events.StopSendingReceived
_STREAM_EVENTS = (events.StreamDataReceived, events.StreamReset, events.StopSendingReceived)

UNCLAIMED_SLACK = 16
AIOQUIC_MAX_STREAMS = 128
"""aioquic's own stream limits, when the configuration is not a `TunnelConfiguration`."""

CRYPTO_ERROR = 0x100
"""QUIC's transport error for a TLS alert: 0x100 + the alert (120: no ALPN in common)."""
INTERNAL_ERROR = 0x1
"""The application close code used when an event handler raises."""


def describe_termination(event: events.ConnectionTerminated) -> str:
    """A human-readable close reason: the phrase, and the code (a TLS alert for 0x1xx)."""
    reason = event.reason_phrase or "no reason given"
    if CRYPTO_ERROR <= event.error_code <= CRYPTO_ERROR + 0xFF:
        return f"TLS handshake failed: {reason} (TLS alert {event.error_code - CRYPTO_ERROR})"
    return f"{reason} (error code {event.error_code:#x})"


class QuicConnection:
    """One QUIC connection (client or server side) driven by trio; see the module docstring.

    Created by the endpoint (`endpoint.connect`, `endpoint.serve`), which passes `quic` (not yet
    connected for a client, before its first datagram for a server) and the function that sends
    one datagram without blocking.
    """

    def __init__(self, quic: FlowQuic, *, send_datagram: Callable[[bytes, NetworkAddress], None]):
        self._quic = quic
        self._send_datagram = send_datagram
        self.send_high_water = SEND_HIGH_WATER
        """Unsent backlog per stream above which `QuicStream.send` waits."""

        self._streams: dict[int, QuicStream] = {}
        self._unclaimed: set[int] = set()
        self._accept_queue: deque[int] = deque()
        self._pending: deque[StreamEvent] = deque()
        self._known_peer_streams: dict[int, int] = {}  # stream type (id % 4) -> count seen
        self._event_handler: EventHandler | None = None
        configuration = quic.configuration
        self._unclaimed_limit = UNCLAIMED_SLACK + (
            configuration.max_streams_bidi + configuration.max_streams_uni
            if isinstance(configuration, TunnelConfiguration)
            else 2 * AIOQUIC_MAX_STREAMS
        )

        self._established = False
        self._closing = False
        self._terminated = False
        self._close_reason = ""
        self._alpn: str | None = None
        self._closed = trio.Event()
        self._state_changed = trio.lowlevel.ParkingLot()
        self._stream_accepted = trio.lowlevel.ParkingLot()
        self._stream_credit = trio.lowlevel.ParkingLot()
        self._blocked_writers: set[QuicStream] = set()
        self._timer_scope: trio.CancelScope | None = None
        self._transmit_due = False
        self._peer_max_streams = 0
        self._quic_streams_at_sweep = 0

        # The endpoint's hooks, called synchronously from event dispatch.
        self.on_established: Callable[[QuicConnection], None] | None = None
        self.on_terminated: Callable[[QuicConnection], None] | None = None
        self.on_cid_issued: Callable[[bytes], None] | None = None
        self.on_cid_retired: Callable[[bytes], None] | None = None

    def __repr__(self) -> str:
        role = "client" if self._quic.configuration.is_client else "server"
        state = "open" if self.is_open else ("closed" if self._closing else "handshaking")
        return f"<QuicConnection {role} {self.remote_address} {state}>"

    # Public state.

    @property
    def quic(self) -> FlowQuic:
        """The aioquic connection (for an HTTP/3 layer; call `transmit` after using it)."""
        return self._quic

    @property
    def established(self) -> bool:
        """The handshake completed (whatever happened since)."""
        return self._established

    @property
    def is_open(self) -> bool:
        """Handshake done and not closing."""
        return self._established and not self._closing

    @property
    def alpn(self) -> str | None:
        """The negotiated ALPN protocol (None for raw-QUIC, or before the handshake)."""
        return self._alpn

    @property
    def remote_address(self) -> NetworkAddress | None:
        return self._quic.get_peer_address()

    @property
    def close_reason(self) -> str:
        """Why the connection is closing ("" while it is not)."""
        return self._close_reason

    @property
    def open_request_streams(self) -> int:
        """Bidirectional streams aioquic still holds (neither finished nor discarded): the
        requests in flight on this connection."""
        return sum(1 for stream_id in self._quic._streams if not stream_id & 2)

    async def wait_closed(self) -> None:
        """Wait until the connection is terminated and its task has finished with it."""
        await self._closed.wait()

    # Streams.

    async def open_stream(self) -> QuicStream:
        """Open our next bidirectional stream (client 0, 4, 8...; server 1, 5, 9...). Waits
        while the peer's MAX_STREAMS does not allow one more (cancellable: the caller bounds
        the wait). Raises `ConnectionClosed` once the connection is closing."""
        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while True:
            if self._closing:
                raise ConnectionClosed(self._closed_message())
            stream_id = self._quic.get_next_available_stream_id()
            if self._established and stream_id // 4 < self._quic._remote_max_streams_bidi:
                break
            await self._stream_credit.park()
            parked = True
        self._quic.consumed[stream_id] = 0
        self._quic.send_stream_data(stream_id, b"")  # creates it in aioquic, sends nothing
        stream = self._streams[stream_id] = QuicStream(self, stream_id)
        if not parked:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return stream

    async def accept_stream(self) -> QuicStream:
        """The next bidirectional stream the peer opened, in stream id order (a stream counts
        as opened once a frame for it or for a later stream of its type arrived). Raises
        `ConnectionClosed` once the connection is closing, and `RuntimeError` once an
        `event_handler` is installed (peer streams then go to it)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while True:
            if self._closing:
                raise ConnectionClosed(self._closed_message())
            if self._accept_queue:
                break
            if self._event_handler is not None:
                raise RuntimeError("the peer's streams go to the connection's event handler")
            await self._stream_accepted.park()
            parked = True
        stream = self._claim(self._accept_queue.popleft())
        if not parked:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return stream

    @property
    def event_handler(self) -> EventHandler | None:
        """The HTTP/3 hook: once set, every stream event of a stream not opened or accepted here
        (and DATAGRAM frames) is passed to it, synchronously, in the endpoint's task; the events
        kept so far are replayed to it first, in arrival order. It must not block; if it raises,
        the connection is closed (code 0x1). Set once; `accept_stream` stops working."""
        return self._event_handler

    @event_handler.setter
    def event_handler(self, handler: EventHandler | None) -> None:
        if handler is None:
            raise ValueError("the event handler cannot be removed")
        if self._event_handler is not None:
            raise RuntimeError("the event handler is already set")
        self._event_handler = handler
        pending, self._pending = self._pending, deque()
        for stream_id in self._unclaimed:  # credit now follows delivery (flow.py)
            self._quic.consumed.pop(stream_id, None)
        self._unclaimed.clear()
        self._accept_queue.clear()
        self._stream_accepted.unpark_all()
        for event in pending:
            self._call_handler(event)
        self.transmit()

    # Closing.

    def close(self, code: int = 0, reason: str = "") -> None:
        """Close the connection with an application error code (CONNECTION_CLOSE sent at once).
        Streams fail immediately; `wait_closed` returns after the closing period (3 PTO).
        Never waits; idempotent."""
        if self._closing:
            return
        self._quic.close(error_code=code, reason_phrase=reason)
        self._begin_closing(f"closed by this side: {reason or 'no reason given'} (code {code})")
        self.transmit()

    def abort(self, reason: str) -> None:
        """Close (code 0, best effort) and terminate now, without a closing period: for a dial
        that failed and for a connection whose task is cancelled. Never waits; idempotent."""
        if self._terminated:
            return
        was_closing = self._closing
        self._begin_closing(reason)
        if not was_closing:
            self._quic.close(error_code=0, reason_phrase="")
            self.transmit()
        self._terminate(reason)

    # The endpoint's side.

    def receive_datagram(self, data: bytes, addr: NetworkAddress) -> None:
        """Feed one datagram and dispatch its events; the endpoint calls `transmit` after the
        batch. Never waits."""
        if self._terminated:
            return
        self._quic.receive_datagram(data, addr, now=trio.current_time())
        self._process_events()

    def transmit_soon(self) -> None:
        """Send what is queued at the end of this loop turn: the connection's task wakes once
        every task that ran in this turn has written, so their frames share packets, one
        `datagrams_to_send` pass and fewer syscalls (a stream's writes, other streams', the ACKs
        and credit of what was read). Without a running task (during the handshake), at once.
        Never waits."""
        if self._transmit_due or self._terminated:
            return
        self._transmit_due = True
        if self._timer_scope is not None:
            self._timer_scope.deadline = -math.inf  # wake `run` after this turn
        else:
            self.transmit()

    def flush(self) -> None:
        """Send now what `transmit_soon` left for the end of the turn (before a reset, which
        would discard it). Never waits."""
        if self._transmit_due:
            self.transmit()

    def transmit(self) -> None:
        """Send what aioquic has to send now and re-arm the timer. Never waits (a datagram the
        socket cannot take right now is dropped, and QUIC loss recovery resends it)."""
        self._transmit_due = False
        if self._terminated:
            return
        quic = self._quic
        for data, addr in quic.datagrams_to_send(now=trio.current_time()):
            self._send_datagram(data, addr)
        if self._timer_scope is not None:
            timer = quic.get_timer()
            self._timer_scope.deadline = math.inf if timer is None else timer
        self._check_closing()
        for stream in list(self._blocked_writers):
            if stream.send_backlog <= self.send_high_water:
                stream._writers.unpark_all()
        if len(quic._streams) != self._quic_streams_at_sweep:
            self._sweep()

    async def run(self) -> None:
        """The connection's timer loop; returns once the connection is terminated. Cancelled,
        it aborts the connection (CONNECTION_CLOSE sent best effort, streams failed)."""
        try:
            while not self._is_terminated():
                timer = self._quic.get_timer()
                with trio.CancelScope(deadline=math.inf if timer is None else timer) as scope:
                    self._timer_scope = scope
                    await trio.sleep_forever()
                self._timer_scope = None
                if self._is_terminated():  # woken by `_terminate`
                    break
                now = trio.current_time()
                timer = self._quic.get_timer()
                if timer is not None and now >= timer:
                    self._quic.handle_timer(now=now)
                    self._process_events()
                self.transmit()
        finally:
            self._timer_scope = None
            self.abort("connection task ended")

    async def wait_established(self) -> None:
        """Wait for the handshake; raises `ConnectFailed` (with the close reason) if the
        connection closes first."""
        while not self._established:
            if self._closing:
                raise ConnectFailed(self._close_reason)
            await self._state_changed.park()

    # Internals.

    def _is_terminated(self) -> bool:
        return self._terminated

    def _closed_message(self) -> str:
        return f"QUIC connection closed: {self._close_reason}"

    def _process_events(self) -> None:
        quic = self._quic
        while (event := quic.next_event()) is not None:
            if isinstance(event, _STREAM_EVENTS):
                self._route(event)
            elif isinstance(event, events.HandshakeCompleted):
                self._on_handshake(event)
            elif isinstance(event, events.ConnectionIdIssued):
                if self.on_cid_issued is not None:
                    self.on_cid_issued(event.connection_id)
            elif isinstance(event, events.ConnectionIdRetired):
                if self.on_cid_retired is not None:
                    self.on_cid_retired(event.connection_id)
            elif isinstance(event, events.ConnectionTerminated):
                self._terminate(describe_termination(event))
            elif (
                isinstance(event, events.DatagramFrameReceived) and self._event_handler is not None
            ):
                self._call_handler(event)
        if quic._remote_max_streams_bidi > self._peer_max_streams:
            self._peer_max_streams = quic._remote_max_streams_bidi
            self._stream_credit.unpark_all()
        self._check_closing()

    def _on_handshake(self, event: events.HandshakeCompleted) -> None:
        self._established = True
        self._alpn = event.alpn_protocol
        logger.debug("QUIC connection %s established (ALPN %s)", self.remote_address, self._alpn)
        self._state_changed.unpark_all()
        self._stream_credit.unpark_all()
        if self.on_established is not None and not self._closing:
            self.on_established(self)

    def _route(self, event: StreamEvent) -> None:
        stream_id = event.stream_id
        stream = self._streams.get(stream_id)
        if stream is not None:
            stream._on_event(event)
        elif self._event_handler is not None:
            self._call_handler(event)
        elif self._closing:
            pass
        elif stream_id in self._unclaimed:
            self._pending.append(event)
        elif self._is_peer_stream(stream_id):
            kind, index = stream_id % 4, stream_id // 4
            known = self._known_peer_streams.get(kind, 0)
            if index < known:
                return  # a finished stream's straggler
            # Opening a stream opens every lower one of its type (RFC 9000 §2.1).
            for opened in range(known * 4 + kind, stream_id + 1, 4):
                self._keep(opened)
                if kind < 2:
                    self._accept_queue.append(opened)
            self._known_peer_streams[kind] = index + 1
            if not self._closing:  # `_keep` may have closed it
                self._pending.append(event)
                self._stream_accepted.unpark_all()
        else:  # a stream of ours made through `quic` directly, before the hook is set
            self._keep(stream_id)
            if not self._closing:
                self._pending.append(event)

    def _keep(self, stream_id: int) -> None:
        """Hold a stream nobody has claimed yet: its events wait in `_pending`, and its credit
        stays at one window (flow.py). A peer cycling through more such streams than it may
        have open at once (finished unidirectional streams free their slot) is refused."""
        self._unclaimed.add(stream_id)
        self._quic.consumed[stream_id] = 0
        if len(self._unclaimed) > self._unclaimed_limit:
            self.close(INTERNAL_ERROR, "too many streams opened and not accepted")

    def _is_peer_stream(self, stream_id: int) -> bool:
        return (stream_id % 2 == 0) != self._quic.configuration.is_client

    def _claim(self, stream_id: int) -> QuicStream:
        self._unclaimed.discard(stream_id)
        stream = self._streams[stream_id] = QuicStream(self, stream_id)
        kept: deque[StreamEvent] = deque()
        for event in self._pending:
            if event.stream_id == stream_id:
                stream._on_event(event)
            else:
                kept.append(event)
        self._pending = kept
        return stream

    def _call_handler(self, event: events.QuicEvent) -> None:
        assert self._event_handler is not None
        try:
            self._event_handler(event)
        except Exception:
            logger.exception("QUIC event handler failed; closing the connection")
            self.close(INTERNAL_ERROR, "internal error")

    def _sweep(self) -> None:
        """Forget the streams aioquic discarded (both directions finished): no event can arrive
        for them any more, and their objects keep working for whoever still holds them."""
        live = self._quic._streams
        for stream_id in [s for s in self._streams if s not in live]:
            del self._streams[stream_id]
            self._quic.consumed.pop(stream_id, None)
        self._quic_streams_at_sweep = len(live)

    def _check_closing(self) -> None:
        close_event = self._quic._close_event
        if close_event is not None and not self._closing:
            self._begin_closing(describe_termination(close_event))

    def _begin_closing(self, reason: str) -> None:
        if self._closing:
            return
        self._closing = True
        self._close_reason = reason
        logger.debug("QUIC connection %s closing: %s", self.remote_address, reason)
        for stream in list(self._streams.values()):
            stream._on_connection_closed()
        self._pending.clear()
        self._unclaimed.clear()
        self._accept_queue.clear()
        self._state_changed.unpark_all()
        self._stream_accepted.unpark_all()
        self._stream_credit.unpark_all()

    def _terminate(self, reason: str) -> None:
        if self._terminated:
            return
        self._begin_closing(reason)
        self._terminated = True
        self._closed.set()
        if self._timer_scope is not None:
            self._timer_scope.cancel()
        if self.on_terminated is not None:
            self.on_terminated(self)
