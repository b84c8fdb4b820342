"""`ProbeClock` (stargate/control_plane/probe_clock.py): every member gets one turn per interval,
members are spread evenly over the interval whenever they join, and the timer survives its
leader's cancellation. Driven by trio's MockClock."""

from __future__ import annotations

import itertools

import pytest
import trio
from trio.testing import MockClock

from stargate.control_plane.probe_clock import ProbeClock


async def _turns(clock: ProbeClock, member: object, log: list[tuple[object, float]]) -> None:
    while True:
        await clock.wait(member)
        log.append((member, trio.current_time()))


def _times(log: list[tuple[object, float]], member: object) -> list[float]:
    return [at for who, at in log if who == member]


async def test_each_member_gets_one_turn_per_interval(autojump_clock: MockClock) -> None:
    clock = ProbeClock(1.0, slots=10)
    log: list[tuple[object, float]] = []
    async with trio.open_nursery() as nursery:
        for member in range(30):
            nursery.start_soon(_turns, clock, member, log)
        await trio.sleep(10.05)
        nursery.cancel_scope.cancel()
    for member in range(30):
        times = _times(log, member)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert len(times) >= 9
        assert all(gap == pytest.approx(1.0) for gap in gaps), (member, gaps)


async def test_members_that_join_together_are_spread_over_the_interval(
    autojump_clock: MockClock,
) -> None:
    clock = ProbeClock(1.0, slots=10)
    log: list[tuple[object, float]] = []
    async with trio.open_nursery() as nursery:
        for member in range(20):  # all at the same instant
            nursery.start_soon(_turns, clock, member, log)
        await trio.sleep(3.0)
        nursery.cancel_scope.cancel()
    per_slot: dict[int, int] = {}
    for _, at in log:
        slot = round((at % 1.0) * 10) % 10
        per_slot[slot] = per_slot.get(slot, 0) + 1
    # 20 members over 10 slots: every slot serves 2 members per interval, none bunches up.
    assert len(per_slot) == 10, per_slot
    assert max(per_slot.values()) - min(per_slot.values()) <= 2, per_slot


async def test_the_timer_outlives_a_cancelled_leader(autojump_clock: MockClock) -> None:
    clock = ProbeClock(1.0, slots=4)
    log: list[tuple[object, float]] = []
    async with trio.open_nursery() as nursery:
        leader_scope = trio.CancelScope()

        async def first() -> None:
            with leader_scope:
                await _turns(clock, "first", log)

        nursery.start_soon(first)
        await trio.sleep(0.01)
        nursery.start_soon(_turns, clock, "second", log)
        nursery.start_soon(_turns, clock, "third", log)
        await trio.sleep(2.2)
        leader_scope.cancel()  # whoever leads now, the others keep their turns
        clock.leave("first")
        before = {m: len(_times(log, m)) for m in ("second", "third")}
        await trio.sleep(3.0)
        nursery.cancel_scope.cancel()
    for member in ("second", "third"):
        assert len(_times(log, member)) - before[member] == 3
    assert clock.members == 2


async def test_a_turn_is_at_least_half_an_interval_away(autojump_clock: MockClock) -> None:
    clock = ProbeClock(1.0, slots=10)
    joined = trio.current_time()
    await clock.wait("m")
    first = trio.current_time()
    assert 0 < first - joined <= 1.0  # a first turn within one interval, as a sleep would give
    await trio.sleep(0.9)  # a slow probe: the slot's next start is 0.1 s away
    await clock.wait("m")
    assert trio.current_time() - first == pytest.approx(2.0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        ProbeClock(0)
    with pytest.raises(ValueError):
        ProbeClock(float("inf"))
    with pytest.raises(ValueError):
        ProbeClock(1.0, slots=0)
