"""The load-balancer configuration file and `x-routing-method` resolution.

docs/data-plane.md, "Load balancer config" to "LB instances". The file is JSON, read once at
startup:

    {"default": "power-of-n",
     "request_algorithms": {"round-robin": "round-robin"},
     "models": {"my-model": {"algorithm": "power-of-n", "sample_count": 4,
                             "request_algorithms": {"random": "random"}}}}

Every name in the file is case-sensitive kebab-case (or one of the documented aliases); only the
header parser (`parse_algorithm_header`) lowercases and maps `_` to `-`. All six upstream
algorithms are implemented, each with its own fields (docs/data-plane.md, Algorithm fields): a
field another algorithm owns is a startup error, and so is an explicit `comparator` on
pulsar-wait-and-widen wherever it can be selected (the `default`, a `models` entry, a
`request_algorithms` entry). Entries nested in a `request_algorithms` entry's own
`request_algorithms` are parsed (so their errors still fail startup, as upstream) but never
used.

Parsing is two-phase, like upstream (deserialise, then build the router): every structural
error in the file (unknown field, bad type, bad `sample_count`…) is reported before any
semantic one (`request_algorithms` key mismatch, unimplemented algorithm). Every error message
starts with the dotted path of the offending key, e.g.
`models.my-model.sample_count: power-of-n sample_count must be between 1 and 64, got 0`.

The file is read strictly (`stargate.documents`, shared with the activator's pool file): NaN,
Infinity and duplicate keys are errors, as for upstream's serde_json. The rules and messages stay
here. The LB instances the resolved definitions select live in `stargate.load_balancing.registry`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from os import PathLike
from types import MappingProxyType
from typing import Any, Final, TypeVar, cast

from stargate.documents import (
    StrictJsonError,
    TypeWords,
    is_integer,
    is_number,
    join_path,
    load_json,
    unknown_keys,
)
from stargate.load_balancing.balancers import (
    COMPARATORS,
    DEFAULT_COMPARATOR,
    DEFAULT_SAMPLE_COUNT,
    MAX_SAMPLE_COUNT,
)
from stargate.load_balancing.prefix_aware import DEFAULT_GROUP_BOOST, DEFAULT_OVERFLOW_MS
from stargate.load_balancing.wait_and_widen import (
    DEFAULT_MAX_QUEUED,
    DEFAULT_N,
    DEFAULT_NEXT_BUCKET_UNLOCK_FACTOR,
    DEFAULT_TTFT_BUCKET_SIZE_MS,
    DEFAULT_VIRTUAL_NODES,
)

__all__ = [
    "ALGORITHMS",
    "IMPLEMENTED_ALGORITHMS",
    "POWER_OF_N",
    "PREFIX_AWARE",
    "PULSAR",
    "PULSAR_VARIANTS",
    "PULSAR_WAIT_AND_WIDEN",
    "RANDOM",
    "ROUND_ROBIN",
    "WAIT_AND_WIDEN",
    "WAIT_AND_WIDEN_VARIANTS",
    "AlgorithmSpec",
    "AlgorithmUnavailable",
    "LbConfig",
    "LbConfigError",
    "ModelEntry",
    "UnknownAlgorithm",
    "default_lb_config",
    "lb_config_at_startup",
    "load_lb_config",
    "not_implemented_message",
    "parse_algorithm_header",
    "parse_algorithm_name",
    "parse_lb_config",
    "resolve",
]

POWER_OF_N: Final = "power-of-n"
WAIT_AND_WIDEN: Final = "wait-and-widen"
ROUND_ROBIN: Final = "round-robin"
RANDOM: Final = "random"
PULSAR: Final = "pulsar"
PULSAR_WAIT_AND_WIDEN: Final = "pulsar-wait-and-widen"
PREFIX_AWARE: Final = "prefix-aware"  # ours, beyond the Rust router (docs/prefix-routing.md)

ALGORITHMS: Final = (
    POWER_OF_N,
    WAIT_AND_WIDEN,
    ROUND_ROBIN,
    RANDOM,
    PULSAR,
    PULSAR_WAIT_AND_WIDEN,
    PREFIX_AWARE,
)
IMPLEMENTED_ALGORITHMS: Final = frozenset(ALGORITHMS)
PULSAR_VARIANTS: Final = frozenset({PULSAR, PULSAR_WAIT_AND_WIDEN})
WAIT_AND_WIDEN_VARIANTS: Final = frozenset({WAIT_AND_WIDEN, PULSAR_WAIT_AND_WIDEN})

# Name (exactly as written in the file) -> canonical name.
_NAMES: Final[Mapping[str, str]] = {
    **{name: name for name in ALGORITHMS},
    "power-of-two": POWER_OF_N,
    "powerOf2": POWER_OF_N,
    "powerOfN": POWER_OF_N,
    "powerof2": POWER_OF_N,
    "powerofn": POWER_OF_N,
    "groq-multiregion": WAIT_AND_WIDEN,
    "pulsar-multiregion": PULSAR_WAIT_AND_WIDEN,
}

_TOP_LEVEL_FIELDS: Final = ("default", "request_algorithms", "models")
_U64_MAX: Final = 2**64 - 1


def not_implemented_message(name: str) -> str:
    """The startup error for an algorithm this replica does not implement (none, today)."""
    return f"{name} is not implemented yet; use power-of-n, round-robin or random"


class LbConfigError(ValueError):
    """The load-balancer config is invalid; the message starts with the offending key path."""


class UnknownAlgorithm(ValueError):
    """An `x-routing-method` value that is blank or names no algorithm (HTTP 400)."""

    reason: Final = "unknown"

    def __init__(self, raw: str) -> None:
        super().__init__(
            "x-routing-method is blank" if not raw else f"unknown routing method {raw!r}"
        )
        self.raw = raw


class AlgorithmUnavailable(ValueError):
    """A known `x-routing-method` that the configuration does not allow for the model (400)."""

    reason: Final = "unavailable"

    def __init__(self, algorithm: str, model_id: str) -> None:
        super().__init__(f"routing method {algorithm} is not available for model {model_id!r}")
        self.algorithm = algorithm
        self.model_id = model_id


# ---- names --------------------------------------------------------------------------------------


def parse_algorithm_name(value: str) -> str:
    """The canonical name for a name written in the config file (case-sensitive, aliases
    allowed). Raises ValueError for anything else."""
    canonical = _NAMES.get(value)
    if canonical is None:
        raise ValueError(f"unknown algorithm {value!r}; expected one of {', '.join(ALGORITHMS)}")
    return canonical


_ASCII_LOWER: Final = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ_", "abcdefghijklmnopqrstuvwxyz-")


def parse_algorithm_header(value: str) -> str:
    """The canonical name for an `x-routing-method` value (docs/data-plane.md, Override
    resolution): trimmed, ASCII-lowercased, `_` mapped to `-`, then the file's names and aliases.
    Raises `UnknownAlgorithm` (a ValueError) when blank or unknown; availability is `resolve`'s
    business."""
    raw = value.strip()
    canonical = _NAMES.get(raw.translate(_ASCII_LOWER))
    if canonical is None:
        raise UnknownAlgorithm(raw)
    return canonical


# ---- configuration values -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AlgorithmSpec:
    """One algorithm definition: what a request resolves to, and half of an LB instance key.

    Beyond the common fields, each setting belongs to some algorithms (docs/data-plane.md,
    Algorithm fields): `sample_count` to power-of-n; `comparator` to power-of-n and
    wait-and-widen; `seed` to wait-and-widen and both Pulsar variants; `consider_kv_free_tokens`
    to the Pulsar variants; the rest to wait-and-widen and pulsar-wait-and-widen. Algorithms
    ignore the settings they do not own and the parser leaves those at their defaults, so equal
    definitions compare (and hash) equal. The parser stores effective values: an absent
    `cache_affinity_backend_selection_count` is 0 (affinity off), and `n` and
    `cache_affinity_virtual_nodes` of 0 are stored as 1.
    """

    name: str = POWER_OF_N
    require_cache_affinity_key: bool = False
    require_input_tokens: bool = False  # parsed, no HTTP effect (x-input-tokens is mandatory)
    max_input_work_seconds: float | None = None
    sample_count: int = DEFAULT_SAMPLE_COUNT
    comparator: str = DEFAULT_COMPARATOR
    seed: str = ""
    consider_kv_free_tokens: bool = False
    cache_affinity_virtual_nodes: int = DEFAULT_VIRTUAL_NODES
    cache_affinity_backend_selection_count: int = 0
    max_queue_time_floor_ms: int | None = None
    max_queue_time_ceil_ms: int | None = None
    ttft_bucket_size_ms: int = DEFAULT_TTFT_BUCKET_SIZE_MS
    next_bucket_unlock_factor: float = DEFAULT_NEXT_BUCKET_UNLOCK_FACTOR
    n: int = DEFAULT_N
    max_queued: int = DEFAULT_MAX_QUEUED
    ignore_queue_time: bool = False
    ignore_input_processing_time: bool = False
    group_boost: float = DEFAULT_GROUP_BOOST
    overflow_ms: int = DEFAULT_OVERFLOW_MS
    capacity_weights: bool = True

    def __post_init__(self) -> None:
        if self.name not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.name!r}")
        if self.comparator not in COMPARATORS:
            raise ValueError(f"unknown comparator {self.comparator!r}")
        if isinstance(self.sample_count, bool) or not 1 <= self.sample_count <= MAX_SAMPLE_COUNT:
            raise ValueError(_sample_count_message(self.sample_count))
        if self.max_input_work_seconds is not None and not math.isfinite(
            self.max_input_work_seconds
        ):
            raise ValueError("max_input_work_seconds must be a finite number")
        if not isinstance(self.seed, str):
            raise ValueError("seed must be a string")
        unsigned = [
            "cache_affinity_virtual_nodes",
            "cache_affinity_backend_selection_count",
            "ttft_bucket_size_ms",
            "n",
            "max_queued",
            "overflow_ms",
        ]
        unsigned += [
            name
            for name in ("max_queue_time_floor_ms", "max_queue_time_ceil_ms")
            if getattr(self, name) is not None
        ]
        for name in unsigned:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U64_MAX:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        factor = self.next_bucket_unlock_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise ValueError("next_bucket_unlock_factor must be a number")
        if not math.isfinite(factor):
            raise ValueError("next_bucket_unlock_factor must be a finite number")
        boost = self.group_boost
        if isinstance(boost, bool) or not isinstance(boost, int | float):
            raise ValueError("group_boost must be a number")
        if not (math.isfinite(boost) and boost >= 1):
            raise ValueError(f"group_boost must be a finite number of at least 1, got {boost!r}")

    @property
    def implemented(self) -> bool:
        return self.name in IMPLEMENTED_ALGORITHMS


@dataclass(frozen=True)
class ModelEntry:
    """A `models` entry: the model's algorithm plus the overrides only this model may select."""

    algorithm: AlgorithmSpec
    request_algorithms: Mapping[str, AlgorithmSpec] = field(
        default_factory=lambda: MappingProxyType({})
    )


@dataclass(frozen=True)
class LbConfig:
    """The whole load-balancer configuration (docs/data-plane.md, Load balancer config).

    `permissive` marks the no-file default.
    """

    default: AlgorithmSpec = AlgorithmSpec()
    request_algorithms: Mapping[str, AlgorithmSpec] = field(
        default_factory=lambda: MappingProxyType({})
    )
    models: Mapping[str, ModelEntry] = field(default_factory=lambda: MappingProxyType({}))
    permissive: bool = False

    def configured_names(self) -> frozenset[str]:
        """Every algorithm the file names, in any entry a request can select."""
        specs = [self.default, *self.request_algorithms.values()]
        for entry in self.models.values():
            specs += [entry.algorithm, *entry.request_algorithms.values()]
        return frozenset(spec.name for spec in specs)

    def configured(self, model_id: str) -> AlgorithmSpec:
        """The model's own algorithm: its `models` entry, else the default."""
        entry = self.models.get(model_id)
        return self.default if entry is None else entry.algorithm


def default_lb_config() -> LbConfig:
    """No `--lb-config-path`: power-of-n for every model, and every algorithm (all six)
    selectable by `x-routing-method` with default settings, as upstream."""
    return LbConfig(
        default=AlgorithmSpec(POWER_OF_N),
        request_algorithms=MappingProxyType(
            {name: AlgorithmSpec(name) for name in ALGORITHMS if name in IMPLEMENTED_ALGORITHMS}
        ),
        models=MappingProxyType({}),
        permissive=True,
    )


def resolve(config: LbConfig, model_id: str, header_algorithm: str | None) -> AlgorithmSpec:
    """The algorithm definition for one request (docs/data-plane.md, Override resolution).

    `header_algorithm` is the canonical name from `parse_algorithm_header`, or None when the
    header is absent. The model's configured algorithm C (its `models` entry, else `default`)
    answers an absent header and a header naming C itself (same definition, hence the same LB
    instance). Any other algorithm A comes from the model's own `request_algorithms[A]`, then the
    top-level `request_algorithms[A]`; otherwise `AlgorithmUnavailable`. The top-level `default`
    is not implicitly selectable by a model configured with another algorithm.
    """
    entry = config.models.get(model_id)
    configured = config.default if entry is None else entry.algorithm
    if header_algorithm is None:
        return configured
    if header_algorithm not in ALGORITHMS:
        raise ValueError(
            f"{header_algorithm!r} is not a canonical algorithm name; "
            "parse the header with parse_algorithm_header first"
        )
    if header_algorithm == configured.name:
        return configured
    if entry is not None:
        spec = entry.request_algorithms.get(header_algorithm)
        if spec is not None:
            return spec
    spec = config.request_algorithms.get(header_algorithm)
    if spec is not None:
        return spec
    raise AlgorithmUnavailable(header_algorithm, model_id)


# ---- parsing ------------------------------------------------------------------------------------

_T = TypeVar("_T")


def _sample_count_message(value: object) -> str:
    return f"power-of-n sample_count must be between 1 and {MAX_SAMPLE_COUNT}, got {value}"


def _json_scalar(value: object) -> str:
    return json.dumps(value) if isinstance(value, str | int | float) else repr(value)


_TYPE_WORDS: Final = TypeWords(
    null="null", mapping="an object", sequence="an array", scalar=_json_scalar
)
"""What a message says the file holds, in JSON's words: `got an array`, `got "4"`, `got true`."""

_describe: Final = _TYPE_WORDS.describe


# Field checkers: (value, path) -> normalised value; raise LbConfigError.
_Checker = Callable[[object, str], object]


def _check_bool(value: object, path: str) -> object:
    if value is None or isinstance(value, bool):
        return value
    raise LbConfigError(f"{path}: expected true or false, got {_describe(value)}")


def _check_string(value: object, path: str) -> object:
    if value is None or isinstance(value, str):
        return value
    raise LbConfigError(f"{path}: expected a string, got {_describe(value)}")


def _check_unsigned(value: object, path: str) -> object:
    if value is None:
        return None
    if is_integer(value) and 0 <= value <= _U64_MAX:
        return value
    raise LbConfigError(f"{path}: expected a non-negative integer, got {_describe(value)}")


def _check_number(value: object, path: str) -> object:
    if value is None:
        return None
    if is_number(value) and math.isfinite(value):
        return float(value)
    raise LbConfigError(f"{path}: expected a finite number, got {_describe(value)}")


def _check_group_boost(value: object, path: str) -> object:
    number = _check_number(value, path)
    if number is not None and cast("float", number) < 1:
        raise LbConfigError(f"{path}: group_boost must be at least 1, got {_json_scalar(value)}")
    return number


def _check_comparator(value: object, path: str) -> object:
    if isinstance(value, str) and value in COMPARATORS:
        return value
    raise LbConfigError(
        f"{path}: unknown comparator {_describe(value)}; expected one of {', '.join(COMPARATORS)}"
    )


def _check_sample_count(value: object, path: str) -> object:
    """Type only; the range is checked after every field's type, as upstream does."""
    if not is_integer(value):
        raise LbConfigError(f"{path}: expected an integer, got {_describe(value)}")
    return value


def _check_sample_count_range(value: object, path: str) -> None:
    if not isinstance(value, int) or not 1 <= value <= MAX_SAMPLE_COUNT:
        raise LbConfigError(f"{path}: {_sample_count_message(value)}")


_COMMON_FIELDS: Final[Mapping[str, _Checker]] = {
    "require_cache_affinity_key": _check_bool,
    "require_input_tokens": _check_bool,
    "max_input_work_seconds": _check_number,
    # "request_algorithms" is common too; it is parsed separately.
}

_WAIT_AND_WIDEN_FIELDS: Final[Mapping[str, _Checker]] = {
    "seed": _check_string,
    "comparator": _check_comparator,
    "cache_affinity_virtual_nodes": _check_unsigned,
    "cache_affinity_backend_selection_count": _check_unsigned,
    "max_queue_time_floor_ms": _check_unsigned,
    "max_queue_time_ceil_ms": _check_unsigned,
    "ttft_bucket_size_ms": _check_unsigned,
    "next_bucket_unlock_factor": _check_number,
    "n": _check_unsigned,
    "max_queued": _check_unsigned,
    "ignore_queue_time": _check_bool,
    "ignore_input_processing_time": _check_bool,
}

_ALGORITHM_FIELDS: Final[Mapping[str, Mapping[str, _Checker]]] = {
    POWER_OF_N: {"sample_count": _check_sample_count, "comparator": _check_comparator},
    WAIT_AND_WIDEN: _WAIT_AND_WIDEN_FIELDS,
    ROUND_ROBIN: {},
    RANDOM: {},
    PULSAR: {"seed": _check_string, "consider_kv_free_tokens": _check_bool},
    PULSAR_WAIT_AND_WIDEN: {**_WAIT_AND_WIDEN_FIELDS, "consider_kv_free_tokens": _check_bool},
    PREFIX_AWARE: {
        "seed": _check_string,
        "consider_kv_free_tokens": _check_bool,
        "group_boost": _check_group_boost,
        "overflow_ms": _check_unsigned,
        "capacity_weights": _check_bool,
    },
}


@dataclass
class _Entry:
    """Phase-1 result for one algorithm entry (name or detailed object)."""

    path: str
    spec: AlgorithmSpec
    explicit_comparator: bool = False
    # canonical algorithm -> (raw key, entry), from a detailed object's `request_algorithms`
    request_algorithms: dict[str, tuple[str, _Entry]] = field(default_factory=dict)


def _parse_name_at(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise LbConfigError(f"{path}: expected an algorithm name, got {_describe(value)}")
    try:
        return parse_algorithm_name(value)
    except ValueError as error:
        raise LbConfigError(f"{path}: {error}") from None


def _parse_entry(value: object, path: str) -> _Entry:
    if isinstance(value, str):
        return _Entry(path, AlgorithmSpec(_parse_name_at(value, path)))
    if not isinstance(value, dict):
        raise LbConfigError(
            f"{path}: load-balancer model config must be an algorithm name or detailed config "
            f"object, got {_describe(value)}"
        )
    if "algorithm" not in value:
        raise LbConfigError(f"{join_path(path, 'algorithm')}: missing required field")
    name = _parse_name_at(value["algorithm"], join_path(path, "algorithm"))
    specific = _ALGORITHM_FIELDS[name]
    # Upstream's order: field types and nested entries (deserialisation), then the sample_count
    # range, then unsupported fields.
    settings: dict[str, object] = {}
    for key, checker in (*_COMMON_FIELDS.items(), *specific.items()):
        if key in value:
            settings[key] = checker(value[key], join_path(path, key))
    nested = (
        _parse_request_algorithms(
            value["request_algorithms"], join_path(path, "request_algorithms")
        )
        if "request_algorithms" in value
        else {}
    )
    if "sample_count" in settings:
        _check_sample_count_range(settings["sample_count"], join_path(path, "sample_count"))
    allowed = {*specific, *_COMMON_FIELDS, "algorithm", "request_algorithms"}
    unsupported = sorted(str(key) for key in unknown_keys(value, allowed))
    if unsupported:
        raise LbConfigError(
            f"{path}: {name} config does not support field(s): {', '.join(unsupported)}"
        )
    spec = AlgorithmSpec(
        name,
        require_cache_affinity_key=_setting(settings, "require_cache_affinity_key", False),
        require_input_tokens=_setting(settings, "require_input_tokens", False),
        max_input_work_seconds=cast("float | None", settings.get("max_input_work_seconds")),
        **_specific_settings(name, settings),
    )
    return _Entry(path, spec, explicit_comparator="comparator" in value, request_algorithms=nested)


def _setting(settings: Mapping[str, object], key: str, default: _T) -> _T:
    """A checked field's value; `default` when absent or null (null means unset)."""
    value = settings.get(key)
    return default if value is None else cast("_T", value)


def _specific_settings(name: str, settings: Mapping[str, object]) -> dict[str, Any]:
    """The `AlgorithmSpec` keywords of the fields `name` owns (the others keep their defaults,
    so equal definitions compare equal). A pulsar-wait-and-widen `comparator` is not taken: it
    is refused where the entry can be selected, and ignored where it cannot."""
    out: dict[str, Any] = {}
    if name == POWER_OF_N:
        out["sample_count"] = _setting(settings, "sample_count", DEFAULT_SAMPLE_COUNT)
    if name in (POWER_OF_N, WAIT_AND_WIDEN):
        out["comparator"] = _setting(settings, "comparator", DEFAULT_COMPARATOR)
    if name in (WAIT_AND_WIDEN, *PULSAR_VARIANTS, PREFIX_AWARE):
        out["seed"] = _setting(settings, "seed", "")
    if name in (*PULSAR_VARIANTS, PREFIX_AWARE):
        out["consider_kv_free_tokens"] = _setting(settings, "consider_kv_free_tokens", False)
    if name == PREFIX_AWARE:
        out["group_boost"] = _setting(settings, "group_boost", DEFAULT_GROUP_BOOST)
        out["overflow_ms"] = _setting(settings, "overflow_ms", DEFAULT_OVERFLOW_MS)
        out["capacity_weights"] = _setting(settings, "capacity_weights", True)
    if name in WAIT_AND_WIDEN_VARIANTS:
        # 0 virtual nodes would leave the ring empty and n = 0 would sample nothing: both are 1.
        out["cache_affinity_virtual_nodes"] = max(
            _setting(settings, "cache_affinity_virtual_nodes", DEFAULT_VIRTUAL_NODES), 1
        )
        out["cache_affinity_backend_selection_count"] = _setting(
            settings, "cache_affinity_backend_selection_count", 0
        )
        for key in ("max_queue_time_floor_ms", "max_queue_time_ceil_ms"):
            out[key] = settings.get(key)
        out["ttft_bucket_size_ms"] = _setting(
            settings, "ttft_bucket_size_ms", DEFAULT_TTFT_BUCKET_SIZE_MS
        )
        out["next_bucket_unlock_factor"] = _setting(
            settings, "next_bucket_unlock_factor", DEFAULT_NEXT_BUCKET_UNLOCK_FACTOR
        )
        out["n"] = max(_setting(settings, "n", DEFAULT_N), 1)
        out["max_queued"] = _setting(settings, "max_queued", DEFAULT_MAX_QUEUED)
        out["ignore_queue_time"] = _setting(settings, "ignore_queue_time", False)
        out["ignore_input_processing_time"] = _setting(
            settings, "ignore_input_processing_time", False
        )
    return out


def _parse_request_algorithms(value: object, path: str) -> dict[str, tuple[str, _Entry]]:
    if not isinstance(value, dict):
        raise LbConfigError(f"{path}: expected an object, got {_describe(value)}")
    parsed: dict[str, tuple[str, _Entry]] = {}
    for raw_key, item in value.items():
        key_path = join_path(path, raw_key)
        canonical = _parse_name_at(raw_key, key_path)
        if canonical in parsed:
            first_key = parsed[canonical][0]
            raise LbConfigError(
                f"{key_path}: duplicate entry for {canonical} (also given as {first_key})"
            )
        parsed[canonical] = (raw_key, _parse_entry(item, key_path))
    return parsed


def _check_selectable(entry: _Entry) -> AlgorithmSpec:
    """Phase 2 for an entry that requests can be routed with (upstream's factory checks)."""
    name = entry.spec.name
    if name == PULSAR_WAIT_AND_WIDEN and entry.explicit_comparator:
        raise LbConfigError(f"{entry.path}: comparator is not supported for {name}")
    if name not in IMPLEMENTED_ALGORITHMS:
        raise LbConfigError(f"{entry.path}: {not_implemented_message(name)}")
    return entry.spec


def _selectable_overrides(
    overrides: Mapping[str, tuple[str, _Entry]],
) -> Mapping[str, AlgorithmSpec]:
    """Phase 2 for a usable `request_algorithms` map; nested maps inside it are dropped."""
    result: dict[str, AlgorithmSpec] = {}
    for canonical, (_raw_key, entry) in overrides.items():
        if entry.spec.name != canonical:
            raise LbConfigError(
                f"{entry.path}: request_algorithms key {canonical} does not match configured "
                f"algorithm {entry.spec.name}"
            )
        result[canonical] = _check_selectable(entry)
    return MappingProxyType(result)


def parse_lb_config(data: object) -> LbConfig:
    """Validate a decoded JSON document; raise `LbConfigError` naming the bad key.

    docs/data-plane.md, Load balancer config.
    """
    if not isinstance(data, dict):
        raise LbConfigError(
            f"<root>: load-balancer config must be a JSON object, got {_describe(data)}"
        )
    unknown = unknown_keys(data, _TOP_LEVEL_FIELDS)
    if unknown:
        raise LbConfigError(
            f"{unknown[0]}: unknown top-level field; expected one of {', '.join(_TOP_LEVEL_FIELDS)}"
        )

    # Phase 1: structure, names, field types and ranges, everywhere in the file.
    if "default" in data:
        default_value = data["default"]
        if isinstance(default_value, dict):
            raise LbConfigError(
                "default: must be an algorithm name; the top-level default cannot carry "
                "settings (configure them under models or request_algorithms)"
            )
        default = _Entry("default", AlgorithmSpec(_parse_name_at(default_value, "default")))
    else:
        default = _Entry("default", AlgorithmSpec(POWER_OF_N))
    overrides = _parse_request_algorithms(data.get("request_algorithms", {}), "request_algorithms")
    models_value = data.get("models", {})
    if not isinstance(models_value, dict):
        raise LbConfigError(f"models: expected an object, got {_describe(models_value)}")
    models: dict[str, _Entry] = {}
    for model_id, item in models_value.items():
        if not isinstance(model_id, str):
            raise LbConfigError(f"models: model ids must be strings, got {_describe(model_id)}")
        models[model_id] = _parse_entry(item, join_path("models", model_id))

    # Phase 2: what can be selected must be implemented and consistent.
    default_spec = _check_selectable(default)
    request_algorithms = _selectable_overrides(overrides)
    model_entries: dict[str, ModelEntry] = {}
    for model_id, entry in models.items():
        model_entries[model_id] = ModelEntry(
            algorithm=_check_selectable(entry),
            request_algorithms=_selectable_overrides(entry.request_algorithms),
        )
    return LbConfig(
        default=default_spec,
        request_algorithms=request_algorithms,
        models=MappingProxyType(model_entries),
        permissive=False,
    )


def load_lb_config(path: str | PathLike[str]) -> LbConfig:
    """Read and validate `--lb-config-path`. Errors are `LbConfigError`s prefixed with the file
    name: unreadable file, invalid JSON (NaN/Infinity and duplicate keys included), or any
    `parse_lb_config` error."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise LbConfigError(f"{path}: cannot read load-balancer config: {reason}") from error
    try:
        data = load_json(text)
    except json.JSONDecodeError as error:
        raise LbConfigError(
            f"{path}: invalid JSON at line {error.lineno} column {error.colno}: {error.msg}"
        ) from error
    except StrictJsonError as error:
        raise LbConfigError(f"{path}: invalid JSON: {error}") from error
    try:
        return parse_lb_config(data)
    except LbConfigError as error:
        raise LbConfigError(f"{path}: {error}") from error


def lb_config_at_startup(path: str | PathLike[str] | None) -> LbConfig:
    """The config `stargate serve` routes with: the file at `--lb-config-path`, or the permissive
    default without one. A file that cannot be used fails start-up (`StartupError`), before
    anything binds: routing by a half-understood config would be worse than not starting."""
    if path is None:
        return default_lb_config()
    try:
        return load_lb_config(path)
    except (LbConfigError, OSError) as error:
        # Imported only here: importing `stargate.serving` installs the Hypercorn patches, and
        # this module is also used where nothing serves (the benchmarks).
        from stargate.serving import StartupError

        raise StartupError(f"invalid load balancer config: {error}") from error
