"""Derived affinity keys (stargate/proxy/affinity_key.py; docs/data-plane.md, "Derived affinity
keys"): the pure derivation, and how `ProxyApp` applies it to both request forms."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from stargate.asgi import ASGIReceive, ASGIScope, ASGISend
from stargate.config import ProxyConfig
from stargate.load_balancing.config import AlgorithmSpec, parse_lb_config
from stargate.metrics import ProxyMetrics
from stargate.proxy.affinity_key import KEY_PREFIX, derive_affinity_key
from stargate.proxy.app import ProxyApp
from stargate.proxy.contract import ContractError, ProxyRequest
from stargate.proxy.forwarder import LocalError
from stargate.proxy.plan import Planner, RequestPlan
from stargate.routing import RoutingState

CHAT = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 100}  # ~2.9 kB


def _body(document: Any) -> bytes:
    return json.dumps(document).encode()


def _chat(messages: list[dict[str, Any]], **extra: Any) -> bytes:
    return _body({"model": "m", "messages": messages, **extra})


def _turns(first_user: str, count: int = 4) -> list[list[dict[str, Any]]]:
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": first_user}]
    turns = [list(messages)]
    for turn in range(count - 1):
        messages += [
            {"role": "assistant", "content": f"answer {turn}"},
            {"role": "user", "content": f"and then {turn}?"},
        ]
        turns.append(list(messages))
    return turns


def test_every_turn_of_a_long_conversation_shares_the_key() -> None:
    keys = {derive_affinity_key(CHAT, _chat(m), 64) for m in _turns("x" * 100)}
    assert len(keys) == 1
    key = keys.pop()
    assert key is not None and key.startswith(KEY_PREFIX)
    assert len(key) == len(KEY_PREFIX) + 32
    assert key == derive_affinity_key(CHAT, _chat(_turns("x" * 100)[0]), 64)  # stable


def test_short_conversations_share_a_key_only_with_identical_prefixes() -> None:
    # Under N bytes of conversation, each turn adds to what is hashed: a new key per turn.
    turns = _turns("hi")
    keys = [derive_affinity_key(CHAT, _chat(m), 2048) for m in turns]
    assert len(set(keys)) == len(turns)
    assert keys[0] == derive_affinity_key(CHAT, _chat(turns[0]), 2048)


def test_system_prompts_count_in_full() -> None:
    user = {"role": "user", "content": "y" * 100}
    one = derive_affinity_key(CHAT, _chat([SYSTEM, user]), 16)
    other_system = {"role": "system", "content": SYSTEM["content"] + "!"}  # differs at the end
    assert derive_affinity_key(CHAT, _chat([other_system, user]), 16) != one
    developer = {"role": "developer", "content": SYSTEM["content"] + "!"}
    assert derive_affinity_key(CHAT, _chat([developer, user]), 16) not in (one, None)
    assert derive_affinity_key(CHAT, _chat([SYSTEM]), 16) is not None  # a system prompt alone


def test_the_encoding_of_the_body_does_not_matter() -> None:
    messages = _turns("x" * 100)[1]
    compact = json.dumps({"messages": messages, "model": "m"}, separators=(",", ":")).encode()
    spaced = json.dumps({"model": "m", "temperature": 0.5, "messages": messages}, indent=2)
    escaped = json.dumps({"model": "m", "messages": messages}, ensure_ascii=True)
    keys = {derive_affinity_key(CHAT, b, 64) for b in (compact, spaced.encode(), escaped.encode())}
    assert len(keys) == 1
    # Fields other than role and content do not count (an answer sent back with `refusal`).
    with_refusal = [dict(m, refusal=None) if m["role"] == "assistant" else m for m in messages]
    assert derive_affinity_key(CHAT, _chat(with_refusal), 4096) == derive_affinity_key(
        CHAT, _chat(messages), 4096
    )
    # Content parts read as their text.
    parts = [{"role": "user", "content": [{"type": "text", "text": "x" * 100}]}]
    assert derive_affinity_key(CHAT, _chat(parts), 64) == derive_affinity_key(
        CHAT, _chat([{"role": "user", "content": "x" * 100}]), 64
    )


def test_messages_past_the_cut_are_not_read() -> None:
    head = _chat([{"role": "user", "content": "z" * 100}])[:-2]  # without `]}`
    broken = head + b', {"role": "user", "content": oops'  # never read: past the cut
    assert derive_affinity_key(CHAT, broken, 64) == derive_affinity_key(
        CHAT, _chat([{"role": "user", "content": "z" * 100}]), 64
    )


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[1, 2]",
        b'{"model": "m"}',
        b'{"model": "m", "messages": []}',
        b'{"model": "m", "messages": 7}',
        b'{"model": "m", "messages": [{"role": "user", "content": "unterminated',
        b'{"model": "m", "messages": [{"role": "user", "content": "a"},',
        b'{"model": "m" "messages": []}',
        b"\xff\xfe{",
        b'{"messages": [' * 2000,
    ],
)
def test_no_key_without_a_readable_prompt(body: bytes) -> None:
    assert derive_affinity_key(CHAT, body, 64) is None


def test_embeddings_and_other_paths_get_no_key() -> None:
    assert derive_affinity_key("/v1/embeddings", _body({"model": "m", "input": "x"}), 64) is None
    assert derive_affinity_key("/v1/other", _chat([SYSTEM]), 64) is None


def test_completions_use_the_first_n_bytes_of_the_prompt() -> None:
    path = "/v1/completions"
    one = derive_affinity_key(path, _body({"model": "m", "prompt": "é" * 5000}), 10)
    assert one is not None
    assert derive_affinity_key(path, _body({"prompt": "é" * 5 + "different"}), 10) == one
    assert derive_affinity_key(path, _body({"prompt": "é" * 4 + "e"}), 10) != one
    assert derive_affinity_key(path, _body({"prompt": [1, 2, 3]}), 10) is not None
    assert derive_affinity_key(path, _body({"prompt": []}), 10) is None
    # The same prompt on another endpoint is another key.
    assert derive_affinity_key(CHAT, _body({"messages": "é" * 5000}), 10) != one


def test_a_long_prompt_is_decoded_only_as_far_as_the_cut() -> None:
    path = "/v1/completions"
    text = "\\u00e9" * 50  # escapes: 6 raw bytes for 2 UTF-8 bytes
    raw = b'{"prompt": "' + text.encode() + b"\\ud83d\\ude00" * 100 + b'"}'
    assert derive_affinity_key(path, raw, 100) == derive_affinity_key(
        path, _body({"prompt": "é" * 50}), 100
    )
    # A string broken past what is decoded still gives a key; broken within it, none.
    assert derive_affinity_key(path, b'{"prompt": "' + b"a" * 1000 + b"\\x", 10) is not None
    assert derive_affinity_key(path, b'{"prompt": "ab\\x' + b"a" * 1000 + b'"}', 10) is None


def test_responses_use_instructions_and_input() -> None:
    path = "/v1/responses"
    base = {"model": "m", "instructions": "be terse " * 50, "input": "q" * 100}
    one = derive_affinity_key(path, _body(base), 64)
    assert one is not None
    assert derive_affinity_key(path, _body({**base, "instructions": "be kind"}), 64) != one
    assert derive_affinity_key(path, _body({**base, "input": "q" * 64 + "other"}), 64) == one
    items = [{"role": "user", "content": [{"type": "input_text", "text": "q" * 100}]}]
    assert derive_affinity_key(path, _body({**base, "input": items}), 64) is not None
    assert derive_affinity_key(path, _body({"model": "m", "instructions": "x"}), 64) is not None


# --- ProxyApp: which requests get a key, and what is forwarded ---------------------------------


class _CountingPlanner(Planner):
    """A `Planner` that counts the algorithm resolutions it makes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.resolutions = 0

    def algorithm(self, request: ProxyRequest) -> AlgorithmSpec:
        self.resolutions += 1
        return super().algorithm(request)


class _Forwarder:
    """Plans as the real forwarder does (model `m` requires a cache-affinity key, or not; no
    `x-routing-method` but its own algorithm is allowed), records what the app routes, then
    answers 503 itself."""

    def __init__(self, require_key: bool = False) -> None:
        model = {"algorithm": "power-of-n", "require_cache_affinity_key": require_key}
        lb_config = parse_lb_config({"default": "power-of-n", "models": {"m": model}})
        self.planner = _CountingPlanner(RoutingState(), lb_config)
        self.forwarded: list[ProxyRequest] = []
        self.body_read = False  # set by `_call`

    async def forward_plan(
        self, plan: RequestPlan, body: bytes, trace: object = None
    ) -> LocalError:
        # The plan routes by the request's key, derived or sent.
        assert plan.routing.cache_affinity_key == plan.request.cache_affinity_key
        self.forwarded.append(plan.request)
        return LocalError(ContractError(503))


async def _call(
    forwarder: _Forwarder, config: ProxyConfig, headers: dict[str, str], body: bytes
) -> int:
    app = ProxyApp(
        forwarder,  # type: ignore[arg-type]
        config,
        ProxyMetrics.create(CollectorRegistry(), "test_"),
        _unused,
    )
    scope: ASGIScope = {
        "type": "http",
        "method": "POST",
        "path": CHAT,
        "raw_path": CHAT.encode(),
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        "scheme": "http",
        "http_version": "1.1",
        "client": ("127.0.0.1", 1),
    }
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if not messages:
            return {"type": "http.disconnect"}
        forwarder.body_read = True
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status: int = sent[0]["status"]
    return status


async def _unused(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
    raise AssertionError("not a proxy path")


ON = ProxyConfig(accept_openai_requests=True, derive_affinity_key=True)
OFF = ProxyConfig(accept_openai_requests=True)
HEADER_FORM = {"x-model": "m", "x-request-id": "r", "x-input-tokens": "1"}
BODY = _chat(_turns("x" * 100)[0])


@pytest.mark.parametrize("headers", [{}, HEADER_FORM], ids=["openai-form", "header-form"])
async def test_both_forms_route_by_the_derived_key_without_forwarding_it(
    headers: dict[str, str],
) -> None:
    forwarder = _Forwarder(require_key=True)  # a derived key satisfies a required one
    assert await _call(forwarder, ON, headers, BODY) == 503
    (request,) = forwarder.forwarded
    assert request.cache_affinity_key == derive_affinity_key(CHAT, BODY, 2048)
    assert all(name != b"x-cache-affinity-key" for name, _ in request.headers)


async def test_an_explicit_key_wins_and_is_forwarded() -> None:
    forwarder = _Forwarder()
    await _call(forwarder, ON, {"x-cache-affinity-key": "mine"}, BODY)
    (request,) = forwarder.forwarded
    assert request.cache_affinity_key == "mine"
    assert (b"x-cache-affinity-key", b"mine") in request.headers


@pytest.mark.parametrize("headers", [{}, HEADER_FORM], ids=["openai-form", "header-form"])
async def test_no_key_when_the_flag_is_off(headers: dict[str, str]) -> None:
    forwarder = _Forwarder()
    await _call(forwarder, ProxyConfig(accept_openai_requests=True), headers, BODY)
    assert forwarder.forwarded[0].cache_affinity_key is None


async def test_a_body_without_a_prompt_still_fails_a_required_key() -> None:
    forwarder = _Forwarder(require_key=True)
    assert await _call(forwarder, ON, HEADER_FORM, b"not json") == 400
    assert forwarder.forwarded == []
    assert forwarder.planner.resolutions == 1  # checked with the key known, not resolved again
    assert await _call(forwarder, ON, {}, _body({"model": "m"})) == 400
    assert forwarder.forwarded == []


@pytest.mark.parametrize("headers", [{}, HEADER_FORM], ids=["openai-form", "header-form"])
@pytest.mark.parametrize(
    "config", [ON, ProxyConfig(accept_openai_requests=True)], ids=["on", "off"]
)
@pytest.mark.parametrize("key", [None, "mine"], ids=["no-key", "sent-key"])
async def test_the_algorithm_is_resolved_once_per_request(
    headers: dict[str, str], config: ProxyConfig, key: str | None
) -> None:
    """The plan is built once: the derived-key path resolves the algorithm before the body is
    read and checks the key requirement after, without resolving it again."""
    forwarder = _Forwarder(require_key=key is None and config.derive_affinity_key)
    sent = headers if key is None else {**headers, "x-cache-affinity-key": key}
    assert await _call(forwarder, config, sent, BODY) == 503
    assert forwarder.planner.resolutions == 1
    (request,) = forwarder.forwarded
    assert (request.cache_affinity_key is not None) is (
        key is not None or config.derive_affinity_key
    )


@pytest.mark.parametrize("method", ["no-such-algorithm", "random"])
async def test_the_header_form_checks_the_algorithm_before_reading_the_body(method: str) -> None:
    """Header form, a key to derive: an `x-routing-method` unknown or not allowed for the model
    is a 400 with the body left unread (docs/data-plane.md, Header contract)."""
    forwarder = _Forwarder(require_key=True)
    headers = {**HEADER_FORM, "x-routing-method": method}
    assert await _call(forwarder, ON, headers, BODY) == 400
    assert not forwarder.body_read and forwarder.forwarded == []
    # The key requirement waits for the body: it is read, and its derived key satisfies it.
    assert await _call(forwarder, ON, HEADER_FORM, BODY) == 503
    assert forwarder.body_read
