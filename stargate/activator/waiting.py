"""Measured waiting: how long a member's swaps take (an EWMA per member), the `Retry-After` a
pool 503 carries, and a breaker per member that stops starting swaps doomed to fail. Pure: no
I/O, no trio; the times are passed in (docs/activator.md, "Measured waiting").

Why here and not in `state.py`: these are small value types with their own rules (smoothing,
rounding, cooldown growth); `state.py` keeps one instance of each per member in `PoolState` and
calls them from its transitions (`end_swap`, `begin_swap`, `settle_breaker`), so every change of
a pool's state still goes through `state.py`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = [
    "BREAKER_COOLDOWN_GROWTH_CAP",
    "BREAKER_GAUGE",
    "OVERRUN_FRACTION",
    "RETRY_AFTER_MAX",
    "RETRY_AFTER_MIN",
    "SWAP_TIME_ALPHA",
    "Breaker",
    "BreakerPhase",
    "BreakerPolicy",
    "SwapTime",
    "remaining_swap_time",
    "retry_after_seconds",
]

SWAP_TIME_ALPHA = 0.3
"""The EWMA's weight of the newest swap. A member's swap time is mostly its model's load time, so
it is stable, but the first load after a node starts reads the weights from disk and later ones
often from the page cache. 0.3 forgets an old figure with a half-life of about two swaps
(0.7 ** 2 ~ 0.5), so the estimate follows such a shift within three or four swaps, while one
outlier (a swap twice as slow) moves it by 30 %, not 100 %."""

RETRY_AFTER_MIN = 1
"""The smallest computed `Retry-After` (seconds): 0 would invite a retry storm."""

RETRY_AFTER_MAX = 300
"""The largest computed `Retry-After` (seconds): the default `swapBudget`. A swap slower than that
is abandoned anyway, so a client told to come back later than that learns nothing more."""

OVERRUN_FRACTION = 0.1
"""A swap that has already run past its EWMA is late by an unknown amount: its expected remaining
time is then a tenth of the EWMA (never 0), so clients come back soon but not at once."""

BREAKER_COOLDOWN_GROWTH_CAP = 8
"""A breaker's cooldown doubles with each opening in a row (failed probes) up to 8 x the
configured cooldown: 30, 60, 120, 240, 240 ... s with the default 30 s."""


@dataclass(slots=True)
class SwapTime:
    """The EWMA of one member's successful swap durations (start to resident). The first
    measurement seeds it; `samples` counts the measurements."""

    ewma: float = 0.0
    samples: int = 0

    def record(self, seconds: float, alpha: float = SWAP_TIME_ALPHA) -> None:
        seconds = max(0.0, seconds)
        if self.samples == 0:
            self.ewma = seconds
        else:
            self.ewma += alpha * (seconds - self.ewma)
        self.samples += 1


def remaining_swap_time(ewma: float, elapsed: float) -> float:
    """The expected remaining time of a swap that started `elapsed` seconds ago: the EWMA's rest,
    or `OVERRUN_FRACTION` of the EWMA once it overran (never negative, never 0 unless the EWMA
    is 0)."""
    return max(ewma - max(0.0, elapsed), OVERRUN_FRACTION * ewma)


def retry_after_seconds(wait: float | None, fallback: int) -> int:
    """`Retry-After` for an expected wait: rounded up to whole seconds, within `RETRY_AFTER_MIN`
    and `RETRY_AFTER_MAX`; `fallback` (the error class's constant) when nothing is measured."""
    if wait is None or math.isnan(wait):
        return fallback
    return max(RETRY_AFTER_MIN, min(RETRY_AFTER_MAX, math.ceil(wait)))


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """When a member's breaker opens: after `failures` consecutive failed swaps (0: never), for
    `cooldown` seconds, doubled per opening in a row up to `BREAKER_COOLDOWN_GROWTH_CAP` x."""

    failures: int = 3
    cooldown: float = 30.0

    def __post_init__(self) -> None:
        if self.failures < 0:
            raise ValueError("breaker failures must be >= 0 (0: off)")
        if self.cooldown <= 0:
            raise ValueError("breaker cooldown must be > 0")

    @property
    def enabled(self) -> bool:
        return self.failures > 0

    def cooldown_for(self, openings: int) -> float:
        """The cooldown of the `openings`-th opening in a row (1 for the first)."""
        factor: int = min(2 ** max(0, openings - 1), BREAKER_COOLDOWN_GROWTH_CAP)
        return self.cooldown * factor


class BreakerPhase(enum.Enum):
    CLOSED = "closed"  # swaps start as usual
    OPEN = "open"  # acquire fails fast, no swap starts
    HALF_OPEN = "half_open"  # cooldown over: the next swap is the probe (or one runs)


# The `llmkube_modelpool_breaker_state` gauge's values, by severity.
BREAKER_GAUGE = {BreakerPhase.CLOSED: 0, BreakerPhase.HALF_OPEN: 1, BreakerPhase.OPEN: 2}


@dataclass(slots=True)
class Breaker:
    """One member's breaker. `open_until` None: closed; else open until then and half-open after.
    `failures`: failed swaps in a row; `openings`: openings in a row since it last closed;
    `probing`: the probe swap runs; `reason`: the last failure's message."""

    failures: int = 0
    openings: int = 0
    open_until: float | None = None
    probing: bool = False
    reason: str = ""

    def phase(self, now: float) -> BreakerPhase:
        if self.open_until is None:
            return BreakerPhase.CLOSED
        if now < self.open_until:
            return BreakerPhase.OPEN
        return BreakerPhase.HALF_OPEN

    def blocks(self, now: float) -> bool:
        """Open: `acquire` for the member must fail fast."""
        return self.open_until is not None and now < self.open_until

    def until_half_open(self, now: float) -> float:
        return 0.0 if self.open_until is None else max(0.0, self.open_until - now)

    def swap_started(self, now: float) -> bool:
        """A swap toward the member started; True when it is the half-open probe."""
        self.probing = self.phase(now) is BreakerPhase.HALF_OPEN
        return self.probing

    def succeeded(self) -> bool:
        """A swap to the member succeeded: close. True when it was open or half-open."""
        was_open = self.open_until is not None
        self.failures = 0
        self.openings = 0
        self.open_until = None
        self.probing = False
        return was_open

    def failed(self, policy: BreakerPolicy, now: float, reason: str) -> bool:
        """A swap to the member failed or was abandoned. True when the breaker opens now: the
        `policy.failures`-th failure in a row, or any failure once it was open (a failed probe)."""
        self.failures += 1
        self.reason = reason
        self.probing = False
        if not policy.enabled:
            return False
        if self.open_until is None and self.failures < policy.failures:
            return False
        self.openings += 1
        self.open_until = now + policy.cooldown_for(self.openings)
        return True

    def cancelled(self) -> None:
        """The swap was cancelled (its last waiter left): no verdict; the next swap probes."""
        self.probing = False
