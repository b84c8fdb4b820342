"""Serving plumbing shared by every process that serves HTTP: the replica, the mock backend and
the benchmarks' no-op server; the shutdown-signal watcher the Pylon uses too; and the replica's
own listeners.

- `bind_listener` / `bind_all` bind the listening sockets up front, so a busy port fails start-up
  with a `StartupError` naming the listener before anything is served.
- `hypercorn_config` builds one listener's Hypercorn settings, with optional connection rotation
  (`MAX_REQUESTS_PER_CONNECTION`, docs/http-serving.md).
- `serve_asgi` serves an ASGI app on a bound socket with Hypercorn's trio worker, over TLS when
  given a server `ssl.SSLContext` (docs/tls.md); `Servers` serves a table of them (`Server`:
  name, app, socket, settings, whether it takes TLS), one task each, and leaves, stops and
  drains them as one. A server whose settings are an `H2Config` is served by the lean HTTP/2
  server instead (`serve_h2`, stargate/h2_server.py): the replica's two gRPC listeners.
- `closed_on_failure` closes the bound sockets when start-up fails before they are served, and
  `startup_failures` finds the `StartupError`s in a failed nursery's exception group.
- The replica's four listeners: `bind_replica` binds them (`BoundAddresses`: where), and
  `replica_servers` is their table: which app each serves, its server's settings, and its TLS.
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

import contextlib
import functools
import logging
import signal
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from stargate import accept_queue, hypercorn_patches
from stargate.asgi import InFlight
from stargate.config import ListenAddress, ServeConfig
from stargate.h2_server import H2Config, serve_h2

__all__ = [
    "LISTEN_BACKLOG",
    "MAX_REQUESTS_PER_CONNECTION",
    "SHUTDOWN_SIGNALS",
    "TLS_HANDSHAKE_TIMEOUT_SECONDS",
    "UNLIMITED_REQUESTS_PER_CONNECTION",
    "ASGIApp",
    "BoundAddresses",
    "Server",
    "Servers",
    "StartupError",
    "bind_all",
    "bind_listener",
    "bind_replica",
    "bound_address",
    "closed_on_failure",
    "hypercorn_config",
    "replica_servers",
    "serve_asgi",
    "startup_failures",
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


@contextlib.contextmanager
def closed_on_failure(sockets: Iterable[socket.socket]) -> Iterator[None]:
    """Close the bound listening sockets if start-up fails before they are served: a process that
    goes on (a test, a library caller) must find the ports free again."""
    try:
        yield
    except BaseException:
        for sock in sockets:
            sock.close()
        raise


def startup_failures(group: BaseExceptionGroup[StartupError]) -> list[BaseException]:
    """The exceptions in `group`, nested groups flattened: a nursery may have nested the group, and
    each failure is reported on its own."""
    found: list[BaseException] = []
    for inner in group.exceptions:
        found.extend(startup_failures(inner) if isinstance(inner, BaseExceptionGroup) else [inner])
    return found


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


@dataclass(frozen=True, slots=True)
class Server:
    """One listener of a process: its name (in logs), its app, its bound socket, its server's
    settings (Hypercorn's, or an `H2Config` for the lean HTTP/2 server), and whether it takes the
    process's TLS (`tls=False` keeps it plain, as the replica's metrics listener, docs/tls.md)."""

    name: str
    app: ASGIApp
    sock: socket.socket
    config: HypercornConfig | H2Config
    tls: bool = True


class Servers:
    """A process's servers, shut down as one (docs/rolling-restarts.md): each started as a task
    (`start`), told to leave together (`leave`: HTTP/1.1 answers carry `Connection: close`, HTTP/2
    connections get GOAWAY, while everything is still served), stopped together (`stop`: no new
    connections, open ones finish), with the requests and streams in flight on all of them
    counted (`wait_idle`). A server started once the group is leaving or stopped leaves at once.
    """

    def __init__(self) -> None:
        self._configs: list[HypercornConfig | H2Config] = []
        self._leaving = False
        self._stopped = trio.Event()
        self._in_flight = InFlight()

    def leave(self) -> None:
        """Ask every client to move on, while still serving it (idempotent)."""
        self._leaving = True
        for config in self._configs:
            _leave(config)

    def stop(self) -> None:
        """Stop accepting on every listener; open connections finish (`serve_asgi`)."""
        self._stopped.set()

    async def wait_idle(self) -> None:
        """Return once no request or stream is in flight on any server."""
        await self._in_flight.wait_idle()

    async def start(
        self,
        nursery: trio.Nursery,
        servers: Iterable[Server],
        *,
        ssl_context: ssl.SSLContext | None = None,
        supervise: Callable[..., Awaitable[None]] | None = None,
    ) -> None:
        """Serve each of `servers` (`serve_asgi`, or `serve_h2` for an `H2Config`) in a task of
        `nursery`, in order, each listener serving before the next starts; over TLS with
        `ssl_context`, except a server with `tls=False`.

        `supervise(name, serve, task_status=...)` runs each server's task in its place, so the
        caller decides what a server that ends means (the replica shuts down); without it, the
        task is the server itself.
        """
        for server in servers:
            self._configs.append(server.config)
            if self._leaving or self._stopped.is_set():  # a shutdown began during start-up
                _leave(server.config)
            app = self._in_flight.track(server.app)
            serve: Callable[..., Awaitable[None]]
            if isinstance(server.config, H2Config):
                serve = functools.partial(
                    serve_h2, app, server.sock, server.config, self._stopped.wait
                )
            else:
                serve = functools.partial(
                    serve_asgi, app, server.sock, server.config, self._stopped.wait
                )
            if ssl_context is not None and server.tls:
                serve = functools.partial(serve, ssl_context=ssl_context)
            if supervise is None:
                await nursery.start(serve)
            else:
                await nursery.start(supervise, server.name, serve)


def _leave(config: HypercornConfig | H2Config) -> None:
    if isinstance(config, H2Config):
        config.leave()
    else:
        hypercorn_patches.leave(config)


# ---- the replica's listeners --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BoundAddresses:
    """The addresses the replica's listeners actually bound (a configured port 0 becomes a real
    one)."""

    http: ListenAddress
    grpc: ListenAddress
    model_discovery: ListenAddress
    metrics: ListenAddress

    def __str__(self) -> str:
        """As the replica's start-up line names them."""
        return (
            f"http={self.http} grpc={self.grpc} model_discovery={self.model_discovery} "
            f"metrics={self.metrics}"
        )


def bind_replica(config: ServeConfig) -> tuple[BoundAddresses, list[socket.socket]]:
    """Bind the replica's four listeners, in `BoundAddresses`' order, or none (`bind_all`)."""
    sockets = bind_all(
        [
            ("HTTP", config.http_listen_addr),
            ("gRPC", config.listen_addr),
            ("model-discovery gRPC", config.model_discovery_listen_addr),
            ("metrics", config.metrics_listen_addr),
        ]
    )
    return BoundAddresses(*(bound_address(sock) for sock in sockets)), sockets


def replica_servers(
    sockets: Sequence[socket.socket],
    *,
    http: ASGIApp,
    control_plane: ASGIApp,
    model_discovery: ASGIApp,
    metrics: ASGIApp,
    drain_timeout: float,
    limit_http: Callable[[ASGIApp, HypercornConfig], ASGIApp],
) -> list[Server]:
    """The replica's servers on the sockets of `bind_replica`, in the order they start.

    Hypercorn's graceful timeout is past `drain_timeout`: the replica's drain deadline decides
    when in-flight work is cut, and Hypercorn's must not fire first. Every listener rotates its
    connections but the control plane's, whose Pylon channels are long-lived; every listener
    takes TLS but metrics, which stays plain (docs/tls.md). `limit_http` puts the client limits
    on the HTTP listener (stargate/http_limits.py), given its app and its settings.
    """
    listener = functools.partial(hypercorn_config, drain_timeout + 1.0)
    grpc = functools.partial(
        H2Config,
        graceful_timeout=drain_timeout + 1.0,
        tls_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_SECONDS,
    )
    http_config = listener(rotate_connections=True)
    http_sock, grpc_sock, discovery_sock, metrics_sock = sockets
    return [
        Server("HTTP server", limit_http(http, http_config), http_sock, http_config),
        Server(
            "control-plane gRPC server",
            control_plane,
            grpc_sock,
            grpc(),
        ),
        Server(
            "model-discovery gRPC server",
            model_discovery,
            discovery_sock,
            grpc(max_requests_per_connection=MAX_REQUESTS_PER_CONNECTION),
        ),
        Server(
            "metrics server",
            metrics,
            metrics_sock,
            listener(rotate_connections=True),
            tls=False,
        ),
    ]


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
