"""Peers part: stargate side by side with nginx, vllm-router and sglang-router, in one run, on the
same engines and the same requests, every figure also given as a ratio to each peer.

`python -m benchmarks peers [--quick]` (or `nox -s bench -- peers`; about 5 minutes, `--quick`
about 2). Why one run: the peers' figures depend on the machine and its load as much as ours do,
so a ratio is only worth something when both sides were measured minutes apart on the same
engines; this part is where the ratios the issue states its goals in come from (stargate issue 28).

Targets, each straight in front of the engine (one engine, so "round robin" picks it every time):

* **stargate**: a replica (`stargate serve`) with the engine registered over a real gRPC
  registration stream (benchmarks.common.Registration), as benchmarks/proxy.py and
  benchmarks/stream.py do;
* **sglang-router** 0.3.2 (`python -m sglang_router.launch_router --worker-urls URL --policy
  round_robin`) and **vllm-router** 0.1.17 (`python -m vllm_router.launch_router`, the same
  flags: it is a fork of sglang's Rust router), each ready once `GET /readiness` counts the
  worker healthy (the time that takes is reported); skipped with a note when not importable
  (`nox -s bench` installs both);
* **nginx**: 1 worker, keep-alive upstream, `proxy_buffering off` (benchmarks/proxy.py's
  configuration); skipped with a note where not installed;
* **direct**: the engine itself, the reference for added latency and for time to first chunk.

Router CPU is utime + stime of the router's process tree (`/proc`, `cpu_seconds_tree`: nginx's
master and worker, the routers' Python launcher and its Rust threads) read around each measured
window. The figures:

1. **CPU per non-streaming request** at 16 keep-alive connections, against `stargate
   mock-backend` (the proxy part's engine), with the proxy part's load generator (wrk where
   installed, else its trio + h11 client);
2. **added latency** p50/p99 at one connection over the engine direct (same engine; the targets
   take turns in rounds so background load falls on all alike);
3. **SSE chunks/s per core of router CPU** with 200 concurrent streams x 100 tokens and 1,000
   streams x 50 tokens, 20 ms apart, against the lean SSE engine of the stream part
   (benchmarks/sse.py; a stream's length is its request's `max_tokens`), each connection sending
   one stream after another;
4. **time to first chunk** p50/p99 when 200 streams of 100 tokens (and 1,000 of 50) open at once
   on new connections (a burst; from the start of each connect to its first event), twice per
   target in a full run.

The table puts the absolute figures, stargate's ratio to each peer and the issue's goal side by
side; a missed goal is printed, it does not fail the run. Writes bench-results/peers.{md,json,png};
`--profile` records a flame graph of the replica during its 200-stream burst.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BenchError,
    Deadline,
    PartResult,
    Processes,
    Profiler,
    Registration,
    Suite,
    cpu_seconds_tree,
    free_ports,
    md_table,
    mock_backend_command,
    num,
    percentile,
    raise_open_file_limit,
    start_printing_server,
    start_replica,
    wait_until,
)

NAME = "peers"
TITLE = "stargate side by side with nginx, vllm-router and sglang-router (issue 28)"

MODEL = "bench-model"
PATH = "/v1/chat/completions"
CHAT_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, separators=(",", ":")
).encode()
INTERVAL_MS = 20
STREAMS_PER_SHARD = 500
TARGETS = ("stargate", "sglang-router", "vllm-router", "nginx", "direct")
PEERS = ("sglang-router", "vllm-router", "nginx")
"""The targets stargate's figures are divided by."""
ROUTER_PACKAGES = {
    "sglang-router": ("sglang_router", "sglang-router", "0.3.2"),
    "vllm-router": ("vllm_router", "vllm-router", "0.1.17"),
}
"""Each Rust router: (module, distribution, the version the goals were set against)."""

GOAL_CPU_RATIO = 4.0
GOAL_ADDED_P50_MS = 0.5
GOAL_CHUNKS_RATIO = 0.6
GOAL_BURST_200_OVER_SGLANG_MS = 50.0
GOAL_BURST_1000_OVER_DIRECT_MS = 100.0


@dataclass(frozen=True)
class Settings:
    connections: int
    seconds: float
    warmup_seconds: float
    latency_seconds: float
    latency_rounds: int
    stream_levels: tuple[tuple[int, int], ...]
    """(concurrent streams, tokens per stream) of the sustained SSE levels."""
    stream_window: float
    stream_warmup: float
    stream_ramp: float
    burst_levels: tuple[tuple[int, int], ...]
    """(streams opened at once, tokens per stream) of the bursts."""
    bursts: int
    """Bursts per target and level (their first chunks pooled)."""
    budget: float


def settings_for(suite: Suite) -> Settings:
    if suite.quick:
        return Settings(
            connections=8,
            seconds=2.0,
            warmup_seconds=1.0,
            latency_seconds=2.0,
            latency_rounds=1,
            stream_levels=((100, 50), (300, 25)),
            stream_window=2.0,
            stream_warmup=1.0,
            stream_ramp=0.5,
            burst_levels=((100, 50), (300, 25)),
            bursts=1,
            budget=180.0,
        )
    return Settings(
        connections=16,
        seconds=5.0,
        warmup_seconds=1.5,
        latency_seconds=4.0,
        latency_rounds=2,
        stream_levels=((200, 100), (1000, 50)),
        stream_window=4.0,
        stream_warmup=1.5,
        stream_ramp=1.0,
        burst_levels=((200, 100), (1000, 50)),
        bursts=2,
        budget=420.0,
    )


# ---- the figures, the ratios and the goals (pure) ------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One row of the comparison: its key in `Figures`, its label, and whether less is better."""

    key: str
    label: str
    digits: int
    lower_is_better: bool


Figures = dict[str, dict[str, float]]
"""figure key -> target -> value (NaN or absent where not measured)."""


def figure_rows(settings: Settings) -> list[Figure]:
    """The comparison table's rows, in order, for the levels `settings` measures."""
    rows = [
        Figure("cpu_us", f"CPU µs per request, {settings.connections} connections", 0, True),
        Figure("added_p50_ms", "added p50 ms at 1 connection", 3, True),
        Figure("added_p99_ms", "added p99 ms at 1 connection", 3, True),
    ]
    for streams, tokens in settings.stream_levels:
        rows.append(
            Figure(
                f"chunks_per_core_{streams}",
                f"SSE chunks/s per core, {streams:,} streams x {tokens} tokens",
                0,
                False,
            )
        )
    for streams, _ in settings.burst_levels:
        for q in ("p50", "p99"):
            rows.append(
                Figure(
                    f"burst_ttft_{q}_{streams}",
                    f"first chunk {q} ms, {streams:,} new streams at once",
                    0,
                    True,
                )
            )
    return rows


def ratio(ours: float, theirs: float) -> float:
    """ours / theirs; NaN where either is missing or theirs is not positive."""
    if math.isnan(ours) or math.isnan(theirs) or theirs <= 0:
        return math.nan
    return ours / theirs


def value(figures: Figures, key: str, target: str) -> float:
    return figures.get(key, {}).get(target, math.nan)


def comparison_table(figures: Figures, rows: Sequence[Figure]) -> str:
    """Every figure for every target, then stargate / each peer."""
    lines: list[list[str]] = []
    for row in rows:
        cells = [row.label + (" (lower is better)" if row.lower_is_better else "")]
        cells += [num(value(figures, row.key, target), row.digits) for target in TARGETS]
        ours = value(figures, row.key, "stargate")
        cells += [num(ratio(ours, value(figures, row.key, peer)), 2) for peer in PEERS]
        lines.append(cells)
    return md_table(
        ["Figure", *TARGETS, *[f"stargate / {peer}" for peer in PEERS]],
        lines,
    )


@dataclass(frozen=True)
class Goal:
    text: str
    measured: float
    bound: float
    met: bool | None
    """None when a side of it was not measured."""
    unit: str = ""


def _goal(text: str, measured: float, bound: float, at_most: bool, unit: str = "") -> Goal:
    if math.isnan(measured) or math.isnan(bound):
        return Goal(text, measured, bound, None, unit)
    return Goal(text, measured, bound, measured <= bound if at_most else measured >= bound, unit)


def goals(figures: Figures, settings: Settings) -> list[Goal]:
    """Issue 28's goals, each with what was measured and its bound."""

    def of(key: str, target: str) -> float:
        return value(figures, key, target)

    found = [
        _goal(
            f"CPU per request ≤ {GOAL_CPU_RATIO:g}x sglang-router's",
            ratio(of("cpu_us", "stargate"), of("cpu_us", "sglang-router")),
            GOAL_CPU_RATIO,
            True,
            "x",
        ),
        _goal(
            f"added p50 at 1 connection ≤ {GOAL_ADDED_P50_MS} ms",
            of("added_p50_ms", "stargate"),
            GOAL_ADDED_P50_MS,
            True,
            " ms",
        ),
    ]
    for streams, _ in settings.stream_levels:
        key = f"chunks_per_core_{streams}"
        found.append(
            _goal(
                f"chunks/s per core at {streams:,} streams ≥ {GOAL_CHUNKS_RATIO:g}x "
                "sglang-router's",
                ratio(of(key, "stargate"), of(key, "sglang-router")),
                GOAL_CHUNKS_RATIO,
                False,
                "x",
            )
        )
    levels = [streams for streams, _ in settings.burst_levels]
    if levels:
        small, large = min(levels), max(levels)
        key = f"burst_ttft_p99_{small}"
        found.append(
            _goal(
                f"first chunk p99, {small:,} new streams ≤ sglang-router's + "
                f"{GOAL_BURST_200_OVER_SGLANG_MS:g} ms",
                of(key, "stargate"),
                of(key, "sglang-router") + GOAL_BURST_200_OVER_SGLANG_MS,
                True,
                " ms",
            )
        )
        if large != small:
            key = f"burst_ttft_p99_{large}"
            found.append(
                _goal(
                    f"first chunk p99, {large:,} new streams ≤ the engine direct + "
                    f"{GOAL_BURST_1000_OVER_DIRECT_MS:g} ms",
                    of(key, "stargate"),
                    of(key, "direct") + GOAL_BURST_1000_OVER_DIRECT_MS,
                    True,
                    " ms",
                )
            )
    return found


def goals_table(found: Sequence[Goal]) -> str:
    def mark(goal: Goal) -> str:
        return "-" if goal.met is None else ("✓" if goal.met else "✗")

    digits = {"x": 2, " ms": 1}
    return md_table(
        ["Goal (issue 28)", "Measured", "Bound", "Met"],
        [
            [
                goal.text,
                num(goal.measured, digits.get(goal.unit, 2)) + goal.unit,
                num(goal.bound, digits.get(goal.unit, 2)) + goal.unit,
                mark(goal),
            ]
            for goal in found
        ],
    )


# ---- the targets ---------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    port: int
    pid: int
    """The process whose tree's CPU is the router's (the engine's for direct)."""
    ready_seconds: float = math.nan
    """From spawn to ready."""
    process: Any = None
    """Its handle in `Processes` (None for the engine, which is the caller's)."""


def router_missing(kind: str) -> str:
    """ "" when the router `kind` is importable here, else why not."""
    module, distribution, version = ROUTER_PACKAGES[kind]
    if importlib.util.find_spec(module) is None:
        return (
            f"{kind} is not installed, its column is empty (pip install "
            f"{distribution}=={version}; `nox -s bench` installs it)"
        )
    return ""


def router_version(kind: str) -> str:
    try:
        return importlib.metadata.version(ROUTER_PACKAGES[kind][1])
    except importlib.metadata.PackageNotFoundError:
        return "?"


def start_router(
    procs: Processes, log_dir: Path, kind: str, url: str, deadline: Deadline
) -> Target:
    """sglang-router or vllm-router in front of the engine at `url` (round robin), ready once
    `GET /readiness` counts it healthy."""
    import httpx

    module = ROUTER_PACKAGES[kind][0]
    port, metrics_port = free_ports(2)
    log_path = log_dir / f"{kind}.log"
    args = [
        sys.executable,
        "-m",
        f"{module}.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        url,
        "--policy",
        "round_robin",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warn" if kind == "sglang-router" else "warning",
    ]
    began = time.monotonic()
    with log_path.open("wb") as log:
        process = procs.spawn(args, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(trust_env=False, timeout=5) as client:

        def ready() -> bool:
            response = client.get(f"{base}/readiness")
            healthy = response.json().get("healthy_workers", 0) if response.is_success else 0
            return bool(healthy >= 1)

        wait_until(ready, deadline.left(60), kind, process, log_path)
    return Target(kind, port, process.pid, time.monotonic() - began, process)


def _wait_routable(port: int, model: str, what: str, process: Any, log_path: Path) -> None:
    import httpx

    headers = {"x-request-id": "peers-ready", "x-input-tokens": "10", "x-model": model}
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    with httpx.Client(trust_env=False, timeout=5) as client:
        wait_until(
            lambda: (
                client.post(
                    f"http://127.0.0.1:{port}{PATH}", headers=headers, content=body
                ).status_code
                == 200
            ),
            20,
            what,
            process,
            log_path,
        )


@contextlib.contextmanager
def started_targets(
    procs: Processes,
    log_dir: Path,
    engine: tuple[int, int],
    deadline: Deadline,
    notes: list[str],
    max_connections: int,
) -> Iterator[dict[str, Target]]:
    """Every target in front of the engine (port, pid): the replica with it registered, the two
    Rust routers, nginx, and the engine itself; what cannot start is left out with a note. Each
    is stopped on the way out (the engine is the caller's)."""
    from benchmarks.proxy import find_nginx, start_nginx

    log_dir.mkdir(parents=True, exist_ok=True)
    engine_port, engine_pid = engine
    url = f"http://127.0.0.1:{engine_port}"
    targets: dict[str, Target] = {}
    registration: Registration | None = None
    try:
        began = time.monotonic()
        replica = start_replica(
            procs,
            log_dir,
            "peers",
            deadline,
            max_connections=max_connections,
            extra_args=[
                "--registration-update-idle-timeout-ms=0",
                f"--proxy-max-connections-per-backend={max_connections}",
            ],
        )
        registration = Registration(replica.grpc, "peers-engine", url, [MODEL])
        registration.wait_ack(deadline.left(10))
        _wait_routable(replica.http, MODEL, "stargate to route", replica.process, replica.log_path)
        targets["stargate"] = Target(
            "stargate", replica.http, replica.pid, time.monotonic() - began, replica.process
        )
        for kind in ("sglang-router", "vllm-router"):
            missing = router_missing(kind)
            if missing:
                notes.append(missing)
                continue
            try:
                target = start_router(procs, log_dir, kind, url, deadline)
            except BenchError as error:
                notes.append(f"{kind} did not start, its column is empty: {str(error)[:300]}")
                continue
            targets[kind] = target
        if find_nginx() is None:
            notes.append("nginx is not installed: its column is empty (apt-get install nginx)")
        else:
            try:
                nginx_dir = Path(tempfile.mkdtemp(dir=log_dir))
                began = time.monotonic()
                nginx, nginx_port = start_nginx(procs, nginx_dir, engine_port, deadline)
                targets["nginx"] = Target(
                    "nginx", nginx_port, nginx.pid, time.monotonic() - began, nginx
                )
            except BenchError as error:
                notes.append(f"nginx did not start, its column is empty: {str(error)[:300]}")
        targets["direct"] = Target("direct", engine_port, engine_pid, 0.0)
        yield targets
    finally:
        if registration is not None:
            registration.close()
        for target in targets.values():
            if target.process is not None:
                procs.stop(target.process)


# ---- 1 and 2: non-streaming requests -------------------------------------------------------------


def measure_requests(
    targets: dict[str, Target],
    engine_pid: int,
    settings: Settings,
    deadline: Deadline,
    tmp: Path,
    figures: Figures,
    raw: dict[str, Any],
    problems: list[str],
) -> None:
    """CPU per request at `connections`, then latency at one connection in rounds."""
    from benchmarks.proxy import LoadResult, LoadSpec, merged, run_h11, run_wrk, wrk_script

    use_wrk = shutil.which("wrk") is not None
    raw["load_generator"] = "wrk" if use_wrk else "h11"

    def load(target: Target, connections: int, warmup: float, seconds: float) -> LoadResult:
        label = f"{target.name}, {connections} connection(s)"
        pids = {"router": target.pid, "engine": engine_pid}
        if use_wrk:
            script = wrk_script(tmp / f"{target.name}-{connections}.lua", target.name)
            return run_wrk(script, target.port, connections, warmup, seconds, pids, label)
        spec = LoadSpec(target.port, False, connections, warmup, seconds, pids)
        return run_h11(spec, label)

    cpu_us: dict[str, float] = {}
    throughput: dict[str, Any] = {}
    for name, target in targets.items():
        if deadline.left(1e9) < settings.warmup_seconds + settings.seconds + 60:
            problems.append(f"skipped (time budget): CPU per request of {name}")
            continue
        print(
            f"  {name}: {settings.connections} connections, {settings.seconds:.0f} s",
            file=sys.stderr,
        )
        result = load(target, settings.connections, settings.warmup_seconds, settings.seconds)
        cpu = result.cpu.get("router", math.nan)
        cpu_us[name] = cpu / result.ok * 1e6 if result.ok else math.nan
        throughput[name] = asdict(result)
        if result.errors or not result.ok:
            problems.append(
                f"{name} at {settings.connections} connections: {result.ok}/{result.requests} "
                f"OK, first error {result.first_error or '-'}"
            )
    figures["cpu_us"] = cpu_us
    raw["throughput"] = throughput

    latency: dict[str, LoadResult] = {}
    per_round = settings.latency_seconds / settings.latency_rounds
    for _ in range(settings.latency_rounds):
        for name, target in targets.items():
            if deadline.left(1e9) < per_round + 40:
                problems.append(f"skipped (time budget): a latency round of {name}")
                continue
            warmup = 0.0 if name in latency else settings.warmup_seconds
            result = load(target, 1, warmup, per_round)
            latency[name] = merged(latency[name], result) if name in latency else result
    direct = latency.get("direct")
    added50: dict[str, float] = {}
    added99: dict[str, float] = {}
    for name, result in latency.items():
        if direct is not None and name != "direct":
            added50[name] = result.q(50) - direct.q(50)
            added99[name] = result.q(99) - direct.q(99)
    figures["added_p50_ms"] = added50
    figures["added_p99_ms"] = added99
    figures["p50_ms"] = {name: result.q(50) for name, result in latency.items()}
    figures["p99_ms"] = {name: result.q(99) for name, result in latency.items()}
    raw["latency"] = {name: asdict(result) for name, result in latency.items()}


# ---- 3 and 4: SSE streams ------------------------------------------------------------------------


@dataclass
class StreamRun:
    """One load of SSE streams against one target: a sustained level or a burst."""

    target: str
    streams: int
    tokens: int
    burst: bool
    chunks: int = 0
    window: float = 0.0
    router_cpu_seconds: float = math.nan
    chunks_per_core_second: float = math.nan
    ttft_ms: list[float] = field(default_factory=list)
    ttft_p50_ms: float = math.nan
    ttft_p99_ms: float = math.nan
    connect_ms: list[float] = field(default_factory=list)
    """Burst: each connect's duration (a full accept queue shows here, as SYN retries)."""
    errors: int = 0
    short_streams: int = 0
    first_error: str = ""
    statuses: dict[str, int] = field(default_factory=dict)


def _shard_sizes(streams: int) -> list[int]:
    shards = max(1, min(4, math.ceil(streams / STREAMS_PER_SHARD)))
    base, extra = divmod(streams, shards)
    return [base + (1 if i < extra else 0) for i in range(shards)]


def run_streams(
    procs: Processes,
    target: Target,
    streams: int,
    tokens: int,
    *,
    burst: bool,
    settings: Settings,
    profile: Callable[[float], contextlib.AbstractContextManager[None]] | None = None,
) -> StreamRun:
    """Shards of benchmarks/sse.py's client against `target`: sustained (keep-alive slots over a
    ramp, a warm-up, a measured window read on the shared clock) or a burst (every slot a new
    connection at the same instant, one stream each)."""
    from benchmarks.sse import ClientResult, ClientSpec, spawn_client

    run = StreamRun(target.name, streams, tokens, burst)
    now = time.monotonic()
    start_at = now + 1.0  # the shards' interpreter start-up
    stream_seconds = tokens * INTERVAL_MS / 1000
    if burst:
        window_start, window_end = start_at - 1.0, start_at + 0.5
        hard_stop = start_at + stream_seconds + 20.0
        ramp = 0.0
    else:
        ramp = settings.stream_ramp
        window_start = start_at + ramp + settings.stream_warmup
        window_end = window_start + settings.stream_window
        hard_stop = window_end + stream_seconds + 3.0
    shards: list[subprocess.Popen[str]] = []
    for index, size in enumerate(_shard_sizes(streams)):
        spec = ClientSpec(
            port=target.port,
            slots=size,
            start_at=start_at,
            ramp=ramp,
            window_start=window_start,
            window_end=window_end,
            hard_stop=hard_stop,
            model=MODEL,
            events=tokens,
            shard=index,
            once=burst,
        )
        shards.append(spawn_client(procs, spec))
    if burst:
        time.sleep(max(0.0, start_at - 0.2 - time.monotonic()))
        cpu0 = cpu_seconds_tree(target.pid)
        measured_from = time.monotonic()
        with profile(stream_seconds + 2) if profile is not None else contextlib.nullcontext():
            results = _collect(procs, shards, hard_stop, target.name, streams)
        run.router_cpu_seconds = cpu_seconds_tree(target.pid) - cpu0
        run.window = time.monotonic() - measured_from
    else:
        time.sleep(max(0.0, window_start - time.monotonic()))
        cpu0 = cpu_seconds_tree(target.pid)
        time.sleep(max(0.0, window_end - time.monotonic()))
        run.router_cpu_seconds = cpu_seconds_tree(target.pid) - cpu0
        run.window = settings.stream_window
        results = _collect(procs, shards, hard_stop, target.name, streams)
    result: ClientResult
    for result in results:
        run.chunks += result.chunks
        run.ttft_ms.extend(seconds * 1000 for seconds in result.ttft)
        run.connect_ms.extend(seconds * 1000 for seconds in result.connect_seconds)
        run.errors += result.errors
        run.short_streams += result.short_streams
        run.first_error = run.first_error or result.first_error
        for status, count in result.statuses.items():
            run.statuses[status] = run.statuses.get(status, 0) + count
    run.ttft_ms.sort()
    run.connect_ms.sort()
    run.ttft_p50_ms = percentile(run.ttft_ms, 0.5)
    run.ttft_p99_ms = percentile(run.ttft_ms, 0.99)
    if not burst and run.router_cpu_seconds > 0:
        run.chunks_per_core_second = run.chunks / run.router_cpu_seconds
    print(
        f"  {target.name:>13} {streams:>5} x {tokens} {'burst' if burst else 'streams'}: "
        + (
            f"first chunk p50 {run.ttft_p50_ms:.0f} ms, p99 {run.ttft_p99_ms:.0f} ms"
            if burst
            else f"{run.chunks / max(run.window, 1e-9):,.0f} chunks/s, "
            f"{num(run.chunks_per_core_second)} per core"
        )
        + f", errors {run.errors}",
        file=sys.stderr,
    )
    return run


def _collect(
    procs: Processes, shards: list[subprocess.Popen[str]], hard_stop: float, what: str, n: int
) -> list[Any]:
    from benchmarks.sse import ClientResult

    results: list[ClientResult] = []
    for shard in shards:
        try:
            out, err = shard.communicate(timeout=max(5.0, hard_stop - time.monotonic() + 20))
        except subprocess.TimeoutExpired:
            procs.stop(shard)
            raise BenchError(f"{what} {n} streams: a load-generator shard hung") from None
        if shard.returncode != 0 or not out.strip():
            raise BenchError(f"{what} {n} streams: a shard failed:\n{err[-2000:]}")
        results.append(ClientResult(**json.loads(out.strip().splitlines()[-1])))
    return results


def merge_bursts(runs: Sequence[StreamRun]) -> StreamRun:
    """Several bursts of one target and level as one: their first chunks pooled."""
    first = runs[0]
    pooled = StreamRun(first.target, first.streams, first.tokens, True)
    for run in runs:
        pooled.ttft_ms.extend(run.ttft_ms)
        pooled.connect_ms.extend(run.connect_ms)
        pooled.errors += run.errors
        pooled.short_streams += run.short_streams
        pooled.first_error = pooled.first_error or run.first_error
        pooled.chunks += run.chunks
        pooled.window += run.window
        for status, count in run.statuses.items():
            pooled.statuses[status] = pooled.statuses.get(status, 0) + count
    pooled.router_cpu_seconds = sum(run.router_cpu_seconds for run in runs)
    pooled.ttft_ms.sort()
    pooled.connect_ms.sort()
    pooled.ttft_p50_ms = percentile(pooled.ttft_ms, 0.5)
    pooled.ttft_p99_ms = percentile(pooled.ttft_ms, 0.99)
    return pooled


def measure_streams(
    procs: Processes,
    targets: dict[str, Target],
    settings: Settings,
    deadline: Deadline,
    profiler: Profiler,
    figures: Figures,
    raw: dict[str, Any],
    problems: list[str],
) -> None:
    runs: list[StreamRun] = []
    for streams, tokens in settings.stream_levels:
        key = f"chunks_per_core_{streams}"
        figures[key] = {}
        for name, target in targets.items():
            needed = settings.stream_ramp + settings.stream_warmup + settings.stream_window + 30
            if deadline.left(1e9) < needed:
                problems.append(f"skipped (time budget): {name} at {streams} streams")
                continue
            run = run_streams(procs, target, streams, tokens, burst=False, settings=settings)
            runs.append(run)
            figures[key][name] = run.chunks_per_core_second
            time.sleep(0.5)
    for streams, tokens in settings.burst_levels:
        p50: dict[str, float] = {}
        p99: dict[str, float] = {}
        for name, target in targets.items():
            bursts: list[StreamRun] = []
            for index in range(settings.bursts):
                if deadline.left(1e9) < tokens * INTERVAL_MS / 1000 + 30:
                    problems.append(f"skipped (time budget): a burst of {streams} at {name}")
                    continue
                profile = None
                if name == "stargate" and index == 0 and streams == settings.burst_levels[0][0]:
                    pid = target.pid

                    def profile(seconds: float, pid: int = pid) -> Any:
                        return profiler.record(pid, seconds, "a burst of new streams")

                bursts.append(
                    run_streams(
                        procs,
                        target,
                        streams,
                        tokens,
                        burst=True,
                        settings=settings,
                        profile=profile,
                    )
                )
                time.sleep(0.5)
            if bursts:
                pooled = merge_bursts(bursts)
                runs.append(pooled)
                p50[name], p99[name] = pooled.ttft_p50_ms, pooled.ttft_p99_ms
        figures[f"burst_ttft_p50_{streams}"] = p50
        figures[f"burst_ttft_p99_{streams}"] = p99
    for run in runs:
        if run.errors or run.short_streams:
            kind = "burst" if run.burst else "streams"
            problems.append(
                f"{run.target}, {run.streams} {kind}: {run.errors} errors "
                f"({run.first_error or '-'}), {run.short_streams} short streams, "
                f"statuses {run.statuses}"
            )
    raw["streams"] = [
        {k: v for k, v in asdict(run).items() if k not in ("ttft_ms", "connect_ms")}
        | {
            "ttft_quantiles_ms": [percentile(run.ttft_ms, q / 100) for q in range(101)],
            "connect_quantiles_ms": [percentile(run.connect_ms, q / 100) for q in range(101)],
        }
        for run in runs
    ]
    raw["stream_table"] = stream_table(runs)


def stream_table(runs: Sequence[StreamRun]) -> str:
    """Every SSE load as measured: delivered chunks, router CPU, first chunks, connects."""
    rows = []
    for run in runs:
        cpu_percent = run.router_cpu_seconds / run.window * 100 if run.window > 0 else math.nan
        rows.append(
            [
                f"{run.streams:,} x {run.tokens} {'burst' if run.burst else 'streams'}",
                run.target,
                "-" if run.burst else num(run.chunks / run.window if run.window else math.nan),
                num(run.router_cpu_seconds, 2),
                num(cpu_percent),
                num(run.ttft_p50_ms),
                num(run.ttft_p99_ms),
                num(percentile(run.connect_ms, 0.99)) if run.burst else "-",
                f"{run.errors} / {run.short_streams}",
            ]
        )
    return md_table(
        [
            "Load",
            "Target",
            "Chunks/s delivered",
            "Router CPU s",
            "Router CPU %",
            "First chunk p50 ms",
            "First chunk p99 ms",
            "Connect p99 ms",
            "Errors / short",
        ],
        rows,
    )


# ---- the report ----------------------------------------------------------------------------------


def markdown(
    figures: Figures,
    settings: Settings,
    ready: dict[str, float],
    versions: dict[str, str],
    load_generator: str,
    streams: str = "",
) -> str:
    rows = figure_rows(settings)
    found = goals(figures, settings)
    ready_table = md_table(
        ["Target", "Version", "Start to ready, s"],
        [[name, versions.get(name, ""), num(ready.get(name, math.nan), 1)] for name in ready],
    )
    return (
        f"{goals_table(found)}\n\n"
        "Every target straight in front of one engine, measured in this one run (columns: "
        "absolute figures; `stargate / peer`: the ratio, > 1 means stargate's figure is larger). "
        f"CPU is the router's process tree from `/proc`; the engine's own CPU is the `direct` "
        f"column. Rows 1-3: `stargate mock-backend`, {load_generator} load generator, "
        f"{settings.seconds:g} s at {settings.connections} keep-alive connections after "
        f"{settings.warmup_seconds:g} s warm-up; latency {settings.latency_seconds:g} s of "
        f"sequential requests per target in {settings.latency_rounds} round(s). SSE rows: "
        f"benchmarks/sse.py's engine, events {INTERVAL_MS} ms apart, keep-alive connections "
        f"each sending one stream after another, a {settings.stream_window:g} s window. First "
        f"chunk: every stream on a new connection opened at the same instant, from the start "
        f"of its connect to its first event, {settings.bursts} burst(s) per target pooled.\n\n"
        f"{comparison_table(figures, rows)}\n\n"
        f"Start-up (spawn to routable):\n\n{ready_table}"
        + (
            "\n\nEvery SSE load (sustained: a window of keep-alive streams, its first chunks "
            "those of streams sent in it; burst: the pooled bursts, router CPU over them; connect "
            "p99 shows a listener whose accept queue overflowed, as SYN retries of a second):"
            f"\n\n{streams}"
            if streams
            else ""
        )
    )


def chart(figures: Figures, settings: Settings, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels: list[tuple[str, list[tuple[str, str]], bool]] = [
        ("CPU µs per request", [("cpu_us", "")], True),
        (
            "added latency at 1 connection, ms",
            [("added_p50_ms", "p50"), ("added_p99_ms", "p99")],
            False,
        ),
        (
            "SSE chunks/s per core of router CPU",
            [(f"chunks_per_core_{s}", f"{s:,} streams") for s, _ in settings.stream_levels],
            False,
        ),
        (
            "first chunk p99 of a burst, ms",
            [(f"burst_ttft_p99_{s}", f"{s:,} at once") for s, _ in settings.burst_levels],
            True,
        ),
    ]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7))
    for axis, (label, series, log) in zip(axes.flat, panels, strict=True):
        names = [t for t in TARGETS if any(t in figures.get(key, {}) for key, _ in series)]
        width = 0.8 / max(1, len(series))
        for index, (key, legend) in enumerate(series):
            values = [value(figures, key, name) for name in names]
            xs = [i + index * width for i in range(len(names))]
            bars = axis.bar(xs, [0 if math.isnan(v) else v for v in values], width, label=legend)
            for bar, number in zip(bars, values, strict=True):
                if not math.isnan(number):
                    axis.annotate(
                        f"{number:,.0f}" if abs(number) >= 100 else f"{number:.3g}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        axis.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(names))])
        axis.set_xticklabels(names, fontsize=8)
        if log:
            axis.set_yscale("log")
        axis.set_title(label, fontsize=9)
        axis.grid(True, axis="y", alpha=0.3)
        if any(legend for _, legend in series):
            axis.legend(fontsize=7)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def run(suite: Suite) -> PartResult:
    settings = settings_for(suite)
    deadline = Deadline(settings.budget)
    most = max(streams for streams, _ in (*settings.stream_levels, *settings.burst_levels))
    nofile = raise_open_file_limit()
    if nofile < 4 * most + 256:
        raise BenchError(f"the open-file limit ({nofile}) is too low for {most} streams")
    procs = Processes()
    profiler = Profiler(suite.profile, suite.out_dir, procs, NAME)
    figures: Figures = {}
    raw: dict[str, Any] = {}
    problems: list[str] = []
    notes: list[str] = []
    ready: dict[str, float] = {}
    began = time.monotonic()
    max_connections = 2 * most + 64
    try:
        with tempfile.TemporaryDirectory(prefix="stargate-peers-") as tmp:
            log_dir = Path(tmp)
            mock, mock_port = start_printing_server(
                procs,
                mock_backend_command(MODEL, "--tokens", "50"),
                log_dir / "mock.log",
                "the mock backend",
                deadline.left(20),
            )
            print("  non-streaming requests, against stargate mock-backend", file=sys.stderr)
            with started_targets(
                procs, log_dir / "mock", (mock_port, mock.pid), deadline, notes, max_connections
            ) as targets:
                ready.update({name: t.ready_seconds for name, t in targets.items()})
                measure_requests(
                    targets, mock.pid, settings, deadline, log_dir, figures, raw, problems
                )
            procs.stop(mock)
            engine, engine_port = start_printing_server(
                procs,
                [sys.executable, "-m", "benchmarks.sse", "engine", "--model", MODEL],
                log_dir / "engine.log",
                "the SSE engine",
                deadline.left(20),
            )
            print("  SSE streams, against benchmarks/sse.py's engine", file=sys.stderr)
            with started_targets(
                procs,
                log_dir / "sse",
                (engine_port, engine.pid),
                deadline,
                notes,
                max_connections,
            ) as targets:
                measure_streams(
                    procs, targets, settings, deadline, profiler, figures, raw, problems
                )
    finally:
        procs.stop_all()
    versions = {
        "sglang-router": router_version("sglang-router"),
        "vllm-router": router_version("vllm-router"),
    }
    load_generator = raw.get("load_generator", "h11")
    text = markdown(figures, settings, ready, versions, load_generator, raw.get("stream_table", ""))
    charts: list[str] = []
    try:
        if chart(figures, settings, suite.out_dir / "peers.png", f"stargate {NAME}: {TITLE}"):
            charts.append("peers.png")
    except Exception as error:  # a chart is not worth the figures
        notes.append(f"no chart: {error!r}")
    if profiler.note:
        notes.append(profiler.note)
    found = goals(figures, settings)
    return PartResult(
        NAME,
        TITLE,
        text,
        {
            "figures": figures,
            "goals": [asdict(goal) for goal in found],
            "ready_seconds": ready,
            "versions": versions,
            **raw,
        },
        settings=asdict(settings),
        problems=problems,
        charts=charts,
        notes=list(dict.fromkeys(notes)),
        elapsed=time.monotonic() - began,
    )
