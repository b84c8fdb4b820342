"""The warmup rule as pure logic: streaks, resets, zero, and the deadline-first wake-up."""

from __future__ import annotations

import pytest

from stargate.config import WarmupConfig
from stargate.warmup import PromotionReason, StabilizationStreak, WarmupSchedule


def test_streak_promotes_after_exactly_window_equal_nonzero_samples() -> None:
    streak = StabilizationStreak(3)
    assert [streak.observe(4) for _ in range(3)] == [False, False, True]
    assert streak.length == 3


def test_streak_resets_on_change_and_the_new_value_starts_at_one() -> None:
    streak = StabilizationStreak(3)
    streak.observe(2)
    streak.observe(2)
    assert not streak.observe(3)
    assert streak.length == 1
    assert not streak.observe(3)
    assert streak.observe(3)


@pytest.mark.parametrize("counts", [(4, 3, 3), (5, 4, 4), (2, 1, 1), (4, 4, 3, 3)])
def test_a_falling_count_restarts_the_streak_too(counts: tuple[int, ...]) -> None:
    """A backend leaving (4, then 3) is a change like one arriving: only equal samples extend the
    streak. (A rule written as "not more than the last" passed every rising-count test.)"""
    streak = StabilizationStreak(3)
    assert not any(streak.observe(count) for count in counts)
    assert streak.length == 2
    assert streak.observe(counts[-1])


def test_zero_never_promotes_and_resets_the_streak() -> None:
    streak = StabilizationStreak(2)
    assert not any(streak.observe(0) for _ in range(10))
    assert streak.length == 0
    streak.observe(5)
    assert not streak.observe(0)
    assert streak.length == 0
    assert not streak.observe(5)  # the streak restarted: 5 counts as one again
    assert streak.observe(5)


def test_window_of_one_promotes_on_first_nonzero_sample() -> None:
    streak = StabilizationStreak(1)
    assert not streak.observe(0)
    assert streak.observe(1)


def test_streak_rejects_zero_window() -> None:
    with pytest.raises(ValueError):
        StabilizationStreak(0)


def _schedule(warmup_ms: int = 10_000, interval_ms: int = 1_000, window: int = 3) -> WarmupSchedule:
    return WarmupSchedule(WarmupConfig(warmup_ms, interval_ms, window), started_at=100.0)


def test_first_sample_is_one_interval_after_start() -> None:
    schedule = _schedule()
    assert schedule.next_wake() == 101.0


def test_early_wake_takes_no_sample() -> None:
    schedule = _schedule()
    reads: list[int] = []
    outcome = schedule.wake(100.5, lambda: reads.append(1) or 1)
    assert outcome.promotion is None and outcome.sampled is None
    assert reads == []


def test_samples_until_stable_then_promotes_as_stabilized() -> None:
    schedule = _schedule(window=3)
    outcomes = []
    for _ in range(3):
        outcomes.append(schedule.wake(schedule.next_wake(), lambda: 7))
    assert [o.promotion for o in outcomes] == [None, None, PromotionReason.STABILIZED]
    assert [o.streak for o in outcomes] == [1, 2, 3]
    assert schedule.samples_taken == 3


def test_deadline_is_checked_first_and_skips_the_sample() -> None:
    schedule = _schedule(warmup_ms=3_000, window=3)
    # Two stable samples, then the third wake-up coincides with the deadline: the deadline wins
    # and the count is not even read.
    schedule.wake(101.0, lambda: 2)
    schedule.wake(102.0, lambda: 2)
    assert schedule.next_wake() == 103.0

    def must_not_read() -> int:
        raise AssertionError("the deadline must be checked before sampling")

    outcome = schedule.wake(103.0, must_not_read)
    assert outcome.promotion is PromotionReason.DEADLINE
    assert outcome.sampled is None


def test_deadline_promotes_with_zero_backends() -> None:
    schedule = _schedule(warmup_ms=2_500)
    now = 100.0
    reasons = []
    while True:
        now = schedule.next_wake()
        outcome = schedule.wake(now, lambda: 0)
        reasons.append(outcome.promotion)
        if outcome.promotion is not None:
            break
    assert now == 102.5
    assert reasons == [None, None, PromotionReason.DEADLINE]


def test_late_wake_delays_the_next_sample_instead_of_bursting() -> None:
    schedule = _schedule()
    schedule.wake(104.2, lambda: 1)  # woke 3.2 s late
    assert schedule.next_wake() == pytest.approx(105.2)


def test_next_wake_never_passes_the_deadline() -> None:
    schedule = _schedule(warmup_ms=500, interval_ms=1_000)
    assert schedule.next_wake() == 100.5


def test_schedule_requires_enabled_warmup() -> None:
    with pytest.raises(ValueError):
        WarmupSchedule(WarmupConfig(warmup_ms=0), started_at=0.0)
