"""`setup_tracing` and `Tracing.aclose` against a fake OTLP/gRPC collector in this process
(tests/fakes/otlp_collector.py): the real exporter, batching processor and gRPC channel.

Off without an endpoint; spans arrive with the configured service name; the access token is sent
as `lightstep-access-token` metadata and never logged; without one a WARNING says the export is
unauthenticated; an unreachable collector costs the replica's exit a bounded wait, no more.
"""

from __future__ import annotations

import logging
import socket
import threading

import pytest
import trio
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

from stargate.config import TracingConfig
from stargate.tracing.setup import NO_TOKEN_WARNING, Tracing, setup_tracing
from tests.fakes.otlp_collector import fake_collector

TOKEN = "s3cr3t-tracing-token"


def _record_one(tracing: Tracing) -> None:
    span = tracing.tracer.start("/v1/chat/completions", [])
    span.end()


def test_without_an_endpoint_there_is_no_tracing() -> None:
    assert setup_tracing(TracingConfig(None), TOKEN) is None


async def test_spans_are_exported_with_the_token_as_metadata(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with fake_collector() as collector:
        tracing = setup_tracing(
            TracingConfig(collector.endpoint, "router-a"), TOKEN, instance_id="replica-1"
        )
        assert tracing is not None
        _record_one(tracing)
        await tracing.aclose()  # flushes
        (span,) = collector.spans
        assert span.name == "proxy_openai_request" and span.service_name == "router-a"
        assert all(call.get("lightstep-access-token") == TOKEN for call in collector.metadata)
    assert NO_TOKEN_WARNING not in caplog.text
    assert TOKEN not in caplog.text


async def test_without_a_token_the_export_is_unauthenticated_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with fake_collector() as collector:
        tracing = setup_tracing(TracingConfig(collector.endpoint), None)
        assert tracing is not None
        _record_one(tracing)
        await tracing.aclose()
        assert len(collector.spans) == 1
        assert all("lightstep-access-token" not in call for call in collector.metadata)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [NO_TOKEN_WARNING]


async def test_an_unreachable_collector_bounds_the_exit_and_drops_the_spans(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    endpoint = f"http://127.0.0.1:{port}"
    # The real exporter, with a deadline shorter than its 10 s default so that the export
    # thread left behind ends within this test (its failure is logged here, not in a later one).
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=1.5)
    tracing = setup_tracing(TracingConfig(endpoint), TOKEN, exporter=exporter)
    assert tracing is not None
    tracing.shutdown_timeout = 0.3
    _record_one(tracing)  # recording never waits for the collector
    started = trio.current_time()
    await tracing.aclose()
    assert trio.current_time() - started < 1.0  # the export was still retrying: abandoned
    assert "unexported spans dropped" in caplog.text
    for thread in threading.enumerate():
        if thread.name.startswith("OtelBatch"):
            await trio.to_thread.run_sync(thread.join, 5.0)
    assert TOKEN not in caplog.text
