"""`TunnelStream`: one bidirectional QUIC stream as the exchanges see it.

The QUIC driver (`quic/`) implements it; the exchanges (`raw_quic.py`, `handshake.py`) are
written against it alone, so they are tested with the in-memory pair of `tests/fakes`.

Contract (trio semantics: every method that waits is a checkpoint and may be cancelled):

* `send(data, end=...)` queues `data` and returns once the stream's unsent backlog is under its
  high-water mark (backpressure: the peer's flow-control credit or a slow link make the sender
  wait, so memory stays bounded). `end=True` sends FIN after `data`. Sending after FIN, after a
  reset, or after the peer asked to stop raises `StreamClosed`.
* `receive()` returns the next bytes available (waiting for some if there are none), `b""` once
  at FIN and on every later call. A reset by the peer raises `StreamReset` (with its code), also
  to a reader already waiting.
* `reset(code)` abandons the sending side (RESET_STREAM); `stop(code)` abandons the receiving side
  (STOP_SENDING). Both never wait and are idempotent; a stream dropped mid-exchange must be reset
  and stopped, as the Rust side does on drop (code 0).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["StreamClosed", "StreamReset", "TunnelStream"]


class StreamReset(Exception):
    """The peer reset the stream (RESET_STREAM), or the connection closed under it."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message or f"stream reset by the peer (code {code})")
        self.code = code


class StreamClosed(Exception):
    """Sending on a stream whose sending side is finished, reset, or stopped by the peer."""


class TunnelStream(Protocol):
    @property
    def stream_id(self) -> int: ...

    async def send(self, data: bytes, *, end: bool = False) -> None: ...

    async def receive(self) -> bytes: ...

    def reset(self, code: int = 0) -> None: ...

    def stop(self, code: int = 0) -> None: ...
