"""The spans of proxied requests (docs/tracing.md): the real proxy (`ProxyApp`, `Forwarder`, the
upstream pool) served by Hypercorn in process, loopback backends written per test that record
what they received, and the SDK's in-memory exporter.

What is checked: a client's `traceparent` is continued (same trace, the client's span as the root
span's remote parent) or a new trace starts; each upstream attempt is a child span whose context
replaces the client's `traceparent` in that attempt's headers; a retry is one more attempt span;
the routing attributes are on the root span; a stream's root span ends when the stream ends (or
the client leaves); local errors set the span status; and with tracing off nothing is recorded
and the client's `traceparent` reaches the backend untouched.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import h11
import httpx
import trio
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from stargate.config import ListenAddress, ProxyConfig
from stargate.load_balancing.config import LbConfig
from stargate.metrics import ProxyMetrics
from stargate.proxy.app import ProxyApp
from stargate.proxy.forwarder import Forwarder
from stargate.routing import BackendRoute, ModelStats, RegistrationIdentity, RoutingState
from stargate.serving import bind_listener, hypercorn_config, serve_asgi
from stargate.tracing.request import ATTEMPT_SPAN, ROOT_SPAN, RequestTracer
from stargate.upstream import ConnectionPool, UpstreamConfig
from tests.fakes.asgi_apps import not_found
from tests.unit.proxy.test_upstream import Server, ServerConn, start_server

MODEL = "m"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
HEADERS = {"x-request-id": "req-1", "x-input-tokens": "12", "x-model": MODEL}


class Recorder:
    """An in-memory span exporter behind a `RequestTracer`, as `setup_tracing` wires the SDK."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.root_ended = trio.Event()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        provider.add_span_processor(_RootEnded(self.root_ended))
        self.tracer = RequestTracer(provider.get_tracer("test"))

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        finished = self.exporter.get_finished_spans()
        return [span for span in finished if name is None or span.name == name]

    async def root(self) -> ReadableSpan:
        """The one root span, once it has ended (it ends right after the last byte is sent)."""
        with trio.fail_after(2):
            await self.root_ended.wait()
        (root,) = self.spans(ROOT_SPAN)
        return root


class _RootEnded(SpanProcessor):
    """Sets `event` when a root span ends (spans end on the trio thread: the proxy's)."""

    def __init__(self, event: trio.Event) -> None:
        self._event = event

    def on_end(self, span: ReadableSpan) -> None:
        if span.name == ROOT_SPAN:
            self._event.set()


async def _ok(conn: ServerConn, request: h11.Request, body: bytes) -> None:
    await conn.respond(200, [(b"content-type", b"application/json")], b'{"ok":true}')


def _closed_port_url() -> str:
    """A loopback URL nothing listens on: connecting is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@asynccontextmanager
async def _proxy(
    backends: Sequence[tuple[str, str]], tracer: RequestTracer | None
) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """The proxy, with `backends` ((server id, URL), one cluster) registered for MODEL: a
    client and the proxy's chat URL."""
    routing = RoutingState()
    for server_id, url in backends:
        registration = routing.begin(RegistrationIdentity(server_id, "cluster-1", url, None))
        routing.apply(registration, {MODEL: BackendRoute(ModelStats(), 1_000_000, 0.0)})
    pool = ConnectionPool(UpstreamConfig(connect_timeout=2, response_head_timeout=5))
    metrics = ProxyMetrics.create(CollectorRegistry(), "test_")
    forwarder = Forwarder(routing, pool, ProxyConfig(), LbConfig(), metrics, capacity=pool)
    app = ProxyApp(forwarder, ProxyConfig(), metrics, not_found, tracer=tracer)
    sock = bind_listener("HTTP", ListenAddress("127.0.0.1", 0))
    port = sock.getsockname()[1]
    stop = trio.Event()
    async with pool, trio.open_nursery() as nursery:
        await nursery.start(serve_asgi, app, sock, hypercorn_config(2.0), stop.wait)
        try:
            async with httpx.AsyncClient() as client:
                yield client, f"http://127.0.0.1:{port}/v1/chat/completions"
        finally:
            stop.set()


def _received(server: Server, name: bytes) -> list[bytes]:
    """Every value of header `name` in the last request `server` received."""
    request, _ = server.requests[-1]
    return [value for key, value in request.headers if key == name]


def _traceparents(server: Server) -> list[tuple[str, str, bool]]:
    """The `traceparent` values of the last request `server` received: (trace id, parent span
    id, sampled)."""
    parsed = []
    for value in _received(server, b"traceparent"):
        version, trace_id, span_id, flags = value.decode().split("-")
        assert version == "00"
        parsed.append((trace_id, span_id, bool(int(flags, 16) & 1)))
    return parsed


def _hex_span(span: ReadableSpan) -> tuple[str, str]:
    assert span.context is not None
    return f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"


async def test_a_client_traceparent_is_continued_and_the_attempt_context_goes_upstream(
    nursery: trio.Nursery,
) -> None:
    backend = await start_server(nursery, _ok)
    recorder = Recorder()
    async with _proxy([("backend-1", backend.url(""))], recorder.tracer) as (client, url):
        headers = {**HEADERS, "traceparent": CLIENT_TRACEPARENT, "tracestate": "vendor=x"}
        response = await client.post(url, headers=headers, content=b"{}")
    assert response.status_code == 200
    root = await recorder.root()
    (attempt,) = recorder.spans(ATTEMPT_SPAN)
    assert root.kind is SpanKind.SERVER and attempt.kind is SpanKind.CLIENT
    # The root continues the client's trace, its parent the client's (remote) span.
    assert _hex_span(root)[0] == CLIENT_TRACE
    assert root.parent is not None and root.parent.is_remote
    assert f"{root.parent.span_id:016x}" == CLIENT_SPAN
    # The attempt is the root's child, in the same trace.
    assert attempt.parent is not None and root.context is not None
    assert attempt.parent.span_id == root.context.span_id
    trace_id, attempt_id = _hex_span(attempt)
    assert trace_id == CLIENT_TRACE
    # The backend got the attempt's context, once, in place of the client's; tracestate kept.
    assert _traceparents(backend) == [(CLIENT_TRACE, attempt_id, True)]
    assert _received(backend, b"tracestate") == [b"vendor=x"]


async def test_without_a_traceparent_a_new_trace_starts(nursery: trio.Nursery) -> None:
    backend = await start_server(nursery, _ok)
    recorder = Recorder()
    async with _proxy([("backend-1", backend.url(""))], recorder.tracer) as (client, url):
        assert (await client.post(url, headers=HEADERS, content=b"{}")).status_code == 200
    root = await recorder.root()
    (attempt,) = recorder.spans(ATTEMPT_SPAN)
    assert root.parent is None
    trace_id, attempt_id = _hex_span(attempt)
    assert trace_id == _hex_span(root)[0] != CLIENT_TRACE
    assert _traceparents(backend) == [(trace_id, attempt_id, True)]


async def test_a_retry_is_one_more_attempt_span_and_the_root_has_the_routing_decision(
    nursery: trio.Nursery,
) -> None:
    live = await start_server(nursery, _ok)
    recorder = Recorder()
    # A cluster's round robin starts at its first backend in id order: the refused one, then its
    # sibling (docs/data-plane.md, Backend choice).
    backends = [("a-refused", _closed_port_url()), ("b-live", live.url(""))]
    async with _proxy(backends, recorder.tracer) as (client, url):
        headers = {
            **HEADERS,
            "traceparent": CLIENT_TRACEPARENT,
            "x-routing-key": "tenant-a",
            "x-priority": "3",
            "x-max-wait-ms": "250",
        }
        routing_key_backends = await client.post(url, headers=headers, content=b"{}")
        # The routing key scopes the target: nothing serves it, a local 404 (checked below).
        assert routing_key_backends.status_code == 404
        del headers["x-routing-key"]
        response = await client.post(url + "?api-key=secret", headers=headers, content=b"{}")
    assert response.status_code == 200
    roots = recorder.spans(ROOT_SPAN)
    assert len(roots) == 2
    missing, root = roots
    assert missing.attributes is not None
    assert missing.attributes["request.routing_key"] == "tenant-a"
    assert missing.attributes["http.response.status_code"] == 404
    assert missing.status.status_code is StatusCode.ERROR
    assert missing.attributes["error.type"] == "no_eligible_candidates"

    attempts = recorder.spans(ATTEMPT_SPAN)
    assert [a.attributes["selected_inst.id"] for a in attempts if a.attributes] == [
        "a-refused",
        "b-live",
    ]
    refused, answered = attempts
    assert refused.status.status_code is StatusCode.ERROR
    assert refused.attributes is not None and refused.attributes["error.type"] == "ConnectError"
    assert answered.attributes is not None
    assert answered.attributes["http.response.status_code"] == 200
    assert answered.status.status_code is StatusCode.UNSET
    for attempt in attempts:
        assert attempt.parent is not None and root.context is not None
        assert attempt.parent.span_id == root.context.span_id
    # Only the answering attempt's context reached a backend (the other was never connected).
    assert _traceparents(live) == [(CLIENT_TRACE, _hex_span(answered)[1], True)]

    assert root.attributes is not None
    expected = {
        "request.endpoint": "chat_completions",
        "request.model_id": MODEL,
        "request.path": "/v1/chat/completions",  # never the query string
        "request.input_tokens": 12,
        "request.priority": 3,
        "request.max_wait_ms": 250,
        "request.cache_affinity_key_present": False,
        "routing.algorithm": "power-of-n",  # the default
        "routing.num_candidates": 1,
        "routing.rank_depth": 1,
        "routing.retry_attempts": 0,
        "selected_cluster.id": "cluster-1",
        "selected_inst.id": "b-live",
        "proxy.upstream_status": 200,
        "proxy.attempt": 2,
        "proxy.connect_attempts": 1,
        "proxy.request_retries": 0,
        "proxy.replay_body_bytes": 2,
        "http.response.status_code": 200,
    }
    assert {key: root.attributes.get(key) for key in expected} == expected
    assert "request.routing_key" not in root.attributes
    assert float(root.attributes["proxy.time_to_first_byte_ms"]) > 0  # type: ignore[arg-type]
    assert root.status.status_code is StatusCode.UNSET
    assert all("secret" not in str(value) for value in root.attributes.values())


async def test_a_streamed_response_ends_its_root_span_when_the_stream_ends(
    nursery: trio.Nursery,
) -> None:
    release = trio.Event()

    async def stream(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked")]
        await conn.send(h11.Response(status_code=200, headers=headers))
        await conn.send(h11.Data(data=b"data: one\n\n"))
        await release.wait()
        await conn.send(h11.Data(data=b"data: [DONE]\n\n"), h11.EndOfMessage())

    backend = await start_server(nursery, stream)
    recorder = Recorder()
    async with _proxy([("backend-1", backend.url(""))], recorder.tracer) as (client, url):
        received = b""
        async with client.stream("POST", url, headers=HEADERS, content=b"{}") as response:
            async for chunk in response.aiter_raw():
                received += chunk
                if not release.is_set():
                    # Mid-stream: the attempt (the exchange up to the head) has ended, the
                    # request's root span has not.
                    await trio.sleep(0.1)
                    assert [s.name for s in recorder.spans()] == [ATTEMPT_SPAN]
                    release.set()
    assert received == b"data: one\n\ndata: [DONE]\n\n"
    root = await recorder.root()
    (attempt,) = recorder.spans(ATTEMPT_SPAN)
    assert root.end_time is not None and attempt.end_time is not None
    assert root.end_time - attempt.end_time >= 100_000_000  # ns: the stream outlived the head
    assert root.attributes is not None and root.attributes["proxy.upstream_status"] == 200


async def test_a_client_leaving_mid_stream_ends_the_root_span(nursery: trio.Nursery) -> None:
    async def endless(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked")]
        await conn.send(h11.Response(status_code=200, headers=headers))
        await conn.send(h11.Data(data=b"data: one\n\n"))
        await conn.wait_for_client_close()

    backend = await start_server(nursery, endless)
    recorder = Recorder()
    async with _proxy([("backend-1", backend.url(""))], recorder.tracer) as (client, url):
        async with client.stream("POST", url, headers=HEADERS, content=b"{}") as response:
            async for _ in response.aiter_raw():
                break  # leave after the first event
        root = await recorder.root()
    assert root.attributes is not None and root.attributes["proxy.client_disconnected"] is True


async def test_a_bad_request_is_a_span_without_error_status(nursery: trio.Nursery) -> None:
    backend = await start_server(nursery, _ok)
    recorder = Recorder()
    async with _proxy([("backend-1", backend.url(""))], recorder.tracer) as (client, url):
        response = await client.post(url, headers={"x-model": MODEL}, content=b"{}")
    assert response.status_code == 400
    root = await recorder.root()
    assert root.attributes is not None and root.attributes["http.response.status_code"] == 400
    assert root.status.status_code is StatusCode.UNSET  # the client's error, not the replica's
    assert recorder.spans(ATTEMPT_SPAN) == []


async def test_an_upstream_5xx_sets_the_error_status(nursery: trio.Nursery) -> None:
    async def failing(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.respond(500, [], b"boom")

    backend = await start_server(nursery, failing)
    recorder = Recorder()
    async with _proxy([("backend-1", backend.url(""))], recorder.tracer) as (client, url):
        assert (await client.post(url, headers=HEADERS, content=b"{}")).status_code == 500
    root = await recorder.root()
    (attempt,) = recorder.spans(ATTEMPT_SPAN)
    assert root.status.status_code is StatusCode.ERROR
    assert attempt.status.status_code is StatusCode.ERROR


async def test_with_tracing_off_the_client_traceparent_is_forwarded_untouched(
    nursery: trio.Nursery,
) -> None:
    backend = await start_server(nursery, _ok)
    async with _proxy([("backend-1", backend.url(""))], None) as (client, url):
        headers = {**HEADERS, "traceparent": CLIENT_TRACEPARENT, "tracestate": "vendor=x"}
        assert (await client.post(url, headers=headers, content=b"{}")).status_code == 200
    assert _received(backend, b"traceparent") == [CLIENT_TRACEPARENT.encode()]
    assert _received(backend, b"tracestate") == [b"vendor=x"]


def test_a_replica_without_tracing_never_imports_opentelemetry() -> None:
    """Tracing off costs no import: the runtime and the proxy load the SDK only when it is on."""
    code = (
        "import sys\n"
        "import stargate.runtime, stargate.cli, stargate.proxy.app, stargate.proxy.forwarder\n"
        "from stargate.config import ServeConfig\n"
        "from stargate.runtime import Replica\n"
        "Replica(ServeConfig(stargate_id='t'))\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
