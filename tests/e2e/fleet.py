"""A fleet of real processes for end-to-end tests of the request path: replicas, `stargate pylon`
sidecars and `stargate mock-backend` engines, all stopped at teardown; and the small clients the
tests read them with (`/debug/routing`, one streamed chat). Shared by the Pylon data-path and the
tunnel tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.e2e.processes import (
    MockBackendProcess,
    PylonProcess,
    Replica,
    free_port,
    launch_mock_backend,
    wait_until,
)

MODEL = "dp-model"
ALGORITHMS = (
    "round-robin",
    "random",
    "power-of-n",
    "wait-and-widen",
    "pulsar",
    "pulsar-wait-and-widen",
)
HEARTBEAT = ("--min-update-interval-ms", "200", "--model-refresh-ms", "500")
# A small batching engine: 2 running slots, then a FIFO queue; 20 ms + 0.05 ms per prompt token
# to the first token, then 10 ms a token.
FAST = ("--max-num-seqs", "2", "--ttft-ms", "20", "--prefill-ms-per-token", "0.05")
FAST_DECODE = ("--inter-token-ms", "10", "--tokens", "12")


class Fleet:
    """Processes of one test; every one is stopped at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.replicas: list[Replica] = []
        self.engines: list[MockBackendProcess] = []
        self.pylons: list[PylonProcess] = []

    def replica(self, *extra: str) -> Replica:
        replica = Replica(
            self.log_dir,
            f"dp-{len(self.replicas)}",
            "--disable-dns-discovery",
            "--accept-openai-requests",
            *extra,
        )
        self.replicas.append(replica)
        return replica

    def engine(self, *flags: str) -> MockBackendProcess:
        engine = launch_mock_backend("--model", MODEL, *flags)
        self.engines.append(engine)
        return engine

    def pylon(self, upstream: str, replica: Replica, *flags: str) -> Pylon:
        """A Pylon for the engine at `upstream`, seeded with `replica` (which announces only
        itself, so the Pylon registers there alone)."""
        port = free_port()
        index = len(self.pylons)
        process = PylonProcess(
            self.log_dir / f"pylon-{index}.log",
            "--upstream",
            upstream,
            "--stargate",
            replica.grpc_addr,
            "--inference-server-id",
            f"pylon-{index}",
            "--http-listen-addr",
            f"127.0.0.1:{port}",
            *HEARTBEAT,
            *flags,
        )
        self.pylons.append(process)
        return Pylon(process, f"http://127.0.0.1:{port}", f"pylon-{index}")

    def close(self) -> None:
        for pylon in self.pylons:
            pylon.kill()
        for engine in self.engines:
            engine.stop()
        for replica in self.replicas:
            replica.close()


class Pylon:
    def __init__(self, process: PylonProcess, url: str, server_id: str) -> None:
        self.process = process
        self.url = url
        self.id = server_id


def routing_view(replica: Replica) -> dict[str, Any]:
    """`/debug/routing` of `replica`: backend id -> the stats its balancers see for MODEL."""
    body = replica.http.get("/debug/routing").json()
    backends: dict[str, Any] = {}
    for target in body["targets"]:
        if target["model_id"] != MODEL:
            continue
        for cluster in target["clusters"]:
            for backend in cluster["backends"]:
                backends[backend["inference_server_id"]] = {
                    **backend["stats"],
                    "input_tps_estimated": cluster["input_tps_estimated"],
                }
    return backends


def wait_routable(replica: Replica, count: int) -> None:
    wait_until(lambda: len(routing_view(replica)) == count, 15, f"{count} routable backends")


def chat(prompt: str = "hello there") -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": True,
        "messages": [{"role": "user", "content": prompt}],
    }


def stream_once(
    client: httpx.Client, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """(status, serving backend id, the streamed text) of one request through a replica."""
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        text = "".join(response.iter_text())
        return response.status_code, response.headers.get("x-inference-server-id", ""), text
