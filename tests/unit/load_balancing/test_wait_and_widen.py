"""Wait-and-widen at the balancer level (docs/data-plane.md, Wait-and-widen): pure, no clock.

The scenarios of the Rust router's load-balancing suite, with the time a request has waited
passed in as `waited_ms`, as the forwarder's routing-wait loop will.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stargate.load_balancing.balancers import RoutingRequest
from stargate.load_balancing.wait_and_widen import (
    AffinityRing,
    WaitAndWiden,
    WidenSettings,
    at_capacity,
    least_queue_then_utilization,
    unlocked_clusters,
)
from stargate.routing.state import ClusterSnapshot
from tests.unit.load_balancing.support import NO_EXCLUSIONS, req, snap


def balancer(
    *,
    seed: int = 1,
    comparator: str = "ttft",
    selection_count: int = 0,
    virtual_nodes: int = 150,
    **widen: object,
) -> WaitAndWiden:
    return WaitAndWiden(
        comparator=comparator,
        cache_affinity_virtual_nodes=virtual_nodes,
        cache_affinity_backend_selection_count=selection_count,
        settings=WidenSettings(**widen),  # type: ignore[arg-type]
        rng=random.Random(seed),
    )


def picks(
    lb: WaitAndWiden,
    clusters: Sequence[ClusterSnapshot],
    request: RoutingRequest,
    count: int = 20,
    excluded: frozenset[str] = NO_EXCLUSIONS,
) -> list[str | None]:
    out: list[str | None] = []
    for _ in range(count):
        choice = lb.choose(clusters, request, excluded)
        out.append(None if choice is None else choice.cluster.cluster_id)
        assert choice is None or choice.rank_depth == 1
    return out


# Fast and slow clusters for 1000 input tokens: TTFT 100 ms and 1000 ms (gap 900 ms).
FAST = snap("fast", last_mean_input_tps=10_000.0, max_engine_concurrency=4)
SLOW = snap("slow", last_mean_input_tps=1_000.0, max_engine_concurrency=4)
FAST_FULL = snap(
    "fast", last_mean_input_tps=10_000.0, max_engine_concurrency=4, num_running_queries=4
)


# ---- scenarios ----------------------------------------------------------------------------------


def test_prefers_the_faster_cluster() -> None:
    assert set(picks(balancer(), [SLOW, FAST], req(1000))) == {"fast"}


def test_waits_for_a_later_bucket_while_the_fastest_is_at_capacity() -> None:
    lb = balancer()
    # The slow bucket starts 900 ms after the fastest: it needs 900 * 0.25 = 225 ms of waiting.
    assert picks(lb, [FAST_FULL, SLOW], req(1000, waited_ms=0.0), 5) == [None] * 5
    assert lb.choose([FAST_FULL, SLOW], req(1000, waited_ms=224.9), NO_EXCLUSIONS) is None
    unlocked = picks(lb, [FAST_FULL, SLOW], req(1000, waited_ms=225.0), 5)
    assert unlocked == ["slow"] * 5
    # Once the fast cluster has room again it wins, whatever the wait.
    assert set(picks(lb, [FAST, SLOW], req(1000, waited_ms=10_000.0))) <= {"fast", "slow"}
    assert set(picks(lb, [FAST, SLOW], req(1000, waited_ms=0.0))) == {"fast"}


def test_unlocked_buckets_still_compare_by_the_comparator() -> None:
    # With the slow bucket unlocked both are sampled (n = 2): the lower TTFT still wins.
    assert set(picks(balancer(), [FAST, SLOW], req(1000, waited_ms=10_000.0))) == {"fast"}


def test_max_queued_tolerates_running_requests_above_the_concurrency() -> None:
    assert set(picks(balancer(max_queued=1), [FAST_FULL, SLOW], req(1000))) == {"fast"}
    fuller = snap(
        "fast", last_mean_input_tps=10_000.0, max_engine_concurrency=4, num_running_queries=5
    )
    assert picks(balancer(max_queued=1), [fuller, SLOW], req(1000), 3) == [None] * 3


def test_at_capacity_rule() -> None:
    assert not at_capacity(snap("a", num_running_queries=100), 0)  # no published limit
    assert not at_capacity(snap("a", max_engine_concurrency=4, num_running_queries=3), 0)
    assert at_capacity(snap("a", max_engine_concurrency=4, num_running_queries=4), 0)
    assert not at_capacity(snap("a", max_engine_concurrency=4, num_running_queries=5), 2)
    assert at_capacity(snap("a", max_engine_concurrency=4, num_running_queries=6), 2)


def test_elapsed_time_is_consumed_per_unlocked_gap() -> None:
    # Bucket starts at 100, 200 and 400 ms (bucket size 20): unlocking the second costs
    # 100 * 0.25 = 25 ms, the third another 200 * 0.25 = 50 ms, so 75 ms in all.
    a = snap("a", last_mean_input_tps=10_000.0, max_engine_concurrency=1, num_running_queries=1)
    b = snap("b", last_mean_input_tps=5_000.0, max_engine_concurrency=1, num_running_queries=1)
    c = snap("c", last_mean_input_tps=2_500.0)
    lb = balancer()
    assert lb.choose([a, b, c], req(1000, waited_ms=74.9), NO_EXCLUSIONS) is None
    choice = lb.choose([a, b, c], req(1000, waited_ms=75.0), NO_EXCLUSIONS)
    assert choice is not None and choice.cluster.cluster_id == "c"
    estimates = [(100.0, a), (200.0, b), (400.0, c)]
    assert [x.cluster_id for x in unlocked_clusters(estimates, 20.0, 0.25, 0.0)] == ["a"]
    assert [x.cluster_id for x in unlocked_clusters(estimates, 20.0, 0.25, 25.0)] == ["a", "b"]
    assert [x.cluster_id for x in unlocked_clusters(estimates, 20.0, 0.25, 74.0)] == ["a", "b"]
    assert len(unlocked_clusters(estimates, 20.0, 0.25, 75.0)) == 3


def test_buckets_are_measured_from_their_first_member() -> None:
    # 100, 115, 130: 115 joins the first bucket (15 <= 20); 130 is 30 above its start.
    estimates = [(130.0, snap("c")), (100.0, snap("a")), (115.0, snap("b"))]
    assert [x.cluster_id for x in unlocked_clusters(estimates, 20.0, 0.25, 0.0)] == ["a", "b"]
    assert [x.cluster_id for x in unlocked_clusters(estimates, 20.0, 0.25, 7.5)] == [
        "a",
        "b",
        "c",
    ]
    # Within one bucket of the fastest: everything, in the given order.
    close = [(110.0, snap("b")), (100.0, snap("a"))]
    assert [x.cluster_id for x in unlocked_clusters(close, 20.0, 0.25, 0.0)] == ["b", "a"]
    # Equal TTFTs sort by cluster id; an infinite TTFT is never unlocked.
    ties = [(100.0, snap("z")), (100.0, snap("y")), (500.0, snap("x")), (float("inf"), snap("w"))]
    assert [x.cluster_id for x in unlocked_clusters(ties, 20.0, 0.25, 1e9)] == ["y", "z", "x"]
    assert unlocked_clusters([(float("inf"), snap("w"))], 20.0, 0.25, 1e9) == []


def test_no_capacity_means_an_infinite_ttft_and_is_never_chosen() -> None:
    dead = snap("dead", last_mean_input_tps=0.0)
    assert set(picks(balancer(), [dead, SLOW], req(1000, waited_ms=1e9))) == {"slow"}
    assert picks(balancer(), [dead], req(1000, waited_ms=1e9), 3) == [None] * 3
    # No input and no queue: the dead cluster's TTFT is its RTT, so it may be chosen.
    assert set(picks(balancer(), [dead], req(0), 3)) == {"dead"}


def test_ignore_flags_change_the_bucketing_only() -> None:
    # "queued": 900 ms of queue, "idle": a 500 ms RTT. Full TTFTs 900 and 500.
    queued = snap("queued", last_mean_input_tps=1_000.0, queued_input_size=900)
    idle = snap("idle", rtt_ms=500.0, last_mean_input_tps=1_000.0)
    # Bucketing on full TTFT: only "idle" (500) is unlocked.
    assert set(picks(balancer(), [queued, idle], req())) == {"idle"}
    # Ignoring the queue, "queued" buckets at 0 ms: only it is unlocked, though its full TTFT
    # is worse.
    assert set(picks(balancer(ignore_queue_time=True), [queued, idle], req())) == {"queued"}
    # Ignoring the queue with a wide bucket: both are sampled and the comparator, on the full
    # TTFT, picks "idle".
    wide = balancer(ignore_queue_time=True, ttft_bucket_size_ms=1000)
    assert set(picks(wide, [queued, idle], req())) == {"idle"}


def test_ignore_input_processing_time() -> None:
    # 1000 tokens: prefill 1000 ms on "slow" and 100 ms on "fast"; "fast" has 300 ms RTT.
    fast = snap("fast", rtt_ms=300.0, last_mean_input_tps=10_000.0)
    slow = snap("slow", last_mean_input_tps=1_000.0)
    assert set(picks(balancer(), [fast, slow], req(1000))) == {"fast"}
    # Without the prefill term "slow" (RTT 0) is the only one in the first bucket.
    assert set(picks(balancer(ignore_input_processing_time=True), [fast, slow], req(1000))) == {
        "slow"
    }


# ---- queue SLO ----------------------------------------------------------------------------------


def test_queue_slo_interpolates_from_floor_to_ceil_with_the_request_slo() -> None:
    # Queue delays 0, 200 and 400 ms; floor 100, ceil 500, x-request-slo-ms 1000. The idle
    # cluster is made slow (RTT) so that the others win when allowed; a big bucket keeps them
    # all unlocked.
    idle = snap("idle", rtt_ms=10_000.0, last_mean_input_tps=1_000.0)
    q200 = snap("q200", last_mean_input_tps=1_000.0, queued_input_size=200)
    q400 = snap("q400", last_mean_input_tps=1_000.0, queued_input_size=400)
    lb = balancer(
        max_queue_time_floor_ms=100, max_queue_time_ceil_ms=500, ttft_bucket_size_ms=100_000, n=3
    )
    clusters = [idle, q200, q400]
    assert set(picks(lb, clusters, req(slo_ms=1000, waited_ms=0.0))) == {"idle"}  # max 100
    assert set(picks(lb, clusters, req(slo_ms=1000, waited_ms=250.0))) == {"q200"}  # max 200
    assert set(picks(lb, clusters, req(slo_ms=1000, waited_ms=750.0))) == {"q200"}  # max 400
    # 400 <= 400 is allowed, but q200 is still better.
    only_q400 = [idle, q400]
    assert set(picks(lb, only_q400, req(slo_ms=1000, waited_ms=750.0))) == {"q400"}
    assert set(picks(lb, only_q400, req(slo_ms=1000, waited_ms=5000.0))) == {"q400"}  # clamped
    # No SLO header, or 0: the ceiling applies at once.
    assert set(picks(lb, only_q400, req(slo_ms=None))) == {"q400"}
    assert set(picks(lb, only_q400, req(slo_ms=0))) == {"q400"}
    # Everything over the ceiling: nothing to choose (wait).
    q900 = snap("q900", last_mean_input_tps=1_000.0, queued_input_size=900)
    assert picks(lb, [q900], req(slo_ms=1000, waited_ms=1e9), 3) == [None] * 3


def test_queue_slo_needs_floor_and_ceil() -> None:
    q900 = snap("q900", last_mean_input_tps=1_000.0, queued_input_size=900)
    halves: list[dict[str, Any]] = [
        {"max_queue_time_floor_ms": 100},
        {"max_queue_time_ceil_ms": 100},
        {},
    ]
    for kwargs in halves:
        assert set(picks(balancer(**kwargs), [q900], req(slo_ms=1000), 3)) == {"q900"}


def test_queue_slo_floor_above_ceil_is_not_reordered() -> None:
    settings_ = WidenSettings(max_queue_time_floor_ms=500, max_queue_time_ceil_ms=100)
    assert settings_.max_queue_time_ms(req(slo_ms=1000, waited_ms=0.0)) == 500.0
    assert settings_.max_queue_time_ms(req(slo_ms=1000, waited_ms=500.0)) == 300.0
    assert settings_.max_queue_time_ms(req(slo_ms=None)) == 100.0
    assert WidenSettings(max_queue_time_floor_ms=5).max_queue_time_ms(req()) is None


def test_queue_slo_uses_the_priority_aware_queue_delay() -> None:
    mapped = snap(
        "mapped",
        last_mean_input_tps=1_000.0,
        queue_time_estimate_ms_by_priority=((0, 50), (4, 300)),
    )
    lb = balancer(max_queue_time_floor_ms=100, max_queue_time_ceil_ms=100)
    assert set(picks(lb, [mapped], req(priority=0), 3)) == {"mapped"}
    assert picks(lb, [mapped], req(priority=4), 3) == [None] * 3


# ---- comparators --------------------------------------------------------------------------------


def test_queue_time_comparator_with_priority_maps() -> None:
    # The Rust suite's scenario: x-priority 4 picks the lower priority-4 estimate; no header
    # means priority 0.
    a = snap(
        "a", last_mean_input_tps=1_000.0, queue_time_estimate_ms_by_priority=((0, 10), (4, 50))
    )
    b = snap(
        "b", last_mean_input_tps=1_000.0, queue_time_estimate_ms_by_priority=((0, 30), (4, 20))
    )
    lb = balancer(comparator="queue-time", ttft_bucket_size_ms=1000)
    assert set(picks(lb, [a, b], req(priority=4))) == {"b"}
    assert set(picks(lb, [a, b], req())) == {"a"}
    assert set(picks(lb, [a, b], req(priority=3))) == {"a"}  # nearest key <= 3 is 0


@pytest.mark.parametrize(
    ("comparator", "winner"),
    [("utilization", "cool"), ("num-requests-queued", "cool"), ("ttft", "hot")],
)
def test_comparator_is_configurable(comparator: str, winner: str) -> None:
    hot = snap(
        "hot",
        last_mean_input_tps=1_000.0,
        max_engine_concurrency=10,
        num_running_queries=8,
        queue_size=5,
    )
    cool = snap(
        "cool",
        rtt_ms=10.0,
        last_mean_input_tps=1_000.0,
        max_engine_concurrency=10,
        num_running_queries=1,
        queue_size=1,
    )
    lb = balancer(comparator=comparator)
    assert set(picks(lb, [hot, cool], req())) == {winner}


def test_n_limits_the_sample_and_zero_means_one() -> None:
    many = [snap(f"c{i}", last_mean_input_tps=1_000.0, queued_input_size=i) for i in range(8)]
    # n = 1: uniform over the unlocked clusters (all within one 20 ms bucket).
    ones = Counter(picks(balancer(n=1), many, req(), 800))
    assert set(ones) == {f"c{i}" for i in range(8)}
    zeros = Counter(picks(balancer(n=0), many, req(), 800))
    assert set(zeros) == set(ones)
    # n >= eligible: always the best.
    assert set(picks(balancer(n=64), many, req())) == {"c0"}


def test_exact_ties_break_at_random() -> None:
    twins = [snap("x", last_mean_input_tps=1_000.0), snap("y", last_mean_input_tps=1_000.0)]
    counts = Counter(picks(balancer(), twins, req(), 400))
    assert 150 < counts["x"] < 250


def test_least_queue_then_utilization() -> None:
    a = snap("a", last_mean_input_tps=1_000.0, queued_input_size=10)
    b = snap("b", last_mean_input_tps=1_000.0, queued_input_size=20)
    assert least_queue_then_utilization([b, a], req()).cluster_id == "a"
    busy = snap("busy", max_engine_concurrency=10, num_running_queries=5)
    calm = snap("calm", max_engine_concurrency=100, num_running_queries=10)
    assert least_queue_then_utilization([busy, calm], req()).cluster_id == "calm"
    # Without a published concurrency on either side, raw running counts compare.
    raw = snap("raw", num_running_queries=7)
    assert least_queue_then_utilization([calm, raw], req()).cluster_id == "raw"
    assert least_queue_then_utilization([raw, calm], req()).cluster_id == "raw"
    # Exact ties keep the first.
    assert least_queue_then_utilization([busy, busy], req()) is busy


def test_exclusions() -> None:
    lb = balancer()
    assert set(picks(lb, [FAST, SLOW], req(1000), excluded=frozenset({"fast"}))) == {"slow"}
    assert picks(lb, [FAST, SLOW], req(1000), 2, frozenset({"fast", "slow"})) == [None, None]
    assert lb.choose([], req(), NO_EXCLUSIONS) is None


def test_reproducible_with_a_seed() -> None:
    many = [snap(f"c{i}", last_mean_input_tps=1_000.0) for i in range(6)]
    first = picks(balancer(seed=9, n=1), many, req(), 30)
    assert picks(balancer(seed=9, n=1), many, req(), 30) == first


# ---- cache affinity -----------------------------------------------------------------------------

EQUALS = [
    snap(f"cluster-{i}", last_mean_input_tps=1_000.0, max_engine_concurrency=8) for i in range(6)
]


def test_affinity_sticks_to_one_cluster_per_key() -> None:
    lb = balancer(selection_count=1)
    sticky = picks(lb, EQUALS, req(key="prefix-1"))
    assert len(set(sticky)) == 1
    # The same on a replica built independently (the ring is a pure function of the inputs).
    assert picks(balancer(seed=2, selection_count=1), EQUALS, req(key="prefix-1")) == sticky
    # Without a key, or with affinity off, requests spread over the clusters.
    assert len(set(picks(lb, EQUALS, req(), 100))) > 1
    assert len(set(picks(balancer(), EQUALS, req(key="prefix-1"), 100))) > 1


def test_affinity_spreads_keys_over_clusters() -> None:
    lb = balancer(selection_count=1)
    homes = Counter(picks(lb, EQUALS, req(key=f"k{i}"), 1)[0] for i in range(600))
    assert set(homes) == {c.cluster_id for c in EQUALS}
    assert min(homes.values()) > 50  # 100 expected each


def test_affinity_falls_back_when_the_home_cluster_is_full() -> None:
    lb = balancer(selection_count=1)
    home = picks(lb, EQUALS, req(key="prefix-1"), 1)[0]
    full = [
        snap(
            c.cluster_id,
            last_mean_input_tps=1_000.0,
            max_engine_concurrency=8,
            num_running_queries=8,
        )
        if c.cluster_id == home
        else c
        for c in EQUALS
    ]
    fallback = picks(lb, full, req(key="prefix-1"), 40)
    assert home not in fallback and None not in fallback
    # Back to the home cluster once it has room.
    assert set(picks(lb, EQUALS, req(key="prefix-1"))) == {home}


def test_affinity_subset_of_several_clusters() -> None:
    lb = balancer(selection_count=2, n=1)
    subset = set(picks(lb, EQUALS, req(key="k"), 100))
    assert len(subset) == 2
    ring_subset = lb.ring.select(EQUALS, req(key="k"), "k", 2, NO_EXCLUSIONS)
    assert {c.cluster_id for c in ring_subset} == subset
    # A count above the cluster count takes them all.
    assert len(lb.ring.select(EQUALS, req(key="k"), "k", 99, NO_EXCLUSIONS)) == len(EQUALS)


def test_affinity_skips_excluded_clusters_on_the_ring() -> None:
    lb = balancer(selection_count=1)
    home = picks(lb, EQUALS, req(key="k"), 1)[0]
    assert home is not None
    second = picks(lb, EQUALS, req(key="k"), 1, frozenset({home}))[0]
    assert second not in (None, home)
    # Stable too: the next clockwise cluster on the ring, not a random one.
    assert picks(lb, EQUALS, req(key="k"), 10, frozenset({home})) == [second] * 10


def test_affinity_ring_is_rebuilt_only_when_the_cluster_list_changes() -> None:
    ring = AffinityRing("s", 10)
    request = req(key="k")
    ring.select(EQUALS, request, "k", 1, NO_EXCLUSIONS)
    assert ring.size == 10 * len(EQUALS)
    ring.select(EQUALS[:3], request, "k", 1, NO_EXCLUSIONS)
    assert ring.size == 30
    assert AffinityRing("s", 0).virtual_nodes == 1
    assert ring.select([], request, "k", 1, NO_EXCLUSIONS) == []
    assert ring.select(EQUALS, request, "k", 0, NO_EXCLUSIONS) == []


def test_affinity_depends_on_seed_routing_key_and_model() -> None:
    def home(lb: WaitAndWiden, request: RoutingRequest) -> str | None:
        return picks(lb, EQUALS, request, 1)[0]

    keys = [f"key-{i}" for i in range(40)]
    base = [home(balancer(selection_count=1), req(key=k)) for k in keys]
    seeded = WaitAndWiden(seed="other", cache_affinity_backend_selection_count=1)
    assert [home(seeded, req(key=k)) for k in keys] != base
    lb = balancer(selection_count=1)
    assert [home(lb, req(key=k, routing_key="tenant-b")) for k in keys] != base
    assert [home(lb, req(key=k, model_id="model-b")) for k in keys] != base


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="unknown comparator"):
        WaitAndWiden(comparator="fastest")
    with pytest.raises(ValueError, match="non-negative"):
        WaitAndWiden(cache_affinity_backend_selection_count=-1)
    with pytest.raises(ValueError, match="non-negative"):
        WidenSettings(n=-1)
    with pytest.raises(ValueError, match="finite"):
        WidenSettings(next_bucket_unlock_factor=float("nan"))
    assert WidenSettings(n=0).sample_count == 1


# ---- properties ---------------------------------------------------------------------------------

cluster_strategy = st.builds(
    lambda i, tps, queued, rtt, limit, running: snap(
        f"c{i}",
        rtt_ms=rtt,
        last_mean_input_tps=tps,
        queued_input_size=queued,
        max_engine_concurrency=limit,
        num_running_queries=running,
    ),
    st.integers(0, 1_000_000),
    st.sampled_from([0.0, 100.0, 1_000.0, 10_000.0, float("nan")]),
    st.integers(0, 5_000),
    st.floats(0.0, 200.0),
    st.integers(0, 4),
    st.integers(0, 6),
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(cluster_strategy, min_size=1, max_size=8, unique_by=lambda c: c.cluster_id),
    st.integers(0, 5_000),
    st.floats(0.0, 5_000.0),
    st.sets(st.integers(0, 7), max_size=3),
    st.text(min_size=1, max_size=8) | st.none(),
)
def test_choice_is_never_excluded_full_or_locked(
    clusters: list[ClusterSnapshot],
    input_tokens: int,
    waited_ms: float,
    excluded_positions: set[int],
    key: str | None,
) -> None:
    excluded = frozenset(clusters[i].cluster_id for i in excluded_positions if i < len(clusters))
    request = req(input_tokens, key=key, slo_ms=2_000, waited_ms=waited_ms)
    slo: dict[str, Any] = {"max_queue_time_floor_ms": 100, "max_queue_time_ceil_ms": 3_000}
    affine = balancer(selection_count=2, **slo).choose(clusters, request, excluded)
    if affine is not None:
        assert affine.cluster.cluster_id not in excluded
        assert not at_capacity(affine.cluster, 0)
    lb = balancer(**slo)
    choice = lb.choose(clusters, request, excluded)
    if choice is None:
        return
    chosen = choice.cluster
    assert chosen.cluster_id not in excluded
    assert not at_capacity(chosen, 0)
    # Within the queue SLO, and its bucket unlocked: its bucket starts within 20 ms below its
    # own TTFT, and unlocking it took (bucket start - fastest) * 0.25 ms of waiting.
    estimates = lb.settings.estimates(
        [c for c in clusters if c.cluster_id not in excluded], request
    )
    assert chosen in [c for _, c in estimates]
    fastest = min(t for t, _ in estimates)
    mine = next(t for t, c in estimates if c is chosen)
    assert mine - fastest <= 20.0 or waited_ms >= (mine - fastest - 20.0) * 0.25 - 1e-6


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0, 10_000.0), min_size=1, max_size=10),
    st.floats(0.0, 100.0),
    st.floats(0.0, 2.0),
    st.floats(0.0, 10_000.0),
    st.floats(0.0, 10_000.0),
)
def test_waiting_longer_never_locks_a_bucket(
    ttfts: list[float], bucket: float, factor: float, waited_a: float, waited_b: float
) -> None:
    estimates = [(t, snap(f"c{i}")) for i, t in enumerate(ttfts)]
    short, long = sorted((waited_a, waited_b))
    fewer = unlocked_clusters(estimates, bucket, factor, short)
    more = unlocked_clusters(estimates, bucket, factor, long)
    assert {c.cluster_id for c in fewer} <= {c.cluster_id for c in more}
    assert fewer  # the fastest bucket is always unlocked
    fastest = min(ttfts)
    for ttft, cluster in estimates:
        if ttft - fastest <= bucket:
            assert cluster in fewer
