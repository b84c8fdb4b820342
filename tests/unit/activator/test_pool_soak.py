"""Invariant soak: seeded random interleavings over several pools, checked after every step.

Operations: acquires in both modes with random hold budgets, releases (some doubled), caller
cancels, time passing (hold expiries, swap deadlines), members that become Ready after a delay or
never, activate errors and hangs, deactivate errors and hangs, members crashing behind the
activator's back, and `invalidate_resident`. After every step, once every task is blocked:

1. at most one resident-or-activating member per pool: the activator's swap target is never the
   believed resident, and in the fake world (an exclusive operator) at most one member is up and
   at most one is Ready;
2. no swap outlives its deadline (plus the bounded wait for the pool lock: one controller timeout
   per queued deactivate);
3. every waiter ends with a grant or a typed error within its hold budget (the caller's own
   cancels end at once), and the activator's held / in-flight counts equal the driver's books;
4. once no swap runs, a request for a Ready resident is granted at once (no time passes).

`STARGATE_SOAK_OPS` and `STARGATE_SOAK_SEEDS` scale it up (default: 10,000 ops, one seed).
"""

from __future__ import annotations

import os
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from stargate.activator import (
    Grant,
    HoldTimeout,
    IncumbentBusy,
    PoolMemberUnavailable,
    PoolQueueFull,
    PoolSpec,
    SwapFailed,
)
from stargate.activator.testing import Harness, running_activator

OPS = int(os.environ.get("STARGATE_SOAK_OPS", "10000"))
SEEDS = [int(s) for s in os.environ.get("STARGATE_SOAK_SEEDS", "1837").split(",")]

RESPONSE_HEADER_TIMEOUT = 1.0
CONTROLLER_TIMEOUT = 0.5
POOLS = [
    PoolSpec("p0", ("a0", "b0"), swap_budget=0.5),
    PoolSpec("p1", ("a1", "b1", "c1"), swap_budget=1.5, default_mode="if_idle"),
    PoolSpec("p2", ("a2", "b2"), swap_budget=None, max_held=4),  # deadline 2 x 1.0 s
    PoolSpec("p3", ("a3", "b3", "c3"), swap_budget=3.0, hold_budget=1.0),
]
MEMBERS = [(spec, m) for spec in POOLS for m in spec.members]
# PoolMemberUnavailable: the member's breaker is open after failed swaps in a row (the injected
# controller errors and hangs trip it; docs/activator.md, "Breaker").
ALLOWED_ERRORS = (HoldTimeout, SwapFailed, IncumbentBusy, PoolQueueFull, PoolMemberUnavailable)


@dataclass
class Request:
    member: str
    pool: str
    mode: str | None
    hold: float
    started: float
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    grant: Grant | None = None
    error: BaseException | None = None
    cancelled_at: float | None = None
    finished: float | None = None


@dataclass
class Stats:
    outcomes: Counter[str] = field(default_factory=Counter)
    ops: Counter[str] = field(default_factory=Counter)
    probes: int = 0
    stale_window_deactivates: int = 0  # deactivates during a *cancelled* swap toward m (allowed)
    violations: list[object] = field(default_factory=list)
    max_swap_overrun: float = 0.0


async def soak(seed: int, ops: int) -> Stats:
    rng = random.Random(seed)
    stats = Stats()
    async with running_activator(
        POOLS,
        exclusive=True,
        response_header_timeout=RESPONSE_HEADER_TIMEOUT,
        resync_interval=1.0,
        controller_timeout=CONTROLLER_TIMEOUT,
    ) as h:
        # Widen the deferred deactivate's window (upstream: goroutine scheduling plus an API GET)
        # with the test-only hook, so a new swap toward the member can start inside it.
        async def before_deactivate(pool: str, member: str) -> None:
            await trio.sleep(rng.choice([0.0, 0.0, 0.01, 0.1, 0.4]))

        h.activator.before_deactivate = before_deactivate

        def observe(pool: str, method: str, member: str) -> None:
            # 1b. No Deactivate(m) lands while a live (not cancelled) swap toward m runs: that is
            # exactly the #1837 stale deactivate undoing a newer activation.
            if method != "deactivate":
                return
            # (Recorded, not raised: the activator logs controller errors and carries on.)
            swap = h.activator.snapshot()[pool]["swap"]
            if swap is not None and swap["to"] == member:
                if swap["cancel_reason"] is None:
                    stats.violations.append(("stale deactivate", pool, member, swap))
                stats.stale_window_deactivates += 1

        for spec in POOLS:
            h.fake(spec.name).on_call = lambda method, member, pool=spec.name: observe(
                pool, method, member
            )
        requests: list[Request] = []
        pending: list[Request] = []  # not finished
        granted: list[Request] = []  # finished with a grant not yet released

        def spawn(member: str, pool: str) -> None:
            mode = rng.choice([None, "wait", "wait", "if_idle"])
            hold = rng.choice([0.05, 0.3, 1.0, 3.0, -1.0])
            req = Request(
                member,
                pool,
                mode,
                h.activator.hold_budget(member) if hold < 0 else hold,
                trio.current_time(),
            )

            async def run() -> None:
                with req.scope:
                    try:
                        req.grant = await h.activator.acquire(
                            member,
                            mode,  # type: ignore[arg-type]
                            hold_budget=None if hold < 0 else hold,
                        )
                    except ALLOWED_ERRORS as exc:
                        req.error = exc
                req.finished = trio.current_time()

            requests.append(req)
            pending.append(req)
            h.nursery.start_soon(run)

        for _ in range(ops):
            op = rng.choices(
                ["acquire", "release", "cancel", "sleep", "script", "crash", "invalidate"],
                weights=[40, 25, 5, 20, 6, 2, 2],
            )[0]
            stats.ops[op] += 1
            spec, member = rng.choice(MEMBERS)
            fake = h.fake(spec.name)
            if op == "acquire":
                for _ in range(rng.choice([1, 1, 1, 2, 4])):
                    spawn(member, spec.name)
            elif op == "release" and granted:
                req = granted.pop(rng.randrange(len(granted)))
                assert req.grant is not None
                req.grant.release()
                if rng.random() < 0.05:
                    req.grant.release()  # a logged no-op
            elif op == "cancel" and pending:
                req = rng.choice(pending)
                req.cancelled_at = trio.current_time()
                req.scope.cancel()
            elif op == "sleep":
                await trio.sleep(rng.choice([0.001, 0.01, 0.1, 0.25, 0.6, 1.5]))
            elif op == "script":
                what = rng.randrange(6)
                if what == 0:
                    fake.ready_delay[member] = rng.choice([0.0, 0.05, 0.2, 0.8, 2.5, None])
                elif what == 1:
                    if member in fake.fail_activate:
                        del fake.fail_activate[member]
                    else:
                        fake.fail_activate[member] = RuntimeError("activate failed")
                elif what == 2:
                    fake.hang_activate ^= {member}
                elif what == 3:
                    fake.hang_deactivate ^= {member}
                elif what == 4:
                    if member in fake.fail_deactivate:
                        del fake.fail_deactivate[member]
                    else:
                        fake.fail_deactivate[member] = RuntimeError("deactivate failed")
                else:  # heal everything for this member
                    fake.ready_delay.pop(member, None)
                    fake.fail_activate.pop(member, None)
                    fake.fail_deactivate.pop(member, None)
                    fake.hang_activate.discard(member)
                    fake.hang_deactivate.discard(member)
            elif op == "crash":
                fake.force(member, up=False)
            elif op == "invalidate":
                h.activator.invalidate_resident(spec.name)

            await trio.testing.wait_all_tasks_blocked()
            # Book-keeping: move finished requests.
            for req in [r for r in pending if r.finished is not None]:
                pending.remove(req)
                if req.grant is not None:
                    granted.append(req)
                    stats.outcomes["granted"] += 1
                elif req.error is not None:
                    name = type(req.error).__name__
                    if isinstance(req.error, SwapFailed):
                        name += f"[{req.error.reason}]"
                    stats.outcomes[name] += 1
                else:
                    stats.outcomes["cancelled"] += 1
            check_invariants(h, pending, granted, stats)
            await probe_residents(h, stats)

        # Drain: release everything, cancel every waiter, let every swap end.
        for req in granted:
            assert req.grant is not None
            req.grant.release()
        for req in pending:
            req.scope.cancel()
        for fake in h.fakes.values():
            fake.hang_activate.clear()
            fake.hang_deactivate.clear()
        await trio.sleep(10.0)
        await trio.testing.wait_all_tasks_blocked()
        for name, snap in h.activator.snapshot().items():
            assert snap["swapping"] is False, name
            assert snap["held_total"] == 0 and snap["in_flight"] == {}, name
            assert snap["pending_deactivates"] == [] and snap["locked"] is False, name
        stats.outcomes["swaps_started"] = sum(
            snap["swaps_started"] for snap in h.activator.snapshot().values()
        )
        stats.outcomes["deactivates_skipped"] = sum(
            snap["deactivates_skipped"] for snap in h.activator.snapshot().values()
        )
        stats.outcomes["virtual_seconds"] = int(trio.current_time())
        stats.outcomes["requests"] = len(requests)
    return stats


def check_invariants(
    h: Harness, pending: list[Request], granted: list[Request], stats: Stats
) -> None:
    assert not stats.violations, stats.violations[:3]
    now = trio.current_time()
    snapshot = h.activator.snapshot()
    for spec in POOLS:
        snap = snapshot[spec.name]
        fake = h.fake(spec.name)
        # 1. at most one resident or activating member.
        assert snap["activating"] is None or snap["activating"] != snap["resident"], snap
        assert len(fake.up_members()) <= 1, fake.replicas
        assert sum(h.availability.is_available(m) for m in spec.members) <= 1
        # 2. no swap outlives its deadline (plus a bounded wait for the pool lock).
        swap = snap["swap"]
        if swap is not None:
            overrun = now - swap["deadline"]
            stats.max_swap_overrun = max(stats.max_swap_overrun, overrun)
            assert overrun <= (len(spec.members) + 1) * CONTROLLER_TIMEOUT + 1e-9, (spec.name, swap)
        # 3. counts equal the driver's books.
        expected_held = Counter(r.member for r in pending if r.pool == spec.name)
        assert snap["held"] == dict(expected_held), (spec.name, snap["held"], expected_held)
        expected_inflight = Counter(
            r.member
            for r in granted
            if r.pool == spec.name and not r.grant.released  # type: ignore[union-attr]
        )
        assert snap["in_flight"] == dict(expected_inflight), (spec.name, snap["in_flight"])
    # 3. every waiter ends within its hold budget; a cancelled one ends at its cancel.
    for req in pending:
        assert now - req.started <= req.hold + 1e-9, req
        assert req.cancelled_at is None, req
    for req in granted:
        assert req.finished is not None and req.finished - req.started <= req.hold + 1e-9, req


async def probe_residents(h: Harness, stats: Stats) -> None:
    """4. Once no swap runs, a request for the (Ready) resident is granted at once."""
    for name, snap in h.activator.snapshot().items():
        resident = snap["resident"]
        if (
            snap["swapping"]
            or snap["locked"]
            or resident is None
            or not h.availability.is_available(resident)
            or resident in snap["swap_errors"]
        ):
            continue
        before = trio.current_time()
        grant = await h.activator.acquire(resident, "if_idle", hold_budget=1e-6)
        assert trio.current_time() == before, name
        assert grant.member == resident
        grant.release()
        stats.probes += 1
    await trio.testing.wait_all_tasks_blocked()


@pytest.mark.parametrize("seed", SEEDS)
async def test_soak_invariants(seed: int, autojump_clock: trio.testing.MockClock) -> None:
    stats = await soak(seed, OPS)
    print(f"\nsoak seed={seed} ops={sum(stats.ops.values())} {dict(stats.ops)}")
    print(f"outcomes {dict(stats.outcomes)} probes={stats.probes}")
    print(f"max swap overrun past deadline {stats.max_swap_overrun:.3f}s")
    print(f"deactivates during a cancelled swap to the member: {stats.stale_window_deactivates}")
    assert sum(stats.ops.values()) >= min(OPS, 10_000)
    # The run must actually exercise every path.
    for outcome in (
        "granted",
        "HoldTimeout",
        "SwapFailed[deadline]",
        "SwapFailed[error]",
        "IncumbentBusy",
        "PoolQueueFull",
        "cancelled",
    ):
        assert stats.outcomes[outcome] > 0, (outcome, stats.outcomes)
    assert stats.probes > 0
