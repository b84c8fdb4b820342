"""The lock-across-patch rule of the #1837 fix, pinned by behaviour (docs/activator.md, Locking;
docs/decisions.md, D15): a deactivate is decided *and applied* under the pool lock, so while its
controller call (the patch) is in progress no activation of the same member can start. Upstream's
wedge was exactly that: a scale-down decided earlier landed after a newer activation.

The controller's `deactivate` waits on an event the test holds, and every test asserts on the
order of the recorded controller calls, never on timing (virtual time, `MockClock`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
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


class GatedDeactivate(FakeController):
    """The fake controller, with every `deactivate` held inside the call until `gate` is set, and
    a log of when each call starts and when a deactivate returns."""

    def __init__(self, availability: MemberAvailability, members: Sequence[str]) -> None:
        super().__init__(availability, members)
        self.gate = trio.Event()
        self.log: list[tuple[str, str]] = []

    async def activate(self, member: str) -> None:
        self.log.append(("activate", member))
        await super().activate(member)

    async def deactivate(self, member: str) -> None:
        self.log.append(("deactivate", member))
        await self.gate.wait()
        await super().deactivate(member)
        self.log.append(("deactivate returned", member))


@asynccontextmanager
async def pool_with_gated_deactivate(
    spec: PoolSpec,
) -> AsyncIterator[tuple[Activator, GatedDeactivate, trio.Nursery]]:
    availability = MemberAvailability()
    controller = GatedDeactivate(availability, spec.members)
    controller.force("judge", up=True)  # the resident
    # An hour per controller call: the held patch is never cut short by the call's timeout here.
    activator = Activator([spec], {POOL: controller}, availability, controller_timeout=3600.0)
    async with trio.open_nursery() as nursery:
        controller.bind(nursery)
        await nursery.start(activator.run)
        yield activator, controller, nursery
        nursery.cancel_scope.cancel()


def assert_no_activation_during_the_patch(log: list[tuple[str, str]], member: str) -> None:
    """Every activation of `member` that follows a deactivate of it starts after that deactivate
    returned."""
    start = log.index(("deactivate", member))
    returned = log.index(("deactivate returned", member))
    activations = [i for i, call in enumerate(log) if call == ("activate", member) and i > start]
    assert activations, log
    assert all(i > returned for i in activations), log


async def _blocked() -> None:
    await trio.testing.wait_all_tasks_blocked()


async def test_a_deferred_deactivate_holds_off_a_new_activation_until_its_patch_returns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """F1: the last waiter for coder gives up; the deferred deactivate passes its re-check and
    patches under the lock. A request for coder arriving during the patch waits for the lock, and
    its swap's Activate comes only after the patch has returned (so the patch cannot undo it)."""
    spec = PoolSpec(POOL, ("judge", "coder"), swap_budget=300.0)
    async with pool_with_gated_deactivate(spec) as (activator, controller, nursery):
        controller.ready_delay["coder"] = None  # W1's swap never becomes Ready
        with pytest.raises(HoldTimeout):
            await activator.acquire("coder", hold_budget=1.0)
        await _blocked()
        assert controller.log == [("activate", "coder"), ("deactivate", "coder")]
        assert activator.snapshot()[POOL]["locked"]  # the patch runs under the pool lock

        controller.ready_delay["coder"] = 0.0  # from now on coder starts at once
        granted = trio.Event()

        async def w2() -> None:
            with await activator.acquire("coder", hold_budget=3600.0):
                granted.set()

        nursery.start_soon(w2)
        await _blocked()
        await trio.sleep(60.0)  # virtual: a minute inside the patch
        assert controller.log[-1] == ("deactivate", "coder")  # W2 started nothing
        assert not granted.is_set()
        assert activator.snapshot()[POOL]["held"] == {"coder": 1}

        controller.gate.set()
        await granted.wait()
        assert controller.log == [
            ("activate", "coder"),
            ("deactivate", "coder"),
            ("deactivate returned", "coder"),
            ("activate", "coder"),
        ]
        assert_no_activation_during_the_patch(controller.log, "coder")
        assert controller.replicas["coder"] == 1  # the patch did not land on the new activation


async def test_an_abandoned_swaps_deactivate_holds_off_a_new_activation_until_it_returns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """F4: a swap past its deadline scales its target down while the lock is held; a request for
    the target arriving during that patch cannot start a swap that the patch would undo."""
    spec = PoolSpec(POOL, ("judge", "coder"), swap_budget=1.0)
    async with pool_with_gated_deactivate(spec) as (activator, controller, nursery):
        controller.ready_delay["coder"] = None
        outcomes: list[BaseException | None] = []

        async def acquire(done: trio.Event) -> None:
            try:
                with await activator.acquire("coder", hold_budget=3600.0):
                    outcomes.append(None)
            except SwapFailed as error:
                outcomes.append(error)
            done.set()

        w1_done = trio.Event()
        nursery.start_soon(acquire, w1_done)
        await trio.sleep(1.0)  # the swap's deadline: abandoned, its deactivate now held
        await _blocked()
        assert controller.log == [("activate", "coder"), ("deactivate", "coder")]
        assert activator.snapshot()[POOL]["locked"]

        controller.ready_delay["coder"] = 0.0
        w2_done = trio.Event()
        nursery.start_soon(acquire, w2_done)
        await _blocked()
        await trio.sleep(60.0)
        assert controller.log[-1] == ("deactivate", "coder")
        assert not w1_done.is_set() and not w2_done.is_set()

        controller.gate.set()
        await w1_done.wait()
        await w2_done.wait()
        # The first waiter sees the abandoned swap's error; the second one's swap succeeds.
        assert sorted(type(o).__name__ for o in outcomes) == ["NoneType", "SwapFailed"]
        assert_no_activation_during_the_patch(controller.log, "coder")
        assert controller.log[:3] == [
            ("activate", "coder"),
            ("deactivate", "coder"),
            ("deactivate returned", "coder"),
        ]
        assert controller.replicas["coder"] == 1
