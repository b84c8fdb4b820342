"""Derived affinity keys through a real replica (docs/data-plane.md, "Derived affinity keys").

A replica with `--accept-openai-requests --derive-affinity-key` and Pulsar over four clusters:
plain OpenAI requests carry no `x-cache-affinity-key`, yet every turn of a conversation (a growing
message list under a long system prompt) is served by the same backend, and a derived key
satisfies `require_cache_affinity_key`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.processes import MockBackendProcess, launch_mock_backend
from tests.e2e.test_affinity_routing import MODEL, start_affinity_replica
from tests.e2e.test_proxy import ProxyReplica


@pytest.fixture(scope="module")
def engines() -> Iterator[list[MockBackendProcess]]:
    started = [launch_mock_backend("--model", MODEL) for _ in range(2)]
    yield started
    for engine in started:
        engine.stop()


@pytest.fixture
def replica(tmp_path: Path, engines: list[MockBackendProcess]) -> Iterator[ProxyReplica]:
    handle = start_affinity_replica(
        tmp_path,
        engines,
        "--accept-openai-requests",
        "--derive-affinity-key",
        "--derive-affinity-key-block-bytes=128",
    )
    yield handle
    handle.close()


def _chat(replica: ProxyReplica, messages: list[dict[str, str]], **headers: str) -> httpx.Response:
    response = httpx.post(
        f"{replica.base}/v1/chat/completions",
        json={"model": MODEL, "messages": messages},
        headers=headers,
        timeout=10,
    )
    assert response.status_code == 200, response.text
    return response


def _conversation(index: int) -> list[list[dict[str, str]]]:
    """Four turns: each turn's messages start with the previous turn's."""
    messages = [
        {"role": "system", "content": f"You are assistant {index}. " + "Be brief. " * 400},
        {"role": "user", "content": f"Question {index}: " + "tell me about caches " * 20},
    ]
    turns = [list(messages)]
    for turn in range(3):
        messages += [
            {"role": "assistant", "content": f"answer {turn}"},
            {"role": "user", "content": f"follow-up {turn}"},
        ]
        turns.append(list(messages))
    return turns


def test_the_turns_of_a_conversation_share_a_backend(replica: ProxyReplica) -> None:
    chosen = []
    for index in range(8):
        served = {
            _chat(replica, messages).headers["x-inference-server-id"]
            for messages in _conversation(index)
        }
        assert len(served) == 1, f"conversation {index} was spread over {served}"
        chosen.append(served.pop())
    assert len(set(chosen)) >= 2  # different system prompts: keys spread over the clusters


def test_a_derived_key_satisfies_a_required_key(replica: ProxyReplica) -> None:
    # wait-and-widen requires a key: the derived one counts, in both request forms.
    method = {"x-routing-method": "wait_and_widen"}
    messages = _conversation(0)[0]
    assert len({_chat(replica, messages, **method).headers["x-inference-server-id"]}) == 1
    header_form = httpx.post(
        f"{replica.base}/v1/chat/completions",
        json={"model": MODEL, "messages": messages},
        headers={"x-model": MODEL, "x-request-id": "r", "x-input-tokens": "10", **method},
        timeout=10,
    )
    assert header_form.status_code == 200, header_form.text
    # An embeddings request has no prompt to derive from: still refused.
    refused = httpx.post(
        f"{replica.base}/v1/embeddings",
        json={"model": MODEL, "input": "x"},
        headers=method,
        timeout=10,
    )
    assert refused.status_code == 400
    assert "x-cache-affinity-key" in refused.json()["error"]["message"]
