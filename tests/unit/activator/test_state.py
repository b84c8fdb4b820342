"""The activator's pure decisions (stargate/activator/state.py), tested without an event loop."""

from __future__ import annotations

import pytest

from stargate.activator.state import (
    Decision,
    PoolState,
    SwapOutcome,
    SwapState,
    add_waiter,
    begin_swap,
    claim_deactivate,
    classify_swap_end,
    cleanup_after_acquire,
    count_grant,
    deactivate_skip_reason,
    decide,
    end_swap,
    forget_on_ownership_change,
    forget_on_ownership_gain,
    forget_on_ownership_loss,
    forget_on_stop,
    invalidate_resident,
    is_idle,
    new_swap,
    reconcile_resident,
    record_deactivate_task,
    rederive_resident,
    release_grant,
    remove_waiter,
    request_deactivate,
    request_swap_cancel,
    resolve_hold_budget,
    resolve_swap_deadline,
    take_swap_error,
)


def swap(gen: int = 1, target: str = "coder", reason: str | None = None) -> SwapState:
    return SwapState(gen, target, "judge", 0.0, 10.0, 0.0, reason)  # type: ignore[arg-type]


def test_decide() -> None:
    st = PoolState(members=("judge", "coder"), resident="judge")
    assert decide(st, "judge", "wait") is Decision.GRANT
    assert decide(st, "coder", "if_idle") is Decision.START_SWAP  # idle incumbent
    st.inflight["judge"] = 1
    assert decide(st, "coder", "wait") is Decision.WAIT  # drain before swap
    assert decide(st, "coder", "if_idle") is Decision.BUSY
    assert decide(st, "judge", "wait") is Decision.GRANT  # coalescing on a busy resident
    st.swap = swap()
    # The fast path is closed for every member during a swap; if_idle waits on it.
    assert decide(st, "judge", "wait") is Decision.WAIT
    assert decide(st, "coder", "if_idle") is Decision.WAIT
    st.swap_err["coder"] = ("boom", "error")
    assert decide(st, "coder", "wait") is Decision.SWAP_ERROR
    cold = PoolState(members=("judge", "coder"))
    assert decide(cold, "coder", "if_idle") is Decision.START_SWAP


def test_reconcile_resident() -> None:
    ready = {"coder"}
    st = PoolState(members=("judge", "coder"), resident="judge")
    assert reconcile_resident(st, ready.__contains__, 100.0, 5.0)
    assert st.resident == "coder" and st.resident_checked_at == 100.0
    ready.clear()
    assert not reconcile_resident(st, ready.__contains__, 104.0, 5.0)  # trusted for 5 s
    assert st.resident == "coder"
    assert reconcile_resident(st, ready.__contains__, 105.0, 5.0)
    assert st.resident is None
    ready.update({"judge", "coder"})
    st.resident_checked_at = None
    assert reconcile_resident(st, ready.__contains__, 106.0, 5.0)
    assert st.resident == "judge"  # declared order wins (docs/activator.md)
    st.resident_checked_at = None
    st.swap = swap()
    assert not reconcile_resident(st, set().__contains__, 107.0, 5.0)  # the swap owns it
    assert st.resident == "judge"


def test_cleanup_after_acquire() -> None:
    st = PoolState(members=("judge", "coder"), resident="judge", swap_gen=3)
    assert cleanup_after_acquire(st, "judge") == (False, None)  # granted / resident
    st.waiting["coder"] = 1
    assert cleanup_after_acquire(st, "coder") == (False, None)  # not the last waiter
    del st.waiting["coder"]
    assert cleanup_after_acquire(st, "coder") == (False, 3)
    st.swap = swap(gen=3)
    assert cleanup_after_acquire(st, "coder") == (True, 3)  # cancel-on-timeout
    assert cleanup_after_acquire(st, "other") == (False, 3)


def test_deactivate_skip_reason() -> None:
    st = PoolState(members=("judge", "coder"), resident="judge", swap_gen=2)
    assert deactivate_skip_reason(st, "coder", 2) is None
    st.waiting["coder"] = 1
    assert deactivate_skip_reason(st, "coder", 2) == "waiter"
    del st.waiting["coder"]
    assert deactivate_skip_reason(st, "judge", 2) == "resident"
    st.swap = swap(gen=3)
    assert deactivate_skip_reason(st, "coder", 2) == "newer_swap"
    st.swap = swap(gen=2)  # the cancelled swap still unwinding does not block it
    assert deactivate_skip_reason(st, "coder", 2) is None


def test_classify_swap_end() -> None:
    assert classify_swap_end(errored=False, cancel_called=True, swap=swap()) is SwapOutcome.SUCCESS
    assert classify_swap_end(errored=True, cancel_called=False, swap=swap()) is SwapOutcome.FAILED
    assert (
        classify_swap_end(errored=True, cancel_called=True, swap=swap(reason="cancelled"))
        is SwapOutcome.CANCELLED
    )
    assert (
        classify_swap_end(errored=True, cancel_called=True, swap=swap(reason="deadline"))
        is SwapOutcome.ABANDONED
    )
    # The scope caught its own deadline with no explicit cancel recorded.
    assert classify_swap_end(errored=True, cancel_called=True, swap=swap()) is SwapOutcome.ABANDONED


def test_budgets() -> None:
    assert resolve_swap_deadline(300.0, 120.0) == 300.0
    assert resolve_swap_deadline(None, 120.0) == 240.0
    assert resolve_swap_deadline(0.0, 30.0) == 60.0
    assert resolve_swap_deadline(-1.0, 30.0) == 60.0
    assert resolve_hold_budget(None, 300.0, 120.0) == 300.0
    assert resolve_hold_budget(10.0, 300.0, 120.0) == 10.0
    assert resolve_hold_budget(None, None, 120.0) == 120.0
    assert resolve_hold_budget(0.0, 0.0, 120.0) == 120.0


# ---- the transitions ----------------------------------------------------------------------------


def test_decide_checks_the_queue_bound_on_the_first_pass_only() -> None:
    st = PoolState(members=("judge", "coder"), resident="judge", waiting={"coder": 3})
    st.inflight["judge"] = 1
    # 2 others held besides the caller: a bound of 2 is full, 3 is not; no bound: not checked.
    assert decide(st, "coder", "wait", max_held=2) is Decision.QUEUE_FULL
    assert decide(st, "coder", "wait", max_held=3) is Decision.WAIT
    assert decide(st, "coder", "wait") is Decision.WAIT
    st.inflight.clear()  # an idle incumbent: a swap would start, but the queue is full first
    assert decide(st, "coder", "wait", max_held=2) is Decision.QUEUE_FULL
    assert decide(st, "coder", "wait", max_held=3) is Decision.START_SWAP
    # A grant, a busy answer and a swap error come before the bound.
    assert decide(st, "judge", "wait", max_held=0) is Decision.GRANT
    st.inflight["judge"] = 1
    assert decide(st, "coder", "if_idle", max_held=0) is Decision.BUSY
    st.swap_err["coder"] = ("boom", "error")
    assert decide(st, "coder", "wait", max_held=0) is Decision.SWAP_ERROR


def test_waiters_come_and_go() -> None:
    st = PoolState(members=("judge", "coder"), resident="judge", swap_gen=4)
    add_waiter(st, "coder")
    add_waiter(st, "coder")
    assert st.waiting == {"coder": 2} and st.held() == 2
    assert remove_waiter(st, "coder") == (False, None)  # not the last one
    assert st.waiting == {"coder": 1}
    st.swap = swap(gen=4)
    assert remove_waiter(st, "coder") == (True, 4)  # the last: cancel its swap, deactivate it
    assert st.waiting == {}
    add_waiter(st, "judge")
    assert remove_waiter(st, "judge") == (False, None)  # the resident is never deactivated
    assert st.waiting == {}


def test_grants_and_releases() -> None:
    st = PoolState(members=("judge",), resident="judge")
    count_grant(st, "judge")
    count_grant(st, "judge")
    assert st.inflight == {"judge": 2}
    assert release_grant(st, "judge") is False
    assert release_grant(st, "judge") is True  # zero: notify
    assert st.inflight == {}
    assert release_grant(st, "judge") is True  # never below zero
    assert st.inflight == {}


def test_take_swap_error_is_one_shot() -> None:
    st = PoolState(members=("judge", "coder"), swap_err={"coder": ("boom", "error")})
    assert take_swap_error(st, "coder") == ("boom", "error")
    assert decide(st, "coder", "wait") is not Decision.SWAP_ERROR
    with pytest.raises(KeyError):
        take_swap_error(st, "coder")


def test_a_swap_starts() -> None:
    st = PoolState(members=("judge", "coder"), resident="judge", swap_gen=6)
    st.swap_err["coder"] = ("old", "error")
    s = new_swap(st, "coder", now=10.0, deadline=310.0, hold_start=9.5)
    assert s == SwapState(7, "coder", "judge", 10.0, 310.0, 9.5)
    assert not st.swapping and st.swap_gen == 6  # not applied yet
    begin_swap(st, s)
    assert st.swap is s and st.swap_gen == 7 and st.swaps_started == 1
    assert st.swap_err == {}  # the target's old error is gone
    assert decide(st, "judge", "wait") is Decision.WAIT  # the fast path is closed


def test_request_swap_cancel_first_cause_wins() -> None:
    st = PoolState(members=("judge", "coder"))
    assert request_swap_cancel(st, now=1.0) is False  # no swap: nothing to cancel
    st.swap = swap()  # deadline 10.0
    assert request_swap_cancel(st, now=1.0) is True
    assert st.swap.cancel_reason == "cancelled"
    assert request_swap_cancel(st, now=11.0) is True
    assert st.swap.cancel_reason == "cancelled"  # the first cause stays
    st.swap = swap()
    assert request_swap_cancel(st, now=10.0) is True
    assert st.swap.cancel_reason == "deadline"  # at the deadline it ended by the deadline


def test_end_swap_by_outcome() -> None:
    def swapping() -> tuple[PoolState, SwapState]:
        st = PoolState(members=("judge", "coder"), resident="judge", resident_checked_at=0.0)
        st.swap = swap(gen=1)
        st.swap_gen = 1
        return st, st.swap

    st, s = swapping()
    assert end_swap(st, s, SwapOutcome.SUCCESS, now=5.0)
    assert st.swap is None and st.resident == "coder" and st.resident_checked_at == 5.0
    assert st.swap_err == {}

    st, s = swapping()
    assert end_swap(st, s, SwapOutcome.CANCELLED, now=5.0)  # F5: quiet
    assert st.swap is None and st.resident == "judge" and st.swap_err == {}

    st, s = swapping()
    assert end_swap(st, s, SwapOutcome.ABANDONED, now=10.25)  # F4
    assert st.swap is None and st.resident == "judge"
    message, reason = st.swap_err["coder"]
    assert reason == "deadline" and "abandoned after 10.250s" in message

    st, s = swapping()
    assert end_swap(st, s, SwapOutcome.FAILED, now=5.0, error=RuntimeError("api down"))
    assert st.swap_err["coder"] == ("model pool swap failed for member coder: api down", "error")

    st, s = swapping()  # F2: a stale task touches nothing
    stale = swap(gen=0)
    assert not end_swap(st, stale, SwapOutcome.SUCCESS, now=5.0)
    assert st.swap is s and st.resident == "judge"


def test_rederive_resident_ignores_the_resync_interval() -> None:
    st = PoolState(members=("judge", "coder"), resident="judge", resident_checked_at=99.0)
    # The failed swap's controller stopped judge; coder came up meanwhile.
    assert rederive_resident(st, {"coder"}.__contains__, 100.0, 3600.0)
    assert st.resident == "coder" and st.resident_checked_at == 100.0


def test_invalidate_resident_is_a_noop_while_swapping() -> None:
    swapping = PoolState(("judge", "coder"), "judge", resident_checked_at=1.0, swap=swap())
    invalidate_resident(swapping)
    assert swapping.resident_checked_at == 1.0  # the swap owns residency
    idle = PoolState(("judge", "coder"), "judge", resident_checked_at=1.0)
    invalidate_resident(idle)
    assert idle.resident_checked_at is None and idle.resident == "judge"


def test_a_deferred_deactivate_is_requested_recorded_and_claimed() -> None:
    st = PoolState(members=("judge", "coder"), resident="judge", swap_gen=1)
    assert request_deactivate(st, "coder", 1) is True  # start a task
    assert st.pending_deactivate == {}  # not until it started
    record_deactivate_task(st, "coder", 1)
    assert not is_idle(st)
    assert claim_deactivate(st, "coder", decides=True) is None  # deactivate now
    assert st.pending_deactivate == {} and is_idle(st)
    assert claim_deactivate(st, "coder", decides=True) == "forgotten"
    assert st.deactivates_skipped == 0


def test_a_pending_deactivate_checks_against_the_newest_last_waiter() -> None:
    """At most one task per member: a second last-waiter exit moves the pending generation on, so
    the newest waiter's own cancelled swap (same generation, unwinding) does not block it."""
    st = PoolState(members=("judge", "coder"), resident="judge", swap_gen=1)
    assert request_deactivate(st, "coder", 1)
    record_deactivate_task(st, "coder", 1)
    st.swap = swap(gen=2, reason="cancelled")  # the second waiter's swap, cancelled
    st.swap_gen = 2
    assert request_deactivate(st, "coder", 2) is False  # no second task
    assert st.pending_deactivate == {"coder": 2}
    assert claim_deactivate(st, "coder", decides=True) is None


def test_claim_deactivate_skips_and_counts() -> None:
    def claimed(st: PoolState, *, decides: bool = True) -> str | None:
        record_deactivate_task(st, "coder", 1)
        skip = claim_deactivate(st, "coder", decides=decides)
        assert st.pending_deactivate == {}
        assert st.deactivates_skipped == (0 if skip is None else 1)
        return skip

    members = ("judge", "coder")
    assert claimed(PoolState(members, "judge", swap_gen=1, waiting={"coder": 1})) == "waiter"
    assert claimed(PoolState(members, "coder", swap_gen=1)) == "resident"
    assert claimed(PoolState(members, "judge", swap=swap(gen=2), swap_gen=2)) == "newer_swap"
    assert claimed(PoolState(members, "judge", swap_gen=1), decides=False) == "not_owner"
    assert claimed(PoolState(members, "judge", swap_gen=1)) is None


def test_ownership_loss_forgets_every_decision_in_progress() -> None:
    st = PoolState(("judge", "coder"), "judge", resident_checked_at=1.0, swap=swap(gen=3))
    st.swap_err["coder"] = ("boom", "error")
    st.pending_deactivate["coder"] = 2
    st.waiting["coder"] = 1
    st.inflight["judge"] = 1
    lost = forget_on_ownership_loss(st)
    assert lost is not None and lost.cancel_reason == "cancelled"  # quiet (F5)
    assert not st.swapping and st.pending_deactivate == {} and st.swap_err == {}
    assert st.resident is None and st.resident_checked_at is None
    assert st.waiting == {"coder": 1} and st.inflight == {"judge": 1}  # still real requests
    assert forget_on_ownership_loss(st) is None
    late = PoolState(("judge", "coder"), swap=swap(reason="deadline"))
    lost = forget_on_ownership_loss(late)
    assert lost is not None and lost.cancel_reason == "deadline"  # the first cause stays


def test_ownership_gain_change_and_stop() -> None:
    st = PoolState(("judge", "coder"), "judge", resident_checked_at=5.0)
    st.swap_err["coder"] = ("boom", "error")
    forget_on_ownership_gain(st)
    assert st.resident_checked_at is None and st.swap_err == {} and st.resident == "judge"

    swapping = PoolState(("judge", "coder"), "judge", resident_checked_at=5.0, swap=swap())
    forget_on_ownership_change(swapping)
    assert swapping.resident_checked_at is None and swapping.swapping  # even while swapping

    stopped = PoolState(("judge", "coder"), "judge", swap=swap(), waiting={"coder": 1})
    stopped.pending_deactivate["coder"] = 1
    forget_on_stop(stopped)
    assert not stopped.swapping and stopped.pending_deactivate == {}
    assert stopped.resident == "judge" and stopped.waiting == {"coder": 1}


def test_no_swap_while_a_grant_is_in_flight_on_any_other_member() -> None:
    """Drain before swap counts every member, not only the believed resident: an ownership loss
    drops the belief (`resident` None) while the grants it covered stay in flight; a swap decided
    from "no resident" then scaled that member down under its requests (the shared-pool soak saw
    "r0 scaled m1 down with 2 granted")."""
    st = PoolState(members=("judge", "coder", "writer"), inflight={"judge": 2})
    forget_on_ownership_loss(st)
    assert st.resident is None and st.inflight == {"judge": 2}
    assert decide(st, "coder", "wait") is Decision.WAIT
    assert decide(st, "coder", "if_idle") is Decision.BUSY
    # a stale belief naming another member does not hide the grants either
    st.resident = "writer"
    assert decide(st, "coder", "wait") is Decision.WAIT
    # the member in flight may itself be the target (its activate stops the others)
    st.resident = None
    assert decide(st, "judge", "wait") is Decision.START_SWAP
    assert release_grant(st, "judge") is False
    assert release_grant(st, "judge") is True
    assert decide(st, "coder", "wait") is Decision.START_SWAP


def test_the_deferred_deactivate_never_runs_under_a_grant() -> None:
    st = PoolState(members=("judge", "coder"), inflight={"coder": 1}, swap_gen=2)
    assert deactivate_skip_reason(st, "coder", 2) == "in_flight"
    release_grant(st, "coder")
    assert deactivate_skip_reason(st, "coder", 2) is None
