"""Derived affinity keys (stargate/prefix_key.py; docs/data-plane.md, "Derived affinity
keys"): the pure derivation, and how `ProxyApp` applies it to both request forms."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from stargate.asgi import ASGIReceive, ASGIScope, ASGISend
from stargate.config import ProxyConfig
from stargate.load_balancing.config import AlgorithmSpec, parse_lb_config
from stargate.metrics import ProxyMetrics
from stargate.prefix_key import KEY_PREFIX, _message, derive_affinity_key, derive_prefix
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


def _message_bytes(messages: list[dict[str, Any]]) -> bytes:
    """The prompt stream of `messages` (each message as the derivation frames it)."""
    return b"".join(_message(message) for message in messages)


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


def test_every_turn_of_a_conversation_shares_the_key() -> None:
    # Short and long first messages alike: the key is the opening's, which every turn resends.
    for first in ("hi", "x" * 100, "y" * 5000):
        keys = {derive_affinity_key(CHAT, _chat(m)) for m in _turns(first)}
        assert len(keys) == 1
        key = keys.pop()
        assert key is not None and key.startswith(KEY_PREFIX)
        assert len(key) == len(KEY_PREFIX) + 16
        assert key == derive_affinity_key(CHAT, _chat(_turns(first)[0]))  # stable


def test_conversations_differ_by_their_first_user_message() -> None:
    one = derive_affinity_key(CHAT, _chat(_turns("hi")[2]))
    assert derive_affinity_key(CHAT, _chat(_turns("hi!")[2])) != one
    # The same opening (a template) is the same conversation key, whatever follows.
    other = [*_turns("hi")[1][:3], {"role": "user", "content": "something else"}]
    assert derive_affinity_key(CHAT, _chat(other)) == one


def test_system_prompts_count_in_full() -> None:
    user = {"role": "user", "content": "y" * 100}
    one = derive_affinity_key(CHAT, _chat([SYSTEM, user]))
    other_system = {"role": "system", "content": SYSTEM["content"] + "!"}  # differs at the end
    assert derive_affinity_key(CHAT, _chat([other_system, user])) != one
    developer = {"role": "developer", "content": SYSTEM["content"] + "!"}
    assert derive_affinity_key(CHAT, _chat([developer, user])) not in (one, None)
    assert derive_affinity_key(CHAT, _chat([SYSTEM])) is not None  # a system prompt alone


def test_the_chain_follows_the_prefix() -> None:
    turns = _turns("x" * 300, count=6)
    derived = [derive_prefix(CHAT, _chat(m), 64, 1000) for m in turns]
    assert all(d is not None for d in derived)
    chains = [d.chain for d in derived if d is not None]
    for shorter, longer in itertools.pairwise(chains):
        assert len(longer) >= len(shorter) and longer[: len(shorter)] == shorter
    # Whole blocks only: the stream of turn 0 is the system and the user message, framed.
    stream = _message_bytes(turns[0])
    assert len(chains[0]) == len(stream) // 64
    # The group is the element ending the system part; the same for every conversation that
    # shares the system prompt, whatever its messages.
    groups = {d.group for d in derived if d is not None}
    other = derive_prefix(CHAT, _chat(_turns("z")[3]), 64, 1000)
    assert other is not None and groups == {other.group} and other.group is not None
    system_blocks = len(_message_bytes([SYSTEM])) // 64
    assert other.group == chains[0][system_blocks - 1] == other.chain[system_blocks - 1]
    assert other.chain[system_blocks:] != chains[0][system_blocks:]
    # A system prompt shorter than one block makes no group.
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u" * 500}]
    small = derive_prefix(CHAT, _chat(messages), 64, 1000)
    assert small is not None and small.group is None
    assert len(small.chain) == len(_message_bytes(messages)) // 64 == 8


def test_depth_caps_what_is_read() -> None:
    derived = derive_prefix(CHAT, _chat(_turns("x" * 100, count=20)[-1]), 64, 5)
    assert derived is not None and len(derived.chain) == 5
    # A system prompt longer than the cap: the group is the last element, the key its hash.
    long_system = derive_prefix(CHAT, _chat([SYSTEM, {"role": "user", "content": "a"}]), 64, 5)
    other_user = derive_prefix(CHAT, _chat([SYSTEM, {"role": "user", "content": "b"}]), 64, 5)
    assert long_system is not None and other_user is not None
    assert long_system.group == long_system.chain[-1]
    assert long_system.key == other_user.key  # the users differ past the cap


def test_the_encoding_of_the_body_does_not_matter() -> None:
    messages = _turns("x" * 100)[1]
    compact = json.dumps({"messages": messages, "model": "m"}, separators=(",", ":")).encode()
    spaced = json.dumps({"model": "m", "temperature": 0.5, "messages": messages}, indent=2)
    escaped = json.dumps({"model": "m", "messages": messages}, ensure_ascii=True)
    derived = {derive_prefix(CHAT, b, 64, 64) for b in (compact, spaced.encode(), escaped.encode())}
    assert len(derived) == 1
    # Fields other than role and content do not count (an answer sent back with `refusal`).
    with_refusal = [dict(m, refusal=None) if m["role"] == "assistant" else m for m in messages]
    assert derive_prefix(CHAT, _chat(with_refusal), 64, 64) == derive_prefix(
        CHAT, _chat(messages), 64, 64
    )
    # Content parts read as their text.
    parts = [{"role": "user", "content": [{"type": "text", "text": "x" * 100}]}]
    assert derive_affinity_key(CHAT, _chat(parts)) == derive_affinity_key(
        CHAT, _chat([{"role": "user", "content": "x" * 100}])
    )


def test_messages_past_the_cap_are_not_read() -> None:
    head = _chat([{"role": "user", "content": "z" * 100}])[:-2]  # without `]}`
    broken = head + b', {"role": "user", "content": oops'  # never read: past the cap
    assert derive_prefix(CHAT, broken, 8, 8) == derive_prefix(
        CHAT, _chat([{"role": "user", "content": "z" * 100}]), 8, 8
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
    assert derive_affinity_key(CHAT, body) is None


def test_embeddings_and_other_paths_get_no_key() -> None:
    assert derive_affinity_key("/v1/embeddings", _body({"model": "m", "input": "x"})) is None
    assert derive_affinity_key("/v1/other", _chat([SYSTEM])) is None


def test_completions_use_the_first_capped_bytes_of_the_prompt() -> None:
    path = "/v1/completions"
    one = derive_affinity_key(path, _body({"model": "m", "prompt": "é" * 5000}), 5, 2)
    assert one is not None
    assert derive_affinity_key(path, _body({"prompt": "é" * 5 + "different"}), 5, 2) == one
    assert derive_affinity_key(path, _body({"prompt": "é" * 4 + "e"}), 5, 2) != one
    assert derive_affinity_key(path, _body({"prompt": [1, 2, 3]}), 5, 2) is not None
    assert derive_affinity_key(path, _body({"prompt": []}), 5, 2) is None
    # The same prompt on another endpoint is another key.
    assert derive_affinity_key(CHAT, _body({"messages": "é" * 5000}), 5, 2) != one


def test_a_long_prompt_is_decoded_only_as_far_as_the_cap() -> None:
    path = "/v1/completions"
    text = "\\u00e9" * 50  # escapes: 6 raw bytes for 2 UTF-8 bytes
    raw = b'{"prompt": "' + text.encode() + b"\\ud83d\\ude00" * 100 + b'"}'
    assert derive_prefix(path, raw, 10, 10) == derive_prefix(
        path, _body({"prompt": "é" * 50}), 10, 10
    )
    # A string broken past what is decoded still gives a key; broken within it, none.
    assert derive_affinity_key(path, b'{"prompt": "' + b"a" * 1000 + b"\\x", 5, 2) is not None
    assert derive_affinity_key(path, b'{"prompt": "ab\\x' + b"a" * 1000 + b'"}', 5, 2) is None


def test_responses_use_instructions_and_input() -> None:
    path = "/v1/responses"
    base = {"model": "m", "instructions": "be terse " * 50, "input": "q" * 100}
    one = derive_prefix(path, _body(base), 64, 64)
    assert one is not None and one.group is not None  # the instructions fill 7 blocks
    kind = derive_prefix(path, _body({**base, "instructions": "be kind"}), 64, 64)
    assert kind is not None and kind.key != one.key and kind.group is None
    longer = derive_prefix(path, _body({**base, "input": "q" * 200}), 64, 64)
    assert longer is not None and longer.key != one.key and longer.group == one.group
    items = [{"role": "user", "content": [{"type": "input_text", "text": "q" * 100}]}]
    assert derive_affinity_key(path, _body({**base, "input": items})) is not None
    assert derive_affinity_key(path, _body({"model": "m", "instructions": "x"})) is not None


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
        # The plan routes by the request's key, derived or sent, and its chain and group.
        assert plan.routing.cache_affinity_key == plan.request.cache_affinity_key
        assert plan.routing.prefix_chain == plan.request.prefix_chain
        assert plan.routing.prefix_group == plan.request.prefix_group
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
    derived = derive_prefix(CHAT, BODY, 256, 64)
    assert derived is not None and derived.group is not None and derived.chain
    assert request.cache_affinity_key == derived.key
    assert (request.prefix_chain, request.prefix_group) == (derived.chain, derived.group)
    assert all(name != b"x-cache-affinity-key" for name, _ in request.headers)
    # The flags' block bytes and depth are the ones used.
    small = ProxyConfig(
        accept_openai_requests=True,
        derive_affinity_key=True,
        derive_affinity_key_block_bytes=64,
        derive_affinity_key_depth=3,
    )
    forwarder = _Forwarder()
    await _call(forwarder, small, headers, BODY)
    assert forwarder.forwarded[0].prefix_chain == derive_prefix(CHAT, BODY, 64, 3).chain  # type: ignore[union-attr]
    assert len(forwarder.forwarded[0].prefix_chain) == 3


async def test_an_explicit_key_wins_and_is_forwarded() -> None:
    forwarder = _Forwarder()
    await _call(forwarder, ON, {"x-cache-affinity-key": "mine"}, BODY)
    (request,) = forwarder.forwarded
    assert request.cache_affinity_key == "mine"
    assert (b"x-cache-affinity-key", b"mine") in request.headers
    assert (request.prefix_chain, request.prefix_group) == ((), None)  # replaced too


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


@settings(max_examples=300, deadline=None)
@given(
    body=st.one_of(
        st.binary(max_size=512),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=40),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(
                    st.sampled_from(["messages", "role", "content", "prompt", "text", "type"]),
                    inner,
                    max_size=4,
                )
            ),
            max_leaves=20,
        ).map(lambda document: json.dumps(document).encode()),
    ),
    path=st.sampled_from([CHAT, "/v1/completions", "/v1/responses"]),
    block_bytes=st.integers(1, 64),
    depth=st.integers(1, 8),
)
# Found by this test: a role that is a list made the system-role test raise TypeError.
@example(body=b'{"messages":[{"":null,"role":[]}]}', path=CHAT, block_bytes=1, depth=1)
def test_any_body_gives_a_prefix_or_none_never_an_error(
    body: bytes, path: str, block_bytes: int, depth: int
) -> None:
    """Bad input (not JSON, odd shapes, non-text parts) never raises: a derivation or None, and a
    derivation always respects the depth and its group is one of its chain elements."""
    derived = derive_prefix(path, body, block_bytes, depth)
    if derived is not None:
        assert derived.key.startswith(KEY_PREFIX) and len(derived.chain) <= depth
        assert derived.group is None or derived.group in derived.chain
