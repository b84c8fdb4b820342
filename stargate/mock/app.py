"""The mock backend: a lean raw ASGI app serving OpenAI-compatible inference endpoints.

It is deliberately cheap (no framework, payloads built from plain dicts, no task per request on
the zero-delay non-streaming path) so that one mock can absorb far more traffic than one router
replica can proxy. Its behaviour is steered at run time through `/test-control` (see
`stargate.mock.control`).

Timing of a generation (`ttft_ms`, `inter_token_ms`, `response_delay_ms` are the current knobs):

* streaming: `response_delay_ms`, then the response head (and, for `/v1/responses`, the
  `response.created` event), then the TTFT, then the first token (chat sends its role chunk
  just before it), then `inter_token_ms` before each further token, then at once the closing
  events (finish chunk, optional usage chunk, `[DONE]`; or `response.completed`). Every SSE
  event is its own ASGI body message.
* non-streaming: `response_delay_ms + TTFT + (tokens - 1) * inter_token_ms`, then the head
  and the whole JSON body.
* embeddings: `response_delay_ms`, then the JSON body.

The TTFT is `ttft_ms`, or with the prefix-cache model on (`prefix_cache_blocks` > 0, see
`stargate.mock.prefix_cache`) `ttft_ms * (1 - hit_fraction * prefix_cache_speedup)`, where
`hit_fraction` is the share of the prompt's text found in the cache when the request was planned
(the cache is looked up and updated at that moment, in the order requests arrive; see
docs/mock-backend.md). Every chat, completions and Responses answer that got that far then
carries `x-mock-prefix-cache-hit-chars` and `x-mock-prefix-cache-prompt-chars`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from stargate.asgi import ASGIMessage, ASGIReceive, ASGIScope, ASGISend, answer_lifespan
from stargate.mock import prefix_cache, shapes
from stargate.mock.control import (
    ControlError,
    Counters,
    FailNext,
    Knobs,
    PrefixCacheKnobs,
    apply_control,
    apply_prefix_cache_control,
)
from stargate.mock.prefix_cache import PrefixCache
from stargate.mock.shapes import RequestError

__all__ = [
    "DroppedConnection",
    "MockBackend",
    "MockBackendConfig",
    "drop_filter",
]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_EMBEDDING_DIMENSIONS = 65536

_JSON = (b"content-type", b"application/json")
_TEXT = (b"content-type", b"text/plain; charset=utf-8")
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]
# Headers a fail_next spec may not set: the mock frames the body itself.
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
HIT_CHARS_HEADER = b"x-mock-prefix-cache-hit-chars"
PROMPT_CHARS_HEADER = b"x-mock-prefix-cache-prompt-chars"

Headers = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True, slots=True)
class MockBackendConfig:
    """What `stargate mock-backend` serves, and the knobs' initial (and reset) values."""

    host: str = "127.0.0.1"
    port: int = 8001
    models: tuple[str, ...] = ("mock-model",)
    ttft_ms: float = 0.0
    inter_token_ms: float = 0.0
    tokens: int = 16
    prefix_cache_blocks: int = 0
    prefix_cache_speedup: float = prefix_cache.DEFAULT_SPEEDUP
    prefix_cache_block_chars: int = prefix_cache.DEFAULT_BLOCK_CHARS

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("the mock backend needs at least one model")
        if self.ttft_ms < 0 or self.inter_token_ms < 0:
            raise ValueError("delays must be non-negative")
        if self.tokens < 1:
            raise ValueError("tokens must be at least 1")
        self.prefix_cache_knobs()  # validates them

    def knobs(self) -> Knobs:
        """The knobs a fresh (or reset) mock starts with."""
        return Knobs(ttft_ms=self.ttft_ms, inter_token_ms=self.inter_token_ms, tokens=self.tokens)

    def prefix_cache_knobs(self) -> PrefixCacheKnobs:
        """The prefix-cache knobs a fresh (or reset) mock starts with."""
        return PrefixCacheKnobs(
            blocks=self.prefix_cache_blocks,
            speedup=self.prefix_cache_speedup,
            block_chars=self.prefix_cache_block_chars,
        )


class DroppedConnection(Exception):
    """Raised by the app to make the server abort a stream (`drop_mid_stream`)."""


def drop_filter(record: logging.LogRecord) -> bool:
    """A logging filter hiding the server's traceback for a deliberate `DroppedConnection`."""
    exc_info = record.exc_info
    return not (exc_info and isinstance(exc_info[1], DroppedConnection))


@dataclass(frozen=True, slots=True)
class _Stream:
    """A planned SSE stream: `(delay before, event bytes)` pairs; the closing events start at
    `closing` (a dropped stream never sends them)."""

    events: list[tuple[float, bytes]]
    closing: int
    headers: Headers = ()


@dataclass(frozen=True, slots=True)
class _Reply:
    """A planned non-streaming JSON answer, sent after `delay` seconds."""

    delay: float
    payload: dict[str, Any]
    headers: Headers = ()


def _seconds(milliseconds: float) -> float:
    return milliseconds / 1000.0


def _header(scope: ASGIScope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _received_headers(scope: ASGIScope) -> dict[str, str]:
    headers: dict[str, str] = {}
    for key, value in scope["headers"]:
        name = bytes(key).decode("latin-1")
        text = bytes(value).decode("latin-1")
        headers[name] = f"{headers[name]}, {text}" if name in headers else text
    return headers


async def _read_body(receive: ASGIReceive) -> bytes | None:
    """The whole request body, or None if the client went away or sent too much."""
    message = await receive()
    if message["type"] != "http.request":
        return None
    body = bytes(message.get("body", b""))
    if not message.get("more_body", False):
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = bytes(message.get("body", b""))
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


Handler = Callable[["MockBackend", ASGIScope, bytes, ASGIReceive, ASGISend], Awaitable[None]]


class MockBackend:
    """The ASGI app; its knobs and counters are plain attributes, changed by `/test-control`."""

    def __init__(self, config: MockBackendConfig) -> None:
        self.config = config
        self.models = config.models
        self._served = frozenset(config.models)
        self.defaults = config.knobs()
        self.knobs = self.defaults
        self.prefix_cache_defaults = config.prefix_cache_knobs()
        self.prefix_cache_knobs = self.prefix_cache_defaults
        self.prefix_cache = PrefixCache(
            self.prefix_cache_knobs.blocks, self.prefix_cache_knobs.block_chars
        )
        self.counters = Counters()
        self.in_flight = 0
        self._ids = itertools.count(1)

    # ---------------------------------------------------------------- dispatch

    async def __call__(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await answer_lifespan(receive, send)

    async def _http(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        counters = self.counters
        counters.requests_total += 1
        route = _ROUTES.get(scope["path"])
        if route is None:
            counters.requests["not_found"] += 1
        else:
            counters.requests[route[0]] += 1
        body = await _read_body(receive)
        if body is None:
            if scope["method"] == "POST":  # too large; a client that left reads nothing anyway
                await self._json(scope, send, 413, shapes.error_body("request body too large"))
            return
        if route is None:
            message = f"no route for {scope['method']} {scope['path']}"
            await self._json(scope, send, 404, shapes.error_body(message, "not_found_error"))
            return
        _, methods, handler = route
        if scope["method"] not in methods:
            message = f"method {scope['method']} not allowed on {scope['path']}"
            extra = [(b"allow", ", ".join(methods).encode())]
            await self._json(scope, send, 405, shapes.error_body(message), extra)
            return
        await handler(self, scope, body, receive, send)

    # ---------------------------------------------------------------- responses

    def _common_headers(self, scope: ASGIScope) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-mock-request-count", str(self.counters.requests_total).encode())]
        request_id = _header(scope, b"x-request-id")
        if request_id is not None:
            headers.append((b"x-request-id", request_id))
        return headers

    async def _send_bytes(
        self,
        scope: ASGIScope,
        send: ASGISend,
        status: int,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        headers.append((b"content-length", str(len(body)).encode()))
        headers.extend(self._common_headers(scope))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _json(
        self,
        scope: ASGIScope,
        send: ASGISend,
        status: int,
        payload: Any,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        headers = [_JSON, *(extra or ())]
        await self._send_bytes(scope, send, status, shapes.dumps(payload), headers)

    async def _failure(self, scope: ASGIScope, send: ASGISend, fail: FailNext) -> None:
        if fail.body is None:
            message = f"mock injected failure (fail_next, status {fail.status})"
            body = shapes.dumps(shapes.error_body(message, "mock_injected_failure", fail.status))
            content_type = _JSON
        else:
            body = fail.body.encode()
            try:
                json.loads(body)
                content_type = _JSON
            except (ValueError, RecursionError):
                content_type = _TEXT
        custom = [
            (name.encode("latin-1"), value.encode("latin-1"))
            for name, value in fail.headers
            if name not in _FRAMING_HEADERS
        ]
        headers = [] if any(name == b"content-type" for name, _ in custom) else [content_type]
        if fail.status in (204, 304):  # no body, and no content-length, for these
            headers = custom + self._common_headers(scope)
            await send({"type": "http.response.start", "status": fail.status, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        await self._send_bytes(scope, send, fail.status, body, headers + custom)

    # ---------------------------------------------------------------- plain endpoints

    async def _models(
        self, scope: ASGIScope, body: bytes, receive: ASGIReceive, send: ASGISend
    ) -> None:
        await self._json(scope, send, 200, shapes.models_list(self.models))

    async def _health(
        self, scope: ASGIScope, body: bytes, receive: ASGIReceive, send: ASGISend
    ) -> None:
        if self.knobs.healthy:
            await self._send_bytes(scope, send, 200, b"ok", [_TEXT])
        else:
            await self._send_bytes(scope, send, 503, b"unhealthy", [_TEXT])

    def snapshot(self) -> dict[str, Any]:
        """`GET /test-control`: the knobs (valid `POST` input), models, in-flight and counters."""
        return {
            **self.knobs.to_json(),
            **self.prefix_cache_knobs.to_json(),
            "models": list(self.models),
            "in_flight": self.in_flight,
            "counters": self.counters.to_json(cached_blocks=len(self.prefix_cache)),
        }

    async def _control(
        self, scope: ASGIScope, body: bytes, receive: ASGIReceive, send: ASGISend
    ) -> None:
        if scope["method"] == "POST":
            try:
                payload = json.loads(body)
            except (ValueError, RecursionError):  # see _generate
                message = "the test-control body is not valid JSON"
                await self._json(scope, send, 400, shapes.error_body(message))
                return
            try:
                knobs, reset = apply_control(payload, self.knobs, self.defaults)
                cache_knobs = apply_prefix_cache_control(
                    payload, self.prefix_cache_knobs, self.prefix_cache_defaults, reset=reset
                )
            except ControlError as error:
                await self._json(scope, send, 400, shapes.error_body(str(error)))
                return
            self.knobs, self.prefix_cache_knobs = knobs, cache_knobs
            if reset:
                self.counters = Counters()
                self.prefix_cache.clear()
            evicted = self.prefix_cache.configure(cache_knobs.blocks, cache_knobs.block_chars)
            self.counters.prefix_cache.evicted_blocks += evicted
            log.info("test-control: %s %s", self.knobs, self.prefix_cache_knobs)
        await self._json(scope, send, 200, self.snapshot())

    # ---------------------------------------------------------------- inference endpoints

    async def _inference(
        self,
        scope: ASGIScope,
        body: bytes,
        receive: ASGIReceive,
        send: ASGISend,
        plan: Callable[[MockBackend, ASGIScope, dict[str, Any], Knobs], _Stream | _Reply],
    ) -> None:
        self.in_flight += 1
        try:
            await self._generate(scope, body, receive, send, plan)
        finally:
            self.in_flight -= 1

    async def _generate(
        self,
        scope: ASGIScope,
        body: bytes,
        receive: ASGIReceive,
        send: ASGISend,
        plan: Callable[[MockBackend, ASGIScope, dict[str, Any], Knobs], _Stream | _Reply],
    ) -> None:
        knobs = self.knobs
        fail = knobs.fail_next
        if fail.count > 0:
            self.knobs = dataclasses.replace(
                knobs, fail_next=dataclasses.replace(fail, count=fail.count - 1)
            )
            self.counters.injected_failures += 1
            if knobs.response_delay_ms > 0:
                await trio.sleep(_seconds(knobs.response_delay_ms))
            await self._failure(scope, send, fail)
            return
        try:
            request = json.loads(body)
            if not isinstance(request, dict):
                raise RequestError("the request body must be a JSON object")
            model = request.get("model")
            if not isinstance(model, str) or not model:
                raise RequestError("you must provide a 'model' parameter")
            if model not in self._served:
                served = ", ".join(self.models)
                raise RequestError(f"the model '{model}' is not served here (serving: {served})")
            planned = plan(self, scope, request, knobs)
        except RequestError as error:
            await self._json(scope, send, 400, shapes.error_body(str(error)))
            return
        except (ValueError, RecursionError):
            # RecursionError: JSON nested deeper than the interpreter's stack (a few thousand
            # `[`) is invalid input like any other, a 400 and not a 500 with a traceback.
            await self._json(scope, send, 400, shapes.error_body("the body is not valid JSON"))
            return
        drop_after: int | None = None
        if isinstance(planned, _Stream):
            drop = self.knobs.drop_mid_stream
            if drop.count > 0:
                self.knobs = dataclasses.replace(
                    self.knobs, drop_mid_stream=dataclasses.replace(drop, count=drop.count - 1)
                )
                drop_after = min(drop.after_chunks, planned.closing)
        elif knobs.response_delay_ms == 0 and planned.delay == 0:
            # The hot path: no timers, so no task watching for the client leaving.
            await self._reply(scope, send, planned, request)
            return
        dropped = await self._watching_disconnect(
            receive, scope, send, planned, request, knobs, drop_after
        )
        if dropped:
            self.counters.dropped_streams += 1
            raise DroppedConnection(f"drop_mid_stream after {drop_after} event(s)")

    async def _watching_disconnect(
        self,
        receive: ASGIReceive,
        scope: ASGIScope,
        send: ASGISend,
        planned: _Stream | _Reply,
        request: dict[str, Any],
        knobs: Knobs,
        drop_after: int | None,
    ) -> bool:
        """Answer, but stop early (cancelled) if the client goes away; True if the stream must
        now be aborted (`drop_mid_stream`)."""
        state = {"finishing": False, "dropped": False}

        async def watch(cancel_scope: trio.CancelScope) -> None:
            while True:
                message: ASGIMessage = await receive()
                if message["type"] == "http.disconnect":
                    if not state["finishing"]:
                        self.counters.client_disconnects += 1
                        cancel_scope.cancel()
                    return

        async def answer(cancel_scope: trio.CancelScope) -> None:
            if knobs.response_delay_ms > 0:
                await trio.sleep(_seconds(knobs.response_delay_ms))
            if isinstance(planned, _Reply):
                if planned.delay > 0:
                    await trio.sleep(planned.delay)
                state["finishing"] = True
                await self._reply(scope, send, planned, request)
            else:
                state["dropped"] = await self._stream(scope, send, planned, drop_after, state)
            cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            nursery.start_soon(answer, nursery.cancel_scope)
        return state["dropped"]

    async def _reply(
        self, scope: ASGIScope, send: ASGISend, planned: _Reply, request: dict[str, Any]
    ) -> None:
        payload = planned.payload
        if _header(scope, b"x-mock-echo-headers") == b"1":
            payload = {**payload, "mock_request_headers": _received_headers(scope)}
        await self._json(scope, send, 200, payload, list(planned.headers))

    async def _stream(
        self,
        scope: ASGIScope,
        send: ASGISend,
        planned: _Stream,
        drop_after: int | None,
        state: dict[str, bool],
    ) -> bool:
        """Send the SSE stream; True if it stopped after `drop_after` events to be aborted."""
        headers = [*_SSE_HEADERS, *planned.headers, *self._common_headers(scope)]
        if _header(scope, b"x-mock-echo-headers") == b"1":  # a stream has no JSON body for them
            echoed = json.dumps(_received_headers(scope), separators=(",", ":"))
            headers.append((b"x-mock-request-headers", echoed.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        events = planned.events
        limit = len(events) if drop_after is None else drop_after
        last = len(events) - 1
        for index in range(limit):
            delay, chunk = events[index]
            if delay > 0:
                await trio.sleep(delay)
            if index == last:
                state["finishing"] = True
                await send({"type": "http.response.body", "body": chunk})
            else:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        return limit < len(events)

    def _next_id(self) -> int:
        return next(self._ids)

    # ---------------------------------------------------------------- planners (no I/O)

    def _prompt_tokens(self, scope: ASGIScope, text: str) -> int:
        from_header = shapes.header_token_count(_header(scope, b"x-input-tokens"))
        return from_header if from_header is not None else shapes.estimate_tokens(text)

    def _prefill(
        self, knobs: Knobs, cache_text: Callable[[dict[str, Any]], str], request: dict[str, Any]
    ) -> tuple[float, Headers]:
        """The request's TTFT in milliseconds and its prefix-cache headers; with the model on,
        looks the prompt up and inserts it (call it once the request is known to be valid)."""
        cache_knobs = self.prefix_cache_knobs
        if not cache_knobs.enabled:
            return knobs.ttft_ms, ()
        lookup = self.prefix_cache.lookup_and_insert(cache_text(request))
        self.counters.prefix_cache.count(lookup)
        ttft_ms = prefix_cache.ttft_ms(knobs.ttft_ms, lookup.hit_fraction, cache_knobs.speedup)
        headers = (
            (HIT_CHARS_HEADER, str(lookup.hit_chars).encode()),
            (PROMPT_CHARS_HEADER, str(lookup.prompt_chars).encode()),
        )
        return ttft_ms, headers

    def _plan_chat(
        self, scope: ASGIScope, request: dict[str, Any], knobs: Knobs
    ) -> _Stream | _Reply:
        prompt = self._prompt_tokens(scope, shapes.chat_prompt_text(request))
        limit = shapes.max_tokens_field(request, "max_completion_tokens", "max_tokens")
        tokens = knobs.tokens if limit is None else min(limit, knobs.tokens)
        ttft_ms, headers = self._prefill(knobs, shapes.chat_cache_text, request)
        model: str = request["model"]
        response_id = f"chatcmpl-mock-{self._next_id()}"
        created = int(time.time())
        if request.get("stream") is not True:
            text = shapes.answer_text(tokens)
            payload = shapes.chat_completion(response_id, created, model, text, prompt, tokens)
            return _Reply(_generation_delay(knobs, ttft_ms, tokens), payload, headers)
        include_usage = _include_usage(request)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            payload = shapes.chat_chunk(
                response_id, created, model, delta, finish, include_usage=include_usage
            )
            return shapes.sse_data(payload)

        ttft, gap = _seconds(ttft_ms), _seconds(knobs.inter_token_ms)
        events = [(ttft, chunk({"role": "assistant", "content": ""}))]
        events += [
            (0.0 if index == 0 else gap, chunk({"content": shapes.token_text(index)}))
            for index in range(tokens)
        ]
        closing = len(events)
        events.append((0.0, chunk({}, "stop")))
        if include_usage:
            usage = shapes.chat_usage_chunk(response_id, created, model, prompt, tokens)
            events.append((0.0, shapes.sse_data(usage)))
        events.append((0.0, shapes.SSE_DONE))
        return _Stream(events, closing, headers)

    def _plan_completion(
        self, scope: ASGIScope, request: dict[str, Any], knobs: Knobs
    ) -> _Stream | _Reply:
        prompt = self._prompt_tokens(scope, shapes.prompt_text(request))
        limit = shapes.max_tokens_field(request, "max_tokens")
        tokens = knobs.tokens if limit is None else min(limit, knobs.tokens)
        ttft_ms, headers = self._prefill(knobs, shapes.completion_cache_text, request)
        model: str = request["model"]
        response_id = f"cmpl-mock-{self._next_id()}"
        created = int(time.time())
        if request.get("stream") is not True:
            text = shapes.answer_text(tokens)
            payload = shapes.completion(response_id, created, model, text, prompt, tokens)
            return _Reply(_generation_delay(knobs, ttft_ms, tokens), payload, headers)
        include_usage = _include_usage(request)

        def chunk(text: str, finish: str | None = None) -> bytes:
            payload = shapes.completion_chunk(
                response_id, created, model, text, finish, include_usage=include_usage
            )
            return shapes.sse_data(payload)

        ttft, gap = _seconds(ttft_ms), _seconds(knobs.inter_token_ms)
        events = [
            (ttft if index == 0 else gap, chunk(shapes.token_text(index)))
            for index in range(tokens)
        ]
        closing = len(events)
        events.append((0.0, chunk("", "stop")))
        if include_usage:
            usage = shapes.completion_usage_chunk(response_id, created, model, prompt, tokens)
            events.append((0.0, shapes.sse_data(usage)))
        events.append((0.0, shapes.SSE_DONE))
        return _Stream(events, closing, headers)

    def _plan_responses(
        self, scope: ASGIScope, request: dict[str, Any], knobs: Knobs
    ) -> _Stream | _Reply:
        prompt = self._prompt_tokens(scope, shapes.responses_input_text(request))
        limit = shapes.max_tokens_field(request, "max_output_tokens")
        tokens = knobs.tokens if limit is None else min(limit, knobs.tokens)
        ttft_ms, headers = self._prefill(knobs, shapes.responses_cache_text, request)
        model: str = request["model"]
        number = self._next_id()
        response_id, message_id = f"resp_mock_{number}", f"msg_mock_{number}"
        created = int(time.time())
        text = shapes.answer_text(tokens)

        def response(status: str) -> dict[str, Any]:
            return shapes.response_object(
                response_id,
                message_id,
                created,
                model,
                status=status,
                text=text,
                input_tokens=prompt,
                output_tokens=tokens,
            )

        if request.get("stream") is not True:
            return _Reply(_generation_delay(knobs, ttft_ms, tokens), response("completed"), headers)
        created_event = {"type": "response.created", "sequence_number": 0}
        created_event["response"] = response("in_progress")
        events = [(0.0, shapes.sse_event("response.created", created_event))]
        ttft, gap = _seconds(ttft_ms), _seconds(knobs.inter_token_ms)
        for index in range(tokens):
            delta = {
                "type": "response.output_text.delta",
                "sequence_number": index + 1,
                "item_id": message_id,
                "output_index": 0,
                "content_index": 0,
                "delta": shapes.token_text(index),
                "logprobs": [],
            }
            delay = ttft if index == 0 else gap
            events.append((delay, shapes.sse_event("response.output_text.delta", delta)))
        closing = len(events)
        completed = {
            "type": "response.completed",
            "sequence_number": tokens + 1,
            "response": response("completed"),
        }
        events.append((0.0, shapes.sse_event("response.completed", completed)))
        return _Stream(events, closing, headers)

    def _plan_embeddings(
        self, scope: ASGIScope, request: dict[str, Any], knobs: Knobs
    ) -> _Stream | _Reply:
        counts = shapes.embedding_inputs(request.get("input"))
        from_header = shapes.header_token_count(_header(scope, b"x-input-tokens"))
        prompt = from_header if from_header is not None else sum(counts)
        encoding = request.get("encoding_format")
        if encoding not in (None, "float", "base64"):
            raise RequestError("'encoding_format' must be 'float' or 'base64'")
        dimensions = request.get("dimensions", 3)
        if (
            isinstance(dimensions, bool)
            or not isinstance(dimensions, int)
            or not 1 <= dimensions <= MAX_EMBEDDING_DIMENSIONS
        ):
            raise RequestError("'dimensions' must be a positive integer")
        payload = shapes.embeddings_response(
            request["model"],
            len(counts),
            prompt,
            dimensions=dimensions,
            base64_format=encoding == "base64",
        )
        return _Reply(0.0, payload)

    # ---------------------------------------------------------------- route handlers

    async def _chat(
        self, scope: ASGIScope, body: bytes, receive: ASGIReceive, send: ASGISend
    ) -> None:
        await self._inference(scope, body, receive, send, MockBackend._plan_chat)

    async def _completions(
        self, scope: ASGIScope, body: bytes, receive: ASGIReceive, send: ASGISend
    ) -> None:
        await self._inference(scope, body, receive, send, MockBackend._plan_completion)

    async def _responses(
        self, scope: ASGIScope, body: bytes, receive: ASGIReceive, send: ASGISend
    ) -> None:
        await self._inference(scope, body, receive, send, MockBackend._plan_responses)

    async def _embeddings(
        self, scope: ASGIScope, body: bytes, receive: ASGIReceive, send: ASGISend
    ) -> None:
        await self._inference(scope, body, receive, send, MockBackend._plan_embeddings)


def _generation_delay(knobs: Knobs, ttft_ms: float, tokens: int) -> float:
    """How long a non-streaming generation of `tokens` tokens takes (TTFT, then decoding)."""
    return _seconds(ttft_ms + max(tokens - 1, 0) * knobs.inter_token_ms)


def _include_usage(request: dict[str, Any]) -> bool:
    options = request.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


_ROUTES: dict[str, tuple[str, tuple[str, ...], Handler]] = {
    "/v1/chat/completions": ("chat_completions", ("POST",), MockBackend._chat),
    "/v1/completions": ("completions", ("POST",), MockBackend._completions),
    "/v1/responses": ("responses", ("POST",), MockBackend._responses),
    "/v1/embeddings": ("embeddings", ("POST",), MockBackend._embeddings),
    "/v1/models": ("models", ("GET", "HEAD"), MockBackend._models),
    "/health": ("health", ("GET", "HEAD"), MockBackend._health),
    "/test-control": ("test_control", ("GET", "POST"), MockBackend._control),
}
