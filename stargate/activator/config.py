"""The activator's pool file (`--pool-config`, docs/decisions.md, D7): which models share a slot
and which member controller swaps them.

The file is YAML, read once at startup:

    pools:
      - name: gpu0
        members: [model-a, model-b]
        swapBudget: 90s            # optional, default 300s (the CRD default)
        activation: wait           # optional: wait | Wait | ifIdle | IfIdle, default wait
        holdBudget: 60s            # optional, default: the swap budget
        maxHeld: 1000              # optional, > 0
        breakerFailures: 3         # optional, >= 0 (0: off), default --pool-breaker-failures
        breakerCooldown: 30s       # optional, > 0, default --pool-breaker-cooldown-ms
        controller:
          kind: process            # process | kubernetes | fake
          members:
            model-a: {command: [stargate, mock-backend, --port, "{port}"], healthPath: /health}

Why a strict parser: a pool file is the one place where a typo silently changes behaviour (a
misspelt `holdBudget` would quietly fall back to the swap budget; a member missing from the
controller would only fail at the first swap, under load). So every unknown key, wrong type or
cross-reference error fails startup, and every message starts with the key path that is wrong, e.g.
`pools[0] (gpu0).swapBudget: invalid duration 'ninety'`. Duplicate YAML keys are errors too, since
PyYAML would otherwise keep the last one without a word. The strict loading and the checks the
load-balancer config shares live in `stargate.documents`; the rules and messages stay here.

Durations are Go-style strings (`90s`, `1h30m`, `500ms`) as in LLMKube's CRDs, or bare numbers of
seconds. Unlike the Go wire config nothing here is in nanoseconds. A swap or hold budget of 0 means
"use the fallbacks" (docs/activator.md, Budgets); negative durations are rejected rather than
silently meaning the same thing. An explicit `null` for an optional key means "not set".
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from os import PathLike
from types import MappingProxyType
from typing import Any, Final, Literal, TypeAlias, cast, get_args

import yaml

from stargate.activator.pool import PoolSpec
from stargate.activator.state import Mode
from stargate.documents import TypeWords, is_integer, is_number, load_yaml, unknown_keys

__all__ = [
    "DEFAULT_HEALTH_PATH",
    "DEFAULT_SWAP_BUDGET",
    "SCALE_SUBRESOURCE_KINDS",
    "ControllerKind",
    "ControllerSpec",
    "KubernetesMember",
    "MemberSpec",
    "PoolConfig",
    "PoolConfigError",
    "PoolsConfig",
    "ProcessMember",
    "load_pool_config",
    "parse_duration",
    "parse_pool_config",
]

ControllerKind: TypeAlias = Literal["process", "kubernetes", "fake"]

DEFAULT_SWAP_BUDGET: Final = 300.0
"""The CRD default for `swapBudget` (docs/activator.md, Budgets), used when the key is absent."""

DEFAULT_HEALTH_PATH: Final = "/health"

SCALE_SUBRESOURCE_KINDS: Final = frozenset({"Deployment", "StatefulSet"})
"""Kinds scaled through `/scale`; every other kind is a custom resource patched on
`spec.replicas` (an LLMKube InferenceService has no scale subresource)."""

_PORT_PLACEHOLDER: Final = "{port}"
_CONTROLLER_KINDS: Final[tuple[str, ...]] = get_args(ControllerKind)
_ACTIVATION: Final[Mapping[str, Mode]] = {
    "wait": "wait",
    "Wait": "wait",
    "ifIdle": "if_idle",
    "IfIdle": "if_idle",
}

_TOP_KEYS: Final = ("pools",)
_POOL_KEYS: Final = (
    "name",
    "members",
    "swapBudget",
    "activation",
    "holdBudget",
    "maxHeld",
    "breakerFailures",
    "breakerCooldown",
    "controller",
)
_CONTROLLER_KEYS: Final = ("kind", "members", "namespace")
_PROCESS_MEMBER_KEYS: Final = ("command", "healthPath", "startupTimeout")
_KUBERNETES_MEMBER_KEYS: Final = ("kind", "name", "apiVersion", "plural")

# RFC 1123: object names (subdomain) and namespaces (label), as the API server validates them;
# checking here turns a 422 at the first swap into a startup error.
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_KIND = re.compile(r"[A-Za-z][A-Za-z0-9]*")

_DURATION_UNITS: Final[Mapping[str, Fraction]] = {
    "ns": Fraction(1, 1_000_000_000),
    "us": Fraction(1, 1_000_000),
    "\u00b5s": Fraction(1, 1_000_000),  # micro sign, as Go accepts
    "\u03bcs": Fraction(1, 1_000_000),  # Greek mu, as Go accepts
    "ms": Fraction(1, 1000),
    "s": Fraction(1),
    "m": Fraction(60),
    "h": Fraction(3600),
}
# Longest units first so "ms" is not read as "m" followed by garbage.
# ASCII digits only, as Go's ParseDuration (`\d` would take any Unicode digit).
_NUMBER = r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+"
_UNITS = "|".join(sorted(_DURATION_UNITS, key=len, reverse=True))
_DURATION_PART = re.compile(rf"({_NUMBER})({_UNITS})")
_BARE_NUMBER = re.compile(_NUMBER)


class PoolConfigError(ValueError):
    """The pool file is malformed. The message starts with the file (when loaded from one) and
    the key path of the offending value, so an operator can fix it without reading code."""


def parse_duration(text: str) -> float:
    """Seconds from a Go-style duration (`300s`, `1.5s`, `500ms`, `5m`, `1h30m`, `2h`) or a bare
    number of seconds (`90`, `0.5`).

    Go syntax because the pool fields mirror LLMKube's CRD durations, so values can be copied
    across unchanged. Arithmetic is exact (`Fraction`) so `1h30m` is exactly 5400.0. Zero is
    allowed (`0`, `0s`): it means "use the fallbacks" for a swap or hold budget
    (docs/activator.md, Budgets).
    Negative, blank and malformed values raise `ValueError`.
    """
    value = text.strip()
    if not value:
        raise ValueError("invalid duration '': blank (expected e.g. '90s', '500ms', '1h30m')")
    if value.startswith("-"):
        raise ValueError(f"invalid duration {text!r}: must not be negative")
    body = value.removeprefix("+")
    if not body:
        raise ValueError(f"invalid duration {text!r}: no value")
    if _BARE_NUMBER.fullmatch(body):
        return _seconds(Fraction(body), text)
    total = Fraction(0)
    pos = 0
    while pos < len(body):
        match = _DURATION_PART.match(body, pos)
        if match is None:
            raise ValueError(
                f"invalid duration {text!r}: expected a number of seconds or Go syntax such as "
                "'90s', '500ms', '5m' or '1h30m' (units: ns, us, ms, s, m, h)"
            )
        total += Fraction(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    return _seconds(total, text)


def _seconds(value: Fraction, text: str) -> float:
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"invalid duration {text[:40]!r}: too large") from None


@dataclass(frozen=True, slots=True)
class ProcessMember:
    """How the `process` controller starts one member: `command` is run with `{port}` replaced
    by a free port, and the member is registered once `health_path` answers on that port.

    The placeholder is required because the controller, not the config author, picks the port:
    a fixed port would collide when two swaps overlap during drain. `startup_timeout`: how long
    the engine may take to become healthy (None: bounded by the pool's swap deadline only).
    """

    command: tuple[str, ...]
    health_path: str = DEFAULT_HEALTH_PATH
    startup_timeout: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        if not self.command or not self.command[0]:
            raise ValueError("command must not be empty")
        if not all(isinstance(arg, str) for arg in self.command):
            raise ValueError("command must be a list of strings")
        if not any(_PORT_PLACEHOLDER in arg for arg in self.command):
            raise ValueError(
                f"command must contain a {_PORT_PLACEHOLDER} placeholder "
                "(the controller picks the port)"
            )
        if not self.health_path.startswith("/"):
            raise ValueError(f"health path {self.health_path!r} must start with '/'")
        if self.startup_timeout is not None and not (
            math.isfinite(self.startup_timeout) and self.startup_timeout > 0
        ):
            raise ValueError(f"startup timeout must be > 0, got {self.startup_timeout!r}")


@dataclass(frozen=True, slots=True)
class KubernetesMember:
    """The Kubernetes object a member scales between 0 and 1 replicas.

    Deployments and StatefulSets go through the scale subresource, which needs only `scale`
    RBAC and works for any built-in workload. Any other kind is a custom resource (e.g. an
    LLMKube `InferenceService`) patched on `spec.replicas`, so it needs an `api_version` with a
    group to build its URL; `plural` is the resource name in that URL (default: lowercase kind +
    "s", which covers the usual CRD naming; set it for irregular plurals).
    """

    kind: str
    name: str
    api_version: str = "apps/v1"
    plural: str | None = None

    def __post_init__(self) -> None:
        if not _KIND.fullmatch(self.kind):
            raise ValueError(f"invalid kind {self.kind!r}")
        if not _DNS_SUBDOMAIN.fullmatch(self.name) or len(self.name) > 253:
            raise ValueError(
                f"invalid object name {self.name!r} (lowercase RFC 1123 subdomain expected)"
            )
        group, sep, version = self.api_version.rpartition("/")
        if not sep or not group or not version:
            raise ValueError(
                f"apiVersion {self.api_version!r} must be group/version, e.g. "
                "'inference.llmkube.dev/v1alpha1' (core-group kinds cannot be scaled)"
            )
        if self.kind in SCALE_SUBRESOURCE_KINDS and group != "apps":
            raise ValueError(f"{self.kind} is in the 'apps' group, not {group!r}")
        if self.plural is None:
            object.__setattr__(self, "plural", self.kind.lower() + "s")
        elif not _DNS_LABEL.fullmatch(self.plural):
            raise ValueError(f"invalid plural {self.plural!r} (lowercase resource name expected)")

    @property
    def uses_scale_subresource(self) -> bool:
        """True for Deployment/StatefulSet (scale via `/scale`), False for a patched CR."""
        return self.kind in SCALE_SUBRESOURCE_KINDS

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    @property
    def resource(self) -> str:
        """The plural resource name (never None after construction)."""
        return self.plural if self.plural is not None else self.kind.lower() + "s"


MemberSpec: TypeAlias = ProcessMember | KubernetesMember | None
"""A controller's settings for one member (None: the fake controller needs none)."""


@dataclass(frozen=True, slots=True)
class ControllerSpec:
    """Which member controller a pool uses, and its per-member settings.

    `members` maps every pool member to its settings: a `ProcessMember` for `process`, a
    `KubernetesMember` for `kubernetes`, None for `fake` (which needs none). `namespace` is the
    Kubernetes namespace (None: the router's own); other kinds have none.
    """

    kind: ControllerKind
    members: Mapping[str, MemberSpec]
    namespace: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in _CONTROLLER_KINDS:
            raise ValueError(f"unknown controller kind {self.kind!r}")
        members = MappingProxyType(dict(self.members))
        object.__setattr__(self, "members", members)
        expected: type[object] = {
            "process": ProcessMember,
            "kubernetes": KubernetesMember,
            "fake": type(None),
        }[self.kind]
        for model, spec in members.items():
            if not isinstance(spec, expected):
                raise ValueError(
                    f"member {model!r}: a {self.kind} controller needs "
                    f"{expected.__name__} settings, got {type(spec).__name__}"
                )
        if self.namespace is not None:
            if self.kind != "kubernetes":
                raise ValueError(f"namespace is only valid for kind kubernetes, not {self.kind}")
            if not _DNS_LABEL.fullmatch(self.namespace) or len(self.namespace) > 63:
                raise ValueError(f"invalid namespace {self.namespace!r}")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One pool: the activator's `PoolSpec` plus the controller that swaps its members."""

    pool: PoolSpec
    controller: ControllerSpec

    def __post_init__(self) -> None:
        members = set(self.pool.members)
        for model in self.controller.members:
            if model not in members:
                raise ValueError(f"controller member {model!r} is not a member of the pool")
        if self.controller.kind != "fake":
            for model in self.pool.members:
                if model not in self.controller.members:
                    raise ValueError(f"pool member {model!r} has no controller entry")


@dataclass(frozen=True, slots=True)
class PoolsConfig:
    """Every pool in the file. A model is in at most one pool, since a request for it must map to
    exactly one slot; pool names are unique because they label metrics and logs."""

    pools: tuple[PoolConfig, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", tuple(self.pools))
        _check_unique(self.pools)

    def pool_of(self, model: str) -> PoolConfig | None:
        """The pool that has `model` as a member, or None for an unpooled model."""
        for pool in self.pools:
            if model in pool.pool.members:
                return pool
        return None

    @property
    def pool_specs(self) -> tuple[PoolSpec, ...]:
        """The `PoolSpec`s in file order, ready for `Activator`."""
        return tuple(pool.pool for pool in self.pools)


def _check_unique(pools: Iterable[PoolConfig]) -> None:
    names: set[str] = set()
    owner: dict[str, str] = {}
    for pool in pools:
        name = pool.pool.name
        if name in names:
            raise ValueError(f"duplicate pool name {name!r}")
        names.add(name)
        for model in pool.pool.members:
            if model in owner:
                raise ValueError(f"model {model!r} is in two pools: {owner[model]} and {name}")
            owner[model] = name


def load_pool_config(path: str | PathLike[str]) -> PoolsConfig:
    """Read and validate a pool file. Every failure (unreadable file, YAML syntax error with its
    line and column, invalid content) is a `PoolConfigError` naming the file."""
    source = str(path)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise PoolConfigError(f"{source}: cannot read pool config: {exc}") from exc
    try:
        data = load_yaml(text)  # duplicate keys are errors too
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise PoolConfigError(f"{source}: {where}{problem}") from exc
    except yaml.YAMLError as exc:
        raise PoolConfigError(f"{source}: invalid YAML: {exc}") from exc
    except RecursionError:
        raise PoolConfigError(f"{source}: invalid YAML: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer past Python's digit limit
        raise PoolConfigError(f"{source}: invalid YAML: {exc}") from None
    try:
        return parse_pool_config(data)
    except PoolConfigError as exc:
        raise PoolConfigError(f"{source}: {exc}") from exc


def parse_pool_config(data: object) -> PoolsConfig:
    """Validate already-decoded YAML/JSON data (what `yaml.safe_load` returns) into pools."""
    if not isinstance(data, Mapping):
        raise PoolConfigError(
            f"expected a mapping with a 'pools' list at the top level, got {_type_name(data)}"
        )
    _reject_unknown(data, _TOP_KEYS, "top level")
    if "pools" not in data:
        raise PoolConfigError("missing required top-level key 'pools'")
    raw_pools = data["pools"]
    if not isinstance(raw_pools, list):
        raise PoolConfigError(f"pools: expected a list of pools, got {_type_name(raw_pools)}")
    pools: list[PoolConfig] = []
    seen_names: dict[str, int] = {}
    owner: dict[str, str] = {}
    for index, raw in enumerate(raw_pools):
        pool = _parse_pool(raw, index)
        where = _pool_where(index, pool.pool.name)
        name = pool.pool.name
        if name in seen_names:
            raise PoolConfigError(
                f"{where}.name: duplicate pool name {name!r} (also pools[{seen_names[name]}])"
            )
        seen_names[name] = index
        for model in pool.pool.members:
            if model in owner:
                raise PoolConfigError(
                    f"{where}.members: model {model!r} is in two pools: {owner[model]} and {name}"
                )
            owner[model] = name
        pools.append(pool)
    return PoolsConfig(tuple(pools))


def _parse_pool(raw: object, index: int) -> PoolConfig:
    where = f"pools[{index}]"
    if not isinstance(raw, Mapping):
        raise PoolConfigError(f"{where}: expected a mapping, got {_type_name(raw)}")
    # The name first, so every later message can say which pool it is about.
    if raw.get("name") is None:
        raise PoolConfigError(f"{where}: missing required key 'name'")
    name = _string(raw["name"], f"{where}.name")
    where = _pool_where(index, name)
    _reject_unknown(raw, _POOL_KEYS, where)

    if raw.get("members") is None:
        raise PoolConfigError(f"{where}: missing required key 'members'")
    members = _members(raw["members"], f"{where}.members")

    swap_budget = _optional_duration(raw, "swapBudget", where)
    hold_budget = _optional_duration(raw, "holdBudget", where)
    mode = _activation(raw.get("activation"), f"{where}.activation")
    max_held = _max_held(raw.get("maxHeld"), f"{where}.maxHeld")
    breaker_failures = _breaker_failures(raw.get("breakerFailures"), f"{where}.breakerFailures")
    breaker_cooldown = _optional_duration(raw, "breakerCooldown", where)
    if breaker_cooldown is not None and breaker_cooldown <= 0:
        raise PoolConfigError(f"{where}.breakerCooldown: must be > 0")

    if raw.get("controller") is None:
        raise PoolConfigError(f"{where}: missing required key 'controller'")
    controller = _parse_controller(raw["controller"], members, f"{where}.controller")

    try:
        spec = PoolSpec(
            name=name,
            members=members,
            swap_budget=DEFAULT_SWAP_BUDGET if swap_budget is None else swap_budget,
            default_mode=mode,
            hold_budget=hold_budget,
            max_held=max_held,
            namespace=controller.namespace or "default",
            breaker_failures=breaker_failures,
            breaker_cooldown=breaker_cooldown,
        )
        return PoolConfig(spec, controller)
    except ValueError as exc:  # pragma: no cover - the checks above come first
        raise PoolConfigError(f"{where}: {exc}") from exc


def _pool_where(index: int, name: str) -> str:
    return f"pools[{index}] ({name})"


def _members(raw: object, where: str) -> tuple[str, ...]:
    if not isinstance(raw, list):
        raise PoolConfigError(f"{where}: expected a list of model names, got {_type_name(raw)}")
    if not raw:
        raise PoolConfigError(f"{where}: must list at least one model")
    members: list[str] = []
    for position, item in enumerate(raw):
        model = _string(item, f"{where}[{position}]")
        if model in members:
            raise PoolConfigError(f"{where}: model {model!r} listed twice")
        members.append(model)
    return tuple(members)


def _optional_duration(raw: Mapping[Any, Any], key: str, where: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    path = f"{where}.{key}"
    if is_number(value):  # not a bool: `true` falls through to "invalid duration True"
        try:
            seconds = float(value)
        except OverflowError:  # an integer beyond float range
            raise PoolConfigError(f"{path}: invalid duration: too large") from None
        if not math.isfinite(seconds) or seconds < 0:
            raise PoolConfigError(f"{path}: invalid duration {value!r}: must be >= 0 seconds")
        return seconds
    if not isinstance(value, str):
        raise PoolConfigError(f"{path}: invalid duration {value!r}")
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise PoolConfigError(f"{path}: {exc}") from exc


def _activation(raw: object, where: str) -> Mode:
    if raw is None:
        return "wait"
    if isinstance(raw, str) and raw in _ACTIVATION:
        return _ACTIVATION[raw]
    raise PoolConfigError(f"{where}: invalid activation {raw!r} (expected Wait or IfIdle)")


def _max_held(raw: object, where: str) -> int:
    if raw is None:
        return 1000
    if not is_integer(raw):
        raise PoolConfigError(f"{where}: expected a positive integer, got {raw!r}")
    if raw <= 0:
        raise PoolConfigError(f"{where}: must be > 0, got {raw}")
    return raw


def _breaker_failures(raw: object, where: str) -> int | None:
    """A pool's override of `--pool-breaker-failures` (docs/activator.md, "Breaker")."""
    if raw is None:
        return None
    if not is_integer(raw) or raw < 0:
        raise PoolConfigError(f"{where}: expected an integer >= 0 (0: off), got {raw!r}")
    return raw


def _parse_controller(raw: object, pool_members: tuple[str, ...], where: str) -> ControllerSpec:
    if not isinstance(raw, Mapping):
        raise PoolConfigError(f"{where}: expected a mapping, got {_type_name(raw)}")
    _reject_unknown(raw, _CONTROLLER_KEYS, where)
    kind = raw.get("kind")
    if kind is None:
        raise PoolConfigError(f"{where}: missing required key 'kind'")
    if kind not in _CONTROLLER_KINDS:
        raise PoolConfigError(
            f"{where}.kind: unknown controller kind {kind!r} "
            f"(expected one of: {', '.join(_CONTROLLER_KINDS)})"
        )
    kind = cast(ControllerKind, kind)

    namespace = raw.get("namespace")
    if namespace is not None:
        if kind != "kubernetes":
            raise PoolConfigError(f"{where}.namespace: only valid for kind kubernetes, not {kind}")
        namespace = _string(namespace, f"{where}.namespace")
        if not _DNS_LABEL.fullmatch(namespace) or len(namespace) > 63:
            raise PoolConfigError(f"{where}.namespace: invalid namespace {namespace!r}")

    raw_members = raw.get("members")
    if raw_members is None:
        raw_members = {}
    if not isinstance(raw_members, Mapping):
        raise PoolConfigError(
            f"{where}.members: expected a mapping of model name to settings, "
            f"got {_type_name(raw_members)}"
        )
    members: dict[str, MemberSpec] = {}
    for key, value in raw_members.items():
        model = _string(key, f"{where}.members key {key!r}")
        member_where = f"{where}.members.{model}"
        if model not in pool_members:
            raise PoolConfigError(
                f"{member_where}: {model!r} is not a member of this pool "
                f"(members: {', '.join(pool_members)})"
            )
        members[model] = _parse_member(kind, value, member_where)

    if kind == "fake":
        members = dict.fromkeys(pool_members)
    else:
        for model in pool_members:
            if model not in members:
                raise PoolConfigError(
                    f"{where}.members: pool member {model!r} has no {kind} controller entry"
                )
        members = {model: members[model] for model in pool_members}

    try:
        return ControllerSpec(kind=kind, members=members, namespace=namespace)
    except ValueError as exc:  # pragma: no cover - the checks above come first
        raise PoolConfigError(f"{where}: {exc}") from exc


def _parse_member(kind: ControllerKind, raw: object, where: str) -> MemberSpec:
    if kind == "fake":
        # The fake needs no settings; tolerate an empty entry so a pool can switch kinds by
        # changing one line, but reject settings it would silently ignore.
        if raw is None or (isinstance(raw, Mapping) and not raw):
            return None
        if isinstance(raw, Mapping):
            _reject_unknown(raw, (), where)
        raise PoolConfigError(f"{where}: a fake controller member takes no settings")
    if not isinstance(raw, Mapping):
        raise PoolConfigError(f"{where}: expected a mapping, got {_type_name(raw)}")
    if kind == "process":
        return _parse_process_member(raw, where)
    return _parse_kubernetes_member(raw, where)


def _parse_process_member(raw: Mapping[Any, Any], where: str) -> ProcessMember:
    _reject_unknown(raw, _PROCESS_MEMBER_KEYS, where)
    command = raw.get("command")
    if command is None:
        raise PoolConfigError(f"{where}: missing required key 'command'")
    if not isinstance(command, list) or not command:
        raise PoolConfigError(
            f"{where}.command: expected a non-empty list of strings, got {_type_name(command)}"
        )
    args: list[str] = []
    for position, arg in enumerate(command):
        if not isinstance(arg, str):
            raise PoolConfigError(
                f"{where}.command[{position}]: expected a string, got {arg!r} (quote it)"
            )
        args.append(arg)
    health_path = raw.get("healthPath")
    if health_path is None:
        health_path = DEFAULT_HEALTH_PATH
    health_path = _string(health_path, f"{where}.healthPath")
    startup_timeout = _optional_duration(raw, "startupTimeout", where)
    if startup_timeout is not None and startup_timeout <= 0:
        raise PoolConfigError(f"{where}.startupTimeout: must be > 0")
    try:
        return ProcessMember(tuple(args), health_path, startup_timeout)
    except ValueError as exc:
        raise PoolConfigError(f"{where}: {exc}") from exc


def _parse_kubernetes_member(raw: Mapping[Any, Any], where: str) -> KubernetesMember:
    _reject_unknown(raw, _KUBERNETES_MEMBER_KEYS, where)
    for key in ("kind", "name"):
        if raw.get(key) is None:
            raise PoolConfigError(f"{where}: missing required key {key!r}")
    kind = _string(raw["kind"], f"{where}.kind")
    name = _string(raw["name"], f"{where}.name")
    api_version = raw.get("apiVersion")
    if api_version is None:
        if kind not in SCALE_SUBRESOURCE_KINDS:
            raise PoolConfigError(
                f"{where}: kind {kind!r} is not a Deployment or StatefulSet, so it needs "
                "'apiVersion' (group/version, e.g. inference.llmkube.dev/v1alpha1)"
            )
        api_version = "apps/v1"
    api_version = _string(api_version, f"{where}.apiVersion")
    plural = raw.get("plural")
    if plural is not None:
        plural = _string(plural, f"{where}.plural")
    try:
        return KubernetesMember(kind=kind, name=name, api_version=api_version, plural=plural)
    except ValueError as exc:
        raise PoolConfigError(f"{where}: {exc}") from exc


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise PoolConfigError(f"{where}: expected a string, got {value!r} (quote it)")
    if not value.strip():
        raise PoolConfigError(f"{where}: must not be blank")
    return value


def _reject_unknown(raw: Mapping[Any, Any], allowed: tuple[str, ...], where: str) -> None:
    """Fail on the first unknown key, suggesting the closest allowed one."""
    unknown = unknown_keys(raw, allowed)
    if not unknown:
        return
    key = unknown[0]
    hint = ""
    close = difflib.get_close_matches(str(key), allowed, n=1)
    if close:
        hint = f" (did you mean {close[0]!r}?)"
    elif allowed:
        hint = f" (expected: {', '.join(allowed)})"
    label = "unknown top-level key" if where == "top level" else "unknown key"
    prefix = "" if where == "top level" else f"{where}: "
    raise PoolConfigError(f"{prefix}{label} {key!r}{hint}")


def _yaml_scalar(value: object) -> str:
    if isinstance(value, str):
        return f"the string {value!r}"
    return f"{type(value).__name__} {value!r}"


_TYPE_WORDS: Final = TypeWords(
    null="nothing (null or empty)", mapping="a mapping", sequence="a list", scalar=_yaml_scalar
)
"""What a message says the file holds: `got a list`, `got the string 'x'`, `got int 7`."""

_type_name: Final = _TYPE_WORDS.describe
