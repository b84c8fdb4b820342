"""Settings for the whole test process (every directory, every xdist worker): a shared default SSL
context for httpx, and the order tests run in.

httpx builds a fresh SSL context for every client it constructs, even one that only ever speaks
plain HTTP, and the default one loads certifi's CA bundle: 43 ms of CPU per `httpx.Client()` on
the 2-core CI machine. The tests make tens of thousands of one-off clients (`httpx.get` inside
`wait_until`, which polls every 20 ms), so that alone kept one core busy through the e2e tests
while they waited. Here the default context (`verify=True`, no client certificate) is built once
per trust setting and shared; every other `verify` (a CA file, a context, `False`) is built as
httpx builds it. The product never does this: its clients are long-lived.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx
import pytest
from httpx._transports import default as _httpx_transports

_build_context = httpx.create_ssl_context  # what the transports call, by this name


@functools.cache
def _default_context(trust_env: bool) -> ssl.SSLContext:
    return _build_context(verify=True, cert=None, trust_env=trust_env)


def _create_ssl_context(
    verify: Any = True, cert: Any = None, trust_env: bool = True
) -> ssl.SSLContext:
    if verify is True and cert is None:
        return _default_context(trust_env)
    return _build_context(verify=verify, cert=cert, trust_env=trust_env)


_httpx_transports.create_ssl_context = _create_ssl_context  # type: ignore[attr-defined]


# Modules with a test of 7 s or more on the 2-core CI machine, slowest first (refresh from the
# "slowest durations" list `nox -s tests` prints). Under pytest-xdist they run first: a worker
# that finishes early steals work from the other, which only helps while the work left is many
# short tests, not one long one (in collection order these came last and one worker ran alone
# for the last 2.5 minutes).
LONG_FIRST = (
    "tests/faults/test_activator_faults.py",
    "tests/e2e/test_fleet.py",
    "tests/unit/activator/test_shared_pools.py",
    "tests/e2e/test_backend_churn.py",
    "tests/faults/test_pylon_faults.py",
    "tests/unit/proxy/test_bad_input.py",
    "tests/e2e/test_shared_pools.py",
    "tests/faults/test_backend_faults.py",
    "tests/unit/activator/test_pool_config_fuzz.py",
    "tests/unit/proxy/test_json_scan.py",
    "tests/e2e/test_pylon_data_path.py",
    "tests/faults/test_sigterm_under_load.py",
    "tests/unit/control_plane/test_registration_fuzz.py",
    "tests/e2e/test_rollout.py",
    "tests/e2e/test_rolling_restart.py",
    "tests/e2e/test_backend_concurrency.py",
    "tests/e2e/test_affinity_routing.py",
    "tests/unit/activator/test_pool_soak.py",
    "tests/e2e/test_metrics_churn.py",
    "tests/faults/test_slow_clients.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of `LONG_FIRST` first, in its order; every other test keeps its place. Every
    xdist worker collects the same order, as xdist requires."""
    rank = {path: index for index, path in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
