"""The mock backend's prefix-cache model through a real `stargate mock-backend` process: a
repeated prompt gets a hit header and its first token sooner, and /test-control counts it."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.e2e.processes import launch_mock_backend

# "user\0" + 250 characters + "\0": 256 characters of prompt text, four 64-character blocks.
CONTENT = "".join(chr(ord("a") + index % 26) for index in range(250))
CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": CONTENT}], "stream": True}


def first_token(client: httpx.Client, body: dict[str, Any]) -> tuple[float, httpx.Headers]:
    """Seconds until the first SSE event of a streamed chat, and the response headers."""
    started = time.monotonic()
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                return time.monotonic() - started, response.headers
    raise AssertionError("the stream ended without an event")


def test_a_repeated_prompt_hits_the_cache_and_its_first_token_comes_sooner() -> None:
    mock = launch_mock_backend("--ttft-ms", "500", "--prefix-cache-blocks", "1000")
    try:
        with httpx.Client(base_url=mock.url, trust_env=False, timeout=10) as client:
            ttft, headers = first_token(client, CHAT)
            assert headers["x-mock-prefix-cache-hit-chars"] == "0"
            assert headers["x-mock-prefix-cache-prompt-chars"] == "256"
            assert ttft >= 0.5
            # The same prompt: every block cached, TTFT 500 ms * (1 - 0.9) = 50 ms.
            ttft, headers = first_token(client, CHAT)
            assert headers["x-mock-prefix-cache-hit-chars"] == "256"
            assert 0.05 <= ttft < 0.3
            # Another prompt misses.
            other = {**CHAT, "messages": [{"role": "user", "content": "z" * 250}]}
            ttft, headers = first_token(client, other)
            assert headers["x-mock-prefix-cache-hit-chars"] == "0"
            assert ttft >= 0.5
            snapshot = client.get("/test-control").json()
            assert snapshot["prefix_cache_blocks"] == 1000
            assert snapshot["counters"]["prefix_cache"] == {
                "lookups": 3,
                "hits": 1,
                "hit_chars": 256,
                "prompt_chars": 768,
                "evicted_blocks": 0,
                "cached_blocks": 8,
            }
            # Turned off at run time: no header, the full TTFT again.
            mock.control(prefix_cache_blocks=0)
            ttft, headers = first_token(client, CHAT)
            assert "x-mock-prefix-cache-hit-chars" not in headers
            assert ttft >= 0.5
    finally:
        mock.stop()
