"""The routing state's counting API: what the readiness sampler reads (spec §3.8)."""

from __future__ import annotations

from stargate.routing import BackendEntry, RoutingState, RoutingTargetKey

MODEL_A = RoutingTargetKey(None, "model-a")
MODEL_B = RoutingTargetKey(None, "model-b")
KEYED_A = RoutingTargetKey("tenant-1", "model-a")


def _backend(server_id: str, cluster_id: str = "") -> BackendEntry:
    return BackendEntry(server_id, cluster_id or server_id, f"http://10.0.0.1:80/{server_id}")


def test_empty_state_counts_zero() -> None:
    state = RoutingState()
    assert state.total_active_backend_count() == 0
    assert state.active_backend_count(MODEL_A) == 0
    assert state.targets() == []


def test_one_backend_serving_three_models_counts_three() -> None:
    state = RoutingState()
    for target in (MODEL_A, MODEL_B, KEYED_A):
        assert state.upsert_backend(target, _backend("pylon-1"))
    assert state.total_active_backend_count() == 3
    assert state.active_backend_count(MODEL_A) == 1


def test_heartbeat_replacement_does_not_change_the_count() -> None:
    state = RoutingState()
    state.upsert_backend(MODEL_A, _backend("pylon-1"))
    refreshed = BackendEntry("pylon-1", "pylon-1", "http://10.0.0.1:80/new")
    assert not state.upsert_backend(MODEL_A, refreshed)
    assert state.total_active_backend_count() == 1
    assert state.backends(MODEL_A) == [refreshed]


def test_routing_keys_are_separate_targets() -> None:
    state = RoutingState()
    state.upsert_backend(MODEL_A, _backend("pylon-1"))
    state.upsert_backend(KEYED_A, _backend("pylon-2"))
    assert state.active_backend_count(MODEL_A) == 1
    assert state.active_backend_count(KEYED_A) == 1
    assert state.active_backend_count(RoutingTargetKey("", "model-a")) == 0
    assert state.total_active_backend_count() == 2


def test_clusters_group_backends_and_count_each() -> None:
    state = RoutingState()
    state.upsert_backend(MODEL_A, _backend("pylon-1", "cluster-x"))
    state.upsert_backend(MODEL_A, _backend("pylon-2", "cluster-x"))
    state.upsert_backend(MODEL_A, _backend("pylon-3", "cluster-y"))
    assert state.active_backend_count(MODEL_A) == 3
    assert [b.inference_server_id for b in state.backends(MODEL_A)] == [
        "pylon-1",
        "pylon-2",
        "pylon-3",
    ]


def test_removing_the_last_backend_drops_the_target() -> None:
    state = RoutingState()
    state.upsert_backend(MODEL_A, _backend("pylon-1", "c"))
    state.upsert_backend(MODEL_A, _backend("pylon-2", "c"))
    assert state.remove_backend(MODEL_A, "c", "pylon-1")
    assert state.targets() == [MODEL_A]
    assert state.remove_backend(MODEL_A, "c", "pylon-2")
    assert state.targets() == []
    assert state.total_active_backend_count() == 0


def test_removing_an_unknown_backend_changes_nothing() -> None:
    state = RoutingState()
    state.upsert_backend(MODEL_A, _backend("pylon-1", "c"))
    assert not state.remove_backend(MODEL_A, "other-cluster", "pylon-1")
    assert not state.remove_backend(MODEL_A, "c", "pylon-9")
    assert not state.remove_backend(MODEL_B, "c", "pylon-1")
    assert state.total_active_backend_count() == 1
