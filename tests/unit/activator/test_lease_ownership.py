"""`LeaseOwnership` against the fake API server, in memory, under `trio.testing.MockClock`.

Every replica is a `LeaseOwnership` with its own `httpx.ASGITransport` (client host = its
identity, so the fake can partition one replica), all sharing one fake API server. A monitor
checks at every mock millisecond-step, and at every ownership event, that at most one replica
says `is_self` and that a replica saying so is the one the stored Lease names
(docs/pool-ownership.md, "Leases").
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import httpx
import pytest
import trio
from trio.testing import MockClock

from stargate.activator.kubernetes import ApiConfig, KubernetesApi, KubernetesError
from stargate.activator.lease import LeaseRecord, LeaseTimings, lease_name
from stargate.activator.lease_ownership import LeaseClient, LeaseOwnership
from stargate.activator.ownership import NO_OWNER, Owner, PoolOwnership
from stargate.config import PoolOwnershipConfig
from tests.fakes.kube_api import NS, TOKEN, FakeApiServer

POOL = "gpu0"
LEASE = lease_name("stargate", POOL)
T = LeaseTimings(lease_duration=15, renew_deadline=10, retry_period=2)
API = ApiConfig(server="http://kube.test", token=TOKEN)
LOGGER = "stargate.activator.lease_ownership"


def replica(
    api: FakeApiServer,
    name: str,
    pools: Sequence[str] = (POOL,),
    *,
    wall_clock: Callable[[], datetime] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> LeaseOwnership:
    extra: dict[str, Any] = {} if wall_clock is None else {"wall_clock": wall_clock}
    return LeaseOwnership(
        pools,
        identity=name,
        owner_url=f"http://{name}:8000",
        namespace=NS,
        api=API,
        timings=T,
        transport=transport if transport is not None else api.transport(name),
        rng=random.Random(name),
        **extra,
    )


class Fleet:
    """Running replicas, each in its own cancel scope (cancelling it is a crash: no release)."""

    def __init__(self, api: FakeApiServer, nursery: trio.Nursery) -> None:
        self.api = api
        self.nursery = nursery
        self.replicas: dict[str, LeaseOwnership] = {}
        self.started: list[LeaseOwnership] = []
        self.scopes: dict[str, trio.CancelScope] = {}
        self.violations: list[str] = []
        self.changes: list[tuple[float, str, Owner]] = []

    async def start(self, ownership: LeaseOwnership) -> LeaseOwnership:
        scope = trio.CancelScope()

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await ownership.run(task_status=task_status)

        self.replicas[ownership.identity] = ownership
        self.started.append(ownership)
        self.scopes[ownership.identity] = scope
        await self.nursery.start(run)
        self.nursery.start_soon(self._follow, ownership)
        self.check()
        return ownership

    def crash(self, name: str) -> None:
        self.scopes[name].cancel()
        # A dead process decides nothing; take it out of the invariant (its object is inert).
        del self.replicas[name]

    def owners(self, pool: str = POOL) -> list[str]:
        return [n for n, r in self.replicas.items() if r.owner(pool).is_self]

    def check(self, pool: str = POOL) -> None:
        owners = self.owners(pool)
        now = trio.current_time()
        if len(owners) > 1:
            self.violations.append(f"{now:.3f}: two owners {owners}")
        holder = self.api.lease_holder(lease_name("stargate", pool))
        for name in owners:
            if holder != name:
                self.violations.append(f"{now:.3f}: {name} is_self, lease names {holder!r}")

    async def monitor(self, step: float = 0.05) -> None:
        while True:
            self.check()
            await trio.sleep(step)

    async def _follow(self, ownership: LeaseOwnership) -> None:
        while True:
            event = ownership.changed(POOL)
            await event.wait()
            self.changes.append((trio.current_time(), ownership.identity, ownership.owner(POOL)))
            self.check()


@asynccontextmanager
async def fleet(api: FakeApiServer) -> AsyncIterator[Fleet]:
    async with trio.open_nursery() as nursery:
        f = Fleet(api, nursery)
        nursery.start_soon(f.monitor)
        try:
            yield f
        finally:
            nursery.cancel_scope.cancel()
    for ownership in f.started:
        await ownership.aclose()
    assert f.violations == []


async def wait_for(predicate: Callable[[], bool], *, within: float, step: float = 0.01) -> float:
    """Wait (mock time) until `predicate()`; return when it became true."""
    with trio.fail_after(within):
        # Polling in mock time: the step bounds how late a change is noticed, not the test's speed.
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(step)
    return trio.current_time()


def lease_writes(api: FakeApiServer, host: str) -> list[float]:
    """When `host`'s lease writes (POST/PUT) arrived."""
    return [c.at for c in api.calls if c.client == host and c.method in ("POST", "PUT")]


# ---- one owner -----------------------------------------------------------------------------------


async def test_the_first_replica_creates_the_lease_and_owns_the_pool(
    autojump_clock: MockClock,
) -> None:
    api = FakeApiServer()
    async with replica(api, "a") as a, fleet(api) as f:
        await f.start(a)
        assert a.owner(POOL) == Owner(is_self=True, address="http://a:8000", identity="a")
        lease = api.lease(LEASE)
        assert lease is not None
        assert lease["metadata"]["annotations"] == {"stargate.dev/owner-url": "http://a:8000"}
        assert lease["spec"]["holderIdentity"] == "a"
        assert lease["spec"]["leaseDurationSeconds"] == 15
        assert lease["spec"]["leaseTransitions"] == 0
        first_renew = lease["spec"]["renewTime"]
        await trio.sleep(30)
        assert a.owner(POOL).is_self
        # Renewed every retry period: GET then PUT with the version just read.
        puts = [c for c in api.calls if c.method == "PUT"]
        assert 14 <= len(puts) <= 16
        assert all(c.body["metadata"]["resourceVersion"] for c in puts)
        assert api.lease(LEASE)["spec"]["renewTime"] > first_renew  # type: ignore[index]
        protocol: PoolOwnership = a  # mypy checks that it honours the contract
        assert protocol.changed(POOL) is a.changed(POOL)


@pytest.mark.parametrize("count", [2, 3])
async def test_contenders_agree_on_exactly_one_owner(autojump_clock: MockClock, count: int) -> None:
    api = FakeApiServer()
    names = ["a", "b", "c"][:count]
    async with fleet(api) as f:
        # All start in the same instant: they race to create, and POST conflicts decide.
        async with trio.open_nursery() as starting:
            for name in names:
                starting.start_soon(f.start, replica(api, name))
        await trio.sleep(1)
        owners = f.owners()
        assert len(owners) == 1
        holder = owners[0]
        for name in names:
            seen = f.replicas[name].owner(POOL)
            if name != holder:
                assert seen == Owner(False, f"http://{holder}:8000", holder)
        await trio.sleep(60)
        assert f.owners() == [holder]  # a healthy owner keeps its pool: no flapping


async def test_a_stale_write_is_refused_with_409() -> None:
    api = FakeApiServer()
    http = KubernetesApi(API, transport=api.transport("x"))
    leases = LeaseClient(http, NS)
    try:
        assert await leases.get("l") is None
        created = await leases.create("l", LeaseRecord("a", "http://a:8000", 15))
        with pytest.raises(KubernetesError) as exists:
            await leases.create("l", LeaseRecord("b", "http://b:8000", 15))
        assert (exists.value.status, exists.value.reason) == (409, "AlreadyExists")
        read = await leases.get("l")
        assert read is not None and read.record == created.record
        rv = created.record.resource_version
        renewed = await leases.update("l", LeaseRecord("a", "u", 15, resource_version=rv), {})
        assert renewed.record.resource_version != rv
        with pytest.raises(KubernetesError) as stale:  # b decided on the old version
            await leases.update("l", LeaseRecord("b", "u", 15, resource_version=rv), {})
        assert (stale.value.status, stale.value.reason) == (409, "Conflict")
        with pytest.raises(ValueError, match="needs the observed resourceVersion"):
            await leases.update("l", LeaseRecord("b", "u", 15), {})
        # The fake mirrors the API server: an update without a resourceVersion is invalid.
        raw = await http.request("GET", leases.path("l"), None, "read")
        del raw["metadata"]["resourceVersion"]
        with pytest.raises(KubernetesError) as invalid:
            await http.request("PUT", leases.path("l"), raw, "write")
        assert (invalid.value.status, invalid.value.reason) == (422, "Invalid")
        stored = api.lease("l")
        assert stored is not None and stored["spec"]["holderIdentity"] == "a"
    finally:
        await http.aclose()


async def test_a_conflict_on_renewal_ends_ownership_at_once(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    api = FakeApiServer()
    async with replica(api, "a") as a, fleet(api) as f:
        await f.start(a)
        conflict = (409, "Conflict", "the object has been modified")
        api.script[("PUT", api.lease_path(LEASE))] = [conflict]
        # Only what follows the conflict: the creation may already be in the records when an
        # earlier test left the logger at INFO.
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=LOGGER):
            lost = await wait_for(lambda: not a.owner(POOL).is_self, within=3)
            # Not "expired": the record still names a, and nobody else holds it.
            assert a.owner(POOL) == NO_OWNER
            back = await wait_for(lambda: a.owner(POOL).is_self, within=3)
        # The next attempt, one (jittered) retry period later, renews: nobody else holds it.
        assert T.retry_period <= back - lost <= T.retry_period * 1.2 + 0.01
        reasons = [r.reason for r in caplog.records if r.getMessage() == "pool owner changed"]  # type: ignore[attr-defined]
        assert reasons == ["conflict", "renew"]


# ---- takeover ------------------------------------------------------------------------------------


async def test_a_crashed_owner_is_replaced_only_after_the_duration_on_the_followers_clock(
    autojump_clock: MockClock,
) -> None:
    api = FakeApiServer()
    # Wall clocks an hour apart either way: renewTime is never what expiry is judged by.
    skewed = {
        "a": lambda: datetime.now(UTC) - timedelta(hours=1),
        "b": lambda: datetime.now(UTC) + timedelta(hours=1),
        "c": lambda: datetime.now(UTC),
    }
    async with fleet(api) as f:
        for name in "abc":
            await f.start(replica(api, name, wall_clock=skewed[name]))
        assert f.owners() == ["a"]
        await trio.sleep(7)
        f.crash("a")
        last_renewal = lease_writes(api, "a")[-1]
        taken = await wait_for(lambda: len(f.owners()) == 1, within=30)
        assert taken >= last_renewal + T.lease_duration
        assert taken <= last_renewal + T.lease_duration + T.retry_period * 1.2 + 0.1
        new = f.owners()[0]
        other = "c" if new == "b" else "b"
        # The other follower hears of the new owner at its next read.
        expected = Owner(False, f"http://{new}:8000", new)
        await wait_for(lambda: f.replicas[other].owner(POOL) == expected, within=2.5)
        stored = api.lease(LEASE)
        assert stored is not None and stored["spec"]["leaseTransitions"] == 1


async def test_a_lease_left_by_a_dead_replica_waits_out_a_full_duration(
    autojump_clock: MockClock,
) -> None:
    api = FakeApiServer()
    ghost = LeaseRecord("ghost", "http://ghost:8000", 15, resource_version=None)
    path = api.lease_path(LEASE)
    api.objects[path] = ghost.to_lease(LEASE, NS)
    api.objects[path]["metadata"].update(resourceVersion="5", uid="u", creationTimestamp="x")
    # Its renewTime says 2020: a follower that trusted it would take over at once.
    api.objects[path]["spec"]["renewTime"] = "2020-01-01T00:00:00.000000Z"
    async with replica(api, "b") as b, fleet(api) as f:
        start = trio.current_time()
        await f.start(b)
        assert b.owner(POOL) == Owner(False, "http://ghost:8000", "ghost")
        taken = await wait_for(lambda: b.owner(POOL).is_self, within=20)
        assert start + T.lease_duration <= taken <= start + T.lease_duration + 0.01
        assert [(o.identity, o.is_self) for _, _, o in f.changes] == [("b", True)]


# ---- leaving -------------------------------------------------------------------------------------


async def test_release_hands_the_pool_over_at_once(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    api = FakeApiServer()
    seen_at_release: list[bool] = []
    a: LeaseOwnership

    async def spy(
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope.get("method") == "PUT":
            seen_at_release.append(a.owner(POOL).is_self)
        await api(scope, receive, send)

    a = replica(api, "a", transport=httpx.ASGITransport(app=spy, client=("a", 1)))
    async with a, replica(api, "b") as b, fleet(api) as f:
        await f.start(a)
        await f.start(b)
        await trio.sleep(5)
        assert f.owners() == ["a"]
        a.stop_acquiring()
        await trio.sleep(5)
        assert f.owners() == ["a"]  # still renewed while held
        seen_at_release.clear()
        with caplog.at_level(logging.INFO, logger=LOGGER):
            released_at = trio.current_time()
            assert await a.release(POOL)
        assert seen_at_release == [False]  # not-owner before the write went out
        freed = api.lease(LEASE)
        assert freed is not None
        assert freed["spec"]["holderIdentity"] == ""
        assert freed["spec"]["leaseDurationSeconds"] == 1
        assert "annotations" not in freed["metadata"]
        taken = await wait_for(lambda: b.owner(POOL).is_self, within=T.lease_duration)
        assert taken - released_at <= T.retry_period * 1.2 + 0.01  # not a lease duration
        await wait_for(lambda: a.owner(POOL) == Owner(False, "http://b:8000", "b"), within=2.5)
        assert not await a.release(POOL)  # not held any more: nothing written
        line = next(r for r in caplog.records if getattr(r, "reason", None) == "released")
        assert (line.pool, line.old_owner, line.new_owner) == (POOL, "a", None)  # type: ignore[attr-defined]


async def test_a_released_pool_is_never_taken_back(autojump_clock: MockClock) -> None:
    api = FakeApiServer()
    async with replica(api, "a") as a, fleet(api) as f:
        await f.start(a)
        assert await a.release(POOL)  # still acquiring other pools, but not this one
        await trio.sleep(60)
        assert a.owner(POOL) == NO_OWNER
        assert api.lease_holder(LEASE) == ""


async def test_release_after_a_renewal_that_landed_unseen_still_releases(
    autojump_clock: MockClock,
) -> None:
    """A renewal cut off after it was sent (a shutdown cancelling the elector) may have been
    applied: the release's resourceVersion is then stale. It reads the Lease again and releases
    it if it still names this replica, instead of leaving it to expire."""
    api = FakeApiServer()
    async with replica(api, "a") as a, fleet(api) as f:
        await f.start(a)
        stored = api.lease(LEASE)
        assert stored is not None and stored["spec"]["holderIdentity"] == "a"
        api.version += 1  # what our own unseen renewal did on the server
        stored["metadata"]["resourceVersion"] = str(api.version)
        assert await a.release(POOL)
        assert api.lease_holder(LEASE) == ""
        puts = [c for c in api.calls if c.method == "PUT" and c.path == api.lease_path(LEASE)]
        assert len(puts) >= 2  # the stale attempt (409), then the one after a fresh read


async def test_a_replica_that_stopped_acquiring_takes_nothing(autojump_clock: MockClock) -> None:
    api = FakeApiServer()
    async with replica(api, "a") as a, replica(api, "b") as b, fleet(api) as f:
        b.stop_acquiring()
        await f.start(b)
        await trio.sleep(30)
        assert api.lease(LEASE) is None and b.owner(POOL) == NO_OWNER  # never created
        await f.start(a)
        assert f.owners() == ["a"]
        f.crash("a")
        await trio.sleep(3 * T.lease_duration)
        assert b.owner(POOL) == NO_OWNER  # expired, and b may not take it
        assert api.lease_holder(LEASE) == "a"


# ---- failures ------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", ["503", "timeout"])
async def test_a_partitioned_owner_stops_deciding_before_its_lease_can_be_taken(
    autojump_clock: MockClock,
    caplog: pytest.LogCaptureFixture,
    answer: Literal["503", "timeout"],
) -> None:
    api = FakeApiServer()
    async with fleet(api) as f:
        for name in "abc":
            await f.start(replica(api, name))
        a = f.replicas["a"]
        await trio.sleep(6.5)
        with caplog.at_level(logging.INFO, logger=LOGGER):
            api.partition("writes", answer=answer, hosts={"a"})
            last_renewal = lease_writes(api, "a")[-1]
            stopped = await wait_for(lambda: not a.owner(POOL).is_self, within=20, step=0.001)
            taken = await wait_for(
                lambda: any(r.owner(POOL).is_self for r in f.replicas.values()), within=20
            )
        # The renew deadline, measured from when the last good renewal was sent...
        assert stopped == pytest.approx(last_renewal + T.renew_deadline, abs=0.002)
        assert stopped < last_renewal + T.lease_duration
        # ...and nobody else before a full lease duration after it.
        assert taken >= last_renewal + T.lease_duration
        new = f.owners()[0]
        assert new in ("b", "c")
        expected = Owner(False, f"http://{new}:8000", new)
        await wait_for(lambda: a.owner(POOL) == expected, within=2.5)  # a still reads
        warnings = [
            r
            for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith("pool lease API failing")
        ]
        assert len(warnings) == 1  # once per failure streak, not once per attempt
        assert getattr(warnings[0], "pool", None) == POOL
        assert TOKEN not in caplog.text
        changes = [
            (r.old_owner, r.new_owner, r.reason)  # type: ignore[attr-defined]
            for r in caplog.records
            if r.getMessage() == "pool owner changed" and r.name == LOGGER
        ]
        assert ("a", None, "renew deadline passed") in changes
        api.heal()
        await trio.sleep(10)
        assert f.owners() == [new]


async def test_an_unreachable_api_is_retried_and_warned_about_once(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    api = FakeApiServer()
    refusing = True

    async def handler(request: httpx.Request) -> httpx.Response:
        if refusing:
            raise httpx.ConnectError("connection refused", request=request)
        transport = api.transport("a")
        return await transport.handle_async_request(request)

    transport = httpx.MockTransport(handler)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        async with replica(api, "a", transport=transport) as a, fleet(api) as f:
            await f.start(a)
            await trio.sleep(20)
            assert a.owner(POOL) == NO_OWNER
            refusing = False
            await wait_for(lambda: a.owner(POOL).is_self, within=3)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "ConnectError" in warnings[0].error  # type: ignore[attr-defined]
    assert sum(r.getMessage() == "pool lease API answering again" for r in caplog.records) == 1
    assert TOKEN not in caplog.text


# ---- bookkeeping ---------------------------------------------------------------------------------


async def test_each_pool_has_its_own_lease_and_owner(autojump_clock: MockClock) -> None:
    api = FakeApiServer()
    pools = ["gpu0", "GPU0", "heavy_slot"]
    async with replica(api, "a", pools) as a, replica(api, "b", pools) as b:
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await nursery.start(b.run)
            names = {a.lease_name(p) for p in pools}
            assert len(names) == 3
            assert all(api.lease_holder(n) == "a" for n in names)
            assert all(b.owner(p).identity == "a" for p in pools)
            nursery.cancel_scope.cancel()
        with pytest.raises(KeyError, match="no lease is kept for pool 'other'"):
            a.owner("other")


def test_built_from_the_pool_ownership_settings() -> None:
    config = PoolOwnershipConfig(
        mode="lease",
        lease_prefix="llm",
        lease_duration_ms=9_000,
        renew_deadline_ms=6_000,
        retry_period_ms=1_000,
        owner_url="http://10.0.0.7:8000/",
    )
    api = ApiConfig(server="http://kube.test", namespace="llm-ns", token=TOKEN)
    ownership = LeaseOwnership.from_config(config, ["gpu0"], identity="r1", api=api)
    assert ownership.timings == LeaseTimings(9, 6, 1)
    assert ownership.namespace == "llm-ns"
    assert ownership.owner_url == "http://10.0.0.7:8000"
    assert ownership.lease_name("gpu0") == "llm-pool-gpu0"
    assert ownership.request_timeout == 3
    with pytest.raises(ValueError, match="--pool-owner-url"):
        LeaseOwnership.from_config(PoolOwnershipConfig(mode="lease"), [], identity="r", api=api)
