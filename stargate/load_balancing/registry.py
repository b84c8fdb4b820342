"""LB instance lifetime: one load balancer per (routing target, algorithm definition).

docs/data-plane.md, LB instances. `lb_config` parses the file and resolves each request to an
`AlgorithmSpec`; this module turns a definition into a balancer (`create_balancer`) and keeps the
instances per target (`BalancerRegistry`), so stateful balancers (round-robin's counter) keep
their state between requests and lose it when their target goes.
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
)
from stargate.load_balancing.config import (
    POWER_OF_N,
    RANDOM,
    ROUND_ROBIN,
    AlgorithmSpec,
    not_implemented_message,
)
from stargate.routing.state import ClusterSnapshot

__all__ = ["BalancerRegistry", "create_balancer"]


def create_balancer(spec: AlgorithmSpec, rng: random.Random | None = None) -> LoadBalancer:
    """A fresh LB instance for one definition. `rng` makes random choices reproducible."""
    if spec.name == POWER_OF_N:
        return PowerOfN(spec.sample_count, spec.comparator, rng=rng)
    if spec.name == ROUND_ROBIN:
        return RoundRobin()
    if spec.name == RANDOM:
        return RandomChoice(rng=rng)
    raise NotImplementedError(not_implemented_message(spec.name))


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
