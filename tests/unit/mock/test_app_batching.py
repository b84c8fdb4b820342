"""The batching model inside the mock backend's ASGI app, called directly (no sockets) in virtual
time (`autojump_clock`): running slots and the FIFO queue, prefill time, the KV cache and the
prefix cache inside it, `/kv-cache/stats`, `/metrics`, continuous usage and the `/test-control`
knobs. The stats stream has its own file (test_app_stats_stream.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from trio.testing import MockClock, wait_all_tasks_blocked

from stargate.mock.shapes import chat_cache_text
from tests.unit.mock.asgi_client import Client, backend, call, start

CHAT: dict[str, Any] = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}
STREAM = {**CHAT, "stream": True}
# "user\0" + 250 characters + "\0": 256 characters, four whole 64-character blocks.
LONG = "".join(chr(ord("a") + index % 26) for index in range(250))


def chat(app: Any, body: dict[str, Any] = STREAM, headers: dict[str, str] | None = None) -> Client:
    return Client(app, "POST", "/v1/chat/completions", body, headers)


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from a /metrics text (labels beyond `engine` and `model_name`)."""
    wanted = {"engine": "0", "model_name": "mock-model", **labels}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == wanted:
                return float(sample.value)
    raise AssertionError(f"no sample {name} {wanted}")


async def scrape(app: Any) -> str:
    answer = await call(app, "GET", "/metrics")
    assert answer.status == 200
    assert answer.response_headers["content-type"].startswith("text/plain; version=0.0.4")
    return answer.body.decode()


async def control(app: Any, **knobs: Any) -> dict[str, Any]:
    answer = await call(app, "POST", "/test-control", knobs)
    assert answer.status == 200, answer.body
    result: dict[str, Any] = answer.json()
    return result


# ------------------------------------------------------------------ running slots


async def test_streams_beyond_the_slots_get_their_head_at_once_and_queue_in_order(
    autojump_clock: MockClock,
) -> None:
    app = backend(ttft_ms=200, tokens=3, max_num_seqs=2)
    async with trio.open_nursery() as nursery:
        clients = [
            await start(nursery, chat(app, headers={"x-request-id": f"r{n}"})) for n in range(4)
        ]
        assert [client.head_sent.is_set() for client in clients] == [True] * 4
        assert [client.head_at for client in clients] == [0.0] * 4
        snapshot = (await call(app, "GET", "/test-control")).json()
        assert (snapshot["running"], snapshot["waiting"], snapshot["in_flight"]) == (2, 2, 4)
        text = await scrape(app)
        assert metric(text, "vllm:num_requests_running") == 2
        assert metric(text, "vllm:num_requests_waiting") == 2
    # The first two run at once; the next two get the slots when the first two finish.
    firsts = [client.first_data_at() for client in clients]
    assert firsts == pytest.approx([0.2, 0.2, 0.4, 0.4])
    assert all(client.events()[-1][1] == "[DONE]" for client in clients)
    text = await scrape(app)
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "vllm:request_success_total", finished_reason="stop") == 4
    assert metric(text, "vllm:generation_tokens_total") == 12
    assert metric(text, "vllm:time_to_first_token_seconds_sum") == pytest.approx(1.2)
    assert metric(text, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.4)
    assert metric(text, "vllm:request_queue_time_seconds_count") == 4


async def test_non_streaming_requests_wait_for_a_slot_too(autojump_clock: MockClock) -> None:
    app = backend(ttft_ms=100, inter_token_ms=10, tokens=3, max_num_seqs=1)
    async with trio.open_nursery() as nursery:
        first = await start(nursery, chat(app, CHAT))
        second = await start(nursery, chat(app, CHAT))
        assert not first.messages and not second.messages  # no head before the answer
        assert (app.engine.running, app.engine.waiting) == (1, 1)
    assert first.head_at == pytest.approx(0.12)
    assert second.head_at == pytest.approx(0.24)
    assert second.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("kv_cache_tokens", [0, 1000])  # the short way, and the long one
async def test_zero_delay_answers_take_a_slot_for_no_time(
    autojump_clock: MockClock, kv_cache_tokens: int
) -> None:
    app = backend(max_num_seqs=1, kv_cache_tokens=kv_cache_tokens)
    for _ in range(3):
        assert (await call(app, "POST", "/v1/chat/completions", CHAT)).status == 200
    assert (await call(app, "POST", "/v1/chat/completions", STREAM)).status == 200
    text = await scrape(app)
    assert metric(text, "vllm:request_success_total", finished_reason="stop") == 4
    assert metric(text, "vllm:generation_tokens_total") == 64
    assert metric(text, "vllm:prompt_tokens_total") == 4  # "hi": one token each
    assert metric(text, "vllm:time_to_first_token_seconds_count") == 4
    assert metric(text, "vllm:request_queue_time_seconds_count") == 4
    assert metric(text, "vllm:request_prompt_tokens_sum") == 4
    assert (app.engine.running, app.engine.waiting, app.engine.kv_used) == (0, 0, 0)


async def test_a_client_that_leaves_while_waiting_leaves_the_queue(
    autojump_clock: MockClock,
) -> None:
    app = backend(ttft_ms=1000, tokens=1, max_num_seqs=1, kv_cache_tokens=1000)
    async with trio.open_nursery() as nursery:
        running = await start(nursery, chat(app))
        leaver = await start(nursery, chat(app, CHAT))  # non-streaming: no head yet
        stream_leaver = await start(nursery, chat(app))
        last = await start(nursery, chat(app))
        assert (app.engine.running, app.engine.waiting) == (1, 3)
        leaver.leave()
        stream_leaver.leave()
        await wait_all_tasks_blocked()
        assert leaver.done and stream_leaver.done
        assert (app.engine.running, app.engine.waiting) == (1, 1)
        assert app.counters.client_disconnects == 2
    # The last one got the slot when the first finished, not two TTFTs later.
    assert running.first_data_at() == pytest.approx(1.0)
    assert last.first_data_at() == pytest.approx(2.0)
    assert leaver.messages == [] and stream_leaver.events() == []
    assert (app.engine.running, app.engine.waiting, app.engine.kv_used) == (0, 0, 0)


async def test_a_client_that_leaves_mid_stream_frees_its_slot(autojump_clock: MockClock) -> None:
    app = backend(ttft_ms=100, inter_token_ms=100, tokens=50, max_num_seqs=1)
    async with trio.open_nursery() as nursery:
        leaving = await start(nursery, chat(app))
        waiting = await start(nursery, chat(app, {**STREAM, "max_tokens": 1}))
        await trio.sleep(0.35)
        assert (app.engine.running, app.engine.waiting) == (1, 1)
        leaving.leave()
    assert waiting.first_data_at() == pytest.approx(0.35 + 0.1)
    text = await scrape(app)
    assert metric(text, "vllm:request_success_total", finished_reason="stop") == 1


async def test_a_dropped_stream_frees_its_slot(autojump_clock: MockClock) -> None:
    app = backend(ttft_ms=100, tokens=4, max_num_seqs=1)
    await control(app, drop_mid_stream={"count": 1, "after_chunks": 2})
    async with trio.open_nursery() as nursery:
        dropped = await start(nursery, chat(app))
        after = await start(nursery, chat(app))
    assert dropped.aborted and len(dropped.events()) == 2
    assert after.first_data_at() == pytest.approx(0.2)
    assert after.events()[-1][1] == "[DONE]"


async def test_more_slots_at_run_time_wake_the_waiters(autojump_clock: MockClock) -> None:
    app = backend(ttft_ms=1000, tokens=1, max_num_seqs=1)
    async with trio.open_nursery() as nursery:
        clients = [await start(nursery, chat(app)) for _ in range(4)]
        await trio.sleep(0.5)
        snapshot = await control(app, max_num_seqs=3)
        assert (snapshot["max_num_seqs"], snapshot["running"], snapshot["waiting"]) == (3, 3, 1)
        # Fewer slots preempt nothing.
        snapshot = await control(app, max_num_seqs=1)
        assert (snapshot["running"], snapshot["waiting"]) == (3, 1)
    firsts = [client.first_data_at() for client in clients]
    # The two woken at 0.5 finish at 1.5; only then is the fourth under the single slot again.
    assert firsts == pytest.approx([1.0, 1.5, 1.5, 2.5])
    # Reset restores the command line's value; unlimited admits everything.
    assert (await control(app, reset=True))["max_num_seqs"] == 1
    assert (await control(app, max_num_seqs=0))["max_num_seqs"] == 0


# ------------------------------------------------------------------ prefill time


async def test_prefill_time_per_token_starts_with_the_slot(autojump_clock: MockClock) -> None:
    app = backend(ttft_ms=100, prefill_ms_per_token=2, tokens=1, max_num_seqs=1)
    async with trio.open_nursery() as nursery:
        first = await start(nursery, chat(app, headers={"x-input-tokens": "50"}))
        second = await start(nursery, chat(app, headers={"x-input-tokens": "200"}))
        # Without x-input-tokens (or with a bad one), the estimate: "hi" is one token.
        third = await start(nursery, chat(app, headers={"x-input-tokens": "many"}))
    assert first.first_data_at() == pytest.approx(0.1 + 0.1)
    assert second.first_data_at() == pytest.approx(0.2 + 0.1 + 0.4)
    assert third.first_data_at() == pytest.approx(0.7 + 0.1 + 0.002)
    # Non-streaming: the same TTFT, then the decoding.
    await control(app, prefill_ms_per_token=1, inter_token_ms=10, tokens=3, max_num_seqs=0)
    answer = await call(
        app,
        "POST",
        "/v1/completions",
        {"model": "mock-model", "prompt": "x"},
        headers={"x-input-tokens": "300"},
    )
    assert answer.head_at == pytest.approx(0.1 + 0.3 + 0.02)
    text = await scrape(app)
    assert metric(text, "vllm:prompt_tokens_total") == 50 + 200 + 1 + 300
    assert metric(text, "vllm:request_prompt_tokens_count") == 4
    assert metric(text, "vllm:request_prompt_tokens_bucket", le="200.0") == 3  # not the 300


async def test_prefill_counts_only_the_uncached_tokens(autojump_clock: MockClock) -> None:
    app = backend(
        ttft_ms=1000,
        tokens=1,
        prefill_ms_per_token=10,
        prefix_cache_blocks=100,
        prefix_cache_speedup=0.5,
    )
    body = {**STREAM, "messages": [{"role": "user", "content": LONG}]}
    miss = await call(app, "POST", "/v1/chat/completions", body, headers={"x-input-tokens": "64"})
    assert miss.first_data_at() == pytest.approx(1.0 + 0.64)
    hit = await call(app, "POST", "/v1/chat/completions", body, headers={"x-input-tokens": "64"})
    assert hit.response_headers["x-mock-prefix-cache-hit-chars"] == "256"
    assert hit.first_data_at() == pytest.approx(0.5)
    # A longer conversation: 256 of its characters are cached.
    turn = {**body, "messages": [*body["messages"], {"role": "user", "content": "y" * 250}]}
    length = len(chat_cache_text(turn))
    partial = await call(
        app, "POST", "/v1/chat/completions", turn, headers={"x-input-tokens": "128"}
    )
    uncached = -(-128 * (length - 256) // length)
    expected = 1.0 * (1 - 256 / length * 0.5) + uncached * 0.01
    assert partial.first_data_at() == pytest.approx(expected)


# ------------------------------------------------------------------ the KV cache


async def test_kv_reservations_admit_in_strict_fifo_order(autojump_clock: MockClock) -> None:
    app = backend(ttft_ms=1000, tokens=10, kv_cache_tokens=100)
    async with trio.open_nursery() as nursery:
        big = await start(nursery, chat(app, headers={"x-input-tokens": "60"}))  # holds 70
        blocked = await start(nursery, chat(app, headers={"x-input-tokens": "40"}))  # 50: no room
        behind = await start(
            nursery, chat(app, headers={"x-input-tokens": "5"})
        )  # 15 fits, but FIFO
        stats = (await call(app, "GET", "/kv-cache/stats")).json()
        assert stats == {
            "model": "mock-model",
            "kv_cache_capacity_tokens": 100,
            "kv_cache_used_tokens": 70,
            "kv_cache_free_tokens": 30,
        }
        snapshot = (await call(app, "GET", "/test-control")).json()
        assert (snapshot["running"], snapshot["waiting"]) == (1, 2)
        assert (snapshot["kv_cache_tokens"], snapshot["kv_cache_used_tokens"]) == (100, 70)
        text = await scrape(app)
        assert metric(text, "vllm:kv_cache_usage_perc") == pytest.approx(0.7)
        info = {"block_size": "16", "num_gpu_blocks": "6"}
        assert metric(text, "vllm:cache_config_info", **info) == 1
    assert big.first_data_at() == pytest.approx(1.0)
    assert blocked.first_data_at() == pytest.approx(2.0)
    assert behind.first_data_at() == pytest.approx(2.0)
    assert (await call(app, "GET", "/kv-cache/stats")).json()["kv_cache_used_tokens"] == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_a_request_larger_than_the_kv_cache_is_refused(path: str) -> None:
    app = backend(tokens=16, kv_cache_tokens=100, prefix_cache_blocks=10)
    body = {"model": "mock-model", "stream": True, "prompt": "x", "input": "x", **CHAT}
    answer = await call(app, "POST", path, body, headers={"x-input-tokens": "85"})
    assert answer.status == 400
    error = answer.json()["error"]
    assert "maximum context" in error["message"]
    assert "101 tokens (85 in the prompt, 16 in the completion)" in error["message"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert app.counters.prefix_cache.lookups == 0  # refused before the cache is looked up
    # A lower max_tokens makes it fit exactly.
    fits = await call(
        app,
        "POST",
        path,
        {**body, "max_tokens": 15, "max_output_tokens": 15},
        headers={"x-input-tokens": "85"},
    )
    assert fits.status == 200


async def test_without_a_kv_cache_its_stats_are_not_found() -> None:
    app = backend()
    answer = await call(app, "GET", "/kv-cache/stats")
    assert answer.status == 404
    assert answer.json()["error"]["type"] == "not_found_error"
    snapshot = (await call(app, "GET", "/test-control")).json()
    assert (snapshot["kv_cache_tokens"], snapshot["kv_cache_used_tokens"]) == (0, 0)
    text = await scrape(app)
    assert "vllm:cache_config_info" not in text
    assert metric(text, "vllm:kv_cache_usage_perc") == 0


async def test_the_prefix_cache_lives_in_what_the_running_sequences_leave_free(
    autojump_clock: MockClock,
) -> None:
    # 160 tokens of KV: ten 16-token blocks (64 characters at four characters a token).
    app = backend(ttft_ms=1000, tokens=1, kv_cache_tokens=160, prefix_cache_blocks=100)
    assert app.prefix_cache.capacity == 10
    one = {**CHAT, "messages": [{"role": "user", "content": LONG}]}
    two = {**CHAT, "messages": [{"role": "user", "content": LONG.upper()}]}
    async with trio.open_nursery() as nursery:
        # One arrives: its four blocks are cached, then it reserves 64 tokens (6 blocks left).
        await start(nursery, chat(app, one, {"x-input-tokens": "63"}))
        assert (len(app.prefix_cache), app.prefix_cache.capacity) == (4, 6)
        # Two arrives: its four blocks push one's two least recently used out (8 > 6), then it
        # reserves 64 more tokens: two blocks left, two's first two (its most recently used).
        await start(nursery, chat(app, two, {"x-input-tokens": "63"}))
        assert (len(app.prefix_cache), app.prefix_cache.capacity) == (2, 2)
        assert app.counters.prefix_cache.evicted_blocks == 6
    assert app.prefix_cache.capacity == 10  # room again, but what was evicted is gone
    again = await call(app, "POST", "/v1/chat/completions", two)
    assert again.response_headers["x-mock-prefix-cache-hit-chars"] == "128"
    again = await call(app, "POST", "/v1/chat/completions", one)
    assert again.response_headers["x-mock-prefix-cache-hit-chars"] == "0"


async def test_without_prefix_cache_blocks_the_kv_cache_caches_no_prefixes() -> None:
    app = backend(kv_cache_tokens=10_000)
    answer = await call(app, "POST", "/v1/chat/completions", CHAT)
    assert "x-mock-prefix-cache-hit-chars" not in answer.response_headers
    assert app.prefix_cache.capacity == 0


# ------------------------------------------------------------------ usage in streams


async def test_continuous_usage_puts_the_usage_so_far_on_every_content_chunk() -> None:
    app = backend(tokens=2)
    headers = {"x-input-tokens": "5"}
    options = {"stream_options": {"continuous_usage_stats": True}}
    answer = await call(app, "POST", "/v1/chat/completions", {**STREAM, **options}, headers=headers)
    chunks = [event for _, event in answer.events()]
    assert chunks[-1] == "[DONE]"
    usages = [json.loads(chunk)["usage"] for chunk in chunks[:-1]]
    assert usages == [
        {"prompt_tokens": 5, "completion_tokens": count, "total_tokens": 5 + count}
        for count in (0, 1, 2, 2)  # role, two tokens, finish; no usage-only chunk
    ]
    both = {"stream_options": {"continuous_usage_stats": True, "include_usage": True}}
    answer = await call(
        app,
        "POST",
        "/v1/completions",
        {"model": "mock-model", "prompt": "x", "stream": True, **both},
        headers=headers,
    )
    payloads = [json.loads(event) for _, event in answer.events()[:-1]]
    assert [p["usage"]["completion_tokens"] for p in payloads] == [1, 2, 2, 2]
    assert payloads[-1]["choices"] == []  # the usual final usage chunk
    # An explicit include_usage: false turns it off, as in vLLM.
    off = {"stream_options": {"continuous_usage_stats": True, "include_usage": False}}
    answer = await call(app, "POST", "/v1/chat/completions", {**STREAM, **off})
    assert b'"usage"' not in answer.body


async def test_streams_without_the_option_are_unchanged() -> None:
    app = backend(tokens=1)
    plain = await call(app, "POST", "/v1/chat/completions", STREAM)
    assert b'"usage"' not in plain.body
    usage = {**STREAM, "stream_options": {"include_usage": True}}
    events = [
        event for _, event in (await call(app, "POST", "/v1/chat/completions", usage)).events()
    ]
    assert [event.count('"usage":null') for event in events[:3]] == [1, 1, 1]


# ------------------------------------------------------------------ control and endpoints


@pytest.mark.parametrize(
    "body",
    [
        {"max_num_seqs": -1},
        {"max_num_seqs": 1.5},
        {"max_num_seqs": True},
        {"prefill_ms_per_token": -1},
        {"prefill_ms_per_token": "2"},
        {"tokens": 3, "max_num_seqs": 2, "prefill_ms_per_token": None},
    ],
)
async def test_bad_batching_knobs_are_400_and_change_nothing(body: dict[str, Any]) -> None:
    app = backend(max_num_seqs=4)
    before = (app.knobs, app.batching_knobs, app.engine.scheduler.max_num_seqs)
    answer = await call(app, "POST", "/test-control", body)
    assert answer.status == 400
    message = answer.json()["error"]["message"]
    assert "max_num_seqs" in message or "prefill_ms_per_token" in message
    assert (app.knobs, app.batching_knobs, app.engine.scheduler.max_num_seqs) == before


async def test_the_snapshot_shows_the_knobs_as_valid_input_and_the_queues() -> None:
    app = backend(max_num_seqs=8, prefill_ms_per_token=0.5)
    snapshot = (await call(app, "GET", "/test-control")).json()
    knobs = {"max_num_seqs": 8, "prefill_ms_per_token": 0.5}
    assert {key: snapshot[key] for key in knobs} == knobs
    assert (snapshot["running"], snapshot["waiting"], snapshot["kv_cache_used_tokens"]) == (0, 0, 0)
    changed = await control(app, max_num_seqs=2, prefill_ms_per_token=3)
    assert (changed["max_num_seqs"], changed["prefill_ms_per_token"]) == (2, 3.0)
    assert (await control(app, **knobs))["max_num_seqs"] == 8


async def test_the_observability_endpoints_are_not_counted() -> None:
    app = backend(kv_cache_tokens=100)
    for path in ("/metrics", "/kv-cache/stats", "/pylon/v1/stats/stream"):
        await call(app, "GET", path)
    answer = await call(app, "POST", "/metrics", {})
    assert (answer.status, answer.response_headers["allow"]) == (405, "GET")
    assert app.counters.requests_total == 0
    assert set(app.counters.requests.values()) == {0}


async def test_embeddings_do_not_go_through_the_engine() -> None:
    app = backend(max_num_seqs=1)
    answer = await call(app, "POST", "/v1/embeddings", {"model": "mock-model", "input": "x"})
    assert answer.status == 200
    assert metric(await scrape(app), "vllm:prompt_tokens_total") == 0
