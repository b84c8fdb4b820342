"""Passing an upstream response on to the client as it arrives: shared by the proxy (a backend's
answer, `ProxyApp._stream`) and the relay to a pool's owner (the owner's answer,
`OwnerRelay`).

The head goes out marked `BODY_FOLLOWS` when body bytes are already there, so the server writes
head and body at once (docs/http-serving.md, "Head with the body"); every chunk is sent as it
comes (SSE events are never held back); the last chunk ends the response in the same send.
"""

from __future__ import annotations

from typing import Any

from stargate.asgi import BODY_FOLLOWS, ASGISend
from stargate.upstream import BackendResponse, UpstreamError

__all__ = ["BodyBroke", "read_bounded", "send_response"]


class BodyBroke(Exception):
    """The upstream body failed after the head went out: `relayed` bytes of it reached the
    client. The caller logs it its own way and ends the response abruptly."""

    def __init__(self, error: UpstreamError, relayed: int) -> None:
        super().__init__(" ".join(str(error).split()) or type(error).__name__)
        self.error = error
        self.relayed = relayed


async def send_response(
    send: ASGISend, response: BackendResponse, start: dict[str, Any] | None, prefix: bytes = b""
) -> None:
    """Send `start` (an `http.response.start` message), then `response`'s body to its end.

    `start` None: the head is already out (a loading stream, stargate/proxy/loading.py), and
    `prefix` (its final comment) goes before the body's first bytes, in the same send.

    Raises `BodyBroke` if the body fails after the head was sent.
    """
    failure: UpstreamError | None = None
    try:
        first = response.take_buffered()  # what arrived with the head: no waiting
    except UpstreamError as error:
        first, failure = None, error  # reported after the head
    if start is not None:
        if first is not None or (failure is None and response.complete):
            # Its body goes right after it: the server may write both at once (one syscall).
            start[BODY_FOLLOWS] = True
        await send(start)
    elif prefix:
        first = prefix + first if first is not None else prefix
    relayed = 0
    try:
        if failure is not None:
            raise failure
        if first is not None:
            if response.complete:
                await send({"type": "http.response.body", "body": first})
                return
            await send({"type": "http.response.body", "body": first, "more_body": True})
            relayed += len(first)
        async for chunk in response.aiter_bytes():
            if response.complete:  # the last chunk ends the response: one send, not two
                await send({"type": "http.response.body", "body": chunk})
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            relayed += len(chunk)
    except UpstreamError as error:
        raise BodyBroke(error, relayed) from None
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def read_bounded(response: BackendResponse, limit: int) -> bytes:
    """Up to `limit` bytes of `response`'s body (less if it ends first; b"" if it fails)."""
    data = bytearray()
    try:
        first = response.take_buffered()
        if first is not None:
            data += first
        if not response.complete:
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) >= limit or response.complete:
                    break
    except UpstreamError:
        pass
    return bytes(data[:limit])
