"""An in-memory pair of `TunnelStream`s: what one side sends, the other receives.

Follows the contract in `stargate/tunnel/stream.py`: bounded backlog (a sender waits while the
peer has more than `high_water` unread bytes), FIN as `b""` once and forever, resets waking a
waiting reader, `stop` making the peer's next send raise `StreamClosed`.
"""

from __future__ import annotations

import trio

from stargate.tunnel.stream import StreamClosed, StreamReset

__all__ = ["FakeStream", "stream_pair"]


class _Direction:
    """One direction's bytes in flight."""

    def __init__(self, high_water: int) -> None:
        self.buffer = bytearray()
        self.fin = False
        self.reset_code: int | None = None
        self.stopped = False
        self.high_water = high_water
        self.changed = trio.Event()

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class FakeStream:
    def __init__(self, stream_id: int, outgoing: _Direction, incoming: _Direction) -> None:
        self._id = stream_id
        self._out = outgoing
        self._in = incoming
        self.sent: list[bytes] = []
        self.resets: list[int] = []
        self.stops: list[int] = []

    @property
    def stream_id(self) -> int:
        return self._id

    async def send(self, data: bytes, *, end: bool = False) -> None:
        out = self._out
        if out.fin or out.reset_code is not None or out.stopped:
            raise StreamClosed("stream closed for sending")
        self.sent.append(bytes(data))
        out.buffer += data
        out.fin = end
        out.wake()
        while len(out.buffer) > out.high_water and not out.stopped:
            await out.changed.wait()
        if out.stopped and not end:
            raise StreamClosed("the peer stopped reading")
        await trio.lowlevel.checkpoint()

    async def receive(self) -> bytes:
        incoming = self._in
        while True:
            if incoming.reset_code is not None:
                raise StreamReset(incoming.reset_code)
            if incoming.buffer:
                data = bytes(incoming.buffer)
                incoming.buffer.clear()
                incoming.wake()
                await trio.lowlevel.checkpoint()
                return data
            if incoming.fin:
                await trio.lowlevel.checkpoint()
                return b""
            await incoming.changed.wait()

    def reset(self, code: int = 0) -> None:
        self.resets.append(code)
        if self._out.reset_code is None and not self._out.fin:
            self._out.reset_code = code
            self._out.buffer.clear()
            self._out.wake()

    def stop(self, code: int = 0) -> None:
        self.stops.append(code)
        self._in.stopped = True
        self._in.buffer.clear()
        self._in.wake()


def stream_pair(high_water: int = 256 * 1024) -> tuple[FakeStream, FakeStream]:
    """(client side, server side) of one bidirectional stream."""
    up, down = _Direction(high_water), _Direction(high_water)
    return FakeStream(0, up, down), FakeStream(0, down, up)
