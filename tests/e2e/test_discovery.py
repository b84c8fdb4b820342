"""Static peers end to end: three real `stargate serve` replicas on loopback list each other,
leave out a killed one after the absent period, and list it again once it is back
(docs/discovery.md; the rules themselves are tested in tests/unit/control_plane/test_discovery.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc

from stargate.protocol import stargate_pb2 as pb
from stargate.protocol import stargate_pb2_grpc as pb_grpc
from tests.e2e.processes import Ports, StargateProcess, launch, stop, wait_until


def _listed(port: int) -> set[str]:
    """The replica ids the first `WatchStargates` message from the replica at `port` lists."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.StargateControlPlaneStub(channel).WatchStargates(  # type: ignore[no-untyped-call]
            pb.WatchStargatesRequest(), timeout=5
        )
        snapshot = next(call)
        call.cancel()
    return {entry.stargate_id for entry in snapshot.stargates}


def test_real_replicas_leave_out_a_killed_static_peer_and_list_it_again_on_restart(
    tmp_path: Path,
) -> None:
    """Three replicas list each other as static peers; one is killed, then restarted."""
    ports = {name: Ports.pick() for name in ("a", "b", "c")}
    peers = ",".join(f"{name}=127.0.0.1:{p.grpc}" for name, p in ports.items())

    def start(name: str) -> StargateProcess:
        return launch(
            tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}.log",
            "serve",
            f"--stargate-id={name}",
            *ports[name].args(),
            f"--peer={peers}",
            "--peer-absent-after-ms=1000",
            "--dns-poll-ms=200",
            "--readiness-warmup-ms=0",
            "--shutdown-delay-ms=0",
        )

    def everyone_lists(names: set[str], among: tuple[str, ...]) -> bool:
        return all(_listed(ports[name].grpc) == names for name in among)

    processes = {name: start(name) for name in ports}
    try:
        wait_until(lambda: everyone_lists({"a", "b", "c"}, ("a", "b", "c")), 20, "three replicas")
        # Taken before the kill: `stop` returns once the process is reaped, which can be after
        # the first check already failed (a run measured 0.974 s with it taken after).
        killed = time.monotonic()
        stop(processes["c"])  # SIGKILL: no goodbye, the port just stops answering
        gone = wait_until(lambda: everyone_lists({"a", "b"}, ("a", "b")), 10, "c left out")
        assert gone - killed >= 1.0  # not before the absent period
        processes["c"] = start("c")
        wait_until(lambda: everyone_lists({"a", "b", "c"}, ("a", "b", "c")), 20, "c listed again")
    finally:
        for process in processes.values():
            stop(process)
