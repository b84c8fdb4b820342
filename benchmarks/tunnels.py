"""Tunnels part: what the replica -> Pylon hop costs over the QUIC tunnels (raw-quic, http3)
against the HTTP/1.1 path.

`python -m benchmarks tunnels [--quick] [--profile] [--load-generator ...]` (or `nox -s bench --
tunnels`). One `stargate mock-backend` with no delays (streams of 100 tokens) serves every
transport; each transport gets its own replica and its own `stargate pylon` in front of that
engine (`--canary-interval-ms 0`, so no canary lands in a measured run; the replica's idle
timeout off, as in the routing part's hop phase):

- http: the replica's defaults; the Pylon's `--backend-connectivity http` (its HTTP/1.1
  listener).
- raw-quic: the replica `--quic-insecure --tunnel-protocol raw-quic`; the Pylon
  `--backend-connectivity direct --tunnel-protocol raw-quic`.
- http3: the same with `--tunnel-protocol http3`.
- reverse raw-quic (full run only; its data path is the direct one's code): the replica adds
  `--backend-connectivity reverse --reverse-tunnel-listen-addr 127.0.0.1:0`; the Pylon
  `--backend-connectivity reverse --tunnel-protocol raw-quic --quic-insecure`.

Each stack is started, waited for until a request through the replica succeeds, and checked to
use its transport (the replica's log names a `quic://` registration, a reverse tunnel, or an
`http://` one); then every replica's and Pylon's CPU with no request is read for a few seconds.
Requests are in the replica's form (`x-request-id`, `x-model`, `x-input-tokens`), sent through
each replica, and CPU is read from `/proc` (utime + stime) of the replica, the Pylon and the
engine around each measured run, as in the routing part's hop phase (benchmarks/routing.py,
phase 2):

- (a) CPU µs per non-streamed request of the replica and of the Pylon at 1 client connection and
  at 100. At 100 the requests in flight share ONE QUIC connection to the Pylon over a tunnel
  (`--direct-quic-connections 1`, the default; a reverse tunnel is one connection): "100 streams
  per connection"; over HTTP they use up to 100 upstream connections.
- (b) CPU µs per streamed SSE chunk (`data:` line) of each, at 1 and at 100 concurrent streams.
- (c) Latency at one connection: the 1-connection runs of (a) are also the latency runs, in
  rounds interleaved with the engine straight (as in the routing part); added p50 = p50 through
  the replica minus p50 straight to the engine.

The 1-connection runs of (a) use the proxy part's load generator (benchmarks/proxy.py: wrk where
installed, else its trio + h11 client; a time window after a warm-up). The others use a closed
loop in this process built on that client: it opens its connections with one request each, then
starts requests for a while and lets every one finish, CPU read around that. A time window would
count the CPU of the requests in flight at its edges but not their units: at 100 streams of a
second or more each, that is most of a short window's chunks.

Every measurement is taken in rounds that go over the transports in turn (the machine's load
drifts alike for all of them) and the rounds are summed (latency quantiles: the request-weighted
mean of the rounds'). The tunnel's cost lands on both ends, so the goals compare the hop's CPU,
the replica's plus the Pylon's (each is shown too). Goals (the issue's): over raw-quic, CPU per
streamed chunk <= 1.5x the HTTP path's and added p50 <= the HTTP path's + 0.3 ms; http3 within
1.3x of raw-quic (CPU per streamed chunk and per request). Same run, same machine, same engine:
the ratios are what hold when cores are shared. `--profile` records py-spy flame graphs of the
replica (bench-results/tunnels.svg) and of the Pylon (tunnels-pylon.svg) during the first raw-quic
run at 100 streams. Writes bench-results/tunnels.{md,json,png}. Not in the default suite (about 3
minutes; `--quick` about 40 s; run it by name).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import h11
import trio

from benchmarks.common import (
    BenchError,
    Deadline,
    PartResult,
    Processes,
    Profiler,
    Replica,
    Suite,
    cpu_seconds,
    cpu_seconds_tree,
    log_tail,
    machine_cpu_seconds,
    md_table,
    mock_backend_command,
    num,
    server_python,
    start_printing_server,
    start_replica,
    wait_until,
)
from benchmarks.proxy import (
    CHAT_BODY,
    MODEL,
    PATH,
    STREAM_BODY,
    LoadResult,
    LoadSpec,
    merged,
    run_h11,
    run_wrk,
    wrk_script,
)
from benchmarks.proxy import _Client as Connection
from benchmarks.routing import (
    HOP_TOKENS,
    PylonProcess,
    RouterInfo,
    _answers_200,
    _per,
    start_pylon,
    stop_routers_first,
)

NAME = "tunnels"
TITLE = "the Pylon hop over QUIC tunnels (raw-quic, http3) against HTTP"

GOAL_RAW_CHUNK_RATIO = 1.5
GOAL_RAW_ADDED_P50_MS = 0.3
GOAL_HTTP3_RATIO = 1.3
CONCURRENCY = (1, 100)
REQUEST, SSE = "request", "sse"
DIRECT = "direct"
"""The engine straight, the latency reference."""


@dataclass(frozen=True)
class Transport:
    """How one replica reaches its Pylon."""

    key: str
    label: str
    connectivity: str
    """The Pylon's `--backend-connectivity`: http, direct or reverse."""
    protocol: str = ""
    """`--tunnel-protocol` of both ends (none over HTTP)."""
    log_mark: str = ""
    """What the replica logs once this transport carries the registration."""

    def replica_flags(self) -> list[str]:
        if not self.protocol:
            return []
        flags = ["--quic-insecure", f"--tunnel-protocol={self.protocol}"]
        if self.connectivity == "reverse":
            flags += ["--backend-connectivity=reverse", "--reverse-tunnel-listen-addr=127.0.0.1:0"]
        return flags

    def pylon_flags(self) -> list[str]:
        flags = [f"--backend-connectivity={self.connectivity}", "--canary-interval-ms=0"]
        if self.protocol:
            flags.append(f"--tunnel-protocol={self.protocol}")
        if self.connectivity == "reverse":
            flags.append("--quic-insecure")
        return flags


HTTP = Transport("http", "HTTP/1.1", "http", log_mark="url=http://")
RAW_QUIC = Transport("raw-quic", "raw-quic (direct)", "direct", "raw-quic", "url=quic://")
HTTP3 = Transport("http3", "http3 (direct)", "direct", "http3", "url=quic://")
REVERSE = Transport(
    "reverse-raw-quic", "raw-quic (reverse)", "reverse", "raw-quic", "reverse tunnel connected"
)
TRANSPORTS = (HTTP, RAW_QUIC, HTTP3, REVERSE)
BY_KEY = {transport.key: transport for transport in TRANSPORTS}


@dataclass(frozen=True)
class Settings:
    transports: tuple[str, ...]
    cpu_seconds: float
    """Measured seconds per transport and concurrency (split over `cpu_rounds`)."""
    cpu_rounds: int
    latency_seconds: float
    """Measured seconds per target at one connection (split over `latency_rounds`)."""
    latency_rounds: int
    warmup: float
    """Before a target's first round of a kind; later rounds get `rewarm`."""
    rewarm: float
    idle_seconds: float
    """Every stack's CPU with no request, before the runs."""
    load_generator: str
    budget: float


def settings_for(suite: Suite) -> Settings:
    chosen = getattr(suite.args, "load_generator", "auto")
    if chosen == "wrk" and not shutil.which("wrk"):
        raise BenchError("--load-generator wrk: wrk is not installed")
    if chosen == "auto":
        chosen = "wrk" if shutil.which("wrk") else "h11"
    if suite.quick:
        return Settings(
            transports=(HTTP.key, RAW_QUIC.key, HTTP3.key),
            cpu_seconds=0.5,
            cpu_rounds=1,
            latency_seconds=0.8,
            latency_rounds=1,
            warmup=0.3,
            rewarm=0.2,
            idle_seconds=1.0,
            load_generator=chosen,
            budget=90.0,
        )
    return Settings(
        transports=tuple(transport.key for transport in TRANSPORTS),
        cpu_seconds=8.0,
        cpu_rounds=2,
        latency_seconds=6.0,
        latency_rounds=3,
        warmup=1.0,
        rewarm=0.3,
        idle_seconds=3.0,
        load_generator=chosen,
        budget=360.0,
    )


# ---- the processes ------------------------------------------------------------------------------


@dataclass
class Stack:
    """One transport's replica and Pylon."""

    transport: Transport
    replica: Replica
    pylon: PylonProcess


def start_stack(
    transport: Transport,
    procs: Processes,
    engine_port: int,
    log_dir: Path,
    deadline: Deadline,
) -> Stack:
    """A replica and a Pylon speaking `transport`, returned once a request through the replica
    succeeds and the replica's log shows the registration on that transport."""
    import httpx

    replica = start_replica(
        procs,
        log_dir,
        f"tunnels-{transport.key}",
        deadline,
        extra_args=["--registration-update-idle-timeout-ms=0", *transport.replica_flags()],
    )
    router = RouterInfo(server_python(), False, frozenset({"--http-listen-addr"}))
    pylon = start_pylon(
        procs,
        router,
        log_dir,
        f"{transport.key}-pylon",
        f"http://127.0.0.1:{engine_port}",
        replica.grpc,
        log_level="warning",
        extra_args=tuple(transport.pylon_flags()),
    )
    headers = {"x-request-id": "tunnels-ready", "x-model": MODEL, "x-input-tokens": "10"}
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    with httpx.Client(trust_env=False, timeout=5) as client:
        try:
            wait_until(
                functools.partial(_answers_200, client, f"{replica.base}{PATH}", headers, body),
                deadline.left(45),
                f"a request through the {transport.label} replica to succeed",
                replica.process,
                replica.log_path,
            )
        except BenchError as error:
            raise BenchError(f"{error}\nPylon:\n{log_tail(pylon.log_path)}") from None
    if transport.log_mark not in replica.log_path.read_text(errors="replace"):
        raise BenchError(
            f"{transport.label}: the replica's log lacks {transport.log_mark!r}: the Pylon is "
            f"not reached over that transport\n{log_tail(replica.log_path)}"
        )
    return Stack(transport, replica, pylon)


# ---- the measurements ---------------------------------------------------------------------------


@dataclass
class Measured:
    """Every run, summed over its rounds: `runs[kind][concurrency][target]`."""

    runs: dict[str, dict[int, dict[str, LoadResult]]] = field(
        default_factory=lambda: {
            REQUEST: {c: {} for c in CONCURRENCY},
            SSE: {c: {} for c in CONCURRENCY},
        }
    )
    idle: dict[str, dict[str, float]] = field(default_factory=dict)
    """CPU ms per second of each transport's replica and Pylon with no request."""
    skipped: list[str] = field(default_factory=list)
    profile_notes: list[str] = field(default_factory=list)

    def get(self, kind: str, concurrency: int, target: str) -> LoadResult | None:
        return self.runs[kind][concurrency].get(target)


@dataclass(frozen=True)
class Run:
    kind: str
    concurrency: int
    target: str
    seconds: float


def plan(settings: Settings) -> list[Run]:
    """The 1-connection request rounds (the latency runs, the engine straight included), then
    100 connections, then streams at 1 and at 100; each in rounds over the transports."""
    runs: list[Run] = []
    latency = settings.latency_seconds / settings.latency_rounds
    for _ in range(settings.latency_rounds):
        runs += [Run(REQUEST, 1, target, latency) for target in (DIRECT, *settings.transports)]
    seconds = settings.cpu_seconds / settings.cpu_rounds
    for kind, concurrency in ((REQUEST, 100), (SSE, 1), (SSE, 100)):
        for _ in range(settings.cpu_rounds):
            runs += [Run(kind, concurrency, key, seconds) for key in settings.transports]
    return runs


DRAIN_CAP = 60.0
"""A closed-loop run's requests get this long past its issuing window to finish; any still
running then are cut (and reported: their work is in the CPU, their units are not)."""


@dataclass
class _Tally:
    ok: int = 0
    errors: int = 0
    first_error: str = ""
    statuses: dict[str, int] = field(default_factory=dict)
    data_lines: int = 0
    issued: int = 0
    cut: int = 0


async def _issue(clients: list[Connection], body: bytes, seconds: float, first_id: int) -> _Tally:
    """Every client sends `body` one request at a time: one, then more while `seconds` have
    not passed; every request started then finishes (bounded by DRAIN_CAP)."""
    tally = _Tally()
    stop_issuing = trio.current_time() + seconds
    running = 0

    async def worker(client: Connection) -> None:
        nonlocal running
        first = True
        while (first or trio.current_time() < stop_issuing) and tally.errors < 50:
            first = False
            tally.issued += 1
            running += 1
            try:
                status, payload = await client.post(first_id + tally.issued, body)
            except (
                OSError,
                trio.BrokenResourceError,
                trio.ClosedResourceError,
                h11.ProtocolError,
            ) as error:
                tally.errors += 1
                tally.first_error = tally.first_error or repr(error)
                await client.close()
                continue
            finally:
                running -= 1
            tally.statuses[str(status)] = tally.statuses.get(str(status), 0) + 1
            if status == 200:
                tally.ok += 1
                tally.data_lines += payload.count(b"\ndata:") + payload.startswith(b"data:")

    with trio.move_on_after(seconds + DRAIN_CAP) as scope:
        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(worker, client)
    if scope.cancelled_caught:
        tally.cut = running
        tally.first_error = tally.first_error or f"{running} request(s) cut at the drain cap"
        with trio.CancelScope(shield=True):
            for client in clients:
                if not client.idle:
                    await client.close()
    return tally


async def _closed_loop(
    port: int, stream: bool, concurrency: int, seconds: float, pids: dict[str, int]
) -> LoadResult:
    """`concurrency` keep-alive connections: one non-streamed request each (connections and
    the replica's upstream ones opened), then the measured run (`_issue`), with the servers'
    CPU read right around it. Every unit started is finished and counted, so in-flight work at
    the edges of a time window (100 streams of a few seconds each) does not skew the figures
    per unit."""
    clients = [Connection(port) for _ in range(concurrency)]
    try:
        warm = await _issue(clients, CHAT_BODY, 0.0, 0)
        cpu_before = {name: cpu_seconds_tree(pid) for name, pid in pids.items()}
        own_before = time.process_time()
        machine_before = machine_cpu_seconds()
        start = time.perf_counter()
        tally = await _issue(clients, STREAM_BODY if stream else CHAT_BODY, seconds, warm.issued)
        wall = time.perf_counter() - start
        own = time.process_time() - own_before
        cpu = {name: cpu_seconds_tree(pid) - cpu_before[name] for name, pid in pids.items()}
        other = machine_cpu_seconds() - machine_before - own - sum(cpu.values())
    finally:
        with trio.CancelScope(shield=True):
            for client in clients:
                await client.close()
    return LoadResult(
        requests=tally.ok + tally.errors + tally.cut,
        ok=tally.ok,
        errors=tally.errors + tally.cut + warm.errors + warm.cut,
        first_error=warm.first_error or tally.first_error,
        statuses=tally.statuses,
        wall=wall,
        data_lines=tally.data_lines,
        cpu=cpu,
        loadgen_cpu=own,
        other_cpu=max(0.0, other),
        tool="closed-loop",
    )


def _stacks_alive(stacks: dict[str, Stack]) -> None:
    for stack in stacks.values():
        for process, what, log_path in (
            (stack.replica.process, "replica", stack.replica.log_path),
            (stack.pylon.process, "Pylon", stack.pylon.log_path),
        ):
            if process.poll() is not None:
                raise BenchError(f"the {stack.transport.label} {what} exited\n{log_tail(log_path)}")


def idle_cpu(stacks: dict[str, Stack], seconds: float) -> dict[str, dict[str, float]]:
    """CPU ms per second of every replica and Pylon over `seconds` with no request (heartbeats,
    the replica's health probe through its Pylon every second, the tunnels' timers)."""
    pids = {
        key: {"replica": stack.replica.pid, "pylon": stack.pylon.pid}
        for key, stack in stacks.items()
    }
    before = {
        key: {end: cpu_seconds(pid) for end, pid in ends.items()} for key, ends in pids.items()
    }
    time.sleep(seconds)
    return {
        key: {
            end: (cpu_seconds(pid) - before[key][end]) / seconds * 1000 for end, pid in ends.items()
        }
        for key, ends in pids.items()
    }


def measure(
    settings: Settings,
    stacks: dict[str, Stack],
    engine: tuple[int, int],
    deadline: Deadline,
    log_dir: Path,
    profilers: tuple[Profiler, Profiler],
) -> Measured:
    """Every run of `plan`: the 1-connection request runs with the proxy part's load generator
    (time windows: their latency quantiles), the others with `_closed_loop`."""
    engine_pid, engine_port = engine
    measured = Measured(idle=idle_cpu(stacks, settings.idle_seconds))
    replica_profiler, pylon_profiler = profilers
    for run in plan(settings):
        label = f"{run.kind} x{run.concurrency} {run.target}"
        where = measured.runs[run.kind][run.concurrency]
        windowed = run.kind == REQUEST and run.concurrency == 1
        warmup = settings.rewarm if run.target in where else settings.warmup
        needed = warmup + run.seconds + 15 if windowed else run.seconds + 30
        if deadline.left(1e9) < needed:
            measured.skipped.append(label)
            continue
        stack = stacks.get(run.target)
        if stack is None:
            port, pids = engine_port, {"engine": engine_pid}
        else:
            port = stack.replica.http
            pids = {"replica": stack.replica.pid, "pylon": stack.pylon.pid, "engine": engine_pid}
        tool = "closed-loop"
        if windowed:
            tool = "wrk" if settings.load_generator == "wrk" else "h11"
        print(f"  {label}: {run.seconds:g} s ({tool})", file=sys.stderr)
        profiling = stack is not None and run.kind == SSE and run.concurrency == 100
        with contextlib.ExitStack() as profiles:
            if profiling and stack is not None and run.target == RAW_QUIC.key:
                span = run.seconds + DRAIN_CAP
                what = "raw-quic streams, 100 at a time"
                profiles.enter_context(replica_profiler.record(stack.replica.pid, span, what))
                profiles.enter_context(pylon_profiler.record(stack.pylon.pid, span, what))
            if tool == "wrk":
                script = wrk_script(log_dir / f"{run.target}.lua", f"tunnels-{run.target}")
                result = run_wrk(script, port, 1, warmup, run.seconds, pids, label)
            elif tool == "h11":
                result = run_h11(LoadSpec(port, False, 1, warmup, run.seconds, pids), label)
            else:
                result = trio.run(
                    _closed_loop, port, run.kind == SSE, run.concurrency, run.seconds, pids
                )
        where[run.target] = merged(where[run.target], result) if run.target in where else result
        _stacks_alive(stacks)
    measured.profile_notes = [p.note for p in profilers if p.note]
    return measured


# ---- the figures --------------------------------------------------------------------------------


@dataclass
class Row:
    """One transport at one concurrency."""

    transport: str
    concurrency: int
    requests_per_second: float = math.nan
    replica_us_per_request: float = math.nan
    pylon_us_per_request: float = math.nan
    chunks_per_second: float = math.nan
    replica_us_per_chunk: float = math.nan
    pylon_us_per_chunk: float = math.nan
    p50_ms: float = math.nan
    """At one connection only."""
    added_p50_ms: float = math.nan
    added_p99_ms: float = math.nan

    @property
    def hop_us_per_request(self) -> float:
        return self.replica_us_per_request + self.pylon_us_per_request

    @property
    def hop_us_per_chunk(self) -> float:
        return self.replica_us_per_chunk + self.pylon_us_per_chunk

    def us_per(self, end: str, unit: str) -> float:
        """CPU µs of `end` (replica, pylon or hop) per `unit` (request or chunk)."""
        value: float = getattr(self, f"{end}_us_per_{unit}")
        return value


def _us_per(result: LoadResult | None, role: str, units: str) -> float:
    if result is None:
        return math.nan
    count = result.ok if units == "requests" else result.data_lines
    return _per(result.cpu.get(role, math.nan), count) * 1e6


def rows_of(measured: Measured, settings: Settings) -> list[Row]:
    direct = measured.get(REQUEST, 1, DIRECT)
    rows: list[Row] = []
    for key in settings.transports:
        for concurrency in CONCURRENCY:
            row = Row(key, concurrency)
            plain = measured.get(REQUEST, concurrency, key)
            sse = measured.get(SSE, concurrency, key)
            if plain is not None:
                row.requests_per_second = _per(plain.ok, plain.wall)
                row.replica_us_per_request = _us_per(plain, "replica", "requests")
                row.pylon_us_per_request = _us_per(plain, "pylon", "requests")
            if sse is not None:
                row.chunks_per_second = _per(sse.data_lines, sse.wall)
                row.replica_us_per_chunk = _us_per(sse, "replica", "chunks")
                row.pylon_us_per_chunk = _us_per(sse, "pylon", "chunks")
            if concurrency == 1 and plain is not None:
                row.p50_ms = plain.q(50)
                if direct is not None:
                    row.added_p50_ms = plain.q(50) - direct.q(50)
                    row.added_p99_ms = plain.q(99) - direct.q(99)
            rows.append(row)
    return rows


def _find(rows: list[Row], key: str, concurrency: int) -> Row | None:
    return next((r for r in rows if r.transport == key and r.concurrency == concurrency), None)


def _ratio(value: float, reference: float) -> float:
    return value / reference if reference > 0 else math.nan


def _mark(met: bool | None) -> str:
    return "-" if met is None else ("PASS" if met else "MISS")


Goal = tuple[str, str, bool | None]


def _ratio_goal(goal: str, row: Row, reference: Row, unit: str, limit: float) -> Goal:
    """`row`'s hop CPU per `unit` ("chunk" or "request") against `reference`'s, each end's
    ratio alongside."""
    hop = _ratio(row.us_per("hop", unit), reference.us_per("hop", unit))
    ends = ", ".join(
        f"{end} {num(_ratio(row.us_per(end, unit), reference.us_per(end, unit)), 2)}x"
        for end in ("replica", "pylon")
    )
    measured = (
        f"{num(row.us_per('hop', unit), 1)} µs vs {num(reference.us_per('hop', unit), 1)} µs: "
        f"{num(hop, 2)}x ({ends})"
    )
    return goal, measured, None if math.isnan(hop) else hop <= limit


def judge(rows: list[Row]) -> list[Goal]:
    """The issue's goals as (goal, measured, met); met is None when not measured."""
    goals: list[Goal] = []
    for concurrency in CONCURRENCY:
        raw, http = _find(rows, RAW_QUIC.key, concurrency), _find(rows, HTTP.key, concurrency)
        if raw is not None and http is not None:
            goal = (
                f"raw-quic CPU per streamed chunk ≤ {GOAL_RAW_CHUNK_RATIO:g}x HTTP's, "
                f"{concurrency} stream(s)"
            )
            goals.append(_ratio_goal(goal, raw, http, "chunk", GOAL_RAW_CHUNK_RATIO))
    raw, http = _find(rows, RAW_QUIC.key, 1), _find(rows, HTTP.key, 1)
    if raw is not None and http is not None:
        delta = raw.added_p50_ms - http.added_p50_ms
        goals.append(
            (
                f"raw-quic added p50 ≤ HTTP's + {GOAL_RAW_ADDED_P50_MS:g} ms",
                f"{num(raw.added_p50_ms, 3)} ms vs {num(http.added_p50_ms, 3)} ms: {delta:+.3f} ms",
                None if math.isnan(delta) else delta <= GOAL_RAW_ADDED_P50_MS,
            )
        )
    for concurrency in CONCURRENCY:
        h3, raw = _find(rows, HTTP3.key, concurrency), _find(rows, RAW_QUIC.key, concurrency)
        if h3 is None or raw is None:
            continue
        for unit, what in (("chunk", "stream(s)"), ("request", "connection(s)")):
            goal = (
                f"http3 CPU per {'streamed chunk' if unit == 'chunk' else 'request'} ≤ "
                f"{GOAL_HTTP3_RATIO:g}x raw-quic's, {concurrency} {what}"
            )
            goals.append(_ratio_goal(goal, h3, raw, unit, GOAL_HTTP3_RATIO))
    return goals


# ---- the report ---------------------------------------------------------------------------------


def main_table(rows: list[Row]) -> str:
    lines = []
    for row in rows:
        http = _find(rows, HTTP.key, row.concurrency)
        raw = _find(rows, RAW_QUIC.key, row.concurrency)
        versus_http = http is not None and row.transport != HTTP.key
        versus_raw = raw is not None and row.transport == HTTP3.key
        one = row.concurrency == 1
        lines.append(
            [
                BY_KEY[row.transport].label,
                str(row.concurrency),
                num(row.requests_per_second),
                num(row.replica_us_per_request),
                num(row.pylon_us_per_request),
                num(row.hop_us_per_request),
                num(_ratio(row.hop_us_per_request, http.hop_us_per_request), 2)
                if versus_http and http
                else "-",
                num(_ratio(row.hop_us_per_request, raw.hop_us_per_request), 2)
                if versus_raw and raw
                else "-",
                num(row.chunks_per_second),
                num(row.replica_us_per_chunk, 1),
                num(row.pylon_us_per_chunk, 1),
                num(row.hop_us_per_chunk, 1),
                num(_ratio(row.hop_us_per_chunk, http.hop_us_per_chunk), 2)
                if versus_http and http
                else "-",
                num(_ratio(row.hop_us_per_chunk, raw.hop_us_per_chunk), 2)
                if versus_raw and raw
                else "-",
                num(row.added_p50_ms, 3) if one else "-",
                f"{row.added_p50_ms - http.added_p50_ms:+.3f}"
                if one and versus_http and http and not math.isnan(row.added_p50_ms)
                else "-",
            ]
        )
    return md_table(
        [
            "Transport",
            "Concurrency",
            "req/s",
            "Replica µs/req",
            "Pylon µs/req",
            "Hop µs/req",
            "Hop/req vs HTTP",
            "Hop/req vs raw-quic",
            "Chunks/s",
            "Replica µs/chunk",
            "Pylon µs/chunk",
            "Hop µs/chunk",
            "Hop/chunk vs HTTP",
            "Hop/chunk vs raw-quic",
            "Added p50 ms",
            "Added p50 vs HTTP ms",
        ],
        lines,
    )


def detail_table(measured: Measured, settings: Settings) -> str:
    """Every run's counts, the engine's CPU and the others' load; latency quantiles at 1."""
    lines = []
    direct = measured.get(REQUEST, 1, DIRECT)
    for kind in (REQUEST, SSE):
        for concurrency in CONCURRENCY:
            for target in (DIRECT, *settings.transports):
                result = measured.get(kind, concurrency, target)
                if result is None:
                    continue
                units = result.ok if kind == REQUEST else result.data_lines
                latency = kind == REQUEST and concurrency == 1
                lines.append(
                    [
                        "engine straight" if target == DIRECT else BY_KEY[target].label,
                        "non-streamed" if kind == REQUEST else "SSE",
                        str(concurrency),
                        f"{result.ok:,}",
                        f"{result.errors:,}",
                        f"{units:,}",
                        num(_per(result.cpu.get("engine", math.nan), units) * 1e6, 1),
                        num(_per(result.other_cpu, result.wall) * 100),
                        num(result.q(50), 3) if latency else "-",
                        num(result.q(99), 3) if latency else "-",
                        num(result.q(99) - direct.q(99), 3)
                        if latency and direct is not None and target != DIRECT
                        else "-",
                    ]
                )
    return md_table(
        [
            "Target",
            "Kind",
            "Concurrency",
            "OK",
            "Errors",
            "Requests or chunks",
            "Engine µs each",
            "Others' CPU %",
            "p50 ms",
            "p99 ms",
            "Added p99 ms",
        ],
        lines,
    )


def idle_table(measured: Measured) -> str:
    rows = [
        [BY_KEY[key].label, num(ends["replica"], 1), num(ends["pylon"], 1)]
        for key, ends in measured.idle.items()
    ]
    return md_table(["Transport", "Replica CPU ms/s", "Pylon CPU ms/s"], rows)


def markdown(rows: list[Row], goals: list[Goal], measured: Measured, settings: Settings) -> str:
    tool = "wrk (1 thread)" if settings.load_generator == "wrk" else "the trio + h11 client"
    goal_table = md_table(
        ["Goal", "Measured", "Met"], [[goal, figure, _mark(met)] for goal, figure, met in goals]
    )
    text = (
        f"Goals (the issue's; benchmark goals, not tests; hop = replica + Pylon, each end's "
        f"ratio in brackets):\n\n{goal_table}\n\n"
        f"One `stargate mock-backend` with no delays ({HOP_TOKENS} tokens per stream) for every "
        "transport; per transport its own replica and `stargate pylon` (no canaries); requests "
        "in the replica's form (`x-model`, `x-input-tokens`, `x-request-id`). CPU = utime + "
        "stime from `/proc` over the measured runs only; hop = replica + Pylon. Concurrency = "
        "client connections, one request at a time each: at 100, a tunnel carries the requests "
        "as streams of ONE QUIC connection, HTTP over up to 100 upstream connections. At 1 "
        f"connection, non-streamed: {tool} (benchmarks/proxy.py), "
        f"{settings.latency_seconds:g} s per target in {settings.latency_rounds} round(s) "
        "interleaved with the engine straight: these runs give both the CPU per request and the "
        "latency (added = minus the engine straight). The others (100 connections, and streams "
        "at 1 and 100): closed loops in this process that open their connections with one "
        f"request each, then start requests for {settings.cpu_seconds / settings.cpu_rounds:g} s "
        f"and let every one finish (CPU read around that), {settings.cpu_rounds} round(s) over "
        "the transports; req/s and chunks/s include that drain. Ratios: each tunnel row "
        "against the HTTP row of the same concurrency, http3 against raw-quic.\n\n"
        f"{main_table(rows)}\n\n"
        "Every run (engine CPU per request or chunk; others' CPU % = what every other process "
        "used during the run, in % of one core; latency at one connection):\n\n"
        f"{detail_table(measured, settings)}\n\n"
        f"With no request ({settings.idle_seconds:g} s before the runs; heartbeats, the "
        "replica's health probe through the Pylon every second, the tunnels' own timers):\n\n"
        f"{idle_table(measured)}"
    )
    if measured.skipped:
        text += f"\n\nSkipped (time budget): {', '.join(measured.skipped)}."
    return text


def chart(rows: list[Row], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not rows:
        return False
    keys = list(dict.fromkeys(row.transport for row in rows))
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.38
    for axis, measure, title in (
        (axes[0], "request", "CPU µs per non-streamed request"),
        (axes[1], "chunk", "CPU µs per streamed chunk"),
    ):
        for offset, concurrency in ((-width / 2, 1), (width / 2, 100)):
            found = [_find(rows, key, concurrency) for key in keys]
            replica = [r.us_per("replica", measure) if r else math.nan for r in found]
            pylon = [r.us_per("pylon", measure) if r else math.nan for r in found]
            xs = [x + offset for x in range(len(keys))]
            shade = 1.0 if concurrency == 1 else 0.55
            axis.bar(
                xs, replica, width, color="tab:blue", alpha=shade, label=f"replica, {concurrency}"
            )
            axis.bar(
                xs,
                pylon,
                width,
                bottom=replica,
                color="tab:orange",
                alpha=shade,
                label=f"Pylon, {concurrency}",
            )
        axis.set_title(title, fontsize=10)
        axis.legend(fontsize=7, loc="best")
    added = [_find(rows, key, 1) for key in keys]
    axes[2].bar(range(len(keys)), [r.added_p50_ms if r else math.nan for r in added], 0.6)
    http = _find(rows, HTTP.key, 1)
    if http is not None and not math.isnan(http.added_p50_ms):
        axes[2].axhline(
            http.added_p50_ms + GOAL_RAW_ADDED_P50_MS,
            color="tab:red",
            linestyle=":",
            label=f"goal (raw-quic): HTTP + {GOAL_RAW_ADDED_P50_MS:g} ms",
        )
        axes[2].legend(fontsize=7, loc="best")
    axes[2].set_title("added p50 at one connection (ms)", fontsize=10)
    for axis in axes:
        axis.set_xticks(range(len(keys)), [BY_KEY[key].label for key in keys], fontsize=8)
        axis.grid(True, axis="y", alpha=0.3)
    figure.suptitle(
        f"stargate {NAME}: replica -> Pylon -> engine; bars at 1 and 100 (lighter) "
        "concurrent requests or streams",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


# ---- the part -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _log_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="stargate-tunnels-") as tmp:
        yield Path(tmp)


def run(suite: Suite) -> PartResult:
    settings = settings_for(suite)
    deadline = Deadline(settings.budget)
    began = time.monotonic()
    procs = Processes()
    profilers = (
        Profiler(suite.profile, suite.out_dir, procs, NAME),
        Profiler(suite.profile, suite.out_dir, procs, f"{NAME}-pylon"),
    )
    stacks: dict[str, Stack] = {}
    with _log_dir() as log_dir:
        try:
            engine, engine_port = start_printing_server(
                procs,
                mock_backend_command(MODEL, "--tokens", str(HOP_TOKENS)),
                log_dir / "engine.log",
                "the mock engine",
                deadline.left(30),
            )
            transports = [BY_KEY[key] for key in settings.transports]
            with ThreadPoolExecutor(len(transports)) as pool:
                futures = [
                    pool.submit(start_stack, t, procs, engine_port, log_dir, deadline)
                    for t in transports
                ]
                stacks = {f.result().transport.key: f.result() for f in futures}
            print(
                f"  routable: {', '.join(t.label for t in transports)} "
                f"({time.monotonic() - began:.1f} s)",
                file=sys.stderr,
            )
            measured = measure(
                settings, stacks, (engine.pid, engine_port), deadline, log_dir, profilers
            )
        finally:
            # Pylons first, then the replicas, then the engine (an engine stopped first would
            # fail the health probes the replicas still send through their Pylons).
            routers = [s.pylon.process for s in stacks.values()]
            routers += [s.replica.process for s in stacks.values()]
            stop_routers_first(procs, routers, None)
    rows = rows_of(measured, settings)
    goals = judge(rows)
    for goal, figure, met in goals:
        print(f"  {_mark(met)}: {goal}: {figure}", file=sys.stderr)
    problems = [f"skipped (time budget): {label}" for label in measured.skipped]
    for kind, by_concurrency in measured.runs.items():
        for concurrency, by_target in by_concurrency.items():
            for target, result in by_target.items():
                if result.errors or result.ok == 0:
                    problems.append(
                        f"{kind} x{concurrency} {target}: {result.ok}/{result.requests} OK, "
                        f"statuses {result.statuses}, first error {result.first_error}"
                    )
    notes = list(measured.profile_notes)
    charts: list[str] = []
    try:
        if chart(rows, suite.out_dir / f"{NAME}.png"):
            charts.append(f"{NAME}.png")
    except Exception as error:  # a chart is not worth the figures
        notes.append(f"no chart: {error!r}")
    data: dict[str, Any] = {
        "goals": [{"goal": g, "measured": m, "met": met} for g, m, met in goals],
        "rows": [
            {
                **asdict(row),
                "hop_us_per_request": row.hop_us_per_request,
                "hop_us_per_chunk": row.hop_us_per_chunk,
            }
            for row in rows
        ],
        "idle_cpu_ms_per_second": measured.idle,
        "runs": {
            kind: {
                str(concurrency): {target: asdict(result) for target, result in by_target.items()}
                for concurrency, by_target in by_concurrency.items()
            }
            for kind, by_concurrency in measured.runs.items()
        },
    }
    return PartResult(
        NAME,
        TITLE,
        markdown(rows, goals, measured, settings),
        data,
        settings={
            **asdict(settings),
            "hop_tokens": HOP_TOKENS,
            "concurrency": CONCURRENCY,
            "flags": {
                t.key: {"replica": t.replica_flags(), "pylon": t.pylon_flags()} for t in TRANSPORTS
            },
        },
        problems=problems,
        charts=charts,
        notes=notes,
        elapsed=time.monotonic() - began,
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.tunnels [options]`: the same as `python -m benchmarks tunnels`."""
    from benchmarks.__main__ import main as suite_main

    return suite_main([NAME, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
