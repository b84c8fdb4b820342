"""The stateless HTTP health probe of a backend engine, shared by every part that judges one.

The replica's backend monitors (`stargate/control_plane/health.py`), the Pylon's engine probes
(`stargate/pylon/sidecar.py`) and the process controller's engine supervisor
(`stargate/activator/process.py`) all ask the same question the same way: does the engine
answer its health endpoint with a 2xx in time, and how long did that take. This module answers it
once; what each caller does with the answer (verdicts, INACTIVE models, routes) stays with it.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx
import trio

__all__ = [
    "DEFAULT_HEALTH_PATHS",
    "PROBE_HEADERS",
    "ProbeFailed",
    "http_health_probe",
]

DEFAULT_HEALTH_PATHS: tuple[str, ...] = ("/health", "/v1/health/ready")
"""Tried in order: `/health`, then `/v1/health/ready` where `/health` is 404."""

PROBE_HEADERS: Mapping[str, str] = {
    "x-request-id": "stargate-health",
    "x-model": "stargate-health",
    "x-input-tokens": "0",
}
"""Headers the replica and the Pylon send with each probe."""


class ProbeFailed(Exception):
    """The backend did not answer its health endpoint with a 2xx in time."""


async def http_health_probe(
    client: httpx.AsyncClient,
    base_url: str,
    probe_timeout: float,
    paths: tuple[str, ...] = DEFAULT_HEALTH_PATHS,
    *,
    headers: Mapping[str, str] = PROBE_HEADERS,
) -> int:
    """One health check: the first of `paths` that is not 404 must answer 2xx, body read.

    Returns the round-trip time in nanoseconds (at least 1) or raises ProbeFailed (refused,
    timed out after `probe_timeout` seconds, non-2xx). Shared by the replica's backend probes, the
    Pylon's engine probes and the process controller, so all judge an engine's health the same
    way.
    """
    if not paths:
        raise ValueError("at least one health path is required")
    base = base_url.rstrip("/")
    for path in paths:
        started = trio.current_time()
        try:
            with trio.fail_after(probe_timeout):
                response = await client.get(base + path, headers=dict(headers))
                await response.aread()
        except (httpx.HTTPError, trio.TooSlowError) as error:
            raise ProbeFailed(f"{base}{path}: {error!r}") from None
        elapsed_ns = int((trio.current_time() - started) * 1e9)
        if response.status_code == 404 and path != paths[-1]:
            continue
        if 200 <= response.status_code < 300:
            return max(elapsed_ns, 1)
        raise ProbeFailed(f"{base}{path} answered {response.status_code}")
    raise ProbeFailed(f"{base}: no health endpoint")  # pragma: no cover - loop always returns
