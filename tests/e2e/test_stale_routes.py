"""Stale routes die fast (docs/stale-routes.md), with real processes on loopback: a replica
(`stargate serve`), mock engines (`stargate mock-backend`), a real `stargate pylon` or direct
registration streams, and signals that freeze them. Real clock.

Every process a test stops with SIGSTOP is sent SIGCONT before it is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import trio

from stargate.protocol import stargate_pb2 as pb
from stargate.protocol import stargate_pb2_grpc as pb_grpc
from tests.e2e.processes import MockBackendProcess, launch_mock_backend, wait_until
from tests.e2e.test_proxy import ProxyReplica, start_proxy_replica
from tests.e2e.test_pylon import PylonProcess
from tests.fakes.pylon import INACTIVE, registration

HEAD_TIMEOUT_MS = 30_000  # the default: the moves below must not be the head timeout's doing
MOVED_WITHIN = 10.0  # seconds; well under the head timeout


def _headers(model: str, request_id: str = "r") -> dict[str, str]:
    return {"x-request-id": request_id, "x-input-tokens": "1", "x-model": model}


def _chat(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


def _list_models(replica: ProxyReplica, model: str) -> list[str]:
    with grpc.insecure_channel(f"127.0.0.1:{replica.ports.discovery}") as channel:
        stub = pb_grpc.StargateModelDiscoveryStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.ListModels(pb.ListModelsRequest(model_ids=[model]), timeout=5)
        return list(reply.model_ids)


def _counter(replica: ProxyReplica, name: str, **labels: str) -> float:
    """The sum of one counter's samples (default `stargate_` prefix) whose labels include
    `labels`."""
    total = 0.0
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    for line in replica.metrics().splitlines():
        if line.startswith(f"stargate_{name}{{") and all(label in line for label in wanted):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Frozen:
    """Processes stopped with SIGSTOP, resumed (SIGCONT) before anything kills them."""

    def __init__(self) -> None:
        self.pids: list[int] = []

    def stop(self, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        self.pids.append(pid)

    def resume_all(self) -> None:
        while self.pids:
            pid = self.pids.pop()
            with contextlib.suppress(ProcessLookupError):  # it was never reaped: still ours
                os.kill(pid, signal.SIGCONT)


@pytest.fixture
def frozen() -> Iterator[Frozen]:
    handle = Frozen()
    yield handle
    handle.resume_all()


def _round_robin(tmp_path: Path) -> Path:
    path = tmp_path / "round-robin.json"
    path.write_text(json.dumps({"default": "round-robin"}))
    return path


# ---- a frozen Pylon ----------------------------------------------------------------------------


def test_a_frozen_pylons_dead_engine_is_unroutable_within_seconds(
    tmp_path: Path, frozen: Frozen
) -> None:
    """The Pylon stops (SIGSTOP: its stream stays open, so the 60 s idle timeout does not fire),
    then its engine dies. The replica's own probe, which goes through the frozen Pylon (it is in
    the request path), gets no answer within the probe timeout (1 s here), and the model is 503
    (registered, nothing active), not 404 and not a wait for the idle timeout."""
    engine = launch_mock_backend("--model", "frozen-model")
    replica = start_proxy_replica(
        tmp_path,
        "--registration-update-idle-timeout-ms=60000",  # the realistic floor, not disabled
        "--health-check-timeout-ms=1000",
        "--accept-openai-requests",
    )
    pylon = PylonProcess(
        tmp_path / "pylon.log",
        "--upstream",
        engine.url,
        "--stargate",
        f"127.0.0.1:{replica.ports.grpc}",
        "--inference-server-id",
        "frozen-engine",
        "--min-update-interval-ms",
        "200",
        "--model-refresh-ms",
        "200",
    )
    try:
        wait_until(lambda: _list_models(replica, "frozen-model") != [], 15, "the registration")
        url = f"{replica.base}/v1/chat/completions"
        ok = httpx.post(url, headers=_headers("frozen-model"), json=_chat("frozen-model"))
        assert ok.status_code == 200

        frozen.stop(pylon.process.pid)
        engine.stop()
        killed_at = time.monotonic()
        dropped_at = wait_until(
            lambda: _list_models(replica, "frozen-model") == [], 10, "ListModels to drop it"
        )
        stale_for = dropped_at - killed_at
        print(f"stale route lived {stale_for:.2f} s after the engine died")
        assert stale_for < 3.0

        started = time.monotonic()
        answer = httpx.post(url, headers=_headers("frozen-model"), json=_chat("frozen-model"))
        assert (answer.status_code, answer.content) == (503, b"")
        openai_form = httpx.post(url, json=_chat("frozen-model"))  # no x-model: OpenAI errors
        assert openai_form.status_code == 503
        assert openai_form.json()["error"]["code"] == "no_active_backend"  # nothing was tried
        assert time.monotonic() - started < 2.0
        assert pylon.process.poll() is None  # still frozen, not gone: its stream is open
    finally:
        frozen.resume_all()
        pylon.kill()
        replica.close()
        engine.stop()


# ---- a hung engine -----------------------------------------------------------------------------


async def _burst(
    replica: ProxyReplica,
    model: str,
    count: int,
    results: list[tuple[int, str, float]] | None = None,
) -> list[tuple[int, str, float]]:
    """`count` concurrent requests: (status, the backend that answered, seconds taken) each,
    appended to `results` as they complete."""
    results = [] if results is None else results

    async def one(client: httpx.AsyncClient, index: int) -> None:
        started = trio.current_time()
        response = await client.post(
            f"{replica.base}/v1/chat/completions",
            headers=_headers(model, f"burst-{index}"),
            json=_chat(model),
        )
        served_by = response.headers.get("x-inference-server-id", "")
        results.append((response.status_code, served_by, trio.current_time() - started))

    async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as nursery:
        for index in range(count):
            nursery.start_soon(one, client, index)
    return results


class TwoEngines:
    """Two mock engines behind one replica, each in its own cluster, registered directly."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.engines: dict[str, MockBackendProcess] = {}
        self.replica: ProxyReplica | None = None
        try:
            for server_id in ("engine-a", "engine-b"):
                self.engines[server_id] = launch_mock_backend("--model", "hung-model")
            self.replica = start_proxy_replica(
                tmp_path,
                f"--lb-config-path={_round_robin(tmp_path)}",
                f"--proxy-response-header-timeout-ms={HEAD_TIMEOUT_MS}",
                *extra,
            )
            self.streams = {
                server_id: self.replica.register(server_id, engine.url, ["hung-model"])
                for server_id, engine in self.engines.items()
            }
            wait_until(self._routable_on_both, 10, "both engines to answer through the replica")
        except BaseException:
            self.close()
            raise

    def _routable_on_both(self) -> bool:
        assert self.replica is not None
        seen = set()
        for index in range(4):
            response = httpx.post(
                f"{self.replica.base}/v1/chat/completions",
                headers=_headers("hung-model", f"warm-{index}"),
                json=_chat("hung-model"),
                timeout=5,
            )
            seen.add(response.headers.get("x-inference-server-id"))
        return seen == set(self.engines)

    def close(self) -> None:
        if self.replica is not None:
            self.replica.close()
        for engine in self.engines.values():
            engine.stop()


async def test_requests_waiting_on_a_hung_engine_move_when_its_probe_fails(
    tmp_path: Path, frozen: Frozen
) -> None:
    """engine-a freezes with requests waiting for its response head. The replica's probe of it
    times out (2 s here rather than 5 s, so the test is quick; the head timeout stays 30 s), the
    backend is unroutable, and the waiting requests complete on engine-b within seconds."""
    setup = TwoEngines(tmp_path, "--health-check-timeout-ms=2000")
    replica = setup.replica
    assert replica is not None
    try:
        frozen.stop(setup.engines["engine-a"].process.pid)
        results = await _burst(replica, "hung-model", 8)
        print("latencies:", sorted(round(elapsed, 2) for _, _, elapsed in results))
        assert {status for status, _, _ in results} == {200}
        assert {served_by for _, served_by, _ in results} == {"engine-b"}
        assert max(elapsed for _, _, elapsed in results) < MOVED_WITHIN
        moved = _counter(
            replica,
            "proxy_attempts_total",
            inference_server_id="engine-a",
            result="proxy_backend_unroutable",
        )
        assert moved >= 1  # they left engine-a because it became unroutable, not by a timeout
        assert _counter(replica, "proxy_attempts_total", result="proxy_502") == 0
        assert _list_models(replica, "hung-model") == ["hung-model"]  # engine-b still serves it
    finally:
        frozen.resume_all()
        setup.close()


async def test_requests_waiting_on_a_hung_engine_move_when_its_pylon_says_inactive(
    tmp_path: Path, frozen: Frozen
) -> None:
    """The same freeze, but the replica's probe is slower than the test (30 s timeout): what moves
    the waiting requests is the Pylon's INACTIVE update for engine-a."""
    setup = TwoEngines(tmp_path, "--health-check-timeout-ms=30000")
    replica = setup.replica
    assert replica is not None
    engine_a = setup.engines["engine-a"]
    try:
        frozen.stop(engine_a.process.pid)
        results: list[tuple[int, str, float]] = []

        async def burst() -> None:
            await _burst(replica, "hung-model", 8, results)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(burst)
            # Round robin: half the burst goes to engine-b and is answered at once; the other
            # half can only be waiting for engine-a's head. (A margin for a loaded machine.)
            with trio.fail_after(10):
                while len(results) < 4:  # noqa: ASYNC110 (no event for "answered by engine-b")
                    await trio.sleep(0.05)
            await trio.sleep(0.5)
            inactive = registration("engine-a", engine_a.url, {"hung-model": INACTIVE})
            await trio.to_thread.run_sync(setup.streams["engine-a"].exchange, inactive)
        print("latencies:", sorted(round(elapsed, 2) for _, _, elapsed in results))
        assert {status for status, _, _ in results} == {200}
        assert {served_by for _, served_by, _ in results} == {"engine-b"}
        assert max(elapsed for _, _, elapsed in results) < MOVED_WITHIN
        moved = _counter(
            replica,
            "proxy_attempts_total",
            inference_server_id="engine-a",
            result="proxy_backend_unroutable",
        )
        assert moved >= 1
    finally:
        frozen.resume_all()
        setup.close()
