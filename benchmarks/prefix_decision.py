"""Prefix-decision part: what one `prefix-aware` routing decision and one key derivation cost.

`python -m benchmarks prefix-decision [--quick]` (or `nox -s bench -- prefix-decision`). In one
process, no I/O: the balancer is pure (stargate/load_balancing/prefix_aware.py), so its cost is
CPU time, read per call with `time.thread_time_ns` (cores are shared: wall-clock figures lie).

* Decisions: `PrefixAware.choose` over 4, 64 and 1,000 clusters with live-looking stats (a new
  snapshot tuple every decision, as the routing state hands out after each reservation), for
  100,000 distinct conversation keys (the issue's "100k tracked prefixes"; the balancer keeps no
  per-prefix state, so the figure is the same for any number), each with a group, under the
  replica's collector settings (stargate/gc_policy.py); p50 / p99 per decision. The issue's goal:
  p99 <= 50 µs at 1,000 backends. Each decision is timed three times: once as it comes, and the
  best of three, since the same decision costs the same work and the rest is interference.
* Memory: what the balancer holds at 1,000 clusters (its multi-probe ring), from tracemalloc.
* Derivation: `derive_prefix` of a chat body of about 4 KB (a system prompt and four turns) and of
  a 2 MB prompt (read only as far as the 16 KiB cap), p50 / p99.

Writes bench-results/prefix-decision.{md,json}.
"""

from __future__ import annotations

import json
import random
import time
import tracemalloc
from collections.abc import Callable

from benchmarks.common import PartResult, Suite, md_table, num, percentile
from stargate.gc_policy import tune_for_serving
from stargate.load_balancing.balancers import RoutingRequest
from stargate.load_balancing.prefix_aware import PrefixAware
from stargate.prefix_key import DEFAULT_BLOCK_BYTES, DEFAULT_DEPTH, derive_prefix
from stargate.routing.state import ClusterSnapshot
from stargate.routing.stats import ModelStats

NAME = "prefix-decision"
TITLE = "prefix-aware: CPU per routing decision (4 to 1,000 clusters) and per key derivation"

FLEETS = (4, 64, 1000)
GOAL_P99_US = 50.0
GOAL_FLEET = 1000
REPEATS = 3
"""Every decision is timed this often: it is deterministic (the same inputs, the same work), so
the best of the three is its cost and the spread above it is the machine's (shared cores)."""


def _clusters(count: int, rng: random.Random) -> tuple[ClusterSnapshot, ...]:
    return tuple(
        ClusterSnapshot(
            f"engine-{index:04d}",
            ModelStats(
                last_mean_input_tps=rng.uniform(5_000, 20_000),
                queued_input_size=rng.randrange(0, 4_000),
                num_running_queries=rng.randrange(0, 32),
            ),
            0.001,
            0.0,
            (),
        )
        for index in range(count)
    )


def _cpu_us(call: Callable[[], object], repeat: int, ordered: bool = True) -> list[float]:
    """Per-call thread CPU time in µs, sorted (or in call order)."""
    samples = []
    for _ in range(repeat):
        started = time.thread_time_ns()
        call()
        samples.append((time.thread_time_ns() - started) / 1000)
    if ordered:
        samples.sort()
    return samples


def _decisions(count: int, keys: list[str], rng: random.Random) -> dict[str, float]:
    clusters = _clusters(count, rng)
    # The routing state rebuilds its snapshot tuple on every heartbeat and reservation: the
    # decisions alternate between two equal tuples, so no decision finds the previous one's.
    snapshots = (clusters, tuple(list(clusters)))
    balancer = PrefixAware(seed="bench")
    requests = [
        RoutingRequest(
            model_id="m",
            input_tokens=1000,
            cache_affinity_key=key,
            prefix_group=index % 20,
        )
        for index, key in enumerate(keys)
    ]
    balancer.choose(clusters, requests[0], frozenset())  # the ring, built once per cluster set
    tune_for_serving()  # the replica's collector settings (stargate/gc_policy.py)

    def timed() -> list[float]:
        iterator = iter(enumerate(requests))

        def decide() -> object:
            index, request = next(iterator)
            return balancer.choose(snapshots[index % 2], request, frozenset())

        return _cpu_us(decide, len(keys), False)

    rounds = [timed() for _ in range(REPEATS)]
    first = sorted(rounds[0])
    best = sorted(min(times) for times in zip(*rounds, strict=True))
    return {
        "p50_us": percentile(first, 0.5),
        "p99_us": percentile(first, 0.99),
        "best_p50_us": percentile(best, 0.5),
        "best_p99_us": percentile(best, 0.99),
    }


def _ring_bytes(count: int) -> int:
    clusters = _clusters(count, random.Random(1))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    balancer = PrefixAware()
    balancer.choose(clusters, RoutingRequest(model_id="m", input_tokens=1), frozenset())
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del balancer
    return held


def _chat_body(rng: random.Random) -> bytes:
    words = ["cache", "prefix", "engine", "router", "token", "block", "turn", "reply"]
    messages = [{"role": "system", "content": " ".join(rng.choices(words, k=260))}]
    for turn in range(4):
        messages.append({"role": "user", "content": " ".join(rng.choices(words, k=60))})
        if turn < 3:
            messages.append({"role": "assistant", "content": " ".join(rng.choices(words, k=40))})
    return json.dumps({"model": "m", "stream": True, "messages": messages}).encode()


def _derivations(repeat: int) -> dict[str, dict[str, float]]:
    chat = _chat_body(random.Random(3))
    huge = json.dumps({"model": "m", "prompt": "x" * 2_000_000}).encode()
    out = {}
    for name, path, body in (
        (f"chat, {len(chat):,} bytes", "/v1/chat/completions", chat),
        (f"completion, {len(huge):,} bytes", "/v1/completions", huge),
    ):
        samples = _cpu_us(
            lambda p=path, b=body: derive_prefix(p, b, DEFAULT_BLOCK_BYTES, DEFAULT_DEPTH), repeat
        )
        out[name] = {"p50_us": percentile(samples, 0.5), "p99_us": percentile(samples, 0.99)}
    return out


def run(suite: Suite) -> PartResult:
    rng = random.Random(26)
    key_count = 10_000 if suite.quick else 100_000
    keys = [f"prefix:{rng.getrandbits(64):016x}" for _ in range(key_count)]
    decisions = {count: _decisions(count, keys, rng) for count in FLEETS}
    ring = _ring_bytes(GOAL_FLEET)
    derivations = _derivations(200 if suite.quick else 2000)
    goal = decisions[GOAL_FLEET]["p99_us"]
    best = decisions[GOAL_FLEET]["best_p99_us"]
    verdict = "met" if goal <= GOAL_P99_US else "missed"
    rows = [
        [
            f"{count:,} clusters",
            num(d["p50_us"], 1),
            num(d["p99_us"], 1),
            num(d["best_p50_us"], 1),
            num(d["best_p99_us"], 1),
        ]
        for count, d in decisions.items()
    ]
    derive_rows = [
        [name, num(d["p50_us"], 1), num(d["p99_us"], 1)] for name, d in derivations.items()
    ]
    markdown = "\n\n".join(
        [
            f"Decisions over {key_count:,} distinct conversation keys (each in one of 20 groups), "
            "CPU µs per `PrefixAware.choose`:",
            md_table(["fleet", "p50 µs", "p99 µs", "best-of-3 p50 µs", "best-of-3 p99 µs"], rows),
            f"Goal: p99 <= {GOAL_P99_US:.0f} µs at {GOAL_FLEET:,} clusters: **{verdict}** "
            f"({goal:.1f} µs once; {best:.1f} µs as the best of {REPEATS} timings of each "
            "decision, which is its cost without the machine's interference). "
            f"Memory held by the balancer at {GOAL_FLEET:,} clusters (its "
            f"multi-probe ring): {ring / 1e6:.2f} MB; no per-prefix state.",
            "Key derivation, CPU µs per `derive_prefix` (block 256 bytes, depth 64):",
            md_table(["body", "p50 µs", "p99 µs"], derive_rows),
        ]
    )
    return PartResult(
        NAME,
        TITLE,
        markdown,
        {
            "decisions": {str(k): v for k, v in decisions.items()},
            "ring_bytes": ring,
            "derivations": derivations,
            "keys": key_count,
        },
        settings={"fleets": list(FLEETS), "keys": key_count},
        problems=[] if verdict == "met" else [f"decision p99 {goal:.1f} µs > {GOAL_P99_US} µs"],
    )
