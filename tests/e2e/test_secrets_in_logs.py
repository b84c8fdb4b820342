"""No secret in a replica's log at any level, and `--log-format json` writes only JSON lines.

A real `stargate serve` at `--log-level debug` with `--registration-token-file`: one registration
with the valid token, several with wrong ones (one a prefix of the real token, one extending it),
and proxy requests carrying `authorization` over HTTP/1.1 and h2c. Once the replica has stopped,
none of those values may appear anywhere in its output, while the output does hold DEBUG lines
(so the debug level was really on). Which third-party loggers are clamped, and why: the docstring
of stargate/logs.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from tests.e2e.processes import Ports, StargateProcess, launch, stop, wait_until
from tests.fakes.pylon import FakeBackend, PylonStream, registration

TOKEN = "sg-reg-7f3a9c1d2e4b5a60c8d9"
WRONG_TOKENS = [
    TOKEN[:14],  # a prefix of the real token
    TOKEN + "x",  # the real token and one more character
    "wrong-guess-41b7e2",
    "Bearer-in-the-token-5d0c",
]
HTTP1_AUTHORIZATION = "Bearer client-secret-http1-93ac4e"
H2C_AUTHORIZATION = "Bearer client-secret-h2c-1fd27b"
PROXY_HEADERS = {"x-request-id": "secret-test", "x-input-tokens": "1", "x-model": "secret-model"}
CHAT = {"model": "secret-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def backend() -> Iterator[FakeBackend]:
    server = FakeBackend()
    yield server
    server.close()


def _start(log_path: Path, ports: Ports, *extra: str) -> StargateProcess:
    process = launch(
        log_path,
        "serve",
        "--stargate-id=secrets-replica",
        *ports.args(),
        "--readiness-warmup-ms=0",
        "--disable-dns-discovery",
        "--shutdown-delay-ms=0",
        *extra,
    )
    wait_until(
        lambda: httpx.get(f"http://127.0.0.1:{ports.http}/healthz", timeout=2).status_code == 200,
        15,
        "the replica",
    )
    return process


def _stop_gracefully(handle: StargateProcess) -> None:
    """SIGTERM and wait, so everything the replica logs on the way out is in the file."""
    handle.process.send_signal(signal.SIGTERM)
    try:
        handle.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        stop(handle)
        raise


def test_no_token_or_authorization_value_is_logged_at_debug(
    tmp_path: Path, backend: FakeBackend
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    ports = Ports.pick()
    replica = _start(
        tmp_path / "replica.log",
        ports,
        "--log-level=debug",
        f"--registration-token-file={token_file}",
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{ports.grpc}")
    try:
        for wrong in WRONG_TOKENS:
            stream = PylonStream(channel, token=wrong)
            stream.send(registration("secret-backend", backend.url, ["secret-model"]))
            error = stream.next_event()
            assert isinstance(error, grpc.RpcError)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        stream = PylonStream(channel, token=TOKEN)
        stream.exchange(registration("secret-backend", backend.url, ["secret-model"]))

        base = f"http://127.0.0.1:{ports.http}"
        with httpx.Client(base_url=base, timeout=10) as http1:
            response = http1.post(
                "/v1/chat/completions",
                headers={**PROXY_HEADERS, "authorization": HTTP1_AUTHORIZATION},
                json=CHAT,
            )
            assert response.http_version == "HTTP/1.1"
            assert response.headers["x-inference-server-id"] == "secret-backend"
        with httpx.Client(base_url=base, timeout=10, http1=False, http2=True) as h2c:
            response = h2c.post(
                "/v1/chat/completions",
                headers={**PROXY_HEADERS, "authorization": H2C_AUTHORIZATION},
                json=CHAT,
            )
            assert response.http_version == "HTTP/2"
            assert response.headers["x-inference-server-id"] == "secret-backend"
        stream.cancel()
    finally:
        channel.close()
        _stop_gracefully(replica)

    log = replica.log
    assert " DEBUG " in log, "debug output was expected (is --log-level debug honoured?)"
    for secret in [TOKEN, *WRONG_TOKENS, HTTP1_AUTHORIZATION, H2C_AUTHORIZATION]:
        assert secret not in log
    for bare in (HTTP1_AUTHORIZATION, H2C_AUTHORIZATION):
        assert bare.removeprefix("Bearer ") not in log


def test_json_log_format_writes_one_json_object_per_line(tmp_path: Path) -> None:
    ports = Ports.pick()
    replica = _start(tmp_path / "replica.log", ports, "--log-level=debug", "--log-format=json")
    try:
        response = httpx.post(
            f"http://127.0.0.1:{ports.http}/v1/chat/completions",
            headers=PROXY_HEADERS,
            json=CHAT,
            timeout=10,
        )
        assert response.status_code == 404  # no backend: a local answer, logged
    finally:
        _stop_gracefully(replica)
    lines = replica.log.splitlines()
    assert len(lines) >= 3
    records = [json.loads(line) for line in lines]  # every line, not just most
    assert all({"time", "level", "logger", "message"} <= record.keys() for record in records)
    assert any(r["message"].startswith("starting stargate version=") for r in records)
    assert any(r["level"] == "DEBUG" for r in records)
