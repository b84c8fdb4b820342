"""The mock backend: a lean raw ASGI app serving OpenAI-compatible inference endpoints.

It is deliberately cheap (no framework, payloads built from plain dicts, no task per request on
the zero-delay non-streaming path) so that one mock can absorb far more traffic than one router
replica can proxy. Its behaviour is steered at run time through `/test-control` (see
`stargate.mock.control`).

Chat, completions and Responses requests go through the mock engine (`stargate.mock.engine`, a
batching server's running slots, KV cache and FIFO waiting queue; docs/mock-backend.md,
"Batching"). With its limits off (the default) every request runs the moment it arrives, and the
timing is exactly that of the knobs. Timing of a generation (`ttft_ms`, `inter_token_ms`,
`response_delay_ms` are the current knobs):

* streaming: `response_delay_ms`, then the response head (and, for `/v1/responses`, the
  `response.created` event) as the request reaches the engine, then the wait for a running
  slot, then the TTFT, then the first token (chat sends its role chunk just before it), then
  `inter_token_ms` before each further token, then at once the closing events (finish chunk,
  optional usage chunk, `[DONE]`; or `response.completed`). Every SSE event is its own ASGI
  body message. The slot is released with the last token.
* non-streaming: `response_delay_ms`, the wait for a slot, `TTFT + (tokens - 1) *
  inter_token_ms`, then the head and the whole JSON body.
* embeddings: `response_delay_ms`, then the JSON body (they do not go through the engine).

The TTFT is `ttft_ms`, or with the prefix-cache model on (`prefix_cache_blocks` > 0, see
`stargate.mock.prefix_cache`) `ttft_ms * (1 - hit_fraction * prefix_cache_speedup)`, where
`hit_fraction` is the share of the prompt's text found in the cache when the request was planned
(the cache is looked up and updated at that moment, in the order requests arrive; see
docs/mock-backend.md); plus `prefill_ms_per_token` for each prompt token not cached. Every chat,
completions and Responses answer that got that far then carries `x-mock-prefix-cache-hit-chars`
and `x-mock-prefix-cache-prompt-chars`. With `engine_id` set (`--engine-id`, a hidden flag for
benchmarks) every answer carries `x-mock-engine-id`, so a client behind any router knows which
engine served it.

`GET /metrics` (vLLM's Prometheus metrics), `GET /kv-cache/stats` (with a bounded KV cache) and
`GET /pylon/v1/stats/stream` (NDJSON, with `engine_stats_stream`) report the engine's load; they
are not counted in `counters.requests`.

With `kv_events.endpoint` set (`--kv-events-endpoint`, `stargate.mock.kv_events`) the prefix
cache keys its blocks by the router's prefix chain of the raw request (a block is
`kv_events.block_bytes` bytes of the router's prompt stream) and publishes its changes as vLLM's
KV events.
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

from stargate.asgi import (
    ASGIMessage,
    ASGIReceive,
    ASGIScope,
    ASGISend,
    BodyTooLarge,
    ClientGone,
    answer_lifespan,
    read_body,
)
from stargate.mock import prefix_cache, shapes
from stargate.mock.control import (
    BatchingKnobs,
    ControlError,
    Counters,
    FailNext,
    Knobs,
    PrefixCacheKnobs,
    apply_batching_control,
    apply_control,
    apply_prefix_cache_control,
)
from stargate.mock.engine import Engine, RunningSequence, SequenceInfo
from stargate.mock.kv_events import KvEventPublisher, KvEventsConfig
from stargate.mock.prefix_cache import PrefixCache
from stargate.mock.shapes import RequestError
from stargate.mock.stats_stream import NDJSON_HEADERS

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
_PROMETHEUS = (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]
# Headers a fail_next spec may not set: the mock frames the body itself.
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
HIT_CHARS_HEADER = b"x-mock-prefix-cache-hit-chars"
PROMPT_CHARS_HEADER = b"x-mock-prefix-cache-prompt-chars"
ENGINE_ID_HEADER = b"x-mock-engine-id"

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
    max_num_seqs: int = 0
    prefill_ms_per_token: float = 0.0
    kv_cache_tokens: int = 0
    engine_stats_stream: bool = False
    engine_id: str = ""
    """Sent as `x-mock-engine-id` on every answer when set (which engine served a request,
    whatever router stands in front of it; the affinity benchmark's engine shares)."""
    kv_events: KvEventsConfig = dataclasses.field(default_factory=KvEventsConfig)
    """Publish the prefix cache's changes as vLLM's KV events (`stargate.mock.kv_events`)."""

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("the mock backend needs at least one model")
        if self.ttft_ms < 0 or self.inter_token_ms < 0:
            raise ValueError("delays must be non-negative")
        if self.tokens < 1:
            raise ValueError("tokens must be at least 1")
        if self.kv_cache_tokens < 0:
            raise ValueError("kv_cache_tokens must be non-negative")
        if not all(" " < char < "\x7f" for char in self.engine_id):
            raise ValueError("engine_id must be visible ASCII (it is sent as a header value)")
        self.prefix_cache_knobs()  # validates them
        self.batching_knobs()

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

    def batching_knobs(self) -> BatchingKnobs:
        """The batching knobs a fresh (or reset) mock starts with."""
        return BatchingKnobs(
            max_num_seqs=self.max_num_seqs, prefill_ms_per_token=self.prefill_ms_per_token
        )


class DroppedConnection(Exception):
    """Raised by the app to make the server abort a stream (`drop_mid_stream`)."""


def drop_filter(record: logging.LogRecord) -> bool:
    """A logging filter hiding the server's traceback for a deliberate `DroppedConnection`."""
    exc_info = record.exc_info
    return not (exc_info and isinstance(exc_info[1], DroppedConnection))


@dataclass(frozen=True, slots=True)
class _Stream:
    """A planned SSE stream: `(delay before, event bytes)` pairs.

    The events before `admit_at` are sent on arrival; the request then waits for a running slot,
    and the delay of event `admit_at` is its TTFT. Generated token `i` (from 1) is event
    `first_token + i - 1`, and the closing events start at `closing` (a dropped stream never
    sends them).
    """

    events: list[tuple[float, bytes]]
    closing: int
    info: SequenceInfo
    headers: Headers = ()
    admit_at: int = 0
    first_token: int = 0


@dataclass(frozen=True, slots=True)
class _Reply:
    """A planned non-streaming JSON answer: once the request has a running slot, `ttft`
    seconds, then `tokens - 1` gaps of `gap` seconds, then the answer. Embeddings have no
    `info`: they take no slot and no time."""

    payload: dict[str, Any]
    headers: Headers = ()
    info: SequenceInfo | None = None
    ttft: float = 0.0
    gap: float = 0.0
    tokens: int = 0

    @property
    def delay(self) -> float:
        """The generation's time once admitted: TTFT, then decoding."""
        return self.ttft + max(self.tokens - 1, 0) * self.gap


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
    try:
        return await read_body(receive, MAX_BODY_BYTES)
    except (BodyTooLarge, ClientGone):
        return None


Handler = Callable[["MockBackend", ASGIScope, bytes, ASGIReceive, ASGISend], Awaitable[None]]
Planner = Callable[["MockBackend", ASGIScope, dict[str, Any], Knobs], "_Stream | _Reply"]


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
        self.kv_events = KvEventPublisher(config.kv_events) if config.kv_events.enabled else None
        # The request being planned, for the KV-events chain (plans are synchronous).
        self._planning: tuple[str, bytes] = ("", b"")
        self.prefix_cache = PrefixCache(
            self.prefix_cache_knobs.blocks, self._cache_block_chars(), self.kv_events
        )
        self.counters = Counters()
        self.in_flight = 0
        self._engine_id_headers = (
            [(ENGINE_ID_HEADER, config.engine_id.encode())] if config.engine_id else []
        )
        self._ids = itertools.count(1)
        self.batching_defaults = config.batching_knobs()
        self.batching_knobs = self.batching_defaults
        self.engine = Engine(
            config.models,
            max_num_seqs=self.batching_knobs.max_num_seqs,
            kv_cache_tokens=config.kv_cache_tokens,
            on_kv_change=self._fit_prefix_cache,
        )
        self._fit_prefix_cache()

    def _fit_prefix_cache(self) -> None:
        """Give the prefix cache its capacity: `prefix_cache_blocks`, or with a bounded KV cache
        at most the blocks the running sequences leave free (evicting down to that)."""
        block_chars = self._cache_block_chars()
        capacity = prefix_cache.capacity_within_kv(
            self.prefix_cache_knobs.blocks, block_chars, self.engine.scheduler.kv_free
        )
        evicted = self.prefix_cache.configure(capacity, block_chars)
        self.counters.prefix_cache.evicted_blocks += evicted

    def _cache_block_chars(self) -> int:
        """The cache's block: `prefix_cache_block_chars`, or with KV events the router's block
        (`kv_events.block_bytes`), whatever the knob says."""
        if self.kv_events is not None:
            return self.config.kv_events.block_bytes
        return self.prefix_cache_knobs.block_chars

    # ---------------------------------------------------------------- dispatch

    async def __call__(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await answer_lifespan(receive, send)

    async def _http(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        route = _ROUTES.get(scope["path"])
        counter = "not_found" if route is None else route[0]
        if counter is not None:  # the observability endpoints are not counted
            counters = self.counters
            counters.requests_total += 1
            counters.requests[counter] += 1
        body = await _read_body(receive)
        if body is None:
            if scope["method"] == "POST":  # too large; a client that left reads nothing anyway
                await self._json(scope, send, 413, shapes.error_body("request body too large"))
            return
        if route is None:
            await self._not_found(scope, send)
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
        headers.extend(self._engine_id_headers)
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

    async def _not_found(self, scope: ASGIScope, send: ASGISend) -> None:
        message = f"no route for {scope['method']} {scope['path']}"
        await self._json(scope, send, 404, shapes.error_body(message, "not_found_error"))

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

    async def _metrics(
        self, scope: ASGIScope, body: bytes, receive: ASGIReceive, send: ASGISend
    ) -> None:
        text = self.engine.render_metrics().encode()
        await self._send_bytes(scope, send, 200, text, [_PROMETHEUS])

    async def _kv_cache_stats(
        self, scope: ASGIScope, body: bytes, receive: ASGIReceive, send: ASGISend
    ) -> None:
        capacity = self.config.kv_cache_tokens
        if capacity == 0:  # unlimited: there is nothing to report
            await self._not_found(scope, send)
            return
        used = self.engine.kv_used
        payload = {
            "model": self.models[0],
            "kv_cache_capacity_tokens": capacity,
            "kv_cache_used_tokens": used,
            "kv_cache_free_tokens": capacity - used,
        }
        await self._json(scope, send, 200, payload)

    async def _stats_stream(
        self, scope: ASGIScope, body: bytes, receive: ASGIReceive, send: ASGISend
    ) -> None:
        if not self.config.engine_stats_stream:
            await self._not_found(scope, send)
            return
        headers = [*NDJSON_HEADERS, *self._common_headers(scope)]
        if await self.engine.stats.serve(receive, send, headers):
            raise DroppedConnection("the stats-stream subscriber fell behind")

    def snapshot(self) -> dict[str, Any]:
        """`GET /test-control`: the knobs (valid `POST` input), models, in-flight, the engine's
        queues and KV cache (read only), and counters."""
        return {
            **self.knobs.to_json(),
            **self.prefix_cache_knobs.to_json(),
            **self.batching_knobs.to_json(),
            "models": list(self.models),
            "in_flight": self.in_flight,
            "running": self.engine.running,
            "waiting": self.engine.waiting,
            "kv_cache_tokens": self.config.kv_cache_tokens,
            "kv_cache_used_tokens": self.engine.kv_used,
            "counters": self.counters.to_json(cached_blocks=len(self.prefix_cache)),
            **self._kv_events_json(),
        }

    def _kv_events_json(self) -> dict[str, Any]:
        publisher = self.kv_events
        if publisher is None:
            return {}
        return {"kv_events": {"sent": publisher.sent, "dropped": publisher.dropped}}

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
                batching = apply_batching_control(
                    payload, self.batching_knobs, self.batching_defaults, reset=reset
                )
            except ControlError as error:
                await self._json(scope, send, 400, shapes.error_body(str(error)))
                return
            self.knobs, self.prefix_cache_knobs = knobs, cache_knobs
            self.batching_knobs = batching
            if reset:
                self.counters = Counters()
                self.prefix_cache.clear()
            self._fit_prefix_cache()
            self.engine.set_max_num_seqs(batching.max_num_seqs)  # more slots wake waiters
            log.info("test-control: %s %s %s", self.knobs, self.prefix_cache_knobs, batching)
        await self._json(scope, send, 200, self.snapshot())

    # ---------------------------------------------------------------- inference endpoints

    async def _inference(
        self,
        scope: ASGIScope,
        body: bytes,
        receive: ASGIReceive,
        send: ASGISend,
        plan: Planner,
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
        plan: Planner,
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
            self._planning = (scope["path"], body)
            try:
                planned = plan(self, scope, request, knobs)
            finally:
                self._planning = ("", b"")
        except RequestError as error:
            await self._json(scope, send, 400, shapes.error_body(str(error), code=error.code))
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
        elif (
            knobs.response_delay_ms == 0
            and planned.delay == 0
            and (planned.info is None or self.engine.complete_at_once(planned.info))
        ):
            # The hot path: no timers, so no task watching for the client leaving. The
            # generation takes no time and got a slot at once, so it went through the engine
            # in one step.
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
                if planned.info is not None:
                    with self.engine.sequence(planned.info) as sequence:
                        await self._generate_quietly(sequence, planned)
                state["finishing"] = True
                await self._reply(scope, send, planned, request)
            else:
                with self.engine.sequence(planned.info) as sequence:
                    state["dropped"] = await self._stream(
                        scope, send, planned, drop_after, state, sequence
                    )
            cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            nursery.start_soon(answer, nursery.cancel_scope)
        return state["dropped"]

    async def _generate_quietly(self, sequence: RunningSequence, planned: _Reply) -> None:
        """A non-streaming generation: a running slot, the TTFT, then the decoding. Its tokens
        are reported one by one only when the stats stream has a listener; otherwise the
        decoding is one sleep (one timer instead of one per token)."""
        await sequence.admission()
        if planned.ttft > 0:
            await trio.sleep(planned.ttft)
        sequence.prefilled()
        tokens, gap = planned.tokens, planned.gap
        if gap > 0 and tokens > 1 and self.engine.stats.active:
            sequence.generated(1)
            for count in range(2, tokens + 1):
                await trio.sleep(gap)
                sequence.generated(count)
        else:
            if gap > 0 and tokens > 1:
                await trio.sleep(gap * (tokens - 1))
            sequence.generated(tokens)
        sequence.finish()

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
        sequence: RunningSequence,
    ) -> bool:
        """Send the SSE stream; True if it stopped after `drop_after` events to be aborted.

        The head goes out at once (as vLLM answers a queued stream); the request then waits for
        a running slot before event `admit_at`, whose delay is the TTFT."""
        headers = [*_SSE_HEADERS, *planned.headers, *self._common_headers(scope)]
        if _header(scope, b"x-mock-echo-headers") == b"1":  # a stream has no JSON body for them
            echoed = json.dumps(_received_headers(scope), separators=(",", ":"))
            headers.append((b"x-mock-request-headers", echoed.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        events = planned.events
        limit = len(events) if drop_after is None else drop_after
        last = len(events) - 1
        admit_at, first_token, closing = planned.admit_at, planned.first_token, planned.closing
        for index in range(limit):
            if index == admit_at:
                await sequence.admission()
            delay, chunk = events[index]
            if delay > 0:
                await trio.sleep(delay)
            if index == admit_at:
                sequence.prefilled()
            if index == last:
                state["finishing"] = True
                await send({"type": "http.response.body", "body": chunk})
            else:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if first_token <= index < closing:
                sequence.generated(index - first_token + 1)
                if index == closing - 1:
                    sequence.finish()
        return limit < len(events)

    def _next_id(self) -> int:
        return next(self._ids)

    # ---------------------------------------------------------------- planners (no I/O)

    def _prompt_tokens(self, scope: ASGIScope, text: str) -> int:
        from_header = shapes.header_token_count(_header(scope, b"x-input-tokens"))
        return from_header if from_header is not None else shapes.estimate_tokens(text)

    def _check_fits(self, prompt: int, tokens: int) -> None:
        """400 for a request whose KV reservation exceeds the whole KV cache: it could never
        run (call it before `_prefill`, so that a refused request does not touch the cache)."""
        capacity = self.config.kv_cache_tokens
        if capacity and prompt + tokens > capacity:
            raise shapes.context_too_long(capacity, prompt, tokens)

    def _sequence_info(
        self, scope: ASGIScope, response_id: str, model: str, prompt: int, tokens: int
    ) -> SequenceInfo:
        """The engine's view of the request; it is known by its `x-request-id`, if it has one."""
        header = _header(scope, b"x-request-id")
        request_id = header.decode("latin-1") if header is not None else response_id
        return SequenceInfo(request_id, model, prompt, tokens)

    def _prefill(
        self,
        knobs: Knobs,
        cache_text: Callable[[dict[str, Any]], str],
        request: dict[str, Any],
        prompt_tokens: int,
    ) -> tuple[float, Headers]:
        """The request's TTFT in milliseconds (counted from when it gets a running slot) and its
        prefix-cache headers; with the model on, looks the prompt up and inserts it (call it
        once the request is known to be valid).

        TTFT = the fixed part (`ttft_ms`, shortened by the cached share of the prompt) plus
        `prefill_ms_per_token` for each uncached prompt token."""
        per_token = self.batching_knobs.prefill_ms_per_token
        cache_knobs = self.prefix_cache_knobs
        if not cache_knobs.enabled:
            return knobs.ttft_ms + per_token * prompt_tokens, ()
        if self.kv_events is not None:
            path, body = self._planning
            chain = self.kv_events.chain(path, body)
            lookup = self.prefix_cache.lookup_and_insert_chain(chain, len(cache_text(request)))
        else:
            lookup = self.prefix_cache.lookup_and_insert(cache_text(request))
        self.counters.prefix_cache.count(lookup)
        ttft_ms = prefix_cache.ttft_ms(knobs.ttft_ms, lookup.hit_fraction, cache_knobs.speedup)
        if per_token:
            ttft_ms += per_token * prefix_cache.uncached_tokens(prompt_tokens, lookup)
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
        self._check_fits(prompt, tokens)
        ttft_ms, headers = self._prefill(knobs, shapes.chat_cache_text, request, prompt)
        model: str = request["model"]
        response_id = f"chatcmpl-mock-{self._next_id()}"
        info = self._sequence_info(scope, response_id, model, prompt, tokens)
        created = int(time.time())
        ttft, gap = _seconds(ttft_ms), _seconds(knobs.inter_token_ms)
        if request.get("stream") is not True:
            text = shapes.answer_text(tokens)
            payload = shapes.chat_completion(response_id, created, model, text, prompt, tokens)
            return _Reply(payload, headers, info, ttft, gap, tokens)
        include_usage = _include_usage(request)
        continuous = _continuous_usage(request)

        def chunk(delta: dict[str, Any], generated: int, finish: str | None = None) -> bytes:
            payload = shapes.chat_chunk(
                response_id,
                created,
                model,
                delta,
                finish,
                include_usage=include_usage,
                usage_so_far=shapes.usage(prompt, generated) if continuous else None,
            )
            return shapes.sse_data(payload)

        events = [(ttft, chunk({"role": "assistant", "content": ""}, 0))]
        events += [
            (0.0 if index == 0 else gap, chunk({"content": shapes.token_text(index)}, index + 1))
            for index in range(tokens)
        ]
        closing = len(events)
        events.append((0.0, chunk({}, tokens, "stop")))
        if include_usage:
            usage = shapes.chat_usage_chunk(response_id, created, model, prompt, tokens)
            events.append((0.0, shapes.sse_data(usage)))
        events.append((0.0, shapes.SSE_DONE))
        return _Stream(events, closing, info, headers, admit_at=0, first_token=1)

    def _plan_completion(
        self, scope: ASGIScope, request: dict[str, Any], knobs: Knobs
    ) -> _Stream | _Reply:
        prompt = self._prompt_tokens(scope, shapes.prompt_text(request))
        limit = shapes.max_tokens_field(request, "max_tokens")
        tokens = knobs.tokens if limit is None else min(limit, knobs.tokens)
        self._check_fits(prompt, tokens)
        ttft_ms, headers = self._prefill(knobs, shapes.completion_cache_text, request, prompt)
        model: str = request["model"]
        response_id = f"cmpl-mock-{self._next_id()}"
        info = self._sequence_info(scope, response_id, model, prompt, tokens)
        created = int(time.time())
        ttft, gap = _seconds(ttft_ms), _seconds(knobs.inter_token_ms)
        if request.get("stream") is not True:
            text = shapes.answer_text(tokens)
            payload = shapes.completion(response_id, created, model, text, prompt, tokens)
            return _Reply(payload, headers, info, ttft, gap, tokens)
        include_usage = _include_usage(request)
        continuous = _continuous_usage(request)

        def chunk(text: str, generated: int, finish: str | None = None) -> bytes:
            payload = shapes.completion_chunk(
                response_id,
                created,
                model,
                text,
                finish,
                include_usage=include_usage,
                usage_so_far=shapes.usage(prompt, generated) if continuous else None,
            )
            return shapes.sse_data(payload)

        events = [
            (ttft if index == 0 else gap, chunk(shapes.token_text(index), index + 1))
            for index in range(tokens)
        ]
        closing = len(events)
        events.append((0.0, chunk("", tokens, "stop")))
        if include_usage:
            usage = shapes.completion_usage_chunk(response_id, created, model, prompt, tokens)
            events.append((0.0, shapes.sse_data(usage)))
        events.append((0.0, shapes.SSE_DONE))
        return _Stream(events, closing, info, headers, admit_at=0, first_token=0)

    def _plan_responses(
        self, scope: ASGIScope, request: dict[str, Any], knobs: Knobs
    ) -> _Stream | _Reply:
        prompt = self._prompt_tokens(scope, shapes.responses_input_text(request))
        limit = shapes.max_tokens_field(request, "max_output_tokens")
        tokens = knobs.tokens if limit is None else min(limit, knobs.tokens)
        self._check_fits(prompt, tokens)
        ttft_ms, headers = self._prefill(knobs, shapes.responses_cache_text, request, prompt)
        model: str = request["model"]
        number = self._next_id()
        response_id, message_id = f"resp_mock_{number}", f"msg_mock_{number}"
        info = self._sequence_info(scope, response_id, model, prompt, tokens)
        created = int(time.time())
        ttft, gap = _seconds(ttft_ms), _seconds(knobs.inter_token_ms)
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
            return _Reply(response("completed"), headers, info, ttft, gap, tokens)
        created_event = {"type": "response.created", "sequence_number": 0}
        created_event["response"] = response("in_progress")
        events = [(0.0, shapes.sse_event("response.created", created_event))]
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
        # response.created goes out on arrival; the slot is awaited before the first delta.
        return _Stream(events, closing, info, headers, admit_at=1, first_token=1)

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
        return _Reply(payload)

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


def _include_usage(request: dict[str, Any]) -> bool:
    options = request.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _continuous_usage(request: dict[str, Any]) -> bool:
    """vLLM's `stream_options.continuous_usage_stats`: the usage so far on every content chunk.
    As in vLLM, an explicit `include_usage: false` turns it off."""
    options = request.get("stream_options")
    return (
        isinstance(options, dict)
        and options.get("continuous_usage_stats") is True
        and options.get("include_usage") is not False
    )


# Route -> (its key in `counters.requests`, None for the observability endpoints, which are not
# counted so that a scraper does not disturb the counts a test asserts; methods; handler).
_ROUTES: dict[str, tuple[str | None, tuple[str, ...], Handler]] = {
    "/v1/chat/completions": ("chat_completions", ("POST",), MockBackend._chat),
    "/v1/completions": ("completions", ("POST",), MockBackend._completions),
    "/v1/responses": ("responses", ("POST",), MockBackend._responses),
    "/v1/embeddings": ("embeddings", ("POST",), MockBackend._embeddings),
    "/v1/models": ("models", ("GET", "HEAD"), MockBackend._models),
    "/health": ("health", ("GET", "HEAD"), MockBackend._health),
    "/test-control": ("test_control", ("GET", "POST"), MockBackend._control),
    "/metrics": (None, ("GET",), MockBackend._metrics),
    "/kv-cache/stats": (None, ("GET",), MockBackend._kv_cache_stats),
    "/pylon/v1/stats/stream": (None, ("GET",), MockBackend._stats_stream),
}
