"""The Pylon's HTTP/1.1 listener: the replica's requests come in here (docs/pylon-data-path.md).

A raw ASGI app served by Hypercorn's trio worker through `stargate/serving.py` (the replica's own
serving machinery, so keep-alive, the disconnect hook and the head-with-body write come with it).
It only adapts ASGI to the transport-independent `PylonHop`: the request head, a bounded body
reader, and a sink that turns the hop's answer into ASGI messages. The replica going away
cancels the hop (and with it the engine request).
"""

from __future__ import annotations

import trio

from stargate.asgi import (
    BODY_FOLLOWS,
    ASGIReceive,
    ASGIScope,
    ASGISend,
    BodyTooLarge,
    ClientGone,
    answer_lifespan,
    disconnect_hook,
    read_body,
)
from stargate.http_headers import Headers, first_header, parse_unsigned
from stargate.pylon.hop import PylonHop, PylonRequest

__all__ = ["PylonApp"]


class _AsgiSink:
    """`ResponseSink` over ASGI `send`."""

    __slots__ = ("_send",)

    def __init__(self, send: ASGISend) -> None:
        self._send = send

    async def start(self, status: int, headers: Headers, *, body_follows: bool) -> None:
        message = {"type": "http.response.start", "status": status, "headers": headers}
        if body_follows:
            message[BODY_FOLLOWS] = True
        await self._send(message)

    async def send(self, data: bytes, *, more: bool) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": more})


class PylonApp:
    """The ASGI app of the Pylon's listener: every request goes to `hop`."""

    def __init__(self, hop: PylonHop) -> None:
        self._hop = hop

    async def __call__(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers: Headers = scope["headers"]
        request = PylonRequest(scope["method"], scope["path"], scope["query_string"], headers)

        async def read_body(limit: int) -> bytes:
            return await _read_body(receive, headers, limit)

        hook = disconnect_hook(scope)
        sink = _AsgiSink(send)
        try:
            if hook is None:  # not served through stargate/serving.py (in-process tests)
                await self._hop.forward(request, read_body, sink)
                return
            with trio.CancelScope() as gone:
                hook.on_disconnect(gone.cancel)
                try:
                    await self._hop.forward(request, read_body, sink)
                finally:
                    hook.on_disconnect(None)
        except ClientGone:
            pass  # the replica left before its request was whole: nobody to answer


async def _read_body(receive: ASGIReceive, headers: Headers, limit: int) -> bytes:
    """The whole request body; BodyTooLarge past `limit`, or at once for a declared length above
    it (nothing is read then)."""
    declared = first_header(headers, b"content-length")
    length = None if declared is None else parse_unsigned(declared, 2**64 - 1)
    if length is not None and length > limit:
        raise BodyTooLarge
    return await read_body(receive, limit)
