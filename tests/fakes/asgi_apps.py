"""Tiny ASGI apps the proxy tests stand behind a `ProxyApp` as its fallback."""

from __future__ import annotations

from stargate.asgi import ASGIReceive, ASGIScope, ASGISend, answer_lifespan


async def not_found(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
    """Lifespan completed; every request answered an empty 404."""
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b""})
