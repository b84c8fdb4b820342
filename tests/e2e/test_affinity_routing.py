"""Cache-affinity routing through real replicas (docs/data-plane.md, Pulsar and Wait-and-widen).

Two `stargate serve` processes with the same LB config and the same four backends (registered on
both, as Pylons do) must send every cache-affinity key to the same backend: Pulsar's ranking is
a function of the key, the seed and the clusters alone. One replica also shows the header
contract of `require_cache_affinity_key`, the KV-room fallback and its metric.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.processes import MockBackendProcess, launch_mock_backend
from tests.e2e.test_proxy import CHAT, ProxyReplica, start_proxy_replica
from tests.fakes.pylon import registration

MODEL = "model-a"
BACKENDS = ("engine-a", "engine-b", "engine-c", "engine-d")
LB_CONFIG = {
    "default": "pulsar",
    "request_algorithms": {
        "wait-and-widen": {
            "algorithm": "wait-and-widen",
            "seed": "fleet",
            "require_cache_affinity_key": True,
            "cache_affinity_backend_selection_count": 1,
        }
    },
    "models": {MODEL: {"algorithm": "pulsar", "seed": "fleet", "consider_kv_free_tokens": True}},
}


@pytest.fixture(scope="module")
def engines() -> Iterator[list[MockBackendProcess]]:
    started = [launch_mock_backend("--model", MODEL) for _ in range(2)]
    yield started
    for engine in started:
        engine.stop()


STATS = {
    "last_mean_input_tps": 1000.0,
    "kv_cache_capacity_tokens": 100_000,
    "kv_cache_free_tokens": 50_000,
}


def start_affinity_replica(
    tmp_path: Path, engines: list[MockBackendProcess], *extra: str
) -> ProxyReplica:
    """A replica with `LB_CONFIG` and the four backends (two per engine); `extra` flags too
    (tests/e2e/test_derived_affinity.py)."""
    tmp_path.mkdir(exist_ok=True)
    config = tmp_path / "lb.json"
    config.write_text(json.dumps(LB_CONFIG))
    replica = start_proxy_replica(tmp_path, "--lb-config-path", str(config), *extra)
    for index, server_id in enumerate(BACKENDS):
        replica.register(server_id, engines[index % 2].url, [MODEL], cluster_id=server_id, **STATS)
    return replica


def _served_by(replica: ProxyReplica, key: str | None, **extra: str) -> httpx.Response:
    headers = {"x-request-id": "r", "x-input-tokens": "10", "x-model": MODEL, **extra}
    if key is not None:
        headers["x-cache-affinity-key"] = key
    return httpx.post(f"{replica.base}/v1/chat/completions", headers=headers, json=CHAT, timeout=10)


def test_every_replica_sends_a_key_to_the_same_backend(
    tmp_path: Path, engines: list[MockBackendProcess]
) -> None:
    first = start_affinity_replica(tmp_path / "one", engines)
    second = start_affinity_replica(tmp_path / "two", engines)
    try:
        keys = [f"conversation-{index}" for index in range(24)]
        chosen = []
        for replica in (first, second, first):
            row = []
            for key in keys:
                response = _served_by(replica, key)
                assert response.status_code == 200
                row.append(response.headers["x-inference-server-id"])
            chosen.append(row)
        assert chosen[0] == chosen[1] == chosen[2]  # across replicas, and over time
        assert len(set(chosen[0])) >= 3  # and the keys spread over the clusters
    finally:
        first.close()
        second.close()


def test_affinity_key_contract_and_kv_room_fallback(
    tmp_path: Path, engines: list[MockBackendProcess]
) -> None:
    replica = start_affinity_replica(tmp_path, engines)
    try:
        # wait-and-widen requires a key here: 400 without one, 200 (one stable backend) with.
        method = {"x-routing-method": "wait_and_widen"}
        assert _served_by(replica, None, **method).status_code == 400
        served = {
            _served_by(replica, "k", **method).headers["x-inference-server-id"] for _ in range(6)
        }
        assert len(served) == 1

        # The key's first-ranked cluster has no KV room left for the request's 10 tokens: the
        # next-ranked one serves it, and the choice is counted as a fallback.
        primary = _served_by(replica, "kv-key").headers["x-inference-server-id"]
        stream = replica.streams[BACKENDS.index(primary)]
        full = {**STATS, "kv_cache_free_tokens": 5}
        url = engines[BACKENDS.index(primary) % 2].url
        stream.exchange(registration(primary, url, [MODEL], cluster_id=primary, **full))
        response = _served_by(replica, "kv-key")
        assert response.status_code == 200
        assert response.headers["x-inference-server-id"] != primary
        metrics = replica.metrics()
        fallback = (
            'stargate_routing_kv_free_token_fallback_selections_total{algorithm="pulsar",'
            f'model="{MODEL}",routing_key=""}} 1.0'
        )
        assert fallback in metrics
        assert 'algorithm="pulsar",model="model-a",routing_key="",selection="fallback"} 1.0' in (
            metrics
        )
    finally:
        replica.close()


def test_a_routing_wait_unlocks_the_next_ttft_bucket(
    tmp_path: Path, engines: list[MockBackendProcess]
) -> None:
    """wait-and-widen keeps a request off a slower cluster until it has waited (TTFT gap x
    `next_bucket_unlock_factor`): without an `x-max-wait-ms` budget nothing is choosable while
    the fast cluster is full (503); with one, the request is served by the slow cluster once its
    bucket unlocks (gap ~990 ms x 0.25)."""
    config = tmp_path / "lb.json"
    config.write_text(json.dumps({"default": "wait-and-widen"}))
    replica = start_proxy_replica(tmp_path, "--lb-config-path", str(config))
    full = {"num_running_queries": 8, "max_engine_concurrency": 8}
    try:
        replica.register(
            "fast", engines[0].url, [MODEL], cluster_id="fast", last_mean_input_tps=1000.0, **full
        )
        replica.register(
            "slow", engines[1].url, [MODEL], cluster_id="slow", last_mean_input_tps=10.0
        )
        assert _served_by(replica, None).status_code == 503
        waited = _served_by(replica, None, **{"x-max-wait-ms": "2000"})
        assert waited.status_code == 200
        assert waited.headers["x-inference-server-id"] == "slow"
        assert waited.elapsed.total_seconds() >= 0.2
    finally:
        replica.close()
