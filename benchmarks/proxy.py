"""Proxy part: what a request costs through one replica, on loopback, against three references.

`python -m benchmarks proxy [--quick] [--connections N] [--seconds S] [--load-generator ...]`
(or `nox -s bench -- proxy`). One run starts a `stargate mock-backend` (the engine), a replica
with the mock registered over a real gRPC registration stream, a no-op ASGI app on the replica's
own Hypercorn-trio stack (benchmarks/proxy.py `serve_noop`), and nginx as a keep-alive reverse
proxy in front of the same mock (a temporary nginx.conf: 1 worker, `upstream { keepalive 256; }`,
`proxy_http_version 1.1`, `proxy_set_header Connection ""`, `proxy_buffering off`; skipped with a
note where nginx is not installed). Then, for each target (replica -> mock, no-op, nginx -> mock,
mock direct):

1. Throughput: N keep-alive connections (16) for a fixed time after a warm-up: requests/s, and
   the *server's* CPU per request, from `/proc/<pid>/stat` (utime + stime, every thread; nginx:
   master and worker) read right around the measured run. The goal (issue 13) is
   noop CPU / replica CPU >= 0.8: the replica costing at most 25 % more than the bare stack.
2. Latency at one connection: sequential requests for a fixed time; p50/p90/p99/p99.9 and the
   latency the replica adds over direct (goals: <= 0.5 ms p50, <= 1.5 ms p99), with its CDF.
3. SSE burst: streams of 50 tokens with no inter-token delay through the replica and direct:
   `data:` lines per second per core of server CPU.

The load generator is `wrk` (one thread; a Lua script sets the POST body and headers and prints
the latency quantiles as JSON) where installed, else (or with `--load-generator h11`) a trio + h11
keep-alive client in its own process (this module's `loadgen_main`); the SSE phase always uses the
h11 client (it counts `data:` lines). Everything listens on 127.0.0.1, each phase is bounded in
time, the part within its budget, and every process started is stopped on the way out. Writes
bench-results/proxy.{md,json} and proxy.png (latency CDFs at one connection); `--profile`
records a flame graph of the replica during its throughput run.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
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
    ROOT,
    BenchError,
    Deadline,
    PartResult,
    Processes,
    Profiler,
    Registration,
    Replica,
    Suite,
    cpu_seconds_tree,
    free_ports,
    log_tail,
    machine_cpu_seconds,
    md_table,
    mock_backend_command,
    num,
    percentile,
    server_python,
    start_printing_server,
    start_replica,
    wait_until,
)
from benchmarks.h11_client import read_response

NAME = "proxy"
TITLE = "cost and latency of a request through the replica"
MODEL = "bench-model"
TOKENS = 50
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
CHAT_BODY = json.dumps(CHAT, separators=(",", ":")).encode()
STREAM_BODY = json.dumps({**CHAT, "stream": True}, separators=(",", ":")).encode()
PATH = "/v1/chat/completions"
GOAL_NOOP_RATIO = 0.8
GOAL_ADDED_P50_MS = 0.5
GOAL_ADDED_P99_MS = 1.5
QUANTILES = [q / 10 for q in range(0, 1000, 5)] + [99.9, 99.99, 100.0]
"""Latency quantiles kept (percent): every 0.5 %, then the tail (for CDFs)."""


# ---- the h11 load generator (runs in its own process) -------------------------------------------


@dataclass
class LoadSpec:
    """One load-generator run: a warm-up, then a measured phase on the same connections."""

    port: int
    stream: bool
    connections: int
    warmup_seconds: float
    seconds: float
    pids: dict[str, int]


@dataclass
class LoadResult:
    """One measured run, from either load generator."""

    requests: int = 0
    ok: int = 0
    errors: int = 0
    first_error: str = ""
    statuses: dict[str, int] = field(default_factory=dict)
    wall: float = 0.0
    quantiles_ms: list[float] = field(default_factory=list)
    """Latency at each of QUANTILES."""
    data_lines: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    """Server CPU seconds over the measured run, by role."""
    loadgen_cpu: float = math.nan
    other_cpu: float = math.nan
    """CPU seconds every other process on the machine used over the measured run."""
    tool: str = "h11"

    def q(self, percent: float) -> float:
        """The latency (ms) at `percent` (one of QUANTILES)."""
        if not self.quantiles_ms:
            return math.nan
        return self.quantiles_ms[QUANTILES.index(percent)]


class _Client:
    """One HTTP/1.1 keep-alive connection driven with h11; reconnects after a failure."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._host = f"127.0.0.1:{port}".encode()
        self._stream: trio.SocketStream | None = None
        self._conn = h11.Connection(h11.CLIENT)

    @property
    def idle(self) -> bool:
        return self._conn.our_state is h11.IDLE and self._conn.their_state is h11.IDLE

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


async def _phase(clients: list[_Client], spec: LoadSpec, seconds: float, first_id: int) -> _Tally:
    """Requests over `clients` (each one request at a time) for `seconds`."""
    tally = _Tally()
    body = STREAM_BODY if spec.stream else CHAT_BODY

    async def worker(client: _Client) -> None:
        while tally.errors < 50:
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

    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(worker, client)
    with trio.CancelScope(shield=True):
        for client in clients:
            if not client.idle:  # cut off mid-request by the time limit: start afresh
                await client.close()
    return tally


async def _generate_load(spec: LoadSpec) -> LoadResult:
    clients = [_Client(spec.port) for _ in range(spec.connections)]
    try:
        warm = await _phase(clients, spec, spec.warmup_seconds, 0)
        cpu_before = {name: cpu_seconds_tree(pid) for name, pid in spec.pids.items()}
        own_before = time.process_time()
        machine_before = machine_cpu_seconds()
        start = time.perf_counter()
        tally = await _phase(clients, spec, spec.seconds, warm.issued)
        wall = time.perf_counter() - start
        own = time.process_time() - own_before
        cpu = {name: cpu_seconds_tree(pid) - cpu_before[name] for name, pid in spec.pids.items()}
        other = machine_cpu_seconds() - machine_before - own - sum(cpu.values())
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
        quantiles_ms=[percentile(latencies, q / 100) * 1000 for q in QUANTILES],
        data_lines=tally.data_lines,
        cpu=cpu,
        loadgen_cpu=own,
        other_cpu=max(0.0, other),
        tool="h11",
    )


def loadgen_main() -> None:
    """Entry point of the load-generator process: a JSON `LoadSpec` on stdin, a result out."""
    spec = LoadSpec(**json.loads(sys.stdin.read()))
    result = trio.run(_generate_load, spec)
    sys.stdout.write(json.dumps(asdict(result)) + "\n")


def run_h11(spec: LoadSpec, label: str) -> LoadResult:
    """Run one h11 load-generator process to completion and return what it measured."""
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
            timeout=spec.warmup_seconds + spec.seconds + 30,
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"{label}: the load generator did not finish in time") from None
    if completed.returncode != 0:
        raise BenchError(f"{label}: the load generator failed:\n{completed.stderr[-3000:]}")
    return LoadResult(**json.loads(completed.stdout.strip().splitlines()[-1]))


# ---- wrk ----------------------------------------------------------------------------------------

WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '%(body)s'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["x-input-tokens"] = "10"
wrk.headers["x-model"] = "%(model)s"
local counter = 0
request = function()
  counter = counter + 1
  wrk.headers["x-request-id"] = "%(prefix)s-" .. counter
  return wrk.format()
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests":%%d,"duration_us":%%d,"connect":%%d,"read":%%d,"write":%%d,' ..
    '"status":%%d,"timeout":%%d,"quantiles_us":[',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout))
  local qs = {%(quantiles)s}
  for i, q in ipairs(qs) do
    local v
    if q <= 0 then v = latency.min elseif q >= 100 then v = latency.max
    else v = latency:percentile(q) end
    if i > 1 then io.write(",") end
    io.write(string.format("%%d", v))
  end
  io.write("]}\\n")
end
"""


def wrk_script(path: Path, prefix: str) -> Path:
    path.write_text(
        WRK_SCRIPT
        % {
            "body": CHAT_BODY.decode(),
            "model": MODEL,
            "prefix": prefix,
            "quantiles": ",".join(f"{q:g}" for q in QUANTILES),
        }
    )
    return path


def run_wrk(
    script: Path,
    port: int,
    connections: int,
    warmup_seconds: float,
    seconds: float,
    pids: dict[str, int],
    label: str,
) -> LoadResult:
    """A warm-up run, then a measured run of `wrk -t1`; server CPU read right around it."""
    url = f"http://127.0.0.1:{port}{PATH}"

    def wrk(duration: float) -> subprocess.CompletedProcess[str]:
        args = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s"]
        args += ["--timeout", "10s", "-s", str(script), url]
        try:
            return subprocess.run(
                args, capture_output=True, text=True, timeout=duration + 30, check=False
            )
        except subprocess.TimeoutExpired:
            raise BenchError(f"{label}: wrk did not finish in time") from None

    if warmup_seconds > 0:
        wrk(warmup_seconds)
    before = {name: cpu_seconds_tree(pid) for name, pid in pids.items()}
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    machine_before = machine_cpu_seconds()
    completed = wrk(seconds)
    machine = machine_cpu_seconds() - machine_before
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {name: cpu_seconds_tree(pid) - before[name] for name, pid in pids.items()}
    loadgen = (children.ru_utime + children.ru_stime) - (
        children_before.ru_utime + children_before.ru_stime
    )
    lines = [line for line in completed.stdout.splitlines() if line.startswith("WRK_JSON ")]
    if completed.returncode != 0 or not lines:
        raise BenchError(f"{label}: wrk failed:\n{completed.stdout[-2000:]}{completed.stderr}")
    report = json.loads(lines[-1].split(" ", 1)[1])
    errors = sum(report[key] for key in ("connect", "read", "write", "timeout"))
    non_2xx = report["status"]
    requests = report["requests"]
    return LoadResult(
        requests=requests,
        ok=requests - non_2xx,
        errors=errors + non_2xx,
        first_error=f"{non_2xx} non-2xx answers" if non_2xx else "",
        statuses={"2xx": requests - non_2xx, "other": non_2xx},
        wall=report["duration_us"] / 1e6,
        quantiles_ms=[value / 1000 for value in report["quantiles_us"]],
        cpu=cpu,
        loadgen_cpu=loadgen,
        other_cpu=max(0.0, machine - loadgen - sum(cpu.values())),
        tool="wrk",
    )


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


# ---- nginx --------------------------------------------------------------------------------------

NGINX_CONF = """
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy_temp;
    fastcgi_temp_path {tmp}/fastcgi_temp;
    uwsgi_temp_path {tmp}/uwsgi_temp;
    scgi_temp_path {tmp}/scgi_temp;
    upstream engine {{
        server 127.0.0.1:{backend};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (path for path in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(path).exists()),
        None,
    )


def start_nginx(
    procs: Processes, tmp: Path, backend_port: int, deadline: Deadline
) -> tuple[subprocess.Popen[Any], int]:
    """nginx (master + 1 worker) on a free port in front of `backend_port`; (process, port)."""
    executable = find_nginx()
    assert executable is not None
    nginx_dir = tmp / "nginx"
    nginx_dir.mkdir()
    nginx_dir.chmod(0o755)  # a worker running as nobody may need its temp paths
    (port,) = free_ports(1)
    conf = nginx_dir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=nginx_dir, backend=backend_port, port=port))
    log_path = nginx_dir / "stderr.log"
    with log_path.open("wb") as log:
        process = procs.spawn(
            [executable, "-p", str(nginx_dir), "-c", str(conf), "-e", str(nginx_dir / "error.log")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    import httpx

    with httpx.Client(trust_env=False, timeout=5) as client:
        wait_until(
            lambda: client.get(f"http://127.0.0.1:{port}/health").status_code == 200,
            deadline.left(15),
            "nginx in front of the mock",
            process,
            nginx_dir / "error.log",
        )
    return process, port


# ---- the servers --------------------------------------------------------------------------------


@dataclass
class Servers:
    replica: Replica
    mock_pid: int
    mock_port: int
    noop_pid: int
    noop_port: int
    nginx_pid: int | None
    nginx_port: int | None
    nginx_note: str


@contextmanager
def started_servers(procs: Processes, log_dir: Path, deadline: Deadline) -> Iterator[Servers]:
    """Mock backend, no-op app, nginx and a replica with the mock registered; yields once a
    request through the replica succeeds."""
    import httpx

    python = server_python()
    mock, mock_port = start_printing_server(
        procs,
        mock_backend_command(MODEL, "--tokens", str(TOKENS)),
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
    nginx_pid = nginx_port = None
    if find_nginx() is None:
        nginx_note = "nginx is not installed: its row is skipped (apt-get install nginx-light)"
        print(f"  {nginx_note}", file=sys.stderr)
    else:
        try:
            nginx, nginx_port = start_nginx(procs, log_dir, mock_port, deadline)
            nginx_pid = nginx.pid
            nginx_note = ""
        except BenchError as error:
            nginx_note = f"nginx did not start, its row is skipped: {str(error)[:300]}"
            print(f"  {nginx_note}", file=sys.stderr)
    replica = start_replica(
        procs,
        log_dir,
        "proxy",
        deadline,
        extra_args=["--registration-update-idle-timeout-ms=0"],
    )
    registration = Registration(
        replica.grpc, "bench-backend-0", f"http://127.0.0.1:{mock_port}", [MODEL]
    )
    try:
        registration.wait_ack(deadline.left(10))
        headers = {"x-request-id": "bench-ready", "x-input-tokens": "10", "x-model": MODEL}
        with httpx.Client(trust_env=False, timeout=5) as client:
            wait_until(
                lambda: (
                    client.post(
                        f"{replica.base}{PATH}", headers=headers, content=CHAT_BODY
                    ).status_code
                    == 200
                ),
                deadline.left(20),
                "a request through the replica to succeed",
                replica.process,
                replica.log_path,
            )
        yield Servers(
            replica, mock.pid, mock_port, noop.pid, noop_port, nginx_pid, nginx_port, nginx_note
        )
    finally:
        registration.close()


# ---- the measurements ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    connections: int
    seconds: float
    warmup_seconds: float
    latency_seconds: float
    latency_rounds: int
    sse_seconds: float
    load_generator: str
    budget: float


def settings_for(suite: Suite) -> Settings:
    args = suite.args
    quick = suite.quick
    chosen = args.load_generator
    if chosen == "auto":
        chosen = "wrk" if shutil.which("wrk") else "h11"
    elif chosen == "wrk" and not shutil.which("wrk"):
        raise BenchError("--load-generator wrk: wrk is not installed")
    return Settings(
        connections=args.connections or (8 if quick else 16),
        seconds=args.seconds or (2.0 if quick else 8.0),
        warmup_seconds=1.0 if quick else 2.0,
        latency_seconds=args.seconds or (2.0 if quick else 8.0),
        latency_rounds=1 if quick else 4,
        sse_seconds=2.0 if quick else 5.0,
        load_generator=chosen,
        budget=75.0 if quick else 240.0,
    )


TARGET_NAMES = {
    "replica": "replica -> mock",
    "noop": "no-op ASGI app, same Hypercorn-trio stack",
    "nginx": "nginx (1 worker, keep-alive upstream) -> mock",
    "direct": "mock direct",
}
SERVER_ROLE = {"replica": "replica", "noop": "server", "nginx": "nginx", "direct": "mock"}


@dataclass
class Results:
    throughput: dict[str, LoadResult] = field(default_factory=dict)
    latency: dict[str, LoadResult] = field(default_factory=dict)
    sse: dict[str, LoadResult] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def measure(
    servers: Servers, settings: Settings, deadline: Deadline, tmp: Path, profiler: Profiler
) -> Results:
    results = Results()
    targets: dict[str, tuple[int, dict[str, int]]] = {
        "replica": (
            servers.replica.http,
            {"replica": servers.replica.pid, "mock": servers.mock_pid},
        ),
        "noop": (servers.noop_port, {"server": servers.noop_pid}),
        "direct": (servers.mock_port, {"mock": servers.mock_pid}),
    }
    if servers.nginx_port is not None and servers.nginx_pid is not None:
        targets["nginx"] = (
            servers.nginx_port,
            {"nginx": servers.nginx_pid, "mock": servers.mock_pid},
        )
    order = [target for target in ("replica", "noop", "nginx", "direct") if target in targets]
    use_wrk = settings.load_generator == "wrk"
    plan: list[tuple[str, str, int, float]] = [
        *[("throughput", t, settings.connections, settings.seconds) for t in order],
        *[
            ("latency", t, 1, settings.latency_seconds / settings.latency_rounds)
            for _ in range(settings.latency_rounds)
            for t in order
        ],
        *[("sse", t, settings.connections, settings.sse_seconds) for t in ("replica", "direct")],
    ]
    for phase, target, connections, seconds in plan:
        label = f"{phase} {target}"
        if deadline.left(1e9) < settings.warmup_seconds + seconds + 15:
            results.skipped.append(label)
            continue
        port, pids = targets[target]
        where: dict[str, LoadResult] = getattr(results, phase)
        print(
            f"  {label}: {connections} connection(s), {seconds:.0f} s "
            f"({'wrk' if use_wrk and phase != 'sse' else 'h11'})",
            file=sys.stderr,
        )
        profiling = phase == "throughput" and target == "replica"
        with (
            profiler.record(
                servers.replica.pid,
                settings.warmup_seconds + seconds + 1,
                "the replica's throughput run",
            )
            if profiling
            else _nothing()
        ):
            warmup = settings.warmup_seconds if target not in where else 0.0
            if use_wrk and phase != "sse":
                script = wrk_script(tmp / f"{phase}-{target}.lua", f"{phase}-{target}")
                result = run_wrk(script, port, connections, warmup, seconds, pids, label)
            else:
                spec = LoadSpec(port, phase == "sse", connections, warmup, seconds, pids)
                result = run_h11(spec, label)
            where[target] = merged(where[target], result) if target in where else result
    return results


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def merged(first: LoadResult, second: LoadResult) -> LoadResult:
    """Two rounds of one target as one: counts and CPU added, each latency quantile the
    request-weighted mean of the rounds' (their quantile functions averaged)."""
    weight = first.ok + second.ok
    quantiles = [
        (a * first.ok + b * second.ok) / weight if weight else math.nan
        for a, b in zip(first.quantiles_ms, second.quantiles_ms, strict=True)
    ]
    statuses = dict(first.statuses)
    for key, count in second.statuses.items():
        statuses[key] = statuses.get(key, 0) + count
    return LoadResult(
        requests=first.requests + second.requests,
        ok=first.ok + second.ok,
        errors=first.errors + second.errors,
        first_error=first.first_error or second.first_error,
        statuses=statuses,
        wall=first.wall + second.wall,
        quantiles_ms=quantiles,
        data_lines=first.data_lines + second.data_lines,
        cpu={k: v + second.cpu.get(k, 0.0) for k, v in first.cpu.items()},
        loadgen_cpu=first.loadgen_cpu + second.loadgen_cpu,
        other_cpu=first.other_cpu + second.other_cpu,
        tool=first.tool,
    )


# ---- the report ---------------------------------------------------------------------------------


def _per(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def report(results: Results, settings: Settings) -> tuple[str, dict[str, Any], list[str]]:
    """(Markdown, figures, problems)."""
    problems: list[str] = [f"skipped (time budget): {label}" for label in results.skipped]
    for phase, by_target in (
        ("throughput", results.throughput),
        ("latency", results.latency),
        ("SSE", results.sse),
    ):
        for target, result in by_target.items():
            if result.errors or result.ok == 0:
                problems.append(
                    f"{phase} {target}: {result.ok}/{result.requests} OK, {result.errors} errors, "
                    f"statuses {result.statuses}"
                    + (f", first error {result.first_error}" if result.first_error else "")
                )
    figures: dict[str, Any] = {}
    cpu_us: dict[str, float] = {}
    rows: list[list[str]] = []
    for target, result in results.throughput.items():
        server_cpu = result.cpu.get(SERVER_ROLE[target], math.nan)
        cpu_us[target] = _per(server_cpu, result.ok) * 1e6
        mock_cpu = result.cpu.get("mock", math.nan) if target in ("replica", "nginx") else math.nan
        rows.append(
            [
                TARGET_NAMES[target],
                f"{result.ok:,}",
                num(_per(result.ok, result.wall)),
                num(result.q(50), 2),
                num(result.q(99), 2),
                num(cpu_us[target]),
                num(_per(result.ok, server_cpu)),
                num(_per(mock_cpu, result.ok) * 1e6),
                num(_per(result.loadgen_cpu, result.ok) * 1e6),
                num(_per(result.other_cpu, result.wall) * 100),
            ]
        )
    throughput = md_table(
        [
            "Target",
            "Requests",
            "req/s",
            "p50 ms",
            "p99 ms",
            "Server CPU µs/req",
            "req/s per core",
            "Mock CPU µs/req",
            "Loadgen CPU µs/req",
            "Others' CPU %",
        ],
        rows,
    )
    figures["cpu_us_per_request"] = cpu_us
    ratio = _per(cpu_us.get("noop", math.nan), cpu_us.get("replica", math.nan))
    figures["noop_over_replica_cpu"] = ratio

    direct = results.latency.get("direct")
    rows = []
    added: dict[str, tuple[float, float]] = {}
    for target, result in results.latency.items():
        add50 = add99 = math.nan
        if direct is not None and target != "direct":
            add50, add99 = result.q(50) - direct.q(50), result.q(99) - direct.q(99)
            added[target] = (add50, add99)
        rows.append(
            [
                TARGET_NAMES[target],
                f"{result.ok:,}",
                num(result.q(50), 3),
                num(result.q(90), 3),
                num(result.q(99), 3),
                num(result.q(99.9), 3),
                num(result.q(100), 3),
                num(add50, 3),
                num(add99, 3),
            ]
        )
    latency = md_table(
        [
            "Target",
            "Requests",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "p99.9 ms",
            "max ms",
            "Added p50 ms",
            "Added p99 ms",
        ],
        rows,
    )
    figures["added_latency_ms"] = {t: {"p50": a, "p99": b} for t, (a, b) in added.items()}

    rows = []
    for target, result in results.sse.items():
        server_cpu = result.cpu.get(SERVER_ROLE[target], math.nan)
        rows.append(
            [
                TARGET_NAMES[target],
                f"{result.ok:,}",
                num(_per(result.data_lines, result.ok), 1),
                num(_per(result.data_lines, result.wall)),
                num(_per(result.data_lines, server_cpu)),
                num(_per(server_cpu, result.data_lines) * 1e6, 1),
            ]
        )
    sse = md_table(
        [
            "Target",
            "Streams",
            "Chunks per stream",
            "Chunks/s",
            "Chunks/s per core",
            "Server CPU µs/chunk",
        ],
        rows,
    )

    replica_added = added.get("replica", (math.nan, math.nan))

    def check(ok: bool, value: float) -> str:
        return "-" if math.isnan(value) else ("✓" if ok else "✗")

    goals = md_table(
        ["Goal", "Measured", "Met"],
        [
            [
                f"no-op CPU / replica CPU per request ≥ {GOAL_NOOP_RATIO}",
                num(ratio, 2),
                check(ratio >= GOAL_NOOP_RATIO, ratio),
            ],
            [
                f"added latency p50 at one connection ≤ {GOAL_ADDED_P50_MS} ms",
                num(replica_added[0], 3) + " ms",
                check(replica_added[0] <= GOAL_ADDED_P50_MS, replica_added[0]),
            ],
            [
                f"added latency p99 at one connection ≤ {GOAL_ADDED_P99_MS} ms",
                num(replica_added[1], 3) + " ms",
                check(replica_added[1] <= GOAL_ADDED_P99_MS, replica_added[1]),
            ],
        ],
    )
    figures["goals_met"] = {
        "noop_ratio": ratio >= GOAL_NOOP_RATIO,
        "added_p50": replica_added[0] <= GOAL_ADDED_P50_MS,
        "added_p99": replica_added[1] <= GOAL_ADDED_P99_MS,
    }
    tool = "wrk (1 thread)" if settings.load_generator == "wrk" else "trio + h11 client"
    text = (
        f"Load generator: {tool}; non-streaming `POST {PATH}`; server CPU = utime + stime from "
        "`/proc/<pid>/stat` over the measured run only (nginx: master + worker).\n\n"
        f"{goals}\n\n"
        f"1. Throughput, {settings.connections} keep-alive connections, {settings.seconds:.0f} s "
        f"after {settings.warmup_seconds:.0f} s warm-up:\n\n{throughput}\n\n"
        f"2. Latency at one connection, {settings.latency_seconds:.0f} s of sequential "
        f"requests per target in {settings.latency_rounds} round(s) interleaved across the "
        "targets (so the machine's background load falls on all alike; quantiles are the "
        "request-weighted mean of the rounds'); added = minus direct:\n\n"
        f"{latency}\n\n"
        f"3. SSE burst ({TOKENS} tokens per stream, no inter-token delay, "
        f"{settings.connections} connections, trio + h11 client):\n\n{sse}\n\n"
        "req/s and latency share the machine's cores between the load generator, the mock and "
        "the server; CPU per request does not depend on that. Others' CPU % is what every other "
        "process on the machine (other users' jobs) used during the run, in % of one core."
    )
    return text, figures, problems


def chart(results: Results, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for target, result in results.latency.items():
        if result.quantiles_ms:
            axis.plot(
                result.quantiles_ms,
                [q / 100 for q in QUANTILES],
                label=TARGET_NAMES[target],
            )
    axis.set_xscale("log")
    axis.set_xlabel("latency at one connection (ms)")
    axis.set_ylabel("fraction of requests")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def run(suite: Suite) -> PartResult:
    settings = settings_for(suite)
    deadline = Deadline(settings.budget)
    began = time.monotonic()
    procs = Processes()
    profiler = Profiler(suite.profile, suite.out_dir, procs, NAME)
    notes: list[str] = []
    try:
        with (
            tempfile.TemporaryDirectory(prefix="stargate-proxy-") as tmp,
            started_servers(procs, Path(tmp), deadline) as servers,
        ):
            print(f"  servers up in {time.monotonic() - began:.1f} s", file=sys.stderr)
            if servers.nginx_note:
                notes.append(servers.nginx_note)
            results = measure(servers, settings, deadline, Path(tmp), profiler)
            if servers.replica.process.poll() is not None:
                raise BenchError(f"the replica exited\n{log_tail(servers.replica.log_path)}")
    finally:
        procs.stop_all()
    text, figures, problems = report(results, settings)
    charts: list[str] = []
    try:
        title = f"stargate {NAME}: latency at one connection"
        if chart(results, suite.out_dir / "proxy.png", title):
            charts.append("proxy.png")
    except Exception as error:  # a chart is not worth the figures
        notes.append(f"no chart: {error!r}")
    if profiler.note:
        notes.append(profiler.note)
    return PartResult(
        NAME,
        TITLE,
        text,
        {
            "figures": figures,
            "throughput": {t: asdict(r) for t, r in results.throughput.items()},
            "latency": {t: asdict(r) for t, r in results.latency.items()},
            "sse": {t: asdict(r) for t, r in results.sse.items()},
            "quantiles_percent": QUANTILES,
        },
        settings=asdict(settings),
        problems=problems,
        charts=charts,
        notes=notes,
        elapsed=time.monotonic() - began,
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.proxy [options]`: the same as `python -m benchmarks proxy`."""
    from benchmarks.__main__ import main as suite_main

    return suite_main(["proxy", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
