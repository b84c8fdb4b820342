"""Pieces the loopback benchmarks share (every part of `python -m benchmarks`, and
benchmarks/capacity.py): process handles, free ports, `/proc` readings, a Pylon-like registration
stream, a replica launcher, py-spy profiling and the result files (`bench-results/<part>.md`,
`<part>.json`, `summary.md`) with the machine and interpreter they were measured on."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "CLK_TCK",
    "HEARTBEAT_HEADER",
    "OUT_DIR",
    "ROOT",
    "BenchError",
    "Deadline",
    "Histogram",
    "JsonProcess",
    "PartResult",
    "Processes",
    "Profiler",
    "Registration",
    "Replica",
    "Suite",
    "cpu_model",
    "cpu_seconds",
    "cpu_seconds_tree",
    "descendants",
    "free_ports",
    "log_tail",
    "machine",
    "machine_cpu_seconds",
    "md_table",
    "memory_kib",
    "metric_sum",
    "num",
    "percentile",
    "python_version",
    "raise_open_file_limit",
    "read_line",
    "server_python",
    "set_server_python",
    "start_printing_server",
    "start_replica",
    "wait_until",
    "write_part",
    "write_summary",
]

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "bench-results"
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


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine, every core, from the first line of `/proc/stat`
    (all but idle and iowait). Its growth over a window minus that of the benchmark's own
    processes is the load of everything else on the machine (other users' jobs)."""
    with open("/proc/stat") as stat:
        values = [int(x) for x in stat.readline().split()[1:9]]
    return (sum(values) - values[3] - values[4]) / CLK_TCK


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
        self,
        args: list[str],
        *,
        stop_signal: signal.Signals = signal.SIGTERM,
        isolated: bool = False,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start `args` (in this checkout, with it first on PYTHONPATH). `isolated`: a Python
        process that must import the stargate installed in its interpreter's own environment
        (an older version, `python -m benchmarks routing --router-python`), so neither
        PYTHONPATH nor the working directory (which `-m` puts first on sys.path) is this
        checkout; the working directory is `/` unless `cwd` says otherwise."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if isolated:
            env.pop("PYTHONPATH", None)
            kwargs.setdefault("cwd", "/")
        else:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
            kwargs.setdefault("cwd", ROOT)
        # Its own session: a Ctrl-C at the terminal reaches only the benchmark, which then stops
        # every process it started itself (in order, by handle).
        kwargs.setdefault("start_new_session", True)
        process: subprocess.Popen[Any] = subprocess.Popen(args, env=env, **kwargs)
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

    def stop_together(self, processes: Sequence[subprocess.Popen[Any]], timeout: float) -> None:
        """Stop several processes this object started at once: each gets its stop signal, then
        they are waited for within one shared `timeout` (not one each), and those still running
        are killed. (A `stargate pylon` can take tens of seconds to finish after SIGTERM.)"""
        chosen = [
            (process, stop_signal)
            for process, stop_signal in self._started
            if any(process is wanted for wanted in processes)
        ]
        for process, stop_signal in chosen:
            if process.poll() is None:
                process.send_signal(stop_signal)
        end = time.monotonic() + timeout
        for process, _ in chosen:
            try:
                process.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            for pipe in (process.stdin, process.stdout):
                if pipe is not None and not pipe.closed:
                    with contextlib.suppress(OSError):
                        pipe.close()

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


# ---- process trees, file limits -----------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children, grandchildren...), read from
    `/proc/<pid>/task/*/children`; [] once `pid` is gone."""
    found: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                text = Path(f"/proc/{parent}/task/{task}/children").read_text()
            except OSError:
                continue
            for word in text.split():
                child = int(word)
                if child not in found:
                    found.append(child)
                    stack.append(child)
    return found


def cpu_seconds_tree(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (an nginx master and its worker)."""
    total = cpu_seconds(pid)
    for child in descendants(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += cpu_seconds(child)
    return total


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (children inherit it); the new soft limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ---- the interpreter under test ------------------------------------------------------------------

_SERVER_PYTHON = [sys.executable]
_PYTHON_VERSIONS: dict[str, str] = {}


def server_python() -> str:
    """The interpreter every server process runs on (the replica, the mock, the engines): this
    one unless `python -m benchmarks --python PATH` chose another (whose environment must have
    this project installed)."""
    return _SERVER_PYTHON[0]


def set_server_python(path: str) -> None:
    _SERVER_PYTHON[0] = os.path.abspath(path) if os.sep in path else path


def python_version(executable: str) -> str:
    """`platform.python_version()` of `executable` (asked once, then remembered)."""
    if executable not in _PYTHON_VERSIONS:
        if executable == sys.executable:
            _PYTHON_VERSIONS[executable] = platform.python_version()
        else:
            try:
                _PYTHON_VERSIONS[executable] = subprocess.run(
                    [executable, "-c", "import platform; print(platform.python_version())"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=True,
                ).stdout.strip()
            except (OSError, subprocess.SubprocessError) as error:
                raise BenchError(f"cannot run the interpreter {executable}: {error}") from None
    return _PYTHON_VERSIONS[executable]


# ---- a replica ----------------------------------------------------------------------------------


@dataclass
class Replica:
    """A `stargate serve` started by `start_replica`."""

    process: subprocess.Popen[Any]
    http: int
    grpc: int
    metrics: int
    log_path: Path
    started_at: float = 0.0
    """time.monotonic() just before the process was spawned."""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def reading(self) -> tuple[int, int, float]:
        """(VmRSS KiB, VmHWM KiB, CPU seconds) of the replica now."""
        if self.process.poll() is not None:
            raise BenchError(f"the replica exited\n{log_tail(self.log_path)}")
        rss, hwm = memory_kib(self.pid)
        return rss, hwm, cpu_seconds(self.pid)

    def metrics_text(self, timeout: float = 10) -> str:
        import httpx

        with httpx.Client(trust_env=False, timeout=timeout) as client:
            return client.get(f"http://127.0.0.1:{self.metrics}/metrics").text


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of metric `name` (all label sets) in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
    return total


def mock_backend_command(model: str, *flags: str, port: str = "0") -> list[str]:
    """`stargate mock-backend` serving `model` on `port` (0: it picks one and prints it; the
    pool file's `{port}` placeholder also works), logging warnings only, with `flags`."""
    return [
        server_python(),
        "-m",
        "stargate",
        "mock-backend",
        "--port",
        port,
        "--model",
        model,
        *flags,
        "--log-level",
        "warning",
    ]


def start_replica(
    procs: Processes,
    log_dir: Path,
    name: str,
    deadline: Deadline,
    *,
    max_connections: int = 384,
    warmup_args: Sequence[str] = ("--readiness-warmup-ms=0",),
    extra_args: Sequence[str] = (),
    python: str | None = None,
    isolated: bool = False,
) -> Replica:
    """A `stargate serve` on free loopback ports (HTTP, gRPC, discovery, metrics), answering
    `/healthz`; three tries at ports (one may be taken between the pick and the bind). It is
    stopped with SIGINT (no leave phase) by `procs`. `python`: its interpreter (default
    `server_python()`); `isolated`: it runs the stargate installed there (`Processes.spawn`)."""
    import httpx

    for attempt in range(3):
        http, grpc_port, discovery, metrics = free_ports(4)
        log_path = log_dir / f"{name}-{attempt}.log"
        with log_path.open("wb") as log:
            started_at = time.monotonic()
            process = procs.spawn(
                [
                    python or server_python(),
                    "-m",
                    "stargate",
                    "serve",
                    f"--stargate-id={name}",
                    f"--http-listen-addr=127.0.0.1:{http}",
                    f"--listen-addr=127.0.0.1:{grpc_port}",
                    f"--model-discovery-listen-addr=127.0.0.1:{discovery}",
                    f"--metrics-listen-addr=127.0.0.1:{metrics}",
                    f"--max-client-connections={max_connections}",
                    *warmup_args,
                    "--disable-dns-discovery",
                    "--shutdown-delay-ms=0",
                    "--shutdown-drain-timeout-ms=1000",
                    *extra_args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stop_signal=signal.SIGINT,  # SIGINT: no leave phase
                isolated=isolated,
            )
        replica = Replica(process, http, grpc_port, metrics, log_path, started_at)
        healthz = f"{replica.base}/healthz"
        with httpx.Client(trust_env=False, timeout=5) as client:
            try:
                wait_until(
                    lambda: client.get(healthz).status_code == 200,  # noqa: B023 (called at once)
                    deadline.left(30),
                    f"{name}'s /healthz",
                    process,
                    log_path,
                )
            except BenchError:
                procs.stop(process)
                if attempt == 2 or process.returncode == 0:
                    raise
                continue
        return replica
    raise AssertionError("unreachable")


# ---- statistics ---------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (NaN when empty)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class Histogram:
    """A log-spaced histogram of durations in seconds: 100 bins a decade from 1 µs to 100 s
    (quantiles within 2.3 %), cheap to fill (one log10) and to merge across processes."""

    LOW = 1e-6
    PER_DECADE = 100
    BINS = 800

    def __init__(self, counts: Sequence[int] | None = None) -> None:
        self.counts = list(counts) if counts is not None else [0] * (self.BINS + 2)

    def add(self, seconds: float) -> None:
        if seconds <= self.LOW:
            self.counts[0] += 1
        else:
            index = 1 + int(math.log10(seconds / self.LOW) * self.PER_DECADE)
            self.counts[min(index, self.BINS + 1)] += 1

    def merge(self, other: Histogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]

    @property
    def total(self) -> int:
        return sum(self.counts)

    def _value(self, index: int) -> float:
        """A bin's geometric middle (its lower edge for the first one)."""
        if index == 0:
            return self.LOW
        return float(self.LOW * 10 ** ((index - 0.5) / self.PER_DECADE))

    def quantile(self, q: float) -> float:
        total = self.total
        if not total:
            return math.nan
        wanted = max(1, math.ceil(q * total))
        seen = 0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= wanted:
                return self._value(index)
        return self._value(len(self.counts) - 1)

    def cdf(self) -> tuple[list[float], list[float]]:
        """(values, cumulative fractions) for a CDF plot."""
        total = self.total
        xs: list[float] = []
        ys: list[float] = []
        seen = 0
        for index, count in enumerate(self.counts):
            if count:
                seen += count
                xs.append(self._value(index))
                ys.append(seen / total)
        return xs, ys


def num(value: float | None, digits: int = 0) -> str:
    """A figure for a table: thousands separators, `-` for missing, NaN or infinite."""
    if value is None or math.isnan(value) or math.isinf(value):
        return "-"
    return f"{value:,.{digits}f}"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (first column left-aligned, the others right-aligned)."""
    align = ["---", *["---:" for _ in headers[1:]]]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    for row in rows:
        cells = [*row, *["?"] * (len(headers) - len(row))]  # a short row stays a table row
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the machine and the result files ------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> dict[str, Any]:
    """What the figures were measured on (every result file carries it)."""
    server = server_python()
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "server_python": python_version(server),
        "server_python_executable": server,
        "load_average_at_start": os.getloadavg()[0],
    }


@dataclass
class Suite:
    """What every part is run with: the suite's options (part-specific ones in `args`)."""

    quick: bool
    profile: bool
    out_dir: Path
    args: Any
    """The parsed command line (argparse.Namespace)."""


@dataclass
class PartResult:
    """What one part measured: a Markdown body (tables and notes), JSON data, problems."""

    name: str
    title: str
    markdown: str
    data: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    charts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    started: str = ""


def write_part(result: PartResult, suite: Suite) -> Path:
    """Write `<out>/<part>.md` and `<part>.json`; return the Markdown path."""
    suite.out_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    started = result.started or datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    python_note = f"Python {info['python']}"
    if info["server_python_executable"] != sys.executable:
        python_note += f" (servers: Python {info['server_python']})"
    header = (
        f"## {result.name}: {result.title}\n\n"
        f"{started.replace('T', ' ')} · {'quick' if suite.quick else 'full'} run, "
        f"{result.elapsed:.0f} s · {info['cpu_model']}, {info['cores']} cores, "
        f"{info['system']} · {python_note} · loopback · load average at start "
        f"{info['load_average_at_start']:.2f}"
    )
    lines = [header, "", result.markdown.rstrip()]
    if result.charts:
        lines += ["", "Charts: " + ", ".join(f"`{chart}`" for chart in result.charts)]
    for note in result.notes:
        lines += ["", f"- {note}"]
    for problem in result.problems:
        lines += ["", f"- WARNING: {problem}"]
    path = suite.out_dir / f"{result.name}.md"
    path.write_text("\n".join(lines) + "\n")
    document = {
        "part": result.name,
        "title": result.title,
        "date": started,
        "run": "quick" if suite.quick else "full",
        "elapsed_seconds": result.elapsed,
        "machine": info,
        "settings": result.settings,
        "data": result.data,
        "problems": result.problems,
        "notes": result.notes,
        "charts": result.charts,
    }
    (suite.out_dir / f"{result.name}.json").write_text(
        json.dumps(document, indent=2, default=str) + "\n"
    )
    return path


SUMMARY_ORDER = (
    "proxy",
    "stream",
    "registration",
    "readiness",
    "activator",
    "affinity",
    "peers",
    "routing",
    "capacity",
    "tunnels",
)


def write_summary(out_dir: Path) -> Path:
    """`<out>/summary.md`: every part's Markdown found in `out_dir`, in suite order (each carries
    its own date, so parts run at different times stay told apart)."""
    sections: list[str] = []
    for name in SUMMARY_ORDER:
        path = out_dir / f"{name}.md"
        if not path.exists():
            continue
        text = path.read_text().rstrip()
        if not text.startswith("## "):
            text = f"## {name}\n\n{text}"
        sections.append(text)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("T", " ")
    body = "\n\n".join(sections) if sections else "(no part has written its results yet)"
    path = out_dir / "summary.md"
    path.write_text(f"# stargate benchmarks: summary\n\nGathered {now}.\n\n{body}\n")
    return path


# ---- py-spy --------------------------------------------------------------------------------------


class Profiler:
    """`--profile`: py-spy records a flame graph of one process during a measured phase
    (`py-spy record -p PID -o <out>/<part>.svg -d S -r 200 --nonblocking`). py-spy needs ptrace;
    when it cannot run, the reason is printed and kept as a note, and the part goes on."""

    def __init__(self, enabled: bool, out_dir: Path, procs: Processes, part: str) -> None:
        self.enabled = enabled
        self.out_dir = out_dir
        self.procs = procs
        self.part = part
        self.note = ""

    def _executable(self) -> str | None:
        import shutil

        beside = Path(sys.executable).parent / "py-spy"
        return shutil.which("py-spy") or (str(beside) if beside.exists() else None)

    @contextlib.contextmanager
    def record(self, pid: int, seconds: float, what: str, again: bool = False) -> Iterator[None]:
        """Profile `pid` while the block runs (at most `seconds`). One flame graph per part: its
        first profiled phase, or with `again` the last one."""
        if not self.enabled or (self.note.startswith("flame graph") and not again):
            yield
            return
        executable = self._executable()
        if executable is None:
            self.note = "no flame graph: py-spy is not installed (pip install py-spy)"
            print(f"  {self.note}", file=sys.stderr)
            yield
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        out = self.out_dir / f"{self.part}.svg"
        log_path = self.out_dir / f".{self.part}-py-spy.log"
        with log_path.open("wb") as log:
            process = self.procs.spawn(
                [
                    executable,
                    "record",
                    "-p",
                    str(pid),
                    "-o",
                    str(out),
                    "-d",
                    str(max(1, math.ceil(seconds))),
                    "-r",
                    "200",
                    "--nonblocking",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stop_signal=signal.SIGINT,  # py-spy writes what it has on Ctrl-C
            )
        began = time.monotonic()
        try:
            yield
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            tail = log_tail(log_path, 6)
            if process.returncode == 0 and out.exists():
                self.note = (
                    f"flame graph: `{out.name}` (py-spy, 200 Hz, --nonblocking, "
                    f"{time.monotonic() - began:.0f} s of {what})"
                )
                log_path.unlink(missing_ok=True)
            else:
                self.note = f"no flame graph: py-spy exited {process.returncode}: {tail[-400:]}"
            print(f"  {self.note}", file=sys.stderr)


class JsonProcess:
    """A helper process driven by one JSON command per stdin line, answering one JSON line each
    (benchmarks/pylons.py, the capacity load generator)."""

    def __init__(self, procs: Processes, args: list[str], log_path: Path, what: str) -> None:
        self._log_path = log_path
        self.what = what
        with log_path.open("wb") as log:
            self.process = procs.spawn(
                args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, op: str, **args: Any) -> None:
        """Send one command (read its answer with `answer`)."""
        stdin = self.process.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps({"op": op, **args}) + "\n")
            stdin.flush()
        except OSError:
            raise BenchError(f"{self.what} gone:\n{log_tail(self._log_path)}") from None

    def answer(self, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = read_line(self.process.stdout, timeout)
        if not line:
            raise BenchError(f"{self.what}: no answer:\n{log_tail(self._log_path)}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise BenchError(f"{self.what}: {answer['error']}")
        return answer

    def call(self, op: str, timeout: float, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.answer(timeout)

    def quit(self) -> None:
        with contextlib.suppress(BenchError):
            self.send("quit")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
