"""Routing targets, their clusters and backends, and the counts derived from them.

All mutations run on the trio loop and contain no `await`, so each one is atomic with respect to
every reader without locks (control-plane spec §3.7). A target that loses its last backend is
dropped, so a later registration re-creates it with fresh per-target state.

Counting follows control-plane spec §3.8: one unit is one routable (registration, routing key,
model) triple, that is one backend entry stored in one target's cluster. A backend serving three
models counts three; heartbeats that only refresh an entry do not change the count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BackendEntry", "RoutingState", "RoutingTargetKey"]


@dataclass(frozen=True, slots=True)
class RoutingTargetKey:
    """The unit of routing: an optional routing key plus a model id.

    `routing_key=None` (unkeyed) and any string key never match each other.
    """

    routing_key: str | None
    model_id: str


@dataclass(frozen=True, slots=True)
class BackendEntry:
    """One active backend of one target, as the proxy will see it (immutable; replaced whole)."""

    inference_server_id: str
    cluster_id: str
    url: str


@dataclass(slots=True)
class _Target:
    clusters: dict[str, dict[str, BackendEntry]] = field(default_factory=dict)

    @property
    def active_backend_count(self) -> int:
        return sum(len(backends) for backends in self.clusters.values())


class RoutingState:
    """Targets by (routing key, model), each holding clusters of active backends."""

    def __init__(self) -> None:
        self._targets: dict[RoutingTargetKey, _Target] = {}

    def upsert_backend(self, target: RoutingTargetKey, backend: BackendEntry) -> bool:
        """Insert or replace `backend` in `target`; return True if it was newly inserted."""
        state = self._targets.setdefault(target, _Target())
        cluster = state.clusters.setdefault(backend.cluster_id, {})
        inserted = backend.inference_server_id not in cluster
        cluster[backend.inference_server_id] = backend
        return inserted

    def remove_backend(
        self, target: RoutingTargetKey, cluster_id: str, inference_server_id: str
    ) -> bool:
        """Remove one backend from `target`; return True if it was there.

        An emptied cluster is dropped, and so is an emptied target.
        """
        state = self._targets.get(target)
        if state is None:
            return False
        cluster = state.clusters.get(cluster_id)
        if cluster is None or cluster.pop(inference_server_id, None) is None:
            return False
        if not cluster:
            del state.clusters[cluster_id]
        if not state.clusters:
            del self._targets[target]
        return True

    def targets(self) -> list[RoutingTargetKey]:
        """Every target with at least one active backend."""
        return list(self._targets)

    def backends(self, target: RoutingTargetKey) -> list[BackendEntry]:
        """The active backends of `target`, by cluster id then server id."""
        state = self._targets.get(target)
        if state is None:
            return []
        return [
            state.clusters[cluster_id][server_id]
            for cluster_id in sorted(state.clusters)
            for server_id in sorted(state.clusters[cluster_id])
        ]

    def active_backend_count(self, target: RoutingTargetKey) -> int:
        """Active backends of one target (the `active_inference_servers` gauge's value)."""
        state = self._targets.get(target)
        return 0 if state is None else state.active_backend_count

    def total_active_backend_count(self) -> int:
        """The sum of active backend counts over every target and routing key (spec §3.8).

        This is what the readiness sampler reads: not a count of distinct Pylons or streams.
        """
        return sum(state.active_backend_count for state in self._targets.values())
