"""`BackendResponse`: what the proxy relays, whichever transport carried it.

`UpstreamResponse` (HTTP/1.1, `connection.py`) and the tunnels' responses
(`stargate/tunnel/raw_quic.py`, `stargate/tunnel/http3.py`) all have this surface, so the
forwarder, the retry rules and the relay never ask which transport a backend uses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import Protocol, Self

__all__ = ["BackendResponse"]


class BackendResponse(Protocol):
    """A response whose head has arrived; its body is read on demand, and it must be closed."""

    status: int
    headers: list[tuple[bytes, bytes]]

    @property
    def complete(self) -> bool:
        """The whole body has been read."""
        ...

    def take_buffered(self) -> bytes | None:
        """Body bytes already there, without waiting (None if none)."""
        ...

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises `UpstreamError` if it breaks."""
        ...

    async def read(self) -> bytes:
        """The rest of the body."""
        ...

    async def aclose(self) -> None:
        """Release the response; an unfinished body is abandoned (its stream or connection
        closed, so the backend stops). Idempotent."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
