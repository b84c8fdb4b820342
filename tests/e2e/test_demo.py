"""`stargate demo` end to end: it starts everything, turns ready, serves a streaming chat, prints
the stats its Pylons measure, and exits 0 on SIGINT (real processes, loopback, real clock)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from tests.e2e.processes import Ports, wait_until


@pytest.mark.parametrize(
    "tunnel",
    [
        pytest.param((), id="http"),
        # The most tunnel machinery in one run: the Pylons dial the replica, HTTP/3 inside.
        pytest.param(("--tunnel=http3", "--tunnel-connectivity=reverse"), id="http3-reverse"),
    ],
)
def test_demo_turns_ready_serves_a_stream_and_exits_0_on_sigint(tunnel: tuple[str, ...]) -> None:
    ports = Ports.pick()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stargate",
            "demo",
            f"--http-listen-addr=127.0.0.1:{ports.http}",
            f"--listen-addr=127.0.0.1:{ports.grpc}",
            f"--model-discovery-listen-addr=127.0.0.1:{ports.discovery}",
            f"--metrics-port={ports.metrics}",
            "--warmup-sample-interval-ms=200",
            "--warmup-stabilization-window=3",
            *tunnel,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    assert process.stdout is not None
    reader = threading.Thread(
        target=lambda: output.extend(iter(lambda: process.stdout.read(1), "")),  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()
    try:
        wait_until(lambda: "ready: promoted" in "".join(output), 60, "the demo to turn ready")
        text = "".join(output)
        assert "curl -N" in text and "warming up:" in text
        assert "ready: promoted (stabilized) with 2 active backends" in text
        assert ("tunnels      http3, reverse" in text) == bool(tunnel)
        body = {
            "model": "demo-model",
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        with httpx.stream(
            "POST", f"http://127.0.0.1:{ports.http}/v1/chat/completions", json=body, timeout=30
        ) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[1][6:])["object"] == "chat.completion.chunk"
        # The stats the replica sees, as its Pylons measured them: the stream above went through
        # one of them, so that engine's line shows a running request or its output throughput.
        wait_until(
            lambda: "demo-pylon-" in "".join(output) and "output " in "".join(output),
            10,
            "the stats lines",
        )
        stats = [line for line in "".join(output).splitlines() if "demo-pylon-" in line]
        assert any("running 1" in line or "output 0.0" not in line for line in stats), stats
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
