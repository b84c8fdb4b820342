"""The activator pool file: durations, the documented example, and every rejection path.

Error tests match on the key path and the gist of the message, because the path is the contract
(an operator must be able to find the wrong line); the rest of the wording may improve.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from stargate.activator.config import (
    ControllerSpec,
    KubernetesMember,
    PoolConfig,
    PoolConfigError,
    PoolsConfig,
    ProcessMember,
    load_pool_config,
    parse_duration,
    parse_pool_config,
)
from stargate.activator.pool import PoolSpec

EXAMPLE = """\
pools:
  - name: gpu0
    members: [model-a, model-b]
    swapBudget: 90s
    activation: wait          # or ifIdle
    holdBudget: 60s           # optional, defaults to swapBudget
    maxHeld: 1000             # optional
    controller:
      kind: process           # or kubernetes, fake
      members:
        model-a: {command: ["stargate", "mock-backend", "--port", "{port}", "--model", "model-a"], healthPath: /health}
        model-b: {command: ["stargate", "mock-backend", "--port", "{port}", "--model", "model-b"], healthPath: /health}
  - name: gpu1
    members: [model-c, model-d]
    controller:
      kind: kubernetes
      namespace: llm
      members:
        model-c: {kind: Deployment, name: vllm-c}
        model-d: {apiVersion: inference.llmkube.dev/v1alpha1, kind: InferenceService, name: small}
"""  # noqa: E501


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pools.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _process(model: str) -> dict[str, Any]:
    return {"command": ["engine", "--port", "{port}", "--model", model]}


def _base() -> dict[str, Any]:
    """A valid two-pool document, as `yaml.safe_load` would return it, for mutation."""
    return {
        "pools": [
            {
                "name": "gpu0",
                "members": ["model-a", "model-b"],
                "controller": {
                    "kind": "process",
                    "members": {"model-a": _process("model-a"), "model-b": _process("model-b")},
                },
            },
            {
                "name": "gpu1",
                "members": ["model-c", "model-d"],
                "controller": {
                    "kind": "kubernetes",
                    "members": {
                        "model-c": {"kind": "Deployment", "name": "vllm-c"},
                        "model-d": {
                            "apiVersion": "inference.llmkube.dev/v1alpha1",
                            "kind": "InferenceService",
                            "name": "small",
                        },
                    },
                },
            },
        ]
    }


def _error(data: object) -> str:
    with pytest.raises(PoolConfigError) as info:
        parse_pool_config(data)
    return str(info.value)


# --- durations ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("300s", 300.0),
        ("1.5s", 1.5),
        ("500ms", 0.5),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("2h", 7200.0),
        ("1h0m0.5s", 3600.5),
        ("1m30s", 90.0),
        ("1.5h", 5400.0),
        (".5s", 0.5),
        ("250us", 0.00025),
        ("250\u00b5s", 0.00025),
        ("1500ns", 0.0000015),
        ("0", 0.0),
        ("0s", 0.0),
        ("90", 90.0),
        ("0.25", 0.25),
        (" 90s ", 90.0),
        ("+5s", 5.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds, rel=1e-12, abs=0)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "blank"),
        ("   ", "blank"),
        ("-5s", "negative"),
        ("-1", "negative"),
        ("ninety", "invalid duration 'ninety'"),
        ("5", None),
        ("5x", "invalid duration '5x'"),
        ("5 s", "invalid duration"),
        ("s", "invalid duration"),
        ("1h30", "invalid duration"),
        ("1e3s", "invalid duration"),
        ("inf", "invalid duration"),
        ("nan", "invalid duration"),
        ("+", "invalid duration"),
        ("5S", "invalid duration"),
    ],
)
def test_parse_duration_rejects(text: str, fragment: str | None) -> None:
    if fragment is None:  # a control row: the bare number is fine
        assert parse_duration(text) == 5.0
        return
    with pytest.raises(ValueError, match=fragment):
        parse_duration(text)


# --- the documented example --------------------------------------------------------------------


def test_example_parses_into_the_expected_objects(tmp_path: Path) -> None:
    config = load_pool_config(_write(tmp_path, EXAMPLE))

    def command(model: str) -> tuple[str, ...]:
        return ("stargate", "mock-backend", "--port", "{port}", "--model", model)

    expected = PoolsConfig(
        (
            PoolConfig(
                PoolSpec(
                    name="gpu0",
                    members=("model-a", "model-b"),
                    swap_budget=90.0,
                    default_mode="wait",
                    hold_budget=60.0,
                    max_held=1000,
                    namespace="default",
                ),
                ControllerSpec(
                    kind="process",
                    members={
                        "model-a": ProcessMember(command("model-a"), "/health"),
                        "model-b": ProcessMember(command("model-b"), "/health"),
                    },
                ),
            ),
            PoolConfig(
                PoolSpec(
                    name="gpu1",
                    members=("model-c", "model-d"),
                    swap_budget=300.0,
                    default_mode="wait",
                    hold_budget=None,
                    max_held=1000,
                    namespace="llm",
                ),
                ControllerSpec(
                    kind="kubernetes",
                    namespace="llm",
                    members={
                        "model-c": KubernetesMember("Deployment", "vllm-c"),
                        "model-d": KubernetesMember(
                            "InferenceService",
                            "small",
                            api_version="inference.llmkube.dev/v1alpha1",
                        ),
                    },
                ),
            ),
        )
    )
    assert config == expected

    gpu0, gpu1 = config.pools
    assert config.pool_of("model-b") is gpu0
    assert config.pool_of("model-d") is gpu1
    assert config.pool_of("unpooled") is None
    assert config.pool_specs == (gpu0.pool, gpu1.pool)

    deployment = gpu1.controller.members["model-c"]
    assert isinstance(deployment, KubernetesMember)
    assert deployment.uses_scale_subresource
    assert (deployment.group, deployment.version, deployment.plural) == (
        "apps",
        "v1",
        "deployments",
    )
    service = gpu1.controller.members["model-d"]
    assert isinstance(service, KubernetesMember)
    assert not service.uses_scale_subresource
    assert service.group == "inference.llmkube.dev"
    assert service.version == "v1alpha1"
    assert service.plural == service.resource == "inferenceservices"

    with pytest.raises(TypeError):
        gpu0.controller.members["model-a"] = None  # type: ignore[index]


def test_activation_spellings() -> None:
    for spelling, mode in [("wait", "wait"), ("Wait", "wait"), ("ifIdle", "if_idle")]:
        data = _base()
        data["pools"][0]["activation"] = spelling
        assert parse_pool_config(data).pools[0].pool.default_mode == mode
    data = _base()
    data["pools"][0]["activation"] = "IfIdle"
    assert parse_pool_config(data).pools[0].pool.default_mode == "if_idle"


def test_optional_values() -> None:
    data = _base()
    pool = data["pools"][0]
    pool.update(swapBudget=0, holdBudget="1m", maxHeld=5, activation=None)
    pool["controller"]["members"]["model-a"].update(healthPath="/v1/models", startupTimeout=30)
    parsed = parse_pool_config(data).pools[0]
    assert parsed.pool.swap_budget == 0.0  # 0: "use the fallbacks" (docs/activator.md)
    assert parsed.pool.hold_budget == 60.0
    assert parsed.pool.max_held == 5
    assert parsed.pool.default_mode == "wait"
    member = parsed.controller.members["model-a"]
    assert member == ProcessMember(
        ("engine", "--port", "{port}", "--model", "model-a"), "/v1/models", 30.0
    )
    # A YAML number is seconds, like a bare numeric string.
    pool["swapBudget"] = 1.5
    assert parse_pool_config(data).pools[0].pool.swap_budget == 1.5


def test_breaker_overrides() -> None:
    """docs/activator.md, "Breaker": absent keys leave the flags' values (None here)."""
    data = _base()
    assert parse_pool_config(data).pools[0].pool.breaker_failures is None
    assert parse_pool_config(data).pools[0].pool.breaker_cooldown is None
    data["pools"][0].update(breakerFailures=0, breakerCooldown="2m")
    pool = parse_pool_config(data).pools[0].pool
    assert (pool.breaker_failures, pool.breaker_cooldown) == (0, 120.0)


def test_fake_controller_needs_no_member_entries() -> None:
    data = _base()
    data["pools"][0]["controller"] = {"kind": "fake"}
    controller = parse_pool_config(data).pools[0].controller
    assert controller == ControllerSpec("fake", {"model-a": None, "model-b": None})
    # Empty entries are tolerated so switching kinds is a one-line change.
    data["pools"][0]["controller"] = {"kind": "fake", "members": {"model-a": None, "model-b": {}}}
    assert parse_pool_config(data).pools[0].controller == controller


def test_kubernetes_member_options() -> None:
    data = _base()
    members = data["pools"][1]["controller"]["members"]
    members["model-c"] = {"kind": "StatefulSet", "name": "vllm-c", "apiVersion": "apps/v1"}
    members["model-d"].update(plural="inferencesvcs")
    controller = parse_pool_config(data).pools[1].controller
    assert controller.namespace is None
    assert parse_pool_config(data).pools[1].pool.namespace == "default"
    assert controller.members["model-c"] == KubernetesMember("StatefulSet", "vllm-c")
    member_d = controller.members["model-d"]
    assert isinstance(member_d, KubernetesMember)
    assert member_d.resource == "inferencesvcs"


def test_empty_pool_list_is_allowed() -> None:
    assert parse_pool_config({"pools": []}) == PoolsConfig(())


# --- rejections --------------------------------------------------------------------------------


def _mutated(path: list[str | int], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(_base())
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


def _without(path: list[str | int]) -> dict[str, Any]:
    data = copy.deepcopy(_base())
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return data


M_D: list[str | int] = ["pools", 1, "controller", "members", "model-d"]
M_A: list[str | int] = ["pools", 0, "controller", "members", "model-a"]
FAKE = {"kind": "fake"}


@pytest.mark.parametrize(
    ("data", "fragments"),
    [
        pytest.param(
            _mutated(["pools", 0, "swapBudget"], "ninety"),
            ["pools[0] (gpu0).swapBudget: invalid duration 'ninety'"],
            id="bad-duration",
        ),
        pytest.param(
            _mutated(["pools", 0, "holdBudget"], "-5s"),
            ["pools[0] (gpu0).holdBudget: invalid duration '-5s': must not be negative"],
            id="negative-duration",
        ),
        pytest.param(
            _mutated(["pools", 0, "swapBudget"], -1),
            ["pools[0] (gpu0).swapBudget: invalid duration -1"],
            id="negative-number",
        ),
        pytest.param(
            _mutated(["pools", 0, "swapBudget"], True),
            ["pools[0] (gpu0).swapBudget: invalid duration True"],
            id="bool-duration",
        ),
        pytest.param(
            _mutated(["pools", 0, "swapBudget"], ""),
            ["pools[0] (gpu0).swapBudget: invalid duration '': blank"],
            id="blank-duration",
        ),
        pytest.param(
            _mutated([*M_D, "replicas"], 1),
            ["pools[1] (gpu1).controller.members.model-d: unknown key 'replicas'"],
            id="unknown-member-key",
        ),
        pytest.param(
            _mutated(["pools", 1], {"name": "gpu1", "members": ["model-a"], "controller": FAKE}),
            ["pools[1] (gpu1).members: model 'model-a' is in two pools: gpu0 and gpu1"],
            id="model-in-two-pools",
        ),
        pytest.param(
            {**_base(), "poools": []},
            ["unknown top-level key 'poools'", "did you mean 'pools'"],
            id="unknown-top-level-key",
        ),
        pytest.param({}, ["missing required top-level key 'pools'"], id="missing-pools"),
        pytest.param(None, ["expected a mapping with a 'pools' list"], id="empty-document"),
        pytest.param({"pools": {"gpu0": {}}}, ["pools: expected a list"], id="pools-not-list"),
        pytest.param({"pools": ["gpu0"]}, ["pools[0]: expected a mapping"], id="pool-not-mapping"),
        pytest.param(
            _without(["pools", 0, "name"]),
            ["pools[0]: missing required key 'name'"],
            id="missing-name",
        ),
        pytest.param(
            _mutated(["pools", 0, "name"], 7),
            ["pools[0].name: expected a string, got 7"],
            id="name-not-string",
        ),
        pytest.param(
            _without(["pools", 1, "members"]),
            ["pools[1] (gpu1): missing required key 'members'"],
            id="missing-members",
        ),
        pytest.param(
            _mutated(["pools", 1, "name"], "gpu0"),
            ["pools[1] (gpu0).name: duplicate pool name 'gpu0'"],
            id="duplicate-pool-name",
        ),
        pytest.param(
            _mutated(["pools", 0, "members"], []),
            ["pools[0] (gpu0).members: must list at least one model"],
            id="empty-members",
        ),
        pytest.param(
            _mutated(["pools", 0, "members"], "model-a"),
            ["pools[0] (gpu0).members: expected a list"],
            id="members-not-list",
        ),
        pytest.param(
            _mutated(["pools", 0, "members"], ["model-a", "model-b", "model-a"]),
            ["pools[0] (gpu0).members: model 'model-a' listed twice"],
            id="member-twice",
        ),
        pytest.param(
            _mutated(["pools", 0, "members"], ["model-a", 1.5]),
            ["pools[0] (gpu0).members[1]: expected a string, got 1.5"],
            id="member-not-string",
        ),
        pytest.param(
            _mutated(["pools", 0, "controller", "members", "model-z"], _process("model-z")),
            ["pools[0] (gpu0).controller.members.model-z: 'model-z' is not a member of this pool"],
            id="controller-member-not-in-pool",
        ),
        pytest.param(
            _without(M_A),
            ["pools[0] (gpu0).controller.members: pool member 'model-a' has no process"],
            id="process-member-without-entry",
        ),
        pytest.param(
            _without(M_D),
            ["pools[1] (gpu1).controller.members: pool member 'model-d' has no kubernetes"],
            id="kubernetes-member-without-entry",
        ),
        pytest.param(
            _mutated(["pools", 0, "activation"], "Sometimes"),
            ["pools[0] (gpu0).activation: invalid activation 'Sometimes'"],
            id="bad-activation",
        ),
        pytest.param(
            _mutated(["pools", 0, "activation"], "if_idle"),
            ["pools[0] (gpu0).activation: invalid activation 'if_idle'"],
            id="activation-python-spelling",
        ),
        pytest.param(
            _mutated(["pools", 0, "maxHeld"], 0),
            ["pools[0] (gpu0).maxHeld: must be > 0, got 0"],
            id="zero-max-held",
        ),
        pytest.param(
            _mutated(["pools", 0, "maxHeld"], -3),
            ["pools[0] (gpu0).maxHeld: must be > 0, got -3"],
            id="negative-max-held",
        ),
        pytest.param(
            _mutated(["pools", 0, "maxHeld"], "many"),
            ["pools[0] (gpu0).maxHeld: expected a positive integer"],
            id="max-held-not-int",
        ),
        pytest.param(
            _mutated(["pools", 0, "maxHeld"], True),
            ["pools[0] (gpu0).maxHeld: expected a positive integer"],
            id="max-held-bool",
        ),
        pytest.param(
            _mutated(["pools", 0, "breakerFailures"], -1),
            ["pools[0] (gpu0).breakerFailures: expected an integer >= 0"],
            id="negative-breaker-failures",
        ),
        pytest.param(
            _mutated(["pools", 0, "breakerFailures"], True),
            ["pools[0] (gpu0).breakerFailures: expected an integer >= 0"],
            id="breaker-failures-bool",
        ),
        pytest.param(
            _mutated(["pools", 0, "breakerCooldown"], 0),
            ["pools[0] (gpu0).breakerCooldown: must be > 0"],
            id="zero-breaker-cooldown",
        ),
        pytest.param(
            _mutated(["pools", 0, "breakerCooldown"], "soon"),
            ["pools[0] (gpu0).breakerCooldown: invalid duration"],
            id="bad-breaker-cooldown",
        ),
        pytest.param(
            _mutated(["pools", 0, "swapBudjet"], "90s"),
            ["pools[0] (gpu0): unknown key 'swapBudjet'", "did you mean 'swapBudget'"],
            id="unknown-pool-key",
        ),
        pytest.param(
            _without(["pools", 0, "controller"]),
            ["pools[0] (gpu0): missing required key 'controller'"],
            id="missing-controller",
        ),
        pytest.param(
            _without(["pools", 0, "controller", "kind"]),
            ["pools[0] (gpu0).controller: missing required key 'kind'"],
            id="missing-controller-kind",
        ),
        pytest.param(
            _mutated(["pools", 0, "controller", "kind"], "docker"),
            ["pools[0] (gpu0).controller.kind: unknown controller kind 'docker'"],
            id="bad-controller-kind",
        ),
        pytest.param(
            _mutated(["pools", 0, "controller", "namespace"], "llm"),
            ["pools[0] (gpu0).controller.namespace: only valid for kind kubernetes"],
            id="namespace-on-process",
        ),
        pytest.param(
            _mutated(["pools", 1, "controller", "namespace"], "LLM_NS"),
            ["pools[1] (gpu1).controller.namespace: invalid namespace 'LLM_NS'"],
            id="bad-namespace",
        ),
        pytest.param(
            _mutated(["pools", 0, "controller", "members"], ["model-a"]),
            ["pools[0] (gpu0).controller.members: expected a mapping"],
            id="controller-members-not-mapping",
        ),
        pytest.param(
            _mutated([*M_A, "command"], ["engine", "--port", "8000"]),
            ["pools[0] (gpu0).controller.members.model-a: command must contain a {port}"],
            id="command-without-port",
        ),
        pytest.param(
            _mutated([*M_A, "command"], "engine --port {port}"),
            ["pools[0] (gpu0).controller.members.model-a.command: expected a non-empty list"],
            id="command-string",
        ),
        pytest.param(
            _mutated([*M_A, "command"], []),
            ["pools[0] (gpu0).controller.members.model-a.command: expected a non-empty list"],
            id="command-empty",
        ),
        pytest.param(
            _mutated([*M_A, "command"], ["engine", "--port", "{port}", "--ctx", 4096]),
            ["pools[0] (gpu0).controller.members.model-a.command[4]: expected a string"],
            id="command-number",
        ),
        pytest.param(
            _without([*M_A, "command"]),
            ["pools[0] (gpu0).controller.members.model-a: missing required key 'command'"],
            id="command-missing",
        ),
        pytest.param(
            _mutated([*M_A, "healthPath"], "health"),
            ["pools[0] (gpu0).controller.members.model-a: health path 'health' must start"],
            id="health-path-relative",
        ),
        pytest.param(
            _mutated([*M_A, "startupTimeout"], "0s"),
            ["pools[0] (gpu0).controller.members.model-a.startupTimeout: must be > 0"],
            id="startup-timeout-zero",
        ),
        pytest.param(
            _mutated([*M_A, "env"], {"A": "1"}),
            ["pools[0] (gpu0).controller.members.model-a: unknown key 'env'"],
            id="unknown-process-key",
        ),
        pytest.param(
            _mutated(M_A, "engine"),
            ["pools[0] (gpu0).controller.members.model-a: expected a mapping"],
            id="member-not-mapping",
        ),
        pytest.param(
            _without([*M_D, "apiVersion"]),
            ["pools[1] (gpu1).controller.members.model-d: kind 'InferenceService'", "apiVersion"],
            id="custom-kind-without-api-version",
        ),
        pytest.param(
            _mutated([*M_D, "apiVersion"], "v1"),
            ["pools[1] (gpu1).controller.members.model-d: apiVersion 'v1' must be group/version"],
            id="api-version-without-group",
        ),
        pytest.param(
            _mutated([*M_D, "name"], "Small_Model"),
            ["pools[1] (gpu1).controller.members.model-d: invalid object name 'Small_Model'"],
            id="bad-object-name",
        ),
        pytest.param(
            _without([*M_D, "name"]),
            ["pools[1] (gpu1).controller.members.model-d: missing required key 'name'"],
            id="missing-object-name",
        ),
        pytest.param(
            _without([*M_D, "kind"]),
            ["pools[1] (gpu1).controller.members.model-d: missing required key 'kind'"],
            id="missing-object-kind",
        ),
        pytest.param(
            _mutated(
                ["pools", 1, "controller", "members", "model-c"],
                {"kind": "Deployment", "name": "vllm-c", "apiVersion": "extensions/v1beta1"},
            ),
            ["pools[1] (gpu1).controller.members.model-c: Deployment is in the 'apps' group"],
            id="deployment-wrong-group",
        ),
    ],
)
def test_rejects(data: object, fragments: list[str]) -> None:
    message = _error(data)
    for fragment in fragments:
        assert fragment in message, message


def test_fake_controller_rejects_settings_and_strangers() -> None:
    data = _mutated(["pools", 0, "controller"], {"kind": "fake", "members": {"model-a": {"x": 1}}})
    assert "pools[0] (gpu0).controller.members.model-a: unknown key 'x'" in _error(data)
    data = _mutated(["pools", 0, "controller"], {"kind": "fake", "members": {"model-a": "on"}})
    assert "controller.members.model-a: a fake controller member takes no settings" in _error(data)
    data = _mutated(["pools", 0, "controller"], {"kind": "fake", "members": {"model-q": None}})
    assert "controller.members.model-q: 'model-q' is not a member of this pool" in _error(data)


def test_dataclasses_validate_direct_construction() -> None:
    """Code that builds configs without the file (tests, the CLI) gets the same invariants."""
    with pytest.raises(ValueError, match=r"\{port\}"):
        ProcessMember(("engine",))
    with pytest.raises(ValueError, match="must start with '/'"):
        ProcessMember(("engine", "--port={port}"), "health")
    assert ProcessMember(["engine", "--port={port}"]).command == ("engine", "--port={port}")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group/version"):
        KubernetesMember("InferenceService", "small", api_version="v1")
    with pytest.raises(ValueError, match="needs KubernetesMember"):
        ControllerSpec("kubernetes", {"m": None})
    with pytest.raises(ValueError, match="only valid for kind kubernetes"):
        ControllerSpec("fake", {"m": None}, namespace="llm")
    spec = PoolSpec("p", ("a", "b"))
    with pytest.raises(ValueError, match="'b' has no controller entry"):
        PoolConfig(spec, ControllerSpec("process", {"a": ProcessMember(("e", "{port}"))}))
    with pytest.raises(ValueError, match="'c' is not a member"):
        PoolConfig(spec, ControllerSpec("fake", {"c": None}))
    fake = ControllerSpec("fake", {})
    with pytest.raises(ValueError, match="duplicate pool name 'p'"):
        PoolsConfig((PoolConfig(spec, fake), PoolConfig(spec, fake)))
    other = PoolSpec("q", ("b",))
    with pytest.raises(ValueError, match="model 'b' is in two pools: p and q"):
        PoolsConfig((PoolConfig(spec, fake), PoolConfig(other, fake)))


# --- files and YAML ----------------------------------------------------------------------------


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "pools:\n  - name: gpu0\n    members: [model-a\n    swapBudget: 9s\n")
    with pytest.raises(PoolConfigError) as info:
        load_pool_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: line ")
    assert "line 4" in message or "line 5" in message, message


def test_yaml_duplicate_key_is_an_error(tmp_path: Path) -> None:
    text = EXAMPLE.replace(
        "        model-b: {command",
        "        model-a: {command: [x, '{port}']}\n        model-b: {command",
    )
    with pytest.raises(PoolConfigError, match=r"line 12, column 9: duplicate key 'model-a'"):
        load_pool_config(_write(tmp_path, text))


def test_load_prefixes_content_errors_with_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, EXAMPLE.replace("swapBudget: 90s", "swapBudget: ninety"))
    with pytest.raises(PoolConfigError) as info:
        load_pool_config(path)
    assert str(info.value).startswith(
        f"{path}: pools[0] (gpu0).swapBudget: invalid duration 'ninety'"
    )


def test_load_empty_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(PoolConfigError, match="expected a mapping with a 'pools' list"):
        load_pool_config(_write(tmp_path, "# nothing yet\n"))
    missing = tmp_path / "absent.yaml"
    with pytest.raises(PoolConfigError, match="cannot read pool config"):
        load_pool_config(missing)


def test_yaml_numbers_and_booleans_are_not_names(tmp_path: Path) -> None:
    """YAML 1.1 turns `yes`/`1.0` into non-strings; they must fail loudly, not become models."""
    text = EXAMPLE.replace("members: [model-a, model-b]", "members: [model-a, yes]")
    with pytest.raises(PoolConfigError, match=r"pools\[0\] \(gpu0\)\.members\[1\]: expected a "):
        load_pool_config(_write(tmp_path, text))
