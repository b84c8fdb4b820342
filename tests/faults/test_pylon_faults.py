"""Faults of the Pylons' registration streams: a Pylon that vanishes without closing its stream, a
Pylon that reconnects in a tight loop, and a thousand streams opened and dropped.

Real processes on loopback: a replica (`stargate serve`), a mock engine, a real `stargate pylon`
frozen with SIGSTOP, registration streams on grpcio channels (`tests/fakes/pylon.py`), and a
subprocess holding streams that is SIGKILLed.

Asserted, because a replica lives for weeks while Pylons come and go:

* a frozen Pylon's routes are removed once the registration idle timeout passes (its stream stays
  open, so nothing else can end it), the model then answers 404, and the Pylon registers again
  when it wakes up (docs/control-plane.md, Idle timeout);
* a Pylon reconnecting 100 times in a row leaves exactly one registration (one active backend,
  served), and none once it goes;
* 1,000 registration streams opened and dropped (cancelled, half-closed, their channel closed,
  their process killed) leave the replica as they found it: the routing state (`/debug/state`,
  the active backend count), the exported metric series, and its open file descriptors are
  exactly their prior values. The series set is exact here without waiting for the sweep's
  grace period (5 minutes, docs/metrics.md) because the churned backends register the model of
  a backend that stays and are sent no request, so no series names them; a departed backend
  that served requests would keep its series for the grace period by design. The replica's trio
  task count is not exported anywhere; its OS thread count is recorded in the tally notes (the
  thread cache of `trio.to_thread` grows and shrinks on its own, so it is not asserted exactly).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from tests.e2e.processes import MockBackendProcess, launch_mock_backend, wait_until
from tests.e2e.test_proxy import ProxyReplica, start_proxy_replica
from tests.e2e.test_pylon import PylonProcess
from tests.fakes.pylon import PylonStream, registration
from tests.faults.support import Tally, describe_sockets, metric_sum, open_fds, os_threads

pytestmark = pytest.mark.faults

MODEL = "model-a"
REPO = Path(__file__).resolve().parents[2]
SAMPLE_LINE = re.compile(r"^(?P<series>[^ #][^ ]*) (?P<value>\S+)$")


@pytest.fixture
def engine() -> Iterator[MockBackendProcess]:
    started = launch_mock_backend("--model", MODEL)
    yield started
    started.stop()


def _headers(request_id: str) -> dict[str, str]:
    return {"x-request-id": request_id, "x-input-tokens": "1", "x-model": MODEL}


def _chat(replica: ProxyReplica, request_id: str) -> httpx.Response:
    return httpx.post(
        f"{replica.base}/v1/chat/completions",
        headers=_headers(request_id),
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )


def _channel(target: str) -> grpc.Channel:
    """A channel with its own connection: grpcio otherwise shares one TCP connection among all
    channels to the same target, and one HTTP/2 connection carries at most 100 streams at once
    (later ones queue), which is not what a thousand Pylons look like."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def _active_models(replica: ProxyReplica) -> list[str]:
    models: list[str] = httpx.get(f"{replica.base}/debug/state", timeout=5).json()[
        "active_model_ids"
    ]
    return models


def _active_backends(replica: ProxyReplica) -> float:
    return metric_sum(replica.metrics(), "stargate_active_inference_servers", model=MODEL)


# ---- a Pylon that vanishes without closing -----------------------------------------------------


def test_a_frozen_pylons_routes_go_after_the_idle_timeout_and_come_back_when_it_wakes(
    tmp_path: Path, engine: MockBackendProcess, tally: Tally
) -> None:
    """The Pylon heartbeats every 200 ms, so its idle timeout is the 1 s floor. Frozen with
    SIGSTOP, it sends nothing and closes nothing, while its engine keeps serving and passing the
    replica's probe: only the idle timeout can end the registration, and it must, within the
    timeout plus a margin. Requests are served until then and get the documented 404 after.
    Resumed, the Pylon finds its stream ended and registers again."""
    idle_timeout = 1.0
    replica = start_proxy_replica(
        tmp_path,
        f"--registration-update-idle-timeout-ms={int(idle_timeout * 1000)}",
        "--registration-update-max-idle-timeout-ms=2000",
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
    frozen = False
    try:
        wait_until(lambda: _active_models(replica) == [MODEL], 20, "the Pylon's registration")
        tally.send()
        assert _chat(replica, "before").status_code == 200

        os.kill(pylon.process.pid, signal.SIGSTOP)
        frozen = True
        frozen_at = time.monotonic()
        tally.inject()
        gone_at = wait_until(lambda: _active_models(replica) == [], 10, "the routes to go")
        stale_for = gone_at - frozen_at
        tally.notes["routes_removed_after_s"] = round(stale_for, 2)
        assert stale_for < idle_timeout + 2.0
        assert "registration stream idle timeout" in replica.process.log
        tally.send()
        answer = _chat(replica, "frozen")
        assert answer.status_code == 404
        assert answer.headers["x-stargate-error-code"] == "no_eligible_candidates"
        assert pylon.process.poll() is None  # frozen, not gone

        os.kill(pylon.process.pid, signal.SIGCONT)
        frozen = False
        wait_until(lambda: _active_models(replica) == [MODEL], 20, "the Pylon to re-register")
        tally.send()
        assert _chat(replica, "woken").status_code == 200
        assert _active_backends(replica) == 1
    finally:
        if frozen:
            os.kill(pylon.process.pid, signal.SIGCONT)
        pylon.terminate()
        replica.close()


# ---- a Pylon reconnecting in a tight loop ------------------------------------------------------


def _register(
    target: str, server_id: str, url: str, rejected: list[grpc.StatusCode]
) -> tuple[grpc.Channel, PylonStream]:
    """Open a channel and a registration stream for `server_id`, retrying at once while the
    replica still holds the previous stream of the same id (ALREADY_EXISTS)."""
    deadline = time.monotonic() + 10
    while True:
        channel = _channel(target)
        stream = PylonStream(channel)
        stream.send(registration(server_id, url, [MODEL]))
        event = stream.next_event(timeout=10)
        if not isinstance(event, grpc.RpcError):
            assert event is not None, "the stream ended without an ack"
            return channel, stream
        channel.close()
        rejected.append(event.code())
        assert event.code() == grpc.StatusCode.ALREADY_EXISTS, event
        assert time.monotonic() < deadline, "the previous stream was never released"


def test_a_pylon_reconnecting_100_times_leaves_one_registration(
    tmp_path: Path, engine: MockBackendProcess, tally: Tally
) -> None:
    """The same Pylon (same inference server id) drops its stream and reconnects at once, 100
    times, alternating a cancelled call and a closed channel. A reconnect that reaches the replica
    before it has released the previous stream is refused with ALREADY_EXISTS (documented) and
    retried. At the end exactly one backend is active and serves; once the last stream goes the
    model is gone."""
    replica = start_proxy_replica(tmp_path)
    target = f"127.0.0.1:{replica.ports.grpc}"
    rejected: list[grpc.StatusCode] = []
    channel, stream = _register(target, "looping-engine", engine.url, rejected)
    try:
        for round_ in range(100):
            if round_ % 2:
                stream.cancel()
            channel.close()
            tally.inject()
            channel, stream = _register(target, "looping-engine", engine.url, rejected)
        tally.notes["already_exists_retries"] = len(rejected)
        wait_until(lambda: _active_backends(replica) == 1, 5, "one active backend")
        assert _active_models(replica) == [MODEL]
        for index in range(5):
            tally.send()
            response = _chat(replica, f"after-loop-{index}")
            assert response.status_code == 200
            assert response.headers["x-inference-server-id"] == "looping-engine"
        assert _active_backends(replica) == 1
    finally:
        stream.cancel()
        channel.close()
    wait_until(lambda: _active_models(replica) == [], 5, "the last registration to go")
    assert _active_backends(replica) == 0
    replica.close()


# ---- 1,000 streams opened and dropped ----------------------------------------------------------

CHURN = 1000
BATCH = 100
CHANNELS_PER_BATCH = 10

HOLDER = """
import sys, time, grpc
from tests.fakes.pylon import PylonStream, registration
target, url, model, first, count, channels = sys.argv[1:7]
first, count, channels = int(first), int(count), int(channels)
options = [("grpc.use_local_subchannel_pool", 1)]
opened = [grpc.insecure_channel(target, options=options) for _ in range(channels)]
streams = []
for n in range(count):
    stream = PylonStream(opened[n % channels])
    stream.exchange(registration(f"churn-{first + n}", url, [model]), timeout=30)
    streams.append(stream)
print("ready", flush=True)
time.sleep(600)
"""


def _series(text: str) -> set[str]:
    """Every exported series (name and labels), without values."""
    return {m["series"] for line in text.splitlines() if (m := SAMPLE_LINE.match(line))}


def _snapshot(replica: ProxyReplica) -> dict[str, Any]:
    state = httpx.get(f"{replica.base}/debug/state", timeout=5).json()
    return {
        "state": json.dumps(state, sort_keys=True),
        "series": _series(replica.metrics()),
        "active": _active_backends(replica),
    }


def _settled_descriptors(
    pid: int, engine: MockBackendProcess, expected: int | None = None
) -> tuple[int, list[str]]:
    """The replica's open descriptor count and TCP sockets once they are steady: no socket in
    CLOSE_WAIT (a client that has just closed: the metrics listener releases such a connection
    only at its 5 s keep-alive timeout), exactly one connection to the engine (the anchor's
    health probe, once a second; extra keep-alive connections of the probes' client expire after
    5 s idle), and, with `expected`, the count back to it. Returns what it sees after 30 s if
    that never happens, for the assertion to show."""
    engine_port = engine.url.rsplit(":", 1)[1]

    def settled() -> bool:
        sockets = describe_sockets(pid)
        if any(entry.endswith("CLOSE_WAIT") for entry in sockets):
            return False
        if sum(entry.split()[0].endswith(f"->{engine_port}") for entry in sockets) != 1:
            return False
        return expected is None or open_fds(pid) == expected

    deadline = time.monotonic() + 30
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.1)
    return open_fds(pid), describe_sockets(pid)


def _open_batch(target: str, url: str, first: int) -> tuple[list[grpc.Channel], list[PylonStream]]:
    channels = [_channel(target) for _ in range(CHANNELS_PER_BATCH)]
    streams = [PylonStream(channels[n % CHANNELS_PER_BATCH]) for n in range(BATCH)]
    for n, stream in enumerate(streams):
        stream.send(registration(f"churn-{first + n}", url, [MODEL]))
    for stream in streams:
        event = stream.next_event(timeout=30)
        assert event is not None and not isinstance(event, grpc.RpcError), event
    return channels, streams


def _drop_batch(how: str, channels: list[grpc.Channel], streams: list[PylonStream]) -> None:
    if how == "cancel":  # RST_STREAM CANCEL, channels left open until the end of the batch
        for stream in streams:
            stream.cancel()
    elif how == "half-close":  # the client ends its side; the replica ends the call with OK
        for stream in streams:
            stream.close()
        for stream in streams:
            with contextlib.suppress(queue.Empty):
                stream.finish(timeout=10)
    # "close": the channels go with their streams still open
    for channel in channels:
        channel.close()


def _hold_in_subprocess(target: str, url: str, first: int) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOLDER,
            target,
            url,
            MODEL,
            str(first),
            str(BATCH),
            str(CHANNELS_PER_BATCH),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    line = holder.stdout.readline()
    if line.strip() != "ready":
        holder.kill()
        raise AssertionError(f"the stream holder did not start: {line!r}")
    return holder


@pytest.mark.timeout(240)
def test_a_thousand_registration_streams_opened_and_dropped_leave_no_trace(
    tmp_path: Path, engine: MockBackendProcess, tally: Tally
) -> None:
    replica = start_proxy_replica(tmp_path, "--log-level=warning")
    target = f"127.0.0.1:{replica.ports.grpc}"
    pid = replica.process.process.pid
    anchor = replica.register("anchor", engine.url, [MODEL])
    try:
        wait_until(lambda: _active_models(replica) == [MODEL], 5, "the anchor to be active")
        fds_before, sockets_before = _settled_descriptors(pid, engine)
        before = _snapshot(replica)
        threads_before = os_threads(pid)

        ways = ["cancel", "half-close", "close", "kill"]
        peak = 0.0
        for batch in range(CHURN // BATCH):
            first = batch * BATCH
            how = ways[batch % len(ways)]
            if how == "kill":  # the Pylon's process dies: the kernel closes its sockets
                holder = _hold_in_subprocess(target, engine.url, first)
                peak = max(peak, _active_backends(replica))
                holder.kill()
                holder.wait()
            else:
                channels, streams = _open_batch(target, engine.url, first)
                peak = max(peak, _active_backends(replica))
                _drop_batch(how, channels, streams)
            tally.inject(BATCH)
        assert peak == BATCH + 1  # every stream of a batch was registered at once

        wait_until(lambda: _active_backends(replica) == 1, 20, "the churned backends to go")
        after = _snapshot(replica)
        fds_after, sockets_after = _settled_descriptors(pid, engine, expected=fds_before)
        tally.notes.update(
            peak_active_backends=peak,
            fds_before=fds_before,
            fds_after=fds_after,
            threads_before=threads_before,
            threads_after=os_threads(pid),
        )
        assert after["state"] == before["state"]
        assert after["series"] == before["series"]
        assert after["active"] == before["active"] == 1
        assert fds_after == fds_before, (sockets_before, sockets_after)
        tally.send()
        response = _chat(replica, "after")
        assert response.status_code == 200
        assert response.headers["x-inference-server-id"] == "anchor"
    finally:
        anchor.cancel()
        replica.close()
