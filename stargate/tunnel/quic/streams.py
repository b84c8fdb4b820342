"""`QuicStream`: one bidirectional QUIC stream of a `QuicConnection`, as a `TunnelStream`.

Bounded in both directions:

* Receiving: data the peer sent waits in the stream's buffer until `receive` takes it, and the
  peer only gets credit (MAX_STREAM_DATA) for what was taken (`flow.FlowQuic`), so the buffer
  never holds more than one receive window (the configuration's `max_stream_data`).
* Sending: `send` hands the data to aioquic, then waits while the stream's unsent backlog in
  aioquic (bytes queued but not yet put in a packet: held back by the peer's credit, congestion
  control or pacing) is above the connection's `send_high_water`. So a stream holds at most the
  high-water mark plus one `send` call's data, plus what is in flight.

All events reach the stream from the connection (`_on_event`), in the endpoint's task; the
stream's own methods run in the application's tasks. Everything is single-threaded trio: the
methods never block except where documented, and every `await` is a checkpoint.
"""

from __future__ import annotations

from collections import deque
from contextlib import suppress
from typing import TYPE_CHECKING

import trio
from aioquic.quic import events

from ..stream import StreamClosed, StreamReset

if TYPE_CHECKING:
    from .driver import QuicConnection

__all__ = ["QuicStream"]


class QuicStream:
    """A bidirectional stream (the `TunnelStream` contract; see `tunnel.stream`).

    Created by `QuicConnection.open_stream` and `accept_stream`, never directly. Beyond the
    contract: `receive` raises `StreamClosed` once `stop` was called on this side, and `reset`
    after a FIN was queued does nothing (the data already queued still goes out), so a "drop"
    that resets and stops a finished exchange does not destroy its last bytes.
    """

    def __init__(self, connection: QuicConnection, stream_id: int) -> None:
        self._connection = connection
        self._quic = connection.quic
        self._id = stream_id
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._fin_received = False
        self._failure: tuple[int, str] | None = None  # peer reset, or connection closed
        self._stopped = False
        self._fin_queued = False
        self._reset_sent = False
        self._peer_stop: int | None = None
        self._readers = trio.lowlevel.ParkingLot()
        self._writers = trio.lowlevel.ParkingLot()

    def __repr__(self) -> str:
        return f"<QuicStream {self._id}>"

    @property
    def stream_id(self) -> int:
        return self._id

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned by `receive`."""
        return self._buffered

    @property
    def send_backlog(self) -> int:
        """Bytes handed to aioquic on this stream and not yet put in a packet."""
        stream = self._quic._streams.get(self._id)
        if stream is None or stream.sender._reset_error_code is not None:
            return 0
        return stream.sender._buffer_stop - stream.sender.highest_offset

    async def send(self, data: bytes, *, end: bool = False) -> None:
        """Queue `data` (then FIN if `end`) and wait while the backlog is above the high-water
        mark. Raises `StreamClosed` if the sending side is finished, reset, stopped by the peer or
        the connection is closing, also while waiting. Cancelled while waiting, the data stays
        queued (the caller should then `reset` the stream)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._fin_queued:
            raise StreamClosed(f"stream {self._id}: sending after FIN")
        self._raise_if_unsendable()
        try:
            self._quic.send_stream_data(self._id, data, end_stream=end)
        except (RuntimeError, ValueError) as error:  # reset or discarded under us
            raise StreamClosed(f"stream {self._id}: {error}") from None
        self._fin_queued = end
        connection = self._connection
        connection.transmit_soon()
        parked = False
        while self.send_backlog > connection.send_high_water:
            self._raise_if_unsendable()
            connection._blocked_writers.add(self)
            try:
                await self._writers.park()
            finally:
                connection._blocked_writers.discard(self)
            parked = True
        if parked:
            self._raise_if_unsendable()
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()

    def _raise_if_unsendable(self) -> None:
        if self._peer_stop is not None:
            raise StreamClosed(
                f"stream {self._id}: the peer asked to stop sending (code {self._peer_stop})"
            )
        if self._reset_sent:
            raise StreamClosed(f"stream {self._id}: sending after reset")
        if self._connection._closing:
            raise StreamClosed(f"stream {self._id}: connection closed")

    async def receive(self) -> bytes:
        """The bytes received so far and not yet returned (waiting for some), `b""` at FIN and
        on every later call. Raises `StreamReset` when the peer reset the stream or the
        connection closed before FIN (code 0, "connection closed"), once the data that arrived
        before it has been read; `StreamClosed` after `stop`. Reading grants the peer new
        credit."""
        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while True:
            if self._stopped:
                raise StreamClosed(f"stream {self._id}: receiving was stopped")
            if self._chunks:  # what arrived before a reset is still the peer's: read it first
                data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                self._consumed(len(data))
                break
            if self._failure is not None:
                code, message = self._failure
                raise StreamReset(code, message)
            if self._fin_received:
                data = b""
                break
            await self._readers.park()
            parked = True
        if not parked:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return data

    def _consumed(self, size: int) -> None:
        consumed = self._quic.consumed
        if self._id in consumed:
            consumed[self._id] += size
            if self._quic.credit_due(self._id):
                self._connection.transmit_soon()

    def reset(self, code: int = 0) -> None:
        """Abandon the sending side (RESET_STREAM with `code`); wakes a waiting `send`, which
        raises `StreamClosed`. Never waits; idempotent; does nothing after FIN was queued, after
        the peer's STOP_SENDING (aioquic already reset) or once the connection is closing."""
        if self._fin_queued or self._reset_sent or self._peer_stop is not None:
            return
        self._reset_sent = True
        if not self._connection._closing:
            # What this turn queued goes out first: a reset discards unsent data, and the events
            # written just before a stream is cut (an output timeout) belong to the client.
            self._connection.flush()
            with suppress(RuntimeError, ValueError):
                self._quic.reset_stream(self._id, code)
            self._connection.transmit()
        self._writers.unpark_all()

    def stop(self, code: int = 0) -> None:
        """Abandon the receiving side (STOP_SENDING with `code`, unless FIN or a reset already
        arrived): drops buffered data and wakes a waiting `receive`, which raises
        `StreamClosed`. Never waits; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._chunks.clear()
        self._buffered = 0
        if not (self._fin_received or self._failure is not None or self._connection._closing):
            with suppress(ValueError):
                self._quic.stop_stream(self._id, code)
            self._connection.transmit()
        self._readers.unpark_all()

    # Called by the connection, in the endpoint's task.

    def _on_event(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived):
            if self._stopped or self._failure is not None:
                return
            if event.data:
                self._chunks.append(event.data)
                self._buffered += len(event.data)
            if event.end_stream:
                self._fin_received = True
            self._readers.unpark_all()
        elif isinstance(event, events.StreamReset):
            if self._stopped or self._failure is not None:
                return
            # What arrived before the reset stays readable (`receive` raises after it): the
            # events an answer had produced before it was cut reach the client.
            self._failure = (event.error_code, "")
            self._readers.unpark_all()
        elif isinstance(event, events.StopSendingReceived):
            self._peer_stop = event.error_code
            self._writers.unpark_all()

    def _on_connection_closed(self) -> None:
        if not (self._fin_received or self._stopped or self._failure is not None):
            self._failure = (0, "connection closed")
            self._chunks.clear()
            self._buffered = 0
        self._readers.unpark_all()
        self._writers.unpark_all()
