"""`ProbeClock`: gives each of many health monitors its turn once per interval, spread evenly over
the interval, from one timer.

Why not `trio.sleep(interval)` in each monitor: a trio sleep ends by cancelling the sleeper's
cancel scope, and that path (deadline heap, cancel status recalculation, a `Cancelled` raised and
caught through five frames) cost about 50 us of CPU per wake-up here, against about 10 us for a
task woken from a parking lot. With a thousand registrations probed every second that was 5% of a
core for sleeping alone. And monitors that start together (every Pylon re-registering after a
replica restart) would stay in step, probing in bursts that delay heartbeat acks; here each
monitor has a slot of its own in the interval, so probes are spread evenly whenever they started
(docs/performance.md, "Control plane").

How: the interval is cut into `slots` equal slots; a monitor's first `wait` gives it the slot with
the fewest monitors and returns at that slot's next start (within one interval); every later
`wait` returns at the slot's next start at least half an interval away (so a monitor whose probe
was slow does not probe again at once). Waiters park in a parking
lot per slot start. The timer is not a task of its own: one of the waiters, the *leader*, sleeps
until the earliest slot start that has waiters and wakes them; when the leader's own turn comes
(or it is cancelled: its registration ended) it wakes the next waiter, which takes over. So the
clock needs no nursery and no `run()`: it works wherever monitors wait on it, and costs one sleep
per occupied slot start instead of one per monitor.
"""

from __future__ import annotations

import heapq
import math

import trio

__all__ = ["ProbeClock"]


class ProbeClock:
    """Turns once per `interval`, in `slots` slots (the finer, the more even the spread)."""

    def __init__(self, interval: float, *, slots: int = 100) -> None:
        if not interval > 0 or math.isinf(interval):
            raise ValueError(f"interval must be a positive number of seconds, got {interval}")
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.interval = interval
        self._slots = slots
        self._slot_length = interval / slots
        self._members: dict[object, int] = {}  # member -> its slot
        self._load = [0] * slots  # members per slot
        self._lots: dict[int, trio.lowlevel.ParkingLot] = {}  # tick (slot start) -> waiters
        self._ticks: list[int] = []  # heap of the ticks in `_lots`
        self._leader: trio.lowlevel.Task | None = None
        self._alarm: trio.CancelScope | None = None  # the leader's sleep

    @property
    def members(self) -> int:
        return len(self._members)

    def join(self, member: object) -> None:
        """Give `member` the least busy slot (done by its first `wait` if not before)."""
        if member not in self._members:
            slot = min(range(self._slots), key=self._load.__getitem__)
            self._members[member] = slot
            self._load[slot] += 1

    def leave(self, member: object) -> None:
        """Free `member`'s slot (its monitor has stopped)."""
        slot = self._members.pop(member, None)
        if slot is not None:
            self._load[slot] -= 1

    async def wait(self, member: object) -> None:
        """Return at `member`'s next turn: its slot's next start, at most one interval away on
        its first wait and at least half an interval away on later ones (so a monitor whose
        probe was slow does not probe again at once). Cancellable; a cancelled waiter loses
        nothing but that turn."""
        joined = member not in self._members
        self.join(member)
        tick = self._next_tick(self._members[member], 0.0 if joined else self.interval / 2)
        while not self._tick_passed(tick):
            if self._leader is None:
                await self._lead(tick)
                return
            lot = self._lots.get(tick)
            if lot is None:
                lot = self._lots[tick] = trio.lowlevel.ParkingLot()
                heapq.heappush(self._ticks, tick)
                alarm = self._alarm
                if alarm is not None and tick * self._slot_length < alarm.deadline:
                    alarm.deadline = tick * self._slot_length  # the leader wakes for it
            # Woken at the turn, or early by a leader handing over (then lead, unless another
            # task took the lead meanwhile: park again).
            await lot.park()
        if self._leader is None:
            self._hand_over()  # the lead was handed to this task as its turn came: pass it on

    def _next_tick(self, slot: int, gap: float) -> int:
        """The first start of `slot` after now + `gap` (and after now), as a tick count."""
        earliest = math.floor((trio.current_time() + gap) / self._slot_length) + 1
        return earliest + (slot - earliest) % self._slots

    def _tick_passed(self, tick: int) -> bool:
        return trio.current_time() >= tick * self._slot_length

    async def _lead(self, own_tick: int) -> None:
        """Run the timer until `own_tick`, waking every waiter whose tick comes first."""
        self._leader = trio.lowlevel.current_task()
        try:
            while True:
                due = min(own_tick, self._ticks[0]) if self._ticks else own_tick
                # A sleep whose deadline a waiter parking for an earlier tick brings forward.
                with trio.CancelScope(deadline=due * self._slot_length) as alarm:
                    self._alarm = alarm
                    await trio.sleep_forever()
                self._alarm = None
                self._wake_due()
                if self._tick_passed(own_tick):
                    return
        finally:
            self._leader = None
            self._alarm = None
            self._hand_over()

    def _wake_due(self) -> None:
        now = trio.current_time()
        ticks = self._ticks
        while ticks and ticks[0] * self._slot_length <= now:
            lot = self._lots.pop(heapq.heappop(ticks), None)
            if lot is not None:
                lot.unpark_all()

    def _hand_over(self) -> None:
        """Wake the waiter of the earliest tick to lead: there is no timer without a leader."""
        ticks = self._ticks
        while ticks:
            lot = self._lots.get(ticks[0])
            if lot is not None and len(lot) > 0:
                lot.unpark()
                return
            self._lots.pop(heapq.heappop(ticks), None)  # every waiter of it was cancelled
