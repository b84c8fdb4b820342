"""The ModelPool activator: one exclusive slot per pool, swapped on demand (docs/activator.md),
with the #1837 fix (PR #1838; docs/activator.md, "The #1837 fix", F1-F6) built in.

Design: one `trio.Lock` per pool, as in docs/activator.md, "Locking", rather than a single
owner task fed by memory channels. The fix's core invariant is "every Deactivate decision *and its
patch* happen under the same lock that every swap start takes", i.e. a critical section that spans
an `await` (the controller call). A lock expresses that directly and keeps the upstream structure
recognisable; an owner task would have to serialize the same awaited patch and would add a second
hop (and a second cancellation path) to every acquire. No invariant spans two pools, so per-pool
locks let a hung controller stall only its own pool, and only for `controller_timeout` per call.

Trio detail: a section without checkpoints is atomic, so the locked sections are the ones that
either await under the lock (the deferred deactivate, the abandoned-swap deactivate) or must not
interleave with them (every acquire decision, since it can start a swap, and the swap task's
completion). `Grant.release`, `invalidate_resident` and the acquire cleanup contain no
checkpoint and need no lock: they start nothing and cannot run in the middle of another section's
state reads. The cleanup being synchronous also means a cancelled caller never waits for a lock.

Swaps and deferred deactivates run in the activator's own nursery (`run`), never under a request.

Measured waiting (docs/activator.md, "Measured waiting" and "Breaker"): the pure rules are in
`waiting.py` and their transitions in `state.py`; this driver only passes the time in, computes a
503's Retry-After where it raises it (`_retry_after`), calls `on_hold` outside the lock, and logs
and publishes the breaker's changes.

Ownership (docs/pool-ownership.md, "The activator with an owner"): with several replicas only a
pool's owner decides for it. A decision is allowed while `_decides(pool)`: the watcher task has
applied "this replica owns the pool" (`_Pool.owned`, which also means the residency belief was
dropped on gaining it) *and* the ownership source still says so now. The second read is the
guard before every controller call, since the source turns `is_self` off before another replica
can take over, possibly before the watcher has run. With `LocalOwnership` both are constant and
the read is skipped, so a request pays two attribute reads for it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from stargate.activator.controller import MemberController
from stargate.activator.errors import (
    ActivatorError,
    ActivatorStopped,
    HoldTimeout,
    IncumbentBusy,
    NoPoolOwner,
    PoolMemberUnavailable,
    PoolOwnedElsewhere,
    PoolQueueFull,
    SwapFailed,
    UnknownMember,
)
from stargate.activator.members import AvailabilitySource
from stargate.activator.metrics import ActivatorMetrics
from stargate.activator.ownership import SELF, LocalOwnership, Owner, PoolOwnership
from stargate.activator.state import (
    Decision,
    Mode,
    PoolState,
    SwapOutcome,
    SwapState,
    add_waiter,
    begin_swap,
    claim_deactivate,
    classify_swap_end,
    count_grant,
    decide,
    end_swap,
    expected_wait,
    forget_on_ownership_change,
    forget_on_ownership_gain,
    forget_on_ownership_loss,
    forget_on_stop,
    invalidate_resident,
    is_idle,
    new_swap,
    reconcile_resident,
    record_deactivate_task,
    rederive_resident,
    release_grant,
    remove_waiter,
    request_deactivate,
    request_swap_cancel,
    resolve_hold_budget,
    resolve_swap_deadline,
    settle_breaker,
    take_swap_error,
)
from stargate.activator.waiting import (
    BREAKER_GAUGE,
    BreakerPhase,
    BreakerPolicy,
    retry_after_seconds,
)

__all__ = ["Activator", "Grant", "OnHold", "PoolSpec"]

log = logging.getLogger(__name__)

BeforeDeactivateHook = Callable[[str, str], Awaitable[None]]
OnHold = Callable[[], None]


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One pool: members share one exclusive slot (docs/activator.md, Concepts).

    `swap_budget`: how long a swap may take (None or <= 0: 2 x response-header timeout).
    `hold_budget`: how long one acquire may wait (None: the swap budget, else the response-header
    timeout). `default_mode`: the activation mode when `acquire` gets none. `max_held`: at most
    this many requests held per pool before `PoolQueueFull`. `namespace`: the `resident` gauge's
    label (LLMKube labels it by namespace). `breaker_failures` and `breaker_cooldown`: this pool's
    override of the activator's breaker policy (None: the activator's; docs/activator.md,
    "Breaker").
    """

    name: str
    members: tuple[str, ...]
    swap_budget: float | None = 300.0
    default_mode: Mode = "wait"
    hold_budget: float | None = None
    max_held: int = 1000
    namespace: str = "default"
    breaker_failures: int | None = None
    breaker_cooldown: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        if not self.members:
            raise ValueError(f"pool {self.name!r} has no members")
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"pool {self.name!r} lists a member twice")
        if self.default_mode not in ("wait", "if_idle"):
            raise ValueError(f"pool {self.name!r}: unknown activation mode {self.default_mode!r}")
        if self.max_held < 0:
            raise ValueError(f"pool {self.name!r}: max_held must be >= 0")
        if self.breaker_failures is not None and self.breaker_failures < 0:
            raise ValueError(f"pool {self.name!r}: breaker_failures must be >= 0")
        if self.breaker_cooldown is not None and self.breaker_cooldown <= 0:
            raise ValueError(f"pool {self.name!r}: breaker_cooldown must be > 0")


class Grant:
    """The right to send one request to `member`. Call `release()` exactly once, when the response
    body ends (or dispatch fails). A second call is a logged no-op, never another request's count.
    Also a (sync) context manager.

    `hold_seconds`: how long the `acquire` waited (0.0 on an immediate grant); `swap_seconds`: how
    long the swap it waited for took to make the member resident (0.0 if it waited for none). The
    proxy reports both in `Server-Timing` (docs/activator.md, "Measured waiting")."""

    __slots__ = ("_pool", "_released", "hold_seconds", "member", "pool", "swap_seconds")

    def __init__(
        self, pool: _Pool, member: str, *, hold_seconds: float = 0.0, swap_seconds: float = 0.0
    ) -> None:
        self._pool = pool
        self.pool = pool.spec.name
        self.member = member
        self.hold_seconds = hold_seconds
        self.swap_seconds = swap_seconds
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            log.warning(
                "model pool grant released twice",
                extra={"pool": self.pool, "member": self.member},
            )
            return
        self._released = True
        self._pool.release(self.member)

    def __enter__(self) -> Grant:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._released:
            self.release()

    def __repr__(self) -> str:
        return f"Grant({self.pool!r}, {self.member!r}, released={self._released})"


@dataclass(slots=True)
class _Acquire:
    """One `acquire` call's own bookkeeping (not the pool's state): its hold deadline, whether its
    next pass is the first decided one, and how its cleanup ends."""

    member: str
    mode: Mode
    hold_start: float
    deadline: float
    first_pass: bool = True  # the first pass decided as owner: reconcile, check the queue bound
    schedule_cleanup: bool = True  # False: it held nothing (the queue was full, breaker open)
    waiting_for_owner: bool = False  # the last pass found another owner, or none
    on_hold: OnHold | None = None  # called once, when the call first waits
    awaited: SwapState | None = None  # the latest swap toward `member` this call waited for


class _Pool:
    """One pool's runtime: spec, lock, state and change broadcast."""

    def __init__(
        self,
        spec: PoolSpec,
        controller: MemberController,
        router: str,
        *,
        owned: bool,
        breaker: BreakerPolicy,
    ) -> None:
        self.spec = spec
        self.controller = controller
        self.router = router
        self.lock = trio.Lock()
        self.state = PoolState(members=spec.members, breaker_policy=breaker)
        self.changed = trio.Event()
        self.swap_scope: trio.CancelScope | None = None
        self.metrics: ActivatorMetrics | None = None
        # Ownership as the watcher last applied it (module docstring): True from the start with
        # `LocalOwnership`, else set by `Activator._apply_owner`.
        self.owned = owned
        self.owner: Owner = SELF if owned else Owner(is_self=False)
        # The controller calls under the lock in progress: cancelled when ownership is lost.
        self.controller_calls: set[trio.CancelScope] = set()
        # Set (and dropped) when the pool turns idle; only exists while someone waits for that.
        self.idle_event: trio.Event | None = None

    def notify(self) -> None:
        """Wake every current waiter and install a fresh event (docs/activator.md, State)."""
        self.changed.set()
        self.changed = trio.Event()
        if self.idle_event is not None:
            self.signal_idle()

    def idle(self) -> bool:
        return is_idle(self.state) and not self.controller_calls

    def signal_idle(self) -> None:
        """Wake `Activator.wait_idle` callers if the pool is idle now (a no-op with none)."""
        event = self.idle_event
        if event is not None and self.idle():
            self.idle_event = None
            event.set()

    def release(self, member: str) -> None:
        if release_grant(self.state, member):
            self.notify()

    def publish_held(self, member: str) -> None:
        if self.metrics is not None:
            self.metrics.held_requests.labels(
                member=member, pool=self.spec.name, router=self.router
            ).set(self.state.waiting.get(member, 0))

    def publish_breaker(self, member: str, phase: BreakerPhase) -> None:
        if self.metrics is not None:
            self.metrics.breaker_state.labels(
                member=member, pool=self.spec.name, router=self.router
            ).set(BREAKER_GAUGE[phase])

    def publish_resident(self) -> None:
        if self.metrics is not None:
            for member in self.spec.members:
                self.metrics.resident.labels(
                    member=member, namespace=self.spec.namespace, pool=self.spec.name
                ).set(1 if member == self.state.resident else 0)


class Activator:
    """Owns every pool. Start `run` in a nursery before the first `acquire`."""

    def __init__(
        self,
        pools: Iterable[PoolSpec],
        controllers: Mapping[str, MemberController],
        availability: AvailabilitySource,
        *,
        metrics: ActivatorMetrics | None = None,
        router_name: str = "stargate",
        response_header_timeout: float = 30.0,
        resync_interval: float = 5.0,
        controller_timeout: float = 10.0,
        breaker_failures: int = 3,
        breaker_cooldown: float = 30.0,
        before_deactivate: BeforeDeactivateHook | None = None,
        # Stateless and never changing, so one shared default is safe.
        ownership: PoolOwnership = LocalOwnership(),  # noqa: B008
    ) -> None:
        self._availability = availability
        self._ownership = ownership
        # Ownership that never changes needs no per-request read (module docstring).
        self._local = type(self._ownership) is LocalOwnership
        self._metrics = metrics
        self._router = router_name or "default"
        self._response_header_timeout = response_header_timeout
        self._resync_interval = resync_interval
        self._controller_timeout = controller_timeout
        # Test-only hook (upstream `beforeDeactivate`): awaited with (pool, member) just before a
        # deferred deactivate re-takes the lock. None in production.
        self.before_deactivate = before_deactivate
        self._pools: dict[str, _Pool] = {}
        self._by_member: dict[str, _Pool] = {}
        for spec in pools:
            if spec.name in self._pools:
                raise ValueError(f"duplicate pool {spec.name!r}")
            controller = controllers.get(spec.name)
            if controller is None:
                raise ValueError(f"pool {spec.name!r} has no member controller")
            breaker = BreakerPolicy(
                failures=breaker_failures
                if spec.breaker_failures is None
                else spec.breaker_failures,
                cooldown=breaker_cooldown
                if spec.breaker_cooldown is None
                else spec.breaker_cooldown,
            )
            pool = _Pool(spec, controller, self._router, owned=self._local, breaker=breaker)
            pool.metrics = metrics
            for member in spec.members:
                other = self._by_member.get(member)
                if other is not None:
                    raise ValueError(
                        f"member {member!r} is in pools {other.spec.name!r} and {spec.name!r}"
                    )
                self._by_member[member] = pool
            self._pools[spec.name] = pool
        self._nursery: trio.Nursery | None = None

    # ---- lifetime -------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host swaps and deferred deactivates until cancelled (the service lifetime).

        On exit every running swap is cancelled; its state is dropped and every waiter is woken,
        so a caller still inside `acquire` gets `ActivatorStopped` instead of holding to its
        budget."""
        if self._nursery is not None:
            raise RuntimeError("Activator.run is already running")
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for pool in self._pools.values():
                    # The contract (stargate/activator/ownership.py): take the event, then read.
                    event = self._ownership.changed(pool.spec.name)
                    self._apply_owner(pool, self._ownership.owner(pool.spec.name), initial=True)
                    nursery.start_soon(self._watch_ownership, pool, event)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for pool in self._pools.values():
                forget_on_stop(pool.state)
                pool.swap_scope = None
                pool.notify()

    # ---- ownership ------------------------------------------------------------------------------

    @property
    def pool_names(self) -> tuple[str, ...]:
        """Every pool's name, in declaration order."""
        return tuple(self._pools)

    @property
    def ownership(self) -> PoolOwnership:
        """Who decides for each pool (the proxy's relay follows its changes)."""
        return self._ownership

    def owns(self, pool: str) -> bool:
        """This replica decides for `pool` now (KeyError for an unknown pool)."""
        return self._decides(self._pools[pool])

    def _decides(self, pool: _Pool) -> bool:
        """The guard of every decision and controller call (module docstring)."""
        return pool.owned and (self._local or self._ownership.owner(pool.spec.name).is_self)

    async def _watch_ownership(self, pool: _Pool, event: trio.Event) -> None:
        """Follow one pool's ownership for the activator's lifetime."""
        name = pool.spec.name
        while True:
            await event.wait()
            event = self._ownership.changed(name)
            self._apply_owner(pool, self._ownership.owner(name))

    def _apply_owner(self, pool: _Pool, owner: Owner, *, initial: bool = False) -> None:
        """An ownership change, applied at once (no checkpoint, so no locked section sees half of
        it; docs/pool-ownership.md, "The activator with an owner").

        Gained: forget the residency belief, so the next acquire re-derives it from the members'
        availability. Lost: stop deciding now, without a controller call: the running swap is
        cancelled and forgotten, pending deactivates dropped, controller calls in progress cut
        short. Every change wakes every waiter, who then proceeds, raises `PoolOwnedElsewhere` or
        keeps waiting for an owner.
        """
        name = pool.spec.name
        old = pool.owner
        pool.owner = owner
        st = pool.state
        if owner.is_self and not pool.owned:
            pool.owned = True
            forget_on_ownership_gain(st)
        elif owner.is_self and not initial:
            # Still ours, yet something changed: it may have been lost and regained between two
            # wake-ups of this watcher, while another replica swapped. Re-read to be sure.
            forget_on_ownership_change(st)
        elif not owner.is_self and pool.owned:
            pool.owned = False
            forget_on_ownership_loss(st)  # marks the running swap "cancelled": quiet
            scope, pool.swap_scope = pool.swap_scope, None
            if scope is not None:
                scope.cancel()
            for call in pool.controller_calls:
                call.cancel()
            pool.publish_resident()
        if self._metrics is not None:
            self._metrics.owned.labels(pool=name, router=self._router).set(1 if pool.owned else 0)
        if (initial and not self._local) or old != owner:
            level = logging.INFO if owner.is_self or old.is_self or initial else logging.DEBUG
            log.log(
                level,
                "model pool owner",
                extra={"pool": name, "old_owner": _describe(old), "new_owner": _describe(owner)},
            )
        pool.notify()

    def count_relayed(self, pool: str, outcome: str) -> None:
        """Count one pool request this replica did not own, by its final outcome (the proxy's
        relay, stargate/proxy/owner_relay.py)."""
        if self._metrics is not None:
            self._metrics.relayed.labels(outcome=outcome, pool=pool, router=self._router).inc()

    def idle(self, pool: str) -> bool:
        """Nothing waiting, nothing in flight, no swap, no deferred deactivate or controller call
        to finish: the owner may release the pool (KeyError for an unknown pool)."""
        return self._pools[pool].idle()

    async def wait_idle(self, pool: str) -> None:
        """Return once `pool` is idle (at once if it is). A leaving owner calls this before it
        releases the pool's lease, so the next owner starts from a settled pool; new requests can
        keep it busy, so the caller bounds the wait."""
        runtime = self._pools[pool]
        while not runtime.idle():
            if runtime.idle_event is None:
                runtime.idle_event = trio.Event()
            await runtime.idle_event.wait()

    # ---- queries --------------------------------------------------------------------------------

    def pool_of(self, model: str) -> str | None:
        pool = self._by_member.get(model)
        return None if pool is None else pool.spec.name

    def pool_spec(self, name: str) -> PoolSpec:
        return self._pools[name].spec

    def hold_budget(self, model: str) -> float:
        """The hold budget `acquire(model)` uses by default."""
        spec = self._pool_for(model).spec
        return resolve_hold_budget(
            spec.hold_budget, spec.swap_budget, self._response_header_timeout
        )

    def swap_deadline(self, pool: str) -> float:
        spec = self._pools[pool].spec
        return resolve_swap_deadline(spec.swap_budget, self._response_header_timeout)

    def expected_wait(self, model: str) -> float | None:
        """Seconds a request for `model` is expected to wait now for it to be resident: 0.0 when it
        is resident, the rest of its swap-time EWMA while a swap toward it runs (a tenth of the
        EWMA once the swap overran it, never negative), its EWMA when a swap would be needed (plus
        the rest of a swap toward another member, and the time until an open breaker
        half-opens), None when none of its swaps was measured yet, or `model` is not pooled.
        O(1), no I/O (docs/activator.md, "Measured waiting")."""
        pool = self._by_member.get(model)
        if pool is None:
            return None
        return expected_wait(pool.state, model, trio.current_time())

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per-pool debugging view; plain data, safe to JSON-encode."""
        now = _now_or_none()
        out: dict[str, dict[str, Any]] = {}
        for name, pool in self._pools.items():
            st = pool.state
            swap = st.swap
            out[name] = {
                "members": list(pool.spec.members),
                "resident": st.resident,
                "resident_checked_at": st.resident_checked_at,
                "activating": None if swap is None else swap.target,
                "swapping": swap is not None,
                "swap_generation": st.swap_gen,
                "swap": None
                if swap is None
                else {
                    "generation": swap.gen,
                    "from": swap.incumbent,
                    "to": swap.target,
                    "started_at": swap.started_at,
                    "deadline": swap.deadline,
                    "remaining": None if now is None else max(0.0, swap.deadline - now),
                    "cancel_reason": swap.cancel_reason,
                },
                "held": dict(st.waiting),
                "held_total": st.held(),
                "in_flight": dict(st.inflight),
                "swap_errors": {m: reason for m, (_, reason) in st.swap_err.items()},
                "pending_deactivates": sorted(st.pending_deactivate),
                "locked": pool.lock.locked(),
                "owned": pool.owned,
                "owner": _describe(pool.owner),
                "swaps_started": st.swaps_started,
                "deactivates_skipped": st.deactivates_skipped,
                "swap_time_estimates": {
                    m: round(t.ewma, 3) for m, t in st.swap_times.items() if t.samples
                },
                "breakers": {
                    m: b.phase(now).value
                    for m, b in st.breakers.items()
                    if now is not None and b.open_until is not None
                },
            }
        return out

    # ---- self-heal ------------------------------------------------------------------------------

    def invalidate_resident(self, pool: str) -> None:
        """Re-verify residency on the next acquire (docs/activator.md, Self-heal). A no-op for an
        unknown pool or while a swap owns residency."""
        runtime = self._pools.get(pool)
        if runtime is not None:
            invalidate_resident(runtime.state)

    # ---- acquire --------------------------------------------------------------------------------

    @asynccontextmanager
    async def hold(
        self,
        model: str,
        mode: Mode | None = None,
        *,
        hold_budget: float | None = None,
        on_hold: OnHold | None = None,
    ) -> AsyncIterator[Grant]:
        """`async with activator.hold(model) as grant:`: acquire, and release on exit."""
        grant = await self.acquire(model, mode, hold_budget=hold_budget, on_hold=on_hold)
        with grant:
            yield grant

    async def acquire(
        self,
        model: str,
        mode: Mode | None = None,
        *,
        hold_budget: float | None = None,
        on_hold: OnHold | None = None,
    ) -> Grant:
        """Wait until `model` may be sent a request, then count it in flight (docs/activator.md,
        Acquire).

        Raises `HoldTimeout`, `SwapFailed`, `IncumbentBusy`, `PoolQueueFull`, `UnknownMember` or
        `ActivatorStopped`; with several replicas (docs/pool-ownership.md) also
        `PoolOwnedElsewhere` (another replica owns the pool: at once, or as soon as ownership
        moves there while this call waits) and `NoPoolOwner` (no replica owned it within the
        hold budget). A cancellation from the caller propagates as `trio.Cancelled`. The grant is
        counted in flight in the same checkpoint-free step that returns it, so a caller cancelled
        while being granted never strands a count. `PoolMemberUnavailable` at once while the
        member's breaker is open (docs/activator.md, "Breaker").

        `on_hold`: called once, synchronously and without the pool lock, when the call starts to
        wait (the member is not resident: a swap is needed, running, or queued behind a busy
        incumbent, or the pool has no owner yet); never on an immediate grant or error. If it
        raises, the call ends with that error (cleaned up as any exit). The 503s it raises carry
        a Retry-After computed from the member's swap times (`expected_wait`).
        """
        pool = self._pool_for(model)
        if self._nursery is None:
            raise ActivatorStopped("Activator.run is not running")
        mode = pool.spec.default_mode if mode is None else mode
        if mode not in ("wait", "if_idle"):
            raise ValueError(f"unknown activation mode {mode!r}")
        hold = hold_budget if hold_budget is not None else self.hold_budget(model)
        hold_start = trio.current_time()
        call = _Acquire(model, mode, hold_start, hold_start + hold, on_hold=on_hold)
        add_waiter(pool.state, model)
        pool.publish_held(model)
        try:
            with trio.CancelScope(deadline=call.deadline):
                while True:
                    async with pool.lock:
                        grant = self._acquire_pass(pool, call)
                        if grant is not None:
                            return grant  # no checkpoint from here to the caller
                        changed = pool.changed  # snapshot under the lock: no lost wakeup
                    if call.on_hold is not None:
                        # Starting to wait: once, outside the lock; nothing can be missed, the
                        # event was taken under the lock.
                        on_hold_once, call.on_hold = call.on_hold, None
                        on_hold_once()
                    await changed.wait()
            # Only our own hold deadline lands here; a caller's cancel propagates as Cancelled.
            raise self._hold_expired(pool, call)
        finally:
            self._cleanup(pool, model, schedule=call.schedule_cleanup)

    def _acquire_pass(self, pool: _Pool, call: _Acquire) -> Grant | None:
        """One pass of the acquire loop, lock held, no checkpoint (docs/activator.md, Acquire, step
        3): a grant, an error raised, or None to wait for the next change."""
        if self._nursery is None:
            raise ActivatorStopped("the activator stopped")
        st, name, member = pool.state, pool.spec.name, call.member
        call.waiting_for_owner = not self._decides(pool)
        if call.waiting_for_owner:
            # Another owner: hand over at once. None yet (or the watcher has not applied a gain):
            # wait, woken by every ownership change.
            self._raise_if_owned_elsewhere(pool, member, call.deadline)
            return None
        is_available = self._availability.is_available
        now = trio.current_time()
        if call.first_pass and reconcile_resident(st, is_available, now, self._resync_interval):
            pool.publish_resident()
        max_held = pool.spec.max_held if call.first_pass else None
        decision = decide(st, member, call.mode, max_held=max_held, now=now)
        call.first_pass = False
        if decision is Decision.GRANT:
            count_grant(st, member)
            if self._metrics is not None:
                labels = {"member": member, "pool": name, "router": self._router}
                self._metrics.coalesced.labels(**labels).inc()
            awaited = call.awaited
            return Grant(
                pool,
                member,
                hold_seconds=now - call.hold_start,
                swap_seconds=0.0 if awaited is None else awaited.seconds,
            )
        if decision is Decision.SWAP_ERROR:
            message, reason = take_swap_error(st, member)
            raise SwapFailed(message, pool=name, member=member, reason=reason)
        if decision is Decision.BREAKER_OPEN:
            call.schedule_cleanup = False  # fails fast: it started and held nothing
            breaker = st.breakers[member]
            message = (
                f"model pool {name} member {member} is unavailable after {breaker.failures} "
                f"failed swaps in a row; last: {breaker.reason}"
            )
            retry_after = retry_after_seconds(
                breaker.until_half_open(now), PoolMemberUnavailable.retry_after or 1
            )
            raise PoolMemberUnavailable(message, pool=name, member=member, retry_after=retry_after)
        if decision is Decision.BUSY:
            if self._metrics is not None:
                labels = {"member": member, "pool": name, "router": self._router}
                self._metrics.busy_skips.labels(**labels).inc()
            message = "model pool incumbent busy; swap not started"
            retry_after = self._retry_after(pool, member, now, IncumbentBusy)
            raise IncumbentBusy(message, pool=name, member=member, retry_after=retry_after)
        if decision is Decision.QUEUE_FULL:
            call.schedule_cleanup = False  # this request started and held nothing
            message = f"model pool {name} already holds {pool.spec.max_held} requests"
            retry_after = self._retry_after(pool, member, now, PoolQueueFull)
            raise PoolQueueFull(message, pool=name, member=member, retry_after=retry_after)
        if decision is Decision.START_SWAP:
            self._start_swap(pool, member, call.hold_start)
        swap = st.swap
        if swap is not None and swap.target == member:
            call.awaited = swap  # the swap this call waits for (its duration goes in the grant)
        return None

    def _retry_after(
        self, pool: _Pool, member: str, now: float, error: type[ActivatorError]
    ) -> int:
        """A 503's Retry-After: the member's expected wait, rounded up and bounded, or the error
        class's constant while nothing is measured (docs/activator.md, "Measured waiting")."""
        fallback = error.retry_after or 1
        return retry_after_seconds(expected_wait(pool.state, member, now), fallback)

    def _hold_expired(self, pool: _Pool, call: _Acquire) -> ActivatorError:
        """The error for an acquire whose hold budget ran out."""
        name = pool.spec.name
        now = trio.current_time()
        if call.waiting_for_owner:
            message = f"no replica owned model pool {name} within the hold budget"
            retry_after = self._retry_after(pool, call.member, now, NoPoolOwner)
            return NoPoolOwner(message, pool=name, member=call.member, retry_after=retry_after)
        message = "model pool activation hold budget exceeded"
        retry_after = self._retry_after(pool, call.member, now, HoldTimeout)
        return HoldTimeout(message, pool=name, member=call.member, retry_after=retry_after)

    def _raise_if_owned_elsewhere(self, pool: _Pool, member: str, deadline: float) -> None:
        """`PoolOwnedElsewhere` when another replica owns `pool` and can be reached."""
        owner = self._ownership.owner(pool.spec.name)
        if not owner.is_self and owner.address is not None:
            raise PoolOwnedElsewhere(
                pool.spec.name,
                member,
                owner.address,
                identity=owner.identity,
                deadline=deadline,
            )

    def _pool_for(self, model: str) -> _Pool:
        pool = self._by_member.get(model)
        if pool is None:
            raise UnknownMember(model)
        return pool

    def _cleanup(self, pool: _Pool, member: str, *, schedule: bool) -> None:
        """Every acquire exit (docs/activator.md, Acquire, step 4).

        Synchronous: never waits, never notifies.
        """
        cancel_swap, gen = remove_waiter(pool.state, member)
        pool.publish_held(member)
        if cancel_swap:
            self._cancel_swap(pool)
        if gen is not None and schedule and self._decides(pool):
            self._schedule_deactivate(pool, member, gen)
        if pool.idle_event is not None:
            pool.signal_idle()

    # ---- swaps ----------------------------------------------------------------------------------

    def _start_swap(self, pool: _Pool, target: str, hold_start: float) -> None:
        """Lock held, no checkpoint (docs/activator.md, Swap): spawn the swap's task, then enter the
        swap in the state (the task only runs after this section)."""
        now = trio.current_time()
        deadline = now + resolve_swap_deadline(pool.spec.swap_budget, self._response_header_timeout)
        swap = new_swap(pool.state, target, now=now, deadline=deadline, hold_start=hold_start)
        # F3 (docs/activator.md): every swap runs under a deadline.
        scope = trio.CancelScope(deadline=deadline)
        self._spawn(self._run_swap, pool, swap, scope)
        if begin_swap(pool.state, swap):
            pool.publish_breaker(target, BreakerPhase.HALF_OPEN)  # the probe (docs: Breaker)
        pool.swap_scope = scope
        pool.notify()

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        """Start a task in the activator's nursery; `ActivatorStopped` while shutting down."""
        if self._nursery is None:
            raise ActivatorStopped("the activator stopped")
        try:
            self._nursery.start_soon(fn, *args)
        except RuntimeError as exc:  # "Nursery is closed to new arrivals"
            raise ActivatorStopped("the activator is stopping") from exc

    def _cancel_swap(self, pool: _Pool) -> None:
        """Cancel-on-timeout: the last waiter for the swap's target left."""
        scope = pool.swap_scope
        if scope is not None and request_swap_cancel(pool.state, now=trio.current_time()):
            scope.cancel()

    async def _run_swap(self, pool: _Pool, swap: SwapState, scope: trio.CancelScope) -> None:
        error: BaseException | None = None
        t0 = trio.current_time()
        if not self._decides(pool):
            # Ownership went away between the swap's start and its task (the source said so
            # before the watcher ran): no controller call; quiet, like a cancelled swap.
            await self._finish_swap(pool, swap, SwapOutcome.CANCELLED, None, t0)
            return
        with scope:
            try:
                await pool.controller.activate(swap.target)
                while not self._availability.is_available(swap.target):
                    await self._availability.wait_changed(swap.target)
            except Exception as exc:
                error = exc
        errored = error is not None or scope.cancelled_caught
        outcome = classify_swap_end(errored=errored, cancel_called=scope.cancel_called, swap=swap)
        await self._finish_swap(pool, swap, outcome, error, t0)

    async def _finish_swap(
        self,
        pool: _Pool,
        swap: SwapState,
        outcome: SwapOutcome,
        error: BaseException | None,
        t0: float,
    ) -> None:
        """The swap task's completion, under the lock (docs/activator.md, Swap): the state change
        is `end_swap`; here the metrics and logs, and an abandoned target's deactivate (F4)."""
        async with pool.lock:
            try:
                now = trio.current_time()
                if not end_swap(pool.state, swap, outcome, now=now, error=error):
                    return  # F2 (docs/activator.md): superseded; never touch a newer swap's state
                pool.swap_scope = None
                self._settle_breaker(pool, swap, outcome, now)
                if outcome is SwapOutcome.SUCCESS:
                    self._report_swap(pool, swap, now, t0)
                    pool.publish_resident()
                elif outcome is not SwapOutcome.CANCELLED:  # F5: a cancelled swap stays quiet
                    self._report_swap_failure(pool, swap, outcome, error, now)
                    if outcome is SwapOutcome.ABANDONED:
                        # F4 (docs/activator.md): scale the target down while the lock is held, so
                        # no waiter can start a fresh swap whose Activate this patch would undo.
                        message = "model pool deactivate after abandoned swap failed"
                        await self._deactivate_locked(pool, swap.target, message)
                    available = self._availability.is_available
                    if rederive_resident(pool.state, available, now, self._resync_interval):
                        pool.publish_resident()
            finally:
                pool.notify()

    def _settle_breaker(
        self, pool: _Pool, swap: SwapState, outcome: SwapOutcome, now: float
    ) -> None:
        """The target's breaker learns the outcome (`settle_breaker`); one log line and the
        metrics per opening and closing (docs/activator.md, "Breaker")."""
        target, name = swap.target, pool.spec.name
        change = settle_breaker(pool.state, swap, outcome, now=now)
        breaker = pool.state.breakers.get(target)
        if change == "opened" and breaker is not None:
            log.warning(
                "model pool breaker opened",
                extra={
                    "pool": name,
                    "member": target,
                    "failures": breaker.failures,
                    "openings": breaker.openings,
                    "cooldown": round(breaker.until_half_open(now), 3),
                    "reason": breaker.reason,
                },
            )
            if self._metrics is not None:
                self._metrics.breaker_openings.labels(
                    member=target, pool=name, router=self._router
                ).inc()
            pool.publish_breaker(target, BreakerPhase.OPEN)
        elif change == "closed":
            log.info("model pool breaker closed", extra={"pool": name, "member": target})
            pool.publish_breaker(target, BreakerPhase.CLOSED)
        elif swap.probe and breaker is not None:
            pool.publish_breaker(target, breaker.phase(now))  # a cancelled probe

    def _report_swap(self, pool: _Pool, swap: SwapState, now: float, t0: float) -> None:
        """The metrics of a successful swap."""
        if self._metrics is None:
            return
        m, name, router = self._metrics, pool.spec.name, self._router
        times = pool.state.swap_times.get(swap.target)
        if times is not None:
            m.swap_time_estimate.labels(member=swap.target, pool=name, router=router).set(
                times.ewma
            )
        m.swaps.labels(
            **{"from": swap.incumbent or ""}, pool=name, router=router, to=swap.target
        ).inc()
        m.swap_duration.labels(pool=name, router=router).observe(now - t0)
        m.hold_duration.labels(member=swap.target, pool=name, router=router).observe(
            now - swap.hold_start
        )

    def _report_swap_failure(
        self,
        pool: _Pool,
        swap: SwapState,
        outcome: SwapOutcome,
        error: BaseException | None,
        now: float,
    ) -> None:
        """The error log and the failure counter of an abandoned (F4) or failed swap."""
        abandoned = outcome is SwapOutcome.ABANDONED
        reason = "deadline" if abandoned else "error"
        target = swap.target
        incumbent = swap.incumbent or ""
        if abandoned:
            elapsed = round(now - swap.started_at, 3)
            log.error(
                "model pool swap abandoned",
                extra={
                    "pool": pool.spec.name,
                    "member": target,
                    "from": incumbent,
                    "to": target,
                    "reason": reason,
                    "elapsed": elapsed,
                },
            )
        else:
            log.error(
                "model pool swap failed",
                extra={
                    "pool": pool.spec.name,
                    "member": target,
                    "from": incumbent,
                    "to": target,
                    "reason": reason,
                    "error": repr(error),
                },
            )
        self._count_failure(pool, target, reason)

    def _count_failure(self, pool: _Pool, member: str, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.swap_failures.labels(
                member=member, pool=pool.spec.name, reason=reason, router=self._router
            ).inc()

    # ---- deactivates ----------------------------------------------------------------------------

    def _schedule_deactivate(self, pool: _Pool, member: str, gen: int) -> None:
        """F1 (docs/activator.md): asynchronous, the caller never waits. At most one pending task
        per member (`request_deactivate`)."""
        if not request_deactivate(pool.state, member, gen):
            return
        try:
            self._spawn(self._deactivate_if_unwanted, pool, member)
        except ActivatorStopped:
            return  # shutting down: nothing runs the patch; the member stays as it is
        record_deactivate_task(pool.state, member, gen)

    async def _deactivate_if_unwanted(self, pool: _Pool, member: str) -> None:
        """docs/activator.md, Deferred deactivate: re-take the lock, re-check, patch under it."""
        if self.before_deactivate is not None:
            await self.before_deactivate(pool.spec.name, member)
        async with pool.lock:
            skip = claim_deactivate(pool.state, member, decides=self._decides(pool))
            if skip is None:
                await self._deactivate_locked(pool, member, "model pool deactivate failed")
                return
            if skip != "forgotten":
                log.debug(
                    "model pool deactivate skipped",
                    extra={"pool": pool.spec.name, "member": member, "reason": skip},
                )
            if pool.idle_event is not None:
                pool.signal_idle()

    async def _deactivate_locked(self, pool: _Pool, member: str, failure_message: str) -> None:
        """One bounded controller call under the pool lock (deviation from upstream,
        docs/decisions.md, D16: a
        hung controller must not freeze the pool). A timed-out patch may still have applied.

        Guarded by ownership (only the owner calls the controller), and cut short if ownership is
        lost during the call (`_apply_owner`)."""
        if not self._decides(pool):
            log.debug(
                "model pool deactivate skipped",
                extra={"pool": pool.spec.name, "member": member, "reason": "not_owner"},
            )
            return
        scope = trio.CancelScope(deadline=trio.current_time() + self._controller_timeout)
        pool.controller_calls.add(scope)
        try:
            with scope:
                try:
                    await pool.controller.deactivate(member)
                except Exception as exc:
                    log.warning(
                        failure_message,
                        extra={"pool": pool.spec.name, "member": member, "error": repr(exc)},
                    )
        finally:
            pool.controller_calls.discard(scope)
            if pool.idle_event is not None:
                pool.signal_idle()
        if scope.cancelled_caught:
            lost = not pool.owned
            log.warning(
                failure_message,
                extra={
                    "pool": pool.spec.name,
                    "member": member,
                    "error": "cut short: ownership lost (may still apply)"
                    if lost
                    else f"timed out after {self._controller_timeout}s (may still apply)",
                },
            )


def _describe(owner: Owner) -> str:
    """An owner for logs: "self", its identity or address, or "none"."""
    if owner.is_self:
        return "self"
    return owner.identity or owner.address or "none"


def _now_or_none() -> float | None:
    try:
        return trio.current_time()
    except RuntimeError:
        return None
