"""Model pools end to end: a replica with `--pool-config` swaps local engines (the `process`
controller runs `stargate mock-backend`) while it holds requests (real processes, real clock)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import yaml

from tests.e2e.processes import Ports, launch, mock_engine_command, stop, wait_until

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _member(model: str) -> dict[str, object]:
    return {"command": mock_engine_command(model), "healthPath": "/health"}


def _write_pools(path: Path, hold: str = "20s") -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "pools": [
                    {
                        "name": "gpu0",
                        "members": ["model-a", "model-b"],
                        "swapBudget": "30s",
                        "holdBudget": hold,
                        "controller": {
                            "kind": "process",
                            "members": {
                                "model-a": _member("model-a"),
                                "model-b": _member("model-b"),
                            },
                        },
                    }
                ]
            }
        )
    )
    return path


def _chat(base: str, model: str, timeout: float = 30) -> httpx.Response:
    headers = {"x-request-id": f"r-{model}", "x-input-tokens": "3", "x-model": model}
    return httpx.post(
        f"{base}/v1/chat/completions",
        headers=headers,
        json={**CHAT, "model": model},
        timeout=timeout,
    )


def test_requests_for_a_non_resident_member_are_held_while_the_pool_swaps(tmp_path: Path) -> None:
    ports = Ports.pick()
    pools = _write_pools(tmp_path / "pools.yaml")
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
        # Cold pool: the request is held while model-b's engine starts, then answered by it.
        started = time.monotonic()
        response = _chat(base, "model-b")
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "model-b"
        assert response.headers["x-inference-server-id"] == "process:gpu0:model-b"
        first_swap = time.monotonic() - started
        # The resident answers at once; the other member swaps in (model-b's engine stops).
        assert _chat(base, "model-b").status_code == 200
        response = _chat(base, "model-a")
        assert response.status_code == 200
        assert response.json()["model"] == "model-a"
        assert httpx.get(f"{base}/v1/models").json()["model_ids"] == ["model-a"]
        metrics = httpx.get(f"http://127.0.0.1:{ports.metrics}/metrics").text
        assert "llmkube_modelpool_swaps_total" in metrics
        assert first_swap < 20
        # Models outside every pool are never held: an unknown one is a plain 404.
        assert _chat(base, "not-pooled").status_code == 404
    finally:
        stop(replica)


def test_hold_budget_expiry_is_503_with_retry_after(tmp_path: Path) -> None:
    ports = Ports.pick()
    pools = tmp_path / "pools.yaml"
    pools.write_text(
        yaml.safe_dump(
            {
                "pools": [
                    {
                        "name": "slow",
                        "members": ["never-ready"],
                        "holdBudget": "300ms",
                        "controller": {
                            "kind": "process",
                            "members": {
                                "never-ready": {
                                    # Starts, but never answers its health path.
                                    "command": [
                                        sys.executable,
                                        "-c",
                                        "import time; time.sleep(60)",
                                        "{port}",
                                    ],
                                    "healthPath": "/health",
                                }
                            },
                        },
                    }
                ]
            }
        )
    )
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
        response = _chat(base, "never-ready", timeout=10)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "5"
        assert response.json()["error"]["code"] == "pool_activation_timeout"
        assert response.headers["x-stargate-error-code"] == "pool_activation_timeout"
    finally:
        stop(replica)


def test_bad_pool_config_fails_start_up_naming_the_pool_and_key(tmp_path: Path) -> None:
    pools = tmp_path / "pools.yaml"
    pools.write_text("pools:\n  - name: gpu0\n    members: [a]\n    swapBudget: ninety\n")
    process = launch(tmp_path / "bad.log", "serve", *Ports.pick().args(), f"--pool-config={pools}")
    assert process.process.wait(timeout=15) == 1
    assert "gpu0" in process.log and "swapBudget" in process.log
