"""One replica: bind the listeners, build and wire every part, run every server and background
task in one trio nursery, and shut down gracefully on SIGTERM/SIGINT.

Shutdown has two phases (docs/rolling-restarts.md). SIGTERM first *leaves*: for
`--shutdown-delay-ms` `/readyz` answers 503 and `WatchStargates` stops announcing this replica,
while everything is still served (clients are told to move on). Then it *drains*: the servers stop
accepting, registration and watch streams end, and in-flight requests and streams finish; exit 0,
or 1 when the work left is cancelled at `--shutdown-drain-timeout-ms` or by a second signal.
SIGINT, and a critical task (a server) that ends on its own, skip the leave phase; the latter also
makes the exit code 1.

This module only wires: the phases, their guards and the exit code rule are `stargate.lifecycle`'s
(read by readiness), the I/O of each step `stargate.shutdown`'s, and each part's builder or upkeep
lives beside the part (e.g. the pools' in `activator/wiring.py`, the server table in `serving.py`,
the backend connections in `upstream/`, the owner relay in `proxy/owner_relay.py`).
"""

from __future__ import annotations

import functools
import logging
import socket
from typing import TYPE_CHECKING, cast

import trio
from prometheus_client import CollectorRegistry

from stargate import __version__
from stargate.activator import Activator, MemberAvailability
from stargate.activator.wiring import ReplicaPools
from stargate.admin_app import replica_admin_app
from stargate.config import PYLON_RECONNECT_WINDOW_MS, ServeConfig, describe
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
from stargate.http_limits import connection_cap, limit_http_clients
from stargate.lifecycle import Lifecycle, Outcome
from stargate.load_balancing.config import PREFIX_AWARE, lb_config_at_startup
from stargate.metrics import (
    SERIES_GRACE_SECONDS,
    DepartedSeriesSweep,
    LiveFleet,
    Metrics,
    TlsMetrics,
    metrics_asgi_app,
)
from stargate.proxy.app import ProxyApp
from stargate.proxy.contract import limit_answer
from stargate.proxy.forwarder import UNREGISTERED, Forwarder
from stargate.proxy.owner_relay import OwnerRelay, owner_relay
from stargate.readiness import Readiness
from stargate.routing import RoutingState, RoutingTargetKey
from stargate.serving import (
    SHUTDOWN_SIGNALS,
    ASGIApp,
    BoundAddresses,
    Servers,
    StartupError,
    bind_replica,
    closed_on_failure,
    replica_servers,
    startup_failures,
)
from stargate.shutdown import Shutdown, ShutdownSteps
from stargate.tracing import start_tracing
from stargate.tunnel.backends import replica_tunnels
from stargate.upstream import ConnectionPool, ConnectionPools, upstream_ca_file, upstream_config

__all__ = ["BoundAddresses", "Replica", "StartupError", "run"]

if TYPE_CHECKING:  # parts loaded only when configured, to keep the start-up of the rest short
    from stargate.tls import ServedIdentity  # with TLS (cryptography: ~50 ms to import)
    from stargate.tracing.setup import Tracing  # with --otel-endpoint (docs/tracing.md)

log = logging.getLogger(__name__)

_ENDINGS = {
    Outcome.FORCED: "forcing immediate exit",
    Outcome.FAILED: "shut down after a critical task failed",
    Outcome.TIMED_OUT: "graceful shutdown timed out; forcing exit",
    Outcome.COMPLETE: "graceful shutdown complete",
}
"""The last line of a run, by how it ended (`Lifecycle.outcome`)."""


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
        # One family for both identities (HTTP/gRPC, and the QUIC tunnels' mounted pair).
        # (None for a plaintext replica, which exports neither series.)
        tls_metrics = (
            TlsMetrics.create(self.registry, config.metrics_prefix)
            if config.tls is not None or config.tunnels.key_path is not None
            else None
        )
        if config.tls is not None:
            from stargate.tls import ServedIdentity

            assert tls_metrics is not None
            self.tls = ServedIdentity.load(
                config.tls,
                metrics=tls_metrics,
                on_served=lambda identity: self.readiness.serve_certificate(identity.not_after),
            )
        proxy, control = config.proxy, config.control_plane
        # Backends are probed through connections of their own (control_plane/health.py).
        self._probe_connections = probe_connections(
            control.health_check_timeout_ms / 1000, ca_file=upstream_ca_file(proxy)
        )
        self.upstream = ConnectionPool(upstream_config(proxy))
        # Kept up and closed together (upstream/upkeep.py), the owner relay's once it exists.
        self._connections = ConnectionPools(self.upstream, self._probe_connections)
        lb_config = lb_config_at_startup(proxy.lb_config_path)
        if not lb_config.permissive:  # read from --lb-config-path (the default is permissive)
            log.info(
                "load balancer config loaded: default_lb=%s model_overrides=%d",
                lb_config.default.name,
                len(lb_config.models),
            )
            if PREFIX_AWARE in lb_config.configured_names() and not proxy.derive_affinity_key:
                log.warning(
                    "the load balancer config uses prefix-aware but --derive-affinity-key is "
                    "off: only requests with x-cache-affinity-key are routed by their prefix "
                    "(docs/prefix-routing.md)"
                )
        authenticator = registration_authenticator(config)
        # quic:// and reverse backends (docs/tunnels.md): the QUIC machinery loads on first use.
        self.tunnels = replica_tunnels(
            config, authenticator.authenticate, self._advertised_host, self.registry, tls_metrics
        )
        self.forwarder = Forwarder(
            self.routing,
            self.upstream,
            proxy,
            lb_config,
            self.metrics.proxy,
            on_dispatch_failure=lambda model_id: self.pools.invalidate_resident(model_id),
            capacity=self.upstream,
            tunnels=self.tunnels,
        )
        self.member_availability = MemberAvailability()
        self.pools = ReplicaPools(
            config,
            routing=self.routing,
            availability=self.member_availability,
            registry=self.registry,
        )
        self.activator: Activator | None = None
        self._relay: OwnerRelay | None = None  # with shared pools (proxy/owner_relay.py)
        self.registrations = RegistrationService(
            self.routing,
            authenticator,
            functools.partial(
                http_health_probe,
                upstream_get(self._probe_connections),
                probe_timeout=control.health_check_timeout_ms / 1000,
            ),
            RegistrationConfig(control.idle_timeout_ms, control.max_idle_timeout_ms),
            tunnels=self.tunnels,
        )
        self.publisher: WatchPublisher | None = None
        self.bound: BoundAddresses | None = None
        # --max-client-connections, or computed from the open-file limit in run()
        self.max_client_connections = config.max_client_connections or 0
        self.admin_app = replica_admin_app(
            config,
            self.readiness,
            self.routing,
            bound=lambda: self.bound,
            advertise_addr=lambda: (
                None if self.publisher is None else self.publisher.config.advertise_addr
            ),
        )
        self._servers = Servers()  # left, stopped and drained as one (serving.py)
        self.shutdown = Shutdown(
            self.lifecycle,
            ShutdownSteps(
                hand_over=self.pools.hand_over,
                leave=self._leave,
                stop_accepting=self._stop_accepting,
                wait_idle=self._servers.wait_idle,
                release=self._release,
            ),
            delay_seconds=config.shutdown_delay_seconds,
            drain_timeout_seconds=config.shutdown_drain_timeout_seconds,
        )
        self.tracing: Tracing | None = None  # built by `run()` with --otel-endpoint

    def _advertised_host(self) -> str:
        """The host of the reverse tunnel target: the advertised gRPC address's."""
        if self.publisher is None:
            return "127.0.0.1"
        host = self.publisher.config.advertise_addr.rpartition(":")[0]
        return host.strip("[]") or "127.0.0.1"

    # ---- shutdown: what the parts do at each step (the sequence is stargate/shutdown.py) ---------

    def _leave(self) -> None:
        if self.publisher is not None:
            self.publisher.leave()
        self.registrations.leave()
        self._servers.leave()

    def _stop_accepting(self) -> None:
        if self.publisher is not None:
            self.publisher.stop()
        self.registrations.shutdown()
        self._servers.stop()

    async def _release(self) -> None:
        self.registrations.release_routes()
        await self.pools.release_leases()

    # ---- run: bind, prepare, start the services, serve, close ------------------------------------

    async def run(
        self, *, task_status: trio.TaskStatus[BoundAddresses] = trio.TASK_STATUS_IGNORED
    ) -> int:
        """Bind, serve until shutdown, drain, and return the process exit code.

        Raises `StartupError` before anything is served if a listener cannot bind (or the
        publisher, the worker-auth gateway or the trace exporter cannot start).
        """
        log.info("starting stargate version=%s %s", __version__, describe(self.config))
        self.max_client_connections = connection_cap(self.config.max_client_connections)
        bound, sockets = bind_replica(self.config)
        self.bound = bound
        with closed_on_failure(sockets):
            publisher = await self._prepare(bound)
        self._warn_about_settings()
        try:
            async with trio.open_nursery() as services:
                await self._start_services(services, publisher)
                await self._serve(services, sockets)
                log.info("listening: %s advertise=%s", bound, publisher.config.advertise_addr)
                task_status.started(bound)
        finally:
            with trio.CancelScope(shield=True):
                await self._close()
        outcome = self.lifecycle.outcome(cancelled=services.cancel_scope.cancelled_caught)
        log.log(logging.INFO if outcome is Outcome.COMPLETE else logging.ERROR, _ENDINGS[outcome])
        return outcome.exit_code

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
        self.shutdown.attach(services)
        if self.config.warmup.enabled:
            services.start_soon(self.readiness.run_warmup, self.routing.total_active_backend_count)
        services.start_soon(self._settle_initial_fleet)
        await services.start(self.shutdown.critical, "WatchStargates publisher", publisher.run)
        await services.start(self.tunnels.run)
        services.start_soon(self._connections.expire_idle, self.upstream.config.idle_expiry)
        services.start_soon(
            self.series_sweep.run, self._live_fleet, self._release_departed_backends
        )
        if self.tls is not None:
            services.start_soon(self.tls.run)
            services.start_soon(self.readiness.watch_certificate_expiry)
        self.activator = await self._start_activator(services)
        self.shutdown.hand_over_if_shutting_down()  # a signal came while the pools started

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
        self._relay = owner_relay(
            config.proxy, self.activator, shared=self.pools.leases is not None
        )
        if self._relay is not None:
            self._connections.add(self._relay.connections)
        assert self.publisher is not None  # built by `_prepare`
        max_bytes = config.control_plane.grpc_max_message_bytes
        servers = replica_servers(
            sockets,
            http=ProxyApp(
                self.forwarder,
                config.proxy,
                self.metrics.proxy,
                fallback=cast(ASGIApp, self.admin_app),
                activator=self.activator,
                tracer=None if self.tracing is None else self.tracing.tracer,
                relay=self._relay,
            ),
            control_plane=control_plane_app(
                self.registrations,
                self.publisher,
                serving=self.readiness,
                max_message_bytes=max_bytes,
            ),
            model_discovery=model_discovery_app(
                self.routing, serving=self.readiness, max_message_bytes=max_bytes
            ),
            metrics=metrics_asgi_app(
                self.registry, before_render=self._refresh_backend_connections
            ),
            drain_timeout=config.shutdown_drain_timeout_seconds,
            limit_http=functools.partial(
                limit_http_clients,
                body_timeout=config.request_body_timeout_seconds,
                max_connections=self.max_client_connections,
                refusal=functools.partial(
                    limit_answer, accept_openai_requests=config.proxy.accept_openai_requests
                ),
                metrics=self.metrics.http,
            ),
        )
        await self._servers.start(
            services,
            servers,
            ssl_context=None if self.tls is None else self.tls.context,
            supervise=self.shutdown.critical,
        )

    async def _close(self) -> None:
        """At exit, however the run ended: pool members stop, every connection closes, the Leases
        a forced exit left held are released, the last spans go out (bounded), the gateway
        channel closes."""
        await self.pools.stop_members()
        await self._connections.aclose()
        await self.pools.close_leases()
        if self.tracing is not None:
            await self.tracing.aclose()
        if isinstance(self.registrations.authenticator, WorkerAuthenticator):
            await self.registrations.authenticator.aclose()

    # ---- background housekeeping: what the replica keeps for backends that left -----------------

    def _live_fleet(self) -> LiveFleet:
        """The fleet the series sweep keeps series for: every live registration."""
        return LiveFleet.of(
            (r.identity.inference_server_id, r.identity.routing_key, r.models)
            for r in self.routing.registrations()
        )

    def _release_departed_backends(self) -> None:
        """After each series sweep, drop the per-backend state no live registration needs, so a
        replica whose backends come and go returns to its baseline (docs/data-plane.md,
        "Per-backend connections"): idle connections, and the forwarder's counters and balancers
        of clusters and targets that are gone; and the outlier records of departed backends
        (ejections that are due end here too when no request comes: docs/outliers.md)."""
        self._connections.close_idle_except(r.identity.url for r in self.routing.registrations())
        self.forwarder.forget_departed()
        self.forwarder.sweep_outliers()

    async def _settle_initial_fleet(self) -> None:
        """When warmup ends (at once without one), the backends registered so far are the
        initial fleet: they never ramp (docs/outliers.md, "Slow start")."""
        await self.readiness.wait_warm()
        self.forwarder.slow_start.settle(trio.current_time())

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
                nursery.start_soon(replica.shutdown.watch, signals)
                code = await replica.run()
                nursery.cancel_scope.cancel()
        except* StartupError as group:
            for failure in startup_failures(group):
                log.error("%s", failure)
    return code


def run(config: ServeConfig) -> int:
    """Run one replica in this process until it shuts down; return the exit code."""
    return trio.run(_main, config)
