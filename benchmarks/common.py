"""Pieces the loopback benchmarks share (benchmarks/proxy.py, benchmarks/capacity.py): process
handles, free ports, `/proc` readings and a Pylon-like registration stream."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = [
    "CLK_TCK",
    "HEARTBEAT_HEADER",
    "ROOT",
    "BenchError",
    "Deadline",
    "Processes",
    "Registration",
    "cpu_seconds",
    "free_ports",
    "log_tail",
    "memory_kib",
    "read_line",
    "start_printing_server",
    "wait_until",
]

ROOT = Path(__file__).resolve().parent.parent
HEARTBEAT_HEADER = "x-stargate-registration-heartbeat-ms"
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    """The benchmark could not run (a process did not start, a phase failed outright)."""


# ---- /proc readings -----------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (every thread, not its children), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        data = stat.read()
    # Fields after the parenthesised command name start at field 3 (state); utime is field 14.
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of process `pid` from `/proc/<pid>/status`, in KiB."""
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0])  # "  12345 kB"
    return values["VmRSS"], values["VmHWM"]


# ---- process management -------------------------------------------------------------------------


class Deadline:
    """The whole run's time budget; every wait takes the smaller of its own cap and what is left."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, cap: float) -> float:
        return max(0.0, min(cap, self.end - time.monotonic()))


class Processes:
    """Every subprocess this run starts; `stop_all` ends each one (by its own handle) with its
    stop signal (SIGTERM unless `spawn` was told otherwise), then kills what is left."""

    def __init__(self) -> None:
        self._started: list[tuple[subprocess.Popen[Any], signal.Signals]] = []

    def spawn(
        self, args: list[str], *, stop_signal: signal.Signals = signal.SIGTERM, **kwargs: Any
    ) -> subprocess.Popen[Any]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        process: subprocess.Popen[Any] = subprocess.Popen(args, cwd=ROOT, env=env, **kwargs)
        self._started.append((process, stop_signal))
        return process

    def stop(self, process: subprocess.Popen[Any], timeout: float = 5) -> None:
        """Stop one process this object started (stop signal, wait, kill)."""
        for started, stop_signal in self._started:
            if started is process:
                self._stop([(started, stop_signal)], timeout)
                return

    def stop_all(self) -> None:
        self._stop(list(reversed(self._started)), 5)

    @staticmethod
    def _stop(
        processes: list[tuple[subprocess.Popen[Any], signal.Signals]], timeout: float
    ) -> None:
        for process, stop_signal in processes:
            if process.poll() is None:
                process.send_signal(stop_signal)
        for process, _ in processes:
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            for pipe in (process.stdin, process.stdout):
                if pipe is not None and not pipe.closed:
                    with contextlib.suppress(OSError):  # a broken stdin pipe: the process is gone
                        pipe.close()


def read_line(stream: IO[str], timeout: float) -> str:
    """The next line of `stream`, or "" if none arrives within `timeout` seconds."""
    box: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: box.put(stream.readline()), daemon=True).start()
    try:
        return box.get(timeout=timeout)
    except queue.Empty:
        return ""


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_printing_server(
    procs: Processes,
    args: list[str],
    log_path: Path,
    what: str,
    timeout: float,
    **kwargs: Any,
) -> tuple[subprocess.Popen[Any], int]:
    """Start a server that prints `listening on http://HOST:PORT` on stdout; return its port."""
    with log_path.open("wb") as log:
        process = procs.spawn(args, stdout=subprocess.PIPE, stderr=log, text=True, **kwargs)
    assert process.stdout is not None
    line = read_line(process.stdout, timeout)
    if not line.startswith("listening on "):
        raise BenchError(f"{what} did not start: {line!r}\n{log_tail(log_path)}")
    return process, int(line.split()[-1].rsplit(":", 1)[1])


PORT_FLOOR = 20_000


def _ephemeral_low() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return max(PORT_FLOOR + 1_000, int(text.split()[0]))
    except (OSError, ValueError, IndexError):
        return 32_768


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports, free a moment ago.

    Every probe socket stays bound until all ports are chosen (so no two picks can return the
    same port), then all are released together. Ports come from *below* the kernel's ephemeral
    range, which the benchmarks' own client connections draw from, so between this pick and a
    server's bind only other listeners compete for them.
    """
    low = _ephemeral_low()
    rng = random.Random()
    held: list[socket.socket] = []
    try:
        for _ in range(count * 50):
            if len(held) == count:
                break
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", rng.randrange(PORT_FLOOR, low)))
            except OSError:
                sock.close()
                continue
            held.append(sock)
        if len(held) < count:
            raise BenchError(f"could not find {count} free ports in [{PORT_FLOOR}, {low})")
        return [int(sock.getsockname()[1]) for sock in held]
    finally:
        for sock in held:
            sock.close()


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    process: subprocess.Popen[Any],
    log_path: Path,
) -> None:
    """Poll `predicate` every 20 ms (errors count as "not yet"); fail if `process` exits."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"{what}: the process exited\n{log_tail(log_path)}")
        try:
            if predicate():
                return
        except Exception as error:  # connection refused and the like: not yet
            last = error
        time.sleep(0.02)
    raise BenchError(f"timed out waiting for {what} (last error: {last!r})\n{log_tail(log_path)}")


# ---- a Pylon-like registration ------------------------------------------------------------------


class Registration:
    """A Pylon-like `RegisterInferenceServer` stream announcing one backend and `models`, all
    ACTIVE (cf. tests/fakes/pylon.py).

    It sends its registration once; `heartbeat()` sends it again, as a Pylon does every
    `heartbeat_ms` (the value it announces in `x-stargate-registration-heartbeat-ms`).
    `own_connection` gives the stream a TCP connection of its own, as every Pylon has; otherwise
    grpc shares one connection among channels to the same address.
    """

    def __init__(
        self,
        grpc_port: int,
        server_id: str,
        url: str,
        models: Sequence[str],
        *,
        heartbeat_ms: int = 1000,
        own_connection: bool = False,
    ) -> None:
        import grpc

        from stargate.protocol import stargate_pb2 as pb
        from stargate.protocol import stargate_pb2_grpc as pb_grpc

        self._grpc = grpc
        self._ack_type = pb.InferenceServerAck
        options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
        self._channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options)
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._acks: queue.Queue[Any] = queue.Queue()
        self.acks = 0
        """Acks received so far (written by the reader thread only)."""
        self.ended = False
        """The replica ended the stream (or it failed)."""
        self._message = pb.InferenceServerRegistration(
            inference_server_id=server_id,
            inference_server_url=url,
            models={
                model: pb.InferenceServerModelRegistration(
                    stats=pb.ModelStats(), status=pb.INFERENCE_SERVER_STATUS_ACTIVE
                )
                for model in models
            },
        )
        self._outbox.put(self._message)
        stub = pb_grpc.StargateControlPlaneStub(self._channel)  # type: ignore[no-untyped-call]
        self._call = stub.RegisterInferenceServer(
            iter(self._outbox.get, None), metadata=[(HEARTBEAT_HEADER, str(heartbeat_ms))]
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for ack in self._call:
                self.acks += 1
                if self.acks == 1:
                    self._acks.put(ack)
        except self._grpc.RpcError as error:
            self._acks.put(error)
            return
        finally:
            self.ended = True
        self._acks.put(None)

    def wait_ack(self, timeout: float) -> None:
        """Wait for the first ack (the registration was admitted)."""
        try:
            ack = self._acks.get(timeout=timeout)
        except queue.Empty:
            raise BenchError("registration: no ack from the replica") from None
        if not isinstance(ack, self._ack_type):
            raise BenchError(f"registration: expected an ack, got {ack!r}")

    def heartbeat(self) -> None:
        """Send the registration again (a Pylon's heartbeat)."""
        self._outbox.put(self._message)

    def close(self) -> None:
        self._outbox.put(None)
        self._call.cancel()
        self._channel.close()
