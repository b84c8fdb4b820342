"""The pure part of the activator: per-pool state and every decision, with no I/O and no trio.

`pool.py` owns the locking, the tasks and the controller calls; each of its locked sections reads
this state, asks one of the functions below what to do, and applies the answer. Keeping the
decisions here lets them be tested without an event loop (docs/activator.md, "Acquire" to "Deferred
deactivate", and "The #1837 fix").
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "Decision",
    "Mode",
    "PoolState",
    "SwapOutcome",
    "SwapState",
    "classify_swap_end",
    "cleanup_after_acquire",
    "deactivate_skip_reason",
    "decide",
    "forget_on_ownership_gain",
    "forget_on_ownership_loss",
    "is_idle",
    "reconcile_resident",
    "resolve_hold_budget",
    "resolve_swap_deadline",
]

Mode = Literal["wait", "if_idle"]
CancelReason = Literal["cancelled", "deadline"]


@dataclass(slots=True)
class SwapState:
    """The swap in flight. `gen` identifies it (docs/activator.md, F2): only the task started with
    this object may
    clear it, and a deferred deactivate compares its captured generation against `gen`."""

    gen: int
    target: str
    incumbent: str | None
    started_at: float
    deadline: float
    hold_start: float  # the starting waiter's hold start (for hold_duration_seconds)
    # Why the swap scope was cancelled, first cause wins (docs/activator.md, Swap). None while not
    # cancelled; a scope that caught its own deadline with no recorded reason ended by "deadline".
    cancel_reason: CancelReason | None = None


@dataclass(slots=True)
class PoolState:
    """Everything the activator believes about one pool (docs/activator.md, State)."""

    members: tuple[str, ...]
    resident: str | None = None
    resident_checked_at: float | None = None  # None: re-verify on the next acquire
    swap: SwapState | None = None
    swap_gen: int = 0
    swap_err: dict[str, tuple[str, str]] = field(default_factory=dict)  # member -> (msg, reason)
    inflight: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    # Deferred deactivates scheduled and not yet checked: member -> generation captured by the
    # latest cleanup that asked for it (at most one task per member; see `cleanup_after_acquire`).
    pending_deactivate: dict[str, int] = field(default_factory=dict)

    @property
    def swapping(self) -> bool:
        return self.swap is not None

    def held(self) -> int:
        return sum(self.waiting.values())


class Decision(enum.Enum):
    """What one pass of the acquire loop does (docs/activator.md, Acquire, step 3)."""

    SWAP_ERROR = "swap_error"  # consume swap_err[m] and raise it
    GRANT = "grant"  # fast path: inflight[m]++
    START_SWAP = "start_swap"  # start a swap toward m, then wait
    BUSY = "busy"  # if_idle and the incumbent is busy: raise at once
    WAIT = "wait"  # sleep on the change event


def decide(state: PoolState, member: str, mode: Mode) -> Decision:
    """One pass of the acquire loop, lock held."""
    if member in state.swap_err:
        return Decision.SWAP_ERROR
    if state.swap is None:
        if state.resident == member:
            return Decision.GRANT
        incumbent = state.resident
        if incumbent is None or state.inflight.get(incumbent, 0) == 0:
            return Decision.START_SWAP
        if mode == "if_idle":
            return Decision.BUSY
    return Decision.WAIT


def reconcile_resident(
    state: PoolState, is_available: Callable[[str], bool], now: float, resync_interval: float
) -> bool:
    """Re-verify the resident belief at most every `resync_interval` (docs/activator.md, Reconcile).

    Availability is the routing state's (docs/decisions.md, D7), an in-memory read, so unlike
    upstream no API call happens under the lock and no read can fail. Returns True when the
    resident gauge should be republished (the belief was re-derived).
    """
    if state.swap is not None:
        return False  # the swap owns residency
    checked = state.resident_checked_at
    if checked is not None and now - checked < resync_interval:
        return False
    state.resident_checked_at = now
    if state.resident is not None and is_available(state.resident):
        return False
    state.resident = next((m for m in state.members if is_available(m)), None)
    return True


def cleanup_after_acquire(state: PoolState, member: str) -> tuple[bool, int | None]:
    """The deferred cleanup of every acquire exit (docs/activator.md, Acquire, step 4),
    waiting already decremented.

    Returns (cancel the swap toward `member`, generation to schedule a deferred deactivate
    against, or None).
    """
    if state.waiting.get(member, 0) > 0 or state.resident == member:
        return False, None
    swap = state.swap
    cancel = swap is not None and swap.target == member
    return cancel, state.swap_gen


def deactivate_skip_reason(state: PoolState, member: str, gen: int) -> str | None:
    """F1 (docs/activator.md, Deferred deactivate): why the deferred deactivate of `member` must not
    patch, or None.

    A swap toward `member` with the *same* generation is the cancelled swap still unwinding: it
    does not block the deactivate (intended upstream).
    """
    if state.waiting.get(member, 0) > 0:
        return "waiter"
    if state.resident == member:
        return "resident"
    swap = state.swap
    if swap is not None and swap.target == member and swap.gen != gen:
        return "newer_swap"
    return None


def forget_on_ownership_loss(state: PoolState) -> SwapState | None:
    """This replica stopped owning the pool (docs/pool-ownership.md, "The activator with an
    owner"): drop every decision in progress without calling the controller, since the next owner
    decides now. Returns the swap that was running, whose task the caller cancels.

    The swap state is cleared here, not by its task, so the task finds itself superseded (F2) and
    only notifies. Pending deferred deactivates are forgotten (their tasks find nothing to do);
    one-shot swap errors are the old owner's. The resident belief is dropped: a replica that does
    not decide has none, so the `resident` gauge summed over the fleet is the owner's. Waiting and
    in-flight counts stay: they are this replica's requests, still real.
    """
    swap = state.swap
    state.swap = None
    state.pending_deactivate.clear()
    state.swap_err.clear()
    state.resident = None
    state.resident_checked_at = None
    return swap


def forget_on_ownership_gain(state: PoolState) -> None:
    """This replica became the pool's owner: whatever it believed about residency may be stale
    (another replica swapped meanwhile), so the next acquire re-derives it from the members'
    availability, as the self-heal path does (docs/activator.md, Reconcile)."""
    state.resident_checked_at = None
    state.swap_err.clear()


def is_idle(state: PoolState) -> bool:
    """Nothing waiting, nothing in flight, no swap and no deferred deactivate still to run: an
    owner may hand the pool over without cutting a decision short."""
    return (
        not state.waiting
        and not state.inflight
        and state.swap is None
        and not state.pending_deactivate
    )


class SwapOutcome(enum.Enum):
    SUCCESS = "success"
    CANCELLED = "cancelled"  # quiet (docs/activator.md, F5)
    ABANDONED = "abandoned"  # deadline (docs/activator.md, F4)
    FAILED = "failed"  # any other error


def classify_swap_end(*, errored: bool, cancel_called: bool, swap: SwapState) -> SwapOutcome:
    """Decide a finished swap's outcome from the *scope's* state, not the error type.

    docs/activator.md, Swap.

    `errored` is True when the controller raised or the scope caught a cancellation. A swap that
    finished without error is a success even past its deadline.
    """
    if not errored:
        return SwapOutcome.SUCCESS
    if cancel_called:
        reason = swap.cancel_reason or "deadline"
        return SwapOutcome.CANCELLED if reason == "cancelled" else SwapOutcome.ABANDONED
    return SwapOutcome.FAILED


def resolve_swap_deadline(swap_budget: float | None, response_header_timeout: float) -> float:
    """F3 (docs/activator.md): the swap budget if > 0, else 2 x the configured response-header
    timeout.

    Deviation (docs/decisions.md, D16): upstream's fallback is a constant 240 s (2 x the *default*).
    """
    if swap_budget is not None and swap_budget > 0:
        return swap_budget
    return 2 * response_header_timeout


def resolve_hold_budget(
    hold_budget: float | None, swap_budget: float | None, response_header_timeout: float
) -> float:
    """How long one acquire may wait: the pool's hold budget, else its swap budget, else the
    response-header timeout (docs/activator.md, Budgets;
    `hold_budget` is a stargate addition)."""
    for value in (hold_budget, swap_budget):
        if value is not None and value > 0:
            return value
    return response_header_timeout
