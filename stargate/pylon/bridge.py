"""Bridging grpcio's blocking streaming calls into trio.

A grpcio streaming call is an iterator whose `next()` blocks. `ResponseReader` drains it on a
dedicated worker thread and hands every response (then one `StreamEnded`) to trio through an
unbounded memory channel. `close()` cancels the call, which makes the blocked `next()` raise at
once, and joins the thread with a timeout, so no thread outlives the trio task that owns it.

`Outbox` is the request side of a client-streaming call: trio puts messages into a
`queue.Queue`, grpcio's own sender thread takes them out through `requests()`, and `close()`
puts the sentinel that ends the iterator (a half-close).
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
import trio

__all__ = ["Outbox", "ResponseReader", "StreamEnded", "rpc_error_text"]

T = TypeVar("T")

JOIN_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """The response stream is over: `error` is None for an OK end, else what ended it."""

    error: BaseException | None = None

    @property
    def code(self) -> grpc.StatusCode | None:
        if isinstance(self.error, grpc.RpcError):
            code = self.error.code()
            return code if isinstance(code, grpc.StatusCode) else None
        return None

    def describe(self) -> str:
        if self.error is None:
            return "the stream ended (OK)"
        return rpc_error_text(self.error)


def rpc_error_text(error: BaseException) -> str:
    """`CODE: details` of a grpc error (one line, no debug string), else the repr."""
    if isinstance(error, grpc.RpcError):
        code = error.code()
        details = error.details()
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        return f"{name}: {details}" if details else str(name)
    return repr(error)


class ResponseReader(Generic[T]):
    """Read a grpcio response iterator on a worker thread; receive the items in trio."""

    def __init__(self, call: Any, name: str) -> None:
        self._call = call
        self._send, self.receive = trio.open_memory_channel[T | StreamEnded](math.inf)
        self._token = trio.lowlevel.current_trio_token()
        self._done = trio.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        end = StreamEnded()
        try:
            for item in self._call:
                self._deliver(item)
        except BaseException as error:  # grpc.RpcError, or anything the iterator raised
            end = StreamEnded(error)
        self._deliver(end)
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(self._done.set, trio_token=self._token)

    def _deliver(self, item: T | StreamEnded) -> None:
        # When nobody is listening any more, the item is dropped.
        with contextlib.suppress(
            trio.RunFinishedError, trio.ClosedResourceError, trio.BrokenResourceError
        ):
            trio.from_thread.run_sync(self._send.send_nowait, item, trio_token=self._token)

    @property
    def finished(self) -> bool:
        return not self._thread.is_alive()

    async def wait_finished(self, seconds: float) -> bool:
        """Wait (shielded from cancellation) up to `seconds` for the thread to end."""
        with trio.CancelScope(shield=True), trio.move_on_after(seconds):
            await self._done.wait()
        self._thread.join(0.1)  # after `_done` it is only returning
        return not self._thread.is_alive()

    async def close(self, seconds: float = JOIN_TIMEOUT_SECONDS) -> None:
        """Cancel the call (a no-op once it ended) and join the reader thread."""
        self._call.cancel()
        await self.wait_finished(seconds)
        self._send.close()


class Outbox(Generic[T]):
    """The request iterator of a client-streaming call, fed from trio without blocking."""

    _SENTINEL: Any = object()

    def __init__(self, max_pending: int = 4) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._max_pending = max_pending
        self._closed = False

    def requests(self) -> Iterable[T]:
        return self._iterate()

    def _iterate(self) -> Iterator[T]:
        while (item := self._queue.get()) is not self._SENTINEL:
            yield item

    def put(self, item: T) -> bool:
        """Queue one message; dropped (False) while `max_pending` are still unsent."""
        if self._closed or self._queue.qsize() >= self._max_pending:
            return False
        self._queue.put(item)
        return True

    def close(self) -> None:
        """Half-close: the iterator ends after the queued messages. Idempotent."""
        if not self._closed:
            self._closed = True
            self._queue.put(self._SENTINEL)
