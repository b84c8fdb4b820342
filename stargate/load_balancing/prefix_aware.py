"""prefix-aware: weighted rendezvous over a request's prefix, weighed against load.

docs/prefix-routing.md has the design, its measurements and its trade-offs. Pure: no I/O, no
clock, no randomness, and no state that depends on the requests routed, so two replicas given
the same cluster snapshots make the same choice for the same request (agreement without gossip).

One selection:

1. *Weights.* Each cluster not excluded weighs its input TPS relative to the largest: 1 above
   one half, else rounded to a power of two (1/2, 1/4...: `_rounded`); a cluster without a valid
   TPS takes part with the smallest weight, 2**-30 (all weigh 1 when none has one). Rounding
   matters: measured TPS wanders with the prompts an engine happened to get, and every move of a
   weight moves the keys near a boundary, so a conversation would change engines. With
   `capacity_weights` off, every cluster weighs 1.
2. *Group home.* A request with a prefix group (the chain element ending its system prompt,
   `RoutingRequest.prefix_group`) has a group home: the first cluster of the group's weighted
   rendezvous ranking. Its weight counts `group_boost` times for this request, so the
   conversations of one system prompt lean towards one cluster (whose cache holds that prompt)
   without all landing there.
3. *Ranking.* Clusters are ranked by weighted rendezvous over the request's conversation key
   (`cache_affinity_key`: derived, or the client's), highest score first, ties by cluster id, as
   Pulsar ranks (stargate/load_balancing/hashing.py; the group key is hashed with its own tag).
   Every turn of a conversation has the same key, so the same ranking.
4. *Feasibility.* With `consider_kv_free_tokens`, a cluster without KV metrics or with fewer free
   tokens than the request's input is skipped (Pulsar's rule).
4b. *Precise mode.* When the engines publish their cached blocks (`BackendSnapshot.kv_blocks`,
   docs/prefix-routing.md, "Precise mode"), the feasible cluster whose prefill of the request is
   cheapest becomes the home: the share of the request's chain its engines do not hold (their
   longest leading run counts), over its weight; the first of the ranking among equals. So a
   new conversation joins an engine that holds its system prompt, a turn stays where its history
   is, and a slow engine takes only what its cache makes cheap there. The engines' sets are the
   same on every replica, up to a heartbeat's skew.
5. *Load.* The first feasible cluster of the ranking (the *home*) is chosen unless its queue
   delay exceeds the least queue delay among the feasible clusters by more than what its cache
   saves (the prefill of the request's input at its TPS) plus `overflow_ms`. Then the walk goes
   on down the ranking, each later cluster allowed only `overflow_ms` above the least; the least
   queued cluster always qualifies. Stats come from the Pylons and are the same on every replica,
   so overflow agrees too (up to a heartbeat's skew).
5b. *The Pylon's queue check.* The choice carries the queue delay it accepted above the estimate
   (the home: its saving plus `overflow_ms`; another cluster: `overflow_ms`) as
   `Choice.queue_allowance_ms`; the forwarder adds it to `x-stargate-expected-queue-ms`, so a
   Pylon refuses the request (429 `queue_estimate_mismatch`, then a retry elsewhere) only when
   its live queue exceeds what this step tolerated. Without it, each replica's estimate lacks the
   other replicas' requests in flight, and the Pylons turned away (and so moved) 3 to 12 % of a
   two-replica trace's turns.
6. *Backend.* Steps 1 to 3, 4b and 5 run again over the chosen cluster's backends (their ids,
   their own stats), and the `Choice` carries that order: the forwarder tries the backends in it
   instead of the cluster's round robin. Engines whose Pylons share a `--cluster-id` form one
   cluster, so among them this is the step that places the request.

At more than `EXACT_LIMIT` clusters, the ranking covers the candidates found by `PROBES` probes
of multi-probe consistent hashing (each probe a point of the key on a ring of cluster-id hashes,
`VIRTUAL_NODES` per cluster: the cluster owning the next point), so a decision costs
O(PROBES log n), not O(n): weights are relative to the fastest candidate, and the ring depends on
the cluster ids only, so it is rebuilt when they change (`PrefixAware._candidates`), never when
stats do.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import Final

from xxhash import xxh3_64_intdigest

from stargate.load_balancing.balancers import (
    Choice,
    RoutingRequest,
    delay,
    input_tps,
    queue_delay_ms,
)
from stargate.load_balancing.hashing import pulsar_prefix, rendezvous_score, tagged
from stargate.load_balancing.pulsar import Feasibility, feasibility
from stargate.routing.state import BackendSnapshot, ClusterSnapshot
from stargate.routing.stats import ModelStats

__all__ = [
    "DEFAULT_GROUP_BOOST",
    "DEFAULT_OVERFLOW_MS",
    "EXACT_LIMIT",
    "PROBES",
    "VIRTUAL_NODES",
    "PrefixAware",
    "prefix_ranking",
]

DEFAULT_GROUP_BOOST: Final = 2.0
DEFAULT_OVERFLOW_MS: Final = 5000
"""A Pylon's queue estimate counts the requests in prefill and arrives once a heartbeat: a busy
engine that batches its prefills shows a second or more. Only a far larger excess is
congestion (docs/prefix-routing.md, "Why overflow_ms is five seconds")."""
EXACT_LIMIT: Final = 16
"""Up to this many clusters, every one is ranked."""
MIN_WEIGHT_EXPONENT: Final = -30
"""The smallest weight is 2**-30 of the largest (a cluster still takes part)."""
VIRTUAL_NODES: Final = 16
"""Points per cluster on the multi-probe ring."""
PROBES: Final = 8
"""Above `EXACT_LIMIT`, the candidates a key's probes find on the ring (at most)."""
_PROBE_SUFFIXES: Final = tuple(probe.to_bytes(2, "little") for probe in range(PROBES))


class _Ring:
    """Each cluster id placed at `VIRTUAL_NODES` points (XXH3-64 hashes), for multi-probe
    candidate sets; several points per cluster even out the arcs a probe can land in."""

    __slots__ = ("ids", "owners", "points")

    def __init__(self, ids: tuple[str, ...]) -> None:
        placed = sorted(
            (
                xxh3_64_intdigest(
                    tagged(b"ring", cluster_id.encode()) + node.to_bytes(2, "little")
                ),
                index,
            )
            for index, cluster_id in enumerate(ids)
            for node in range(VIRTUAL_NODES)
        )
        self.ids = ids
        self.points = [point for point, _ in placed]
        self.owners = [index for _, index in placed]

    def candidates(self, key: bytes, count: int) -> list[int]:
        """Indices (into the id tuple) of the distinct clusters found by `count` probes."""
        points, owners, size = self.points, self.owners, len(self.points)
        found = {
            owners[bisect.bisect_left(points, xxh3_64_intdigest(key + suffix)) % size]: None
            for suffix in _PROBE_SUFFIXES[:count]
        }
        return list(found)


_Id = Callable[[int], str]
_Stats = Callable[[int], ModelStats]


def _weights(
    candidates: Sequence[int], ident: _Id, stats: _Stats, excluded: AbstractSet[str], capacity: bool
) -> dict[int, float]:
    """Step 1 over the candidates: each one's weight (0: excluded). With `capacity`, its input TPS
    relative to the largest among them (`_rounded`; an unmeasured one the smallest weight, so it
    takes part last); without, or when none is measured, 1."""
    tps = {i: 0.0 if ident(i) in excluded else input_tps(stats(i)) for i in candidates}
    largest = max(tps.values(), default=0.0) if capacity else 0.0
    if largest <= 0.0:
        return {i: 0.0 if ident(i) in excluded else 1.0 for i in candidates}
    smallest = 2.0**MIN_WEIGHT_EXPONENT
    return {
        i: 0.0 if ident(i) in excluded else _rounded(t / largest) if t > 0.0 else smallest
        for i, t in tps.items()
    }


def _rounded(share: float) -> float:
    """`share` (in (0, 1]) as a weight: 1 above one half, else rounded to the nearest power of two
    on a log scale. Measured TPS moves by tens of percent between heartbeats, and a weight that
    followed it would move the keys near each boundary with it (a turn whose engine changes
    loses its cache): engines of one kind all weigh 1 however their figures wander, and only an
    engine at most half as fast as the fastest weighs less."""
    if share > 0.5:
        return 1.0
    return 2.0 ** max(round(math.log2(share)), MIN_WEIGHT_EXPONENT)


def _ranked(
    prefix: bytes, candidates: Sequence[int], ident: _Id, weights: dict[int, float]
) -> list[int]:
    """Weighted rendezvous (`pulsar_hash` of `prefix` and each id, scored by
    `rendezvous_score`), highest first, ties by id; items of weight 0 are left out."""
    scored: list[tuple[float, str, int]] = []
    for index in candidates:
        weight = weights[index]
        if weight <= 0.0:
            continue
        name = ident(index)
        score = rendezvous_score(weight, xxh3_64_intdigest(prefix + _id_field(name)))
        if score is not None:
            scored.append((-score, name, index))
    scored.sort()
    return [index for _, _, index in scored]


@functools.lru_cache(maxsize=65_536)
def _id_field(cluster_id: str) -> bytes:
    """The tagged `cluster_id` field `pulsar_hash` appends (cached: ids recur on every request)."""
    return tagged(b"cluster_id", cluster_id.encode())


def _keys(seed: str, request: RoutingRequest, group_boost: float) -> tuple[bytes, bytes | None]:
    """The request's ranking key and, when it has a group that counts, the group's."""
    key = pulsar_prefix(seed, request.routing_key, request.model_id, request.cache_affinity_key)
    if request.prefix_group is None or group_boost == 1.0:
        return key, None
    group_key = pulsar_prefix(seed, request.routing_key, request.model_id, None) + tagged(
        b"prefix_group", request.prefix_group.to_bytes(8, "little")
    )
    return key, group_key


def _rank(
    keys: tuple[bytes, bytes | None],
    count: int,
    ident: _Id,
    stats: _Stats,
    excluded: AbstractSet[str],
    group_boost: float,
    capacity: bool,
    candidates_of: Callable[[bytes], Sequence[int]] | None = None,
) -> tuple[list[int], dict[int, float]]:
    """Steps 1 to 3 over `count` items (clusters, or one cluster's backends): the ranking, best
    first, and the items' weights (step 1's, before the group lean). `candidates_of` (a key's
    multi-probe candidates) limits both rankings to their candidates; without it every item
    takes part."""
    key, group_key = keys
    candidates: Sequence[int] = range(count) if candidates_of is None else candidates_of(key)
    if group_key is None:
        weights = _weights(candidates, ident, stats, excluded, capacity)
        return _ranked(key, candidates, ident, weights), weights
    group_candidates = candidates if candidates_of is None else candidates_of(group_key)
    weights = _weights(
        list(dict.fromkeys([*candidates, *group_candidates])), ident, stats, excluded, capacity
    )
    homes = _ranked(group_key, group_candidates, ident, weights)
    if not homes:
        return _ranked(key, candidates, ident, weights), weights
    home = homes[0]
    if home not in candidates:  # found by the group's own probes: it competes for this key too
        candidates = [*candidates, home]
    leaning = {**weights, home: weights[home] * group_boost}
    return _ranked(key, candidates, ident, leaning), weights


def prefix_ranking(
    seed: str,
    clusters: Sequence[ClusterSnapshot],
    request: RoutingRequest,
    excluded: AbstractSet[str] = frozenset(),
    group_boost: float = DEFAULT_GROUP_BOOST,
    capacity_weights: bool = True,
) -> list[int]:
    """Steps 1 to 3 over every cluster: indices into `clusters` of the ranked clusters, best
    first."""
    ranking, _ = _rank(
        _keys(seed, request, group_boost),
        len(clusters),
        lambda i: clusters[i].cluster_id,
        lambda i: clusters[i].stats,
        excluded,
        group_boost,
        capacity_weights,
    )
    return ranking


def _overflow(
    ranked: Sequence[int], queue_ms: Callable[[int], float], saved_ms: float, overflow_ms: int
) -> int:
    """Step 5: the position in `ranked` (non-empty) to choose: the home (0) unless its queue
    delay exceeds the least by more than `saved_ms + overflow_ms`; then the first later one
    within `overflow_ms` of the least (the least queued always is)."""
    home = queue_ms(ranked[0])
    if home <= saved_ms + overflow_ms:
        return 0  # its excess over the least cannot be more (queue delays are not negative)
    queue = [home, *(queue_ms(index) for index in ranked[1:])]
    least = min(queue)

    def excess(position: int) -> float:  # inf - inf would be NaN: equal is no excess
        return 0.0 if queue[position] == least else queue[position] - least

    if excess(0) <= saved_ms + overflow_ms:
        return 0
    return next(p for p in range(1, len(ranked)) if excess(p) <= overflow_ms)


def _matched(chain: Sequence[int], backends: Sequence[BackendSnapshot]) -> int:
    """How many leading blocks of `chain` some backend's engine holds (precise mode)."""
    best = 0
    for backend in backends:
        held = backend.kv_blocks
        if not held:
            continue
        count = 0
        for block in chain:
            if block not in held:
                break
            count += 1
        best = max(best, count)
    return best


def _promote_cheapest_prefill(
    ranked: list[int],
    chain: Sequence[int],
    backends_of: Callable[[int], Sequence[BackendSnapshot]],
    weight_of: Callable[[int], float],
) -> list[int]:
    """Step 4b, precise mode: when engines publish their cached blocks, the item whose prefill of
    the request is cheapest (the share of the chain it does not hold, over its weight) becomes
    the home, the first of the ranking among equals; the rest keep their order. Without published
    blocks `ranked` as it is."""
    if not chain or len(ranked) < 2:
        return ranked
    matched = [_matched(chain, backends_of(item)) for item in ranked]
    if not any(matched):
        return ranked
    costs = [
        (1.0 - held / len(chain)) / weight_of(item)
        for held, item in zip(matched, ranked, strict=True)
    ]
    first = costs.index(min(costs))
    if first == 0:
        return ranked
    return [ranked[first], *ranked[:first], *ranked[first + 1 :]]


def _saved_ms(stats: ModelStats, request: RoutingRequest) -> float:
    """What the home's cache is expected to save: the prefill of the request's input."""
    saved = delay(request.input_tokens, input_tps(stats)) * 1000.0
    return saved if math.isfinite(saved) else 0.0


class PrefixAware:
    """docs/prefix-routing.md: the module docstring's steps, for the cluster and then for the
    backend inside it."""

    __slots__ = (
        "_ring",
        "capacity_weights",
        "consider_kv_free_tokens",
        "group_boost",
        "overflow_ms",
        "seed",
    )

    name: Final = "prefix-aware"

    def __init__(
        self,
        *,
        seed: str = "",
        consider_kv_free_tokens: bool = False,
        group_boost: float = DEFAULT_GROUP_BOOST,
        overflow_ms: int = DEFAULT_OVERFLOW_MS,
        capacity_weights: bool = True,
    ) -> None:
        if not (math.isfinite(group_boost) and group_boost >= 1.0):
            raise ValueError(f"group_boost must be finite and at least 1, got {group_boost}")
        self.seed = seed
        self.consider_kv_free_tokens = consider_kv_free_tokens
        self.group_boost = float(group_boost)
        self.overflow_ms = overflow_ms
        self.capacity_weights = capacity_weights
        self._ring: _Ring | None = None

    def _candidates(self, clusters: Sequence[ClusterSnapshot], key: bytes) -> Sequence[int]:
        """`key`'s multi-probe candidates among `clusters` (more than EXACT_LIMIT of them).

        The ring is built from the clusters' ids and kept while it fits them: rebuilt when their
        number changes or when a candidate's id is not the one the ring placed at its position.
        The routing state rebuilds its snapshot on every heartbeat and reservation, so checking
        every id per request would cost O(n); a cluster replaced by another at the same position
        is noticed by the first request whose probes reach it (one in about n / PROBES)."""
        ring = self._ring
        if ring is None or len(ring.ids) != len(clusters):
            ring = self._ring = _Ring(tuple(cluster.cluster_id for cluster in clusters))
        found = ring.candidates(key, PROBES)
        if any(clusters[i].cluster_id != ring.ids[i] for i in found):
            ring = self._ring = _Ring(tuple(cluster.cluster_id for cluster in clusters))
            found = ring.candidates(key, PROBES)
        return found

    def choose(
        self,
        clusters: Sequence[ClusterSnapshot],
        request: RoutingRequest,
        excluded: AbstractSet[str],
    ) -> Choice | None:
        if not clusters:
            return None
        keys = _keys(self.seed, request, self.group_boost)
        ranking, weights = _rank(
            keys,
            len(clusters),
            lambda i: clusters[i].cluster_id,
            lambda i: clusters[i].stats,
            excluded,
            self.group_boost,
            self.capacity_weights,
            None if len(clusters) <= EXACT_LIMIT else lambda k: self._candidates(clusters, k),
        )
        verdicts = [
            feasibility(clusters[i], request.input_tokens, excluded, self.consider_kv_free_tokens)
            for i in ranking
        ]
        feasible = [p for p, verdict in enumerate(verdicts) if verdict is Feasibility.ELIGIBLE]
        if not feasible:
            return None
        feasible = _promote_cheapest_prefill(
            feasible,
            request.prefix_chain,
            lambda p: clusters[ranking[p]].backends,
            lambda p: weights[ranking[p]],
        )
        saved = _saved_ms(clusters[ranking[feasible[0]]].stats, request)
        step = _overflow(
            [ranking[p] for p in feasible],
            lambda i: queue_delay_ms(clusters[i], request),
            saved,
            self.overflow_ms,
        )
        position = feasible[step]
        cluster = clusters[ranking[position]]
        kv_skipped = any(verdict.kv_skip for verdict in verdicts[:position])
        allowance = saved + self.overflow_ms if step == 0 else float(self.overflow_ms)
        return Choice(
            cluster,
            position + 1,
            kv_skipped,
            self._backends(keys, cluster, request),
            math.ceil(allowance),
        )

    def _backends(
        self, keys: tuple[bytes, bytes | None], cluster: ClusterSnapshot, request: RoutingRequest
    ) -> tuple[BackendSnapshot, ...]:
        """The cluster's backends in the order to try them: steps 1 to 3, 4b and 5 again, over
        backend ids and each backend's own stats (engines whose Pylons share a `--cluster-id`
        are one cluster: this is where prefix routing happens among them)."""
        backends = cluster.backends
        if len(backends) < 2:
            return backends
        ranked, weights = _rank(
            keys,
            len(backends),
            lambda i: backends[i].inference_server_id,
            lambda i: backends[i].stats,
            frozenset(),
            self.group_boost,
            self.capacity_weights,
        )
        ranked = _promote_cheapest_prefill(
            ranked, request.prefix_chain, lambda i: (backends[i],), weights.__getitem__
        )
        first = _overflow(
            ranked,
            lambda i: _backend_queue_ms(backends[i], cluster, request),
            _saved_ms(backends[ranked[0]].stats, request),
            self.overflow_ms,
        )
        order = [ranked[first], *ranked[:first], *ranked[first + 1 :]]
        return tuple(backends[i] for i in order)


def _backend_queue_ms(
    backend: BackendSnapshot, cluster: ClusterSnapshot, request: RoutingRequest
) -> float:
    return queue_delay_ms(replace(cluster, stats=backend.stats), request)
