"""`stargate pylon` end to end: real replicas (`stargate serve`), real mock engines
(`stargate mock-backend`) and the Pylon itself as a subprocess, all on loopback with the real
clock. Pure helpers (backoff, snapshot building, discovery bookkeeping) are tested directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from stargate.protocol import stargate_pb2 as pb
from stargate.pylon import PylonConfig, run_pylon
from stargate.pylon.backoff import Backoff
from stargate.pylon.config import (
    DialTarget,
    PylonConfigError,
    parse_dial_target,
    parse_upstream_url,
)
from stargate.pylon.snapshot import (
    ReplicaInfo,
    WatchResult,
    build_registration,
    desired_replicas,
    parse_model_list,
    parse_watch_response,
    reachable_watches,
)
from stargate.routing.stats import ModelStats
from tests.e2e.processes import (
    MockBackendProcess,
    PylonProcess,
    Replica,
    launch_mock_backend,
    wait_until,
)

HEARTBEAT_FLAGS = ("--min-update-interval-ms", "200", "--model-refresh-ms", "200")

# ---- processes ----------------------------------------------------------------------------------


StartPylon = Callable[..., PylonProcess]
StartMock = Callable[..., MockBackendProcess]


@pytest.fixture
def pylons(tmp_path: Path) -> Iterator[StartPylon]:
    """Start Pylon subprocesses; every one is killed at teardown if still running."""
    started: list[PylonProcess] = []

    def start(*args: str) -> PylonProcess:
        handle = PylonProcess(tmp_path / f"pylon-{len(started)}.log", *args)
        started.append(handle)
        return handle

    yield start
    for handle in started:
        handle.kill()


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    handle = Replica(tmp_path_factory.mktemp("replica"), "solo", "--disable-dns-discovery")
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def replica_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Replica, Replica]]:
    """Replica A announces B (static peer); B announces only itself."""
    log_dir = tmp_path_factory.mktemp("pair")
    b = Replica(log_dir, "pair-b", "--disable-dns-discovery")
    a: Replica | None = None
    try:
        a = Replica(log_dir, "pair-a", f"--peer=pair-b={b.grpc_addr}")
        yield a, b
    finally:
        if a is not None:
            a.close()
        b.close()


@pytest.fixture
def mock_backends() -> Iterator[StartMock]:
    started: list[MockBackendProcess] = []

    def start(models: str, *args: str) -> MockBackendProcess:
        handle = launch_mock_backend("--model", models, *args)
        started.append(handle)
        return handle

    yield start
    for handle in started:
        handle.stop()


# ---- end to end ---------------------------------------------------------------------------------


def test_registers_discovered_models_and_sigterm_deregisters(
    replica: Replica, mock_backends: StartMock, pylons: StartPylon
) -> None:
    engine = mock_backends("disc-a,disc-b")
    pylon = pylons("--upstream", engine.url, "--stargate", replica.grpc_addr, *HEARTBEAT_FLAGS)
    replica.wait_models(["disc-a", "disc-b"], "disc-a", "disc-b")
    assert {"disc-a", "disc-b"} <= set(replica.http_models())
    wait_until(lambda: "registered with replica solo" in pylon.log, 5, "the log line")

    assert pylon.terminate() == 0
    replica.wait_models([], "disc-a", "disc-b", timeout=3)
    assert "received SIGTERM" in pylon.log
    assert "Traceback" not in pylon.log


def test_model_set_follows_the_upstream(
    replica: Replica, mock_backends: StartMock, pylons: StartPylon
) -> None:
    """A model the engine stops listing is dropped at the next refresh."""
    engine = mock_backends("follow-a,follow-b")
    pylons("--upstream", engine.url, "--stargate", replica.grpc_addr, *HEARTBEAT_FLAGS)
    replica.wait_models(["follow-a", "follow-b"], "follow-a", "follow-b")
    # The mock's model list is fixed at start, so replace the engine behind the same URL.
    port = engine.url.rsplit(":", 1)[1]
    engine.stop()
    replica.wait_models([], "follow-a", "follow-b", timeout=5)  # down: INACTIVE
    replacement = mock_backends("follow-b", "--port", port)
    assert replacement.url == engine.url
    replica.wait_models(["follow-b"], "follow-a", "follow-b", timeout=5)


def test_explicit_model_names_restrict_the_registration(
    replica: Replica, mock_backends: StartMock, pylons: StartPylon
) -> None:
    """Only the named models are registered; one the engine does not serve fails its canary
    (the engine answers 400) and is INACTIVE: advertised, never routed to."""
    engine = mock_backends("only-a,only-b")
    pylon = pylons(
        "--upstream",
        engine.url,
        "--stargate",
        replica.grpc_addr,
        "--model-name",
        "only-a,extra-model",
        "--canary-interval-ms",
        "200",
        *HEARTBEAT_FLAGS,
    )
    replica.wait_models(["only-a"], "only-a", "only-b", "extra-model")
    wait_until(lambda: "canary of extra-model failed" in pylon.log, 5, "the canary failure")
    assert "canary of only-a failed" not in pylon.log
    assert replica.list_models("only-b") == []
    assert replica.list_models("extra-model") == []


def test_follows_announced_replicas_and_upstream_health(
    replica_pair: tuple[Replica, Replica], mock_backends: StartMock, pylons: StartPylon
) -> None:
    a, b = replica_pair
    engine = mock_backends("pair-model")
    pylon = pylons("--upstream", engine.url, "--stargate", a.grpc_addr, *HEARTBEAT_FLAGS)
    a.wait_models(["pair-model"], "pair-model")
    b.wait_models(["pair-model"], "pair-model")
    wait_until(lambda: "registered with replica pair-b" in pylon.log, 5, "the log line")

    engine.control(healthy=False)
    a.wait_models([], "pair-model", timeout=5)
    b.wait_models([], "pair-model", timeout=5)
    # The replicas' own health probes may drop the backend before the Pylon's next probe sees
    # it: two observers of one engine, so the Pylon's log line may come a probe period later.
    wait_until(lambda: "upstream unhealthy" in pylon.log, 5, "the Pylon's unhealthy log line")

    engine.control(healthy=True)
    a.wait_models(["pair-model"], "pair-model", timeout=5)
    b.wait_models(["pair-model"], "pair-model", timeout=5)


def test_reregisters_after_the_replica_restarts(
    tmp_path: Path, mock_backends: StartMock, pylons: StartPylon
) -> None:
    restarting = Replica(tmp_path, "restarting", "--disable-dns-discovery")
    try:
        engine = mock_backends("restart-model")
        pylon = pylons(
            "--upstream", engine.url, "--stargate", restarting.grpc_addr, *HEARTBEAT_FLAGS
        )
        restarting.wait_models(["restart-model"])
        restarting.restart()
        restarting.wait_models(["restart-model"], timeout=10)
        wait_until(
            lambda: pylon.log.count("registered with replica restarting") == 2,
            5,
            "the second registration log line",
        )
        assert pylon.process.poll() is None
    finally:
        restarting.close()


def test_duplicate_id_retries_until_the_holder_leaves(
    replica: Replica, mock_backends: StartMock, pylons: StartPylon
) -> None:
    first_engine = mock_backends("dup-first")
    second_engine = mock_backends("dup-second")
    common = ("--stargate", replica.grpc_addr, "--inference-server-id", "dup-id")
    first = pylons("--upstream", first_engine.url, *common, *HEARTBEAT_FLAGS)
    replica.wait_models(["dup-first"], "dup-first")
    second = pylons("--upstream", second_engine.url, *common, *HEARTBEAT_FLAGS)
    wait_until(lambda: "ALREADY_EXISTS" in second.log, 10, "the ALREADY_EXISTS log line")
    time.sleep(0.6)  # several retries (backoff 0.1, 0.2, 0.4 s), all refused
    assert replica.list_models("dup-first", "dup-second") == ["dup-first"]
    assert "registered with replica" not in second.log
    assert second.process.poll() is None

    assert first.terminate() == 0
    replica.wait_models(["dup-second"], "dup-first", "dup-second", timeout=10)
    wait_until(lambda: "registered with replica solo" in second.log, 5, "the log line")


def test_bearer_token_from_the_token_file(
    tmp_path: Path, mock_backends: StartMock, pylons: StartPylon
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    guarded = Replica(
        tmp_path, "guarded", "--disable-dns-discovery", f"--registration-token-file={token}"
    )
    try:
        engine = mock_backends("token-model")
        common = ("--upstream", engine.url, "--stargate", guarded.grpc_addr, *HEARTBEAT_FLAGS)
        refused = pylons(*common, "--inference-server-id", "no-token")
        wait_until(lambda: "UNAUTHENTICATED" in refused.log, 10, "the UNAUTHENTICATED log line")
        accepted = pylons(*common, "--inference-server-id", "with-token", "--token-file", token)
        guarded.wait_models(["token-model"])
        assert accepted.terminate() == 0
        assert "s3cret" not in accepted.log
    finally:
        guarded.close()


def test_unreachable_upstream_registers_inactive_without_waiting(
    replica: Replica, pylons: StartPylon
) -> None:
    """--upstream-health-wait-ms 0: one probe, then the models are registered INACTIVE."""
    pylon = pylons(
        "--upstream",
        "http://127.0.0.1:9",
        "--stargate",
        replica.grpc_addr,
        "--model-name",
        "never-up",
        "--upstream-health-wait-ms",
        "0",
        *HEARTBEAT_FLAGS,
    )
    wait_until(lambda: "registered with replica solo" in pylon.log, 10, "the registration")
    assert "INACTIVE" in pylon.log
    assert replica.list_models("never-up") == []
    assert pylon.terminate() == 0


async def test_run_pylon_in_process_cancels_cleanly(
    replica: Replica, mock_backends: StartMock
) -> None:
    """The library entry point: started() after the health wait, cancel ends every stream and
    leaves no worker thread behind."""
    engine = mock_backends("lib-model")
    config = PylonConfig(
        upstream_url=engine.url,
        stargates=(DialTarget(replica.grpc_addr),),
        model_names=("lib-model",),
        inference_server_id="lib-pylon",
        min_update_interval_ms=200,
    )

    async with trio.open_nursery() as nursery:
        await nursery.start(run_pylon, config)
        await trio.to_thread.run_sync(lambda: replica.wait_models(["lib-model"], "lib-model"))
        nursery.cancel_scope.cancel()
    await trio.to_thread.run_sync(lambda: replica.wait_models([], "lib-model", timeout=3))
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pylon-")]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--upstream", "ftp://127.0.0.1:8000"), "http:// or https://"),
        (("--upstream", "http://127.0.0.1:8000", "--min-update-interval-ms", "0"), "0"),
        (("--upstream", "http://127.0.0.1:8000", "--stargate", "no-port"), "no port"),
        (("--upstream", "http://127.0.0.1:8000", "--stargate", "127.0.0.1:99999"), "port"),
        (("--stargate", "127.0.0.1:50071"), "--upstream"),
    ],
)
def test_bad_flags_are_usage_errors(
    flags: tuple[str, ...], message: str, pylons: StartPylon
) -> None:
    pylon = pylons(*flags)
    assert pylon.process.wait(timeout=10) == 2
    assert message in pylon.log


def test_env_vars_configure_the_pylon(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from stargate.pylon.cli import pylon_command; pylon_command()",
        ],
        env={
            **os.environ,
            "STARGATE_PYLON_UPSTREAM": "http://127.0.0.1:8000",
            "STARGATE_PYLON_MIN_UPDATE_INTERVAL_MS": "-5",
        },
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert result.returncode == 2
    assert "--min-update-interval-ms" in result.stderr


# ---- pure helpers -------------------------------------------------------------------------------


def test_backoff_doubles_to_the_cap_with_jitter_inside_the_cap_and_resets() -> None:
    """Jitter is applied before the cap, so the cap is a real bound on every delay (an outage
    leaves every Pylon at the cap, and the cap is what readiness windows are sized against)."""
    backoff = Backoff(0.1, 1.0, uniform=lambda low, high: high)
    delays = [round(backoff.next(), 6) for _ in range(6)]
    assert delays == [0.12, 0.24, 0.48, 0.96, 1.0, 1.0]
    backoff.reset()
    assert round(backoff.next(), 6) == 0.12
    low = Backoff(0.1, 1.0, uniform=lambda low, high: low)
    assert [round(low.next(), 6) for _ in range(6)] == [0.08, 0.16, 0.32, 0.64, 0.8, 0.8]
    jittered = Backoff(1.0, 1.0)
    assert all(0.8 <= jittered.next() <= 1.0 for _ in range(100))
    capped = Backoff(0.1, 5.0)
    assert max(capped.next() for _ in range(200)) <= 5.0


def test_registration_message() -> None:
    stats = ModelStats(
        last_mean_input_tps=120.5,
        queue_size=2,
        queued_input_size=40,
        queue_time_estimate_ms_by_priority=((0, 333), (4, 500)),
        stats_observed_at_unix_ms=1234,
        stats_capabilities=("request.output.chunk_usage",),
        stats_sources=("chunk_usage",),
    )
    message = build_registration(
        inference_server_id="id",
        inference_server_url="http://10.0.0.1:8000",
        cluster_id="",
        models={"a": (stats, True), "b": (ModelStats(), False)},
    )
    assert sorted(message.models) == ["a", "b"]
    assert message.models["a"].status == pb.INFERENCE_SERVER_STATUS_ACTIVE
    assert message.models["b"].status == pb.INFERENCE_SERVER_STATUS_INACTIVE
    assert message.models["b"].HasField("stats")  # an empty one: without it the model is INACTIVE
    wire = message.models["a"].stats
    assert wire.last_mean_input_tps == 120.5
    assert (wire.queue_size, wire.queued_input_size) == (2, 40)
    assert dict(wire.queue_time_estimate_ms_by_priority) == {0: 333, 4: 500}
    assert wire.stats_observed_at_unix_ms == 1234
    assert list(wire.stats_capabilities) == ["request.output.chunk_usage"]
    assert list(wire.stats_sources) == ["chunk_usage"]
    assert not message.reverse_tunnel


def test_parse_model_list() -> None:
    body = {"object": "list", "data": [{"id": "b"}, {"id": "a"}, {"id": "a"}, {"id": " "}]}
    assert parse_model_list(body) == ("a", "b")
    bad_bodies: list[object] = [[], {"data": "x"}, {"data": [{"name": "a"}]}]
    for bad in bad_bodies:
        with pytest.raises(ValueError):
            parse_model_list(bad)


def test_address_parsing() -> None:
    assert parse_dial_target("127.0.0.1:50071") == DialTarget("127.0.0.1:50071")
    assert parse_dial_target("[::1]:5") == DialTarget("[::1]:5")
    assert parse_dial_target("Stargate.Example:1") == DialTarget("stargate.example:1")
    assert parse_dial_target("https://sg.example") == DialTarget("sg.example:443", secure=True)
    assert parse_dial_target("other-region", default_port=50071) == DialTarget("other-region:50071")
    for bad in ("", "host", "host:0", "host:x", "::1:5", "ftp://h:1", "a b:1", "bad_host!:1"):
        with pytest.raises(PylonConfigError):
            parse_dial_target(bad)
    assert parse_upstream_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    for bad in ("127.0.0.1:8000", "quic://1.2.3.4:5", "http://", "http://h:0", "http://h/?q=1"):
        with pytest.raises(PylonConfigError):
            parse_upstream_url(bad)
    config = PylonConfig(upstream_url="http://127.0.0.1:8123")
    assert config.inference_server_id.endswith(":8123")
    with pytest.raises(PylonConfigError):
        PylonConfig(upstream_url="http://h:1", min_update_interval_ms=0)


def test_watch_bookkeeping() -> None:
    seed = DialTarget("seed:1")
    remote = DialTarget("remote:2")
    loop = DialTarget("loop:3")
    response = pb.WatchStargatesResponse(
        stargates=[
            pb.StargateInfo(stargate_id="a", advertise_addr="10.0.0.1:50071"),
            pb.StargateInfo(
                stargate_id="b", advertise_addr="10.0.0.2:50071", grpc_pylon_dial_addr="lb:7"
            ),
            pb.StargateInfo(stargate_id="no-address"),
        ],
        watch_stargate_urls=["remote:2", "not an address"],
    )
    parsed = parse_watch_response(response)
    assert parsed.watch_urls == {remote}
    assert parsed.replicas == {
        ReplicaInfo("10.0.0.1:50071", DialTarget("10.0.0.1:50071")),
        ReplicaInfo("10.0.0.2:50071", DialTarget("lb:7")),
    }
    remote_result = WatchResult(
        frozenset({ReplicaInfo("10.1.0.1:50071", DialTarget("10.1.0.1:50071"), "r")}),
        frozenset({loop}),
    )
    loop_result = WatchResult(frozenset(), frozenset({remote}))
    results = {seed: parsed, remote: remote_result, loop: loop_result}
    assert reachable_watches([seed], results) == {seed, remote, loop}
    assert len(desired_replicas([seed, remote, loop], results)) == 3
    # The seed's watch dropped: what only it announced (directly or not) is no longer watched,
    # even though remote and loop announce each other.
    del results[seed]
    assert reachable_watches([seed], results) == {seed}
    assert desired_replicas([seed], results) == frozenset()
