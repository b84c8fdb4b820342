"""One replica: bind the listeners, run every server and background task in one trio nursery,
and shut down gracefully on SIGTERM/SIGINT.

Shutdown (control-plane spec §4.2): the first signal makes `/readyz` answer 503, ends warmup, and
tells every server to stop accepting and let in-flight requests and streams finish. If they have
not finished within `--shutdown-drain-timeout-ms`, or a second signal arrives, the remaining work
is cancelled and the process exits 1; a drain that completes exits 0. A critical task (a server)
that ends on its own also begins a shutdown, and the exit code is then 1.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app
from prometheus_client import CollectorRegistry

from stargate import __version__
from stargate.config import ListenAddress, ServeConfig
from stargate.http_app import create_http_app
from stargate.metrics import Metrics, metrics_asgi_app
from stargate.readiness import Readiness
from stargate.routing import RoutingState

__all__ = ["BoundAddresses", "Replica", "StartupError", "run"]

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024


class StartupError(RuntimeError):
    """The replica cannot start (for example a listener cannot bind); the message says which."""


@dataclass(frozen=True, slots=True)
class BoundAddresses:
    """The addresses the listeners actually bound (a configured port 0 becomes a real one)."""

    http: ListenAddress
    metrics: ListenAddress


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


def _bound_address(sock: socket.socket) -> ListenAddress:
    host, port = sock.getsockname()[:2]
    return ListenAddress(host, port)


def _hypercorn_config(graceful_timeout: float) -> HypercornConfig:
    config = HypercornConfig()
    # Our own drain deadline decides when in-flight work is cut; Hypercorn's must not fire first.
    config.graceful_timeout = graceful_timeout
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


ASGIApp = Callable[..., Awaitable[None]]


async def serve_asgi(
    app: ASGIApp,
    sock: socket.socket,
    config: HypercornConfig,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on an already-bound socket with Hypercorn's trio worker, in this task.

    Returns after `shutdown_trigger` returns and every open connection has finished.
    """

    class _Started:
        def started(self, value: object = None) -> None:
            task_status.started()

    await worker_serve(
        wrap_app(app, config.wsgi_max_body_size, "asgi"),
        config,
        sockets=Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[]),
        shutdown_trigger=shutdown_trigger,
        task_status=_Started(),
    )


class Replica:
    """A replica's parts, wired together.

    `run()` serves until shutdown and returns the process exit code.
    """

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = Metrics(self.registry, config.metrics_prefix)
        self.routing = RoutingState()
        self.readiness = Readiness(config.warmup, self.metrics.readiness)
        self.http_app = create_http_app(self.readiness, stargate_id=config.stargate_id)
        self._shutdown_started = trio.Event()
        self._services_scope: trio.CancelScope | None = None
        self._drain_deadline: float | None = None
        self._forced = False
        self._failed = False

    @property
    def shutting_down(self) -> bool:
        return self._shutdown_started.is_set()

    def begin_shutdown(self) -> None:
        """Start a graceful shutdown (idempotent): unready now, stop accepting, drain."""
        if self._shutdown_started.is_set():
            return
        log.info("entering draining mode")
        self.readiness.begin_draining()
        self._shutdown_started.set()
        self._drain_deadline = trio.current_time() + self.config.shutdown_drain_timeout_seconds
        if self._services_scope is not None:
            self._services_scope.deadline = self._drain_deadline

    def force_exit(self) -> None:
        """Stop draining now: cancel whatever is still running; the exit code will be 1."""
        self._forced = True
        self.begin_shutdown()
        if self._services_scope is not None:
            self._services_scope.cancel()

    async def run(
        self, *, task_status: trio.TaskStatus[BoundAddresses] = trio.TASK_STATUS_IGNORED
    ) -> int:
        """Bind, serve until shutdown, drain, and return the process exit code.

        Raises `StartupError` before anything is served if a listener cannot bind.
        """
        config = self.config
        log.info("starting stargate version=%s %s", __version__, describe(config))
        http_sock = bind_listener("HTTP", config.http_listen_addr)
        try:
            metrics_sock = bind_listener("metrics", config.metrics_listen_addr)
        except StartupError:
            http_sock.close()
            raise
        bound = BoundAddresses(http=_bound_address(http_sock), metrics=_bound_address(metrics_sock))
        graceful = config.shutdown_drain_timeout_seconds + 1.0

        async with trio.open_nursery() as services:
            self._services_scope = services.cancel_scope
            if self._drain_deadline is not None:
                services.cancel_scope.deadline = self._drain_deadline
            if config.warmup.enabled:
                services.start_soon(
                    self.readiness.run_warmup, self.routing.total_active_backend_count
                )
            await services.start(
                self._critical,
                "HTTP server",
                serve_asgi,
                self.http_app,
                http_sock,
                _hypercorn_config(graceful),
            )
            await services.start(
                self._critical,
                "metrics server",
                serve_asgi,
                metrics_asgi_app(self.registry),
                metrics_sock,
                _hypercorn_config(graceful),
            )
            log.info("HTTP listener on %s, metrics listener on %s", bound.http, bound.metrics)
            task_status.started(bound)

        if self._forced:
            log.error("forcing immediate exit")
            return 1
        if services.cancel_scope.cancelled_caught:
            log.error("graceful shutdown timed out; forcing exit")
            return 1
        if self._failed:
            log.error("shut down after a critical task failed")
            return 1
        log.info("graceful shutdown complete")
        return 0

    async def _critical(
        self,
        name: str,
        serve: Callable[..., Awaitable[None]],
        *args: Any,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run a task whose ending, other than in a shutdown, shuts the replica down."""
        try:
            await serve(*args, self._shutdown_started.wait, task_status=task_status)
        finally:
            if not self._shutdown_started.is_set():
                log.error("%s exited unexpectedly; beginning shutdown", name)
                self._failed = True
                self.begin_shutdown()


def describe(config: object) -> str:
    """`key=value` pairs of a (nested) config dataclass, for the one start-up log line."""
    assert dataclasses.is_dataclass(config)
    parts = []
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, ListenAddress):
            parts.append(describe(value))
        else:
            parts.append(f"{item.name}={value}")
    return " ".join(parts)


async def _watch_signals(signals: AsyncIterator[int], replica: Replica) -> None:
    async for signum in signals:
        name = signal.Signals(signum).name
        if not replica.shutting_down:
            log.info("received %s, beginning graceful shutdown", name)
            replica.begin_shutdown()
        else:
            log.warning("received %s during shutdown", name)
            replica.force_exit()


async def _main(config: ServeConfig) -> int:
    replica = Replica(config)
    code = 1
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_signals, signals, replica)
                code = await replica.run()
                nursery.cancel_scope.cancel()
        except* StartupError as group:
            for error in group.exceptions:
                log.error("%s", error)
    return code


def run(config: ServeConfig) -> int:
    """Run one replica in this process until it shuts down; return the exit code."""
    return trio.run(_main, config)
