"""The forwarder's side of outlier ejection and slow start (docs/outliers.md), in process under a
mock clock: a fake upstream answers per backend, the routing state is real. An ejected backend
is left out of every decision, comes back when its time is up, and is routed anyway when every
candidate is ejected; a retryable 503 ejects nobody; a backend that joins after the initial
fleet gets about its ramp factor of its share, under every balancer; the log lines and series."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import trio
import trio.lowlevel
from prometheus_client import CollectorRegistry, generate_latest
from trio.testing import MockClock

from stargate.config import ProxyConfig
from stargate.load_balancing.config import AlgorithmSpec, LbConfig
from stargate.metrics import ProxyMetrics
from stargate.proxy.contract import Headers, ProxyRequest
from stargate.proxy.forwarder import Forwarded, Forwarder
from stargate.routing import (
    BackendRoute,
    ModelStats,
    Registration,
    RegistrationIdentity,
    RoutingState,
)

MODEL = "m"


class _Response:
    def __init__(self, status: int, headers: Headers) -> None:
        self.status = status
        self.headers = list(headers)

    @property
    def complete(self) -> bool:
        return True

    def take_buffered(self) -> bytes | None:
        return None

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        yield b""

    async def read(self) -> bytes:
        return b""

    async def aclose(self) -> None:
        return None


class _Upstream:
    """Answers by backend URL: `statuses[url]` (default 200), optional extra headers."""

    def __init__(self) -> None:
        self.statuses: dict[str, int] = {}
        self.headers: dict[str, Headers] = {}
        self.sent: Counter[str] = Counter()

    async def request(
        self, method: str, url: str, headers: Headers, body: bytes | bytearray
    ) -> _Response:
        backend = url.split("/")[2]
        self.sent[backend] += 1
        await trio.lowlevel.checkpoint()
        return _Response(self.statuses.get(backend, 200), self.headers.get(backend, []))


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
    def __init__(self, config: ProxyConfig | None = None) -> None:
        self.routing = RoutingState(estimate_unmeasured=True)  # the replica's default
        self.upstream = _Upstream()
        self.registry = CollectorRegistry()
        self.forwarder = Forwarder(
            self.routing,
            self.upstream,  # type: ignore[arg-type]
            config or ProxyConfig(),
            LbConfig(),
            ProxyMetrics.create(self.registry, "stargate_"),
        )
        self.registrations: dict[str, Registration] = {}
        self.sent = 0

    def join(self, backend: str) -> None:
        registration = self.routing.begin(
            RegistrationIdentity(backend, f"cluster-{backend}", f"http://{backend}", None)
        )
        self.registrations[backend] = registration
        route = BackendRoute(ModelStats(), 1_000_000, trio.current_time())
        assert self.routing.apply(registration, {MODEL: route})

    def heartbeat(self) -> None:
        """Every backend's Pylon reports again (its reservations are superseded)."""
        for registration in self.registrations.values():
            route = BackendRoute(ModelStats(), 1_000_000, trio.current_time())
            assert self.routing.apply(registration, {MODEL: route})

    async def send(self, count: int, algorithm: str = "round-robin") -> Counter[str]:
        served: Counter[str] = Counter()
        for index in range(count):
            if index % 20 == 0:
                self.heartbeat()
            self.sent += 1
            result = await self.forwarder.forward(
                _request(self.sent), AlgorithmSpec(name=algorithm), b"{}"
            )
            assert isinstance(result, Forwarded)
            served[result.backend.inference_server_id] += 1
            await trio.sleep(0.01)
        return served

    def metric(self, text: str) -> str:
        return "\n".join(
            line
            for line in generate_latest(self.registry).decode().splitlines()
            if text in line and not line.startswith("#")
        )


async def test_a_backend_that_answers_500_is_ejected_then_returns(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    setup = _Setup()
    setup.forwarder.slow_start.settle(trio.current_time())
    for backend in ("a", "b", "c"):
        setup.join(backend)
    setup.upstream.statuses["bad"] = 500
    setup.upstream.statuses["b"] = 500
    caplog.set_level(logging.INFO, logger="stargate.proxy.forwarder")
    served = await setup.send(15)  # round robin: "b" gets its 5th request at the 14th
    assert served["b"] == 5
    served = await setup.send(300)
    assert served["b"] == 0 and served["a"] == served["c"] == 150
    ejected = [r.getMessage() for r in caplog.records if "outlier ejected" in r.getMessage()]
    assert ejected == [
        "outlier ejected: backend=b reason=consecutive_5xx consecutive=5 ejections=1 "
        "ejection_ms=30000"
    ]
    assert (
        'stargate_outlier_ejections_total{inference_server_id="b",reason="consecutive_5xx"} 1.0'
        in (setup.metric("outlier_ejections_total"))
    )
    assert setup.metric("stargate_outlier_ejected_backends") == (
        "stargate_outlier_ejected_backends 1.0"
    )
    await trio.sleep(30)  # the ejection ends; the next request brings it back
    setup.upstream.statuses["b"] = 200
    served = await setup.send(30)
    assert served["b"] == 10
    returned = [r.getMessage() for r in caplog.records if "outlier returned" in r.getMessage()]
    assert len(returned) == 1 and returned[0].startswith("outlier returned to routing: backend=b")
    assert setup.metric("stargate_outlier_ejected_backends").endswith(" 0.0")


async def test_a_backend_failing_again_is_ejected_for_longer(autojump_clock: MockClock) -> None:
    setup = _Setup()
    for backend in ("a", "b", "c"):
        setup.join(backend)
    setup.upstream.statuses["b"] = 500
    await setup.send(15)
    assert set(setup.forwarder.outliers.ejected) == {"b"}
    await trio.sleep(30)
    await setup.send(15)  # back, still failing: five more and it is out for 60 s
    assert set(setup.forwarder.outliers.ejected) == {"b"}
    await trio.sleep(31)
    assert (await setup.send(9))["b"] == 0  # 30 s would have been over by now
    await trio.sleep(30)
    assert (await setup.send(9))["b"] == 3


async def test_a_retryable_503_is_load_not_failure(autojump_clock: MockClock) -> None:
    setup = _Setup(ProxyConfig(max_request_retries=0))
    for backend in ("a", "b"):
        setup.join(backend)
    setup.upstream.statuses["b"] = 503
    setup.upstream.headers["b"] = [(b"x-stargate-retryable", b"true")]
    result = Counter[int]()
    for index in range(40):
        outcome = await setup.forwarder.forward(
            _request(index), AlgorithmSpec(name="round-robin"), b"{}"
        )
        assert isinstance(outcome, Forwarded)
        result[outcome.response.status] += 1
    assert result == {200: 20, 503: 20}
    assert not setup.forwarder.outliers.any_ejected


async def test_when_every_candidate_is_ejected_they_are_routed_anyway(
    autojump_clock: MockClock,
) -> None:
    config = ProxyConfig(outlier_max_ejection_percent=100)
    setup = _Setup(config)
    for backend in ("a", "b"):
        setup.join(backend)
    setup.upstream.statuses.update(a=500, b=500)
    await setup.send(10)
    assert set(setup.forwarder.outliers.ejected) == {"a", "b"}
    served = await setup.send(10)  # nothing to shift to: both get requests rather than none
    assert served == {"a": 5, "b": 5}


async def test_max_percent_keeps_the_second_failing_backend_in(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    setup = _Setup()
    for backend in ("a", "b", "c"):
        setup.join(backend)
    setup.upstream.statuses.update(a=500, b=500)
    await setup.send(30)
    assert len(setup.forwarder.outliers.ejected) == 1  # 10 % of 3, but at least one
    assert "outlier not ejected, --outlier-max-ejection-percent reached" in caplog.text
    assert setup.metric("outlier_ejections_refused_total{") != ""


async def test_transport_failures_eject_too(autojump_clock: MockClock) -> None:
    from stargate.upstream import UpstreamError

    setup = _Setup()
    for backend in ("a", "b", "c"):
        setup.join(backend)
    upstream = setup.upstream
    answer = upstream.request

    async def reset_by_b(
        method: str, url: str, headers: Headers, body: bytes | bytearray
    ) -> _Response:
        if "//b/" in url:
            upstream.sent["b"] += 1
            raise UpstreamError("connection reset before the response head", request_sent=True)
        return await answer(method, url, headers, body)

    upstream.request = reset_by_b  # type: ignore[method-assign]
    await setup.send(30)  # each failure moves to a sibling: every request is answered
    assert set(setup.forwarder.outliers.ejected) == {"b"}
    assert upstream.sent["b"] == 5
    assert 'reason="consecutive_transport_failure"' in setup.metric("outlier_ejections_total")


async def _shares_of_a_joiner(algorithm: str, window_ms: int) -> list[float]:
    """The share of a backend that joins an established fleet of three, in 6 windows of 5 s
    (500 requests each, heartbeats every 20 requests) and a seventh, past the 30 s window, of
    2,000 requests (20 s): under `random` a share of 500 requests has a standard deviation of
    about 0.019, and comparing it with another such share failed once in CI (0.240 against
    0.8 x 0.312); over 2,000 it is about 0.010."""
    setup = _Setup(ProxyConfig(slow_start_window_ms=window_ms))
    for backend in ("a", "b", "c"):
        setup.join(backend)
    setup.forwarder.slow_start.settle(trio.current_time())  # warmup over: a, b, c are the fleet
    await trio.sleep(60)
    setup.join("new")
    shares = []
    for size in (500, 500, 500, 500, 500, 500, 2_000):
        served = await setup.send(size, algorithm)
        shares.append(served["new"] / size)
    if window_ms:
        assert setup.metric('slow_start_left_out_total{inference_server_id="new"}') != ""
    return shares


# Pulsar and prefix-aware rank equal clusters deterministically: with the fake's identical stats
# the joiner gets nothing with or without slow start, so there is no share to compare.
@pytest.mark.parametrize("algorithm", ["round-robin", "random", "power-of-n", "wait-and-widen"])
async def test_a_joining_backend_ramps_under_every_balancer(
    autojump_clock: MockClock, algorithm: str
) -> None:
    control = await _shares_of_a_joiner(algorithm, 0)
    shares = await _shares_of_a_joiner(algorithm, 30_000)
    assert min(control) > 0.18, control  # a full share is 1/4
    # First 5 s: well below its share (the factor is 10 % to 17 %; a load-aware balancer
    # prefers the joiner while it is in the set, so it gets more than that, never the whole).
    assert shares[0] < 0.5 * control[0], (shares, control)
    assert shares[0] < shares[2] < shares[5], shares
    # Past the window: a full share, 1/4 (the control shows each balancer gives one); measured
    # over 2,000 requests, 0.8 of it is five standard deviations below under `random`.
    assert shares[6] > 0.8 * 0.25, (shares, control)


async def test_a_fleet_registering_together_is_not_ramped(autojump_clock: MockClock) -> None:
    setup = _Setup(ProxyConfig(slow_start_window_ms=30_000))
    setup.forwarder.slow_start.settle(trio.current_time())  # warmup off: settled before anyone
    await trio.sleep(0.1)
    for backend in ("a", "b", "c"):
        setup.join(backend)
        await trio.sleep(1)
    served = await setup.send(300)
    assert served == {"a": 100, "b": 100, "c": 100}
