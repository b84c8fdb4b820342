"""The routing state: registrations, targets, clusters and the counts derived from them.

docs/control-plane.md, "Routing state". Every mutation runs on the trio loop and contains no
`await`, so each one is atomic with respect to every reader without locks. What the Rust code does
with generation objects compared by pointer, this does with Python objects compared by `is`:

* a `Registration` is the generation of one admitted stream; every cleanup names the exact
  generation it cleans up, so a late cleanup of an old stream can never remove a same-id
  replacement;
* a `ClusterGeneration` is shared by the live registrations of one (routing key, cluster id); it
  is retired when the last one ends, and a cluster entry still holding a retired generation is
  replaced whole on the next upsert;
* a target (routing key, model) that loses its last backend is dropped, so per-target state (load
  balancer memory, from the proxy) starts fresh when the target comes back.

"Advertised" and "active" are different sets (docs/control-plane.md, Model status): every model
a registration lists, in any status, is advertised (a request for it gets 503 rather than 404
while none is active); a model is active for a registration only while a backend entry is stored
for it.

When a backend entry goes (the Pylon's update, the replica's own health probe, or the end of the
registration), `on_backend_unroutable` hears of it, so the proxy can move requests still waiting
for that backend's response head (docs/stale-routes.md).

A backend whose connection was refused is *demoted* (docs/data-plane.md, Retries): it stays in
every snapshot and count, but the proxy does not pick it until its health probe passes again.
Demotion is by `inference_server_id` and ends with the registration: a new registration of the
same id is routable only once its own probe has passed, which is exactly what lifts a demotion,
so keeping it would change nothing but keep every departed engine's id (and `any_demoted`, which
costs every request a set union) for the life of the replica.

Each backend entry keeps the time it joined its target (`BackendSnapshot.joined_at`: the
`received_at` of the update that first made it routable there, carried across heartbeats), and
the state the latest such time (`last_join`), so slow start (docs/outliers.md) can tell in O(1)
whether any backend may still be ramping.

A backend whose Pylon publishes its engine's KV events (docs/prefix-routing.md, "Precise mode")
has a set of cached prefix blocks (`kv_blocks.py`), per registration: `apply_kv_blocks` applies
each message's delta, and every `BackendSnapshot` of the registration shares the set by
reference (`BackendSnapshot.kv_blocks`, a live read-only view). A new stream starts from an empty
set (its first message is a reset), and the set goes with the registration.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Final

from stargate.routing.kv_blocks import MAX_KV_BLOCKS, KvBlocks
from stargate.routing.stats import (
    ModelStats,
    aggregate_stats,
    apply_reservations,
    mean_rtt_seconds,
)

__all__ = [
    "NO_KV_BLOCKS",
    "UNMEASURED_INPUT_TPS",
    "AlreadyRegistered",
    "BackendRoute",
    "BackendSnapshot",
    "ClusterGeneration",
    "ClusterSnapshot",
    "Registration",
    "RegistrationIdentity",
    "Reservation",
    "RoutingState",
    "RoutingTargetKey",
    "TargetSnapshot",
    "estimate_unmeasured_input_tps",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RoutingTargetKey:
    """The unit of routing: an optional routing key plus a model id.

    `routing_key=None` (unkeyed) and any string key never match each other.
    """

    routing_key: str | None
    model_id: str


@dataclass(frozen=True, slots=True)
class RegistrationIdentity:
    """What a registration stream may never change after admission.

    docs/control-plane.md, Admission.
    """

    inference_server_id: str
    cluster_id: str
    url: str
    routing_key: str | None
    reverse_tunnel: bool = False
    """The Pylon dials the replica's reverse tunnel listener (docs/tunnels.md)."""


class AlreadyRegistered(Exception):
    """Another live registration holds the same `inference_server_id` (any routing key)."""

    def __init__(self, inference_server_id: str) -> None:
        super().__init__(f"inference_server_id '{inference_server_id}' is already registered")
        self.inference_server_id = inference_server_id


class ClusterGeneration:
    """The shared generation of one (routing key, cluster id) while registrations are live."""

    __slots__ = ("cluster_id", "live_registrations", "retired", "routing_key")

    def __init__(self, routing_key: str | None, cluster_id: str) -> None:
        self.routing_key = routing_key
        self.cluster_id = cluster_id
        self.live_registrations = 0
        self.retired = False


class Registration:
    """One admitted registration stream. Compared by identity, never by id string."""

    __slots__ = (
        "_applying_previous",
        "_targets",
        "cluster",
        "ended",
        "identity",
        "kv_blocks",
        "models",
    )

    def __init__(self, identity: RegistrationIdentity, cluster: ClusterGeneration) -> None:
        self.identity = identity
        self.cluster = cluster
        self.models: frozenset[str] = frozenset()  # the advertised set
        self._applying_previous: frozenset[str] | None = None
        self.ended = False
        self.kv_blocks: KvBlocks | None = None
        """The engine's cached prefix blocks, once its Pylon published a KV delta."""
        # Each model's target key, made once: every heartbeat names the same models again.
        self._targets: dict[str, RoutingTargetKey] = {}

    @property
    def kv_view(self) -> AbstractSet[int]:
        """What `BackendSnapshot.kv_blocks` shows: the live set, or `NO_KV_BLOCKS`."""
        blocks = self.kv_blocks
        return NO_KV_BLOCKS if blocks is None else blocks.view

    def target(self, model_id: str) -> RoutingTargetKey:
        target = self._targets.get(model_id)
        if target is None:
            target = self._targets[model_id] = RoutingTargetKey(self.identity.routing_key, model_id)
        return target

    def __repr__(self) -> str:
        return f"Registration({self.identity.inference_server_id!r}, ended={self.ended})"


@dataclass(frozen=True, slots=True)
class BackendRoute:
    """An update's instruction to route one model to this registration's backend."""

    stats: ModelStats
    rtt_ns: int
    received_at: float


NO_KV_BLOCKS: Final[AbstractSet[int]] = frozenset()
"""`BackendSnapshot.kv_blocks` of a backend whose Pylon publishes no KV events."""


@dataclass(frozen=True, slots=True)
class BackendSnapshot:
    """One active backend of one target. Immutable: replaced whole on every update, so a
    request in flight keeps the snapshot it picked.

    `kv_blocks` is the exception: the hashes of the prefix blocks the backend's engine has
    cached (docs/prefix-routing.md, "Precise mode"), a live read-only view of the set the
    routing state keeps per registration and updates with every heartbeat (shared by every
    snapshot of the backend, never copied); `NO_KV_BLOCKS` (empty) when the Pylon publishes
    none. Not compared, not in the repr."""

    registration: Registration
    stats: ModelStats
    rtt_ns: int
    received_at: float
    kv_blocks: AbstractSet[int] = field(default=NO_KV_BLOCKS, compare=False, repr=False)
    joined_at: float = field(default=-math.inf, compare=False, repr=False)
    """When this backend joined the target: the `received_at` of the update that first made it
    routable there, kept by every later heartbeat (slow start, stargate/routing/slow_start.py)."""

    @property
    def inference_server_id(self) -> str:
        return self.registration.identity.inference_server_id

    @property
    def cluster_id(self) -> str:
        return self.registration.identity.cluster_id

    @property
    def url(self) -> str:
        return self.registration.identity.url


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """A cluster as load balancers see it: aggregated stats and its backends (sorted by id).

    `input_tps_estimated`: the cluster published no usable `last_mean_input_tps` and
    `stats.last_mean_input_tps` is a stand-in (`estimate_unmeasured_input_tps`)."""

    cluster_id: str
    stats: ModelStats
    rtt_seconds: float
    received_at: float
    backends: tuple[BackendSnapshot, ...]
    input_tps_estimated: bool = False

    @property
    def active_backend_count(self) -> int:
        return len(self.backends)


@dataclass(frozen=True, slots=True)
class TargetSnapshot:
    """Every cluster of one target at one instant."""

    target: RoutingTargetKey
    clusters: tuple[ClusterSnapshot, ...]

    @property
    def active_backend_count(self) -> int:
        return sum(cluster.active_backend_count for cluster in self.clusters)


UNMEASURED_INPUT_TPS: Final = 1000.0
"""The stand-in input TPS when no cluster of a target is measured yet. Only its equality across
the target matters (every estimate then scales alike, so the queues decide); 1,000 tokens/s keeps
the estimates in a plausible range for traces and wait-and-widen's millisecond buckets."""


def estimate_unmeasured_input_tps(
    clusters: tuple[ClusterSnapshot, ...],
) -> tuple[ClusterSnapshot, ...]:
    """`clusters` with a stand-in `last_mean_input_tps` for every cluster that has none usable
    (docs/pylon-data-path.md, "Unmeasured backends").

    A Pylon publishes its input TPS only after five completed requests (or a calibration), and
    every load-aware balancer needs one: without it pulsar ranks nothing, wait-and-widen finds no
    finite TTFT and power-of-n compares infinities, so a fresh fleet would be refused (503) or
    balanced at random. The stand-in is the mean of the target's measured clusters (a new engine
    is taken for an average one until it is measured), or `UNMEASURED_INPUT_TPS` when none is;
    the queue counts the Pylons publish from their first request then decide. Clusters that are
    measured are returned as they are, so the Rust rules hold wherever stats exist.
    """
    measured = [
        tps
        for cluster in clusters
        if math.isfinite(tps := cluster.stats.last_mean_input_tps) and tps > 0.0
    ]
    if len(measured) == len(clusters):
        return clusters
    stand_in = sum(measured) / len(measured) if measured else UNMEASURED_INPUT_TPS
    return tuple(
        cluster
        if math.isfinite(tps := cluster.stats.last_mean_input_tps) and tps > 0.0
        else replace(
            cluster,
            stats=replace(cluster.stats, last_mean_input_tps=stand_in),
            input_tps_estimated=True,
        )
        for cluster in clusters
    )


class Reservation:
    """A pending request on one backend of one cluster of one target (docs/data-plane.md,
    Reservations): a handle for `RoutingState.release`. Compared by identity. `active` turns False
    exactly once: on release, on the backend's next heartbeat for the target, or when the backend
    leaves the cluster."""

    __slots__ = ("_cluster", "_target", "active", "input_tokens", "priority", "registration")

    def __init__(
        self,
        registration: Registration,
        input_tokens: int,
        priority: int,
        target: _Target,
        cluster: _Cluster,
    ) -> None:
        self.registration = registration
        self.input_tokens = input_tokens
        self.priority = priority
        self.active = True
        self._target = target
        self._cluster = cluster

    @property
    def inference_server_id(self) -> str:
        return self.registration.identity.inference_server_id

    @property
    def cluster_id(self) -> str:
        return self.registration.identity.cluster_id

    def _deactivate(self) -> None:
        """Drop out of the cluster's pending set and invalidate the cached snapshots."""
        if not self.active:
            return
        self.active = False
        cluster = self._cluster
        cluster.pending.pop(self, None)
        mine = cluster.pending_by_backend.get(self.inference_server_id)
        if mine is not None:
            mine.pop(self, None)
            if not mine:
                del cluster.pending_by_backend[self.inference_server_id]
        cluster.reserved_count -= 1
        cluster.reserved_tokens -= self.input_tokens
        cluster.view = None
        self._target.snapshot = None

    def __repr__(self) -> str:
        return (
            f"Reservation({self.inference_server_id!r}, tokens={self.input_tokens}, "
            f"priority={self.priority}, active={self.active})"
        )


class _Cluster:
    __slots__ = (
        "backends",
        "generation",
        "pending",
        "pending_by_backend",
        "reserved_count",
        "reserved_tokens",
        "snapshot",
        "source_id",
        "stale",
        "view",
    )

    def __init__(self, generation: ClusterGeneration) -> None:
        self.generation = generation
        self.backends: dict[str, BackendSnapshot] = {}
        self.source_id: str | None = None
        self.snapshot: ClusterSnapshot | None = None  # the base: aggregated, no reservations
        # The backends changed since `snapshot` was built: rebuilt by the next read, not by every
        # heartbeat (docs/performance.md, "Control plane").
        self.stale = False
        self.pending: dict[Reservation, None] = {}  # insertion-ordered set of active reservations
        # The same reservations by backend id, so a heartbeat (the registration apply loop)
        # releases its own without scanning the whole cluster's.
        self.pending_by_backend: dict[str, dict[Reservation, None]] = {}
        self.reserved_count = 0  # len(pending) and the sum of its tokens, kept incrementally
        self.reserved_tokens = 0
        self.view: ClusterSnapshot | None = None  # cached base + pending; None = recompute

    def refresh(self) -> None:
        """Note an insert, replace or removal: the snapshot is rebuilt when next read.

        A heartbeat changes its backend's statistics every time, and most heartbeats are never
        read before the next one replaces them (a target's snapshot is built only when a request
        needs it), so the aggregation runs once per read of a changed cluster rather than once
        per heartbeat.
        """
        self.stale = True
        self.view = None

    def _rebuild(self) -> None:
        """Recompute the cluster snapshot (docs/control-plane.md, Cluster aggregation)."""
        self.stale = False
        if self.source_id not in self.backends:
            # The source left: keep latest-wins fields from the most recently updated backend.
            self.source_id = max(
                self.backends.values(), key=lambda b: b.received_at
            ).registration.identity.inference_server_id
        source = self.backends[self.source_id]
        ordered = tuple(self.backends[key] for key in sorted(self.backends))
        self.snapshot = ClusterSnapshot(
            cluster_id=self.generation.cluster_id,
            stats=aggregate_stats([b.stats for b in ordered], source.stats),
            rtt_seconds=mean_rtt_seconds([b.rtt_ns for b in ordered]),
            received_at=source.received_at,
            backends=ordered,
        )
        self.view = None

    def current(self) -> ClusterSnapshot | None:
        """The base snapshot with every pending reservation applied (cached until either
        changes)."""
        if self.stale:
            self._rebuild()
        if self.view is None and self.snapshot is not None:
            base = self.snapshot
            if self.pending:
                stats = apply_reservations(
                    base.stats,
                    ((r.input_tokens, r.priority) for r in self.pending),
                    totals=(self.reserved_count, self.reserved_tokens),
                )
                self.view = ClusterSnapshot(
                    cluster_id=base.cluster_id,
                    stats=stats,
                    rtt_seconds=base.rtt_seconds,
                    received_at=base.received_at,
                    backends=base.backends,
                )
            else:
                self.view = base
        return self.view

    def release_backend(self, inference_server_id: str) -> None:
        """Drop every pending reservation on one backend (its heartbeat arrived, or it left)."""
        for reservation in list(self.pending_by_backend.get(inference_server_id, ())):
            reservation._deactivate()

    def release_all(self) -> None:
        """The cluster is dropped: none of its reservations can apply any more."""
        for reservation in list(self.pending):
            reservation._deactivate()


class _Target:
    __slots__ = ("clusters", "snapshot")

    def __init__(self) -> None:
        self.clusters: dict[str, _Cluster] = {}
        self.snapshot: TargetSnapshot | None = None

    @property
    def active_backend_count(self) -> int:
        return sum(len(cluster.backends) for cluster in self.clusters.values())


TargetCountListener = Callable[[RoutingTargetKey, int], None]
BackendUnroutableListener = Callable[[Registration, RoutingTargetKey], None]


class RoutingState:
    """Registrations and the targets they make routable.

    `on_target_count(target, count)` is called after every change of a target's active backend
    count (with 0 when the target empties), so the metrics layer can keep the
    `active_inference_servers` gauge without this module importing it.

    `on_backend_unroutable(registration, target)` is called after the backend entry of exactly
    that registration leaves `target` (once per entry; never for an entry that was not stored), so
    the proxy can cancel attempts still waiting for that backend's response head instead of
    letting them wait out the head timeout. It must not mutate the routing state.

    `estimate_unmeasured`: snapshots give clusters without a usable input TPS a stand-in
    (`estimate_unmeasured_input_tps`; `serve --unmeasured-backends estimate`). Off, the snapshots
    carry what the Pylons published (the Rust rule).
    """

    def __init__(
        self,
        on_target_count: TargetCountListener | None = None,
        *,
        wall_clock: Callable[[], float] = time.time,
        on_backend_unroutable: BackendUnroutableListener | None = None,
        estimate_unmeasured: bool = False,
    ) -> None:
        self._on_target_count = on_target_count
        self._estimate_unmeasured = estimate_unmeasured
        self._on_backend_unroutable = on_backend_unroutable
        self._registrations: dict[str, Registration] = {}
        self._clusters: dict[tuple[str | None, str], ClusterGeneration] = {}
        self._advertised: dict[RoutingTargetKey, int] = {}
        self._targets: dict[RoutingTargetKey, _Target] = {}
        # Every target some registration ever advertised, with the wall-clock time it first did:
        # the only model names that may become metric labels, and OpenAI's `created`.
        self._known: dict[RoutingTargetKey, int] = {}
        self._wall_clock = wall_clock
        self._demoted: set[str] = set()
        self._last_join = -math.inf

    # ---- registrations --------------------------------------------------------------------------

    def begin(self, identity: RegistrationIdentity) -> Registration:
        """Reserve `identity.inference_server_id` for a new stream and join its cluster.

        Raises `AlreadyRegistered` if a live registration has the same id, whatever its routing
        key (docs/control-plane.md, Admission).
        """
        if identity.inference_server_id in self._registrations:
            raise AlreadyRegistered(identity.inference_server_id)
        key = (identity.routing_key, identity.cluster_id)
        generation = self._clusters.get(key)
        if generation is None:
            generation = self._clusters[key] = ClusterGeneration(*key)
        generation.live_registrations += 1
        registration = Registration(identity, generation)
        self._registrations[identity.inference_server_id] = registration
        return registration

    def apply(self, registration: Registration, models: Mapping[str, BackendRoute | None]) -> bool:
        """Apply one registration update: `models` maps every model the update lists to a route
        (ACTIVE with an RTT) or None (listed but not routable).

        Models missing from `models` lose both their route and their advertised membership.
        Returns False (and changes nothing) if `registration` has already ended.
        """
        if not self.is_live(registration):
            return False
        previous = registration.models
        advertised = frozenset(models)
        # 1. Publish the advertised set first, so no reader ever sees a route for a model that is
        #    not advertised.
        for model_id in advertised - previous:
            target = registration.target(model_id)
            self._advertised[target] = self._advertised.get(target, 0) + 1
            if target not in self._known:
                self._known[target] = int(self._wall_clock())
        for model_id in previous - advertised:
            self._unadvertise(registration.target(model_id))
        registration._applying_previous = previous
        registration.models = advertised
        # 2. Routes of models no longer listed go.
        for model_id in previous - advertised:
            self._remove(registration, registration.target(model_id))
            registration._targets.pop(model_id, None)  # keys only of models still listed
        # 3. Upsert or remove each listed model.
        for model_id, route in models.items():
            if route is None:
                self._remove(registration, registration.target(model_id))
            else:
                self._upsert(registration, registration.target(model_id), route)
        registration._applying_previous = None
        return True

    def apply_kv_blocks(
        self,
        registration: Registration,
        *,
        reset: bool,
        added: Iterable[int],
        removed: Iterable[int],
    ) -> bool:
        """Apply one registration message's KV-block delta (reset, then added, then removed) to
        the backend's block set, created by the first delta. Returns False (and changes
        nothing) if `registration` has already ended."""
        if not self.is_live(registration):
            return False
        blocks = registration.kv_blocks
        if blocks is None:
            blocks = registration.kv_blocks = KvBlocks(MAX_KV_BLOCKS)
            self._share_kv_blocks(registration)
        blocks.apply(reset=reset, added=added, removed=removed)
        return True

    def _share_kv_blocks(self, registration: Registration) -> None:
        """Give the backend entries stored before its first delta the new set."""
        view = registration.kv_view
        for model_id in registration.models:
            state = self._targets.get(registration.target(model_id))
            if state is None:
                continue
            cluster = state.clusters.get(registration.identity.cluster_id)
            server_id = registration.identity.inference_server_id
            entry = None if cluster is None else cluster.backends.get(server_id)
            if cluster is None or entry is None or entry.registration is not registration:
                continue
            cluster.backends[server_id] = replace(entry, kv_blocks=view)
            cluster.refresh()
            state.snapshot = None

    def end(self, registration: Registration, *, notify: bool = True) -> bool:
        """End exactly this registration: remove every route and advertised membership it holds.

        A no-op (returns False) if the id now belongs to another registration or this one already
        ended. If it ends mid-update, routes of the previous and the advertised set both go.
        `notify=False` keeps `on_backend_unroutable` silent: for removals that say nothing about
        the backend (the replica's own shutdown, a held registration replaced by the same
        backend's new stream), where requests in flight should finish where they are.
        """
        if self._registrations.get(registration.identity.inference_server_id) is not registration:
            return False
        del self._registrations[registration.identity.inference_server_id]
        registration.ended = True
        cleanup = registration.models | (registration._applying_previous or frozenset())
        for model_id in registration.models:
            self._unadvertise(registration.target(model_id))
        generation = registration.cluster
        generation.live_registrations -= 1
        if generation.live_registrations == 0:
            generation.retired = True
            key = (generation.routing_key, generation.cluster_id)
            if self._clusters.get(key) is generation:
                del self._clusters[key]
        for model_id in cleanup:
            self._remove(registration, registration.target(model_id), notify=notify)
        self._demoted.discard(registration.identity.inference_server_id)
        if registration.kv_blocks is not None:
            registration.kv_blocks.clear()  # snapshots still held see an empty set
            registration.kv_blocks = None
        return True

    def is_live(self, registration: Registration) -> bool:
        return self._registrations.get(registration.identity.inference_server_id) is registration

    def registrations(self) -> list[Registration]:
        """Live registrations, by id."""
        return [self._registrations[key] for key in sorted(self._registrations)]

    # ---- reads ----------------------------------------------------------------------------------

    def snapshot(self, target: RoutingTargetKey) -> TargetSnapshot | None:
        """Every cluster of `target` now, with pending reservations applied, or None if it has no
        active backend (docs/data-plane.md, Reservations and Forwarding)."""
        state = self._targets.get(target)
        if state is None:
            return None
        if state.snapshot is None:
            views = (cluster.current() for cluster in state.clusters.values())
            clusters = tuple(view for view in views if view is not None)
            if self._estimate_unmeasured:
                clusters = estimate_unmeasured_input_tps(clusters)
            state.snapshot = TargetSnapshot(target, clusters)
        return state.snapshot

    def is_advertised(self, target: RoutingTargetKey) -> bool:
        """True while some live registration lists the model under this routing key (any status)."""
        return target in self._advertised

    def is_known(self, target: RoutingTargetKey) -> bool:
        """True if some registration has ever advertised this target (any status)."""
        return target in self._known

    def first_advertised(self, target: RoutingTargetKey) -> int | None:
        """Unix time (seconds) when a registration first advertised `target`, if one ever did."""
        return self._known.get(target)

    def targets(self) -> list[RoutingTargetKey]:
        """Every target with at least one active backend."""
        return list(self._targets)

    def has_cluster(self, target: RoutingTargetKey, cluster_id: str) -> bool:
        """True while `target` has an active backend in the cluster `cluster_id`."""
        state = self._targets.get(target)
        return state is not None and cluster_id in state.clusters

    def active_backend_count(self, target: RoutingTargetKey) -> int:
        """Active backends of one target (the `active_inference_servers` gauge's value)."""
        state = self._targets.get(target)
        return 0 if state is None else state.active_backend_count

    def total_active_backend_count(self) -> int:
        """Sum of active backend counts over every target and routing key (docs/control-plane.md,
        Total active backend count).

        One unit is one routable (registration, routing key, model) triple: not a count of
        distinct Pylons or streams. This is what the readiness sampler reads.
        """
        return sum(state.active_backend_count for state in self._targets.values())

    def list_models(
        self, routing_key: str | None, model_ids: Sequence[str] | None = None
    ) -> list[str]:
        """Model ids with an active backend under exactly `routing_key`, sorted and unique.

        With `model_ids`, only those ids are looked up (docs/control-plane.md, ListModels).
        """
        if model_ids:
            wanted: Iterable[str] = set(model_ids)
            found = {m for m in wanted if RoutingTargetKey(routing_key, m) in self._targets}
        else:
            found = {t.model_id for t in self._targets if t.routing_key == routing_key}
        return sorted(found)

    def active_model_ids(self) -> list[str]:
        """Model ids with an active backend under any routing key, sorted and unique."""
        return sorted({target.model_id for target in self._targets})

    @property
    def last_join(self) -> float:
        """The latest `BackendSnapshot.joined_at` of any backend entry ever stored (-inf: none):
        slow start's O(1) "is some backend still in its window?"
        (stargate/routing/slow_start.py)."""
        return self._last_join

    def backend_count(self) -> int:
        """Live registrations: the population outlier ejection's percentage is taken of."""
        return len(self._registrations)

    def is_registered(self, inference_server_id: str) -> bool:
        """Some live registration has this id."""
        return inference_server_id in self._registrations

    # ---- demotion (docs/data-plane.md, Retries) --------------------------------------------------

    def demote(self, inference_server_id: str) -> None:
        """A connection to this backend was refused: no request picks it until `restore`."""
        self._demoted.add(inference_server_id)

    def restore(self, inference_server_id: str) -> None:
        """Its health probe passed: a demoted backend may be picked again (idempotent)."""
        self._demoted.discard(inference_server_id)

    def is_demoted(self, inference_server_id: str) -> bool:
        return inference_server_id in self._demoted

    @property
    def demoted(self) -> frozenset[str]:
        """Every demoted backend id now (empty when none is)."""
        return frozenset(self._demoted)

    @property
    def any_demoted(self) -> bool:
        """True while some backend is demoted (the 404 rule reads it, docs/data-plane.md,
        Forwarding)."""
        return bool(self._demoted)

    # ---- reservations (docs/data-plane.md, Reservations) ----------------------------------------

    def reserve(
        self,
        target: RoutingTargetKey,
        cluster_id: str,
        registration: Registration,
        input_tokens: int,
        priority: int,
    ) -> Reservation | None:
        """Add a pending request of `input_tokens` at `priority` to one cluster of `target`, on
        `registration`'s backend; every snapshot of the target counts it until it is released.

        None (nothing reserved) unless that exact registration's backend is still stored in that
        cluster of that target.
        """
        state = self._targets.get(target)
        if state is None:
            return None
        cluster = state.clusters.get(cluster_id)
        if cluster is None or cluster.generation is not registration.cluster:
            return None
        entry = cluster.backends.get(registration.identity.inference_server_id)
        if entry is None or entry.registration is not registration:
            return None
        reservation = Reservation(registration, input_tokens, priority, state, cluster)
        cluster.pending[reservation] = None
        cluster.pending_by_backend.setdefault(reservation.inference_server_id, {})[reservation] = (
            None
        )
        cluster.reserved_count += 1
        cluster.reserved_tokens += input_tokens
        cluster.view = None
        state.snapshot = None
        return reservation

    def release(self, reservation: Reservation) -> None:
        """Stop counting `reservation` (idempotent; a no-op once it already went away)."""
        reservation._deactivate()

    # ---- internals ------------------------------------------------------------------------------

    def _unadvertise(self, target: RoutingTargetKey) -> None:
        remaining = self._advertised.get(target, 0) - 1
        if remaining > 0:
            self._advertised[target] = remaining
        else:
            self._advertised.pop(target, None)

    def _upsert(
        self, registration: Registration, target: RoutingTargetKey, route: BackendRoute
    ) -> None:
        state = self._targets.get(target)
        if state is None:
            state = self._targets[target] = _Target()
        identity = registration.identity
        cluster = state.clusters.get(identity.cluster_id)
        if cluster is None or cluster.generation is not registration.cluster:
            if cluster is not None and not cluster.generation.retired:
                # Two live generations of one cluster in one target cannot happen: generations are
                # keyed by (routing key, cluster id), the same key as the target's cluster map.
                raise AssertionError(f"two live generations of cluster {identity.cluster_id!r}")
            if cluster is not None:
                cluster.release_all()
            cluster = state.clusters[identity.cluster_id] = _Cluster(registration.cluster)
        else:
            # A new heartbeat from this backend supersedes its reservations (docs/data-plane.md).
            cluster.release_backend(identity.inference_server_id)
        previous = cluster.backends.get(identity.inference_server_id)
        joined = previous is None
        joined_at = route.received_at if previous is None else previous.joined_at
        if joined:
            self._last_join = max(self._last_join, joined_at)
        cluster.backends[identity.inference_server_id] = BackendSnapshot(
            registration,
            route.stats,
            route.rtt_ns,
            route.received_at,
            registration.kv_view,
            joined_at,
        )
        cluster.source_id = identity.inference_server_id
        cluster.refresh()
        state.snapshot = None
        if joined:
            # A heartbeat of a backend already routed leaves the target's count as it was:
            # counting (a walk over every cluster of the target) is skipped, as a thousand
            # backends of one model would otherwise make each heartbeat cost O(backends).
            self._publish(target)

    def _remove(
        self, registration: Registration, target: RoutingTargetKey, *, notify: bool = True
    ) -> None:
        state = self._targets.get(target)
        if state is None:
            return
        identity = registration.identity
        cluster = state.clusters.get(identity.cluster_id)
        if cluster is None:
            return
        if cluster.generation is not registration.cluster:
            if not cluster.generation.retired:
                return
            del state.clusters[identity.cluster_id]  # stale: drop the whole retired cluster
            cluster.release_all()
            entry: BackendSnapshot | None = None  # its backends belong to ended registrations
        else:
            entry = cluster.backends.get(identity.inference_server_id)
            if entry is None or entry.registration is not registration:
                return
            del cluster.backends[identity.inference_server_id]
            cluster.release_backend(identity.inference_server_id)
            if cluster.backends:
                cluster.refresh()
            else:
                del state.clusters[identity.cluster_id]
        state.snapshot = None
        if not state.clusters:
            del self._targets[target]
        self._publish(target)
        if entry is not None and notify and self._on_backend_unroutable is not None:
            self._on_backend_unroutable(registration, target)

    def _publish(self, target: RoutingTargetKey) -> None:
        if self._on_target_count is not None:
            self._on_target_count(target, self.active_backend_count(target))
