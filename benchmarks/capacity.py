"""Capacity benchmark: what one replica's memory and CPU grow by per unit, on loopback.

Run with `nox -s bench -- capacity [--quick]` (or `python -m benchmarks.capacity [--quick]` from
the project root). A `stargate mock-backend` serves every request; for each of four parts a fresh
`stargate serve` replica is started, and the part raises one count in steps while the replica's
VmRSS and VmHWM (`/proc/<pid>/status`) and CPU time (utime + stime, `/proc/<pid>/stat`) are read:

1. Idle keep-alive client connections (HTTP/1.1), each after one non-streaming request through
   the replica: memory with all of them open, CPU per connection to accept it and serve its
   request. Hypercorn closes a keep-alive connection after 5 s idle, so each step is read within
   that, and a `poll()` of every client socket confirms none was closed by then.
2. Open SSE streams: streaming chat completions the mock answers with its first token at once and
   the next one ten minutes later, so every stream stays open (a client connection and an upstream
   connection each): memory with all open, CPU per stream to open it.
3. Registrations: Pylon-like `RegisterInferenceServer` streams (benchmarks.common.Registration,
   one TCP connection each), 4 models each, re-sent every second (heartbeat 1 s), each for an
   engine of its own (a health endpoint on a port of its own, served by the load generator) that
   the replica probes every second: memory, and CPU % over a steady window. A step the replica
   cannot keep up with (CPU >= 90 %, heartbeats not acked, registrations not admitted within
   30 s) is reported as saturated and left out of the fits.
4. Non-streaming requests: CPU per request and memory growth over a run of requests (5,000)
   after a warm-up.

Each step of a part is measured in the same replica, counts rising; least squares over the steps
gives the slope (bytes per unit, microseconds per unit, CPU % per unit). Results go to
`bench-results/capacity.{md,json}` and a chart to `bench-results/capacity.png` (matplotlib, Agg);
the table is printed with an estimate of what one replica holds on a 1-core / 1 GiB pod. The load
generator is a trio + h11 client (and the engines' health endpoints) in its own process, driven
by JSON lines on its stdin; the registrations run in this process. Everything listens on
127.0.0.1, the run is bounded by `--budget`, and every process started is stopped on the way out
(errors and Ctrl-C included).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import h11
import trio

from benchmarks.common import (
    CLK_TCK,
    ROOT,
    BenchError,
    Deadline,
    Processes,
    Registration,
    Replica,
    cpu_model,
    cpu_seconds,
    log_tail,
    mock_backend_command,
    python_version,
    raise_open_file_limit,
    read_line,
    server_python,
    start_printing_server,
    wait_until,
)
from benchmarks.common import start_replica as common_start_replica
from benchmarks.h11_client import read_response

MODEL = "bench-model"
PATH = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
# max_tokens 1: the mock answers at once despite its long inter-token delay (kept for streams).
CHAT_BODY = json.dumps(
    {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}, separators=(",", ":")
).encode()
STREAM_BODY = json.dumps(
    {"model": MODEL, "messages": MESSAGES, "stream": True}, separators=(",", ":")
).encode()
MOCK_INTER_TOKEN_MS = 600_000
"""Streams get their role chunk and first token at once, the second token after ten minutes."""
CATALOGUE = [f"capacity-model-{index}" for index in range(16)]
MODELS_PER_REGISTRATION = 4
HEARTBEAT_SECONDS = 1.0
KEEP_ALIVE_SECONDS = 5.0
"""Hypercorn closes an idle HTTP/1.1 keep-alive connection after this long."""
SATURATED_CPU_PERCENT = 90.0
"""A replica this busy (of its one core) is saturated: its step stays out of the fits."""
OPEN_CONCURRENCY = 32
WARMUP_REGISTRATIONS = 5
REQUEST_CONNECTIONS = 16
GIB_KIB = 1024 * 1024
OUT_DIR = ROOT / "bench-results"

_TRANSPORT_ERRORS = (
    OSError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    h11.ProtocolError,
)


# ---- the load generator (runs in its own process) -----------------------------------------------


class _Conn:
    """One HTTP/1.1 keep-alive client connection driven with h11."""

    def __init__(self, stream: trio.SocketStream, port: int) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)
        self.host = f"127.0.0.1:{port}".encode()
        self.last_answer = time.monotonic()

    @classmethod
    async def open(cls, port: int) -> _Conn:
        return cls(await trio.open_tcp_stream("127.0.0.1", port), port)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()

    def fileno(self) -> int:
        return int(self.stream.socket.fileno())

    async def _send(self, body: bytes, request_id: int) -> None:
        headers = [
            (b"host", self.host),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", b"capacity-%d" % request_id),
            (b"x-input-tokens", b"10"),
            (b"x-model", MODEL.encode()),
        ]
        conn = self.conn
        await self.stream.send_all(
            (conn.send(h11.Request(method=b"POST", target=PATH, headers=headers)) or b"")
            + (conn.send(h11.Data(data=body)) or b"")
            + (conn.send(h11.EndOfMessage()) or b"")
        )

    async def post(self, request_id: int) -> int:
        """One non-streaming request; its status. ConnectionError if the server will close."""
        await self._send(CHAT_BODY, request_id)
        status, _ = await read_response(self.conn, self.stream)
        self.last_answer = time.monotonic()
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        else:
            raise ConnectionError("the server closes the connection after this response")
        return status

    async def start_stream(self, request_id: int) -> int:
        """Send a streaming request and read until its role chunk and first token arrived."""
        await self._send(STREAM_BODY, request_id)
        status = 0
        received = b""
        while received.count(b"data:") < 2:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
                if status != 200:
                    return status
            elif isinstance(event, h11.Data):
                received += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                raise ConnectionError("the stream ended before its second event")
        return status


def _readable(conns: Sequence[_Conn]) -> int:
    """How many of `conns` have their socket readable now: closed by the server (or sent data
    nobody asked for). One `poll()` with no wait."""
    if not conns:
        return 0
    poller = select.poll()
    for conn in conns:
        poller.register(conn.fileno(), select.POLLIN | getattr(select, "POLLRDHUP", 0))
    return len(poller.poll(0))


@dataclass
class _Opened:
    opened: int = 0
    errors: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    first_error: str = ""
    seconds: float = 0.0


class LoadGenerator:
    """The load generator's state: the connections it holds between commands."""

    def __init__(self) -> None:
        self.idle: list[_Conn] = []
        self.streams: list[_Conn] = []
        self.workers: list[_Conn | None] = []
        self.next_id = 0

    def _request_id(self) -> int:
        self.next_id += 1
        return self.next_id

    async def _open_many(
        self, n: int, concurrency: int, port: int, start: Callable[[_Conn], Awaitable[int]]
    ) -> tuple[list[_Conn], _Opened]:
        held: list[_Conn] = []
        result = _Opened()
        issued = 0
        began = time.perf_counter()

        async def worker() -> None:
            nonlocal issued
            while issued < n:
                issued += 1
                conn: _Conn | None = None
                try:
                    conn = await _Conn.open(port)
                    status = await start(conn)
                except _TRANSPORT_ERRORS as error:
                    result.errors += 1
                    result.first_error = result.first_error or repr(error)
                    if conn is not None:
                        await conn.aclose()
                    continue
                result.statuses[str(status)] = result.statuses.get(str(status), 0) + 1
                if status == 200:
                    held.append(conn)
                else:
                    result.errors += 1
                    await conn.aclose()

        async with trio.open_nursery() as nursery:
            for _ in range(min(concurrency, n)):
                nursery.start_soon(worker)
        result.opened = len(held)
        result.seconds = time.perf_counter() - began
        return held, result

    async def open_idle(self, port: int, n: int, concurrency: int) -> dict[str, Any]:
        async def start(conn: _Conn) -> int:
            return await conn.post(self._request_id())

        held, result = await self._open_many(n, concurrency, port, start)
        self.idle.extend(held)
        return asdict(result)

    async def open_streams(self, port: int, n: int, concurrency: int) -> dict[str, Any]:
        async def start(conn: _Conn) -> int:
            return await conn.start_stream(self._request_id())

        held, result = await self._open_many(n, concurrency, port, start)
        self.streams.extend(held)
        return asdict(result)

    def probe(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "idle_total": len(self.idle),
            "idle_open": len(self.idle) - _readable(self.idle),
            "streams_total": len(self.streams),
            "streams_open": len(self.streams) - _readable(self.streams),
            "oldest_idle_seconds": max((now - c.last_answer for c in self.idle), default=0.0),
        }

    async def requests(self, port: int, n: int, connections: int) -> dict[str, Any]:
        """`n` non-streaming requests over `connections` keep-alive connections (kept for the
        next call; a connection the server closed is replaced)."""
        while len(self.workers) < connections:
            self.workers.append(None)
        result = _Opened()
        issued = 0
        began = time.perf_counter()

        async def worker(index: int) -> None:
            nonlocal issued
            while issued < n and result.errors < max(20, n // 10):
                issued += 1
                conn = self.workers[index]
                try:
                    if conn is None:
                        conn = self.workers[index] = await _Conn.open(port)
                    status = await conn.post(self._request_id())
                except _TRANSPORT_ERRORS as error:
                    result.errors += 1
                    result.first_error = result.first_error or repr(error)
                    if conn is not None:
                        await conn.aclose()
                    self.workers[index] = None
                    continue
                result.statuses[str(status)] = result.statuses.get(str(status), 0) + 1
                if status == 200:
                    result.opened += 1
                else:
                    result.errors += 1

        async with trio.open_nursery() as nursery:
            for index in range(connections):
                nursery.start_soon(worker, index)
        result.seconds = time.perf_counter() - began
        return asdict(result)

    async def close(self) -> dict[str, Any]:
        conns = [*self.idle, *self.streams, *(c for c in self.workers if c is not None)]
        self.idle, self.streams, self.workers = [], [], []
        for conn in conns:
            await conn.aclose()
        return {"closed": len(conns)}


async def _answer_health(stream: trio.SocketStream) -> None:
    """An engine's health endpoint, and nothing else: `GET /health` 200, anything else 404;
    HTTP/1.1 keep-alive."""
    conn = h11.Connection(h11.SERVER)
    target = b""
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(4096))
            elif isinstance(event, h11.Request):
                target = event.target
            elif isinstance(event, h11.EndOfMessage):
                status = 200 if target == b"/health" else 404
                await stream.send_all(
                    (conn.send(h11.Response(status_code=status, headers=HEALTH_HEADERS)) or b"")
                    + (conn.send(h11.Data(data=b"ok")) or b"")
                    + (conn.send(h11.EndOfMessage()) or b"")
                )
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                return
    except _TRANSPORT_ERRORS:
        pass
    finally:
        await stream.aclose()


HEALTH_HEADERS = [(b"content-type", b"text/plain"), (b"content-length", b"2")]


async def _serve_commands() -> None:
    gen = LoadGenerator()
    try:
        async with trio.open_nursery() as nursery:
            while True:
                line = await trio.to_thread.run_sync(sys.stdin.readline)
                if not line:
                    break
                command = json.loads(line)
                op = command.pop("op")
                answer: dict[str, Any]
                if op == "open_idle":
                    answer = await gen.open_idle(**command)
                elif op == "open_streams":
                    answer = await gen.open_streams(**command)
                elif op == "probe":
                    answer = gen.probe()
                elif op == "requests":
                    answer = await gen.requests(**command)
                elif op == "close":
                    answer = await gen.close()
                elif op == "engines":
                    answer = {"ports": await _start_engines(nursery, **command)}
                elif op == "quit":
                    break
                else:
                    answer = {"error": f"unknown op {op!r}"}
                sys.stdout.write(json.dumps(answer) + "\n")
                sys.stdout.flush()
            nursery.cancel_scope.cancel()
    finally:
        await gen.close()


async def _start_engines(nursery: trio.Nursery, n: int) -> list[int]:
    """`n` health endpoints, each on a loopback port of its own (bound here, port 0): distinct
    origins for the replica's probes, as distinct engines are."""
    ports: list[int] = []
    for _ in range(n):
        sock = trio.socket.socket()
        await sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        ports.append(sock.getsockname()[1])
        nursery.start_soon(trio.serve_listeners, _answer_health, [trio.SocketListener(sock)])
    return ports


def loadgen_main() -> None:
    """Entry point of the load-generator process: one JSON command per stdin line, one JSON
    answer per stdout line."""
    trio.run(_serve_commands)


# ---- this process: servers, registrations, readings ---------------------------------------------


class LoadGen:
    """Handle of the load-generator process."""

    def __init__(self, procs: Processes, log_path: Path) -> None:
        self._log_path = log_path
        with log_path.open("wb") as log:
            self._process = procs.spawn(
                [
                    sys.executable,
                    "-c",
                    "from benchmarks.capacity import loadgen_main; loadgen_main()",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,  # Ctrl-C reaches only us; we stop the children ourselves
            )

    def call(self, op: str, timeout: float, **args: Any) -> dict[str, Any]:
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(json.dumps({"op": op, **args}) + "\n")
            process.stdin.flush()
        except OSError:
            raise BenchError(f"load generator gone:\n{log_tail(self._log_path)}") from None
        line = read_line(process.stdout, timeout)
        if not line:
            raise BenchError(f"load generator: no answer to {op}:\n{log_tail(self._log_path)}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise BenchError(f"load generator: {answer['error']}")
        return answer

    @property
    def pid(self) -> int:
        return self._process.pid

    def quit(self) -> None:
        """Ask the load generator to close its connections and exit (no answer)."""
        process = self._process
        assert process.stdin is not None
        with contextlib.suppress(OSError):
            process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            process.stdin.flush()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)


class Heartbeats:
    """One thread re-sending every registration's message each `interval`, spread over it."""

    def __init__(self, interval: float = HEARTBEAT_SECONDS) -> None:
        self.interval = interval
        self.registrations: list[Registration] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            registrations = list(self.registrations)
            began = time.monotonic()
            for index, registration in enumerate(registrations):
                delay = began + self.interval * index / len(registrations) - time.monotonic()
                if delay > 0 and self._stopping.wait(delay):
                    return
                registration.heartbeat()
            rest = began + self.interval - time.monotonic()
            if rest > 0:
                self._stopping.wait(rest)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)


def start_replica(
    procs: Processes, log_dir: Path, name: str, max_connections: int, deadline: Deadline
) -> Replica:
    """A `stargate serve` on free loopback ports, answering /healthz (benchmarks.common)."""
    return common_start_replica(procs, log_dir, name, deadline, max_connections=max_connections)


def catalogue_models(index: int) -> list[str]:
    """Registration `index` serves 4 consecutive models of the 16-model catalogue."""
    return [CATALOGUE[(index + k) % len(CATALOGUE)] for k in range(MODELS_PER_REGISTRATION)]


@contextlib.contextmanager
def data_replica(
    procs: Processes,
    log_dir: Path,
    name: str,
    mock_url: str,
    max_connections: int,
    deadline: Deadline,
) -> Iterator[Replica]:
    """A replica with the mock registered (heartbeat 1 s); yields once a request succeeds."""
    import httpx

    replica = start_replica(procs, log_dir, name, max_connections, deadline)
    heartbeats = Heartbeats()
    registration: Registration | None = None
    try:
        registration = Registration(
            replica.grpc, f"{name}-mock", mock_url, [MODEL], heartbeat_ms=1000, own_connection=True
        )
        registration.wait_ack(deadline.left(10))
        heartbeats.registrations.append(registration)
        headers = {"x-request-id": "capacity-ready", "x-input-tokens": "10", "x-model": MODEL}
        url = f"http://127.0.0.1:{replica.http}{PATH}"
        with httpx.Client(trust_env=False, timeout=5) as client:
            wait_until(
                lambda: client.post(url, headers=headers, content=CHAT_BODY).status_code == 200,
                deadline.left(20),
                "a request through the replica to succeed",
                replica.process,
                replica.log_path,
            )
        yield replica
    finally:
        heartbeats.stop()
        if registration is not None:
            registration.close()
        procs.stop(replica.process)


# ---- the measurements ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    idle_levels: tuple[int, ...]
    stream_levels: tuple[int, ...]
    registration_levels: tuple[int, ...]
    requests: int
    request_steps: int
    request_warmup: int
    window: float
    settle: float
    admit_limit: float
    budget: float
    label: str


@dataclass
class Step:
    """One step of a part: the count, the replica's memory, and CPU figures."""

    n: int
    rss_kib: int
    hwm_kib: int
    cpu_us_per_unit: float = math.nan
    """CPU to open each unit of this step (connections, streams)."""
    idle_cpu_percent: float = math.nan
    """Replica CPU % (of one core) while the units sit open."""
    cpu_seconds: float = math.nan
    """Cumulative replica CPU seconds (requests)."""
    open_seconds: float = 0.0
    still_open: int = 0
    saturated: bool = False
    """The replica could not keep up (registrations): left out of the fits."""
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class Part:
    name: str
    unit: str
    steps: list[Step] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)


def _settle_cpu(replica: Replica, quiet: float) -> None:
    """Wait until the replica's CPU stays flat for `quiet` seconds (at most 5 s)."""
    end = time.monotonic() + 5
    before = replica.reading()[2]
    while time.monotonic() < end:
        time.sleep(quiet)
        now = replica.reading()[2]
        if now - before <= 1 / CLK_TCK:
            return
        before = now


def measure_idle(replica: Replica, gen: LoadGen, settings: Settings, deadline: Deadline) -> Part:
    part = Part("idle_connections", "idle keep-alive connection")
    gen.call("open_idle", 30, port=replica.http, n=20, concurrency=OPEN_CONCURRENCY)  # warm-up
    gen.call("close", 10)
    for n in settings.idle_levels:
        if deadline.left(60) < 15:
            part.skipped.append(n)
            continue
        _settle_cpu(replica, 0.3)
        cpu0 = replica.reading()[2]
        opened = gen.call("open_idle", 60, port=replica.http, n=n, concurrency=OPEN_CONCURRENCY)
        rss, hwm, cpu1 = replica.reading()
        probe = gen.call("probe", 10)
        # CPU while all sit idle: a window that ends before the oldest reaches the 5 s timer.
        window = max(0.2, min(1.0, KEEP_ALIVE_SECONDS - 0.5 - probe["oldest_idle_seconds"]))
        time.sleep(window)
        cpu2 = replica.reading()[2]
        after = gen.call("probe", 10)
        step = Step(
            n,
            rss,
            hwm,
            cpu_us_per_unit=(cpu1 - cpu0) / n * 1e6 if n else math.nan,
            idle_cpu_percent=(cpu2 - cpu1) / window * 100,
            open_seconds=opened["seconds"],
            still_open=probe["idle_open"],
            notes={"opened": opened, "after_window_open": after["idle_open"], "window": window},
        )
        part.steps.append(step)
        if opened["opened"] != n or probe["idle_open"] != n:
            part.problems.append(
                f"{n} idle connections: {opened['opened']} opened, {probe['idle_open']} still "
                f"open when read (errors {opened['errors']}: {opened['first_error']})"
            )
        gen.call("close", 30)
        print(
            f"  idle connections {n:>5}: RSS {rss / 1024:7.1f} MiB, HWM {hwm / 1024:7.1f} MiB, "
            f"opened in {opened['seconds']:.2f} s",
            file=sys.stderr,
        )
        time.sleep(0.5)
    return part


def measure_streams(replica: Replica, gen: LoadGen, settings: Settings, deadline: Deadline) -> Part:
    part = Part("streams", "open SSE stream")
    gen.call("open_streams", 30, port=replica.http, n=20, concurrency=OPEN_CONCURRENCY)
    gen.call("close", 10)
    time.sleep(1)
    for n in settings.stream_levels:
        if deadline.left(60) < 15:
            part.skipped.append(n)
            continue
        _settle_cpu(replica, 0.3)
        cpu0 = replica.reading()[2]
        opened = gen.call("open_streams", 90, port=replica.http, n=n, concurrency=OPEN_CONCURRENCY)
        time.sleep(0.3)  # the last streams' upstream bookkeeping
        rss, _, cpu1 = replica.reading()
        window = 2.0
        time.sleep(window)
        rss2, hwm2, cpu2 = replica.reading()
        probe = gen.call("probe", 10)
        step = Step(
            n,
            max(rss, rss2),
            hwm2,
            cpu_us_per_unit=(cpu1 - cpu0) / n * 1e6 if n else math.nan,
            idle_cpu_percent=(cpu2 - cpu1) / window * 100,
            open_seconds=opened["seconds"],
            still_open=probe["streams_open"],
            notes={"opened": opened},
        )
        part.steps.append(step)
        if opened["opened"] != n or probe["streams_open"] != n:
            part.problems.append(
                f"{n} streams: {opened['opened']} opened, {probe['streams_open']} still open "
                f"(errors {opened['errors']}: {opened['first_error']})"
            )
        gen.call("close", 30)
        print(
            f"  open streams     {n:>5}: RSS {step.rss_kib / 1024:7.1f} MiB, "
            f"HWM {hwm2 / 1024:7.1f} MiB, opened in {opened['seconds']:.2f} s",
            file=sys.stderr,
        )
        time.sleep(1.0)  # the replica and the mock end the closed streams
    return part


def register_within(
    replica: Replica,
    server_ids: Sequence[str],
    urls: Sequence[str],
    first_index: int,
    until: float,
) -> tuple[list[Registration], int]:
    """Open registrations (batches of 50) until `until` (monotonic): (the streams still open,
    admitted or not yet, and how many the replica refused or failed). Past `until` no more are
    opened; a replica short of CPU admits slowly, and its Pylons would keep trying too."""
    opened: list[Registration] = []
    failed = 0
    for batch in range(0, len(server_ids), 50):
        if time.monotonic() >= until:
            break
        fresh = [
            Registration(
                replica.grpc,
                server_id,
                urls[batch + offset],
                catalogue_models(first_index + batch + offset),
                heartbeat_ms=int(HEARTBEAT_SECONDS * 1000),
                own_connection=True,
            )
            for offset, server_id in enumerate(server_ids[batch : batch + 50])
        ]
        for registration in fresh:
            try:
                registration.wait_ack(max(0.05, until - time.monotonic()))
            except BenchError:
                if registration.ended:  # refused or failed, not merely slow
                    registration.close()
                    failed += 1
                    continue
            opened.append(registration)
    return opened, failed


def measure_registrations(
    replica: Replica, gen: LoadGen, settings: Settings, deadline: Deadline
) -> Part:
    part = Part("registrations", "registration")
    # Every registration is an engine of its own: a health endpoint on a port of its own.
    ports = gen.call("engines", 60, n=max(settings.registration_levels) + WARMUP_REGISTRATIONS)
    urls = [f"http://127.0.0.1:{port}" for port in ports["ports"]]
    heartbeats = Heartbeats()
    registrations: list[Registration] = []
    try:
        # Warm-up: a few registrations admitted, heart-beaten and ended.
        warm, _ = register_within(
            replica,
            [f"warmup-{i}" for i in range(WARMUP_REGISTRATIONS)],
            urls[-WARMUP_REGISTRATIONS:],
            0,
            time.monotonic() + deadline.left(10),
        )
        if len(warm) < WARMUP_REGISTRATIONS or not all(r.acks for r in warm):
            raise BenchError(f"warm-up registrations not admitted\n{log_tail(replica.log_path)}")
        heartbeats.registrations.extend(warm)
        time.sleep(2)
        heartbeats.registrations.clear()
        for registration in warm:
            registration.close()
        time.sleep(1)
        for n in settings.registration_levels:
            if deadline.left(120) < settings.admit_limit + settings.window + settings.settle + 10:
                part.skipped.append(n)
                continue
            began = time.monotonic()
            fresh, failed = register_within(
                replica,
                [f"capacity-backend-{i}" for i in range(len(registrations), n)],
                urls[len(registrations) : n],
                len(registrations),
                began + settings.admit_limit,
            )
            registrations.extend(fresh)
            heartbeats.registrations.extend(fresh)
            opened = time.monotonic() - began
            time.sleep(settings.settle)
            _, _, cpu0 = replica.reading()
            engines0 = cpu_seconds(gen.pid)
            acks0 = sum(r.acks for r in registrations)
            own0 = time.process_time()
            start = time.monotonic()
            time.sleep(settings.window)
            rss, hwm, cpu1 = replica.reading()
            wall = time.monotonic() - start
            acks_per_second = (sum(r.acks for r in registrations) - acks0) / wall
            admitted = sum(r.acks > 0 and not r.ended for r in registrations)
            cpu_percent = (cpu1 - cpu0) / wall * 100
            saturated = n > 0 and (
                admitted < n
                or acks_per_second < 0.9 * n / HEARTBEAT_SECONDS
                or cpu_percent >= SATURATED_CPU_PERCENT
            )
            step = Step(
                n,
                rss,
                hwm,
                idle_cpu_percent=cpu_percent,
                open_seconds=opened,
                still_open=admitted,
                saturated=saturated,
                notes={
                    "attempted": len(registrations) + failed,
                    "admitted": admitted,
                    "failed": failed,
                    "acks_per_second": acks_per_second,
                    "engines_cpu_percent": (cpu_seconds(gen.pid) - engines0) / wall * 100,
                    "benchmark_cpu_percent": (time.process_time() - own0) / wall * 100,
                    "window": wall,
                },
            )
            part.steps.append(step)
            print(
                f"  registrations    {n:>5}: RSS {rss / 1024:7.1f} MiB, HWM {hwm / 1024:7.1f} "
                f"MiB, CPU {cpu_percent:5.1f} %, {admitted} admitted in {opened:.1f} s, "
                f"{acks_per_second:.0f} acks/s" + (" (saturated)" if saturated else ""),
                file=sys.stderr,
            )
            if saturated:
                part.skipped.extend(x for x in settings.registration_levels if x > n)
                break
    finally:
        heartbeats.stop()
        for registration in registrations:
            registration.close()
    return part


def measure_requests(
    replica: Replica, gen: LoadGen, settings: Settings, deadline: Deadline
) -> Part:
    part = Part("requests", "non-streaming request")
    warm = gen.call(
        "requests",
        60,
        port=replica.http,
        n=settings.request_warmup,
        connections=REQUEST_CONNECTIONS,
    )
    if warm["errors"]:
        part.problems.append(f"warm-up: {warm['errors']} errors ({warm['first_error']})")
    rss, hwm, cpu_start = replica.reading()
    part.steps.append(Step(0, rss, hwm, cpu_seconds=0.0))
    done = 0
    per_step = max(1, settings.requests // settings.request_steps)
    while done < settings.requests:
        if deadline.left(60) < 10:
            part.skipped.append(settings.requests)
            break
        count = min(per_step, settings.requests - done)
        answer = gen.call(
            "requests", 120, port=replica.http, n=count, connections=REQUEST_CONNECTIONS
        )
        done += count
        rss, hwm, cpu = replica.reading()
        part.steps.append(
            Step(
                done,
                rss,
                hwm,
                cpu_seconds=cpu - cpu_start,
                open_seconds=answer["seconds"],
                notes={"ok": answer["opened"], "errors": answer["errors"]},
            )
        )
        if answer["errors"]:
            part.problems.append(
                f"requests {done - count}-{done}: {answer['errors']} errors "
                f"({answer['first_error']}, statuses {answer['statuses']})"
            )
    print(
        f"  requests         {done:>5}: RSS {rss / 1024:7.1f} MiB, HWM {hwm / 1024:7.1f} MiB",
        file=sys.stderr,
    )
    gen.call("close", 30)
    return part


# ---- fits and the report ------------------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    slope: float
    intercept: float
    r2: float


def least_squares(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    """The least-squares line through (xs, ys); NaN when fewer than two distinct xs."""
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if not math.isnan(y)]
    if len({x for x, _ in points}) < 2:
        return Fit(math.nan, math.nan, math.nan)
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    ss_tot = sum((y - mean_y) ** 2 for _, y in points)
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in points)
    return Fit(slope, intercept, 1 - ss_res / ss_tot if ss_tot > 0 else 1.0)


@dataclass
class Summary:
    """The slopes of one part: memory (bytes) and CPU per unit."""

    rss: Fit
    hwm: Fit
    cpu: Fit
    """Connections, streams: CPU us to open one (mean of the steps, as slope). Registrations:
    CPU % of one core against the count. Requests: cumulative CPU seconds against the count."""
    idle_cpu: Fit
    """CPU % of one core against the count while the units sit open."""


def summarize(part: Part) -> Summary:
    """Least squares over the part's steps, saturated ones left out."""
    steps = [step for step in part.steps if not step.saturated]
    ns = [float(step.n) for step in steps]
    rss = least_squares(ns, [step.rss_kib * 1024.0 for step in steps])
    hwm = least_squares(ns, [step.hwm_kib * 1024.0 for step in steps])
    idle = least_squares(ns, [step.idle_cpu_percent for step in steps])
    if part.name in ("idle_connections", "streams"):
        # Each step's CPU to open its units, pooled: total CPU over total units.
        opened = [step for step in steps if step.n and not math.isnan(step.cpu_us_per_unit)]
        units = sum(step.n for step in opened)
        total_us = sum(step.cpu_us_per_unit * step.n for step in opened)
        cpu = Fit(total_us / units if units else math.nan, 0.0, math.nan)
    elif part.name == "registrations":
        cpu = idle
    else:
        cpu = least_squares(ns, [step.cpu_seconds * 1e6 for step in steps])
    return Summary(rss, hwm, cpu, idle)


def _num(value: float, digits: int = 0) -> str:
    if math.isnan(value) or math.isinf(value):
        return "-"
    return f"{value:,.{digits}f}"


def _bytes(value: float) -> str:
    if math.isnan(value):
        return "-"
    if abs(value) >= 1024:
        return f"{value / 1024:,.1f} KiB"
    return f"{value:,.0f} B"


@dataclass
class Estimate:
    baseline_mib: float
    idle_connections: float
    streams: float
    registrations_memory: float
    registrations_cpu: float
    registrations_healthy: float
    """When a step saturated the replica: the largest count it kept up with (NaN: none did)."""
    registrations_saturated: float
    """The smallest count that saturated the replica (NaN: none did)."""
    requests_per_core_second: float

    @property
    def registrations(self) -> float:
        bounds = [self.registrations_memory, self.registrations_cpu, self.registrations_healthy]
        return min((b for b in bounds if not math.isnan(b)), default=math.nan)


def estimate(parts: dict[str, Part], summaries: dict[str, Summary]) -> Estimate:
    """What one replica holds on a 1-core / 1 GiB pod: (1 GiB - baseline RSS) / RSS per unit, and
    (1 core - idle CPU) / CPU per registration."""
    baselines = [p.steps[0].rss_kib for p in parts.values() if p.steps and p.steps[0].n == 0]
    baseline_kib = max(baselines) if baselines else math.nan
    free_bytes = (GIB_KIB - baseline_kib) * 1024

    def by_memory(name: str) -> float:
        summary = summaries.get(name)
        if summary is None or math.isnan(summary.rss.slope) or summary.rss.slope <= 0:
            return math.nan
        return free_bytes / summary.rss.slope

    registrations_cpu = math.nan
    reg = summaries.get("registrations")
    if reg is not None and reg.cpu.slope > 0:
        registrations_cpu = (100 - max(reg.cpu.intercept, 0.0)) / reg.cpu.slope
    steps = parts["registrations"].steps if "registrations" in parts else []
    saturated = [float(step.n) for step in steps if step.saturated]
    healthy = [float(step.n) for step in steps if not step.saturated]
    requests = summaries.get("requests")
    per_core = 1e6 / requests.cpu.slope if requests is not None and requests.cpu.slope > 0 else 0
    return Estimate(
        baseline_mib=baseline_kib / 1024,
        idle_connections=by_memory("idle_connections"),
        streams=by_memory("streams"),
        registrations_memory=by_memory("registrations"),
        registrations_cpu=registrations_cpu,
        registrations_healthy=max(healthy, default=math.nan) if saturated else math.nan,
        registrations_saturated=min(saturated, default=math.nan),
        requests_per_core_second=per_core or math.nan,
    )


def _round_count(value: float) -> str:
    if math.isnan(value):
        return "-"
    magnitude = 10 ** max(0, int(math.log10(max(value, 1))) - 1)
    return f"~{round(value / magnitude) * magnitude:,.0f}"


def markdown(
    parts: dict[str, Part], summaries: dict[str, Summary], est: Estimate, header: str
) -> str:
    rows: list[str] = []
    labels = {
        "idle_connections": "Idle keep-alive connection (HTTP/1.1, after 1 request)",
        "streams": "Open SSE stream (client + upstream connection)",
        "registrations": f"Registration ({MODELS_PER_REGISTRATION} models, heartbeat 1 s)",
        "requests": "Non-streaming request",
    }
    footnotes: list[str] = []
    for name, part in parts.items():
        summary = summaries[name]
        counts = " / ".join(f"{step.n:,}" + ("*" if step.saturated else "") for step in part.steps)
        rss = " / ".join(f"{step.rss_kib / 1024:.1f}" for step in part.steps)
        memory = f"{_bytes(summary.rss.slope)} (R² {_num(summary.rss.r2, 3)})"
        peak = _bytes(summary.hwm.slope)
        last = part.steps[-1] if part.steps else None
        if name in ("idle_connections", "streams") and last is not None:
            what = "accept and serve its request" if name == "idle_connections" else "open"
            cpu = (
                f"{_num(summary.cpu.slope)} µs to {what}; idle: "
                f"{_num(last.idle_cpu_percent, 1)} % of a core with {last.n:,} open"
            )
        elif name == "registrations":
            cpu = (
                f"{_num(summary.cpu.slope, 3)} % of a core ({_num(summary.cpu.slope * 1e4)} "
                f"µs/s; R² {_num(summary.cpu.r2, 3)})"
            )
            for step in part.steps:
                if step.saturated:
                    footnotes.append(
                        f"\\* {step.n:,} registrations need more than one core: the replica ran "
                        f"at {step.idle_cpu_percent:.0f} % CPU, had admitted "
                        f"{step.notes['admitted']:,} of {step.n:,} after "
                        f"{step.open_seconds:.0f} s and acked "
                        f"{step.notes['acks_per_second']:,.0f} heartbeats/s (of {step.n:,}); "
                        "this step is left out of the fits."
                    )
        elif last is not None:
            first = part.steps[0]
            growth = (last.rss_kib - first.rss_kib) / 1024
            # Growth that levels off is warm-up; what goes on growing in the second half would
            # be a leak.
            tail = [step for step in part.steps if step.n >= last.n / 2]
            tail_fit = least_squares(
                [float(step.n) for step in tail], [step.rss_kib * 1024.0 for step in tail]
            )
            memory = (
                f"{growth:+,.1f} MiB over {last.n:,} ({_bytes(summary.rss.slope)} each); "
                f"{_bytes(tail_fit.slope)} each over the last {last.n - tail[0].n:,}"
            )
            cpu = f"{_num(summary.cpu.slope)} µs (R² {_num(summary.cpu.r2, 4)})"
        else:
            cpu = "-"
        rows.append(f"| {labels[name]} | {counts} | {rss} | {memory} | {peak} | {cpu} |")
    registration_steps = parts["registrations"].steps if "registrations" in parts else []
    measured = max((step.n for step in registration_steps), default=0)
    lines = [
        header,
        "",
        "| Unit | N | RSS at N (MiB) | Memory per unit (RSS slope) | Peak (VmHWM slope) | "
        "CPU per unit |",
        "|---|---|---|---|---|---|",
        *rows,
        *(["", *footnotes] if footnotes else []),
        "",
        f"One replica on a 1-core / 1 GiB pod (baseline RSS {est.baseline_mib:.1f} MiB; "
        "memory-bound counts are (1 GiB - baseline) / RSS per unit, each unit alone):",
        "",
        f"- idle keep-alive connections: {_round_count(est.idle_connections)} by memory "
        "(set `--max-client-connections` and the open-file limit to match)",
        f"- open SSE streams: {_round_count(est.streams)} by memory (2 descriptors each)",
        f"- registrations: {_round_count(est.registrations_memory)} by memory, "
        f"{_round_count(est.registrations_cpu)} by CPU (1 core, linear fit)"
        + (
            f" -> {_round_count(est.registrations)} (extrapolated past the {measured:,} measured; "
            "the replica may stop keeping up before its core is busy: measure up to it)"
            if math.isnan(est.registrations_saturated) and est.registrations > measured
            else f" -> {_round_count(est.registrations)}"
            if math.isnan(est.registrations_saturated)
            else f"; but it kept up with {est.registrations_healthy:,.0f} and not with "
            f"{est.registrations_saturated:,.0f} (\\*) -> plan for at most "
            f"{est.registrations:,.0f} (locate the knee with `--registrations`)"
        ),
        f"- non-streaming requests: {_num(est.requests_per_core_second)} per second per core",
    ]
    for name, part in parts.items():
        for problem in part.problems:
            lines.append(f"- WARNING ({name}): {problem}")
        if part.skipped:
            lines.append(f"- WARNING ({name}): skipped (time budget): {part.skipped}")
    return "\n".join(lines) + "\n"


def chart(parts: dict[str, Part], summaries: dict[str, Summary], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for axis, name, xlabel in (
        (axes[0], "streams", "open SSE streams"),
        (axes[1], "registrations", f"registrations ({MODELS_PER_REGISTRATION} models, 1 s)"),
    ):
        part = parts.get(name)
        if part is None or not part.steps:
            axis.set_visible(False)
            continue
        fitted = [step for step in part.steps if not step.saturated]
        beyond = [step for step in part.steps if step.saturated]
        xs = [step.n for step in part.steps]
        axis.plot([s.n for s in fitted], [s.rss_kib / 1024 for s in fitted], "o", label="VmRSS")
        axis.plot([s.n for s in fitted], [s.hwm_kib / 1024 for s in fitted], "x", label="VmHWM")
        if beyond:
            axis.plot(
                [s.n for s in beyond],
                [s.rss_kib / 1024 for s in beyond],
                "o",
                markerfacecolor="none",
                color="tab:red",
                label="VmRSS, CPU saturated (not fitted)",
            )
            for step in beyond:
                axis.annotate(
                    f"{step.notes['admitted']:,} admitted",
                    (step.n, step.rss_kib / 1024),
                    textcoords="offset points",
                    xytext=(-10, -14),
                    ha="right",
                    fontsize=8,
                    color="tab:red",
                )
        fit = summaries[name].rss
        if not math.isnan(fit.slope):
            ends = [0, max(xs)]
            axis.plot(
                ends,
                [(fit.intercept + fit.slope * x) / 2**20 for x in ends],
                "-",
                label=f"fit: {_bytes(fit.slope)} per unit",
            )
        axis.set_xlabel(xlabel)
        axis.set_ylabel("replica memory (MiB)")
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---- the run ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="nox -s bench -- capacity",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--quick", action="store_true", help="smaller counts (under 90 s)")
    parser.add_argument(
        "--registrations",
        help="registration counts, comma-separated (0,100,300,1000; quick 0,25,75,200)",
    )
    parser.add_argument(
        "--requests", type=int, help="non-streaming requests measured (5000; quick 1000)"
    )
    parser.add_argument("--window", type=float, help="registration CPU window, s (10; quick 3)")
    parser.add_argument("--budget", type=float, help="seconds for the whole run (300; quick 90)")
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    settings = Settings(
        idle_levels=(0, 50, 100, 200) if quick else (0, 250, 500, 1000),
        stream_levels=(0, 25, 50, 100) if quick else (0, 100, 250, 500),
        registration_levels=_levels(args.registrations, parser)
        or ((0, 25, 75, 200) if quick else (0, 100, 300, 1000)),
        requests=args.requests or (1000 if quick else 5000),
        request_steps=5,
        request_warmup=200 if quick else 500,
        window=args.window or (3.0 if quick else 10.0),
        settle=1.0 if quick else 2.0,
        admit_limit=10.0 if quick else 30.0,
        budget=args.budget or (90.0 if quick else 300.0),
        label="quick" if quick else "full",
    )
    if settings.window <= 0 or settings.budget <= 0 or settings.requests < 1:
        parser.error("--requests, --window and --budget must be positive")
    return settings


def _levels(text: str | None, parser: argparse.ArgumentParser) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        levels = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        parser.error(f"--registrations: not a list of counts: {text!r}")
    if levels[0] < 0:
        parser.error("--registrations: counts must not be negative")
    return levels


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run(settings: Settings, procs: Processes, log_dir: Path, deadline: Deadline) -> dict[str, Part]:
    nofile = raise_open_file_limit()
    most = max(*settings.idle_levels, *settings.stream_levels, *settings.registration_levels)
    if nofile < 3 * most + 256:
        raise BenchError(f"the open-file limit ({nofile}) is too low for {most} connections")
    max_connections = 2 * most + 64
    mock, mock_port = start_printing_server(
        procs,
        mock_backend_command(MODEL, "--tokens", "16", "--inter-token-ms", str(MOCK_INTER_TOKEN_MS)),
        log_dir / "mock.log",
        "the mock backend",
        deadline.left(20),
        start_new_session=True,
    )
    mock_url = f"http://127.0.0.1:{mock_port}"
    gen = LoadGen(procs, log_dir / "loadgen.log")
    parts: dict[str, Part] = {}
    measures: list[tuple[str, Callable[[Replica], Part]]] = [
        ("idle_connections", lambda r: measure_idle(r, gen, settings, deadline)),
        ("streams", lambda r: measure_streams(r, gen, settings, deadline)),
        ("requests", lambda r: measure_requests(r, gen, settings, deadline)),
    ]
    for name, measure in measures:
        print(f"{name}:", file=sys.stderr)
        with data_replica(procs, log_dir, name, mock_url, max_connections, deadline) as replica:
            parts[name] = measure(replica)
    print("registrations:", file=sys.stderr)
    replica = start_replica(procs, log_dir, "registrations", max_connections, deadline)
    try:
        parts["registrations"] = measure_registrations(replica, gen, settings, deadline)
    finally:
        procs.stop(replica.process)
    gen.quit()
    procs.stop(mock)
    order = ["idle_connections", "streams", "registrations", "requests"]
    return {name: parts[name] for name in order if name in parts}


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    # SIGTERM (a CI timeout, say) unwinds like Ctrl-C, so every process started is still stopped;
    # Ctrl-C too when started from a shell that ignores SIGINT for background jobs.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    deadline = Deadline(settings.budget)
    started = time.monotonic()
    procs = Processes()
    try:
        with tempfile.TemporaryDirectory(prefix="stargate-capacity-") as log_dir:
            parts = run(settings, procs, Path(log_dir), deadline)
    except BenchError as error:
        print(f"benchmark failed: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; stopping every process started", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
    elapsed = time.monotonic() - started
    summaries = {name: summarize(part) for name, part in parts.items()}
    est = estimate(parts, summaries)
    now = datetime.datetime.now(datetime.UTC)
    machine = (
        f"Python {python_version(server_python())}, {os.cpu_count()} CPUs ({cpu_model()}), "
        f"{platform.system()} {platform.release()}, loopback"
    )
    header = (
        f"stargate replica capacity ({settings.label} run, {now:%Y-%m-%d}, {machine}; "
        f"{elapsed:.0f} s)"
    )
    text = markdown(parts, summaries, est, header)
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "capacity.md").write_text(text)
    document = {
        "date": now.isoformat(timespec="seconds"),
        "machine": machine,
        "settings": asdict(settings),
        "elapsed_seconds": elapsed,
        "parts": {name: asdict(part) for name, part in parts.items()},
        "fits": {name: asdict(summary) for name, summary in summaries.items()},
        "estimate_1_core_1_gib": {**asdict(est), "registrations": est.registrations},
        "units": {
            "rss/hwm slope": "bytes per unit",
            "cpu (idle_connections, streams)": "microseconds to open one unit",
            "cpu (registrations), idle_cpu": "percent of one core per unit",
            "cpu (requests)": "microseconds per request",
        },
    }
    (OUT_DIR / "capacity.json").write_text(json.dumps(document, indent=2, allow_nan=True) + "\n")
    print()
    print(text, end="")
    try:
        chart(parts, summaries, OUT_DIR / "capacity.png", header)
        print(f"\nwrote {OUT_DIR / 'capacity.md'}, capacity.json and capacity.png")
    except ImportError:
        print(f"\nwrote {OUT_DIR / 'capacity.md'} and capacity.json (no matplotlib: no chart)")
    problems = [p for part in parts.values() for p in part.problems] + [
        f"{name}: skipped {part.skipped}" for name, part in parts.items() if part.skipped
    ]
    print(f"whole run: {elapsed:.1f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
