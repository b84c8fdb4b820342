"""One replica: bind the listeners, run every server and background task in one trio nursery,
and shut down gracefully on SIGTERM/SIGINT.

Shutdown has two phases (docs/rolling-restarts.md). SIGTERM first *leaves*: for
`--shutdown-delay-ms` `/readyz` answers 503 and `WatchStargates` stops announcing this replica,
while every listener keeps accepting and every request is served as usual (HTTP/1.1 answers carry
`Connection: close`, HTTP/2 connections get GOAWAY, so pooled clients move on). Then it
*drains*: the servers stop accepting, registration and watch streams end, and in-flight requests
and streams finish. If they have not finished within `--shutdown-drain-timeout-ms`, or a second
signal arrives, the remaining work is cancelled and the process exits 1; a drain that completes
exits 0. SIGINT, and a critical task (a server) that ends on its own, skip the leave phase; the
latter also makes the exit code 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import logging
import math
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from prometheus_client import CollectorRegistry

from stargate import __version__, hypercorn_patches
from stargate.activator import (
    Activator,
    ActivatorMetrics,
    FakeController,
    LocalOwnership,
    MemberAvailability,
    MemberController,
    PoolOwnership,
)
from stargate.activator.config import (
    KubernetesMember,
    PoolConfig,
    PoolConfigError,
    PoolsConfig,
    ProcessMember,
    load_pool_config,
)
from stargate.activator.kubernetes import (
    KubernetesConfigError,
    KubernetesController,
    KubernetesTarget,
    load_api_config,
)
from stargate.activator.lease_ownership import LeaseOwnership
from stargate.activator.process import MemberCommand, ProcessController
from stargate.admin_app import create_admin_app
from stargate.asgi import InFlight
from stargate.config import (
    PYLON_RECONNECT_WINDOW_MS,
    ActivatorConfig,
    ConfigError,
    DiscoveryConfig,
    ListenAddress,
    ProxyConfig,
    ServeConfig,
)
from stargate.control_plane.auth import (
    Authenticator,
    OpenAuthenticator,
    StaticTokenAuthenticator,
    WorkerAuthenticator,
    WorkerAuthUnavailable,
    parse_gateway_endpoint,
    read_token_file,
)
from stargate.control_plane.discovery import PublisherConfig, WatchPublisher
from stargate.control_plane.gateway_credentials import (
    BearerProvider,
    OAuth2ClientCredentials,
    SecretsFileBearer,
)
from stargate.control_plane.health import probe_pool, upstream_get
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
from stargate.load_balancing.config import (
    LbConfig,
    LbConfigError,
    default_lb_config,
    load_lb_config,
)
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
from stargate.secrets_file import SecretsFile, SecretsFileError, tracing_access_token
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
from stargate.upstream import ConnectionPool, UpstreamConfig

__all__ = ["BoundAddresses", "Replica", "StartupError", "run"]

if TYPE_CHECKING:  # loaded only with --otel-endpoint (`_start_tracing`, docs/tracing.md)
    from stargate.tracing.setup import Tracing

log = logging.getLogger(__name__)

STOP_POOL_MEMBERS_SECONDS = 15.0
# At exit, how long releasing the pool Leases still held may take (docs/pool-ownership.md).
LEASE_RELEASE_SECONDS = 2.0


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
        self.readiness = Readiness(config.warmup, self.metrics.readiness)
        # TLS on the HTTP and gRPC listeners (docs/tls.md): a pair that cannot be served fails
        # start-up here, before anything binds.
        self.tls: ServedIdentity | None = None
        if config.tls is not None:
            self.tls = ServedIdentity.load(
                config.tls,
                metrics=TlsMetrics.create(self.registry, config.metrics_prefix),
                on_served=lambda identity: self.readiness.serve_certificate(identity.not_after),
            )
        # The process controller's engine probes (a few engines); backends are probed through
        # `_probe_pool` (stargate/control_plane/health.py, `probe_pool`).
        self._health_client = httpx.AsyncClient(follow_redirects=False, trust_env=False)
        proxy = config.proxy
        self._probe_pool = probe_pool(
            config.control_plane.health_check_timeout_ms / 1000,
            ca_file=None if proxy.upstream_ca_file is None else str(proxy.upstream_ca_file),
        )
        self.pool = ConnectionPool(
            UpstreamConfig(
                connect_timeout=proxy.connect_timeout_ms / 1000,
                response_head_timeout=proxy.response_header_timeout_ms / 1000,
                ca_file=None if proxy.upstream_ca_file is None else str(proxy.upstream_ca_file),
                max_connections_per_origin=proxy.max_connections_per_backend,
            )
        )
        self.forwarder = Forwarder(
            self.routing,
            self.pool,
            proxy,
            _lb_config(proxy),
            self.metrics.proxy,
            on_dispatch_failure=self._invalidate_pool_resident,
            capacity=self.pool,
        )
        self.member_availability = MemberAvailability()
        self.pools = _pool_config(config.activator)
        self.activator: Activator | None = None
        # With --pool-ownership=lease: who decides for each pool (docs/pool-ownership.md), and
        # the connections that relay a pool's requests to its owner.
        self.pool_leases: LeaseOwnership | None = None
        self._relay_pool: ConnectionPool | None = None
        self._pool_controllers: list[MemberController] = []
        control = config.control_plane
        self.registrations = RegistrationService(
            self.routing,
            _authenticator(config),
            functools.partial(
                http_health_probe,
                upstream_get(self._probe_pool),
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
            debug_config=self._debug_config,
            accept_openai_requests=config.proxy.accept_openai_requests,
            debug_endpoints=config.debug_endpoints,
        )
        self._leaving = False  # the shutdown has begun (first with the leave phase, if any)
        self._shutdown_started = trio.Event()  # the servers stop accepting: draining
        self._listener_configs: list[HypercornConfig] = []
        self._services_scope: trio.CancelScope | None = None
        self._services: trio.Nursery | None = None
        self._drain_deadline: float | None = None
        self._forced = False
        self._failed = False
        self._drained = False
        self._in_flight = InFlight()
        self.tracing: Tracing | None = None  # built by `run()` with --otel-endpoint

    @property
    def shutting_down(self) -> bool:
        """True from the first signal on (leaving or draining)."""
        return self._leaving

    def begin_shutdown(self, *, leave: bool = True) -> None:
        """Start a graceful shutdown (idempotent): unready now, then stop accepting and drain.

        With `leave` (SIGTERM) and a nonzero `--shutdown-delay-ms`, the replica first serves on
        for the delay while clients and Pylons move to other replicas; nothing but
        `force_exit()` or a later `begin_shutdown(leave=False)` cuts that short. Without it
        (SIGINT, a critical failure) it stops accepting at once.
        """
        if self._leaving:
            if not leave:
                self._stop_accepting()
            return
        self._leaving = True
        self._hand_over_pools()
        if not leave or self.config.shutdown_delay_ms == 0:
            self._stop_accepting()
            return
        log.info(
            "leaving: /readyz answers 503 and clients are asked to move on; still serving for "
            "%g s before draining",
            self.config.shutdown_delay_seconds,
        )
        self.readiness.begin_leaving()
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
        if self._shutdown_started.is_set():
            return
        self._leaving = True
        log.info("entering draining mode")
        self.readiness.begin_draining()
        if self.publisher is not None:
            self.publisher.stop()
        self.registrations.shutdown()
        self._shutdown_started.set()
        if self._services is not None:
            self._services.start_soon(self._finish_drain)
        self._drain_deadline = trio.current_time() + self.config.shutdown_drain_timeout_seconds
        if self._services_scope is not None:
            self._services_scope.deadline = self._drain_deadline

    def force_exit(self) -> None:
        """Stop draining now: cancel whatever is still running; the exit code will be 1."""
        self._forced = True
        self.begin_shutdown(leave=False)
        if self._services_scope is not None:
            self._services_scope.cancel()

    async def _check_worker_auth(self) -> None:
        """Before serving: the worker-auth gateway answers and the replica's own bearer can be
        had, so a wrong endpoint, CA or secret exits 1 at once (docs/worker-auth.md)."""
        authenticator = self.registrations.authenticator
        if not isinstance(authenticator, WorkerAuthenticator):
            return
        try:
            await authenticator.check()
        except WorkerAuthUnavailable as error:
            with trio.CancelScope(shield=True):
                await authenticator.aclose()
            raise StartupError(str(error)) from None
        log.info(
            "worker auth gateway %s reachable (tls=%s, credentials=%s)",
            authenticator.endpoint,
            authenticator.gateway.tls,
            authenticator.credentials_kind,
        )

    async def run(
        self, *, task_status: trio.TaskStatus[BoundAddresses] = trio.TASK_STATUS_IGNORED
    ) -> int:
        """Bind, serve until shutdown, drain, and return the process exit code.

        Raises `StartupError` before anything is served if a listener cannot bind.
        """
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
        http_sock, grpc_sock, discovery_sock, metrics_sock = sockets
        self.bound = bound = BoundAddresses(*(bound_address(sock) for sock in sockets))
        with _closed_on_failure(sockets):
            try:
                self.publisher = WatchPublisher(_discovery_config(config, bound))
            except ConfigError as error:
                raise StartupError(f"invalid discovery configuration: {error}") from error
            await self._check_worker_auth()
            try:
                self.tracing = _start_tracing(config)
            except SecretsFileError as error:  # names the file and key, never a value
                raise StartupError(f"cannot start the trace exporter: {error}") from error
        if not config.warmup.covers_pylon_reconnect:
            log.warning(
                "the warmup stabilization window (%d x %d ms) is shorter than %d ms: a restarted "
                "replica may promote before every Pylon has reconnected (docs/pylon.md)",
                config.warmup.stabilization_window,
                config.warmup.sample_interval_ms,
                PYLON_RECONNECT_WINDOW_MS,
            )
        if isinstance(self.registrations.authenticator, OpenAuthenticator):
            log.warning(
                "registration is unauthenticated: any client can register backends "
                "(set --registration-token-file or --worker-auth-endpoint)"
            )
        max_bytes = config.control_plane.grpc_max_message_bytes
        # Our drain deadline decides when in-flight work is cut; Hypercorn's must not fire first.
        graceful = config.shutdown_drain_timeout_seconds + 1.0

        try:
            async with trio.open_nursery() as services:
                self._services_scope = services.cancel_scope
                self._services = services
                if self._shutdown_started.is_set():
                    services.start_soon(self._finish_drain)
                elif self._leaving:
                    services.start_soon(self._leave_then_drain)
                if self._drain_deadline is not None:
                    services.cancel_scope.deadline = self._drain_deadline
                if config.warmup.enabled:
                    services.start_soon(
                        self.readiness.run_warmup, self.routing.total_active_backend_count
                    )
                await services.start(self._critical, "WatchStargates publisher", self.publisher.run)
                services.start_soon(self._expire_idle_upstream_connections)
                services.start_soon(self._sweep_departed_series)
                if self.tls is not None:
                    services.start_soon(self.tls.run)
                    services.start_soon(self.readiness.watch_certificate_expiry)
                self.activator = await self._start_activator(services)
                if self._leaving:  # a signal came while the pools started
                    self._hand_over_pools()
                # The HTTP app is built once the activator exists: the proxy holds pooled requests.
                proxy_app = ProxyApp(
                    self.forwarder,
                    config.proxy,
                    self.metrics.proxy,
                    fallback=cast(ASGIApp, self.admin_app),
                    activator=self.activator,
                    tracer=None if self.tracing is None else self.tracing.tracer,
                    relay=self._owner_relay(),
                )
                listener_config = functools.partial(hypercorn_config, graceful)
                http_app, http_config = self._limit_http_clients(
                    proxy_app, listener_config(rotate_connections=True)
                )
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
                        metrics_asgi_app(
                            self.registry, before_render=self._refresh_backend_connections
                        ),
                        metrics_sock,
                        listener_config(rotate_connections=True),
                    ),
                ]
                for name, app, sock, server_config in servers:
                    self._listener_configs.append(server_config)
                    if self._leaving:  # a signal came during start-up
                        hypercorn_patches.leave(server_config)
                    serve = functools.partial(
                        serve_asgi,
                        self._in_flight.track(app),
                        sock,
                        server_config,
                        self._shutdown_started.wait,
                    )
                    if self.tls is not None and sock is not metrics_sock:
                        # TLS on every listener but metrics, which stays plain (docs/tls.md).
                        serve = functools.partial(serve, ssl_context=self.tls.context)
                    await services.start(self._critical, name, serve)
                log.info(
                    "listening: http=%s grpc=%s model_discovery=%s metrics=%s advertise=%s",
                    bound.http,
                    bound.grpc,
                    bound.model_discovery,
                    bound.metrics,
                    self.publisher.config.advertise_addr,
                )
                task_status.started(bound)
        finally:
            with trio.CancelScope(shield=True):
                for controller in self._pool_controllers:
                    close = getattr(controller, "aclose", None)
                    if close is not None:
                        with trio.move_on_after(STOP_POOL_MEMBERS_SECONDS):
                            await close()
                await self._health_client.aclose()
                await self._probe_pool.aclose()
                await self.pool.aclose()
                if self._relay_pool is not None:
                    await self._relay_pool.aclose()
                if self.pool_leases is not None:  # a forced exit may have left some held
                    await self._release_pool_leases()
                    await self.pool_leases.aclose()
                if self.tracing is not None:  # the last spans, within a bounded wait
                    await self.tracing.aclose()
                if isinstance(self.registrations.authenticator, WorkerAuthenticator):
                    await self.registrations.authenticator.aclose()

        if self._forced:
            log.error("forcing immediate exit")
            return 1
        if self._failed:
            log.error("shut down after a critical task failed")
            return 1
        if services.cancel_scope.cancelled_caught and not self._drained:
            log.error("graceful shutdown timed out; forcing exit")
            return 1
        log.info("graceful shutdown complete")
        return 0

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
            if not self._shutdown_started.is_set():
                log.error("%s exited unexpectedly; beginning shutdown", name)
                self._failed = True
                self.begin_shutdown(leave=False)

    async def _start_activator(self, services: trio.Nursery) -> Activator | None:
        """Build the pools' controllers and run the activator in the service nursery."""
        if self.pools is None:
            return None
        timing = self.config.activator
        controllers: dict[str, MemberController] = {}
        for pool in self.pools.pools:
            controller = self._controller(pool, services)
            controllers[pool.pool.name] = controller
            self._pool_controllers.append(controller)
        members = [member for pool in self.pools.pools for member in pool.pool.members]
        self.member_availability.seed(
            members, lambda model: self.routing.active_backend_count(RoutingTargetKey(None, model))
        )
        ownership: PoolOwnership = LocalOwnership()
        if timing.ownership.mode == "lease":
            self.pool_leases = self._pool_leases(self.pools)
            await services.start(self.pool_leases.run)
            ownership = self.pool_leases
        activator = Activator(
            self.pools.pool_specs,
            controllers,
            self.member_availability,
            metrics=ActivatorMetrics.create(self.registry),
            router_name=self.config.stargate_id,
            response_header_timeout=self.config.proxy.response_header_timeout_ms / 1000,
            resync_interval=timing.resync_interval_ms / 1000,
            controller_timeout=timing.controller_timeout_ms / 1000,
            ownership=ownership,
        )
        await services.start(activator.run)
        log.info("model pools enabled: %s", ", ".join(p.pool.name for p in self.pools.pools))
        if self.pool_leases is None:
            warning = shared_pools_warning(self.pools, self.config.discovery)
            if warning is not None:
                log.warning("%s", warning)
        return activator

    def _pool_leases(self, pools: PoolsConfig) -> LeaseOwnership:
        """One Lease per pool (docs/pool-ownership.md)."""
        config = self.config.activator.ownership
        try:
            api = load_api_config()
        except KubernetesConfigError as error:
            raise StartupError(f"--pool-ownership=lease: {error}") from error
        owner_url = config.owner_url
        if owner_url is None and self.publisher is not None:
            # This replica's HTTP listener as its peers reach it: the advertise host.
            scheme = "http" if self.tls is None else "https"
            owner_url = f"{scheme}://{self.publisher.config.http_advertise_addr}"
        return LeaseOwnership.from_config(
            dataclasses.replace(config, owner_url=owner_url),
            [p.pool.name for p in pools.pools],
            identity=self.config.stargate_id,
            api=api,
        )

    def _hand_over_pools(self) -> None:
        """A shutdown begins: take no pool Lease any more, and release each one held as soon as
        its pool is idle, so another replica decides for it within a retry period rather than
        after the Lease expires (docs/pool-ownership.md, Failover)."""
        leases, activator = self.pool_leases, self.activator
        if leases is None or activator is None or self._services is None:
            return
        leases.stop_acquiring()
        for pool in activator.pool_names:
            if activator.owns(pool):
                self._services.start_soon(self._release_when_idle, leases, activator, pool)

    async def _release_pool_leases(self) -> None:
        """Release every pool Lease still held, within `LEASE_RELEASE_SECONDS`: once nothing is in
        flight (the drain), before the electors stop, so no renewal is cut off half-way."""
        leases = self.pool_leases
        if leases is None:
            return
        with trio.move_on_after(LEASE_RELEASE_SECONDS):
            for pool in leases.pools:
                await leases.release(pool)

    async def _release_when_idle(
        self, leases: LeaseOwnership, activator: Activator, pool: str
    ) -> None:
        await activator.wait_idle(pool)
        await leases.release(pool)

    def _controller(self, pool: PoolConfig, services: trio.Nursery) -> MemberController:
        spec = pool.controller
        name = pool.pool.name
        if spec.kind == "process":
            commands = {
                member: MemberCommand(entry.command, entry.health_path)
                for member, entry in spec.members.items()
                if isinstance(entry, ProcessMember)
            }
            timeouts = [
                entry.startup_timeout
                for entry in spec.members.values()
                if isinstance(entry, ProcessMember) and entry.startup_timeout is not None
            ]
            return ProcessController(
                name,
                commands,
                self.routing,
                services,
                health_client=self._health_client,
                startup_timeout=max(timeouts, default=300.0),
            )
        if spec.kind == "kubernetes":
            try:
                api = load_api_config()
            except KubernetesConfigError as error:
                raise StartupError(f"pool {name!r}: {error}") from error
            targets = {
                member: KubernetesTarget(entry.kind, entry.name, entry.api_version, entry.plural)
                for member, entry in spec.members.items()
                if isinstance(entry, KubernetesMember)
            }
            return KubernetesController(
                name,
                spec.namespace or api.namespace or "default",
                targets,
                api,
                request_timeout=self.config.activator.controller_timeout_ms / 1000,
            )
        return FakeController(self.member_availability, pool.pool.members)

    def _invalidate_pool_resident(self, model_id: str) -> None:
        """A dispatch to a pooled backend failed before its response head (refused, head timeout,
        reset, protocol error, unroutable): its pool must re-check which member is up."""
        if self.activator is not None and (pool := self.activator.pool_of(model_id)):
            self.activator.invalidate_resident(pool)

    async def _expire_idle_upstream_connections(self) -> None:
        """Close idle backend connections past their expiry, so a backend that gets no more
        traffic does not keep sockets open until shutdown."""
        while True:
            await trio.sleep(self.pool.config.idle_expiry)
            self.pool.close_expired()
            self._probe_pool.close_expired()
            if self._relay_pool is not None:
                self._relay_pool.close_expired()

    def _owner_relay(self) -> OwnerRelay | None:
        """With shared pools, the relay of a pool's requests to its owner (docs/pool-ownership.md):
        its own connections, whose response head may take a whole hold budget (the owner holds
        the request before it answers), so only the relay's deadline bounds it."""
        if self.pool_leases is None or self.activator is None:
            return None
        proxy = self.config.proxy
        self._relay_pool = ConnectionPool(
            UpstreamConfig(
                connect_timeout=proxy.connect_timeout_ms / 1000,
                response_head_timeout=math.inf,
                ca_file=None if proxy.upstream_ca_file is None else str(proxy.upstream_ca_file),
                max_connections_per_origin=proxy.max_connections_per_backend,
            )
        )
        return OwnerRelay(
            self._relay_pool,
            self.activator,
            response_header_timeout=proxy.response_header_timeout_ms / 1000,
        )

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
        self.pool.close_idle_except(urls)
        self._probe_pool.close_idle_except(urls)
        self.forwarder.forget_departed()

    def _refresh_backend_connections(self) -> None:
        """Before each `/metrics` render: every registered backend's upstream connections."""
        rows = []
        for registration in self.routing.registrations():
            load = self.pool.load(registration.identity.url)
            server_id = registration.identity.inference_server_id
            rows.append((server_id, load.in_use, load.idle, load.waiting))
        self.metrics.backend_connections.update(rows)

    async def _finish_drain(self) -> None:
        """End the servers once nothing is in flight; their remaining connections are idle."""
        await self._in_flight.wait_idle()
        log.info("in-flight requests and streams finished")
        await self._release_pool_leases()
        self._drained = True
        if self._services_scope is not None:
            self._services_scope.cancel()

    def _publish_target_count(self, target: RoutingTargetKey, count: int) -> None:
        self.metrics.set_active_inference_servers(target.routing_key, target.model_id, count)
        if count:
            self.series_sweep.saw_live_target(target.routing_key, target.model_id)
        self.member_availability.on_target_count(target, count)
        if count == 0:
            self.forwarder.forget_target(target)

    def _debug_config(self) -> dict[str, Any]:
        """`/debug/state`'s `config`: the Rust field set, with this replica's HTTP transport."""
        bound = self.bound
        publisher = self.publisher
        return {
            "stargate_id": self.config.stargate_id,
            "grpc_listen_addr": None if bound is None else str(bound.grpc),
            "model_discovery_listen_addr": None if bound is None else str(bound.model_discovery),
            "http_listen_addr": None if bound is None else str(bound.http),
            "metrics_listen_addr": None if bound is None else str(bound.metrics),
            "advertise_addr": None if publisher is None else publisher.config.advertise_addr,
            "stargate_discovery_dns_name": self.config.discovery.dns_name,
            "tunnel_protocol": "http",
            "backend_connectivity": "direct",
            "direct_quic_connections": 0,
        }


@contextlib.contextmanager
def _closed_on_failure(sockets: Iterable[socket.socket]) -> Iterator[None]:
    """Close the bound listening sockets if start-up fails before they are served."""
    try:
        yield
    except BaseException:
        for sock in sockets:
            sock.close()
        raise


def _start_tracing(config: ServeConfig) -> Tracing | None:
    """OpenTelemetry tracing with --otel-endpoint, else None (the SDK is not even imported: a
    replica without tracing never loads it; docs/tracing.md)."""
    if not config.tracing.enabled:
        return None
    from stargate.tracing.setup import setup_tracing

    # Read once: the exporter's gRPC metadata is fixed when it is built (docs/tracing.md, Token).
    path = config.secrets.path
    token = None if path is None else tracing_access_token(path)
    return setup_tracing(config.tracing, token, instance_id=config.stargate_id)


def _pool_config(activator: ActivatorConfig) -> PoolsConfig | None:
    """The pool file, validated at construction so a bad file fails before anything binds.

    Only `kubernetes` pools can be shared (`--pool-ownership=lease`): a `process` pool's engines
    are this replica's own children, on this machine (docs/pool-ownership.md)."""
    pools = _load_pools(activator)
    if pools is not None and activator.ownership.mode == "lease":
        local = [p.pool.name for p in pools.pools if p.controller.kind != "kubernetes"]
        if local:
            raise StartupError(
                f"--pool-ownership=lease shares pools between replicas, but pools "
                f"{', '.join(local)} do not use the kubernetes controller (a process pool's "
                "engines run on this machine): use --pool-ownership=local, one replica per "
                "machine, for those"
            )
    return pools


def _load_pools(activator: ActivatorConfig) -> PoolsConfig | None:
    if activator.pool_config_path is None:
        return None
    try:
        return load_pool_config(activator.pool_config_path)
    except PoolConfigError as error:
        raise StartupError(f"invalid pool config: {error}") from error


def shared_pools_warning(pools: PoolsConfig, discovery: DiscoveryConfig) -> str | None:
    """The start-up warning for pools whose members other replicas also control, or None.

    Pools are per replica: each replica runs its own activator with per-process locks, so two
    replicas driving the same Kubernetes members can scale down each other's busy member, and one
    replica's late deactivate can undo another's activation. Whether this replica is alone is
    decided from its discovery config (static peers or a DNS name mean peers; the Helm chart
    refuses the combination outright). `process` pools are not shared: their engines are this
    replica's own children, registered only here.
    """
    shared = [p.pool.name for p in pools.pools if p.controller.kind == "kubernetes"]
    if not shared:
        return None
    if discovery.peers:
        peers = f"static peers {', '.join(discovery.peers)}"
    elif discovery.dns_name is not None and not discovery.disable_dns_discovery:
        peers = f"peers discovered through {discovery.dns_name}"
    else:
        return None
    return (
        f"model pools {', '.join(shared)} use the kubernetes controller but this replica has "
        f"{peers}: every replica runs its own activator with per-process locks, so replicas can "
        "scale down each other's busy members and undo each other's activations; run a single "
        "replica while pools are enabled (README, Model pools)"
    )


def _lb_config(config: ProxyConfig) -> LbConfig:
    """The load-balancer config file, or the permissive default; a bad file fails start-up."""
    if config.lb_config_path is None:
        return default_lb_config()
    try:
        lb_config = load_lb_config(config.lb_config_path)
    except (LbConfigError, OSError) as error:
        raise StartupError(f"invalid load balancer config: {error}") from error
    log.info(
        "load balancer config loaded: default_lb=%s model_overrides=%d",
        lb_config.default.name,
        len(lb_config.models),
    )
    return lb_config


def _authenticator(config: ServeConfig) -> Authenticator:
    control = config.control_plane
    if control.registration_token_file is not None:
        return StaticTokenAuthenticator(read_token_file(control.registration_token_file))
    if control.worker_auth_endpoint is not None:
        try:
            parse_gateway_endpoint(control.worker_auth_endpoint)
            return WorkerAuthenticator(
                control.worker_auth_endpoint,
                _gateway_credentials(config),
                ca_file=control.worker_auth_ca_file,
            )
        except (ValueError, OSError) as error:
            raise StartupError(f"invalid worker auth configuration: {error}") from error
    return OpenAuthenticator()


def _gateway_credentials(config: ServeConfig) -> BearerProvider | None:
    """The bearer the replica presents to the worker-auth gateway (docs/worker-auth.md): minted
    by OAuth2 with `--oauth2-provider-host`, else read from the secrets file; none without one."""
    if config.secrets.path is None:
        return None
    secrets = SecretsFile(config.secrets.path)
    if config.control_plane.oauth2_provider_host is not None:
        return OAuth2ClientCredentials(config.control_plane.oauth2_provider_host, secrets)
    return SecretsFileBearer(secrets, config.secrets.json_keys)


def _host_address() -> str:
    """This host's primary address, for advertising when the listener binds every interface."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _discovery_config(config: ServeConfig, bound: BoundAddresses) -> PublisherConfig:
    advertise = config.advertise_addr
    if advertise is None:
        host = config.listen_addr.host
        if ipaddress.ip_address(host).is_unspecified:
            host = _host_address()
        advertise = ListenAddress(host, bound.grpc.port)
    return PublisherConfig(
        stargate_id=config.stargate_id,
        advertise_addr=str(advertise),
        http_advertise_addr=str(ListenAddress(advertise.host, bound.http.port)),
        discovery=config.discovery,
    )


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
        return 1
    tune_for_serving()  # docs/performance.md, "Garbage collection"
    code = 1
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
