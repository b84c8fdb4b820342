"""The mock backend's engine identity: `--engine-id` (hidden; `STARGATE_MOCK_ENGINE_ID`) puts
`x-mock-engine-id` on every answer, so a benchmark knows which engine served a request whatever
router stands in front of it (benchmarks/affinity.py, sglang-router included)."""

from __future__ import annotations

from typing import Any

import pytest

from stargate.mock.app import MockBackendConfig
from tests.unit.mock.asgi_client import backend, call
from tests.unit.mock.cli_runner import invoke

STREAM: dict[str, Any] = {
    "model": "mock-model",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
}


def test_the_flag_and_its_environment_variable_set_it(served: list[MockBackendConfig]) -> None:
    assert invoke("--engine-id", "engine-2").exit_code == 0
    assert invoke(env={"STARGATE_MOCK_ENGINE_ID": "engine-3"}).exit_code == 0
    assert invoke().exit_code == 0
    assert [config.engine_id for config in served] == ["engine-2", "engine-3", ""]


def test_it_is_hidden_from_the_help() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    assert "--engine-id" not in result.output


@pytest.mark.parametrize("value", ["engine 1", "engine\t1", "engine-é"])
def test_a_value_that_is_not_a_header_value_is_a_usage_error(
    served: list[MockBackendConfig], value: str
) -> None:
    result = invoke("--engine-id", value)
    assert result.exit_code == 2
    assert "--engine-id" in result.output
    assert served == []


def test_the_config_refuses_it_too() -> None:
    with pytest.raises(ValueError, match="engine_id"):
        MockBackendConfig(engine_id="a b")


async def test_every_answer_names_the_engine() -> None:
    app = backend(engine_id="engine-7", prefix_cache_blocks=8)
    stream = await call(app, "POST", "/v1/chat/completions", STREAM)
    assert stream.status == 200
    assert stream.response_headers["x-mock-engine-id"] == "engine-7"
    assert stream.response_headers["x-mock-prefix-cache-prompt-chars"] == "8"  # user NUL hi NUL
    for method, path, body in (
        ("POST", "/v1/chat/completions", {**STREAM, "stream": False}),
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", {"model": "other"}),  # a 400 too
        ("GET", "/no-such-path", None),
    ):
        answer = await call(app, method, path, body)
        assert answer.response_headers["x-mock-engine-id"] == "engine-7", (method, path)


async def test_without_it_there_is_no_header() -> None:
    app = backend()
    answer = await call(app, "POST", "/v1/chat/completions", STREAM)
    assert answer.status == 200
    assert "x-mock-engine-id" not in answer.response_headers
