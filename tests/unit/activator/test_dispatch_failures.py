"""Self-heal (docs/activator.md): every dispatch to a pooled member that ends without a response
head makes its pool re-check residency on the next acquire, whatever the failure (refused
connection, response-head timeout, reset before the head, protocol error, the backend turning
unroutable), while a response head, even a 5xx, does not. The forwarder runs against a scripted
connection pool and the activator on the fake controller, in virtual time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from stargate.activator import PoolSpec
from stargate.activator.testing import Harness, running_activator
from stargate.config import ProxyConfig
from stargate.load_balancing.config import LbConfig
from stargate.metrics import ProxyMetrics
from stargate.proxy.contract import ProxyRequest
from stargate.proxy.forwarder import Forwarded, Forwarder, LocalError
from stargate.routing import (
    BackendRoute,
    ModelStats,
    Registration,
    RegistrationIdentity,
    RoutingState,
    RoutingTargetKey,
)
from stargate.upstream import (
    ConnectError,
    ConnectionPoolTimeout,
    ResponseHeadTimeout,
    UpstreamError,
    UpstreamProtocolError,
)

POOL = "gpu0"
MODEL = "gemma"
TARGET = RoutingTargetKey(None, MODEL)


class _Head:
    def __init__(self, status: int) -> None:
        self.status = status
        self.headers: list[tuple[bytes, bytes]] = []

    async def aclose(self) -> None:
        pass


class ScriptedPool:
    """The upstream connection pool: every request raises `error`, answers `status`, or (with
    neither) waits for its head until cancelled."""

    def __init__(self, error: UpstreamError | None = None, status: int | None = None) -> None:
        self.error = error
        self.status = status
        self.requests = 0

    async def request(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes = b""
    ) -> _Head:
        self.requests += 1
        await trio.lowlevel.checkpoint()
        if self.error is not None:
            raise self.error
        if self.status is not None:
            return _Head(self.status)
        await trio.sleep_forever()
        raise AssertionError("unreachable")


def _request() -> ProxyRequest:
    return ProxyRequest(
        endpoint="chat_completions",
        target_path=b"/v1/chat/completions",
        request_id="r",
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


def _wire(h: Harness, pool: ScriptedPool) -> tuple[Forwarder, Registration]:
    """A forwarder as the runtime wires it: a failed dispatch invalidates the model's pool."""

    def invalidate(model_id: str) -> None:
        if (name := h.activator.pool_of(model_id)) is not None:
            h.activator.invalidate_resident(name)

    routing = RoutingState()
    forwarder = Forwarder(
        routing,
        cast(Any, pool),
        ProxyConfig(max_connect_retries=0),  # one attempt: the failure is the answer
        LbConfig(),
        ProxyMetrics.create(CollectorRegistry(), "test_"),
        on_dispatch_failure=invalidate,
    )
    registration = routing.begin(
        RegistrationIdentity("engine-gemma", "engine-gemma", "http://127.0.0.1:1", None)
    )
    routing.apply(registration, {MODEL: BackendRoute(ModelStats(), 1_000_000, 0.0)})
    return forwarder, registration


async def _forward(forwarder: Forwarder) -> Forwarded | LocalError:
    request = _request()
    return await forwarder.forward(request, forwarder.resolve_algorithm(request), b"{}")


async def _stale_belief(h: Harness) -> None:
    """gemma is resident; behind the activator's back it goes down and coder comes up, and
    (with an hour-long resync) the next acquire still trusts the belief."""
    (await h.activator.acquire(MODEL)).release()
    h.fake().force(MODEL, up=False)
    h.fake().force("coder", up=True)
    (await h.activator.acquire(MODEL)).release()
    assert h.fake().activations(MODEL) == 1


FAILURES: list[tuple[str, Callable[[], UpstreamError]]] = [
    ("connect-error", lambda: ConnectError("connection refused")),
    ("head-timeout", lambda: ResponseHeadTimeout("no response head", request_sent=True)),
    (
        "reset-before-head",
        lambda: UpstreamProtocolError(
            "connection closed before any response byte arrived", request_sent=True
        ),
    ),
    ("protocol-error", lambda: UpstreamProtocolError("malformed head", request_sent=True)),
    ("pool-timeout", lambda: ConnectionPoolTimeout("no connection slot")),
]


@pytest.mark.parametrize("make_error", [f for _, f in FAILURES], ids=[n for n, _ in FAILURES])
async def test_every_dispatch_failure_rechecks_residency(
    autojump_clock: trio.testing.MockClock, make_error: Callable[[], UpstreamError]
) -> None:
    spec = PoolSpec(POOL, (MODEL, "coder"))
    async with running_activator([spec], resync_interval=3600.0) as h:
        await _stale_belief(h)
        upstream = ScriptedPool(error=make_error())
        forwarder, _ = _wire(h, upstream)
        outcome = await _forward(forwarder)
        # No connection freed up: the 503 of docs/data-plane.md, "Per-backend connections";
        # every other failure, with no retry left, the 502.
        status = 503 if isinstance(upstream.error, ConnectionPoolTimeout) else 502
        assert isinstance(outcome, LocalError) and outcome.error.status == status
        assert upstream.requests == 1
        assert h.pool()["resident_checked_at"] is None  # invalidated
        with await h.activator.acquire(MODEL):
            assert h.fake().activations(MODEL) == 2  # the corrective swap
        assert h.pool()["resident"] == MODEL


async def test_a_backend_turning_unroutable_before_its_head_rechecks_residency(
    autojump_clock: trio.testing.MockClock,
) -> None:
    spec = PoolSpec(POOL, (MODEL, "coder"))
    async with running_activator([spec], resync_interval=3600.0) as h:
        await _stale_belief(h)
        forwarder, registration = _wire(h, ScriptedPool())  # the head never comes
        outcomes: list[Forwarded | LocalError] = []

        async def forward() -> None:
            outcomes.append(await _forward(forwarder))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(forward)
            await trio.testing.wait_all_tasks_blocked()
            forwarder.backend_unroutable(registration, TARGET)  # its probe failed
        (outcome,) = outcomes
        assert isinstance(outcome, LocalError)
        assert h.pool()["resident_checked_at"] is None
        with await h.activator.acquire(MODEL):
            assert h.fake().activations(MODEL) == 2


async def test_a_response_head_even_a_5xx_keeps_the_belief(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """docs/activator.md, Self-heal: a 5xx response does not invalidate; it only releases."""
    spec = PoolSpec(POOL, (MODEL, "coder"))
    async with running_activator([spec], resync_interval=3600.0) as h:
        await _stale_belief(h)
        forwarder, _ = _wire(h, ScriptedPool(status=500))
        outcome = await _forward(forwarder)
        assert isinstance(outcome, Forwarded) and outcome.response.status == 500
        assert h.pool()["resident_checked_at"] is not None
        (await h.activator.acquire(MODEL)).release()
        assert h.fake().activations(MODEL) == 1
