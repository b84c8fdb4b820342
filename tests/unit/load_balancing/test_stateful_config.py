"""The stateful algorithms' config fields, their balancers and input-work admission.

docs/data-plane.md, Algorithm fields and Input-work admission.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest

from stargate.load_balancing.balancers import input_work_rejection
from stargate.load_balancing.config import (
    AlgorithmSpec,
    LbConfigError,
    parse_lb_config,
    resolve,
)
from stargate.load_balancing.pulsar import Pulsar, PulsarWaitAndWiden, pulsar_admission_clusters
from stargate.load_balancing.registry import (
    BalancerRegistry,
    create_balancer,
    input_work_rejection_for,
)
from stargate.load_balancing.wait_and_widen import WaitAndWiden, WidenSettings
from stargate.routing.state import RoutingTargetKey
from tests.unit.load_balancing.support import snap

ROOT = Path(__file__).resolve().parents[3]


def model(entry: object) -> dict[str, Any]:
    return {"models": {"m": entry}}


def parsed(entry: object) -> AlgorithmSpec:
    return parse_lb_config(model(entry)).models["m"].algorithm


def parse_error(data: object) -> str:
    with pytest.raises(LbConfigError) as info:
        parse_lb_config(data)
    return str(info.value)


WAIT_AND_WIDEN_ALL = {
    "algorithm": "wait-and-widen",
    "seed": "fleet-1",
    "comparator": "queue-time",
    "cache_affinity_virtual_nodes": 64,
    "cache_affinity_backend_selection_count": 2,
    "max_queue_time_floor_ms": 100,
    "max_queue_time_ceil_ms": 800,
    "ttft_bucket_size_ms": 50,
    "next_bucket_unlock_factor": 0.5,
    "n": 3,
    "max_queued": 4,
    "ignore_queue_time": True,
    "ignore_input_processing_time": True,
    "require_cache_affinity_key": True,
    "max_input_work_seconds": 2,
}


# ---- parsing ------------------------------------------------------------------------------------


def test_wait_and_widen_every_field() -> None:
    assert parsed(WAIT_AND_WIDEN_ALL) == AlgorithmSpec(
        "wait-and-widen",
        require_cache_affinity_key=True,
        max_input_work_seconds=2.0,
        seed="fleet-1",
        comparator="queue-time",
        cache_affinity_virtual_nodes=64,
        cache_affinity_backend_selection_count=2,
        max_queue_time_floor_ms=100,
        max_queue_time_ceil_ms=800,
        ttft_bucket_size_ms=50,
        next_bucket_unlock_factor=0.5,
        n=3,
        max_queued=4,
        ignore_queue_time=True,
        ignore_input_processing_time=True,
    )


def test_wait_and_widen_defaults() -> None:
    spec = parsed({"algorithm": "groq-multiregion"})
    assert spec == AlgorithmSpec("wait-and-widen") == parsed("wait-and-widen")
    assert (spec.seed, spec.comparator) == ("", "ttft")
    assert (spec.cache_affinity_virtual_nodes, spec.cache_affinity_backend_selection_count) == (
        150,
        0,
    )
    assert (spec.max_queue_time_floor_ms, spec.max_queue_time_ceil_ms) == (None, None)
    assert (spec.ttft_bucket_size_ms, spec.next_bucket_unlock_factor) == (20, 0.25)
    assert (spec.n, spec.max_queued) == (2, 0)
    assert not spec.ignore_queue_time and not spec.ignore_input_processing_time
    assert not spec.consider_kv_free_tokens


def test_nulls_are_unset() -> None:
    entry = {key: None for key in WAIT_AND_WIDEN_ALL if key not in ("algorithm", "comparator")}
    assert parsed({"algorithm": "wait-and-widen", **entry}) == AlgorithmSpec("wait-and-widen")


def test_zero_n_and_zero_virtual_nodes_mean_one() -> None:
    spec = parsed({"algorithm": "wait-and-widen", "n": 0, "cache_affinity_virtual_nodes": 0})
    assert (spec.n, spec.cache_affinity_virtual_nodes) == (1, 1)
    balancer = create_balancer(spec)
    assert isinstance(balancer, WaitAndWiden)
    assert balancer.settings.sample_count == 1 and balancer.ring.virtual_nodes == 1
    # Built directly, the balancer applies the same rule.
    assert WaitAndWiden(cache_affinity_virtual_nodes=0).ring.virtual_nodes == 1


def test_unchecked_ranges() -> None:
    # Not range-checked, as upstream: a negative factor, floor above ceil, a zero bucket.
    spec = parsed(
        {
            "algorithm": "wait-and-widen",
            "next_bucket_unlock_factor": -1,
            "max_queue_time_floor_ms": 900,
            "max_queue_time_ceil_ms": 100,
            "ttft_bucket_size_ms": 0,
            "cache_affinity_backend_selection_count": 0,
        }
    )
    assert spec.next_bucket_unlock_factor == -1.0
    assert isinstance(spec.next_bucket_unlock_factor, float)
    assert (spec.max_queue_time_floor_ms, spec.max_queue_time_ceil_ms) == (900, 100)
    assert spec.ttft_bucket_size_ms == 0 and spec.cache_affinity_backend_selection_count == 0


def test_pulsar_fields() -> None:
    assert parsed({"algorithm": "pulsar", "seed": "s", "consider_kv_free_tokens": True}) == (
        AlgorithmSpec("pulsar", seed="s", consider_kv_free_tokens=True)
    )
    assert parsed("pulsar") == AlgorithmSpec("pulsar")


def test_pulsar_wait_and_widen_fields() -> None:
    entry = {
        **{k: v for k, v in WAIT_AND_WIDEN_ALL.items() if k != "comparator"},
        "algorithm": "pulsar-multiregion",
        "consider_kv_free_tokens": True,
    }
    spec = parsed(entry)
    assert spec.name == "pulsar-wait-and-widen"
    assert spec.consider_kv_free_tokens and spec.seed == "fleet-1"
    assert (spec.max_queue_time_floor_ms, spec.max_queue_time_ceil_ms, spec.n) == (100, 800, 3)
    # Accepted, unused by this algorithm.
    assert spec.cache_affinity_virtual_nodes == 64
    assert spec.comparator == "ttft"  # the default, never used: its preference is fixed


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            model({"algorithm": "pulsar-wait-and-widen", "comparator": "queue-time"}),
            "models.m: comparator is not supported for pulsar-wait-and-widen",
        ),
        (
            {
                "request_algorithms": {
                    "pulsar-multiregion": {
                        "algorithm": "pulsar-multiregion",
                        "comparator": "ttft",
                    }
                }
            },
            "request_algorithms.pulsar-multiregion: comparator is not supported for "
            "pulsar-wait-and-widen",
        ),
        (
            model({"algorithm": "pulsar-wait-and-widen", "comparator": "fastest"}),
            'models.m.comparator: unknown comparator "fastest"; expected one of ttft, '
            "queue-time, input-work-seconds, utilization, num-requests-queued",
        ),
        (
            model({"algorithm": "wait-and-widen", "consider_kv_free_tokens": False}),
            "models.m: wait-and-widen config does not support field(s): consider_kv_free_tokens",
        ),
        (
            model({"algorithm": "power-of-n", "consider_kv_free_tokens": True}),
            "models.m: power-of-n config does not support field(s): consider_kv_free_tokens",
        ),
        (
            model({"algorithm": "random", "consider_kv_free_tokens": True, "n": 1}),
            "models.m: random config does not support field(s): consider_kv_free_tokens, n",
        ),
        (
            model({"algorithm": "pulsar", "n": 2, "ttft_bucket_size_ms": 5, "comparator": "ttft"}),
            "models.m: pulsar config does not support field(s): comparator, n, ttft_bucket_size_ms",
        ),
        (
            model({"algorithm": "wait-and-widen", "sample_count": 2}),
            "models.m: wait-and-widen config does not support field(s): sample_count",
        ),
        (
            model({"algorithm": "pulsar-wait-and-widen", "sample_count": 2}),
            "models.m: pulsar-wait-and-widen config does not support field(s): sample_count",
        ),
        (
            model({"algorithm": "wait-and-widen", "n": 1.5}),
            "models.m.n: expected a non-negative integer, got 1.5",
        ),
        (
            model({"algorithm": "wait-and-widen", "cache_affinity_virtual_nodes": -1}),
            "models.m.cache_affinity_virtual_nodes: expected a non-negative integer, got -1",
        ),
        (
            model({"algorithm": "wait-and-widen", "cache_affinity_backend_selection_count": "2"}),
            "models.m.cache_affinity_backend_selection_count: expected a non-negative integer, "
            'got "2"',
        ),
        (
            model({"algorithm": "pulsar-wait-and-widen", "max_queue_time_floor_ms": True}),
            "models.m.max_queue_time_floor_ms: expected a non-negative integer, got true",
        ),
        (
            model({"algorithm": "wait-and-widen", "max_queue_time_ceil_ms": 2**64}),
            "models.m.max_queue_time_ceil_ms: expected a non-negative integer, "
            "got 18446744073709551616",
        ),
        (
            model({"algorithm": "wait-and-widen", "ttft_bucket_size_ms": []}),
            "models.m.ttft_bucket_size_ms: expected a non-negative integer, got an array",
        ),
        (
            model({"algorithm": "wait-and-widen", "max_queued": -3}),
            "models.m.max_queued: expected a non-negative integer, got -3",
        ),
        (
            model({"algorithm": "wait-and-widen", "next_bucket_unlock_factor": True}),
            "models.m.next_bucket_unlock_factor: expected a finite number, got true",
        ),
        (
            model({"algorithm": "wait-and-widen", "ignore_queue_time": 1}),
            "models.m.ignore_queue_time: expected true or false, got 1",
        ),
        (
            model({"algorithm": "pulsar-wait-and-widen", "ignore_input_processing_time": "no"}),
            'models.m.ignore_input_processing_time: expected true or false, got "no"',
        ),
        (
            model({"algorithm": "pulsar", "seed": ["s"]}),
            "models.m.seed: expected a string, got an array",
        ),
        (
            model({"algorithm": "pulsar-wait-and-widen", "consider_kv_free_tokens": 0}),
            "models.m.consider_kv_free_tokens: expected true or false, got 0",
        ),
        (
            {"default": {"algorithm": "pulsar", "seed": "s"}},
            "default: must be an algorithm name; the top-level default cannot carry settings "
            "(configure them under models or request_algorithms)",
        ),
        (
            {"request_algorithms": {"pulsar": "wait-and-widen"}},
            "request_algorithms.pulsar: request_algorithms key pulsar does not match configured "
            "algorithm wait-and-widen",
        ),
    ],
)
def test_errors(data: object, message: str) -> None:
    assert parse_error(data) == message


def test_the_stateful_algorithms_are_selectable_everywhere() -> None:
    config = parse_lb_config(
        {
            "default": "groq-multiregion",
            "request_algorithms": {
                "pulsar": {"algorithm": "pulsar", "seed": "s"},
                "pulsar-multiregion": "pulsar-wait-and-widen",
            },
            "models": {
                "a": {
                    "algorithm": "pulsar",
                    "consider_kv_free_tokens": True,
                    "request_algorithms": {
                        "wait-and-widen": {"algorithm": "wait-and-widen", "n": 4}
                    },
                }
            },
        }
    )
    assert config.default == AlgorithmSpec("wait-and-widen")
    assert resolve(config, "b", "pulsar") == AlgorithmSpec("pulsar", seed="s")
    assert resolve(config, "b", "pulsar-wait-and-widen") == AlgorithmSpec("pulsar-wait-and-widen")
    assert resolve(config, "a", None) == AlgorithmSpec("pulsar", consider_kv_free_tokens=True)
    assert resolve(config, "a", "wait-and-widen") == AlgorithmSpec("wait-and-widen", n=4)
    assert resolve(config, "a", "pulsar") == AlgorithmSpec("pulsar", consider_kv_free_tokens=True)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "wait-and-widen", "n": -1},
        {"name": "wait-and-widen", "n": True},
        {"name": "wait-and-widen", "max_queue_time_floor_ms": -1},
        {"name": "wait-and-widen", "cache_affinity_virtual_nodes": 2**64},
        {"name": "wait-and-widen", "next_bucket_unlock_factor": float("inf")},
        {"name": "pulsar", "seed": 5},
    ],
)
def test_algorithm_spec_validates_the_new_fields(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AlgorithmSpec(**kwargs)


# ---- balancers from definitions -----------------------------------------------------------------


def test_create_balancer_passes_every_field() -> None:
    spec = parsed(WAIT_AND_WIDEN_ALL)
    balancer = create_balancer(spec)
    assert isinstance(balancer, WaitAndWiden)
    assert (balancer.seed, balancer.comparator) == ("fleet-1", "queue-time")
    assert balancer.cache_affinity_backend_selection_count == 2
    assert balancer.ring.virtual_nodes == 64 and balancer.ring.seed == "fleet-1"
    assert balancer.settings == WidenSettings(
        max_queue_time_floor_ms=100,
        max_queue_time_ceil_ms=800,
        ttft_bucket_size_ms=50,
        next_bucket_unlock_factor=0.5,
        n=3,
        max_queued=4,
        ignore_queue_time=True,
        ignore_input_processing_time=True,
    )
    pulsar = create_balancer(AlgorithmSpec("pulsar", seed="x", consider_kv_free_tokens=True))
    assert isinstance(pulsar, Pulsar)
    assert (pulsar.name, pulsar.seed, pulsar.consider_kv_free_tokens) == ("pulsar", "x", True)
    hybrid = create_balancer(AlgorithmSpec("pulsar-wait-and-widen", seed="y", max_queued=2, n=5))
    assert isinstance(hybrid, PulsarWaitAndWiden)
    assert (hybrid.name, hybrid.seed, hybrid.settings.max_queued, hybrid.settings.n) == (
        "pulsar-wait-and-widen",
        "y",
        2,
        5,
    )
    assert create_balancer(AlgorithmSpec("wait-and-widen")).name == "wait-and-widen"


def test_caches_live_in_the_instance_per_target_and_definition() -> None:
    registry = BalancerRegistry()
    spec = AlgorithmSpec("pulsar", seed="s")
    target = RoutingTargetKey("rk-1", "model-a")
    first = registry.get(target, spec)
    assert registry.get(target, AlgorithmSpec("pulsar", seed="s")) is first
    assert registry.get(target, AlgorithmSpec("pulsar", seed="t")) is not first
    assert registry.get(RoutingTargetKey("rk-2", "model-a"), spec) is not first
    registry.forget(target)
    assert registry.get(target, spec) is not first


# ---- input-work admission -----------------------------------------------------------------------

BUSY_NO_TPS = snap("busy", last_mean_input_tps=0.0, queued_input_size=100_000)
IDLE = snap("idle", last_mean_input_tps=1_000.0)


def test_admission_without_a_limit_always_admits() -> None:
    for name in ("power-of-n", "pulsar", "wait-and-widen"):
        assert input_work_rejection_for(AlgorithmSpec(name), [BUSY_NO_TPS], 10**9) is None


def test_non_pulsar_admission_considers_every_non_excluded_cluster() -> None:
    spec = AlgorithmSpec("wait-and-widen", max_input_work_seconds=1.0)
    # The busy cluster without capacity adds its 100k queued tokens, no capacity: 100 s.
    assert input_work_rejection_for(spec, [BUSY_NO_TPS, IDLE], 0) == "input_work_limit_exceeded"
    assert input_work_rejection_for(spec, [BUSY_NO_TPS, IDLE], 0, frozenset({"busy"})) is None
    assert input_work_rejection_for(spec, [BUSY_NO_TPS], 0) == "input_work_capacity_unavailable"
    assert input_work_rejection_for(spec, [IDLE], 1_000) is None  # 1 s: at the limit
    assert input_work_rejection_for(spec, [IDLE], 1_001) == "input_work_limit_exceeded"
    assert input_work_rejection_for(spec, [BUSY_NO_TPS, IDLE], 0) == input_work_rejection(
        [BUSY_NO_TPS, IDLE], 0, 1.0
    )


@pytest.mark.parametrize("name", ["pulsar", "pulsar-wait-and-widen"])
def test_pulsar_admission_considers_only_what_pulsar_could_choose(name: str) -> None:
    spec = AlgorithmSpec(name, max_input_work_seconds=1.0)
    # The cluster without a valid TPS is never ranked: its queue does not count.
    assert input_work_rejection_for(spec, [BUSY_NO_TPS, IDLE], 0) is None
    assert input_work_rejection_for(spec, [BUSY_NO_TPS], 0) == "input_work_capacity_unavailable"
    assert (
        input_work_rejection_for(spec, [IDLE], 0, frozenset({"idle"}))
        == "input_work_capacity_unavailable"
    )
    # With the KV check, clusters that fail it are not considered either.
    kv = AlgorithmSpec(name, max_input_work_seconds=1.0, consider_kv_free_tokens=True)
    roomy = snap("roomy", last_mean_input_tps=1_000.0, kv_cache_free_tokens=500)
    tight = snap(
        "tight", last_mean_input_tps=1_000_000.0, kv_cache_free_tokens=10, queued_input_size=0
    )
    assert input_work_rejection_for(kv, [roomy, tight], 400) is None  # 0.4 s on roomy
    assert input_work_rejection_for(kv, [IDLE], 400) == "input_work_capacity_unavailable"
    # Without it, the tight cluster's capacity counts.
    assert input_work_rejection_for(spec, [roomy, tight], 400) is None
    assert (
        input_work_rejection_for(spec, [snap("r", last_mean_input_tps=100.0), tight], 10_000)
        is None
    )
    assert (
        input_work_rejection_for(
            kv, [snap("r", last_mean_input_tps=100.0, kv_cache_free_tokens=10**6), tight], 10_000
        )
        == "input_work_limit_exceeded"
    )


def test_pulsar_admission_clusters() -> None:
    roomy = snap("roomy", last_mean_input_tps=1.0, kv_cache_free_tokens=500)
    assert pulsar_admission_clusters([BUSY_NO_TPS, IDLE, roomy], 100, False) == [IDLE, roomy]
    assert pulsar_admission_clusters([BUSY_NO_TPS, IDLE, roomy], 100, True) == [roomy]
    assert pulsar_admission_clusters([IDLE, roomy], 100, False, frozenset({"idle"})) == [roomy]


# ---- purity and the documented example ----------------------------------------------------------

IO_MODULES = {
    "trio",
    "socket",
    "httpx",
    "h11",
    "h2",
    "hypercorn",
    "quart",
    "grpc",
    "asyncio",
    "time",
}


@pytest.mark.parametrize(
    "name",
    ["balancers.py", "hashing.py", "wait_and_widen.py", "pulsar.py", "registry.py", "config.py"],
)
def test_load_balancing_modules_do_no_io(name: str) -> None:
    """As tests/unit/test_layering.py checks for balancers.py: no event loop, socket, HTTP
    library or clock in the new modules either."""
    tree = ast.parse((ROOT / "stargate" / "load_balancing" / name).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
    }
    assert imported & IO_MODULES == set()


def test_the_documented_example_config_parses() -> None:
    text = (ROOT / "docs" / "data-plane.md").read_text()
    match = re.search(r"<!-- lb-config-example -->\s*```json\n(.*?)```", text, re.DOTALL)
    assert match is not None, "docs/data-plane.md lost its example LB config"
    config = parse_lb_config(json.loads(match.group(1)))
    names = {config.default.name} | {e.algorithm.name for e in config.models.values()}
    assert {"wait-and-widen", "pulsar", "pulsar-wait-and-widen"} <= names
    for entry in config.models.values():
        create_balancer(entry.algorithm)
