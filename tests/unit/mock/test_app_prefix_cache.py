"""The prefix-cache model inside the mock backend's ASGI app, called directly (no sockets) in
virtual time (`autojump_clock`): hit headers, the TTFT it saves, the counters, and the
`/test-control` knobs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from stargate.mock import MockBackend, MockBackendConfig
from stargate.mock.shapes import chat_cache_text, completion_cache_text, responses_cache_text

HIT = "x-mock-prefix-cache-hit-chars"
PROMPT = "x-mock-prefix-cache-prompt-chars"
# "user\0" + 250 characters + "\0": 256 characters, four whole 64-character blocks.
CONTENT = "".join(chr(ord("a") + index % 26) for index in range(250))
CHAT: dict[str, Any] = {"model": "mock-model", "messages": [{"role": "user", "content": CONTENT}]}


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    head_at: float  # seconds after the request, virtual time
    bodies_at: list[float]  # each body message's time, likewise

    def json(self) -> Any:
        return json.loads(self.body)


async def call(
    app: MockBackend, method: str, path: str, body: Any = None, raw: bytes | None = None
) -> Answer:
    payload = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    delivered = False
    started = trio.current_time()
    messages: list[tuple[float, dict[str, Any]]] = []

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: Any) -> None:
        messages.append((trio.current_time() - started, dict(message)))

    scope = {"type": "http", "method": method, "path": path, "headers": []}
    await app(scope, receive, send)
    head_at, head = messages[0]
    bodies = [(at, message) for at, message in messages[1:]]
    return Answer(
        status=head["status"],
        headers={bytes(k).decode(): bytes(v).decode() for k, v in head["headers"]},
        body=b"".join(message.get("body", b"") for _, message in bodies),
        head_at=head_at,
        bodies_at=[at for at, _ in bodies],
    )


async def control(app: MockBackend, **knobs: Any) -> dict[str, Any]:
    answer = await call(app, "POST", "/test-control", knobs)
    assert answer.status == 200, answer.body
    result: dict[str, Any] = answer.json()
    return result


def backend(**settings: Any) -> MockBackend:
    return MockBackend(MockBackendConfig(port=0, **settings))


def test_the_cache_texts_frame_messages_and_keep_earlier_turns_as_a_prefix() -> None:
    assert chat_cache_text(CHAT) == f"user\0{CONTENT}\0"
    assert len(chat_cache_text(CHAT)) == 256
    turn_2 = {
        "messages": [
            *CHAT["messages"],
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": "more"},
        ]
    }
    assert chat_cache_text(turn_2) == f"user\0{CONTENT}\0assistant\0ok\0user\0more\0"
    # The framing is unambiguous: a NUL inside a content is escaped, not a boundary.
    one = chat_cache_text({"messages": [{"role": "user", "content": "a\0user\0b"}]})
    two = chat_cache_text(
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    )
    assert one != two
    assert "\x01\x02" in one
    escaped = chat_cache_text({"messages": [{"role": "user", "content": "\x00"}]})
    assert escaped == "user\x00\x01\x02\x00"
    assert chat_cache_text({"messages": [{"role": "user", "content": "\x01\x02"}]}) != escaped
    assert chat_cache_text({}) == ""
    # Completions: the prompt as it is; arrays joined by NUL, token ids as JSON.
    assert completion_cache_text({"prompt": "abc"}) == "abc"
    assert completion_cache_text({"prompt": ["abc", "de"]}) == "abc\0de"
    assert completion_cache_text({"prompt": [1, 2, 30]}) == "1\x002\x0030"
    assert completion_cache_text({"prompt": [[1, 2]]}) == "[1,2]"
    assert completion_cache_text({}) == ""
    # Responses: the same framing as chat; instructions first, as a system message.
    assert responses_cache_text({"input": CONTENT}) == chat_cache_text(CHAT)
    assert responses_cache_text({"input": [{"role": "user", "content": CONTENT}]}) == (
        chat_cache_text(CHAT)
    )
    assert responses_cache_text({"instructions": "be brief", "input": "hi"}) == (
        "system\0be brief\0user\0hi\0"
    )
    assert responses_cache_text({"input": 5}) == ""


async def test_off_by_default_nothing_changes(autojump_clock: MockClock) -> None:
    app = backend(ttft_ms=1000)
    for _ in range(2):
        answer = await call(app, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
        assert answer.status == 200
        assert HIT not in answer.headers and PROMPT not in answer.headers
        assert answer.bodies_at[0] == pytest.approx(1.0)
    snapshot = (await call(app, "GET", "/test-control")).json()
    assert {key: snapshot[key] for key in snapshot if key.startswith("prefix_cache_")} == {
        "prefix_cache_blocks": 0,
        "prefix_cache_speedup": 0.9,
        "prefix_cache_block_chars": 64,
    }
    assert snapshot["counters"]["prefix_cache"] == {
        "lookups": 0,
        "hits": 0,
        "hit_chars": 0,
        "prompt_chars": 0,
        "evicted_blocks": 0,
        "cached_blocks": 0,
    }


async def test_a_repeated_chat_prompt_hits_and_its_ttft_shrinks(autojump_clock: MockClock) -> None:
    app = backend(ttft_ms=1000, inter_token_ms=10, tokens=3, prefix_cache_blocks=100)
    first = await call(app, "POST", "/v1/chat/completions", CHAT)
    assert (first.status, first.headers[HIT], first.headers[PROMPT]) == (200, "0", "256")
    assert first.head_at == pytest.approx(1.0 + 2 * 0.01)
    # The same prompt again, streamed: all four blocks hit, the TTFT is 1000 * (1 - 0.9).
    again = await call(app, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
    assert (again.headers[HIT], again.headers[PROMPT]) == ("256", "256")
    assert again.head_at == pytest.approx(0.0)
    assert again.bodies_at[0] == pytest.approx(0.1)  # the role chunk, just before token one
    # The next turn of the conversation hits the first turn's blocks.
    turn_2 = {
        **CHAT,
        "messages": [
            *CHAT["messages"],
            {"role": "assistant", "content": "x" * 100},
            {"role": "user", "content": "y" * 100},
        ],
    }
    length = len(chat_cache_text(turn_2))
    answer = await call(app, "POST", "/v1/chat/completions", turn_2)
    assert (answer.headers[HIT], answer.headers[PROMPT]) == ("256", str(length))
    expected_ttft = 1.0 * (1 - 0.9 * 256 / length)
    assert answer.head_at == pytest.approx(expected_ttft + 0.02)
    counters = (await call(app, "GET", "/test-control")).json()["counters"]["prefix_cache"]
    assert counters == {
        "lookups": 3,
        "hits": 2,
        "hit_chars": 512,
        "prompt_chars": 256 + 256 + length,
        "evicted_blocks": 0,
        "cached_blocks": length // 64,
    }


async def test_completions_and_responses_look_up_too(autojump_clock: MockClock) -> None:
    app = backend(ttft_ms=1000, prefix_cache_blocks=100, prefix_cache_speedup=0.5)
    prompt = {"model": "mock-model", "prompt": "p" * 128, "stream": True}
    assert (await call(app, "POST", "/v1/completions", prompt)).headers[HIT] == "0"
    answer = await call(app, "POST", "/v1/completions", prompt)
    assert answer.headers[HIT] == "128"
    assert answer.bodies_at[0] == pytest.approx(0.5)  # the first token
    # A Responses request with the same text as an earlier chat hits its blocks.
    await call(app, "POST", "/v1/chat/completions", CHAT)
    body = {"model": "mock-model", "input": CONTENT, "stream": True}
    answer = await call(app, "POST", "/v1/responses", body)
    assert answer.headers[HIT] == "256"
    assert answer.bodies_at[0] == pytest.approx(0.0)  # response.created at once
    assert answer.bodies_at[1] == pytest.approx(0.5)  # the first delta after the TTFT
    plain = await call(app, "POST", "/v1/responses", {**body, "stream": False})
    assert (plain.headers[HIT], plain.head_at) == ("256", pytest.approx(0.5))


async def test_refused_and_failed_requests_do_not_look_up(autojump_clock: MockClock) -> None:
    app = backend(prefix_cache_blocks=100)
    bad = await call(app, "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 0})
    assert bad.status == 400 and HIT not in bad.headers
    assert (await call(app, "POST", "/v1/chat/completions", raw=b"{oops")).status == 400
    assert (await call(app, "POST", "/v1/embeddings", {**CHAT, "input": "x"})).status == 200
    await control(app, fail_next={"count": 1})
    assert (await call(app, "POST", "/v1/chat/completions", CHAT)).status == 503
    snapshot = (await call(app, "GET", "/test-control")).json()
    assert snapshot["counters"]["prefix_cache"]["lookups"] == 0
    assert snapshot["counters"]["prefix_cache"]["cached_blocks"] == 0


async def test_test_control_turns_it_on_resizes_and_resets(autojump_clock: MockClock) -> None:
    app = backend(ttft_ms=1000, prefix_cache_speedup=0.8)
    snapshot = await control(app, prefix_cache_blocks=6)
    assert (snapshot["prefix_cache_blocks"], snapshot["prefix_cache_speedup"]) == (6, 0.8)
    await call(app, "POST", "/v1/chat/completions", CHAT)
    answer = await call(app, "POST", "/v1/chat/completions", CHAT)
    assert answer.headers[HIT] == "256"
    assert answer.head_at == pytest.approx(0.2)  # 1000 * (1 - 0.8), no decode delay
    # A lower capacity evicts, counted; a new block size empties the cache.
    snapshot = await control(app, prefix_cache_blocks=3)
    assert snapshot["counters"]["prefix_cache"]["evicted_blocks"] == 1
    assert snapshot["counters"]["prefix_cache"]["cached_blocks"] == 3
    assert (await call(app, "POST", "/v1/chat/completions", CHAT)).headers[HIT] == "192"
    snapshot = await control(app, prefix_cache_block_chars=128, prefix_cache_speedup=1)
    assert snapshot["counters"]["prefix_cache"]["cached_blocks"] == 0
    assert (await call(app, "POST", "/v1/chat/completions", CHAT)).headers[HIT] == "0"
    answer = await call(app, "POST", "/v1/chat/completions", CHAT)
    assert (answer.headers[HIT], answer.head_at) == ("256", pytest.approx(0.0))
    # The snapshot's knobs are valid input.
    knobs = {key: snapshot[key] for key in snapshot if key.startswith("prefix_cache_")}
    assert {key: (await control(app, **knobs))[key] for key in knobs} == knobs
    # Reset: the CLI's values again (off), an empty cache, zeroed counters.
    snapshot = await control(app, reset=True)
    assert (snapshot["prefix_cache_blocks"], snapshot["prefix_cache_speedup"]) == (0, 0.8)
    assert snapshot["prefix_cache_block_chars"] == 64
    assert snapshot["counters"]["prefix_cache"]["lookups"] == 0
    assert len(app.prefix_cache) == 0
    assert HIT not in (await call(app, "POST", "/v1/chat/completions", CHAT)).headers
    # Turning it off and on again also starts empty.
    await control(app, prefix_cache_blocks=10)
    await call(app, "POST", "/v1/chat/completions", CHAT)
    await control(app, prefix_cache_blocks=0)
    await control(app, prefix_cache_blocks=10)
    assert (await call(app, "POST", "/v1/chat/completions", CHAT)).headers[HIT] == "0"


@pytest.mark.parametrize(
    "body",
    [
        {"prefix_cache_blocks": -1},
        {"prefix_cache_blocks": 2.5},
        {"prefix_cache_speedup": 2},
        {"prefix_cache_speedup": "0.5"},
        {"prefix_cache_block_chars": 0},
        # All or nothing: the valid fields of a refused body do not apply either.
        {"tokens": 3, "prefix_cache_blocks": 5, "prefix_cache_speedup": -1},
        {"prefix_cache_blocks": 5, "tokens": 0},
    ],
)
async def test_bad_control_values_are_400_and_change_nothing(body: dict[str, Any]) -> None:
    app = backend(prefix_cache_blocks=1)
    before = (app.knobs, app.prefix_cache_knobs, app.prefix_cache.capacity)
    answer = await call(app, "POST", "/test-control", body)
    assert answer.status == 400
    message = answer.json()["error"]["message"]
    assert "prefix_cache" in message or "tokens" in message
    assert (app.knobs, app.prefix_cache_knobs, app.prefix_cache.capacity) == before


def test_the_config_validates_the_prefix_cache_settings() -> None:
    config = MockBackendConfig(
        prefix_cache_blocks=5, prefix_cache_speedup=0.25, prefix_cache_block_chars=16
    )
    knobs = config.prefix_cache_knobs()
    assert (knobs.blocks, knobs.speedup, knobs.block_chars) == (5, 0.25, 16)
    for settings in (
        {"prefix_cache_blocks": -1},
        {"prefix_cache_speedup": 1.5},
        {"prefix_cache_block_chars": 0},
    ):
        with pytest.raises(ValueError):
            MockBackendConfig(**settings)
