"""`TunnelLink`: one QUIC connection as the replica uses it, whatever the exchange on it.

docs/tunnels.md. A link carries requests (`request`), says whether it can carry more (`healthy`:
the QUIC connection is open, and for http3 its H3 layer alive) and closes. `RawQuicLink` runs the
raw-quic exchange on a fresh stream per request; the http3 link is in `http3.py`.
"""

from __future__ import annotations

from typing import Protocol

import trio

from stargate.http_headers import Headers
from stargate.tunnel.quic import QuicConnection
from stargate.tunnel.raw_quic import send_request
from stargate.upstream import BackendResponse, ResponseHeadTimeout, UpstreamProtocolError

__all__ = ["RawQuicLink", "TunnelLink"]


class TunnelLink(Protocol):
    @property
    def healthy(self) -> bool: ...

    @property
    def open_requests(self) -> int:
        """Requests in flight on this connection (their streams not finished)."""
        ...

    async def request(
        self,
        method: str,
        path_and_query: bytes,
        headers: Headers,
        body: bytes | bytearray,
        deadline: float,
    ) -> BackendResponse: ...

    def close(self) -> None: ...


class RawQuicLink:
    """The raw-quic exchange over one QUIC connection; the replica opens every stream (on a
    reverse connection those are server-initiated streams, which the Pylon accepts)."""

    __slots__ = ("connection",)

    def __init__(self, connection: QuicConnection) -> None:
        self.connection = connection

    @property
    def healthy(self) -> bool:
        return self.connection.is_open

    @property
    def open_requests(self) -> int:
        return self.connection.open_request_streams

    async def request(
        self,
        method: str,
        path_and_query: bytes,
        headers: Headers,
        body: bytes | bytearray,
        deadline: float,
    ) -> BackendResponse:
        """One request on a fresh stream; opening it (waiting for the peer's stream credit
        included) counts against the same `deadline` as the head (Rust's one budget)."""
        with trio.move_on_at(deadline):
            try:
                stream = await self.connection.open_stream()
            except Exception as error:  # the connection closed under us
                raise UpstreamProtocolError(
                    f"cannot open a tunnel stream: {error}", request_sent=False
                ) from error
            return await send_request(stream, method, path_and_query, headers, body, deadline)
        raise ResponseHeadTimeout("quic request timed out", request_sent=False)

    def close(self) -> None:
        self.connection.close(0, "shutdown")
