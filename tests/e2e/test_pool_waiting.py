"""Measured waiting end to end (docs/activator.md, "Measured waiting" and "Breaker"): a replica
with `--pool-config` whose `process` controller runs real `stargate mock-backend` engines, one of
them slow to start, and one that cannot start at all; real HTTP clients, the real clock."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import httpx
import yaml

from tests.e2e.processes import Ports, launch, mock_engine_command, stop, wait_until

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SLOW_START = 5  # seconds the slow member sleeps before its engine starts: rounding Retry-After
# up to whole seconds adds less than 1 s, under 25 % of a swap this long


_engine = mock_engine_command


def _chat(base: str, model: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions",
        headers={"x-request-id": f"r-{model}", "x-input-tokens": "3", "x-model": model},
        json={**CHAT, "model": model},
        timeout=timeout,
    )


def _sample(text: str, name: str, **labels: str) -> float | None:
    """One sample of the Prometheus text `text` whose labels include `labels`."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


def test_retry_after_follows_the_measured_swap_time(tmp_path: Path) -> None:
    """After five swaps of a member that takes about S s to start, an `IfIdle` request for it
    while the resident is busy gets a 503 whose Retry-After is within 25 % of S (the fixed value
    was 5 s whatever S was)."""
    slow = ["sh", "-c", f"sleep {SLOW_START}; exec " + " ".join(_engine("model-b"))]
    pools = tmp_path / "pools.yaml"
    pools.write_text(
        yaml.safe_dump(
            {
                "pools": [
                    {
                        "name": "gpu0",
                        "members": ["model-a", "model-b"],
                        "activation": "IfIdle",
                        "swapBudget": "60s",
                        "holdBudget": "60s",
                        "controller": {
                            "kind": "process",
                            "members": {
                                # model-a answers after 1.5 s: long enough to be busy.
                                "model-a": {
                                    "command": _engine("model-a", "--ttft-ms", "1500"),
                                    "healthPath": "/health",
                                },
                                "model-b": {"command": slow, "healthPath": "/health"},
                            },
                        },
                    }
                ]
            }
        )
    )
    ports = Ports.pick()
    replica = launch(
        tmp_path / "replica.log",
        "serve",
        *ports.args(),
        "--readiness-warmup-ms=0",
        "--disable-dns-discovery",
        f"--pool-config={pools}",
    )
    base = f"http://127.0.0.1:{ports.http}"
    try:
        wait_until(lambda: httpx.get(f"{base}/healthz").status_code == 200, 15, "the replica")
        swaps = []
        for _ in range(5):
            assert _chat(base, "model-a").status_code == 200
            started = time.monotonic()
            response = _chat(base, "model-b")  # held while model-b's engine starts
            swaps.append(time.monotonic() - started)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == "model-b"
        measured = sum(swaps) / len(swaps)
        assert measured > SLOW_START
        metrics = httpx.get(f"http://127.0.0.1:{ports.metrics}/metrics").text
        estimate = _sample(
            metrics, "llmkube_modelpool_swap_time_estimate_seconds", member="model-b"
        )
        assert estimate is not None and abs(estimate - measured) <= 0.25 * measured

        # model-a resident and busy (one request in flight): IfIdle refuses model-b at once.
        assert _chat(base, "model-a").status_code == 200
        busy = threading.Thread(target=_chat, args=(base, "model-a"))
        busy.start()  # in flight on model-a for 1.5 s (its time to first token)
        time.sleep(0.5)
        refused = _chat(base, "model-b")
        busy.join()
        assert refused.status_code == 503, refused.text
        assert refused.headers["x-stargate-error-code"] == "pool_incumbent_busy"
        retry_after = int(refused.headers["retry-after"])
        print(f"swap times {[round(s, 2) for s in swaps]} mean {measured:.2f}s, ", end="")
        print(f"EWMA {estimate:.2f}s, Retry-After {retry_after}s")
        assert abs(retry_after - measured) <= 0.25 * measured, (retry_after, swaps)
    finally:
        stop(replica)


def test_a_member_that_cannot_start_trips_its_breaker_and_then_fails_fast(tmp_path: Path) -> None:
    pools = tmp_path / "pools.yaml"
    pools.write_text(
        yaml.safe_dump(
            {
                "pools": [
                    {
                        "name": "gpu0",
                        "members": ["model-a", "broken"],
                        "swapBudget": "20s",
                        "controller": {
                            "kind": "process",
                            "members": {
                                "model-a": {
                                    "command": _engine("model-a"),
                                    "healthPath": "/health",
                                },
                                "broken": {
                                    "command": [str(tmp_path / "no-such-engine"), "{port}"],
                                    "healthPath": "/health",
                                },
                            },
                        },
                    }
                ]
            }
        )
    )
    ports = Ports.pick()
    replica = launch(
        tmp_path / "replica.log",
        "serve",
        *ports.args(),
        "--readiness-warmup-ms=0",
        "--disable-dns-discovery",
        f"--pool-config={pools}",
        "--pool-breaker-cooldown-ms=20000",  # --pool-breaker-failures: the default, 3
    )
    base = f"http://127.0.0.1:{ports.http}"
    metrics_url = f"http://127.0.0.1:{ports.metrics}/metrics"
    try:
        wait_until(lambda: httpx.get(f"{base}/healthz").status_code == 200, 15, "the replica")
        assert _chat(base, "model-a").status_code == 200
        for _ in range(3):  # each request starts a swap that fails
            response = _chat(base, "broken")
            assert response.status_code == 502, response.text
            assert response.headers["x-stargate-error-code"] == "pool_swap_failed"
        metrics = httpx.get(metrics_url).text
        labels = {"member": "broken", "pool": "gpu0"}
        assert _sample(metrics, "llmkube_modelpool_breaker_state", **labels) == 2
        assert _sample(metrics, "llmkube_modelpool_breaker_openings_total", **labels) == 1
        failures = _sample(metrics, "llmkube_modelpool_swap_failures_total", **labels)
        assert failures == 3

        started = time.monotonic()
        response = _chat(base, "broken")
        elapsed = time.monotonic() - started
        assert response.status_code == 503, response.text
        assert response.headers["x-stargate-error-code"] == "pool_member_unavailable"
        message = response.json()["error"]["message"]
        assert "no-such-engine" in message or "No such file" in message, message
        assert 1 <= int(response.headers["retry-after"]) <= 20
        assert elapsed < 1.0  # fast: no swap, no hold
        metrics = httpx.get(metrics_url).text
        assert _sample(metrics, "llmkube_modelpool_swap_failures_total", **labels) == 3
        # The other member is unaffected and the breaker's opening was logged once.
        assert _chat(base, "model-a").status_code == 200
        assert len(re.findall("model pool breaker opened", replica.log)) == 1
    finally:
        stop(replica)
