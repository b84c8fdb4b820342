"""The pure rules of measured waiting (stargate/activator/waiting.py and their transitions in
state.py; docs/activator.md, "Measured waiting" and "Breaker"): plain values, no event loop."""

from __future__ import annotations

import math

import pytest

from stargate.activator.state import (
    Decision,
    PoolState,
    SwapOutcome,
    begin_swap,
    decide,
    end_swap,
    expected_wait,
    new_swap,
    settle_breaker,
)
from stargate.activator.waiting import (
    OVERRUN_FRACTION,
    RETRY_AFTER_MAX,
    SWAP_TIME_ALPHA,
    Breaker,
    BreakerPhase,
    BreakerPolicy,
    SwapTime,
    remaining_swap_time,
    retry_after_seconds,
)

# ---- the EWMA ---------------------------------------------------------------------------------


def test_the_first_measurement_seeds_the_ewma() -> None:
    times = SwapTime()
    times.record(40.0)
    assert (times.ewma, times.samples) == (40.0, 1)


def test_the_ewma_moves_by_alpha_toward_each_new_measurement() -> None:
    times = SwapTime()
    times.record(40.0)
    times.record(20.0)
    assert times.ewma == pytest.approx(40.0 - SWAP_TIME_ALPHA * 20.0)  # 34
    times.record(20.0)
    assert times.ewma == pytest.approx(20.0 + (1 - SWAP_TIME_ALPHA) ** 2 * 20.0)  # 29.8
    assert times.samples == 3


def test_after_a_shift_the_ewma_converges_within_a_few_swaps() -> None:
    times = SwapTime()
    times.record(80.0)  # a cold first load, then the page cache makes it 40 s
    errors = []
    for _ in range(8):
        times.record(40.0)
        errors.append(abs(times.ewma - 40.0) / 40.0)
    assert errors == sorted(errors, reverse=True)  # closer every time
    assert errors[3] < 0.25  # within 25 % after four fast swaps: 0.7 ** 4
    assert errors[-1] == pytest.approx((1 - SWAP_TIME_ALPHA) ** 8)


def test_a_negative_duration_counts_as_zero() -> None:
    times = SwapTime()
    times.record(-1.0)
    assert times.ewma == 0.0


# ---- Retry-After --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wait", "expected"),
    [
        (None, 5),  # nothing measured: the class constant
        (float("nan"), 5),
        (0.0, 1),  # at least 1 s
        (0.2, 1),
        (1.0, 1),
        (1.01, 2),  # rounded up
        (39.2, 40),
        (299.5, 300),
        (1000.0, RETRY_AFTER_MAX),  # at most 300 s
    ],
)
def test_retry_after_is_the_wait_rounded_up_and_bounded(wait: float | None, expected: int) -> None:
    assert retry_after_seconds(wait, 5) == expected


def test_a_swap_that_overran_its_ewma_has_a_small_positive_remaining_time() -> None:
    assert remaining_swap_time(40.0, 10.0) == 30.0
    assert remaining_swap_time(40.0, 39.0) == pytest.approx(4.0)  # the floor: a tenth
    assert remaining_swap_time(40.0, 400.0) == pytest.approx(OVERRUN_FRACTION * 40.0)
    assert remaining_swap_time(40.0, -3.0) == 40.0  # a clock that went back: the full EWMA


# ---- the breaker --------------------------------------------------------------------------------


def test_the_breaker_opens_after_n_failures_in_a_row_and_a_success_resets_the_count() -> None:
    policy = BreakerPolicy(failures=3, cooldown=30.0)
    b = Breaker()
    assert not b.failed(policy, 0.0, "one")
    assert not b.failed(policy, 1.0, "two")
    assert not b.succeeded()  # closed already: nothing to report
    assert b.failures == 0
    assert not b.failed(policy, 2.0, "one")
    assert not b.failed(policy, 3.0, "two")
    assert b.failed(policy, 4.0, "three")
    assert (b.phase(4.0), b.open_until, b.reason) == (BreakerPhase.OPEN, 34.0, "three")
    assert b.blocks(33.9) and not b.blocks(34.0)
    assert b.phase(34.0) is BreakerPhase.HALF_OPEN
    assert b.until_half_open(10.0) == 24.0 and b.until_half_open(50.0) == 0.0


def test_each_failed_probe_doubles_the_cooldown_up_to_eight_times() -> None:
    policy = BreakerPolicy(failures=1, cooldown=30.0)
    b = Breaker()
    now = 0.0
    cooldowns = []
    for _ in range(6):
        assert b.failed(policy, now, "down")
        assert b.open_until is not None
        cooldowns.append(b.open_until - now)
        now = b.open_until
        assert b.swap_started(now)  # half-open: this swap is the probe
    assert cooldowns == [30.0, 60.0, 120.0, 240.0, 240.0, 240.0]
    assert b.succeeded()  # the probe succeeded: closed, the growth starts over
    assert b.phase(now) is BreakerPhase.CLOSED and b.openings == 0
    assert b.failed(policy, now, "down") and b.open_until == now + 30.0


def test_a_cancelled_probe_leaves_the_breaker_half_open_for_the_next_swap() -> None:
    policy = BreakerPolicy(failures=1, cooldown=10.0)
    b = Breaker()
    b.failed(policy, 0.0, "down")
    assert not b.swap_started(5.0)  # still open: not a probe (decide never lets one start)
    assert b.swap_started(10.0)
    assert b.probing
    b.cancelled()
    assert (b.probing, b.phase(11.0)) == (False, BreakerPhase.HALF_OPEN)


def test_a_breaker_with_zero_failures_never_opens() -> None:
    policy = BreakerPolicy(failures=0)
    b = Breaker()
    assert not any(b.failed(policy, float(t), "down") for t in range(20))
    assert b.phase(20.0) is BreakerPhase.CLOSED


@pytest.mark.parametrize("kwargs", [{"failures": -1}, {"cooldown": 0.0}, {"cooldown": -5.0}])
def test_a_bad_breaker_policy_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BreakerPolicy(**kwargs)  # type: ignore[arg-type]


# ---- the transitions in state.py ---------------------------------------------------------------


def _swap(state: PoolState, target: str, now: float) -> None:
    swap = new_swap(state, target, now=now, deadline=now + 300.0, hold_start=now)
    begin_swap(state, swap)


def _end(state: PoolState, outcome: SwapOutcome, now: float, error: str = "boom") -> str | None:
    swap = state.swap
    assert swap is not None
    assert end_swap(state, swap, outcome, now=now, error=RuntimeError(error))
    return settle_breaker(state, swap, outcome, now=now)


def test_only_successful_swaps_feed_the_ewma_from_start_to_resident() -> None:
    state = PoolState(members=("a", "b"))
    _swap(state, "a", 100.0)
    _end(state, SwapOutcome.FAILED, 103.0)
    _swap(state, "a", 110.0)
    _end(state, SwapOutcome.CANCELLED, 111.0)
    _swap(state, "a", 120.0)
    _end(state, SwapOutcome.ABANDONED, 420.0)
    assert "a" not in state.swap_times
    _swap(state, "a", 500.0)
    swap = state.swap
    _end(state, SwapOutcome.SUCCESS, 540.0)
    assert state.swap_times["a"].ewma == 40.0
    assert swap is not None and swap.seconds == 40.0


def test_expected_wait_for_resident_swapping_cold_and_unmeasured_members() -> None:
    state = PoolState(members=("a", "b"))
    assert expected_wait(state, "a", 0.0) is None  # nothing measured
    _swap(state, "a", 0.0)
    assert expected_wait(state, "a", 5.0) is None  # swapping, but never measured
    _end(state, SwapOutcome.SUCCESS, 40.0)  # a: 40 s
    assert expected_wait(state, "a", 41.0) == 0.0  # resident
    assert expected_wait(state, "b", 41.0) is None
    _swap(state, "b", 50.0)
    assert expected_wait(state, "a", 55.0) == 40.0  # a swap elsewhere, its time unknown
    _end(state, SwapOutcome.SUCCESS, 60.0)  # b: 10 s
    assert expected_wait(state, "a", 61.0) == 40.0  # cold: a swap would be needed
    _swap(state, "a", 100.0)
    assert expected_wait(state, "a", 110.0) == 30.0  # the rest of the swap in progress
    assert expected_wait(state, "a", 150.0) == pytest.approx(4.0)  # overran: a tenth
    assert expected_wait(state, "b", 110.0) == 40.0 - 10.0 + 10.0  # a's rest, then b's swap


def test_an_open_breaker_fails_fast_after_a_swap_error_and_adds_its_cooldown_to_the_wait() -> None:
    state = PoolState(members=("a", "b"), breaker_policy=BreakerPolicy(failures=2, cooldown=30.0))
    _swap(state, "a", 0.0)
    _end(state, SwapOutcome.SUCCESS, 10.0)  # a: 10 s
    _swap(state, "b", 10.0)
    _end(state, SwapOutcome.SUCCESS, 15.0)  # b resident
    assert _end_after(state, "a", 20.0, SwapOutcome.FAILED) is None
    state.swap_err.clear()  # its waiter took it
    assert _end_after(state, "a", 30.0, SwapOutcome.ABANDONED) == "opened"
    # The waiter of the failure that opened it sees that failure first.
    assert decide(state, "a", "wait", now=31.0) is Decision.SWAP_ERROR
    assert "abandoned" in state.breakers["a"].reason
    state.swap_err.clear()
    assert decide(state, "a", "wait", now=31.0) is Decision.BREAKER_OPEN
    assert decide(state, "a", "wait") is Decision.START_SWAP  # without `now`: not consulted
    assert decide(state, "a", "wait", now=60.0) is Decision.START_SWAP  # half-open: the probe
    assert math.isclose(expected_wait(state, "a", 31.0) or 0.0, 10.0 + 29.0)
    _swap(state, "a", 60.0)
    assert state.swap is not None and state.swap.probe
    assert _end(state, SwapOutcome.SUCCESS, 70.0) == "closed"
    assert decide(state, "a", "wait", now=71.0) is Decision.GRANT
    assert state.swap_times["a"].ewma == pytest.approx(10.0)  # the probe took 10 s too


def test_a_resident_member_is_granted_even_while_its_breaker_is_open() -> None:
    state = PoolState(members=("a", "b"), breaker_policy=BreakerPolicy(failures=1))
    _swap(state, "a", 0.0)
    _end(state, SwapOutcome.FAILED, 1.0)
    state.swap_err.clear()
    assert decide(state, "a", "wait", now=2.0) is Decision.BREAKER_OPEN
    state.resident = "a"  # it came up after all (a reconcile found it Ready)
    assert decide(state, "a", "wait", now=2.0) is Decision.GRANT


def _end_after(state: PoolState, target: str, now: float, outcome: SwapOutcome) -> str | None:
    _swap(state, target, now - 1.0)
    return _end(state, outcome, now)
