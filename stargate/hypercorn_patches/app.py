"""What the app sees of Hypercorn: the disconnect hook in every HTTP exchange (a patch), and the
response completed before `http.disconnect` (an app wrapper, applied by `serving.serve_asgi`;
docs/http-serving.md, "Disconnect hook" and "Final send before `http.disconnect`").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.task_group import TaskGroup

from stargate.asgi import (
    DISCONNECT_HOOK,
    ASGIApp,
    ASGIMessage,
    ASGIReceive,
    ASGIScope,
    ASGISend,
    DisconnectHook,
    disconnect_hook,
)

__all__ = ["complete_response_before_disconnect", "spawn_app"]

Put = Callable[[Any], Awaitable[None]]
SpawnApp = Callable[[TaskGroup, Any, HypercornConfig, Any, Put], Awaitable[Put]]


def spawn_app(original: SpawnApp) -> SpawnApp:
    """`TaskGroup.spawn_app`: give every HTTP exchange a `DisconnectHook` (stargate/asgi.py) in its
    scope's extensions, fired where Hypercorn queues `http.disconnect` for the app.

    Not a fix of Hypercorn: it lets the proxy stop its upstream work when its client leaves
    without a second task per request waiting in `receive()` (docs/data-plane.md,
    "Cancellation"). Every message Hypercorn queues for the app still reaches `receive()`.
    """

    async def spawn_app(
        self: TaskGroup,
        app: Any,
        config: HypercornConfig,
        scope: Any,
        send: Put,
    ) -> Put:
        if scope["type"] != "http":
            return await original(self, app, config, scope, send)
        hook = DisconnectHook()
        scope["extensions"][DISCONNECT_HOOK] = hook
        put = await original(self, app, config, scope, send)

        async def app_put(message: Any) -> None:
            if message["type"] == "http.disconnect":
                hook.fire()
            await put(message)

        return app_put

    return spawn_app


def complete_response_before_disconnect(app: ASGIApp) -> ASGIApp:
    """Wrap `app` so Hypercorn can finish a response before the app hears `http.disconnect`.

    Hypercorn delivers `http.disconnect` to the app from inside the app's final `send()`, before
    it has done its own bookkeeping for the finished response (close the connection for
    `Connection: close` or HTTP/1.0, start the keep-alive idle timer), which runs in the app's
    task. An app that cancels its work on `http.disconnect` (the proxy, QuartTrio, the gRPC
    server) thereby cancelled that bookkeeping, and such connections were never closed.

    While the `send()` that completes the response runs, an `http.disconnect` it produces is held
    back from `receive()` until that `send()` returns; nothing is shielded, so a shutdown can
    still cancel the app. Every other disconnect (a client leaving mid-stream) is delivered at
    once, so the proxy still cancels its upstream request within milliseconds.
    """

    async def wrapped(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        completing: trio.Event | None = None
        hook = disconnect_hook(scope)

        async def send_final(message: ASGIMessage) -> None:
            nonlocal completing
            if not _completes_response(message):
                await send(message)
                return
            completing = trio.Event()
            if hook is not None:
                hook.completing = True  # the same hold for the hook's callback
            try:
                await send(message)
            finally:
                completing.set()

        async def receive_held() -> ASGIMessage:
            message = await receive()
            if message["type"] == "http.disconnect" and completing is not None:
                await completing.wait()
            return message

        await app(scope, receive_held, send_final)

    return wrapped


def _completes_response(message: ASGIMessage) -> bool:
    kind = message["type"]
    if kind == "http.response.body":
        return not message.get("more_body", False)
    if kind == "http.response.trailers":
        return not message.get("more_trailers", False)
    return False
