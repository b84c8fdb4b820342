"""The mock's token pacing in virtual time: each chunk is its own message, `--inter-token-ms`
apart, the first after `--ttft-ms`. (The loopback test of tests/e2e/test_mock_backend.py checks
only what a loaded machine cannot break: causality, and that the chunks are not held back.)"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from trio.testing import MockClock

from tests.unit.mock.asgi_client import backend, call

STREAM: dict[str, Any] = {
    "model": "mock-model",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
}


@pytest.mark.parametrize(("ttft_ms", "inter_token_ms"), [(0, 50), (200, 50), (30, 7)])
async def test_each_token_is_its_own_message_exactly_one_gap_apart(
    autojump_clock: MockClock, ttft_ms: int, inter_token_ms: int
) -> None:
    app = backend(ttft_ms=ttft_ms, inter_token_ms=inter_token_ms, tokens=6)
    client = await call(app, "POST", "/v1/chat/completions", STREAM)
    events = client.events()
    assert events[-1][1] == "[DONE]"
    assert len(events) == 9  # role, 6 tokens, stop, [DONE]
    tokens = [at for at, _ in events[1:7]]
    assert tokens[0] == pytest.approx(ttft_ms / 1000)
    gaps = [later - earlier for earlier, later in itertools.pairwise(tokens)]
    assert gaps == pytest.approx([inter_token_ms / 1000] * 5)
    body_messages = [m for _, m in client.messages[1:] if m.get("body")]
    assert len(body_messages) >= 8  # not batched: one write per event (the last may carry two)
