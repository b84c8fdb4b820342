"""The serving process's collector settings (stargate/gc_policy.py), checked in a child process:
they are process-wide, and the test process must keep its own."""

from __future__ import annotations

import subprocess
import sys

from stargate.gc_policy import YOUNG_THRESHOLD

CHECK = """
import gc
from stargate.gc_policy import tune_for_serving
before = gc.get_threshold()
tune_for_serving()
after = gc.get_threshold()
print(before[1:] == after[1:], after[0], gc.get_freeze_count() > 0)
"""


def test_serving_freezes_start_up_objects_and_raises_the_young_threshold() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout.split() == ["True", str(YOUNG_THRESHOLD), "True"]


def test_stargate_serve_applies_it() -> None:
    """`stargate serve` (runtime._main) tunes the collector; a `Replica` built by a library
    user (the tests) does not."""
    import inspect

    from stargate import runtime

    assert "tune_for_serving()" in inspect.getsource(runtime._main)
    assert "tune_for_serving" not in inspect.getsource(runtime.Replica)
