"""Proxy benchmark: what a request costs through one replica, on loopback.

Run with `nox -s bench -- proxy [--quick]` (or `python -m benchmarks.proxy [--quick]` from the
project root). One run starts a mock backend, a replica with that backend registered over a real
gRPC registration stream, and a no-op ASGI app on the same Hypercorn-trio stack, then measures:

1. Non-streaming throughput (N keep-alive connections, a fixed request count) against the
   replica, the no-op app and the mock directly: requests/s and the *server's* CPU time per
   request, read from `/proc/<pid>/stat` (utime + stime, all threads) before and after the
   measured phase; "requests per core-second" is requests divided by those CPU seconds.
2. Added latency at one connection: sequential requests through the replica minus direct.
3. SSE: `data:` lines received per second per core of replica CPU (50 tokens, no inter-token
   delay), with the direct-to-mock figures for reference.

The load generator is a small trio + h11 keep-alive client that runs in its own process (it shares
no GIL with anything measured); it samples the servers' CPU counters itself, right around the
measured phase, after a warm-up on the same connections. Everything listens on 127.0.0.1 (the
replica's metrics listener binds 0.0.0.0 by design, but nothing talks to it), every phase is
bounded in request count and time, the whole run is bounded by `--budget`, and every process
started is stopped on the way out, errors included.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
    cpu_seconds,
    free_ports,
    start_printing_server,
    wait_until,
)
from benchmarks.h11_client import read_response

MODEL = "bench-model"
TOKENS = 50
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
CHAT_BODY = json.dumps(CHAT, separators=(",", ":")).encode()
STREAM_BODY = json.dumps({**CHAT, "stream": True}, separators=(",", ":")).encode()
PATH = "/v1/chat/completions"


# ---- the load generator (runs in its own process) -----------------------------------------------


@dataclass
class LoadSpec:
    """One load-generator run: warm-up, then a measured phase on the same connections."""

    port: int
    stream: bool
    connections: int
    warmup: int
    requests: int
    time_limit: float
    pids: dict[str, int]


@dataclass
class LoadResult:
    requests: int = 0
    ok: int = 0
    errors: int = 0
    first_error: str = ""
    statuses: dict[str, int] = field(default_factory=dict)
    wall: float = 0.0
    p50_ms: float = math.nan
    p90_ms: float = math.nan
    p99_ms: float = math.nan
    max_ms: float = math.nan
    data_lines: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    loadgen_cpu: float = 0.0
    timed_out: bool = False


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (NaN when empty)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class _Client:
    """One HTTP/1.1 keep-alive connection driven with h11; reconnects after a failure."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._host = f"127.0.0.1:{port}".encode()
        self._stream: trio.SocketStream | None = None
        self._conn = h11.Connection(h11.CLIENT)

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()

    async def post(self, request_id: int, body: bytes) -> tuple[int, bytes]:
        if self._stream is None:
            self._stream = await trio.open_tcp_stream("127.0.0.1", self._port)
            self._conn = h11.Connection(h11.CLIENT)
        conn, stream = self._conn, self._stream
        headers = [
            (b"host", self._host),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", b"bench-%d" % request_id),
            (b"x-input-tokens", b"10"),
            (b"x-model", MODEL.encode()),
        ]
        await stream.send_all(
            (conn.send(h11.Request(method=b"POST", target=PATH, headers=headers)) or b"")
            + (conn.send(h11.Data(data=body)) or b"")
            + (conn.send(h11.EndOfMessage()) or b"")
        )
        status, answer = await read_response(conn, stream)
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:  # the server will close: start afresh next time
            await self.close()
        return status, answer


@dataclass
class _Tally:
    latencies: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    ok: int = 0
    errors: int = 0
    first_error: str = ""
    data_lines: int = 0
    issued: int = 0


async def _phase(
    clients: list[_Client], spec: LoadSpec, count: int, time_limit: float, first_id: int
) -> tuple[_Tally, bool]:
    """Send `count` requests over `clients` (each one request at a time); stop at `time_limit`."""
    tally = _Tally()
    body = STREAM_BODY if spec.stream else CHAT_BODY
    error_limit = max(20, count // 10)

    async def worker(client: _Client) -> None:
        while tally.issued < count and tally.errors < error_limit:
            request_id = first_id + tally.issued
            tally.issued += 1
            start = time.perf_counter()
            try:
                status, payload = await client.post(request_id, body)
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
            tally.latencies.append(time.perf_counter() - start)
            tally.statuses[str(status)] = tally.statuses.get(str(status), 0) + 1
            if status == 200:
                tally.ok += 1
            if spec.stream:
                tally.data_lines += sum(
                    1 for line in payload.split(b"\n") if line.startswith(b"data:")
                )

    with trio.move_on_after(time_limit) as scope:
        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(worker, client)
    return tally, scope.cancelled_caught


async def _generate_load(spec: LoadSpec) -> LoadResult:
    clients = [_Client(spec.port) for _ in range(spec.connections)]
    try:
        warm, _ = await _phase(clients, spec, spec.warmup, spec.time_limit / 3, 0)
        cpu_before = {name: cpu_seconds(pid) for name, pid in spec.pids.items()}
        own_before = time.process_time()
        start = time.perf_counter()
        tally, timed_out = await _phase(clients, spec, spec.requests, spec.time_limit, warm.issued)
        wall = time.perf_counter() - start
        own = time.process_time() - own_before
        cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in spec.pids.items()}
    finally:
        with trio.CancelScope(shield=True):
            for client in clients:
                await client.close()
    latencies = sorted(tally.latencies)
    return LoadResult(
        requests=len(latencies) + tally.errors,
        ok=tally.ok,
        errors=tally.errors + warm.errors,
        first_error=warm.first_error or tally.first_error,
        statuses=tally.statuses,
        wall=wall,
        p50_ms=percentile(latencies, 0.50) * 1000,
        p90_ms=percentile(latencies, 0.90) * 1000,
        p99_ms=percentile(latencies, 0.99) * 1000,
        max_ms=percentile(latencies, 1.0) * 1000,
        data_lines=tally.data_lines,
        cpu=cpu,
        loadgen_cpu=own,
        timed_out=timed_out,
    )


def loadgen_main() -> None:
    """Entry point of the load-generator process: a JSON `LoadSpec` on stdin, a result out."""
    spec = LoadSpec(**json.loads(sys.stdin.read()))
    result = trio.run(_generate_load, spec)
    sys.stdout.write(json.dumps(asdict(result)) + "\n")


# ---- the no-op ASGI app (runs in its own process) -----------------------------------------------

NOOP_BODY = (
    b'{"id":"noop","object":"chat.completion","model":"bench-model","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}'
)
NOOP_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(NOOP_BODY)).encode()),
]


async def noop_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Raw ASGI: read the request body, answer 200 with a fixed JSON body."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200, "headers": NOOP_HEADERS})
    await send({"type": "http.response.body", "body": NOOP_BODY})


def serve_noop() -> None:
    """Serve `noop_app` with the replica's own Hypercorn-trio setup on a free loopback port."""
    from stargate.config import ListenAddress
    from stargate.serving import bind_listener, hypercorn_config, serve_asgi

    sock = bind_listener("no-op", ListenAddress("127.0.0.1", 0))
    port = sock.getsockname()[1]

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                serve_asgi, noop_app, sock, hypercorn_config(1.0), trio.sleep_forever
            )
            print(f"listening on http://127.0.0.1:{port}", flush=True)

    trio.run(run)


# ---- the servers -------------------------------------------------------------------------------


@dataclass
class Servers:
    replica_pid: int
    replica_port: int
    mock_pid: int
    mock_port: int
    noop_pid: int
    noop_port: int


@contextmanager
def started_servers(procs: Processes, log_dir: Path, deadline: Deadline) -> Iterator[Servers]:
    """Mock backend, no-op app and a replica with the mock registered; yields once routable."""
    import httpx

    python = sys.executable
    mock, mock_port = start_printing_server(
        procs,
        [
            python,
            "-m",
            "stargate",
            "mock-backend",
            "--port",
            "0",
            "--model",
            MODEL,
            "--tokens",
            str(TOKENS),
            "--log-level",
            "warning",
        ],
        log_dir / "mock.log",
        "the mock backend",
        deadline.left(20),
    )
    noop, noop_port = start_printing_server(
        procs,
        [python, "-c", "from benchmarks.proxy import serve_noop; serve_noop()"],
        log_dir / "noop.log",
        "the no-op ASGI server",
        deadline.left(20),
    )
    http, grpc_port, discovery, metrics = free_ports(4)
    replica_log = log_dir / "replica.log"
    with replica_log.open("wb") as log:
        replica = procs.spawn(
            [
                python,
                "-m",
                "stargate",
                "serve",
                f"--http-listen-addr=127.0.0.1:{http}",
                f"--listen-addr=127.0.0.1:{grpc_port}",
                f"--model-discovery-listen-addr=127.0.0.1:{discovery}",
                f"--metrics-port={metrics}",
                "--readiness-warmup-ms=0",
                "--disable-dns-discovery",
                "--registration-update-idle-timeout-ms=0",
                "--shutdown-drain-timeout-ms=1000",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{http}"
    with httpx.Client(trust_env=False, timeout=5) as client:
        wait_until(
            lambda: client.get(f"{base}/healthz").status_code == 200,
            deadline.left(30),
            "the replica's /healthz",
            replica,
            replica_log,
        )
        registration = Registration(
            grpc_port, "bench-backend-0", f"http://127.0.0.1:{mock_port}", [MODEL]
        )
        try:
            registration.wait_ack(deadline.left(10))
            headers = {"x-request-id": "bench-ready", "x-input-tokens": "10", "x-model": MODEL}
            wait_until(
                lambda: (
                    client.post(f"{base}{PATH}", headers=headers, content=CHAT_BODY).status_code
                    == 200
                ),
                deadline.left(20),
                "a request through the replica to succeed",
                replica,
                replica_log,
            )
            yield Servers(replica.pid, http, mock.pid, mock_port, noop.pid, noop_port)
        finally:
            registration.close()


# ---- the measurements ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    connections: int
    requests: int
    warmup: int
    latency_requests: int
    sse_requests: int
    phase_limit: float
    budget: float
    label: str


def run_load(spec: LoadSpec, label: str) -> LoadResult:
    """Run one load-generator process to completion and return what it measured."""
    print(
        f"  {label}: {spec.requests} requests on {spec.connections} connection(s)", file=sys.stderr
    )
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    try:
        completed = subprocess.run(
            [sys.executable, "-c", "from benchmarks.proxy import loadgen_main; loadgen_main()"],
            input=json.dumps(asdict(spec)),
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=spec.time_limit * 4 / 3 + 20,
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"{label}: the load generator did not finish in time") from None
    if completed.returncode != 0:
        raise BenchError(f"{label}: the load generator failed:\n{completed.stderr[-3000:]}")
    return LoadResult(**json.loads(completed.stdout.strip().splitlines()[-1]))


@dataclass
class Results:
    nonstream: dict[str, LoadResult] = field(default_factory=dict)
    latency: dict[str, LoadResult] = field(default_factory=dict)
    sse: dict[str, LoadResult] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def measure(servers: Servers, settings: Settings, deadline: Deadline) -> Results:
    results = Results()
    targets = {
        "replica": (
            servers.replica_port,
            {"replica": servers.replica_pid, "mock": servers.mock_pid},
        ),
        "noop": (servers.noop_port, {"server": servers.noop_pid}),
        "direct": (servers.mock_port, {"mock": servers.mock_pid}),
    }
    plan: list[tuple[dict[str, LoadResult], str, str, bool, int, int, int]] = [
        # (where, target, label, stream, connections, warm-up, requests)
        (
            results.nonstream,
            "replica",
            "(a) replica",
            False,
            settings.connections,
            settings.warmup,
            settings.requests,
        ),
        (
            results.nonstream,
            "noop",
            "(b) no-op",
            False,
            settings.connections,
            settings.warmup,
            settings.requests,
        ),
        (
            results.nonstream,
            "direct",
            "(c) direct",
            False,
            settings.connections,
            settings.warmup,
            settings.requests,
        ),
        (
            results.latency,
            "replica",
            "latency replica",
            False,
            1,
            max(10, settings.latency_requests // 10),
            settings.latency_requests,
        ),
        (
            results.latency,
            "direct",
            "latency direct",
            False,
            1,
            max(10, settings.latency_requests // 10),
            settings.latency_requests,
        ),
        (
            results.latency,
            "noop",
            "latency no-op",
            False,
            1,
            max(10, settings.latency_requests // 10),
            settings.latency_requests,
        ),
        (
            results.sse,
            "replica",
            "SSE replica",
            True,
            settings.connections,
            max(settings.connections, settings.sse_requests // 10),
            settings.sse_requests,
        ),
        (
            results.sse,
            "direct",
            "SSE direct",
            True,
            settings.connections,
            max(settings.connections, settings.sse_requests // 10),
            settings.sse_requests,
        ),
    ]
    for where, target, label, stream, connections, warmup, requests in plan:
        # Leave room for the load generator's own start-up and the final shutdown.
        limit = deadline.left(settings.phase_limit + 8) - 8
        if limit < 1:
            results.skipped.append(label)
            continue
        port, pids = targets[target]
        spec = LoadSpec(port, stream, connections, warmup, requests, limit * 3 / 4, pids)
        where[target] = run_load(spec, label)
    return results


# ---- the report ---------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def _num(value: float, digits: int = 0) -> str:
    if math.isnan(value) or math.isinf(value):
        return "-"
    return f"{value:,.{digits}f}"


def _signed(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:+,.{digits}f}"


def _per(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def _ordered(results_by_target: dict[str, LoadResult]) -> list[tuple[str, LoadResult]]:
    order = ["replica", "noop", "direct"]
    return sorted(results_by_target.items(), key=lambda item: order.index(item[0]))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def report(results: Results, settings: Settings) -> list[str]:
    """Print the tables; return the problems found (errors, time-outs, skipped phases)."""
    problems: list[str] = [f"skipped (time budget): {label}" for label in results.skipped]
    for group, results_by_target in (
        ("non-streaming", results.nonstream),
        ("latency", results.latency),
        ("SSE", results.sse),
    ):
        for target, result in results_by_target.items():
            if result.errors or result.ok < result.requests or result.timed_out:
                problems.append(
                    f"{group} {target}: {result.ok}/{result.requests} OK, {result.errors} errors, "
                    f"statuses {result.statuses}, timed out: {result.timed_out}"
                    + (f", first error {result.first_error}" if result.first_error else "")
                )

    print()
    print(
        f"stargate proxy benchmark ({settings.label}): Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs ({_cpu_model()}), loopback only"
    )
    print(
        f"load generator: trio + h11 keep-alive client in its own process; CPU = utime+stime "
        f"from /proc/<pid>/stat (tick {1000 / CLK_TCK:g} ms) over the measured phase only"
    )

    names = {
        "replica": "(a) replica -> mock",
        "noop": "(b) no-op ASGI, Hypercorn-trio",
        "direct": "(c) direct -> mock",
    }
    server_key = {"replica": "replica", "noop": "server", "direct": "mock"}
    cpu_per_req: dict[str, float] = {}
    rps: dict[str, float] = {}
    rows: list[list[str]] = []
    for target, result in _ordered(results.nonstream):
        server_cpu = result.cpu.get(server_key[target], math.nan)
        cpu_per_req[target] = _per(server_cpu, result.ok) * 1e6
        rps[target] = _per(result.ok, result.wall)
        mock_cpu = result.cpu.get("mock", math.nan) if target == "replica" else math.nan
        rows.append(
            [
                names[target],
                f"{result.ok}/{result.requests}",
                _num(rps[target]),
                _num(result.p50_ms, 2),
                _num(result.p99_ms, 2),
                _num(cpu_per_req[target]),
                _num(_per(result.ok, server_cpu)),
                _num(_per(mock_cpu, result.ok) * 1e6),
                _num(_per(result.loadgen_cpu, result.ok) * 1e6),
            ]
        )
    print()
    print(
        f"1. Non-streaming POST {PATH} ({settings.connections} connections, "
        f"{settings.requests} requests after {settings.warmup} warm-up)"
    )
    print(
        _table(
            [
                "target",
                "OK",
                "req/s",
                "p50 ms",
                "p99 ms",
                "server CPU us/req",
                "req/s per core",
                "mock CPU us/req",
                "loadgen CPU us/req",
            ],
            rows,
        )
    )
    if "replica" in cpu_per_req:
        for other, name in (("noop", "no-op"), ("direct", "direct")):
            if other not in cpu_per_req:
                continue
            mine, theirs = cpu_per_req["replica"], cpu_per_req[other]
            print(
                f"replica vs {name}: CPU per request x{_num(mine / theirs, 2)} "
                f"({_signed(mine - theirs, 0)} us), req/s x{_num(rps['replica'] / rps[other], 2)}, "
                f"req/s per core x{_num(theirs / mine, 2)}"
            )
        replica = results.nonstream["replica"]
        total = _per(replica.cpu.get("replica", 0) + replica.cpu.get("mock", 0), replica.ok) * 1e6
        print(f"end to end through the replica (replica + mock CPU): {_num(total)} us/req")

    print()
    print(f"2. Latency at one connection ({settings.latency_requests} sequential requests each)")
    direct = results.latency.get("direct")
    rows = []
    for target, result in _ordered(results.latency):
        added50 = added99 = "-"
        if direct is not None and target != "direct":
            added50 = _signed(result.p50_ms - direct.p50_ms, 3)
            added99 = _signed(result.p99_ms - direct.p99_ms, 3)
        rows.append(
            [
                names[target],
                f"{result.ok}/{result.requests}",
                _num(result.p50_ms, 3),
                _num(result.p90_ms, 3),
                _num(result.p99_ms, 3),
                _num(result.max_ms, 3),
                added50,
                added99,
            ]
        )
    print(
        _table(
            [
                "target",
                "OK",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "max ms",
                "added p50 ms",
                "added p99 ms",
            ],
            rows,
        )
    )

    print()
    print(
        f"3. SSE ({settings.sse_requests} streams of {TOKENS} tokens, inter-token 0, "
        f"{settings.connections} connections; chunks = 'data:' lines received)"
    )
    rows = []
    for target, result in _ordered(results.sse):
        server_cpu = result.cpu.get(server_key[target], math.nan)
        lines_per_stream = _per(result.data_lines, result.ok)
        per_stream_us = _per(server_cpu, result.ok) * 1e6
        plain_us = cpu_per_req.get(target, math.nan)
        rows.append(
            [
                names[target],
                f"{result.ok}/{result.requests}",
                _num(lines_per_stream, 1),
                _num(_per(result.data_lines, result.wall)),
                _num(server_cpu, 2),
                _num(_per(result.data_lines, server_cpu)),
                _num(_per(server_cpu, result.data_lines) * 1e6, 1),
                _num(per_stream_us),
                _num((per_stream_us - plain_us) / lines_per_stream, 1),
            ]
        )
    print(
        _table(
            [
                "target",
                "OK",
                "chunks/stream",
                "chunks/s",
                "server CPU s",
                "chunks/s per core",
                "CPU us/chunk",
                "CPU us/stream",
                "extra us/chunk vs non-stream",
            ],
            rows,
        )
    )
    print()
    print(
        "req/s and latency share the machine's cores between the load generator, the mock and "
        "the server; CPU per request and per core do not depend on that."
    )
    return problems


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="nox -s bench -- proxy", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--quick", action="store_true", help="small counts: a smoke run")
    parser.add_argument("--connections", type=int, help="concurrent connections (16)")
    parser.add_argument("--requests", type=int, help="non-streaming requests per target (3000)")
    parser.add_argument("--warmup", type=int, help="warm-up requests per target (300)")
    parser.add_argument("--latency-requests", type=int, help="sequential requests (500)")
    parser.add_argument("--sse-requests", type=int, help="streams per SSE target (300)")
    parser.add_argument("--phase-limit", type=float, help="seconds per measured phase (15)")
    parser.add_argument("--budget", type=float, help="seconds for the whole run (105)")
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    settings = Settings(
        connections=args.connections or (8 if quick else 16),
        requests=args.requests or (200 if quick else 3000),
        warmup=args.warmup if args.warmup is not None else (20 if quick else 300),
        latency_requests=args.latency_requests or (50 if quick else 500),
        sse_requests=args.sse_requests or (20 if quick else 300),
        phase_limit=args.phase_limit or (5.0 if quick else 15.0),
        budget=args.budget or (45.0 if quick else 105.0),
        label="quick" if quick else "full",
    )
    if min(settings.connections, settings.requests, settings.latency_requests) < 1:
        parser.error("counts must be positive")
    if settings.sse_requests < 1 or settings.warmup < 0:
        parser.error("counts must be positive")
    return settings


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    # SIGTERM (a CI timeout, say) unwinds like Ctrl-C, so every process started is still stopped.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    deadline = Deadline(settings.budget)
    started = time.monotonic()
    procs = Processes()
    try:
        with (
            tempfile.TemporaryDirectory(prefix="stargate-bench-") as log_dir,
            started_servers(procs, Path(log_dir), deadline) as servers,
        ):
            print(f"servers up in {time.monotonic() - started:.1f} s; measuring", file=sys.stderr)
            results = measure(servers, settings, deadline)
    except BenchError as error:
        print(f"benchmark failed: {error}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
    problems = report(results, settings)
    print(f"whole run: {time.monotonic() - started:.1f} s")
    for problem in problems:
        print(f"WARNING: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
