"""Unmeasured backends (docs/pylon-data-path.md, "Unmeasured backends"): a cluster whose Pylon has
published no usable input TPS gets a stand-in in the routing state's snapshots, so every load
balancer can pick it by its queue; measured clusters are left exactly as published."""

from __future__ import annotations

import math
import random

import pytest

from stargate.load_balancing.balancers import PowerOfN, RoutingRequest, ttft_ms
from stargate.load_balancing.pulsar import Pulsar
from stargate.load_balancing.wait_and_widen import WaitAndWiden
from stargate.routing import BackendRoute, ModelStats, RegistrationIdentity, RoutingState
from stargate.routing import RoutingTargetKey as Target
from stargate.routing.state import UNMEASURED_INPUT_TPS

M = Target(None, "m")


def _state(estimate: bool, *published: ModelStats) -> RoutingState:
    state = RoutingState(estimate_unmeasured=estimate)
    for index, stats in enumerate(published):
        name = f"b{index}"
        registration = state.begin(RegistrationIdentity(name, name, f"http://{name}:1", None))
        assert state.apply(registration, {"m": BackendRoute(stats, 1_000_000, float(index))})
    return state


def _tps(state: RoutingState) -> dict[str, tuple[float, bool]]:
    snapshot = state.snapshot(M)
    assert snapshot is not None
    return {
        c.cluster_id: (c.stats.last_mean_input_tps, c.input_tps_estimated)
        for c in snapshot.clusters
    }


def test_off_the_snapshots_carry_what_was_published() -> None:
    state = _state(False, ModelStats(), ModelStats(last_mean_input_tps=500.0))
    assert _tps(state) == {"b0": (0.0, False), "b1": (500.0, False)}


def test_an_unmeasured_cluster_is_taken_for_the_mean_of_the_measured_ones() -> None:
    state = _state(
        True,
        ModelStats(last_mean_input_tps=400.0),
        ModelStats(),
        ModelStats(last_mean_input_tps=800.0),
        ModelStats(last_mean_input_tps=math.nan),
    )
    assert _tps(state) == {
        "b0": (400.0, False),
        "b1": (600.0, True),
        "b2": (800.0, False),
        "b3": (600.0, True),
    }


def test_with_none_measured_every_cluster_gets_the_same_stand_in() -> None:
    state = _state(True, ModelStats(queue_size=3), ModelStats(last_mean_input_tps=-1.0))
    assert _tps(state) == {
        "b0": (UNMEASURED_INPUT_TPS, True),
        "b1": (UNMEASURED_INPUT_TPS, True),
    }
    snapshot = state.snapshot(M)
    assert snapshot is not None
    assert snapshot.clusters[0].stats.queue_size == 3  # nothing else changes


def test_all_measured_is_the_very_same_snapshot_tuple() -> None:
    state = _state(True, ModelStats(last_mean_input_tps=1.0), ModelStats(last_mean_input_tps=2.0))
    snapshot = state.snapshot(M)
    assert snapshot is not None
    assert all(not c.input_tps_estimated for c in snapshot.clusters)


@pytest.mark.parametrize("estimate", [False, True])
def test_pulsar_and_wait_and_widen_choose_only_with_the_estimate(estimate: bool) -> None:
    """A fresh fleet (no Pylon measured yet): the Rust rule returns no choice (503 after the
    routing wait); with the estimate both pick a cluster."""
    state = _state(estimate, ModelStats(), ModelStats())
    snapshot = state.snapshot(M)
    assert snapshot is not None
    request = RoutingRequest(model_id="m", input_tokens=100)
    for balancer in (Pulsar(), WaitAndWiden(rng=random.Random(1))):
        choice = balancer.choose(snapshot.clusters, request, frozenset())
        assert (choice is not None) is estimate, balancer.name


def test_power_of_n_prefers_the_shorter_queue_among_unmeasured_clusters() -> None:
    """Without the estimate every TTFT is +inf and power-of-n picks at random; with it the
    published queue decides."""
    busy = ModelStats(queue_size=4, queued_input_size=4000)
    state = _state(True, busy, ModelStats())
    snapshot = state.snapshot(M)
    assert snapshot is not None
    request = RoutingRequest(model_id="m", input_tokens=100)
    scores = [ttft_ms(c, request) for c in snapshot.clusters]
    assert all(math.isfinite(score) for score in scores)
    balancer = PowerOfN(rng=random.Random(7))
    picks = {
        balancer.choose(snapshot.clusters, request, frozenset()).cluster.cluster_id  # type: ignore[union-attr]
        for _ in range(50)
    }
    assert picks == {"b1"}
