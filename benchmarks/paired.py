"""Before/after CPU per request and per chunk, paired and interleaved in one run:
`python -m benchmarks.paired --before-python PATH [--rounds N] [--seconds S] [--stream]`;
and the control plane's CPU per heartbeat, paired side by side:
`python -m benchmarks.paired --before-python PATH --pylons N`.

Why not two runs of `python -m benchmarks proxy`: on a shared 2-core machine the replica's CPU per
request drifts by ±15 % between runs a few minutes apart (the mock's own CPU per request drifts
with it), which hides a 5 % change either way. Here one mock engine serves two replicas at once,
"before" (the stargate installed in `--before-python`'s environment, e.g. a venv in a worktree of
the older commit) and "after" (this checkout), and the h11 load generator of the proxy part
alternates short blocks between them (ABBA order), so drift falls on both alike. CPU is
utime + stime of each replica from `/proc` over its measured blocks only; the figure to read is
the median of the per-pair after/before ratios, with its quartiles as the noise.

With `--pylons N` the two replicas are measured at the same time instead: each gets N
Pylon-like registrations (benchmarks/pylons.py, new statistics on every 1 s heartbeat, an engine
health endpoint of their own from benchmarks/capacity.py, probed every second, as in the
registration part), and each block reads both replicas' CPU over the same seconds, so the
machine's drift falls on both alike. The figure is CPU µs per heartbeat.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.capacity import HEARTBEAT_SECONDS, LoadGen, catalogue_models
from benchmarks.common import (
    Deadline,
    JsonProcess,
    Processes,
    Registration,
    cpu_seconds,
    mock_backend_command,
    start_printing_server,
    start_replica,
)
from benchmarks.proxy import MODEL, TOKENS, LoadSpec, run_h11

ROLES = ("before", "after")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paired", description=__doc__)
    parser.add_argument(
        "--before-python",
        required=True,
        help="interpreter whose environment has the older stargate installed",
    )
    parser.add_argument("--rounds", type=int, default=10, help="blocks per replica (10)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per block")
    parser.add_argument("--connections", type=int, default=8, help="keep-alive connections (8)")
    parser.add_argument(
        "--stream", action="store_true", help="streamed requests: CPU per SSE chunk"
    )
    parser.add_argument(
        "--pylons",
        type=int,
        default=0,
        help="the control plane instead: this many heartbeating registrations on each replica",
    )
    return parser.parse_args(argv)


def measure_control_plane(args: argparse.Namespace) -> dict[str, list[float]]:
    """CPU µs per heartbeat of each replica, both loaded at once, one figure per block."""
    log_dir = Path(tempfile.mkdtemp(prefix="stargate-paired-"))
    procs = Processes()
    try:
        deadline = Deadline(300)
        engines = LoadGen(procs, log_dir / "engines.log")
        ports = engines.call("engines", 120, n=2 * args.pylons)["ports"]
        replicas = {
            "before": start_replica(
                procs, log_dir, "before", deadline, python=args.before_python, isolated=True
            ),
            "after": start_replica(procs, log_dir, "after", deadline),
        }
        shards = {}
        for offset, (role, replica) in enumerate(replicas.items()):
            shard = shards[role] = JsonProcess(
                procs,
                [sys.executable, "-m", "benchmarks.pylons"],
                log_dir / f"pylons-{role}.log",
                f"Pylon shard {role}",
            )
            first = offset * args.pylons
            shard.send(
                "open",
                grpc_port=replica.grpc,
                registrations=[
                    [f"pylon-{i}", f"http://127.0.0.1:{ports[i]}", catalogue_models(i)]
                    for i in range(first, first + args.pylons)
                ],
                admit_seconds=60,
                heartbeat_ms=int(HEARTBEAT_SECONDS * 1000),
                changing_stats=True,
            )
        for shard in shards.values():
            shard.answer(120)
        time.sleep(3)  # admitted, probed, settled
        figures: dict[str, list[float]] = {role: [] for role in ROLES}
        for _ in range(args.rounds):
            t0 = time.monotonic()
            cpu0 = {role: cpu_seconds(r.process.pid) for role, r in replicas.items()}
            time.sleep(args.seconds)
            t1 = time.monotonic()
            for role, replica in replicas.items():
                stats = shards[role].call("stats", 30, since=t0, until=t1)
                acks = max(len(stats["latencies_ms"]), 1)
                figures[role].append((cpu_seconds(replica.process.pid) - cpu0[role]) / acks * 1e6)
        return figures
    finally:
        procs.stop_all()


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """CPU µs per request (or chunk) of each replica, one figure per block."""
    log_dir = Path(tempfile.mkdtemp(prefix="stargate-paired-"))
    procs = Processes()
    try:
        deadline = Deadline(120)
        _, mock_port = start_printing_server(
            procs,
            mock_backend_command(MODEL, "--tokens", str(TOKENS)),
            log_dir / "mock.log",
            "the mock backend",
            deadline.left(20),
        )
        idle = ["--registration-update-idle-timeout-ms=0"]
        replicas = {
            "before": start_replica(
                procs,
                log_dir,
                "before",
                deadline,
                python=args.before_python,
                isolated=True,
                extra_args=idle,
            ),
            "after": start_replica(procs, log_dir, "after", deadline, extra_args=idle),
        }
        registrations = [
            Registration(replica.grpc, f"paired-{role}", f"http://127.0.0.1:{mock_port}", [MODEL])
            for role, replica in replicas.items()
        ]
        for registration in registrations:
            registration.wait_ack(deadline.left(10))
        time.sleep(1)  # both replicas route the mock before the first block
        figures: dict[str, list[float]] = {role: [] for role in ROLES}
        for block in range(args.rounds):
            for role in ROLES if block % 2 == 0 else tuple(reversed(ROLES)):
                replica = replicas[role]
                spec = LoadSpec(
                    replica.http,
                    args.stream,
                    args.connections,
                    0.5,
                    args.seconds,
                    {"server": replica.process.pid},
                )
                result = run_h11(spec, role)
                units = result.data_lines if args.stream else result.ok
                figures[role].append(result.cpu["server"] / max(units, 1) * 1e6)
        for registration in registrations:
            registration.close()
        return figures
    finally:
        procs.stop_all()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    figures = measure_control_plane(args) if args.pylons else measure(args)
    unit = "heartbeat" if args.pylons else "chunk" if args.stream else "request"
    for role in ROLES:
        values = figures[role]
        print(
            f"{role}: median {statistics.median(values):.1f} µs per {unit} "
            f"(blocks: {', '.join(f'{v:.0f}' for v in values)})"
        )
    ratios = [
        after / before for after, before in zip(figures["after"], figures["before"], strict=True)
    ]
    quartiles = statistics.quantiles(ratios, n=4)
    print(
        f"after/before per pair: median {statistics.median(ratios):.3f} "
        f"(quartiles {quartiles[0]:.3f} .. {quartiles[2]:.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
