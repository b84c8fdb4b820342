"""`stargate mock-backend`'s prefix-cache flags: help, environment variables, usage errors, and
the config they make (the server itself is not started)."""

from __future__ import annotations

import pytest

from stargate.mock.app import MockBackendConfig
from tests.unit.mock.cli_runner import invoke


def test_help_names_the_flags_and_their_environment_variables() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for flag in ("--prefix-cache-blocks", "--prefix-cache-speedup", "--prefix-cache-block-chars"):
        assert flag in result.output
    for name in ("BLOCKS", "SPEEDUP", "BLOCK_CHARS"):
        assert f"STARGATE_MOCK_PREFIX_CACHE_{name}" in result.output


def test_the_model_is_off_by_default(served: list[MockBackendConfig]) -> None:
    assert invoke().exit_code == 0
    [config] = served
    knobs = config.prefix_cache_knobs()
    assert (knobs.blocks, knobs.speedup, knobs.block_chars) == (0, 0.9, 64)


def test_flags_and_environment_variables_set_it(served: list[MockBackendConfig]) -> None:
    result = invoke(
        "--prefix-cache-blocks",
        "1000",
        "--prefix-cache-speedup",
        "0.5",
        "--prefix-cache-block-chars",
        "16",
    )
    assert result.exit_code == 0, result.output
    env = {
        "STARGATE_MOCK_PREFIX_CACHE_BLOCKS": "7",
        "STARGATE_MOCK_PREFIX_CACHE_SPEEDUP": "1",
        "STARGATE_MOCK_PREFIX_CACHE_BLOCK_CHARS": "32",
    }
    assert invoke(env=env).exit_code == 0
    first, second = served
    assert (first.prefix_cache_blocks, first.prefix_cache_speedup) == (1000, 0.5)
    assert first.prefix_cache_block_chars == 16
    assert (second.prefix_cache_blocks, second.prefix_cache_speedup) == (7, 1.0)
    assert second.prefix_cache_block_chars == 32


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--prefix-cache-blocks", "-1"),
        ("--prefix-cache-blocks", "many"),
        ("--prefix-cache-speedup", "1.5"),
        ("--prefix-cache-speedup", "-0.1"),
        ("--prefix-cache-speedup", "nan"),
        ("--prefix-cache-block-chars", "0"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(
    served: list[MockBackendConfig], flag: str, value: str
) -> None:
    result = invoke(flag, value)
    assert result.exit_code == 2
    assert f"Invalid value for '{flag}'" in result.output
    assert served == []
