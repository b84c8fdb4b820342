"""Backend statistics and how a cluster's statistics are aggregated from its backends.

`ModelStats` mirrors the `stargate.ModelStats` protobuf message field for field, as an immutable
value the routing state can share with readers; the control plane converts the wire message.
Aggregation follows control-plane spec §3.4: some fields are summed over the cluster's backends,
others are taken whole from one "source" backend (the one updated last), and RTT is the mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["ModelStats", "aggregate_stats", "mean_rtt_seconds"]


@dataclass(frozen=True, slots=True)
class ModelStats:
    """One backend's (or one cluster's aggregated) load statistics for one model."""

    last_mean_input_tps: float = 0.0
    output_tps: float = 0.0
    queue_size: int = 0
    queued_input_size: int = 0
    max_output_tps: float = 0.0
    kv_cache_capacity_tokens: int = 0
    kv_cache_used_tokens: int = 0
    kv_cache_free_tokens: int = 0
    num_running_queries: int = 0
    max_engine_concurrency: int = 0  # 0 = not reported
    total_query_input_size: int = 0
    # (priority, estimated queue time in ms), sorted by priority; a tuple keeps the value hashable.
    queue_time_estimate_ms_by_priority: tuple[tuple[int, int], ...] = ()
    input_processing_queries: int = 0
    output_generation_queries: int = 0
    stats_observed_at_unix_ms: int = 0  # 0 = unknown
    stats_capabilities: tuple[str, ...] = field(default=())
    stats_sources: tuple[str, ...] = field(default=())


def _union(groups: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    """Order-preserving union of label lists."""
    return tuple(dict.fromkeys(label for group in groups for label in group))


def aggregate_stats(backends: Sequence[ModelStats], source: ModelStats) -> ModelStats:
    """A cluster's statistics from its backends' (spec §3.4).

    Summed: output TPS, queue sizes and the two query counters; `last_mean_input_tps` only over
    backends reporting a finite positive value; the observation time is the newest. Latest-wins
    ("cluster-scoped", the engine is shared by the cluster): taken whole from `source`.
    """
    return ModelStats(
        last_mean_input_tps=sum(
            s.last_mean_input_tps
            for s in backends
            if math.isfinite(s.last_mean_input_tps) and s.last_mean_input_tps > 0
        ),
        output_tps=sum(s.output_tps for s in backends),
        queue_size=sum(s.queue_size for s in backends),
        queued_input_size=sum(s.queued_input_size for s in backends),
        input_processing_queries=sum(s.input_processing_queries for s in backends),
        output_generation_queries=sum(s.output_generation_queries for s in backends),
        stats_observed_at_unix_ms=max((s.stats_observed_at_unix_ms for s in backends), default=0),
        stats_capabilities=_union([s.stats_capabilities for s in backends]),
        stats_sources=_union([s.stats_sources for s in backends]),
        max_output_tps=source.max_output_tps,
        kv_cache_capacity_tokens=source.kv_cache_capacity_tokens,
        kv_cache_used_tokens=source.kv_cache_used_tokens,
        kv_cache_free_tokens=source.kv_cache_free_tokens,
        num_running_queries=source.num_running_queries,
        max_engine_concurrency=source.max_engine_concurrency,
        total_query_input_size=source.total_query_input_size,
        queue_time_estimate_ms_by_priority=source.queue_time_estimate_ms_by_priority,
    )


def mean_rtt_seconds(rtts_ns: Sequence[int]) -> float:
    """Arithmetic mean of RTTs given in whole nanoseconds, truncated to whole nanoseconds."""
    if not rtts_ns:
        return 0.0
    return (sum(rtts_ns) // len(rtts_ns)) / 1e9
