"""Accepting every connection the kernel has queued in one pass of the scheduler.

Hypercorn serves its listeners with trio's `serve_listeners`, whose loop takes one connection per
`listener.accept()`, and each accept is a checkpoint: a pass of trio's scheduler between two
connections. On an idle replica a pass is short. Under load every pass also runs every task that
is ready (each open stream relaying its chunks), so when 200 clients connect at once the 200th
waits 200 such passes before its request is even read: 1,000 new streams on a replica already
relaying streams waited 4 s for their first chunk at p99 (docs/performance.md, "Side by side
with the peers").

`serve_one_listener` replaces trio's per-listener loop (`_serve_one_listener`; same errors, same
sleep when the process is out of file descriptors): after each accept it takes, without a
checkpoint, what else the kernel has already queued on a plain TCP listener (non-blocking
`accept(2)` until it would block, at most `MAX_ACCEPTS_PER_PASS`, so a flood still lets the
loop run between batches) and starts a handler task for each. A TLS listener accepts one at a
time as before. What the handlers do (admission against the client limits, the request) is
unchanged: they start sooner, together.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import trio
from trio._highlevel_serve_listeners import (  # trio's own loop, which this replaces
    ACCEPT_CAPACITY_ERRNOS,
    LOGGER,
    SLEEP_TIME,
    _run_handler,
)

__all__ = ["MAX_ACCEPTS_PER_PASS", "queued_streams", "serve_one_listener"]

MAX_ACCEPTS_PER_PASS = 256
"""Connections started in one pass at most; the rest wait for the next pass."""

# Errors of an accept that concern only that connection (the peer gave up): trio's own list.
_IGNORABLE = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM}


def queued_streams(listener: object, limit: int) -> list[trio.SocketStream]:
    """Up to `limit` connections already queued on `listener`, accepted without blocking or a
    checkpoint; [] for a listener other than a plain `trio.SocketListener` (TLS accepts one at a
    time) or when the next accept would block or fails (the loop's own accept reports that)."""
    if not isinstance(listener, trio.SocketListener):
        return []
    raw = getattr(listener.socket, "_sock", None)  # the stdlib socket trio wraps
    if not isinstance(raw, socket.socket):
        return []
    streams: list[trio.SocketStream] = []
    while len(streams) < limit:
        try:
            conn, _ = raw.accept()
        except BlockingIOError:
            break
        except OSError as error:
            if error.errno in _IGNORABLE:
                continue
            break
        streams.append(trio.SocketStream(trio.socket.from_stdlib_socket(conn)))
    return streams


async def serve_one_listener(
    listener: trio.abc.Listener[Any],
    handler_nursery: trio.Nursery,
    handler: Callable[[Any], Awaitable[object]],
) -> NoReturn:
    """trio's `_serve_one_listener`, starting every queued connection's handler in one pass."""
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno in ACCEPT_CAPACITY_ERRNOS:
                    LOGGER.error(
                        "accept returned %s (%s); retrying in %s seconds",
                        errno.errorcode[exc.errno],
                        exc.strerror,
                        SLEEP_TIME,
                        exc_info=True,
                    )
                    await trio.sleep(SLEEP_TIME)
                else:
                    raise
            else:
                handler_nursery.start_soon(_run_handler, stream, handler)
                for queued in queued_streams(listener, MAX_ACCEPTS_PER_PASS - 1):
                    handler_nursery.start_soon(_run_handler, queued, handler)
