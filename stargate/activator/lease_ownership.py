"""Pool ownership through Kubernetes Leases: one elector per pool, at most one owner fleet-wide.

The rules are the pure functions of lease.py; this module does the I/O (GET, POST and PUT on
`coordination.k8s.io/v1` Leases through kubernetes.py's `KubernetesApi`), the timers, and the
`PoolOwnership` view the activator and the proxy read (ownership.py). docs/pool-ownership.md,
"Leases" explains the timings and the failure behaviour.

Per pool, one loop (in its own nursery, under `LeaseOwnership.run`) reads the Lease every retry
period and does what `lease.decide` says: create it, renew it, take it over, or wait. Beside it a
watchdog owns the renew deadline: it flips `Owner.is_self` to False the moment the deadline
passes without a successful renewal, even while the loop is stuck in a slow request, because the
guarantee that the next owner never overlaps with this one (ownership.py) depends on that flip
happening on time, not at the next loop iteration.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Final
from urllib.parse import quote

import httpx
import trio

from stargate.activator.kubernetes import ApiConfig, KubernetesApi, KubernetesError
from stargate.activator.lease import (
    Action,
    LeaseFormatError,
    LeaseRecord,
    LeaseTimings,
    current_holder,
    decide,
    expires_at,
    lease_name,
    observe,
    released_record,
    written_record,
)
from stargate.activator.ownership import NO_OWNER, Owner
from stargate.config import PoolOwnershipConfig

__all__ = ["LeaseClient", "LeaseOwnership", "ObservedLease"]

log = logging.getLogger(__name__)

# A follower's re-read is spread over [1, 1 + _JITTER) retry periods so that replicas started
# together do not all write at the same instant (client-go jitters its acquire loop too).
_JITTER: Final = 0.2


# ---- Lease I/O -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ObservedLease:
    """A Lease as read or written: the record, and the object's metadata (kept so that an update
    carries over labels and annotations that are not ours)."""

    record: LeaseRecord
    metadata: Mapping[str, Any]


class LeaseClient:
    """GET, create (POST) and update (PUT) the Leases of one namespace.

    An update sends `metadata.resourceVersion`, so the API server answers 409 Conflict when
    anyone wrote since it was read: the optimistic concurrency that makes two owners impossible.
    Failures raise `KubernetesError` (a malformed object too, as reason `BadResponse`).
    """

    def __init__(self, http: KubernetesApi, namespace: str) -> None:
        self.http = http
        self.namespace = namespace
        self._collection = (
            f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace, safe='')}/leases"
        )

    def path(self, name: str) -> str:
        return f"{self._collection}/{quote(name, safe='')}"

    async def get(self, name: str) -> ObservedLease | None:
        """The Lease, or None when it does not exist (404)."""
        doing = f"read pool lease {self.namespace}/{name}"
        try:
            body = await self.http.request("GET", self.path(name), None, doing)
        except KubernetesError as error:
            if error.status == 404:
                return None
            raise
        return _observed(body, doing)

    async def create(self, name: str, record: LeaseRecord) -> ObservedLease:
        """Create the Lease; 409 AlreadyExists when someone else created it first."""
        doing = f"create pool lease {self.namespace}/{name}"
        body = record.to_lease(name, self.namespace)
        answer = await self.http.request("POST", self._collection, body, doing)
        return _observed(answer, doing)

    async def update(
        self, name: str, record: LeaseRecord, metadata: Mapping[str, Any]
    ) -> ObservedLease:
        """Replace the Lease; `record.resource_version` must be the one read (else 409)."""
        doing = f"update pool lease {self.namespace}/{name}"
        if record.resource_version is None:
            raise ValueError(f"{doing}: an update needs the observed resourceVersion")
        body = record.to_lease(name, self.namespace, metadata=metadata)
        answer = await self.http.request("PUT", self.path(name), body, doing)
        return _observed(answer, doing)


def _observed(body: Mapping[str, Any], doing: str) -> ObservedLease:
    try:
        record = LeaseRecord.from_lease(body)
    except LeaseFormatError as error:
        raise KubernetesError(None, "BadResponse", f"{doing}: {error}") from error
    metadata = body.get("metadata")
    return ObservedLease(record, dict(metadata) if isinstance(metadata, Mapping) else {})


# ---- the elector ---------------------------------------------------------------------------------


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(eq=False)
class _PoolLease:
    """One pool's election state. Mutated only by its loop, its watchdog and `release`."""

    pool: str
    name: str
    observed: LeaseRecord | None = None
    observed_at: float | None = None  # None: never read successfully (unknown)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    holding: bool = False
    valid_until: float = -math.inf  # while holding: last successful write sent + renew deadline
    released: bool = False
    owner: Owner = NO_OWNER
    changed: trio.Event = field(default_factory=trio.Event)
    failing: bool = False
    lock: trio.Lock = field(default_factory=trio.Lock)
    watch: trio.CancelScope | None = None


class LeaseOwnership:
    """`PoolOwnership` for a fixed set of pools, one Lease each (see the module docstring).

    `identity` is this replica's `--stargate-id` (the Lease's holderIdentity; it must differ
    between replicas) and `owner_url` its HTTP listener as the peers reach it (stored in the
    `stargate.dev/owner-url` annotation). Leases are named `lease_name(lease_prefix, pool)` in
    `namespace`. Pass `transport` (an in-memory `httpx.ASGITransport`) or `client` to choose how
    the API server is reached; otherwise a client is made from `api` and `aclose()` closes it.
    Each request is bounded by `request_timeout` (default: half the renew deadline, so one slow
    call leaves room for another attempt before the holder must stop).
    """

    def __init__(
        self,
        pools: Iterable[str],
        *,
        identity: str,
        owner_url: str,
        namespace: str,
        api: ApiConfig,
        timings: LeaseTimings | None = None,
        lease_prefix: str = "stargate",
        client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        request_timeout: float | None = None,
        rng: random.Random | None = None,
        wall_clock: Callable[[], datetime] = _utc_now,
    ) -> None:
        if not identity:
            raise ValueError("a lease holder needs a non-empty identity")
        self.identity = identity
        self.owner_url = owner_url
        self.namespace = namespace
        self.timings = timings if timings is not None else LeaseTimings()
        self.request_timeout = (
            request_timeout if request_timeout is not None else self.timings.renew_deadline / 2
        )
        self._http = KubernetesApi(
            api,
            client=client,
            transport=transport,
            request_timeout=self.request_timeout,
            user_agent="stargate-pool-lease",
        )
        self._leases = LeaseClient(self._http, namespace)
        self._pools: dict[str, _PoolLease] = {}
        names: dict[str, str] = {}
        for pool in pools:
            name = lease_name(lease_prefix, pool)
            if name in names and names[name] != pool:
                raise ValueError(f"pools {names[name]!r} and {pool!r} map to lease {name!r}")
            names[name] = pool
            self._pools[pool] = _PoolLease(pool, name)
        self._acquiring = True
        self._rng = rng if rng is not None else random.Random()
        self._wall = wall_clock

    @classmethod
    def from_config(
        cls,
        config: PoolOwnershipConfig,
        pools: Iterable[str],
        *,
        identity: str,
        api: ApiConfig,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> LeaseOwnership:
        """Build from the `--pool-*` settings; the namespace defaults to the API configuration's
        (the Pod's own namespace in a cluster), then `default`."""
        if config.owner_url is None:
            raise ValueError("lease pool ownership needs --pool-owner-url")
        return cls(
            pools,
            identity=identity,
            owner_url=config.owner_url.rstrip("/"),
            namespace=config.lease_namespace or api.namespace or "default",
            api=api,
            timings=LeaseTimings.from_ms(
                config.lease_duration_ms, config.renew_deadline_ms, config.retry_period_ms
            ),
            lease_prefix=config.lease_prefix,
            transport=transport,
        )

    # ---- PoolOwnership ------------------------------------------------------------------------

    @property
    def pools(self) -> tuple[str, ...]:
        """The pools this object elects an owner for."""
        return tuple(self._pools)

    def owner(self, pool: str) -> Owner:
        """The pool's owner now. Raises KeyError for a pool this object was not built with."""
        state = self._state(pool)
        # Belt and braces for the watchdog: past the deadline we are not the owner, even in the
        # instant before the watchdog task has run.
        if state.owner.is_self and trio.current_time() >= state.valid_until:
            return NO_OWNER
        return state.owner

    def changed(self, pool: str) -> trio.Event:
        return self._state(pool).changed

    # ---- control ------------------------------------------------------------------------------

    def lease_name(self, pool: str) -> str:
        return self._state(pool).name

    def stop_acquiring(self) -> None:
        """Never create or take over a lease from now on (a leaving replica); the leases held are
        still renewed until `release`d, so the pools keep an owner until the hand-over."""
        self._acquiring = False

    async def release(self, pool: str) -> bool:
        """Give the pool's lease up so another replica can take it at once; True if written.

        This replica stops deciding for the pool first (before the write, so it never decides
        while another may already own it), and never renews or acquires the pool again. The
        write carries the observed resourceVersion: if anyone wrote since, nothing is released.
        When the API cannot be reached the lease simply expires.
        """
        state = self._state(pool)
        state.released = True
        self._lose(state, "released")
        async with state.lock:  # after an in-flight renewal, whose result must not count
            for attempt in range(2):
                observed = state.observed
                if observed is None or observed.holder != self.identity:
                    return False
                record = released_record(observed, self._wall())
                try:
                    written = await self._leases.update(state.name, record, state.metadata)
                except KubernetesError as error:
                    if error.status == 409 and attempt == 0:
                        # Our own renewal may have landed unseen (cancelled after it was sent):
                        # read again, and release if the Lease still names us.
                        with contextlib.suppress(KubernetesError):
                            self._observe(state, await self._leases.get(state.name))
                            continue
                    log.warning(
                        "pool lease release failed; it will expire instead",
                        extra={"pool": pool, "lease": state.name, "error": str(error)},
                    )
                    return False
                self._observe(state, written)
                self._refresh(state, "released")
                return True
            return False

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> LeaseOwnership:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Elect for every pool until cancelled. Reports started once every pool has had its
        first attempt (successful or not), so `owner` then reflects a first reading."""
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as starting:
                for state in self._pools.values():
                    starting.start_soon(nursery.start, self._elect, state)
            task_status.started()

    # ---- the loop -----------------------------------------------------------------------------

    def _state(self, pool: str) -> _PoolLease:
        try:
            return self._pools[pool]
        except KeyError:
            raise KeyError(f"no lease is kept for pool {pool!r}") from None

    async def _elect(
        self, state: _PoolLease, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_deadline, state)
            started = False
            while True:
                began = trio.current_time()
                await self._cycle(state)
                if not started:
                    task_status.started()
                    started = True
                await trio.sleep_until(self._next_attempt(state, began))

    def _next_attempt(self, state: _PoolLease, began: float) -> float:
        retry = self.timings.retry_period
        if state.holding:
            return began + retry  # a holder keeps its cadence exactly
        wake = began + retry * (1 + _JITTER * self._rng.random())
        if state.observed is not None and state.observed_at is not None and state.observed.holder:
            # Look again the moment another holder's lease lapses on our clock.
            lapse = expires_at(state.observed, state.observed_at, self.timings)
            if lapse > trio.current_time():
                wake = min(wake, lapse)
        return wake

    async def _cycle(self, state: _PoolLease) -> None:
        async with state.lock:
            try:
                fresh = await self._leases.get(state.name)
            except KubernetesError as error:
                self._failed(state, error)
                self._refresh(state, "lease unreadable")
                return
            self._observe(state, fresh)
            if state.holding and (fresh is None or fresh.record.holder != self.identity):
                self._lose(state, "another holder")
            assert state.observed_at is not None
            now = trio.current_time()
            holding = state.holding and now < state.valid_until
            decision = decide(
                state.observed,
                state.observed_at,
                now,
                self.identity,
                self.timings,
                acquiring=self._acquiring and not state.released,
                holding=holding,
            )
            if decision.action is Action.WAIT:
                self._recovered(state)
                self._refresh(state, decision.why)
                return
            record = written_record(
                decision, state.observed, self.identity, self.owner_url, self.timings, self._wall()
            )
            sent = trio.current_time()
            try:
                if decision.action is Action.CREATE:
                    written = await self._leases.create(state.name, record)
                else:
                    written = await self._leases.update(state.name, record, state.metadata)
            except KubernetesError as error:
                if error.status == 409:
                    # Someone wrote first: the race is lost, whatever we believed.
                    self._recovered(state)
                    self._lose(state, "conflict")
                    log.debug("pool lease write lost a race: %s", error)
                else:
                    self._failed(state, error)
                    self._refresh(state, "lease write failed")
                return
            self._recovered(state)
            self._observe(state, written)
            valid_until = sent + self.timings.renew_deadline
            if not state.released and trio.current_time() < valid_until:
                state.holding = True
                state.valid_until = valid_until
                self._arm(state)
            self._refresh(state, decision.action.value)

    async def _watch_deadline(self, state: _PoolLease) -> None:
        """Flip to not-owner when the renew deadline passes; `_arm` moves the deadline."""
        while True:
            with trio.CancelScope(deadline=self._deadline(state)) as scope:
                state.watch = scope
                await trio.sleep_forever()
            if state.holding and trio.current_time() >= state.valid_until:
                self._lose(state, "renew deadline passed")

    def _deadline(self, state: _PoolLease) -> float:
        return state.valid_until if state.holding else math.inf

    def _arm(self, state: _PoolLease) -> None:
        if state.watch is not None:
            state.watch.deadline = self._deadline(state)

    # ---- state changes ------------------------------------------------------------------------

    def _observe(self, state: _PoolLease, fresh: ObservedLease | None) -> None:
        record = None if fresh is None else fresh.record
        state.observed, state.observed_at = observe(
            state.observed, state.observed_at, record, trio.current_time()
        )
        if fresh is not None:
            state.metadata = fresh.metadata

    def _lose(self, state: _PoolLease, reason: str) -> None:
        state.holding = False
        state.valid_until = -math.inf
        self._arm(state)
        self._refresh(state, reason)

    def _refresh(self, state: _PoolLease, reason: str) -> None:
        """Recompute the pool's owner from the state; log and signal a change."""
        now = trio.current_time()
        if state.holding and now < state.valid_until and not state.released:
            new = Owner(is_self=True, address=self.owner_url, identity=self.identity)
        elif state.observed_at is None:
            new = NO_OWNER  # never read: unknown
        else:
            holder = current_holder(state.observed, state.observed_at, now, self.timings)
            if holder is None or holder.holder == self.identity:
                new = NO_OWNER  # free, lapsed, or ours but no longer decided on
            else:
                new = Owner(is_self=False, address=holder.owner_url, identity=holder.holder)
        old = state.owner
        if new == old:
            return
        state.owner = new
        log.info(
            "pool owner changed",
            extra={
                "pool": state.pool,
                "old_owner": old.identity,
                "new_owner": new.identity,
                "owner_is_self": new.is_self,
                "reason": reason,
            },
        )
        state.changed.set()
        state.changed = trio.Event()

    def _failed(self, state: _PoolLease, error: KubernetesError) -> None:
        """One WARNING per failure streak: a streak ends only with a cycle in which every request
        was answered (a readable API that refuses writes is still failing)."""
        if state.failing:
            log.debug("pool lease API still failing: %s", error)
            return
        state.failing = True
        log.warning(
            "pool lease API failing; retrying every retry period",
            extra={"pool": state.pool, "lease": state.name, "error": str(error)},
        )

    def _recovered(self, state: _PoolLease) -> None:
        if state.failing:
            state.failing = False
            log.info("pool lease API answering again", extra={"pool": state.pool})
