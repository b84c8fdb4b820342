"""`stargate mock-backend`'s batching flags: help, environment variables, usage errors, and the
config they make (the server itself is not started)."""

from __future__ import annotations

from typing import Any

import pytest

from stargate.mock.app import MockBackendConfig
from tests.unit.mock.cli_runner import invoke

FLAGS = {
    "--max-num-seqs": "STARGATE_MOCK_MAX_NUM_SEQS",
    "--prefill-ms-per-token": "STARGATE_MOCK_PREFILL_MS_PER_TOKEN",
    "--kv-cache-tokens": "STARGATE_MOCK_KV_CACHE_TOKENS",
    "--engine-stats-stream": "STARGATE_MOCK_ENGINE_STATS_STREAM",
}


def test_help_names_the_flags_and_their_environment_variables() -> None:
    output = invoke("--help").output
    for flag, name in FLAGS.items():
        assert flag in output and name in output


def test_everything_is_off_by_default(served: list[MockBackendConfig]) -> None:
    assert invoke().exit_code == 0
    [config] = served
    assert (config.max_num_seqs, config.prefill_ms_per_token) == (0, 0.0)
    assert (config.kv_cache_tokens, config.engine_stats_stream) == (0, False)


def test_flags_and_environment_variables_set_them(served: list[MockBackendConfig]) -> None:
    result = invoke(
        "--max-num-seqs",
        "4",
        "--prefill-ms-per-token",
        "0.25",
        "--kv-cache-tokens",
        "4096",
        "--engine-stats-stream",
    )
    assert result.exit_code == 0, result.output
    env = {
        "STARGATE_MOCK_MAX_NUM_SEQS": "2",
        "STARGATE_MOCK_PREFILL_MS_PER_TOKEN": "1",
        "STARGATE_MOCK_KV_CACHE_TOKENS": "160",
        "STARGATE_MOCK_ENGINE_STATS_STREAM": "true",
    }
    assert invoke(env=env).exit_code == 0
    assert invoke(env={"STARGATE_MOCK_ENGINE_STATS_STREAM": "0"}).exit_code == 0
    first, second, third = served
    assert (first.max_num_seqs, first.prefill_ms_per_token) == (4, 0.25)
    assert (first.kv_cache_tokens, first.engine_stats_stream) == (4096, True)
    assert (second.max_num_seqs, second.prefill_ms_per_token) == (2, 1.0)
    assert (second.kv_cache_tokens, second.engine_stats_stream) == (160, True)
    assert third.engine_stats_stream is False


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-num-seqs", "-1"),
        ("--max-num-seqs", "1.5"),
        ("--prefill-ms-per-token", "-0.5"),
        ("--prefill-ms-per-token", "nan"),
        ("--prefill-ms-per-token", "inf"),
        ("--kv-cache-tokens", "-1"),
        ("--kv-cache-tokens", "lots"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(
    served: list[MockBackendConfig], flag: str, value: str
) -> None:
    result = invoke(flag, value)
    assert result.exit_code == 2
    assert f"Invalid value for '{flag}'" in result.output
    assert served == []


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_seqs": -1},
        {"prefill_ms_per_token": -1.0},
        {"prefill_ms_per_token": float("nan")},
        {"kv_cache_tokens": -1},
    ],
)
def test_the_config_refuses_invalid_values(settings: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        MockBackendConfig(**settings)
