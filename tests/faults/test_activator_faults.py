"""Faults of model-pool members, in a soak over real processes: a member whose engine exits as
soon as it starts, and a member whose engine takes seconds to start.

A replica (`stargate serve --pool-config`) runs two pools with the `process` controller, each
member a local command (docs/activator.md; README, "Model pools"):

* pool `flaky` (swap deadline 3 s): `model-a`, a mock engine, and `model-broken`, whose command
  exits at once with status 3, so every swap to it is abandoned at the deadline;
* pool `slow` (swap deadline 12 s): `model-c`, a mock engine, and `model-slow`, a mock engine
  whose command sleeps 2 s before it starts serving.

For about 24 s one sequential client per member sends chat completions, interleaved, so the pools
swap back and forth and every swap to `model-broken` fails. A client of a healthy member retries a
failed request every 100 ms until it gets a 200. Asserted:

* no pool stays dark after a swap deadline: every round of a healthy member ends in a 200 within
  its pool's deadline plus a start-up margin (a request that arrived during a failing swap waits
  for the abandonment, then for its own member's start), and the slow pool answers nothing but
  200s;
* every request for `model-broken` gets the documented 502 `pool_swap_failed` (never a hang, never
  a 200), and `llmkube_modelpool_swap_failures_total` counts exactly those failures, all with
  `reason="deadline"` for `model-broken`, none for the healthy members;
* once the replica stops (SIGTERM) none of the engines it started is left running.

Two bugs this suite found are pinned by their own tests:

* `test_right_after_an_abandoned_swap_the_incumbent_is_swapped_back_in`: right after an
  abandoned swap the incumbent was granted although the controller had stopped its engine, and
  answered 404 until the next resync; a failed or abandoned swap now makes the next acquire
  re-verify residency (stargate/activator/pool.py).
* `test_a_killed_replica_leaves_no_engine_running`: a replica killed with SIGKILL left its
  engines running; they now get SIGTERM from the kernel when the replica dies
  (stargate/activator/engine_process.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio
import yaml

from tests.e2e.processes import (
    Ports,
    StargateProcess,
    launch,
    mock_engine_command,
    stop,
    wait_until,
)
from tests.faults.support import Tally, metric_sum

pytestmark = pytest.mark.faults

SOAK_SECONDS = 24.0
FLAKY_DEADLINE = 3.0
SLOW_DEADLINE = 12.0
SLOW_START = 2.0
# Stopping the incumbent engine's process and draining its requests on a loaded 2-core machine:
# what no swap deadline covers (see the bound in the soak below).
START_MARGIN = 8.0
HEALTHY = {"model-a": FLAKY_DEADLINE, "model-c": SLOW_DEADLINE, "model-slow": SLOW_DEADLINE}
RESYNC = 1.0  # --pool-resync-interval-ms, seconds
GAPS = {"model-a": 0.3, "model-broken": 1.0, "model-c": 0.5, "model-slow": 2.0}


_mock_command = mock_engine_command


def _member(command: list[str]) -> dict[str, object]:
    return {"command": command, "healthPath": "/health"}


# Sleeps, then becomes the mock engine (same process, so the controller's signals reach it).
SLOW_COMMAND = (
    "import os, sys, time; time.sleep(float(sys.argv[1])); os.execv(sys.argv[2], sys.argv[2:])"
)


def _pools(path: Path) -> Path:
    slow = _member(
        [sys.executable, "-c", SLOW_COMMAND, str(SLOW_START), *_mock_command("model-slow")]
    )
    broken = _member([sys.executable, "-c", "import sys; sys.exit(3)", "{port}"])
    path.write_text(
        yaml.safe_dump(
            {
                "pools": [
                    {
                        "name": "flaky",
                        "members": ["model-a", "model-broken"],
                        "swapBudget": f"{FLAKY_DEADLINE}s",
                        "holdBudget": "60s",
                        "controller": {
                            "kind": "process",
                            "members": {
                                "model-a": _member(_mock_command("model-a")),
                                "model-broken": broken,
                            },
                        },
                    },
                    {
                        "name": "slow",
                        "members": ["model-c", "model-slow"],
                        "swapBudget": f"{SLOW_DEADLINE}s",
                        "holdBudget": "60s",
                        "controller": {
                            "kind": "process",
                            "members": {
                                "model-c": _member(_mock_command("model-c")),
                                "model-slow": slow,
                            },
                        },
                    },
                ]
            }
        )
    )
    return path


def _children(pid: int) -> set[int]:
    """The direct children of `pid` (the engines the process controller started)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                text = Path(f"/proc/{pid}/task/{task}/children").read_text()
                found.update(int(child) for child in text.split())
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _kill_leftovers(pids: set[int]) -> list[int]:
    """SIGKILL every engine in `pids` still running (their own process groups); return them."""
    left = sorted(pid for pid in pids if _alive(pid))
    for pid in left:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    return left


@dataclass
class Answer:
    model: str
    status: int
    code: str
    seconds: float


def _start(tmp_path: Path, *extra: str) -> tuple[StargateProcess, Ports]:
    ports = Ports.pick()
    replica = launch(
        tmp_path / "replica.log",
        "serve",
        *ports.args(),
        "--readiness-warmup-ms=0",
        "--disable-dns-discovery",
        "--shutdown-delay-ms=0",
        f"--pool-config={_pools(tmp_path / 'pools.yaml')}",
        *extra,
    )
    base = f"http://127.0.0.1:{ports.http}"
    wait_until(lambda: httpx.get(f"{base}/healthz").status_code == 200, 15, "the replica")
    return replica, ports


@pytest.mark.timeout(150)
async def test_pools_with_a_failing_and_a_slow_member_never_stay_dark(
    tmp_path: Path, tally: Tally
) -> None:
    # Breaker off: this soak is about every request for model-broken starting a doomed swap (and
    # the healthy members surviving each one); with the breaker (docs/activator.md, "Breaker")
    # all but three would fail fast without a swap. tests/e2e/test_pool_waiting.py covers it.
    replica, ports = await trio.to_thread.run_sync(
        _start,
        tmp_path,
        f"--pool-resync-interval-ms={int(RESYNC * 1000)}",
        "--pool-breaker-failures=0",
    )
    base = f"http://127.0.0.1:{ports.http}"
    engines: set[int] = set()
    answers: list[Answer] = []
    waits: dict[str, list[float]] = {model: [] for model in HEALTHY}
    try:
        soak_end = trio.current_time() + SOAK_SECONDS

        async def ask(client: httpx.AsyncClient, model: str, request_id: str) -> Answer:
            tally.send()
            started = trio.current_time()
            response = await client.post(
                "/v1/chat/completions",
                headers={"x-request-id": request_id, "x-input-tokens": "1", "x-model": model},
                json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
            )
            code = response.headers.get("x-stargate-error-code", "")
            answer = Answer(model, response.status_code, code, trio.current_time() - started)
            answers.append(answer)
            return answer

        async def member_client(client: httpx.AsyncClient, model: str) -> None:
            """Sequential requests; for a healthy member each round retries (every 100 ms) until
            a 200, and the round's wait is what a client of that member sees."""
            index = 0
            while trio.current_time() < soak_end:
                index += 1
                started = trio.current_time()
                answer = await ask(client, model, f"{model}-{index}")
                if model == "model-broken":
                    tally.inject()
                else:
                    while answer.status != 200 and trio.current_time() < started + 60:
                        await trio.sleep(0.1)
                        answer = await ask(client, model, f"{model}-{index}-retry")
                    waits[model].append(trio.current_time() - started)
                await trio.sleep(GAPS[model])

        async def watch_engines() -> None:
            while True:
                engines.update(_children(replica.process.pid))
                await trio.sleep(0.2)

        async with (
            httpx.AsyncClient(base_url=base, timeout=SLOW_DEADLINE + 60) as client,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(watch_engines)
            async with trio.open_nursery() as clients:
                for model in GAPS:
                    clients.start_soon(member_client, client, model)
            nursery.cancel_scope.cancel()

        metrics_url = f"http://127.0.0.1:{ports.metrics}/metrics"
        metrics = (await trio.to_thread.run_sync(lambda: httpx.get(metrics_url, timeout=5))).text
    finally:
        engines.update(_children(replica.process.pid))
        replica.process.send_signal(signal.SIGTERM)
        code = await trio.to_thread.run_sync(lambda: replica.process.wait(timeout=60))
        stop(replica)
        left = await trio.to_thread.run_sync(_wait_gone, engines)

    outcomes = Counter((a.model, a.status, a.code) for a in answers)
    longest = {model: round(max(times, default=0), 2) for model, times in waits.items()}
    # After a swap to model-broken is abandoned, model-a must be swapped back in, never granted
    # on a stale belief and answered 404 (test_right_after_an_abandoned_swap_...).
    bad = [
        a
        for a in answers
        if (a.model in HEALTHY and a.status != 200)
        or (a.model == "model-broken" and (a.status, a.code) != (502, "pool_swap_failed"))
    ]
    tally.lose(len(bad))
    tally.notes.update(
        outcomes={f"{m} {s} {c}".strip(): n for (m, s, c), n in sorted(outcomes.items())},
        longest_wait_s=longest,
        engines_started=len(engines),
    )
    assert bad == [], tally.notes
    for model, deadline in HEALTHY.items():
        # No pool stays dark. The bound follows from the contract, not from a past run: a round
        # for a healthy member waits for at most the swap in progress when it arrived (ended or
        # abandoned by its pool's deadline), then its own member's swap, which must succeed
        # within that same deadline (an abandoned one would have answered 502, a failure the
        # check above counts), plus a resync interval (a stale belief is corrected at the next
        # resync) and START_MARGIN for what neither deadline covers: stopping the incumbent's
        # process and draining its requests. (The bound once added only the member's own start
        # delay to one deadline and was raised after rounds of 22.3 s against 21 s on CI.)
        assert waits[model], tally.notes
        assert max(waits[model]) <= 2 * deadline + RESYNC + START_MARGIN, tally.notes
    failures = outcomes[("model-broken", 502, "pool_swap_failed")]
    assert failures >= 2, tally.notes  # the soak did inject the fault, more than once
    swap_failures = "llmkube_modelpool_swap_failures_total"
    assert metric_sum(metrics, swap_failures) == failures
    assert metric_sum(metrics, swap_failures, member="model-broken", reason="deadline") == failures
    assert metric_sum(metrics, "llmkube_modelpool_swaps_total", pool="slow") >= 2
    assert code == 0
    assert left == [], f"engines still running after the replica stopped: {left}"


@pytest.mark.timeout(60)
def test_right_after_an_abandoned_swap_the_incumbent_is_swapped_back_in(
    tmp_path: Path, tally: Tally
) -> None:
    """Minimal reproduction: model-a is resident; a request for model-broken waits for its swap
    to be abandoned (3 s; its engine exits at once), gets 502 `pool_swap_failed`; the next
    request for model-a must be served (swapping model-a back in), not answered 404."""
    replica, ports = _start(tmp_path, "--pool-resync-interval-ms=60000")
    base = f"http://127.0.0.1:{ports.http}"

    def chat(model: str) -> httpx.Response:
        tally.send()
        return httpx.post(
            f"{base}/v1/chat/completions",
            headers={"x-request-id": model, "x-input-tokens": "1", "x-model": model},
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )

    try:
        assert chat("model-a").status_code == 200
        broken = chat("model-broken")
        tally.inject()
        assert (broken.status_code, broken.headers["x-stargate-error-code"]) == (
            502,
            "pool_swap_failed",
        )
        after = chat("model-a")
        if after.status_code != 200:
            tally.lose(known_bug=True)
        assert after.status_code == 200, (after.status_code, after.text)
    finally:
        engines = _children(replica.process.pid)
        replica.process.send_signal(signal.SIGTERM)
        replica.process.wait(timeout=60)
        stop(replica)
        _wait_gone(engines)


def _wait_gone(pids: set[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _kill_leftovers(pids)


@pytest.mark.timeout(60)
def test_a_killed_replica_leaves_no_engine_running(tmp_path: Path, tally: Tally) -> None:
    replica, ports = _start(tmp_path)
    engines: set[int] = set()
    try:
        tally.send()
        response = httpx.post(
            f"http://127.0.0.1:{ports.http}/v1/chat/completions",
            headers={"x-request-id": "r", "x-input-tokens": "1", "x-model": "model-a"},
            json={"model": "model-a", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert response.status_code == 200
        engines = _children(replica.process.pid)
        assert engines
        replica.process.kill()  # the replica dies without a chance to stop its engines
        tally.inject()
        replica.process.wait()
    finally:
        stop(replica)
        left = _wait_gone(engines, timeout=5)
    assert left == [], f"engines left running by the killed replica: {left}"
