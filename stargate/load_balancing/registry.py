"""LB instance lifetime: one load balancer per (routing target, algorithm definition).

docs/data-plane.md, LB instances. `lb_config` parses the file and resolves each request to an
`AlgorithmSpec`; this module turns a definition into a balancer (`create_balancer`) and keeps the
instances per target (`BalancerRegistry`), so stateful balancers (round-robin's counter, the
wait-and-widen affinity ring, the Pulsar ranking caches) keep their state between requests and
lose it when their target goes. `input_work_rejection_for` is input-work admission for a
definition (docs/data-plane.md, Input-work admission).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence
from collections.abc import Set as AbstractSet

from stargate.load_balancing.balancers import (
    Choice,
    LoadBalancer,
    PowerOfN,
    RandomChoice,
    RoundRobin,
    RoutingRequest,
    input_work_rejection,
)
from stargate.load_balancing.config import (
    POWER_OF_N,
    PREFIX_AWARE,
    PULSAR,
    PULSAR_VARIANTS,
    PULSAR_WAIT_AND_WIDEN,
    RANDOM,
    ROUND_ROBIN,
    WAIT_AND_WIDEN,
    AlgorithmSpec,
    not_implemented_message,
)
from stargate.load_balancing.prefix_aware import PrefixAware
from stargate.load_balancing.pulsar import Pulsar, PulsarWaitAndWiden, pulsar_admission_clusters
from stargate.load_balancing.wait_and_widen import WaitAndWiden, WidenSettings
from stargate.routing.state import ClusterSnapshot

__all__ = ["BalancerRegistry", "create_balancer", "input_work_rejection_for", "widen_settings"]


def widen_settings(spec: AlgorithmSpec) -> WidenSettings:
    """The wait-and-widen selection settings of a definition."""
    return WidenSettings(
        max_queue_time_floor_ms=spec.max_queue_time_floor_ms,
        max_queue_time_ceil_ms=spec.max_queue_time_ceil_ms,
        ttft_bucket_size_ms=spec.ttft_bucket_size_ms,
        next_bucket_unlock_factor=spec.next_bucket_unlock_factor,
        n=spec.n,
        max_queued=spec.max_queued,
        ignore_queue_time=spec.ignore_queue_time,
        ignore_input_processing_time=spec.ignore_input_processing_time,
    )


def create_balancer(spec: AlgorithmSpec, rng: random.Random | None = None) -> LoadBalancer:
    """A fresh LB instance for one definition. `rng` makes random choices reproducible."""
    if spec.name == POWER_OF_N:
        return PowerOfN(spec.sample_count, spec.comparator, rng=rng)
    if spec.name == ROUND_ROBIN:
        return RoundRobin()
    if spec.name == RANDOM:
        return RandomChoice(rng=rng)
    if spec.name == WAIT_AND_WIDEN:
        return WaitAndWiden(
            seed=spec.seed,
            comparator=spec.comparator,
            cache_affinity_virtual_nodes=spec.cache_affinity_virtual_nodes,
            cache_affinity_backend_selection_count=spec.cache_affinity_backend_selection_count,
            settings=widen_settings(spec),
            rng=rng,
        )
    if spec.name == PULSAR:
        return Pulsar(seed=spec.seed, consider_kv_free_tokens=spec.consider_kv_free_tokens)
    if spec.name == PULSAR_WAIT_AND_WIDEN:
        return PulsarWaitAndWiden(
            seed=spec.seed,
            consider_kv_free_tokens=spec.consider_kv_free_tokens,
            settings=widen_settings(spec),
            rng=rng,
        )
    if spec.name == PREFIX_AWARE:
        return PrefixAware(
            seed=spec.seed,
            consider_kv_free_tokens=spec.consider_kv_free_tokens,
            group_boost=spec.group_boost,
            overflow_ms=spec.overflow_ms,
            capacity_weights=spec.capacity_weights,
        )
    raise NotImplementedError(not_implemented_message(spec.name))


def input_work_rejection_for(
    spec: AlgorithmSpec,
    clusters: Sequence[ClusterSnapshot],
    input_tokens: int,
    excluded: AbstractSet[str] = frozenset(),
) -> str | None:
    """Input-work admission for one routing attempt under `spec` (docs/data-plane.md,
    Input-work admission): None to admit (always, when `max_input_work_seconds` is unset), else
    the rejection reason of `input_work_rejection`.

    The considered clusters are those of `clusters` not in `excluded`; for the Pulsar variants
    only those of them with a valid input TPS that pass the KV check (when
    `consider_kv_free_tokens` is set), as those are the only ones Pulsar can choose.
    """
    limit = spec.max_input_work_seconds
    if limit is None:
        return None
    considered: Sequence[ClusterSnapshot] = (
        [cluster for cluster in clusters if cluster.cluster_id not in excluded]
        if excluded
        else clusters
    )
    if spec.name in PULSAR_VARIANTS:
        considered = pulsar_admission_clusters(
            considered, input_tokens, spec.consider_kv_free_tokens
        )
    return input_work_rejection(considered, input_tokens, limit)


class BalancerRegistry:
    """LB instances per (target, algorithm definition), created lazily on first use.

    docs/data-plane.md, LB instances.

    `target` is any hashable key for the routing target (the routing state's
    `RoutingTargetKey`). The routing state drops a target when its last backend goes; call
    `forget(target)` then, so a recreated target starts with fresh LB state (round-robin
    counters restart). Equal definitions share an instance, so an override naming the model's
    configured algorithm uses the configured instance.
    """

    __slots__ = ("_factory", "_instances")

    def __init__(self, factory: Callable[[AlgorithmSpec], LoadBalancer] = create_balancer) -> None:
        self._factory = factory
        self._instances: dict[Hashable, dict[AlgorithmSpec, LoadBalancer]] = {}

    def get(self, target: Hashable, spec: AlgorithmSpec) -> LoadBalancer:
        """The instance for (target, spec), created on first use."""
        per_target = self._instances.get(target)
        if per_target is None:
            per_target = self._instances[target] = {}
        balancer = per_target.get(spec)
        if balancer is None:
            balancer = per_target[spec] = self._factory(spec)
        return balancer

    def choose(
        self,
        target: Hashable,
        spec: AlgorithmSpec,
        clusters: Sequence[ClusterSnapshot],
        request: RoutingRequest,
        excluded: AbstractSet[str],
    ) -> Choice | None:
        """Choose with the (target, spec) instance; no instance is created without candidates."""
        if not clusters:
            return None
        return self.get(target, spec).choose(clusters, request, excluded)

    def forget(self, target: Hashable) -> None:
        """Drop every instance of `target` (it emptied); a no-op for an unknown target."""
        self._instances.pop(target, None)

    def instance_count(self, target: Hashable | None = None) -> int:
        """Live instances, for one target or overall (for tests and debugging)."""
        if target is not None:
            return len(self._instances.get(target, ()))
        return sum(len(per_target) for per_target in self._instances.values())

    def targets(self) -> list[Hashable]:
        return list(self._instances)
