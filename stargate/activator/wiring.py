"""How a replica wires its model pools: the pool file at start-up, which member controller serves
which pool, who decides for each pool across replicas (the Lease rules), and the pools' part of a
shutdown (docs/activator.md; docs/pool-ownership.md, "In the replica").

The runtime builds one `ReplicaPools` and calls it at start-up (`start`), when a shutdown begins
(`hand_over`), when the drain finishes (`release_leases`) and at exit (`stop_members`,
`close_leases`); what it decides, the runtime logs. The rules live here, beside the activator they
configure, so the runtime only wires.
"""

from __future__ import annotations

import dataclasses

import httpx
import trio
from prometheus_client import CollectorRegistry

from stargate.activator.config import (
    KubernetesMember,
    PoolConfig,
    PoolConfigError,
    PoolsConfig,
    ProcessMember,
    load_pool_config,
)
from stargate.activator.controller import FakeController, MemberController
from stargate.activator.kubernetes import (
    KubernetesConfigError,
    KubernetesController,
    KubernetesTarget,
    load_api_config,
)
from stargate.activator.lease_ownership import LeaseOwnership
from stargate.activator.members import MemberAvailability
from stargate.activator.metrics import ActivatorMetrics
from stargate.activator.ownership import LocalOwnership, PoolOwnership
from stargate.activator.pool import Activator
from stargate.activator.process import MemberCommand, ProcessController
from stargate.config import ActivatorConfig, DiscoveryConfig, PoolOwnershipConfig, ServeConfig
from stargate.routing import RoutingState, RoutingTargetKey
from stargate.serving import StartupError

__all__ = [
    "LEASE_RELEASE_SECONDS",
    "STOP_POOL_MEMBERS_SECONDS",
    "ReplicaPools",
    "lease_owner_url",
    "load_pools",
    "member_controller",
    "pool_leases",
    "shared_pools_warning",
]

STOP_POOL_MEMBERS_SECONDS = 15.0
"""At exit, how long each pool's controller may take to stop the members it started."""
LEASE_RELEASE_SECONDS = 2.0
"""At exit, how long releasing the pool Leases still held may take (docs/pool-ownership.md)."""


def load_pools(config: ActivatorConfig) -> PoolsConfig | None:
    """The pool file (`--pool-config`), or None without one; validated when the replica is built,
    so a bad file fails start-up (`StartupError`) before anything binds.

    Only `kubernetes` pools can be shared (`--pool-ownership=lease`): a `process` pool's engines
    are this replica's own children, on this machine (docs/pool-ownership.md)."""
    if config.pool_config_path is None:
        return None
    try:
        pools = load_pool_config(config.pool_config_path)
    except PoolConfigError as error:
        raise StartupError(f"invalid pool config: {error}") from error
    if config.ownership.mode == "lease":
        local = [p.pool.name for p in pools.pools if p.controller.kind != "kubernetes"]
        if local:
            raise StartupError(
                f"--pool-ownership=lease shares pools between replicas, but pools "
                f"{', '.join(local)} do not use the kubernetes controller (a process pool's "
                "engines run on this machine): use --pool-ownership=local, one replica per "
                "machine, for those"
            )
    return pools


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


def member_controller(
    pool: PoolConfig,
    *,
    availability: MemberAvailability,
    routing: RoutingState,
    services: trio.Nursery,
    health_client: httpx.AsyncClient,
    request_timeout: float,
) -> MemberController:
    """The controller that swaps `pool`'s members, by the pool's `controller.kind`: `process` runs
    each member's engine as this replica's child (in `services`, probed with `health_client`; the
    longest member start-up timeout bounds a start), `kubernetes` scales each member's workload
    through the API server (`request_timeout` per call), anything else (`fake`) only flips
    availability in memory."""
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
            routing,
            services,
            health_client=health_client,
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
            request_timeout=request_timeout,
        )
    return FakeController(availability, pool.pool.members)


def lease_owner_url(
    config: PoolOwnershipConfig, *, http_advertise_addr: str | None, tls: bool
) -> str | None:
    """The URL this replica records in the Leases it holds, where followers relay a pool's
    requests: `--pool-owner-url`, else its HTTP listener as its peers reach it (the advertise host
    with the HTTP port, `https://` when that listener serves TLS)."""
    if config.owner_url is not None or http_advertise_addr is None:
        return config.owner_url
    scheme = "http" if not tls else "https"
    return f"{scheme}://{http_advertise_addr}"


def pool_leases(
    config: PoolOwnershipConfig, pools: PoolsConfig, *, identity: str, owner_url: str | None
) -> LeaseOwnership:
    """One Lease per pool (docs/pool-ownership.md), written with the API credentials the
    members' scaling uses; credentials that cannot be found fail start-up."""
    try:
        api = load_api_config()
    except KubernetesConfigError as error:
        raise StartupError(f"--pool-ownership=lease: {error}") from error
    return LeaseOwnership.from_config(
        dataclasses.replace(config, owner_url=owner_url),
        [p.pool.name for p in pools.pools],
        identity=identity,
        api=api,
    )


class ReplicaPools:
    """A replica's model pools as wired: the pool file (`config`, None without one), each pool's
    controller, the Lease elector with `--pool-ownership=lease` (`leases`), and the `activator`
    once started.

    The pool file is read here, when the replica is built. `availability` is fed by the routing
    state's target counts (the runtime forwards them); the process controllers' engine probes
    use a client of their own.
    """

    def __init__(
        self,
        config: ServeConfig,
        *,
        routing: RoutingState,
        availability: MemberAvailability,
        registry: CollectorRegistry,
    ) -> None:
        self._serve = config
        self._routing = routing
        self._availability = availability
        self._registry = registry
        # Built with the first controller that probes engines: an httpx client costs a replica
        # without pools 40 ms of CPU at start-up (it loads certifi's CA bundle).
        self._health_client: httpx.AsyncClient | None = None
        self.config = load_pools(config.activator)
        self.activator: Activator | None = None
        self.leases: LeaseOwnership | None = None
        self._controllers: list[MemberController] = []

    @property
    def names(self) -> tuple[str, ...]:
        """Every pool's name, in file order (none without a pool file)."""
        return () if self.config is None else tuple(p.pool.name for p in self.config.pools)

    async def start(
        self, services: trio.Nursery, *, http_advertise_addr: str | None, tls: bool
    ) -> Activator | None:
        """Build each pool's controller and, with `--pool-ownership=lease`, the Lease elector;
        run the elector and the activator in `services`. None without a pool file.

        `http_advertise_addr` and `tls` give the owner URL recorded in the Leases
        (`lease_owner_url`)."""
        pools = self.config
        if pools is None:
            return None
        timing = self._serve.activator
        controllers: dict[str, MemberController] = {}
        self._health_client = httpx.AsyncClient(follow_redirects=False, trust_env=False)
        for pool in pools.pools:
            controller = member_controller(
                pool,
                availability=self._availability,
                routing=self._routing,
                services=services,
                health_client=self._health_client,
                request_timeout=timing.controller_timeout_ms / 1000,
            )
            controllers[pool.pool.name] = controller
            self._controllers.append(controller)
        members = [member for pool in pools.pools for member in pool.pool.members]
        self._availability.seed(
            members, lambda model: self._routing.active_backend_count(RoutingTargetKey(None, model))
        )
        ownership: PoolOwnership = LocalOwnership()
        if timing.ownership.mode == "lease":
            owner_url = lease_owner_url(
                timing.ownership, http_advertise_addr=http_advertise_addr, tls=tls
            )
            self.leases = pool_leases(
                timing.ownership, pools, identity=self._serve.stargate_id, owner_url=owner_url
            )
            await services.start(self.leases.run)
            ownership = self.leases
        activator = Activator(
            pools.pool_specs,
            controllers,
            self._availability,
            metrics=ActivatorMetrics.create(self._registry),
            router_name=self._serve.stargate_id,
            response_header_timeout=self._serve.proxy.response_header_timeout_ms / 1000,
            resync_interval=timing.resync_interval_ms / 1000,
            controller_timeout=timing.controller_timeout_ms / 1000,
            breaker_failures=timing.breaker_failures,
            breaker_cooldown=timing.breaker_cooldown_ms / 1000,
            ownership=ownership,
        )
        await services.start(activator.run)
        self.activator = activator
        return activator

    def unshared_warning(self) -> str | None:
        """`shared_pools_warning` for pools that are not shared through Leases, else None."""
        if self.config is None or self.leases is not None:
            return None
        return shared_pools_warning(self.config, self._serve.discovery)

    def invalidate_resident(self, model_id: str) -> None:
        """A dispatch to a pooled backend failed before its response head (refused, head timeout,
        reset, protocol error, unroutable): its pool must re-check which member is up."""
        if self.activator is not None and (pool := self.activator.pool_of(model_id)):
            self.activator.invalidate_resident(pool)

    def hand_over(self, services: trio.Nursery) -> None:
        """A shutdown begins: take no pool Lease any more, and release each one held as soon as
        its pool is idle, so another replica decides for it within a retry period rather than
        after the Lease expires (docs/pool-ownership.md, Failover)."""
        leases, activator = self.leases, self.activator
        if leases is None or activator is None:
            return
        leases.stop_acquiring()
        for pool in activator.pool_names:
            if activator.owns(pool):
                services.start_soon(_release_when_idle, leases, activator, pool)

    async def release_leases(self) -> None:
        """Release every pool Lease still held, within `LEASE_RELEASE_SECONDS`: once nothing is in
        flight (the drain), before the electors stop, so no renewal is cut off half-way."""
        leases = self.leases
        if leases is None:
            return
        with trio.move_on_after(LEASE_RELEASE_SECONDS):
            for pool in leases.pools:
                await leases.release(pool)

    async def stop_members(self) -> None:
        """At exit: each controller stops the members it started (each within
        `STOP_POOL_MEMBERS_SECONDS`), then the engine probes' client closes."""
        for controller in self._controllers:
            close = getattr(controller, "aclose", None)
            if close is not None:
                with trio.move_on_after(STOP_POOL_MEMBERS_SECONDS):
                    await close()
        if self._health_client is not None:
            await self._health_client.aclose()

    async def close_leases(self) -> None:
        """At exit: release the Leases a forced exit may have left held, then stop the elector."""
        if self.leases is not None:
            await self.release_leases()
            await self.leases.aclose()


async def _release_when_idle(leases: LeaseOwnership, activator: Activator, pool: str) -> None:
    await activator.wait_idle(pool)
    await leases.release(pool)
