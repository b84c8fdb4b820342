"""The routing state (docs/control-plane.md, Routing state): registrations, targets, clusters and
counts."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stargate.routing import (
    AlreadyRegistered,
    BackendRoute,
    ModelStats,
    Registration,
    RegistrationIdentity,
    RoutingState,
    RoutingTargetKey,
)
from stargate.routing.stats import aggregate_stats, mean_rtt_seconds


def _identity(
    server_id: str, cluster_id: str = "", routing_key: str | None = None
) -> RegistrationIdentity:
    return RegistrationIdentity(
        server_id, cluster_id or server_id, f"http://10.0.0.1:8000/{server_id}", routing_key
    )


def _route(rtt_ms: float = 1.0, received_at: float = 0.0, **stats: object) -> BackendRoute:
    return BackendRoute(ModelStats(**stats), int(rtt_ms * 1e6), received_at)  # type: ignore[arg-type]


def _target(model: str, routing_key: str | None = None) -> RoutingTargetKey:
    return RoutingTargetKey(routing_key, model)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[RoutingTargetKey, int]] = []

    def __call__(self, target: RoutingTargetKey, count: int) -> None:
        self.events.append((target, count))


def test_empty_state_counts_zero() -> None:
    state = RoutingState()
    assert state.total_active_backend_count() == 0
    assert state.snapshot(_target("m")) is None
    assert not state.is_advertised(_target("m"))


def test_active_route_counts_and_snapshots() -> None:
    state = RoutingState()
    reg = state.begin(_identity("pylon-1"))
    assert state.apply(reg, {"m": _route(rtt_ms=2, queue_size=3)})
    snapshot = state.snapshot(_target("m"))
    assert snapshot is not None
    (cluster,) = snapshot.clusters
    assert cluster.cluster_id == "pylon-1"
    assert cluster.stats.queue_size == 3
    assert cluster.rtt_seconds == pytest.approx(0.002)
    assert [b.inference_server_id for b in cluster.backends] == ["pylon-1"]
    assert cluster.backends[0].url == "http://10.0.0.1:8000/pylon-1"
    assert state.total_active_backend_count() == 1


def test_one_backend_serving_three_models_counts_three() -> None:
    state = RoutingState()
    reg = state.begin(_identity("pylon-1"))
    state.apply(reg, {"a": _route(), "b": _route(), "c": _route()})
    assert state.total_active_backend_count() == 3
    assert state.list_models(None) == ["a", "b", "c"]


def test_heartbeat_does_not_double_count_and_replaces_the_snapshot() -> None:
    state = RoutingState()
    recorder = Recorder()
    state = RoutingState(on_target_count=recorder)
    reg = state.begin(_identity("pylon-1"))
    state.apply(reg, {"m": _route(queue_size=1)})
    state.apply(reg, {"m": _route(queue_size=9)})
    assert state.total_active_backend_count() == 1
    snapshot = state.snapshot(_target("m"))
    assert snapshot is not None and snapshot.clusters[0].stats.queue_size == 9
    # The count changed once: a heartbeat of a routed backend publishes nothing (and does not
    # walk the target's clusters to count them).
    assert recorder.events == [(_target("m"), 1)]


def test_inactive_model_is_advertised_but_not_active() -> None:
    state = RoutingState()
    reg = state.begin(_identity("pylon-1"))
    state.apply(reg, {"m": _route()})
    state.apply(reg, {"m": None})
    assert state.snapshot(_target("m")) is None
    assert state.is_advertised(_target("m"))  # 503, not 404
    state.apply(reg, {})
    assert not state.is_advertised(_target("m"))  # now 404


def test_setting_one_model_inactive_removes_only_that_model() -> None:
    state = RoutingState()
    reg = state.begin(_identity("pylon-1"))
    state.apply(reg, {"a": _route(), "b": _route()})
    state.apply(reg, {"a": None, "b": _route()})
    assert state.list_models(None) == ["b"]


def test_duplicate_live_id_is_refused_regardless_of_routing_key() -> None:
    state = RoutingState()
    state.begin(_identity("pylon-1", routing_key="tenant-a"))
    with pytest.raises(AlreadyRegistered, match="'pylon-1' is already registered"):
        state.begin(_identity("pylon-1", routing_key="tenant-b"))


def test_end_removes_every_route_and_releases_the_id() -> None:
    recorder = Recorder()
    state = RoutingState(on_target_count=recorder)
    reg = state.begin(_identity("pylon-1"))
    state.apply(reg, {"a": _route(), "b": None})
    assert state.end(reg)
    assert state.total_active_backend_count() == 0
    assert not state.is_advertised(_target("a")) and not state.is_advertised(_target("b"))
    assert (_target("a"), 0) in recorder.events
    assert state.registrations() == []
    state.begin(_identity("pylon-1"))  # the id is free again
    assert not state.end(reg)  # ending twice is a no-op


def test_stale_cleanup_cannot_remove_a_same_id_replacement() -> None:
    state = RoutingState()
    old = state.begin(_identity("pylon-1"))
    state.apply(old, {"m": _route()})
    state.end(old)
    new = state.begin(_identity("pylon-1"))
    state.apply(new, {"m": _route()})
    assert not state.end(old)
    assert not state.apply(old, {})  # a late update of the old stream changes nothing
    assert state.total_active_backend_count() == 1
    assert state.is_live(new) and not state.is_live(old)


def test_membership_survives_until_the_last_advertiser_leaves() -> None:
    state = RoutingState()
    first = state.begin(_identity("pylon-1"))
    second = state.begin(_identity("pylon-2"))
    state.apply(first, {"m": None})
    state.apply(second, {"m": None})
    state.end(first)
    assert state.is_advertised(_target("m"))
    state.end(second)
    assert not state.is_advertised(_target("m"))


def test_cleanup_during_an_applying_update_removes_previous_and_advertised() -> None:
    state = RoutingState()
    reg = state.begin(_identity("pylon-1"))
    state.apply(reg, {"old": _route()})

    class Boom(Exception):
        pass

    class ExplodingRoutes(dict[str, BackendRoute | None]):
        """Fails after step 1 of apply, as if the stream died mid-update."""

        def items(self):  # type: ignore[no-untyped-def,override]
            raise Boom

    with pytest.raises(Boom):
        state.apply(reg, ExplodingRoutes({"new": _route()}))
    state.end(reg)
    assert state.total_active_backend_count() == 0
    assert not state.is_advertised(_target("old"))
    assert not state.is_advertised(_target("new"))


def test_routing_keys_isolate_targets() -> None:
    state = RoutingState()
    a = state.begin(_identity("pylon-a", routing_key="tenant-a"))
    b = state.begin(_identity("pylon-b", routing_key="tenant-b"))
    state.apply(a, {"m": _route()})
    state.apply(b, {"m": _route()})
    state.apply(a, {"m": None})  # demoting tenant A does not touch tenant B
    assert state.snapshot(_target("m", "tenant-a")) is None
    assert state.snapshot(_target("m", "tenant-b")) is not None
    assert state.list_models(None) == []
    assert state.list_models("tenant-b") == ["m"]
    assert state.active_model_ids() == ["m"]


def test_shared_cluster_sums_stats_and_keeps_siblings_when_one_leaves() -> None:
    state = RoutingState()
    one = state.begin(_identity("pylon-1", cluster_id="shared"))
    two = state.begin(_identity("pylon-2", cluster_id="shared"))
    state.apply(one, {"m": _route(rtt_ms=1, received_at=1, output_tps=17, queued_input_size=5)})
    state.apply(two, {"m": _route(rtt_ms=2, received_at=2, output_tps=23, queued_input_size=7)})
    snapshot = state.snapshot(_target("m"))
    assert snapshot is not None
    (cluster,) = snapshot.clusters
    assert cluster.active_backend_count == 2
    assert cluster.stats.output_tps == 40
    assert cluster.stats.queued_input_size == 12
    assert cluster.rtt_seconds == pytest.approx(0.0015)
    state.end(two)
    snapshot = state.snapshot(_target("m"))
    assert snapshot is not None
    assert snapshot.clusters[0].stats.output_tps == 17
    assert state.list_models(None) == ["m"]


def test_separate_clusters_are_separate_candidates() -> None:
    state = RoutingState()
    for server in ("pylon-1", "pylon-2"):
        state.apply(state.begin(_identity(server)), {"m": _route()})
    snapshot = state.snapshot(_target("m"))
    assert snapshot is not None
    assert sorted(c.cluster_id for c in snapshot.clusters) == ["pylon-1", "pylon-2"]
    assert snapshot.active_backend_count == 2


def test_emptied_target_is_dropped_and_recreated_fresh() -> None:
    state = RoutingState()
    reg = state.begin(_identity("pylon-1"))
    state.apply(reg, {"m": _route()})
    first = state.snapshot(_target("m"))
    state.apply(reg, {"m": None})
    assert state.targets() == []
    state.apply(reg, {"m": _route()})
    assert state.targets() == [_target("m")]
    assert state.snapshot(_target("m")) is not first


def test_list_models_filters_exactly() -> None:
    state = RoutingState()
    reg = state.begin(_identity("pylon-1"))
    state.apply(reg, {"a": _route(), "b": _route(), "c": None})
    assert state.list_models(None, ["b", "c", "zz", "b"]) == ["b"]
    assert state.list_models("other") == []


def test_latest_wins_fields_come_from_the_last_updated_backend() -> None:
    mine = ModelStats(kv_cache_free_tokens=10, output_tps=1.0, last_mean_input_tps=math.inf)
    theirs = ModelStats(kv_cache_free_tokens=99, output_tps=2.0, last_mean_input_tps=5.0)
    aggregated = aggregate_stats([mine, theirs], theirs)
    assert aggregated.kv_cache_free_tokens == 99
    assert aggregated.output_tps == 3.0
    assert aggregated.last_mean_input_tps == 5.0  # non-finite TPS is not summed


def test_label_sets_are_an_order_preserving_union() -> None:
    a = ModelStats(stats_sources=("engine", "pylon"))
    b = ModelStats(stats_sources=("pylon", "probe"))
    assert aggregate_stats([a, b], b).stats_sources == ("engine", "pylon", "probe")


def test_rtt_mean_truncates_to_whole_nanoseconds() -> None:
    assert mean_rtt_seconds([1, 2]) == 1e-9
    assert mean_rtt_seconds([]) == 0.0


def test_registration_repr_names_the_id() -> None:
    state = RoutingState()
    reg = state.begin(_identity("pylon-1"))
    assert isinstance(reg, Registration)
    assert "pylon-1" in repr(reg)


def test_demote_and_restore_are_by_id_and_idempotent() -> None:
    state = RoutingState()
    assert not state.any_demoted
    assert state.demoted == frozenset()
    state.demote("a")
    state.demote("a")
    state.demote("b")
    assert state.any_demoted
    assert state.is_demoted("a")
    assert state.demoted == {"a", "b"}
    state.restore("a")
    assert not state.is_demoted("a")
    assert state.is_demoted("b")
    state.restore("a")  # restoring what is not demoted is a no-op
    state.restore("never-seen")
    assert state.demoted == {"b"}
    state.restore("b")
    assert not state.any_demoted


def test_demotion_changes_no_snapshot_count_or_listing() -> None:
    events = Recorder()
    state = RoutingState(events)
    reg = state.begin(_identity("pylon-1"))
    state.apply(reg, {"m": _route()})
    before = state.snapshot(_target("m"))
    state.demote("pylon-1")
    assert state.snapshot(_target("m")) is before  # still a candidate: the proxy skips it
    assert state.total_active_backend_count() == 1
    assert state.list_models(None) == ["m"]
    assert events.events == [(_target("m"), 1)]  # no count change published
    state.restore("pylon-1")
    assert state.snapshot(_target("m")) is before


def test_demotion_lasts_until_restored_or_the_registration_ends() -> None:
    """A demotion ends with its registration: a new registration of the id is routable only
    after its own probe passed, which would lift it anyway; kept, every departed engine's id
    would stay demoted (and `any_demoted` true) for the life of the replica."""
    state = RoutingState()
    reg = state.begin(_identity("pylon-1"))
    state.apply(reg, {"m": _route()})
    state.demote("pylon-1")
    state.apply(reg, {"m": _route()})
    assert state.is_demoted("pylon-1")  # an update does not lift it; only a passing probe does
    state.end(reg)
    assert not state.any_demoted
    again = state.begin(_identity("pylon-1"))
    state.apply(again, {"m": _route()})
    state.demote("pylon-1")
    stale = state.begin(_identity("pylon-2"))
    state.end(stale)
    assert state.is_demoted("pylon-1")  # another registration's end leaves it alone
    state.restore("pylon-1")
    assert not state.any_demoted


def test_the_demoted_view_is_a_copy() -> None:
    state = RoutingState()
    state.demote("a")
    view = state.demoted
    state.restore("a")
    assert view == {"a"}
    assert state.demoted == frozenset()


_labels = st.lists(st.sampled_from(["engine", "pylon", "probe"]), max_size=4).map(tuple)


@settings(max_examples=300, deadline=None)
@given(
    tps=st.floats(allow_nan=True, allow_infinity=True),
    capabilities=_labels,
    sources=_labels,
    queue=st.integers(min_value=0, max_value=2**40),
)
def test_a_one_backend_cluster_aggregates_as_the_general_rule_does(
    tps: float, capabilities: tuple[str, ...], sources: tuple[str, ...], queue: int
) -> None:
    """The one-backend shortcut of `aggregate_stats` (no new value per heartbeat) gives what the
    general rule gives, field for field."""
    stats = ModelStats(
        last_mean_input_tps=tps,
        queue_size=queue,
        stats_capabilities=capabilities,
        stats_sources=sources,
        stats_observed_at_unix_ms=7,
    )
    general = aggregate_stats([stats, ModelStats(stats_observed_at_unix_ms=0)], stats)
    # The second backend above adds nothing but a 0 to every sum and label list.
    alone = aggregate_stats([stats], stats)
    assert alone == general
    if len(set(capabilities)) == len(capabilities) and len(set(sources)) == len(sources):
        assert (alone is stats) == (tps == 0 or (math.isfinite(tps) and tps > 0))


def test_heartbeats_rebuild_a_cluster_only_when_it_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Aggregation runs once per read of a changed cluster, not once per heartbeat
    (docs/performance.md, "Control plane"), and every read sees the latest heartbeat."""
    import stargate.routing.state as state_module

    calls: list[int] = []

    def counting(backends: list[ModelStats], source: ModelStats) -> ModelStats:
        calls.append(len(backends))
        return aggregate_stats(backends, source)

    monkeypatch.setattr(state_module, "aggregate_stats", counting)
    state = RoutingState()
    mine = state.begin(_identity("a", "shared"))
    theirs = state.begin(_identity("b", "shared"))
    state.apply(theirs, {"m": _route(queue_size=100, received_at=0.0)})
    before = state.snapshot(_target("m"))
    assert before is not None and calls == [1]
    for beat in range(1, 51):
        state.apply(mine, {"m": _route(queue_size=beat, received_at=float(beat))})
    assert calls == [1]  # fifty heartbeats, nothing read: nothing aggregated
    after = state.snapshot(_target("m"))
    assert after is not None and calls == [1, 2]
    (cluster,) = after.clusters
    assert cluster.stats.queue_size == 150  # summed: b's 100 and a's latest, 50
    assert cluster.received_at == 50.0  # latest-wins from the last updated backend
    assert before.clusters[0].stats.queue_size == 100  # a snapshot already taken is kept
    assert state.snapshot(_target("m")) is after and calls == [1, 2]  # cached until a change
    state.end(mine)
    (cluster,) = state.snapshot(_target("m")).clusters  # type: ignore[union-attr]
    assert cluster.stats.queue_size == 100 and cluster.received_at == 0.0  # the source left


def test_a_registration_keeps_one_target_key_per_listed_model() -> None:
    state = RoutingState()
    reg = state.begin(_identity("pylon-1", routing_key="k"))
    state.apply(reg, {"a": _route(), "b": _route()})
    key = reg.target("a")
    assert key == RoutingTargetKey("k", "a")
    state.apply(reg, {"a": _route(), "b": _route()})
    assert reg.target("a") is key  # made once, not per heartbeat
    state.apply(reg, {"a": _route()})
    assert set(reg._targets) == {"a"}  # a model no longer listed leaves no key behind
    assert state.list_models("k") == ["a"]
