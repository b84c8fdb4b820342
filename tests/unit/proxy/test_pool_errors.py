"""A model pool's refusals carry `x-stargate-error-code`, like every other answer the replica
makes with a code (docs/clients.md, Error bodies): in the Rust form (JSON body
`{"error":{"code","message"}}`) and in the OpenAI form (the OpenAI error document)."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from stargate.activator import (
    ActivatorError,
    HoldTimeout,
    IncumbentBusy,
    PoolMemberUnavailable,
    PoolQueueFull,
    PoolSpec,
    SwapFailed,
)
from stargate.activator.testing import running_activator
from stargate.asgi import ASGIReceive, ASGIScope, ASGISend
from stargate.config import ProxyConfig
from stargate.load_balancing.config import LbConfig
from stargate.metrics import ProxyMetrics
from stargate.proxy.app import ProxyApp, _pool_error
from stargate.proxy.forwarder import Forwarder
from stargate.routing import RoutingState

ERRORS: list[tuple[ActivatorError, int, str | None]] = [
    (HoldTimeout("held too long", pool="p", member="m"), 503, "5"),
    (SwapFailed("swap failed", pool="p", member="m", reason="error"), 502, None),
    (SwapFailed("swap abandoned", pool="p", member="m", reason="deadline"), 502, None),
    (IncumbentBusy("busy", pool="p", member="m"), 503, "5"),
    (PoolQueueFull("full", pool="p", member="m"), 503, "5"),
    (ActivatorError("other", pool="p", member="m"), 502, None),
    # Computed where raised from the member's swap times (docs/activator.md, Measured waiting).
    (HoldTimeout("held too long", pool="p", member="m", retry_after=37), 503, "37"),
    (PoolMemberUnavailable("breaker open", pool="p", member="m", retry_after=30), 503, "30"),
]


@pytest.mark.parametrize("openai_form", [False, True], ids=["rust-form", "openai-form"])
@pytest.mark.parametrize(("error", "status", "retry_after"), ERRORS, ids=lambda e: repr(e))
def test_every_pool_error_carries_its_code_header(
    error: ActivatorError, status: int, retry_after: str | None, openai_form: bool
) -> None:
    answer = _pool_error(error)
    headers, body = answer.answer(openai_form)
    assert answer.status == status
    codes = [value for name, value in headers if name == b"x-stargate-error-code"]
    assert codes == [error.code.encode()]  # exactly one, in both forms
    assert error.code.startswith("pool_")
    assert dict(headers)[b"content-type"] == b"application/json"
    assert dict(headers).get(b"retry-after") == (
        None if retry_after is None else retry_after.encode()
    )
    document = json.loads(body)
    assert document["error"]["code"] == error.code
    assert document["error"]["message"] == str(error)
    if openai_form:
        assert document["error"]["type"] == "server_error"


class _Fallback:
    async def __call__(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        raise AssertionError("a proxy path reached the fallback app")


async def _post(app: ProxyApp, headers: list[tuple[bytes, bytes]], body: bytes) -> dict[str, Any]:
    """One POST through the ASGI app; the status, headers and body it sent."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await trio.sleep_forever()  # the client stays: no disconnect
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": headers,
        "scheme": "http",
        "client": ("127.0.0.1", 40000),
    }
    await app(scope, receive, send)
    start, *chunks = sent
    return {
        "status": start["status"],
        "headers": start["headers"],
        "body": b"".join(chunk.get("body", b"") for chunk in chunks),
    }


@pytest.mark.parametrize("openai_form", [False, True], ids=["rust-form", "openai-form"])
async def test_a_full_pool_queue_answers_with_its_code_header(
    autojump_clock: trio.testing.MockClock, openai_form: bool
) -> None:
    """Through the proxy app: a pool that may hold nobody (`max_held=0`) refuses at once."""
    spec = PoolSpec("gpu0", ("model-a", "model-b"), max_held=0)
    async with running_activator([spec], ready=["model-a"]) as h:
        config = ProxyConfig(accept_openai_requests=True)
        metrics = ProxyMetrics.create(CollectorRegistry(), "test_")
        forwarder = Forwarder(RoutingState(), cast(Any, object()), config, LbConfig(), metrics)
        app = ProxyApp(forwarder, config, metrics, _Fallback(), activator=h.activator)
        headers = [(b"content-type", b"application/json")]
        if not openai_form:
            headers += [
                (b"x-request-id", b"r1"),
                (b"x-input-tokens", b"3"),
                (b"x-model", b"model-b"),
            ]
        body = json.dumps({"model": "model-b", "messages": []}).encode()
        answer = await _post(app, headers, body)
    assert answer["status"] == 503
    sent = dict(answer["headers"])
    assert sent[b"x-stargate-error-code"] == b"pool_queue_full"
    assert sent[b"retry-after"] == b"5"
    assert json.loads(answer["body"])["error"]["code"] == "pool_queue_full"
