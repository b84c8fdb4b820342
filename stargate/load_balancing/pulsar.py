"""Pulsar and pulsar-wait-and-widen (alias pulsar-multiregion): weighted rendezvous rankings.

docs/data-plane.md, Pulsar and Pulsar-wait-and-widen. Pure: no I/O, no clock.

*Ranking.* For one request every cluster with a valid `last_mean_input_tps` (finite, positive:
its weight) gets the score weight / -ln(u), u being the unit-interval value of the XXH3-64 hash
of the request's Pulsar prefix and the cluster id (`stargate.load_balancing.hashing`). Clusters
without a valid weight, or whose -ln(u) is not finite and positive, are not ranked at all. The
ranking is by score, highest first, ties by cluster id ascending. Weighted rendezvous hashing
gives each cluster the share weight / total weight of the keys, and the order for one key
changes only when the set of clusters or a weight changes.

*Feasibility.* Walking a ranking, a cluster excluded for this request is skipped; with
`consider_kv_free_tokens` so is one that publishes no KV-cache metrics (capacity, used and free
tokens all 0) or has fewer free tokens than the request's input tokens (a *KV skip*).

*Ranking cache.* Rankings are cached per cache-affinity key in the balancer instance
(`RankingCache`).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Final

from stargate.load_balancing.balancers import Choice, RoutingRequest, input_tps, valid_input_tps
from stargate.load_balancing.hashing import pulsar_hash, pulsar_prefix, rendezvous_score
from stargate.load_balancing.wait_and_widen import (
    WidenSettings,
    least_queue_then_utilization,
    widen_choose,
)
from stargate.routing.state import ClusterSnapshot
from stargate.routing.stats import ModelStats

__all__ = [
    "MAX_CACHEABLE_KEY_BYTES",
    "PROBATION_LIMIT",
    "RANKING_CACHE_LIMIT",
    "Feasibility",
    "Pulsar",
    "PulsarWaitAndWiden",
    "RankingCache",
    "feasibility",
    "has_kv_metrics",
    "pulsar_admission_clusters",
    "pulsar_ranking",
]

RANKING_CACHE_LIMIT: Final = 4096
PROBATION_LIMIT: Final = 4096
MAX_CACHEABLE_KEY_BYTES: Final = 256


def pulsar_ranking(
    seed: str, clusters: Sequence[ClusterSnapshot], request: RoutingRequest
) -> list[int]:
    """Indices into `clusters` of the ranked clusters, best first (module docstring)."""
    prefix = pulsar_prefix(seed, request.routing_key, request.model_id, request.cache_affinity_key)
    scored: list[tuple[float, str, int]] = []
    for index, cluster in enumerate(clusters):
        weight = cluster.stats.last_mean_input_tps
        if not valid_input_tps(weight):
            continue
        score = rendezvous_score(weight, pulsar_hash(prefix, cluster.cluster_id))
        if score is not None:
            scored.append((-score, cluster.cluster_id, index))
    scored.sort()
    return [index for _, _, index in scored]


def has_kv_metrics(stats: ModelStats) -> bool:
    """The cluster publishes KV-cache metrics: any of capacity, used or free tokens is non-zero."""
    return (
        stats.kv_cache_capacity_tokens > 0
        or stats.kv_cache_used_tokens > 0
        or stats.kv_cache_free_tokens > 0
    )


class Feasibility(enum.Enum):
    """Why a ranked cluster may or may not serve this request."""

    ELIGIBLE = "eligible"
    EXCLUDED = "excluded"  # failed (or otherwise excluded) for this request
    NO_KV_METRICS = "no_kv_metrics"  # a KV skip
    INSUFFICIENT_KV_FREE_TOKENS = "insufficient_kv_free_tokens"  # a KV skip

    @property
    def kv_skip(self) -> bool:
        return self in (Feasibility.NO_KV_METRICS, Feasibility.INSUFFICIENT_KV_FREE_TOKENS)


def feasibility(
    cluster: ClusterSnapshot,
    input_tokens: int,
    excluded: AbstractSet[str],
    consider_kv_free_tokens: bool,
) -> Feasibility:
    if cluster.cluster_id in excluded:
        return Feasibility.EXCLUDED
    if not consider_kv_free_tokens:
        return Feasibility.ELIGIBLE
    stats = cluster.stats
    if not has_kv_metrics(stats):
        return Feasibility.NO_KV_METRICS
    if stats.kv_cache_free_tokens < input_tokens:
        return Feasibility.INSUFFICIENT_KV_FREE_TOKENS
    return Feasibility.ELIGIBLE


def pulsar_admission_clusters(
    clusters: Sequence[ClusterSnapshot],
    input_tokens: int,
    consider_kv_free_tokens: bool,
    excluded: AbstractSet[str] = frozenset(),
) -> list[ClusterSnapshot]:
    """The clusters input-work admission considers for a Pulsar variant (docs/data-plane.md,
    Input-work admission): not excluded, a valid input TPS, and feasible for the KV check."""
    return [
        cluster
        for cluster in clusters
        if valid_input_tps(cluster.stats.last_mean_input_tps)
        and feasibility(cluster, input_tokens, excluded, consider_kv_free_tokens)
        is Feasibility.ELIGIBLE
    ]


_Signature = tuple[str | None, str, tuple[tuple[str, float], ...]]


class RankingCache:
    """Pulsar rankings per cache-affinity key, for one balancer instance.

    * Only keys of at most 256 UTF-8 bytes are cached (an absent key is the empty key); longer
      ones are ranked on every request.
    * The cache belongs to one candidate list: the routing key, the model and, in order, every
      cluster's id and input TPS (invalid values count as 0, as they rank alike). Any change
      empties the cache (and its probation list) before the lookup.
    * A hit returns the stored ranking. A miss computes it and stores it while the cache holds
      fewer than 4096 rankings. When it is full, a key's first miss only puts the key on
      *probation* (an insertion-ordered set of at most 4096 keys, the oldest dropped first) and
      its ranking is used once; a miss of a key on probation stores its ranking, evicting the
      oldest stored ranking (first in, first out: hits do not refresh an entry). So one-off keys
      cannot flush the rankings of keys that recur.
    """

    __slots__ = ("_probation", "_rankings", "_signature", "computed")

    def __init__(self) -> None:
        self._signature: _Signature | None = None
        self._rankings: dict[str, tuple[int, ...]] = {}
        self._probation: dict[str, None] = {}
        self.computed = 0  # rankings computed (for tests)

    def __len__(self) -> int:
        return len(self._rankings)

    def __contains__(self, key: object) -> bool:
        return key in self._rankings

    def on_probation(self, key: str) -> bool:
        return key in self._probation

    def ranking(
        self, seed: str, clusters: Sequence[ClusterSnapshot], request: RoutingRequest
    ) -> Sequence[int]:
        key = request.cache_affinity_key or ""
        if len(key.encode()) > MAX_CACHEABLE_KEY_BYTES:
            self.computed += 1
            return pulsar_ranking(seed, clusters, request)
        signature: _Signature = (
            request.routing_key,
            request.model_id,
            tuple((cluster.cluster_id, input_tps(cluster.stats)) for cluster in clusters),
        )
        if signature != self._signature:
            self._signature = signature
            self._rankings.clear()
            self._probation.clear()
        cached = self._rankings.get(key)
        if cached is not None:
            return cached
        ranking = tuple(pulsar_ranking(seed, clusters, request))
        self.computed += 1
        if len(self._rankings) < RANKING_CACHE_LIMIT:
            self._rankings[key] = ranking
        elif key in self._probation:  # its second miss since the cache filled: admit it
            del self._probation[key]
            while len(self._rankings) >= RANKING_CACHE_LIMIT:
                del self._rankings[next(iter(self._rankings))]
            self._rankings[key] = ranking
        else:
            self._probation[key] = None
            while len(self._probation) > PROBATION_LIMIT:
                del self._probation[next(iter(self._probation))]
        return ranking


class Pulsar:
    """docs/data-plane.md, Pulsar: the first feasible cluster of the request's ranking."""

    __slots__ = ("_rankings", "consider_kv_free_tokens", "seed")

    name: Final = "pulsar"

    def __init__(self, *, seed: str = "", consider_kv_free_tokens: bool = False) -> None:
        self.seed = seed
        self.consider_kv_free_tokens = consider_kv_free_tokens
        self._rankings = RankingCache()

    @property
    def rankings(self) -> RankingCache:
        return self._rankings

    def choose(
        self,
        clusters: Sequence[ClusterSnapshot],
        request: RoutingRequest,
        excluded: AbstractSet[str],
    ) -> Choice | None:
        if not clusters:
            return None
        kv_skipped = False
        for position, index in enumerate(self._rankings.ranking(self.seed, clusters, request)):
            cluster = clusters[index]
            verdict = feasibility(
                cluster, request.input_tokens, excluded, self.consider_kv_free_tokens
            )
            if verdict is Feasibility.ELIGIBLE:
                return Choice(cluster, position + 1, kv_skipped)
            kv_skipped = kv_skipped or verdict.kv_skip
        return None


class PulsarWaitAndWiden:
    """docs/data-plane.md, Pulsar-wait-and-widen: wait-and-widen inside widening bands of the
    request's Pulsar ranking.

    Without a queue SLO (floor and ceil not both set) a feasible primary (rank 1) is chosen at
    once, whatever its load. Otherwise, or when the primary is not feasible, the bands are
    ranks [1], [2, 3], [4, 7], [8, 15]... (widths 1, 2, 4, 8...): wait-and-widen runs over each
    band's feasible clusters in turn, preferring the least queue delay, then the least used
    (`least_queue_then_utilization`), and the first band that yields a cluster wins. None when
    no band does (the forwarder waits and selects again).
    """

    __slots__ = ("_rankings", "_rng", "consider_kv_free_tokens", "seed", "settings")

    name: Final = "pulsar-wait-and-widen"

    def __init__(
        self,
        *,
        seed: str = "",
        consider_kv_free_tokens: bool = False,
        settings: WidenSettings | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.seed = seed
        self.consider_kv_free_tokens = consider_kv_free_tokens
        self.settings = settings if settings is not None else WidenSettings()
        self._rankings = RankingCache()
        self._rng = rng if rng is not None else random.Random()

    @property
    def rankings(self) -> RankingCache:
        return self._rankings

    def choose(
        self,
        clusters: Sequence[ClusterSnapshot],
        request: RoutingRequest,
        excluded: AbstractSet[str],
    ) -> Choice | None:
        if not clusters:
            return None
        ranking = self._rankings.ranking(self.seed, clusters, request)
        if not ranking:
            return None
        ranked = [clusters[index] for index in ranking]
        verdicts = [
            feasibility(cluster, request.input_tokens, excluded, self.consider_kv_free_tokens)
            for cluster in ranked
        ]
        if self.settings.max_queue_time_ms(request) is None and verdicts[0] is Feasibility.ELIGIBLE:
            return Choice(ranked[0])
        start, width = 0, 1
        while start < len(ranked):
            end = min(start + width, len(ranked))
            band = [
                ranked[position]
                for position in range(start, end)
                if verdicts[position] is Feasibility.ELIGIBLE
            ]
            if band:
                chosen = widen_choose(
                    self.settings, band, request, self._rng, least_queue_then_utilization
                )
                if chosen is not None:
                    position = next(
                        p for p in range(start, end) if ranked[p].cluster_id == chosen.cluster_id
                    )
                    kv_skipped = any(verdict.kv_skip for verdict in verdicts[:position])
                    return Choice(chosen, position + 1, kv_skipped)
            start, width = end, width * 2
        return None
