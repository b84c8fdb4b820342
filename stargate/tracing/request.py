"""The spans of one proxied request: a SERVER root span and a CLIENT span per upstream attempt.

docs/tracing.md, "Spans" and "Propagation". The proxy (stargate/proxy/app.py and forwarder.py)
holds a `RequestTracer` only when tracing is on and calls it at a few points of a request; every
OpenTelemetry call lives here, so the proxy's own modules never import the SDK.

Span context is passed explicitly (the root span object travels with the request, each attempt's
context is injected into that attempt's headers), never through OpenTelemetry's "current span"
context variable: trio keeps context variables per task, and passing spans around does not depend
on which task runs which part of a request.

The attribute names are the Rust router's, so that dashboards built on its traces keep working.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Protocol

from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from stargate.asgi import ASGIMessage, ASGISend

__all__ = [
    "ATTEMPT_SPAN",
    "ROOT_SPAN",
    "AttemptSpan",
    "RequestSpan",
    "RequestTracer",
    "TracedAttempts",
    "TracedRequest",
]

ROOT_SPAN = "proxy_openai_request"
ATTEMPT_SPAN = "proxy_upstream_http_request"

_TRACEPARENT = b"traceparent"
_TRACESTATE = b"tracestate"
_TRACE_HEADERS = (_TRACEPARENT, _TRACESTATE)
# The W3C limits the propagator enforces itself, with a WARNING per offending request: a client
# could fill the log with them, so a value past them is dropped here, silently.
_MAX_TRACEPARENT = 512
_MAX_TRACESTATE = 8192
# A local answer with one of these statuses refused the client's input; it is not the replica
# failing, so it leaves the span status unset (as any upstream 4xx does).
_CLIENT_INPUT_STATUSES = frozenset({400, 405, 413})

Headers = list[tuple[bytes, bytes]]


class TracedRequest(Protocol):
    """What the root span reads of a validated request (`stargate.proxy.contract.ProxyRequest`)."""

    @property
    def endpoint(self) -> str: ...
    @property
    def target_path(self) -> bytes: ...
    @property
    def model_id(self) -> str: ...
    @property
    def routing_key(self) -> str | None: ...
    @property
    def routing_method(self) -> str | None: ...
    @property
    def input_tokens(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def max_wait_ms(self) -> int | None: ...
    @property
    def request_slo_ms(self) -> int | None: ...
    @property
    def cache_affinity_key(self) -> str | None: ...


class TracedAttempts(Protocol):
    """What the root span reads of a request's retry state (`stargate.proxy.retry.Attempts`)."""

    @property
    def connect_retries(self) -> int: ...
    @property
    def request_retries(self) -> int: ...
    @property
    def failed_backends(self) -> AbstractSet[str]: ...


class RequestTracer:
    """Starts the root span of each proxied request; one per replica, shared by all requests."""

    __slots__ = ("_propagator", "_tracer")

    def __init__(self, tracer: Tracer, propagator: TextMapPropagator | None = None) -> None:
        self._tracer = tracer
        self._propagator = propagator or TraceContextTextMapPropagator()

    def start(self, path: str, headers: Iterable[tuple[bytes, bytes]]) -> RequestSpan:
        """The root span of a request to `path`: a child of the client's `traceparent` (and
        `tracestate`) when it sent a valid one, else the first span of a new trace."""
        parent = self._propagator.extract(_trace_carrier(headers))
        span = self._tracer.start_span(
            ROOT_SPAN,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"request.path": path, "http.request.method": "POST"},
        )
        return RequestSpan(self, span)

    def _start_attempt(self, root: Span) -> Span:
        return self._tracer.start_span(
            ATTEMPT_SPAN, context=set_span_in_context(root), kind=SpanKind.CLIENT
        )

    def _inject(self, span: Span, headers: Headers) -> Headers:
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span))
        kept = [header for header in headers if header[0] not in _TRACE_HEADERS]
        kept += [(name.encode(), value.encode()) for name, value in carrier.items()]
        return kept


class RequestSpan:
    """The root span of one request, `proxy_openai_request` (kind SERVER).

    Ended by `end()` once the response has ended: for a stream, when its last chunk went out or
    the client went away, not when the head was sent.
    """

    __slots__ = ("_attempts", "_ended", "_selections", "_span", "_start", "_tracer")

    def __init__(self, tracer: RequestTracer, span: Span) -> None:
        self._tracer = tracer
        self._span = span
        self._start = time.monotonic()
        self._attempts = 0
        self._selections = 0
        self._ended = False

    @property
    def span(self) -> Span:
        return self._span

    def wrap_send(self, send: ASGISend) -> ASGISend:
        """`send`, recording the status of the response head on the way (whoever answers: a
        backend, the forwarder or the header contract)."""

        async def traced_send(message: ASGIMessage) -> None:
            if message["type"] == "http.response.start":
                self._responded(message["status"], message.get("headers") or ())
            await send(message)

        return traced_send

    def set_request(self, request: TracedRequest, algorithm: str, body_bytes: int) -> None:
        """The validated request and the algorithm resolved for it."""
        attributes: dict[str, AttributeValue] = {
            "request.endpoint": request.endpoint,
            "request.model_id": request.model_id,
            "request.path": request.target_path.partition(b"?")[0].decode("latin-1"),
            "request.input_tokens": request.input_tokens,
            "request.priority": request.priority,
            "request.cache_affinity_key_present": request.cache_affinity_key is not None,
            "routing.algorithm": algorithm,
            "proxy.replay_body_bytes": body_bytes,
        }
        if request.routing_key is not None:
            attributes["request.routing_key"] = request.routing_key
        if request.max_wait_ms is not None:
            attributes["request.max_wait_ms"] = request.max_wait_ms
        if request.request_slo_ms is not None:
            attributes["request.slo_ms"] = request.request_slo_ms
        if request.routing_method is not None:
            attributes["routing.requested_algorithm"] = request.routing_method
        self._span.set_attributes(attributes)

    def routing_choice(
        self, candidates: int, rank_depth: int, cluster_id: str, after_kv_free_tokens_skip: bool
    ) -> None:
        """The balancer chose `cluster_id` among `candidates` eligible clusters. Called again on
        each re-selection after a cluster failed: the last choice is what the span keeps, and
        `routing.retry_attempts` counts the re-selections."""
        self._selections += 1
        self._span.set_attributes(
            {
                "routing.num_candidates": candidates,
                "routing.rank_depth": rank_depth,
                "routing.selected_after_kv_free_tokens_skip": after_kv_free_tokens_skip,
                "routing.retry_attempts": self._selections - 1,
                "selected_cluster.id": cluster_id,
            }
        )

    def admission_rejected(self, reason: str) -> None:
        self._span.set_attribute("routing.admission_rejection_reason", reason)

    def pool_held(self, pool: str, seconds: float) -> None:
        """A model pool (the activator) held the request this long before it was forwarded."""
        self._span.set_attributes({"pool.name": pool, "pool.hold_ms": round(seconds * 1000, 3)})

    def start_attempt(self, backend_id: str, cluster_id: str, backend_url: str) -> AttemptSpan:
        """A child span for one upstream attempt; inject its context into the attempt's headers
        (`AttemptSpan.inject`) and end it with `AttemptSpan.end`."""
        self._attempts += 1
        span = self._tracer._start_attempt(self._span)
        span.set_attributes(
            {
                "proxy.attempt": self._attempts,
                "selected_inst.id": backend_id,
                "selected_inst.url": backend_url,
                "selected_cluster.id": cluster_id,
                "http.request.method": "POST",
            }
        )
        return AttemptSpan(self, span, backend_id, cluster_id)

    def client_gone(self) -> None:
        """The client went away before the response ended (the exchange was cancelled)."""
        self._span.set_attribute("proxy.client_disconnected", True)

    def failed(self, error: BaseException) -> None:
        """The request ended with an exception (for example the upstream failing mid-body)."""
        self._span.set_attribute("error.type", type(error).__name__)
        self._span.set_status(Status(StatusCode.ERROR, " ".join(str(error).split()) or None))

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._span.end()

    def _attempt_ended(
        self,
        attempt: int,
        backend_id: str,
        cluster_id: str,
        status: int | None,
        retry_reason: str | None,
        final: bool,
        state: TracedAttempts,
    ) -> None:
        attributes: dict[str, AttributeValue] = {
            "proxy.attempt": attempt,
            "proxy.connect_attempts": state.connect_retries,
            "proxy.request_retries": state.request_retries,
            "proxy.failed_backends": len(state.failed_backends),
            "selected_inst.id": backend_id,
            "selected_cluster.id": cluster_id,
        }
        if retry_reason is not None:
            attributes["proxy.retry_reason"] = retry_reason
        if final and status is not None:
            attributes["proxy.upstream_status"] = status
            attributes["proxy.time_to_first_byte_ms"] = round(
                (time.monotonic() - self._start) * 1000, 3
            )
        self._span.set_attributes(attributes)

    def _responded(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
        local = True
        code: bytes | None = None
        for name, value in headers:
            if name == b"x-inference-server-id":
                local = False
            elif name == b"x-stargate-error-code":
                code = value
        span = self._span
        span.set_attribute("http.response.status_code", status)
        if code is not None:
            span.set_attribute("error.type", code.decode("latin-1"))
        if status >= 500 or (local and status >= 400 and status not in _CLIENT_INPUT_STATUSES):
            description = code.decode("latin-1") if code is not None else f"HTTP {status}"
            span.set_status(Status(StatusCode.ERROR, description))


class AttemptSpan:
    """One upstream attempt, `proxy_upstream_http_request` (kind CLIENT), a child of the root."""

    __slots__ = ("_attempt", "_backend_id", "_cluster_id", "_error", "_root", "_span")

    def __init__(self, root: RequestSpan, span: Span, backend_id: str, cluster_id: str) -> None:
        self._root = root
        self._span = span
        self._attempt = root._attempts
        self._backend_id = backend_id
        self._cluster_id = cluster_id
        self._error: BaseException | None = None

    @property
    def span(self) -> Span:
        return self._span

    def inject(self, headers: Headers) -> Headers:
        """`headers` with this attempt's `traceparent` (and `tracestate`) in place of the
        client's: the backend's spans become children of the attempt. A new list."""
        return self._root._tracer._inject(self._span, headers)

    def failed(self, error: BaseException) -> None:
        """The attempt got no response head (connect error, head timeout, reset, no connection)."""
        self._error = error

    def abandon(self) -> None:
        """The attempt was cancelled before its head arrived (the client left, or shutdown)."""
        self._span.set_attribute("proxy.cancelled", True)
        self._span.end()

    def end(
        self, status: int | None, retry_reason: str | None, final: bool, state: TracedAttempts
    ) -> None:
        """End the attempt: `status` of its response head (None: none arrived), the retry it
        led to, whether its response is the one the client gets; `state` after it."""
        span = self._span
        attributes: dict[str, AttributeValue] = {}
        if status is not None:
            attributes["http.response.status_code"] = status
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        else:
            error = self._error
            kind = "backend_unroutable" if error is None else type(error).__name__
            attributes["error.type"] = kind
            message = "" if error is None else " ".join(str(error).split())
            span.set_status(Status(StatusCode.ERROR, message or kind))
        if retry_reason is not None:
            attributes["proxy.retry_reason"] = retry_reason
        span.set_attributes(attributes)
        span.end()
        self._root._attempt_ended(
            self._attempt,
            self._backend_id,
            self._cluster_id,
            status,
            retry_reason,
            final,
            state,
        )


def _trace_carrier(headers: Iterable[tuple[bytes, bytes]]) -> Mapping[str, str | list[str]]:
    """The client's trace headers as the propagator reads them: the first `traceparent` and
    every `tracestate` (RFC 9110 lets a list header repeat), values past the W3C limits left out."""
    carrier: dict[str, str | list[str]] = {}
    states: list[str] = []
    for name, value in headers:
        if name == _TRACEPARENT:
            if "traceparent" not in carrier and len(value) <= _MAX_TRACEPARENT:
                carrier["traceparent"] = value.decode("latin-1")
        elif name == _TRACESTATE:
            states.append(value.decode("latin-1"))
    if states and sum(len(state) + 1 for state in states) <= _MAX_TRACESTATE:
        carrier["tracestate"] = states
    return carrier
