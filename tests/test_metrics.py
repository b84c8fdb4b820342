"""The metrics registry and its ASGI exposition app."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry

from stargate.metrics import Metrics, metrics_asgi_app


def _client(registry: CollectorRegistry) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=metrics_asgi_app(registry))
    return httpx.AsyncClient(transport=transport, base_url="http://metrics")


async def test_metrics_endpoint_serves_the_private_registry_with_the_prefix() -> None:
    registry = CollectorRegistry()
    Metrics(registry, prefix="llm_request_router_")
    async with _client(registry) as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert "llm_request_router_readiness_ready 0.0" in text
    assert 'llm_request_router_readiness_warmup_promotions_total{reason="deadline"} 0.0' in text
    assert "stargate_" not in text
    assert "_created" not in text
    assert "process_" not in text  # no process collectors, as in the Rust replica


async def test_two_registries_do_not_share_counters() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    Metrics(first).readiness.warmup_promotions.labels(reason="deadline").inc()
    Metrics(second)
    sample = 'stargate_readiness_warmup_promotions_total{reason="deadline"}'
    assert first.get_sample_value(sample.split("{")[0], {"reason": "deadline"}) == 1.0
    assert second.get_sample_value(sample.split("{")[0], {"reason": "deadline"}) == 0.0


async def test_other_paths_and_methods_are_refused() -> None:
    async with _client(CollectorRegistry()) as client:
        assert (await client.get("/")).status_code == 404
        assert (await client.get("/metrics/extra")).status_code == 404
        response = await client.post("/metrics")
        assert response.status_code == 405
        assert response.headers["allow"] == "GET, HEAD"
        head = await client.head("/metrics")
        assert head.status_code == 200 and head.content == b""
