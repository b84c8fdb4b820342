"""prefix-aware (stargate/load_balancing/prefix_aware.py; docs/prefix-routing.md): the ranking,
the group lean, the load overflow, agreement between instances, and the multi-probe candidates
at a thousand clusters. Fixed seeds and keys: every figure here is reproducible."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from stargate.load_balancing.balancers import RoutingRequest
from stargate.load_balancing.config import AlgorithmSpec, LbConfigError, parse_lb_config
from stargate.load_balancing.prefix_aware import EXACT_LIMIT, PrefixAware, prefix_ranking
from stargate.load_balancing.registry import create_balancer
from stargate.routing.state import (
    BackendSnapshot,
    ClusterGeneration,
    ClusterSnapshot,
    Registration,
    RegistrationIdentity,
)
from stargate.routing.stats import ModelStats
from tests.unit.load_balancing.support import NO_EXCLUSIONS, req, snap

EQUAL = [snap(f"c{i}", last_mean_input_tps=1000.0) for i in range(4)]


def _keys(count: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [f"prefix:{rng.getrandbits(64):016x}" for _ in range(count)]


def _pick(balancer: PrefixAware, clusters: list[ClusterSnapshot], request: RoutingRequest) -> str:
    choice = balancer.choose(clusters, request, NO_EXCLUSIONS)
    assert choice is not None
    return choice.cluster.cluster_id


def test_the_same_request_gets_the_same_cluster_from_any_instance() -> None:
    """No state from the requests routed: a fresh instance, one that routed other traffic and
    one with another seed's twin all agree (the replica-agreement property)."""
    fresh, busy = PrefixAware(seed="s"), PrefixAware(seed="s")
    clusters = [snap(f"c{i}", last_mean_input_tps=500.0 + 100 * i) for i in range(8)]
    for key in _keys(500, seed=1):
        busy.choose(clusters, req(100, key=key), NO_EXCLUSIONS)
    requests = [req(100, key=key) for key in _keys(2000)]
    first = [_pick(fresh, clusters, r) for r in requests]
    assert [_pick(busy, clusters, r) for r in requests] == first
    other_seed = [_pick(PrefixAware(seed="t"), clusters, r) for r in requests]
    assert sum(a != b for a, b in zip(first, other_seed, strict=True)) > 1000  # the seed counts


def test_keys_spread_by_capacity_or_evenly() -> None:
    """By default a cluster 4x slower (a quarter of the TPS) is home to about 1/13 of the keys;
    without capacity_weights every cluster weighs 1, whatever its TPS."""
    clusters = [snap(f"c{i}", last_mean_input_tps=4000.0) for i in range(3)]
    clusters.append(snap("slow", last_mean_input_tps=1000.0))
    keys = _keys(20_000)
    even = Counter(
        _pick(PrefixAware(capacity_weights=False), clusters, req(100, key=k)) for k in keys
    )
    assert all(0.23 < n / 20_000 < 0.27 for n in even.values()) and len(even) == 4
    counts = Counter(_pick(PrefixAware(), clusters, req(100, key=k)) for k in keys)
    assert 0.065 < counts["slow"] / 20_000 < 0.090
    for i in range(3):
        assert 0.29 < counts[f"c{i}"] / 20_000 < 0.33


def test_capacity_weights_hold_still_while_tps_wanders() -> None:
    """Measured TPS wanders; rounded weights do not move a key until a cluster's TPS relative
    to the largest crosses a power-of-two boundary (here: 1000 against 4000, 2x wander)."""
    base = [4000.0, 4000.0, 4000.0, 1000.0]
    keys = _keys(3000)
    balancer = PrefixAware(capacity_weights=True)

    def picks(tps: list[float]) -> list[str]:
        clusters = [snap(f"c{i}", last_mean_input_tps=t) for i, t in enumerate(tps)]
        return [_pick(balancer, clusters, req(100, key=k)) for k in keys]

    before = picks(base)
    assert picks([3100.0, 4000.0, 3500.0, 1300.0]) == before  # every ratio stays in its bucket
    moved = sum(a != b for a, b in zip(before, picks([4000.0] * 4), strict=True))
    assert 0.1 < moved / len(keys) < 0.25  # the slow one recovered: it takes its quarter


def test_without_any_stats_every_cluster_takes_part() -> None:
    clusters = [snap(f"c{i}") for i in range(4)]
    counts = Counter(_pick(PrefixAware(), clusters, req(10, key=k)) for k in _keys(8000))
    assert set(counts) == {"c0", "c1", "c2", "c3"}
    assert max(counts.values()) / min(counts.values()) < 1.15
    # A cluster without a TPS takes part last while others have one (the smallest weight).
    mixed = [snap("measured", last_mean_input_tps=10.0), snap("unmeasured")]
    assert {_pick(PrefixAware(), mixed, req(10, key=k)) for k in _keys(200)} == {"measured"}
    choice = PrefixAware().choose(mixed, req(10, key="prefix:k"), frozenset({"measured"}))
    assert choice is not None and choice.cluster.cluster_id == "unmeasured"
    # Queued work without a TPS is an infinite queue delay: on every cluster, no overflow.
    stuck = [snap(f"c{i}", queued_input_size=100) for i in range(4)]
    request = req(10, key="prefix:k")
    assert (
        _pick(PrefixAware(), stuck, request)
        == stuck[prefix_ranking("", stuck, request)[0]].cluster_id
    )
    # On the home only: the least queued cluster (within overflow_ms) takes it.
    home = prefix_ranking("", clusters, request)[0]
    one_stuck = [
        snap(c.cluster_id, queued_input_size=100 if i == home else 0)
        for i, c in enumerate(clusters)
    ]
    assert _pick(PrefixAware(), one_stuck, request) != clusters[home].cluster_id


def test_the_conversations_of_a_group_lean_to_its_home() -> None:
    """With group_boost 2 among 4 equal clusters the group home weighs 2 of 5: it gets about
    0.4 of the group's conversations (0.25 without a group), and the rest spread."""
    group = 0x1234_5678_9ABC_DEF0
    requests = [replace(req(100, key=k), prefix_group=group) for k in _keys(10_000)]
    counts = Counter(_pick(PrefixAware(), EQUAL, r) for r in requests)
    home, top = counts.most_common(1)[0]
    assert 0.37 < top / 10_000 < 0.43
    assert all(0.17 < n / 10_000 < 0.23 for c, n in counts.items() if c != home)
    flat = Counter(_pick(PrefixAware(group_boost=1.0), EQUAL, r) for r in requests)
    assert max(flat.values()) / 10_000 < 0.28
    # Another group has its own home (over 20 groups, at least 3 distinct homes).
    homes = set()
    for g in range(20):
        tally = Counter(
            _pick(PrefixAware(), EQUAL, replace(req(1, key=k), prefix_group=g))
            for k in _keys(400, seed=g)
        )
        homes.add(tally.most_common(1)[0][0])
    assert len(homes) >= 3


def test_a_loaded_home_keeps_what_its_cache_saves() -> None:
    """The home keeps the request while its extra queue delay is below the prefill its cache
    saves plus overflow_ms; beyond, the next ranked cluster within overflow_ms of the least."""
    request = req(2000, key="prefix:conversation")
    ranking = prefix_ranking("", EQUAL, request)
    home, second = EQUAL[ranking[0]].cluster_id, EQUAL[ranking[1]].cluster_id
    balancer = PrefixAware(overflow_ms=250)  # not the default: round figures below

    def with_queue(delays: dict[str, int]) -> list[ClusterSnapshot]:
        return [
            replace(
                c,
                stats=replace(
                    c.stats, queue_time_estimate_ms_by_priority=((0, delays.get(c.cluster_id, 0)),)
                ),
            )
            for c in EQUAL
        ]

    # 2000 tokens at 1000 TPS: the home's cache saves 2000 ms; with 250 ms, 2250 ms of extra
    # queue are tolerated.
    assert _pick(balancer, with_queue({home: 2250}), request) == home
    choice = balancer.choose(with_queue({home: 2251}), request, NO_EXCLUSIONS)
    assert choice is not None and choice.cluster.cluster_id == second and choice.rank_depth == 2
    # A later cluster is only allowed overflow_ms above the least queued one.
    assert _pick(balancer, with_queue({home: 5000, second: 250}), request) == second
    third = EQUAL[ranking[2]].cluster_id
    assert _pick(balancer, with_queue({home: 5000, second: 251}), request) == third


def test_exclusions_and_kv_room() -> None:
    request = req(100, key="prefix:k")
    ranking = [EQUAL[i].cluster_id for i in prefix_ranking("", EQUAL, request)]
    balancer = PrefixAware()
    choice = balancer.choose(EQUAL, request, frozenset(ranking[:2]))
    assert choice is not None and choice.cluster.cluster_id == ranking[2]
    assert balancer.choose(EQUAL, request, frozenset(ranking)) is None
    assert balancer.choose([], request, NO_EXCLUSIONS) is None
    kv = [
        replace(
            c,
            stats=replace(
                c.stats,
                kv_cache_capacity_tokens=1000,
                kv_cache_free_tokens=50 if c.cluster_id == ranking[0] else 500,
            ),
        )
        for c in EQUAL
    ]
    choice = PrefixAware(consider_kv_free_tokens=True).choose(kv, request, NO_EXCLUSIONS)
    assert choice is not None and choice.cluster.cluster_id == ranking[1]
    assert choice.after_kv_free_tokens_skip and choice.rank_depth == 2
    assert _pick(PrefixAware(), kv, request) == ranking[0]  # the check is opt-in


def test_a_thousand_clusters_use_multi_probe_candidates() -> None:
    """Above EXACT_LIMIT the ranking covers the probes' candidates; a cluster leaving moves only
    the keys it was home to (and few others), and weights still count."""
    clusters = [snap(f"engine-{i:04d}", last_mean_input_tps=1000.0) for i in range(1000)]
    assert len(clusters) > EXACT_LIMIT
    keys = _keys(5000)
    balancer = PrefixAware()  # one instance: its ring is built once per cluster set
    before = {k: _pick(balancer, clusters, req(10, key=k)) for k in keys}
    assert len(set(before.values())) > 950  # spread over the fleet (993 expected if uniform)
    gone = clusters[17].cluster_id
    rest = clusters[:17] + clusters[18:]
    after = {k: _pick(balancer, rest, req(10, key=k)) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert [k for k in keys if before[k] == gone] == [k for k in moved if before[k] == gone]
    assert sum(before[k] != gone for k in moved) <= 50  # 1 %: probes whose next point changed
    heavy = [
        replace(c, stats=replace(c.stats, last_mean_input_tps=8000.0)) if i < 100 else c
        for i, c in enumerate(clusters)
    ]
    even = PrefixAware(capacity_weights=False)
    assert sum(_pick(even, heavy, req(10, key=k)) < "engine-0100" for k in keys) < 0.15 * len(keys)
    counts = Counter(_pick(balancer, heavy, req(10, key=k)) for k in keys)
    heavy_share = sum(n for c, n in counts.items() if int(c.split("-")[1]) < 100) / len(keys)
    assert heavy_share > 0.3  # 10 % of the clusters with 8x the weight: well above 10 %


def test_config_fields_and_errors() -> None:
    entry = {
        "algorithm": "prefix-aware",
        "seed": "fleet",
        "group_boost": 3,
        "overflow_ms": 100,
        "capacity_weights": True,
    }
    spec = parse_lb_config({"models": {"m": entry}}).configured("m")
    assert (spec.name, spec.seed, spec.group_boost, spec.overflow_ms) == (
        "prefix-aware",
        "fleet",
        3.0,
        100,
    )
    balancer = create_balancer(spec)
    assert isinstance(balancer, PrefixAware)
    assert (balancer.seed, balancer.group_boost, balancer.overflow_ms) == ("fleet", 3.0, 100)
    assert balancer.capacity_weights is True and spec.capacity_weights is True
    assert AlgorithmSpec("prefix-aware") == parse_lb_config({"default": "prefix-aware"}).default
    for bad, message in [
        ({"group_boost": 0.5}, "models.m.group_boost: group_boost must be at least 1, got 0.5"),
        ({"group_boost": "2"}, "models.m.group_boost: expected a finite number"),
        ({"overflow_ms": -1}, "models.m.overflow_ms"),
        ({"capacity_weights": 1}, "models.m.capacity_weights"),
        ({"comparator": "ttft"}, "models.m: prefix-aware config does not support field"),
    ]:
        with pytest.raises(
            LbConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")
        ):
            parse_lb_config({"models": {"m": {"algorithm": "prefix-aware", **bad}}})
    with pytest.raises(ValueError, match="group_boost"):
        PrefixAware(group_boost=float("inf"))


def test_configured_names_list_every_selectable_algorithm() -> None:
    """What the replica's start-up warning (prefix-aware without --derive-affinity-key) reads."""
    config = parse_lb_config(
        {
            "default": "power-of-n",
            "request_algorithms": {"random": "random"},
            "models": {
                "m": {"algorithm": "pulsar", "request_algorithms": {"prefix-aware": "prefix-aware"}}
            },
        }
    )
    assert config.configured_names() == {"power-of-n", "random", "pulsar", "prefix-aware"}
    assert parse_lb_config({"default": "round-robin"}).configured_names() == {"round-robin"}


def _with_blocks(
    cluster_id: str, held: dict[str, set[int]], tps: float = 1000.0
) -> ClusterSnapshot:
    """A cluster whose backends (ids and cached blocks in `held`) publish KV blocks."""
    stats = ModelStats(last_mean_input_tps=tps)
    generation = ClusterGeneration(None, cluster_id)
    backends = tuple(
        BackendSnapshot(
            Registration(
                RegistrationIdentity(backend_id, cluster_id, f"http://{backend_id}", None),
                generation,
            ),
            stats,
            0,
            0.0,
            frozenset(blocks),
        )
        for backend_id, blocks in held.items()
    )
    return ClusterSnapshot(cluster_id, stats, 0.0, 0.0, backends)


def test_precise_mode_promotes_the_longest_true_match() -> None:
    """With published blocks, the cluster holding the longest leading run of the request's chain
    becomes the home (the first of the ranking among equals); without any, the ranking rules."""
    chain = (11, 12, 13, 14)
    request = replace(req(1000, key="prefix:conversation"), prefix_chain=chain)
    bare = [_with_blocks(f"c{i}", {f"b{i}": set()}) for i in range(4)]
    ranking = [bare[i].cluster_id for i in prefix_ranking("", bare, request)]
    assert _pick(PrefixAware(), bare, request) == ranking[0]

    def fleet(held: dict[str, set[int]]) -> list[ClusterSnapshot]:
        return [_with_blocks(c, {f"b-{c}": held.get(c, set())}) for c in sorted(ranking)]

    # The third-ranked holds the system prompt's two blocks: it becomes the home.
    choice = PrefixAware().choose(fleet({ranking[2]: {11, 12}}), request, NO_EXCLUSIONS)
    assert choice is not None and choice.cluster.cluster_id == ranking[2]
    # A run counts from the first block: a later block alone is no match.
    assert _pick(PrefixAware(), fleet({ranking[2]: {12, 13, 14}}), request) == ranking[0]
    # The home holding as much as any keeps it; among equals the ranking decides.
    same = {ranking[0]: {11}, ranking[1]: {11}, ranking[3]: {11}}
    assert _pick(PrefixAware(), fleet(same), request) == ranking[0]
    equal = {ranking[1]: {11, 12}, ranking[3]: {11, 12}}
    assert _pick(PrefixAware(), fleet(equal), request) == ranking[1]
    # The longest wins over the ranking.
    longer = {ranking[1]: {11}, ranking[3]: {11, 12, 13}}
    assert _pick(PrefixAware(), fleet(longer), request) == ranking[3]
    # A request without a chain (an explicit key, or no derivation) ignores the blocks.
    plain = req(1000, key="prefix:conversation")
    assert _pick(PrefixAware(), fleet(longer), plain) == ranking[0]


def test_precise_mode_orders_the_backends_of_a_cluster() -> None:
    """Inside one cluster (Pylons sharing a --cluster-id) the backend holding the longest run
    comes first; without blocks the backends follow their own ranking, the same every time."""
    request = replace(req(100, key="prefix:k"), prefix_chain=(1, 2, 3))
    held = {f"engine-{i}": set() for i in range(4)}
    plain = _with_blocks("one", held)
    order = PrefixAware().choose([plain], request, NO_EXCLUSIONS)
    assert order is not None and len(order.backends) == 4
    again = PrefixAware().choose([plain], request, NO_EXCLUSIONS)
    assert again is not None and again.backends == order.backends
    last = order.backends[-1].inference_server_id
    warm = _with_blocks("one", {**held, last: {1, 2}})
    choice = PrefixAware().choose([warm], request, NO_EXCLUSIONS)
    assert choice is not None and choice.backends[0].inference_server_id == last


def test_precise_mode_weighs_the_prefill_left_by_capacity() -> None:
    """A 4x slower cluster holding the request's system prompt (half of its chain) is not worth
    it (half the prefill at a quarter of the speed costs twice the home's whole prefill); holding
    nine tenths of the chain (a conversation's history) it is (0.1 x 4 < 1)."""
    chain = tuple(range(100, 110))
    request = replace(req(1000, key="prefix:conversation"), prefix_chain=chain)
    ids = [f"c{i}" for i in range(4)]
    bare = [_with_blocks(c, {f"b-{c}": set()}) for c in ids]
    ranking = [bare[i].cluster_id for i in prefix_ranking("", bare, request)]
    slow = ranking[3]

    def fleet(held: set[int]) -> list[ClusterSnapshot]:
        return [
            _with_blocks(
                c, {f"b-{c}": held if c == slow else set()}, 250.0 if c == slow else 1000.0
            )
            for c in ids
        ]

    assert _pick(PrefixAware(), fleet(set(chain[:5])), request) == ranking[0]
    assert _pick(PrefixAware(), fleet(set(chain[:9])), request) == slow
    # Without capacity weights the longest run wins whatever the speed.
    assert _pick(PrefixAware(capacity_weights=False), fleet(set(chain[:5])), request) == slow


def test_a_new_snapshot_keeps_the_ring_until_its_clusters_change() -> None:
    """The routing state hands out a new tuple after every heartbeat: equal clusters keep the
    ring; a cluster replaced at the same position is noticed by the first request whose probes
    reach it, after which the choices are a fresh balancer's."""
    clusters = [snap(f"engine-{i:04d}", last_mean_input_tps=1000.0) for i in range(200)]
    balancer = PrefixAware()
    keys = _keys(3000)
    _pick(balancer, tuple(clusters), req(10, key=keys[0]))
    ring = balancer._ring
    _pick(balancer, tuple(list(clusters)), req(10, key=keys[1]))
    assert balancer._ring is ring  # same ids: not rebuilt
    swapped = tuple([*clusters[:5], snap("newcomer", last_mean_input_tps=1000.0), *clusters[6:]])
    seen = [_pick(balancer, swapped, req(10, key=k)) for k in keys]
    assert balancer._ring is not ring and "newcomer" in seen
    fresh = PrefixAware()
    assert seen[-1000:] == [_pick(fresh, swapped, req(10, key=k)) for k in keys[-1000:]]
