"""Registration part: what Pylon registrations cost one replica, and what routing costs with many.

`python -m benchmarks registration [--quick] [--registrations 100,300,1000] [--window S]` (or
`nox -s bench -- registration`). One replica; the registrations rise in steps (100, 300, 1,000
by default) in the same replica. Each registration is Pylon-like: a `RegisterInferenceServer`
stream on a TCP connection of its own, 4 models of a 16-model catalogue
(benchmarks/capacity.py `catalogue_models`), re-sent every second (heartbeat 1 s) with new
statistics every time, as a Pylon measuring its engine sends them (`--static-stats`: the first
message re-sent unchanged, the load before the Pylon measured every request), naming an
engine of its own: a health endpoint on a port of its own, served by benchmarks/capacity.py's
load generator (`engines`), which the replica probes every second. The streams run in Pylon shard
processes (benchmarks/pylons.py: grpc.aio, one per 500 streams). Each step opens the new
registrations (admission bounded by 30 s), lets them settle, then over a steady window reads:

* the replica's CPU % of one core (`/proc/<pid>/stat`) and its VmRSS (`/proc/<pid>/status`);
* heartbeat ack latency p50/p99 (send to ack, per stream, in the shards) and acks per second;
* backends routable: the sum of the replica's `stargate_active_inference_servers` gauge (one per
  (model, backend)) over the 4 models each registration serves.

A step the replica cannot keep up with (admitted < N, acks < 90 % of heartbeats, or CPU >= 90 %)
is *saturated* and ends the part. Goals (issue 28, with new statistics on every heartbeat), at
1,000 Pylons: ack p99 <= 50 ms and replica CPU <= 30 % of a core. The shards and engines share
the machine's cores with the replica: CPU is read for the replica alone, but ack latency includes
the shards' own scheduling (their CPU is in the table).

Then the routing decision time with many backends, in-process on the server interpreter
(`routing_main`): a `stargate.routing.RoutingState` holding N registrations (1 to 1,000, each its
own cluster, 4 catalogue models each), the default balancer (`resolve(default_lb_config())`,
power-of-n) in a `BalancerRegistry`, and one decision timed as the proxy takes it: snapshot the
target, choose a cluster, choose its backend, reserve (every reservation, like every heartbeat,
invalidates the cached snapshot, so the next decision rebuilds it), then release. Also timed: the
same with the snapshot already cached. Writes bench-results/registration.{md,json,png};
`--profile` records a flame graph of the replica during the last step's window.
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
from typing import Any

from benchmarks.capacity import (
    CATALOGUE,
    HEARTBEAT_SECONDS,
    MODELS_PER_REGISTRATION,
    LoadGen,
    catalogue_models,
)
from benchmarks.common import (
    ROOT,
    BenchError,
    Deadline,
    JsonProcess,
    PartResult,
    Processes,
    Profiler,
    Suite,
    cpu_seconds,
    log_tail,
    machine_cpu_seconds,
    md_table,
    memory_kib,
    metric_sum,
    num,
    percentile,
    raise_open_file_limit,
    server_python,
    start_replica,
)

NAME = "registration"
TITLE = "Pylon registrations: replica CPU, heartbeat acks, routing with many backends"
PER_SHARD = 500
SATURATED_CPU_PERCENT = 90.0
GOAL_ACK_P99_MS = 50.0
GOAL_CPU_PERCENT = 30.0
GOAL_AT = 1000
ROUTING_COUNTS = (1, 100, 300, 1000)


@dataclass(frozen=True)
class Settings:
    levels: tuple[int, ...]
    window: float
    settle: float
    admit_limit: float
    decisions: int
    budget: float
    changing_stats: bool = True


def settings_for(suite: Suite) -> Settings:
    args = suite.args
    levels: tuple[int, ...] = ()
    if args.registrations:
        levels = tuple(sorted({int(x) for x in args.registrations.split(",") if int(x) > 0}))
    return Settings(
        levels=levels or ((25, 75, 200) if suite.quick else (100, 300, 1000)),
        window=args.window or (3.0 if suite.quick else 10.0),
        settle=1.0 if suite.quick else 2.0,
        admit_limit=10.0 if suite.quick else 30.0,
        decisions=2000 if suite.quick else 20000,
        budget=60.0 if suite.quick else 240.0,
        changing_stats=not getattr(args, "static_stats", False),
    )


@dataclass
class Step:
    pylons: int
    admitted: int = 0
    admit_seconds: float = 0.0
    failed: int = 0
    routable_entries: float = math.nan
    routable_backends: float = math.nan
    cpu_percent: float = math.nan
    acks_per_second: float = math.nan
    heartbeats_per_second: float = math.nan
    ack_p50_ms: float = math.nan
    ack_p99_ms: float = math.nan
    ack_max_ms: float = math.nan
    rss_kib: int = 0
    hwm_kib: int = 0
    rss_per_pylon_kib: float = math.nan
    shards: int = 0
    shards_cpu_percent: float = math.nan
    engines_cpu_percent: float = math.nan
    other_cpu_percent: float = math.nan
    window: float = 0.0
    saturated: bool = False
    first_error: str = ""


@dataclass
class RoutingRow:
    registrations: int
    backends_for_model: int
    decision_p50_us: float
    decision_p99_us: float
    cached_p50_us: float
    cached_p99_us: float


@dataclass
class Measured:
    steps: list[Step] = field(default_factory=list)
    baseline_rss_kib: int = 0
    skipped: list[int] = field(default_factory=list)
    routing: list[RoutingRow] = field(default_factory=list)
    routing_error: str = ""


def _routable(replica_metrics: str) -> float:
    return metric_sum(replica_metrics, "stargate_active_inference_servers")


def measure(
    suite: Suite,
    settings: Settings,
    procs: Processes,
    log_dir: Path,
    deadline: Deadline,
    profiler: Profiler,
) -> Measured:
    measured = Measured()
    most = max(settings.levels)
    engines = LoadGen(procs, log_dir / "engines.log")
    ports = engines.call("engines", 120, n=most)["ports"]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    replica = start_replica(procs, log_dir, "registration", deadline)
    shard_count = max(1, math.ceil(most / PER_SHARD))
    shards = [
        JsonProcess(
            procs,
            [sys.executable, "-m", "benchmarks.pylons"],
            log_dir / f"pylons-{index}.log",
            f"Pylon shard {index}",
        )
        for index in range(shard_count)
    ]
    try:
        time.sleep(1.0)
        measured.baseline_rss_kib = memory_kib(replica.pid)[0]
        opened = 0
        for n in settings.levels:
            if deadline.left(1e9) < settings.admit_limit + settings.settle + settings.window + 15:
                measured.skipped.append(n)
                continue
            step = Step(n, shards=shard_count, window=settings.window)
            fresh = [
                [f"pylon-{index}", urls[index], catalogue_models(index)]
                for index in range(opened, n)
            ]
            began = time.monotonic()
            for index, shard in enumerate(shards):
                shard.send(
                    "open",
                    grpc_port=replica.grpc,
                    registrations=fresh[index::shard_count],
                    admit_seconds=settings.admit_limit,
                    heartbeat_ms=int(HEARTBEAT_SECONDS * 1000),
                    changing_stats=settings.changing_stats,
                )
            answers = [shard.answer(settings.admit_limit + 60) for shard in shards]
            opened = n
            step.admit_seconds = time.monotonic() - began
            step.failed = sum(a["failed"] for a in answers)
            time.sleep(settings.settle)
            t0 = time.monotonic()
            cpu0 = cpu_seconds(replica.pid)
            shards0 = sum(cpu_seconds(shard.pid) for shard in shards)
            engines0 = cpu_seconds(engines.pid)
            machine0 = machine_cpu_seconds()
            with profiler.record(replica.pid, settings.window, f"{n} Pylons", again=True):
                time.sleep(settings.window)
            t1 = time.monotonic()
            rss, hwm, cpu1 = replica.reading()
            wall = t1 - t0
            step.window = wall
            step.cpu_percent = (cpu1 - cpu0) / wall * 100
            step.shards_cpu_percent = (
                (sum(cpu_seconds(shard.pid) for shard in shards) - shards0) / wall * 100
            )
            step.engines_cpu_percent = (cpu_seconds(engines.pid) - engines0) / wall * 100
            ours = step.cpu_percent + step.shards_cpu_percent + step.engines_cpu_percent
            step.other_cpu_percent = max(
                0.0, (machine_cpu_seconds() - machine0) / wall * 100 - ours
            )
            stats = [shard.call("stats", 30, since=t0, until=t1) for shard in shards]
            latencies = sorted(lat for s in stats for lat in s["latencies_ms"])
            step.admitted = sum(s["live"] for s in stats)
            step.acks_per_second = len(latencies) / wall
            step.heartbeats_per_second = sum(s["sent"] for s in stats) / wall
            step.ack_p50_ms = percentile(latencies, 0.50)
            step.ack_p99_ms = percentile(latencies, 0.99)
            step.ack_max_ms = percentile(latencies, 1.0)
            step.first_error = next((s["first_error"] for s in stats if s["first_error"]), "")
            step.rss_kib, step.hwm_kib = rss, hwm
            step.rss_per_pylon_kib = (rss - measured.baseline_rss_kib) / n
            try:
                entries = _routable(replica.metrics_text())
                step.routable_entries = entries
                step.routable_backends = entries / MODELS_PER_REGISTRATION
            except Exception as error:  # the metrics page did not answer: leave it out
                step.first_error = step.first_error or f"metrics: {error!r}"
            step.saturated = (
                step.admitted < n
                or step.acks_per_second < 0.9 * n / HEARTBEAT_SECONDS
                or step.cpu_percent >= SATURATED_CPU_PERCENT
            )
            measured.steps.append(step)
            print(
                f"  {n:>5} Pylons: {step.admitted} admitted in {step.admit_seconds:.1f} s, "
                f"routable {num(step.routable_backends)}, CPU {step.cpu_percent:.1f} %, "
                f"{step.acks_per_second:.0f} acks/s, ack p50/p99 {step.ack_p50_ms:.1f}/"
                f"{step.ack_p99_ms:.1f} ms, RSS {rss / 1024:.1f} MiB"
                + (" (saturated)" if step.saturated else ""),
                file=sys.stderr,
            )
            if step.saturated:
                measured.skipped.extend(level for level in settings.levels if level > n)
                break
        if replica.process.poll() is not None:
            raise BenchError(f"the replica exited\n{log_tail(replica.log_path)}")
    finally:
        for shard in shards:
            shard.quit()
        engines.quit()
        procs.stop(replica.process)
    print("  routing decision time (in-process)", file=sys.stderr)
    try:
        measured.routing = routing_decisions(settings.decisions, deadline)
    except BenchError as error:
        measured.routing_error = str(error)
    return measured


# ---- routing decision time (in-process, on the server interpreter) ------------------------------


def routing_main() -> None:
    """`python -c 'from benchmarks.registration import routing_main; routing_main()'`: a JSON
    `{"counts": [...], "decisions": N}` on stdin, a JSON list of rows on stdout."""
    spec = json.loads(sys.stdin.read())
    rows = [asdict(_decisions(count, spec["decisions"])) for count in spec["counts"]]
    sys.stdout.write(json.dumps(rows) + "\n")


def _decisions(count: int, decisions: int) -> RoutingRow:
    from stargate.load_balancing.balancers import RoutingRequest, choose_backend
    from stargate.load_balancing.config import default_lb_config, resolve
    from stargate.load_balancing.registry import BalancerRegistry
    from stargate.routing import (
        BackendRoute,
        ModelStats,
        RegistrationIdentity,
        RoutingState,
        RoutingTargetKey,
    )

    state = RoutingState()
    now = time.time()
    for index in range(count):
        registration = state.begin(
            RegistrationIdentity(
                f"pylon-{index}",
                f"pylon-{index}",
                f"http://10.0.{index // 250}.{index % 250}:8000",
                None,
            )
        )
        routes = {
            model: BackendRoute(
                ModelStats(
                    last_mean_input_tps=1000.0 + index,
                    output_tps=50.0,
                    queue_size=index % 7,
                    queued_input_size=(index % 7) * 100,
                    num_running_queries=index % 5,
                ),
                1_000_000 + index,
                now,
            )
            for model in catalogue_models(index)
        }
        state.apply(registration, routes)
    model = CATALOGUE[0]
    target = RoutingTargetKey(None, model)
    spec = resolve(default_lb_config(), model, None)
    balancers = BalancerRegistry()
    request = RoutingRequest(model_id=model, input_tokens=10)
    none: frozenset[str] = frozenset()
    full: list[float] = []
    cached: list[float] = []
    clock = time.perf_counter
    for counter in range(decisions):
        # A request's decision: the snapshot (rebuilt: the last reservation invalidated it).
        began = clock()
        snapshot = state.snapshot(target)
        assert snapshot is not None
        choice = balancers.choose(target, spec, snapshot.clusters, request, none)
        assert choice is not None
        backend = choose_backend(choice.cluster, counter, none)
        assert backend is not None
        reservation = state.reserve(
            target, choice.cluster.cluster_id, backend.registration, request.input_tokens, 0
        )
        full.append(clock() - began)
        if reservation is not None:
            state.release(reservation)
        # The same decision on a cached snapshot (nothing changed since the last one).
        state.snapshot(target)
        began = clock()
        snapshot = state.snapshot(target)
        assert snapshot is not None
        choice = balancers.choose(target, spec, snapshot.clusters, request, none)
        assert choice is not None
        choose_backend(choice.cluster, counter + 1, none)
        cached.append(clock() - began)
    full.sort()
    cached.sort()
    return RoutingRow(
        count,
        state.active_backend_count(target),
        percentile(full, 0.5) * 1e6,
        percentile(full, 0.99) * 1e6,
        percentile(cached, 0.5) * 1e6,
        percentile(cached, 0.99) * 1e6,
    )


def routing_decisions(decisions: int, deadline: Deadline) -> list[RoutingRow]:
    try:
        completed = subprocess.run(
            [
                server_python(),
                "-c",
                "from benchmarks.registration import routing_main; routing_main()",
            ],
            input=json.dumps({"counts": list(ROUTING_COUNTS), "decisions": decisions}),
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=max(30.0, deadline.left(120)),
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise BenchError("the routing decision benchmark did not finish in time") from None
    if completed.returncode != 0:
        raise BenchError(f"the routing decision benchmark failed:\n{completed.stderr[-2000:]}")
    return [RoutingRow(**row) for row in json.loads(completed.stdout.strip().splitlines()[-1])]


# ---- the report ---------------------------------------------------------------------------------


def _markdown(measured: Measured, settings: Settings) -> tuple[str, list[str]]:
    problems: list[str] = []
    rows: list[list[str]] = []
    for step in measured.steps:
        rows.append(
            [
                f"{step.pylons:,}" + (" (saturated)" if step.saturated else ""),
                f"{step.admitted:,} ({step.admit_seconds:.1f} s)",
                num(step.routable_backends),
                num(step.cpu_percent, 1),
                f"{step.acks_per_second:,.0f} / {step.heartbeats_per_second:,.0f}",
                num(step.ack_p50_ms, 1),
                num(step.ack_p99_ms, 1),
                num(step.ack_max_ms, 1),
                num(step.rss_kib / 1024, 1),
                num(step.rss_per_pylon_kib, 1),
                f"{num(step.shards_cpu_percent)} ({step.shards}) / {num(step.engines_cpu_percent)}",
                num(step.other_cpu_percent),
            ]
        )
        if step.failed or step.first_error:
            problems.append(
                f"{step.pylons} Pylons: {step.failed} registrations ended by the replica; "
                f"first error {step.first_error or '-'}"
            )
    table = md_table(
        [
            "Pylons",
            "Admitted (time to admit)",
            "Routable backends",
            "Replica CPU %",
            "Acks/s / heartbeats/s",
            "Ack p50 ms",
            "Ack p99 ms",
            "Ack max ms",
            "RSS MiB",
            "RSS per Pylon KiB",
            "Shards (n) / engines CPU %",
            "Others' CPU %",
        ],
        rows,
    )
    at_goal = next((s for s in measured.steps if s.pylons == GOAL_AT), None)
    if at_goal is None:
        goal_text = (
            f"Goals at {GOAL_AT:,} Pylons (ack p99 ≤ {GOAL_ACK_P99_MS:.0f} ms, CPU ≤ "
            f"{GOAL_CPU_PERCENT:.0f} %): not measured in this run"
            + (f" (skipped: {measured.skipped})" if measured.skipped else "")
            + "."
        )
    else:
        ack_ok = at_goal.ack_p99_ms <= GOAL_ACK_P99_MS and not at_goal.saturated
        cpu_ok = at_goal.cpu_percent <= GOAL_CPU_PERCENT
        goal_text = md_table(
            ["Goal at 1,000 Pylons", "Measured", "Met"],
            [
                [
                    f"heartbeat ack p99 ≤ {GOAL_ACK_P99_MS:.0f} ms",
                    f"{num(at_goal.ack_p99_ms, 1)} ms",
                    "✓" if ack_ok else "✗",
                ],
                [
                    f"replica CPU ≤ {GOAL_CPU_PERCENT:.0f} % of a core",
                    f"{num(at_goal.cpu_percent, 1)} %",
                    "✓" if cpu_ok else "✗",
                ],
            ],
        )
    routing_rows = [
        [
            f"{row.registrations:,}",
            f"{row.backends_for_model:,}",
            num(row.decision_p50_us, 1),
            num(row.decision_p99_us, 1),
            num(row.cached_p50_us, 1),
            num(row.cached_p99_us, 1),
        ]
        for row in measured.routing
    ]
    routing = (
        md_table(
            [
                "Registrations",
                "Backends of the model",
                "Decision µs p50",
                "Decision µs p99",
                "Cached snapshot µs p50",
                "Cached snapshot µs p99",
            ],
            routing_rows,
        )
        if routing_rows
        else f"(not measured: {measured.routing_error[:500]})"
    )
    skipped = (
        f"\n\nNot run: {', '.join(f'{n:,}' for n in measured.skipped)} Pylons (after a "
        "saturated step, or out of time)."
        if measured.skipped
        else ""
    )
    text = (
        f"Each Pylon: its own gRPC stream and TCP connection, {MODELS_PER_REGISTRATION} models of "
        f"{len(CATALOGUE)}, heartbeat {HEARTBEAT_SECONDS:g} s ("
        + ("new statistics on every heartbeat" if settings.changing_stats else "re-sent unchanged")
        + "), an engine health endpoint of its "
        f"own probed by the replica every second. Steps cumulative in one replica (baseline "
        f"VmRSS {measured.baseline_rss_kib / 1024:.1f} MiB); steady window "
        f"{settings.window:.0f} s after {settings.settle:.0f} s settling; admission bounded by "
        f"{settings.admit_limit:.0f} s. Routable backends = sum of "
        f"`stargate_active_inference_servers` / {MODELS_PER_REGISTRATION}.\n\n"
        f"{goal_text}\n\n{table}{skipped}\n\n"
        "Ack latency is measured in the Pylon shards (grpc.aio, one process per "
        f"{PER_SHARD} streams), which share the machine's cores with the replica and the engines; "
        "their CPU is in the next-to-last column, and what every other process on the machine "
        "used in the window (other users' jobs) in the last.\n\n"
        f"Routing decision time, in-process ({settings.decisions:,} decisions each; snapshot, "
        "balancer choice (default: power-of-n), backend, reservation; the reservation "
        "invalidates the cached snapshot as every heartbeat does, so each decision rebuilds it):"
        f"\n\n{routing}"
    )
    return text, problems


def _chart(measured: Measured, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not measured.steps:
        return False
    figure, axis = plt.subplots(figsize=(8, 4.5))
    xs = [step.pylons for step in measured.steps]
    axis.plot(xs, [step.cpu_percent for step in measured.steps], "o-", label="replica CPU %")
    axis.axhline(
        GOAL_CPU_PERCENT,
        color="tab:green",
        linestyle=":",
        label=f"goal at 1,000: {GOAL_CPU_PERCENT:.0f} %",
    )
    axis.set_xlabel("registered Pylons (4 models, heartbeat 1 s)")
    axis.set_ylabel("replica CPU, % of one core")
    axis.grid(True, alpha=0.3)
    other = axis.twinx()
    other.plot(
        xs, [step.ack_p99_ms for step in measured.steps], "s--", color="tab:red", label="ack p99"
    )
    other.set_ylabel("heartbeat ack p99 (ms)")
    lines = axis.get_legend_handles_labels()
    more = other.get_legend_handles_labels()
    axis.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    axis.set_title(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def run(suite: Suite) -> PartResult:
    settings = settings_for(suite)
    deadline = Deadline(settings.budget)
    most = max(settings.levels)
    nofile = raise_open_file_limit()
    if nofile < 4 * most + 256:
        raise BenchError(f"the open-file limit ({nofile}) is too low for {most} registrations")
    began = time.monotonic()
    procs = Processes()
    profiler = Profiler(suite.profile, suite.out_dir, procs, NAME)
    try:
        with tempfile.TemporaryDirectory(prefix="stargate-registration-") as tmp:
            measured = measure(suite, settings, procs, Path(tmp), deadline, profiler)
    finally:
        procs.stop_all()
    text, problems = _markdown(measured, settings)
    charts = []
    notes = [profiler.note] if profiler.note else []
    try:
        if _chart(measured, suite.out_dir / "registration.png", f"stargate {NAME}: CPU and acks"):
            charts.append("registration.png")
    except Exception as error:  # a chart is not worth the figures
        notes.append(f"no chart: {error!r}")
    data: dict[str, Any] = asdict(measured)
    return PartResult(
        NAME,
        TITLE,
        text,
        data,
        settings=asdict(settings),
        problems=problems,
        charts=charts,
        notes=notes,
        elapsed=time.monotonic() - began,
    )
