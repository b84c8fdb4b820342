"""What real clients see (docs/clients.md): OpenAI-shaped answers for OpenAI-form requests, exact
Rust answers for header-form requests in the same replica, bounded metric labels, header hygiene
and request targets. A real replica and mock backend on loopback; the `openai` SDK and raw HTTP."""

from __future__ import annotations

import json
import re
import socket
import threading
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.processes import MockBackendProcess, launch_mock_backend
from tests.e2e.test_proxy import ProxyReplica, start_proxy_replica
from tests.fakes.pylon import INACTIVE

RUST = {"x-request-id": "req-1", "x-input-tokens": "10"}
CHAT = {"model": "model-a", "messages": [{"role": "user", "content": "hi"}]}
REPLAY_LIMIT = 4096


@pytest.fixture(scope="module")
def backend() -> Iterator[MockBackendProcess]:
    started = launch_mock_backend("--model", "model-a")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def replica(
    tmp_path_factory: pytest.TempPathFactory, backend: MockBackendProcess
) -> Iterator[ProxyReplica]:
    handle = start_proxy_replica(
        tmp_path_factory.mktemp("clients"),
        "--accept-openai-requests",
        f"--proxy-max-replay-body-bytes={REPLAY_LIMIT}",
    )
    handle.register("backend-0", backend.url, ["model-a", "org/model-b"])
    handle.register("idle-backend", backend.url, {"registered-idle": INACTIVE})
    yield handle
    handle.close()


@pytest.fixture
def sdk(replica: ProxyReplica) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{replica.base}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


@pytest.fixture(autouse=True)
def reset_backend(backend: MockBackendProcess) -> None:
    backend.control(reset=True)


# ---- OpenAI mode: models ------------------------------------------------------------------------


def test_sdk_lists_and_retrieves_models(sdk: openai.OpenAI) -> None:
    models = sdk.models.list()
    assert [model.id for model in models.data] == ["model-a", "org/model-b"]
    assert all(model.owned_by == "stargate" and model.created > 0 for model in models.data)
    retrieved = sdk.models.retrieve("org/model-b")  # the SDK sends the slash as %2F
    assert (retrieved.id, retrieved.object) == ("org/model-b", "model")


def test_sdk_retrieve_of_an_unknown_model_is_an_openai_404(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.models.retrieve("no-such-model")
    assert "no-such-model" in caught.value.message
    assert caught.value.code == "model_not_found"


def test_models_listing_is_a_superset_for_contract_clients(replica: ProxyReplica) -> None:
    body = httpx.get(f"{replica.base}/v1/models", timeout=5).json()
    assert body["model_ids"] == ["model-a", "org/model-b"]
    assert body["object"] == "list"
    assert [entry["id"] for entry in body["data"]] == body["model_ids"]


# ---- OpenAI mode: errors ------------------------------------------------------------------------


def test_sdk_404_names_the_model(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.chat.completions.create(model="no-such-model", messages=[])
    error = caught.value
    assert error.status_code == 404
    assert "no-such-model" in error.message
    assert error.code == "no_eligible_candidates"
    assert error.response.headers["x-stargate-error-code"] == "no_eligible_candidates"
    assert error.response.headers["content-type"] == "application/json"


def test_sdk_503_says_the_model_has_no_active_backend(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as caught:
        sdk.chat.completions.create(model="registered-idle", messages=[])
    assert caught.value.status_code == 503
    assert "registered-idle" in caught.value.message
    assert "no active backend" in caught.value.message
    assert caught.value.response.headers["x-stargate-error-code"] == "no_active_backend"


def test_sdk_400_names_the_bad_header(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(
            model="model-a", messages=[], extra_headers={"x-priority": "high"}
        )
    assert "x-priority" in caught.value.message
    assert caught.value.code == "invalid_header"


def test_sdk_413_states_the_limit(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        sdk.chat.completions.create(
            model="model-a", messages=[{"role": "user", "content": "x" * REPLAY_LIMIT}]
        )
    assert caught.value.status_code == 413
    assert str(REPLAY_LIMIT) in caught.value.message
    assert caught.value.code == "request_too_large"


def test_sdk_chat_still_works(sdk: openai.OpenAI) -> None:
    completion = sdk.chat.completions.create(
        model="model-a", messages=[{"role": "user", "content": "hi"}]
    )
    assert completion.choices[0].message.content


# ---- the Rust header form stays exact in the same replica ---------------------------------------


def test_rust_form_404_is_the_exact_rust_body(replica: ProxyReplica) -> None:
    response = httpx.post(
        f"{replica.base}/v1/chat/completions",
        headers={**RUST, "x-model": "no-such-model"},
        json=CHAT,
        timeout=5,
    )
    assert response.status_code == 404
    assert response.content == b'{"error":"no eligible candidates","code":"no_eligible_candidates"}'
    assert response.headers["x-stargate-error-code"] == "no_eligible_candidates"


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({**RUST, "x-model": "registered-idle"}, 503),
        ({**RUST, "x-model": "model-a", "x-priority": "high"}, 400),
        ({"x-request-id": "r", "x-model": "model-a"}, 400),
    ],
)
def test_rust_form_errors_are_bare(
    replica: ProxyReplica, headers: dict[str, str], status: int
) -> None:
    response = httpx.post(
        f"{replica.base}/v1/chat/completions", headers=headers, json=CHAT, timeout=5
    )
    assert response.status_code == status
    assert response.content == b""
    assert "x-stargate-error-code" not in response.headers


# ---- bounded metrics ----------------------------------------------------------------------------


def _series(metrics: str) -> int:
    return sum(1 for line in metrics.splitlines() if line and not line.startswith("#"))


def test_random_model_names_do_not_grow_the_metrics(replica: ProxyReplica) -> None:
    with httpx.Client(base_url=replica.base, timeout=5) as client:
        # One of each label pair first: the fixed pair's series exist, later ones add nothing.
        client.post(
            "/v1/chat/completions",
            headers={**RUST, "x-model": "warm", "x-routing-key": "k"},
            json=CHAT,
        )
        before = _series(replica.metrics())
        for _ in range(1000):
            model = f"random-{uuid.uuid4().hex}"
            response = client.post(
                "/v1/chat/completions",
                headers={**RUST, "x-model": model, "x-routing-key": uuid.uuid4().hex},
                json=CHAT,
            )
            assert response.status_code == 404
    metrics = replica.metrics()
    assert "random-" not in metrics
    assert _series(metrics) == before
    counted = re.search(
        r'stargate_requests_total\{inference_server_id="",model="__unregistered__",'
        r'routing_key="__unregistered__",status="404"\} (\d+)',
        metrics,
    )
    assert counted is not None and float(counted.group(1)) >= 1000


def test_registered_models_keep_their_label(replica: ProxyReplica) -> None:
    httpx.post(
        f"{replica.base}/v1/chat/completions",
        headers={**RUST, "x-model": "registered-idle"},
        json=CHAT,
        timeout=5,
    )
    assert 'model="registered-idle",routing_key="",status="503"' in replica.metrics()


# ---- header hygiene -----------------------------------------------------------------------------


def _echoed(replica: ProxyReplica, headers: list[tuple[str, str]]) -> dict[str, str]:
    response = httpx.post(
        f"{replica.base}/v1/embeddings",
        headers=[("x-mock-echo-headers", "1"), *headers],
        json={"model": "model-a", "input": "hi"},
        timeout=5,
    )
    assert response.status_code == 200, response.text
    received: dict[str, str] = response.json()["mock_request_headers"]
    return received


def test_only_the_routed_model_and_request_id_are_forwarded(replica: ProxyReplica) -> None:
    received = _echoed(
        replica,
        [
            ("x-request-id", "first"),
            ("x-request-id", "second"),
            ("x-input-tokens", "1"),
            ("x-model", "model-a"),
            ("x-model", "registered-idle"),
        ],
    )
    assert received["x-model"] == "model-a"
    assert received["x-request-id"] == "first"


def test_invalid_request_id_in_openai_form_is_replaced_not_forwarded(
    replica: ProxyReplica,
) -> None:
    response = httpx.post(
        f"{replica.base}/v1/embeddings",
        headers=[("x-mock-echo-headers", "1"), ("x-request-id", "bad\x7fid")],
        json={"model": "model-a", "input": "hi"},
        timeout=5,
    )
    received = response.json()["mock_request_headers"]
    assert received["x-request-id"] == response.headers["x-request-id"]
    assert "bad" not in received["x-request-id"]


def test_connection_named_headers_are_dropped_and_forwarding_added(replica: ProxyReplica) -> None:
    received = _echoed(
        replica,
        [
            *RUST.items(),
            ("x-model", "model-a"),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "secret"),
            ("http2-settings", "AAMAAABkAAQAAP__"),
            ("x-forwarded-for", "203.0.113.7"),
        ],
    )
    assert "x-hop" not in received
    assert "http2-settings" not in received
    assert received["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"
    assert received["x-forwarded-proto"] == "http"


def test_x_forwarded_proto_from_a_proxy_in_front_is_kept(replica: ProxyReplica) -> None:
    received = _echoed(
        replica, [*RUST.items(), ("x-model", "model-a"), ("x-forwarded-proto", "https")]
    )
    assert received["x-forwarded-proto"] == "https"
    assert received["x-forwarded-for"] == "127.0.0.1"


class RawBackend:
    """A backend written with raw sockets, for responses Hypercorn would not send (a
    `Connection` header naming another header); it answers every request with `answer`."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                received = b""
                while b"\r\n\r\n" not in received and (chunk := conn.recv(65536)):
                    received += chunk
                head, _, body = received.partition(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                while length and len(body) < int(length.group(1)) and (chunk := conn.recv(65536)):
                    body += chunk
                conn.sendall(self.answer)

    def close(self) -> None:
        self.listener.close()


def test_response_headers_named_in_connection_are_dropped(replica: ProxyReplica) -> None:
    backend = RawBackend(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
        b"connection: close, x-upstream-hop\r\nx-upstream-hop: 1\r\nx-kept: 1\r\n\r\n{}"
    )
    try:
        replica.register("raw-backend", backend.url, ["raw-model"])
        response = httpx.post(
            f"{replica.base}/v1/embeddings",
            headers={**RUST, "x-model": "raw-model"},
            json={"input": "hi"},
            timeout=5,
        )
    finally:
        backend.close()
    assert response.status_code == 200
    assert response.headers.get("x-kept") == "1"
    assert "x-upstream-hop" not in response.headers


# ---- request targets and framework answers ------------------------------------------------------


def _raw(replica: ProxyReplica, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", replica.ports.http), timeout=5) as sock:
        sock.sendall(request)
        received = b""
        while b"\r\n\r\n" not in received and (chunk := sock.recv(65536)):
            received += chunk
        return received


def test_absolute_form_target_is_served(replica: ProxyReplica) -> None:
    body = json.dumps({"model": "model-a", "input": "hi"}).encode()
    answer = _raw(
        replica,
        b"POST http://router.example/v1/embeddings HTTP/1.1\r\nhost: router.example\r\n"
        b"connection: close\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body,
    )
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_percent_encoded_proxy_path_is_refused(replica: ProxyReplica) -> None:
    response = httpx.post(
        f"{replica.base}/v1/chat%2Fcompletions", headers={**RUST, "x-model": "model-a"}, json=CHAT
    )
    assert response.status_code == 400


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/healthz", 200), ("GET", "/nope", 404), ("POST", "/readyz", 405)],
)
def test_probes_and_framework_errors_are_never_html(
    replica: ProxyReplica, method: str, path: str, status: int
) -> None:
    response = httpx.request(method, f"{replica.base}{path}", timeout=5)
    assert response.status_code == status
    assert response.content == b""
    assert response.headers["content-type"].startswith("text/plain")
    if status == 405:
        assert "GET" in response.headers["allow"]
