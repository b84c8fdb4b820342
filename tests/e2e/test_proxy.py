"""The data plane end to end: a real replica, real mock backends registered over real gRPC
streams, and real HTTP clients (httpx and the `openai` package). Real clock, loopback only."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import trio

from tests.e2e.processes import (
    BIND_ATTEMPTS,
    MockBackendProcess,
    Ports,
    StargateProcess,
    launch,
    launch_mock_backend,
    lost_a_port,
    stop,
    wait_until,
)
from tests.fakes.pylon import INACTIVE, PylonStream, registration

HEADERS = {"x-request-id": "req-1", "x-input-tokens": "10", "x-model": "model-a"}
CHAT = {"model": "model-a", "messages": [{"role": "user", "content": "hi"}]}


class ProxyReplica:
    def __init__(self, process: StargateProcess, ports: Ports) -> None:
        self.process = process
        self.ports = ports
        self.base = f"http://127.0.0.1:{ports.http}"
        self.channel = grpc.insecure_channel(f"127.0.0.1:{ports.grpc}")
        self.streams: list[PylonStream] = []

    def register(self, server_id: str, url: str, models: object, **kwargs: object) -> PylonStream:
        stream = PylonStream(self.channel)
        stream.exchange(registration(server_id, url, models, **kwargs))  # type: ignore[arg-type]
        self.streams.append(stream)
        return stream

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.ports.metrics}/metrics", timeout=5).text

    def close(self) -> None:
        for stream in self.streams:
            stream.cancel()
        self.channel.close()
        stop(self.process)


def start_proxy_replica(log_dir: Path, *extra: str) -> ProxyReplica:
    for attempt in range(BIND_ATTEMPTS):
        ports = Ports.pick()
        process = launch(
            log_dir / f"proxy-{ports.http}.log",
            "serve",
            *ports.args(),
            "--readiness-warmup-ms=0",
            "--disable-dns-discovery",
            "--registration-update-idle-timeout-ms=0",
            *extra,
        )
        replica = ProxyReplica(process, ports)

        def serving(process: StargateProcess = process, replica: ProxyReplica = replica) -> bool:
            code = process.process.poll()
            if code is not None:  # say why at once, rather than time out on a dead process
                raise AssertionError(f"the replica exited with {code}:\n{process.log[-3000:]}")
            return httpx.get(f"{replica.base}/healthz").status_code == 200

        try:
            wait_until(serving, 15, "the replica")
            return replica
        except AssertionError:
            if attempt + 1 == BIND_ATTEMPTS or not lost_a_port(process):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


@pytest.fixture(scope="module")
def backends() -> Iterator[list[MockBackendProcess]]:
    started = [launch_mock_backend("--model", "model-a,model-b") for _ in range(2)]
    yield started
    for backend in started:
        backend.stop()


@pytest.fixture(scope="module")
def replica(
    tmp_path_factory: pytest.TempPathFactory, backends: list[MockBackendProcess]
) -> Iterator[ProxyReplica]:
    handle = start_proxy_replica(tmp_path_factory.mktemp("proxy"), "--accept-openai-requests")
    handle.register("backend-0", backends[0].url, ["model-a", "model-b"], cluster_id="c0")
    handle.register("backend-1", backends[1].url, ["model-a"], cluster_id="c1")
    handle.register("idle-backend", backends[0].url, {"registered-idle": INACTIVE})
    yield handle
    handle.close()


@pytest.fixture(autouse=True)
def reset_backends(backends: list[MockBackendProcess]) -> None:
    for backend in backends:
        backend.control(reset=True)


def _post(
    replica: ProxyReplica, headers: dict[str, str], body: object = CHAT, **kw: object
) -> httpx.Response:
    return httpx.post(
        f"{replica.base}/v1/chat/completions",
        headers=headers,
        json=body,
        timeout=10,
        **kw,  # type: ignore[arg-type]
    )


# ---- the error contract (docs/data-plane.md, Local answers) ------------------------------------


@pytest.mark.parametrize("missing", ["x-request-id", "x-input-tokens", "x-model"])
def test_missing_required_header_is_a_bare_400(replica: ProxyReplica, missing: str) -> None:
    headers = {k: v for k, v in HEADERS.items() if k != missing}
    if missing == "x-model":
        response = httpx.post(
            f"{replica.base}/v1/embeddings", headers=headers, content=b"not json", timeout=5
        )
        assert response.status_code == 400  # OpenAI mode: a JSON error explains it
        assert "model" in response.json()["error"]["message"]
        return
    response = _post(replica, headers)
    assert (response.status_code, response.content) == (400, b"")
    assert "x-stargate-error-code" not in response.headers


def test_unknown_model_is_404_no_eligible_candidates(replica: ProxyReplica) -> None:
    response = _post(replica, {**HEADERS, "x-model": "nobody-serves-this"})
    assert response.status_code == 404
    assert response.content == b'{"error":"no eligible candidates","code":"no_eligible_candidates"}'
    assert response.headers["x-stargate-error-code"] == "no_eligible_candidates"
    assert response.headers["content-type"] == "application/json"
    assert "x-inference-server-id" not in response.headers


def test_wrong_routing_key_is_404(replica: ProxyReplica) -> None:
    response = _post(replica, {**HEADERS, "x-routing-key": "other-tenant"})
    assert response.status_code == 404


def test_registered_but_inactive_model_is_a_bare_503(replica: ProxyReplica) -> None:
    response = _post(replica, {**HEADERS, "x-model": "registered-idle"})
    assert (response.status_code, response.content) == (503, b"")
    assert "x-stargate-error-code" not in response.headers


def test_bad_headers_are_400_even_for_unknown_models(replica: ProxyReplica) -> None:
    for extra in (
        {"x-priority": "high"},
        {"x-routing-method": "teleport"},
        {"x-input-tokens": "1_0"},
    ):
        response = _post(replica, {**HEADERS, "x-model": "unknown", **extra})
        assert response.status_code == 400, extra


def test_oversized_content_length_is_413_before_the_body_is_sent(replica: ProxyReplica) -> None:
    import socket

    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: r\r\n"
        "x-input-tokens: 1\r\nx-model: model-a\r\n"
        f"content-length: {64 * 1024 * 1024 + 1}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", replica.ports.http), timeout=5) as sock:
        sock.sendall(head.encode())
        assert sock.recv(64).startswith(b"HTTP/1.1 413")


def test_unknown_paths_and_wrong_methods(replica: ProxyReplica) -> None:
    assert httpx.get(f"{replica.base}/v1/chat/completions").status_code == 405
    assert httpx.get(f"{replica.base}/v1/chat/completions").headers["allow"] == "POST"
    assert httpx.post(f"{replica.base}/v1/unknown", headers=HEADERS).status_code == 404


# ---- forwarding ---------------------------------------------------------------------------------


def test_non_streaming_chat_carries_the_routing_headers(replica: ProxyReplica) -> None:
    response = _post(replica, {**HEADERS, "x-model": "model-b", "x-mock-echo-headers": "1"})
    assert response.status_code == 200
    assert response.headers["x-inference-server-id"] == "backend-0"
    assert response.headers["x-stargate-cluster-id"] == "c0"
    assert response.headers["x-inference-server-url"].startswith("http://127.0.0.1:")
    body = response.json()
    assert body["object"] == "chat.completion"
    echoed = {k.lower(): v for k, v in body["mock_request_headers"].items()}
    assert echoed["x-request-id"] == "req-1" and echoed["x-input-tokens"] == "10"
    assert "x-routing-method" not in echoed


def test_both_clusters_serve_a_shared_model(replica: ProxyReplica) -> None:
    served = {
        _post(replica, {**HEADERS, "x-routing-method": "round_robin"}).headers[
            "x-inference-server-id"
        ]
        for _ in range(6)
    }
    assert served == {"backend-0", "backend-1"}


def test_streaming_chat_ends_with_done(replica: ProxyReplica) -> None:
    body = {**CHAT, "stream": True}
    with httpx.stream(
        "POST", f"{replica.base}/v1/chat/completions", headers=HEADERS, json=body, timeout=10
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[1][6:])["object"] == "chat.completion.chunk"


async def test_twenty_concurrent_streams_all_end_with_done(replica: ProxyReplica) -> None:
    done: list[bool] = []

    async def one(client: httpx.AsyncClient, index: int) -> None:
        headers = {**HEADERS, "x-request-id": f"c-{index}"}
        async with client.stream(
            "POST", "/v1/chat/completions", headers=headers, json={**CHAT, "stream": True}
        ) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
        done.append(lines[-1] == "data: [DONE]")

    async with (
        httpx.AsyncClient(base_url=replica.base, timeout=20) as client,
        trio.open_nursery() as nursery,
    ):
        for index in range(20):
            nursery.start_soon(one, client, index)
    assert done == [True] * 20


def test_chunks_are_forwarded_one_by_one(
    replica: ProxyReplica, backends: list[MockBackendProcess]
) -> None:
    for backend in backends:
        backend.control(inter_token_ms=300, tokens=3)
    arrivals: list[float] = []
    with httpx.stream(
        "POST",
        f"{replica.base}/v1/chat/completions",
        headers=HEADERS,
        json={**CHAT, "stream": True},
        timeout=10,
    ) as response:
        started = time.monotonic()
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic() - started)
    # Events: role, token 1 (at once), token 2 (+300 ms), token 3 (+600 ms), stop, [DONE].
    # Buffering would deliver them together at the end.
    assert len(arrivals) == 6, arrivals
    assert arrivals[1] < 0.2, arrivals
    assert arrivals[2] - arrivals[1] > 0.15 and arrivals[3] - arrivals[2] > 0.15, arrivals


def test_retryable_503_moves_to_another_cluster(
    replica: ProxyReplica, backends: list[MockBackendProcess]
) -> None:
    backends[0].control(
        fail_next={"count": 1, "status": 503, "headers": {"x-stargate-retryable": "true"}}
    )
    for _ in range(20):  # until a request has hit backend-0 first and used up its failure
        response = _post(replica, HEADERS)
        assert response.status_code == 200
        counters = httpx.get(f"{backends[0].url}/test-control").json()["counters"]
        if counters["injected_failures"]:
            break
    assert response.headers["x-inference-server-id"] == "backend-1"
    assert 'reason="retryable_upstream_response"' in replica.metrics()


def test_retryable_503_from_the_only_cluster_is_a_bare_503(
    replica: ProxyReplica, backends: list[MockBackendProcess]
) -> None:
    backends[0].control(
        fail_next={"count": 1, "status": 503, "headers": {"x-stargate-retryable": "true"}}
    )
    response = _post(replica, {**HEADERS, "x-model": "model-b"})  # only backend-0 serves it
    assert (response.status_code, response.content) == (503, b"")
    assert 'reason="no_eligible_backend"' in replica.metrics()


def test_non_retryable_503_passes_through(
    replica: ProxyReplica, backends: list[MockBackendProcess]
) -> None:
    for backend in backends:
        backend.control(fail_next={"count": 1, "status": 503, "body": "engine busy"})
    response = _post(replica, HEADERS)
    assert (response.status_code, response.text) == (503, "engine busy")
    assert response.headers["x-inference-server-id"] in {"backend-0", "backend-1"}


def test_mid_stream_reset_truncates_the_client_stream(
    replica: ProxyReplica, backends: list[MockBackendProcess]
) -> None:
    for backend in backends:
        backend.control(drop_mid_stream={"count": 1, "after_chunks": 2})
    lines: list[str] = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream(
            "POST",
            f"{replica.base}/v1/chat/completions",
            headers=HEADERS,
            json={**CHAT, "stream": True},
            timeout=10,
        ) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            lines.append(line)
    assert "data: [DONE]" not in lines
    # The replica is fine afterwards.
    assert _post(replica, HEADERS).status_code == 200
    # Logged as one WARNING line with its fields, and no traceback (stargate/logs.py).
    (warning,) = [
        line
        for line in replica.process.log.splitlines()
        if "upstream body failed mid-stream" in line
    ]
    assert " WARNING stargate.proxy.app: " in warning
    for field in ("request_id=req-1 ", "backend=backend-", "bytes=", "url=http://127.0.0.1:"):
        assert field in warning
    assert "Error in ASGI Framework" not in replica.process.log


def test_openai_client_streams_and_not(replica: ProxyReplica) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{replica.base}/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.create(
        model="model-a", messages=[{"role": "user", "content": "hello"}]
    )
    assert completion.choices[0].message.content
    stream = client.chat.completions.create(
        model="model-a", messages=[{"role": "user", "content": "hello"}], stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text
    client.close()


def test_generated_request_id_is_returned(replica: ProxyReplica) -> None:
    response = httpx.post(f"{replica.base}/v1/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 200
    assert len(response.headers["x-request-id"]) == 36


def test_requests_are_counted_by_status(replica: ProxyReplica) -> None:
    _post(replica, HEADERS)
    metrics = replica.metrics()
    assert 'stargate_requests_total{inference_server_id="backend-' in metrics
    assert 'status="200"' in metrics


# ---- replicas of their own ----------------------------------------------------------------------


class _Relay:
    """A TCP relay to a backend that can stop accepting new connections while the ones it has
    keep working: the replica's health probes reuse their kept-alive connection and keep
    passing, so the backend stays routable, while a proxied request, which needs a connection
    of its own, is refused. (Stopping the backend instead races its next health probe: a probe
    that fails first unroutes it before any request could be refused.)"""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def refuse_new_connections(self) -> None:
        # shutdown() stops listening at once, so a connect gets ECONNREFUSED (a close() alone
        # would wait for the accepting thread's blocked accept() to return).
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def test_refused_connection_fails_over_to_another_backend(tmp_path: Path) -> None:
    alive = launch_mock_backend("--model", "model-a")
    doomed = launch_mock_backend("--model", "model-a")
    relay = _Relay(int(doomed.url.rsplit(":", 1)[1]))
    replica = start_proxy_replica(tmp_path, "--lb-config-path", str(_round_robin(tmp_path)))
    try:
        replica.register("alive", alive.url, ["model-a"])
        replica.register("doomed", relay.url, ["model-a"])
        relay.refuse_new_connections()  # registered and routable, but refusing connections
        statuses = {_post(replica, HEADERS).status_code for _ in range(4)}
        assert statuses == {200}
        assert 'reason="connect_failover"' in replica.metrics()
    finally:
        replica.close()
        alive.stop()
        doomed.stop()


def test_slow_response_head_is_502(tmp_path: Path) -> None:
    backend = launch_mock_backend("--model", "model-a")
    replica = start_proxy_replica(
        tmp_path, "--proxy-response-header-timeout-ms=300", "--proxy-max-connect-retries=0"
    )
    try:
        replica.register("slow", backend.url, ["model-a"])
        backend.control(response_delay_ms=2000)
        started = time.monotonic()
        response = _post(replica, HEADERS)
        assert (response.status_code, response.content) == (502, b"")
        assert time.monotonic() - started < 1.5
    finally:
        replica.close()
        backend.stop()


def test_bad_lb_config_fails_start_up_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "lb.json"
    config.write_text(json.dumps({"models": {"m": {"algorithm": "power-of-n", "sample_count": 0}}}))
    process = launch(
        tmp_path / "lb.log", "serve", *Ports.pick().args(), f"--lb-config-path={config}"
    )
    assert process.process.wait(timeout=15) == 1
    assert "models.m.sample_count" in process.log


def _round_robin(tmp_path: Path) -> Path:
    path = tmp_path / "round-robin.json"
    path.write_text(json.dumps({"default": "round-robin"}))
    return path


def test_client_disconnect_cancels_the_upstream_request(
    replica: ProxyReplica, backends: list[MockBackendProcess]
) -> None:
    for backend in backends:
        backend.control(inter_token_ms=200, tokens=50)  # a 10 s stream
    with httpx.stream(
        "POST",
        f"{replica.base}/v1/chat/completions",
        headers=HEADERS,
        json={**CHAT, "stream": True},
        timeout=10,
    ) as response:
        served_by = response.headers["x-inference-server-id"]
        next(response.iter_lines())  # the stream is running; now the client goes away
    backend = backends[int(served_by.rsplit("-", 1)[1])]

    def upstream_cancelled() -> bool:
        state = httpx.get(f"{backend.url}/test-control", timeout=5).json()
        return state["in_flight"] == 0 and state["counters"]["client_disconnects"] >= 1

    wait_until(upstream_cancelled, 5, "the backend to see the upstream request cancelled")


def test_zero_retry_budget_passes_a_retryable_response_through(
    replica: ProxyReplica, backends: list[MockBackendProcess]
) -> None:
    backends[0].control(
        fail_next={"count": 1, "status": 429, "headers": {"x-stargate-retryable": "true"}}
    )
    response = _post(replica, {**HEADERS, "x-model": "model-b", "x-stargate-max-wait-ms": "0"})
    assert response.status_code == 429
    assert "x-stargate-retryable" not in response.headers  # Stargate-internal, stripped
    assert 'reason="retry_budget_exhausted"' in replica.metrics()
    assert 'stargate_proxy_responses_total{endpoint="chat_completions",status_class="4xx"}' in (
        replica.metrics()
    )


def test_input_work_admission_and_power_of_n_preference(tmp_path: Path) -> None:
    config = tmp_path / "lb.json"
    config.write_text(
        json.dumps(
            {
                "default": "power-of-n",
                "models": {"guarded": {"algorithm": "power-of-n", "max_input_work_seconds": 0.5}},
            }
        )
    )
    idle = launch_mock_backend("--model", "model-a,guarded")
    busy = launch_mock_backend("--model", "model-a")
    replica = start_proxy_replica(tmp_path, f"--lb-config-path={config}")
    try:
        replica.register("idle", idle.url, ["model-a"], last_mean_input_tps=100.0)
        replica.register(
            "busy", busy.url, ["model-a"], last_mean_input_tps=100.0, queued_input_size=5000
        )
        served = {_post(replica, HEADERS).headers["x-inference-server-id"] for _ in range(20)}
        assert served == {"idle"}  # power-of-n compares both: the empty queue always wins
        replica.register(
            "overloaded", idle.url, ["guarded"], last_mean_input_tps=100.0, queued_input_size=1000
        )
        response = _post(replica, {**HEADERS, "x-model": "guarded"})
        assert response.status_code == 503
        assert response.content == (
            b'{"error":"input work admission limit exceeded","code":"input_work_limit_exceeded"}'
        )
        assert response.headers["x-stargate-error-code"] == "input_work_limit_exceeded"
        assert 'reason="input_work_limit_exceeded"' in replica.metrics()
        assert _post(replica, {**HEADERS, "x-model": "unknown"}).status_code == 404
    finally:
        replica.close()
        idle.stop()
        busy.stop()


async def test_reservations_spread_concurrent_streams_with_power_of_n(
    tmp_path: Path, backends: list[MockBackendProcess]
) -> None:
    # Two equal clusters that never heartbeat again: without reservations power-of-n would see
    # identical stats for every request; with them, each attempt makes its cluster look busier
    # (+10 queued tokens = +100 ms at 100 TPS) until the backend's next heartbeat, which here never
    # comes, so the choice alternates.
    replica = start_proxy_replica(tmp_path)
    try:
        replica.register("even-0", backends[0].url, ["model-a"], last_mean_input_tps=100.0)
        replica.register("even-1", backends[1].url, ["model-a"], last_mean_input_tps=100.0)
        for backend in backends:
            backend.control(inter_token_ms=300, tokens=4)  # ~1 s per stream
        served: list[str] = []

        async def one(client: httpx.AsyncClient, index: int) -> None:
            headers = {**HEADERS, "x-request-id": f"r-{index}", "x-routing-method": "power-of-n"}
            async with client.stream(
                "POST", "/v1/chat/completions", headers=headers, json={**CHAT, "stream": True}
            ) as response:
                assert response.status_code == 200
                served.append(response.headers["x-inference-server-id"])
                lines = [line async for line in response.aiter_lines() if line]
            assert lines[-1] == "data: [DONE]"

        async with (
            httpx.AsyncClient(base_url=replica.base, timeout=20) as client,
            trio.open_nursery() as nursery,
        ):
            for index in range(6):
                nursery.start_soon(one, client, index)
        assert sorted(set(served)) == ["even-0", "even-1"], served
        assert min(served.count("even-0"), served.count("even-1")) >= 2, served
    finally:
        replica.close()
