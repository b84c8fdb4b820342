"""Wait-and-widen (alias groq-multiregion): TTFT buckets that unlock as a request waits.

docs/data-plane.md, Wait-and-widen. Pure: the time a request has waited comes in
`RoutingRequest.waited_ms` (the forwarder measures it), never from a clock.

One selection, over the candidates (the clusters not excluded for this request):

1. *Queue SLO* (only when both `max_queue_time_floor_ms` and `max_queue_time_ceil_ms` are set):
   drop the clusters whose queue delay exceeds floor + (ceil - floor) * f, where f is
   waited_ms / x-request-slo-ms clamped to [0, 1], or 1 without an SLO (absent or 0).
2. *TTFT* per cluster: RTT + queue delay + prefill of the request's input tokens, leaving out the
   queue term with `ignore_queue_time` and the prefill term with `ignore_input_processing_time`
   (these flags change the bucketing only; the comparator always sees the full scores).
3. *Buckets*: when every TTFT is finite and they all lie within `ttft_bucket_size_ms` of the
   fastest, everything is unlocked. Otherwise sort by (TTFT, cluster id) and walk: a cluster
   more than the bucket size above the current bucket's first TTFT starts a new bucket, and the
   gap between the two bucket starts must be paid for: the new bucket is unlocked only if the
   remaining wait budget (starting at `waited_ms`) is at least gap * `next_bucket_unlock_factor`,
   which is then subtracted. The walk stops at the first locked bucket or infinite TTFT. The
   gaps telescope, so bucket k unlocks once waited_ms >= (its first TTFT - the fastest TTFT) *
   factor.
4. *Capacity*: drop unlocked clusters with `max_engine_concurrency > 0` and
   `num_running_queries >= max_engine_concurrency + max_queued`.
5. *Sample* min(n, remaining) distinct clusters uniformly and take the best by the comparator
   (first-found among equals, and the sample is in random order, so ties break at random).

Nothing left at step 4 (or no finite TTFT) is None: "wait" — the forwarder's `x-max-wait-ms`
loop selects again later with a larger `waited_ms`, which unlocks more buckets.

*Cache affinity*: with `cache_affinity_backend_selection_count` > 0 and an
`x-cache-affinity-key`, the key's position on a consistent-hash ring (`AffinityRing`) first
names a stable subset of that many clusters, and the steps above run on it; only when it yields
nothing do they run on every candidate.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Final

from stargate.load_balancing.balancers import (
    COMPARATORS,
    DEFAULT_COMPARATOR,
    Choice,
    RoutingRequest,
    _order_key,
    delay,
    input_tps,
    queue_delay_ms,
)
from stargate.load_balancing.hashing import affinity_key_hash, ring_prefix, virtual_node_hash
from stargate.routing.state import ClusterSnapshot

__all__ = [
    "DEFAULT_MAX_QUEUED",
    "DEFAULT_N",
    "DEFAULT_NEXT_BUCKET_UNLOCK_FACTOR",
    "DEFAULT_TTFT_BUCKET_SIZE_MS",
    "DEFAULT_VIRTUAL_NODES",
    "AffinityRing",
    "Pick",
    "WaitAndWiden",
    "WidenSettings",
    "at_capacity",
    "least_queue_then_utilization",
    "lowest_score",
    "unlocked_clusters",
    "widen_choose",
]

DEFAULT_VIRTUAL_NODES: Final = 150
DEFAULT_TTFT_BUCKET_SIZE_MS: Final = 20
DEFAULT_NEXT_BUCKET_UNLOCK_FACTOR: Final = 0.25
DEFAULT_N: Final = 2
DEFAULT_MAX_QUEUED: Final = 0


def _check_unsigned(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def at_capacity(cluster: ClusterSnapshot, max_queued: int) -> bool:
    """The cluster publishes a concurrency limit and runs at least `max_queued` queries above
    it (docs/data-plane.md, Wait-and-widen)."""
    stats = cluster.stats
    return (
        stats.max_engine_concurrency > 0
        and stats.num_running_queries >= stats.max_engine_concurrency + max_queued
    )


def unlocked_clusters(
    estimates: Sequence[tuple[float, ClusterSnapshot]],
    bucket_size_ms: float,
    unlock_factor: float,
    waited_ms: float,
) -> list[ClusterSnapshot]:
    """The clusters whose TTFT bucket is unlocked after `waited_ms` (step 3 of the module
    docstring). `estimates` are (bucketing TTFT in ms, cluster)."""
    finite = [ttft for ttft, _ in estimates if math.isfinite(ttft)]
    if not finite:
        return []
    if len(finite) == len(estimates) and max(finite) - min(finite) <= bucket_size_ms:
        return [cluster for _, cluster in estimates]
    ordered = sorted(estimates, key=lambda item: (item[0], item[1].cluster_id))
    budget = waited_ms
    bucket_start = ordered[0][0]
    unlocked: list[ClusterSnapshot] = []
    for ttft, cluster in ordered:
        if not math.isfinite(ttft):
            break
        gap = ttft - bucket_start
        if gap > bucket_size_ms:
            needed = gap * unlock_factor
            if budget < needed:
                break
            budget -= needed
            bucket_start = ttft
        unlocked.append(cluster)
    return unlocked


Pick = Callable[[Sequence[ClusterSnapshot], RoutingRequest], ClusterSnapshot]
"""Chooses one cluster from a non-empty sample (step 5)."""


def lowest_score(comparator: str) -> Pick:
    """The first cluster of the sample with the lowest score of a named comparator."""
    score = COMPARATORS[comparator]

    def pick(sample: Sequence[ClusterSnapshot], request: RoutingRequest) -> ClusterSnapshot:
        best = sample[0]
        best_key = _order_key(score(best, request))
        for cluster in sample[1:]:
            key = _order_key(score(cluster, request))
            if key < best_key:
                best, best_key = cluster, key
        return best

    return pick


def _less_used(a: ClusterSnapshot, b: ClusterSnapshot) -> bool:
    """Utilisation order: running / concurrency when both publish a concurrency, else the raw
    running counts."""
    limit_a, limit_b = a.stats.max_engine_concurrency, b.stats.max_engine_concurrency
    if limit_a == 0 or limit_b == 0:
        return a.stats.num_running_queries < b.stats.num_running_queries
    return a.stats.num_running_queries / limit_a < b.stats.num_running_queries / limit_b


def least_queue_then_utilization(
    sample: Sequence[ClusterSnapshot], request: RoutingRequest
) -> ClusterSnapshot:
    """Pulsar-wait-and-widen's fixed preference: the least queue delay, then the least used."""
    best = sample[0]
    best_queue = queue_delay_ms(best, request)
    for cluster in sample[1:]:
        queue = queue_delay_ms(cluster, request)
        if queue < best_queue or (queue == best_queue and _less_used(cluster, best)):
            best, best_queue = cluster, queue
    return best


@dataclass(frozen=True, slots=True)
class WidenSettings:
    """The selection settings shared by wait-and-widen and pulsar-wait-and-widen."""

    max_queue_time_floor_ms: int | None = None
    max_queue_time_ceil_ms: int | None = None
    ttft_bucket_size_ms: int = DEFAULT_TTFT_BUCKET_SIZE_MS
    next_bucket_unlock_factor: float = DEFAULT_NEXT_BUCKET_UNLOCK_FACTOR
    n: int = DEFAULT_N  # 0 is taken as 1
    max_queued: int = DEFAULT_MAX_QUEUED
    ignore_queue_time: bool = False
    ignore_input_processing_time: bool = False

    def __post_init__(self) -> None:
        for name in ("max_queue_time_floor_ms", "max_queue_time_ceil_ms"):
            value = getattr(self, name)
            if value is not None:
                _check_unsigned(name, value)
        for name in ("ttft_bucket_size_ms", "n", "max_queued"):
            _check_unsigned(name, getattr(self, name))
        factor = self.next_bucket_unlock_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise ValueError(f"next_bucket_unlock_factor must be a number, got {factor!r}")
        if not math.isfinite(factor):
            raise ValueError("next_bucket_unlock_factor must be a finite number")

    @property
    def sample_count(self) -> int:
        return max(self.n, 1)

    def max_queue_time_ms(self, request: RoutingRequest) -> float | None:
        """The queue-delay ceiling for this selection, or None without a queue SLO."""
        floor, ceil = self.max_queue_time_floor_ms, self.max_queue_time_ceil_ms
        if floor is None or ceil is None:
            return None
        slo = request.request_slo_ms
        fraction = min(max(request.waited_ms / slo, 0.0), 1.0) if slo else 1.0
        return floor + (ceil - floor) * fraction

    def estimates(
        self, candidates: Sequence[ClusterSnapshot], request: RoutingRequest
    ) -> list[tuple[float, ClusterSnapshot]]:
        """(bucketing TTFT in ms, cluster) for the candidates within the queue SLO."""
        limit = self.max_queue_time_ms(request)
        out: list[tuple[float, ClusterSnapshot]] = []
        for cluster in candidates:
            queue_ms = queue_delay_ms(cluster, request)
            if limit is not None and not queue_ms <= limit:
                continue
            ttft = cluster.rtt_seconds * 1000.0
            if not self.ignore_queue_time:
                ttft += queue_ms
            if not self.ignore_input_processing_time:
                ttft += delay(request.input_tokens, input_tps(cluster.stats)) * 1000.0
            out.append((ttft, cluster))
        return out


def widen_choose(
    settings: WidenSettings,
    candidates: Sequence[ClusterSnapshot],
    request: RoutingRequest,
    rng: random.Random,
    pick: Pick,
) -> ClusterSnapshot | None:
    """Steps 1-5 of the module docstring over `candidates` (already free of exclusions)."""
    unlocked = unlocked_clusters(
        settings.estimates(candidates, request),
        float(settings.ttft_bucket_size_ms),
        settings.next_bucket_unlock_factor,
        request.waited_ms,
    )
    roomy = [cluster for cluster in unlocked if not at_capacity(cluster, settings.max_queued)]
    if not roomy:
        return None
    sample = rng.sample(roomy, min(settings.sample_count, len(roomy)))
    return pick(sample, request)


class AffinityRing:
    """The consistent-hash ring of one wait-and-widen instance (docs/data-plane.md, Hashing).

    Each cluster has `virtual_nodes` points on the ring; a key's subset is the first `count`
    distinct clusters met walking clockwise from the key's hash (the first point at or after
    it, wrapping around), skipping excluded clusters. The ring is built from the whole
    candidate list (excluded clusters included, so a retry does not move the other keys) and
    kept until the list of cluster ids, the routing key or the model changes.
    """

    __slots__ = ("_hashes", "_owners", "_prefix", "_signature", "seed", "virtual_nodes")

    def __init__(self, seed: str = "", virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
        self.seed = seed
        self.virtual_nodes = max(virtual_nodes, 1)
        self._signature: tuple[str | None, str, tuple[str, ...]] | None = None
        self._prefix = b""
        self._hashes: list[int] = []
        self._owners: list[int] = []  # index into the candidate list, per ring point

    @property
    def size(self) -> int:
        """Points on the current ring (virtual nodes x clusters)."""
        return len(self._hashes)

    def _refresh(self, clusters: Sequence[ClusterSnapshot], request: RoutingRequest) -> None:
        signature = (
            request.routing_key,
            request.model_id,
            tuple(cluster.cluster_id for cluster in clusters),
        )
        if signature == self._signature:
            return
        prefix = ring_prefix(self.seed, request.routing_key, request.model_id)
        points = sorted(
            (virtual_node_hash(prefix, cluster.cluster_id, node), cluster.cluster_id, index)
            for index, cluster in enumerate(clusters)
            for node in range(self.virtual_nodes)
        )
        self._signature = signature
        self._prefix = prefix
        self._hashes = [point[0] for point in points]
        self._owners = [point[2] for point in points]

    def select(
        self,
        clusters: Sequence[ClusterSnapshot],
        request: RoutingRequest,
        key: str,
        count: int,
        excluded: AbstractSet[str],
    ) -> list[ClusterSnapshot]:
        """The key's stable subset: up to min(count, len(clusters)) non-excluded clusters."""
        if not clusters or count <= 0:
            return []
        self._refresh(clusters, request)
        wanted = min(count, len(clusters))
        start = bisect.bisect_left(self._hashes, affinity_key_hash(self._prefix, key))
        chosen: list[ClusterSnapshot] = []
        seen: set[int] = set()
        total = len(self._owners)
        for offset in range(total):
            index = self._owners[(start + offset) % total]
            if index in seen:
                continue
            seen.add(index)
            cluster = clusters[index]
            if cluster.cluster_id in excluded:
                continue
            chosen.append(cluster)
            if len(chosen) >= wanted or len(seen) == len(clusters):
                break
        return chosen


class WaitAndWiden:
    """docs/data-plane.md, Wait-and-widen. One instance per (target, definition): it keeps the
    affinity ring and a random generator (seed it for reproducible tests)."""

    __slots__ = (
        "_pick",
        "_ring",
        "_rng",
        "cache_affinity_backend_selection_count",
        "comparator",
        "seed",
        "settings",
    )

    name: Final = "wait-and-widen"

    def __init__(
        self,
        *,
        seed: str = "",
        comparator: str = DEFAULT_COMPARATOR,
        cache_affinity_virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
        cache_affinity_backend_selection_count: int = 0,
        settings: WidenSettings | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if comparator not in COMPARATORS:
            raise ValueError(
                f"unknown comparator {comparator!r}; expected one of {', '.join(COMPARATORS)}"
            )
        _check_unsigned("cache_affinity_virtual_nodes", cache_affinity_virtual_nodes)
        _check_unsigned(
            "cache_affinity_backend_selection_count", cache_affinity_backend_selection_count
        )
        self.seed = seed
        self.comparator = comparator
        self.cache_affinity_backend_selection_count = cache_affinity_backend_selection_count
        self.settings = settings if settings is not None else WidenSettings()
        self._pick = lowest_score(comparator)
        self._ring = AffinityRing(seed, cache_affinity_virtual_nodes)
        self._rng = rng if rng is not None else random.Random()

    @property
    def ring(self) -> AffinityRing:
        return self._ring

    def choose(
        self,
        clusters: Sequence[ClusterSnapshot],
        request: RoutingRequest,
        excluded: AbstractSet[str],
    ) -> Choice | None:
        eligible = (
            [cluster for cluster in clusters if cluster.cluster_id not in excluded]
            if excluded
            else clusters
        )
        if not eligible:
            return None
        key = request.cache_affinity_key
        if self.cache_affinity_backend_selection_count > 0 and key is not None:
            subset = self._ring.select(
                clusters, request, key, self.cache_affinity_backend_selection_count, excluded
            )
            if subset:
                chosen = widen_choose(self.settings, subset, request, self._rng, self._pick)
                if chosen is not None:
                    return Choice(chosen)
        chosen = widen_choose(self.settings, eligible, request, self._rng, self._pick)
        return None if chosen is None else Choice(chosen)
