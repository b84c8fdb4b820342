"""Fixtures of the fault suite, and its tally.

Every test here injects faults into real processes on loopback (a replica, mock engines, Pylons,
misbehaving clients and backends) and asserts what a client sees. Each test keeps a `Tally` of
the faults it injected, the requests it sent and the requests it lost (accepted by the replica
but never completed, or answered other than documented). At teardown the tally is appended as
one JSON line to `faults-tally.jsonl` under pytest's base temporary directory (the controller's,
when pytest-xdist runs the suite in workers: each worker's own directory is inside it), and when
the session ends the totals are written to the terminal, so CI output shows them without `-s`:

    faults injected N, requests sent M, requests lost L (K of them to known bugs, ...)
"""

from __future__ import annotations

import json
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.support import Tally

_TALLY_NAME = "faults-tally.jsonl"


def _tally_path(factory: pytest.TempPathFactory, config: pytest.Config) -> Path:
    """The session's tally file: under the controller's base directory, which a pytest-xdist
    worker's own base directory (`popen-gwN`) sits in."""
    base = factory.getbasetemp()
    return (base.parent if hasattr(config, "workerinput") else base) / _TALLY_NAME


@pytest.fixture
def tally(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Tally]:
    """This test's tally; written to the session's JSON-lines file at teardown (pass or fail)."""
    path = _tally_path(tmp_path_factory, request.config)
    counts = Tally()
    yield counts
    line = {"test": request.node.nodeid, **counts.as_dict()}
    with path.open("a") as out:
        out.write(json.dumps(line) + "\n")


@pytest.fixture(scope="session", autouse=True)
def _enough_descriptors() -> None:
    """Hundreds of concurrent client connections need more than a 1024 soft limit; processes
    started from here inherit the raised limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: the controller reports the whole session
    factory: pytest.TempPathFactory | None = getattr(session.config, "_tmp_path_factory", None)
    if factory is None:
        return
    path = _tally_path(factory, session.config)
    if not path.exists():
        return
    totals = Tally()
    tests = 0
    for raw in path.read_text().splitlines():
        if raw.strip():
            totals.add(json.loads(raw))
            tests += 1
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    reporter.write("\n")  # the progress line is still open when this hook runs
    reporter.write_sep("-", "fault suite")
    known = f" ({totals.known} of them to known bugs, see the xfail tests)" if totals.known else ""
    reporter.write_line(
        f"faults injected {totals.faults}, requests sent {totals.sent}, "
        f"requests lost {totals.lost}{known} [{tests} tests; per test: {path}]"
    )
