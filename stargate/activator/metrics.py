"""The activator's Prometheus series, under LLMKube's `llmkube_modelpool_*` names
(docs/decisions.md, D7), so existing ModelPool dashboards work. Defined on a registry passed in;
label names alphabetical.

Label sets follow docs/activator.md, "Metrics" (`resident` is labelled by namespace, not router).
Two series are stargate's own, for pools shared by several replicas (docs/pool-ownership.md), kept
under the same prefix so one dashboard query finds every pool series: `owned` (1 on the replica
that owns the pool) and `relayed_requests_total` (requests handed to the owner, by outcome).
Three more are stargate's measured waiting (docs/activator.md, "Measured waiting"):
`swap_time_estimate_seconds` (the per-member swap-time EWMA behind Retry-After),
`breaker_state` (0 closed, 1 half-open, 2 open) and `breaker_openings_total`.
Bucket deviation: upstream's swap-duration buckets stop at 512 s and hold-duration buckets at
204.8 s, below the default 300 s swap budget; the same buckets are kept and extended to 1200 s.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["HOLD_BUCKETS", "SWAP_BUCKETS", "ActivatorMetrics"]

# Upstream 1, 2, 4 ... 512, extended.
SWAP_BUCKETS = (*(float(2**i) for i in range(10)), 1024.0, 1200.0)
# Upstream 0.1, 0.2 ... 204.8, extended.
HOLD_BUCKETS = (*(round(0.1 * 2**i, 1) for i in range(12)), 409.6, 819.2, 1200.0)


@dataclass(frozen=True, slots=True)
class ActivatorMetrics:
    resident: Gauge  # member, namespace, pool
    swaps: Counter  # from, pool, router, to
    swap_duration: Histogram  # pool, router
    hold_duration: Histogram  # member, pool, router
    coalesced: Counter  # member, pool, router
    busy_skips: Counter  # member, pool, router
    held_requests: Gauge  # member, pool, router
    swap_failures: Counter  # member, pool, reason, router
    owned: Gauge  # pool, router
    relayed: Counter  # outcome, pool, router
    swap_time_estimate: Gauge  # member, pool, router
    breaker_state: Gauge  # member, pool, router
    breaker_openings: Counter  # member, pool, router

    @classmethod
    def create(cls, registry: CollectorRegistry) -> ActivatorMetrics:
        per_member = ("member", "pool", "router")
        return cls(
            resident=Gauge(
                "llmkube_modelpool_resident",
                "1 for the member the activator believes owns the pool's slot, 0 for the others.",
                labelnames=("member", "namespace", "pool"),
                registry=registry,
            ),
            swaps=Counter(
                "llmkube_modelpool_swaps_total",
                "Successful pool swaps (from is empty on a cold pool).",
                labelnames=("from", "pool", "router", "to"),
                registry=registry,
            ),
            swap_duration=Histogram(
                "llmkube_modelpool_swap_duration_seconds",
                "Activate plus wait-ready time of successful swaps.",
                labelnames=("pool", "router"),
                buckets=SWAP_BUCKETS,
                registry=registry,
            ),
            hold_duration=Histogram(
                "llmkube_modelpool_hold_duration_seconds",
                "Per successful swap: time from the starting waiter's arrival to residency.",
                labelnames=per_member,
                buckets=HOLD_BUCKETS,
                registry=registry,
            ),
            coalesced=Counter(
                "llmkube_modelpool_coalesced_total",
                "Every grant on the resident member (fast path), held requests included.",
                labelnames=per_member,
                registry=registry,
            ),
            busy_skips=Counter(
                "llmkube_modelpool_busy_skips_total",
                "IfIdle acquires refused because the resident had work in flight.",
                labelnames=per_member,
                registry=registry,
            ),
            held_requests=Gauge(
                "llmkube_modelpool_held_requests",
                "Requests currently inside acquire for the member.",
                labelnames=per_member,
                registry=registry,
            ),
            swap_failures=Counter(
                "llmkube_modelpool_swap_failures_total",
                "Failed (reason=error) and abandoned (reason=deadline) swaps; never cancelled.",
                labelnames=("member", "pool", "reason", "router"),
                registry=registry,
            ),
            owned=Gauge(
                "llmkube_modelpool_owned",
                "1 on the replica that owns the pool (decides its swaps), 0 on the others.",
                labelnames=("pool", "router"),
                registry=registry,
            ),
            relayed=Counter(
                "llmkube_modelpool_relayed_requests_total",
                "Pool requests this replica did not own, by final outcome (relayed to the owner, "
                "served locally after ownership moved here, or refused).",
                labelnames=("outcome", "pool", "router"),
                registry=registry,
            ),
            swap_time_estimate=Gauge(
                "llmkube_modelpool_swap_time_estimate_seconds",
                "EWMA of the member's successful swap durations (start to resident), the base of "
                "the Retry-After of the pool's 503s.",
                labelnames=per_member,
                registry=registry,
            ),
            breaker_state=Gauge(
                "llmkube_modelpool_breaker_state",
                "The member's swap breaker: 0 closed, 1 half-open (its probe swap runs), 2 open "
                "(requests fail fast, no swap starts).",
                labelnames=per_member,
                registry=registry,
            ),
            breaker_openings=Counter(
                "llmkube_modelpool_breaker_openings_total",
                "Times the member's breaker opened after consecutive failed swaps (or a failed "
                "probe).",
                labelnames=per_member,
                registry=registry,
            ),
        )
