"""The Pylon's hop (`PylonHop.forward` and its header helpers) and the ASGI listener in front of it,
against a fake engine in virtual time (docs/pylon-data-path.md, "One request").

The engine is a fake `ConnectionPool` whose answers are a head and then body chunks with virtual
delays between them; the replica's side is a recording `ResponseSink` (or, for the listener, lists
of ASGI messages). The stats are a real `StatsAggregator` that also keeps the trackers it creates,
so each test can read both the published `ModelStats` and the request's phase.
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import pytest
import trio
from trio.testing import MockClock

from stargate.asgi import BODY_FOLLOWS, DISCONNECT_HOOK, BodyTooLarge, DisconnectHook
from stargate.http_headers import Headers, first_header
from stargate.pylon.hop import (
    HopConfig,
    PylonHop,
    PylonRequest,
    StreamAborted,
    response_headers,
    retry_after_ms,
    upstream_headers,
)
from stargate.pylon.listener import PylonApp
from stargate.pylon.stats.admission import AdmissionConfig
from stargate.pylon.stats.aggregator import StatsAggregator, StatsConfig
from stargate.pylon.stats.observer import Endpoint, Phase, RequestTracker
from stargate.routing.stats import ModelStats
from stargate.upstream import (
    ConnectError,
    ConnectionPool,
    ConnectionPoolTimeout,
    ResponseHeadTimeout,
    UpstreamError,
    UpstreamProtocolError,
)

MODEL = "model-a"
ENGINE = "http://engine:8000"
CHAT = "/v1/chat/completions"
MIB = 1024 * 1024
PROBLEM = b"application/problem+json"
SSE: Headers = [(b"content-type", b"text/event-stream")]
JSON: Headers = [(b"content-type", b"application/json")]
DONE = b"data: [DONE]\n\n"
CREATED = b'event: response.created\ndata: {"type":"response.created"}\n\n'


def delta(text: str) -> bytes:
    """One chat stream event carrying `text` (its words are its tokens by the estimate)."""
    chunk = {"choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


# ---- the fake engine ---------------------------------------------------------------------------

Step = tuple[float, bytes | UpstreamError]
"""One piece of an engine body: after `delay` virtual seconds, a chunk (or a failure)."""


class FakeResponse:
    """An engine answer, duck-typed like `UpstreamResponse`: its head at once, then its body as
    steps. Chunks without a delay arrived with the head (`take_buffered` returns them); `complete`
    turns true when the last chunk is handed out, as the real one does."""

    def __init__(
        self, status: int = 200, headers: Headers | None = None, body: Sequence[Step] | bytes = b""
    ) -> None:
        self.status = status
        self.headers: Headers = list(headers if headers is not None else JSON)
        self._steps: list[Step] = [(0.0, body)] if isinstance(body, bytes) and body else []
        if not isinstance(body, bytes):
            self._steps = list(body)
        self.complete = False
        self.closed = False

    def take_buffered(self) -> bytes | None:
        arrived: list[bytes] = []
        while self._steps and self._steps[0][0] == 0:
            item = self._steps[0][1]
            if not isinstance(item, bytes):
                break
            arrived.append(item)
            self._steps.pop(0)
        self.complete = not self._steps
        return b"".join(arrived) if arrived else None

    def aiter_bytes(self) -> FakeResponse:
        return self

    def __aiter__(self) -> FakeResponse:
        return self

    async def __anext__(self) -> bytes:
        if not self._steps:
            self.complete = True
            raise StopAsyncIteration
        delay, item = self._steps.pop(0)
        await trio.sleep(delay)
        if isinstance(item, UpstreamError):
            raise item
        self.complete = not self._steps
        return item

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    async def aclose(self) -> None:
        self.closed = True
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> FakeResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@dataclass(frozen=True)
class Sent:
    """One request as the engine received it."""

    method: str
    url: str
    headers: Headers
    body: bytes


class FakePool:
    """A `ConnectionPool` stand-in: records each request and answers it with `respond` (which
    returns a response or raises an `UpstreamError`)."""

    def __init__(self, respond: Callable[[Sent], FakeResponse]) -> None:
        self._respond = respond
        self.sent: list[Sent] = []
        self.responses: list[FakeResponse] = []

    async def request(
        self, method: str, url: str, headers: Headers, body: bytes = b""
    ) -> FakeResponse:
        sent = Sent(method, url, list(headers), bytes(body))
        self.sent.append(sent)
        await trio.lowlevel.checkpoint()
        response = self._respond(sent)
        self.responses.append(response)
        return response


def answering(*responses: FakeResponse | UpstreamError) -> FakePool:
    """A pool whose engine gives these answers, in order."""
    queue = list(responses)

    def respond(_: Sent) -> FakeResponse:
        answer = queue.pop(0)
        if isinstance(answer, UpstreamError):
            raise answer
        return answer

    return FakePool(respond)


# ---- the replica's side ------------------------------------------------------------------------


class RecordingStats(StatsAggregator):
    """A real aggregator serving MODEL that also keeps every tracker it creates."""

    def __init__(self, config: StatsConfig | None = None) -> None:
        super().__init__(config or StatsConfig(), lambda: 1_700_000_000_000)
        self.set_models([MODEL])
        self.trackers: list[RequestTracker] = []

    def track(self, **kwargs: Any) -> RequestTracker:
        tracker = super().track(**kwargs)
        self.trackers.append(tracker)
        return tracker

    @property
    def only(self) -> RequestTracker:
        (tracker,) = self.trackers
        return tracker

    def now(self) -> ModelStats:
        return self.snapshot(MODEL, trio.current_time())


class Sink:
    """A `ResponseSink` that records the head and every body piece with its virtual time."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: Headers = []
        self.body_follows: bool | None = None
        self.sends: list[tuple[float, bytes, bool]] = []

    async def start(self, status: int, headers: Headers, *, body_follows: bool) -> None:
        assert self.status is None, "a second head"
        self.status, self.headers, self.body_follows = status, list(headers), body_follows

    async def send(self, data: bytes, *, more: bool) -> None:
        assert self.status is not None, "body before the head"
        assert not self.ended, "body after the end"
        self.sends.append((trio.current_time(), data, more))

    @property
    def body(self) -> bytes:
        return b"".join(data for _, data, _ in self.sends)

    @property
    def ended(self) -> bool:
        """The answer was ended properly (a last piece with more=False)."""
        return bool(self.sends) and not self.sends[-1][2]

    def header(self, name: bytes) -> bytes | None:
        return first_header(self.headers, name)

    def problem(self) -> dict[str, Any]:
        assert self.header(b"content-type") == PROBLEM
        assert self.header(b"content-length") == str(len(self.body)).encode()
        document: dict[str, Any] = json.loads(self.body)
        return document


class Body:
    """The listener's body reader: records the limits it was asked for."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.limits: list[int] = []

    async def __call__(self, limit: int) -> bytes:
        self.limits.append(limit)
        if len(self.data) > limit:
            raise BodyTooLarge
        return self.data


def tunnel(
    *,
    request_id: str | None = "r1",
    model: str | None = MODEL,
    input_tokens: str | None = "100",
    priority: str | None = None,
) -> Headers:
    headers: Headers = []
    for name, value in (
        (b"x-request-id", request_id),
        (b"x-model", model),
        (b"x-input-tokens", input_tokens),
        (b"x-priority", priority),
    ):
        if value is not None:
            headers.append((name, value.encode()))
    return headers


def make_hop(
    pool: FakePool,
    stats: StatsAggregator | None = None,
    *,
    pending: Callable[[str], bool] = lambda model: False,
    **config: Any,
) -> PylonHop:
    return PylonHop(
        HopConfig(ENGINE, **config),
        cast(ConnectionPool, pool),
        stats if stats is not None else RecordingStats(),
        pending=pending,
    )


async def forward(
    hop: PylonHop,
    *,
    method: str = "POST",
    path: str = CHAT,
    query: bytes = b"",
    headers: Headers | None = None,
    body: bytes = b'{"stream": true}',
    sink: Sink | None = None,
) -> tuple[Sink, Body]:
    sink = sink if sink is not None else Sink()
    reader = Body(body)
    request = PylonRequest(method, path, query, tunnel() if headers is None else headers)
    await hop.forward(request, reader, sink)
    return sink, reader


# ---- refusals before the engine ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "detail"),
    [
        (tunnel(request_id=None), "missing required x-request-id header"),
        (tunnel(request_id="  "), "missing required x-request-id header"),
        (tunnel(model=None), "missing required x-model header"),
        (tunnel(model=""), "missing required x-model header"),
        (tunnel(input_tokens=None), "missing required x-input-tokens header"),
        (tunnel(input_tokens="-1"), "invalid x-input-tokens header"),
        (tunnel(input_tokens="12k"), "invalid x-input-tokens header"),
        (tunnel(input_tokens=str(2**64)), "invalid x-input-tokens header"),
        (tunnel(priority="high"), "invalid x-priority header"),
        (tunnel(priority=str(2**32)), "invalid x-priority header"),
    ],
)
async def test_a_bad_tunnel_header_is_a_400_before_the_body_is_read(
    headers: Headers, detail: str
) -> None:
    """Step 2: each of the five 400s, as a problem document naming the header; the body is never
    read and the engine never asked."""
    pool = answering()
    sink, body = await forward(make_hop(pool), headers=headers)
    assert sink.status == 400
    assert sink.problem() == {
        "type": "about:blank",
        "title": "Bad Request",
        "status": 400,
        "detail": detail,
    }
    assert sink.body_follows is True and sink.ended
    assert body.limits == [] and pool.sent == []


async def test_the_largest_tunnel_values_are_accepted() -> None:
    """Step 2's bounds: x-input-tokens up to u64 max and x-priority up to u32 max pass."""
    pool = answering(FakeResponse(200, JSON, b"{}"))
    headers = tunnel(input_tokens=str(2**64 - 1), priority=str(2**32 - 1))
    sink, _ = await forward(make_hop(pool), headers=headers, body=b"{}")
    assert sink.status == 200 and len(pool.sent) == 1


async def test_a_model_still_calibrating_is_a_retryable_503() -> None:
    """Step 3: a known but not admitted model: 503 `model_generation_unavailable`, retryable,
    before the body is read."""
    pool = answering()
    hop = make_hop(pool, pending=lambda model: model == MODEL)
    sink, body = await forward(hop)
    assert sink.status == 503
    assert sink.header(b"x-stargate-retryable") == b"true"
    assert sink.header(b"x-stargate-retry-reason") == b"model_generation_unavailable"
    assert sink.problem()["detail"] == f"model {MODEL} is not admitted yet (calibrating)"
    assert body.limits == [] and pool.sent == []


async def test_a_body_over_64_mib_is_a_413() -> None:
    """Step 4: the body is read with the 64 MiB limit; past it, 413 and no engine request."""
    pool = answering()
    sink, body = await forward(make_hop(pool), body=b" " * (64 * MIB + 1))
    assert body.limits == [64 * MIB]
    assert sink.status == 413
    assert sink.problem()["detail"] == "request body too large"
    assert pool.sent == []


async def test_a_body_that_is_not_json_is_a_400() -> None:
    """Step 4: the body must be JSON."""
    pool = answering()
    sink, _ = await forward(make_hop(pool), body=b"{not json")
    assert sink.status == 400
    assert sink.problem()["detail"] == "request body must be valid JSON"
    assert pool.sent == []


@pytest.mark.parametrize("path", [CHAT, "/v1/responses"])
async def test_require_streaming_refuses_a_non_streaming_chat_with_the_rust_400(path: str) -> None:
    """Deviations: with `--require-streaming`, chat and Responses must set stream=true."""
    pool = answering()
    sink, _ = await forward(make_hop(pool, require_streaming=True), path=path, body=b"{}")
    assert sink.status == 400
    assert sink.problem()["detail"] == f"{path} requests must set stream=true"
    assert pool.sent == []


@pytest.mark.parametrize(
    ("require", "path", "body"),
    [
        (False, CHAT, b'{"stream": false}'),  # the default serves non-streaming chat
        (False, "/v1/responses", b"{}"),
        (True, CHAT, b'{"stream": true}'),
        (True, "/v1/embeddings", b'{"input": "x"}'),  # only chat and Responses must stream
    ],
)
async def test_require_streaming_lets_these_through(require: bool, path: str, body: bytes) -> None:
    """Deviations: non-streaming chat is served by default; the flag only concerns chat and
    Responses requests that do not stream."""
    pool = answering(FakeResponse(200, JSON, b'{"usage": {"completion_tokens": 1}}'))
    sink, _ = await forward(make_hop(pool, require_streaming=require), path=path, body=body)
    assert sink.status == 200 and len(pool.sent) == 1


# ---- what the engine gets ----------------------------------------------------------------------

DROPPED: Headers = [
    (b"host", b"pylon:9000"),
    (b"connection", b"keep-alive, x-hop-option"),
    (b"x-hop-option", b"1"),
    (b"keep-alive", b"timeout=5"),
    (b"transfer-encoding", b"chunked"),
    (b"te", b"trailers"),
    (b"upgrade", b"h2c"),
    (b"proxy-connection", b"keep-alive"),
    (b"content-length", b"17"),
    (b"x-method", b"POST"),
    (b"x-path", b"/v1/chat/completions"),
    (b"x-stargate-expected-queue-ms", b"100000"),
    (b"x-stargate-upstream-retryable", b"true"),
    (b"x-stargate-retryable", b"true"),
    (b"x-stargate-retry-reason", b"spoofed"),
    (b"x-stargate-retry-after-ms", b"1"),
    (b"x-dynamo-request-priority", b"9999"),
    (b"x-dynamo-request-strict-priority", b"1"),
]
KEPT: Headers = [
    *tunnel(priority="100"),
    (b"authorization", b"Bearer t"),
    (b"content-type", b"application/json"),
    (b"x-custom", b"a"),
    (b"x-custom", b"b"),
]


async def test_the_engine_gets_the_request_minus_the_hop_and_stargate_headers() -> None:
    """Step 7: hop-by-hop (and those `connection` names), host, x-method, x-path, the expected
    queue, the retry controls and inbound Dynamo priorities are dropped; everything else passes
    in order, then Dynamo's priority headers; the path and query are kept."""
    pool = answering(FakeResponse(200, JSON, b"{}"))
    headers = [*DROPPED[:9], *KEPT[:4], *DROPPED[9:], *KEPT[4:]]
    await forward(make_hop(pool), path="/v1/chat/completions", query=b"a=1&b=2", headers=headers)
    (sent,) = pool.sent
    assert sent.method == "POST"
    assert sent.url == ENGINE + "/v1/chat/completions?a=1&b=2"
    assert sent.body == b'{"stream": true}'
    assert sent.headers == [
        *KEPT,
        (b"x-dynamo-request-priority", b"3500"),
        (b"x-dynamo-request-strict-priority", b"0"),
    ]


@pytest.mark.parametrize(
    ("priority", "ceiling", "dynamo"),
    [
        (None, 3600, b"0"),  # no x-priority: the least urgent for Dynamo
        ("0", 3600, b"3600"),  # the most urgent
        ("100", 3600, b"3500"),
        ("3600", 3600, b"0"),
        ("5000", 3600, b"0"),  # over the ceiling: clamped
        ("3", 10, b"7"),  # --pylon-priority-ceiling
    ],
)
def test_dynamo_priority_is_the_ceiling_minus_the_stargate_priority(
    priority: str | None, ceiling: int, dynamo: bytes
) -> None:
    """Step 7: x-dynamo-request-priority = ceiling - min(x-priority, ceiling); absent -> 0."""
    parsed = None if priority is None else int(priority)
    out = upstream_headers(
        tunnel(priority=priority),
        priority=parsed,
        config=HopConfig(ENGINE, priority_ceiling=ceiling),
    )
    assert first_header(out, b"x-dynamo-request-priority") == dynamo
    assert first_header(out, b"x-dynamo-request-strict-priority") == b"0"


def test_the_none_backend_writes_no_dynamo_headers() -> None:
    """Step 7: `--pylon-upstream-backend none`: no Dynamo headers, and inbound ones still go."""
    headers = [*tunnel(priority="5"), (b"x-dynamo-request-priority", b"9")]
    out = upstream_headers(headers, priority=5, config=HopConfig(ENGINE, upstream_backend="none"))
    assert out == tunnel(priority="5")


# ---- /health -----------------------------------------------------------------------------------


async def test_health_is_relayed_to_the_first_path_that_is_not_404() -> None:
    """Step 1: /health goes to each health path in turn, the query kept, until one is not 404;
    no tunnel headers needed, nothing observed, the answer relayed whole."""
    stats = RecordingStats()

    def respond(sent: Sent) -> FakeResponse:
        if sent.url.startswith(ENGINE + "/health?"):
            return FakeResponse(404, [], b"no")
        return FakeResponse(200, [(b"content-type", b"text/plain")], b"ready")

    pool = FakePool(respond)
    sink, body = await forward(make_hop(pool, stats), method="GET", path="/health", query=b"x=1")
    assert [s.url for s in pool.sent] == [
        ENGINE + "/health?x=1",
        ENGINE + "/v1/health/ready?x=1",
    ]
    assert sink.status == 200 and sink.body == b"ready" and sink.ended
    assert sink.body_follows is True
    assert body.limits == [] and stats.trackers == []


async def test_health_relays_the_first_answer_that_is_not_404() -> None:
    """Step 1: a 503 from the first health path is the answer (not a reason to try the next)."""
    pool = answering(FakeResponse(503, [], b"starting"))
    sink, _ = await forward(make_hop(pool), method="GET", path="/health", headers=[])
    assert [s.url for s in pool.sent] == [ENGINE + "/health"]
    assert sink.status == 503 and sink.body == b"starting"


# ---- engine failures and the engine's head -----------------------------------------------------


@pytest.mark.parametrize("error", [ConnectError("refused"), ConnectionPoolTimeout("no slot")])
@pytest.mark.parametrize("retryable", [False, True])
async def test_an_engine_that_cannot_be_reached_is_a_503(
    error: UpstreamError, retryable: bool
) -> None:
    """Step 8: `local_connect_failure`, final unless `--pylon-local-connect-failures-retryable`."""
    hop = make_hop(answering(error), local_connect_failures_retryable=retryable)
    sink, _ = await forward(hop)
    assert sink.status == 503
    assert sink.header(b"x-stargate-retryable") == (b"true" if retryable else b"false")
    assert sink.header(b"x-stargate-retry-reason") == b"local_connect_failure"
    assert sink.problem()["detail"] == "local upstream connection failed"


@pytest.mark.parametrize(
    "error",
    [
        UpstreamProtocolError("reset before the head", request_sent=True),
        ResponseHeadTimeout("no head", request_sent=True),
    ],
)
async def test_another_engine_failure_before_the_head_is_a_502(error: UpstreamError) -> None:
    """Step 8: any other failure before the response head is a 502 problem, not retryable."""
    sink, _ = await forward(make_hop(answering(error)))
    assert sink.status == 502
    assert sink.problem()["detail"] == f"local upstream request failed: {error}"
    assert sink.header(b"x-stargate-retryable") is None


async def test_an_engine_failure_before_the_head_ends_the_request_failed() -> None:
    """Step 11: "anything else failed; the replica going away cancelled"."""
    stats = RecordingStats()
    await forward(make_hop(answering(ConnectError("refused")), stats))
    assert stats.only.phase is Phase.FAILED


SPOOFED: Headers = [
    (b"x-stargate-retryable", b"true"),
    (b"x-stargate-retry-reason", b"spoofed"),
    (b"x-stargate-retry-after-ms", b"99999"),
]


@pytest.mark.parametrize("status", [429, 503])
async def test_an_engine_rejection_marked_retryable_is_retryable_for_the_replica(
    status: int,
) -> None:
    """Step 9: a 429/503 with `x-stargate-upstream-retryable: true` becomes
    `upstream_admission_rejected` with the Retry-After seconds in ms; the engine's own retry
    headers (and the marker) are dropped, its other headers kept."""
    engine_headers = [
        (b"x-stargate-upstream-retryable", b"True "),
        (b"retry-after", b"3"),
        *SPOOFED,
        (b"x-engine", b"e1"),
    ]
    pool = answering(FakeResponse(status, engine_headers, b"busy"))
    sink, _ = await forward(make_hop(pool))
    assert sink.status == status
    assert sink.headers == [
        (b"x-stargate-retryable", b"true"),
        (b"x-stargate-retry-reason", b"upstream_admission_rejected"),
        (b"x-stargate-retry-after-ms", b"3000"),
        (b"retry-after", b"3"),
        (b"x-engine", b"e1"),
    ]
    assert sink.body == b"busy"


async def test_an_http_date_retry_after_is_converted_to_ms() -> None:
    """Step 9: Retry-After as an HTTP date (an hour ahead of the wall clock) -> ms until then."""
    date = email.utils.formatdate(time.time() + 3600, usegmt=True).encode()
    headers = [(b"x-stargate-upstream-retryable", b"true"), (b"retry-after", date)]
    sink, _ = await forward(make_hop(answering(FakeResponse(503, headers, b""))))
    after = sink.header(b"x-stargate-retry-after-ms")
    assert after is not None and 3_590_000 <= int(after) <= 3_601_000


@pytest.mark.parametrize(
    ("status", "marker"),
    [(200, b"true"), (429, None), (429, b"false"), (500, b"true"), (502, b"true")],
)
def test_an_engine_cannot_spoof_a_retry(status: int, marker: bytes | None) -> None:
    """Step 9: without the marker on a 429/503 nothing is retryable, and the engine's own
    `x-stargate-retryable`, `-retry-reason` and `-retry-after-ms` never pass."""
    headers = [*SPOOFED, (b"content-type", b"text/plain")]
    if marker is not None:
        headers.append((b"x-stargate-upstream-retryable", marker))
    assert response_headers(status, headers, now_unix=0.0) == [(b"content-type", b"text/plain")]


def test_a_retryable_rejection_without_retry_after_gets_no_delay() -> None:
    """Step 9: no Retry-After, no `x-stargate-retry-after-ms` (the engine's spoofed one dropped)."""
    headers = [(b"x-stargate-upstream-retryable", b"true"), *SPOOFED]
    assert response_headers(429, headers, now_unix=0.0) == [
        (b"x-stargate-retryable", b"true"),
        (b"x-stargate-retry-reason", b"upstream_admission_rejected"),
    ]


def test_hop_by_hop_response_headers_are_dropped() -> None:
    """The engine's hop-by-hop headers (and those its `connection` names) are not relayed."""
    headers = [
        (b"connection", b"close, x-private"),
        (b"x-private", b"1"),
        (b"transfer-encoding", b"chunked"),
        (b"keep-alive", b"timeout=5"),
        (b"content-type", b"application/json"),
    ]
    assert response_headers(200, headers, now_unix=0.0) == [(b"content-type", b"application/json")]


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        (None, None),
        (b"3", 3000),
        (b" 0 ", 0),
        (b"Wed, 21 Oct 2015 07:28:20 GMT", 20_000),  # 20 s after `now`
        (b"Wed, 21 Oct 2015 07:27:00 GMT", 0),  # already past
        (b"soon", None),
        (b"-5", None),
    ],
)
def test_retry_after_in_seconds_or_as_an_http_date(value: bytes | None, ms: int | None) -> None:
    """Step 9: `Retry-After` is delta seconds or an HTTP date; anything else gives no delay."""
    now = email.utils.parsedate_to_datetime("Wed, 21 Oct 2015 07:28:00 GMT").timestamp()
    assert retry_after_ms(value, now) == ms


# ---- the SSE relay -----------------------------------------------------------------------------


async def test_an_sse_answer_is_relayed_byte_for_byte(autojump_clock: MockClock) -> None:
    """Step 10: events sent on unchanged whatever the engine's chunking (CRLF events, comments,
    an unterminated tail), and the answer ended properly."""
    stream = (
        delta("one two")
        + b": keep-alive\r\n\r\n"
        + delta("three").replace(b"\n", b"\r\n")
        + DONE
        + b"data: no blank line"
    )
    steps: list[Step] = [(0.5, stream[i : i + 7]) for i in range(0, len(stream), 7)]
    sink, _ = await forward(make_hop(answering(FakeResponse(200, SSE, steps))))
    assert sink.status == 200 and sink.headers == SSE and sink.body_follows is False
    assert sink.body == stream
    assert sink.ended


async def test_the_bytes_go_on_as_they_arrive(autojump_clock: MockClock) -> None:
    """Step 10: every read goes to the replica at once, the part of an event included (nothing
    waits for an event's end), and the last one ends the answer."""
    first, second = delta("a"), delta("b")
    steps: list[Step] = [(1, first[:5]), (1, first[5:]), (8, second)]
    start = trio.current_time()
    sink, _ = await forward(make_hop(answering(FakeResponse(200, SSE, steps))))
    assert [(at - start, data, more) for at, data, more in sink.sends] == [
        (1, first[:5], True),
        (2, first[5:], True),
        (10, second, False),
    ]


async def test_output_events_are_counted_and_timed(autojump_clock: MockClock) -> None:
    """Step 10 and "Input samples": a non-output event does not end the input phase, each output
    event counts its words, and five completed requests publish input tokens / time to the first
    output (100 / 2 s) and output tokens / time after the first token (6 / 2 s)."""
    stats = RecordingStats()
    for number in range(5):
        steps: list[Step] = [
            (1, b": warming up\n\n"),
            (1, delta("a b")),
            (1, delta("c d")),
            (1, delta("e f")),
            (0, DONE),
        ]
        pool = answering(FakeResponse(200, SSE, steps))
        await forward(make_hop(pool, stats), headers=tunnel(request_id=f"r{number}"))
    assert [t.output_tokens for t in stats.trackers] == [6] * 5
    assert all(t.phase is Phase.COMPLETE for t in stats.trackers)
    snapshot = stats.now()
    assert snapshot.last_mean_input_tps == pytest.approx(50.0)
    assert snapshot.max_output_tps == pytest.approx(3.0)
    assert snapshot.output_tps == pytest.approx(3.0)
    assert snapshot.num_running_queries == 0


async def test_the_request_moves_to_output_generation_at_its_first_output_event(
    autojump_clock: MockClock,
) -> None:
    """Steps 9-10: head -> input processing; `response.created` is not output; the first delta
    moves the request to output generation."""
    stats = RecordingStats()
    steps: list[Step] = [(1, CREATED), (2, delta("hi")), (2, DONE)]
    hop = make_hop(answering(FakeResponse(200, SSE, steps)), stats)
    phases: list[tuple[int, int, int]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: forward(hop, path="/v1/responses"))
        for pause in (1.5, 2, 2):
            await trio.sleep(pause)  # t = 1.5 (after created), 3.5 (after the delta), 5.5 (ended)
            snapshot = stats.now()
            phases.append(
                (
                    snapshot.input_processing_queries,
                    snapshot.output_generation_queries,
                    snapshot.num_running_queries,
                )
            )
    assert phases == [(1, 0, 1), (0, 1, 1), (0, 0, 0)]


@pytest.mark.parametrize("path", ["/v1/responses", CHAT])
async def test_done_and_response_created_are_not_output(
    autojump_clock: MockClock, path: str
) -> None:
    """Step 10 and "Deviations": a stream of only `response.created` and `[DONE]` (and an empty
    event) has no output: relayed whole, the request failed, no first output."""
    stats = RecordingStats()
    stream = CREATED + b"data:\n\n" + DONE
    pool = answering(FakeResponse(200, SSE, [(1, stream)]))
    sink, _ = await forward(make_hop(pool, stats), path=path)
    assert sink.body == stream and sink.ended
    assert stats.only.phase is Phase.FAILED
    assert stats.only.to_first_output is None


@pytest.mark.parametrize(
    "steps",
    [
        [(31.0, delta("late"))],
        # keep-alive comments are bytes, not output: they do not hold the stream open
        [(10.0, b": ping\n\n"), (10.0, b": ping\n\n"), (11.0, delta("late"))],
    ],
)
async def test_no_first_output_within_30_s_cuts_the_stream(
    autojump_clock: MockClock, steps: list[Step]
) -> None:
    """Step 10: the first output must come within 30 s; else StreamAborted (the replica sees a
    broken body, never an ended one), the request failed, the engine connection closed."""
    stats = RecordingStats()
    pool = answering(FakeResponse(200, SSE, steps))
    sink = Sink()
    start = trio.current_time()
    with pytest.raises(StreamAborted, match="first output"):
        await forward(make_hop(pool, stats), sink=sink)
    assert trio.current_time() - start == pytest.approx(30.0)
    assert sink.status == 200 and not sink.ended and delta("late") not in sink.body
    assert stats.only.phase is Phase.FAILED
    assert stats.now().num_running_queries == 0
    assert pool.responses[0].closed


async def test_no_next_output_within_30_s_cuts_the_stream(autojump_clock: MockClock) -> None:
    """Step 10: each next output must come within 30 s of the last one (the cut may come up to
    `DEADLINE_SLACK_SECONDS` later, never earlier)."""
    stats = RecordingStats()
    steps: list[Step] = [(1, delta("first")), (29, b": ping\n\n"), (3, delta("late"))]
    sink = Sink()
    start = trio.current_time()
    with pytest.raises(StreamAborted, match="next output"):
        await forward(make_hop(answering(FakeResponse(200, SSE, steps)), stats), sink=sink)
    assert 31.0 <= trio.current_time() - start <= 32.0
    assert sink.body == delta("first") + b": ping\n\n" and not sink.ended
    assert stats.only.phase is Phase.FAILED


async def test_an_output_29_9_s_after_the_last_is_in_time(autojump_clock: MockClock) -> None:
    """The slack never cuts early: outputs 1 s, then 29.9 s, then 29.9 s apart all pass."""
    stats = RecordingStats()
    steps: list[Step] = [(1.0, delta("a")), (29.9, delta("b")), (29.9, delta("c")), (0.0, DONE)]
    sink, _ = await forward(make_hop(answering(FakeResponse(200, SSE, steps)), stats))
    assert sink.ended and stats.only.phase is Phase.COMPLETE


async def test_outputs_every_20_s_complete(autojump_clock: MockClock) -> None:
    """Step 10: each output restarts the 30 s wait, so a slow but steady stream (80 s) ends."""
    stats = RecordingStats()
    steps: list[Step] = [(20.0, delta("x")) for _ in range(4)]
    steps.append((0.0, DONE))
    sink, _ = await forward(make_hop(answering(FakeResponse(200, SSE, steps)), stats))
    assert sink.ended and sink.body == delta("x") * 4 + DONE
    assert stats.only.phase is Phase.COMPLETE


@pytest.mark.parametrize(("size", "cut"), [(MIB, False), (MIB + 1, True)])
async def test_an_event_over_1_mib_cuts_the_stream(
    autojump_clock: MockClock, size: int, cut: bool
) -> None:
    """Step 10: at most 1 MiB per event (its blank line included), else the stream is cut."""
    stats = RecordingStats()
    event = b"data: " + b"x" * (size - 8) + b"\n\n"
    assert len(event) == size
    pool = answering(FakeResponse(200, SSE, [(1, delta("a")), (1, event), (1, DONE)]))
    sink = Sink()
    if cut:
        with pytest.raises(StreamAborted):
            await forward(make_hop(pool, stats), sink=sink)
        assert sink.body == delta("a") and not sink.ended
        assert stats.only.phase is Phase.FAILED
    else:
        await forward(make_hop(pool, stats), sink=sink)
        assert sink.ended and stats.only.phase is Phase.COMPLETE


@pytest.mark.parametrize(
    ("path", "model", "headers", "phase"),
    [
        (CHAT, MODEL, SSE, Phase.FAILED),  # the SSE relay
        ("/v1/embeddings", MODEL, JSON, Phase.FAILED),  # an observed whole answer
        (CHAT, "unknown-model", SSE, None),  # relayed unobserved
    ],
)
async def test_an_engine_body_that_breaks_cuts_the_stream(
    autojump_clock: MockClock, path: str, model: str, headers: Headers, phase: Phase | None
) -> None:
    """Steps 10-11: an engine body that breaks after the head is StreamAborted, never an ended
    answer, and an observed request failed."""
    stats = RecordingStats()
    broken = UpstreamProtocolError("connection lost mid-body", request_sent=True)
    pool = answering(FakeResponse(200, headers, [(1, delta("a")), (1, broken)]))
    sink = Sink()
    with pytest.raises(StreamAborted, match="mid-body"):
        await forward(make_hop(pool, stats), path=path, headers=tunnel(model=model), sink=sink)
    assert sink.body == delta("a") and not sink.ended
    assert [t.phase for t in stats.trackers] == ([] if phase is None else [phase])


async def test_the_replica_going_away_cancels_the_request(autojump_clock: MockClock) -> None:
    """Step 11 and "Cancellation": cancelling `forward` leaves the request cancelled, the live
    queue empty again and the engine connection closed."""
    stats = RecordingStats()
    pool = answering(FakeResponse(200, SSE, [(1, delta("x")) for _ in range(100)]))
    sink = Sink()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: forward(make_hop(pool, stats), sink=sink))
        await trio.sleep(5.5)
        assert stats.now().num_running_queries == 1
        nursery.cancel_scope.cancel()
    assert stats.only.phase is Phase.CANCELLED
    snapshot = stats.now()
    assert snapshot.num_running_queries == 0 and snapshot.queue_size == 0
    assert pool.responses[0].closed
    assert len(sink.sends) == 5 and not sink.ended


# ---- queue admission ---------------------------------------------------------------------------


def busy_stats() -> RecordingStats:
    """A pinned 1000 tokens/s and 5000 tokens of prompt work already pending (5 s of queue)."""
    stats = RecordingStats(StatsConfig(initial_input_tps=1000.0, pin_input_tps=True))
    stats.track(
        model=MODEL,
        request_id="ahead",
        endpoint=Endpoint.CHAT,
        streaming=True,
        input_tokens=5000,
        priority=0,
        now=0.0,
    )
    return stats


async def test_a_queue_estimate_far_too_low_is_a_retryable_429() -> None:
    """Queue admission: the local queue (5000 ms) exceeds max(100 + 25, ceil(100 x 1.25)):
    429 `queue_estimate_mismatch` with the figures, before the engine; the refused request
    leaves the queue."""
    stats = busy_stats()
    pool = answering()
    hop = make_hop(pool, stats, admission=AdmissionConfig(retry_after_ms=250))
    headers = [*tunnel(), (b"x-stargate-expected-queue-ms", b"100")]
    sink, _ = await forward(hop, headers=headers)
    assert sink.status == 429
    assert sink.header(b"x-stargate-retryable") == b"true"
    assert sink.header(b"x-stargate-retry-reason") == b"queue_estimate_mismatch"
    assert sink.header(b"x-stargate-retry-after-ms") == b"250"
    assert sink.problem() == {
        "type": "about:blank",
        "title": "Too Many Requests",
        "status": 429,
        "detail": "local queue estimate exceeded Stargate routing estimate",
        "reason": "queue_estimate_mismatch",
        "expected_queue_ms": 100,
        "actual_queue_ms": 5000,
        "threshold_ms": 125,
    }
    assert pool.sent == []
    refused = stats.trackers[-1]
    assert refused.rejected and refused.phase is Phase.FAILED
    assert stats.now().queue_size == 1  # only the request ahead


@pytest.mark.parametrize(
    ("expected", "admission"),
    [
        (b"4000", AdmissionConfig()),  # threshold ceil(4000 x 1.25) = 5000: not exceeded
        (None, AdmissionConfig()),  # no header: the replica had no estimate
        (b"soon", AdmissionConfig()),  # not a number
        (b"100", AdmissionConfig(enabled=False)),  # --pylon-queue-mismatch-retry-enabled=false
    ],
)
async def test_these_requests_are_admitted(
    expected: bytes | None, admission: AdmissionConfig
) -> None:
    """Queue admission: forwarded when within the tolerance, without a (readable) header, or
    with the rule turned off."""
    stats = busy_stats()
    pool = answering(FakeResponse(200, JSON, b"{}"))
    headers = tunnel()
    if expected is not None:
        headers.append((b"x-stargate-expected-queue-ms", expected))
    sink, _ = await forward(make_hop(pool, stats, admission=admission), headers=headers)
    assert sink.status == 200 and len(pool.sent) == 1


# ---- what is observed --------------------------------------------------------------------------


async def test_a_non_streamed_answer_records_the_output_tokens_of_its_usage() -> None:
    """Step 10: a successful non-streamed answer's end is its output, with the tokens its
    `usage` reports (not the 3 words of its text)."""
    stats = RecordingStats()
    answer = b'{"choices":[{"message":{"content":"a b c"}}],"usage":{"completion_tokens":7}}'
    pool = answering(FakeResponse(200, JSON, [(0, answer[:20]), (1, answer[20:])]))
    sink, _ = await forward(make_hop(pool, stats), body=b'{"stream": false}')
    assert sink.body == answer and sink.ended
    assert stats.only.streaming is False
    assert stats.only.output_tokens == 7
    assert stats.only.phase is Phase.COMPLETE


async def test_a_non_streamed_error_is_relayed_and_failed() -> None:
    """Step 11: a non-2xx answer is relayed and the request failed, with no output counted."""
    stats = RecordingStats()
    pool = answering(
        FakeResponse(400, JSON, b'{"error": "bad", "usage": {"completion_tokens": 3}}')
    )
    sink, _ = await forward(make_hop(pool, stats), body=b"{}")
    assert sink.status == 400 and sink.ended
    assert stats.only.phase is Phase.FAILED and stats.only.output_tokens == 0


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/completions"]
)
async def test_posts_to_the_observed_paths_are_observed(path: str) -> None:
    """Step 5: POST to the four paths enters the model's live state."""
    stats = RecordingStats()
    pool = answering(FakeResponse(200, JSON, b"{}"))
    await forward(make_hop(pool, stats), path=path, body=b"{}")
    assert [t.request_id for t in stats.trackers] == ["r1"]


@pytest.mark.parametrize(
    ("method", "path", "model"),
    [
        ("POST", "/v1/tokenize", MODEL),  # not an observed path
        ("PUT", CHAT, MODEL),  # not a POST
        ("POST", CHAT, "unknown-model"),  # a model the Pylon does not know
    ],
)
async def test_other_requests_are_forwarded_unobserved(method: str, path: str, model: str) -> None:
    """Steps 3 and 5: forwarded and relayed (a whole answer: head and body at once) without a
    tracker."""
    stats = RecordingStats()
    pool = answering(FakeResponse(201, JSON, b'{"ok": true}'))
    sink, _ = await forward(
        make_hop(pool, stats), method=method, path=path, headers=tunnel(model=model), body=b"{}"
    )
    assert [(s.method, s.url) for s in pool.sent] == [(method, ENGINE + path)]
    assert sink.status == 201 and sink.body == b'{"ok": true}'
    assert sink.body_follows is True and sink.sends[0][2] is False
    assert stats.trackers == []


async def test_an_unobserved_answer_is_relayed_chunk_by_chunk(autojump_clock: MockClock) -> None:
    """Step 10: any other answer goes on as it arrives: what came with the head at once, each
    later chunk when it arrives, the last one ending the answer."""
    pool = answering(FakeResponse(200, JSON, [(0, b"[1,"), (1, b"2,"), (1, b"3]")]))
    start = trio.current_time()
    sink, _ = await forward(make_hop(pool), headers=tunnel(model="unknown-model"))
    assert sink.body_follows is True
    assert [(at - start, data, more) for at, data, more in sink.sends] == [
        (0, b"[1,", True),
        (1, b"2,", True),
        (2, b"3]", False),
    ]


# ---- the listener ------------------------------------------------------------------------------


class Asgi:
    """One ASGI exchange with `PylonApp`: the messages the replica sends, those the app sends."""

    def __init__(self, incoming: list[dict[str, Any]]) -> None:
        self.incoming = incoming
        self.received = 0
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        self.received += 1
        if not self.incoming:
            await trio.sleep_forever()
        return self.incoming.pop(0)

    async def send(self, message: Any) -> None:
        self.sent.append(dict(message))

    @property
    def body(self) -> bytes:
        return b"".join(m["body"] for m in self.sent if m["type"] == "http.response.body")


def scope(headers: Headers, *, path: str = CHAT, hook: DisconnectHook | None = None) -> Any:
    found: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": b"",
        "headers": headers,
    }
    if hook is not None:
        found["extensions"] = {DISCONNECT_HOOK: hook}
    return found


def request(body: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


async def test_the_listener_joins_the_body_and_sends_a_whole_answer_with_its_head() -> None:
    """Listener: the body arrives in pieces and goes to the engine whole; a whole engine answer
    is one head marked BODY_FOLLOWS and one final body message."""
    pool = answering(FakeResponse(200, JSON, b'{"ok":1}'))
    app = PylonApp(make_hop(pool))
    exchange = Asgi([request(b'{"stream"', more=True), request(b": true}")])
    await app(scope(tunnel(model="unknown")), exchange.receive, exchange.send)
    assert pool.sent[0].body == b'{"stream": true}'
    assert exchange.sent == [
        {
            "type": "http.response.start",
            "status": 200,
            "headers": JSON,
            BODY_FOLLOWS: True,
        },
        {"type": "http.response.body", "body": b'{"ok":1}', "more_body": False},
    ]


async def test_the_listener_streams_without_body_follows(autojump_clock: MockClock) -> None:
    """Listener: a streamed answer's head goes alone (no BODY_FOLLOWS), its events as they come,
    the last one ending the answer."""
    pool = answering(FakeResponse(200, SSE, [(1, delta("a")), (1, DONE)]))
    exchange = Asgi([request(b'{"stream": true}')])
    await PylonApp(make_hop(pool))(scope(tunnel()), exchange.receive, exchange.send)
    assert exchange.sent == [
        {"type": "http.response.start", "status": 200, "headers": SSE},
        {"type": "http.response.body", "body": delta("a"), "more_body": True},
        {"type": "http.response.body", "body": DONE, "more_body": False},
    ]


async def test_a_declared_length_over_the_limit_is_a_413_without_reading() -> None:
    """Listener: a `content-length` above the limit is refused before any body is received."""
    pool = answering()
    exchange = Asgi([request(b"{}")])
    headers = [*tunnel(), (b"content-length", b"17")]
    await PylonApp(make_hop(pool, max_body_bytes=16))(
        scope(headers), exchange.receive, exchange.send
    )
    assert exchange.sent[0]["status"] == 413 and exchange.sent[0][BODY_FOLLOWS] is True
    assert json.loads(exchange.body)["detail"] == "request body too large"
    assert exchange.received == 0 and pool.sent == []


@pytest.mark.parametrize(("size", "status"), [(16, 200), (17, 413)])
async def test_a_streamed_body_is_bounded(size: int, status: int) -> None:
    """Listener: without a declared length, the body is counted as it arrives: up to the limit
    is read, past it 413."""
    pool = answering(FakeResponse(200, JSON, b"{}"))
    body = b'{"a":"' + b"x" * (size - 8) + b'"}'
    pieces = [request(body[i : i + 5], more=i + 5 < len(body)) for i in range(0, len(body), 5)]
    exchange = Asgi(pieces)
    app = PylonApp(make_hop(pool, max_body_bytes=16))
    await app(scope(tunnel(model="unknown")), exchange.receive, exchange.send)
    assert exchange.sent[0]["status"] == status
    assert len(pool.sent) == (1 if status == 200 else 0)


async def test_a_replica_gone_while_the_body_is_read_gets_nothing() -> None:
    """Listener: a disconnect while reading ends the exchange quietly: no answer, no engine."""
    pool = answering()
    exchange = Asgi([request(b'{"st', more=True), {"type": "http.disconnect"}])
    await PylonApp(make_hop(pool))(scope(tunnel()), exchange.receive, exchange.send)
    assert exchange.sent == [] and pool.sent == []


async def test_the_disconnect_hook_cancels_the_request(autojump_clock: MockClock) -> None:
    """Listener: the replica going away mid-answer (the server's disconnect hook) cancels the
    hop: the request is cancelled and the engine connection closed."""
    stats = RecordingStats()
    pool = answering(FakeResponse(200, SSE, [(1, delta("x")) for _ in range(100)]))
    hook = DisconnectHook()
    exchange = Asgi([request(b'{"stream": true}')])
    app = PylonApp(make_hop(pool, stats))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, scope(tunnel(), hook=hook), exchange.receive, exchange.send)
        await trio.sleep(3.5)
        hook.fire()
    assert stats.only.phase is Phase.CANCELLED
    assert pool.responses[0].closed
    assert len(exchange.sent) == 4 and exchange.sent[-1]["more_body"] is True


async def test_a_cut_stream_propagates_out_of_the_app(autojump_clock: MockClock) -> None:
    """Listener: StreamAborted leaves the app, so the server breaks the connection instead of
    ending the body."""
    broken = UpstreamProtocolError("lost", request_sent=True)
    pool = answering(FakeResponse(200, SSE, [(1, delta("a")), (1, broken)]))
    exchange = Asgi([request(b'{"stream": true}')])
    with pytest.raises(StreamAborted):
        await PylonApp(make_hop(pool))(scope(tunnel()), exchange.receive, exchange.send)
    assert all(m.get("more_body", True) for m in exchange.sent)
