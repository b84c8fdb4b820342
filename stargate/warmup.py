"""The warmup decision as pure logic: no clock, no I/O, no trio.

The readiness sampler (`stargate.readiness`) owns time and the routing state; this module only
answers "given that it is now `now` and the backend count reads `n`, is warmup over, and why?".
Keeping it pure lets the rules of docs/decisions.md, D2 be tested exhaustively without a loop:

* the first sample is taken one interval after warmup starts;
* on every wake-up the deadline is checked first, and reaching it promotes even with zero
  backends or a count that never settles;
* otherwise a sample is taken; the replica is promoted once the last `window` samples are equal
  and nonzero. A change, or a zero, restarts the streak.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from stargate.config import WarmupConfig

__all__ = ["PromotionReason", "StabilizationStreak", "WakeOutcome", "WarmupSchedule"]


class PromotionReason(enum.Enum):
    """Why warmup ended. The value is the `reason` label of the promotions metric."""

    STABILIZED = "stabilized"
    DEADLINE = "deadline"
    DISABLED = "disabled"
    SHUTDOWN = "shutdown"


class StabilizationStreak:
    """Counts how many consecutive samples ended on the same nonzero backend count."""

    def __init__(self, window: int) -> None:
        if window <= 0:
            raise ValueError("stabilization window must be greater than 0")
        self.window = window
        self.length = 0
        self._last: int | None = None

    def observe(self, count: int) -> bool:
        """Record one sample; return True once the streak has reached the window."""
        if count <= 0:
            self.length = 0
        elif count == self._last:
            self.length += 1
        else:
            self.length = 1
        self._last = count
        return self.length >= self.window


@dataclass(frozen=True, slots=True)
class WakeOutcome:
    """What one wake-up of the sampler decided.

    `sampled` is the backend count read on this wake-up, or None when no sample was taken (the
    deadline won, or the wake-up came before the next sample was due).
    """

    promotion: PromotionReason | None
    sampled: int | None
    streak: int


class WarmupSchedule:
    """When the sampler should wake next and what each wake-up decides.

    Sampling uses "delay" semantics: the next sample is due one interval after the previous one was
    actually taken, so a late wake-up never produces a burst of catch-up samples that would
    complete a streak faster than the configured window of time.
    """

    def __init__(self, config: WarmupConfig, started_at: float) -> None:
        if not config.enabled:
            raise ValueError("a warmup schedule needs a nonzero warmup")
        self.started_at = started_at
        self.deadline = started_at + config.warmup_seconds
        self._interval = config.sample_interval_seconds
        self.next_sample_at = started_at + self._interval
        self.streak = StabilizationStreak(config.stabilization_window)
        self.samples_taken = 0

    def next_wake(self) -> float:
        return min(self.next_sample_at, self.deadline)

    def wake(self, now: float, read_count: Callable[[], int]) -> WakeOutcome:
        """Decide at time `now`; `read_count` is called only if a sample is due."""
        if now >= self.deadline:
            return WakeOutcome(PromotionReason.DEADLINE, None, self.streak.length)
        if now < self.next_sample_at:
            return WakeOutcome(None, None, self.streak.length)
        count = read_count()
        self.samples_taken += 1
        self.next_sample_at = now + self._interval
        stable = self.streak.observe(count)
        return WakeOutcome(
            PromotionReason.STABILIZED if stable else None, count, self.streak.length
        )
