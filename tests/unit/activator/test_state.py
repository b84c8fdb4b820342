"""The activator's pure decisions (stargate/activator/state.py), tested without an event loop."""

from __future__ import annotations

from stargate.activator.state import (
    Decision,
    PoolState,
    SwapOutcome,
    SwapState,
    classify_swap_end,
    cleanup_after_acquire,
    deactivate_skip_reason,
    decide,
    reconcile_resident,
    resolve_hold_budget,
    resolve_swap_deadline,
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
