"""Fixes for Hypercorn 0.18 bugs that a client could use to take a replica down.

Applied once, when the runtime module is imported. Each fix is small, targeted at one upstream
issue, and covered by a test that fails without it.

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
"""

from __future__ import annotations

from typing import Any

import h2.errors
import h2.events
import h2.exceptions
from hypercorn.protocol.h2 import BUFFER_LOW_WATER, H2Protocol, StreamBuffer

__all__ = ["apply"]

_applied = False


def apply() -> None:
    """Install the fixes (idempotent)."""
    global _applied
    if _applied:
        return
    _applied = True
    original = H2Protocol._handle_events

    async def handle_events(self: Any, events: list[h2.events.Event]) -> None:
        # One event at a time: an earlier event of the same batch may create the stream.
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                try:
                    self.connection.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
                    # RFC 9113 §8.1: the response is complete; ask the client to stop sending.
                    self.connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)
                except h2.exceptions.ProtocolError:
                    pass  # h2 already considers the stream closed
                continue
            await original(self, [event])
        # Always, as the original does: h2 may have queued frames (a RST_STREAM for DATA on a
        # stream it knows is closed) even for a batch that produced no events.
        await self._flush()

    H2Protocol._handle_events = handle_events  # type: ignore[method-assign]

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
