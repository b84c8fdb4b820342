"""Backend health and RTT for registrations (docs/control-plane.md, Health and RTT).

Each admitted registration runs a monitor that probes `GET {url}/health` (falling back to
`GET {url}/v1/health/ready` when `/health` is 404) every second and publishes either the round-trip
time of the last success or "pending". A backend is routable only while its probe passes, however
ACTIVE its Pylon says it is.

The monitor also reports every change of its verdict (`on_verdict`), and the registration applies
it at once instead of waiting for the Pylon's next update: a Pylon that is frozen or cut off from
the replica sends no next update, and its engine's routes would otherwise outlive the engine by the
whole idle timeout (docs/stale-routes.md). How many failures turn the verdict is `ProbeVerdict`'s
rule, kept pure so it can be tested and changed in one place. The probe itself is the stateless
`http_health_probe` of `stargate/health_probe.py`, shared with the Pylon and the process controller;
the replica sends it through `upstream_get`, a connection pool of the proxy's kind kept for probes
alone, whose status-only GET reads the answer without h11 (docs/performance.md, "Control
plane").
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from stargate.control_plane.probe_clock import ProbeClock
from stargate.health_probe import HttpGet, ProbeFailed
from stargate.upstream import ConnectionPool, UpstreamConfig, UpstreamError

__all__ = [
    "FAILURES_TO_UNROUTE",
    "HealthMonitor",
    "HealthProbe",
    "ProbeVerdict",
    "probe_connections",
    "upstream_get",
]

log = logging.getLogger(__name__)

PROBE_INTERVAL_SECONDS = 1.0
FAILURES_TO_UNROUTE = 1
"""Consecutive failed probes that make a healthy backend unroutable: one. A failure already means
the backend refused the connection, answered non-2xx, or stayed silent for the whole probe timeout
(`--health-check-timeout-ms`, 5 s by default), and one failure always made the next update
unroutable; acting on it at once only removes the wait for that update. A higher threshold would
buy tolerance of single blips with (threshold - 1) probe intervals more of routing to a dead
backend."""


HealthProbe = Callable[[str], Awaitable[int]]
"""Probe a backend base URL; return the round-trip time in nanoseconds or raise ProbeFailed."""


def probe_connections(probe_timeout: float, *, ca_file: str | None = None) -> ConnectionPool:
    """The replica's connections for health probes: one kept-alive connection per backend.

    Apart from the proxy's connections so that a backend at `--proxy-max-connections-per-backend`
    (every slot carrying a stream) is still probed at once rather than after a slot frees, and
    so that probes never queue behind requests. A probe's connection is reused by the next one
    a second later, well within `idle_expiry`.
    """
    return ConnectionPool(
        UpstreamConfig(
            connect_timeout=probe_timeout,
            response_head_timeout=probe_timeout,
            pool_acquire_timeout=probe_timeout,
            max_connections_per_origin=2,
            max_idle_per_origin=1,
            idle_expiry=30.0,
            ca_file=ca_file,
        )
    )


def upstream_get(connections: ConnectionPool) -> HttpGet:
    """`HttpGet` through `connections` (`ConnectionPool.get_status`: the answer is read without
    h11, a probe's CPU more than halved), whose own stale-connection retry is the one `HttpGet`
    asks for."""
    last: tuple[Mapping[str, str], list[tuple[bytes, bytes]]] | None = None

    async def get(url: str, headers: Mapping[str, str]) -> int:
        nonlocal last
        if last is None or last[0] is not headers:  # the probe headers are one constant
            last = (headers, [(k.encode("ascii"), v.encode("latin-1")) for k, v in headers.items()])
        fields = last[1]
        try:
            return await connections.get_status(url, fields)
        except (UpstreamError, ValueError) as error:
            raise ProbeFailed(repr(error)) from None

    return get


class ProbeVerdict:
    """The routability rule of a backend's own health probes, free of I/O and clocks.

    The verdict starts pending (never probed: not routable). A passing probe makes it healthy at
    once; `threshold` consecutive failures make a healthy backend unhealthy, and any failure makes
    a pending one unhealthy (a backend that never answered has nothing to keep).
    """

    __slots__ = ("failures", "healthy", "threshold")

    def __init__(self, threshold: int = FAILURES_TO_UNROUTE) -> None:
        if threshold < 1:
            raise ValueError("the failure threshold must be at least 1")
        self.threshold = threshold
        self.healthy: bool | None = None  # None = pending
        self.failures = 0  # consecutive, since the last pass

    @property
    def routable(self) -> bool:
        return self.healthy is True

    def record(self, passed: bool) -> bool:
        """Count one probe result; True when the verdict changed (routing must follow it)."""
        if passed:
            self.failures = 0
            changed = self.healthy is not True
            self.healthy = True
            return changed
        self.failures += 1
        if self.healthy is True and self.failures < self.threshold:
            return False
        changed = self.healthy is not False
        self.healthy = False
        return changed


class HealthMonitor:
    """The latest health sample of one registration's backend.

    `on_healthy` runs after every passing probe (it lifts the routing state's connect-failure
    demotion);
    `on_verdict(routable)` runs after each change of the verdict, so the registration can make
    the backend unroutable, or routable again, without waiting for its Pylon.
    """

    def __init__(
        self,
        url: str,
        probe: HealthProbe,
        interval: float = PROBE_INTERVAL_SECONDS,
        *,
        on_healthy: Callable[[], None] | None = None,
        on_verdict: Callable[[bool], None] | None = None,
        failure_threshold: int = FAILURES_TO_UNROUTE,
        clock: ProbeClock | None = None,
    ) -> None:
        self._url = url
        self._probe = probe
        # Monitors of one replica share a clock (stargate/control_plane/probe_clock.py).
        self._clock = ProbeClock(interval) if clock is None else clock
        self._on_healthy = on_healthy
        self._on_verdict = on_verdict
        self._verdict = ProbeVerdict(failure_threshold)
        self._last_rtt_ns: int | None = None

    @property
    def routable(self) -> bool:
        """True while the verdict is healthy."""
        return self._verdict.routable

    @property
    def rtt_ns(self) -> int | None:
        """The RTT of the last passing probe while the verdict is healthy; None (pending)
        otherwise, which `routes_for_update` turns into "not routable"."""
        return self._last_rtt_ns if self._verdict.routable else None

    async def run(self) -> None:
        """Probe now, then at each of the monitor's turns on its clock (one interval apart);
        cancel to stop."""
        try:
            while True:
                await self.probe_once()
                await self._clock.wait(self)
        finally:
            self._clock.leave(self)

    async def probe_once(self) -> int | None:
        try:
            rtt_ns = await self._probe(self._url)
        except ProbeFailed as error:
            was_healthy = self._verdict.healthy
            changed = self._verdict.record(False)
            if changed and was_healthy:
                log.warning("health check failed; backend unroutable: %s", error)
        else:
            was_healthy = self._verdict.healthy
            self._last_rtt_ns = rtt_ns
            changed = self._verdict.record(True)
            if changed and was_healthy is False:
                log.info("health check passed again; backend routable: %s", self._url)
            if self._on_healthy is not None:
                self._on_healthy()  # e.g. lift a demotion after a failed connection
        if changed and self._on_verdict is not None:
            self._on_verdict(self._verdict.routable)
        return self.rtt_ns

    async def rtt_for_update(self) -> int | None:
        """The RTT to apply an update with: the latest sample, or one inline probe if pending."""
        if self.rtt_ns is not None:
            return self.rtt_ns
        return await self.probe_once()
