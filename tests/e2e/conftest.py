"""Fixtures of the end-to-end tests (tests/e2e/processes.py holds the process handles)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.fleet import Fleet
from tests.e2e.processes import StargateProcess, launch, stop


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Replicas, Pylons and engines of one test (tests/e2e/fleet.py), all stopped at teardown."""
    handle = Fleet(tmp_path)
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture
def start_stargate(tmp_path: Path) -> Iterator[object]:
    """Start `python -m stargate ARGS...`; every process started is killed at teardown."""
    started: list[StargateProcess] = []

    def start(*args: str) -> StargateProcess:
        handle = launch(tmp_path / f"stargate-{len(started)}.log", *args)
        started.append(handle)
        return handle

    yield start
    for handle in started:
        stop(handle)
