"""The pure core of the activator: one pool's state, every decision and every state change, with
no I/O and no trio.

Like h11's state machine, this file owns every change to a pool's state: `pool.py` (the driver)
keeps the locks, the tasks and their awaits, the controller calls, the timers and the metrics, and
never assigns a `PoolState` or `SwapState` field itself. Each of its locked sections reads this
state, calls one of the transitions below with the event's inputs (the time, an outcome,
ownership), and does what the answer says. So every transition can be tested with plain values,
without an event loop (tests/unit/activator/test_state.py; docs/activator.md, "Acquire" to
"Deferred deactivate", and "The #1837 fix").

The transitions, by event (each documents its contract):

* a request: `add_waiter`, then per pass `decide` and one of `take_swap_error`, `count_grant`
  or `new_swap` + `begin_swap`; on every exit `remove_waiter`; at the end of its response
  `release_grant`;
* a swap: `new_swap`, `begin_swap`, `request_swap_cancel`, `end_swap`, `rederive_resident`;
* residency: `reconcile_resident`, `invalidate_resident`;
* the deferred deactivate: `request_deactivate`, `record_deactivate_task`, `claim_deactivate`
  (whose re-check is `deactivate_skip_reason`);
* ownership and lifetime: `forget_on_ownership_gain`, `forget_on_ownership_change`,
  `forget_on_ownership_loss`, `forget_on_stop`;
* measured waiting (docs/activator.md, "Measured waiting"): `end_swap` feeds the member's
  swap-time EWMA, `begin_swap` marks a breaker probe, `settle_breaker` opens or closes the
  member's breaker, `decide` fails fast while it is open; `expected_wait` reads the estimate.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from stargate.activator.waiting import (
    Breaker,
    BreakerPolicy,
    SwapTime,
    remaining_swap_time,
)

__all__ = [
    "Decision",
    "Mode",
    "PoolState",
    "SwapOutcome",
    "SwapState",
    "add_waiter",
    "begin_swap",
    "claim_deactivate",
    "classify_swap_end",
    "cleanup_after_acquire",
    "count_grant",
    "deactivate_skip_reason",
    "decide",
    "end_swap",
    "expected_wait",
    "forget_on_ownership_change",
    "forget_on_ownership_gain",
    "forget_on_ownership_loss",
    "forget_on_stop",
    "invalidate_resident",
    "is_idle",
    "new_swap",
    "reconcile_resident",
    "record_deactivate_task",
    "rederive_resident",
    "release_grant",
    "remove_waiter",
    "request_deactivate",
    "request_swap_cancel",
    "resolve_hold_budget",
    "resolve_swap_deadline",
    "settle_breaker",
    "take_swap_error",
]

Mode = Literal["wait", "if_idle"]
CancelReason = Literal["cancelled", "deadline"]


@dataclass(slots=True)
class SwapState:
    """The swap in flight. `gen` identifies it (docs/activator.md, F2): its task's `end_swap`
    touches the state only while this object is still the current swap (ownership loss and the
    activator stopping drop it first), and a deferred deactivate compares its captured generation
    against `gen`."""

    gen: int
    target: str
    incumbent: str | None
    started_at: float
    deadline: float
    hold_start: float  # the starting waiter's hold start (for hold_duration_seconds)
    # Why the swap scope was cancelled, first cause wins (docs/activator.md, Swap). None while not
    # cancelled; a scope that caught its own deadline with no recorded reason ended by "deadline".
    cancel_reason: CancelReason | None = None
    ended_at: float | None = None  # set by a successful `end_swap`: the target became resident
    probe: bool = False  # the half-open probe of the target's breaker (`begin_swap`)

    @property
    def seconds(self) -> float:
        """How long the swap took to make its target resident; 0.0 until it has."""
        return 0.0 if self.ended_at is None else self.ended_at - self.started_at


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
    # latest cleanup that asked for it (at most one task per member; see `request_deactivate`).
    pending_deactivate: dict[str, int] = field(default_factory=dict)
    # Counters for tests and the debugging snapshot.
    swaps_started: int = 0
    deactivates_skipped: int = 0
    # Measured waiting (stargate/activator/waiting.py): per member, created on first use.
    swap_times: dict[str, SwapTime] = field(default_factory=dict)
    breakers: dict[str, Breaker] = field(default_factory=dict)
    breaker_policy: BreakerPolicy = field(default_factory=BreakerPolicy)

    def breaker(self, member: str) -> Breaker:
        breaker = self.breakers.get(member)
        if breaker is None:
            breaker = self.breakers[member] = Breaker()
        return breaker

    @property
    def swapping(self) -> bool:
        return self.swap is not None

    def held(self) -> int:
        return sum(self.waiting.values())


# ---- acquire ----------------------------------------------------------------------------------


class Decision(enum.Enum):
    """What one pass of the acquire loop does (docs/activator.md, Acquire, step 3)."""

    SWAP_ERROR = "swap_error"  # `take_swap_error` and raise it
    GRANT = "grant"  # fast path: `count_grant`
    START_SWAP = "start_swap"  # start a swap toward m (`new_swap`, `begin_swap`), then wait
    BUSY = "busy"  # if_idle and the incumbent is busy: raise at once
    QUEUE_FULL = "queue_full"  # the first pass found `max_held` others held: raise at once
    BREAKER_OPEN = "breaker_open"  # the member's breaker is open: raise at once, start nothing
    WAIT = "wait"  # sleep on the change event


def add_waiter(state: PoolState, member: str) -> None:
    """A request entered `acquire` for `member` (docs/activator.md, Acquire, step 2): count it as
    a waiter. Every call is paired with one `remove_waiter`."""
    state.waiting[member] = state.waiting.get(member, 0) + 1


def decide(
    state: PoolState,
    member: str,
    mode: Mode,
    *,
    max_held: int | None = None,
    now: float | None = None,
) -> Decision:
    """One pass of the acquire loop, lock held; reads only.

    `max_held`: the pool's bound on held requests, passed on the caller's first pass only (the
    caller is already counted as a waiter): a caller that would wait or start a swap beyond it
    gets `QUEUE_FULL` instead, while a swap error, a grant and a busy answer come first.

    `now` (None: breakers are not consulted): a member whose breaker is open gets
    `BREAKER_OPEN` unless it is granted on the fast path (it is resident after all); a swap error
    still comes first, so the waiter of the failure that opened it sees that failure.
    """
    if member in state.swap_err:
        return Decision.SWAP_ERROR
    decision = Decision.WAIT
    if state.swap is None and state.resident == member:
        return Decision.GRANT
    if now is not None:
        breaker = state.breakers.get(member)
        if breaker is not None and breaker.blocks(now):
            return Decision.BREAKER_OPEN
    if state.swap is None:
        if not in_flight_elsewhere(state, member):
            decision = Decision.START_SWAP
        elif mode == "if_idle":
            return Decision.BUSY
    if max_held is not None and state.held() - 1 >= max_held:
        return Decision.QUEUE_FULL
    return decision


def in_flight_elsewhere(state: PoolState, member: str) -> bool:
    """A grant is in flight on a member other than `member`: a swap to `member` would scale it
    down (a controller's `activate` stops every other member), so it must wait ("drain before
    swap"). Every member counts, not only the believed resident: after an ownership change the
    belief is dropped (`forget_on_ownership_loss`) while the grants it covered are still in
    flight, and a swap decided from "no resident" once scaled such a member down under its
    requests (the shared-pool soak, tests/unit/activator/test_shared_pools.py)."""
    return any(count > 0 for other, count in state.inflight.items() if other != member)


def take_swap_error(state: PoolState, member: str) -> tuple[str, str]:
    """`Decision.SWAP_ERROR`: consume `member`'s one-shot swap error, (message, reason). Only the
    waiter that takes it sees it; the others start a fresh swap (docs/activator.md, "Behaviours
    kept on purpose"). KeyError if there is none."""
    return state.swap_err.pop(member)


def count_grant(state: PoolState, member: str) -> None:
    """`Decision.GRANT`: one more request in flight on `member`, until its `release_grant`."""
    state.inflight[member] = state.inflight.get(member, 0) + 1


def release_grant(state: PoolState, member: str) -> bool:
    """A grant's response ended (docs/activator.md, Acquire, step 5). Never goes below zero.
    Returns True when nothing is in flight on `member` any more: the driver notifies, so a waiter
    for another member can swap."""
    inflight = state.inflight.get(member, 0)
    if inflight > 0:
        inflight -= 1
        state.inflight[member] = inflight
    if inflight == 0:
        state.inflight.pop(member, None)
        return True
    return False


def cleanup_after_acquire(state: PoolState, member: str) -> tuple[bool, int | None]:
    """The decision of `remove_waiter`, reads only (waiting already decremented).

    Returns (cancel the swap toward `member`, generation to schedule a deferred deactivate
    against, or None).
    """
    if state.waiting.get(member, 0) > 0 or state.resident == member:
        return False, None
    swap = state.swap
    cancel = swap is not None and swap.target == member
    return cancel, state.swap_gen


def remove_waiter(state: PoolState, member: str) -> tuple[bool, int | None]:
    """Every acquire exit (docs/activator.md, Acquire, step 4): stop counting the waiter, then
    decide as `cleanup_after_acquire`. If it was `member`'s last waiter and `member` is not
    resident, the driver cancels a swap toward it (`request_swap_cancel`, when the first value is
    True) and, with the generation of the second, schedules its deferred deactivate
    (`request_deactivate`). Never asks for a notification."""
    remaining = state.waiting.get(member, 0) - 1
    if remaining > 0:
        state.waiting[member] = remaining
    else:
        state.waiting.pop(member, None)
    return cleanup_after_acquire(state, member)


# ---- swaps ------------------------------------------------------------------------------------


def new_swap(
    state: PoolState, target: str, *, now: float, deadline: float, hold_start: float
) -> SwapState:
    """`Decision.START_SWAP`: the swap to start toward `target`, from the resident, with the next
    generation; reads only. The driver spawns its task, then applies it with `begin_swap` (so a
    swap whose task could not start never enters the state)."""
    return SwapState(
        gen=state.swap_gen + 1,
        target=target,
        incumbent=state.resident,
        started_at=now,
        deadline=deadline,
        hold_start=hold_start,
    )


def begin_swap(state: PoolState, swap: SwapState) -> bool:
    """A swap's task was started (docs/activator.md, Swap): it owns the state from now on (the fast
    path closes), its generation is current, and the target's old swap error is cleared. The
    driver notifies. Returns True when the swap is the half-open probe of the target's breaker
    (`decide` only lets a swap start toward a member whose breaker is closed or half-open)."""
    state.swap_gen = swap.gen
    state.swap = swap
    state.swaps_started += 1
    state.swap_err.pop(swap.target, None)
    breaker = state.breakers.get(swap.target)
    swap.probe = breaker is not None and breaker.swap_started(swap.started_at)
    return swap.probe


def request_swap_cancel(state: PoolState, *, now: float) -> bool:
    """The last waiter for the swap's target left (cancel-on-timeout): record why the swap is
    cancelled, first cause wins (docs/activator.md, Swap): at or past its deadline it already
    ended by "deadline", else "cancelled". Returns True when a swap runs, whose scope the driver
    then cancels; False when none does."""
    swap = state.swap
    if swap is None:
        return False
    if swap.cancel_reason is None:
        swap.cancel_reason = "deadline" if now >= swap.deadline else "cancelled"
    return True


def end_swap(
    state: PoolState,
    swap: SwapState,
    outcome: SwapOutcome,
    *,
    now: float,
    error: BaseException | None = None,
) -> bool:
    """A swap's task finished with `outcome` (`classify_swap_end`), lock held (docs/activator.md,
    Swap). Returns False, touching nothing, when `swap` is no longer the current one (F2).

    Otherwise the swap state is cleared and: SUCCESS makes the target resident, checked `now`,
    and feeds the target's swap-time EWMA with `now - started_at`; CANCELLED changes nothing else
    (F5: the deferred deactivate scales it down); ABANDONED (F4) and FAILED leave a one-shot swap
    error for the target's next waiter. For those two the driver then logs and counts the
    failure, deactivates an abandoned target under the lock, and calls `rederive_resident`. The
    driver then calls `settle_breaker` for every outcome.
    """
    if state.swap is not swap:
        return False
    state.swap = None
    target = swap.target
    if outcome is SwapOutcome.SUCCESS:
        state.resident = target
        state.resident_checked_at = now
        swap.ended_at = now
        times = state.swap_times.get(target)
        if times is None:
            times = state.swap_times[target] = SwapTime()
        times.record(now - swap.started_at)
    elif outcome is SwapOutcome.ABANDONED:
        state.swap_err[target] = (
            f"model pool swap to member {target} abandoned after {now - swap.started_at:.3f}s; "
            "target never became resident",
            "deadline",
        )
    elif outcome is SwapOutcome.FAILED:
        state.swap_err[target] = (f"model pool swap failed for member {target}: {error}", "error")
    return True


BreakerChange = Literal["opened", "closed"]


def settle_breaker(
    state: PoolState, swap: SwapState, outcome: SwapOutcome, *, now: float
) -> BreakerChange | None:
    """After `end_swap` returned True: the target's breaker learns the outcome
    (docs/activator.md, "Breaker"). SUCCESS closes it; FAILED and ABANDONED count a failure,
    with the swap error's message as the reason, and open it after `breaker_policy.failures` in a
    row (or at once after a failed probe, with a longer cooldown); CANCELLED gives no verdict.
    Returns "opened" or "closed" when the breaker changed so (the driver logs and counts it)."""
    target = swap.target
    if outcome is SwapOutcome.SUCCESS:
        breaker = state.breakers.get(target)
        return "closed" if breaker is not None and breaker.succeeded() else None
    if outcome is SwapOutcome.CANCELLED:
        breaker = state.breakers.get(target)
        if breaker is not None:
            breaker.cancelled()
        return None
    message, _ = state.swap_err.get(target, (f"model pool swap to member {target} failed", ""))
    opened = state.breaker(target).failed(state.breaker_policy, now, message)
    return "opened" if opened else None


def expected_wait(state: PoolState, member: str, now: float) -> float | None:
    """Seconds a request for `member` is expected to wait now for it to be resident; reads only,
    O(1) (docs/activator.md, "Measured waiting").

    0.0 when it is resident and no swap runs. A swap toward it: the rest of its EWMA
    (`remaining_swap_time`: a tenth of the EWMA once it overran). A swap toward another member:
    that swap's rest (when that member is measured) plus `member`'s EWMA. Otherwise `member`'s
    EWMA (a swap would be needed; a busy incumbent's drain is not counted). An open breaker adds
    the time until it half-opens. None when `member`'s swaps were never measured (and it is not
    resident).
    """
    swap = state.swap
    if swap is None and state.resident == member:
        return 0.0
    times = state.swap_times.get(member)
    if times is None or times.samples == 0:
        return None
    if swap is not None and swap.target == member:
        return remaining_swap_time(times.ewma, now - swap.started_at)
    wait = times.ewma
    if swap is not None:
        other = state.swap_times.get(swap.target)
        if other is not None and other.samples > 0:
            wait += remaining_swap_time(other.ewma, now - swap.started_at)
    breaker = state.breakers.get(member)
    if breaker is not None:
        wait += breaker.until_half_open(now)
    return wait


def rederive_resident(
    state: PoolState, is_available: Callable[[str], bool], now: float, resync_interval: float
) -> bool:
    """After a failed or abandoned swap: the controller may have stopped the incumbent while
    starting the target (a pool with the `process` controller does), so re-derive who is resident
    now, before the waiters the driver wakes decide on the belief from before the swap
    (docs/activator.md, Self-heal). `reconcile_resident` with the resync interval ignored; returns
    True when the resident gauge should be republished."""
    state.resident_checked_at = None
    return reconcile_resident(state, is_available, now, resync_interval)


# ---- residency --------------------------------------------------------------------------------


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


def invalidate_resident(state: PoolState) -> None:
    """A dispatch to a pooled member ended without a response head (docs/activator.md, Self-heal):
    re-verify residency on the next acquire. A no-op while a swap owns residency."""
    if state.swap is None:
        state.resident_checked_at = None


# ---- deferred deactivates -----------------------------------------------------------------------


def request_deactivate(state: PoolState, member: str, gen: int) -> bool:
    """F1 (docs/activator.md, Deferred deactivate): `remove_waiter` asked to scale `member` down,
    against generation `gen`. Returns True when the driver must start a deferred-deactivate task
    (then `record_deactivate_task`); False when one is already pending for `member`, which now
    checks against `gen` (the newest "last waiter left"): at most one task per member."""
    if member in state.pending_deactivate:
        state.pending_deactivate[member] = gen
        return False
    return True


def record_deactivate_task(state: PoolState, member: str, gen: int) -> None:
    """The deferred-deactivate task for `member` was started: it is pending against `gen` until its
    `claim_deactivate`. (Not called when the task could not start: the activator is stopping.)"""
    state.pending_deactivate[member] = gen


def deactivate_skip_reason(state: PoolState, member: str, gen: int) -> str | None:
    """F1 (docs/activator.md, Deferred deactivate): why the deferred deactivate of `member` must not
    patch, or None; reads only.

    A swap toward `member` with the *same* generation is the cancelled swap still unwinding: it
    does not block the deactivate (intended upstream).
    """
    if state.waiting.get(member, 0) > 0:
        return "waiter"
    if state.resident == member:
        return "resident"
    if state.inflight.get(member, 0) > 0:
        return "in_flight"  # granted while the resident belief said otherwise: never under it
    swap = state.swap
    if swap is not None and swap.target == member and swap.gen != gen:
        return "newer_swap"
    return None


def claim_deactivate(state: PoolState, member: str, *, decides: bool) -> str | None:
    """The deferred deactivate of `member` re-took the pool lock (docs/activator.md, Deferred
    deactivate): take its pending entry and re-check. `decides`: this replica still decides for
    the pool (docs/pool-ownership.md).

    Returns None when the driver must deactivate `member` now, holding the lock through the call.
    Otherwise why not: "forgotten" (nothing was pending any more: ownership was lost or the
    activator stopped since), a `deactivate_skip_reason`, or "not_owner"; every reason but
    "forgotten" counts in `deactivates_skipped`.
    """
    gen = state.pending_deactivate.pop(member, None)
    if gen is None:
        return "forgotten"
    skip = deactivate_skip_reason(state, member, gen)
    if skip is None and not decides:
        skip = "not_owner"  # the next owner decides
    if skip is not None:
        state.deactivates_skipped += 1
    return skip


# ---- ownership and lifetime ---------------------------------------------------------------------


def forget_on_ownership_loss(state: PoolState) -> SwapState | None:
    """This replica stopped owning the pool (docs/pool-ownership.md, "The activator with an
    owner"): drop every decision in progress without calling the controller, since the next owner
    decides now. Returns the swap that was running, whose task the caller cancels; it is marked
    "cancelled" unless a cause was recorded first, so it ends quietly (F5).

    The swap state is cleared here, not by its task, so the task finds itself superseded (F2) and
    only notifies. Pending deferred deactivates are forgotten (their tasks find nothing to do);
    one-shot swap errors are the old owner's. The resident belief is dropped: a replica that does
    not decide has none, so the `resident` gauge summed over the fleet is the owner's. Waiting and
    in-flight counts stay: they are this replica's requests, still real.
    """
    swap = state.swap
    if swap is not None and swap.cancel_reason is None:
        swap.cancel_reason = "cancelled"
    state.swap = None
    state.pending_deactivate.clear()
    state.swap_err.clear()
    state.resident = None
    state.resident_checked_at = None
    if swap is not None and swap.probe:
        state.breaker(swap.target).cancelled()  # no verdict: the next swap probes again
    return swap


def forget_on_ownership_gain(state: PoolState) -> None:
    """This replica became the pool's owner: whatever it believed about residency may be stale
    (another replica swapped meanwhile), so the next acquire re-derives it from the members'
    availability, as the self-heal path does (docs/activator.md, Reconcile)."""
    state.resident_checked_at = None
    state.swap_err.clear()


def forget_on_ownership_change(state: PoolState) -> None:
    """The pool is still this replica's, yet its ownership changed: it may have been lost and
    regained between two wake-ups of the watcher while another replica swapped, so the next
    acquire re-derives residency (even while a swap runs, unlike `invalidate_resident`)."""
    state.resident_checked_at = None


def forget_on_stop(state: PoolState) -> None:
    """The activator stopped (its nursery, which ran every swap and deferred deactivate, is gone):
    drop the swap and the pending deactivates, so the waiters the driver wakes find no swap to
    wait for. The resident belief, counts, swap errors, swap times and breakers stay."""
    if state.swap is not None and state.swap.probe:
        state.breaker(state.swap.target).cancelled()
    state.swap = None
    state.pending_deactivate.clear()


def is_idle(state: PoolState) -> bool:
    """Nothing waiting, nothing in flight, no swap and no deferred deactivate still to run: an
    owner may hand the pool over without cutting a decision short."""
    return (
        not state.waiting
        and not state.inflight
        and state.swap is None
        and not state.pending_deactivate
    )


# ---- outcomes and budgets -----------------------------------------------------------------------


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
