"""Readiness part: how long a fresh replica takes from process start to `/readyz` 200, with a
fixed warmup window against the stabilization sampler, while N Pylons join.

`python -m benchmarks readiness [--quick] [--pylons 0,10,100] [--warmup-ms MS]` (or
`nox -s bench -- readiness`). For each (warmup mode, N) a fresh `stargate serve` is started on
loopback (`start_replica`); as soon as its `/healthz` answers, N Pylon-like registrations
(benchmarks/pylons.py, 4 catalogue models each, heartbeat 1 s, each naming an engine health
endpoint of its own served by benchmarks/capacity.py's load generator) register with it, while a
thread polls `/readyz` every 10 ms. Recorded, from just before the process was spawned: `/healthz`
200, every Pylon admitted (first ack), and `/readyz` 200 with its `promotion_reason` and
`sampled_backend_count` (stargate/readiness.py, stargate/warmup.py). Modes:

* fixed: `--readiness-warmup-ms=W --warmup-stabilization-window=1000000` (no sampler can fill
  it, so the deadline W always decides: a fixed window, as in benchmarks/rollout.py);
* stabilization: `--readiness-warmup-ms=W` with the defaults, 1 s samples, window 5: ready once 5
  samples agree on a nonzero backend count (about 5 s after the Pylons are in), never after W;
* fast stabilization (full run only): 250 ms samples, window 4.

W is 10 s (quick: 6 s) so a run with no Pylon ends at the deadline in bounded time. Writes
bench-results/readiness.{md,json} (no chart: the table says it).
"""

from __future__ import annotations

import contextlib
import math
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.capacity import LoadGen, catalogue_models
from benchmarks.common import (
    BenchError,
    Deadline,
    JsonProcess,
    PartResult,
    Processes,
    Profiler,
    Replica,
    Suite,
    md_table,
    num,
    raise_open_file_limit,
    start_replica,
)

NAME = "readiness"
TITLE = "time from process start to /readyz 200: fixed warmup vs stabilization sampler"


@dataclass(frozen=True)
class Mode:
    name: str
    args: tuple[str, ...]


def modes_for(warmup_ms: int, quick: bool) -> list[Mode]:
    modes = [
        Mode(
            f"fixed {warmup_ms / 1000:g} s",
            (f"--readiness-warmup-ms={warmup_ms}", "--warmup-stabilization-window=1000000"),
        ),
        Mode(
            "stabilization 1 s x 5",
            (
                f"--readiness-warmup-ms={warmup_ms}",
                "--warmup-sample-interval-ms=1000",
                "--warmup-stabilization-window=5",
            ),
        ),
    ]
    if not quick:
        modes.append(
            Mode(
                "stabilization 250 ms x 4",
                (
                    f"--readiness-warmup-ms={warmup_ms}",
                    "--warmup-sample-interval-ms=250",
                    "--warmup-stabilization-window=4",
                ),
            )
        )
    return modes


@dataclass(frozen=True)
class Settings:
    pylons: tuple[int, ...]
    warmup_ms: int
    budget: float


def settings_for(suite: Suite) -> Settings:
    args = suite.args
    pylons = tuple(int(x) for x in args.pylons.split(",")) if args.pylons else ()
    return Settings(
        pylons=pylons or ((0, 5) if suite.quick else (0, 10, 100)),
        warmup_ms=args.warmup_ms or (6000 if suite.quick else 10000),
        budget=70.0 if suite.quick else 200.0,
    )


@dataclass
class Run:
    mode: str
    pylons: int
    healthz_s: float = math.nan
    admitted_s: float = math.nan
    admitted: int = 0
    ready_s: float = math.nan
    reason: str = ""
    sampled_backends: Any = None
    after_admitted_s: float = math.nan


class ReadyzPoller(threading.Thread):
    """Polls `/readyz` every 10 ms until it answers 200 (or `stop`)."""

    def __init__(self, base: str, limit: float) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.limit = limit
        self.ready_at = math.nan
        self.body: dict[str, Any] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        import httpx

        end = time.monotonic() + self.limit
        with httpx.Client(trust_env=False, timeout=2) as client:
            while time.monotonic() < end and not self._halt.is_set():
                try:
                    response = client.get(f"{self.base}/readyz")
                except httpx.HTTPError:
                    response = None
                if response is not None and response.status_code == 200:
                    self.ready_at = time.monotonic()
                    self.body = response.json()
                    return
                self._halt.wait(0.01)

    def stop(self) -> None:
        self._halt.set()


def one_run(
    procs: Processes,
    log_dir: Path,
    mode: Mode,
    pylons: int,
    urls: list[str],
    shard: JsonProcess,
    settings: Settings,
    deadline: Deadline,
    index: int,
    profiler: Profiler | None,
) -> Run:
    run = Run(mode.name, pylons)
    replica = start_replica(
        procs, log_dir, f"readiness-{index}", deadline, warmup_args=list(mode.args)
    )
    try:
        run.healthz_s = time.monotonic() - replica.started_at
        poller = ReadyzPoller(replica.base, settings.warmup_ms / 1000 + 15)
        poller.start()
        profiling = (
            profiler.record(replica.pid, settings.warmup_ms / 1000 + 5, "start-up to /readyz")
            if profiler is not None
            else contextlib.nullcontext()
        )
        with profiling:
            _join(shard, replica, pylons, urls, run, poller, settings)
    finally:
        if pylons:
            shard.call("close", 30)
        procs.stop(replica.process)
    print(
        f"  {mode.name:<26} {pylons:>4} Pylons: /healthz {run.healthz_s:.2f} s, admitted "
        f"{num(run.admitted_s, 2)} s, /readyz {num(run.ready_s, 2)} s ({run.reason})",
        file=sys.stderr,
    )
    return run


def _join(
    shard: JsonProcess,
    replica: Replica,
    pylons: int,
    urls: list[str],
    run: Run,
    poller: ReadyzPoller,
    settings: Settings,
) -> None:
    """Register the Pylons, then wait for the poller to see /readyz 200."""
    if pylons:
        answer = shard.call(
            "open",
            60,
            grpc_port=replica.grpc,
            registrations=[[f"pylon-{i}", urls[i], catalogue_models(i)] for i in range(pylons)],
            admit_seconds=20.0,
            heartbeat_ms=1000,
        )
        run.admitted = answer["admitted"]
        run.admitted_s = time.monotonic() - replica.started_at
    poller.join(timeout=settings.warmup_ms / 1000 + 20)
    poller.stop()
    run.ready_s = poller.ready_at - replica.started_at
    run.reason = str(poller.body.get("promotion_reason", "-"))
    run.sampled_backends = poller.body.get("sampled_backend_count")
    if pylons:
        run.after_admitted_s = run.ready_s - run.admitted_s


def run(suite: Suite) -> PartResult:
    settings = settings_for(suite)
    deadline = Deadline(settings.budget)
    raise_open_file_limit()
    began = time.monotonic()
    procs = Processes()
    profiler = Profiler(suite.profile, suite.out_dir, procs, NAME)
    runs: list[Run] = []
    skipped: list[str] = []
    modes = modes_for(settings.warmup_ms, suite.quick)
    plan = [(mode, n) for mode in modes for n in settings.pylons]
    if suite.quick:  # a fixed window does not depend on the Pylons: one run of it
        plan = [(m, n) for m, n in plan if not (m is modes[0] and n != max(settings.pylons))]
    try:
        with tempfile.TemporaryDirectory(prefix="stargate-readiness-") as tmp:
            log_dir = Path(tmp)
            most = max(settings.pylons)
            engines = LoadGen(procs, log_dir / "engines.log")
            urls = [
                f"http://127.0.0.1:{port}"
                for port in engines.call("engines", 60, n=max(1, most))["ports"]
            ]
            profiled = next(
                ((m, n) for m, n in plan if m is not modes[0] and n == max(settings.pylons)), None
            )
            shard = JsonProcess(
                procs, [sys.executable, "-m", "benchmarks.pylons"], log_dir / "pylons.log", "Pylons"
            )
            for index, (mode, pylons) in enumerate(plan):
                if deadline.left(1e9) < settings.warmup_ms / 1000 + 10:
                    skipped.append(f"{mode.name} with {pylons} Pylons")
                    continue
                runs.append(
                    one_run(
                        procs,
                        log_dir,
                        mode,
                        pylons,
                        urls,
                        shard,
                        settings,
                        deadline,
                        index,
                        profiler if (mode, pylons) == profiled else None,
                    )
                )
            shard.quit()
            engines.quit()
    finally:
        procs.stop_all()
    rows = [
        [
            r.mode,
            f"{r.pylons:,}",
            num(r.healthz_s, 2),
            num(r.admitted_s, 2) if r.pylons else "-",
            num(r.ready_s, 2),
            num(r.after_admitted_s, 2) if r.pylons else "-",
            r.reason,
            "-" if r.sampled_backends is None else str(r.sampled_backends),
        ]
        for r in runs
    ]
    table = md_table(
        [
            "Warmup",
            "Pylons",
            "/healthz 200 s",
            "All admitted s",
            "/readyz 200 s",
            "Ready after admitted s",
            "Promotion reason",
            "Sampled backends",
        ],
        rows,
    )
    text = (
        f"Seconds from spawning `stargate serve` (deadline `--readiness-warmup-ms="
        f"{settings.warmup_ms}` in every mode); the Pylons (4 models each, so 4 backends each "
        "in the sampled count) start registering when `/healthz` answers; `/readyz` polled "
        f"every 10 ms.\n\n{table}"
    )
    problems = [f"skipped (time budget): {label}" for label in skipped]
    problems += [
        f"{r.mode}, {r.pylons} Pylons: only {r.admitted} admitted"
        for r in runs
        if r.pylons and r.admitted < r.pylons
    ]
    problems += [
        f"{r.mode}, {r.pylons} Pylons: /readyz never answered 200"
        for r in runs
        if math.isnan(r.ready_s)
    ]
    if not runs:
        raise BenchError("no readiness run fitted in the time budget")
    return PartResult(
        NAME,
        TITLE,
        text,
        {"runs": [asdict(r) for r in runs]},
        settings=asdict(settings),
        problems=problems,
        notes=[profiler.note] if profiler.note else [],
        elapsed=time.monotonic() - began,
    )
