"""The proxy routes as a lean ASGI handler in front of the QuartTrio app.

`POST /v1/chat/completions`, `/v1/responses`, `/v1/embeddings` and `/v1/completions` are served here
without Quart's request machinery (docs/decisions.md, D11: about 200 µs per request saved);
everything else (probes, `/v1/models`, `/debug/state`) goes to the Quart app. A wrong method on a
proxy path is 405 with `allow: POST`.

Request targets (docs/clients.md, "Paths"): an absolute-form target (`POST http://host/v1/...`,
RFC 9112 §3.2.2) is served as its path; a proxy path written with percent-encoding
(`/v1/chat%2Fcompletions`) is refused with 400, so a path rule in front of the replica cannot be
bypassed by an encoding the rule did not expect.

Per request: validate the header contract, read the body (bounded; in the OpenAI form, whose
model is in the body, first), route and attempt, then stream the upstream response as it
arrives. The body is held once, in the buffer that is sent and replayed (`_BodyBuffer`;
docs/data-plane.md, "Request bodies in memory"). A client that goes away cancels everything in
flight for it, upstream connection included; an upstream that fails mid-body ends the client's
body without its final chunk (the connection is closed), so the client can tell, and is logged as
one WARNING line with its fields and no traceback (docs/logging.md).

A request that may wait (a pooled model, or `x-max-wait-ms`) gets a nursery and a
`LoadingStream` (stargate/proxy/loading.py), whose task starts only if the request is held and
asks for a stream: its head and SSE comments go out at once, and the engine's body follows them
(docs/clients.md, "Held streaming requests"). Every answer to a forwarded request carries
`Server-Timing` (stargate/proxy/server_timing.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING
from urllib.parse import unquote

import trio

from stargate.activator import (
    Activator,
    ActivatorError,
    Grant,
    PoolOwnedElsewhere,
    PoolOwnerMoved,
)
from stargate.asgi import (
    ASGIApp,
    ASGIReceive,
    ASGIScope,
    ASGISend,
    disconnect_hook,
)
from stargate.config import ProxyConfig
from stargate.logs import LoggedError
from stargate.metrics import ProxyMetrics
from stargate.prefix_key import derive_prefix
from stargate.proxy import json_scan
from stargate.proxy.contract import (
    ENDPOINTS,
    ContractError,
    ProxyRequest,
    filter_response_headers,
    first_header,
    is_openai_form,
    parse_proxy_request,
    parse_unsigned,
)
from stargate.proxy.forwarder import Forwarded, Forwarder, LocalError
from stargate.proxy.loading import (
    AfterHead,
    LoadingStream,
    error_event,
    final_comment,
    upstream_error,
)
from stargate.proxy.owner_relay import OwnerRelay, is_relayed
from stargate.proxy.plan import RequestPlan
from stargate.proxy.response_body import BodyBroke, read_bounded, send_response
from stargate.proxy.server_timing import server_timing

if TYPE_CHECKING:  # the tracing modules load OpenTelemetry: only with tracing on (docs/tracing.md)
    from stargate.routing import BackendSnapshot
    from stargate.tracing.request import RequestSpan, RequestTracer

__all__ = ["ProxyApp", "UpstreamBodyError"]

log = logging.getLogger(__name__)


class UpstreamBodyError(LoggedError):
    """The upstream failed mid-body; raised to make Hypercorn close the client connection.

    Its cause is already logged as one WARNING line, so Hypercorn's traceback for it is dropped
    (`LoggedError`, stargate/logs.py)."""


class _ClientGone(Exception):
    pass


# How much of an upstream error body is read for its message after a loading stream's head.
_ERROR_BODY_LIMIT = 64 * 1024


class ProxyApp:
    """ASGI app: the proxy routes, with `fallback` serving every other path."""

    def __init__(
        self,
        forwarder: Forwarder,
        config: ProxyConfig,
        metrics: ProxyMetrics,
        fallback: ASGIApp,
        *,
        activator: Activator | None = None,
        tracer: RequestTracer | None = None,
        relay: OwnerRelay | None = None,
    ) -> None:
        self._forwarder = forwarder
        # Plans each request once: its algorithm, routing input and metric labels.
        self._planner = forwarder.planner
        self._activator = activator
        # Hands pool requests to the pool's owner when another replica owns the pool
        # (stargate/proxy/owner_relay.py); None: such a request is answered 503.
        self._relay = relay
        # None with tracing off: then a request pays one `is None` test for it (docs/tracing.md).
        self._tracer = tracer
        self._config = config
        self._metrics = metrics
        self._fallback = fallback
        header = config.retry_budget_header
        self._retry_budget_header = None if header is None else header.encode()
        if config.accept_openai_requests:
            json_scan.prepare("model")  # not on the first request: ~80 ms of compiling
        # docs/data-plane.md, "Derived affinity keys": the key covers this many bytes, or 0 (off).
        # (block bytes, depth) with --derive-affinity-key, else None.
        self._derive = (
            (config.derive_affinity_key_block_bytes, config.derive_affinity_key_depth)
            if config.derive_affinity_key
            else None
        )
        # docs/clients.md, "Held streaming requests": seconds between loading comments, None: off.
        self._loading_interval = (
            config.loading_comment_interval_ms / 1000 if config.loading_comments else None
        )

    async def __call__(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] != "http":
            await self._fallback(scope, receive, send)
            return
        scope = _origin_form(scope)
        if scope["path"] not in ENDPOINTS:
            await self._fallback(scope, receive, send)
            return
        openai_form = is_openai_form(scope["headers"], self._config.accept_openai_requests)
        if scope["method"] != "POST":
            await _respond(send, ContractError(405, b"", [(b"allow", b"POST")]), openai_form)
            return
        if scope["raw_path"] != scope["path"].encode():
            error = ContractError(
                400,
                message="percent-encoded proxy paths are refused; send the path as written",
                code="encoded_path",
            )
            self._count_local(scope["path"], openai_form, error)
            await _respond(send, error, openai_form)
            return
        self._metrics.in_flight.inc()
        try:
            if self._tracer is None:
                await self._proxy(scope, receive, send, openai_form)
            else:
                await self._proxy_traced(scope, receive, send, openai_form, self._tracer)
        except _ClientGone:
            pass  # not counted: the client left before a final status
        finally:
            self._metrics.in_flight.dec()

    async def _proxy_traced(
        self,
        scope: ASGIScope,
        receive: ASGIReceive,
        send: ASGISend,
        openai_form: bool,
        tracer: RequestTracer,
    ) -> None:
        """`_proxy` inside the request's root span, which ends when the response has ended (a
        stream's last chunk, or the client leaving), not when its head was sent."""
        span = tracer.start(scope["path"], scope["headers"])
        try:
            await self._proxy(scope, receive, span.wrap_send(send), openai_form, span)
        except _ClientGone:
            span.client_gone()
            raise
        except Exception as error:
            span.failed(error)
            raise
        finally:
            span.end()

    async def _proxy(
        self,
        scope: ASGIScope,
        receive: ASGIReceive,
        send: ASGISend,
        openai_form: bool,
        span: RequestSpan | None = None,
    ) -> None:
        headers: list[tuple[bytes, bytes]] = scope["headers"]  # ASGI: names already lower-case
        limit = self._config.max_replay_body_bytes
        planner = self._planner
        try:
            # docs/data-plane.md, Header contract: every header check comes before the 413. The
            # header form needs no body for them, so the body is read last; the OpenAI form takes
            # its model (and the estimate of its tokens) from the body, so it reads it first.
            if openai_form:
                body = await _read_body(receive, headers, limit)
                request = self._with_derived_key(scope, self._parse(scope, headers, body), body)
                plan = planner.plan(request)
            else:
                request = self._parse(scope, headers, b"")  # the header form reads no body
                if self._derive is not None and request.cache_affinity_key is None:
                    # The key comes from the body, read after every header check: the algorithm
                    # is checked now, the key requirement once the key is known.
                    spec = planner.algorithm(request)
                    body = await _read_body(receive, headers, limit)
                    plan = planner.plan(self._with_derived_key(scope, request, body), spec)
                else:
                    plan = planner.plan(request)
                    body = await _read_body(receive, headers, limit)
        except ContractError as error:
            self._count_local(scope["path"], openai_form, error)
            await _respond(send, error, openai_form)
            return

        # The client leaving cancels everything in flight for it, upstream connection included.
        hook = disconnect_hook(scope)
        if hook is not None:  # served by stargate/serving.py: no watcher task needed
            with trio.CancelScope() as gone:
                hook.on_disconnect(gone.cancel)
                try:
                    await self._exchange(send, scope, plan, body, span)
                finally:
                    hook.on_disconnect(None)
            if gone.cancelled_caught:
                raise _ClientGone
            return
        completed = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            await self._exchange(send, scope, plan, body, span)
            completed = True
            nursery.cancel_scope.cancel()
        if not completed:
            raise _ClientGone

    async def _exchange(
        self,
        send: ASGISend,
        scope: ASGIScope,
        plan: RequestPlan,
        body: bytes | bytearray,
        span: RequestSpan | None,
    ) -> None:
        """`_serve`, with a loading stream ready for a request that may be held (a pooled model,
        or a routing wait): its nursery is opened only then, and its task started only once the
        request is held (docs/clients.md, "Held streaming requests")."""
        request = plan.request
        if self._loading_interval is None or not self._may_hold(request):
            await self._serve(send, scope, plan, body, span, None)
            return
        async with trio.open_nursery() as nursery:
            generated = request.request_id if request.generated_request_id else None
            loading = LoadingStream(
                send, nursery, request.model_id, body, self._loading_interval, generated
            )
            await self._serve(send, scope, plan, body, span, loading)

    def _may_hold(self, request: ProxyRequest) -> bool:
        """The request may wait before it is forwarded: a routing wait, or a pool's hold."""
        if request.max_wait_ms:
            return True
        activator = self._activator
        return (
            activator is not None
            and request.routing_key is None
            and activator.pool_of(request.model_id) is not None
        )

    async def _serve(
        self,
        send: ASGISend,
        scope: ASGIScope,
        plan: RequestPlan,
        body: bytes | bytearray,
        span: RequestSpan | None,
        loading: LoadingStream | None,
    ) -> None:
        """Hold a pool slot if the model is pooled, forward, and answer; hand the request to the
        pool's owner when another replica owns the pool."""
        grant: Grant | None = None
        try:
            grant = await self._acquire(plan.request, span, loading)
        except PoolOwnedElsewhere as elsewhere:
            relay_send = send
            if loading is not None and await loading.stop():
                # Held here first (no owner yet), then the pool's owner appeared elsewhere: the
                # loading head is out, so only the owner's body can follow it.
                relay_send = AfterHead(send)
            try:
                grant = await self._owned_elsewhere(relay_send, plan, body, scope, elsewhere)
            except ActivatorError as error:
                await self._answer(send, plan, _pool_error(error), loading)
                return
            if grant is None:
                return  # answered by the owner
        except ActivatorError as error:
            await self._answer(send, plan, _pool_error(error), loading)
            return
        try:
            forwarding = trio.current_time()
            if loading is None:
                outcome = await self._forwarder.forward_plan(plan, body, span)
            else:
                on_hold = partial(loading.hold, _routing_eta(plan.request, forwarding))
                outcome = await self._forwarder.forward_plan(plan, body, span, on_hold=on_hold)
            # docs/clients.md, "Server-Timing": the routing wait counts as hold, not upstream.
            waited = outcome.waited
            upstream = trio.current_time() - forwarding - waited
            if grant is None:
                timing = server_timing(waited, 0.0, upstream)
            else:
                timing = server_timing(grant.hold_seconds + waited, grant.swap_seconds, upstream)
            if isinstance(outcome, LocalError):
                await self._answer(send, plan, outcome.error, loading, timing)
            else:
                await self._stream(send, plan, outcome, loading, timing)
        finally:
            if grant is not None:
                grant.release()  # exactly once, when the response body has ended

    async def _owned_elsewhere(
        self,
        send: ASGISend,
        plan: RequestPlan,
        body: bytes | bytearray,
        scope: ASGIScope,
        elsewhere: PoolOwnedElsewhere,
    ) -> Grant | None:
        """Relay to the owner (None: answered), or a grant if ownership came here meanwhile.

        A request that was already relayed once is never relayed again (no loop): its sender
        believed this replica owned the pool, so ownership moved, and the client retries
        (docs/pool-ownership.md, "Relaying requests to the owner")."""
        if is_relayed(scope["headers"]):
            if self._activator is not None:
                self._activator.count_relayed(elsewhere.pool, "rejected")
            raise PoolOwnerMoved(
                f"this replica does not own model pool {elsewhere.pool} (it moved); retry",
                pool=elsewhere.pool,
                member=elsewhere.member,
            )
        if self._relay is None:
            raise elsewhere
        return await self._relay.relay(
            send,
            scope,
            plan.request,
            body,
            elsewhere,
            lambda status: self._count(plan, "", status),
        )

    def _parse(
        self, scope: ASGIScope, headers: list[tuple[bytes, bytes]], body: bytes | bytearray
    ) -> ProxyRequest:
        return parse_proxy_request(
            scope["path"],
            scope.get("query_string", b""),
            headers,
            body,
            retry_budget_header=self._retry_budget_header,
            accept_openai_requests=self._config.accept_openai_requests,
            client=scope.get("client"),
            scheme=scope["scheme"],
            http1=scope.get("http_version") != "2",
        )

    def _with_derived_key(
        self, scope: ASGIScope, request: ProxyRequest, body: bytes | bytearray
    ) -> ProxyRequest:
        """`request` with a key, chain and group derived from its body when it sent no key and the
        flag is on (an explicit key replaces all three: docs/prefix-routing.md).

        Routing only: nothing derived is forwarded (docs/data-plane.md, "Derived affinity
        keys"), nor logged (it is in no log line and no metric label).
        """
        if self._derive is None or request.cache_affinity_key is not None:
            return request
        derived = derive_prefix(scope["path"], body, *self._derive)
        if derived is None:
            return request
        return replace(
            request,
            cache_affinity_key=derived.key,
            prefix_chain=derived.chain,
            prefix_group=derived.group,
        )

    async def _acquire(
        self, request: ProxyRequest, span: RequestSpan | None, loading: LoadingStream | None
    ) -> Grant | None:
        """Hold a request for a pooled model until its member is resident (None: not pooled).

        Pools are unscoped: a request with a routing key is never held. With tracing on, the
        hold time goes on the request's span (granted or refused). A held streaming request
        starts its loading stream, whose comments give the pool's expected wait.
        """
        activator = self._activator
        if activator is None or request.routing_key is not None:
            return None
        model = request.model_id
        pool = activator.pool_of(model)
        if pool is None:
            return None
        on_hold = None
        if loading is not None:
            on_hold = partial(loading.hold, partial(activator.expected_wait, model))
        if span is None:
            return await activator.acquire(model, on_hold=on_hold)
        started = trio.current_time()
        try:
            return await activator.acquire(model, on_hold=on_hold)
        finally:
            span.pool_held(pool, trio.current_time() - started)

    async def _stream(
        self,
        send: ASGISend,
        plan: RequestPlan,
        outcome: Forwarded,
        loading: LoadingStream | None,
        timing: bytes,
    ) -> None:
        request, response, backend = plan.request, outcome.response, outcome.backend
        async with response:
            if loading is not None and await loading.stop():
                await self._stream_after_head(send, plan, outcome, timing)
                return
            headers = filter_response_headers(response.headers)
            headers += [
                (b"x-inference-server-id", backend.inference_server_id.encode()),
                (b"x-inference-server-url", backend.url.encode()),
                (b"x-stargate-cluster-id", backend.cluster_id.encode()),
                (b"server-timing", timing),
            ]
            if request.generated_request_id:  # ours, whatever the upstream echoed
                headers = [h for h in headers if h[0] != b"x-request-id"]
                headers.append((b"x-request-id", request.request_id.encode()))
            # Counted before the head goes out: a client that leaves now still got a status.
            self._count(plan, backend.inference_server_id, response.status)
            start = {"type": "http.response.start", "status": response.status, "headers": headers}
            try:
                await send_response(send, response, start)
            except BodyBroke as broke:
                raise self._body_broke(request, backend, broke) from None

    async def _stream_after_head(
        self, send: ASGISend, plan: RequestPlan, outcome: Forwarded, timing: bytes
    ) -> None:
        """The engine's answer after a loading stream's head: the final comment (timings, the
        backend), then a 2xx body unchanged; any other status becomes the error event."""
        response, backend = outcome.response, outcome.backend
        self._count(plan, backend.inference_server_id, response.status)
        prefix = final_comment(timing, (backend.inference_server_id, backend.cluster_id))
        if 200 <= response.status < 300:
            try:
                await send_response(send, response, None, prefix)
            except BodyBroke as broke:
                raise self._body_broke(plan.request, backend, broke) from None
            return
        error = upstream_error(response.status, await read_bounded(response, _ERROR_BODY_LIMIT))
        await send({"type": "http.response.body", "body": prefix + error_event(error)})

    def _body_broke(
        self, request: ProxyRequest, backend: BackendSnapshot, broke: BodyBroke
    ) -> UpstreamBodyError:
        """Log an upstream body that failed mid-stream; the error that closes the connection."""
        message = str(broke)
        log.warning(
            "upstream body failed mid-stream",
            extra={
                "request_id": request.request_id,
                "backend": backend.inference_server_id,
                # Without the query string: it is the client's and may carry a key.
                "url": backend.url.rstrip("/")
                + request.target_path.partition(b"?")[0].decode("latin-1"),
                "bytes": broke.relayed,
                "error": message,
            },
        )
        return UpstreamBodyError(message)

    async def _answer(
        self,
        send: ASGISend,
        plan: RequestPlan,
        error: ContractError,
        loading: LoadingStream | None = None,
        timing: bytes | None = None,
    ) -> None:
        """Count, then send, an answer the replica makes itself for a planned request: after a
        loading stream's head, as its error event."""
        self._count(plan, "", error.status)
        if loading is not None and await loading.stop():
            prefix = b"" if timing is None else final_comment(timing)
            await send({"type": "http.response.body", "body": prefix + error_event(error)})
            return
        await _respond(send, error, plan.request.openai_form, plan.request, timing)

    def _count(self, plan: RequestPlan, server_id: str, status: int) -> None:
        metrics = self._metrics
        metrics.count_response(plan.request.endpoint, _status_class(status))
        model, routing_key = self._planner.labels(plan)
        metrics.count_request(server_id, model, routing_key, str(status))

    def _count_local(self, path: str, openai_form: bool, error: ContractError) -> None:
        """Count an answer made before the request was parsed (no model label: the model is
        client input that may never have been registered). A 400 is not a finished request in
        `requests_total` (Rust parity) but is in `proxy_responses_total`."""
        self._metrics.count_response(ENDPOINTS[path], _status_class(error.status))
        if error.status != 400:
            self._metrics.count_request("", "", "", str(error.status))


def _status_class(status: int) -> str:
    """`2xx`, `4xx`, ...: the `status_class` label of a status."""
    return f"{status // 100}xx"


async def _cancel_on_disconnect(receive: ASGIReceive, scope: trio.CancelScope) -> None:
    """The body is already read: the next message is `http.disconnect`, when the client leaves."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def _read_body(
    receive: ASGIReceive, headers: list[tuple[bytes, bytes]], limit: int
) -> bytes | bytearray:
    """The whole request body, or 413 when it (or its declared length) exceeds `limit`."""
    declared = first_header(headers, b"content-length")
    length = None if declared is None else parse_unsigned(declared, 2**64 - 1)
    if length is not None and length > limit:
        raise _too_large(limit)
    body = _BodyBuffer(length)
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        body.append(chunk)
        if not message.get("more_body", False):
            return body.take()


class _BodyBuffer:
    """A request body as it arrives, in the one buffer that is then sent and replayed
    (docs/data-plane.md, "Request bodies in memory").

    A body that arrives in one piece is kept as that piece (no copy at all). Otherwise the pieces
    are copied, as they arrive, into one `bytearray`: with a declared length, one of exactly that
    size (under 1 KiB more), reached by doubling as the body arrives, so that a client
    cannot make the replica commit memory for a body it does not send; without one (chunked
    framing), one that grows by appending (amortised, as `bytearray` grows). Either way there is
    no second copy: no list of pieces to join, no `bytes` made of it.

    The declared length is only a size hint: the servers in front enforce it (h11 reads exactly
    that many bytes, h2 resets a stream whose data disagrees with it), and a body that still
    differs is kept as it arrived, as before.
    """

    __slots__ = ("_buffer", "_declared", "_filled", "_first")

    # The first allocation for a declared length is at most this; doubling reaches the length.
    _STEP = 65536

    def __init__(self, declared: int | None) -> None:
        self._declared = declared
        self._first = b""  # the first piece, until a second arrives
        self._buffer: bytearray | None = None
        self._filled = 0  # bytes of `_buffer` that hold the body (past them: room)

    def append(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self._buffer is None:
            if not self._first:
                self._first = chunk
                return
            self._buffer = bytearray(self._initial_size())
            first, self._first = self._first, b""
            self._write(first)
        self._write(chunk)

    def take(self) -> bytes | bytearray:
        """The body: the one piece, or the buffer (trimmed to the body)."""
        buffer = self._buffer
        if buffer is None:
            return self._first
        del buffer[self._filled :]
        return buffer

    def _initial_size(self) -> int:
        """ceil(declared / 2**k) for the least k that makes it at most `_STEP`: doubling it k
        times gives the declared length, plus less than 2**k bytes (under 1 KiB at 64 MiB)."""
        size = self._declared or 0
        while size > self._STEP:
            size = (size + 1) // 2
        return size

    def _write(self, chunk: bytes) -> None:
        buffer = self._buffer
        assert buffer is not None
        start, end = self._filled, self._filled + len(chunk)
        if end > len(buffer):
            if self._declared is None or end > self._declared:
                # No declared length, or past it: grow by appending.
                del buffer[start:]
                buffer += chunk
                self._filled = end
                return
            while len(buffer) < end:
                buffer *= 2  # in place: a `realloc`, no second buffer
        buffer[start:end] = chunk  # same length: copied in place
        self._filled = end


def _too_large(limit: int) -> ContractError:
    return ContractError(
        413,
        message=f"request body exceeds the replay limit of {limit} bytes",
        code="request_too_large",
    )


def _pool_error(error: ActivatorError) -> ContractError:
    """The activator's refusals as JSON errors (503s carry Retry-After), with
    `x-stargate-error-code` like every answer the replica makes with a code (the OpenAI form sets
    it from the same `code`)."""
    body = json.dumps({"error": {"code": error.code, "message": str(error)}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"x-stargate-error-code", error.code.encode()),
    ]
    if error.retry_after is not None:
        headers.append((b"retry-after", str(error.retry_after).encode()))
    return ContractError(error.status, body, headers, message=str(error), code=error.code)


def _routing_eta(request: ProxyRequest, start: float) -> Callable[[], float | None]:
    """A loading comment's ETA during a routing wait: what is left of it."""
    deadline = start + (request.max_wait_ms or 0) / 1000

    def remaining() -> float:
        return max(0.0, deadline - trio.current_time())

    return remaining


def _origin_form(scope: ASGIScope) -> ASGIScope:
    """`scope` with an absolute-form target (RFC 9112 §3.2.2) reduced to its path."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    scheme, sep, rest = raw.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https") or b"/" in scheme:
        return scope
    slash = rest.find(b"/")
    path = b"/" if slash < 0 else rest[slash:]
    return {**scope, "raw_path": path, "path": unquote(path.decode("ascii", "replace"))}


async def _respond(
    send: ASGISend,
    error: ContractError,
    openai_form: bool,
    request: ProxyRequest | None = None,
    timing: bytes | None = None,
) -> None:
    headers, body = error.answer(openai_form)
    headers = list(headers)
    if body:
        headers.append((b"content-length", str(len(body)).encode()))
    if request is not None and request.generated_request_id:
        headers.append((b"x-request-id", request.request_id.encode()))
    if timing is not None:
        headers.append((b"server-timing", timing))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
