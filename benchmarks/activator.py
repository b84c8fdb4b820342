"""Activator part: what a model-pool swap costs beyond the member's own start, and a mixed-model
trace over one pool.

`python -m benchmarks activator [--quick] [--swaps K] [--trace-seconds S]` (or
`nox -s bench -- activator`). A replica runs with `--pool-config`: one pool, `gpu0`, of two
members (`model-a`, `model-b`) under the `process` controller, each member a
`stargate mock-backend --port {port} --model M` (README, "Model pools"; the file format of
tests/e2e/test_pools.py). Measured, all on loopback:

1. Swaps: a cold request (nothing resident), then K sequential requests alternating between the
   members, each one held while the pool stops the resident and starts the other, each followed by
   a warm request (the member resident).
2. The member's own start, right before each swap (so both see the same background load): the
   member command started alone, timed from spawn to its `GET /health` 200 (polled every 5 ms),
   and its stop (SIGTERM to exit). Swap overhead = swap request latency - member start -
   warm request latency (p50s); the pool's own `llmkube_modelpool_swap_duration_seconds` mean is
   reported beside it.
3. A mixed-model trace: 4 clients for S seconds, each sending runs of 5 requests to one member,
   then 5 to the other (the clients' runs out of phase): requests/s, latency p50/p99, answers, and
   the swaps it caused (`llmkube_modelpool_swaps_total`).

Every engine the replica starts is its child; on the way out the replica is stopped (it stops
them) and any of its descendants still alive are killed by pid. Writes
bench-results/activator.{md,json}; `--profile` records a flame graph of the replica during the
trace.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import (
    BenchError,
    Deadline,
    PartResult,
    Processes,
    Profiler,
    Replica,
    Suite,
    descendants,
    free_ports,
    log_tail,
    md_table,
    metric_sum,
    mock_backend_command,
    num,
    percentile,
    start_replica,
)

NAME = "activator"
TITLE = "model-pool swap overhead and a mixed-model trace"
MEMBERS = ("model-a", "model-b")
POOL = "gpu0"
CLIENTS = 4
RUN_LENGTH = 5


@dataclass(frozen=True)
class Settings:
    swaps: int
    trace_seconds: float
    budget: float


def settings_for(suite: Suite) -> Settings:
    args = suite.args
    return Settings(
        swaps=args.swaps or (3 if suite.quick else 6),
        trace_seconds=args.trace_seconds or (5.0 if suite.quick else 15.0),
        budget=60.0 if suite.quick else 150.0,
    )


def member_command(model: str) -> list[str]:
    return mock_backend_command(model, port="{port}")


def write_pool_file(path: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "pools": [
                    {
                        "name": POOL,
                        "members": list(MEMBERS),
                        "swapBudget": "30s",
                        "holdBudget": "30s",
                        "controller": {
                            "kind": "process",
                            "members": {
                                model: {"command": member_command(model), "healthPath": "/health"}
                                for model in MEMBERS
                            },
                        },
                    }
                ]
            }
        )
    )
    return path


@dataclass
class Timings:
    member_start_s: list[float] = field(default_factory=list)
    member_stop_s: list[float] = field(default_factory=list)
    cold_s: float = math.nan
    swap_s: list[float] = field(default_factory=list)
    warm_s: list[float] = field(default_factory=list)
    swap_metric_mean_s: float = math.nan
    swap_metric_count: float = math.nan
    trace_requests: int = 0
    trace_seconds: float = 0.0
    trace_statuses: dict[str, int] = field(default_factory=dict)
    trace_latencies_s: list[float] = field(default_factory=list)
    trace_swaps: float = math.nan
    trace_first_error: str = ""


def time_member_start(procs: Processes, log_dir: Path, attempt: int, timings: Timings) -> None:
    """The member command alone: spawn to `/health` 200, then SIGTERM to exit."""
    import httpx

    (port,) = free_ports(1)
    args = [part.replace("{port}", str(port)) for part in member_command(MEMBERS[0])]
    log_path = log_dir / f"member-{attempt}.log"
    with httpx.Client(trust_env=False, timeout=2) as client:
        with log_path.open("wb") as log:
            began = time.monotonic()
            process = procs.spawn(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            end = began + 30
            while time.monotonic() < end:
                if process.poll() is not None:
                    raise BenchError(f"the member exited:\n{log_tail(log_path)}")
                try:
                    if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.005)
            else:
                raise BenchError(f"the member never answered /health:\n{log_tail(log_path)}")
            timings.member_start_s.append(time.monotonic() - began)
            stopping = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=15)
            timings.member_stop_s.append(time.monotonic() - stopping)
        finally:
            procs.stop(process)


def chat(client: Any, base: str, model: str, request_id: str) -> tuple[int, float]:
    headers = {"x-request-id": request_id, "x-input-tokens": "3", "x-model": model}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    began = time.monotonic()
    response = client.post(f"{base}/v1/chat/completions", headers=headers, json=body)
    return response.status_code, time.monotonic() - began


def pool_metrics(replica: Replica) -> tuple[float, float, float]:
    """(swaps, swap duration sum, swap duration count) from the replica's /metrics."""
    text = replica.metrics_text()
    return (
        metric_sum(text, "llmkube_modelpool_swaps_total"),
        metric_sum(text, "llmkube_modelpool_swap_duration_seconds_sum"),
        metric_sum(text, "llmkube_modelpool_swap_duration_seconds_count"),
    )


def measure_swaps(
    procs: Processes, log_dir: Path, replica: Replica, settings: Settings, timings: Timings
) -> None:
    import httpx

    with httpx.Client(trust_env=False, timeout=60) as client:
        status, seconds = chat(client, replica.base, MEMBERS[0], "cold")
        if status != 200:
            raise BenchError(f"the cold request answered {status}\n{log_tail(replica.log_path)}")
        timings.cold_s = seconds
        status, seconds = chat(client, replica.base, MEMBERS[0], "warm-0")
        timings.warm_s.append(seconds)
        for index in range(settings.swaps):
            # The member alone, right before each swap: both under the same background load.
            time_member_start(procs, log_dir, index, timings)
            model = MEMBERS[(index + 1) % 2]
            status, seconds = chat(client, replica.base, model, f"swap-{index}")
            if status != 200:
                raise BenchError(f"swap {index} answered {status}\n{log_tail(replica.log_path)}")
            timings.swap_s.append(seconds)
            status, seconds = chat(client, replica.base, model, f"warm-{index + 1}")
            if status == 200:
                timings.warm_s.append(seconds)
    _, total, count = pool_metrics(replica)
    timings.swap_metric_count = count
    timings.swap_metric_mean_s = total / count if count else math.nan


def run_trace(replica: Replica, settings: Settings, timings: Timings, profiler: Profiler) -> None:
    import httpx

    swaps_before = pool_metrics(replica)[0]
    end = time.monotonic() + settings.trace_seconds
    lock = threading.Lock()

    def client_loop(index: int) -> None:
        sent = 0
        with httpx.Client(trust_env=False, timeout=60) as client:
            while time.monotonic() < end:
                # Runs of RUN_LENGTH requests per member; odd clients start on the other one.
                model = MEMBERS[(sent // RUN_LENGTH + index) % 2]
                try:
                    status, seconds = chat(client, replica.base, model, f"trace-{index}-{sent}")
                except httpx.HTTPError as error:
                    with lock:
                        timings.trace_statuses["error"] = timings.trace_statuses.get("error", 0) + 1
                        timings.trace_first_error = timings.trace_first_error or repr(error)
                    continue
                finally:
                    sent += 1
                with lock:
                    timings.trace_requests += 1
                    timings.trace_latencies_s.append(seconds)
                    key = str(status)
                    timings.trace_statuses[key] = timings.trace_statuses.get(key, 0) + 1

    began = time.monotonic()
    with profiler.record(replica.pid, settings.trace_seconds, "the mixed-model trace"):
        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=settings.trace_seconds + 70)
    timings.trace_seconds = time.monotonic() - began
    timings.trace_swaps = pool_metrics(replica)[0] - swaps_before


def stop_replica_and_engines(procs: Processes, replica: Replica) -> None:
    """Stop the replica (it stops its engines), then kill any descendant still alive."""
    children = descendants(replica.pid)
    procs.stop(replica.process, timeout=15)
    for pid in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _markdown(timings: Timings, settings: Settings) -> str:
    start50 = percentile(sorted(timings.member_start_s), 0.5)
    stop50 = percentile(sorted(timings.member_stop_s), 0.5)
    swap50 = percentile(sorted(timings.swap_s), 0.5)
    warm50 = percentile(sorted(timings.warm_s), 0.5)
    overhead = swap50 - start50 - warm50
    swaps = md_table(
        ["Measure", "p50", "min", "max", "n"],
        [
            [
                "member start alone (spawn to /health 200)",
                f"{num(start50 * 1000)} ms",
                f"{num(min(timings.member_start_s, default=math.nan) * 1000)} ms",
                f"{num(max(timings.member_start_s, default=math.nan) * 1000)} ms",
                str(len(timings.member_start_s)),
            ],
            [
                "member stop alone (SIGTERM to exit)",
                f"{num(stop50 * 1000)} ms",
                f"{num(min(timings.member_stop_s, default=math.nan) * 1000)} ms",
                f"{num(max(timings.member_stop_s, default=math.nan) * 1000)} ms",
                str(len(timings.member_stop_s)),
            ],
            ["cold request (nothing resident)", f"{num(timings.cold_s * 1000)} ms", "", "", "1"],
            [
                "swap request (stop the resident, start the other, answer)",
                f"{num(swap50 * 1000)} ms",
                f"{num(min(timings.swap_s, default=math.nan) * 1000)} ms",
                f"{num(max(timings.swap_s, default=math.nan) * 1000)} ms",
                str(len(timings.swap_s)),
            ],
            [
                "warm request (member resident)",
                f"{num(warm50 * 1000, 1)} ms",
                f"{num(min(timings.warm_s, default=math.nan) * 1000, 1)} ms",
                f"{num(max(timings.warm_s, default=math.nan) * 1000, 1)} ms",
                str(len(timings.warm_s)),
            ],
            [
                "`llmkube_modelpool_swap_duration_seconds` mean (cold start included)",
                f"{num(timings.swap_metric_mean_s * 1000)} ms",
                "",
                "",
                num(timings.swap_metric_count),
            ],
            [
                "**swap overhead** = swap - member start - warm request (p50s)",
                f"**{num(overhead * 1000)} ms**",
                "",
                "",
                "",
            ],
            [
                "of which not the member's own stop either (overhead - member stop)",
                f"{num((overhead - stop50) * 1000)} ms",
                "",
                "",
                "",
            ],
        ],
    )
    latencies = sorted(timings.trace_latencies_s)
    ok = timings.trace_statuses.get("200", 0)
    trace = md_table(
        [
            "Clients",
            "Seconds",
            "Requests (200)",
            "Requests/s",
            "Swaps",
            "Requests per swap",
            "p50 ms",
            "p99 ms",
            "Answers",
        ],
        [
            [
                str(CLIENTS),
                num(timings.trace_seconds, 1),
                f"{timings.trace_requests:,} ({ok:,})",
                num(timings.trace_requests / timings.trace_seconds, 1)
                if timings.trace_seconds
                else "-",
                num(timings.trace_swaps),
                num(timings.trace_requests / timings.trace_swaps, 1)
                if timings.trace_swaps
                else "-",
                num(percentile(latencies, 0.5) * 1000, 1),
                num(percentile(latencies, 0.99) * 1000, 1),
                ", ".join(f"{k}: {v:,}" for k, v in sorted(timings.trace_statuses.items())),
            ]
        ],
    )
    return (
        f"One pool `{POOL}` of {len(MEMBERS)} members, `process` controller, each member a "
        "`stargate mock-backend` (the controller probes a starting engine every 100 ms). The "
        "swap overhead is what the pool adds to the member's own start: stopping the resident "
        f"(about {num(stop50 * 1000)} ms alone), health polling, registering the member, routing "
        "the held request.\n\n"
        f"{swaps}\n\nMixed-model trace: {CLIENTS} clients, runs of {RUN_LENGTH} requests per "
        "member, out of phase (a busy resident is never pre-empted, so requests for the other "
        "member wait until it is idle):\n\n"
        f"{trace}"
    )


def run(suite: Suite) -> PartResult:
    settings = settings_for(suite)
    deadline = Deadline(settings.budget)
    began = time.monotonic()
    procs = Processes()
    profiler = Profiler(suite.profile, suite.out_dir, procs, NAME)
    timings = Timings()
    problems: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="stargate-activator-") as tmp:
            log_dir = Path(tmp)
            pools = write_pool_file(log_dir / "pools.yaml")
            replica = start_replica(
                procs,
                log_dir,
                "activator",
                deadline,
                extra_args=[f"--pool-config={pools}"],
            )
            try:
                print(
                    f"  cold request, then {settings.swaps} swaps, each after the member "
                    "started alone",
                    file=sys.stderr,
                )
                measure_swaps(procs, log_dir, replica, settings, timings)
                if deadline.left(1e9) > settings.trace_seconds + 15:
                    print(f"  mixed trace, {settings.trace_seconds:.0f} s", file=sys.stderr)
                    run_trace(replica, settings, timings, profiler)
                else:
                    problems.append("skipped (time budget): the mixed-model trace")
            finally:
                stop_replica_and_engines(procs, replica)
    finally:
        procs.stop_all()
    errors = sum(v for k, v in timings.trace_statuses.items() if k != "200")
    if errors:
        problems.append(
            f"trace: {errors} requests not answered 200 ({timings.trace_statuses}"
            + (f", first error {timings.trace_first_error}" if timings.trace_first_error else "")
            + ")"
        )
    data: dict[str, Any] = asdict(timings)
    data["trace_latencies_s"] = [
        percentile(sorted(timings.trace_latencies_s), q / 100) for q in range(101)
    ]
    return PartResult(
        NAME,
        TITLE,
        _markdown(timings, settings),
        data,
        settings=asdict(settings),
        problems=problems,
        notes=[profiler.note] if profiler.note else [],
        elapsed=time.monotonic() - began,
    )
