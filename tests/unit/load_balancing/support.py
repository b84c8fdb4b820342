"""Cluster snapshots and requests for the balancer tests (no backends: balancers never look)."""

from __future__ import annotations

from stargate.load_balancing.balancers import RoutingRequest
from stargate.routing.state import ClusterSnapshot
from stargate.routing.stats import ModelStats

NO_EXCLUSIONS: frozenset[str] = frozenset()


def snap(cluster_id: str, *, rtt_ms: float = 0.0, **stats: object) -> ClusterSnapshot:
    """A cluster snapshot with the given `ModelStats` fields."""
    return ClusterSnapshot(cluster_id, ModelStats(**stats), rtt_ms / 1000.0, 0.0, ())  # type: ignore[arg-type]


def req(
    input_tokens: int = 0,
    *,
    model_id: str = "model-a",
    routing_key: str | None = "rk-1",
    key: str | None = None,
    priority: int = 0,
    slo_ms: int | None = None,
    waited_ms: float = 0.0,
) -> RoutingRequest:
    return RoutingRequest(
        model_id=model_id,
        input_tokens=input_tokens,
        priority=priority,
        cache_affinity_key=key,
        request_slo_ms=slo_ms,
        routing_key=routing_key,
        waited_ms=waited_ms,
    )
