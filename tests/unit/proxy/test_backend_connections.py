"""Per-backend connection caps (docs/data-plane.md, "Per-backend connections").

The pool's O(1) answers (`any_full`, `has_free_slot`, `load`) and its release of departed
backends' idle connections (`close_idle_except`); the forwarder preferring a backend or cluster
with a free connection over one at its cap, waiting only when every candidate is full, and the
503 when none frees up; and the scrape-time `proxy_backend_connections` family. Real loopback
servers (the h11 test server of test_upstream.py), real clock, a cap of 1 or 2.
"""

from __future__ import annotations

import h11
import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest

from stargate.config import ProxyConfig
from stargate.load_balancing.config import AlgorithmSpec, LbConfig
from stargate.metrics import Metrics, ProxyMetrics
from stargate.proxy.contract import ProxyRequest
from stargate.proxy.forwarder import Forwarded, Forwarder, LocalError
from stargate.routing import (
    BackendRoute,
    ModelStats,
    RegistrationIdentity,
    RoutingState,
    RoutingTargetKey,
)
from stargate.upstream import ConnectionPool, UpstreamConfig, UpstreamResponse
from stargate.upstream.connection_pool import OriginLoad
from tests.unit.proxy.test_upstream import Server, ServerConn, echo, start_server

MODEL = "m"
ROUND_ROBIN = AlgorithmSpec(name="round-robin")


# ---- the pool's counts --------------------------------------------------------------------------


async def test_a_full_origin_is_known_in_o1_and_counts_in_use_idle_and_waiting(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, echo)
    other = await start_server(nursery, echo)
    config = UpstreamConfig(max_connections_per_origin=2, pool_acquire_timeout=5)
    async with ConnectionPool(config) as pool:
        base = server.url("")
        assert not pool.any_full and pool.has_free_slot(base)
        assert pool.load(base) == OriginLoad(0, 0, 0)
        first = await pool.request("GET", server.url("/1"), [])
        assert not pool.any_full and pool.load(base) == OriginLoad(1, 0, 0)
        second = await pool.request("GET", server.url("/2"), [])
        assert pool.any_full
        assert not pool.has_free_slot(base)
        assert not pool.has_free_slot(server.url("/any/path?q=1"))  # any URL of the origin
        assert pool.has_free_slot(other.url(""))  # another origin has room
        assert pool.load(base) == OriginLoad(2, 0, 0)

        got: list[UpstreamResponse] = []

        async def waiter() -> None:
            got.append(await pool.request("GET", server.url("/3"), []))

        async with trio.open_nursery() as inner:
            inner.start_soon(waiter)
            await trio.sleep(0.05)
            assert pool.load(base) == OriginLoad(2, 0, 1)
            async with first:
                await first.read()
        # The slot passed straight to the waiter: still full, nobody waits.
        assert pool.any_full and pool.load(base) == OriginLoad(2, 0, 0)
        for response in (second, *got):
            async with response:
                await response.read()
        assert not pool.any_full and pool.has_free_slot(base)
        assert pool.load(base) == OriginLoad(0, 2, 0)


async def test_close_idle_except_releases_the_origins_of_departed_backends(
    nursery: trio.Nursery,
) -> None:
    staying = await start_server(nursery, echo)
    leaving = await start_server(nursery, echo)
    async with ConnectionPool() as pool:
        held = await pool.request("GET", leaving.url("/streaming"), [])
        for server in (staying, leaving):
            async with await pool.request("GET", server.url("/"), []) as response:
                await response.read()
        assert pool.origin_count == 2
        assert pool.close_idle_except([staying.url("")]) == 1  # the departed one's idle
        assert pool.load(staying.url("")) == OriginLoad(0, 1, 0)
        assert pool.load(leaving.url("")) == OriginLoad(1, 0, 0)  # in use: left to finish
        await leaving.wait_disconnects(1)
        async with held:
            await held.read()
        # Released after the departure: pooled, and closed by the next housekeeping.
        assert pool.close_idle_except([staying.url("")]) == 1
        assert pool.origin_count == 1
        assert pool.stats().open_connections == 1


# ---- the forwarder prefers room -----------------------------------------------------------------


def _request(index: int) -> ProxyRequest:
    return ProxyRequest(
        endpoint="chat_completions",
        target_path=b"/v1/chat/completions",
        request_id=f"r{index}",
        model_id=MODEL,
        input_tokens=10,
        routing_key=None,
        routing_method=None,
        priority=0,
        max_wait_ms=None,
        request_slo_ms=None,
        cache_affinity_key=None,
        retry_budget_ms=None,
        headers=[],
    )


class _Setup:
    """Backends (one loopback server each) registered for MODEL, a pool with a small cap, and a
    forwarder that asks the pool which backends have room, as the runtime wires it."""

    def __init__(
        self, servers: dict[str, tuple[Server, str]], cap: int, acquire_timeout: float = 5.0
    ) -> None:
        self.routing = RoutingState()
        for server_id, (server, cluster_id) in servers.items():
            identity = RegistrationIdentity(server_id, cluster_id, server.url(""), None)
            registration = self.routing.begin(identity)
            self.routing.apply(registration, {MODEL: BackendRoute(ModelStats(), 1_000_000, 0.0)})
        self.registry = CollectorRegistry()
        self.pool = ConnectionPool(
            UpstreamConfig(max_connections_per_origin=cap, pool_acquire_timeout=acquire_timeout)
        )
        self.forwarder = Forwarder(
            self.routing,
            self.pool,
            ProxyConfig(),
            LbConfig(),
            ProxyMetrics.create(self.registry, "test_"),
            capacity=self.pool,
        )
        self.sent = 0

    async def forward(self) -> Forwarded | LocalError:
        self.sent += 1
        return await self.forwarder.forward(_request(self.sent), ROUND_ROBIN, b"{}")

    async def hold(self) -> Forwarded:
        """A request whose response stays open, holding its connection (a stream)."""
        result = await self.forward()
        assert isinstance(result, Forwarded)
        return result

    def attempts(self, result: str) -> float:
        total = 0.0
        for metric in self.registry.collect():
            for sample in metric.samples:
                if sample.name == "test_proxy_attempts_total" and sample.labels["result"] == result:
                    total += sample.value
        return total


async def _finish(forwarded: Forwarded) -> None:
    async with forwarded.response as response:
        await response.read()


async def test_load_moves_to_the_cluster_with_room_instead_of_waiting(
    nursery: trio.Nursery,
) -> None:
    a, b = await start_server(nursery, echo), await start_server(nursery, echo)
    setup = _Setup({"a": (a, "ca"), "b": (b, "cb")}, cap=1)
    first = await setup.hold()  # round robin: cluster ca
    second = await setup.hold()  # cluster cb
    assert (first.backend.inference_server_id, second.backend.inference_server_id) == ("a", "b")
    await _finish(second)
    # The round robin's turn is ca, at its cap: cb has room, so the request goes there at once
    # instead of waiting up to 5 s for ca's connection.
    with trio.fail_after(1):
        third = await setup.hold()
    assert third.backend.inference_server_id == "b"
    await _finish(third)
    await _finish(first)
    assert len(a.requests) == 1 and len(b.requests) == 2


async def test_load_moves_to_the_sibling_with_room_instead_of_waiting(
    nursery: trio.Nursery,
) -> None:
    a, b = await start_server(nursery, echo), await start_server(nursery, echo)
    setup = _Setup({"a": (a, "c"), "b": (b, "c")}, cap=1)
    first = await setup.hold()  # the cluster's backend round robin: a, then b
    second = await setup.hold()
    assert (first.backend.inference_server_id, second.backend.inference_server_id) == ("a", "b")
    await _finish(second)
    with trio.fail_after(1):
        third = await setup.hold()  # a's turn, but a is at its cap
    assert third.backend.inference_server_id == "b"
    await _finish(third)
    await _finish(first)


async def test_when_every_candidate_is_full_a_request_waits_for_the_first_free_connection(
    nursery: trio.Nursery,
) -> None:
    a, b = await start_server(nursery, echo), await start_server(nursery, echo)
    setup = _Setup({"a": (a, "ca"), "b": (b, "cb")}, cap=1)
    held = [await setup.hold(), await setup.hold()]
    results: list[Forwarded | LocalError] = []

    async def late() -> None:
        results.append(await setup.forward())

    async with trio.open_nursery() as inner:
        inner.start_soon(late)
        await trio.sleep(0.1)
        assert results == []  # queued on a connection, not answered
        assert setup.pool.load(a.url("")).waiting + setup.pool.load(b.url("")).waiting == 1
        for forwarded in held:
            await _finish(forwarded)
    (result,) = results
    assert isinstance(result, Forwarded)
    await _finish(result)
    assert setup.attempts("proxy_503") == 0


async def test_a_full_fleet_that_stays_full_is_a_503_after_the_acquire_timeout_without_retries(
    nursery: trio.Nursery,
) -> None:
    a, b = await start_server(nursery, echo), await start_server(nursery, echo)
    setup = _Setup({"a": (a, "ca"), "b": (b, "cb")}, cap=1, acquire_timeout=0.5)
    held = [await setup.hold(), await setup.hold()]
    started = trio.current_time()
    result = await setup.forward()
    waited = trio.current_time() - started
    assert isinstance(result, LocalError)
    error = result.error
    assert error.status == 503 and error.body == b"" and error.headers == []  # the bare 503
    assert error.code == "no_available_backend"
    assert error.message is not None and "--proxy-max-connections-per-backend" in error.message
    # One wait of the acquire timeout, not one per candidate: every candidate was full, another
    # one would only be waited for again. No connect retry is spent, nothing was sent. The
    # lower bound is causal (the wait starts inside `forward`); the upper one is a second wait,
    # so a loaded machine has the whole acquire timeout (0.5 s) of headroom, not a guess.
    assert 0.5 <= waited < 1.0
    assert setup.attempts("proxy_503") == 1
    assert len(a.requests) + len(b.requests) == 2
    for forwarded in held:
        await _finish(forwarded)


async def test_without_a_full_backend_the_choice_is_unchanged(nursery: trio.Nursery) -> None:
    """Below every cap nothing is filtered: the round robin alternates as before."""

    async def slow(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await echo(conn, request, body)

    a, b = await start_server(nursery, slow), await start_server(nursery, slow)
    setup = _Setup({"a": (a, "ca"), "b": (b, "cb")}, cap=8)
    chosen = []
    for _ in range(4):
        forwarded = await setup.hold()
        chosen.append(forwarded.backend.inference_server_id)
        await _finish(forwarded)
    assert chosen == ["a", "b", "a", "b"]
    assert not setup.pool.any_full


# ---- the metric ---------------------------------------------------------------------------------


def test_backend_connections_are_exported_from_the_rows_of_the_last_refresh() -> None:
    registry = CollectorRegistry(auto_describe=True)
    metrics = Metrics(registry, "test_")
    family = "test_proxy_backend_connections"
    assert f"# TYPE {family} gauge" in generate_latest(registry).decode()
    metrics.backend_connections.update([("engine-a", 3, 2, 0), ("engine-b", 1024, 0, 7)])
    text = generate_latest(registry).decode()
    for line in (
        f'{family}{{inference_server_id="engine-a",state="in_use"}} 3.0',
        f'{family}{{inference_server_id="engine-a",state="idle"}} 2.0',
        f'{family}{{inference_server_id="engine-a",state="waiting"}} 0.0',
        f'{family}{{inference_server_id="engine-b",state="in_use"}} 1024.0',
        f'{family}{{inference_server_id="engine-b",state="waiting"}} 7.0',
    ):
        assert line in text
    metrics.backend_connections.update([("engine-b", 0, 1, 0)])  # engine-a left
    assert "engine-a" not in generate_latest(registry).decode()


def test_the_cap_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="--proxy-max-connections-per-backend"):
        ProxyConfig(max_connections_per_backend=0)
    assert ProxyConfig().max_connections_per_backend == 1024
    assert UpstreamConfig().max_connections_per_origin == 1024


def test_forget_departed_drops_counters_of_clusters_that_left_a_live_target() -> None:
    routing = RoutingState()
    registrations = {}
    for server_id in ("stays", "leaves"):
        identity = RegistrationIdentity(server_id, f"c-{server_id}", "http://127.0.0.1:9", None)
        registrations[server_id] = registration = routing.begin(identity)
        routing.apply(registration, {MODEL: BackendRoute(ModelStats(), 1_000_000, 0.0)})
    forwarder = Forwarder(
        routing,
        ConnectionPool(),
        ProxyConfig(),
        LbConfig(),
        ProxyMetrics.create(CollectorRegistry(), "test_"),
    )
    target = RoutingTargetKey(None, MODEL)
    forwarder._backend_counters.update({(target, "c-stays"): 3, (target, "c-leaves"): 5})
    forwarder._balancers.get(target, ROUND_ROBIN)
    gone = RoutingTargetKey(None, "gone")
    forwarder._balancers.get(gone, ROUND_ROBIN)  # a target with no backend left
    routing.end(registrations["leaves"])  # the target keeps its other cluster
    forwarder.forget_departed()
    assert forwarder._backend_counters == {(target, "c-stays"): 3}
    assert forwarder.retained == {"balancers": 1, "cluster_counters": 1, "head_waits": 0}
