"""The retry rules of one proxied request, as pure functions: no I/O, no clock, no metrics.

docs/data-plane.md, "Forwarding" and "Retries". The forwarder (`forwarder.py`) owns the loop, the
upstream I/O and the metric calls; after each attempt, in one place (`Forwarder._conclude`), it
asks `decide_response` (a response head) or `decide_transport_failure` (none: a `FailureKind`)
what to do (`decide` takes either, as an `Outcome`), applies the counters and exclusions with
`record`, and then does the I/O the `Decision` names. Keeping the rules here lets them be tested
without an event loop, in the style of the activator's `state.py`.

The retry reason is the trimmed `x-stargate-retry-reason`, compared exactly: a reason that merely
contains `queue_estimate_mismatch` (or is contained in it, or differs in case) is another reason,
as in the Rust router.
"""

from __future__ import annotations

import enum
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal

from stargate.proxy.contract import Headers, first_header

__all__ = [
    "DEFAULT_RETRY_REASON",
    "QUEUE_ESTIMATE_MISMATCH",
    "RETRYABLE_STATUSES",
    "Action",
    "Attempts",
    "Decision",
    "FailureKind",
    "Outcome",
    "RetryPolicy",
    "TransportFailure",
    "UpstreamHead",
    "decide",
    "decide_response",
    "decide_transport_failure",
    "expired",
    "is_queue_estimate_mismatch",
    "record",
    "retry_reason",
]

RETRYABLE_STATUSES = frozenset({429, 503})
QUEUE_ESTIMATE_MISMATCH = "queue_estimate_mismatch"
DEFAULT_RETRY_REASON = "retryable_upstream_response"

RetryCounter = Literal["connect", "request"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """The retry flags: `--proxy-max-connect-retries`, `--proxy-max-request-retries`,
    `--proxy-require-pylon-retry-signal`."""

    max_connect_retries: int
    max_request_retries: int
    require_pylon_retry_signal: bool


@dataclass(slots=True)
class Attempts:
    """Per-request retry state (docs/data-plane.md, Forwarding): the backends and clusters that
    failed for this request, both retry counters (per request, not per backend) and the
    retry-budget deadline (None: no budget header)."""

    failed_backends: set[str] = field(default_factory=set)
    failed_clusters: set[str] = field(default_factory=set)
    connect_retries: int = 0
    request_retries: int = 0
    budget_deadline: float | None = None
    mismatched: dict[str, str] = field(default_factory=dict)
    """Backend id -> cluster id of the backends that answered a queue-estimate mismatch."""
    queue_check_waived: bool = False
    """The last resort was taken: attempts go without `x-stargate-expected-queue-ms`."""
    left_out: AbstractSet[str] = frozenset()
    """Backends the current routing decision leaves out: ejected outliers and backends sitting
    out their slow-start share (docs/outliers.md). Drawn again for every decision; not failures,
    so they count for neither `failed_any` nor a retry."""

    @property
    def failed_any(self) -> bool:
        return bool(self.failed_backends or self.failed_clusters)

    def waive_queue_check(self) -> bool:
        """The last resort of a queue-estimate mismatch (docs/data-plane.md, Retries): once no
        other candidate is left, the backends that answered one become candidates again and the
        request is sent without an expected queue time, which a Pylon accepts. The mismatch says
        "another backend may be better", not "I cannot take it". False when there is nothing to
        waive (no mismatch, or already waived)."""
        if self.queue_check_waived or not self.mismatched:
            return False
        self.queue_check_waived = True
        self.failed_backends -= self.mismatched.keys()
        self.failed_clusters -= set(self.mismatched.values())
        self.mismatched.clear()
        return True


class FailureKind(enum.Enum):
    """How an attempt failed before its response head."""

    CONNECT = "connect"  # the connection was refused or could not be made
    OTHER = "other"  # head timeout, a reset before the head, an upload error
    BACKEND_UNROUTABLE = "backend_unroutable"  # the control plane took the backend out meanwhile
    # Every connection to the backend stayed in use for the pool's acquire timeout; nothing sent.
    BACKEND_FULL = "backend_full"


@dataclass(frozen=True, slots=True)
class TransportFailure:
    kind: FailureKind


@dataclass(frozen=True, slots=True)
class UpstreamHead:
    """The parts of an upstream response head the retry rules read (first values, raw)."""

    status: int
    retryable: bytes | None = None  # x-stargate-retryable
    retry_reason: bytes | None = None  # x-stargate-retry-reason

    @classmethod
    def from_headers(cls, status: int, headers: Headers) -> UpstreamHead:
        return cls(
            status,
            first_header(headers, b"x-stargate-retryable"),
            first_header(headers, b"x-stargate-retry-reason"),
        )


Outcome = TransportFailure | UpstreamHead


class Action(enum.Enum):
    """What the forwarder does after one attempt."""

    RESPOND = "respond"  # return the upstream response as final
    FAIL = "fail"  # return the local 502
    UNAVAILABLE = "unavailable"  # return the local 503: every candidate is at its connection cap
    SIBLING = "sibling"  # exclude this backend; a sibling in the cluster next, else re-balance
    OTHER_CLUSTER = "other_cluster"  # exclude the whole cluster and run the balancer again
    # The same backend again, without an expected queue time: a queue-estimate mismatch when no
    # request retry is left (`Attempts.waive_queue_check`).
    RESEND_WITHOUT_QUEUE_CHECK = "resend_without_queue_check"


@dataclass(frozen=True, slots=True)
class Decision:
    """One attempt's consequence.

    `retry` names the counter a retry spends (None: no retry); `retry_reason` is then the
    `proxy_retries_total` reason. `exhausted_reason` is the `proxy_retry_exhausted_total` reason
    when a retry was wanted but none is left. `release_reservation` (the queue-mismatch 429) and
    `demote` (a refused connection) are side effects to apply whatever the action.
    """

    action: Action
    retry: RetryCounter | None = None
    retry_reason: str | None = None
    exhausted_reason: str | None = None
    release_reservation: bool = False
    demote: bool = False


def expired(deadline: float | None, now: float) -> bool:
    """The retry budget has run out: no retry may start."""
    return deadline is not None and now >= deadline


def retry_reason(head: UpstreamHead, require_pylon_retry_signal: bool) -> str | None:
    """The retry reason if `head` is a retry candidate, else None (docs/data-plane.md, Retries)."""
    if head.status not in RETRYABLE_STATUSES:
        return None
    signal = head.retryable
    if signal is None:
        if require_pylon_retry_signal:
            return None
    elif signal.strip().lower() != b"true":
        return None
    raw = head.retry_reason
    reason = raw.decode("latin-1").strip() if raw else ""
    return reason or DEFAULT_RETRY_REASON


def is_queue_estimate_mismatch(head: UpstreamHead) -> bool:
    """A Pylon's explicit "my queue is not what you estimated" 429 (docs/data-plane.md, One
    attempt): the one response that releases its attempt's reservation, whether or not a retry
    follows. It needs the explicit signal even when the Pylon signal is not required."""
    if head.status != 429:
        return False
    signal = head.retryable
    if signal is None or signal.strip().lower() != b"true":
        return False
    raw = head.retry_reason
    return raw is not None and raw.decode("latin-1").strip() == QUEUE_ESTIMATE_MISMATCH


def decide_transport_failure(
    attempts: Attempts, kind: FailureKind, policy: RetryPolicy, now: float
) -> Decision:
    """An attempt failed before its response head: a sibling (one connect retry spent), or the
    502 when the retry budget or the connect retries are out. A refused connection demotes the
    backend; one the control plane took out is not demoted (docs/stale-routes.md).

    A backend that stayed at its connection cap for the acquire timeout is the 503 at once, with
    no retry spent (docs/data-plane.md, Per-backend connections): it was chosen only because
    every candidate was at its cap, so another one would only be waited for again.
    """
    if kind is FailureKind.BACKEND_FULL:
        return Decision(Action.UNAVAILABLE)
    demote = kind is FailureKind.CONNECT
    if expired(attempts.budget_deadline, now):
        return Decision(Action.FAIL, exhausted_reason="retry_budget_exhausted", demote=demote)
    if attempts.connect_retries >= policy.max_connect_retries:
        return Decision(Action.FAIL, exhausted_reason="connect_retries_exhausted", demote=demote)
    reason = "backend_unroutable" if kind is FailureKind.BACKEND_UNROUTABLE else "connect_failover"
    return Decision(Action.SIBLING, retry="connect", retry_reason=reason, demote=demote)


def decide_response(
    attempts: Attempts, head: UpstreamHead, policy: RetryPolicy, now: float
) -> Decision:
    """A response head arrived: pass it through, or retry it (docs/data-plane.md, Retries).

    A queue-estimate mismatch moves to a sibling backend, any other retry reason to another
    cluster. A mismatch with no request retry left is sent once more to the same backend without
    an expected queue time (the last resort, `Attempts.waive_queue_check`; not when the retry
    budget is out, which is the client's own limit).
    """
    release = is_queue_estimate_mismatch(head)
    reason = retry_reason(head, policy.require_pylon_retry_signal)
    if reason is None:
        return Decision(Action.RESPOND, release_reservation=release)
    if expired(attempts.budget_deadline, now):
        return Decision(
            Action.RESPOND, exhausted_reason="retry_budget_exhausted", release_reservation=release
        )
    if attempts.request_retries >= policy.max_request_retries:
        if release and not attempts.queue_check_waived:
            return Decision(
                Action.RESEND_WITHOUT_QUEUE_CHECK,
                retry_reason="queue_check_waived",
                release_reservation=True,
            )
        return Decision(Action.RESPOND, exhausted_reason=reason, release_reservation=release)
    action = Action.SIBLING if reason == QUEUE_ESTIMATE_MISMATCH else Action.OTHER_CLUSTER
    return Decision(action, retry="request", retry_reason=reason, release_reservation=release)


def decide(attempts: Attempts, outcome: Outcome, policy: RetryPolicy, now: float) -> Decision:
    """What to do after one attempt ended in `outcome`."""
    if isinstance(outcome, TransportFailure):
        return decide_transport_failure(attempts, outcome.kind, policy, now)
    return decide_response(attempts, outcome, policy, now)


def record(attempts: Attempts, decision: Decision, backend_id: str, cluster_id: str) -> None:
    """Apply a decision to the attempt record: spend its retry, exclude what failed."""
    if decision.retry == "connect":
        attempts.connect_retries += 1
    elif decision.retry == "request":
        attempts.request_retries += 1
    if decision.action is Action.SIBLING:
        attempts.failed_backends.add(backend_id)
        if decision.retry_reason == QUEUE_ESTIMATE_MISMATCH:
            attempts.mismatched[backend_id] = cluster_id
    elif decision.action is Action.OTHER_CLUSTER:
        attempts.failed_clusters.add(cluster_id)
    elif decision.action is Action.RESEND_WITHOUT_QUEUE_CHECK:
        attempts.queue_check_waived = True
