"""Activator scenarios of docs/activator.md, "Tests" (one test each) on the FakeController, virtual
time.

Pool `lab/heavy-slot` with members [judge, coder], as upstream. Every test runs on trio's
`MockClock(autojump_threshold=0)`: sleeps cost no wall time.
"""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from stargate.activator import (
    Grant,
    HoldTimeout,
    IncumbentBusy,
    PoolSpec,
    SwapFailed,
)
from stargate.activator.testing import Harness, running_activator

POOL = "heavy-slot"
SPEC = PoolSpec(POOL, ("judge", "coder"), swap_budget=300.0, namespace="lab")
ROUTER = "r1"


def spec(**changes: object) -> PoolSpec:
    fields = {
        "name": POOL,
        "members": ("judge", "coder"),
        "swap_budget": 300.0,
        "namespace": "lab",
    }
    fields.update(changes)
    return PoolSpec(**fields)  # type: ignore[arg-type]


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


class Pending:
    """An acquire running in the background; `.result` / `.error` once done."""

    def __init__(self) -> None:
        self.result: Grant | None = None
        self.error: BaseException | None = None
        self.done = trio.Event()
        self.scope = trio.CancelScope()
        self.finished_at: float | None = None

    @property
    def blocked(self) -> bool:
        return not self.done.is_set()


def start_acquire(h: Harness, model: str, mode: str | None = None, **kw: object) -> Pending:
    pending = Pending()

    async def runner() -> None:
        with pending.scope:
            try:
                pending.result = await h.activator.acquire(model, mode, **kw)  # type: ignore[arg-type]
            except Exception as exc:
                pending.error = exc
        pending.finished_at = trio.current_time()
        pending.done.set()

    h.nursery.start_soon(runner)
    return pending


# ---- existing upstream tests ---------------------------------------------------------------------


async def test_cold_activate(autojump_clock: trio.testing.MockClock) -> None:
    async with running_activator([SPEC], router_name=ROUTER) as h:
        grant = await h.activator.acquire("judge")
        assert isinstance(grant, Grant)
        assert h.fake().activations("judge") == 1
        assert h.pool()["resident"] == "judge"
        assert (
            h.sample(
                "llmkube_modelpool_swaps_total",
                **{"from": ""},
                pool=POOL,
                router=ROUTER,
                to="judge",
            )
            == 1
        )
        grant.release()


async def test_seeds_resident_default(autojump_clock: trio.testing.MockClock) -> None:
    async with running_activator([SPEC], ready=["coder"]) as h:
        with await h.activator.acquire("coder"):
            pass
        assert h.fake().calls == []
        assert h.pool()["resident"] == "coder"
        assert (
            h.sample("llmkube_modelpool_resident", member="coder", namespace="lab", pool=POOL) == 1
        )
        assert (
            h.sample("llmkube_modelpool_resident", member="judge", namespace="lab", pool=POOL) == 0
        )


async def test_coalesces_same_model(autojump_clock: trio.testing.MockClock) -> None:
    async with running_activator([SPEC], default_ready_delay=1.0) as h:
        pendings = [start_acquire(h, "judge") for _ in range(8)]
        for p in pendings:
            await p.done.wait()
        assert all(p.result is not None for p in pendings)
        assert h.fake().activations("judge") == 1
        assert h.pool()["in_flight"] == {"judge": 8}
        for p in pendings:
            assert p.result is not None
            p.result.release()
        assert h.pool()["in_flight"] == {}


async def test_swap_when_idle(autojump_clock: trio.testing.MockClock) -> None:
    async with running_activator([SPEC], router_name=ROUTER) as h:
        (await h.activator.acquire("judge")).release()
        grant = await h.activator.acquire("coder")
        assert h.fake().activations("coder") == 1
        assert h.pool()["resident"] == "coder"
        assert (
            h.sample(
                "llmkube_modelpool_swaps_total",
                **{"from": "judge"},
                pool=POOL,
                router=ROUTER,
                to="coder",
            )
            == 1
        )
        grant.release()


async def test_hold_budget_exceeded(autojump_clock: trio.testing.MockClock) -> None:
    async with running_activator([SPEC]) as h:
        h.fake().activate_gate["judge"] = trio.Event()  # gated forever
        start = trio.current_time()
        with pytest.raises(HoldTimeout) as info:
            await h.activator.acquire("judge", hold_budget=0.03)
        assert trio.current_time() - start == pytest.approx(0.03)
        assert info.value.status == 503 and info.value.code == "pool_activation_timeout"
        assert info.value.retry_after == 5
        await trio.sleep(1.0)
        assert h.fake().deactivations("judge") >= 1
        assert h.pool()["swapping"] is False  # the cancelled swap unwound quietly


async def test_coalesce_holds_cross_model_until_drain(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_activator([SPEC]) as h:
        judge = await h.activator.acquire("judge")
        coder = start_acquire(h, "coder")
        await trio.sleep(0.05)
        assert coder.blocked
        assert h.fake().activations("coder") == 0
        # Same-model requests keep being served on the busy resident meanwhile.
        (await h.activator.acquire("judge")).release()
        judge.release()
        await coder.done.wait()
        assert coder.result is not None
        assert h.fake().activations("coder") == 1
        coder.result.release()


async def test_swap_failure_propagates(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_activator([SPEC], router_name=ROUTER) as h:
        h.fake().fail_activate["coder"] = RuntimeError("api down")
        with caplog.at_level(logging.ERROR), pytest.raises(SwapFailed) as info:
            await h.activator.acquire("coder")
        assert not isinstance(info.value, HoldTimeout)
        assert info.value.reason == "error" and info.value.code == "pool_swap_failed"
        assert "api down" in str(info.value)
        assert [r.getMessage() for r in caplog.records] == ["model pool swap failed"]
        assert (
            h.sample(
                "llmkube_modelpool_swap_failures_total",
                member="coder",
                pool=POOL,
                reason="error",
                router=ROUTER,
            )
            == 1
        )


async def test_self_heals_stale_resident(autojump_clock: trio.testing.MockClock) -> None:
    pool = PoolSpec(POOL, ("gemma", "coder"))
    async with running_activator([pool], resync_interval=0.0) as h:
        (await h.activator.acquire("gemma")).release()
        assert h.fake().activations("gemma") == 1
        # Behind our back: gemma goes "Terminating", coder becomes Ready.
        h.fake().force("gemma", up=False)
        h.fake().force("coder", up=True)
        with await h.activator.acquire("gemma"):
            assert h.fake().activations("gemma") == 2  # the corrective swap
        assert h.pool()["resident"] == "gemma"


async def test_invalidate_resident_forces_recheck(autojump_clock: trio.testing.MockClock) -> None:
    pool = PoolSpec(POOL, ("gemma", "coder"))
    async with running_activator([pool], resync_interval=3600.0) as h:
        (await h.activator.acquire("gemma")).release()
        h.fake().force("gemma", up=False)
        h.fake().force("coder", up=True)
        (await h.activator.acquire("gemma")).release()  # the belief is trusted
        assert h.fake().activations("gemma") == 1
        h.activator.invalidate_resident(POOL)
        (await h.activator.acquire("gemma")).release()
        assert h.fake().activations("gemma") == 2
        h.activator.invalidate_resident("no-such-pool")  # unknown pool: no-op


async def test_if_idle_skips_busy_incumbent(autojump_clock: trio.testing.MockClock) -> None:
    async with running_activator([SPEC], router_name=ROUTER) as h:
        judge = await h.activator.acquire("judge")
        start = trio.current_time()
        with pytest.raises(IncumbentBusy) as info:
            await h.activator.acquire("coder", "if_idle")
        assert trio.current_time() - start < 0.5
        assert info.value.code == "pool_incumbent_busy" and info.value.retry_after == 5
        assert h.fake().activations("coder") == 0
        snap = h.pool()
        assert snap["resident"] == "judge" and snap["swapping"] is False
        assert snap["held_total"] == 0
        assert (
            h.sample("llmkube_modelpool_busy_skips_total", member="coder", pool=POOL, router=ROUTER)
            == 1
        )
        judge.release()
        with await h.activator.acquire("coder", "if_idle"):
            assert h.fake().activations("coder") == 1


async def test_if_idle_waits_on_in_flight_swap(autojump_clock: trio.testing.MockClock) -> None:
    async with running_activator([SPEC], ready=["judge"]) as h:
        gate = h.fake().activate_gate["coder"] = trio.Event()
        waiter = start_acquire(h, "coder", "wait")
        await settle()
        assert h.pool()["activating"] == "coder"
        if_idle = start_acquire(h, "coder", "if_idle")
        await trio.sleep(0.05)
        assert waiter.blocked and if_idle.blocked
        gate.set()
        await waiter.done.wait()
        await if_idle.done.wait()
        assert waiter.result is not None and if_idle.result is not None
        assert h.fake().activations("coder") == 1


# ---- the #1837 fix: the two regression tests ---------------------------------------------------


async def test_stale_deactivate_window(autojump_clock: trio.testing.MockClock) -> None:
    """docs/activator.md, Tests: the stale-deactivate window. FAILS if the re-check is removed from
    the deferred deactivate, i.e. if `_deactivate_if_unwanted` in stargate/activator/pool.py patches
    without consulting `deactivate_skip_reason` (the stale Deactivate lands: Deactivate(coder) is
    called once and W2's swap never completes)."""
    windows: list[str] = []
    hook_done = trio.Event()

    async with running_activator([SPEC], ready=["judge"], default_ready_delay=None) as h:
        fake = h.fake()
        w2: list[Pending] = []

        async def before_deactivate(pool: str, member: str) -> None:
            # Exactly the window the unfixed code lost: W1's deactivate was decided, not applied.
            if member != "coder" or w2:
                return
            windows.append(member)
            w2.append(start_acquire(h, "coder", hold_budget=3600.0))
            await settle()
            snap = h.pool()
            assert snap["held"].get("coder") == 1
            assert snap["activating"] == "coder" and snap["swap_generation"] == 2
            assert fake.activations("coder") == 2  # a no-op by check: replicas already 1
            hook_done.set()

        h.activator.before_deactivate = before_deactivate
        # W1: coder's availability is gated (activate scales to 1, Ready never comes by itself).
        with pytest.raises(HoldTimeout):
            await h.activator.acquire("coder", hold_budget=1.0)
        await hook_done.wait()
        await settle()
        assert windows == ["coder"]
        assert fake.deactivations("coder") == 0
        assert fake.replicas["coder"] == 1
        assert h.pool()["deactivates_skipped"] == 1
        fake.make_ready("coder")  # the gate opens
        (pending,) = w2
        await pending.done.wait()
        assert pending.error is None and pending.result is not None
        assert h.pool()["resident"] == "coder"
        pending.result.release()


async def test_abandoned_at_deadline(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/activator.md, Tests: the abandoned swap. FAILS if the swap runs without a deadline, i.e.
    if `_start_swap` in stargate/activator/pool.py creates `trio.CancelScope()` instead of
    `trio.CancelScope(deadline=deadline)`: the caller then burns its whole 2 s hold and gets
    `HoldTimeout`, and the pool stays in `swapping` until the last waiter leaves."""
    async with running_activator([spec(swap_budget=0.1)], ready=["judge"], router_name=ROUTER) as h:
        fake = h.fake()
        fake.ready_delay["coder"] = None  # Activate succeeds, Ready never comes
        start = trio.current_time()
        with caplog.at_level(logging.ERROR), pytest.raises(SwapFailed) as info:
            await h.activator.acquire("coder", hold_budget=2.0)
        assert not isinstance(info.value, HoldTimeout)
        assert "abandoned" in str(info.value) and info.value.reason == "deadline"
        assert trio.current_time() - start == pytest.approx(0.1)
        snap = h.pool()
        assert snap["swapping"] is False and snap["activating"] is None
        assert fake.deactivations("coder") >= 1
        assert fake.replicas["coder"] == 0
        # The resident's fast path is open at once: no wait, no Activate.
        before = trio.current_time()
        with await h.activator.acquire("judge", hold_budget=0.001):
            assert trio.current_time() == before
        assert fake.activations("judge") == 0
        assert (
            h.sample(
                "llmkube_modelpool_swap_failures_total",
                member="coder",
                pool=POOL,
                reason="deadline",
                router=ROUTER,
            )
            == 1
        )
        abandoned = [r for r in caplog.records if r.getMessage() == "model pool swap abandoned"]
        assert len(abandoned) == 1 and abandoned[0].levelno == logging.ERROR
        assert abandoned[0].__dict__["pool"] == POOL
        assert abandoned[0].__dict__["member"] == "coder"
        assert abandoned[0].__dict__["reason"] == "deadline"


async def test_superseded_swap_does_not_clear_newer_swap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """docs/activator.md, Tests: the superseded swap. Unreachable through the public API here (a new
    swap only starts after the old task cleared its own state), so the stale completion is driven
    directly: a finished task of generation 1 must leave generation 2's state alone
    (docs/activator.md, F2)."""
    from stargate.activator.state import SwapOutcome, SwapState

    async with running_activator([SPEC], ready=["judge"]) as h:
        h.fake().activate_gate["coder"] = trio.Event()
        waiter = start_acquire(h, "coder")
        await settle()
        pool = h.activator._pools[POOL]
        current = pool.state.swap
        assert current is not None and current.gen == 1
        pool.state.swap_gen = 2  # pretend a newer swap owns the state
        current.gen = 2
        stale = SwapState(1, "coder", "judge", 0.0, 1.0, 0.0)
        await h.activator._finish_swap(pool, stale, SwapOutcome.SUCCESS, None, 0.0)
        snap = h.pool()
        assert snap["swapping"] is True and snap["activating"] == "coder"
        assert snap["resident"] == "judge"
        waiter.scope.cancel()


# ---- stargate additions ------------------------------------------------------------------------


async def test_cancelled_swap_is_quiet(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """F5 (docs/activator.md): the last waiter leaving cancels the swap with no log, no counter and
    no swap error."""
    async with running_activator([SPEC], ready=["judge"], router_name=ROUTER) as h:
        h.fake().activate_gate["coder"] = trio.Event()
        waiter = start_acquire(h, "coder")
        await trio.sleep(1.0)
        with caplog.at_level(logging.WARNING):
            waiter.scope.cancel()
            await settle()
        assert caplog.records == []
        snap = h.pool()
        assert snap["swapping"] is False and snap["swap_errors"] == {}
        assert snap["resident"] == "judge"
        assert (
            h.sample(
                "llmkube_modelpool_swap_failures_total",
                member="coder",
                pool=POOL,
                reason="deadline",
                router=ROUTER,
            )
            == 0
        )
        assert h.fake().deactivations("coder") == 1


async def test_swap_error_is_one_shot(autojump_clock: trio.testing.MockClock) -> None:
    """docs/activator.md: only the first waiter sees a failure; the others start a fresh swap."""
    async with running_activator([spec(swap_budget=1.0)], ready=["judge"]) as h:
        h.fake().ready_delay["coder"] = None
        waiters = [start_acquire(h, "coder", hold_budget=1.5) for _ in range(2)]
        for w in waiters:
            await w.done.wait()
        errors = sorted(type(w.error).__name__ for w in waiters)
        assert errors == ["HoldTimeout", "SwapFailed"]
        assert h.fake().activations("coder") == 2


async def test_cancelled_while_granted_does_not_strand_count(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_activator([SPEC], ready=["judge"]) as h:
        gate = h.fake().activate_gate["coder"] = trio.Event()
        waiter = start_acquire(h, "coder")
        await settle()
        gate.set()
        waiter.scope.cancel()  # cancelled in the same step that makes coder resident
        await settle()
        assert waiter.result is None
        assert h.pool()["in_flight"] == {} and h.pool()["held_total"] == 0


async def test_double_release_is_a_logged_noop(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_activator([SPEC]) as h:
        first = await h.activator.acquire("judge")
        second = await h.activator.acquire("judge")
        first.release()
        with caplog.at_level(logging.WARNING):
            first.release()
        assert [r.getMessage() for r in caplog.records] == ["model pool grant released twice"]
        assert h.pool()["in_flight"] == {"judge": 1}  # the other request keeps its count
        second.release()


async def test_pool_queue_full(autojump_clock: trio.testing.MockClock) -> None:
    from stargate.activator import PoolQueueFull

    async with running_activator([spec(max_held=2)], ready=["judge"]) as h:
        busy = await h.activator.acquire("judge")
        held = [start_acquire(h, "coder") for _ in range(2)]
        await settle()
        with pytest.raises(PoolQueueFull) as info:
            await h.activator.acquire("coder")
        assert info.value.status == 503 and info.value.code == "pool_queue_full"
        with await h.activator.acquire("judge"):  # the resident is still served
            pass
        busy.release()
        for p in held:
            await p.done.wait()
            assert p.result is not None
            p.result.release()


async def test_hung_deactivate_is_bounded_and_other_pools_run(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    other = PoolSpec("other", ("a", "b"))
    async with running_activator(
        [spec(swap_budget=1.0), other], ready=["judge"], controller_timeout=2.0
    ) as h:
        fake = h.fake(POOL)
        fake.ready_delay["coder"] = None
        fake.hang_deactivate.add("coder")
        start = trio.current_time()
        with caplog.at_level(logging.WARNING), pytest.raises(SwapFailed):
            await h.activator.acquire("coder", hold_budget=5.0)
        # Abandoned at 1 s; its deactivate hung under the pool lock until controller_timeout.
        assert trio.current_time() - start == pytest.approx(3.0)
        # Other pools never waited on it.
        t0 = trio.current_time()
        with await h.activator.acquire("a"):
            assert trio.current_time() == t0
        # The waiter's own deferred deactivate hangs too; the pool is blocked at most that long.
        with await h.activator.acquire("judge", hold_budget=10.0):
            assert trio.current_time() - t0 <= 2.0
        messages = [r.getMessage() for r in caplog.records]
        assert "model pool deactivate after abandoned swap failed" in messages
        assert "model pool deactivate failed" in messages


async def test_deferred_deactivate_skips_when_member_became_resident(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A cancelled swap that had already succeeded: the deactivate must skip (resident == m)."""
    async with running_activator([SPEC], ready=["judge"]) as h:
        release_hook = trio.Event()

        async def hook(pool: str, member: str) -> None:
            await release_hook.wait()

        h.activator.before_deactivate = hook
        h.fake().ready_delay["coder"] = 1.0
        # if_idle on a busy incumbent schedules a (harmless) deactivate (docs/activator.md).
        busy = await h.activator.acquire("judge")
        with pytest.raises(IncumbentBusy):
            await h.activator.acquire("coder", "if_idle")
        busy.release()
        with await h.activator.acquire("coder"):
            pass
        release_hook.set()
        await settle()
        assert h.fake().deactivations("coder") == 0
        assert h.pool()["deactivates_skipped"] == 1


async def test_acquire_errors_for_unknown_member_and_not_running() -> None:
    from stargate.activator import Activator, FakeController, MemberAvailability, UnknownMember

    availability = MemberAvailability()
    activator = Activator([SPEC], {POOL: FakeController(availability)}, availability)
    assert activator.pool_of("coder") == POOL and activator.pool_of("x") is None
    with pytest.raises(UnknownMember):
        await activator.acquire("x")
    with pytest.raises(RuntimeError):
        await activator.acquire("coder")
    with pytest.raises(ValueError):
        Activator(
            [SPEC, PoolSpec("p2", ("coder",))], {POOL: FakeController(availability)}, availability
        )
    with pytest.raises(ValueError):
        Activator([SPEC], {}, availability)


def test_swap_deadline_and_hold_fallbacks() -> None:
    from stargate.activator import Activator, FakeController, MemberAvailability

    availability = MemberAvailability()
    pools = [spec(swap_budget=None, name="a", members=("x",)), spec(name="b", members=("y",))]
    fakes = {"a": FakeController(availability), "b": FakeController(availability)}
    activator = Activator(pools, fakes, availability, response_header_timeout=30.0)
    assert activator.swap_deadline("a") == 60.0  # 2 x the configured header timeout
    assert activator.swap_deadline("b") == 300.0
    assert activator.hold_budget("x") == 30.0
    assert activator.hold_budget("y") == 300.0
