"""Pulsar and pulsar-wait-and-widen at the balancer level (docs/data-plane.md, Pulsar)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stargate.load_balancing import pulsar as pulsar_module
from stargate.load_balancing.balancers import RoutingRequest
from stargate.load_balancing.hashing import pulsar_hash, pulsar_prefix, rendezvous_score
from stargate.load_balancing.pulsar import (
    MAX_CACHEABLE_KEY_BYTES,
    RANKING_CACHE_LIMIT,
    Feasibility,
    Pulsar,
    PulsarWaitAndWiden,
    RankingCache,
    feasibility,
    has_kv_metrics,
    pulsar_ranking,
)
from stargate.load_balancing.wait_and_widen import WidenSettings
from stargate.routing.state import ClusterSnapshot
from tests.unit.load_balancing.support import NO_EXCLUSIONS, req, snap

SEED = "seed-1"


def ranked_ids(clusters: Sequence[ClusterSnapshot], request: RoutingRequest) -> list[str]:
    return [clusters[i].cluster_id for i in pulsar_ranking(SEED, clusters, request)]


def pool(count: int, **stats: object) -> list[ClusterSnapshot]:
    base: dict[str, Any] = {"last_mean_input_tps": 1_000.0, **stats}
    return [snap(f"cluster-{i}", **base) for i in range(count)]


def with_stats(
    clusters: Sequence[ClusterSnapshot], cluster_id: str, **stats: object
) -> list[ClusterSnapshot]:
    return [
        replace(c, stats=replace(c.stats, **stats)) if c.cluster_id == cluster_id else c  # type: ignore[arg-type]
        for c in clusters
    ]


def choose_id(
    lb: Pulsar | PulsarWaitAndWiden,
    clusters: Sequence[ClusterSnapshot],
    request: RoutingRequest,
    excluded: frozenset[str] = NO_EXCLUSIONS,
) -> str | None:
    choice = lb.choose(clusters, request, excluded)
    return None if choice is None else choice.cluster.cluster_id


# ---- ranking ------------------------------------------------------------------------------------


def test_golden_vector_cluster_gets_the_documented_score() -> None:
    request = req(key="prefix-123", routing_key="rk-1", model_id="model-a")
    prefix = pulsar_prefix(SEED, "rk-1", "model-a", "prefix-123")
    hash64 = pulsar_hash(prefix, "inst-a")
    assert hash64 == 0x19443C44EC9F8ABF
    u = (float(hash64) + 1.0) / (float(2**64 - 1) + 2.0)
    assert rendezvous_score(250.0, hash64) == 250.0 / -math.log(u)
    clusters = [snap("inst-a", last_mean_input_tps=250.0)]
    assert pulsar_ranking(SEED, clusters, request) == [0]


def test_ranking_is_by_score_then_cluster_id() -> None:
    clusters = pool(12)
    request = req(key="k")
    prefix = pulsar_prefix(SEED, "rk-1", "model-a", "k")
    scores = {
        c.cluster_id: rendezvous_score(1_000.0, pulsar_hash(prefix, c.cluster_id)) for c in clusters
    }
    expected = sorted(scores, key=lambda cid: (-(scores[cid] or 0.0), cid))
    assert ranked_ids(clusters, request) == expected


def test_same_key_always_ranks_the_same_and_across_replicas() -> None:
    clusters = pool(8)
    first, second = Pulsar(seed=SEED), Pulsar(seed=SEED)
    for i in range(200):
        request = req(key=f"prefix-{i}")
        a = [choose_id(first, clusters, request) for _ in range(3)]
        # A second replica (another instance, the candidate list in another order) agrees.
        b = choose_id(second, list(reversed(clusters)), request)
        assert a == [b] * 3


def test_ranking_depends_on_seed_routing_key_model_and_key() -> None:
    clusters = pool(8)
    keys = [f"k{i}" for i in range(30)]

    def primaries(seed: str, **kwargs: object) -> list[str]:
        return [
            clusters[pulsar_ranking(seed, clusters, req(key=k, **kwargs))[0]].cluster_id  # type: ignore[arg-type]
            for k in keys
        ]

    base = primaries(SEED)
    assert primaries("seed-2") != base
    assert primaries(SEED, routing_key="rk-2") != base
    assert primaries(SEED, model_id="model-b") != base
    assert primaries(SEED, routing_key=None) == primaries(SEED, routing_key="")
    assert len(set(base)) > 1


def test_weights_are_proportional_to_input_tps() -> None:
    clusters = [
        snap("small", last_mean_input_tps=1_000.0),
        snap("large", last_mean_input_tps=3_000.0),
    ]
    lb = Pulsar(seed=SEED)
    counts = Counter(choose_id(lb, clusters, req(key=f"key-{i}")) for i in range(8_000))
    assert abs(counts["large"] / 8_000 - 0.75) < 0.02  # sd 0.005
    three = [
        snap("a", last_mean_input_tps=100.0),
        snap("b", last_mean_input_tps=200.0),
        snap("c", last_mean_input_tps=300.0),
    ]
    counts = Counter(choose_id(lb, three, req(key=f"key-{i}")) for i in range(6_000))
    expected = {"a": 1_000, "b": 2_000, "c": 3_000}
    chi2 = sum((counts[k] - e) ** 2 / e for k, e in expected.items())
    assert chi2 < 13.82  # p = 0.001, 2 degrees of freedom


def test_clusters_without_a_valid_tps_never_take_part() -> None:
    for bad in (0.0, -1.0, math.nan, math.inf):
        clusters = [snap("bad", last_mean_input_tps=bad), snap("good", last_mean_input_tps=1.0)]
        assert ranked_ids(clusters, req(key="k")) == ["good"]
        assert {choose_id(Pulsar(), clusters, req(key=f"k{i}")) for i in range(50)} == {"good"}
        assert Pulsar().choose([clusters[0]], req(), NO_EXCLUSIONS) is None
    assert Pulsar().choose([], req(), NO_EXCLUSIONS) is None


def test_weight_changes_move_only_some_keys() -> None:
    clusters = pool(5)
    keys = [f"k{i}" for i in range(500)]
    before = {k: ranked_ids(clusters, req(key=k))[0] for k in keys}
    doubled = with_stats(clusters, "cluster-0", last_mean_input_tps=2_000.0)
    after = {k: ranked_ids(doubled, req(key=k))[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    # Rendezvous hashing: keys only move to the cluster whose weight grew.
    assert moved and all(after[k] == "cluster-0" for k in moved)


# ---- walking the ranking ------------------------------------------------------------------------


def test_primary_has_rank_depth_one() -> None:
    choice = Pulsar(seed=SEED).choose(pool(4), req(key="k"), NO_EXCLUSIONS)
    assert choice is not None
    assert (choice.rank_depth, choice.after_kv_free_tokens_skip) == (1, False)
    assert choice.cluster.cluster_id == ranked_ids(pool(4), req(key="k"))[0]


def test_excluded_clusters_are_walked_past() -> None:
    clusters = pool(4)
    order = ranked_ids(clusters, req(key="k"))
    lb = Pulsar(seed=SEED)
    choice = lb.choose(clusters, req(key="k"), frozenset(order[:2]))
    assert choice is not None
    assert (choice.cluster.cluster_id, choice.rank_depth) == (order[2], 3)
    assert not choice.after_kv_free_tokens_skip
    assert lb.choose(clusters, req(key="k"), frozenset(order)) is None


def test_kv_free_tokens_skip() -> None:
    clusters = pool(4, kv_cache_capacity_tokens=1024, kv_cache_free_tokens=1024)
    order = ranked_ids(clusters, req(key="k"))
    tight = with_stats(clusters, order[0], kv_cache_free_tokens=50, kv_cache_used_tokens=974)
    lb = Pulsar(seed=SEED, consider_kv_free_tokens=True)
    choice = lb.choose(tight, req(100, key="k"), NO_EXCLUSIONS)
    assert choice is not None
    assert (choice.cluster.cluster_id, choice.rank_depth) == (order[1], 2)
    assert choice.after_kv_free_tokens_skip
    # Exactly enough free tokens is enough.
    choice = lb.choose(tight, req(50, key="k"), NO_EXCLUSIONS)
    assert choice is not None and (choice.rank_depth, choice.after_kv_free_tokens_skip) == (
        1,
        False,
    )
    # Without consider_kv_free_tokens the KV metrics are not looked at.
    choice = Pulsar(seed=SEED).choose(tight, req(100, key="k"), NO_EXCLUSIONS)
    assert choice is not None and choice.rank_depth == 1
    # An exclusion before a KV skip: the flag is about KV skips only.
    choice = lb.choose(clusters, req(100, key="k"), frozenset({order[0]}))
    assert choice is not None and (choice.rank_depth, choice.after_kv_free_tokens_skip) == (
        2,
        False,
    )
    choice = lb.choose(tight, req(100, key="k"), frozenset({order[1]}))
    assert choice is not None
    assert (choice.cluster.cluster_id, choice.rank_depth) == (order[2], 3)
    assert choice.after_kv_free_tokens_skip


def test_clusters_without_kv_metrics_are_skipped_when_considered() -> None:
    clusters = pool(3)  # no KV metrics at all
    lb = Pulsar(seed=SEED, consider_kv_free_tokens=True)
    assert lb.choose(clusters, req(0, key="k"), NO_EXCLUSIONS) is None
    order = ranked_ids(clusters, req(key="k"))
    one = with_stats(clusters, order[2], kv_cache_used_tokens=1)  # publishes metrics, 0 free
    choice = lb.choose(one, req(0, key="k"), NO_EXCLUSIONS)
    assert choice is not None
    assert (choice.cluster.cluster_id, choice.rank_depth) == (order[2], 3)
    assert choice.after_kv_free_tokens_skip


def test_feasibility_rules() -> None:
    assert not has_kv_metrics(snap("a").stats)
    for field in ("kv_cache_capacity_tokens", "kv_cache_used_tokens", "kv_cache_free_tokens"):
        assert has_kv_metrics(snap("a", **{field: 1}).stats)
    plain = snap("a")
    assert feasibility(plain, 10, {"a"}, True) is Feasibility.EXCLUDED
    assert feasibility(plain, 10, set(), False) is Feasibility.ELIGIBLE
    assert feasibility(plain, 10, set(), True) is Feasibility.NO_KV_METRICS
    low = snap("a", kv_cache_free_tokens=9)
    assert feasibility(low, 10, set(), True) is Feasibility.INSUFFICIENT_KV_FREE_TOKENS
    assert feasibility(low, 9, set(), True) is Feasibility.ELIGIBLE
    assert Feasibility.NO_KV_METRICS.kv_skip and not Feasibility.EXCLUDED.kv_skip


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.text(min_size=1, max_size=6), st.floats(0.001, 1e6)),
        min_size=1,
        max_size=10,
        unique_by=lambda item: item[0],
    ),
    st.text(max_size=20) | st.none(),
    st.randoms(use_true_random=False),
)
def test_ranking_ignores_the_candidate_order(
    items: list[tuple[str, float]], key: str | None, rng: random.Random
) -> None:
    clusters = [snap(cid, last_mean_input_tps=tps) for cid, tps in items]
    shuffled = clusters[:]
    rng.shuffle(shuffled)
    request = req(key=key)
    assert ranked_ids(clusters, request) == ranked_ids(shuffled, request)
    assert sorted(ranked_ids(clusters, request)) == sorted(cid for cid, _ in items)


# ---- the ranking cache --------------------------------------------------------------------------


def test_rankings_are_cached_per_key() -> None:
    lb = Pulsar(seed=SEED)
    clusters = pool(4)
    for _ in range(5):
        lb.choose(clusters, req(key="a"), NO_EXCLUSIONS)
        lb.choose(clusters, req(key="b"), frozenset({"cluster-0"}))
    assert lb.rankings.computed == 2 and len(lb.rankings) == 2
    assert "a" in lb.rankings and "b" in lb.rankings
    lb.choose(clusters, req(), NO_EXCLUSIONS)  # no key: the empty key
    assert "" in lb.rankings


def test_cache_is_invalidated_when_a_tps_changes() -> None:
    lb = Pulsar(seed=SEED)
    clusters = pool(4)
    keys = [f"k{i}" for i in range(300)]
    for k in keys:
        lb.choose(clusters, req(key=k), NO_EXCLUSIONS)
    assert lb.rankings.computed == 300
    grown = with_stats(clusters, "cluster-2", last_mean_input_tps=50_000.0)
    picks = [choose_id(lb, grown, req(key=k)) for k in keys]
    assert lb.rankings.computed == 600 and len(lb.rankings) == 300
    assert picks == [ranked_ids(grown, req(key=k))[0] for k in keys]
    assert Counter(picks)["cluster-2"] > 200  # 50/53 of the keys
    # Other stats (load, KV) are not part of the ranking: the cache stays.
    loaded = with_stats(grown, "cluster-2", queued_input_size=10_000, num_running_queries=9)
    lb.choose(loaded, req(key="k0"), NO_EXCLUSIONS)
    assert lb.rankings.computed == 600
    # Invalid TPS values rank alike (not at all): changing one for another keeps the cache.
    dead = with_stats(loaded, "cluster-1", last_mean_input_tps=0.0)
    lb.choose(dead, req(key="k0"), NO_EXCLUSIONS)
    assert lb.rankings.computed == 601
    lb.choose(
        with_stats(dead, "cluster-1", last_mean_input_tps=math.nan), req(key="k0"), NO_EXCLUSIONS
    )
    assert lb.rankings.computed == 601


def test_cache_is_invalidated_when_the_cluster_set_changes() -> None:
    lb = Pulsar(seed=SEED)
    clusters = pool(4)
    lb.choose(clusters, req(key="k"), NO_EXCLUSIONS)
    more = [*clusters, snap("cluster-new", last_mean_input_tps=1e9)]
    choice = lb.choose(more, req(key="k"), NO_EXCLUSIONS)
    assert choice is not None and choice.cluster.cluster_id == ranked_ids(more, req(key="k"))[0]
    assert lb.rankings.computed == 2 and len(lb.rankings) == 1
    lb.choose(clusters[:3], req(key="k"), NO_EXCLUSIONS)
    assert lb.rankings.computed == 3
    lb.choose(clusters[:3], req(key="k", routing_key="rk-other"), NO_EXCLUSIONS)
    assert lb.rankings.computed == 4


def test_long_keys_are_not_cached() -> None:
    lb = Pulsar(seed=SEED)
    clusters = pool(3)
    longest = "x" * MAX_CACHEABLE_KEY_BYTES
    too_long = "é" * (MAX_CACHEABLE_KEY_BYTES // 2 + 1)  # 258 UTF-8 bytes, 129 characters
    for key in (longest, too_long, too_long):
        lb.choose(clusters, req(key=key), NO_EXCLUSIONS)
    assert longest in lb.rankings and too_long not in lb.rankings
    assert lb.rankings.computed == 3
    choice = lb.choose(clusters, req(key=too_long), NO_EXCLUSIONS)
    assert (
        choice is not None
        and choice.cluster.cluster_id == ranked_ids(clusters, req(key=too_long))[0]
    )


def test_full_cache_admits_a_key_on_its_second_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pulsar_module, "RANKING_CACHE_LIMIT", 4)
    monkeypatch.setattr(pulsar_module, "PROBATION_LIMIT", 2)
    cache = RankingCache()
    clusters = pool(3)

    def rank(key: str) -> None:
        assert list(cache.ranking(SEED, clusters, req(key=key))) == pulsar_ranking(
            SEED, clusters, req(key=key)
        )

    for key in "abcd":
        rank(key)
    assert len(cache) == 4
    rank("e")  # full: on probation, not stored
    assert "e" not in cache and cache.on_probation("e")
    rank("a")  # a hit, not a miss
    assert cache.computed == 5
    rank("e")  # second miss: stored, the oldest ("a", FIFO even though just hit) evicted
    assert "e" in cache and "a" not in cache and not cache.on_probation("e")
    assert len(cache) == 4
    for key in ("f", "g", "h"):  # probation holds the 2 newest
        rank(key)
    assert not cache.on_probation("f") and cache.on_probation("g") and cache.on_probation("h")
    assert RANKING_CACHE_LIMIT == 4096  # the module constant, for the docs


def test_real_cache_limit() -> None:
    lb = Pulsar(seed=SEED)
    clusters = pool(2)
    for i in range(RANKING_CACHE_LIMIT + 10):
        lb.choose(clusters, req(key=f"k{i}"), NO_EXCLUSIONS)
    assert len(lb.rankings) == RANKING_CACHE_LIMIT
    assert lb.rankings.on_probation(f"k{RANKING_CACHE_LIMIT}")


# ---- pulsar-wait-and-widen ----------------------------------------------------------------------

SLO: dict[str, Any] = {"max_queue_time_floor_ms": 100, "max_queue_time_ceil_ms": 100}


def pww(seed: int = 1, consider_kv: bool = False, **widen: object) -> PulsarWaitAndWiden:
    return PulsarWaitAndWiden(
        seed=SEED,
        consider_kv_free_tokens=consider_kv,
        settings=WidenSettings(**widen),  # type: ignore[arg-type]
        rng=random.Random(seed),
    )


def test_without_a_queue_slo_a_feasible_primary_wins_whatever_its_load() -> None:
    clusters = pool(3, max_engine_concurrency=1)
    order = ranked_ids(clusters, req(key="k"))
    full = with_stats(clusters, order[0], num_running_queries=5, queued_input_size=100_000)
    choice = pww(n=2).choose(full, req(key="k"), NO_EXCLUSIONS)
    assert choice is not None
    assert (choice.cluster.cluster_id, choice.rank_depth) == (order[0], 1)


def test_with_a_queue_slo_the_primary_must_qualify() -> None:
    clusters = pool(5, rtt_ms=100.0)
    order = ranked_ids(clusters, req(key="k"))
    lb = pww(n=2, ttft_bucket_size_ms=100, **SLO)
    choice = lb.choose(clusters, req(key="k"), NO_EXCLUSIONS)
    assert choice is not None and (choice.cluster.cluster_id, choice.rank_depth) == (order[0], 1)
    # Primary over the SLO (200 ms of queue): the next band [2, 3], least queue first.
    slow = with_stats(clusters, order[0], queued_input_size=200)
    slow = with_stats(slow, order[1], queued_input_size=5)
    choice = lb.choose(slow, req(key="k"), NO_EXCLUSIONS)
    assert choice is not None and (choice.cluster.cluster_id, choice.rank_depth) == (order[2], 3)
    assert not choice.after_kv_free_tokens_skip


@pytest.mark.parametrize("first_ok", [0, 1, 2, 3, 6, 7, 14])
def test_bands_widen_1_2_4_8(first_ok: int) -> None:
    """Ranks [1], [2-3], [4-7], [8-15]: the band holding the first cluster within the SLO wins,
    and inside it the least queue delay, even when a later band has a lower one."""
    clusters = pool(15)
    order = ranked_ids(clusters, req(key="k"))
    band_end = next(end for end in (1, 3, 7, 15) if first_ok < end)
    for position, cluster_id in enumerate(order):
        # Queue delays (ms): over the SLO before `first_ok`, else decreasing with the rank.
        queue_ms = 500 if position < first_ok else 90 - position
        clusters = with_stats(clusters, cluster_id, queued_input_size=queue_ms)
    choice = pww(n=16, ttft_bucket_size_ms=1_000, **SLO).choose(
        clusters, req(key="k"), NO_EXCLUSIONS
    )
    assert choice is not None
    assert choice.rank_depth == band_end
    assert choice.cluster.cluster_id == order[band_end - 1]


def test_band_limits() -> None:
    ends: list[int] = []
    clusters = pool(15)
    order = ranked_ids(clusters, req(key="k"))
    for first_ok in range(15):
        staged = clusters
        for position, cluster_id in enumerate(order):
            queue_ms = 500 if position < first_ok else 50
            staged = with_stats(staged, cluster_id, queued_input_size=queue_ms)
        choice = pww(n=16, ttft_bucket_size_ms=1_000, **SLO).choose(
            staged, req(key="k"), NO_EXCLUSIONS
        )
        assert choice is not None
        ends.append(choice.rank_depth)
    # Each band's members tie on queue delay: any of the band's qualifying ranks may win.
    for first_ok, depth in enumerate(ends):
        band = next(b for b in ((1, 1), (2, 3), (4, 7), (8, 15)) if b[0] <= first_ok + 1 <= b[1])
        assert first_ok + 1 <= depth <= band[1]


def test_widen_inside_a_band_waits_and_unlocks() -> None:
    # Band [2, 3]: rank 2 fast but full, rank 3 900 ms slower. The primary is over the SLO.
    clusters = pool(3, max_engine_concurrency=1)
    order = ranked_ids(clusters, req(key="k"))
    staged = with_stats(clusters, order[0], queued_input_size=10_000)
    staged = with_stats(staged, order[1], num_running_queries=1)
    staged = [replace(c, rtt_seconds=0.9) if c.cluster_id == order[2] else c for c in staged]
    lb = pww(max_queue_time_floor_ms=1_000, max_queue_time_ceil_ms=1_000)
    assert lb.choose(staged, req(key="k", waited_ms=0.0), NO_EXCLUSIONS) is None
    choice = lb.choose(staged, req(key="k", waited_ms=225.0), NO_EXCLUSIONS)
    assert choice is not None and (choice.cluster.cluster_id, choice.rank_depth) == (order[2], 3)


def test_pww_kv_skip_and_exclusions() -> None:
    clusters = pool(4, kv_cache_capacity_tokens=1024, kv_cache_free_tokens=1024)
    order = ranked_ids(clusters, req(key="k"))
    tight = with_stats(clusters, order[0], kv_cache_free_tokens=10)
    lb = pww(consider_kv=True, n=2)
    choice = lb.choose(tight, req(100, key="k"), NO_EXCLUSIONS)
    assert choice is not None and choice.rank_depth in (2, 3)
    assert choice.after_kv_free_tokens_skip
    # An excluded primary: the next band, no KV flag.
    choice = lb.choose(clusters, req(100, key="k"), frozenset({order[0]}))
    assert choice is not None and choice.rank_depth in (2, 3)
    assert not choice.after_kv_free_tokens_skip
    assert lb.choose(clusters, req(100, key="k"), frozenset(order)) is None
    assert lb.choose([], req(), NO_EXCLUSIONS) is None
    assert lb.choose(pool(2, last_mean_input_tps=0.0), req(), NO_EXCLUSIONS) is None


def test_pww_ties_on_queue_go_to_the_least_used() -> None:
    clusters = pool(3, max_engine_concurrency=10)
    order = ranked_ids(clusters, req(key="k"))
    staged = with_stats(clusters, order[0], queued_input_size=10_000)
    staged = with_stats(staged, order[1], num_running_queries=6)
    staged = with_stats(staged, order[2], num_running_queries=2)
    lb = pww(n=2, **SLO)
    for _ in range(20):
        choice = lb.choose(staged, req(key="k"), NO_EXCLUSIONS)
        assert choice is not None and choice.cluster.cluster_id == order[2]


def test_pww_same_key_same_cluster_across_replicas() -> None:
    clusters = pool(6)
    for i in range(100):
        request = req(key=f"k{i}")
        a = choose_id(pww(seed=1), clusters, request)
        b = choose_id(pww(seed=2), list(reversed(clusters)), request)
        assert a == b == choose_id(Pulsar(seed=SEED), clusters, request)
