"""Queue admission: refuse a request whose routing estimate was far too optimistic.

The replica sends `x-stargate-expected-queue-ms`, the queue time it expected here when it chose
this backend (from the Pylon's last heartbeat plus its own reservations). The Pylon compares it
with its live queue at admission: when the local estimate exceeds what the replica expected by
more than the tolerance, the request would wait far longer here than the replica believed (other
replicas routed to this engine meanwhile), so it is answered with a retryable 429
`queue_estimate_mismatch` and the replica retries it on another backend of the cluster, releasing
its reservation.

The request is accepted whenever the rule cannot be applied: admission off, no or an unreadable
header (the replica had no estimate), or no usable local input TPS (no local estimate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stargate.http_headers import Headers, parse_unsigned
from stargate.pylon.stats.problems import problem
from stargate.routing.stats import U64_MAX

if TYPE_CHECKING:
    from stargate.pylon.stats.aggregator import StatsAggregator
    from stargate.pylon.stats.observer import RequestTracker

__all__ = [
    "EXPECTED_QUEUE_MS_HEADER",
    "QUEUE_ESTIMATE_MISMATCH",
    "AdmissionConfig",
    "QueueMismatch",
    "evaluate",
    "mismatch_response",
    "mismatch_threshold_ms",
    "parse_expected_queue_ms",
]

EXPECTED_QUEUE_MS_HEADER = b"x-stargate-expected-queue-ms"
QUEUE_ESTIMATE_MISMATCH = "queue_estimate_mismatch"
_DETAIL = "local queue estimate exceeded Stargate routing estimate"


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """The `--pylon-queue-mismatch-*` settings: refused only when the local estimate exceeds
    max(expected + `min_delta_ms`, ceil(expected x `tolerance_factor`)); `retry_after_ms`, when
    set, is sent as `x-stargate-retry-after-ms`."""

    enabled: bool = True
    min_delta_ms: int = 25
    tolerance_factor: float = 1.25
    retry_after_ms: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.min_delta_ms <= U64_MAX:
            raise ValueError("min_delta_ms must be a u64")
        if not (math.isfinite(self.tolerance_factor) and self.tolerance_factor > 0):
            raise ValueError("tolerance_factor must be finite and > 0")
        if self.retry_after_ms is not None and not 0 <= self.retry_after_ms <= U64_MAX:
            raise ValueError("retry_after_ms must be a u64")


@dataclass(frozen=True, slots=True)
class QueueMismatch:
    """Why a request was refused: the replica's estimate, the local one and the threshold."""

    expected_ms: int
    actual_ms: int
    threshold_ms: int


def mismatch_threshold_ms(expected: int, min_delta: int, factor: float) -> int:
    """max(expected + min_delta, ceil(expected x factor)), saturating at u64 max (100 -> 125,
    0 -> 25 with the defaults). A factor that is not finite and positive counts as 1."""
    additive = min(expected + min_delta, U64_MAX)
    if not (math.isfinite(factor) and factor > 0.0):
        factor = 1.0
    scaled = math.ceil(expected * factor)  # Rust: f64 product, saturating cast to u64
    return max(additive, min(scaled, U64_MAX))


def parse_expected_queue_ms(raw: bytes | None) -> int | None:
    """The header's value as Rust reads it (trimmed ASCII digits, optional `+`, a u64); None when
    absent or unreadable, and then the request is accepted."""
    return None if raw is None else parse_unsigned(raw, U64_MAX)


def evaluate(
    stats: StatsAggregator,
    tracker: RequestTracker,
    expected_ms: int | None,
    config: AdmissionConfig,
) -> QueueMismatch | None:
    """The mismatch that refuses `tracker` (already admitted PENDING), or None to accept it."""
    if not config.enabled or expected_ms is None:
        return None
    actual = stats.actual_queue_ms(tracker)
    if actual is None:
        return None
    threshold = mismatch_threshold_ms(expected_ms, config.min_delta_ms, config.tolerance_factor)
    return QueueMismatch(expected_ms, actual, threshold) if actual > threshold else None


def mismatch_response(
    mismatch: QueueMismatch, config: AdmissionConfig
) -> tuple[int, Headers, bytes]:
    """The retryable 429 that tells the replica to try another backend of the cluster."""
    headers = [
        (b"x-stargate-retryable", b"true"),
        (b"x-stargate-retry-reason", QUEUE_ESTIMATE_MISMATCH.encode()),
    ]
    if config.retry_after_ms is not None:
        headers.append((b"x-stargate-retry-after-ms", str(config.retry_after_ms).encode()))
    return problem(
        429,
        "Too Many Requests",
        _DETAIL,
        headers,
        fields={
            "reason": QUEUE_ESTIMATE_MISMATCH,
            "expected_queue_ms": mismatch.expected_ms,
            "actual_queue_ms": mismatch.actual_ms,
            "threshold_ms": mismatch.threshold_ms,
        },
    )
