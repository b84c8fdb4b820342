"""The one h11 response reader both benchmarks use (a client with no library in the way, so the
load generator's own cost stays small and visible)."""

from __future__ import annotations

import h11
import trio

__all__ = ["read_response"]

MAX_EVENTS = 100_000
"""Bound on the events of one response (a runaway server cannot keep a reader looping)."""


async def read_response(conn: h11.Connection, stream: trio.SocketStream) -> tuple[int, bytes]:
    """Read one whole response from `stream`: its status and body.

    Raises ConnectionError when the server closes the connection before the response ends (or
    sends more than `MAX_EVENTS` events).
    """
    status = 0
    parts: list[bytes] = []
    for _ in range(MAX_EVENTS):
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            parts.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return status, b"".join(parts)
        elif isinstance(event, h11.ConnectionClosed):
            raise ConnectionError("the server closed the connection mid-response")
    raise ConnectionError(f"no end of response after {MAX_EVENTS} events")
