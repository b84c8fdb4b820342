"""The benchmark suite's dispatcher: `python -m benchmarks [PART ...] [options]`, which is what
`nox -s bench -- [PART ...] [options]` runs (`nox -s bench-3.13` on Python 3.13).

Without PART it runs the default suite in order: proxy, stream, registration, readiness, activator,
affinity, prefix-decision, client-limits, peers (each its own module in this package; `-` in a
name is `_` in the module's; peers is benchmarks/peers.py, stargate beside nginx, vllm-router and
sglang-router). `routing` (benchmarks/routing.py: routing by real
load through real Pylons, and the Pylon hop's cost; about 5 minutes), `tunnels`
(benchmarks/tunnels.py: the Pylon hop over the QUIC tunnels, raw-quic and http3, against HTTP;
about 3 minutes) and `capacity` (benchmarks/capacity.py) run only when named. Each part starts its
own processes on loopback, stops every one of them on the way out (errors, SIGTERM and Ctrl-C
included), keeps to a time budget of its own, and writes `bench-results/<part>.md` (a Markdown
table headed with the date, the machine and the Python version) and `<part>.json`, plus PNG charts
where they mean something; `bench-results/summary.md` then gathers every part's table found there.
A part that fails is reported and the suite goes on to the next one; the exit status is 1 if any
part failed.

`--quick` is a smoke run of every part (the whole default suite in about 5 minutes, peers 2 of
them); the full default suite takes about 17 minutes on a 2-core machine (peers about 4).
`--profile` records a py-spy flame graph of the replica during each part's measured phase
(`bench-results/<part>.svg`). `--python PATH` runs every server process (replica, mock
engines, no-op app) on another interpreter whose environment has this project installed; the
load generators stay on this one.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import time
import traceback
from pathlib import Path

from benchmarks.common import (
    OUT_DIR,
    BenchError,
    PartResult,
    Suite,
    python_version,
    server_python,
    set_server_python,
    write_part,
    write_summary,
)

DEFAULT_PARTS = (
    "proxy",
    "stream",
    "registration",
    "readiness",
    "activator",
    "affinity",
    "prefix-decision",
    "client-limits",
    "peers",
)
PARTS = (*DEFAULT_PARTS, "routing", "tunnels", "capacity")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="stargate's loopback benchmark suite (see benchmarks/__main__.py).",
    )
    parser.add_argument(
        "parts",
        nargs="*",
        metavar="PART",
        help=(
            f"parts to run, in this order: {', '.join(PARTS)} "
            "(default: all but routing, tunnels and capacity)"
        ),
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of every part")
    parser.add_argument(
        "--profile", action="store_true", help="py-spy flame graph of the replica per part"
    )
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="result directory")
    parser.add_argument(
        "--python",
        help="interpreter for the server processes (its environment must have stargate)",
    )
    proxy = parser.add_argument_group("proxy")
    proxy.add_argument("--connections", type=int, help="keep-alive connections (16; quick 8)")
    proxy.add_argument("--seconds", type=float, help="measured seconds per target (8; quick 2)")
    proxy.add_argument(
        "--load-generator",
        choices=("auto", "wrk", "h11"),
        default="auto",
        help="auto: wrk where installed, else the trio + h11 client",
    )
    stream = parser.add_argument_group("stream")
    stream.add_argument("--streams", help="stream levels, comma-separated (100,1000)")
    stream.add_argument("--stream-window", type=float, help="measured seconds per level (10)")
    registration = parser.add_argument_group("registration")
    registration.add_argument(
        "--registrations", help="registration levels, comma-separated (100,300,1000)"
    )
    registration.add_argument(
        "--window", type=float, help="CPU window per registration level, s (10; quick 3)"
    )
    registration.add_argument(
        "--static-stats",
        action="store_true",
        help="re-send each registration unchanged (default: new statistics every heartbeat)",
    )
    readiness = parser.add_argument_group("readiness")
    readiness.add_argument("--pylons", help="Pylon counts joining, comma-separated (0,10,100)")
    readiness.add_argument(
        "--warmup-ms", type=int, help="the readiness warmup deadline (10000; quick 6000)"
    )
    activator = parser.add_argument_group("activator")
    activator.add_argument("--swaps", type=int, help="sequential swaps measured (6; quick 3)")
    activator.add_argument(
        "--trace-seconds", type=float, help="mixed-model trace duration (15; quick 5)"
    )
    routing = parser.add_argument_group("routing")
    routing.add_argument(
        "--router-python",
        help="interpreter for the replica and the Pylons only, with its own installed stargate "
        "(e.g. an older version, for a before figure)",
    )
    routing.add_argument(
        "--routing-window", type=float, help="measured seconds per algorithm (18; quick 5)"
    )
    routing.add_argument(
        "--routing-algorithms", help="algorithms, comma-separated (all six, round-robin first)"
    )
    args = parser.parse_args(argv)
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    return args


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_capacity(suite: Suite) -> None:
    """benchmarks/capacity.py keeps its own command line and writes its own files."""
    from benchmarks import capacity

    argv = ["--quick"] if suite.quick else []
    if suite.args.registrations:
        argv += ["--registrations", "0," + suite.args.registrations]
    status = capacity.main(argv)
    if status != 0:
        raise BenchError(f"capacity exited {status} (see its warnings above)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.python:
        set_server_python(args.python)
    parts = list(dict.fromkeys(args.parts)) or list(DEFAULT_PARTS)
    out_dir = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    suite = Suite(quick=args.quick, profile=args.profile, out_dir=out_dir, args=args)
    print(
        f"stargate benchmarks: {', '.join(parts)} ({'quick' if args.quick else 'full'}); "
        f"Python {python_version(sys.executable)}, servers on Python "
        f"{python_version(server_python())} ({server_python()})",
        file=sys.stderr,
    )
    began = time.monotonic()
    walls: dict[str, float] = {}
    failed: dict[str, str] = {}
    try:
        for part in parts:
            print(f"\n== {part} ==", file=sys.stderr)
            started = time.monotonic()
            try:
                if part == "capacity":
                    run_capacity(suite)
                else:
                    module = importlib.import_module(f"benchmarks.{part.replace('-', '_')}")
                    result: PartResult = module.run(suite)
                    path = write_part(result, suite)
                    print(f"\n{path.read_text()}")
                    for problem in result.problems:
                        print(f"WARNING ({part}): {problem}", file=sys.stderr)
            except BenchError as error:
                failed[part] = str(error)
                print(f"{part} failed: {error}", file=sys.stderr)
            except Exception as error:  # a bug in one part: report it, run the others
                failed[part] = repr(error)
                traceback.print_exc()
            walls[part] = time.monotonic() - started
            print(f"{part}: {walls[part]:.1f} s", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted: every process started was stopped", file=sys.stderr)
        return 130
    finally:
        if walls:
            summary = write_summary(suite.out_dir)
            print(f"\nwrote {summary}", file=sys.stderr)
    print(
        "wall times: "
        + ", ".join(f"{part} {seconds:.0f} s" for part, seconds in walls.items())
        + f"; total {time.monotonic() - began:.0f} s",
        file=sys.stderr,
    )
    for part, message in failed.items():
        print(f"FAILED {part}: {message.splitlines()[0] if message else ''}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
