"""The retry rules as pure functions (docs/data-plane.md, Retries): every outcome against every
budget, retry-count and Pylon-signal setting, with no event loop."""

from __future__ import annotations

import itertools

import pytest

from stargate.proxy.retry import (
    DEFAULT_RETRY_REASON,
    QUEUE_ESTIMATE_MISMATCH,
    Action,
    Attempts,
    Decision,
    FailureKind,
    RetryPolicy,
    TransportFailure,
    UpstreamHead,
    decide,
    decide_response,
    decide_transport_failure,
    expired,
    is_queue_estimate_mismatch,
    record,
    retry_reason,
)

NOW = 100.0
MAX = 2

# Budget deadlines: no budget header, still open, exactly now (expired: `now >= deadline`), past.
BUDGETS: dict[str, tuple[float | None, bool]] = {
    "none": (None, False),
    "open": (NOW + 0.001, False),
    "now": (NOW, True),
    "past": (NOW - 5.0, True),
}


def _policy(require_signal: bool = True) -> RetryPolicy:
    return RetryPolicy(
        max_connect_retries=MAX, max_request_retries=MAX, require_pylon_retry_signal=require_signal
    )


def _attempts(budget: str = "none", connect: int = 0, request: int = 0) -> Attempts:
    return Attempts(
        connect_retries=connect, request_retries=request, budget_deadline=BUDGETS[budget][0]
    )


# ---- the budget -------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", BUDGETS)
def test_expired(budget: str) -> None:
    deadline, is_expired = BUDGETS[budget]
    assert expired(deadline, NOW) is is_expired


# ---- transport failures -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "budget", "retries_left"),
    list(itertools.product(FailureKind, BUDGETS, [True, False])),
)
@pytest.mark.parametrize("require_signal", [True, False])
def test_transport_failures(
    kind: FailureKind, budget: str, retries_left: bool, require_signal: bool
) -> None:
    attempts = _attempts(budget, connect=MAX - 1 if retries_left else MAX, request=MAX)
    decision = decide(attempts, TransportFailure(kind), _policy(require_signal), NOW)
    demote = kind is FailureKind.CONNECT  # never for one the control plane took out
    if kind is FailureKind.BACKEND_FULL:
        # Every candidate was at its connection cap: the 503 at once, whatever is left.
        expected = Decision(Action.UNAVAILABLE)
    elif BUDGETS[budget][1]:
        expected = Decision(Action.FAIL, exhausted_reason="retry_budget_exhausted", demote=demote)
    elif not retries_left:
        expected = Decision(
            Action.FAIL, exhausted_reason="connect_retries_exhausted", demote=demote
        )
    else:
        reason = (
            "backend_unroutable" if kind is FailureKind.BACKEND_UNROUTABLE else "connect_failover"
        )
        expected = Decision(Action.SIBLING, retry="connect", retry_reason=reason, demote=demote)
    assert decision == expected
    assert decision == decide_transport_failure(attempts, kind, _policy(require_signal), NOW)


def test_request_retries_do_not_limit_transport_failures() -> None:
    decision = decide_transport_failure(
        _attempts(connect=0, request=99), FailureKind.OTHER, _policy(), NOW
    )
    assert decision.action is Action.SIBLING


def test_zero_connect_retries_fail_at_once() -> None:
    policy = RetryPolicy(0, MAX, True)
    decision = decide_transport_failure(_attempts(), FailureKind.CONNECT, policy, NOW)
    assert decision == Decision(
        Action.FAIL, exhausted_reason="connect_retries_exhausted", demote=True
    )


# ---- upstream responses -------------------------------------------------------------------------

# x-stargate-retryable as sent: absent, explicit true (any case, padded), explicit false, garbage.
SIGNALS: dict[str, bytes | None] = {
    "absent": None,
    "true": b"true",
    "padded-true": b" TRUE ",
    "false": b"false",
    "other": b"yes",
}
# x-stargate-retry-reason as sent.
REASONS: dict[str, bytes | None] = {
    "absent": None,
    "empty": b"",
    "blank": b"   ",
    "custom": b" overloaded ",
    "mismatch": b"queue_estimate_mismatch",
    "padded-mismatch": b"  queue_estimate_mismatch ",
    # Near misses: the reason is matched exactly after trimming, as the Rust router does, never
    # as a substring (either way round) or without case.
    "longer": b"queue_estimate_mismatch_v2",
    "inside": b"not_queue_estimate_mismatch",
    "shorter": b" queue_estimate ",
    "upper-case": b"QUEUE_ESTIMATE_MISMATCH",
}
MISMATCHES = ("mismatch", "padded-mismatch")
STATUSES = [200, 400, 429, 500, 502, 503, 504]


def _expected_reason(status: int, signal: str, reason: str, require_signal: bool) -> str | None:
    if status not in (429, 503):
        return None
    if signal == "absent":
        if require_signal:
            return None
    elif signal not in ("true", "padded-true"):
        return None
    return {
        "absent": DEFAULT_RETRY_REASON,
        "empty": DEFAULT_RETRY_REASON,
        "blank": DEFAULT_RETRY_REASON,
        "custom": "overloaded",
        "mismatch": QUEUE_ESTIMATE_MISMATCH,
        "padded-mismatch": QUEUE_ESTIMATE_MISMATCH,
        "longer": "queue_estimate_mismatch_v2",
        "inside": "not_queue_estimate_mismatch",
        "shorter": "queue_estimate",
        "upper-case": "QUEUE_ESTIMATE_MISMATCH",
    }[reason]


def _expected_release(status: int, signal: str, reason: str) -> bool:
    # Only a 429 with an explicit true signal, whatever the signal setting.
    return status == 429 and signal in ("true", "padded-true") and reason in MISMATCHES


@pytest.mark.parametrize(
    ("status", "signal", "reason"), list(itertools.product(STATUSES, SIGNALS, REASONS))
)
@pytest.mark.parametrize("require_signal", [True, False])
def test_retry_reason_and_mismatch(
    status: int, signal: str, reason: str, require_signal: bool
) -> None:
    head = UpstreamHead(status, SIGNALS[signal], REASONS[reason])
    expected = _expected_reason(status, signal, reason, require_signal)
    assert retry_reason(head, require_signal) == expected
    assert is_queue_estimate_mismatch(head) is _expected_release(status, signal, reason)


@pytest.mark.parametrize(
    ("status", "signal", "reason"), list(itertools.product(STATUSES, SIGNALS, REASONS))
)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("retries_left", [True, False])
@pytest.mark.parametrize("require_signal", [True, False])
def test_upstream_responses(
    status: int,
    signal: str,
    reason: str,
    budget: str,
    retries_left: bool,
    require_signal: bool,
) -> None:
    head = UpstreamHead(status, SIGNALS[signal], REASONS[reason])
    attempts = _attempts(budget, connect=MAX, request=MAX - 1 if retries_left else MAX)
    decision = decide(attempts, head, _policy(require_signal), NOW)
    retry = _expected_reason(status, signal, reason, require_signal)
    release = _expected_release(status, signal, reason)
    if retry is None:
        expected = Decision(Action.RESPOND, release_reservation=release)
    elif BUDGETS[budget][1]:
        expected = Decision(
            Action.RESPOND, exhausted_reason="retry_budget_exhausted", release_reservation=release
        )
    elif not retries_left and release:
        # The last resort of an explicit mismatch: the same backend, without the queue check.
        expected = Decision(
            Action.RESEND_WITHOUT_QUEUE_CHECK,
            retry_reason="queue_check_waived",
            release_reservation=True,
        )
    elif not retries_left:
        expected = Decision(Action.RESPOND, exhausted_reason=retry, release_reservation=release)
    else:
        action = Action.SIBLING if retry == QUEUE_ESTIMATE_MISMATCH else Action.OTHER_CLUSTER
        expected = Decision(
            action, retry="request", retry_reason=retry, release_reservation=release
        )
    assert decision == expected
    assert decision == decide_response(attempts, head, _policy(require_signal), NOW)
    assert not decision.demote


def test_a_mismatch_reason_without_the_signal_moves_to_a_sibling_but_keeps_the_reservation() -> (
    None
):
    head = UpstreamHead(429, None, b"queue_estimate_mismatch")
    decision = decide_response(_attempts(), head, _policy(require_signal=False), NOW)
    assert decision == Decision(
        Action.SIBLING, retry="request", retry_reason=QUEUE_ESTIMATE_MISMATCH
    )


def test_a_503_mismatch_retries_on_a_sibling_without_releasing() -> None:
    head = UpstreamHead(503, b"true", b"queue_estimate_mismatch")
    decision = decide_response(_attempts(), head, _policy(), NOW)
    assert decision.action is Action.SIBLING
    assert not decision.release_reservation


def test_the_mismatch_429_releases_even_when_passed_through() -> None:
    head = UpstreamHead(429, b"true", b"queue_estimate_mismatch")
    decision = decide_response(_attempts("past"), head, _policy(), NOW)
    assert decision == Decision(
        Action.RESPOND, exhausted_reason="retry_budget_exhausted", release_reservation=True
    )


@pytest.mark.parametrize("reason", sorted(set(REASONS) - set(MISMATCHES) - {"absent"}))
def test_only_the_exact_mismatch_reason_is_a_mismatch(reason: str) -> None:
    """A reason that contains, or is contained in, `queue_estimate_mismatch` is another reason:
    the reservation stays, the whole cluster is excluded, and no last resort follows."""
    head = UpstreamHead(429, b"true", REASONS[reason])
    assert not is_queue_estimate_mismatch(head)
    attempts = _attempts()
    decision = decide_response(attempts, head, _policy(), NOW)
    assert decision.action is Action.OTHER_CLUSTER and not decision.release_reservation
    record(attempts, decision, "b1", "c1")
    assert attempts.failed_clusters == {"c1"} and attempts.mismatched == {}
    exhausted = decide_response(_attempts(request=MAX), head, _policy(), NOW)
    assert exhausted.action is Action.RESPOND  # no resend without the queue check
    # Nor does `record` take the reason for a mismatch, whatever action it comes with.
    sibling = Decision(Action.SIBLING, retry="request", retry_reason=retry_reason(head, True))
    record(attempts, sibling, "b2", "c2")
    assert attempts.mismatched == {} and not attempts.waive_queue_check()


def test_connect_retries_do_not_limit_request_retries() -> None:
    head = UpstreamHead(503, b"true", None)
    decision = decide_response(_attempts(connect=99, request=0), head, _policy(), NOW)
    assert decision.action is Action.OTHER_CLUSTER


def test_head_from_headers_reads_first_values() -> None:
    headers = [
        (b"x-stargate-retry-reason", b"first"),
        (b"x-stargate-retryable", b"true"),
        (b"x-stargate-retryable", b"false"),
        (b"x-stargate-retry-reason", b"second"),
    ]
    assert UpstreamHead.from_headers(429, headers) == UpstreamHead(429, b"true", b"first")
    assert UpstreamHead.from_headers(200, []) == UpstreamHead(200, None, None)


# ---- the attempt record -----------------------------------------------------------------------


def test_record_spends_the_named_counter_and_excludes_what_failed() -> None:
    attempts = Attempts()
    assert not attempts.failed_any
    record(attempts, Decision(Action.SIBLING, retry="connect", retry_reason="x"), "b1", "c1")
    assert (attempts.connect_retries, attempts.request_retries) == (1, 0)
    assert attempts.failed_backends == {"b1"}
    assert attempts.failed_clusters == set()
    assert attempts.failed_any
    record(attempts, Decision(Action.OTHER_CLUSTER, retry="request", retry_reason="y"), "b2", "c2")
    assert (attempts.connect_retries, attempts.request_retries) == (1, 1)
    assert attempts.failed_backends == {"b1"}
    assert attempts.failed_clusters == {"c2"}
    record(attempts, Decision(Action.SIBLING, retry="request", retry_reason="z"), "b3", "c3")
    assert attempts.request_retries == 2
    assert attempts.failed_backends == {"b1", "b3"}


@pytest.mark.parametrize(
    "decision",
    [
        Decision(Action.RESPOND),
        Decision(Action.RESPOND, exhausted_reason="retry_budget_exhausted"),
        Decision(Action.FAIL, exhausted_reason="connect_retries_exhausted", demote=True),
    ],
)
def test_final_decisions_change_nothing(decision: Decision) -> None:
    attempts = Attempts(budget_deadline=1.0)
    record(attempts, decision, "b", "c")
    assert attempts == Attempts(budget_deadline=1.0)


def test_a_request_runs_out_of_connect_retries_after_max() -> None:
    attempts = Attempts()
    actions = []
    for backend in ("a", "b", "c"):
        decision = decide_transport_failure(attempts, FailureKind.CONNECT, _policy(), NOW)
        actions.append(decision.action)
        record(attempts, decision, backend, "cluster")
    assert actions == [Action.SIBLING, Action.SIBLING, Action.FAIL]
    assert attempts.failed_backends == {"a", "b"}


def test_a_mismatch_with_no_retry_left_is_resent_once_then_passed_through() -> None:
    """The last resort is taken once per request: a second mismatch after it is final."""
    head = UpstreamHead(429, b"true", b"queue_estimate_mismatch")
    attempts = _attempts("none", connect=MAX, request=MAX)
    first = decide(attempts, head, _policy(True), NOW)
    assert first.action is Action.RESEND_WITHOUT_QUEUE_CHECK
    record(attempts, first, "b1", "c1")
    assert attempts.queue_check_waived
    assert attempts.request_retries == MAX  # the resend spends no request retry
    second = decide(attempts, head, _policy(True), NOW)
    assert second == Decision(
        Action.RESPOND, exhausted_reason=QUEUE_ESTIMATE_MISMATCH, release_reservation=True
    )


def test_waiving_restores_the_mismatched_backends_and_their_clusters_only() -> None:
    attempts = Attempts()
    mismatch = Decision(
        Action.SIBLING,
        retry="request",
        retry_reason=QUEUE_ESTIMATE_MISMATCH,
        release_reservation=True,
    )
    record(attempts, mismatch, "b1", "c1")
    record(attempts, Decision(Action.SIBLING, retry="connect"), "b2", "c2")
    attempts.failed_clusters |= {"c1", "c2"}
    assert attempts.mismatched == {"b1": "c1"}
    assert attempts.waive_queue_check()
    assert attempts.failed_backends == {"b2"}
    assert attempts.failed_clusters == {"c2"}
    assert attempts.queue_check_waived
    assert not attempts.waive_queue_check()  # once per request


def test_nothing_to_waive_without_a_mismatch() -> None:
    attempts = Attempts(failed_backends={"b1"}, failed_clusters={"c1"})
    assert not attempts.waive_queue_check()
    assert attempts.failed_backends == {"b1"} and not attempts.queue_check_waived
