"""The activator with a pool owner (docs/pool-ownership.md, "The activator with an owner"): only
the owner decides and calls the controller; losing ownership stops every decision at once, gaining
it re-derives residency; a non-owner hands requests over (`PoolOwnedElsewhere`) or waits for an
owner within the hold budget (`NoPoolOwner`). FakeController and FakeOwnership, virtual time."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from stargate.activator import (
    Grant,
    NoPoolOwner,
    Owner,
    PoolOwnedElsewhere,
    PoolSpec,
)
from stargate.activator.testing import FakeOwnership, Harness, running_activator

POOL = "gpu0"
SPEC = PoolSpec(POOL, ("a", "b"), swap_budget=60.0, hold_budget=30.0)
ROUTER = "r1"
OWNER = "http://10.0.0.7:8000"


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


class Pending:
    """An acquire running in the background."""

    def __init__(self) -> None:
        self.result: Grant | None = None
        self.error: BaseException | None = None
        self.done = trio.Event()
        self.at: float | None = None


def start_acquire(h: Harness, model: str, **kw: float) -> Pending:
    pending = Pending()

    async def runner() -> None:
        try:
            pending.result = await h.activator.acquire(model, **kw)  # type: ignore[arg-type]
        except Exception as exc:
            pending.error = exc
        pending.at = trio.current_time()
        pending.done.set()

    h.nursery.start_soon(runner)
    return pending


def owned_gauge(h: Harness) -> float:
    return h.sample("llmkube_modelpool_owned", pool=POOL, router=ROUTER)


async def test_a_non_owner_hands_over_at_once_and_never_calls_the_controller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ownership = FakeOwnership()
    ownership.elsewhere(POOL, OWNER, "replica-2")
    async with running_activator([SPEC], ownership=ownership, router_name=ROUTER, ready=["a"]) as h:
        started = trio.current_time()
        for model in ("a", "b", "b"):
            with pytest.raises(PoolOwnedElsewhere) as caught:
                await h.activator.acquire(model)
            assert trio.current_time() == started  # at once
        error = caught.value
        assert (error.pool, error.member, error.address) == (POOL, "b", OWNER)
        assert error.identity == "replica-2"
        assert error.deadline == started + 30.0  # the hold budget, for the relay to count once
        await trio.sleep(120)  # long past any deferred deactivate
        assert h.fake().calls == []
        assert h.activator.idle(POOL)
        assert owned_gauge(h) == 0
        assert not h.pool()["owned"]


async def test_losing_ownership_mid_swap_cancels_it_without_controller_calls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ownership = FakeOwnership()
    ownership.own(POOL)
    async with running_activator([SPEC], ownership=ownership, ready=["a"]) as h:
        fake = h.fake()
        fake.ready_delay["b"] = None  # the swap to b never becomes Ready by itself
        waiters = [start_acquire(h, "b") for _ in range(3)]
        await settle()
        assert h.pool()["swapping"]
        assert fake.calls == [("activate", "b")]
        await trio.sleep(5)
        ownership.elsewhere(POOL, OWNER)
        await settle()
        for waiter in waiters:
            assert waiter.done.is_set()
            assert isinstance(waiter.error, PoolOwnedElsewhere)
            assert waiter.error.address == OWNER
            assert waiter.at == 5.0  # woken at the change, not at the hold budget
        assert not h.pool()["swapping"]
        assert h.pool()["pending_deactivates"] == []
        await trio.sleep(120)  # past the swap deadline and any deferred deactivate
        assert fake.calls == [("activate", "b")]  # nothing after the loss
        assert h.activator.idle(POOL)


async def test_losing_ownership_drops_pending_deactivates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A deferred deactivate waiting for the lock when ownership goes is never run."""
    ownership = FakeOwnership()
    ownership.own(POOL)
    gate = trio.Event()

    async def before_deactivate(pool: str, member: str) -> None:
        await gate.wait()

    async with running_activator(
        [SPEC], ownership=ownership, ready=["a"], before_deactivate=before_deactivate
    ) as h:
        fake = h.fake()
        fake.ready_delay["b"] = None
        waiter = start_acquire(h, "b", hold_budget=10.0)
        await waiter.done.wait()
        assert isinstance(waiter.error, Exception)  # the hold budget ran out
        assert h.pool()["pending_deactivates"] == ["b"]
        assert not h.activator.idle(POOL)  # a deactivate is still to run
        ownership.elsewhere(POOL, OWNER)
        await settle()
        gate.set()
        await settle()
        assert fake.deactivations("b") == 0
        assert h.activator.idle(POOL)


async def test_losing_ownership_cuts_a_deactivate_in_progress_short(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ownership = FakeOwnership()
    ownership.own(POOL)
    async with running_activator([SPEC], ownership=ownership, ready=["a"]) as h:
        fake = h.fake()
        fake.ready_delay["b"] = None
        fake.hang_deactivate.add("b")
        waiter = start_acquire(h, "b", hold_budget=10.0)
        await waiter.done.wait()
        await settle()
        assert fake.deactivations("b") == 1  # in progress, under the lock, hung
        assert not h.activator.idle(POOL)
        ownership.elsewhere(POOL, OWNER)
        await settle()
        assert h.activator.idle(POOL)
        assert not h.pool()["locked"]
        assert trio.current_time() == 10.0  # not the controller timeout


async def test_the_guard_reads_the_source_before_the_watcher_has_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The source turns `is_self` off before anyone else can own the pool, possibly before its
    change event is seen: the deferred deactivate must ask it again right before the call."""
    ownership = FakeOwnership()
    ownership.own(POOL)
    gate = trio.Event()

    async def before_deactivate(pool: str, member: str) -> None:
        await gate.wait()

    async with running_activator(
        [SPEC], ownership=ownership, ready=["a"], before_deactivate=before_deactivate
    ) as h:
        h.fake().ready_delay["b"] = None
        waiter = start_acquire(h, "b", hold_budget=10.0)
        await waiter.done.wait()
        ownership.set_owner(POOL, Owner(is_self=False), notify=False)
        gate.set()
        await settle()
        assert h.fake().deactivations("b") == 0
        assert h.pool()["deactivates_skipped"] == 1


async def test_gaining_ownership_rereads_the_resident_from_the_members(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ownership = FakeOwnership()
    ownership.own(POOL)
    async with running_activator([SPEC], ownership=ownership, ready=["a"]) as h:
        fake = h.fake()
        with await h.activator.acquire("a"):
            pass
        assert h.pool()["resident"] == "a"
        ownership.elsewhere(POOL, OWNER)
        await settle()
        assert h.pool()["resident"] is None
        # Meanwhile the other owner swapped the pool to b.
        fake.force("a", up=False)
        fake.force("b", up=True)
        await trio.sleep(1)  # well inside the resync interval
        ownership.own(POOL)
        await settle()
        grant = await h.activator.acquire("b")
        grant.release()
        assert h.pool()["resident"] == "b"
        assert fake.calls == []  # granted on the re-read, no swap


async def test_a_gained_belief_is_not_trusted_even_if_recent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Regaining a pool this replica still held a fresh belief about: re-read anyway."""
    ownership = FakeOwnership()
    ownership.own(POOL)
    async with running_activator([SPEC], ownership=ownership, ready=["a"]) as h:
        with await h.activator.acquire("a"):
            pass
        ownership.disown(POOL)
        await settle()
        h.fake().force("a", up=False)
        h.fake().force("b", up=True)
        ownership.own(POOL)
        await settle()
        with await h.activator.acquire("b"):
            pass
        assert h.fake().calls == []


async def test_lost_and_regained_between_two_wakeups_still_rereads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The watcher may only see the last of several changes: "self" again after a change event
    is still a reason to re-read residency."""
    ownership = FakeOwnership()
    ownership.own(POOL)
    async with running_activator([SPEC], ownership=ownership, ready=["a"]) as h:
        with await h.activator.acquire("a"):
            pass
        ownership.elsewhere(POOL, OWNER)
        ownership.own(POOL)  # no checkpoint between: the watcher sees self -> self
        h.fake().force("a", up=False)
        h.fake().force("b", up=True)
        await settle()
        with await h.activator.acquire("b"):
            pass
        assert h.fake().calls == []


async def test_acquire_waits_for_an_owner_then_proceeds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ownership = FakeOwnership()  # nobody owns the pool yet
    async with running_activator([SPEC], ownership=ownership, ready=["a"]) as h:
        waiter = start_acquire(h, "b")
        await trio.sleep(4)
        assert not waiter.done.is_set()
        assert h.fake().calls == []
        ownership.own(POOL)
        await waiter.done.wait()
        assert isinstance(waiter.result, Grant)
        assert waiter.result.member == "b"
        waiter.result.release()
        assert h.fake().calls == [("activate", "b")]


async def test_a_waiter_keeps_waiting_while_nobody_owns_then_hands_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ownership = FakeOwnership()
    ownership.own(POOL)
    async with running_activator([SPEC], ownership=ownership, ready=["a"]) as h:
        h.fake().ready_delay["b"] = None
        waiter = start_acquire(h, "b")
        await trio.sleep(2)
        ownership.disown(POOL)  # the lease expired, nobody took it yet
        await trio.sleep(2)
        assert not waiter.done.is_set()
        ownership.elsewhere(POOL, OWNER)
        await waiter.done.wait()
        assert isinstance(waiter.error, PoolOwnedElsewhere)
        assert waiter.at == 4.0
        assert h.fake().calls == [("activate", "b")]


async def test_no_owner_within_the_hold_budget_is_its_own_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ownership = FakeOwnership()
    async with running_activator([SPEC], ownership=ownership) as h:
        with pytest.raises(NoPoolOwner) as caught:
            await h.activator.acquire("a")
        assert trio.current_time() == 30.0
        assert caught.value.status == 503
        assert caught.value.code == "pool_owner_unavailable"
        assert caught.value.retry_after is not None
        assert h.fake().calls == []
        assert h.activator.idle(POOL)


async def test_idle_and_wait_idle(autojump_clock: trio.testing.MockClock) -> None:
    ownership = FakeOwnership()
    ownership.own(POOL)
    async with running_activator([SPEC], ownership=ownership, ready=["a"]) as h:
        assert h.activator.idle(POOL)
        grant = await h.activator.acquire("a")
        assert not h.activator.idle(POOL)  # in flight
        waiter = start_acquire(h, "b")  # waits behind the busy resident
        await settle()
        assert not h.activator.idle(POOL)
        idle_at: list[float] = []

        async def wait_idle() -> None:
            await h.activator.wait_idle(POOL)
            idle_at.append(trio.current_time())

        h.nursery.start_soon(wait_idle)
        await trio.sleep(3)
        grant.release()  # the swap to b starts and completes; then b is in flight
        await waiter.done.wait()
        assert waiter.result is not None
        await settle()
        assert idle_at == []
        await trio.sleep(2)
        waiter.result.release()
        await settle()
        assert idle_at == [5.0]
        assert h.activator.idle(POOL)
        await h.activator.wait_idle(POOL)  # at once when idle


async def test_wait_idle_wakes_when_the_last_waiter_gives_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A waiter leaving (its hold budget ran out) is a way to become idle too."""
    ownership = FakeOwnership()
    async with running_activator([SPEC], ownership=ownership) as h:
        waiter = start_acquire(h, "a", hold_budget=7.0)
        await settle()
        assert not h.activator.idle(POOL)
        await h.activator.wait_idle(POOL)
        assert trio.current_time() == 7.0
        assert isinstance(waiter.error, NoPoolOwner)


async def test_ownership_gauge_and_relay_counter(autojump_clock: trio.testing.MockClock) -> None:
    ownership = FakeOwnership()
    async with running_activator([SPEC], ownership=ownership, router_name=ROUTER) as h:
        assert owned_gauge(h) == 0
        ownership.own(POOL)
        await settle()
        assert owned_gauge(h) == 1
        assert h.pool()["owned"]
        ownership.elsewhere(POOL, OWNER)
        await settle()
        assert owned_gauge(h) == 0
        h.activator.count_relayed(POOL, "relayed")
        h.activator.count_relayed(POOL, "relayed")
        sample = h.sample(
            "llmkube_modelpool_relayed_requests_total", outcome="relayed", pool=POOL, router=ROUTER
        )
        assert sample == 2


async def test_local_ownership_owns_every_pool_without_asking(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The default: one replica decides for every pool, and the gauge says so."""
    async with running_activator([SPEC], router_name=ROUTER, ready=["a"]) as h:
        assert owned_gauge(h) == 1
        assert h.activator.owns(POOL)
        with await h.activator.acquire("a"):
            pass


async def test_ownership_changes_are_logged(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    ownership = FakeOwnership()
    caplog.set_level("INFO", logger="stargate.activator.pool")
    async with running_activator([SPEC], ownership=ownership) as h:
        ownership.own(POOL)
        await settle()
        ownership.elsewhere(POOL, OWNER, "replica-2")
        await settle()
        assert h is not None
    changes = [
        (r.old_owner, r.new_owner)  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == "model pool owner"
    ]
    assert changes == [("none", "none"), ("none", "self"), ("self", "replica-2")]
