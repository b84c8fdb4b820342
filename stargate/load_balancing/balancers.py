"""Load balancers: a pure choice of one cluster from a target's snapshot (docs/data-plane.md).

Nothing here does I/O or reads a clock. A balancer gets the target's cluster snapshots, the
request's routing inputs and the clusters this request has already failed, and returns a `Choice` or
None ("nothing choosable now"). This module has the protocol, the scores and the three simple
algorithms; round-robin keeps a counter. The stateful algorithms live beside it:
`wait_and_widen.py` (wait-and-widen) and `pulsar.py` (pulsar, pulsar-wait-and-widen), with their
hash layouts in `hashing.py`. Every instance belongs to one (target, algorithm definition) pair,
owned by `stargate.load_balancing.registry.BalancerRegistry` (docs/data-plane.md, LB instances).

Scores (docs/data-plane.md, Scores) are plain functions of one cluster snapshot and the request,
lower is better:

* `input_tps` is `last_mean_input_tps` when finite and positive, else 0 (no capacity);
* `delay(work, rate)` is 0 for no work, +inf for no rate, else work / rate (seconds);
* `queue_delay_ms` uses the published per-priority estimate (largest priority key <= the
  request's priority; 0 if none) when the cluster publishes any, else the queued input work;
* `ttft_ms` = RTT + queue delay + prefill delay of the request's own input tokens.

The per-cluster backend round robin (docs/data-plane.md, Backend choice) is `choose_backend`; its
counter belongs to the caller, since it is shared by every algorithm and request for the cluster.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Final, Protocol

from stargate.routing.state import BackendSnapshot, ClusterSnapshot
from stargate.routing.stats import ModelStats

__all__ = [
    "COMPARATORS",
    "DEFAULT_COMPARATOR",
    "DEFAULT_SAMPLE_COUNT",
    "MAX_SAMPLE_COUNT",
    "Choice",
    "Comparator",
    "LoadBalancer",
    "PowerOfN",
    "RandomChoice",
    "RoundRobin",
    "RoutingRequest",
    "choose_backend",
    "delay",
    "expected_queue_ms",
    "input_tps",
    "input_work_seconds",
    "num_requests_queued",
    "priority_queue_estimate_ms",
    "queue_delay_ms",
    "queue_time_delta_ms",
    "ttft_ms",
    "utilization",
    "valid_input_tps",
]

DEFAULT_SAMPLE_COUNT: Final = 2
MAX_SAMPLE_COUNT: Final = 64
DEFAULT_COMPARATOR: Final = "ttft"
_U64_MAX: Final = 2**64 - 1
_U64_MAX_AS_FLOAT: Final = float(2**64)


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What a balancer may know about one request (parsed from headers: docs/data-plane.md).

    * `routing_key`: the trimmed `x-routing-key` (None when absent or blank); with `model_id` it is
      hashed by the affinity ring and by Pulsar (docs/data-plane.md, Hashing).
    * `cache_affinity_key`: `x-cache-affinity-key` (None when absent or blank).
    * `request_slo_ms`: `x-request-slo-ms`; None and 0 both mean "no SLO".
    * `prefix_chain`, `prefix_group`: the block-hash chain of the request's prompt and the element
      ending its system part, derived with `--derive-affinity-key` (docs/prefix-routing.md; the
      `prefix-aware` balancer reads them; empty and None otherwise).
    * `waited_ms`: how long the request has been waiting for a cluster, in milliseconds: the
      time from the request's start to this selection, 0 for the first one. The forwarder
      refreshes it on every pass of its routing-wait loop; it is what unlocks wait-and-widen's
      later buckets and widens its queue SLO (docs/data-plane.md, Wait-and-widen). Balancers
      never read a clock themselves.
    """

    model_id: str
    input_tokens: int
    priority: int = 0
    cache_affinity_key: str | None = None
    request_slo_ms: int | None = None
    routing_key: str | None = None
    waited_ms: float = 0.0
    prefix_chain: tuple[int, ...] = ()
    prefix_group: int | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    """A balancer's pick.

    `rank_depth` is the chosen cluster's position (from 1) in the ranking the algorithm walked:
    1 is a primary selection (metric `routing_selections_total{selection="primary"}`), more is a
    fallback (`selection="fallback"`). Only the Pulsar variants report more than 1.

    `after_kv_free_tokens_skip` is True when a cluster ranked above the chosen one was passed over
    because of its KV-cache free tokens (Pulsar with `consider_kv_free_tokens`): the forwarder
    then counts `routing_kv_free_token_fallback_selections_total`.

    `backends` is the balancer's own order of the cluster's backends (prefix-aware: the first is
    the one whose cache should hold the request's prefix); empty for the cluster's round robin
    (docs/data-plane.md, Backend choice).

    `queue_allowance_ms` is the queue delay the balancer accepted above its estimate to keep the
    request where its cache is (prefix-aware): the forwarder adds it to the attempt's
    `x-stargate-expected-queue-ms`, so the Pylon's queue check refuses only past it.
    """

    cluster: ClusterSnapshot
    rank_depth: int = 1
    after_kv_free_tokens_skip: bool = False
    backends: tuple[BackendSnapshot, ...] = ()
    queue_allowance_ms: int = 0


# ---- scores (docs/data-plane.md, Scores) ---------------------------------------------------------


def valid_input_tps(value: float) -> bool:
    """A usable `last_mean_input_tps`: finite and positive."""
    return math.isfinite(value) and value > 0.0


def input_tps(stats: ModelStats) -> float:
    """The cluster's input capacity in tokens per second; 0 when the published value is not
    finite and positive."""
    tps = stats.last_mean_input_tps
    return tps if valid_input_tps(tps) else 0.0


def delay(work: float, rate: float) -> float:
    """Seconds to process `work` at `rate`: 0 without work (whatever the rate), +inf without a
    positive rate."""
    if work == 0:
        return 0.0
    if rate <= 0.0:
        return math.inf
    return work / rate


def priority_queue_estimate_ms(stats: ModelStats, priority: int) -> int | None:
    """The published queue estimate for `priority`: the entry with the largest priority key
    <= `priority`, 0 if the map is non-empty but has no such key, None if no map is published."""
    entries = stats.queue_time_estimate_ms_by_priority
    if not entries:
        return None
    best_key: int | None = None
    best_ms = 0
    for key, ms in entries:
        if key <= priority and (best_key is None or key > best_key):
            best_key, best_ms = key, ms
    return best_ms


def queue_time_delta_ms(input_tokens: int, last_mean_input_tps: float) -> int | None:
    """ceil(tokens / tps * 1000) ms; 0 for no tokens; None when the TPS is not usable or the
    result is not representable as a u64."""
    if input_tokens == 0:
        return 0
    if not valid_input_tps(last_mean_input_tps):
        return None
    raw = input_tokens / last_mean_input_tps * 1000.0
    if not math.isfinite(raw) or not 0.0 <= raw <= _U64_MAX_AS_FLOAT:
        return None
    return min(math.ceil(raw), _U64_MAX)  # Rust's saturating float-to-u64 cast


def expected_queue_ms(cluster: ClusterSnapshot, priority: int) -> int | None:
    """The `x-stargate-expected-queue-ms` value for one attempt, or None to omit it.

    docs/data-plane.md, One attempt and Scores.

    The per-priority rule when the cluster publishes a map (no matching entry gives 0, not
    None), else the queued input work at the published TPS.
    """
    estimate = priority_queue_estimate_ms(cluster.stats, priority)
    if estimate is not None:
        return estimate
    return queue_time_delta_ms(cluster.stats.queued_input_size, cluster.stats.last_mean_input_tps)


def queue_delay_ms(cluster: ClusterSnapshot, request: RoutingRequest) -> float:
    """Priority-aware queue delay in ms (the `queue-time` comparator)."""
    estimate = priority_queue_estimate_ms(cluster.stats, request.priority)
    if estimate is not None:
        return float(estimate)
    return delay(cluster.stats.queued_input_size, input_tps(cluster.stats)) * 1000.0


def ttft_ms(cluster: ClusterSnapshot, request: RoutingRequest) -> float:
    """Estimated time to first token in ms: RTT + queue delay + prefill of the request's input
    (the `ttft` comparator)."""
    prefill_ms = delay(request.input_tokens, input_tps(cluster.stats)) * 1000.0
    return cluster.rtt_seconds * 1000.0 + queue_delay_ms(cluster, request) + prefill_ms


def input_work_seconds(cluster: ClusterSnapshot, request: RoutingRequest) -> float:
    """(queued input + the request's input) / TPS, in seconds (`input-work-seconds`)."""
    work = cluster.stats.queued_input_size + request.input_tokens
    return delay(work, input_tps(cluster.stats))


def utilization(cluster: ClusterSnapshot, request: RoutingRequest | None = None) -> float:
    """Running queries over max(max_engine_concurrency, 1) (`utilization`)."""
    stats = cluster.stats
    return stats.num_running_queries / max(stats.max_engine_concurrency, 1)


def num_requests_queued(cluster: ClusterSnapshot, request: RoutingRequest | None = None) -> int:
    """The queue length, compared as an integer (`num-requests-queued`)."""
    return cluster.stats.queue_size


Comparator = Callable[[ClusterSnapshot, RoutingRequest], float]

COMPARATORS: Final[Mapping[str, Comparator]] = {
    "ttft": ttft_ms,
    "queue-time": queue_delay_ms,
    "input-work-seconds": input_work_seconds,
    "utilization": utilization,
    "num-requests-queued": num_requests_queued,
}


def _order_key(score: float) -> tuple[bool, float]:
    """Total order for scores, lowest first; NaN (never expected) sorts after +inf."""
    return (True, 0.0) if math.isnan(score) else (False, score)


# ---- balancers (docs/data-plane.md, Balancers) ---------------------------------------------------


class LoadBalancer(Protocol):
    """One algorithm instance for one (target, algorithm definition)."""

    @property
    def name(self) -> str:
        """The canonical algorithm name (metric label `algorithm`)."""
        ...

    def choose(
        self,
        clusters: Sequence[ClusterSnapshot],
        request: RoutingRequest,
        excluded: AbstractSet[str],
    ) -> Choice | None:
        """Pick one cluster whose id is not in `excluded`, or None if none is choosable."""
        ...


def _eligible(
    clusters: Sequence[ClusterSnapshot], excluded: AbstractSet[str]
) -> Sequence[ClusterSnapshot]:
    if not excluded:
        return clusters
    return [cluster for cluster in clusters if cluster.cluster_id not in excluded]


class RoundRobin:
    """Counter mod #eligible over the non-excluded clusters in list order.

    The counter advances only when a cluster is chosen (not when everything is excluded).
    """

    __slots__ = ("_counter",)

    name: Final = "round-robin"

    def __init__(self) -> None:
        self._counter = 0

    def choose(
        self,
        clusters: Sequence[ClusterSnapshot],
        request: RoutingRequest,
        excluded: AbstractSet[str],
    ) -> Choice | None:
        eligible = _eligible(clusters, excluded)
        if not eligible:
            return None
        index = self._counter % len(eligible)
        self._counter += 1
        return Choice(eligible[index])


class RandomChoice:
    """Uniform over the non-excluded clusters."""

    __slots__ = ("_rng",)

    name: Final = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()

    def choose(
        self,
        clusters: Sequence[ClusterSnapshot],
        request: RoutingRequest,
        excluded: AbstractSet[str],
    ) -> Choice | None:
        eligible = _eligible(clusters, excluded)
        if not eligible:
            return None
        return Choice(eligible[self._rng.randrange(len(eligible))])


class PowerOfN:
    """Sample min(n, #eligible) distinct eligible clusters uniformly; the lowest comparator
    score wins; exact ties are broken uniformly at random."""

    __slots__ = ("_rng", "_score", "comparator", "sample_count")

    name: Final = "power-of-n"

    def __init__(
        self,
        sample_count: int = DEFAULT_SAMPLE_COUNT,
        comparator: str = DEFAULT_COMPARATOR,
        rng: random.Random | None = None,
    ) -> None:
        if isinstance(sample_count, bool) or not 1 <= sample_count <= MAX_SAMPLE_COUNT:
            raise ValueError(
                f"power-of-n sample_count must be between 1 and {MAX_SAMPLE_COUNT}, "
                f"got {sample_count}"
            )
        score = COMPARATORS.get(comparator)
        if score is None:
            raise ValueError(
                f"unknown comparator {comparator!r}; expected one of {', '.join(COMPARATORS)}"
            )
        self.sample_count = sample_count
        self.comparator = comparator
        self._score = score
        self._rng = rng if rng is not None else random.Random()

    def choose(
        self,
        clusters: Sequence[ClusterSnapshot],
        request: RoutingRequest,
        excluded: AbstractSet[str],
    ) -> Choice | None:
        eligible = _eligible(clusters, excluded)
        if not eligible:
            return None
        if self.sample_count >= len(eligible):
            sampled: Sequence[ClusterSnapshot] = eligible
        else:
            sampled = self._rng.sample(eligible, self.sample_count)
        best: list[ClusterSnapshot] = []
        best_key: tuple[bool, float] | None = None
        for cluster in sampled:
            key = _order_key(self._score(cluster, request))
            if best_key is None or key < best_key:
                best, best_key = [cluster], key
            elif key == best_key:
                best.append(cluster)
        chosen = best[0] if len(best) == 1 else best[self._rng.randrange(len(best))]
        return Choice(chosen)


# ---- backend inside a cluster (docs/data-plane.md, Backend choice) -------------------------------


def choose_backend(
    cluster: ClusterSnapshot,
    counter: int,
    failed_backend_ids: AbstractSet[str],
    has_room: Callable[[BackendSnapshot], bool] | None = None,
    preferred: Sequence[BackendSnapshot] = (),
) -> BackendSnapshot | None:
    """Round robin over the cluster's backends (stable id order) not yet failed by this request.

    `counter` is the cluster's shared selection counter, taken (then incremented) by the caller
    for every selection. None when every backend has failed: the caller then fails the cluster.

    `has_room` (docs/data-plane.md, Per-backend connections): when given, the round robin runs
    over the unfailed backends it accepts (those below their connection cap), and over every
    unfailed backend only when it accepts none of them.

    `preferred` (a `Choice`'s `backends`): the first of them that is unfailed (and accepted by
    `has_room`, when some is) instead of the round robin.
    """
    listed = preferred or cluster.backends
    if failed_backend_ids:
        unfailed = [b for b in listed if b.inference_server_id not in failed_backend_ids]
    else:
        unfailed = list(listed)
    if not unfailed:
        return None
    if has_room is not None:
        roomy = [b for b in unfailed if has_room(b)]
        if roomy:
            unfailed = roomy
    return unfailed[0] if preferred else unfailed[counter % len(unfailed)]


# ---- input-work admission (docs/data-plane.md, Input-work admission) -----------------------------


def input_work_rejection(
    clusters: Sequence[ClusterSnapshot], input_tokens: int, limit_seconds: float
) -> str | None:
    """Why a request must not be routed at all, or None to admit it (docs/data-plane.md,
    Input-work admission).

    Work = the request's input tokens plus every considered cluster's queued input; capacity = the
    sum of their valid input TPS (clusters without one add work, not capacity). No capacity is
    `input_work_capacity_unavailable`; more seconds of work than the limit is
    `input_work_limit_exceeded`.
    """
    capacity = sum(input_tps(cluster.stats) for cluster in clusters)
    if capacity <= 0:
        return "input_work_capacity_unavailable"
    work = input_tokens + sum(cluster.stats.queued_input_size for cluster in clusters)
    seconds = work / capacity
    if not math.isfinite(seconds):
        return "input_work_capacity_unavailable"
    return "input_work_limit_exceeded" if seconds > limit_seconds else None
