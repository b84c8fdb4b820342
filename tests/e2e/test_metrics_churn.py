"""Metric series follow the fleet: after backends come and go, `/metrics` shrinks back.

A replica in this process (real loopback sockets, real clock: docs/decisions.md, H7) with a short
series grace period, one `stargate mock-backend` process behind every registration, and real
registration streams (grpcio, in worker threads so the replica's loop keeps serving them).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import grpc
import httpx
import pytest
import trio

from stargate.config import ListenAddress, ServeConfig, WarmupConfig
from stargate.runtime import BoundAddresses, Replica
from tests.e2e.processes import MockBackendProcess, launch_mock_backend
from tests.fakes.pylon import PylonStream, registration

CHURNED = 200
GRACE = 1.0  # seconds; the sweep then runs every GRACE / 4
SAMPLE_LINE = re.compile(r"^(?P<series>[^ #][^ ]*) (?P<value>\S+)$")


@pytest.fixture(scope="module")
def backend() -> Iterator[MockBackendProcess]:
    started = launch_mock_backend("--model", "steady,churn")
    yield started
    started.stop()


def _config() -> ServeConfig:
    return ServeConfig(
        stargate_id="churn-replica",
        http_listen_addr=ListenAddress("127.0.0.1", 0),
        listen_addr=ListenAddress("127.0.0.1", 0),
        model_discovery_listen_addr=ListenAddress("127.0.0.1", 0),
        metrics_port=0,
        shutdown_delay_ms=0,
        warmup=WarmupConfig(warmup_ms=0),
    )


def _series(text: str) -> set[str]:
    """Every exported series (name and labels), without values."""
    return {m["series"] for line in text.splitlines() if (m := SAMPLE_LINE.match(line))}


class _Client:
    def __init__(self, bound: BoundAddresses) -> None:
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{bound.http.port}", timeout=10)
        self.metrics_url = f"http://127.0.0.1:{bound.metrics.port}/metrics"
        self.channel = grpc.insecure_channel(f"127.0.0.1:{bound.grpc.port}")

    async def chat(self, model: str, request_id: str) -> int:
        response = await self.http.post(
            "/v1/chat/completions",
            headers={"x-request-id": request_id, "x-input-tokens": "10", "x-model": model},
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        )
        return response.status_code

    async def metrics(self) -> str:
        response = await self.http.get(self.metrics_url)
        assert response.status_code == 200
        return response.text

    async def register(self, server_id: str, url: str, model: str) -> PylonStream:
        message = registration(server_id, url, [model], cluster_id=f"cluster-{server_id}")
        stream = await trio.to_thread.run_sync(PylonStream, self.channel)
        await trio.to_thread.run_sync(stream.exchange, message)
        return stream

    async def aclose(self) -> None:
        await self.http.aclose()
        self.channel.close()


async def _wait_until_gone(replica: Replica, server_id: str) -> None:
    """Until the replica has ended the registration (the stream's end reaches it async)."""
    for _ in range(1000):
        if all(
            r.identity.inference_server_id != server_id for r in replica.routing.registrations()
        ):
            return
        await trio.sleep(0.005)
    raise AssertionError(f"{server_id} is still registered")


async def test_series_of_departed_backends_are_removed_after_the_grace_period(
    backend: MockBackendProcess,
) -> None:
    replica = Replica(_config(), series_grace_seconds=GRACE)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(replica.run)
        client = _Client(bound)
        try:
            # Baseline: one backend that stays, with traffic, so every series that is not about
            # a particular backend or model (responses by endpoint, in flight...) exists already.
            anchor = await client.register("anchor", backend.url, "steady")
            assert await client.chat("steady", "baseline") == 200
            baseline = await client.metrics()

            for index in range(CHURNED):
                server_id = f"engine-{index}:8080"
                stream = await client.register(server_id, backend.url, "churn")
                assert await client.chat("churn", f"churn-{index}") == 200
                stream.cancel()
                await _wait_until_gone(replica, server_id)

            # Backends that left less than the grace period ago are still exported (the first
            # ones may be gone already: the churn itself takes a few grace periods).
            churned = await client.metrics()
            assert 'inference_server_id="engine-199:8080"' in churned
            assert len(churned) > len(baseline) + 2_000
            assert 'stargate_active_inference_servers{model="churn",routing_key=""} 0.0' in churned

            # Removal lands within the grace period plus two sweeps of leaving.
            for _ in range(40):
                after = await client.metrics()
                if _series(after) == _series(baseline):
                    break
                await trio.sleep(GRACE / 4)
            assert _series(after) == _series(baseline)
            assert "engine-" not in after and 'model="churn"' not in after
            # Only values differ: proxy_responses_total counted the churn's 200 responses.
            assert abs(len(after) - len(baseline)) <= 8
            # The backend that stayed kept its series, values included.
            anchor_lines = [line for line in baseline.splitlines() if '"anchor"' in line]
            assert anchor_lines and all(line in after.splitlines() for line in anchor_lines)
            anchor.cancel()
        finally:
            await client.aclose()
            replica.shutdown.begin(leave=False)


async def test_a_departed_model_that_still_gets_requests_keeps_its_series(
    backend: MockBackendProcess,
) -> None:
    """A series that is still written is never removed under its writer: requests for a model
    whose backends all left keep counting their 503s past the grace period."""
    replica = Replica(_config(), series_grace_seconds=GRACE)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(replica.run)
        client = _Client(bound)
        try:
            stream = await client.register("only", backend.url, "churn")
            assert await client.chat("churn", "before") == 200
            stream.cancel()
            await _wait_until_gone(replica, "only")
            series = 'stargate_requests_total{inference_server_id="",model="churn",routing_key=""'
            deadline = trio.current_time() + 3 * GRACE
            count = 0
            while trio.current_time() < deadline:
                assert await client.chat("churn", f"after-{count}") in (404, 503)
                count += 1
                await trio.sleep(GRACE / 5)
            text = await client.metrics()
            written = [line for line in text.splitlines() if line.startswith(series)]
            assert sum(float(line.rsplit(" ", 1)[1]) for line in written) == count
            # The departed backend's own series went, written last before the grace period.
            assert 'inference_server_id="only"' not in text
        finally:
            await client.aclose()
            replica.shutdown.begin(leave=False)
