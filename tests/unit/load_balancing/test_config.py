"""The LB config file, x-routing-method resolution and LB instance lifetime (docs/data-plane.md)."""

from __future__ import annotations

import json
import random
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest

from stargate.load_balancing.balancers import (
    LoadBalancer,
    PowerOfN,
    RandomChoice,
    RoundRobin,
    RoutingRequest,
)
from stargate.load_balancing.config import (
    ALGORITHMS,
    IMPLEMENTED_ALGORITHMS,
    AlgorithmSpec,
    AlgorithmUnavailable,
    LbConfig,
    LbConfigError,
    UnknownAlgorithm,
    default_lb_config,
    load_lb_config,
    parse_algorithm_header,
    parse_algorithm_name,
    parse_lb_config,
    resolve,
)
from stargate.load_balancing.pulsar import Pulsar, PulsarWaitAndWiden
from stargate.load_balancing.registry import BalancerRegistry, create_balancer
from stargate.load_balancing.wait_and_widen import WaitAndWiden
from stargate.routing import BackendRoute, ModelStats, RegistrationIdentity, RoutingState
from stargate.routing.state import ClusterSnapshot, RoutingTargetKey

ALL_NAMES = (
    "power-of-n, wait-and-widen, round-robin, random, pulsar, pulsar-wait-and-widen, prefix-aware"
)
COMPARATOR_NAMES = "ttft, queue-time, input-work-seconds, utilization, num-requests-queued"


def parse_error(data: object) -> str:
    with pytest.raises(LbConfigError) as info:
        parse_lb_config(data)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def model(entry: object, model_id: str = "m") -> dict[str, Any]:
    return {"models": {model_id: entry}}


# ---- names --------------------------------------------------------------------------------------


def test_algorithm_names_canonical_and_aliases_in_the_file() -> None:
    assert ALGORITHMS == (
        "power-of-n",
        "wait-and-widen",
        "round-robin",
        "random",
        "pulsar",
        "pulsar-wait-and-widen",
        "prefix-aware",
    )
    assert frozenset(ALGORITHMS) == IMPLEMENTED_ALGORITHMS
    for name in ALGORITHMS:
        assert parse_algorithm_name(name) == name
    for alias in ("power-of-two", "powerOf2", "powerOfN", "powerof2", "powerofn"):
        assert parse_algorithm_name(alias) == "power-of-n"
    assert parse_algorithm_name("groq-multiregion") == "wait-and-widen"
    assert parse_algorithm_name("pulsar-multiregion") == "pulsar-wait-and-widen"


@pytest.mark.parametrize(
    "bad", ["round_robin", "Round-Robin", "POWER-OF-N", "powerOfTwo", " random", "", "sticky"]
)
def test_file_names_are_case_sensitive_kebab_case(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown algorithm"):
        parse_algorithm_name(bad)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("round-robin", "round-robin"),
        ("Round_Robin", "round-robin"),
        ("  RANDOM\t", "random"),
        ("POWER_OF_TWO", "power-of-n"),
        ("powerOf2", "power-of-n"),
        ("PowerOfN", "power-of-n"),
        ("power_of_n", "power-of-n"),
        ("pulsar_wait_and_widen", "pulsar-wait-and-widen"),
        ("PULSAR-MULTIREGION", "pulsar-wait-and-widen"),
        ("groq_multiregion", "wait-and-widen"),
        ("Wait-And-Widen", "wait-and-widen"),
        ("pulsar", "pulsar"),
    ],
)
def test_header_names_are_normalised(header: str, expected: str) -> None:
    assert parse_algorithm_header(header) == expected


@pytest.mark.parametrize(
    "bad", ["", "   ", "sticky", "round robin", "round--robin", "ROUND-ROBİN", "power_of_2x"]
)
def test_header_blank_or_unknown(bad: str) -> None:
    with pytest.raises(UnknownAlgorithm) as info:
        parse_algorithm_header(bad)
    assert isinstance(info.value, ValueError)
    assert info.value.reason == "unknown"
    assert info.value.raw == bad.strip()


# ---- values -------------------------------------------------------------------------------------


def test_algorithm_spec_defaults_and_equality() -> None:
    spec = AlgorithmSpec()
    assert (spec.name, spec.sample_count, spec.comparator) == ("power-of-n", 2, "ttft")
    assert not spec.require_cache_affinity_key and not spec.require_input_tokens
    assert spec.max_input_work_seconds is None
    assert AlgorithmSpec("round-robin") == AlgorithmSpec("round-robin")
    assert hash(AlgorithmSpec("random")) == hash(AlgorithmSpec("random"))
    assert AlgorithmSpec("power-of-n", sample_count=3) != AlgorithmSpec("power-of-n")
    assert all(AlgorithmSpec(name).implemented for name in ALGORITHMS)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "round_robin"},
        {"comparator": "fastest"},
        {"sample_count": 0},
        {"sample_count": 65},
        {"sample_count": True},
        {"max_input_work_seconds": float("nan")},
        {"max_input_work_seconds": float("inf")},
    ],
)
def test_algorithm_spec_validates(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AlgorithmSpec(**kwargs)


# ---- permissive default -------------------------------------------------------------------------


def test_permissive_default() -> None:
    config = default_lb_config()
    assert config.permissive
    assert config.default == AlgorithmSpec("power-of-n")
    assert dict(config.models) == {}
    # Upstream's permissive default: all six algorithms, with default settings.
    assert dict(config.request_algorithms) == {name: AlgorithmSpec(name) for name in ALGORITHMS}
    assert resolve(config, "any-model", None) is config.default
    assert resolve(config, "any-model", "power-of-n") is config.default
    for name in ALGORITHMS[1:]:
        assert resolve(config, "any-model", name) == AlgorithmSpec(name)


def test_empty_file_is_power_of_n_and_restrictive() -> None:
    config = parse_lb_config({})
    assert not config.permissive
    assert config.default == AlgorithmSpec("power-of-n")
    assert dict(config.request_algorithms) == {}
    assert dict(config.models) == {}
    assert resolve(config, "m", "power-of-n") == AlgorithmSpec("power-of-n")
    for name in ("round-robin", "random"):  # explicit_config_stays_restrictive
        with pytest.raises(AlgorithmUnavailable):
            resolve(config, "m", name)


# ---- parsing ------------------------------------------------------------------------------------


def test_names_and_aliases_in_every_position() -> None:
    config = parse_lb_config(
        {
            "default": "powerOf2",
            "request_algorithms": {"power-of-two": "powerofn", "round-robin": "round-robin"},
            "models": {"a": "random", "b": {"algorithm": "powerOfN"}},
        }
    )
    assert config.default == AlgorithmSpec("power-of-n")
    assert dict(config.request_algorithms) == {
        "power-of-n": AlgorithmSpec("power-of-n"),
        "round-robin": AlgorithmSpec("round-robin"),
    }
    assert config.models["a"].algorithm == AlgorithmSpec("random")
    assert dict(config.models["a"].request_algorithms) == {}
    assert config.models["b"].algorithm == AlgorithmSpec("power-of-n")
    assert config.configured("a") == AlgorithmSpec("random")
    assert config.configured("unlisted") == config.default


def test_detailed_power_of_n_entry() -> None:
    config = parse_lb_config(
        model(
            {
                "algorithm": "power-of-n",
                "sample_count": 64,
                "comparator": "queue-time",
                "require_cache_affinity_key": True,
                "require_input_tokens": True,
                "max_input_work_seconds": 2.5,
            }
        )
    )
    assert config.models["m"].algorithm == AlgorithmSpec(
        "power-of-n",
        require_cache_affinity_key=True,
        require_input_tokens=True,
        max_input_work_seconds=2.5,
        sample_count=64,
        comparator="queue-time",
    )


@pytest.mark.parametrize("comparator", ["ttft", "queue-time", "input-work-seconds", "utilization"])
def test_every_comparator_parses(comparator: str) -> None:
    spec = parse_lb_config(model({"algorithm": "power-of-n", "comparator": comparator}))
    assert spec.models["m"].algorithm.comparator == comparator


def test_common_fields_on_simple_algorithms() -> None:
    config = parse_lb_config(
        {
            "request_algorithms": {
                "round-robin": {"algorithm": "round-robin", "require_cache_affinity_key": True},
                "random": {"algorithm": "random", "max_input_work_seconds": -1},
            }
        }
    )
    assert config.request_algorithms["round-robin"] == AlgorithmSpec(
        "round-robin", require_cache_affinity_key=True
    )
    # max_input_work_seconds is not range-checked; an integer is a number.
    assert config.request_algorithms["random"].max_input_work_seconds == -1.0


def test_null_means_unset_for_optional_fields() -> None:
    config = parse_lb_config(
        model(
            {
                "algorithm": "random",
                "require_cache_affinity_key": None,
                "require_input_tokens": None,
                "max_input_work_seconds": None,
            }
        )
    )
    assert config.models["m"].algorithm == AlgorithmSpec("random")


def test_nested_entries_parse_their_fields_but_are_never_selectable() -> None:
    # Entries nested in an override entry are parsed and ignored, so they may name anything.
    nested = {
        "wait-and-widen": {
            "algorithm": "groq-multiregion",
            "seed": "s",
            "comparator": "utilization",
            "cache_affinity_virtual_nodes": 0,
            "cache_affinity_backend_selection_count": 2,
            "max_queue_time_floor_ms": 100,
            "max_queue_time_ceil_ms": 200,
            "ttft_bucket_size_ms": 20,
            "next_bucket_unlock_factor": 0.25,
            "n": 2,
            "max_queued": 0,
            "ignore_queue_time": True,
            "ignore_input_processing_time": False,
            "require_cache_affinity_key": True,
        },
        "pulsar": {"algorithm": "pulsar", "seed": "s", "consider_kv_free_tokens": True},
        "pulsar-wait-and-widen": {
            "algorithm": "pulsar-multiregion",
            "seed": None,
            "consider_kv_free_tokens": False,
            "ttft_bucket_size_ms": 5,
            "comparator": "ttft",  # explicit comparator: only an error where selectable
        },
        "random": "round-robin",  # a key mismatch: only an error where selectable
    }
    config = parse_lb_config(
        {"request_algorithms": {"random": {"algorithm": "random", "request_algorithms": nested}}}
    )
    assert dict(config.request_algorithms) == {"random": AlgorithmSpec("random")}
    for name in ("wait-and-widen", "pulsar", "pulsar-wait-and-widen", "round-robin"):
        with pytest.raises(AlgorithmUnavailable):
            resolve(config, "m", name)


# Every error, with its exact message.
ERROR_CASES: list[tuple[object, str]] = [
    ([], "<root>: load-balancer config must be a JSON object, got an array"),
    (
        {"default": "random", "defaults": "random"},
        "defaults: unknown top-level field; expected one of default, request_algorithms, models",
    ),
    (
        {"default": {"algorithm": "random"}},
        "default: must be an algorithm name; the top-level default cannot carry settings "
        "(configure them under models or request_algorithms)",
    ),
    ({"default": "fastest"}, f"default: unknown algorithm 'fastest'; expected one of {ALL_NAMES}"),
    (
        {"default": "Round-Robin"},
        f"default: unknown algorithm 'Round-Robin'; expected one of {ALL_NAMES}",
    ),
    (
        {"default": "round_robin"},
        f"default: unknown algorithm 'round_robin'; expected one of {ALL_NAMES}",
    ),
    ({"default": None}, "default: expected an algorithm name, got null"),
    ({"request_algorithms": []}, "request_algorithms: expected an object, got an array"),
    ({"request_algorithms": None}, "request_algorithms: expected an object, got null"),
    (
        {"request_algorithms": {"fast": "random"}},
        f"request_algorithms.fast: unknown algorithm 'fast'; expected one of {ALL_NAMES}",
    ),
    ({"models": "random"}, 'models: expected an object, got "random"'),
    (
        model(5),
        "models.m: load-balancer model config must be an algorithm name or detailed config "
        "object, got 5",
    ),
    (
        model(["random"]),
        "models.m: load-balancer model config must be an algorithm name or "
        "detailed config object, got an array",
    ),
    (model({"sample_count": 2}), "models.m.algorithm: missing required field"),
    (model({"algorithm": 1}), "models.m.algorithm: expected an algorithm name, got 1"),
    (
        model({"algorithm": "round_robin"}),
        f"models.m.algorithm: unknown algorithm 'round_robin'; expected one of {ALL_NAMES}",
    ),
    (
        model({"algorithm": "random", "sample_count": 4, "comparator": "ttft"}),
        "models.m: random config does not support field(s): comparator, sample_count",
    ),
    (
        model({"algorithm": "round-robin", "seed": "unused"}),
        "models.m: round-robin config does not support field(s): seed",
    ),
    (
        model({"algorithm": "round-robin", "consider_kv_free_tokens": True}),
        "models.m: round-robin config does not support field(s): consider_kv_free_tokens",
    ),
    (
        model({"algorithm": "power-of-n", "seed": "s", "n": 2, "bogus": None}),
        "models.m: power-of-n config does not support field(s): bogus, n, seed",
    ),
    (
        model({"algorithm": "pulsar", "max_queue_time_floor_ms": 100}),
        "models.m: pulsar config does not support field(s): max_queue_time_floor_ms",
    ),
    (
        model({"algorithm": "wait-and-widen", "consider_kv_free_tokens": True}),
        "models.m: wait-and-widen config does not support field(s): consider_kv_free_tokens",
    ),
    (
        model({"algorithm": "power-of-n", "sample_count": 0}, "my-model"),
        "models.my-model.sample_count: power-of-n sample_count must be between 1 and 64, got 0",
    ),
    (
        model({"algorithm": "power-of-n", "sample_count": 65}),
        "models.m.sample_count: power-of-n sample_count must be between 1 and 64, got 65",
    ),
    (
        model({"algorithm": "power-of-n", "sample_count": -1}),
        "models.m.sample_count: power-of-n sample_count must be between 1 and 64, got -1",
    ),
    (
        model({"algorithm": "power-of-n", "sample_count": "4"}),
        'models.m.sample_count: expected an integer, got "4"',
    ),
    (
        model({"algorithm": "power-of-n", "sample_count": 4.0}),
        "models.m.sample_count: expected an integer, got 4.0",
    ),
    (
        model({"algorithm": "power-of-n", "sample_count": True}),
        "models.m.sample_count: expected an integer, got true",
    ),
    (
        model({"algorithm": "power-of-n", "sample_count": None}),
        "models.m.sample_count: expected an integer, got null",
    ),
    (
        model({"algorithm": "power-of-n", "comparator": "fastest"}),
        f'models.m.comparator: unknown comparator "fastest"; expected one of {COMPARATOR_NAMES}',
    ),
    (
        model({"algorithm": "power-of-n", "comparator": None}),
        f"models.m.comparator: unknown comparator null; expected one of {COMPARATOR_NAMES}",
    ),
    (
        model({"algorithm": "power-of-n", "comparator": "queue_time"}),
        f'models.m.comparator: unknown comparator "queue_time"; expected one of {COMPARATOR_NAMES}',
    ),
    (
        model({"algorithm": "random", "require_cache_affinity_key": "yes"}),
        'models.m.require_cache_affinity_key: expected true or false, got "yes"',
    ),
    (
        model({"algorithm": "random", "require_input_tokens": 1}),
        "models.m.require_input_tokens: expected true or false, got 1",
    ),
    (
        model({"algorithm": "random", "max_input_work_seconds": "0.5"}),
        'models.m.max_input_work_seconds: expected a finite number, got "0.5"',
    ),
    (
        model({"algorithm": "random", "max_input_work_seconds": float("inf")}),
        "models.m.max_input_work_seconds: expected a finite number, got Infinity",
    ),
    (
        model({"algorithm": "random", "max_input_work_seconds": False}),
        "models.m.max_input_work_seconds: expected a finite number, got false",
    ),
    (
        model({"algorithm": "random", "request_algorithms": ["random"]}),
        "models.m.request_algorithms: expected an object, got an array",
    ),
    # Structural errors in ignored nested entries still fail startup.
    (
        {
            "request_algorithms": {
                "random": {
                    "algorithm": "random",
                    "request_algorithms": {
                        "wait-and-widen": {"algorithm": "wait-and-widen", "n": -1}
                    },
                }
            }
        },
        "request_algorithms.random.request_algorithms.wait-and-widen.n: expected a non-negative "
        "integer, got -1",
    ),
    (
        {
            "request_algorithms": {
                "random": {"algorithm": "random", "request_algorithms": {"pulsar": {"seed": 1}}}
            }
        },
        "request_algorithms.random.request_algorithms.pulsar.algorithm: missing required field",
    ),
    (
        model({"algorithm": "wait-and-widen", "seed": 7}),
        "models.m.seed: expected a string, got 7",
    ),
    (
        model({"algorithm": "wait-and-widen", "next_bucket_unlock_factor": "x"}),
        'models.m.next_bucket_unlock_factor: expected a finite number, got "x"',
    ),
    (
        model({"algorithm": "pulsar", "consider_kv_free_tokens": "true"}),
        'models.m.consider_kv_free_tokens: expected true or false, got "true"',
    ),
    # Key/value mismatches (canonical names in the message, the raw key in the path).
    (
        {"request_algorithms": {"random": "round-robin"}},
        "request_algorithms.random: request_algorithms key random does not match configured "
        "algorithm round-robin",
    ),
    (
        {"request_algorithms": {"powerOf2": {"algorithm": "random"}}},
        "request_algorithms.powerOf2: request_algorithms key power-of-n does not match "
        "configured algorithm random",
    ),
    (
        model({"algorithm": "random", "request_algorithms": {"round-robin": "power-of-two"}}),
        "models.m.request_algorithms.round-robin: request_algorithms key round-robin does not "
        "match configured algorithm power-of-n",
    ),
    (
        {"request_algorithms": {"power-of-n": "power-of-n", "powerOf2": "power-of-n"}},
        "request_algorithms.powerOf2: duplicate entry for power-of-n (also given as power-of-n)",
    ),
    # An explicit comparator on pulsar-wait-and-widen, wherever it could be selected.
    (
        model({"algorithm": "pulsar-wait-and-widen", "comparator": "ttft"}),
        "models.m: comparator is not supported for pulsar-wait-and-widen",
    ),
    ({"models": {1: "random"}}, "models: model ids must be strings, got 1"),
]


@pytest.mark.parametrize(("data", "message"), ERROR_CASES)
def test_config_errors_name_the_key(data: object, message: str) -> None:
    assert parse_error(data) == message


def test_structural_errors_come_before_semantic_ones() -> None:
    # Upstream deserialises the whole file before building the router.
    message = parse_error(
        {
            "request_algorithms": {"random": "pulsar"},
            "models": {"m": {"algorithm": "power-of-n", "sample_count": 0}},
        }
    )
    assert message.startswith("models.m.sample_count:")


def test_entry_errors_follow_upstream_order() -> None:
    # Field types first, then the sample_count range, then unsupported fields.
    both = {"algorithm": "power-of-n", "sample_count": 0, "seed": "x"}
    assert parse_error(model(both)).startswith("models.m.sample_count: power-of-n sample_count")
    typed = {"algorithm": "power-of-n", "sample_count": 0, "comparator": 3}
    assert parse_error(model(typed)).startswith("models.m.comparator: unknown comparator 3")
    nested = {"algorithm": "power-of-n", "seed": "x", "request_algorithms": {"nope": "random"}}
    assert parse_error(model(nested)).startswith("models.m.request_algorithms.nope: unknown")
    # A field the algorithm does not have is unsupported, whatever its value.
    other = {"algorithm": "random", "sample_count": 0}
    assert parse_error(model(other)) == "models.m: random config does not support field(s): " + (
        "sample_count"
    )


def test_mismatch_is_reported_before_the_comparator_check() -> None:
    message = parse_error(
        {
            "request_algorithms": {
                "random": {"algorithm": "pulsar-wait-and-widen", "comparator": "ttft"}
            }
        }
    )
    assert "does not match configured algorithm pulsar-wait-and-widen" in message


# ---- resolution (docs/data-plane.md, Override resolution) ----------------------------------------

RESOLUTION_CONFIG = {
    "default": "random",
    "request_algorithms": {
        "power-of-n": {"algorithm": "power-of-n", "comparator": "queue-time"},
        "round-robin": {"algorithm": "round-robin", "require_cache_affinity_key": True},
    },
    "models": {
        "model-a": {
            "algorithm": "round-robin",
            "request_algorithms": {
                "power-of-n": {
                    "algorithm": "power-of-n",
                    "comparator": "num-requests-queued",
                    # Nested in an override entry: parsed and ignored.
                    "request_algorithms": {"random": {"algorithm": "random"}},
                }
            },
        },
        "model-c": "power-of-n",
        "model-d": {
            "algorithm": "power-of-n",
            "sample_count": 8,
            "request_algorithms": {"power-of-n": {"algorithm": "power-of-n", "sample_count": 64}},
        },
        "model-e": {"algorithm": "round-robin", "max_input_work_seconds": 1.5},
    },
}

TOP_POWER = AlgorithmSpec("power-of-n", comparator="queue-time")
TOP_ROUND_ROBIN = AlgorithmSpec("round-robin", require_cache_affinity_key=True)
MODEL_A = AlgorithmSpec("round-robin")
MODEL_A_POWER = AlgorithmSpec("power-of-n", comparator="num-requests-queued")
MODEL_D = AlgorithmSpec("power-of-n", sample_count=8)
MODEL_E = AlgorithmSpec("round-robin", max_input_work_seconds=1.5)


@pytest.mark.parametrize(
    ("model_id", "header", "expected"),
    [
        # Model with its own entry.
        ("model-a", None, MODEL_A),
        ("model-a", "round-robin", MODEL_A),  # A == C: the configured definition
        ("model-a", "power-of-n", MODEL_A_POWER),  # the model's own override first
        ("model-a", "random", None),  # the top-level default is not implicitly available
        ("model-a", "pulsar", None),
        # Model without an entry: the default and the top-level overrides.
        ("model-b", None, AlgorithmSpec("random")),
        ("model-b", "random", AlgorithmSpec("random")),
        ("model-b", "power-of-n", TOP_POWER),
        ("model-b", "round-robin", TOP_ROUND_ROBIN),
        ("model-b", "wait-and-widen", None),
        # Model entry given by name only.
        ("model-c", "power-of-n", AlgorithmSpec("power-of-n")),  # not the top-level override
        ("model-c", "round-robin", TOP_ROUND_ROBIN),  # falls back to top-level overrides
        ("model-c", "random", None),
        # The configured algorithm beats the model's same-algorithm override.
        ("model-d", "power-of-n", MODEL_D),
        ("model-d", None, MODEL_D),
        # A model entry without its own overrides falls back to the top-level ones.
        ("model-e", "power-of-n", TOP_POWER),
        ("model-e", "round-robin", MODEL_E),
    ],
)
def test_resolution_table(
    model_id: str, header: str | None, expected: AlgorithmSpec | None
) -> None:
    config = parse_lb_config(RESOLUTION_CONFIG)
    if expected is None:
        assert header is not None
        with pytest.raises(AlgorithmUnavailable) as info:
            resolve(config, model_id, header)
        assert str(info.value) == f"routing method {header} is not available for model '{model_id}'"
    else:
        assert resolve(config, model_id, header) == expected


def test_model_ids_match_exactly() -> None:
    config = parse_lb_config(RESOLUTION_CONFIG)
    assert resolve(config, "Model-A", None) == AlgorithmSpec("random")
    assert resolve(config, "model-a ", None) == AlgorithmSpec("random")


def test_same_algorithm_header_returns_the_configured_object() -> None:
    config = parse_lb_config(RESOLUTION_CONFIG)
    assert resolve(config, "model-a", "round-robin") is config.models["model-a"].algorithm
    assert resolve(config, "model-b", "random") is config.default


def test_nested_request_algorithms_in_override_entries_are_ignored() -> None:
    config = parse_lb_config(RESOLUTION_CONFIG)
    # model-a's power-of-n override lists "random"; that does not make random available.
    with pytest.raises(AlgorithmUnavailable):
        resolve(config, "model-a", "random")
    top_level_nested = parse_lb_config(
        {
            "request_algorithms": {
                "random": {
                    "algorithm": "random",
                    "request_algorithms": {"round-robin": "round-robin"},
                }
            }
        }
    )
    assert resolve(top_level_nested, "m", "random") == AlgorithmSpec("random")
    with pytest.raises(AlgorithmUnavailable):
        resolve(top_level_nested, "m", "round-robin")


def test_requirements_come_from_the_resolved_definition() -> None:
    config = parse_lb_config(RESOLUTION_CONFIG)
    assert not resolve(config, "model-b", None).require_cache_affinity_key
    assert resolve(config, "model-b", "round-robin").require_cache_affinity_key
    assert resolve(config, "model-e", None).max_input_work_seconds == 1.5
    assert resolve(config, "model-e", "power-of-n").max_input_work_seconds is None


def test_resolve_wants_canonical_names() -> None:
    config = default_lb_config()
    with pytest.raises(ValueError, match="not a canonical algorithm name") as info:
        resolve(config, "m", "Round_Robin")
    assert not isinstance(info.value, AlgorithmUnavailable)
    assert resolve(config, "m", parse_algorithm_header("Round_Robin")) == AlgorithmSpec(
        "round-robin"
    )


def test_header_then_resolve_for_the_stateful_algorithms() -> None:
    for header, name in (
        ("PULSAR", "pulsar"),
        ("groq_multiregion", "wait-and-widen"),
        ("pulsar-multiregion", "pulsar-wait-and-widen"),
    ):
        assert resolve(default_lb_config(), "m", parse_algorithm_header(header)) == AlgorithmSpec(
            name
        )
        with pytest.raises(AlgorithmUnavailable):
            resolve(parse_lb_config({}), "m", parse_algorithm_header(header))


# ---- the file -----------------------------------------------------------------------------------


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "lb.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_load_lb_config(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps(RESOLUTION_CONFIG))
    assert load_lb_config(path) == parse_lb_config(RESOLUTION_CONFIG)
    assert load_lb_config(str(path)).default == AlgorithmSpec("random")


def test_load_lb_config_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(LbConfigError, match="cannot read load-balancer config") as info:
        load_lb_config(path)
    assert str(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "invalid JSON at line 1 column 2"),
        ('{"default": "random",}', "invalid JSON at line 1 column"),
        ("", "invalid JSON at line 1 column 1"),
        ('{"models": {"m": {"algorithm": "random", "max_input_work_seconds": NaN}}}', "NaN"),
        (
            '{"models": {"m": {"algorithm": "random", "max_input_work_seconds": Infinity}}}',
            "Infinity",
        ),
        ('{"default": "random", "default": "round-robin"}', "duplicate key 'default'"),
        ('{"models": {"m": "random", "m": "round-robin"}}', "duplicate key 'm'"),
    ],
)
def test_load_lb_config_rejects_invalid_json(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(LbConfigError, match="invalid JSON") as info:
        load_lb_config(path)
    assert message in str(info.value)
    assert str(info.value).startswith(f"{path}: ")


def test_load_lb_config_rejects_non_utf8(tmp_path: Path) -> None:
    with pytest.raises(LbConfigError, match="cannot read"):
        load_lb_config(write(tmp_path, b'{"default": "\xff"}'))


def test_load_lb_config_prefixes_validation_errors_with_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path, '{"models": {"my-model": {"algorithm": "power-of-n", "sample_count": 0}}}'
    )
    with pytest.raises(LbConfigError) as info:
        load_lb_config(path)
    assert str(info.value) == (
        f"{path}: models.my-model.sample_count: power-of-n sample_count must be between 1 and 64, "
        "got 0"
    )


# ---- LB instances (docs/data-plane.md, LB instances) ---------------------------------------------


def candidates(*ids: str) -> list[ClusterSnapshot]:
    return [ClusterSnapshot(i, ModelStats(), 0.0, 0.0, ()) for i in ids]


def rr_picks(
    registry: BalancerRegistry, target: Hashable, spec: AlgorithmSpec, count: int
) -> list[str]:
    out = []
    req = RoutingRequest("m", 0)
    for _ in range(count):
        choice = registry.choose(target, spec, candidates("a", "b", "c"), req, frozenset())
        assert choice is not None
        out.append(choice.cluster.cluster_id)
    return out


def test_create_balancer() -> None:
    power = create_balancer(AlgorithmSpec("power-of-n", sample_count=5, comparator="utilization"))
    assert isinstance(power, PowerOfN)
    assert (power.sample_count, power.comparator) == (5, "utilization")
    assert isinstance(create_balancer(AlgorithmSpec("round-robin")), RoundRobin)
    assert isinstance(create_balancer(AlgorithmSpec("random")), RandomChoice)
    assert isinstance(create_balancer(AlgorithmSpec("wait-and-widen")), WaitAndWiden)
    assert isinstance(create_balancer(AlgorithmSpec("pulsar")), Pulsar)
    assert isinstance(create_balancer(AlgorithmSpec("pulsar-wait-and-widen")), PulsarWaitAndWiden)


def test_create_balancer_with_a_seeded_rng() -> None:
    spec = AlgorithmSpec("random")
    req = RoutingRequest("m", 0)
    many = candidates(*(f"c{i}" for i in range(20)))

    def sequence(balancer: LoadBalancer) -> list[str]:
        out = []
        for _ in range(30):
            choice = balancer.choose(many, req, frozenset())
            assert choice is not None
            out.append(choice.cluster.cluster_id)
        return out

    assert sequence(create_balancer(spec, random.Random(5))) == sequence(
        create_balancer(spec, random.Random(5))
    )


def test_registry_creates_lazily_and_reuses() -> None:
    created: list[AlgorithmSpec] = []

    def factory(spec: AlgorithmSpec) -> LoadBalancer:
        created.append(spec)
        return create_balancer(spec)

    registry = BalancerRegistry(factory)
    target = RoutingTargetKey(None, "m")
    spec = AlgorithmSpec("round-robin")
    assert registry.instance_count() == 0
    first = registry.get(target, spec)
    assert registry.get(target, AlgorithmSpec("round-robin")) is first  # equal definitions share
    assert registry.get(RoutingTargetKey(None, "m"), spec) is first  # equal targets share
    assert created == [spec]
    strict = AlgorithmSpec("round-robin", require_cache_affinity_key=True)
    assert registry.get(target, strict) is not first  # another definition, another instance
    assert registry.instance_count(target) == 2
    assert registry.get(RoutingTargetKey("rk", "m"), spec) is not first  # routing keys isolate
    assert registry.get(RoutingTargetKey(None, "other"), spec) is not first
    assert registry.instance_count() == 4
    assert len(created) == 4


def test_registry_choose_creates_nothing_without_candidates() -> None:
    registry = BalancerRegistry()
    target = RoutingTargetKey(None, "m")
    assert registry.choose(target, AlgorithmSpec(), [], RoutingRequest("m", 0), frozenset()) is None
    assert registry.instance_count() == 0
    assert registry.targets() == []


def test_round_robin_state_is_per_target_and_per_definition() -> None:
    registry = BalancerRegistry()
    spec = AlgorithmSpec("round-robin")
    strict = AlgorithmSpec("round-robin", require_cache_affinity_key=True)
    a, b = RoutingTargetKey(None, "a"), RoutingTargetKey("rk", "a")
    assert rr_picks(registry, a, spec, 2) == ["a", "b"]
    assert rr_picks(registry, b, spec, 1) == ["a"]
    assert rr_picks(registry, a, strict, 1) == ["a"]
    assert rr_picks(registry, a, spec, 2) == ["c", "a"]


def test_override_equal_to_configured_shares_the_configured_instance() -> None:
    config = parse_lb_config({"default": "round-robin", "request_algorithms": {"random": "random"}})
    registry = BalancerRegistry()
    target = RoutingTargetKey(None, "m")
    out = []
    for header in (None, "round-robin", None, parse_algorithm_header("ROUND_ROBIN")):
        out += rr_picks(registry, target, resolve(config, "m", header), 1)
    assert out == ["a", "b", "c", "a"]
    assert registry.instance_count(target) == 1


def test_forget_resets_a_target() -> None:
    registry = BalancerRegistry()
    spec = AlgorithmSpec("round-robin")
    target, other = RoutingTargetKey(None, "m"), RoutingTargetKey(None, "n")
    assert rr_picks(registry, target, spec, 2) == ["a", "b"]
    assert rr_picks(registry, other, spec, 1) == ["a"]
    registry.forget(target)
    assert registry.instance_count(target) == 0
    assert rr_picks(registry, target, spec, 2) == ["a", "b"]  # fresh counter
    assert rr_picks(registry, other, spec, 1) == ["b"]  # untouched
    registry.forget(RoutingTargetKey(None, "never-seen"))  # no-op


def test_registry_follows_routing_state_target_lifetime() -> None:
    """Wired as the runtime would: forget a target when its active backend count drops to 0."""
    registry = BalancerRegistry()
    spec = AlgorithmSpec("round-robin")

    def on_target_count(target: RoutingTargetKey, count: int) -> None:
        if count == 0:
            registry.forget(target)

    state = RoutingState(on_target_count=on_target_count)
    target = RoutingTargetKey(None, "m")
    req = RoutingRequest("m", 0)

    def register(server_id: str) -> Any:
        reg = state.begin(RegistrationIdentity(server_id, server_id, f"http://{server_id}", None))
        state.apply(reg, {"m": BackendRoute(ModelStats(), 1_000_000, 0.0)})
        return reg

    def pick() -> str:
        snapshot = state.snapshot(target)
        assert snapshot is not None
        choice = registry.choose(target, spec, snapshot.clusters, req, frozenset())
        assert choice is not None
        return choice.cluster.cluster_id

    regs = [register("p1"), register("p2")]
    first = [pick() for _ in range(3)]
    assert first[0] != first[1] and first[2] == first[0]
    for reg in regs:
        state.end(reg)
    assert registry.instance_count() == 0
    regs = [register("p1"), register("p2")]
    assert [pick() for _ in range(3)] == first  # a recreated target starts fresh


def test_lb_config_is_immutable() -> None:
    config = default_lb_config()
    with pytest.raises(TypeError):
        config.request_algorithms["pulsar"] = AlgorithmSpec("pulsar")  # type: ignore[index]
    with pytest.raises(AttributeError):
        config.permissive = False  # type: ignore[misc]
    assert isinstance(config, LbConfig)
