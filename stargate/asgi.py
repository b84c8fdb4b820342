"""Small ASGI helpers shared by the replica's servers."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

__all__ = [
    "ASGIApp",
    "ASGIReceive",
    "ASGIScope",
    "ASGISend",
    "InFlight",
    "answer_lifespan",
    "visible_query",
]

ASGIScope = MutableMapping[str, Any]
ASGIMessage = MutableMapping[str, Any]
ASGIReceive = Callable[[], Awaitable[ASGIMessage]]
ASGISend = Callable[[ASGIMessage], Awaitable[None]]
ASGIApp = Callable[[ASGIScope, ASGIReceive, ASGISend], Awaitable[None]]


async def answer_lifespan(
    receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
) -> None:
    """Complete the ASGI lifespan protocol for an app with nothing to start or stop.

    Hypercorn's trio worker fails at start-up on an app that ignores lifespan (docs/decisions.md,
    H4).
    """
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class InFlight:
    """Counts the HTTP exchanges (requests, streams, gRPC calls) in progress on every server.

    A graceful shutdown is over when this reaches zero, not when Hypercorn has closed every
    connection: idle connections carry no work, and a client may hold one open (HTTP/2 streams it
    never ends, a connection it never reads from) until the drain deadline. Once nothing is in
    flight the runtime cancels the servers, and with them whatever connections are left.
    """

    def __init__(self) -> None:
        self.count = 0
        self._idle = trio.Event()
        self._idle.set()

    def track(self, app: ASGIApp) -> ASGIApp:
        """Wrap `app` so each of its HTTP exchanges counts while the app handles it."""

        async def tracked(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            self.count += 1
            if self.count == 1:
                self._idle = trio.Event()
            try:
                await app(scope, receive, send)
            finally:
                self.count -= 1
                if self.count == 0:
                    self._idle.set()

        return tracked

    async def wait_idle(self) -> None:
        """Return once nothing is in flight (at once if nothing is)."""
        while self.count:
            await self._idle.wait()


_VISIBLE_ASCII = re.compile(rb"[\x21-\x7e]*")


def visible_query(query: bytes) -> bytes:
    """`query` with every byte outside visible ASCII written as `%XX`, as an HTTP/1.1 client must
    send it; a valid query (all an HTTP/1.1 parser lets through) is returned as it is, after one
    C-speed match.

    HTTP/2 checks nothing in `:path` beyond NUL, CR and LF, so `?\\x01` or `?caf\\xc3\\xa9` reach
    the apps: the proxy cannot send such a target over HTTP/1.1, and Quart decodes the query as
    strict UTF-8; both answered 500 (found by tests/unit/proxy/test_bad_input.py).
    """
    if _VISIBLE_ASCII.fullmatch(query):
        return query
    return b"".join(bytes((byte,)) if 0x21 <= byte <= 0x7E else b"%%%02X" % byte for byte in query)
