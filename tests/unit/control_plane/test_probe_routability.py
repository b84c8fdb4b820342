"""Stale routes die fast (docs/stale-routes.md), without processes: the probe verdict rule, its
effect on a registration's routes between Pylon updates, the routing state's unroutable listener,
and the forwarder's cancellation of attempts waiting for a response head. Virtual time (MockClock)
throughout; the real-process checks are in tests/e2e/test_stale_routes.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import pytest
import trio
from prometheus_client import CollectorRegistry
from trio.testing import MockClock

from stargate.config import ProxyConfig
from stargate.control_plane.auth import OpenAuthenticator
from stargate.control_plane.health import HealthMonitor, ProbeVerdict
from stargate.control_plane.registration import RegistrationConfig, RegistrationService
from stargate.grpc_asgi import RequestStream, RpcContext
from stargate.health_probe import ProbeFailed
from stargate.load_balancing.config import AlgorithmSpec, LbConfig
from stargate.metrics import ProxyMetrics
from stargate.protocol import stargate_pb2 as pb
from stargate.proxy.contract import ProxyRequest
from stargate.proxy.forwarder import Forwarded, Forwarder, HeadWaits, LocalError
from stargate.routing import (
    BackendRoute,
    ModelStats,
    Registration,
    RegistrationIdentity,
    RoutingState,
    RoutingTargetKey,
)
from stargate.upstream import ConnectionPool
from tests.fakes.pylon import INACTIVE, registration

M = RoutingTargetKey(None, "m")
OTHER = RoutingTargetKey(None, "other")

# ---- the verdict rule ---------------------------------------------------------------------------


def _routable(verdict: ProbeVerdict) -> bool:
    return verdict.routable  # a call, so a type checker does not narrow it between records


def test_one_failure_unroutes_a_healthy_backend_and_one_pass_restores_it() -> None:
    verdict = ProbeVerdict()
    assert not _routable(verdict)  # pending: never probed
    assert verdict.record(True) and _routable(verdict)
    assert not verdict.record(True)  # no change, nothing to re-apply
    assert verdict.record(False) and not _routable(verdict)
    assert not verdict.record(False)
    assert verdict.record(True) and _routable(verdict)


def test_a_pending_backend_that_fails_is_unhealthy_at_once_whatever_the_threshold() -> None:
    verdict = ProbeVerdict(threshold=3)
    assert verdict.record(False)
    assert verdict.healthy is False


def test_a_higher_threshold_counts_consecutive_failures_only() -> None:
    verdict = ProbeVerdict(threshold=2)
    verdict.record(True)
    assert not verdict.record(False) and _routable(verdict)  # one blip is tolerated
    assert not verdict.record(True)  # a pass resets the count
    assert not verdict.record(False) and _routable(verdict)
    assert verdict.record(False) and not _routable(verdict)


def test_the_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ProbeVerdict(threshold=0)


class ScriptedProbe:
    """A health probe answering from `results` (an RTT in ns, or None for a failure); the last
    result repeats."""

    def __init__(self, *results: int | None) -> None:
        self.results = list(results)
        self.calls = 0

    def set(self, result: int | None) -> None:
        self.results = [result]

    async def __call__(self, url: str) -> int:
        await trio.sleep(0.01)
        self.calls += 1
        result = self.results.pop(0) if len(self.results) > 1 else self.results[0]
        if result is None:
            raise ProbeFailed(f"{url}: down")
        return result


async def test_monitor_reports_verdict_changes_and_every_pass(autojump_clock: MockClock) -> None:
    probe = ScriptedProbe(5, 6, None, None, 9)
    verdicts: list[bool] = []
    passes: list[int] = []
    monitor = HealthMonitor(
        "http://b", probe, 1.0, on_healthy=lambda: passes.append(1), on_verdict=verdicts.append
    )
    assert await monitor.probe_once() == 5
    assert await monitor.probe_once() == 6
    assert await monitor.probe_once() is None
    assert not monitor.routable
    assert await monitor.probe_once() is None
    assert await monitor.probe_once() == 9  # the fresh RTT, not the last one before the failure
    assert verdicts == [True, False, True]
    assert len(passes) == 3


# ---- the routing state's listener ---------------------------------------------------------------


def _identity(server_id: str, cluster_id: str = "") -> RegistrationIdentity:
    return RegistrationIdentity(
        server_id, cluster_id or server_id, f"http://127.0.0.1:1/{server_id}", None
    )


def _route(rtt_ns: int = 1_000_000) -> BackendRoute:
    return BackendRoute(ModelStats(), rtt_ns, 0.0)


@dataclass
class Unroutable:
    events: list[tuple[str, str]] = field(default_factory=list)

    def __call__(self, registration: Registration, target: RoutingTargetKey) -> None:
        self.events.append((registration.identity.inference_server_id, target.model_id))


def test_listener_hears_each_removed_route_once_and_only_that_model() -> None:
    heard = Unroutable()
    state = RoutingState(on_backend_unroutable=heard)
    reg = state.begin(_identity("a"))
    state.apply(reg, {"m": _route(), "other": _route()})
    state.apply(reg, {"m": None, "other": _route()})  # m INACTIVE (or its probe failed)
    assert heard.events == [("a", "m")]
    assert state.is_advertised(M)  # still advertised: a request gets 503, not 404
    assert state.snapshot(M) is None
    state.apply(reg, {"m": None, "other": _route()})  # nothing stored for m: nothing to say
    assert heard.events == [("a", "m")]
    state.apply(reg, {"m": None})  # other no longer listed
    assert heard.events == [("a", "m"), ("a", "other")]
    assert not state.is_advertised(OTHER)


def test_listener_hears_a_registration_end_unless_told_not_to() -> None:
    heard = Unroutable()
    state = RoutingState(on_backend_unroutable=heard)
    ended = state.begin(_identity("a", "c"))
    quiet = state.begin(_identity("b", "c"))
    state.apply(ended, {"m": _route()})
    state.apply(quiet, {"m": _route()})
    assert state.end(ended)
    assert heard.events == [("a", "m")]
    assert state.end(quiet, notify=False)  # e.g. the replica's own shutdown
    assert heard.events == [("a", "m")]
    assert state.snapshot(M) is None


# ---- registrations: the probe decides between Pylon updates -------------------------------------


@dataclass
class Stream:
    """One registration stream driven in-process."""

    send: trio.MemorySendChannel[pb.InferenceServerRegistration]
    acks: list[pb.InferenceServerAck]


async def _open(
    nursery: trio.Nursery, service: RegistrationService, heartbeat_ms: str = "1000"
) -> Stream:
    send, receive = trio.open_memory_channel[pb.InferenceServerRegistration](10)
    acks: list[pb.InferenceServerAck] = []

    async def ack(message: pb.InferenceServerAck) -> None:
        acks.append(message)

    context = RpcContext(
        method="/stargate.StargateControlPlane/RegisterInferenceServer",
        metadata={"x-stargate-registration-heartbeat-ms": heartbeat_ms},
        deadline=None,
        peer="",
    )
    nursery.start_soon(service.register, RequestStream(receive), context, ack)
    return Stream(send, acks)


async def _until(predicate: Callable[[], bool]) -> None:
    """Poll `predicate` every 10 ms of virtual time, failing after 10 s."""
    with trio.fail_after(10):
        while not predicate():  # noqa: ASYNC110 (routing state changes have no event)
            await trio.sleep(0.01)


async def _exchange(stream: Stream, message: pb.InferenceServerRegistration) -> None:
    count = len(stream.acks)
    await stream.send.send(message)
    await _until(lambda: len(stream.acks) > count)


def _rtt(state: RoutingState) -> int | None:
    snapshot = state.snapshot(M)
    if snapshot is None:
        return None
    (cluster,) = snapshot.clusters
    (backend,) = cluster.backends
    return backend.rtt_ns


async def test_a_failed_probe_unroutes_at_once_and_updates_cannot_reenable_it(
    autojump_clock: MockClock,
) -> None:
    heard = Unroutable()
    state = RoutingState(on_backend_unroutable=heard)
    probe = ScriptedProbe(1_000)
    service = RegistrationService(
        state, OpenAuthenticator(), probe, RegistrationConfig(idle_timeout_ms=0)
    )
    message = registration("a", "http://127.0.0.1:1", ["m"])
    async with trio.open_nursery() as nursery:
        stream = await _open(nursery, service)
        await _exchange(stream, message)
        assert _rtt(state) == 1_000

        probe.set(None)  # the engine dies; its Pylon says nothing more
        started = trio.current_time()
        await _until(lambda: state.snapshot(M) is None)
        assert trio.current_time() - started <= 1.1  # one probe interval, not the idle timeout
        assert state.is_advertised(M)  # 503, not 404
        assert heard.events == [("a", "m")]

        await _exchange(stream, message)  # the Pylon still says ACTIVE: the probe overrides it
        assert state.snapshot(M) is None
        state.demote("a")  # as the proxy does on a refused connection
        await trio.sleep(1.5)
        assert state.is_demoted("a")  # a failing probe lifts nothing

        probe.set(2_000)
        await _until(lambda: state.snapshot(M) is not None)
        assert _rtt(state) == 2_000  # restored with the fresh RTT, no update needed
        assert not state.is_demoted("a")  # every pass lifts a connect-failure demotion

        await stream.send.aclose()  # the Pylon ends the stream: the routes go, and it is said
    assert not state.is_advertised(M)
    assert heard.events == [("a", "m"), ("a", "m")]


async def test_inactive_while_the_probe_fails_stays_down_when_the_probe_recovers(
    autojump_clock: MockClock,
) -> None:
    state = RoutingState()
    probe = ScriptedProbe(1_000)
    service = RegistrationService(
        state, OpenAuthenticator(), probe, RegistrationConfig(idle_timeout_ms=0)
    )
    async with trio.open_nursery() as nursery:
        stream = await _open(nursery, service)
        await _exchange(stream, registration("a", "http://127.0.0.1:1", ["m"]))
        probe.set(None)
        await trio.sleep(1.5)
        await _exchange(stream, registration("a", "http://127.0.0.1:1", {"m": INACTIVE}))
        probe.set(3_000)
        await trio.sleep(1.5)  # the probe passes again, but the latest update says INACTIVE
        assert state.snapshot(M) is None
        assert state.is_advertised(M)
        service.shutdown()


async def test_routes_are_held_through_the_drain_and_removed_without_cancelling_anything(
    autojump_clock: MockClock,
) -> None:
    heard = Unroutable()
    state = RoutingState(on_backend_unroutable=heard)
    service = RegistrationService(
        state, OpenAuthenticator(), ScriptedProbe(1_000), RegistrationConfig(idle_timeout_ms=0)
    )
    async with trio.open_nursery() as nursery:
        live = await _open(nursery, service)
        await _exchange(live, registration("live", "http://127.0.0.1:1", ["m"]))
        held = await _open(nursery, service)
        await _exchange(held, registration("held", "http://127.0.0.1:2", ["other"]))
        service.leave()
        await held.send.aclose()  # ends while the replica leaves: its route is held
        await trio.sleep(0.5)
        assert service.held_registrations == 1
        assert state.snapshot(OTHER) is not None
        service.shutdown()  # the replica's own drain: in-flight requests finish where they are
        await trio.sleep(0.5)
        # Every route stays through the drain: requests on connections accepted just before the
        # listeners closed are still routed.
        assert service.held_registrations == 2
        assert state.snapshot(M) is not None and state.snapshot(OTHER) is not None
        service.release_routes()  # nothing in flight any more
    assert state.snapshot(M) is None and state.snapshot(OTHER) is None
    assert service.held_registrations == 0
    assert heard.events == []


# ---- the forwarder: attempts waiting for a head ----------------------------------------------


async def test_head_waits_bookkeeping() -> None:
    waits = HeadWaits()
    state = RoutingState()
    a = state.begin(_identity("a"))
    b = state.begin(_identity("b"))
    first = waits.open(a, M)
    second = waits.open(a, M)
    other_model = waits.open(a, OTHER)
    other_backend = waits.open(b, M)
    assert len(waits) == 4
    assert waits.cancel(a, M) == 2
    assert first.cancel_called and second.cancel_called
    assert not other_model.cancel_called and not other_backend.cancel_called
    for scope in (first, second):
        waits.close(a, M, scope)
    waits.close(a, M, first)  # idempotent
    assert waits.cancel(a, M) == 0
    waits.close(a, OTHER, other_model)
    waits.close(b, M, other_backend)
    assert len(waits) == 0
    assert waits.pairs == 0  # nothing left behind for finished attempts


class _Response:
    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.headers: list[tuple[bytes, bytes]] = []

    async def aclose(self) -> None:
        pass


class HangingPool:
    """Backends whose id is in `hung` never send a head; the others answer 200 at once."""

    def __init__(self, *hung: str) -> None:
        self.hung = set(hung)
        self.cancelled: list[str] = []
        self.started: list[str] = []

    async def request(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes = b""
    ) -> _Response:
        server_id = url.split("/")[3]
        self.started.append(server_id)
        if server_id in self.hung:
            try:
                await trio.sleep_forever()
            finally:
                self.cancelled.append(server_id)
        return _Response()


def _request(model: str = "m") -> ProxyRequest:
    return ProxyRequest(
        endpoint="chat_completions",
        target_path=b"/v1/chat/completions",
        request_id="r",
        model_id=model,
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


@dataclass
class Setup:
    state: RoutingState
    forwarder: Forwarder
    pool: HangingPool
    registry: CollectorRegistry
    registrations: dict[str, Registration]

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(f"test_{name}", labels) or 0.0


def _setup(pool: HangingPool, *backends: str, config: ProxyConfig | None = None) -> Setup:
    """The backends in one cluster (so the first attempt goes to the first id), serving "m" and
    "other"."""
    forwarder: Forwarder | None = None

    def unroutable(registration: Registration, target: RoutingTargetKey) -> None:
        assert forwarder is not None
        forwarder.backend_unroutable(registration, target)

    state = RoutingState(on_backend_unroutable=unroutable)
    registry = CollectorRegistry()
    forwarder = Forwarder(
        state,
        cast(ConnectionPool, pool),
        config or ProxyConfig(),
        LbConfig(),
        ProxyMetrics.create(registry, "test_"),
    )
    registrations = {}
    for server_id in backends:
        reg = registrations[server_id] = state.begin(_identity(server_id, "c"))
        state.apply(reg, {"m": _route(), "other": _route()})
    return Setup(state, forwarder, pool, registry, registrations)


async def _forward_with(
    setup: Setup, action: Callable[[], object], model: str = "m"
) -> tuple[Forwarded | LocalError, float]:
    """Forward one request; once it waits for a head, run `action`; the outcome and how long the
    request took."""
    outcome: list[Forwarded | LocalError] = []
    started = trio.current_time()

    async def forward() -> None:
        spec = AlgorithmSpec(name="round-robin")
        outcome.append(await setup.forwarder.forward(_request(model), spec, b"{}"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(forward)
        await _until(lambda: len(setup.forwarder.head_waits) > 0 or bool(outcome))
        action()
    return outcome[0], trio.current_time() - started


async def test_an_attempt_waiting_on_a_backend_made_unroutable_moves_to_another(
    autojump_clock: MockClock,
) -> None:
    setup = _setup(HangingPool("a"), "a", "b")
    result, elapsed = await _forward_with(
        setup, lambda: setup.state.apply(setup.registrations["a"], {"m": None, "other": _route()})
    )
    assert isinstance(result, Forwarded)
    assert result.backend.inference_server_id == "b"
    assert setup.pool.started == ["a", "b"]
    assert setup.pool.cancelled == ["a"]  # the hung attempt was cancelled, its connection closed
    assert elapsed < 1.0  # not the 30 s head timeout
    labels = {"model": "m", "routing_key": ""}
    attempt = {"inference_server_id": "a", "result": "proxy_backend_unroutable", **labels}
    assert setup.sample("proxy_attempts_total", **attempt) == 1
    assert setup.sample("proxy_retries_total", reason="backend_unroutable", **labels) == 1
    assert not setup.state.is_demoted("a")  # the control plane took it out, not a refusal
    assert len(setup.forwarder.head_waits) == 0


async def test_the_only_backend_made_unroutable_answers_503_not_404(
    autojump_clock: MockClock,
) -> None:
    setup = _setup(HangingPool("a"), "a")
    result, elapsed = await _forward_with(
        setup, lambda: setup.state.apply(setup.registrations["a"], {"m": None})
    )
    assert isinstance(result, LocalError)
    assert result.error.status == 503
    assert elapsed < 1.0


async def test_no_connect_retry_left_is_a_502(autojump_clock: MockClock) -> None:
    setup = _setup(HangingPool("a", "b"), "a", "b", config=ProxyConfig(max_connect_retries=0))
    result, _ = await _forward_with(
        setup, lambda: setup.state.end(setup.registrations[setup.pool.started[0]])
    )
    assert isinstance(result, LocalError)
    assert result.error.status == 502
    assert len(setup.pool.started) == 1


async def test_other_models_and_arrived_heads_are_not_cut(autojump_clock: MockClock) -> None:
    setup = _setup(HangingPool("a"), "a")
    waiting: list[Forwarded | LocalError] = []

    async def forward_other() -> None:
        spec = AlgorithmSpec(name="round-robin")
        waiting.append(await setup.forwarder.forward(_request("other"), spec, b"{}"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(forward_other)
        await trio.sleep(1)
        assert len(setup.forwarder.head_waits) == 1
        setup.state.apply(setup.registrations["a"], {"m": None, "other": _route()})
        await trio.sleep(1)
        assert waiting == [] and setup.pool.cancelled == []  # "other" is still routable on a
        nursery.cancel_scope.cancel()

    # A head that has arrived is final: making the backend unroutable afterwards changes nothing.
    setup.pool.hung.clear()
    setup.state.apply(setup.registrations["a"], {"m": _route(), "other": _route()})
    result = await setup.forwarder.forward(_request(), AlgorithmSpec(), b"{}")
    assert isinstance(result, Forwarded)
    setup.state.apply(setup.registrations["a"], {"m": None, "other": _route()})
    assert setup.pool.cancelled == ["a"]  # only the "other" wait, cancelled by the nursery
    assert len(setup.forwarder.head_waits) == 0


async def test_a_sibling_removed_since_the_snapshot_is_skipped_without_a_retry(
    autojump_clock: MockClock,
) -> None:
    """A cluster snapshot is reused across the attempts on its backends; a sibling that left the
    target while an earlier attempt waited is skipped, not sent to and not charged a retry."""
    pool = HangingPool("a")
    forwarder: Forwarder | None = None

    def unroutable(registration: Registration, target: RoutingTargetKey) -> None:
        assert forwarder is not None
        forwarder.backend_unroutable(registration, target)

    state = RoutingState(on_backend_unroutable=unroutable)
    registry = CollectorRegistry()
    forwarder = Forwarder(
        state,
        cast(ConnectionPool, pool),
        ProxyConfig(max_connect_retries=1),
        LbConfig(),
        ProxyMetrics.create(registry, "test_"),
    )
    regs = {server_id: state.begin(_identity(server_id, "c")) for server_id in ("a", "b")}
    for reg in regs.values():
        state.apply(reg, {"m": _route()})
    outcome: list[Forwarded | LocalError] = []

    async def forward() -> None:
        outcome.append(await forwarder.forward(_request(), AlgorithmSpec(), b"{}"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(forward)
        await trio.sleep(1)
        assert pool.started == ["a"]  # the cluster's round robin starts at the first id
        state.apply(regs["b"], {"m": None})  # the sibling leaves first (nothing waits on it)
        state.apply(regs["a"], {"m": None})  # then a: its wait is cancelled
    (result,) = outcome
    assert isinstance(result, LocalError) and result.error.status == 503
    assert pool.started == ["a"]  # b was never sent to
    labels = {"model": "m", "routing_key": ""}
    assert (
        registry.get_sample_value(
            "test_proxy_retries_total", {"reason": "backend_unroutable", **labels}
        )
        == 1
    )
