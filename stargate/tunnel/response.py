"""`StreamedResponse`: a tunnel answer whose head has arrived, its body read chunk by chunk.

The surface the proxy relays (`stargate.upstream.BackendResponse`) written once for both
exchanges: a subclass says how to read the next chunk of its stream (`_read`) and how to give
the stream up (`_abandon`); the bookkeeping (complete, broken, idempotent close, iteration) is
here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import Self

import trio

from stargate.http_headers import Headers
from stargate.upstream import UpstreamProtocolError

__all__ = ["StreamedResponse"]


class StreamedResponse:
    """An answer over one tunnel stream. Closing it before the body is complete abandons the
    stream (the Pylon then stops its engine request). Not safe for concurrent use by several
    tasks."""

    __slots__ = ("_broken", "_complete", "headers", "status")

    def __init__(self, status: int, headers: Headers) -> None:
        self._complete = False
        self._broken = False
        self.status = status
        self.headers = headers

    async def _read(self) -> bytes | None:
        """The next body chunk, or None at its end. Raises UpstreamProtocolError when the
        stream breaks."""
        raise NotImplementedError

    def _abandon(self) -> None:
        """Give up the stream before the body's end (reset and stop it)."""
        raise NotImplementedError

    @property
    def complete(self) -> bool:
        """The whole body has been read."""
        return self._complete

    def take_buffered(self) -> bytes | None:
        """Always None: a tunnel answer's body is read message by message."""
        return None

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives; UpstreamProtocolError(request_sent=True) if it breaks."""
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[bytes]:
        while (chunk := await self._next_chunk()) is not None:
            yield chunk

    async def read(self) -> bytes:
        """The rest of the body."""
        chunks: list[bytes] = []
        while (chunk := await self._next_chunk()) is not None:
            chunks.append(chunk)
        return b"".join(chunks)

    async def _next_chunk(self) -> bytes | None:
        if self._complete:
            return None
        if self._broken:
            raise UpstreamProtocolError("the response body already failed", request_sent=True)
        try:
            chunk = await self._read()
        except BaseException:  # a broken stream, or cancellation mid-body: never reusable
            self._broken = True
            raise
        self._complete = chunk is None
        return chunk

    async def aclose(self) -> None:
        """Abandon the stream unless the body was read to its end. Idempotent."""
        if not self._complete:
            self._complete = True
            self._abandon()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
