"""The deferred deactivate scales down a member whose last waiter left (docs/activator.md, Acquire,
step 4, and Deferred deactivate; F1).

Each test ends with a member that is up, is not resident and has no waiter left, and asserts the
*world* afterwards (the member's replicas are 0), not only that a call was made. The fake
controller here is not exclusive: it never stops one member because another starts, so nothing
but the activator's deferred deactivate can scale the member down. (The soak's fake is exclusive,
which is why a member never scaled down could pass it: the next activation stopped it anyway.)

Virtual time (`MockClock`), the shape of the pool of tests/unit/activator/test_pool.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from stargate.activator import (
    Activator,
    FakeController,
    HoldTimeout,
    MemberAvailability,
    PoolSpec,
    SwapFailed,
)

POOL = "heavy-slot"
SPEC = PoolSpec(POOL, ("judge", "coder"), swap_budget=300.0)


@asynccontextmanager
async def running(
    controller: FakeController, availability: MemberAvailability
) -> AsyncIterator[tuple[Activator, trio.Nursery]]:
    """The activator over `controller`; judge is up, Ready and resident-to-be."""
    controller.force("judge", up=True)
    activator = Activator([SPEC], {POOL: controller}, availability)
    async with trio.open_nursery() as nursery:
        controller.bind(nursery)
        await nursery.start(activator.run)
        yield activator, nursery
        nursery.cancel_scope.cancel()


def never_ready() -> tuple[FakeController, MemberAvailability]:
    """A fake whose `activate` scales a member up and never makes it Ready."""
    availability = MemberAvailability()
    return FakeController(availability, SPEC.members, default_ready_delay=None), availability


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


def assert_scaled_down(activator: Activator, fake: FakeController, member: str) -> None:
    snap = activator.snapshot()[POOL]
    assert fake.replicas[member] == 0, fake.calls
    assert snap["pending_deactivates"] == [] and snap["held_total"] == 0
    assert fake.replicas["judge"] == 1  # the resident is never touched
    assert snap["resident"] == "judge"


async def test_the_member_of_a_cancelled_swap_is_scaled_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The last waiter's hold budget runs out during its swap: the swap is cancelled quietly (F5),
    which scales nothing down, so the deferred deactivate must."""
    fake, availability = never_ready()
    async with running(fake, availability) as (activator, _):
        with pytest.raises(HoldTimeout):
            await activator.acquire("coder", hold_budget=1.0)
        await settle()
        assert fake.deactivations("coder") == 1
        assert_scaled_down(activator, fake, "coder")


class StartsThenFails(FakeController):
    """`activate` scales the member up, then raises: an engine that started and failed its health
    check, or a Kubernetes patch that applied and then timed out."""

    async def activate(self, member: str) -> None:
        await super().activate(member)
        raise RuntimeError(f"{member} failed its health check")


async def test_the_member_of_a_failed_swap_is_scaled_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A failed swap leaves its target as the controller left it (up, here); the waiter that takes
    the swap error is the last one, and its deferred deactivate scales the target down."""
    availability = MemberAvailability()
    fake = StartsThenFails(availability, SPEC.members, default_ready_delay=None)
    async with running(fake, availability) as (activator, _):
        with pytest.raises(SwapFailed) as info:
            await activator.acquire("coder", hold_budget=60.0)
        assert info.value.reason == "error"
        await settle()
        assert_scaled_down(activator, fake, "coder")


async def test_a_member_waited_for_behind_a_busy_resident_is_scaled_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No swap ever starts (the resident stays busy), so there is nothing to cancel; a leftover
    coder that is up but not Ready is still scaled down when its last waiter gives up."""
    fake, availability = never_ready()
    async with running(fake, availability) as (activator, _):
        busy = await activator.acquire("judge")
        fake.force("coder", up=True, ready=False)  # left over, still starting
        with pytest.raises(HoldTimeout):
            await activator.acquire("coder", hold_budget=1.0)
        await settle()
        assert fake.activations("coder") == 0
        assert_scaled_down(activator, fake, "coder")
        busy.release()


async def test_every_last_waiter_scales_its_member_down_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A deferred deactivate that ran leaves nothing pending behind, so the next round's last
    waiter schedules (and runs) a new one."""
    fake, availability = never_ready()
    async with running(fake, availability) as (activator, _):
        for round_ in range(1, 4):
            with pytest.raises(HoldTimeout):
                await activator.acquire("coder", hold_budget=1.0)
            assert fake.replicas["coder"] == 1  # up until the deferred deactivate runs
            await settle()
            assert fake.activations("coder") == round_
            assert fake.deactivations("coder") == round_
            assert_scaled_down(activator, fake, "coder")


class SlowUnwind(FakeController):
    """The second `activate` of coder hangs after scaling up, and once cancelled it takes until
    `unwind` is set to return: its swap stays in the state, cancelled and unwinding."""

    def __init__(self, availability: MemberAvailability) -> None:
        super().__init__(availability, SPEC.members, default_ready_delay=None)
        self.unwind = trio.Event()

    async def activate(self, member: str) -> None:
        await super().activate(member)
        if member == "coder" and self.activations("coder") == 2:
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await self.unwind.wait()


async def test_a_pending_deactivate_runs_against_the_newest_last_waiter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two last-waiter exits before the first deferred deactivate re-checks share one task
    (at most one per member), which must check against the *newest* generation: the swap it finds
    toward coder is the newest waiter's own cancelled swap, still unwinding, and does not block
    it. Checked against the first exit's generation it would look like a newer swap and skip, and
    nothing else would ever scale coder down."""
    availability = MemberAvailability()
    fake = SlowUnwind(availability)
    hold_deactivate = trio.Event()
    async with running(fake, availability) as (activator, nursery):
        try:
            await two_last_waiters_then_the_deactivate(activator, fake, nursery, hold_deactivate)
        finally:
            fake.unwind.set()  # even on a failed assertion: the shielded unwind must not hang
        await settle()
        assert activator.snapshot()[POOL]["swapping"] is False
        assert_scaled_down(activator, fake, "coder")


async def two_last_waiters_then_the_deactivate(
    activator: Activator, fake: SlowUnwind, nursery: trio.Nursery, hold_deactivate: trio.Event
) -> None:
    async def before_deactivate(pool: str, member: str) -> None:
        await hold_deactivate.wait()

    activator.before_deactivate = before_deactivate
    with pytest.raises(HoldTimeout):  # W1: swap 1 cancelled; its deactivate waits in the hook
        await activator.acquire("coder", hold_budget=1.0)
    await settle()
    assert activator.snapshot()[POOL]["pending_deactivates"] == ["coder"]
    w2 = trio.CancelScope()

    async def second_waiter() -> None:
        with w2:
            await activator.acquire("coder")

    nursery.start_soon(second_waiter)
    await settle()
    swap = activator.snapshot()[POOL]["swap"]
    assert swap is not None and swap["generation"] == 2 and swap["to"] == "coder"
    w2.cancel()  # W2, the last waiter again: swap 2 cancelled, still unwinding
    await settle()
    swap = activator.snapshot()[POOL]["swap"]
    assert swap is not None and swap["cancel_reason"] == "cancelled"
    hold_deactivate.set()
    await settle()
    # The deactivate ran while swap 2 was still unwinding (the same generation: not blocked).
    assert activator.snapshot()[POOL]["swapping"] is True
    assert fake.deactivations("coder") == 1
    assert activator.snapshot()[POOL]["deactivates_skipped"] == 0
