"""Small ASGI helpers shared by the replica's servers."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

__all__ = [
    "BODY_FOLLOWS",
    "DISCONNECT_HOOK",
    "ASGIApp",
    "ASGIReceive",
    "ASGIScope",
    "ASGISend",
    "BodyTooLarge",
    "ClientGone",
    "DisconnectHook",
    "InFlight",
    "answer_lifespan",
    "disconnect_hook",
    "read_body",
    "visible_query",
]

ASGIScope = MutableMapping[str, Any]
ASGIMessage = MutableMapping[str, Any]
ASGIReceive = Callable[[], Awaitable[ASGIMessage]]
ASGISend = Callable[[ASGIMessage], Awaitable[None]]
ASGIApp = Callable[[ASGIScope, ASGIReceive, ASGISend], Awaitable[None]]


BODY_FOLLOWS = "stargate.body_follows"
"""A key an app may set (true) in its `http.response.start` message: its first body message comes
right after, without waiting for anything. An HTTP/1.1 server may then write the head together
with that body, one write instead of two (`stargate/hypercorn_patches/h11.py`,
docs/http-serving.md, "Head with the body"); without the key, or where the server ignores it,
the head is written at once."""

DISCONNECT_HOOK = "stargate.disconnect"
"""The key of an HTTP exchange's `DisconnectHook` in `scope["extensions"]`; present when the app is
served through `stargate/serving.py` (`stargate/hypercorn_patches/app.py` installs it)."""


class DisconnectHook:
    """Calls the app back, synchronously, when its client goes away before the response is done.

    An app that must stop working when its client leaves (the proxy cancels its upstream request)
    otherwise needs a second task per request, waiting in `receive()` for `http.disconnect`: a
    nursery and a task cost about 45 us a request, more than anything else the proxy adds to a
    request (docs/data-plane.md, "Cancellation"). The server calls `fire()` where it queues
    `http.disconnect` for the app, so `receive()` still gets that message as before.

    A disconnect that arrives while the app's final `send()` runs (`completing`) is the end of a
    complete exchange, which Hypercorn reports from inside that `send()`: it is not passed on,
    as `hypercorn_patches.complete_response_before_disconnect` holds that message back from
    `receive()` (the app has nothing left to cancel, and cancelling it there would cancel
    Hypercorn's own bookkeeping for the response).
    """

    __slots__ = ("_callback", "completing", "disconnected")

    def __init__(self) -> None:
        self._callback: Callable[[], object] | None = None
        self.completing = False
        """The app's final `send()` is running (set by the server's wrapper)."""
        self.disconnected = False
        """The client has gone (or the exchange has ended)."""

    def on_disconnect(self, callback: Callable[[], object] | None) -> None:
        """Call `callback` when the client leaves (now, if it has already left); None: stop."""
        self._callback = callback
        if callback is not None and self.disconnected and not self.completing:
            callback()

    def fire(self) -> None:
        """The server's side: the client has gone, or the exchange is over."""
        if self.disconnected:
            return
        self.disconnected = True
        callback = self._callback
        if callback is not None and not self.completing:
            callback()


def disconnect_hook(scope: ASGIScope) -> DisconnectHook | None:
    """The exchange's `DisconnectHook`, if the server installed one."""
    extensions = scope.get("extensions")
    if not extensions:
        return None
    hook = extensions.get(DISCONNECT_HOOK)
    return hook if isinstance(hook, DisconnectHook) else None


class BodyTooLarge(Exception):
    """The request body exceeds the reader's limit."""


class ClientGone(Exception):
    """The client went away before its request body was complete."""


async def read_body(receive: ASGIReceive, limit: int) -> bytes:
    """The whole request body of an HTTP exchange, at most `limit` bytes.

    Raises BodyTooLarge as soon as the body passes `limit` (the rest is not read), ClientGone on
    `http.disconnect`. A body that arrives in one message is returned as it is (no copy)."""
    message = await receive()
    if message["type"] != "http.request":
        raise ClientGone
    body = bytes(message.get("body", b""))
    if len(body) > limit:
        raise BodyTooLarge
    if not message.get("more_body", False):
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        chunk = bytes(message.get("body", b""))
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


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
