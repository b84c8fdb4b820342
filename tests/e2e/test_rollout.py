"""The rolling-restart rehearsal (benchmarks/rollout.py) in the normal suite.

Two replicas behind the simulated Service, one Pylon, steady clients of both kinds (the openai SDK
on pooled keep-alive connections, and a fresh connection per request); one replica is replaced as
a StatefulSet does it. With the leave phase (`--shutdown-delay-ms` longer than the endpoint
propagation lag) no client request may fail: the terminating replica keeps serving until no proxy
sends it new connections, tells pooled clients to close, and only then stops accepting. Without it
the restart costs refused connections and disconnects, and this test says which and how many.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.rollout import RolloutParams, Warmup, rehearse


async def test_replacing_a_replica_under_load_fails_no_request(tmp_path: Path) -> None:
    params = RolloutParams(
        replicas=2,
        pylons=1,
        replace=1,
        # A short sampler so the replacement is promoted about 1 s after its Pylon registers.
        warmup=Warmup(
            "stabilization", warmup_ms=60_000, sample_interval_ms=200, stabilization_window=5
        ),
        probe_period=0.5,
        propagation_lag=1.0,
        shutdown_delay_ms=2_000,
        clients=4,
        warm_before=1.0,
        warm_after=1.0,
        out_dir=tmp_path,
        label="test",
    )
    started = time.monotonic()
    report = await rehearse(params)
    wall = time.monotonic() - started

    served = {record.client for record in report.requests if record.kind == "ok"}
    assert served == {"sdk", "fresh"}, report.describe_failures()
    assert [event.what for event in report.events if event.slot == 1].count("started") == 2
    failed = report.failed
    assert failed == 0, (
        f"{report.describe_failures()}\n(wall time {wall:.1f} s; logs in {report.log_dir})"
    )
