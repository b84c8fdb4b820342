"""Three replicas sharing one model pool through a Lease, in process, under `MockClock`.

Each simulated replica is the real thing minus HTTP between replicas: a `LeaseOwnership` and a
`KubernetesController` over its own in-memory transport to one shared fake API server (client
host = the replica's name, so one replica can be partitioned), and an `Activator` with that
ownership. A request on replica R for member M acquires locally, or, on `PoolOwnedElsewhere`,
is relayed to the owner the error names, following `OwnerRelay`'s rules
(stargate/proxy/owner_relay.py): the owner runs its own `acquire`, an unreachable owner or one
that answers "moved" is retried at the next ownership change within the hold budget, the hold
budget is counted once. A granted request holds its grant for a service time, then releases it.
Engines: a member is available once the fake API has shown it scaled to >= 1 for a start-up
delay; scaled to 0, it is gone at once.

Invariants, checked at every API request (the fake server's handler is wrapped), at every
ownership change and every 50 mock ms (docs/pool-ownership.md):

1. no scale-down of a member while a request holds a grant for it anywhere in the fleet;
2. at most one member of the pool is scaled up;
3. at most one live replica's ownership says `is_self`, and only the one the stored Lease names;
   and only that replica talks to the members' workloads (every controller request, read or
   write, comes from a replica whose ownership says `is_self` at that instant, sent before its
   renew deadline: last successful Lease write + renew deadline);
4. no swap outlives its deadline (plus the bounded wait for the pool lock).

At the end of every test: no wedge (a request for each member is granted within the swap
deadline plus the hold budget), counts balance (every request granted, refused with a documented
error or cancelled), the ledger of granted requests is empty and every activator is idle.

Service times stay below lease duration - renew deadline (1 s here): a partitioned owner stops
granting at its renew deadline and the next owner cannot decide before the lease duration, so
its in-flight requests end first (docs/pool-ownership.md, "Limit", is then never hit).

`STARGATE_SHARED_SOAK_OPS` and `STARGATE_SHARED_SOAK_SEEDS` scale the soak (default 5,000 ops).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import pytest
import trio
import trio.testing
from trio.testing import MockClock

from stargate.activator import (
    ActivatorError,
    ActivatorStopped,
    Grant,
    MemberAvailability,
    PoolOwnedElsewhere,
    PoolSpec,
    SwapFailed,
)
from stargate.activator.kubernetes import ApiConfig, KubernetesController, KubernetesTarget
from stargate.activator.lease import LeaseTimings, lease_name
from stargate.activator.lease_ownership import LeaseOwnership
from stargate.activator.pool import Activator
from stargate.activator.waiting import BreakerPolicy
from tests.fakes.kube_api import NS, TOKEN, FakeApiServer

POOL = "gpu0"
MEMBERS = ("m0", "m1", "m2")
NAMES = ("r0", "r1", "r2")
LEASE = lease_name("stargate", POOL)
TIMINGS = LeaseTimings(lease_duration=3.0, renew_deadline=2.0, retry_period=0.5)
SWAP_BUDGET = 4.0
HOLD_BUDGET = 8.0
RESPONSE_HEADER_TIMEOUT = 2.0
CONTROLLER_TIMEOUT = 1.0
RELAY_LATENCY = (0.001, 0.02)
API_LATENCY = (0.0002, 0.002)  # each way
SERVICE_TIME = (0.01, 0.8)  # < lease_duration - renew_deadline (module docstring)
SPEC = PoolSpec(POOL, MEMBERS, swap_budget=SWAP_BUDGET, hold_budget=HOLD_BUDGET)
API = ApiConfig(server="http://kube.test", token=TOKEN)
WORKLOADS = f"/apis/apps/v1/namespaces/{NS}/deployments/"
LEASE_PATH = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"

OPS = int(os.environ.get("STARGATE_SHARED_SOAK_OPS", "5000"))
SEEDS = [int(s) for s in os.environ.get("STARGATE_SHARED_SOAK_SEEDS", "1837").split(",")]

# Every way a request may end (module docstring, "counts balance"); anything else fails a test.
DOCUMENTED = frozenset(
    {
        "served",  # granted here (or by the owner, relayed), held, released
        "HoldTimeout",  # 503 pool_activation_timeout
        "SwapFailed[deadline]",  # 502 pool_swap_failed (abandoned)
        "SwapFailed[error]",  # 502 pool_swap_failed (a controller error)
        "IncumbentBusy",  # 503 pool_incumbent_busy
        "PoolMemberUnavailable",  # 503 pool_member_unavailable: its breaker is open
        "NoPoolOwner",  # 503 pool_owner_unavailable
        "PoolOwnerMoved",  # 503 pool_owner_moved
        "relay_failed",  # 502 pool_relay_failed: the owner's head came too late
        "relay_broken",  # the owner died mid-body: the client's response is cut
        "cancelled",  # the client left
        "crashed",  # the replica the client talked to died
    }
)


def outcome_of(error: ActivatorError) -> str:
    if isinstance(error, SwapFailed):
        return f"SwapFailed[{error.reason}]"
    return type(error).__name__


# ---- the fake API server, watched -------------------------------------------------------------


class SharedApi(FakeApiServer):
    """The fake API server with a hook around every request (the invariant checks and the engine
    model live in `World`), a small random latency each way (so that a controller call spans
    checkpoints and can be interleaved and cut short, as over a network), and `sent`: when each
    request was sent (the in-memory transport delivers it to this wrapper at once)."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng
        self.before: Callable[[str, str, str | None, Any], None] | None = None
        self.after: Callable[[str, str, str | None, Any, int, float], None] | None = None
        self.sent: list[tuple[float, str | None, str, str, Any]] = []

    async def _handle(
        self, method: str, path: str, headers: dict[str, str], raw: bytes, host: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        body = json.loads(raw) if raw else None
        sent = trio.current_time()
        self.sent.append((sent, host, method, path, body))
        if self.before is not None:
            self.before(method, path, host, body)
        await trio.sleep(self.rng.uniform(*API_LATENCY))
        code, answer = await super()._handle(method, path, headers, raw, host)
        if self.after is not None:
            self.after(method, path, host, body, code, sent)
        await trio.sleep(self.rng.uniform(*API_LATENCY))
        return code, answer


# ---- one replica -------------------------------------------------------------------------------


class Replica:
    """One incarnation of a replica: its lease elector, controller and activator, and the requests
    it serves, all in one nursery (cancelling it is a crash: nothing released, connections cut)."""

    def __init__(self, world: World, name: str, incarnation: int) -> None:
        self.world = world
        self.name = name
        self.incarnation = incarnation
        self.address = f"http://{name}:8000"
        self.lease = LeaseOwnership(
            [POOL],
            identity=name,
            owner_url=self.address,
            namespace=NS,
            api=API,
            timings=TIMINGS,
            transport=world.api.transport(name),
            rng=random.Random(f"{name}-{incarnation}-{world.seed}"),
        )
        self.client = httpx.AsyncClient(transport=world.api.transport(name))
        self.controller = KubernetesController(
            POOL,
            NS,
            {m: KubernetesTarget("Deployment", m) for m in MEMBERS},
            API,
            client=self.client,
            request_timeout=CONTROLLER_TIMEOUT,
        )
        self.activator = Activator(
            [SPEC],
            {POOL: self.controller},
            world.availability,
            router_name=name,
            response_header_timeout=RESPONSE_HEADER_TIMEOUT,
            resync_interval=1.0,
            controller_timeout=CONTROLLER_TIMEOUT,
            ownership=self.lease,
        )
        self.alive = False
        self.leaving = False
        self.scope = trio.CancelScope()
        self.requests: trio.Nursery | None = None

    async def life(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.scope:
            try:
                async with trio.open_nursery() as system:
                    await system.start(self.lease.run)
                    await system.start(self.activator.run)
                    system.start_soon(self.world.follow, self)
                    async with trio.open_nursery() as requests:
                        self.requests = requests
                        self.alive = True
                        task_status.started()
                        await trio.sleep_forever()
            finally:
                self.alive = False
                self.requests = None
                self.world.retire(self)

    def crash(self) -> None:
        """Die now: no release, every request cut."""
        self.alive = False
        self.requests = None
        self.scope.cancel()

    def is_self(self) -> bool:
        return self.alive and self.lease.owner(POOL).is_self


# ---- the fleet ---------------------------------------------------------------------------------


@dataclass
class Request:
    member: str
    on: str
    started: float
    outcome: str | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    relays: int = 0
    granted_at: float | None = None


@dataclass
class RelayCall:
    """One relayed request as the follower sees it: the owner's head (grant or refusal), then the
    end of its body."""

    member: str
    request: Request
    head: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    answer: str | None = None  # "granted", "moved", "unreachable" or a refusal's outcome
    completed: bool = False
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class World:
    """Three replicas, one fake API server, the engines, the ledger and the invariant checks."""

    def __init__(self, nursery: trio.Nursery, seed: int, rng: random.Random) -> None:
        self.nursery = nursery
        self.seed = seed
        self.rng = rng
        self.api = SharedApi(random.Random(f"api-{seed}"))
        self.api.before = self._before
        self.api.after = self._after
        self.availability = MemberAvailability()
        self.paths: dict[str, str] = {}  # scale path -> member
        for member in MEMBERS:
            self.paths[self.api.add_workload("deployments", member, 0)] = member
        self.replicas: dict[str, Replica] = {}
        self.incarnations: dict[str, int] = Counter()
        self.retired: list[Replica] = []
        self.ledger: Counter[str] = Counter()  # member -> granted, not released, fleet-wide
        self.violations: list[str] = []
        self.outcomes: Counter[str] = Counter()
        self.requests: list[Request] = []
        self.counts: Counter[str] = Counter()
        self.last_lease_write: dict[str, float] = {}  # host -> last 2xx lease write (sent)
        self.engine_epoch: Counter[str] = Counter()
        # Start-up delay of a member's engine (None: it never becomes available).
        self.startup: Callable[[str], float | None] = lambda member: 0.5
        self.on_applied: Callable[[str, str | None, int], None] | None = None
        self.gains: list[tuple[float, str]] = []
        self.owner_seen: str | None = None  # the last replica seen with is_self (for counting)
        self.swaps_retired = 0

    # ---- engines ------------------------------------------------------------------------------

    def force_up(self, member: str) -> None:
        """Start with `member` scaled up and its engine running."""
        path = next(p for p, m in self.paths.items() if m == member)
        self.api.objects[path.removesuffix("/scale")]["spec"]["replicas"] = 1
        self.availability.set_available(member, True)

    def up(self) -> list[str]:
        return [m for p, m in self.paths.items() if (self.api.replicas(p) or 0) >= 1]

    async def _start_engine(self, member: str, epoch: int, delay: float) -> None:
        await trio.sleep(delay)
        if self.engine_epoch[member] == epoch and member in self.up():
            self.availability.set_available(member, True)

    # ---- the checks -------------------------------------------------------------------------

    def violation(self, what: str) -> None:
        self.violations.append(f"{trio.current_time():.3f}: {what}")

    def live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.alive]

    def owners(self) -> list[str]:
        return [r.name for r in self.live() if r.is_self()]

    def check_ownership(self) -> None:
        owners = self.owners()
        if len(owners) > 1:
            self.violation(f"two replicas own the pool: {owners}")
        holder = self.api.lease_holder(LEASE)
        for name in owners:
            if name != holder:
                self.violation(f"{name} says is_self, the Lease names {holder!r}")
        if owners and owners[0] != self.owner_seen:
            self.counts["ownership_gains"] += 1
            self.owner_seen = owners[0]

    def check_swaps(self) -> None:
        now = trio.current_time()
        for replica in self.live():
            swap = replica.activator.snapshot()[POOL]["swap"]
            if swap is not None:
                overrun = now - swap["deadline"]
                # The lock may be held by one controller call per member queued before it.
                if overrun > (len(MEMBERS) + 1) * CONTROLLER_TIMEOUT + 1e-9:
                    self.violation(f"{replica.name}'s swap outlived its deadline: {swap}")

    def _before(self, method: str, path: str, host: str | None, body: Any) -> None:
        if path.startswith(WORKLOADS):
            # 3. Only the owner talks to the members, and only before its renew deadline.
            replica = self.replicas.get(host or "")
            if replica is None or not replica.is_self():
                self.violation(f"{method} {path} from {host}, which does not own the pool")
            last = self.last_lease_write.get(host or "", -math.inf)
            if trio.current_time() >= last + TIMINGS.renew_deadline:
                self.violation(
                    f"{method} {path} from {host} past its renew deadline (last renewal {last:.3f})"
                )
        self.check_ownership()

    def _after(
        self, method: str, path: str, host: str | None, body: Any, code: int, sent: float
    ) -> None:
        if path.startswith(LEASE_PATH) and method in ("POST", "PUT") and 200 <= code < 300:
            self.last_lease_write[host or ""] = max(
                self.last_lease_write.get(host or "", sent), sent
            )
        if method == "PATCH" and path in self.paths and code == 200:
            member = self.paths[path]
            replicas = self.api.replicas(path) or 0
            self.counts["scale_ups" if replicas else "scale_downs"] += 1
            if replicas == 0:
                # 1. Never under a granted request.
                if self.ledger[member]:
                    self.violation(
                        f"{host} scaled {member} down with {self.ledger[member]} granted"
                    )
                self.engine_epoch[member] += 1
                self.availability.set_available(member, False)
            elif not self.availability.is_available(member):
                self.engine_epoch[member] += 1
                delay = self.startup(member)
                if delay is not None:
                    self.nursery.start_soon(
                        self._start_engine, member, self.engine_epoch[member], delay
                    )
            # 2. At most one member up.
            if len(self.up()) > 1:
                self.violation(f"members up at once: {self.up()}")
            if self.on_applied is not None:
                self.on_applied(member, host, replicas)
        self.check_ownership()

    async def monitor(self) -> None:
        while True:
            self.check_ownership()
            self.check_swaps()
            await trio.sleep(0.05)

    async def follow(self, replica: Replica) -> None:
        while True:
            await replica.lease.changed(POOL).wait()
            self.counts["ownership_events"] += 1
            if replica.is_self():
                self.gains.append((trio.current_time(), replica.name))
            self.check_ownership()

    def gained_at(self, name: str) -> float:
        """When `name` last became the owner (its change event fires at that instant)."""
        return max(at for at, who in self.gains if who == name)

    # ---- replicas -----------------------------------------------------------------------------

    async def start(self, name: str) -> Replica:
        self.incarnations[name] += 1
        replica = Replica(self, name, self.incarnations[name])
        self.replicas[name] = replica
        await self.nursery.start(replica.life)
        self.check_ownership()
        return replica

    def retire(self, replica: Replica) -> None:
        self.retired.append(replica)
        self.swaps_retired += replica.activator.snapshot()[POOL]["swaps_started"]

    def crash(self, name: str) -> None:
        self.counts["crashes"] += 1
        self.replicas[name].crash()

    async def leave(self, name: str, drain: float = 30.0) -> None:
        """SIGTERM: stop acquiring, wait (bounded) until the pool is idle, release, exit."""
        replica = self.replicas[name]
        replica.leaving = True
        self.counts["graceful_leaves"] += 1
        replica.lease.stop_acquiring()
        with trio.move_on_after(drain) as waited:
            await replica.activator.wait_idle(POOL)
        if waited.cancelled_caught:
            self.counts["drain_timeouts"] += 1
            if replica.requests is not None:
                replica.requests.cancel_scope.cancel()  # exit cuts what is still in flight
            await trio.sleep(0.001)
        if replica.alive:
            await replica.lease.release(POOL)
        replica.crash()  # the process exits (everything was handed over above)

    async def close(self) -> None:
        for replica in [*self.retired, *self.replicas.values()]:
            await replica.lease.aclose()
            await replica.client.aclose()

    # ---- requests -----------------------------------------------------------------------------

    def request(self, on: str, member: str, mode: Literal["wait", "if_idle"] = "wait") -> Request:
        """A client request for `member` arriving at replica `on` (which must be alive)."""
        replica = self.replicas[on]
        req = Request(member, on, trio.current_time())
        self.requests.append(req)
        assert replica.requests is not None
        replica.requests.start_soon(self._serve_client, replica, req, mode)
        return req

    def finish(self, req: Request, outcome: str) -> None:
        if req.outcome is not None:
            self.violation(f"request {req} ended twice ({outcome})")
            return
        req.outcome = outcome
        self.outcomes[outcome] += 1
        if outcome not in DOCUMENTED:
            self.violation(f"undocumented outcome {outcome} for {req}")

    async def _serve_client(
        self, replica: Replica, req: Request, mode: Literal["wait", "if_idle"]
    ) -> None:
        outcome = "crashed"  # unless it ends otherwise: the replica died under it
        try:
            with req.scope:
                try:
                    grant = await replica.activator.acquire(req.member, mode)
                except PoolOwnedElsewhere as elsewhere:
                    outcome = await self._relay(replica, req, elsewhere)
                except ActivatorError as error:
                    outcome = outcome_of(error)
                except ActivatorStopped:
                    self.stopped(replica)
                else:
                    await self._hold(req, grant)
                    outcome = "served"
            if req.scope.cancelled_caught:
                outcome = "cancelled"
        finally:
            self.finish(req, outcome)

    def stopped(self, replica: Replica) -> None:
        """`ActivatorStopped` only while the replica goes down (its requests are being cut)."""
        if replica.alive:
            self.violation(f"ActivatorStopped on live replica {replica.name}")

    async def _hold(self, req: Request, grant: Grant) -> None:
        """The backend's work: the grant is counted in the fleet's ledger while it is held."""
        self.ledger[grant.member] += 1
        req.granted_at = trio.current_time()
        try:
            await trio.sleep(self.rng.uniform(*SERVICE_TIME))
        finally:
            self.ledger[grant.member] -= 1
            grant.release()

    async def _relay(self, follower: Replica, req: Request, elsewhere: PoolOwnedElsewhere) -> str:
        """`OwnerRelay.relay`, with a call into the owner's process instead of HTTP."""
        assert elsewhere.deadline is not None
        hold_deadline = elsewhere.deadline
        head_deadline = hold_deadline + RESPONSE_HEADER_TIMEOUT
        while True:
            event = follower.lease.changed(POOL)
            address = elsewhere.address
            answer = await self._attempt(address, req, head_deadline)
            if answer not in ("moved", "unreachable"):
                return answer
            owner = follower.lease.owner(POOL)
            if not (owner.is_self or (owner.address is not None and owner.address != address)):
                with trio.move_on_at(hold_deadline):
                    await event.wait()
            remaining = hold_deadline - trio.current_time()
            if remaining <= 0:
                return "PoolOwnerMoved" if answer == "moved" else "NoPoolOwner"
            try:
                grant = await follower.activator.acquire(req.member, hold_budget=remaining)
            except PoolOwnedElsewhere as again:
                elsewhere = again
                continue
            except ActivatorError as error:
                return outcome_of(error)
            except ActivatorStopped:
                self.stopped(follower)
                return "crashed"
            await self._hold(req, grant)
            return "served"

    async def _attempt(self, address: str, req: Request, head_deadline: float) -> str:
        owner = next((r for r in self.live() if r.address == address), None)
        if owner is None or owner.requests is None:
            return "unreachable"  # connection refused
        call = RelayCall(req.member, req)
        try:
            owner.requests.start_soon(self._serve_relayed, owner, call)
        except RuntimeError:  # its nursery is closing
            return "unreachable"
        try:
            with trio.move_on_at(head_deadline):
                await call.head.wait()
            if not call.head.is_set():
                return "relay_failed"  # no head in time: 502 pool_relay_failed
            if call.answer is None:
                return "unreachable"  # died before answering
            if call.answer != "granted":
                if call.answer not in ("moved", "unreachable"):
                    self.counts["relays"] += 1  # the owner's refusal is relayed as its answer
                return call.answer
            self.counts["relays"] += 1
            req.relays += 1
            await call.done.wait()
            return "served" if call.completed else "relay_broken"
        finally:
            call.scope.cancel()  # the connection closes (the client left, or it is over)

    async def _serve_relayed(self, owner: Replica, call: RelayCall) -> None:
        """The owner's side of a relayed request: its own acquire and hold budget, never relayed
        again (`PoolOwnerMoved` when it does not own the pool)."""
        try:
            with call.scope:
                await trio.sleep(self.rng.uniform(*RELAY_LATENCY))
                try:
                    grant = await owner.activator.acquire(call.member)
                except PoolOwnedElsewhere:
                    call.answer = "moved"
                    return
                except ActivatorStopped:
                    call.answer = "unreachable"
                    return
                except ActivatorError as error:
                    call.answer = outcome_of(error)
                    return
                call.answer = "granted"
                call.head.set()
                await self._hold(call.request, grant)
                call.completed = True
        finally:
            call.head.set()
            call.done.set()

    # ---- settling -----------------------------------------------------------------------------

    async def settled_owner(self, within: float = 30.0) -> Replica:
        """Wait until one live replica owns the pool and every live replica agrees."""
        with trio.fail_after(within):
            while True:
                owners = self.owners()
                if len(owners) == 1:
                    address = self.replicas[owners[0]].address
                    if all(
                        r.is_self() or r.lease.owner(POOL).address == address for r in self.live()
                    ):
                        return self.replicas[owners[0]]
                await trio.sleep(0.05)

    async def no_wedge(self) -> None:
        """4. After the load: a request for each member, on each replica, is granted within the
        swap deadline plus the hold budget. Replicas that are down come back first. A member
        whose breaker the faults opened answers 503 `pool_member_unavailable` until its cooldown
        ends (docs/activator.md, "Breaker"): that is no wedge, so the request is sent again after
        the longest cooldown, as a client honouring `Retry-After` would, and must then be served
        (the probe swap succeeds once the faults are off)."""
        for name in NAMES:
            if not self.replicas[name].alive:
                await self.start(name)
        await self.settled_owner()
        longest_cooldown = BreakerPolicy().cooldown_for(64)
        for member in MEMBERS:
            for name in NAMES:
                for _ in range(2):
                    start = trio.current_time()
                    req = self.request(name, member)
                    with trio.fail_after(SWAP_BUDGET + HOLD_BUDGET + SERVICE_TIME[1] + 1):
                        while req.outcome is None:  # noqa: ASYNC110
                            await trio.sleep(0.01)
                    if req.outcome != "PoolMemberUnavailable":
                        break
                    await trio.sleep(longest_cooldown)
                assert req.outcome == "served", (member, name, req)
                assert req.granted_at is not None
                assert req.granted_at - start <= SWAP_BUDGET + HOLD_BUDGET, req

    async def wait_all_done(self, within: float = 60.0) -> None:
        with trio.fail_after(within):
            while any(r.outcome is None for r in self.requests):  # noqa: ASYNC110
                await trio.sleep(0.05)

    def assert_balanced(self) -> None:
        """5. Counts balance, the ledger is empty, every live activator is idle."""
        assert all(r.outcome is not None for r in self.requests)
        assert sum(self.outcomes.values()) == len(self.requests), self.outcomes
        assert set(self.outcomes) <= DOCUMENTED, self.outcomes
        assert all(v == 0 for v in self.ledger.values()), self.ledger
        for replica in self.live():
            snap = replica.activator.snapshot()[POOL]
            assert replica.activator.idle(POOL), (replica.name, snap)
            assert snap["held_total"] == 0 and snap["in_flight"] == {}, snap
        assert self.violations == [], self.violations[:5]

    def swaps(self) -> int:
        return self.swaps_retired + sum(
            int(r.activator.snapshot()[POOL]["swaps_started"])
            for r in self.replicas.values()
            if r.alive
        )


@asynccontextmanager
async def world(seed: int = 0, *, resident: str | None = "m0") -> AsyncIterator[World]:
    """Three replicas started one after the other (r0 creates the Lease and owns the pool)."""
    async with trio.open_nursery() as nursery:
        w = World(nursery, seed, random.Random(seed))
        if resident is not None:
            w.force_up(resident)
        nursery.start_soon(w.monitor)
        try:
            for name in NAMES:
                await w.start(name)
            yield w
        finally:
            nursery.cancel_scope.cancel()
    await w.close()
    assert w.violations == [], w.violations[:5]


async def until(predicate: Callable[[], bool], *, within: float, step: float = 0.01) -> float:
    with trio.fail_after(within):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(step)
    return trio.current_time()


def workload_calls(w: World, host: str, since: float = -math.inf) -> list[tuple[float, str, str]]:
    """(sent, method, path) of `host`'s requests to the members' workloads."""
    return [
        (at, method, path)
        for at, client, method, path, _ in w.api.sent
        if client == host and path.startswith(WORKLOADS) and at >= since
    ]


def outcome(req: Request) -> str | None:
    """How `req` ended so far (a function, so type narrowing does not stick across awaits)."""
    return req.outcome


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


# ---- (a) concurrent requests from every replica ---------------------------------------------


async def test_concurrent_requests_for_different_members_from_different_replicas(
    autojump_clock: MockClock,
) -> None:
    """Every replica asks for every member at once, in waves: the owner serialises the swaps
    (never two members up, never a busy member scaled down), the followers relay and never touch
    the workloads, and everything is served."""
    async with world(1) as w:
        w.startup = lambda member: 0.3
        owner = await w.settled_owner()
        assert owner.name == "r0"
        for wave in range(6):
            for name in NAMES:
                for k in range(len(MEMBERS)):
                    w.request(name, MEMBERS[(k + wave + NAMES.index(name)) % len(MEMBERS)])
            await trio.sleep(0.05 * wave)
        await w.wait_all_done()
        assert w.outcomes == {"served": 6 * 9}, w.outcomes
        assert w.counts["relays"] > 0
        for name in ("r1", "r2"):
            assert workload_calls(w, name) == []  # only the owner decides
        assert w.counts["scale_ups"] >= 2  # really swapped, more than once
        await w.no_wedge()
        w.assert_balanced()


# ---- (b) the #1837 window across replicas ---------------------------------------------------


async def test_the_1837_window_across_replicas_stays_fixed(autojump_clock: MockClock) -> None:
    """W1 (relayed from r1) gives up on m1 before its engine is up; the owner's deferred
    deactivate of m1 is held in its window while W2 (relayed from r2) starts a newer swap to m1,
    whose activation is a no-op by check. The deactivate must find the newer waiter and skip:
    m1 is never scaled down and W2 is served. FAILS if `_deactivate_if_unwanted` patches without
    the re-check (m1 goes to 0, W2's swap is abandoned at its deadline)."""
    async with world(2) as w:
        w.startup = lambda member: 3.0 if member == "m1" else 0.3
        owner = await w.settled_owner()
        windows: list[str] = []
        scale_ups: list[int] = []
        w2: list[Request] = []
        hook_done = trio.Event()

        async def before_deactivate(pool: str, member: str) -> None:
            if member != "m1" or w2:
                return
            windows.append(member)
            scale_ups.append(w.counts["scale_ups"])
            w2.append(w.request("r2", "m1"))
            await until(lambda: owner.activator.snapshot()[POOL]["held"].get("m1") == 1, within=1)
            snap = owner.activator.snapshot()[POOL]
            assert snap["activating"] == "m1" and snap["swap_generation"] == 2
            hook_done.set()

        owner.activator.before_deactivate = before_deactivate
        w1 = w.request("r1", "m1")
        # W1 relays and waits on the owner; give up (client disconnect) before m1 is up.
        await trio.sleep(1.0)
        assert outcome(w1) is None and w1.relays == 0
        w1.scope.cancel()
        await hook_done.wait()
        await settle()
        assert windows == ["m1"]
        # W2's activation wrote nothing: m1 was still up.
        assert scale_ups == [1] and w.counts["scale_ups"] == 1
        assert w.up() == ["m1"]
        assert owner.activator.snapshot()[POOL]["deactivates_skipped"] == 1
        (req,) = w2
        await until(lambda: req.outcome is not None, within=HOLD_BUDGET)
        assert req.outcome == "served" and req.relays == 1
        assert outcome(w1) == "cancelled"
        m1_writes = [c.body for c in w.api.calls if c.method == "PATCH" and "/m1/" in c.path]
        assert m1_writes == [{"spec": {"replicas": 1}}]  # scaled up once, never down
        assert w.counts["scale_downs"] == 1  # only m0, when the swap to m1 began
        await w.no_wedge()
        w.assert_balanced()


async def test_a_deferred_deactivate_from_an_owner_that_lost_the_pool_never_lands(
    autojump_clock: MockClock,
) -> None:
    """The #1837 window spanning an ownership change: r0's deferred deactivate of m1 is held in
    its window while r0 is partitioned (writes fail) and loses the pool; r1 or r2 takes over and
    starts m1 again for a request relayed from the third replica. When the window closes, r0 must
    not even try to scale m1 down (the guard reads ownership again)."""
    async with world(3) as w:
        # m1's engine starts after W1 gave up, within the successor's swap deadline.
        w.startup = lambda member: 6.0 if member == "m1" else 0.3
        owner = await w.settled_owner()
        gate = trio.Event()
        held: list[str] = []

        async def before_deactivate(pool: str, member: str) -> None:
            held.append(member)
            await gate.wait()

        owner.activator.before_deactivate = before_deactivate
        w1 = w.request("r0", "m1")
        await trio.sleep(1.0)
        w1.scope.cancel()
        await until(lambda: held == ["m1"], within=1)
        cut = w.api.partition("writes", hosts={"r0"})
        new = await until(lambda: w.owners() not in ([], ["r0"]), within=10)
        successor = w.replicas[w.owners()[0]]
        third = next(n for n in NAMES if n not in ("r0", successor.name))
        before = len(w.api.calls)
        w2 = w.request(third, "m1")
        await until(lambda: w2.outcome is not None, within=HOLD_BUDGET)
        assert w2.outcome == "served"
        w.startup = lambda member: 0.5
        gate.set()
        await trio.sleep(1.0)
        assert [c for c in w.api.calls[before:] if c.client == "r0" and c.method == "PATCH"] == []
        assert w.up() == ["m1"]
        assert new >= w.last_lease_write.get("r0", 0.0)  # bookkeeping sanity
        w.api.heal(cut)
        await w.no_wedge()
        w.assert_balanced()


# ---- (c) the owner killed mid-swap -----------------------------------------------------------


@pytest.mark.parametrize("engine", ["starts", "never starts"])
async def test_the_owner_killed_mid_swap_is_replaced_and_the_swap_completes_or_is_abandoned(
    autojump_clock: MockClock, engine: str
) -> None:
    """r0 dies between scaling m0 down and scaling m1 up (no release). After a lease duration
    another replica owns the pool, re-derives the resident from the cluster (nothing is up) and
    decides a swap to m1 for the requests its followers held, which completes (or, if m1's engine
    never starts, is abandoned and m1 scaled down) within the swap deadline."""
    async with world(4) as w:
        w.startup = lambda member: None if engine == "never starts" and member == "m1" else 1.0
        owner = await w.settled_owner()
        assert owner.name == "r0"
        await trio.sleep(1.3)  # out of phase with the renewals
        killed: list[float] = []

        def kill_mid_swap(member: str, host: str | None, replicas: int) -> None:
            if host == "r0" and member == "m0" and replicas == 0 and not killed:
                killed.append(trio.current_time())
                w.crash("r0")

        w.on_applied = kill_mid_swap
        on_owner = w.request("r0", "m1")
        held = [w.request("r1", "m1"), w.request("r2", "m1")]
        await until(lambda: bool(killed), within=1)
        (killed_at,) = killed
        last_renewal = w.last_lease_write["r0"]
        assert w.up() == []  # mid-swap: m0 down, m1 not up yet
        await until(lambda: w.owners() != [], within=10, step=0.001)
        new = w.owners()[0]
        assert new in ("r1", "r2")
        taken = w.gained_at(new)
        await until(lambda: workload_calls(w, new) != [], within=10, step=0.001)
        decided = workload_calls(w, new)[0][0]  # the first request of its first swap
        await w.wait_all_done()
        assert on_owner.outcome == "crashed"
        # Nobody owned the pool before a lease duration after the last renewal, nor decided.
        assert taken >= last_renewal + TIMINGS.lease_duration
        assert decided >= taken
        failover = decided - killed_at
        print(
            f"\nfailover ({engine}): killed at {killed_at:.3f}, lease taken by {new} at "
            f"{taken:.3f}, first swap decided at {decided:.3f}: {failover:.3f} s"
        )
        assert failover <= TIMINGS.lease_duration + TIMINGS.retry_period * 1.2 + 0.1
        m1_writes = [
            (at, body["spec"].get("replicas"))
            for at, client, method, path, body in w.api.sent
            if client == new and method == "PATCH" and path.endswith("/m1/scale")
        ]
        if engine == "starts":
            assert [r.outcome for r in held] == ["served", "served"]
            granted = [r.granted_at for r in held]
            assert all(g is not None and g <= decided + SWAP_BUDGET for g in granted)
            assert [r for _, r in m1_writes] == [1] and m1_writes[0][0] >= decided
            assert w.up() == ["m1"]
        else:
            outcomes = sorted(str(r.outcome) for r in held)
            assert "SwapFailed[deadline]" in outcomes, outcomes
            # Only the first waiter gets the one-shot swap error; the other waits for a new swap
            # (at the new owner, past its follower's head deadline: 502 pool_relay_failed).
            assert set(outcomes) <= {"SwapFailed[deadline]", "HoldTimeout", "relay_failed"}
            # Abandoned at its deadline, and the target scaled down under the lock (F4).
            assert [r for _, r in m1_writes][:2] == [1, 0] and m1_writes[0][0] >= decided
            assert m1_writes[1][0] <= decided + SWAP_BUDGET + CONTROLLER_TIMEOUT
            w.startup = lambda member: 1.0
        await w.no_wedge()
        w.assert_balanced()


# ---- (d) a partitioned owner ------------------------------------------------------------------


@pytest.mark.parametrize("scope", ["all", "writes"])
async def test_a_partitioned_owner_stops_deciding_before_anyone_else_may_start(
    autojump_clock: MockClock, scope: Literal["all", "writes"]
) -> None:
    """r0's requests to the API fail (all of them, or its writes). Under load it keeps trying
    swaps while it still owns the pool, then stops deciding at its renew deadline: no request to
    the workloads from it after last successful renewal + renew deadline, while r1 or r2 takes the
    pool only a lease duration after that renewal, and decides only after that."""
    async with world(5) as w:
        w.startup = lambda member: 0.2
        owner = await w.settled_owner()
        assert owner.name == "r0"
        await trio.sleep(0.7)

        async def load() -> None:
            for i in range(80):
                w.request("r0", MEMBERS[i % 3])
                w.request(NAMES[1 + i % 2], MEMBERS[(i + 1) % 3])
                await trio.sleep(0.1)

        cut = w.api.partition(scope, hosts={"r0"})
        partitioned_at = trio.current_time()
        w.request("r0", "m1")  # m0 is idle: r0 decides a swap at once, against a cut-off API
        w.nursery.start_soon(load)
        stopped = await until(lambda: not owner.is_self(), within=5, step=0.001)
        await until(lambda: w.owners() != [], within=10, step=0.001)
        new = w.owners()[0]
        assert new in ("r1", "r2")
        taken = w.gained_at(new)
        last = w.last_lease_write["r0"]
        assert last <= partitioned_at
        assert stopped == pytest.approx(last + TIMINGS.renew_deadline, abs=0.002)
        assert taken >= last + TIMINGS.lease_duration
        r0_calls = workload_calls(w, "r0")
        assert any(at >= partitioned_at for at, _, _ in r0_calls)  # it did try, while it owned
        assert all(at < last + TIMINGS.renew_deadline for at, _, _ in r0_calls), r0_calls[-3:]
        print(
            f"\npartition ({scope}): last renewal {last:.3f}, stopped deciding {stopped:.3f}, "
            f"taken by {new} at {taken:.3f}, r0 workload calls during the partition: "
            f"{sum(at >= partitioned_at for at, _, _ in r0_calls)}"
        )
        await trio.sleep(8.5)
        w.api.heal(cut)
        await w.wait_all_done()
        assert all(at < last + TIMINGS.renew_deadline for at, _, _ in workload_calls(w, "r0"))
        assert workload_calls(w, new)[0][0] >= taken  # it decided, and only once it owned
        assert w.outcomes["served"] > 0
        await w.no_wedge()
        w.assert_balanced()


# ---- (e) the soak ---------------------------------------------------------------------------


async def soak(seed: int, ops: int) -> tuple[World, Counter[str]]:
    rng = random.Random(seed)
    done: Counter[str] = Counter()
    async with world(seed) as w:
        w.startup = lambda member: (
            None if rng.random() < 0.02 else rng.choice([0.05, 0.2, 0.5, 1.0, 2.0])
        )
        restarting: set[str] = set()

        async def restart_later(name: str, delay: float) -> None:
            await trio.sleep(delay)
            if not w.replicas[name].alive:
                await w.start(name)
            restarting.discard(name)

        async def leave_and_return(name: str) -> None:
            await w.leave(name)
            await restart_later(name, rng.uniform(0.5, 5.0))

        async def heal_later(cut: Any, delay: float) -> None:
            await trio.sleep(delay)
            if cut in w.api.partitions:
                w.api.heal(cut)

        for _ in range(ops):
            op = rng.choices(
                ["request", "sleep", "cancel", "leave", "crash", "partition"],
                weights=[48, 38, 5, 3, 3, 3],
            )[0]
            done[op] += 1
            up = [r for r in w.live() if not r.leaving and r.name not in restarting]
            owners = [r for r in up if r.is_self()]
            if op == "request" and up:
                for _ in range(rng.choice([1, 1, 2, 3])):
                    on = rng.choice(up).name
                    mode: Literal["wait", "if_idle"] = "if_idle" if rng.random() < 0.1 else "wait"
                    w.request(on, rng.choice(MEMBERS), mode)
            elif op == "sleep":
                await trio.sleep(rng.choice([0.001, 0.01, 0.05, 0.2, 0.5, 1.0, 2.0]))
            elif op == "cancel":
                pending = [r for r in w.requests if r.outcome is None]
                if pending:
                    rng.choice(pending).scope.cancel()
            elif op == "leave" and owners and len(up) > 1:
                name = owners[0].name
                restarting.add(name)
                w.nursery.start_soon(leave_and_return, name)
            elif op == "crash" and len(up) > 1:
                victim = owners[0] if owners and rng.random() < 0.6 else rng.choice(up)
                restarting.add(victim.name)
                w.crash(victim.name)
                w.nursery.start_soon(restart_later, victim.name, rng.uniform(0.2, 6.0))
            elif op == "partition" and up:
                victim = owners[0] if owners and rng.random() < 0.6 else rng.choice(up)
                cut = w.api.partition(
                    rng.choice(["all", "writes"]),
                    answer="timeout" if rng.random() < 0.2 else "503",
                    hosts={victim.name},
                )
                w.counts["partitions"] += 1
                w.nursery.start_soon(heal_later, cut, rng.uniform(0.3, 8.0))
            else:
                w.counts["ops_skipped"] += 1  # nothing to do it to (counted in `done` too)
            assert w.violations == [], w.violations[:5]
        # The load stops: heal, bring every replica back, let every request end.
        w.api.heal()
        with trio.fail_after(30):
            while restarting:  # noqa: ASYNC110
                await trio.sleep(0.1)
        for name in NAMES:
            if not w.replicas[name].alive:
                await w.start(name)
        w.startup = lambda member: 0.5
        await w.wait_all_done(within=120)
        await w.no_wedge()
        await w.wait_all_done()
        await trio.sleep(2 * SWAP_BUDGET)  # deferred deactivates, abandoned swaps
        w.assert_balanced()
        lease = w.api.lease(LEASE)
        assert lease is not None
        w.counts["lease_transitions"] = lease["spec"]["leaseTransitions"]
        w.counts["swaps"] = w.swaps()
        w.counts["virtual_seconds"] = int(trio.current_time())
    return w, done


@pytest.mark.parametrize("seed", SEEDS)
async def test_soak_three_replicas_one_pool(autojump_clock: MockClock, seed: int) -> None:
    w, ops = await soak(seed, OPS)
    print(f"\nshared soak seed={seed} ops={sum(ops.values())} {dict(ops)}")
    print(f"requests={len(w.requests)} outcomes={dict(w.outcomes)}")
    print(f"counts={dict(w.counts)}")
    assert sum(ops.values()) == OPS
    assert w.violations == []
    # The run must exercise what it claims to.
    assert w.outcomes["served"] > len(w.requests) // 2
    assert w.counts["relays"] > 100
    assert w.counts["swaps"] > 50
    assert w.counts["crashes"] > 0 and w.counts["graceful_leaves"] > 0
    assert w.counts["partitions"] > 0
    assert w.counts["lease_transitions"] > 10
