"""One replica: bind the listeners, build and wire every part, run every server and background
task in one trio nursery, and shut down gracefully on SIGTERM/SIGINT.

Shutdown has two phases (docs/rolling-restarts.md). SIGTERM first *leaves*: for
`--shutdown-delay-ms` `/readyz` answers 503 and `WatchStargates` stops announcing this replica,
while every listener keeps accepting and every request is served as usual (HTTP/1.1 answers carry
`Connection: close`, HTTP/2 connections get GOAWAY, so pooled clients move on). Then it
*drains*: the servers stop accepting, registration and watch streams end, and in-flight requests
and streams finish. If they have not finished within `--shutdown-drain-timeout-ms`, or a second
signal arrives, the remaining work is cancelled and the process exits 1; a drain that completes
exits 0. SIGINT, and a critical task (a server) that ends on its own, skip the leave phase; the
latter also makes the exit code 1.

This module only wires: the phases, their guards and the exit code rule are `stargate.lifecycle`'s
(driven from here, read by readiness), and each part's builder lives beside the part (the pools'
in `stargate/activator/wiring.py`, registration auth in `control_plane/auth.py`, the publisher in
`control_plane/discovery.py`, the LB config in `load_balancing/config.py`, tracing in
`stargate/tracing/`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import trio
from hypercorn.config import Config as HypercornConfig
from prometheus_client import CollectorRegistry

from stargate import __version__, hypercorn_patches
from stargate.activator import Activator, MemberAvailability
from stargate.activator.wiring import ReplicaPools
from stargate.admin_app import create_admin_app, debug_state_config
from stargate.asgi import InFlight
from stargate.config import (
    PYLON_RECONNECT_WINDOW_MS,
    ListenAddress,
    ProxyConfig,
    ServeConfig,
    describe,
)
from stargate.control_plane.auth import (
    OpenAuthenticator,
    WorkerAuthenticator,
    check_worker_auth,
    registration_authenticator,
)
from stargate.control_plane.discovery import WatchPublisher, replica_publisher
from stargate.control_plane.health import probe_connections, upstream_get
from stargate.control_plane.registration import RegistrationConfig, RegistrationService
from stargate.control_plane.services import control_plane_app, model_discovery_app
from stargate.gc_policy import tune_for_serving
from stargate.health_probe import http_health_probe
from stargate.http_limits import (
    ConnectionLimit,
    check_open_file_limit,
    limit_connections,
    limit_request_body_time,
)
from stargate.lifecycle import Lifecycle, Outcome, Phase
from stargate.load_balancing.config import lb_config_at_startup
from stargate.metrics import (
    SERIES_GRACE_SECONDS,
    DepartedSeriesSweep,
    LiveFleet,
    Metrics,
    TlsMetrics,
    metrics_asgi_app,
    sweep_interval,
)
from stargate.proxy.app import ProxyApp
from stargate.proxy.contract import limit_answer
from stargate.proxy.forwarder import UNREGISTERED, Forwarder
from stargate.proxy.owner_relay import OwnerRelay
from stargate.readiness import Readiness
from stargate.routing import Registration, RoutingState, RoutingTargetKey
from stargate.serving import (
    SHUTDOWN_SIGNALS,
    ASGIApp,
    StartupError,
    bind_all,
    bound_address,
    hypercorn_config,
    serve_asgi,
    watch_signals,
)
from stargate.tls import ServedIdentity
from stargate.tracing import start_tracing
from stargate.upstream import ConnectionPool, UpstreamConfig

__all__ = ["BoundAddresses", "Replica", "StartupError", "run"]

if TYPE_CHECKING:  # loaded only with --otel-endpoint (`start_tracing`, docs/tracing.md)
    from stargate.tracing.setup import Tracing

log = logging.getLogger(__name__)

_ENDINGS = {
    Outcome.FORCED: "forcing immediate exit",
    Outcome.FAILED: "shut down after a critical task failed",
    Outcome.TIMED_OUT: "graceful shutdown timed out; forcing exit",
    Outcome.COMPLETE: "graceful shutdown complete",
}
"""The last line of a run, by how it ended (`Lifecycle.outcome`)."""


@dataclass(frozen=True, slots=True)
class BoundAddresses:
    """The addresses the listeners actually bound (a configured port 0 becomes a real one)."""

    http: ListenAddress
    grpc: ListenAddress
    model_discovery: ListenAddress
    metrics: ListenAddress


class Replica:
    """A replica's parts, wired together.

    `run()` serves until shutdown and returns the process exit code. `series_grace_seconds`
    (not a flag; tests shorten it) is how long the metric series of a departed backend or target
    stay exported (docs/metrics.md).
    """

    def __init__(
        self, config: ServeConfig, *, series_grace_seconds: float = SERIES_GRACE_SECONDS
    ) -> None:
        self.config = config
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = Metrics(self.registry, config.metrics_prefix)
        self.series_sweep = DepartedSeriesSweep(
            self.metrics, grace_seconds=series_grace_seconds, pinned_models=(UNREGISTERED,)
        )
        self.routing = RoutingState(
            on_target_count=self._publish_target_count,
            # Requests waiting on a backend that stops being routable move on (the router is
            # built below; the listener only runs once registrations exist).
            on_backend_unroutable=lambda registration, target: self.forwarder.backend_unroutable(
                registration, target
            ),
            estimate_unmeasured=config.proxy.estimate_unmeasured_backends,
        )
        # The phases (stargate/lifecycle.py): driven by this class, read by readiness.
        self.lifecycle = Lifecycle(leave_phase=config.shutdown_delay_ms > 0)
        self.readiness = Readiness(config.warmup, self.metrics.readiness, lifecycle=self.lifecycle)
        # TLS on the HTTP and gRPC listeners (docs/tls.md): a pair that cannot be served fails
        # start-up here, before anything binds.
        self.tls: ServedIdentity | None = None
        if config.tls is not None:
            self.tls = ServedIdentity.load(
                config.tls,
                metrics=TlsMetrics.create(self.registry, config.metrics_prefix),
                on_served=lambda identity: self.readiness.serve_certificate(identity.not_after),
            )
        proxy, control = config.proxy, config.control_plane
        # Backends are probed through connections of their own (control_plane/health.py).
        self._probe_connections = probe_connections(
            control.health_check_timeout_ms / 1000, ca_file=_ca_file(proxy)
        )
        self.upstream = ConnectionPool(
            _upstream_config(proxy, response_head_timeout=proxy.response_header_timeout_ms / 1000)
        )
        lb_config = lb_config_at_startup(proxy.lb_config_path)
        if not lb_config.permissive:  # read from --lb-config-path (the default is permissive)
            log.info(
                "load balancer config loaded: default_lb=%s model_overrides=%d",
                lb_config.default.name,
                len(lb_config.models),
            )
        self.forwarder = Forwarder(
            self.routing,
            self.upstream,
            proxy,
            lb_config,
            self.metrics.proxy,
            on_dispatch_failure=lambda model_id: self.pools.invalidate_resident(model_id),
            capacity=self.upstream,
        )
        self.member_availability = MemberAvailability()
        self.pools = ReplicaPools(
            config,
            routing=self.routing,
            availability=self.member_availability,
            registry=self.registry,
        )
        self.activator: Activator | None = None
        # With shared pools, the connections that relay a pool's requests to its owner.
        self._relay_connections: ConnectionPool | None = None
        self.registrations = RegistrationService(
            self.routing,
            registration_authenticator(config),
            functools.partial(
                http_health_probe,
                upstream_get(self._probe_connections),
                probe_timeout=control.health_check_timeout_ms / 1000,
            ),
            RegistrationConfig(control.idle_timeout_ms, control.max_idle_timeout_ms),
        )
        self.publisher: WatchPublisher | None = None
        self.bound: BoundAddresses | None = None
        self.admin_app = create_admin_app(
            self.readiness,
            self.routing,
            stargate_id=config.stargate_id,
            debug_config=lambda: debug_state_config(
                stargate_id=config.stargate_id,
                discovery_dns_name=config.discovery.dns_name,
                bound=self.bound,
                advertise_addr=None
                if self.publisher is None
                else self.publisher.config.advertise_addr,
            ),
            accept_openai_requests=config.proxy.accept_openai_requests,
            debug_endpoints=config.debug_endpoints,
        )
        self._stop_serving = trio.Event()  # the servers' shutdown trigger: set when draining
        self._listener_configs: list[HypercornConfig] = []
        self._services_scope: trio.CancelScope | None = None
        self._services: trio.Nursery | None = None
        self._drain_deadline: float | None = None
        self._in_flight = InFlight()
        self.tracing: Tracing | None = None  # built by `run()` with --otel-endpoint

    # ---- shutdown: the lifecycle's transitions, and the I/O each one calls for -------------------

    @property
    def shutting_down(self) -> bool:
        """True from the first signal on (leaving or draining)."""
        return self.lifecycle.shutting_down

    def begin_shutdown(self, *, leave: bool = True) -> None:
        """Start a graceful shutdown (idempotent): unready now, then stop accepting and drain.

        With `leave` (SIGTERM) and a nonzero `--shutdown-delay-ms`, the replica first serves on
        for the delay while clients and Pylons move to other replicas; nothing but
        `force_exit()` or a later `begin_shutdown(leave=False)` cuts that short. Without it
        (SIGINT, a critical failure) it stops accepting at once.
        """
        step = self.lifecycle.shutdown_step(leave=leave)
        if step is not None and not self.lifecycle.shutting_down:
            self._hand_over_pools()
        if step is Phase.LEAVING:
            self._leave()
        elif step is Phase.DRAINING:
            self._stop_accepting()

    def _leave(self) -> None:
        """The leave phase: unready, clients and Pylons told to move on, everything still served;
        the drain follows after the delay."""
        log.info(
            "leaving: /readyz answers 503 and clients are asked to move on; still serving for "
            "%g s before draining",
            self.config.shutdown_delay_seconds,
        )
        self.lifecycle.begin_leaving()
        if self.publisher is not None:
            self.publisher.leave()
        self.registrations.leave()
        for config in self._listener_configs:
            hypercorn_patches.leave(config)
        if self._services is not None:
            self._services.start_soon(self._leave_then_drain)

    async def _leave_then_drain(self) -> None:
        await trio.sleep(self.config.shutdown_delay_seconds)
        self._stop_accepting()

    def _stop_accepting(self) -> None:
        """The drain: stop accepting, end registration and watch streams (routes removed, so
        Pylons stay with the other replicas) and let in-flight requests and streams finish."""
        if self.lifecycle.stopped_accepting:
            return
        log.info("entering draining mode")
        self.lifecycle.begin_draining()
        if self.publisher is not None:
            self.publisher.stop()
        self.registrations.shutdown()
        self._stop_serving.set()
        if self._services is not None:
            self._services.start_soon(self._finish_drain)
        self._drain_deadline = trio.current_time() + self.config.shutdown_drain_timeout_seconds
        if self._services_scope is not None:
            self._services_scope.deadline = self._drain_deadline

    def force_exit(self) -> None:
        """Stop draining now: cancel whatever is still running; the exit code will be 1."""
        self.lifecycle.force()
        self.begin_shutdown(leave=False)
        if self._services_scope is not None:
            self._services_scope.cancel()

    async def _finish_drain(self) -> None:
        """End the servers once nothing is in flight; their remaining connections are idle."""
        await self._in_flight.wait_idle()
        log.info("in-flight requests and streams finished")
        await self.pools.release_leases()
        self.lifecycle.drained()
        if self._services_scope is not None:
            self._services_scope.cancel()

    def _hand_over_pools(self) -> None:
        if self._services is not None:
            self.pools.hand_over(self._services)

    # ---- run: bind, prepare, start the services, serve, close ------------------------------------

    async def run(
        self, *, task_status: trio.TaskStatus[BoundAddresses] = trio.TASK_STATUS_IGNORED
    ) -> int:
        """Bind, serve until shutdown, drain, and return the process exit code.

        Raises `StartupError` before anything is served if a listener cannot bind (or the
        publisher, the worker-auth gateway or the trace exporter cannot start).
        """
        bound, sockets = self._bind()
        with _closed_on_failure(sockets):
            publisher = await self._prepare(bound)
        self._warn_about_settings()
        try:
            async with trio.open_nursery() as services:
                await self._start_services(services, publisher)
                await self._serve(services, sockets)
                log.info(
                    "listening: http=%s grpc=%s model_discovery=%s metrics=%s advertise=%s",
                    bound.http,
                    bound.grpc,
                    bound.model_discovery,
                    bound.metrics,
                    publisher.config.advertise_addr,
                )
                task_status.started(bound)
        finally:
            with trio.CancelScope(shield=True):
                await self._close()
        outcome = self.lifecycle.outcome(cancelled=services.cancel_scope.cancelled_caught)
        log.log(logging.INFO if outcome is Outcome.COMPLETE else logging.ERROR, _ENDINGS[outcome])
        return outcome.exit_code

    def _bind(self) -> tuple[BoundAddresses, list[socket.socket]]:
        config = self.config
        log.info("starting stargate version=%s %s", __version__, describe(config))
        check_open_file_limit(config.max_client_connections)
        sockets = bind_all(
            [
                ("HTTP", config.http_listen_addr),
                ("gRPC", config.listen_addr),
                ("model-discovery gRPC", config.model_discovery_listen_addr),
                ("metrics", config.metrics_listen_addr),
            ]
        )
        self.bound = BoundAddresses(*(bound_address(sock) for sock in sockets))
        return self.bound, sockets

    async def _prepare(self, bound: BoundAddresses) -> WatchPublisher:
        """Before serving, what needs the bound ports or the network: the publisher (advertising
        the real ports), the worker-auth gateway's start-up check, the trace exporter."""
        self.publisher = replica_publisher(
            self.config, grpc_port=bound.grpc.port, http_port=bound.http.port
        )
        gateway = await check_worker_auth(self.registrations.authenticator)
        if gateway is not None:
            log.info(
                "worker auth gateway %s reachable (tls=%s, credentials=%s)",
                gateway.endpoint,
                gateway.gateway.tls,
                gateway.credentials_kind,
            )
        self.tracing = start_tracing(self.config)
        return self.publisher

    def _warn_about_settings(self) -> None:
        warmup = self.config.warmup
        if not warmup.covers_pylon_reconnect:
            log.warning(
                "the warmup stabilization window (%d x %d ms) is shorter than %d ms: a restarted "
                "replica may promote before every Pylon has reconnected (docs/pylon.md)",
                warmup.stabilization_window,
                warmup.sample_interval_ms,
                PYLON_RECONNECT_WINDOW_MS,
            )
        if isinstance(self.registrations.authenticator, OpenAuthenticator):
            log.warning(
                "registration is unauthenticated: any client can register backends "
                "(set --registration-token-file or --worker-auth-endpoint)"
            )

    async def _start_services(self, services: trio.Nursery, publisher: WatchPublisher) -> None:
        """The background tasks, the publisher and the pools, before any listener serves."""
        self._services_scope = services.cancel_scope
        self._services = services
        # A shutdown that began before this nursery existed (a signal during start-up) goes on.
        if self.lifecycle.stopped_accepting:
            services.start_soon(self._finish_drain)
        elif self.lifecycle.shutting_down:
            services.start_soon(self._leave_then_drain)
        if self._drain_deadline is not None:
            services.cancel_scope.deadline = self._drain_deadline
        if self.config.warmup.enabled:
            services.start_soon(self.readiness.run_warmup, self.routing.total_active_backend_count)
        await services.start(self._critical, "WatchStargates publisher", publisher.run)
        services.start_soon(self._expire_idle_upstream_connections)
        services.start_soon(self._sweep_departed_series)
        if self.tls is not None:
            services.start_soon(self.tls.run)
            services.start_soon(self.readiness.watch_certificate_expiry)
        self.activator = await self._start_activator(services)
        if self.lifecycle.shutting_down:  # a signal came while the pools started
            self._hand_over_pools()

    async def _start_activator(self, services: trio.Nursery) -> Activator | None:
        """Run the pools' controllers and the activator in the service nursery (None without a
        pool file), and say so."""
        publisher = self.publisher
        activator = await self.pools.start(
            services,
            http_advertise_addr=None if publisher is None else publisher.config.http_advertise_addr,
            tls=self.tls is not None,
        )
        if activator is not None:
            log.info("model pools enabled: %s", ", ".join(self.pools.names))
            if (warning := self.pools.unshared_warning()) is not None:
                log.warning("%s", warning)
        return activator

    async def _serve(self, services: trio.Nursery, sockets: list[socket.socket]) -> None:
        """Serve every listener, each as a critical task. The HTTP app is built once the activator
        exists: the proxy holds pooled requests."""
        config = self.config
        proxy_app = ProxyApp(
            self.forwarder,
            config.proxy,
            self.metrics.proxy,
            fallback=cast(ASGIApp, self.admin_app),
            activator=self.activator,
            tracer=None if self.tracing is None else self.tracing.tracer,
            relay=self._owner_relay(),
        )
        # Our drain deadline decides when in-flight work is cut; Hypercorn's must not fire first.
        graceful = config.shutdown_drain_timeout_seconds + 1.0
        listener_config = functools.partial(hypercorn_config, graceful)
        http_app, http_config = self._limit_http_clients(
            proxy_app, listener_config(rotate_connections=True)
        )
        max_bytes = config.control_plane.grpc_max_message_bytes
        http_sock, grpc_sock, discovery_sock, metrics_sock = sockets
        assert self.publisher is not None  # built by `_prepare`
        servers: list[tuple[str, ASGIApp, socket.socket, HypercornConfig]] = [
            ("HTTP server", http_app, http_sock, http_config),
            (
                "control-plane gRPC server",
                control_plane_app(
                    self.registrations,
                    self.publisher,
                    serving=self.readiness,
                    max_message_bytes=max_bytes,
                ),
                grpc_sock,
                listener_config(rotate_connections=False),  # long-lived Pylon channels
            ),
            (
                "model-discovery gRPC server",
                model_discovery_app(
                    self.routing, serving=self.readiness, max_message_bytes=max_bytes
                ),
                discovery_sock,
                listener_config(rotate_connections=True),
            ),
            (
                "metrics server",
                metrics_asgi_app(self.registry, before_render=self._refresh_backend_connections),
                metrics_sock,
                listener_config(rotate_connections=True),
            ),
        ]
        for name, app, sock, server_config in servers:
            self._listener_configs.append(server_config)
            if self.lifecycle.shutting_down:  # a signal came during start-up
                hypercorn_patches.leave(server_config)
            serve = functools.partial(
                serve_asgi,
                self._in_flight.track(app),
                sock,
                server_config,
                self._stop_serving.wait,
            )
            if self.tls is not None and sock is not metrics_sock:
                # TLS on every listener but metrics, which stays plain (docs/tls.md).
                serve = functools.partial(serve, ssl_context=self.tls.context)
            await services.start(self._critical, name, serve)

    async def _close(self) -> None:
        """At exit, however the run ended: pool members stop, every connection closes, the Leases
        a forced exit left held are released, the last spans go out (bounded), the gateway
        channel closes."""
        await self.pools.stop_members()
        await self._probe_connections.aclose()
        await self.upstream.aclose()
        if self._relay_connections is not None:
            await self._relay_connections.aclose()
        await self.pools.close_leases()
        if self.tracing is not None:
            await self.tracing.aclose()
        if isinstance(self.registrations.authenticator, WorkerAuthenticator):
            await self.registrations.authenticator.aclose()

    def _limit_http_clients(
        self, app: ASGIApp, listener: HypercornConfig
    ) -> tuple[ASGIApp, HypercornConfig]:
        """The HTTP listener's client limits (stargate/http_limits.py): the request body time on
        its app, the connection count on its listener. gRPC listeners get neither."""
        refusal = functools.partial(
            limit_answer, accept_openai_requests=self.config.proxy.accept_openai_requests
        )
        timeout = self.config.request_body_timeout_seconds
        if timeout is not None:
            app = limit_request_body_time(app, timeout, refusal, metrics=self.metrics.http)
        limit = ConnectionLimit(
            self.config.max_client_connections, refusal=refusal, metrics=self.metrics.http
        )
        limit_connections(listener, limit)
        return app, listener

    async def _critical(
        self,
        name: str,
        run: Callable[..., Awaitable[None]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run a task whose ending, other than in a shutdown, shuts the replica down."""
        try:
            await run(task_status=task_status)
        finally:
            if self.lifecycle.fail():
                log.error("%s exited unexpectedly; beginning shutdown", name)
                self.begin_shutdown(leave=False)

    def _owner_relay(self) -> OwnerRelay | None:
        """With shared pools, the relay of a pool's requests to its owner (docs/pool-ownership.md):
        its own connections, whose response head may take a whole hold budget (the owner holds
        the request before it answers), so only the relay's deadline bounds it."""
        if self.pools.leases is None or self.activator is None:
            return None
        proxy = self.config.proxy
        self._relay_connections = ConnectionPool(
            _upstream_config(proxy, response_head_timeout=math.inf)
        )
        return OwnerRelay(
            self._relay_connections,
            self.activator,
            response_header_timeout=proxy.response_header_timeout_ms / 1000,
        )

    # ---- background housekeeping -----------------------------------------------------------------

    async def _expire_idle_upstream_connections(self) -> None:
        """Close idle backend connections past their expiry, so a backend that gets no more
        traffic does not keep sockets open until shutdown."""
        while True:
            await trio.sleep(self.upstream.config.idle_expiry)
            self.upstream.close_expired()
            self._probe_connections.close_expired()
            if self._relay_connections is not None:
                self._relay_connections.close_expired()

    async def _sweep_departed_series(self) -> None:
        """Every sweep interval, release what the replica keeps for backends that left.

        Remove the metric series of backends and targets that left the fleet a grace period
        ago, so `/metrics` (its size, and the time to render it) follows the live fleet rather
        than every Pylon that ever registered; and `_release_departed_backends`."""
        interval = sweep_interval(self.series_sweep.grace_seconds)
        while True:
            await trio.sleep(interval)
            registrations = self.routing.registrations()
            fleet = LiveFleet.of(
                (r.identity.inference_server_id, r.identity.routing_key, r.models)
                for r in registrations
            )
            self.series_sweep.sweep(fleet, trio.current_time())
            self._release_departed_backends(registrations)

    def _release_departed_backends(self, live: Iterable[Registration]) -> None:
        """Drop the per-backend state no `live` registration needs any more, so a replica whose
        backends come and go returns to its baseline (docs/data-plane.md, "Per-backend
        connections"): the idle upstream connections of backends that left, and with them
        their origins (each a descriptor and a few KB, otherwise kept until `idle_expiry`), and
        the forwarder's round-robin counters and balancers of clusters and targets that are
        gone. Connections still carrying a stream are left to finish."""
        urls = {r.identity.url for r in live}
        self.upstream.close_idle_except(urls)
        self._probe_connections.close_idle_except(urls)
        self.forwarder.forget_departed()

    def _refresh_backend_connections(self) -> None:
        """Before each `/metrics` render: every registered backend's upstream connections."""
        rows = []
        for registration in self.routing.registrations():
            load = self.upstream.load(registration.identity.url)
            server_id = registration.identity.inference_server_id
            rows.append((server_id, load.in_use, load.idle, load.waiting))
        self.metrics.backend_connections.update(rows)

    def _publish_target_count(self, target: RoutingTargetKey, count: int) -> None:
        self.metrics.set_active_inference_servers(target.routing_key, target.model_id, count)
        if count:
            self.series_sweep.saw_live_target(target.routing_key, target.model_id)
        self.member_availability.on_target_count(target, count)
        if count == 0:
            self.forwarder.forget_target(target)


def _ca_file(proxy: ProxyConfig) -> str | None:
    return None if proxy.upstream_ca_file is None else str(proxy.upstream_ca_file)


def _upstream_config(proxy: ProxyConfig, *, response_head_timeout: float) -> UpstreamConfig:
    """Connections to backends (and, for the relay, to pool owners) as the proxy's flags say."""
    return UpstreamConfig(
        connect_timeout=proxy.connect_timeout_ms / 1000,
        response_head_timeout=response_head_timeout,
        ca_file=_ca_file(proxy),
        max_connections_per_origin=proxy.max_connections_per_backend,
    )


@contextlib.contextmanager
def _closed_on_failure(sockets: Iterable[socket.socket]) -> Iterator[None]:
    """Close the bound listening sockets if start-up fails before they are served."""
    try:
        yield
    except BaseException:
        for sock in sockets:
            sock.close()
        raise


async def _watch_signals(signals: AsyncIterator[int], replica: Replica) -> None:
    """SIGTERM (an orchestrator) leaves then drains; SIGINT (a person at a terminal) drains at
    once; a second signal of either kind, or any signal once the replica is already shutting
    down (a critical task failed), forces exit 1."""

    def begin(sig: signal.Signals) -> None:
        log.info("received %s, beginning graceful shutdown", sig.name)
        replica.begin_shutdown(leave=sig != signal.SIGINT)

    def force(sig: signal.Signals) -> None:
        log.warning("received %s during shutdown", sig.name)
        replica.force_exit()

    await watch_signals(signals, begin, force, stopping=lambda: replica.shutting_down)


async def _main(config: ServeConfig) -> int:
    try:
        replica = Replica(config)
    except StartupError as error:
        log.error("%s", error)
        return Outcome.STARTUP_FAILED.exit_code
    tune_for_serving()  # docs/performance.md, "Garbage collection"
    code = Outcome.STARTUP_FAILED.exit_code  # unless the run returns one
    with trio.open_signal_receiver(*SHUTDOWN_SIGNALS) as signals:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_signals, signals, replica)
                code = await replica.run()
                nursery.cancel_scope.cancel()
        except* StartupError as group:
            for failure in _leaves(group):  # a nursery may have nested the group
                log.error("%s", failure)
    return code


def _leaves(group: BaseExceptionGroup[StartupError]) -> list[BaseException]:
    """The exceptions in `group`, nested groups flattened."""
    found: list[BaseException] = []
    for inner in group.exceptions:
        found.extend(_leaves(inner) if isinstance(inner, BaseExceptionGroup) else [inner])
    return found


def run(config: ServeConfig) -> int:
    """Run one replica in this process until it shuts down; return the exit code."""
    return trio.run(_main, config)
