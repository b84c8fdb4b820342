"""A fake OTLP/gRPC trace collector: a grpcio server implementing
`opentelemetry.proto.collector.trace.v1.TraceService/Export` that keeps every span it receives
and the metadata of every call (the tracing tests read `lightstep-access-token` from it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, with its resource's `service.name`."""

    service_name: str
    span: trace_pb2.Span

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_span_id(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def attributes(self) -> dict[str, object]:
        values: dict[str, object] = {}
        for attribute in self.span.attributes:
            value = attribute.value
            kind = value.WhichOneof("value")
            values[attribute.key] = getattr(value, kind) if kind else None
        return values


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[ReceivedSpan] = []
        self.metadata: list[dict[str, str]] = []

    def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        metadata = {key: str(value) for key, value in context.invocation_metadata()}
        received: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            service = ""
            for attribute in resource_spans.resource.attributes:
                if attribute.key == "service.name":
                    service = attribute.value.string_value
            for scope_spans in resource_spans.scope_spans:
                received += [ReceivedSpan(service, span) for span in scope_spans.spans]
        with self.lock:
            self.metadata.append(metadata)
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()


class FakeCollector:
    """The running collector: its `endpoint` (http://127.0.0.1:PORT), what it received."""

    def __init__(self, service: _Service, port: int) -> None:
        self._service = service
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._service.lock:
            return list(self._service.spans)

    @property
    def metadata(self) -> list[dict[str, str]]:
        with self._service.lock:
            return list(self._service.metadata)

    def wait_for_spans(self, count: int, timeout: float) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.spans
            if len(spans) >= count:
                return spans
            time.sleep(0.02)
        raise AssertionError(f"the collector got {len(self.spans)} span(s), expected {count}")


@contextmanager
def fake_collector() -> Iterator[FakeCollector]:
    """A collector on a free loopback port, stopped on exit."""
    service = _Service()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield FakeCollector(service, port)
    finally:
        server.stop(grace=None)
