"""The engine stats stream (`GET /pylon/v1/stats/stream`, `--engine-stats-stream`): NDJSON lines
telling every subscriber how far each request has got, as NVIDIA's mock-dynamo engine does, so a
router can follow an engine's load token by token instead of sampling `/metrics`.

Lines (each one compact JSON object ending in `\\n`):

* `{"v":1,"type":"ping"}`: at connect, then every `PING_INTERVAL` seconds.
* `{"v":1,"type":"stats","request_id":ID,"model":M,"tokens_processed":P,"tokens_generated":G}`:
  (0, 0) when a request reaches the engine, (prompt tokens, 0) when its prefill is done, then
  (prompt tokens, i) after its i-th generated token.
* `{"v":1,"type":"stats","request_id":ID,"model":M,"finished":true}`: when it ends, completed or
  not.

Publishing never waits: each subscriber has a bounded buffer (`StatsHub.buffer` lines), and one
that falls that far behind is disconnected (its connection aborted), so a stuck reader can neither
slow generation down nor make the mock's memory grow.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from stargate.asgi import ASGIMessage, ASGIReceive, ASGISend
from stargate.mock.shapes import dumps

__all__ = [
    "DEFAULT_BUFFER",
    "NDJSON_HEADERS",
    "PING",
    "PING_INTERVAL",
    "StatsHub",
    "finished_line",
    "stats_line",
]

PING = b'{"v":1,"type":"ping"}\n'
PING_INTERVAL = 5.0
DEFAULT_BUFFER = 4096
NDJSON_HEADERS = [
    (b"content-type", b"application/x-ndjson"),
    (b"cache-control", b"no-cache"),
]


def stats_line(request_id: str, model: str, processed: int, generated: int) -> bytes:
    """A request's progress: `processed` prompt tokens prefilled, `generated` tokens out."""
    payload = {
        "v": 1,
        "type": "stats",
        "request_id": request_id,
        "model": model,
        "tokens_processed": processed,
        "tokens_generated": generated,
    }
    return dumps(payload) + b"\n"


def finished_line(request_id: str, model: str) -> bytes:
    """A request has left the engine (finished, failed or cancelled)."""
    payload = {"v": 1, "type": "stats", "request_id": request_id, "model": model, "finished": True}
    return dumps(payload) + b"\n"


@dataclass(eq=False, slots=True)
class _Subscriber:
    channel: trio.MemorySendChannel[bytes]
    cancel_scope: trio.CancelScope
    overflowed: bool = False


class StatsHub:
    """The subscribers of the stats stream; `publish` hands a line to each without waiting."""

    def __init__(self, buffer: int = DEFAULT_BUFFER, ping_interval: float = PING_INTERVAL) -> None:
        if buffer < 1:
            raise ValueError("a subscriber's buffer must hold at least one line")
        self.buffer = buffer
        self.ping_interval = ping_interval
        self._subscribers: set[_Subscriber] = set()
        self._closed = False

    @property
    def active(self) -> bool:
        """Whether anyone listens (callers skip building lines otherwise)."""
        return bool(self._subscribers)

    def __len__(self) -> int:
        return len(self._subscribers)

    def publish(self, line: bytes) -> None:
        """Queue `line` for every subscriber; one whose buffer is full is disconnected."""
        for subscriber in list(self._subscribers):
            try:
                subscriber.channel.send_nowait(line)
            except trio.WouldBlock:
                subscriber.overflowed = True
                self._drop(subscriber)
                subscriber.cancel_scope.cancel()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._drop(subscriber)

    def close(self) -> None:
        """End every stream cleanly (after what is buffered) and refuse new subscribers: the
        server is shutting down, and an endless stream would hold its graceful stop."""
        self._closed = True
        for subscriber in list(self._subscribers):
            self._drop(subscriber)

    def _drop(self, subscriber: _Subscriber) -> None:
        self._subscribers.discard(subscriber)
        subscriber.channel.close()

    async def serve(
        self, receive: ASGIReceive, send: ASGISend, headers: list[tuple[bytes, bytes]]
    ) -> bool:
        """Answer one subscriber until it leaves or the hub closes; True if it was disconnected
        for falling behind (the caller then aborts the connection)."""
        sender, receiver = trio.open_memory_channel[bytes](self.buffer)
        subscriber = _Subscriber(sender, trio.CancelScope())
        if self._closed:
            sender.close()
        else:
            self._subscribers.add(subscriber)
        left = False
        try:
            with subscriber.cancel_scope:  # a reader stuck even before the head is cut too
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                async with trio.open_nursery() as nursery:

                    async def watch() -> None:
                        nonlocal left
                        while True:
                            message: ASGIMessage = await receive()
                            if message["type"] == "http.disconnect":
                                left = True
                                nursery.cancel_scope.cancel()
                                return

                    nursery.start_soon(watch)
                    await self._feed(receiver, send)
                    nursery.cancel_scope.cancel()
            if subscriber.overflowed:
                return True
            if not left:
                await send({"type": "http.response.body", "body": b""})
            return False
        finally:
            self._subscribers.discard(subscriber)
            sender.close()

    async def _feed(self, receiver: trio.MemoryReceiveChannel[bytes], send: ASGISend) -> None:
        """Send a ping, then every line as it comes (whatever is buffered in one body message),
        and a ping whenever `ping_interval` has passed; returns when the channel is closed."""
        await send({"type": "http.response.body", "body": PING, "more_body": True})
        next_ping = trio.current_time() + self.ping_interval
        ended = False
        while not ended:
            lines: list[bytes] = []
            with trio.move_on_at(next_ping):
                try:
                    lines.append(await receiver.receive())
                except trio.EndOfChannel:
                    return
            while True:
                try:
                    lines.append(receiver.receive_nowait())
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    ended = True
                    break
            now = trio.current_time()
            if now >= next_ping:
                lines.append(PING)
                while next_ping <= now:  # one ping, however long a send was blocked
                    next_ping += self.ping_interval
            if lines:
                await send(
                    {"type": "http.response.body", "body": b"".join(lines), "more_body": True}
                )
