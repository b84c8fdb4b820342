"""The mock backend (`stargate mock-backend`): every endpoint and every `/test-control` knob, on
a real Hypercorn (trio worker) over loopback with the real clock, plus one real process."""

from __future__ import annotations

import base64
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from click.testing import CliRunner

from stargate.mock import MockBackend, MockBackendConfig, mock_backend_command, run_mock_backend
from stargate.mock.control import ControlError, Knobs, apply_control
from stargate.mock.shapes import TOKENS, answer_text, embedding_vector

CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "Hello there, mock!"}]}


@asynccontextmanager
async def serving(**settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, MockBackend]]:
    """A mock on 127.0.0.1:0 and an httpx client for it; the server stops on exit."""
    config = MockBackendConfig(port=0, **settings)
    app = MockBackend(config)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(run_mock_backend, config, app=app))
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=5
        ) as client:
            yield client, app
        nursery.cancel_scope.cancel()


@pytest.fixture
async def mock() -> AsyncIterator[tuple[httpx.AsyncClient, MockBackend]]:
    async with serving() as served:
        yield served


async def control(client: httpx.AsyncClient, **knobs: Any) -> dict[str, Any]:
    response = await client.post("/test-control", json=knobs)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def sse_lines(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[str]:
    """The non-empty lines of a streamed response (asserting it is an SSE 200)."""
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        return [line async for line in response.aiter_lines() if line]


def data_events(lines: list[str]) -> list[Any]:
    return [
        "[DONE]" if line == "data: [DONE]" else json.loads(line.removeprefix("data: "))
        for line in lines
        if line.startswith("data: ")
    ]


# ------------------------------------------------------------------ generation endpoints


async def test_chat_completion_shape_usage_and_headers(mock: Any) -> None:
    client, _ = mock
    response = await client.post(
        "/v1/chat/completions", json=CHAT, headers={"x-request-id": "req-1"}
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"] == "req-1"
    assert response.headers["x-mock-request-count"] == "1"
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "mock-model"
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": answer_text(16)}
    assert choice["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
    assert "mock_request_headers" not in body

    response = await client.post(
        "/v1/chat/completions",
        json={**CHAT, "max_tokens": 3},
        headers={"x-input-tokens": "42"},
    )
    assert response.headers["x-mock-request-count"] == "2"
    assert "x-request-id" not in response.headers
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "Hello, how"
    assert body["usage"] == {"prompt_tokens": 42, "completion_tokens": 3, "total_tokens": 45}
    # A larger max_tokens does not raise the configured count.
    response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 99})
    assert response.json()["usage"]["completion_tokens"] == 16


async def test_echo_headers_only_when_asked(mock: Any) -> None:
    client, _ = mock
    headers = {"x-model": "mock-model", "x-input-tokens": "7", "x-request-id": "r-9"}
    response = await client.post(
        "/v1/chat/completions", json=CHAT, headers={**headers, "x-mock-echo-headers": "1"}
    )
    echoed = response.json()["mock_request_headers"]
    assert {name: echoed[name] for name in headers} == headers
    response = await client.post("/v1/embeddings", json={"model": "mock-model", "input": "x"})
    assert "mock_request_headers" not in response.json()


async def test_a_stream_echoes_headers_in_a_response_header_when_asked(mock: Any) -> None:
    client, _ = mock
    headers = {"x-model": "mock-model", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    body = {**CHAT, "stream": True}
    response = await client.post(
        "/v1/chat/completions", json=body, headers={**headers, "x-mock-echo-headers": "1"}
    )
    echoed = json.loads(response.headers["x-mock-request-headers"])
    assert {name: echoed[name] for name in headers} == headers
    assert response.text.rstrip().endswith("data: [DONE]")  # the stream itself is unchanged
    response = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert "x-mock-request-headers" not in response.headers


async def test_chat_stream_events(mock: Any) -> None:
    client, _ = mock
    lines = await sse_lines(client, "/v1/chat/completions", {**CHAT, "stream": True})
    events = data_events(lines)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = [chunk["choices"][0]["delta"]["content"] for chunk in chunks[1:-1]]
    assert tokens == list(TOKENS[:16])
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert all("usage" not in chunk for chunk in chunks)

    lines = await sse_lines(
        client,
        "/v1/chat/completions",
        {**CHAT, "stream": True, "max_tokens": 2, "stream_options": {"include_usage": True}},
    )
    events = data_events(lines)
    assert events[-1] == "[DONE]"
    assert [event["usage"] for event in events[:-2]] == [None] * 4  # role, 2 tokens, stop
    assert events[-2]["choices"] == []
    assert events[-2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


async def test_stream_chunks_arrive_one_by_one(mock: Any) -> None:
    client, _ = mock
    await control(client, inter_token_ms=50, tokens=6)
    arrivals: list[tuple[float, str]] = []
    started = trio.current_time()
    body = {**CHAT, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line:
                arrivals.append((trio.current_time() - started, line))
    assert arrivals[-1][1] == "data: [DONE]"
    assert len(arrivals) == 9  # role, 6 tokens, stop, [DONE]
    # Causality, which no load can break: token k cannot arrive before k - 1 gaps have passed.
    # (Gaps measured between arrivals once had ~10 ms of headroom: a late chunk shortens the gap
    # after it. The exact pacing is tests/unit/mock/test_app_pacing.py, in virtual time.)
    tokens = [at for at, _ in arrivals[1:7]]
    assert all(at >= k * 0.05 for k, at in enumerate(tokens)), tokens
    # Not held back until the end: the first token arrives while the other five are still to
    # be sent (0.25 s of gaps after it; the margin is that schedule, not a guess at the load).
    assert tokens[0] < tokens[-1], tokens
    assert tokens[0] < arrivals[-1][0] - 0.1, arrivals


async def test_ttft_delays_the_first_token_not_the_head(mock: Any) -> None:
    client, _ = mock
    await control(client, ttft_ms=200, tokens=2)
    started = trio.current_time()
    body = {**CHAT, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        head = trio.current_time() - started
        lines = [line async for line in response.aiter_lines() if line]
        done = trio.current_time() - started
    assert head < 0.15 and done >= 0.2
    assert lines[-1] == "data: [DONE]"
    started = trio.current_time()
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert trio.current_time() - started >= 0.2
    assert response.json()["usage"]["completion_tokens"] == 2


async def test_completions_plain_and_streamed(mock: Any) -> None:
    client, _ = mock
    body = {"model": "mock-model", "prompt": "Say hello", "max_tokens": 4}
    response = await client.post("/v1/completions", json=body)
    payload = response.json()
    assert payload["object"] == "text_completion"
    assert payload["id"].startswith("cmpl-")
    assert payload["choices"][0]["text"] == answer_text(4)
    assert payload["choices"][0]["finish_reason"] == "stop"
    assert payload["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}

    lines = await sse_lines(
        client,
        "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = data_events(lines)
    assert events[-1] == "[DONE]"
    texts = [event["choices"][0]["text"] for event in events[:4]]
    assert texts == list(TOKENS[:4])
    assert events[4]["choices"][0]["finish_reason"] == "stop"
    assert events[5]["choices"] == []
    assert events[5]["usage"]["completion_tokens"] == 4


async def test_responses_plain_and_streamed(mock: Any) -> None:
    client, _ = mock
    body = {"model": "mock-model", "input": "Say hello", "max_output_tokens": 3}
    response = await client.post("/v1/responses", json=body)
    payload = response.json()
    assert payload["object"] == "response"
    assert payload["status"] == "completed"
    [message] = payload["output"]
    assert message["role"] == "assistant"
    assert message["content"][0] == {"type": "output_text", "text": "Hello, how", "annotations": []}
    assert payload["usage"]["input_tokens"] == 3
    assert payload["usage"]["output_tokens"] == 3
    assert payload["usage"]["total_tokens"] == 6

    lines = await sse_lines(client, "/v1/responses", {**body, "stream": True})
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names == [
        "response.created",
        *["response.output_text.delta"] * 3,
        "response.completed",
    ]
    events = data_events(lines)
    assert [event["type"] for event in events] == names
    assert [event["sequence_number"] for event in events] == list(range(5))
    assert events[0]["response"]["status"] == "in_progress"
    assert "".join(event["delta"] for event in events[1:4]) == "Hello, how"
    completed = events[-1]["response"]
    assert completed["status"] == "completed"
    assert completed["output"][0]["content"][0]["text"] == "Hello, how"
    assert "[DONE]" not in events


async def test_embeddings_shapes(mock: Any) -> None:
    client, _ = mock
    response = await client.post("/v1/embeddings", json={"model": "mock-model", "input": "hello"})
    assert response.json() == {
        "object": "list",
        "data": [{"object": "embedding", "embedding": [0.0, 0.125, -0.25], "index": 0}],
        "model": "mock-model",
        "usage": {"prompt_tokens": 2, "total_tokens": 2},
    }
    response = await client.post(
        "/v1/embeddings",
        json={"model": "mock-model", "input": ["a", "b", [1, 2, 3]], "dimensions": 4},
    )
    payload = response.json()
    assert [item["index"] for item in payload["data"]] == [0, 1, 2]
    assert payload["data"][2]["embedding"] == [2.0, 2.125, -2.25, 2.375]
    assert payload["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    # A flat list of token ids is one input.
    response = await client.post(
        "/v1/embeddings",
        json={"model": "mock-model", "input": [5, 6, 7], "encoding_format": "base64"},
        headers={"x-input-tokens": "11"},
    )
    payload = response.json()
    [item] = payload["data"]
    assert struct.unpack("<3f", base64.b64decode(item["embedding"])) == (0.0, 0.125, -0.25)
    assert payload["usage"]["prompt_tokens"] == 11
    bad_bodies: list[dict[str, Any]] = [
        {"input": []},
        {"input": [{}]},
        {"input": "x", "encoding_format": "hex"},
        {"input": "x", "dimensions": 0},
    ]
    for bad in bad_bodies:
        response = await client.post("/v1/embeddings", json={"model": "mock-model", **bad})
        assert response.status_code == 400, bad


def test_embedding_vector() -> None:
    assert embedding_vector(0) == [0.0, 0.125, -0.25]
    assert embedding_vector(3, 6) == [3.0, 3.125, -3.25, 3.375, 3.5, -3.625]


async def test_models_and_health() -> None:
    async with serving(models=("alpha", "beta")) as (client, _):
        response = await client.get("/v1/models")
        assert response.json() == {
            "object": "list",
            "data": [
                {"id": "alpha", "object": "model", "created": 0, "owned_by": "stargate-mock"},
                {"id": "beta", "object": "model", "created": 0, "owned_by": "stargate-mock"},
            ],
        }
        body = {**CHAT, "model": "beta"}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 400

        health = await client.get("/health")
        assert (health.status_code, health.text) == (200, "ok")
        assert (await client.head("/health")).status_code == 200
        await control(client, healthy=False)
        health = await client.get("/health")
        assert (health.status_code, health.text) == (503, "unhealthy")
        await control(client, healthy=True)
        assert (await client.get("/health")).status_code == 200


async def test_bad_requests_are_openai_errors(mock: Any) -> None:
    client, _ = mock
    cases: list[tuple[str, Any]] = [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/chat/completions", {"messages": CHAT["messages"]}),
        ("/v1/chat/completions", {**CHAT, "model": "other"}),
        ("/v1/chat/completions", {"model": "mock-model"}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}),
        ("/v1/completions", {"model": "mock-model"}),
        ("/v1/responses", {"model": "mock-model", "input": 3}),
        ("/v1/embeddings", {"model": "mock-model"}),
        # Deeper than the interpreter's stack: json.loads raised RecursionError, a 500.
        ("/v1/chat/completions", b"[" * 20_000 + b"]" * 20_000),
        ("/v1/embeddings", b'{"model":' * 5_000 + b'"mock-model"' + b"}" * 5_000),
    ]
    for path, body in cases:
        if isinstance(body, bytes):
            response = await client.post(path, content=body)
        else:
            response = await client.post(path, json=body)
        assert response.status_code == 400, (path, body)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"]
    response = await client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
    assert "'other'" in response.json()["error"]["message"]


async def test_unknown_path_and_wrong_method(mock: Any) -> None:
    client, app = mock
    response = await client.get("/v2/nothing")
    assert response.status_code == 404
    assert "x-mock-request-count" in response.headers
    response = await client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    response = await client.post("/v1/models", json={})
    assert (response.status_code, response.headers["allow"]) == (405, "GET, HEAD")
    response = await client.delete("/test-control")
    assert (response.status_code, response.headers["allow"]) == (405, "GET, POST")
    assert app.counters.requests["not_found"] == 1


# ------------------------------------------------------------------ test-control knobs


async def test_counters_and_snapshot(mock: Any) -> None:
    client, _ = mock
    await client.post("/v1/chat/completions", json=CHAT)
    await client.post("/v1/completions", json={"model": "mock-model", "prompt": "x"})
    await client.post("/v1/embeddings", json={"model": "mock-model", "input": "x"})
    await client.get("/v1/models")
    await client.get("/health")
    response = await client.get("/test-control")
    assert response.headers["x-mock-request-count"] == "6"
    snapshot = response.json()
    assert snapshot["models"] == ["mock-model"]
    assert snapshot["in_flight"] == 0
    assert snapshot["counters"]["requests_total"] == 6
    assert snapshot["counters"]["requests"] == {
        "chat_completions": 1,
        "completions": 1,
        "responses": 0,
        "embeddings": 1,
        "models": 1,
        "health": 1,
        "test_control": 1,
        "not_found": 0,
    }
    knobs = {key: snapshot[key] for key in Knobs().to_json()}
    assert knobs == {
        "ttft_ms": 0.0,
        "inter_token_ms": 0.0,
        "tokens": 16,
        "healthy": True,
        "response_delay_ms": 0.0,
        "fail_next": {"count": 0, "status": 503, "body": None, "headers": {}},
        "drop_mid_stream": {"count": 0, "after_chunks": 1},
    }
    # The snapshot's knobs are valid control input.
    assert {key: (await control(client, **knobs))[key] for key in knobs} == knobs


async def test_fail_next_with_status_body_and_headers(mock: Any) -> None:
    client, _ = mock
    await control(
        client,
        fail_next={
            "count": 2,
            "status": 429,
            "body": '{"error":"queue full"}',
            "headers": {"x-stargate-retryable": "true"},
        },
    )
    for _ in range(2):
        response = await client.post(
            "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "f"}
        )
        assert response.status_code == 429
        assert response.json() == {"error": "queue full"}
        assert response.headers["x-stargate-retryable"] == "true"
        assert response.headers["content-type"] == "application/json"
        assert response.headers["x-request-id"] == "f"
    # GET endpoints are not affected, and the third request succeeds.
    await control(client, fail_next={"count": 1})
    assert (await client.get("/v1/models")).status_code == 200
    assert (await client.get("/health")).status_code == 200
    response = await client.post("/v1/embeddings", json={"model": "mock-model", "input": "x"})
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "mock_injected_failure"
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    await control(client, fail_next={"status": 500, "body": "boom", "count": 1})
    response = await client.post("/v1/responses", content=b"not even json")
    assert (response.status_code, response.text) == (500, "boom")
    assert response.headers["content-type"].startswith("text/plain")
    snapshot = (await client.get("/test-control")).json()
    assert snapshot["counters"]["injected_failures"] == 4
    assert snapshot["fail_next"]["count"] == 0
    await control(client, fail_next={"status": 204, "body": "dropped"})
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert (response.status_code, response.content) == (204, b"")
    assert "content-length" not in response.headers


async def test_drop_mid_stream_truncates_the_chunked_body(mock: Any) -> None:
    client, app = mock
    await control(client, drop_mid_stream={"count": 1, "after_chunks": 3})
    received: list[str] = []
    body = {**CHAT, "stream": True}
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line:
                    received.append(line)
    assert len(received) == 3  # role chunk and two tokens, then the connection was cut
    assert all('"finish_reason":null' in line for line in received)
    # Only `count` streams are dropped; a drop beyond the last token never sends the end.
    lines = await sse_lines(client, "/v1/chat/completions", body)
    assert lines[-1] == "data: [DONE]"
    await control(client, drop_mid_stream={"after_chunks": 1000}, tokens=2)
    received.clear()
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream("POST", "/v1/responses", json={**body, "input": "x"}) as response:
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    received.append(line)
    assert received == ["event: response.created", *["event: response.output_text.delta"] * 2]
    assert app.counters.dropped_streams == 2
    # Non-streaming requests leave the drop pending.
    await control(client, drop_mid_stream={"count": 1, "after_chunks": 0})
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    with pytest.raises(httpx.RemoteProtocolError):
        await client.post("/v1/completions", json={"model": "mock-model", "prompt": "x", **body})


async def test_response_delay_holds_the_head(mock: Any) -> None:
    client, _ = mock
    await control(client, response_delay_ms=300)
    started = trio.current_time()
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert trio.current_time() - started >= 0.3
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, timeout=0.1)
    await control(client, fail_next={"count": 1})
    started = trio.current_time()
    assert (await client.post("/v1/embeddings", json=CHAT)).status_code == 503
    assert trio.current_time() - started >= 0.3
    # GET endpoints answer at once.
    started = trio.current_time()
    assert (await client.get("/v1/models")).status_code == 200
    assert trio.current_time() - started < 0.2


async def test_client_disconnect_ends_the_stream(mock: Any) -> None:
    client, app = mock
    await control(client, inter_token_ms=100, tokens=50)
    body = json.dumps({**CHAT, "stream": True}).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", client.base_url.port)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: mock\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await stream.send_all(request)
    received = b""
    while b"Hello" not in received:
        received += await stream.receive_some()
    assert received.startswith(b"HTTP/1.1 200")
    assert app.in_flight == 1
    await stream.aclose()
    with trio.fail_after(2):
        while app.in_flight:  # noqa: ASYNC110 (the app has no event to wait on)
            await trio.sleep(0.01)
    assert app.counters.client_disconnects == 1


async def test_reset_restores_cli_defaults_and_zeroes_counters() -> None:
    async with serving(tokens=4, ttft_ms=1) as (client, app):
        await client.post("/v1/chat/completions", json=CHAT)
        await control(
            client,
            tokens=2,
            ttft_ms=5,
            healthy=False,
            fail_next={"count": 3},
            drop_mid_stream={"count": 2},
            response_delay_ms=7,
        )
        snapshot = await control(client, reset=True)
        assert snapshot["tokens"] == 4
        assert snapshot["ttft_ms"] == 1.0
        assert snapshot["healthy"] is True
        assert snapshot["response_delay_ms"] == 0.0
        assert snapshot["fail_next"]["count"] == 0
        assert snapshot["drop_mid_stream"]["count"] == 0
        assert snapshot["counters"]["requests_total"] == 0
        assert set(snapshot["counters"]["requests"].values()) == {0}
        # `reset` with other fields: reset first, then apply them.
        snapshot = await control(client, reset=True, tokens=9)
        assert snapshot["tokens"] == 9 and snapshot["ttft_ms"] == 1.0
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.headers["x-mock-request-count"] == "1"
        assert app.knobs.tokens == 9


@pytest.mark.parametrize(
    "body",
    [
        b"{oops",
        b"[" * 20_000 + b"]" * 20_000,  # RecursionError in json.loads: was a 500
        b"[]",
        b'{"unknown": 1}',
        b'{"tokens": 0}',
        b'{"tokens": 2.5}',
        b'{"ttft_ms": -1}',
        b'{"inter_token_ms": "5"}',
        b'{"healthy": "yes"}',
        b'{"reset": 1}',
        b'{"fail_next": {"status": 99}}',
        b'{"fail_next": {"count": -1}}',
        b'{"fail_next": {"headers": {"x": 1}}}',
        b'{"fail_next": {"body": 5}}',
        b'{"fail_next": {"typo": 1}}',
        b'{"drop_mid_stream": {"after_chunks": -1}}',
        b'{"drop_mid_stream": 3}',
        b'{"tokens": 3, "response_delay_ms": true}',
    ],
)
async def test_bad_control_json_is_400_and_changes_nothing(mock: Any, body: bytes) -> None:
    client, app = mock
    before = app.knobs
    response = await client.post("/test-control", content=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"]
    assert app.knobs == before


def test_apply_control_is_pure_and_clears_with_null() -> None:
    defaults = Knobs(tokens=4)
    knobs, reset = apply_control({"fail_next": {"count": 2}}, defaults, defaults)
    assert (knobs.fail_next.count, knobs.fail_next.status, reset) == (2, 503, False)
    assert defaults.fail_next.count == 0
    cleared, _ = apply_control({"fail_next": None, "drop_mid_stream": None}, knobs, defaults)
    assert cleared == defaults
    with pytest.raises(ControlError, match="unknown"):
        apply_control({"nope": 1}, defaults, defaults)


# ------------------------------------------------------------------ clients and process


async def test_openai_client_chat_plain_and_streamed(mock: Any) -> None:
    openai = pytest.importorskip("openai")
    client, _ = mock
    base_url = str(client.base_url).rstrip("/") + "/v1"
    async with openai.AsyncOpenAI(api_key="unused", base_url=base_url, max_retries=0) as sdk:
        completion = await sdk.chat.completions.create(
            model="mock-model", messages=CHAT["messages"], max_tokens=5
        )
        assert completion.choices[0].message.content == answer_text(5)
        assert completion.usage is not None and completion.usage.completion_tokens == 5
        stream = await sdk.chat.completions.create(
            model="mock-model",
            messages=CHAT["messages"],
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async with stream:
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if chunk.usage is not None:
                    usage = chunk.usage
        assert text == answer_text(16)
        assert usage is not None and usage.total_tokens == 21
        embeddings = await sdk.embeddings.create(model="mock-model", input=["a", "b"])
        assert [item.embedding for item in embeddings.data][1] == [1.0, 1.125, -1.25]
        with pytest.raises(openai.BadRequestError):
            await sdk.chat.completions.create(model="nope", messages=CHAT["messages"])


def test_cli_help_names_every_env_var() -> None:
    result = CliRunner().invoke(mock_backend_command, ["--help"])
    assert result.exit_code == 0
    for name in ("HOST", "PORT", "MODEL", "TTFT_MS", "INTER_TOKEN_MS", "TOKENS", "LOG_LEVEL"):
        assert f"STARGATE_MOCK_{name}" in result.output
    result = CliRunner().invoke(mock_backend_command, ["--host", "localhost"])
    assert result.exit_code == 2
    assert "not an IP address" in result.output


def test_process_prints_its_port_serves_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    code = "from stargate.mock.cli import mock_backend_command; mock_backend_command()"
    log_path = tmp_path / "mock.log"
    with (
        log_path.open("wb") as log,
        subprocess.Popen(
            [sys.executable, "-c", code, "--port", "0", "--model", "a,b", "--tokens", "3"],
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, "STARGATE_MOCK_TTFT_MS": "1"},
        ) as process,
    ):
        _check_process(process)
    assert "received SIGTERM" in log_path.read_text()


def _check_process(process: subprocess.Popen[bytes]) -> None:
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode().strip()
        assert line.startswith("listening on http://127.0.0.1:"), line
        base = line.removeprefix("listening on ")
        with httpx.Client(base_url=base, trust_env=False, timeout=5) as client:
            assert client.get("/health").text == "ok"
            assert [model["id"] for model in client.get("/v1/models").json()["data"]] == ["a", "b"]
            snapshot = client.get("/test-control").json()
            assert (snapshot["tokens"], snapshot["ttft_ms"]) == (3, 1.0)
            client.post("/test-control", json={"inter_token_ms": 50, "tokens": 6})
            body = {**CHAT, "model": "b", "stream": True}
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                # SIGTERM: no new connections, but the stream in flight finishes.
                started = time.monotonic()
                process.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            assert len(rest) == 8  # 6 tokens, stop chunk, [DONE]
            # The idle keep-alive connection left behind does not hold up the exit.
            assert process.wait(timeout=5) == 0
            assert time.monotonic() - started < 2
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
