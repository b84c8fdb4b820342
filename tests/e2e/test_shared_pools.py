"""Shared model pools end to end (docs/pool-ownership.md): three real `stargate serve` replicas with
`--pool-ownership=lease`, a fake Kubernetes API server (tests/fakes/kube_api.py) holding the
members' Deployments and the pool's Lease, and a stand-in for the cluster that starts a member's
engine (registers a `stargate mock-backend` with every replica, as its Pylon would) while its
Deployment is scaled up, and stops it at once when it is scaled down.

Asserted: one replica owns the pool and decides every swap (the fake API records who holds the
Lease at each scale write); the others relay their requests to it and every request is answered;
no member is ever scaled down while its engine has a request in flight; when the owner leaves
(SIGTERM) another replica takes the pool within about a retry period, and when it crashes
(SIGKILL), once the Lease has expired, and then serves a swap.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml

from stargate.activator.lease import lease_name
from stargate.config import ListenAddress
from stargate.serving import bind_listener, serve_asgi
from tests.e2e.processes import MockBackendProcess, launch_mock_backend, wait_until
from tests.e2e.test_proxy import ProxyReplica, start_proxy_replica
from tests.fakes.kube_api import NS, TOKEN, FakeApiServer

POOL = "gpu0"
MEMBERS = {"model-a": "vllm-a", "model-b": "vllm-b"}
LEASE = lease_name("stargate", POOL)
# Short Lease timings so failover fits a test: duration 3 s, renew deadline 2 s, retry 0.5 s.
TIMINGS = ("--pool-lease-duration-ms=3000", "--pool-lease-renew-deadline-ms=2000")
RETRY = "--pool-lease-retry-period-ms=500"
ENGINE_START_S = 0.3  # how long a scaled-up member's engine takes to register
INTER_TOKEN_MS = 100  # a request lasts about 0.5 s at its engine


@dataclass
class ScaleWrite:
    member: str
    replicas: int
    holder: str | None  # the Lease holder when the write arrived: the deciding replica
    engine_in_flight: int  # requests the member's engine was serving at that moment
    at: float  # time.monotonic()


@dataclass
class Cluster(FakeApiServer):
    """The fake API, recording every scale write with who held the Lease and what the member's
    engine was serving."""

    engines: dict[str, str] = field(default_factory=dict)  # member -> engine base URL
    scale_writes: list[ScaleWrite] = field(default_factory=list)

    async def _handle(
        self, method: str, path: str, headers: dict[str, str], raw: bytes, host: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        if method == "PATCH" and path.endswith("/scale"):
            name = path.removesuffix("/scale").rsplit("/", 1)[-1]
            member = next(m for m, deployment in MEMBERS.items() if deployment == name)
            url = self.engines[member]
            in_flight = await trio.to_thread.run_sync(
                lambda: int(httpx.get(f"{url}/test-control", timeout=5).json()["in_flight"])
            )
            replicas = int(yaml.safe_load(raw.decode())["spec"].get("replicas", 0))
            self.scale_writes.append(
                ScaleWrite(member, replicas, self.lease_holder(LEASE), in_flight, time.monotonic())
            )
        return await super()._handle(method, path, headers, raw, host)

    def up(self, member: str) -> bool:
        path = f"/apis/apps/v1/namespaces/{NS}/deployments/{MEMBERS[member]}"
        return bool(self.replicas(path))


@contextlib.contextmanager
def _served(cluster: Cluster) -> Iterator[str]:
    """The fake API on loopback, in a thread of its own."""
    sock = bind_listener("fake-kube-api", ListenAddress("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    ready = threading.Event()
    stop = threading.Event()

    async def serve() -> None:
        from hypercorn.config import Config

        config = Config()
        config.accesslog = None
        config.graceful_timeout = 1.0

        async def stopped() -> None:
            while not stop.is_set():  # noqa: ASYNC110 (a thread's event)
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            await nursery.start(serve_asgi, cluster, sock, config, stopped)
            ready.set()

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield url
    finally:
        stop.set()
        thread.join(10)


@dataclass
class Fleet:
    cluster: Cluster
    replicas: dict[str, ProxyReplica]
    engines: dict[str, MockBackendProcess]
    registered: dict[str, list[Any]] = field(default_factory=dict)  # member -> streams

    def base(self, replica: str) -> str:
        return self.replicas[replica].base

    def owner(self) -> str | None:
        return self.cluster.lease_holder(LEASE)

    def sync_engines(self) -> None:
        """A member's engine registers with every live replica while its Deployment is up."""
        for member, engine in self.engines.items():
            if self.cluster.up(member) and member not in self.registered:
                time.sleep(ENGINE_START_S)
                streams = []
                for replica in self.replicas.values():
                    if replica.process.process.poll() is None:
                        with contextlib.suppress(Exception):  # a replica that is stopping
                            streams.append(
                                replica.register(f"engine-{member}", engine.url, [member])
                            )
                self.registered[member] = streams
            elif not self.cluster.up(member) and member in self.registered:
                for stream in self.registered.pop(member):
                    stream.cancel()


def _chat(base: str, model: str, request_id: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions",
        headers={"x-request-id": request_id, "x-input-tokens": "3", "x-model": model},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        timeout=timeout,
    )


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    cluster = Cluster()
    for deployment in MEMBERS.values():
        cluster.add_workload("deployments", deployment, 0)
    engines = {
        member: launch_mock_backend(
            "--model", member, "--inter-token-ms", str(INTER_TOKEN_MS), "--tokens", "5"
        )
        for member in MEMBERS
    }
    cluster.engines = {member: engine.url for member, engine in engines.items()}
    replicas: dict[str, ProxyReplica] = {}
    with _served(cluster) as url:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": url}}],
                    "users": [{"name": "u", "user": {"token": TOKEN}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
                }
            )
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        pools = tmp_path / "pools.yaml"
        pools.write_text(
            yaml.safe_dump(
                {
                    "pools": [
                        {
                            "name": POOL,
                            "members": list(MEMBERS),
                            "swapBudget": "20s",
                            "holdBudget": "30s",
                            "controller": {
                                "kind": "kubernetes",
                                "namespace": NS,
                                "members": {
                                    m: {"kind": "Deployment", "name": d} for m, d in MEMBERS.items()
                                },
                            },
                        }
                    ]
                }
            )
        )
        try:
            for name in ("r0", "r1", "r2"):
                replicas[name] = start_proxy_replica(
                    tmp_path,
                    f"--stargate-id={name}",
                    f"--pool-config={pools}",
                    "--pool-ownership=lease",
                    f"--pool-lease-namespace={NS}",
                    *TIMINGS,
                    RETRY,
                    "--pool-resync-interval-ms=500",
                    "--shutdown-delay-ms=0",
                )
            fleet = Fleet(cluster, replicas, engines)
            wait_until(lambda: fleet.owner() is not None, 10, "a pool owner")
            stop = threading.Event()

            def simulate() -> None:
                while not stop.is_set():
                    fleet.sync_engines()
                    time.sleep(0.05)

            simulator = threading.Thread(target=simulate, daemon=True)
            simulator.start()
            try:
                yield fleet
            finally:
                stop.set()
                simulator.join(10)
        finally:
            for replica in replicas.values():
                replica.close()
            for engine in engines.values():
                engine.stop()


def _no_scale_down_under_load(cluster: Cluster) -> None:
    busy = [w for w in cluster.scale_writes if w.replicas == 0 and w.engine_in_flight]
    assert busy == [], busy


def test_one_owner_decides_and_the_others_relay(fleet: Fleet) -> None:
    owner = fleet.owner()
    assert owner in fleet.replicas
    plan = [
        (replica, member, n) for n in range(4) for replica in fleet.replicas for member in MEMBERS
    ]
    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(
            pool.map(
                lambda job: (job, _chat(fleet.base(job[0]), job[1], f"{job[0]}-{job[1]}-{job[2]}")),
                plan,
            )
        )
    failed = [(job, r.status_code, r.text[:200]) for job, r in answers if r.status_code != 200]
    assert failed == []
    assert all(r.json()["model"] == job[1] for job, r in answers)
    writes = fleet.cluster.scale_writes
    assert writes, "the pool never swapped"
    assert {w.holder for w in writes} == {owner}  # only the Lease holder scaled members
    _no_scale_down_under_load(fleet.cluster)
    metrics = {name: replica.metrics() for name, replica in fleet.replicas.items()}
    owned = {
        name: _metric(text, "llmkube_modelpool_owned", pool=POOL) for name, text in metrics.items()
    }
    assert owned == {name: float(name == owner) for name in fleet.replicas}
    for name, text in metrics.items():
        relayed = _metric(
            text, "llmkube_modelpool_relayed_requests_total", pool=POOL, outcome="relayed"
        )
        assert (relayed > 0) is (name != owner), (name, relayed)
    swaps = sum(
        _metric(text, "llmkube_modelpool_swaps_total", pool=POOL) for text in metrics.values()
    )
    assert swaps == _metric(metrics[owner], "llmkube_modelpool_swaps_total", pool=POOL) > 0


def _other_member(fleet: Fleet) -> str:
    return next(member for member in MEMBERS if not fleet.cluster.up(member))


def _failover(fleet: Fleet, sig: signal.Signals) -> tuple[str, str, float, float]:
    """Stop the owner with `sig`; return (old owner, new owner, seconds until another replica
    held the Lease, seconds until its first scale write)."""
    first = _chat(fleet.base("r0"), "model-a", "warm-up")  # a resident member
    assert first.status_code == 200, first.text
    old = fleet.owner()
    assert old is not None
    survivor = next(name for name in fleet.replicas if name != old)
    fleet.replicas[old].process.process.send_signal(sig)
    stopped = time.monotonic()
    wanted = _other_member(fleet)
    response = _chat(fleet.base(survivor), wanted, "after-the-owner")  # held during the gap
    assert response.status_code == 200, response.text
    assert response.json()["model"] == wanted
    new = fleet.owner()
    assert new not in (None, old)
    held = wait_until(lambda: fleet.owner() == new, 1, "the new owner") - stopped
    decided = [w for w in fleet.cluster.scale_writes if w.at > stopped]
    assert decided and {w.holder for w in decided} == {new}
    _no_scale_down_under_load(fleet.cluster)
    return old, new, held, decided[0].at - stopped


def test_a_leaving_owner_hands_the_pool_over_at_once(fleet: Fleet) -> None:
    old, new, _, first_swap = _failover(fleet, signal.SIGTERM)
    print(f"SIGTERM to owner {old}: {new} decided its first swap {first_swap:.2f} s later")
    assert first_swap < 2.5  # released, not left to expire (3 s)


def test_a_crashed_owners_pool_is_taken_over_once_its_lease_expires(fleet: Fleet) -> None:
    old, new, _, first_swap = _failover(fleet, signal.SIGKILL)
    print(f"SIGKILL to owner {old}: {new} decided its first swap {first_swap:.2f} s later")
    # The Lease's 3 s, counted by each follower from when it last saw the record change (up to
    # a retry period before the crash), then a read and the swap.
    assert 2.0 < first_swap < 6.0


def test_process_pools_cannot_be_shared(tmp_path: Path) -> None:
    pools = tmp_path / "pools.yaml"
    command = ["stargate", "mock-backend", "--port", "{port}"]
    pools.write_text(
        yaml.safe_dump(
            {
                "pools": [
                    {
                        "name": "local",
                        "members": ["m"],
                        "controller": {"kind": "process", "members": {"m": {"command": command}}},
                    }
                ]
            }
        )
    )
    with pytest.raises(AssertionError, match="do not use the kubernetes controller"):
        start_proxy_replica(tmp_path, f"--pool-config={pools}", "--pool-ownership=lease")
