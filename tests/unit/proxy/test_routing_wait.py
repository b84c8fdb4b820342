"""The routing wait's `Retry-After` and `on_hold` (stargate/proxy/routing_wait.py, the forwarder's
`_nothing_chosen`; docs/data-plane.md, "Forwarding", step 4): the per-model average of how long
requests waited for a backend, under a mock clock, and the forwarder that measures it."""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any, cast

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from stargate.config import ProxyConfig
from stargate.load_balancing.balancers import Choice
from stargate.load_balancing.config import AlgorithmSpec, LbConfig
from stargate.load_balancing.registry import BalancerRegistry
from stargate.metrics import ProxyMetrics
from stargate.proxy.contract import ProxyRequest
from stargate.proxy.forwarder import Forwarded, Forwarder, LocalError
from stargate.proxy.routing_wait import RoutingWaits
from stargate.routing import (
    BackendRoute,
    ClusterSnapshot,
    ModelStats,
    RegistrationIdentity,
    RoutingState,
)
from stargate.upstream import ConnectionPool

# ---- the average, pure -------------------------------------------------------------------------


def test_nothing_measured_gives_no_retry_after() -> None:
    waits = RoutingWaits()
    assert waits.retry_after("m", 0.0) is None
    assert waits.average("m", 0.0) is None


def test_the_average_is_exponentially_weighted_per_model() -> None:
    waits = RoutingWaits(weight=0.5)
    waits.observe("m", 4.0, 0.0)
    assert waits.average("m", 0.0) == 4.0  # the first sample is the average
    waits.observe("m", 2.0, 1.0)
    assert waits.average("m", 1.0) == 3.0
    waits.observe("m", 7.0, 2.0)
    assert waits.average("m", 2.0) == 5.0
    assert waits.average("other", 2.0) is None  # per model


@pytest.mark.parametrize(
    ("waited", "retry_after"),
    [(0.004, 1), (0.9, 1), (1.0, 1), (3.2, 4), (59.5, 60), (75.0, 60), (3600.0, 60)],
)
def test_retry_after_is_the_average_rounded_up_within_1_and_60_seconds(
    waited: float, retry_after: int
) -> None:
    waits = RoutingWaits()
    waits.observe("m", waited, 0.0)
    assert waits.retry_after("m", 0.0) == retry_after


async def test_a_wait_measured_long_ago_is_forgotten(
    autojump_clock: trio.testing.MockClock,
) -> None:
    waits = RoutingWaits(stale_after=300.0)
    waits.observe("m", 10.0, trio.current_time())
    await trio.sleep(300.0)
    assert waits.retry_after("m", trio.current_time()) == 10
    await trio.sleep(1.0)
    assert waits.retry_after("m", trio.current_time()) is None
    # A stale average is not blended into the next sample: it starts afresh.
    waits.observe("m", 2.0, trio.current_time())
    assert waits.average("m", trio.current_time()) == 2.0


def test_the_map_is_bounded_oldest_first() -> None:
    waits = RoutingWaits(max_models=2)
    waits.observe("a", 1.0, 0.0)
    waits.observe("b", 1.0, 0.0)
    waits.observe("a", 1.0, 1.0)  # refreshed: now the newest
    waits.observe("c", 1.0, 2.0)
    assert len(waits) == 2
    assert waits.average("b", 2.0) is None
    assert waits.average("a", 2.0) == 1.0 and waits.average("c", 2.0) == 1.0


# ---- the forwarder's routing wait --------------------------------------------------------------


@dataclass
class _Response:
    status: int = 200
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    async def aclose(self) -> None:
        pass


class _Pool:
    async def request(self, *args: Any) -> _Response:
        return _Response()


class _BusyUntil:
    """The balancers, choosing nothing (every backend busy) until virtual time `until`."""

    def __init__(self, real: BalancerRegistry, until: float) -> None:
        self.real = real
        self.until = until

    def choose(
        self,
        target: Any,
        spec: AlgorithmSpec,
        clusters: Sequence[ClusterSnapshot],
        request: Any,
        excluded: AbstractSet[str],
    ) -> Choice | None:
        if trio.current_time() < self.until:
            return None
        return self.real.choose(target, spec, clusters, request, excluded)


def _forwarder(busy_until: float) -> tuple[Forwarder, _BusyUntil]:
    state = RoutingState()
    identity = RegistrationIdentity("b1", "c1", "http://10.0.0.1:8000", None)
    state.apply(state.begin(identity), {"m": BackendRoute(ModelStats(), 1_000_000, 0.0)})
    metrics = ProxyMetrics.create(CollectorRegistry(), "test_")
    forwarder = Forwarder(state, cast(ConnectionPool, _Pool()), ProxyConfig(), LbConfig(), metrics)
    busy = _BusyUntil(forwarder._balancers, busy_until)
    forwarder._balancers = busy  # type: ignore[assignment]
    return forwarder, busy


def _request(max_wait_ms: int | None) -> ProxyRequest:
    return ProxyRequest(
        endpoint="chat_completions",
        target_path=b"/v1/chat/completions",
        request_id="r",
        model_id="m",
        input_tokens=10,
        routing_key=None,
        routing_method=None,
        priority=0,
        max_wait_ms=max_wait_ms,
        request_slo_ms=None,
        cache_affinity_key=None,
        retry_budget_ms=0,  # no queue-check waiver: a wait that runs out is the 503
        headers=[],
    )


async def _forward(
    forwarder: Forwarder, request: ProxyRequest, holds: list[float]
) -> Forwarded | LocalError:
    plan = forwarder.planner.plan(request, AlgorithmSpec())
    return await forwarder.forward_plan(
        plan, b"{}", on_hold=lambda: holds.append(trio.current_time())
    )


async def test_on_hold_is_called_once_when_the_first_wait_begins_and_the_wait_is_measured(
    autojump_clock: trio.testing.MockClock,
) -> None:
    start = trio.current_time()
    forwarder, _ = _forwarder(busy_until=start + 2.0)
    holds: list[float] = []
    outcome = await _forward(forwarder, _request(10_000), holds)
    assert isinstance(outcome, Forwarded)
    assert holds == [start]  # once, although it slept hundreds of times
    assert outcome.waited == pytest.approx(2.0, abs=0.01)
    assert forwarder.routing_waits.average("m", trio.current_time()) == outcome.waited


async def test_a_request_chosen_at_once_is_not_held_and_not_measured(
    autojump_clock: trio.testing.MockClock,
) -> None:
    forwarder, _ = _forwarder(busy_until=0.0)
    holds: list[float] = []
    outcome = await _forward(forwarder, _request(10_000), holds)
    assert isinstance(outcome, Forwarded)
    assert holds == [] and outcome.waited == 0.0
    assert len(forwarder.routing_waits) == 0


async def test_a_routing_503_carries_retry_after_from_the_measured_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    forwarder, busy = _forwarder(busy_until=trio.current_time() + 3.5)
    holds: list[float] = []
    # Nothing measured yet: today's bare 503, without Retry-After.
    outcome = await _forward(forwarder, _request(1_000), holds)
    assert isinstance(outcome, LocalError) and outcome.error.status == 503
    assert outcome.error.code == "no_available_backend"
    assert dict(outcome.error.headers).get(b"retry-after") is None
    assert outcome.waited == pytest.approx(1.0, abs=0.01)  # all of it was routing wait
    # One that waited long enough is chosen (after 3.5 s in all): 2.5 s measured.
    assert isinstance(await _forward(forwarder, _request(10_000), holds), Forwarded)
    busy.until = trio.current_time() + 60
    outcome = await _forward(forwarder, _request(1_000), holds)
    assert isinstance(outcome, LocalError)
    assert dict(outcome.error.headers)[b"retry-after"] == b"3"
    # In both forms of the answer.
    rust_headers, _ = outcome.error.answer(False)
    openai_headers, _ = outcome.error.answer(True)
    assert (b"retry-after", b"3") in rust_headers and (b"retry-after", b"3") in openai_headers


async def test_a_request_without_a_routing_wait_is_never_held(
    autojump_clock: trio.testing.MockClock,
) -> None:
    forwarder, _ = _forwarder(busy_until=trio.current_time() + 60)
    holds: list[float] = []
    outcome = await _forward(forwarder, replace(_request(None)), holds)
    assert isinstance(outcome, LocalError) and outcome.error.status == 503
    assert holds == [] and outcome.waited == 0.0
