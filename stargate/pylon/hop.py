"""The Pylon's hop: one request from the replica to the engine and back, observed.

docs/pylon-data-path.md. Transport-independent: a listener (HTTP/1.1 today, `listener.py`; the
QUIC tunnels later) hands `PylonHop.forward` a `PylonRequest`, a way to read the body, and a
`ResponseSink`. What happens to a request, in order (the Rust Pylon's order):

1. `/health` (the path, whatever the query) is a health probe: relayed to the engine's first
   health path that does not answer 404, with no checks and no observation.
2. The tunnel headers: `x-request-id` and `x-model` non-empty, `x-input-tokens` an unsigned
   64-bit integer, `x-priority` (optional) an unsigned 32-bit one; else 400 (a problem document
   naming the header), before the body is read.
3. A model the Pylon knows but has not admitted yet (calibrating) is a retryable 503
   `model_generation_unavailable`.
4. The body is read whole (at most `max_body_bytes`, else 413) and must be JSON (else 400);
   with `require_streaming`, chat and Responses requests must set `"stream": true` (the Rust
   rule; off by default, see the doc's "Deviations").
5. An observed request (POST to one of `OBSERVED_PATHS`, for an admitted model) enters the
   model's live state; queue admission may refuse it with the retryable 429
   `queue_estimate_mismatch` (`stats/admission.py`).
6. Forward: hop-by-hop, routing-internal and retry-control headers are dropped, the Dynamo
   priority headers written. A refused connection is a 503 `local_connect_failure`; any other
   failure before the response head a 502.
7. The response head: the engine's 429/503 marked `x-stargate-upstream-retryable: true` becomes
   a retryable answer for the replica (`upstream_admission_rejected`); the engine's own
   retry-control headers are never passed on.
8. The body: an SSE answer of an observed request is relayed as it arrives and split into
   events on the way, each output event counted (`stats/tokens.py`) and timed; the first
   output must come within
   `first_output_timeout`, each next one within `output_chunk_timeout`, else the stream is cut.
   Any other body is relayed chunk by chunk as it arrives.

Cancellation: the listener cancels `forward` when the replica goes away; the request's tracker is
then cancelled and the engine connection closed (the engine stops generating).
"""

from __future__ import annotations

import email.utils
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import orjson
import trio

from stargate.asgi import BodyTooLarge
from stargate.http_headers import HOP_BY_HOP, Headers, connection_options, first_header
from stargate.http_headers import parse_unsigned as _parse_unsigned
from stargate.logs import LoggedError
from stargate.pylon.stats.admission import (
    AdmissionConfig,
    evaluate,
    mismatch_response,
    parse_expected_queue_ms,
)
from stargate.pylon.stats.aggregator import StatsAggregator
from stargate.pylon.stats.observer import Endpoint, RequestTracker
from stargate.pylon.stats.problems import problem
from stargate.pylon.stats.sse import MAX_SSE_EVENT_BYTES, SseEventTooLarge, SseSplitter
from stargate.pylon.stats.tokens import OutputTokenParser
from stargate.upstream import (
    ConnectError,
    ConnectionPool,
    ConnectionPoolTimeout,
    UpstreamError,
    UpstreamResponse,
)

__all__ = [
    "OBSERVED_PATHS",
    "HopConfig",
    "PylonHop",
    "PylonRequest",
    "ResponseSink",
    "StreamAborted",
]

log = logging.getLogger("stargate.pylon")

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_COUNTED_BODY_BYTES = 4 * 1024 * 1024
"""A non-streaming answer is buffered for counting its output tokens up to this size; a larger one
is relayed all the same, uncounted."""
DEFAULT_PRIORITY_CEILING = 3600
DEFAULT_OUTPUT_TIMEOUT_SECONDS = 30.0
DEADLINE_SLACK_SECONDS = 1.0
"""How late the between-outputs timeout may fire (it never fires early): its deadline is moved
once a second at most."""

OBSERVED_PATHS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/responses": Endpoint.RESPONSES,
    "/v1/embeddings": Endpoint.EMBEDDINGS,
    # Beyond the Rust Pylon, which passes completions through unobserved: they are inference
    # load like chat, so they count as chat (docs/pylon-data-path.md, "Deviations").
    "/v1/completions": Endpoint.CHAT,
}
_STREAM_REQUIRED = ("/v1/chat/completions", "/v1/responses")
_SSE_ENDPOINTS = frozenset({Endpoint.CHAT, Endpoint.RESPONSES})

# Never sent to the engine: the replica's routing inputs and the retry signals, which only the
# Pylon may set (an engine that wants a retry says so with x-stargate-upstream-retryable).
_RETRY_CONTROL = frozenset(
    {
        b"x-stargate-upstream-retryable",
        b"x-stargate-retryable",
        b"x-stargate-retry-reason",
        b"x-stargate-retry-after-ms",
    }
)
_DROPPED_UPSTREAM = (
    HOP_BY_HOP
    | _RETRY_CONTROL
    | frozenset(
        {
            b"content-length",  # the connection pool frames the body
            b"x-method",
            b"x-path",
            b"x-stargate-expected-queue-ms",
            b"x-dynamo-request-priority",
            b"x-dynamo-request-strict-priority",
        }
    )
)
_DROPPED_RESPONSE = HOP_BY_HOP | _RETRY_CONTROL


@dataclass(frozen=True, slots=True)
class HopConfig:
    """How the Pylon forwards (the CLI builds it; docs/pylon-data-path.md)."""

    upstream_url: str
    health_paths: tuple[str, ...] = ("/health", "/v1/health/ready")
    upstream_backend: str = "dynamo"
    """`dynamo` writes Dynamo's priority headers on every request; `none` writes none."""
    priority_ceiling: int = DEFAULT_PRIORITY_CEILING
    require_streaming: bool = False
    local_connect_failures_retryable: bool = False
    first_output_timeout: float = DEFAULT_OUTPUT_TIMEOUT_SECONDS
    output_chunk_timeout: float = DEFAULT_OUTPUT_TIMEOUT_SECONDS
    max_body_bytes: int = MAX_BODY_BYTES
    max_sse_event_bytes: int = MAX_SSE_EVENT_BYTES
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)


@dataclass(frozen=True, slots=True)
class PylonRequest:
    """One request as the listener received it; header names lower-case."""

    method: str
    path: str
    query: bytes
    headers: Headers


class ResponseSink(Protocol):
    """Where the answer goes (the listener's side of the transport)."""

    async def start(self, status: int, headers: Headers, *, body_follows: bool) -> None:
        """Send the response head; `body_follows`: the first body bytes come right after."""
        ...

    async def send(self, data: bytes, *, more: bool) -> None:
        """Send body bytes; `more=False` ends the response."""
        ...


class StreamAborted(LoggedError):
    """The answer cannot be completed after its head went out (engine failure, an SSE event too
    large, an output timeout): raised so the transport cuts the stream and the replica sees a
    broken body, never a truncated one that looks whole. Its cause is already logged."""


BodyReader = Callable[[int], Awaitable[bytes]]
"""Reads the whole request body, at most the given number of bytes (else BodyTooLarge)."""


@dataclass(frozen=True, slots=True)
class _Tunnel:
    """The validated tunnel headers of one request."""

    request_id: str
    model: str
    input_tokens: int
    priority: int | None


class _Refusal(Exception):
    def __init__(self, status: int, headers: Headers, body: bytes) -> None:
        super().__init__(status)
        self.answer = (status, headers, body)


def _bad_request(detail: str) -> _Refusal:
    return _Refusal(*problem(400, "Bad Request", detail))


def _text(raw: bytes | None) -> str | None:
    if raw is None:
        return None
    text = raw.decode("latin-1").strip()
    return text or None


def tunnel_headers(headers: Headers) -> _Tunnel:
    """The required headers of a non-health request, or a 400 naming the first bad one."""
    request_id = _text(first_header(headers, b"x-request-id"))
    if request_id is None:
        raise _bad_request("missing required x-request-id header")
    model = _text(first_header(headers, b"x-model"))
    if model is None:
        raise _bad_request("missing required x-model header")
    raw_tokens = first_header(headers, b"x-input-tokens")
    if raw_tokens is None:
        raise _bad_request("missing required x-input-tokens header")
    input_tokens = _parse_unsigned(raw_tokens, U64_MAX)
    if input_tokens is None:
        raise _bad_request("invalid x-input-tokens header")
    raw_priority = first_header(headers, b"x-priority")
    priority = None if raw_priority is None else _parse_unsigned(raw_priority, U32_MAX)
    if raw_priority is not None and priority is None:
        raise _bad_request("invalid x-priority header")
    return _Tunnel(request_id, model, input_tokens, priority)


def upstream_headers(headers: Headers, *, priority: int | None, config: HopConfig) -> Headers:
    """The headers the engine gets: the request's minus what belongs to the hop or to Stargate,
    plus Dynamo's priority headers (`x-dynamo-request-priority` = ceiling - x-priority, with a
    missing x-priority counting as the ceiling: lower numbers are more urgent for Stargate,
    higher ones for Dynamo)."""
    dropped = _DROPPED_UPSTREAM | connection_options(headers)
    forwarded = [(name, value) for name, value in headers if name not in dropped]
    if config.upstream_backend == "dynamo":
        ceiling = config.priority_ceiling
        urgency = ceiling - min(ceiling if priority is None else priority, ceiling)
        forwarded.append((b"x-dynamo-request-priority", str(urgency).encode()))
        forwarded.append((b"x-dynamo-request-strict-priority", b"0"))
    return forwarded


def retry_after_ms(value: bytes | None, now_unix: float) -> int | None:
    """`Retry-After` (delta seconds or an HTTP date) in milliseconds, or None."""
    if value is None:
        return None
    text = value.decode("latin-1").strip()
    seconds = _parse_unsigned(text.encode(), U64_MAX // 1000)
    if seconds is not None:
        return seconds * 1000
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0, math.ceil((when.timestamp() - now_unix) * 1000))


def response_headers(status: int, headers: Headers, *, now_unix: float) -> Headers:
    """The engine's response headers as the replica gets them.

    A 429 or 503 the engine marked `x-stargate-upstream-retryable: true` is made retryable for
    the replica (`upstream_admission_rejected`, with `x-stargate-retry-after-ms` from
    `Retry-After`); the engine's own retry-control headers are dropped either way, so an engine
    cannot make the replica retry by spoofing them."""
    out: Headers = []
    if status in (429, 503):
        signal = first_header(headers, b"x-stargate-upstream-retryable")
        if signal is not None and signal.strip().lower() == b"true":
            out += [
                (b"x-stargate-retryable", b"true"),
                (b"x-stargate-retry-reason", b"upstream_admission_rejected"),
            ]
            after = retry_after_ms(first_header(headers, b"retry-after"), now_unix)
            if after is not None:
                out.append((b"x-stargate-retry-after-ms", str(after).encode()))
    dropped = _DROPPED_RESPONSE | connection_options(headers)
    out += [(name, value) for name, value in headers if name not in dropped]
    return out


def _is_sse(headers: Headers) -> bool:
    content_type = first_header(headers, b"content-type")
    return content_type is not None and content_type.lstrip().lower().startswith(
        b"text/event-stream"
    )


def _streaming(body: bytes) -> bool | None:
    """The body's top-level `"stream"` (True only for `true`), or None when it is not JSON."""
    try:
        document = orjson.loads(body)  # a prompt can be large: the cheaper parser
    except orjson.JSONDecodeError:
        return None
    return isinstance(document, dict) and document.get("stream") is True


class PylonHop:
    """Forwards the replica's requests to one engine and observes them (module docstring).

    `stats` is the engine's `StatsAggregator`; `pending(model)` says whether a model is known but
    not admitted yet (still calibrating)."""

    def __init__(
        self,
        config: HopConfig,
        pool: ConnectionPool,
        stats: StatsAggregator,
        *,
        pending: Callable[[str], bool] = lambda model: False,
    ) -> None:
        self.config = config
        self._pool = pool
        self._stats = stats
        self._pending = pending
        self._base = config.upstream_url.rstrip("/")

    async def forward(
        self, request: PylonRequest, read_body: BodyReader, sink: ResponseSink
    ) -> None:
        """Answer one request through `sink` (module docstring for the steps). Raises
        StreamAborted when the answer must be cut after its head went out."""
        if request.path == "/health":
            await self._health(request, sink)
            return
        try:
            tunnel = tunnel_headers(request.headers)
            if self._pending(tunnel.model):
                raise _Refusal(
                    *problem(
                        503,
                        "Service Unavailable",
                        f"model {tunnel.model} is not admitted yet (calibrating)",
                        [
                            (b"x-stargate-retryable", b"true"),
                            (b"x-stargate-retry-reason", b"model_generation_unavailable"),
                        ],
                    )
                )
            try:
                body = await read_body(self.config.max_body_bytes)
            except BodyTooLarge:
                raise _Refusal(
                    *problem(413, "Payload Too Large", "request body too large")
                ) from None
            streaming = self._check_body(request, body)
        except _Refusal as refusal:
            await _answer(sink, *refusal.answer)
            return
        tracker = self._track(request, tunnel, streaming)
        try:
            if tracker is not None and (refused := self._admit(request, tracker)) is not None:
                tracker.reject()
                await _answer(sink, *refused)
                return
            await self._exchange(request, tunnel, body, sink, tracker)
        finally:
            if tracker is not None and not tracker.done:
                tracker.cancel(trio.current_time())

    # ---- the steps before forwarding ---------------------------------------------------------

    def _check_body(self, request: PylonRequest, body: bytes) -> bool:
        """Whether the request asks for a stream; a 400 for a body that is not JSON (or, with
        `require_streaming`, a chat or Responses request that does not stream)."""
        streaming = _streaming(body)
        if streaming is None:
            raise _bad_request("request body must be valid JSON")
        if (
            self.config.require_streaming
            and request.method == "POST"
            and request.path in _STREAM_REQUIRED
            and not streaming
        ):
            raise _bad_request(f"{request.path} requests must set stream=true")
        return streaming

    def _track(
        self, request: PylonRequest, tunnel: _Tunnel, streaming: bool
    ) -> RequestTracker | None:
        endpoint = OBSERVED_PATHS.get(request.path)
        if endpoint is None or request.method != "POST" or tunnel.model not in self._stats.models:
            return None
        return self._stats.track(
            model=tunnel.model,
            request_id=tunnel.request_id,
            endpoint=endpoint,
            streaming=streaming,
            input_tokens=tunnel.input_tokens,
            priority=tunnel.priority or 0,
            now=trio.current_time(),
            calibration=tunnel.request_id.startswith("calibration-"),
        )

    def _admit(
        self, request: PylonRequest, tracker: RequestTracker
    ) -> tuple[int, Headers, bytes] | None:
        """The 429 answer when the replica's queue estimate is too far below the local one."""
        config = self.config.admission
        if not config.enabled:
            return None
        expected = parse_expected_queue_ms(
            first_header(request.headers, b"x-stargate-expected-queue-ms")
        )
        mismatch = evaluate(self._stats, tracker, expected, config)
        if mismatch is None:
            return None
        log.info(
            "queue estimate mismatch: request %s expected %d ms, local %d ms (threshold %d ms)",
            tracker.request_id,
            mismatch.expected_ms,
            mismatch.actual_ms,
            mismatch.threshold_ms,
        )
        return mismatch_response(mismatch, config)

    # ---- the exchange with the engine --------------------------------------------------------

    async def _health(self, request: PylonRequest, sink: ResponseSink) -> None:
        """Relay a health probe to the first engine health path that does not answer 404."""
        query = b"?" + request.query if request.query else b""
        paths = self.config.health_paths
        for index, path in enumerate(paths):
            url = self._base + path + query.decode("latin-1")
            try:
                response = await self._pool.request("GET", url, [])
            except (ConnectError, ConnectionPoolTimeout) as error:
                await _answer(sink, *self._connect_failure(error))
                return
            except UpstreamError as error:
                await _answer(sink, *_send_failure(error))
                return
            async with response:
                if response.status == 404 and index + 1 < len(paths):
                    await response.read()
                    continue
                headers = response_headers(response.status, response.headers, now_unix=time.time())
                await _relay(sink, response, headers)
                return

    def _connect_failure(self, error: UpstreamError) -> tuple[int, Headers, bytes]:
        log.warning("engine connection failed: %s", error)
        retryable = b"true" if self.config.local_connect_failures_retryable else b"false"
        return problem(
            503,
            "Service Unavailable",
            "local upstream connection failed",
            [
                (b"x-stargate-retryable", retryable),
                (b"x-stargate-retry-reason", b"local_connect_failure"),
            ],
        )

    async def _exchange(
        self,
        request: PylonRequest,
        tunnel: _Tunnel,
        body: bytes,
        sink: ResponseSink,
        tracker: RequestTracker | None,
    ) -> None:
        url = self._base + request.path
        if request.query:
            url += "?" + request.query.decode("latin-1")
        headers = upstream_headers(request.headers, priority=tunnel.priority, config=self.config)
        try:
            response = await self._pool.request(request.method, url, headers, body)
        except (ConnectError, ConnectionPoolTimeout) as error:
            if tracker is not None:
                tracker.finish(False, trio.current_time())
            await _answer(sink, *self._connect_failure(error))
            return
        except UpstreamError as error:
            if tracker is not None:
                tracker.finish(False, trio.current_time())
            log.warning("engine request %s failed: %s", tunnel.request_id, error)
            await _answer(sink, *_send_failure(error))
            return
        async with response:
            now = trio.current_time()
            if tracker is not None:
                tracker.headers(now)
            out = response_headers(response.status, response.headers, now_unix=time.time())
            ok = 200 <= response.status < 300
            if tracker is None:
                await _relay(sink, response, out)
            elif tracker.endpoint in _SSE_ENDPOINTS and _is_sse(response.headers):
                await self._relay_events(sink, response, out, tracker)
            else:
                await _relay_counted(sink, response, out, tracker, counted=ok)
            if tracker is not None:
                tracker.finish(ok, trio.current_time())

    async def _relay_events(
        self,
        sink: ResponseSink,
        response: UpstreamResponse,
        headers: Headers,
        tracker: RequestTracker,
    ) -> None:
        """Relay an SSE answer chunk by chunk as it arrives, counting its events' output tokens
        and bounding the waits for output (module docstring, step 8)."""
        config = self.config
        chunk_timeout = config.output_chunk_timeout
        splitter = SseSplitter(config.max_sse_event_bytes)
        parser = OutputTokenParser()
        await sink.start(response.status, headers, body_follows=False)
        ended = False
        with trio.CancelScope(deadline=trio.current_time() + config.first_output_timeout) as timer:
            try:
                async for chunk in response.aiter_bytes():
                    # Parsed for the observation only: the bytes go on as they came, an event
                    # cut between two reads included (nothing waits for its end).
                    output = False
                    for event in splitter.feed(chunk):
                        if parser.observe_event(event):
                            output = True
                    if output:
                        now = trio.current_time()
                        tracker.output(parser.tokens, parser.explicit, now)
                        # Moved at most once a second, and then a second further than
                        # needed: setting a deadline costs more than the rest of an
                        # event's bookkeeping. A gap may so last up to 31 s, never less
                        # than 30.
                        if now + chunk_timeout > timer.deadline:
                            timer.deadline = now + chunk_timeout + DEADLINE_SLACK_SECONDS
                    ended = _is_complete(response)  # the last chunk ends the answer: one send
                    await sink.send(chunk, more=not ended)
            except SseEventTooLarge as error:
                tracker.finish(False, trio.current_time())
                log.warning("engine stream of request %s cut: %s", tracker.request_id, error)
                raise StreamAborted(str(error)) from None
            except UpstreamError as error:
                tracker.finish(False, trio.current_time())
                log.warning("engine stream of request %s broke: %s", tracker.request_id, error)
                raise StreamAborted(str(error)) from None
        if timer.cancelled_caught:
            tracker.finish(False, trio.current_time())
            which = "first output" if tracker.to_first_output is None else "next output"
            log.warning(
                "engine stream of request %s cut: no %s within %.0f s",
                tracker.request_id,
                which,
                config.first_output_timeout
                if tracker.to_first_output is None
                else config.output_chunk_timeout,
            )
            raise StreamAborted(f"no {which} in time")
        if not ended:
            await sink.send(b"", more=False)


def _is_complete(response: UpstreamResponse) -> bool:
    """`response.complete`, read anew (it changes as the body is read)."""
    return response.complete


def _send_failure(error: UpstreamError) -> tuple[int, Headers, bytes]:
    return problem(502, "Bad Gateway", f"local upstream request failed: {error}")


async def _answer(sink: ResponseSink, status: int, headers: Headers, body: bytes) -> None:
    await sink.start(
        status, [*headers, (b"content-length", str(len(body)).encode())], body_follows=True
    )
    await sink.send(body, more=False)


async def _relay(sink: ResponseSink, response: UpstreamResponse, headers: Headers) -> None:
    """Relay a body chunk by chunk as it arrives; the last chunk ends the answer."""
    first = response.take_buffered()
    whole = response.complete
    await sink.start(response.status, headers, body_follows=first is not None or whole)
    try:
        if first is not None or whole:
            await sink.send(first or b"", more=not whole)
            if whole:
                return
        async for chunk in response.aiter_bytes():
            last = _is_complete(response)
            await sink.send(chunk, more=not last)
            if last:
                return
    except UpstreamError as error:
        log.warning("engine body broke: %s", error)
        raise StreamAborted(str(error)) from None
    await sink.send(b"", more=False)


async def _relay_counted(
    sink: ResponseSink,
    response: UpstreamResponse,
    headers: Headers,
    tracker: RequestTracker,
    *,
    counted: bool,
) -> None:
    """Relay a non-SSE answer of an observed request; its end is the request's first (and
    only) output, with the output tokens its JSON reports."""
    chunks: list[bytes] = []
    size = 0
    await sink.start(response.status, headers, body_follows=False)
    try:
        async for chunk in response.aiter_bytes():
            if counted and size <= MAX_COUNTED_BODY_BYTES:
                chunks.append(chunk)
                size += len(chunk)
            await sink.send(chunk, more=not response.complete)
            if response.complete:
                break
        else:
            await sink.send(b"", more=False)
    except UpstreamError as error:
        tracker.finish(False, trio.current_time())
        log.warning("engine body of request %s broke: %s", tracker.request_id, error)
        raise StreamAborted(str(error)) from None
    if counted:
        tokens = (
            OutputTokenParser().observe_body(b"".join(chunks))
            if size <= MAX_COUNTED_BODY_BYTES
            else 0
        )
        tracker.output(tokens, False, trio.current_time())
