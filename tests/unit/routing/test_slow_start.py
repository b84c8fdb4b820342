"""Slow start's rules (stargate/routing/slow_start.py, docs/outliers.md), under a mock clock: the
ramp factor over the window (Envoy's formula), who ramps (joiners after the initial fleet), the
guards (never when every candidate is new, never an empty set), the O(1) "anyone ramping?", and
the routing state keeping each backend's join time across heartbeats."""

from __future__ import annotations

import math
import random

import pytest
from trio.testing import MockClock

from stargate.routing import BackendRoute, ModelStats, RegistrationIdentity, RoutingState
from stargate.routing.slow_start import SlowStart, SlowStartPolicy, ramp_factor

POLICY = SlowStartPolicy(window=30.0, aggression=1.0, min_weight_percent=10.0)


def test_the_linear_ramp_starts_at_the_min_weight_and_ends_at_one() -> None:
    assert ramp_factor(POLICY, 0.0) == 0.1
    assert ramp_factor(POLICY, 1.5) == 0.1  # 5 % of the window: still the floor
    assert ramp_factor(POLICY, 3.0) == pytest.approx(0.1)
    assert ramp_factor(POLICY, 15.0) == pytest.approx(0.5)
    assert ramp_factor(POLICY, 27.0) == pytest.approx(0.9)
    assert ramp_factor(POLICY, 30.0) == 1.0
    assert ramp_factor(POLICY, 1e6) == 1.0
    factors = [ramp_factor(POLICY, t / 10) for t in range(301)]
    assert factors == sorted(factors)  # never decreases


def test_aggression_bends_the_ramp_as_in_envoy() -> None:
    fast = SlowStartPolicy(window=30.0, aggression=2.0, min_weight_percent=0.0)
    slow = SlowStartPolicy(window=30.0, aggression=0.5, min_weight_percent=0.0)
    assert ramp_factor(fast, 7.5) == pytest.approx(math.sqrt(0.25))  # (1/4) ^ (1/2)
    assert ramp_factor(slow, 7.5) == pytest.approx(0.25**2)
    assert ramp_factor(fast, 0.0) == 0.0


def test_off_means_every_factor_is_one_and_nobody_ramps() -> None:
    off = SlowStart(SlowStartPolicy(window=0.0))
    assert ramp_factor(off.policy, 0.0) == 1.0
    assert not off.active(last_join=100.0, now=100.0)
    assert off.left_out([("old", -math.inf), ("new", 100.0)], 100.0, lambda: 0.0) == set()


def test_only_backends_that_joined_after_the_initial_fleet_ramp() -> None:
    clock = MockClock()
    slow = SlowStart(POLICY)
    initial = clock.current_time()
    clock.jump(5)
    slow.settle(clock.current_time())  # warmup ended: everything so far is the initial fleet
    assert not slow.ramping(initial, clock.current_time())
    assert not slow.active(initial, clock.current_time())
    clock.jump(1)
    joined = clock.current_time()
    assert slow.active(joined, clock.current_time())
    assert slow.ramping(joined, clock.current_time())
    assert slow.factor(joined, clock.current_time()) == 0.1
    assert slow.factor(initial, clock.current_time()) == 1.0
    clock.jump(15)
    assert slow.factor(joined, clock.current_time()) == pytest.approx(0.5)
    clock.jump(15)
    assert not slow.ramping(joined, clock.current_time())
    assert not slow.active(joined, clock.current_time())  # O(1): the latest join is past


def _shares(
    slow: SlowStart, candidates: list[tuple[str, float]], now: float, decisions: int
) -> dict[str, float]:
    """How often each candidate stays in over `decisions` draws."""
    rng = random.Random(7)
    kept = dict.fromkeys((backend for backend, _ in candidates), 0)
    for _ in range(decisions):
        out = slow.left_out(candidates, now, rng.random)
        assert len(out) < len(candidates)  # never empty
        for backend, _ in candidates:
            kept[backend] += backend not in out
    return {backend: count / decisions for backend, count in kept.items()}


def test_a_ramping_backend_sits_out_with_probability_one_minus_its_factor() -> None:
    clock = MockClock()
    slow = SlowStart(POLICY)
    slow.settle(clock.current_time())
    established = [("a", -math.inf), ("b", -math.inf), ("c", -math.inf)]
    clock.jump(1)
    joined = clock.current_time()
    for elapsed, factor in ((0.0, 0.1), (6.0, 0.2), (15.0, 0.5), (27.0, 0.9)):
        now = joined + elapsed
        shares = _shares(slow, [*established, ("new", joined)], now, 20_000)
        assert shares["new"] == pytest.approx(factor, abs=0.015)
        assert shares["a"] == shares["b"] == shares["c"] == 1.0  # established: always in


def test_nobody_sits_out_when_every_candidate_is_new() -> None:
    clock = MockClock()
    slow = SlowStart(POLICY)
    slow.settle(clock.current_time())
    clock.jump(1)
    first = clock.current_time()
    clock.jump(2)
    second = clock.current_time()
    # A fleet that registers together after warmup (or with warmup off): nobody to shift to.
    assert slow.left_out([("x", first), ("y", second)], second, lambda: 0.99) == set()
    assert slow.left_out([("x", first)], second, lambda: 0.99) == set()
    assert slow.left_out([], second, lambda: 0.99) == set()
    # Once one of them is past its window, the other (still in its own) ramps the rest.
    now = first + 30.0
    assert slow.left_out([("x", first), ("y", second)], now, lambda: 0.99) == {"y"}
    assert slow.left_out([("x", first), ("y", second)], now, lambda: 0.0) == set()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": -1.0},
        {"aggression": 0.0},
        {"aggression": -1.0},
        {"min_weight_percent": 101.0},
        {"min_weight_percent": -0.1},
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SlowStartPolicy(**kwargs)


def _route(received_at: float) -> BackendRoute:
    return BackendRoute(ModelStats(), 1_000_000, received_at)


def test_the_routing_state_keeps_the_join_time_across_heartbeats() -> None:
    state = RoutingState()
    assert state.last_join == -math.inf
    first = state.begin(RegistrationIdentity("a", "ca", "http://a", None))
    second = state.begin(RegistrationIdentity("b", "cb", "http://b", None))
    assert state.apply(first, {"m": _route(10.0)})
    assert state.apply(second, {"m": _route(12.0)})
    assert state.last_join == 12.0
    for heartbeat in (13.0, 20.0, 50.0):
        assert state.apply(first, {"m": _route(heartbeat)})
    snapshot = state.snapshot(first.target("m"))
    assert snapshot is not None
    joined = {b.inference_server_id: b.joined_at for c in snapshot.clusters for b in c.backends}
    assert joined == {"a": 10.0, "b": 12.0}
    assert state.last_join == 12.0  # heartbeats are not joins
    # The model goes inactive and comes back: a new join (the engine may have reloaded it).
    assert state.apply(first, {"m": None})
    assert state.apply(first, {"m": _route(60.0)})
    snapshot = state.snapshot(first.target("m"))
    assert snapshot is not None
    joined = {b.inference_server_id: b.joined_at for c in snapshot.clusters for b in c.backends}
    assert joined == {"a": 60.0, "b": 12.0} and state.last_join == 60.0
    assert state.backend_count() == 2 and state.is_registered("a")
    state.end(first)
    assert state.backend_count() == 1 and not state.is_registered("a")
