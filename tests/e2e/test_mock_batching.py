"""The mock backend's batching model through a real `stargate mock-backend` process on loopback
with the real clock: running slots and the FIFO queue, prefill time, the KV cache and
`/kv-cache/stats`, `/metrics`, the stats stream, continuous usage and the run-time knobs.

Timings are real, on a shared machine: the bounds are generous and the assertions are about
order (who got a first token before whom) more than about exact delays."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.processes import launch_mock_backend

CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@asynccontextmanager
async def mock_backend(*args: str) -> AsyncIterator[httpx.AsyncClient]:
    mock = launch_mock_backend(*args)
    try:
        async with httpx.AsyncClient(base_url=mock.url, trust_env=False, timeout=10) as client:
            yield client
    finally:
        mock.stop()


def gauges(text: str) -> dict[str, float]:
    """The mock-model series of /metrics' samples, by name (other labels dropped)."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") == "mock-model" and "le" not in sample.labels:
                found[sample.name] = float(sample.value)
    return found


class Timed:
    """One streamed chat: when its head and its first SSE event arrived (seconds from `t0`)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.head = -1.0
        self.first = -1.0
        self.events: list[Any] = []

    async def run(
        self, client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            self.head = trio.current_time() - self.t0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    if self.first < 0:
                        self.first = trio.current_time() - self.t0
                    data = line.removeprefix("data: ")
                    self.events.append(data if data == "[DONE]" else json.loads(data))


async def test_slots_queue_streams_in_order_and_metrics_show_the_queue() -> None:
    async with mock_backend("--max-num-seqs", "2", "--ttft-ms", "500", "--tokens", "3") as client:
        t0 = trio.current_time()
        streams = [Timed(t0) for _ in range(4)]
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(stream.run, client, CHAT)
            # While the first two run, /metrics shows two running and two waiting.
            with trio.fail_after(5):
                while True:
                    metrics = gauges((await client.get("/metrics")).text)
                    if metrics["vllm:num_requests_waiting"] == 2:
                        break
                    await trio.sleep(0.02)
            assert metrics["vllm:num_requests_running"] == 2
            snapshot = (await client.get("/test-control")).json()
            assert (snapshot["running"], snapshot["waiting"]) == (2, 2)
        heads = sorted(stream.head for stream in streams)
        firsts = sorted(stream.first for stream in streams)
        # Every head came at once, before any first token; two streams got their first token
        # after one TTFT, the other two only after a second one.
        assert heads[-1] < firsts[0]
        assert firsts[0] >= 0.5
        assert firsts[2] - firsts[1] >= 0.3
        assert firsts[2] >= 1.0
        assert all(stream.events[-1] == "[DONE]" for stream in streams)
        metrics = gauges((await client.get("/metrics")).text)
        assert metrics["vllm:num_requests_running"] == 0
        assert metrics["vllm:num_requests_waiting"] == 0
        assert metrics["vllm:request_success_total"] == 4
        assert metrics["vllm:generation_tokens_total"] == 12
        assert metrics["vllm:time_to_first_token_seconds_count"] == 4
        assert metrics["vllm:request_queue_time_seconds_sum"] >= 0.8  # two waited ~0.5 s


async def test_more_slots_at_run_time_wake_a_waiter_and_prefill_adds_per_token() -> None:
    args = ("--max-num-seqs", "1", "--ttft-ms", "1000", "--tokens", "1")
    async with mock_backend(*args, "--prefill-ms-per-token", "0") as client:
        t0 = trio.current_time()
        first, second = Timed(t0), Timed(t0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(first.run, client, CHAT)
            await trio.sleep(0.2)
            nursery.start_soon(second.run, client, CHAT)
            await trio.sleep(0.2)
            snapshot = (await client.get("/test-control")).json()
            assert (snapshot["running"], snapshot["waiting"]) == (1, 1)
            response = await client.post("/test-control", json={"max_num_seqs": 2})
            assert response.json()["running"] == 2
        # Woken at ~0.4 s: its first token comes ~1.4 s, not after the first one's 1 s + 1 s.
        assert second.first < 1.8
        # Prefill: 5 ms for each of 200 prompt tokens, on top of the TTFT.
        await client.post(
            "/test-control", json={"prefill_ms_per_token": 5, "ttft_ms": 0, "max_num_seqs": 0}
        )
        short, long = Timed(trio.current_time()), Timed(trio.current_time())
        await short.run(client, CHAT, {"x-input-tokens": "1"})
        long.t0 = trio.current_time()
        await long.run(client, CHAT, {"x-input-tokens": "200"})
        assert long.first >= 1.0
        assert short.first < long.first


async def test_the_kv_cache_admits_what_fits_and_refuses_what_never_will() -> None:
    args = ("--kv-cache-tokens", "160", "--tokens", "10", "--ttft-ms", "600")
    async with mock_backend(*args) as client:
        refused = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"x-input-tokens": "151"}
        )
        assert refused.status_code == 400
        assert "maximum context" in refused.json()["error"]["message"]
        t0 = trio.current_time()
        big, blocked = Timed(t0), Timed(t0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(big.run, client, CHAT, {"x-input-tokens": "110"})  # holds 120
            await trio.sleep(0.1)
            nursery.start_soon(blocked.run, client, CHAT, {"x-input-tokens": "40"})  # 50
            await trio.sleep(0.2)
            stats = (await client.get("/kv-cache/stats")).json()
            assert stats == {
                "model": "mock-model",
                "kv_cache_capacity_tokens": 160,
                "kv_cache_used_tokens": 120,
                "kv_cache_free_tokens": 40,
            }
            text = (await client.get("/metrics")).text
            assert gauges(text)["vllm:kv_cache_usage_perc"] == 0.75
            assert 'block_size="16"' in text and 'num_gpu_blocks="10"' in text
        # The second could start only when the first gave its 120 tokens back.
        assert blocked.first >= big.first + 0.4
        assert (await client.get("/kv-cache/stats")).json()["kv_cache_used_tokens"] == 0


async def test_the_stats_stream_follows_a_request_and_ends_at_shutdown() -> None:
    args = ("--engine-stats-stream", "--ttft-ms", "100", "--inter-token-ms", "20", "--tokens", "3")
    mock = launch_mock_backend(*args)
    try:
        async with httpx.AsyncClient(base_url=mock.url, trust_env=False, timeout=10) as client:
            lines: list[Any] = []
            async with client.stream("GET", "/pylon/v1/stats/stream") as response:
                assert response.status_code == 200
                assert response.headers["content-type"] == "application/x-ndjson"
                reader = response.aiter_lines()
                assert json.loads(await reader.__anext__()) == {"v": 1, "type": "ping"}
                chat = Timed(trio.current_time())
                await chat.run(client, CHAT, {"x-request-id": "e2e-1", "x-input-tokens": "9"})
                async for line in reader:
                    event = json.loads(line)
                    if event["type"] == "stats":
                        lines.append(event)
                    if event.get("finished"):
                        break
                # SIGTERM: the stream ends (cleanly) instead of holding the graceful stop.
                started = trio.current_time()
                mock.process.terminate()
                rest = [line async for line in reader]
            assert all(json.loads(line)["type"] == "ping" for line in rest)
            assert await trio.to_thread.run_sync(mock.process.wait, 5) == 0
            assert trio.current_time() - started < 3
    finally:
        mock.stop()
    base = {"v": 1, "type": "stats", "request_id": "e2e-1", "model": "mock-model"}
    assert lines == [
        *(
            {**base, "tokens_processed": processed, "tokens_generated": generated}
            for processed, generated in ((0, 0), (9, 0), (9, 1), (9, 2), (9, 3))
        ),
        {**base, "finished": True},
    ]


async def test_by_default_no_kv_cache_no_stats_stream_and_usage_on_request() -> None:
    async with mock_backend("--tokens", "2") as client:
        assert (await client.get("/kv-cache/stats")).status_code == 404
        assert (await client.get("/pylon/v1/stats/stream")).status_code == 404
        text = (await client.get("/metrics")).text
        assert "vllm:cache_config_info" not in text
        assert gauges(text)["vllm:kv_cache_usage_perc"] == 0
        body = {**CHAT, "stream_options": {"continuous_usage_stats": True}}
        chat = Timed(trio.current_time())
        await chat.run(client, body, {"x-input-tokens": "4"})
        usage = [event["usage"] for event in chat.events[:-1]]
        assert [item["completion_tokens"] for item in usage] == [0, 1, 2, 2]
        assert {item["total_tokens"] - item["completion_tokens"] for item in usage} == {4}
        plain = Timed(trio.current_time())
        await plain.run(client, CHAT)
        assert all("usage" not in event for event in plain.events[:-1])
