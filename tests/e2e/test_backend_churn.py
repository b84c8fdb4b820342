"""A replica returns to its baseline after backends come and go (issue 19, item 3).

A replica in this process (real loopback sockets, real clock), one `stargate mock-backend`
process listening on every loopback address, and 300 backend ids that each register at their own
origin (`http://127.1.X.Y:PORT`: a distinct upstream origin per backend, as engine pods have),
serve traffic, and leave, while one backend that stays keeps the model's target alive. After the
metric grace period everything the replica kept for them is gone: the upstream origins and their
idle connections, the forwarder's per-cluster counters, registrations and their health monitors,
the sweeper's state and the metric series; the process's RSS stays within a bound.

Registration streams are driven straight into `RegistrationService.register` (the handler the
gRPC service calls) rather than through grpcio, whose client threads and channels would sit in
this process's memory next to the replica's and blur what the replica keeps.

Before the fix each departed backend that carried traffic kept its upstream origin with an idle
keep-alive connection (an `Origin`, its slot semaphore, the connection's socket, h11 state and
receive buffer: about 3 KB of Python objects by tracemalloc, 17-23 KB of RSS, and a descriptor)
until the idle expiry (60 s) and the next housekeeping pass (up to 60 s more), and a departed
cluster's round-robin counter stayed as long as its target lived: after this test's two churns,
601 origins, 601 open connections and 601 counters, and 5.3 MB more RSS for the second 300.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from stargate.config import ControlPlaneConfig, ListenAddress, ServeConfig, WarmupConfig
from stargate.control_plane.admission import HEARTBEAT_HEADER
from stargate.grpc_asgi import RequestStream, RpcContext
from stargate.protocol import stargate_pb2 as pb
from stargate.runtime import Replica
from tests.e2e.processes import MockBackendProcess, launch_mock_backend
from tests.fakes.pylon import registration

CHURNED = 300
WARMUP = CHURNED  # churned first: one-time growth (dict tables, caches, allocator arenas)
GRACE = 1.0  # seconds; the sweep then runs every GRACE / 4
# The second churn of 300 moved RSS by -0.7 to +1.5 MB (allocator noise); before the fix, +5.3 MB.
RSS_BOUND_KB = 3 * 1024
MODEL = "churn"
SAMPLE_LINE = re.compile(r"^(?P<series>[^ #][^ ]*) (?P<value>\S+)$")


@pytest.fixture(scope="module")
def backend() -> Iterator[MockBackendProcess]:
    # Every 127.0.0.0/8 address is this machine: one process gives each backend its own origin.
    started = launch_mock_backend("--host", "0.0.0.0", "--model", MODEL)
    yield started
    started.stop()


def _port(backend: MockBackendProcess) -> int:
    return int(backend.url.rsplit(":", 1)[1])


def _host(round_: int, index: int) -> str:
    return f"127.{1 + round_}.{1 + index // 250}.{1 + index % 250}"


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def _series(text: str) -> set[str]:
    return {m["series"] for line in text.splitlines() if (m := SAMPLE_LINE.match(line))}


class _Fleet:
    """The replica, a client, and registration streams driven in process."""

    def __init__(self, replica: Replica, nursery: trio.Nursery, http_port: int) -> None:
        self.replica = replica
        self.nursery = nursery
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=10)
        assert replica.bound is not None
        self.metrics_url = f"http://127.0.0.1:{replica.bound.metrics.port}/metrics"

    async def register(self, server_id: str, url: str) -> trio.CancelScope:
        """Admit a registration (ACTIVE for MODEL, its own cluster); cancel the scope to end its
        stream, as a Pylon that goes away does."""
        send, receive = trio.open_memory_channel[pb.InferenceServerRegistration](1)
        acked = trio.Event()
        scope = trio.CancelScope()

        async def ack(message: pb.InferenceServerAck) -> None:
            acked.set()

        async def stream() -> None:
            context = RpcContext("/register", {HEARTBEAT_HEADER: "1000"}, None, "")
            with scope:
                await self.replica.registrations.register(RequestStream(receive), context, ack)

        self.nursery.start_soon(stream)
        await send.send(registration(server_id, url, [MODEL], cluster_id=f"cluster-{server_id}"))
        with trio.fail_after(5):
            await acked.wait()
        return scope

    async def chat_until_served_by(self, server_id: str) -> None:
        """Requests until one is answered by `server_id` (round robin over the clusters: the
        first or the second)."""
        for attempt in range(4):
            response = await self.http.post(
                "/v1/chat/completions",
                headers={
                    "x-request-id": f"{server_id}-{attempt}",
                    "x-input-tokens": "10",
                    "x-model": MODEL,
                    "x-routing-method": "round-robin",
                },
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert response.status_code == 200, response.text
            if response.headers["x-inference-server-id"] == server_id:
                return
        raise AssertionError(f"{server_id} served no request")

    async def churn(self, round_: int, count: int, port: int) -> None:
        for index in range(count):
            server_id = f"engine-{round_}-{index}:8080"
            scope = await self.register(server_id, f"http://{_host(round_, index)}:{port}")
            await self.chat_until_served_by(server_id)
            scope.cancel()
            await trio.lowlevel.checkpoint()

    async def metrics(self) -> str:
        response = await self.http.get(self.metrics_url)
        assert response.status_code == 200
        return response.text

    def retained(self) -> dict[str, int]:
        """Everything the replica keeps per backend, by kind."""
        replica = self.replica
        stats = replica.upstream.stats()
        return {
            "registrations": len(replica.routing.registrations()),
            "registration_streams": replica.registrations.open_streams,  # + health monitors
            "upstream_origins": replica.upstream.origin_count,
            "upstream_connections": stats.open_connections,
            "demoted": len(replica.routing.demoted),
            "series_in_grace": replica.series_sweep.tracked,
            **replica.forwarder.retained,
        }

    async def settled(self, baseline: dict[str, int], series: set[str]) -> str:
        """Wait (at most 10 s) until the pooled objects and the series are back to `baseline`;
        return the `/metrics` text then."""
        text = ""
        for _ in range(100):
            text = await self.metrics()
            if self.retained() == baseline and _series(text) == series:
                break
            await trio.sleep(0.1)
        return text


async def test_a_replica_returns_to_its_baseline_after_300_backends_came_served_and_left(
    backend: MockBackendProcess,
) -> None:
    port = _port(backend)
    with socket.create_connection((_host(0, 1), port), timeout=2):
        pass  # the loopback network routes every 127.x address (Linux)
    config = ServeConfig(
        stargate_id="churn-replica",
        http_listen_addr=ListenAddress("127.0.0.1", 0),
        listen_addr=ListenAddress("127.0.0.1", 0),
        model_discovery_listen_addr=ListenAddress("127.0.0.1", 0),
        metrics_port=0,
        shutdown_delay_ms=0,
        warmup=WarmupConfig(warmup_ms=0),
        # The streams here send no heartbeats; nothing may end them but the test.
        control_plane=ControlPlaneConfig(idle_timeout_ms=0, max_idle_timeout_ms=0),
    )
    replica = Replica(config, series_grace_seconds=GRACE)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(replica.run)
        fleet = _Fleet(replica, nursery, bound.http.port)
        try:
            anchor = await fleet.register("anchor", backend.url)  # keeps the target alive
            await fleet.chat_until_served_by("anchor")
            await fleet.churn(0, WARMUP, port)
            # The baseline: one live backend, and a churn already behind (its series swept).
            baseline_series = _series(await fleet.metrics())
            baseline_series = {s for s in baseline_series if "engine-" not in s}
            expected = {
                **fleet.retained(),
                "registrations": 1,
                "registration_streams": 1,
                "upstream_origins": 1,
                "upstream_connections": 1,
                "series_in_grace": 0,
                "cluster_counters": 1,
            }
            baseline_text = await fleet.settled(expected, baseline_series)
            baseline = fleet.retained()
            assert baseline == expected, baseline
            rss_before = _rss_kb()

            await fleet.churn(1, CHURNED, port)
            during = fleet.retained()
            assert during["upstream_origins"] > 1  # the last ones left a moment ago
            churned = await fleet.metrics()
            assert f'inference_server_id="engine-1-{CHURNED - 1}:8080"' in churned

            after = await fleet.settled(baseline, baseline_series)
            assert fleet.retained() == baseline
            assert _series(after) == baseline_series
            # Only values differ (the counters of the staying backend and the endpoints).
            assert abs(len(after) - len(baseline_text)) <= 64, (len(baseline_text), len(after))
            grown = _rss_kb() - rss_before
            assert grown < RSS_BOUND_KB, f"RSS grew {grown} KB over {CHURNED} departed backends"
            anchor.cancel()
        finally:
            await fleet.http.aclose()
            replica.shutdown.begin(leave=False)
