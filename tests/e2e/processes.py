"""Handles for real `stargate` processes on loopback, shared by the end-to-end tests and the
fault suite: start, stop, free ports, wait for a condition."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from stargate.protocol import stargate_pb2 as pb
from stargate.protocol import stargate_pb2_grpc as pb_grpc


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll `predicate` every 20 ms (transport errors count as "not yet"); return when it held."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return time.monotonic()
        except (httpx.TransportError, grpc.RpcError) as error:
            last_error = error
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what} (last error: {last_error!r})")


def free_port() -> int:
    """A loopback port that was free a moment ago, below the kernel's ephemeral range.

    Ports the OS picks for `bind(0)` come from the ephemeral range, which every outgoing
    connection of every process on the machine also draws from; between the pick and the
    replica's bind one of them could take it. Below that range only listeners compete.

    A port is never handed out twice by one test process: the pick releases its probe socket,
    so two picks before the replica binds could otherwise agree (`Ports.pick` once gave the
    gRPC and the model-discovery listener the same port, and the replica exited with
    "Address already in use").
    """
    low, high = _PORT_RANGE
    if len(_handed_out) > (high - low) // 2:
        _handed_out.clear()  # a very long session: forget the oldest picks rather than fail
    for _ in range(200):
        port = _rng.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def _ephemeral_low() -> int:
    try:
        return max(
            21_000, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        )
    except (OSError, ValueError, IndexError):
        return 32_768


def _port_range(ephemeral_low: int) -> tuple[int, int]:
    """This test process's slice of [20000, ephemeral_low): under pytest-xdist each worker picks
    from its own slice, so two workers never hand out one port between a pick and a bind."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return 20_000, ephemeral_low
    index = int(worker.removeprefix("gw")) % count
    width = (ephemeral_low - 20_000) // count
    return 20_000 + index * width, 20_000 + (index + 1) * width


_EPHEMERAL_LOW = _ephemeral_low()
_PORT_RANGE = _port_range(_EPHEMERAL_LOW)
_rng = random.Random()
_handed_out: set[int] = set()


BIND_ATTEMPTS = 3
"""A process whose picked port was taken before it bound it (by a process of another test run on
the same machine: the ports of one run never collide) is started again on fresh ports."""


def lost_a_port(process: StargateProcess) -> bool:
    """Whether `process` exited because a port picked for it was taken meanwhile."""
    return process.process.poll() is not None and "Address already in use" in process.log


@dataclass
class StargateProcess:
    """A `stargate` subprocess with its log captured to a file."""

    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


# Sets the open-file limit, then execs the interpreter with the rest of its arguments. A
# `preexec_fn` would do it between fork and exec, but forking a test process in which gRPC runs
# threads crashed the child at times (grpc's fork handlers: "Check failed: next_worker->state").
_WITH_OPEN_FILES = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


def launch(log_path: Path, *args: str, open_files: int | None = None) -> StargateProcess:
    """Start `python -m stargate ARGS...` with its output in `log_path`; `open_files`: its
    open-file limit (soft and hard)."""
    command = [sys.executable, "-m", "stargate", *args]
    if open_files is not None:
        command = [sys.executable, "-c", _WITH_OPEN_FILES, str(open_files), *command[1:]]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return StargateProcess(process, log_path)


def stop(handle: StargateProcess) -> None:
    if handle.process.poll() is None:
        handle.process.kill()
        handle.process.wait()


@dataclass(frozen=True)
class Ports:
    """Free loopback ports for every listener of one replica."""

    http: int
    grpc: int
    discovery: int
    metrics: int

    @classmethod
    def pick(cls) -> Ports:
        return cls(free_port(), free_port(), free_port(), free_port())

    def args(self) -> list[str]:
        return [
            f"--http-listen-addr=127.0.0.1:{self.http}",
            f"--listen-addr=127.0.0.1:{self.grpc}",
            f"--model-discovery-listen-addr=127.0.0.1:{self.discovery}",
            f"--metrics-port={self.metrics}",
        ]


@dataclass
class MockBackendProcess:
    """A `stargate mock-backend` subprocess on a loopback port."""

    process: subprocess.Popen[str]
    url: str

    def control(self, **knobs: object) -> None:
        response = httpx.post(f"{self.url}/test-control", json=knobs, timeout=5)
        response.raise_for_status()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def mock_engine_command(model: str, *extra: str) -> list[str]:
    """The command of a model pool member (the `process` controller) that runs `stargate
    mock-backend` for `model` on the port the controller picks (`{port}`)."""
    command = [sys.executable, "-m", "stargate", "mock-backend", "--port", "{port}"]
    return [*command, "--model", model, "--log-level", "warning", *extra]


def launch_mock_backend(*args: str) -> MockBackendProcess:
    """Start `python -m stargate mock-backend --port 0 ARGS...` and wait for its port."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stargate",
            "mock-backend",
            "--port",
            "0",
            "--log-level",
            "warning",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("listening on "):
        process.kill()
        raise AssertionError(f"mock backend did not start: {line!r}")
    return MockBackendProcess(process, line.split()[-1])


class Replica:
    """A `stargate serve` process and clients for its discovery and HTTP listeners."""

    def __init__(self, log_dir: Path, name: str, *extra: str, ports: Ports | None = None) -> None:
        self.name = name
        self.extra = extra
        self.log_dir = log_dir
        for attempt in range(1 if ports is not None else BIND_ATTEMPTS):
            self.ports = ports or Ports.pick()
            self.process = self._launch()
            if not self._lost_a_port_at_start() or attempt + 1 == BIND_ATTEMPTS:
                break
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.ports.discovery}")
        self.discovery = pb_grpc.StargateModelDiscoveryStub(self.channel)  # type: ignore[no-untyped-call]
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.ports.http}", timeout=5)
        self.wait_up()

    def _lost_a_port_at_start(self) -> bool:
        """Wait until the replica serves or exits; True if it exited for a taken port."""
        deadline = time.monotonic() + 15
        url = f"http://127.0.0.1:{self.ports.http}/healthz"
        while time.monotonic() < deadline and self.process.process.poll() is None:
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return False
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        return lost_a_port(self.process)

    def _launch(self) -> StargateProcess:
        return launch(
            self.log_dir / f"replica-{self.name}-{self.ports.grpc}.log",
            "serve",
            f"--stargate-id={self.name}",
            *self.ports.args(),
            "--readiness-warmup-ms=0",
            "--dns-poll-ms=100",
            "--watch-heartbeat-ms=1000",
            *self.extra,
        )

    def wait_up(self) -> None:
        wait_until(lambda: self.http.get("/healthz").status_code == 200, 15, f"replica {self.name}")

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    def list_models(self, *model_ids: str) -> list[str]:
        request = pb.ListModelsRequest(model_ids=list(model_ids))
        return list(self.discovery.ListModels(request, timeout=5).model_ids)

    def http_models(self) -> list[str]:
        return list(self.http.get("/v1/models").json()["model_ids"])

    def wait_models(self, expected: list[str], *model_ids: str, timeout: float = 10) -> None:
        wait_until(
            lambda: self.list_models(*model_ids) == expected,
            timeout,
            f"models {expected} on replica {self.name}",
        )

    def restart(self) -> None:
        stop(self.process)
        self.process = self._launch()
        self.wait_up()

    def close(self) -> None:
        self.channel.close()
        self.http.close()
        stop(self.process)


class PylonProcess:
    """The Pylon CLI as a subprocess, its log captured to a file."""

    def __init__(self, log_path: Path, *args: str | Path) -> None:
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from stargate.pylon.cli import pylon_command; pylon_command()",
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 10) -> int:
        """SIGTERM, then wait for the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
