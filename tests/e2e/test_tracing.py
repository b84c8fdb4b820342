"""Tracing end to end (docs/tracing.md): a real `stargate serve --otel-endpoint` exporting over
OTLP/gRPC to a fake collector in this process (tests/fakes/otlp_collector.py), a real
`stargate mock-backend`, and one streaming chat request carrying the client's `traceparent`.

The replica is stopped with SIGINT after the request, and the spans arrive through the flush on
exit (the batch processor's 5 s schedule is longer than the test waits otherwise).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.processes import MockBackendProcess, launch_mock_backend
from tests.e2e.test_proxy import start_proxy_replica
from tests.fakes.otlp_collector import FakeCollector, ReceivedSpan, fake_collector

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TOKEN = "tracing-token-e2e"
SPAN_KIND_SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind
SPAN_KIND_CLIENT = 3


@pytest.fixture
def backend() -> Iterator[MockBackendProcess]:
    started = launch_mock_backend("--model", "model-a", "--tokens", "4")
    yield started
    started.stop()


@pytest.fixture
def collector() -> Iterator[FakeCollector]:
    with fake_collector() as running:
        yield running


def _stream_one_chat(
    tmp_path: Path, collector: FakeCollector, backend: MockBackendProcess, *extra: str
) -> tuple[str, dict[str, str], str]:
    """Serve, stream one chat through the replica, stop it; (body, what the backend received,
    the replica's log)."""
    replica = start_proxy_replica(
        tmp_path,
        f"--otel-endpoint={collector.endpoint}",
        "--otel-service-name=stargate-e2e",
        *extra,
    )
    try:
        replica.register("backend-0", backend.url, ["model-a"], cluster_id="c0")
        headers = {
            "x-request-id": "req-trace",
            "x-input-tokens": "5",
            "x-model": "model-a",
            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
            "x-mock-echo-headers": "1",
        }
        chat = {"model": "model-a", "messages": [{"role": "user", "content": "hi"}]}
        with httpx.stream(
            "POST",
            f"{replica.base}/v1/chat/completions",
            headers=headers,
            json={**chat, "stream": True},
            timeout=10,
        ) as response:
            assert response.status_code == 200
            body = response.read().decode()
            received = json.loads(response.headers["x-mock-request-headers"])
        replica.process.process.send_signal(signal.SIGINT)
        assert replica.process.process.wait(timeout=20) == 0
        return body, received, replica.process.log
    finally:
        replica.close()


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    (span,) = [span for span in spans if span.name == name]
    return span


def test_a_streamed_chat_is_traced_from_the_client_through_the_backend(
    tmp_path: Path, collector: FakeCollector, backend: MockBackendProcess
) -> None:
    secrets = tmp_path / "secrets.json"
    secrets.write_text(json.dumps({"tracingAccessToken": TOKEN}))
    body, received, log = _stream_one_chat(
        tmp_path, collector, backend, f"--secrets-path={secrets}"
    )
    assert body.rstrip().endswith("data: [DONE]")

    spans = collector.wait_for_spans(2, timeout=5)
    root = _one(spans, "proxy_openai_request")
    attempt = _one(spans, "proxy_upstream_http_request")
    for exported in (root, attempt):  # the trace as the collector got it (pytest -s shows it)
        print(
            f"{exported.span.name} kind={exported.span.kind} trace={exported.trace_id} "
            f"span={exported.span_id} parent={exported.parent_span_id} "
            f"{dict(sorted(exported.attributes.items()))}"
        )
    print(f"backend received traceparent: {received['traceparent']}")
    assert root.service_name == attempt.service_name == "stargate-e2e"
    # The client's trace continues: the root's parent is the client's span.
    assert root.span.kind == SPAN_KIND_SERVER and attempt.span.kind == SPAN_KIND_CLIENT
    assert root.trace_id == attempt.trace_id == CLIENT_TRACE
    assert root.parent_span_id == CLIENT_SPAN
    assert attempt.parent_span_id == root.span_id
    # The backend's parent is the attempt span.
    version, trace_id, parent_id, flags = received["traceparent"].split("-")
    assert (version, trace_id, parent_id) == ("00", CLIENT_TRACE, attempt.span_id)
    assert int(flags, 16) & 1  # sampled
    # The routing decision, and a root span that outlived the stream's head.
    attributes = root.attributes
    assert attributes["request.model_id"] == "model-a"
    assert attributes["selected_inst.id"] == "backend-0"
    assert attributes["selected_cluster.id"] == "c0"
    assert attributes["proxy.upstream_status"] == 200
    assert attributes["proxy.attempt"] == 1
    assert root.span.end_time_unix_nano > attempt.span.end_time_unix_nano
    # Authenticated with the secrets file's token, which is never logged.
    assert collector.metadata
    assert all(call.get("lightstep-access-token") == TOKEN for call in collector.metadata)
    assert "no tracingAccessToken" not in log
    assert TOKEN not in log


def test_without_a_token_the_export_is_unauthenticated_with_a_warning(
    tmp_path: Path, collector: FakeCollector, backend: MockBackendProcess
) -> None:
    _, _, log = _stream_one_chat(tmp_path, collector, backend)
    spans = collector.wait_for_spans(2, timeout=5)
    assert {span.trace_id for span in spans} == {CLIENT_TRACE}
    assert all("lightstep-access-token" not in call for call in collector.metadata)
    assert "no tracingAccessToken; OTLP trace export is unauthenticated" in log
