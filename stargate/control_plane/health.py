"""Backend health and RTT for registrations (spec §2.8, adapted to HTTP backends by decision 3).

Each admitted registration runs a monitor that probes `GET {url}/health` (falling back to
`GET {url}/v1/health/ready` when `/health` is 404) every second and publishes either the round-trip
time of the last success or "pending". The monitor never changes routing by itself: the next
registration update reads it, so a failed check takes effect within one Pylon heartbeat, and a
backend whose health endpoint fails stays unroutable however ACTIVE its Pylon says it is.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx
import trio

__all__ = ["HealthMonitor", "HealthProbe", "ProbeFailed", "http_health_probe"]

log = logging.getLogger(__name__)

HEALTH_PATHS = ("/health", "/v1/health/ready")
PROBE_INTERVAL_SECONDS = 1.0


class ProbeFailed(Exception):
    """The backend did not answer its health endpoint with a 2xx in time."""


HealthProbe = Callable[[str], Awaitable[int]]
"""Probe a backend base URL; return the round-trip time in nanoseconds or raise ProbeFailed."""


async def http_health_probe(
    client: httpx.AsyncClient,
    base_url: str,
    probe_timeout: float,
    paths: tuple[str, ...] = HEALTH_PATHS,
) -> int:
    """One health check: the first of `paths` that is not 404 must answer 2xx, body read.

    Shared by the replica's backend probes and the Pylon's engine probes, so both sides judge
    an engine's health the same way.
    """
    if not paths:
        raise ValueError("at least one health path is required")
    base = base_url.rstrip("/")
    headers = {
        "x-request-id": "stargate-health",
        "x-model": "stargate-health",
        "x-input-tokens": "0",
    }
    for path in paths:
        started = trio.current_time()
        try:
            with trio.fail_after(probe_timeout):
                response = await client.get(base + path, headers=headers)
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


class HealthMonitor:
    """The latest health sample of one registration's backend."""

    def __init__(
        self,
        url: str,
        probe: HealthProbe,
        interval: float = PROBE_INTERVAL_SECONDS,
        *,
        on_healthy: Callable[[], None] | None = None,
    ) -> None:
        self._url = url
        self._probe = probe
        self._interval = interval
        self._on_healthy = on_healthy
        self.rtt_ns: int | None = None  # None = pending (never probed, or the last probe failed)

    async def run(self) -> None:
        """Probe forever, one interval apart; cancel to stop."""
        while True:
            await self.probe_once()
            await trio.sleep(self._interval)

    async def probe_once(self) -> int | None:
        try:
            self.rtt_ns = await self._probe(self._url)
        except ProbeFailed as error:
            if self.rtt_ns is not None:
                log.warning("health check failed: %s", error)
            self.rtt_ns = None
        else:
            if self._on_healthy is not None:
                self._on_healthy()  # e.g. lift a demotion after a failed connection
        return self.rtt_ns

    async def rtt_for_update(self) -> int | None:
        """The RTT to apply an update with: the latest sample, or one inline probe if pending."""
        if self.rtt_ns is not None:
            return self.rtt_ns
        return await self.probe_once()
