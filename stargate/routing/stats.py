"""Backend statistics and how a cluster's statistics are aggregated from its backends.

`ModelStats` mirrors the `stargate.ModelStats` protobuf message field for field, as an immutable
value the routing state can share with readers; the control plane converts the wire message.
Aggregation follows docs/control-plane.md, "Cluster aggregation": some fields are summed over the
cluster's backends, others are taken whole from one "source" backend (the one updated last), and
RTT is the mean.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

__all__ = [
    "U64_MAX",
    "ModelStats",
    "aggregate_stats",
    "apply_reservations",
    "mean_rtt_seconds",
    "reservation_delta_ms",
]

U64_MAX: Final = 2**64 - 1
_U64_MAX_AS_FLOAT: Final = float(2**64)


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
    """A cluster's statistics from its backends' (docs/control-plane.md, Cluster aggregation).

    Summed: output TPS, queue sizes and the two query counters; `last_mean_input_tps` only over
    backends reporting a finite positive value; the observation time is the newest. Latest-wins
    ("cluster-scoped", the engine is shared by the cluster): taken whole from `source`.
    """
    if len(backends) == 1 and backends[0] is source and (alone := _aggregate_of_one(source)):
        return alone  # most clusters have one backend: no new value per heartbeat
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


def _aggregate_of_one(stats: ModelStats) -> ModelStats | None:
    """What `aggregate_stats([stats], stats)` computes, cheaply; None where it is not `stats`
    itself or a copy with only `last_mean_input_tps` cleared (label lists with duplicates)."""
    if len(set(stats.stats_capabilities)) != len(stats.stats_capabilities) or len(
        set(stats.stats_sources)
    ) != len(stats.stats_sources):
        return None
    tps = stats.last_mean_input_tps
    if tps == 0 or (math.isfinite(tps) and tps > 0):
        return stats
    return replace(stats, last_mean_input_tps=0.0)  # not finite or not positive: not counted


def mean_rtt_seconds(rtts_ns: Sequence[int]) -> float:
    """Arithmetic mean of RTTs given in whole nanoseconds, truncated to whole nanoseconds."""
    if not rtts_ns:
        return 0.0
    return (sum(rtts_ns) // len(rtts_ns)) / 1e9


def reservation_delta_ms(input_tokens: int, last_mean_input_tps: float) -> int | None:
    """The queue time one pending request adds: ceil(tokens / tps * 1000) ms.

    docs/data-plane.md, Reservations.

    0 for no tokens (whatever the TPS); None when the TPS is not finite and positive or the result
    is not representable as a u64. (The same rule as `balancers.queue_time_delta_ms`, kept here so
    the routing state does not import the balancers.)
    """
    if input_tokens == 0:
        return 0
    if not (math.isfinite(last_mean_input_tps) and last_mean_input_tps > 0.0):
        return None
    raw = input_tokens / last_mean_input_tps * 1000.0
    if not math.isfinite(raw) or not 0.0 <= raw <= _U64_MAX_AS_FLOAT:
        return None
    return min(math.ceil(raw), U64_MAX)  # Rust's saturating float-to-u64 cast


def _add_to_priority_map(entries: dict[int, int], priority: int, delta: int) -> None:
    """One reservation's effect on a non-empty per-priority queue map (in place): the request's
    own entry is created from the best estimate at or below its priority (0 if none) and, like
    every numerically larger priority key, increased by `delta` (saturating)."""
    if priority not in entries:
        below = [key for key in entries if key <= priority]
        entries[priority] = entries[max(below)] if below else 0
    for key, ms in entries.items():
        if key >= priority:
            entries[key] = min(ms + delta, U64_MAX)


def apply_reservations(
    base: ModelStats,
    reservations: Iterable[tuple[int, int]],
    *,
    totals: tuple[int, int] | None = None,
) -> ModelStats:
    """`base` with pending reservations, each (input tokens, priority), applied on top
    (docs/data-plane.md, Reservations).

    Per reservation: queue size and running queries +1, queued input and total query input
    +tokens (both saturating at u64), and the per-priority queue map rule (a no-op when the cluster
    publishes no map; the whole map is cleared when the delta cannot be computed).

    `totals` = (count, tokens) kept incrementally by the caller: then `reservations` is only
    iterated when the cluster publishes a priority map, so the proxy's per-request snapshot does
    not cost O(pending reservations) for the common map-less cluster.
    """
    pending: Iterable[tuple[int, int]]
    if totals is None:
        pending = list(reservations)
        count = len(pending)
        tokens = sum(input_tokens for input_tokens, _ in pending)
    else:
        pending = reservations
        count, tokens = totals
    if count == 0:
        return base
    by_priority = base.queue_time_estimate_ms_by_priority
    if by_priority:
        entries = dict(by_priority)
        for input_tokens, priority in pending:
            delta = reservation_delta_ms(input_tokens, base.last_mean_input_tps)
            if delta is None:
                entries = {}
                break
            _add_to_priority_map(entries, priority, delta)
        by_priority = tuple(sorted(entries.items()))
    return replace(
        base,
        queue_size=min(base.queue_size + count, U64_MAX),
        queued_input_size=min(base.queued_input_size + tokens, U64_MAX),
        num_running_queries=min(base.num_running_queries + count, U64_MAX),
        total_query_input_size=min(base.total_query_input_size + tokens, U64_MAX),
        queue_time_estimate_ms_by_priority=by_priority,
    )
