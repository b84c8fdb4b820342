"""Held streaming requests end to end (docs/clients.md, "Held streaming requests"): a replica with
`--pool-config` whose `process` controller starts `stargate mock-backend` engines only after a
delay (a cold start), and real clients: the `openai` SDK with a 10 s read timeout, directly and
through nginx with its default proxy settings, and httpx for the raw stream.

Without loading comments, a 20 s cold start is cut by the SDK's 10 s read timeout; with them,
the head and a first comment arrive at once and a comment every 5 s keeps the read alive.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.e2e.nginx import nginx_in_front
from tests.e2e.processes import (
    Ports,
    StargateProcess,
    launch,
    launch_mock_backend,
    stop,
    wait_until,
)
from tests.e2e.test_proxy import start_proxy_replica

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
COLD_START = 20  # seconds: the goal's cold swap


def _engine(model: str, delay: float) -> dict[str, object]:
    """A member whose engine answers its health path `delay` seconds after it was started."""
    engine = f"{sys.executable} -m stargate mock-backend --port {{port}} --model {model}"
    return {
        "command": ["sh", "-c", f"sleep {delay}; exec {engine} --log-level warning"],
        "healthPath": "/health",
    }


def _never_healthy() -> dict[str, object]:
    """A member whose engine starts and never answers its health path: its swap fails at the
    swap budget."""
    return {
        "command": [sys.executable, "-c", "import time; time.sleep(60)", "{port}"],
        "healthPath": "/health",
    }


def _pool(name: str, members: dict[str, dict[str, object]], swap_budget: str) -> dict[str, Any]:
    return {
        "name": name,
        "members": list(members),
        "swapBudget": swap_budget,
        "holdBudget": "60s",
        "controller": {"kind": "process", "members": members},
    }


@dataclass
class Served:
    replica: StargateProcess
    ports: Ports

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"


def _serve(tmp_path: Path, pools: list[dict[str, Any]]) -> Served:
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump({"pools": pools}))
    ports = Ports.pick()
    replica = launch(
        tmp_path / "replica.log",
        "serve",
        *ports.args(),
        "--readiness-warmup-ms=0",
        "--disable-dns-discovery",
        "--accept-openai-requests",
        f"--pool-config={path}",
    )
    served = Served(replica, ports)
    wait_until(lambda: httpx.get(f"{served.base}/healthz").status_code == 200, 15, "the replica")
    return served


def _sdk(base: str) -> openai.OpenAI:
    """The client of the goal: a 10 s read timeout (10 s for every phase: a float is the SDK's
    own spelling of `httpx.Timeout(10, read=10)`), no retries."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=10.0)


# --- the SDK's stream, timed ----------------------------------------------------------------------


@dataclass
class Streamed:
    """When (seconds after the request) the response head arrived (the SDK returns its stream
    then), the first token, and the end; the text; or the error raised."""

    head: float | None = None
    first_token: float | None = None
    total: float | None = None
    text: str = ""
    error: BaseException | None = None
    finish_reasons: list[str] = field(default_factory=list)


def _stream(client: openai.OpenAI, model: str, started: float, into: Streamed) -> None:
    try:
        stream = client.chat.completions.create(model=model, messages=MESSAGES, stream=True)
        into.head = time.monotonic() - started
        for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if choice.delta.content:
                if into.first_token is None:
                    into.first_token = time.monotonic() - started
                into.text += choice.delta.content
            if choice.finish_reason:
                into.finish_reasons.append(choice.finish_reason)
        into.total = time.monotonic() - started
    except BaseException as error:  # reported by the test thread
        into.error = error


def test_a_20_s_cold_swap_streams_to_the_sdk_directly_and_behind_nginx(tmp_path: Path) -> None:
    """Both requests wait for the same 20 s cold start (one swap), one straight to the replica,
    one through nginx; both clients have a 10 s read timeout."""
    pools = [_pool("gpu0", {"cold": _engine("cold", COLD_START)}, "60s")]
    served = _serve(tmp_path, pools)
    try:
        with nginx_in_front(tmp_path / "nginx", served.ports.http) as nginx:
            direct, proxied = Streamed(), Streamed()
            started = time.monotonic()
            threads = [
                threading.Thread(target=_stream, args=(_sdk(served.base), "cold", started, direct)),
                threading.Thread(
                    target=_stream,
                    args=(_sdk(f"http://127.0.0.1:{nginx}"), "cold", started, proxied),
                ),
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=COLD_START + 30)
            for name, result in (("direct", direct), ("nginx", proxied)):
                print(
                    f"\n{name}: head {result.head:.3f} s, first token {result.first_token:.3f} s, "
                    f"total {result.total:.3f} s"
                    if result.error is None
                    else f"\n{name}: {result.error!r}"
                )
            for result in (direct, proxied):
                assert result.error is None, repr(result.error)
                assert result.head is not None and result.total is not None
                assert result.head < 1.0  # the loading head: half a second in, not at the end
                assert result.total >= COLD_START - 1  # the engine really was cold
                assert result.text.startswith("Hello")  # the engine's tokens, unchanged
                assert result.finish_reasons == ["stop"]
    finally:
        stop(served.replica)


def test_a_swap_that_fails_after_the_head_ends_with_an_error_event(tmp_path: Path) -> None:
    """The swap budget (3 s) expires after the loading head went out: the stream ends with the
    OpenAI error event and `[DONE]`; the SDK raises it as an APIError with its message."""
    pools = [_pool("bad", {"broken": _never_healthy()}, "3s")]
    served = _serve(tmp_path, pools)
    try:
        started = time.monotonic()
        lines: list[tuple[float, str]] = []
        body = {"model": "broken", "messages": MESSAGES, "stream": True}
        url = f"{served.base}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=10) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            assert response.headers["x-accel-buffering"] == "no"
            for line in response.iter_lines():
                if line:
                    lines.append((time.monotonic() - started, line))
        first_at, first = lines[0]
        assert first == ": loading model broken eta unknown" and first_at < 1.0
        *_, (_, error_line), (_, done) = lines
        assert done == "data: [DONE]"
        error = json.loads(error_line.removeprefix("data: "))["error"]
        assert error["code"] == "pool_swap_failed"
        assert error["type"] == "server_error"
        assert lines[-1][0] >= 2.5  # at the swap budget, not before

        # The SDK: the same failure, raised with its message.
        with pytest.raises(openai.APIError) as caught:
            stream = _sdk(served.base).chat.completions.create(
                model="broken", messages=MESSAGES, stream=True
            )
            for _ in stream:
                pass
        # The message of the event (each swap states its own elapsed time).
        message = caught.value.message
        assert message.startswith("model pool swap to member broken abandoned")
        assert error["message"].startswith("model pool swap to member broken abandoned")
    finally:
        stop(served.replica)


def test_a_non_streaming_request_during_a_swap_gets_plain_json(tmp_path: Path) -> None:
    """No comment for a request without `"stream": true`: the engine's own head and JSON body,
    after the swap, with the swap in `Server-Timing`."""
    pools = [_pool("gpu0", {"warm": _engine("warm", 3)}, "30s")]
    served = _serve(tmp_path, pools)
    try:
        response = httpx.post(
            f"{served.base}/v1/chat/completions",
            json={"model": "warm", "messages": MESSAGES},
            timeout=30,
        )
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/json")
        assert response.json()["model"] == "warm"
        assert response.headers["x-inference-server-id"] == "process:gpu0:warm"
        timing = dict(
            item.strip().split(";dur=") for item in response.headers["server-timing"].split(",")
        )
        assert set(timing) == {"hold", "swap", "upstream"}
        assert float(timing["swap"]) >= 2500 and float(timing["hold"]) >= float(timing["swap"])
        # Resident now: a streaming request is not held, and gets the engine's own head.
        with httpx.stream(
            "POST",
            f"{served.base}/v1/chat/completions",
            json={"model": "warm", "messages": MESSAGES, "stream": True},
            timeout=10,
        ) as streamed:
            assert streamed.headers["x-inference-server-id"] == "process:gpu0:warm"
            text = streamed.read().decode()
        assert not text.startswith(":") and text.rstrip().endswith("data: [DONE]")
    finally:
        stop(served.replica)


def test_a_routing_wait_streams_loading_comments_and_its_503s_carry_retry_after(
    tmp_path: Path,
) -> None:
    """No pool: wait-and-widen keeps a request off the slow cluster while the fast one is full,
    until it has waited a quarter of the slow cluster's extra prefill time (docs/data-plane.md,
    Wait-and-widen): about 250 ms for 10 input tokens at 10 tokens/s, 1.5 s for 60. A streaming
    request held by that routing wait past the half-second grace gets the loading head, then the
    engine's stream; one held for 250 ms keeps the engine's own head. The waits become the
    `Retry-After` of the model's routing 503s."""
    engines = [launch_mock_backend("--model", "model-a") for _ in range(2)]
    config = tmp_path / "lb.json"
    config.write_text(json.dumps({"default": "wait-and-widen"}))
    replica = start_proxy_replica(tmp_path, "--lb-config-path", str(config))
    try:
        full = {"num_running_queries": 8, "max_engine_concurrency": 8}
        replica.register(
            "fast", engines[0].url, ["model-a"], cluster_id="fast", last_mean_input_tps=1e3, **full
        )
        replica.register(
            "slow", engines[1].url, ["model-a"], cluster_id="slow", last_mean_input_tps=10.0
        )
        url = f"{replica.base}/v1/chat/completions"
        headers = {"x-request-id": "r", "x-input-tokens": "10", "x-model": "model-a"}
        chat = {"model": "model-a", "messages": MESSAGES}
        # Nothing measured yet: the bare 503 of a request that cannot wait, as before.
        refused = httpx.post(url, headers=headers, json=chat, timeout=10)
        assert refused.status_code == 503 and "retry-after" not in refused.headers

        # A wait of about 250 ms, within the grace: the engine's own head and stream.
        waiting = {**headers, "x-max-wait-ms": "4000"}
        stream = {**chat, "stream": True}
        with httpx.stream("POST", url, headers=waiting, json=stream, timeout=10) as response:
            assert response.status_code == 200
            assert response.headers["x-inference-server-id"] == "slow"
            assert 200 <= _hold_ms(response.headers["server-timing"]) < 500
            lines = [line for line in response.iter_lines() if line]
        assert not any(line.startswith(":") for line in lines) and lines[-1] == "data: [DONE]"

        # A wait of about 1.5 s: the loading head and comment half a second in, then the engine.
        longer = {**waiting, "x-input-tokens": "60"}
        started = time.monotonic()
        with httpx.stream("POST", url, headers=longer, json=stream, timeout=10) as response:
            head_after = time.monotonic() - started
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            assert "x-inference-server-id" not in response.headers  # the engine's head is lost
            lines = [line for line in response.iter_lines() if line]
        assert 0.4 < head_after < 1.4, head_after
        assert re.fullmatch(r": loading model model-a eta [1-4]s", lines[0]), lines[0]
        timing = next(line for line in lines if line.startswith(": server-timing "))
        assert 1000 <= _hold_ms(timing) < 4000
        assert ": x-inference-server-id slow" in lines
        assert lines[-1] == "data: [DONE]"
        assert any(line.startswith('data: {"id"') for line in lines)  # the engine's events

        # A non-streaming request held the same way gets the engine's own head and JSON.
        plain = httpx.post(url, headers=waiting, json=chat, timeout=10)
        assert plain.status_code == 200 and plain.headers["x-inference-server-id"] == "slow"
        assert _hold_ms(plain.headers["server-timing"]) >= 200

        # Waits of about 0.25, 1.5 and 0.25 s measured: their average, rounded up, lies between
        # the shortest and the longest wait's (stargate/proxy/routing_wait.py), so 1 or 2 s.
        refused = httpx.post(url, headers=headers, json=chat, timeout=10)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] in ("1", "2")
    finally:
        replica.close()
        for engine in engines:
            engine.stop()


def _hold_ms(timing: str) -> float:
    """The `hold` of a `Server-Timing` value (or of its comment line), in milliseconds."""
    return float(timing.split("hold;dur=")[1].split(",")[0])
