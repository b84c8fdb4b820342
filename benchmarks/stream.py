"""Stream part: many concurrent SSE streams through one replica, against the same streams direct.

`python -m benchmarks stream [--quick] [--streams 100,1000] [--stream-window S]` (or
`nox -s bench -- stream`). A lean SSE engine (benchmarks/sse.py: raw trio sockets, one timer
loop, every event its own write) serves OpenAI `chat.completion.chunk` streams of 50 events
20 ms apart, each event stamped with its emit time (CLOCK_MONOTONIC); it is registered with a
replica over a real `RegisterInferenceServer` stream (benchmarks.common.Registration) and answers
the replica's `GET /health` probes. For each level (100 and 1,000 concurrent streams by default)
and each target (the replica, then the engine direct), load-generator shards (separate processes,
one per 500 streams, raw trio sockets) hold that many keep-alive connections, each
sending one streaming request after another: slots start over a ramp, run a warm-up, and then a
measured window is read by every process on the same clock:

* chunks/s delivered and chunks/s per core of *server* CPU (the replica's, or the engine's when
  direct), CPU from `/proc/<pid>/stat` (utime + stime, all threads) at the window's edges;
* per-chunk lag (arrival minus emit time; log histogram, 2 % bins) p50/p99, replica vs direct;
* time to first chunk (request sent to first event) p50/p99, replica vs direct;
* memory per open stream: the replica's VmRSS in mid-window minus its VmRSS before any stream,
  divided by the streams.

A level is *saturated* when fewer than 85 % of the offered chunks arrive or the server's CPU
reaches 90 % of a core (the replica, or the machine's cores shared by everything here, cannot keep
up); its latencies then measure the backlog. Goals (issue 13): >= 25,000 chunks/s per core;
time-to-first-chunk p99 at most 100 ms above direct below saturation. Writes
bench-results/stream.{md,json,png}; `--profile` records a flame graph of the replica during the
largest level's window.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.common import (
    BenchError,
    Deadline,
    Histogram,
    PartResult,
    Processes,
    Profiler,
    Registration,
    Replica,
    Suite,
    cpu_seconds,
    machine_cpu_seconds,
    md_table,
    memory_kib,
    num,
    percentile,
    raise_open_file_limit,
    start_printing_server,
    start_replica,
    wait_until,
)
from benchmarks.sse import MODEL, PATH, ClientResult, ClientSpec, histogram_from, spawn_client

NAME = "stream"
TITLE = "concurrent SSE streams through the replica vs direct"
EVENTS = 50
INTERVAL_MS = 20
STREAMS_PER_SHARD = 500
SATURATED_FRACTION = 0.85
SATURATED_CPU_PERCENT = 90.0
GOAL_CHUNKS_PER_CORE = 25_000
GOAL_TTFT_ADDED_MS = 100


@dataclass(frozen=True)
class Settings:
    levels: tuple[int, ...]
    window: float
    warmup: float
    ramp: float
    budget: float


def settings_for(suite: Suite) -> Settings:
    args = suite.args
    levels = tuple(int(x) for x in args.streams.split(",")) if args.streams else ()
    return Settings(
        levels=levels or ((50, 300) if suite.quick else (100, 1000)),
        window=args.stream_window or (3.0 if suite.quick else 10.0),
        warmup=1.5 if suite.quick else 2.0,
        ramp=0.5 if suite.quick else 1.0,
        budget=60.0 if suite.quick else 240.0,
    )


@dataclass
class Level:
    streams: int
    target: str
    shards: int
    chunks: int = 0
    chunks_per_second: float = math.nan
    offered_per_second: float = math.nan
    server_cpu_seconds: float = math.nan
    server_cpu_percent: float = math.nan
    chunks_per_core_second: float = math.nan
    lag_p50_ms: float = math.nan
    lag_p99_ms: float = math.nan
    ttft_p50_ms: float = math.nan
    ttft_p99_ms: float = math.nan
    ttft_quantiles_ms: list[float] = field(default_factory=list)
    """TTFT at the percentiles 0, 1, ..., 100 (for the CDF chart)."""
    streams_in_window: int = 0
    short_streams: int = 0
    errors: int = 0
    first_error: str = ""
    statuses: dict[str, int] = field(default_factory=dict)
    rss_mid_kib: int = 0
    rss_baseline_kib: int = 0
    hwm_kib: int = 0
    rss_per_stream_kib: float = math.nan
    loadgen_cpu_percent: float = math.nan
    engine_cpu_percent: float = math.nan
    other_cpu_percent: float = math.nan
    """What everything else on the machine used in the window (% of one core)."""
    window: float = 0.0
    saturated: bool = False


def _shard_sizes(streams: int) -> list[int]:
    shards = max(1, min(4, math.ceil(streams / STREAMS_PER_SHARD)))
    base, extra = divmod(streams, shards)
    return [base + (1 if i < extra else 0) for i in range(shards)]


def run_level(
    procs: Processes,
    streams: int,
    target: str,
    port: int,
    server_pid: int,
    engine_pid: int,
    replica: Replica | None,
    baseline_kib: int,
    settings: Settings,
    profiler: Profiler | None,
) -> Level:
    sizes = _shard_sizes(streams)
    level = Level(streams, target, len(sizes), window=settings.window)
    now = time.monotonic()
    start_at = now + 1.0  # the shards' interpreter start-up
    window_start = start_at + settings.ramp + settings.warmup
    window_end = window_start + settings.window
    hard_stop = window_end + 3.0
    shards: list[subprocess.Popen[str]] = []
    for index, size in enumerate(sizes):
        spec = ClientSpec(
            port=port,
            slots=size,
            start_at=start_at,
            ramp=settings.ramp,
            window_start=window_start,
            window_end=window_end,
            hard_stop=hard_stop,
            model=MODEL,
            events=EVENTS,
            shard=index,
        )
        shards.append(spawn_client(procs, spec))
    print(
        f"  {target:>7} {streams:>5} streams ({len(sizes)} shard(s)): window "
        f"{settings.window:.0f} s",
        file=sys.stderr,
    )
    time.sleep(max(0.0, window_start - time.monotonic()))
    cpu0 = cpu_seconds(server_pid)
    engine0 = cpu_seconds(engine_pid)
    machine0 = machine_cpu_seconds()
    mid = window_start + settings.window / 2
    if profiler is not None:
        with profiler.record(server_pid, settings.window, f"{streams} streams through the replica"):
            time.sleep(max(0.0, mid - time.monotonic()))
            rss_mid, _ = memory_kib(server_pid)
            time.sleep(max(0.0, window_end - time.monotonic()))
    else:
        time.sleep(max(0.0, mid - time.monotonic()))
        rss_mid, _ = memory_kib(server_pid)
        time.sleep(max(0.0, window_end - time.monotonic()))
    cpu1 = cpu_seconds(server_pid)
    engine1 = cpu_seconds(engine_pid)
    machine1 = machine_cpu_seconds()
    _, hwm = memory_kib(server_pid)
    results: list[ClientResult] = []
    for shard in shards:
        try:
            out, err = shard.communicate(timeout=max(5.0, hard_stop - time.monotonic() + 20))
        except subprocess.TimeoutExpired:
            procs.stop(shard)
            raise BenchError(f"{target} {streams} streams: a load-generator shard hung") from None
        if shard.returncode != 0 or not out.strip():
            raise BenchError(f"{target} {streams} streams: a shard failed:\n{err[-2000:]}")
        results.append(ClientResult(**json.loads(out.strip().splitlines()[-1])))
    lag = Histogram()
    ttft: list[float] = []
    for result in results:
        lag.merge(histogram_from(result.lag_counts))
        ttft.extend(result.ttft)
        level.chunks += result.chunks
        level.streams_in_window += result.streams_in_window
        level.short_streams += result.short_streams
        level.errors += result.errors
        level.first_error = level.first_error or result.first_error
        for status, count in result.statuses.items():
            level.statuses[status] = level.statuses.get(status, 0) + count
    ttft.sort()
    level.chunks_per_second = level.chunks / settings.window
    level.offered_per_second = streams * 1000 / INTERVAL_MS
    level.server_cpu_seconds = cpu1 - cpu0
    level.server_cpu_percent = level.server_cpu_seconds / settings.window * 100
    if level.server_cpu_seconds > 0:
        level.chunks_per_core_second = level.chunks / level.server_cpu_seconds
    level.lag_p50_ms = lag.quantile(0.50) * 1000
    level.lag_p99_ms = lag.quantile(0.99) * 1000
    level.ttft_p50_ms = percentile(ttft, 0.50) * 1000
    level.ttft_p99_ms = percentile(ttft, 0.99) * 1000
    level.ttft_quantiles_ms = [percentile(ttft, q / 100) * 1000 for q in range(101)] if ttft else []
    level.loadgen_cpu_percent = sum(r.window_cpu_seconds for r in results) / settings.window * 100
    level.engine_cpu_percent = (engine1 - engine0) / settings.window * 100
    ours = (engine1 - engine0) + sum(r.window_cpu_seconds for r in results)
    if server_pid != engine_pid:
        ours += cpu1 - cpu0
    level.other_cpu_percent = max(0.0, (machine1 - machine0 - ours) / settings.window * 100)
    level.rss_mid_kib = rss_mid
    level.hwm_kib = hwm
    if replica is not None:
        level.rss_baseline_kib = baseline_kib
        level.rss_per_stream_kib = (rss_mid - baseline_kib) / streams
    level.saturated = (
        level.chunks_per_second < SATURATED_FRACTION * level.offered_per_second
        or level.server_cpu_percent >= SATURATED_CPU_PERCENT
    )
    print(
        f"          {level.chunks_per_second:,.0f} chunks/s of {level.offered_per_second:,.0f} "
        f"offered, server CPU {level.server_cpu_percent:.0f} %, "
        f"{num(level.chunks_per_core_second)} chunks/s per core, lag p99 "
        f"{level.lag_p99_ms:.1f} ms, TTFT p99 {level.ttft_p99_ms:.1f} ms, errors {level.errors}",
        file=sys.stderr,
    )
    return level


def _markdown(levels: list[Level], settings: Settings) -> tuple[str, list[str]]:
    rows: list[list[str]] = []
    problems: list[str] = []
    for level in levels:
        rows.append(
            [
                f"{level.streams:,}",
                level.target + (" (saturated)" if level.saturated else ""),
                f"{level.chunks_per_second:,.0f} / {level.offered_per_second:,.0f}",
                num(level.server_cpu_percent),
                num(level.chunks_per_core_second),
                num(level.lag_p50_ms, 2),
                num(level.lag_p99_ms, 2),
                num(level.ttft_p50_ms, 2),
                num(level.ttft_p99_ms, 2),
                num(level.rss_per_stream_kib, 1),
                f"{num(level.loadgen_cpu_percent)} / {num(level.engine_cpu_percent)}",
                num(level.other_cpu_percent),
            ]
        )
        if level.errors or level.short_streams:
            problems.append(
                f"{level.target} at {level.streams} streams: {level.errors} errors "
                f"({level.first_error}), {level.short_streams} streams short of {EVENTS} events, "
                f"statuses {level.statuses}"
            )
    table = md_table(
        [
            "Streams",
            "Target",
            "Chunks/s (got / offered)",
            "Server CPU %",
            "Chunks/s per core",
            "Lag p50 ms",
            "Lag p99 ms",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "RSS per stream KiB",
            "Loadgen / engine CPU %",
            "Others' CPU %",
        ],
        rows,
    )
    goal_rows: list[list[str]] = []
    by_key = {(level.streams, level.target): level for level in levels}
    for streams in sorted({level.streams for level in levels}):
        replica = by_key.get((streams, "replica"))
        direct = by_key.get((streams, "direct"))
        if replica is None:
            continue
        added_ttft = replica.ttft_p99_ms - direct.ttft_p99_ms if direct else math.nan
        goal_rows.append(
            [
                f"{streams:,}",
                num(replica.chunks_per_core_second)
                + (" ✓" if replica.chunks_per_core_second >= GOAL_CHUNKS_PER_CORE else " ✗"),
                num(replica.lag_p50_ms - direct.lag_p50_ms, 2) if direct else "-",
                num(replica.lag_p99_ms - direct.lag_p99_ms, 2) if direct else "-",
                num(replica.ttft_p50_ms - direct.ttft_p50_ms, 2) if direct else "-",
                num(added_ttft, 2)
                + (
                    ""
                    if math.isnan(added_ttft)
                    else " (saturated)"
                    if replica.saturated
                    else " ✓"
                    if added_ttft <= GOAL_TTFT_ADDED_MS
                    else " ✗"
                ),
            ]
        )
    goals = md_table(
        [
            "Streams",
            f"Replica chunks/s per core (goal ≥ {GOAL_CHUNKS_PER_CORE:,})",
            "Added lag p50 ms",
            "Added lag p99 ms",
            "Added TTFT p50 ms",
            f"Added TTFT p99 ms (goal ≤ {GOAL_TTFT_ADDED_MS} below saturation)",
        ],
        goal_rows,
    )
    text = (
        f"{EVENTS} events per stream, {INTERVAL_MS} ms apart, each its own write; keep-alive "
        f"connections, one stream after another; measured window {settings.window:.0f} s after a "
        f"{settings.ramp:.1f} s ramp and {settings.warmup:.1f} s warm-up. Server CPU is the "
        "replica's (target replica) or the SSE engine's (direct). Lag = arrival minus emit "
        "time; TTFT = request sent to first event. RSS per stream = (replica VmRSS mid-window - "
        "VmRSS before any stream) / streams. Every slot opens about one stream a second, so "
        "the replica's CPU per chunk includes each stream's set-up spread over its 50 "
        "events.\n\n"
        f"{table}\n\nReplica vs direct:\n\n{goals}\n\n"
        "The load generator (shards in their own processes) and the engine share the machine's "
        "cores with the replica: their CPU is in the next-to-last column; the last is what every "
        "other process on the machine used in the window (other users' jobs). A saturated level "
        f"delivered less than {SATURATED_FRACTION:.0%} of the offered chunks or kept its server at "
        f"{SATURATED_CPU_PERCENT:.0f} % CPU or more."
    )
    return text, problems


def _chart(levels: list[Level], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    replica = [level for level in levels if level.target == "replica"]
    direct = [level for level in levels if level.target == "direct"]
    for group, label, marker in ((replica, "replica", "o-"), (direct, "engine direct", "s--")):
        if group:
            axes[0].plot(
                [lvl.streams for lvl in group],
                [lvl.chunks_per_core_second for lvl in group],
                marker,
                label=f"{label} (per core of its own CPU)",
            )
    axes[0].axhline(GOAL_CHUNKS_PER_CORE, color="tab:green", linestyle=":", label="goal 25,000")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("concurrent streams")
    axes[0].set_ylabel("chunks/s per core")
    axes[0].grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    for level in levels:
        if not level.ttft_quantiles_ms:
            continue
        style = "-" if level.target == "replica" else "--"
        axes[1].plot(
            [max(value, 1e-3) for value in level.ttft_quantiles_ms],
            [q / 100 for q in range(101)],
            style,
            label=f"{level.target}, {level.streams:,} streams",
        )
    axes[1].set_xscale("log")
    axes[1].set_xlabel("time to first chunk (ms)")
    axes[1].set_ylabel("fraction of streams")
    axes[1].grid(True, alpha=0.3)
    axes[1].legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def run(suite: Suite) -> PartResult:
    settings = settings_for(suite)
    deadline = Deadline(settings.budget)
    most = max(settings.levels)
    nofile = raise_open_file_limit()
    if nofile < 3 * most + 256:
        raise BenchError(f"the open-file limit ({nofile}) is too low for {most} streams")
    procs = Processes()
    profiler = Profiler(suite.profile, suite.out_dir, procs, NAME)
    levels: list[Level] = []
    skipped: list[str] = []
    began = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="stargate-stream-") as tmp:
            log_dir = Path(tmp)
            engine, engine_port = start_printing_server(
                procs,
                [
                    sys.executable,
                    "-m",
                    "benchmarks.sse",
                    "engine",
                    "--model",
                    MODEL,
                    "--events",
                    str(EVENTS),
                    "--interval-ms",
                    str(INTERVAL_MS),
                ],
                log_dir / "engine.log",
                "the SSE engine",
                deadline.left(20),
            )
            replica = start_replica(
                procs,
                log_dir,
                "stream",
                deadline,
                max_connections=2 * most + 64,
                extra_args=[
                    "--registration-update-idle-timeout-ms=0",
                    f"--proxy-max-connections-per-backend={2 * most + 64}",
                ],
            )
            registration = Registration(
                replica.grpc, "stream-engine", f"http://127.0.0.1:{engine_port}", [MODEL]
            )
            try:
                registration.wait_ack(deadline.left(10))
                _wait_routable(replica, deadline)
                time.sleep(0.5)
                baseline, _ = memory_kib(replica.pid)
                for streams in settings.levels:
                    for target in ("replica", "direct"):
                        needed = settings.ramp + settings.warmup + settings.window + 8
                        if deadline.left(1e9) < needed:
                            skipped.append(f"{target} {streams}")
                            continue
                        is_replica = target == "replica"
                        levels.append(
                            run_level(
                                procs,
                                streams,
                                target,
                                replica.http if is_replica else engine_port,
                                replica.pid if is_replica else engine.pid,
                                engine.pid,
                                replica if is_replica else None,
                                baseline,
                                settings,
                                profiler if is_replica and streams == most else None,
                            )
                        )
                        time.sleep(1.0)  # the last streams end; connections close
            finally:
                registration.close()
    finally:
        procs.stop_all()
    elapsed = time.monotonic() - began
    text, problems = _markdown(levels, settings)
    problems += [f"skipped (time budget): {label}" for label in skipped]
    charts: list[str] = []
    notes = [profiler.note] if profiler.note else []
    try:
        if _chart(levels, suite.out_dir / "stream.png", f"stargate {NAME}: {TITLE}"):
            charts.append("stream.png")
    except Exception as error:  # a chart is not worth the figures
        notes.append(f"no chart: {error!r}")
    return PartResult(
        NAME,
        TITLE,
        text,
        {"levels": [asdict(level) for level in levels]},
        settings=asdict(settings),
        problems=problems,
        charts=charts,
        notes=notes,
        elapsed=elapsed,
    )


def _wait_routable(replica: Replica, deadline: Deadline) -> None:
    """Until a (non-streaming) request through the replica succeeds (the engine's probe passed)."""
    import httpx

    headers = {"x-request-id": "stream-ready", "x-input-tokens": "10", "x-model": MODEL}
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    with httpx.Client(trust_env=False, timeout=5) as client:
        wait_until(
            lambda: (
                client.post(f"{replica.base}{PATH}", headers=headers, content=body).status_code
                == 200
            ),
            deadline.left(20),
            "a request through the replica to succeed",
            replica.process,
            replica.log_path,
        )
