"""Optimistic reservations (docs/data-plane.md, Reservations): the arithmetic applied
on top of a cluster's aggregated stats, and when a reservation goes away."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

import pytest
from prometheus_client import CollectorRegistry

from stargate.config import ProxyConfig
from stargate.load_balancing.balancers import queue_time_delta_ms
from stargate.load_balancing.config import AlgorithmSpec, LbConfig
from stargate.metrics import ProxyMetrics
from stargate.proxy.contract import ProxyRequest
from stargate.proxy.forwarder import Forwarded, Forwarder
from stargate.routing import (
    BackendRoute,
    ClusterSnapshot,
    ModelStats,
    RegistrationIdentity,
    RoutingState,
    RoutingTargetKey,
)
from stargate.routing.state import Reservation
from stargate.routing.stats import U64_MAX, apply_reservations, reservation_delta_ms
from stargate.upstream import ConnectError, ConnectionPool

TARGET = RoutingTargetKey(None, "m")


def _identity(server_id: str, cluster_id: str = "c") -> RegistrationIdentity:
    return RegistrationIdentity(server_id, cluster_id, f"http://10.0.0.1:8000/{server_id}", None)


def _route(received_at: float = 0.0, **stats: object) -> BackendRoute:
    return BackendRoute(ModelStats(**stats), 1_000_000, received_at)  # type: ignore[arg-type]


def _alive(reservation: Reservation) -> bool:
    return reservation.active  # a call, so a type checker does not narrow it between mutations


def _cluster(state: RoutingState, cluster_id: str = "c") -> ClusterSnapshot:
    snapshot = state.snapshot(TARGET)
    assert snapshot is not None
    (cluster,) = [c for c in snapshot.clusters if c.cluster_id == cluster_id]
    return cluster


# ---- the arithmetic ----------------------------------------------------------------------------


def test_no_reservations_returns_the_base_unchanged() -> None:
    base = ModelStats(queue_size=3)
    assert apply_reservations(base, []) is base


def test_each_reservation_adds_one_query_and_its_tokens() -> None:
    base = ModelStats(
        queue_size=2, queued_input_size=100, num_running_queries=5, total_query_input_size=700
    )
    stats = apply_reservations(base, [(10, 0), (32, 4)])
    assert stats.queue_size == 4
    assert stats.queued_input_size == 142
    assert stats.num_running_queries == 7
    assert stats.total_query_input_size == 742
    assert stats.queue_time_estimate_ms_by_priority == ()  # no map published: stays absent


def test_token_sums_saturate_at_u64() -> None:
    base = ModelStats(queued_input_size=U64_MAX - 5, total_query_input_size=U64_MAX)
    stats = apply_reservations(base, [(10, 0), (U64_MAX, 0)])
    assert stats.queued_input_size == U64_MAX
    assert stats.total_query_input_size == U64_MAX
    assert stats.queue_size == 2


@pytest.mark.parametrize(
    ("tokens", "tps", "expected"),
    [
        (0, 0.0, 0),  # no tokens: 0 whatever the TPS
        (0, math.nan, 0),
        (100, 1000.0, 100),
        (1, 3.0, 334),  # ceil(333.33…)
        (10, 0.0, None),
        (10, -1.0, None),
        (10, math.inf, None),
        (10, math.nan, None),
        (U64_MAX, 1e-300, None),  # not representable
    ],
)
def test_delta_ms(tokens: int, tps: float, expected: int | None) -> None:
    assert reservation_delta_ms(tokens, tps) == expected
    assert queue_time_delta_ms(tokens, tps) == expected  # the balancers' rule agrees


def test_priority_map_entry_is_created_from_the_best_lower_estimate() -> None:
    base = ModelStats(
        last_mean_input_tps=1000.0, queue_time_estimate_ms_by_priority=((0, 50), (2, 80), (9, 500))
    )
    stats = apply_reservations(base, [(100, 5)])  # delta 100 ms
    # 5 is created from 2's 80 and increased; 9 (numerically larger) increases; 0 and 2 do not.
    assert stats.queue_time_estimate_ms_by_priority == ((0, 50), (2, 80), (5, 180), (9, 600))


def test_priority_map_entry_defaults_to_zero_without_a_lower_key() -> None:
    base = ModelStats(last_mean_input_tps=1000.0, queue_time_estimate_ms_by_priority=((3, 40),))
    stats = apply_reservations(base, [(100, 1)])
    assert stats.queue_time_estimate_ms_by_priority == ((1, 100), (3, 140))


def test_existing_priority_entry_and_larger_keys_are_increased() -> None:
    base = ModelStats(
        last_mean_input_tps=1000.0, queue_time_estimate_ms_by_priority=((0, 10), (1, 20), (2, 30))
    )
    stats = apply_reservations(base, [(100, 1), (50, 0)])
    # (100, 1): 1 -> 120, 2 -> 130; then (50, 0): every key +50.
    assert stats.queue_time_estimate_ms_by_priority == ((0, 60), (1, 170), (2, 180))


def test_priority_map_entries_saturate() -> None:
    base = ModelStats(
        last_mean_input_tps=1000.0, queue_time_estimate_ms_by_priority=((0, U64_MAX - 1),)
    )
    stats = apply_reservations(base, [(100, 0)])
    assert stats.queue_time_estimate_ms_by_priority == ((0, U64_MAX),)


@pytest.mark.parametrize("tps", [0.0, -3.0, math.nan, math.inf])
def test_invalid_tps_clears_the_whole_priority_map(tps: float) -> None:
    base = ModelStats(
        last_mean_input_tps=tps, queue_size=1, queue_time_estimate_ms_by_priority=((0, 5), (4, 9))
    )
    stats = apply_reservations(base, [(10, 2)])
    assert stats.queue_time_estimate_ms_by_priority == ()
    assert stats.queue_size == 2  # the counters still count it


def test_zero_token_reservation_keeps_the_map_even_with_invalid_tps() -> None:
    base = ModelStats(last_mean_input_tps=0.0, queue_time_estimate_ms_by_priority=((0, 5),))
    stats = apply_reservations(base, [(0, 3)])
    assert stats.queue_time_estimate_ms_by_priority == ((0, 5), (3, 5))
    assert stats.queue_size == 1


def test_reservations_apply_on_top_of_the_aggregated_cluster_stats() -> None:
    state = RoutingState()
    a = state.begin(_identity("a"))
    b = state.begin(_identity("b"))
    state.apply(a, {"m": _route(last_mean_input_tps=100.0, queued_input_size=10, queue_size=1)})
    state.apply(
        b,
        {
            "m": _route(
                received_at=1.0,
                last_mean_input_tps=300.0,
                queued_input_size=20,
                queue_size=2,
                num_running_queries=4,
                total_query_input_size=50,
                queue_time_estimate_ms_by_priority=((0, 7),),
            )
        },
    )
    assert state.reserve(TARGET, "c", a, 400, 0) is not None
    stats = _cluster(state).stats
    assert stats.queue_size == 4  # 1 + 2 summed, +1
    assert stats.queued_input_size == 430
    assert stats.num_running_queries == 5  # latest-wins source b, +1
    assert stats.total_query_input_size == 450
    assert stats.queue_time_estimate_ms_by_priority == ((0, 1007),)  # 400 / 400 TPS = 1000 ms
    assert stats.last_mean_input_tps == 400.0


# ---- lifetime ----------------------------------------------------------------------------------


def test_explicit_release_is_idempotent() -> None:
    state = RoutingState()
    a = state.begin(_identity("a"))
    state.apply(a, {"m": _route()})
    first = state.reserve(TARGET, "c", a, 10, 0)
    second = state.reserve(TARGET, "c", a, 5, 0)
    assert first is not None and second is not None
    assert _cluster(state).stats.queued_input_size == 15
    state.release(first)
    state.release(first)
    assert not _alive(first) and _alive(second)
    assert _cluster(state).stats.queued_input_size == 5
    assert _cluster(state).stats.queue_size == 1
    state.release(second)
    assert _cluster(state).stats == ModelStats()


def test_next_heartbeat_of_the_reserved_backend_releases_only_its_reservations() -> None:
    state = RoutingState()
    a = state.begin(_identity("a"))
    b = state.begin(_identity("b"))
    state.apply(a, {"m": _route()})
    state.apply(b, {"m": _route()})
    on_a = state.reserve(TARGET, "c", a, 10, 0)
    on_b = state.reserve(TARGET, "c", b, 20, 0)
    assert on_a is not None and on_b is not None
    assert _cluster(state).stats.queued_input_size == 30
    state.apply(a, {"m": _route(queued_input_size=1)})  # a's heartbeat
    assert not _alive(on_a) and _alive(on_b)
    assert _cluster(state).stats.queued_input_size == 21
    state.release(on_a)  # already gone: nothing changes
    assert _cluster(state).stats.queued_input_size == 21


def test_reservations_are_per_target() -> None:
    state = RoutingState()
    a = state.begin(_identity("a"))
    state.apply(a, {"m": _route(), "other": _route()})
    on_m = state.reserve(TARGET, "c", a, 10, 0)
    on_other = state.reserve(RoutingTargetKey(None, "other"), "c", a, 7, 0)
    assert on_m is not None and on_other is not None
    assert _cluster(state).stats.queued_input_size == 10
    state.release(on_other)
    assert _alive(on_m) and _cluster(state).stats.queued_input_size == 10
    # A heartbeat upserts every listed model, so it releases the backend's reservations on each.
    again = state.reserve(RoutingTargetKey(None, "other"), "c", a, 7, 0)
    assert again is not None
    state.apply(a, {"m": _route(), "other": _route()})
    assert not _alive(on_m) and not _alive(again)


def test_backend_leaving_the_cluster_drops_its_reservations() -> None:
    state = RoutingState()
    a = state.begin(_identity("a"))
    b = state.begin(_identity("b"))
    state.apply(a, {"m": _route()})
    state.apply(b, {"m": _route()})
    on_a = state.reserve(TARGET, "c", a, 10, 0)
    on_b = state.reserve(TARGET, "c", b, 20, 0)
    assert on_a is not None and on_b is not None
    state.apply(a, {"m": None})  # a: model no longer routable
    assert not _alive(on_a) and _alive(on_b)
    assert _cluster(state).stats.queued_input_size == 20
    state.end(b)  # the cluster empties and the target goes
    assert not _alive(on_b)
    assert state.snapshot(TARGET) is None


def test_ending_a_registration_drops_its_reservations() -> None:
    state = RoutingState()
    a = state.begin(_identity("a"))
    b = state.begin(_identity("b"))
    state.apply(a, {"m": _route()})
    state.apply(b, {"m": _route()})
    on_a = state.reserve(TARGET, "c", a, 10, 0)
    assert on_a is not None
    state.end(a)
    assert not _alive(on_a)
    assert _cluster(state).stats.queue_size == 0


def test_failed_or_finished_requests_do_not_release() -> None:
    # Nothing but release/heartbeat/leave removes a reservation: it stays while it is not touched.
    state = RoutingState()
    a = state.begin(_identity("a"))
    state.apply(a, {"m": _route()})
    reservation = state.reserve(TARGET, "c", a, 10, 0)
    assert reservation is not None
    for _ in range(3):
        assert _cluster(state).stats.queue_size == 1
    assert _alive(reservation)


def test_stale_registration_is_refused() -> None:
    state = RoutingState()
    old = state.begin(_identity("a"))
    state.apply(old, {"m": _route()})
    state.end(old)
    assert state.reserve(TARGET, "c", old, 10, 0) is None  # no target at all
    new = state.begin(_identity("a"))
    state.apply(new, {"m": _route()})
    assert state.reserve(TARGET, "c", old, 10, 0) is None  # same id, another registration
    assert state.reserve(TARGET, "other-cluster", new, 10, 0) is None
    assert state.reserve(RoutingTargetKey("key", "m"), "c", new, 10, 0) is None
    assert state.reserve(RoutingTargetKey(None, "x"), "c", new, 10, 0) is None
    assert _cluster(state).stats.queue_size == 0
    assert state.reserve(TARGET, "c", new, 10, 0) is not None
    assert _cluster(state).stats.queue_size == 1


def test_backend_not_in_that_target_is_refused() -> None:
    state = RoutingState()
    a = state.begin(_identity("a"))
    b = state.begin(_identity("b"))
    state.apply(a, {"m": _route()})
    state.apply(b, {"other": _route()})
    assert state.reserve(TARGET, "c", b, 10, 0) is None
    state.apply(a, {"m": None})
    assert state.reserve(TARGET, "c", a, 10, 0) is None


def test_reservations_are_per_cluster() -> None:
    state = RoutingState()
    a = state.begin(_identity("a", "c1"))
    b = state.begin(_identity("b", "c2"))
    state.apply(a, {"m": _route()})
    state.apply(b, {"m": _route()})
    assert state.reserve(TARGET, "c1", a, 10, 0) is not None
    assert _cluster(state, "c1").stats.queue_size == 1
    assert _cluster(state, "c2").stats.queue_size == 0


# ---- the snapshot cache ------------------------------------------------------------------------


def test_snapshot_is_cached_until_reservations_change() -> None:
    state = RoutingState()
    a = state.begin(_identity("a", "c1"))
    b = state.begin(_identity("b", "c2"))
    state.apply(a, {"m": _route(queue_size=1)})
    state.apply(b, {"m": _route(queue_size=1)})
    first = state.snapshot(TARGET)
    assert state.snapshot(TARGET) is first
    reservation = state.reserve(TARGET, "c1", a, 10, 0)
    assert reservation is not None
    second = state.snapshot(TARGET)
    assert second is not first and second is not None
    assert state.snapshot(TARGET) is second
    c1, c2 = second.clusters
    assert (c1.stats.queue_size, c2.stats.queue_size) == (2, 1)
    assert (
        first is not None and c2 is first.clusters[1]
    )  # the untouched cluster keeps its cached snapshot
    state.release(reservation)
    third = state.snapshot(TARGET)
    assert third is not second and third is not None
    assert third.clusters[0].stats.queue_size == 1
    state.release(reservation)  # idempotent: the cache stays valid
    assert state.snapshot(TARGET) is third


def test_a_snapshot_taken_earlier_is_not_changed_by_later_reservations() -> None:
    state = RoutingState()
    a = state.begin(_identity("a"))
    state.apply(a, {"m": _route()})
    before = _cluster(state)
    state.reserve(TARGET, "c", a, 10, 0)
    assert before.stats.queue_size == 0
    assert _cluster(state).stats.queue_size == 1
    assert _cluster(state).backends == before.backends


def test_heartbeat_after_a_reservation_refreshes_the_snapshot() -> None:
    state = RoutingState()
    a = state.begin(_identity("a"))
    state.apply(a, {"m": _route(queue_size=5)})
    state.reserve(TARGET, "c", a, 10, 0)
    assert _cluster(state).stats.queue_size == 6
    state.apply(a, {"m": _route(queue_size=6)})  # the backend now counts the request itself
    assert _cluster(state).stats.queue_size == 6


# ---- the forwarder: one reservation per attempt, released only by a queue-estimate mismatch ---


@dataclass
class _Response:
    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    async def aclose(self) -> None:
        pass


class _Pool:
    """Answers attempts from a script; records the target's per-cluster queue sizes each attempt
    saw (its own reservation included)."""

    def __init__(self, state: RoutingState, script: list[_Response | Exception]) -> None:
        self.state = state
        self.script = script
        self.seen: list[tuple[str, dict[str, int]]] = []
        self.expected: list[bytes | None] = []  # each attempt's x-stargate-expected-queue-ms

    async def request(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes = b""
    ) -> _Response:
        snapshot = self.state.snapshot(TARGET)
        assert snapshot is not None
        queues = {c.cluster_id: c.stats.queue_size for c in snapshot.clusters}
        self.seen.append((url.split("/")[3], queues))  # the backend id in its URL
        self.expected.append(
            next((v for k, v in headers if k == b"x-stargate-expected-queue-ms"), None)
        )
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step


def _forwarder(state: RoutingState, pool: _Pool) -> Forwarder:
    metrics = ProxyMetrics.create(CollectorRegistry(), "test_")
    return Forwarder(state, cast(ConnectionPool, pool), ProxyConfig(), LbConfig(), metrics)


def _request() -> ProxyRequest:
    return ProxyRequest(
        endpoint="chat_completions",
        target_path=b"/v1/chat/completions",
        request_id="r",
        model_id="m",
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


def _retryable(status: int, reason: str) -> _Response:
    return _Response(
        status, [(b"x-stargate-retryable", b"true"), (b"x-stargate-retry-reason", reason.encode())]
    )


async def test_queue_estimate_mismatch_releases_that_attempts_reservation() -> None:
    state = RoutingState()
    for server_id in ("a", "b"):
        state.apply(state.begin(_identity(server_id)), {"m": _route()})
    pool = _Pool(state, [_retryable(429, "queue_estimate_mismatch"), _Response(200)])
    result = await _forwarder(state, pool).forward(_request(), AlgorithmSpec(), b"{}")
    assert isinstance(result, Forwarded)
    first, second = pool.seen
    assert first[0] != second[0]  # the sibling backend
    assert first[1] == {"c": 1} and second[1] == {"c": 1}  # the first one was released
    assert _cluster(state).stats.queue_size == 1  # success does not release


async def test_other_retries_and_failures_keep_their_reservations() -> None:
    state = RoutingState()
    for server_id in ("a", "b", "x"):
        cluster_id = "c2" if server_id == "x" else "c"
        state.apply(state.begin(_identity(server_id, cluster_id)), {"m": _route()})
    script: list[_Response | Exception] = [
        ConnectError("refused"),
        _retryable(503, "upstream_admission_rejected"),
        _Response(200),
    ]
    pool = _Pool(state, script)
    spec = AlgorithmSpec(name="round-robin")
    result = await _forwarder(state, pool).forward(_request(), spec, b"{}")
    assert isinstance(result, Forwarded)
    assert [sum(queues.values()) for _, queues in pool.seen] == [1, 2, 3]
    snapshot = state.snapshot(TARGET)
    assert snapshot is not None
    assert sum(c.stats.queue_size for c in snapshot.clusters) == 3


async def test_mismatch_on_the_only_backend_is_released_then_resent_without_the_check() -> None:
    """One backend: the mismatch is released and retried, no sibling is left, so the last resort
    sends the request to the same backend again without an expected queue time (the Pylon
    accepts it) instead of answering 503 while that backend has room."""
    state = RoutingState()
    state.apply(state.begin(_identity("a")), {"m": _route(last_mean_input_tps=100.0)})
    pool = _Pool(state, [_retryable(429, "queue_estimate_mismatch"), _Response(200)])
    result = await _forwarder(state, pool).forward(_request(), AlgorithmSpec(), b"{}")
    assert isinstance(result, Forwarded)
    assert [backend for backend, _ in pool.seen] == ["a", "a"]
    # The first attempt carried the estimate, the resend none; the first reservation was
    # released before the resend made its own.
    assert [queues["c"] for _, queues in pool.seen] == [1, 1]
    assert pool.expected == [b"0", None]
    assert _cluster(state).stats.queue_size == 1  # the resend's own, until the next heartbeat


async def test_prefix_aware_raises_the_expected_queue_by_what_it_tolerated() -> None:
    """prefix-aware accepts queue above its estimate to keep a request where its cache is; the
    attempt's x-stargate-expected-queue-ms carries that allowance (the home: its prefill saving
    plus overflow_ms), so the Pylon's check refuses only past it. Other balancers send the bare
    estimate."""
    state = RoutingState()
    state.apply(
        state.begin(_identity("a")), {"m": _route(last_mean_input_tps=100.0, queued_input_size=50)}
    )
    spec = AlgorithmSpec(name="prefix-aware", overflow_ms=700)
    pool = _Pool(state, [_Response(200), _Response(200)])
    forwarder = _forwarder(state, pool)
    assert isinstance(await forwarder.forward(_request(), spec, b"{}"), Forwarded)
    # The chosen snapshot's 50 queued tokens at 100 TPS: 500 ms; its 10 tokens save 100 ms.
    assert pool.expected[-1] == b"1300"  # 500 + 100 + 700
    assert isinstance(await forwarder.forward(_request(), AlgorithmSpec(), b"{}"), Forwarded)
    assert pool.expected[-1] == b"600"  # power-of-n: the estimate alone (now with a reservation)
