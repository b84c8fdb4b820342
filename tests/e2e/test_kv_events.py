"""Precise mode end to end (docs/prefix-routing.md, "Precise mode"), with real processes: a
`stargate mock-backend` publishing its prefix cache's KV events, a `stargate pylon` subscribed to
them, and a replica that learns the engine's cached blocks from the Pylon's registration
messages, read back from `/debug/routing`; and a Pylon whose endpoint is silent."""

from __future__ import annotations

from typing import Any

import httpx

from tests.e2e.fleet import MODEL, Fleet, stream_once, wait_routable
from tests.e2e.processes import MockBackendProcess, Replica, free_port, wait_until

SYSTEM = "You are a careful assistant. " * 24  # 696 bytes: the shared opening of every chat


def kv_blocks(replica: Replica) -> dict[str, int]:
    """Backend id -> the KV-block count `/debug/routing` shows for MODEL."""
    body = replica.http.get("/debug/routing").json()
    return {
        backend["inference_server_id"]: backend["kv_blocks"]
        for target in body["targets"]
        if target["model_id"] == MODEL
        for cluster in target["clusters"]
        for backend in cluster["backends"]
    }


def cached_blocks(engine: MockBackendProcess) -> int:
    counters: dict[str, Any] = httpx.get(f"{engine.url}/test-control", timeout=5).json()
    return int(counters["counters"]["prefix_cache"]["cached_blocks"])


def conversation(user: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": True,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": user * 120},
        ],
    }


def test_the_replica_learns_the_engines_cached_blocks(fleet: Fleet) -> None:
    replica = fleet.replica()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    # 8 blocks of 256 bytes: the conversations below need more, so the engine evicts too.
    engine = fleet.engine("--prefix-cache-blocks", "8", "--kv-events-endpoint", endpoint)
    pylon = fleet.pylon(engine.url, replica, "--kv-events-endpoint", endpoint)
    wait_routable(replica, 1)
    assert kv_blocks(replica) == {pylon.id: 0}  # subscribed, nothing cached yet

    # A subscriber misses what is published before its subscription is up (ZMQ's slow
    # joiner): send requests until the replica knows a block, then start from a clear cache.
    def warmed() -> bool:
        assert stream_once(replica.http, conversation("warm up "))[0] == 200
        return kv_blocks(replica)[pylon.id] > 0

    wait_until(warmed, 15, "the Pylon's first KV event to reach the replica")
    engine.control(reset=True)
    wait_until(lambda: kv_blocks(replica)[pylon.id] == 0, 5, "the reset to reach the replica")

    for user in ("alpha ", "bravo ", "charlie ", "alpha "):  # the last one hits the cache
        status, served_by, text = stream_once(replica.http, conversation(user))
        assert (status, served_by) == (200, pylon.id) and text
    wait_until(
        lambda: kv_blocks(replica)[pylon.id] == cached_blocks(engine) > 0,
        5,
        "the replica's block count to match the engine's cache",
    )
    assert cached_blocks(engine) == 8  # full: blocks were evicted, and removed on the replica

    engine.control(reset=True)  # AllBlocksCleared
    wait_until(lambda: kv_blocks(replica)[pylon.id] == 0, 5, "the count to drop to 0")
    assert "undecodable" not in pylon.process.log and "missed" not in pylon.process.log


def test_a_silent_endpoint_is_a_warning_and_requests_are_served(fleet: Fleet) -> None:
    replica = fleet.replica()
    engine = fleet.engine()  # publishes nothing
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pylon = fleet.pylon(engine.url, replica, "--kv-events-endpoint", endpoint)
    wait_routable(replica, 1)
    assert stream_once(replica.http, conversation("first "))[0] == 200
    wait_until(
        lambda: f"no message from {endpoint} within 10 s of start" in pylon.process.log,
        20,
        "the Pylon's warning about the silent endpoint",
    )
    status, served_by, _ = stream_once(replica.http, conversation("second "))
    assert (status, served_by) == (200, pylon.id)
    assert kv_blocks(replica) == {pylon.id: 0}
    assert pylon.process.process.poll() is None
