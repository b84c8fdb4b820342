"""Loading streams through the proxy app (docs/clients.md, "Held streaming requests"): a real
activator over a fake controller (its swaps take virtual seconds), a fake forwarder (a scripted
engine answer, or a routing wait), a mock clock, and the ASGI messages the app sends, with the
virtual time each was sent at."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from stargate.activator import PoolSpec
from stargate.activator.testing import running_activator
from stargate.asgi import ASGIMessage, ASGIReceive, ASGIScope, ASGISend
from stargate.config import ProxyConfig
from stargate.load_balancing.config import LbConfig
from stargate.metrics import ProxyMetrics
from stargate.proxy.app import ProxyApp
from stargate.proxy.contract import ContractError
from stargate.proxy.forwarder import Forwarded, LocalError
from stargate.proxy.loading import HEAD_GRACE
from stargate.proxy.plan import Planner
from stargate.routing import RoutingState

ENGINE = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n'
SWAP = 12.0  # virtual seconds a cold member takes to become ready


class _Response:
    """An engine's answer: a head, then its body in chunks."""

    def __init__(self, status: int = 200, chunks: tuple[bytes, ...] = (ENGINE,)) -> None:
        self.status = status
        self.headers = [(b"content-type", b"text/event-stream")]
        self._chunks = list(chunks)
        self.complete = False

    def take_buffered(self) -> bytes | None:
        return None

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        while self._chunks:
            chunk = self._chunks.pop(0)
            self.complete = not self._chunks
            yield chunk

    async def __aenter__(self) -> _Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass


class _Forwarder:
    """Answers after `wait` virtual seconds; with `routing_wait`, the wait is a routing wait (its
    `on_hold` is called first, as the forwarder's `_nothing_chosen` does)."""

    planner = Planner(RoutingState(), LbConfig())

    def __init__(
        self,
        outcome: Callable[[], _Response | ContractError] = _Response,
        *,
        wait: float = 0.0,
        routing_wait: bool = False,
    ) -> None:
        self._outcome = outcome
        self._wait = wait
        self._routing_wait = routing_wait
        self.on_hold_given = False

    async def forward_plan(
        self,
        plan: object,
        body: bytes,
        trace: object = None,
        *,
        on_hold: Callable[[], None] | None = None,
    ) -> Forwarded | LocalError:
        self.on_hold_given = on_hold is not None
        if self._routing_wait and on_hold is not None:
            on_hold()
        await trio.sleep(self._wait)
        waited = self._wait if self._routing_wait else 0.0
        outcome = self._outcome()
        if isinstance(outcome, ContractError):
            return LocalError(outcome, waited)
        backend = SimpleNamespace(
            inference_server_id="backend-7", url="http://127.0.0.1:9/", cluster_id="c1"
        )
        return Forwarded(outcome, backend, waited)  # type: ignore[arg-type]


class _Fallback:
    async def __call__(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        raise AssertionError("a proxy path reached the fallback app")


def _body(model: str, stream: bool) -> bytes:
    return json.dumps({"model": model, "messages": [], "stream": stream}).encode()


async def _post(
    app: ProxyApp, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> list[tuple[float, dict[str, Any]]]:
    """One POST in the OpenAI form; every message the app sent, with its virtual time."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[tuple[float, dict[str, Any]]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: ASGIMessage) -> None:
        sent.append((trio.current_time(), dict(message)))

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *(headers or [])],
        "scheme": "http",
        "client": ("127.0.0.1", 40000),
    }
    await app(scope, receive, send)
    return sent


def _app(forwarder: _Forwarder, activator: Any = None, **config: Any) -> ProxyApp:
    proxy = ProxyConfig(accept_openai_requests=True, loading_comment_interval_ms=5000, **config)
    metrics = ProxyMetrics.create(CollectorRegistry(), "test_")
    return ProxyApp(forwarder, proxy, metrics, _Fallback(), activator=activator)  # type: ignore[arg-type]


def _body_of(sent: list[tuple[float, dict[str, Any]]]) -> bytes:
    return b"".join(m.get("body", b"") for _, m in sent if m["type"] == "http.response.body")


def _comments(sent: list[tuple[float, dict[str, Any]]]) -> list[tuple[float, bytes]]:
    return [
        (at, m["body"])
        for at, m in sent
        if m["type"] == "http.response.body" and m["body"].startswith(b": loading")
    ]


def _timing(text: bytes) -> dict[str, float]:
    """`hold;dur=1.0, swap;dur=...` as {"hold": 1.0, ...}."""
    pairs = (item.strip().split(";dur=") for item in text.decode().split(","))
    return {name: float(value) for name, value in pairs}


def _final_timing(body: bytes) -> dict[str, float]:
    (line,) = [x for x in body.split(b"\n") if x.startswith(b": server-timing ")]
    return _timing(line[len(b": server-timing ") :])


def _error(body: bytes) -> dict[str, Any]:
    data = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert data[-1] == b"[DONE]"
    document: dict[str, Any] = json.loads(data[-2])["error"]
    return document


POOL = PoolSpec("gpu0", ("model-a", "model-b"))


async def test_a_held_streaming_request_gets_its_head_at_the_grace_then_comments_then_the_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_activator([POOL], default_ready_delay=SWAP, ready=["model-a"]) as h:
        start = trio.current_time()
        sent = await _post(_app(_Forwarder(), h.activator), _body("model-b", True))
    (at, head), *rest = sent
    assert at == start + HEAD_GRACE and head["status"] == 200
    headers = dict(head["headers"])
    assert headers[b"content-type"] == b"text/event-stream"
    assert headers[b"cache-control"] == b"no-cache"
    assert headers[b"x-accel-buffering"] == b"no"
    assert b"x-request-id" in headers  # generated (the OpenAI form): known before the engine
    # At 0.5, 5.5 and 10.5 s; the swap was never measured: no estimate yet.
    assert _comments(sent) == [
        (start + HEAD_GRACE + t, b": loading model model-b eta unknown\n\n") for t in (0, 5, 10)
    ]
    body = _body_of(sent)
    assert body.endswith(ENGINE)  # the engine's stream, unchanged, after the comments
    assert b": x-inference-server-id backend-7\n" in body
    timing = _final_timing(body)
    assert timing["hold"] == pytest.approx(SWAP * 1000, abs=1)
    assert timing["swap"] == pytest.approx(SWAP * 1000, abs=1)
    assert rest[-1][1].get("more_body", False) is False


async def test_the_eta_is_the_pools_expected_wait_once_a_swap_was_measured(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pools = [POOL]
    async with running_activator(
        pools, default_ready_delay=SWAP, ready=["model-a"], exclusive=True
    ) as h:
        app = _app(_Forwarder(), h.activator)
        await _post(app, _body("model-b", False))  # a measured swap toward model-b
        await _post(app, _body("model-a", False))  # and one back to model-a
        start = trio.current_time()
        sent = await _post(app, _body("model-b", True))
    comments = _comments(sent)
    assert comments[0] == (start + HEAD_GRACE, b": loading model model-b eta 12s\n\n")
    assert comments[1] == (start + HEAD_GRACE + 5, b": loading model model-b eta 7s\n\n")


async def test_a_non_streaming_request_during_a_swap_gets_no_comment(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_activator([POOL], default_ready_delay=SWAP, ready=["model-a"]) as h:
        start = trio.current_time()
        sent = await _post(_app(_Forwarder(), h.activator), _body("model-b", False))
    (at, head), *_ = sent
    assert at == start + SWAP  # the engine's own head, when it came
    assert _comments(sent) == []
    assert _body_of(sent) == ENGINE
    timing = _timing(dict(head["headers"])[b"server-timing"])
    assert timing["hold"] == pytest.approx(SWAP * 1000, abs=1)
    assert timing["swap"] == pytest.approx(SWAP * 1000, abs=1)


async def test_an_immediately_granted_streaming_request_gets_the_engines_head(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_activator([POOL], default_ready_delay=SWAP, ready=["model-a"]) as h:
        sent = await _post(_app(_Forwarder(wait=0.25), h.activator), _body("model-a", True))
    head = sent[0][1]
    assert head["status"] == 200 and _comments(sent) == []
    headers = dict(head["headers"])
    assert headers[b"x-inference-server-id"] == b"backend-7"
    assert _timing(headers[b"server-timing"]) == {"hold": 0.0, "swap": 0.0, "upstream": 250.0}


async def test_with_loading_comments_off_a_held_stream_waits_for_the_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_activator([POOL], default_ready_delay=SWAP, ready=["model-a"]) as h:
        forwarder = _Forwarder()
        start = trio.current_time()
        sent = await _post(
            _app(forwarder, h.activator, loading_comments=False), _body("model-b", True)
        )
    assert sent[0][0] == start + SWAP and _comments(sent) == []
    assert not forwarder.on_hold_given  # nothing is prepared for it


async def test_a_hold_that_fails_after_the_head_ends_with_the_error_event(
    autojump_clock: trio.testing.MockClock,
) -> None:
    spec = PoolSpec("gpu0", ("model-a", "model-b"), hold_budget=8.0)
    async with running_activator([spec], default_ready_delay=None, ready=["model-a"]) as h:
        start = trio.current_time()
        sent = await _post(_app(_Forwarder(), h.activator), _body("model-b", True))
    assert sent[0][1]["status"] == 200
    assert [at - start for at, _ in _comments(sent)] == [HEAD_GRACE, HEAD_GRACE + 5]
    error = _error(_body_of(sent))
    assert error["code"] == "pool_activation_timeout"
    assert error["type"] == "server_error" and error["message"]
    assert sent[-1][0] == start + 8 and sent[-1][1].get("more_body", False) is False


async def test_an_upstream_error_after_the_head_ends_with_its_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    document = b'{"error": {"message": "context too long", "code": "context_length_exceeded"}}'
    async with running_activator([POOL], default_ready_delay=SWAP, ready=["model-a"]) as h:
        forwarder = _Forwarder(lambda: _Response(400, (document,)))
        sent = await _post(_app(forwarder, h.activator), _body("model-b", True))
    assert sent[0][1]["status"] == 200
    body = _body_of(sent)
    assert _final_timing(body)["swap"] == pytest.approx(SWAP * 1000, abs=1)
    error = _error(body)
    assert (error["message"], error["code"]) == ("context too long", "context_length_exceeded")
    assert error["type"] == "invalid_request_error"


async def test_a_routing_wait_starts_a_loading_stream_with_the_waits_remaining_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No pool: the forwarder's routing wait (`x-max-wait-ms`) holds the request, then its 503."""
    forwarder = _Forwarder(
        lambda: ContractError(503, code="no_available_backend"), wait=12.0, routing_wait=True
    )
    start = trio.current_time()
    sent = await _post(_app(forwarder), _body("m", True), [(b"x-max-wait-ms", b"12000")])
    assert sent[0][1]["status"] == 200
    assert _comments(sent) == [
        (start + HEAD_GRACE, b": loading model m eta 12s\n\n"),  # 11.5 s left, rounded up
        (start + HEAD_GRACE + 5, b": loading model m eta 7s\n\n"),
        (start + HEAD_GRACE + 10, b": loading model m eta 2s\n\n"),
    ]
    body = _body_of(sent)
    assert _final_timing(body)["hold"] == pytest.approx(12000, abs=1)
    assert _error(body)["code"] == "no_available_backend"


async def test_a_routing_wait_shorter_than_the_grace_keeps_the_engines_head(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Wait-and-widen often waits a few milliseconds: such a stream is not turned into a loading
    stream, so its engine's status and headers reach the client."""
    forwarder = _Forwarder(wait=HEAD_GRACE / 2, routing_wait=True)
    start = trio.current_time()
    sent = await _post(_app(forwarder), _body("m", True), [(b"x-max-wait-ms", b"12000")])
    (at, head), *_ = sent
    assert at == start + HEAD_GRACE / 2 and _comments(sent) == []
    headers = dict(head["headers"])
    assert headers[b"x-inference-server-id"] == b"backend-7"
    assert _timing(headers[b"server-timing"])["hold"] == pytest.approx(HEAD_GRACE / 2 * 1000)
    assert _body_of(sent) == ENGINE


async def test_a_request_that_cannot_wait_opens_no_loading_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Not pooled and no `x-max-wait-ms`: the forwarder gets no `on_hold` (the hot path)."""
    forwarder = _Forwarder()
    sent = await _post(_app(forwarder), _body("m", True))
    assert not forwarder.on_hold_given
    assert sent[0][1]["status"] == 200 and b"server-timing" in dict(sent[0][1]["headers"])


async def test_a_local_error_without_a_hold_carries_server_timing() -> None:
    forwarder = _Forwarder(lambda: ContractError(502, code="upstream_failed"))
    sent = await _post(_app(forwarder), _body("m", True))
    head = sent[0][1]
    assert head["status"] == 502
    assert set(_timing(dict(head["headers"])[b"server-timing"])) == {"hold", "swap", "upstream"}
