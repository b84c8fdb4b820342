"""The Pylon in the request path, end to end with real processes: `stargate serve`,
`stargate pylon` and `stargate mock-backend` (as a batching engine), driven by real clients (the
`openai` package, httpx). docs/pylon-data-path.md.

What the unit tests of `stargate/pylon/stats/` prove with injected numbers, these prove with the
product: the requests go through the Pylon, its measurements reach the replica's load balancers
(read back from `/debug/routing`), every algorithm routes a fresh fleet without a failure, and bad
input to the Pylon gets its documented answer and loses nothing.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.fleet import (
    ALGORITHMS,
    FAST,
    FAST_DECODE,
    MODEL,
    Fleet,
    chat,
    routing_view,
    stream_once,
    wait_routable,
)
from tests.e2e.processes import (
    MockBackendProcess,
    wait_until,
)
from tests.fakes.http_thread import QuietHandler, ThreadedHttpServer


def test_requests_go_through_the_pylon_and_its_measurements_reach_the_replica(
    fleet: Fleet,
) -> None:
    """The replica's balancers see what the Pylon measured: real input and output throughput
    after a few streams, the live queue while requests wait in the engine's queue, and the queue
    back at 0 once they are done."""
    replica = fleet.replica()
    # 1 s per stream: the six concurrent streams below overlap for most of a second even when
    # their threads start hundreds of ms apart (with 0.4 s streams on two loaded cores, the
    # heartbeats once saw at most two in flight).
    engine = fleet.engine(*FAST, "--inter-token-ms", "40", "--tokens", "25")
    pylon = fleet.pylon(engine.url, replica)
    wait_routable(replica, 1)
    registered = replica.http.get("/debug/routing").json()
    assert registered["targets"][0]["clusters"][0]["backends"][0]["inference_server_id"] == pylon.id

    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{replica.ports.http}/v1", api_key="unused")
    for _ in range(6):  # five completed requests publish the input TPS
        chunks = list(
            sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "count to ten"}], stream=True
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    wait_until(lambda: routing_view(replica)[pylon.id]["last_mean_input_tps"] > 0, 5, "the TPS")
    stats = routing_view(replica)[pylon.id]
    assert stats["output_tps"] > 0 and stats["max_output_tps"] > 0
    assert stats["stats_observed_at_unix_ms"] > 0
    assert stats["max_engine_concurrency"] == 0  # as the Rust Pylon: never reported

    # Six concurrent streams on two slots: four wait in the engine's queue, and the replica sees
    # them (the Pylon's heartbeat, every 200 ms here).
    seen: list[dict[str, Any]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(routing_view(replica)[pylon.id])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{replica.ports.http}", timeout=30) as client:
            results: list[tuple[int, str, str]] = []
            threads = [
                threading.Thread(target=lambda: results.append(stream_once(client, chat())))
                for _ in range(6)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        stop.set()
        watcher.join()
    assert [status for status, _, _ in results] == [200] * 6
    assert {backend for _, backend, _ in results} == {pylon.id}
    assert all("[DONE]" in text for _, _, text in results)
    peak = max(seen, key=lambda s: s["num_running_queries"])
    assert peak["queue_size"] >= 1 and peak["queued_input_size"] >= peak["queue_size"]
    assert peak["num_running_queries"] >= 3
    assert peak["queue_time_estimate_ms_by_priority"]  # prompt work at a valid TPS
    wait_until(
        lambda: routing_view(replica)[pylon.id]["num_running_queries"] == 0, 5, "an empty queue"
    )


def test_every_algorithm_routes_a_fresh_fleet_without_a_failure(fleet: Fleet) -> None:
    """Three fresh Pylons (nothing measured yet), one engine four times slower: every algorithm
    serves every request from the first one on. With `--unmeasured-backends exclude` (the Rust
    rule) the same fresh fleet is refused by pulsar: the estimate is what makes it routable."""
    replica = fleet.replica()
    strict = fleet.replica("--unmeasured-backends", "exclude")
    slow = ("--max-num-seqs", "2", "--ttft-ms", "80", "--prefill-ms-per-token", "0.2")
    engines = [
        fleet.engine(*FAST, *FAST_DECODE),
        fleet.engine(*FAST, *FAST_DECODE),
        fleet.engine(*slow, "--inter-token-ms", "40", "--tokens", "12"),
    ]
    for engine in engines:
        # Each Pylon registers with both replicas (the seed announces only itself, so one each).
        fleet.pylon(engine.url, replica)
        fleet.pylon(engine.url, strict)
    wait_routable(replica, 3)
    wait_routable(strict, 3)
    assert all(s["input_tps_estimated"] for s in routing_view(replica).values())

    with httpx.Client(base_url=f"http://127.0.0.1:{strict.ports.http}", timeout=30) as client:
        status, _, _ = stream_once(client, chat(), {"x-routing-method": "pulsar"})
        assert status == 503  # the Rust rule: nothing measured, nothing ranked

    served: dict[str, set[str]] = {}
    with httpx.Client(base_url=f"http://127.0.0.1:{replica.ports.http}", timeout=30) as client:
        for algorithm in ALGORITHMS:
            results: list[tuple[int, str, str]] = []

            def one(algorithm: str = algorithm, results: list[Any] = results) -> None:
                results.append(stream_once(client, chat(), {"x-routing-method": algorithm}))

            threads = [threading.Thread(target=one) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            statuses = [status for status, _, _ in results]
            assert statuses == [200] * 8, (algorithm, statuses)
            served[algorithm] = {backend for _, backend, _ in results}
    # round-robin spreads 8 requests over all three.
    assert len(served["round-robin"]) == 3


def _chats(engine: MockBackendProcess) -> int:
    """Chat completions the engine received (canaries included; health probes not)."""
    counters = httpx.get(engine.url + "/test-control").json()["counters"]
    return int(counters["requests"]["chat_completions"])


def test_queue_admission_refuses_a_mismatch_and_the_replica_retries_it_elsewhere(
    fleet: Fleet,
) -> None:
    """A Pylon whose queue holds far more work than the replica's estimate refuses with the
    retryable 429 `queue_estimate_mismatch` before the engine sees the request; through the
    replica such a request is served by the other backend, without a failure."""
    replica = fleet.replica()
    busy_engine = fleet.engine("--max-num-seqs", "1", "--ttft-ms", "3000", "--tokens", "2")
    idle_engine = fleet.engine(*FAST, *FAST_DECODE)
    # A pinned input TPS of 10 tokens/s: 100 queued tokens are 10 s of local queue. Its heartbeat
    # is 10 s: the replica keeps the empty queue of its first message for the whole test, as a
    # replica's view is stale between heartbeats (and blind to other replicas' requests).
    busy = fleet.pylon(
        busy_engine.url,
        replica,
        "--canary-interval-ms",
        "0",
        "--initial-input-tps",
        "10",
        "--benchmark-pin-input-tps",
        "--min-update-interval-ms",
        "10000",
    )
    idle = fleet.pylon(idle_engine.url, replica)
    wait_routable(replica, 2)
    head = {"x-request-id": "hold", "x-model": MODEL, "x-input-tokens": "100"}
    holder = threading.Thread(
        target=lambda: httpx.post(
            busy.url + "/v1/chat/completions", json=chat(), headers=head, timeout=30
        )
    )
    holder.start()
    try:
        wait_until(
            lambda: httpx.get(busy_engine.url + "/test-control").json()["running"] == 1,
            5,
            "the held request",
        )
        direct = httpx.post(
            busy.url + "/v1/chat/completions",
            json=chat(),
            headers={
                "x-request-id": "direct",
                "x-model": MODEL,
                "x-input-tokens": "5",
                "x-stargate-expected-queue-ms": "0",
            },
            timeout=10,
        )
        assert direct.status_code == 429
        assert direct.headers["content-type"] == "application/problem+json"
        assert direct.headers["x-stargate-retryable"] == "true"
        assert direct.headers["x-stargate-retry-reason"] == "queue_estimate_mismatch"
        problem = direct.json()
        assert problem["reason"] == "queue_estimate_mismatch"
        assert problem["expected_queue_ms"] == 0
        assert problem["actual_queue_ms"] == 10_000  # 100 tokens at 10 tokens/s
        assert problem["threshold_ms"] == 25
        before = _chats(busy_engine)

        with httpx.Client(base_url=f"http://127.0.0.1:{replica.ports.http}", timeout=30) as client:
            outcomes = [
                stream_once(client, chat(), {"x-routing-method": "round-robin"}) for _ in range(4)
            ]
        assert [status for status, _, _ in outcomes] == [200] * 4
        assert {backend for _, backend, _ in outcomes} == {idle.id}
        assert _chats(busy_engine) == before  # refused before the engine, every time
        assert "queue estimate mismatch" in busy.process.log
    finally:
        holder.join()


def test_side_channels_fill_the_kv_fields_and_label_their_source(fleet: Fleet) -> None:
    """The engine stats stream, the KV-cache JSON endpoint and (ours) the engine's vLLM metrics
    each claim their stats label; both KV sources give the engine's capacity."""
    replica = fleet.replica()
    engine = fleet.engine(*FAST, *FAST_DECODE, "--engine-stats-stream", "--kv-cache-tokens", "4096")
    with_json = fleet.pylon(engine.url, replica, "--kv-cache-stats-path", "/kv-cache/stats")
    with_metrics = fleet.pylon(engine.url, replica, "--engine-stats-stream", "off")
    wait_routable(replica, 2)
    with httpx.Client(base_url=f"http://127.0.0.1:{replica.ports.http}", timeout=30) as client:
        for _ in range(4):
            assert stream_once(client, chat(), {"x-routing-method": "round-robin"})[0] == 200

    def labelled() -> bool:
        view = routing_view(replica)
        return (
            "engine_stats_stream" in view[with_json.id]["stats_sources"]
            and "kv_cache_stats" in view[with_json.id]["stats_sources"]
            and "engine_metrics" in view[with_metrics.id]["stats_sources"]
        )

    wait_until(labelled, 10, "the stats labels")
    view = routing_view(replica)
    assert view[with_json.id]["stats_capabilities"][:2] == [
        "model.throughput.engine_stream",
        "machine.kv_cache.http",
    ]
    assert "engine_stats_stream" not in view[with_metrics.id]["stats_sources"]
    for server_id in (with_json.id, with_metrics.id):
        assert view[server_id]["kv_cache_capacity_tokens"] == 4096
        assert view[server_id]["kv_cache_free_tokens"] <= 4096


def test_calibration_publishes_a_measured_tps_before_the_first_request(fleet: Fleet) -> None:
    replica = fleet.replica()
    engine = fleet.engine("--prefill-ms-per-token", "0.01", "--tokens", "1")
    pylon = fleet.pylon(
        engine.url,
        replica,
        "--do-calibration",
        "--calibration-requests",
        "2",
        "--calibration-max-steps",
        "3",
        "--calibration-prompt-units",
        "1024",
    )
    wait_routable(replica, 1)
    stats = routing_view(replica)[pylon.id]
    # Advertised only once calibrated: the first heartbeat already carries a measured TPS.
    assert stats["last_mean_input_tps"] > 0
    assert not stats["input_tps_estimated"]
    assert "calibration of dp-model: input TPS" in pylon.process.log
    counters = httpx.get(engine.url + "/test-control").json()["counters"]
    assert counters["requests"]["chat_completions"] >= 2 + 4 + 8  # three steps (and canaries)


def test_a_canary_that_runs_to_max_tokens_makes_the_model_inactive(fleet: Fleet) -> None:
    replica = fleet.replica()
    engine = fleet.engine("--tokens", "237")  # every answer runs to the canary's max_tokens
    pylon = fleet.pylon(engine.url, replica, "--canary-interval-ms", "200")
    wait_until(lambda: "canary of dp-model failed" in pylon.process.log, 10, "the canary")
    wait_until(lambda: replica.list_models(MODEL) == [], 5, "the model INACTIVE")
    engine.control(tokens=16)
    wait_until(lambda: replica.list_models(MODEL) == [MODEL], 5, "the model ACTIVE again")
    assert "canary of dp-model passed" in pylon.process.log


class _HugeEvent(QuietHandler):
    """An engine whose stream sends one SSE event larger than the Pylon's 1 MiB bound."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n')
        self.wfile.write(b"data: " + b"x" * (1024 * 1024 + 10) + b"\n\n")
        self.wfile.flush()

    def do_GET(self) -> None:
        body = (
            json.dumps({"data": [{"id": MODEL}]}).encode() if self.path == "/v1/models" else b"ok"
        )
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_bad_input_to_the_pylon_gets_its_documented_answer_and_loses_nothing(fleet: Fleet) -> None:
    replica = fleet.replica()
    engine = fleet.engine(*FAST, *FAST_DECODE)
    pylon = fleet.pylon(engine.url, replica, "--canary-interval-ms", "0")
    wait_routable(replica, 1)
    good = {"x-request-id": "r1", "x-model": MODEL, "x-input-tokens": "7"}
    cases = [
        (
            {k: v for k, v in good.items() if k != "x-request-id"},
            "missing required x-request-id header",
        ),
        ({**good, "x-model": ""}, "missing required x-model header"),
        ({**good, "x-input-tokens": "seven"}, "invalid x-input-tokens header"),
        ({**good, "x-input-tokens": "-1"}, "invalid x-input-tokens header"),
        ({**good, "x-priority": "99999999999"}, "invalid x-priority header"),
    ]
    for headers, detail in cases:
        answer = httpx.post(pylon.url + "/v1/chat/completions", json=chat(), headers=headers)
        assert answer.status_code == 400, detail
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.json() == {
            "type": "about:blank",
            "title": "Bad Request",
            "status": 400,
            "detail": detail,
        }
    not_json = httpx.post(pylon.url + "/v1/chat/completions", content=b"{nope", headers=good)
    assert not_json.status_code == 400
    assert not_json.json()["detail"] == "request body must be valid JSON"
    assert (
        httpx.get(engine.url + "/test-control").json()["counters"]["requests"]["chat_completions"]
        == 0
    )  # none of them reached the engine

    # Header hygiene: the Dynamo priority headers are written, inbound ones and the replica's
    # routing headers are not passed on.
    echoed = httpx.post(
        pylon.url + "/v1/chat/completions",
        json={**chat(), "stream": False},
        headers={
            **good,
            "x-priority": "600",
            "x-dynamo-request-priority": "1",
            "x-stargate-expected-queue-ms": "5",
            "x-stargate-retryable": "true",
            "x-mock-echo-headers": "1",
        },
    )
    assert echoed.status_code == 200
    received = echoed.json()["mock_request_headers"]
    assert received["x-dynamo-request-priority"] == "3000"
    assert received["x-dynamo-request-strict-priority"] == "0"
    assert "x-stargate-expected-queue-ms" not in received
    assert "x-stargate-retryable" not in received
    assert received["x-request-id"] == "r1"

    # The health probe goes through to the engine.
    assert httpx.get(pylon.url + "/health").status_code == 200
    engine.control(healthy=False)
    assert httpx.get(pylon.url + "/health").status_code == 503
    engine.control(healthy=True)

    # An engine event over 1 MiB cuts the stream: the client sees a broken body, not a short
    # one that looks whole.
    huge = ThreadedHttpServer(_HugeEvent)
    try:
        cut = fleet.pylon(huge.url, replica, "--canary-interval-ms", "0")
        wait_until(lambda: "upstream models: ['dp-model']" in cut.process.log, 10, "the model")
        with (
            pytest.raises(httpx.RemoteProtocolError),
            httpx.stream(
                "POST", cut.url + "/v1/chat/completions", json=chat(), headers=good
            ) as response,
        ):
            assert response.status_code == 200
            for _ in response.iter_bytes():
                pass
        assert "engine stream of request r1 cut" in cut.process.log
        # That Pylon leaves before its engine does: a request routed to it after the engine
        # closed would get its non-retryable 503 `local_connect_failure` (the Rust default).
        cut.process.process.send_signal(signal.SIGTERM)
        assert cut.process.process.wait(timeout=10) == 0
    finally:
        huge.close()

    # Nothing was lost: the Pylon still serves through the replica, its queue is empty.
    wait_routable(replica, 1)
    with httpx.Client(base_url=f"http://127.0.0.1:{replica.ports.http}", timeout=30) as client:
        assert stream_once(client, chat())[0] == 200
    wait_until(
        lambda: routing_view(replica)[pylon.id]["num_running_queries"] == 0, 5, "an empty queue"
    )


def test_sigterm_closes_the_registration_and_finishes_the_streams_in_flight(fleet: Fleet) -> None:
    replica = fleet.replica()
    engine = fleet.engine("--inter-token-ms", "100", "--tokens", "20")
    # No canaries: the engine's one request in flight must be the client's stream (a periodic
    # canary, 2 s on this engine, once stood in for it and SIGTERM came before the stream did).
    pylon = fleet.pylon(engine.url, replica, "--canary-interval-ms", "0")
    wait_routable(replica, 1)
    results: list[tuple[int, str, str]] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{replica.ports.http}", timeout=30) as client:
        streaming = threading.Thread(target=lambda: results.append(stream_once(client, chat())))
        streaming.start()
        wait_until(
            lambda: httpx.get(engine.url + "/test-control").json()["in_flight"] == 1, 5, "a stream"
        )
        pylon.process.process.send_signal(signal.SIGTERM)
        wait_until(lambda: replica.list_models(MODEL) == [], 3, "the registration closed")
        streaming.join()
    assert results[0][0] == 200 and "[DONE]" in results[0][2]  # the stream ran to its end
    assert pylon.process.process.wait(timeout=10) == 0
