"""Loading comments, the pure parts and the stream (stargate/proxy/loading.py; docs/clients.md,
"Held streaming requests"): the head, the comment and its ETA, the final comment, the error
event, how a streaming request is recognised, and the comments' timing under a mock clock."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from stargate.asgi import BODY_FOLLOWS, ASGIMessage
from stargate.proxy.contract import ContractError
from stargate.proxy.loading import (
    DONE,
    HEAD_GRACE,
    AfterHead,
    LoadingStream,
    error_event,
    eta_text,
    final_comment,
    is_streaming,
    loading_comment,
    loading_head,
    upstream_error,
)
from stargate.proxy.server_timing import server_timing

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def _event_data(event: bytes) -> list[str]:
    """The `data:` values of an SSE text, in order."""
    return [line[6:] for line in event.decode().split("\n") if line.startswith("data: ")]


# ---- pure parts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "unknown"),
        (float("nan"), "unknown"),
        (float("inf"), "unknown"),
        (0.0, "0s"),
        (-3.0, "0s"),  # an overdue estimate is never negative
        (0.2, "1s"),  # rounded up: not "0s" while something is still left
        (11.0, "11s"),
        (11.01, "12s"),
        (59.9, "60s"),
    ],
)
def test_the_eta_is_whole_seconds_rounded_up_or_unknown(seconds: float | None, text: str) -> None:
    assert eta_text(seconds) == text


def test_a_loading_comment_is_one_sse_comment_line_then_a_blank_line() -> None:
    assert loading_comment("qwen-7b", 11.3) == b": loading model qwen-7b eta 12s\n\n"
    assert loading_comment("m", None) == b": loading model m eta unknown\n\n"
    # A model id is client input: a line break in it cannot end the comment early.
    assert loading_comment("a\nb\r: x", 1) == b": loading model a?b?: x eta 1s\n\n"


def test_the_head_is_an_unbuffered_event_stream() -> None:
    assert loading_head() == [
        (b"content-type", b"text/event-stream"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
    ]
    assert loading_head("gen-1")[-1] == (b"x-request-id", b"gen-1")


@pytest.mark.parametrize(
    ("body", "streaming"),
    [
        (CHAT[:-1] + b', "stream": true}', True),
        (CHAT[:-1] + b', "stream" : true }', True),
        (CHAT[:-1] + b', "stream": false}', False),
        (CHAT[:-1] + b', "stream": "true"}', False),
        (CHAT[:-1] + b', "stream": 1}', False),
        (CHAT[:-1] + b', "stream": true, "stream": false}', False),  # the last one counts
        (CHAT[:-1] + b', "options": {"stream": true}}', False),  # not at the top level
        (CHAT[:-1] + b', "str\\u0065am": true}', True),  # however the key is escaped
        (CHAT, False),  # no "stream"
        (b'{"stream": true', False),  # not JSON: never a loading stream
        (b"", False),
        ('{"stream": true}'.encode("utf-16"), True),  # the json.loads path
    ],
)
def test_a_request_streams_when_its_top_level_stream_is_true(body: bytes, streaming: bool) -> None:
    assert is_streaming(body) is streaming
    assert is_streaming(bytearray(body)) is streaming


def test_the_final_comment_carries_the_timings_and_the_backend() -> None:
    timing = server_timing(1.5, 1.25, 0.0104)
    assert timing == b"hold;dur=1500.0, swap;dur=1250.0, upstream;dur=10.4"
    assert final_comment(timing, ("b-1", "c-1")) == (
        b": server-timing hold;dur=1500.0, swap;dur=1250.0, upstream;dur=10.4\n"
        b": x-inference-server-id b-1\n: x-stargate-cluster-id c-1\n\n"
    )
    assert final_comment(timing) == b": server-timing " + timing + b"\n\n"
    assert server_timing(-0.001, 0, 0) == b"hold;dur=0.0, swap;dur=0.0, upstream;dur=0.0"


def test_the_error_event_is_the_openai_error_document_then_done() -> None:
    error = ContractError(502, message="model pool gpu0 swap failed", code="pool_swap_failed")
    event = error_event(error)
    assert event.endswith(b"\n\n" + DONE)
    data = _event_data(event)
    assert data[1] == "[DONE]"
    assert json.loads(data[0]) == {
        "error": {
            "message": "model pool gpu0 swap failed",
            "type": "server_error",
            "param": None,
            "code": "pool_swap_failed",
        }
    }
    # A bare local error (no message of its own) says what its status means.
    bare = json.loads(_event_data(error_event(ContractError(503)))[0])["error"]
    assert bare["code"] == "unavailable" and bare["message"]


@pytest.mark.parametrize(
    ("status", "body", "message", "code", "kind"),
    [
        (
            400,
            b'{"error": {"message": "too long", "type": "invalid_request_error", "code": "ctx"}}',
            "too long",
            "ctx",
            "invalid_request_error",
        ),
        (
            503,
            b'{"error": "no eligible candidates", "code": "x"}',
            "no eligible candidates",
            "x",
            "server_error",
        ),
        (500, b'{"message": "boom"}', "boom", "upstream_500", "server_error"),
        (
            502,
            b"<html>bad gateway</html>",
            "the upstream answered 502",
            "upstream_502",
            "server_error",
        ),
        (429, b"", "the upstream answered 429", "upstream_429", "invalid_request_error"),
    ],
)
def test_an_upstream_error_keeps_its_message_and_code(
    status: int, body: bytes, message: str, code: str, kind: str
) -> None:
    error = json.loads(_event_data(error_event(upstream_error(status, body)))[0])["error"]
    assert (error["message"], error["code"], error["type"]) == (message, code, kind)


# ---- the stream (I/O), under a mock clock ------------------------------------------------------


class _Recorder:
    """An ASGI send that records (virtual time, message)."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, dict[str, Any]]] = []

    async def __call__(self, message: ASGIMessage) -> None:
        self.sent.append((trio.current_time(), dict(message)))

    @property
    def comments(self) -> list[tuple[float, bytes]]:
        return [
            (at, m["body"])
            for at, m in self.sent
            if m["type"] == "http.response.body" and m["body"].startswith(b": loading")
        ]


STREAM = CHAT[:-1] + b', "stream": true}'


async def test_comments_go_out_after_the_grace_then_every_interval_until_stopped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    send = _Recorder()
    etas = iter([None, 10.0, 5.0, 0.4])
    async with trio.open_nursery() as nursery:
        loading = LoadingStream(send, nursery, "m", STREAM, 5.0, "gen-1")
        await trio.sleep(1.0)
        start = trio.current_time()
        loading.hold(lambda: next(etas))
        await trio.sleep(16.0)  # comments at 0.5, 5.5, 10.5 and 15.5
        assert await loading.stop()
        stopped = trio.current_time()
    (at, head), *_ = send.sent
    start += HEAD_GRACE
    assert at == start
    assert head["type"] == "http.response.start" and head["status"] == 200
    assert dict(head["headers"])[b"content-type"] == b"text/event-stream"
    assert dict(head["headers"])[b"x-request-id"] == b"gen-1"
    assert head[BODY_FOLLOWS] is True  # head and first comment: one write
    assert send.comments == [
        (start, b": loading model m eta unknown\n\n"),
        (start + 5, b": loading model m eta 10s\n\n"),
        (start + 10, b": loading model m eta 5s\n\n"),
        (start + 15, b": loading model m eta 1s\n\n"),
    ]
    assert stopped == start - HEAD_GRACE + 16  # the sleep toward the next comment: cancelled
    assert all(m.get("more_body") for _, m in send.sent[1:])  # the stream is left open


async def test_a_second_hold_changes_the_eta_source_but_starts_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    send = _Recorder()
    async with trio.open_nursery() as nursery:
        loading = LoadingStream(send, nursery, "m", STREAM, 2.0)
        loading.hold(lambda: 30.0)  # the pool's hold
        await trio.sleep(1.0)
        loading.hold(lambda: 7.0)  # then a routing wait
        await trio.sleep(1.8)  # comments at 0.5 and 2.5
        assert await loading.stop()
    heads = [m for _, m in send.sent if m["type"] == "http.response.start"]
    assert len(heads) == 1
    assert b"x-request-id" not in dict(heads[0]["headers"])  # the client's own id: not known
    assert [body for _, body in send.comments] == [
        b": loading model m eta 30s\n\n",
        b": loading model m eta 7s\n\n",
    ]


async def test_a_request_that_does_not_stream_gets_no_loading_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    send = _Recorder()
    async with trio.open_nursery() as nursery:
        loading = LoadingStream(send, nursery, "m", CHAT, 1.0)
        loading.hold(lambda: 3.0)
        await trio.sleep(5.0)
        assert not await loading.stop()
    assert send.sent == []


async def test_a_request_never_held_sends_nothing(autojump_clock: trio.testing.MockClock) -> None:
    send = _Recorder()
    async with trio.open_nursery() as nursery:
        loading = LoadingStream(send, nursery, "m", STREAM, 1.0)
        await trio.sleep(5.0)
        assert not await loading.stop()
        loading.hold(lambda: 1.0)  # too late: the answer went out without it
        await trio.sleep(5.0)
    assert send.sent == []


async def test_a_hold_that_ends_within_the_grace_sends_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A routing wait of a few milliseconds keeps the engine's own head."""
    send = _Recorder()
    async with trio.open_nursery() as nursery:
        loading = LoadingStream(send, nursery, "m", STREAM, 1.0)
        loading.hold(lambda: None)
        await trio.sleep(HEAD_GRACE * 0.9)
        started = trio.current_time()
        assert not await loading.stop()
        assert trio.current_time() == started  # the grace's sleep was cancelled at once
        loading.hold(lambda: None)  # a later hold of the same request starts nothing
        await trio.sleep(5.0)
    assert send.sent == []


async def test_stopped_before_its_task_ran_a_stream_sends_nothing() -> None:
    send = _Recorder()
    async with trio.open_nursery() as nursery:
        loading = LoadingStream(send, nursery, "m", STREAM, 1.0)
        loading.hold(lambda: None)
        assert not await loading.stop()
    assert send.sent == []


async def test_without_a_grace_the_head_goes_out_even_if_stopped_before_the_task_ran() -> None:
    send = _Recorder()
    async with trio.open_nursery() as nursery:
        loading = LoadingStream(send, nursery, "m", STREAM, 1.0, grace=0)
        loading.hold(lambda: None)
        assert await loading.stop()  # waits for the head and the first comment
        assert [m["type"] for _, m in send.sent] == ["http.response.start", "http.response.body"]
    assert len(send.comments) == 1


async def test_the_client_leaving_cancels_the_comments(
    autojump_clock: trio.testing.MockClock,
) -> None:
    send = _Recorder()
    with trio.CancelScope() as gone:
        async with trio.open_nursery() as nursery:
            loading = LoadingStream(send, nursery, "m", STREAM, 1.0)
            loading.hold(lambda: None)
            await trio.sleep(2.7)
            gone.cancel()
            await trio.sleep_forever()
    assert gone.cancelled_caught
    assert len(send.comments) == 3  # at 0.5, 1.5 and 2.5; nothing after the cancel


# ---- after the head: a relayed answer ----------------------------------------------------------


async def test_after_head_drops_the_answers_head_and_passes_a_2xx_body() -> None:
    send = _Recorder()
    after = AfterHead(send, b": server-timing x\n\n")
    await after({"type": "http.response.start", "status": 200, "headers": []})
    await after({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    await after({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    assert [m for _, m in send.sent] == [
        {
            "type": "http.response.body",
            "body": b": server-timing x\n\ndata: 1\n\n",
            "more_body": True,
        },
        {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False},
    ]


async def test_after_head_turns_an_error_answer_into_the_error_event() -> None:
    send = _Recorder()
    after = AfterHead(send)
    await after({"type": "http.response.start", "status": 503, "headers": []})
    await after(
        {"type": "http.response.body", "body": b'{"error": {"message": "mo', "more_body": True}
    )
    await after({"type": "http.response.body", "body": b'ved", "code": "pool_owner_moved"}}'})
    ((_, message),) = send.sent
    assert message.get("more_body", False) is False
    data = _event_data(message["body"])
    assert data[1] == "[DONE]"
    error = json.loads(data[0])["error"]
    assert (error["message"], error["code"]) == ("moved", "pool_owner_moved")
