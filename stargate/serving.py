"""Serving plumbing shared by every process that serves HTTP: the replica, the mock backend and
the benchmarks' no-op server; and the shutdown-signal watcher the Pylon uses too.

- `bind_listener` / `bind_all` bind the listening sockets up front, so a busy port fails start-up
  with a `StartupError` naming the listener before anything is served.
- `hypercorn_config` builds one listener's Hypercorn settings, with optional connection rotation
  (`MAX_REQUESTS_PER_CONNECTION`, docs/http-serving.md).
- `serve_asgi` serves an ASGI app on a bound socket with Hypercorn's trio worker, over TLS when
  given a server `ssl.SSLContext` (docs/tls.md).
- `watch_signals` turns SIGTERM/SIGINT into the caller's own shutdown policy: one callback for the
  signal that starts the shutdown, another for any later one (docs/rolling-restarts.md).

Importing this module installs every patch of Hypercorn and h11 (`hypercorn_patches.install()`,
idempotent; stargate/hypercorn_patches/, docs/http-serving.md), so whatever serves through it
gets them: the fixes, the cost cuts, strict HTTP/1.1 request framing, and the hooks of the HTTP
listener's client limits (which act only on listeners registered with
`http_limits.limit_connections`). It refuses, with a message that says what to do, to run on a
Hypercorn, h11 or h2 the patch table was not written for.
"""

from __future__ import annotations

import logging
import signal
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from stargate import accept_queue, hypercorn_patches
from stargate.config import ListenAddress

__all__ = [
    "LISTEN_BACKLOG",
    "MAX_REQUESTS_PER_CONNECTION",
    "SHUTDOWN_SIGNALS",
    "TLS_HANDSHAKE_TIMEOUT_SECONDS",
    "UNLIMITED_REQUESTS_PER_CONNECTION",
    "ASGIApp",
    "StartupError",
    "bind_all",
    "bind_listener",
    "bound_address",
    "hypercorn_config",
    "serve_asgi",
    "watch_signals",
]

hypercorn_patches.install()

LISTEN_BACKLOG = 1024
# Requests one client connection may carry before it is rotated (HTTP/2 GOAWAY, HTTP/1.1
# `Connection: close`), on every replica listener but the control plane's (docs/http-serving.md).
MAX_REQUESTS_PER_CONNECTION = 10_000
UNLIMITED_REQUESTS_PER_CONNECTION = 2**31
# How long an accepted TLS connection may take to complete its handshake before it is closed
# (Hypercorn's default is 60 s), so slow or stalled handshakes do not hold connections.
TLS_HANDSHAKE_TIMEOUT_SECONDS = 10.0
# The signals that stop a stargate process: SIGTERM from an orchestrator, SIGINT from a terminal.
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)

ASGIApp = Callable[..., Awaitable[None]]


class StartupError(RuntimeError):
    """A server cannot start (for example a listener cannot bind); the message says which."""


def bind_listener(name: str, address: ListenAddress) -> socket.socket:
    """Bind and listen on `address`, or raise `StartupError` naming the listener."""
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address.host, address.port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as error:
        sock.close()
        reason = error.strerror or str(error)
        raise StartupError(f"failed to bind {name} listener on {address}: {reason}") from error
    sock.setblocking(False)
    return sock


def bind_all(listeners: Sequence[tuple[str, ListenAddress]]) -> list[socket.socket]:
    """Bind every listener or none: on a failure the ones already bound are closed."""
    bound: list[socket.socket] = []
    try:
        for name, address in listeners:
            bound.append(bind_listener(name, address))
    except StartupError:
        for sock in bound:
            sock.close()
        raise
    return bound


def bound_address(sock: socket.socket) -> ListenAddress:
    """The address a socket actually bound (a requested port 0 becomes a real one)."""
    host, port = sock.getsockname()[:2]
    return ListenAddress(host, port)


def hypercorn_config(
    graceful_timeout: float, *, rotate_connections: bool = False
) -> HypercornConfig:
    """Hypercorn's settings for one listener.

    `graceful_timeout`: how long Hypercorn lets open connections finish after the shutdown
    trigger; a caller with its own drain deadline sets it past that deadline, so Hypercorn's
    never fires first. `rotate_connections`: after `MAX_REQUESTS_PER_CONNECTION` requests an
    HTTP/2 connection gets GOAWAY (its streams in flight finish; the client reconnects) and an
    HTTP/1.1 one gets `Connection: close`. Off by default, and for the replica's control-plane
    listener, whose Pylon channels carry registration streams for the life of the Pylon
    (docs/http-serving.md).
    """
    config = HypercornConfig()
    config.graceful_timeout = graceful_timeout
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_max_requests = (
        MAX_REQUESTS_PER_CONNECTION if rotate_connections else UNLIMITED_REQUESTS_PER_CONNECTION
    )
    return config


async def serve_asgi(
    app: ASGIApp,
    sock: socket.socket,
    config: HypercornConfig,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    *,
    ssl_context: ssl.SSLContext | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on an already-bound socket with Hypercorn's trio worker, in this task.

    With `ssl_context` the listener is served over TLS through Hypercorn's own TLS path (its
    secure sockets, wrapped in `trio.SSLListener`, each connection's handshake bounded by
    `TLS_HANDSHAKE_TIMEOUT_SECONDS`; ALPN picks HTTP/2 or HTTP/1.1). The context is used as is,
    not copied: whoever owns it can load a new identity for later handshakes (docs/tls.md).

    Returns after `shutdown_trigger` returns and every open connection has finished. Before the
    listening socket closes, new handshakes are refused and the connections the kernel already
    queued are accepted and served (`accept_queue.stop_new_connections`). The app is wrapped so
    Hypercorn completes each response (closing the connection, or starting its keep-alive idle
    timer) before the app hears `http.disconnect` (docs/http-serving.md).
    """

    class _Started:
        def started(self, value: object = None) -> None:
            task_status.started()

    async def stop_accepting() -> None:
        await shutdown_trigger()
        await accept_queue.stop_new_connections(sock)

    served: ASGIApp = hypercorn_patches.complete_response_before_disconnect(app)
    if ssl_context is None:
        sockets = Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[])
    else:
        # `worker_serve` asks the config for the context of its secure sockets.
        config.create_ssl_context = lambda: ssl_context  # type: ignore[method-assign]
        config.ssl_handshake_timeout = TLS_HANDSHAKE_TIMEOUT_SECONDS
        sockets = Sockets(secure_sockets=[sock], insecure_sockets=[], quic_sockets=[])
    await worker_serve(
        wrap_app(served, config.wsgi_max_body_size, "asgi"),
        config,
        sockets=sockets,
        shutdown_trigger=stop_accepting,
        task_status=_Started(),
    )


async def watch_signals(
    signals: AsyncIterator[int],
    on_first: Callable[[signal.Signals], None],
    on_repeat: Callable[[signal.Signals], None] | None = None,
    *,
    stopping: Callable[[], bool] | None = None,
) -> None:
    """Hand each signal from `signals` (a `trio.open_signal_receiver(*SHUTDOWN_SIGNALS)`, or a
    memory channel in tests) to the caller's shutdown policy.

    `on_first` gets the signal that starts the shutdown, `on_repeat` every later one (typically:
    stop waiting, exit now). `stopping` says whether the process is already shutting down for
    another reason (a server failed): then even the first signal received is a repeat. Without
    `on_repeat` the first signal received goes to `on_first` and this returns; later ones stay
    queued, unhandled, while the receiver is open. Otherwise this returns when `signals` ends.
    """
    received = False
    async for signum in signals:
        sig = signal.Signals(signum)
        if on_repeat is None:
            on_first(sig)
            return
        if received or (stopping is not None and stopping()):
            on_repeat(sig)
        else:
            on_first(sig)
        received = True
