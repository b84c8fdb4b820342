"""Readiness: what `/readyz` and gRPC health say, read from the replica's lifecycle; the warmup
sampler that promotes it; the served certificate's expiry.

The phases and their rules (warming, ready, leaving, draining, done) are `stargate.lifecycle`'s, a
pure state machine the runtime drives; this module reads it and reacts to its changes. `/readyz`
answers 200 only in phase `ready`. Warmup is a trio cancel scope (the "cancellable readiness
scope"): the sampler runs inside it, and warmup ends when the scope ends, whichever comes first of

* stabilization: the total active backend count read from the routing state has been nonzero and
  unchanged for `stabilization_window` samples;
* the deadline (`--readiness-warmup-ms`), which promotes even with zero backends;
* shutdown: the lifecycle leaving (or draining, when there is no leave phase) cancels the scope,
  so nothing ever waits on a warmup that cannot finish; `/readyz` stays 503 from then on (phase
  `leaving`, then `draining`; docs/rolling-restarts.md).

Promotion is latched: once warm, a later drop of the backend count to zero does not make the
replica unready (the proxy answers such requests itself; pulling every replica out of the Service
would turn 503s into refused connections). The one exception is TLS (docs/tls.md): while the
served certificate is expired (now > its notAfter) `/readyz` is 503 with phase
`certificate_expired`, promoted or not, until a reload serves a valid one.

`accepting_work` and `next_change` are what the gRPC health service reads (docs/grpc-health.md):
one predicate and one change notification, so new phases need not touch the health service.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import trio

from stargate.config import WarmupConfig
from stargate.lifecycle import Lifecycle, Phase
from stargate.metrics import ReadinessMetrics
from stargate.warmup import PromotionReason, WarmupSchedule

__all__ = ["Promotion", "Readiness", "ReadinessState"]

log = logging.getLogger(__name__)

EXPIRY_MARGIN_SECONDS = 0.001
"""Past notAfter by this much when the expiry watcher wakes: expiry is strictly after it."""
EXPIRY_RECHECK_SECONDS = 60.0
"""The expiry watcher re-reads the wall clock at least this often."""


@dataclass(frozen=True, slots=True)
class Promotion:
    """How warmup ended: the reason, how long it took, and what the sampler had seen."""

    reason: PromotionReason
    elapsed_seconds: float
    samples: int
    backend_count: int | None


@dataclass(frozen=True, slots=True)
class ReadinessState:
    """A point-in-time view for `/readyz` bodies and `/debug` pages."""

    ready: bool
    phase: str  # "warming", "ready", "certificate_expired", "leaving" or "draining"
    promotion: Promotion | None
    stable_samples: int
    sampled_backend_count: int | None
    reason: str | None = None  # why not ready, for people; None when ready


class Readiness:
    """The replica's readiness: its lifecycle's phase as probes see it, plus the warmup sampler.

    Create it before the servers start (warmup time counts from `run_warmup`, which the runtime
    starts first). With a warmup of 0 the replica is ready at construction and `run_warmup` returns
    at once without reading anything. `lifecycle` is the one the runtime drives; without one (a
    readiness used alone, as in tests) it makes its own, driven through `self.lifecycle`.
    """

    def __init__(
        self,
        config: WarmupConfig,
        metrics: ReadinessMetrics | None = None,
        *,
        wall_clock: Callable[[], float] = time.time,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        self._config = config
        self._wall_clock = wall_clock  # unix time, for certificate expiry (tests pass a fake)
        self._certificate_not_after: float | None = None  # without TLS: never expires
        self._metrics = metrics
        self._warmup_scope = trio.CancelScope()
        self._promoted = trio.Event()
        self._promotion: Promotion | None = None  # how warmup ended, once it has
        self.lifecycle = Lifecycle() if lifecycle is None else lifecycle
        self.lifecycle.watch(self._phase_changed)
        self._started_at: float | None = None
        self._samples = 0
        self._stable_samples = 0
        self._last_count: int | None = None
        # Replaced by a fresh event each time it is set: see `next_change`.
        self._changed = trio.Event()
        if not config.enabled:
            self._promote(PromotionReason.DISABLED, elapsed=0.0)

    # ---- reads (cheap; called by every probe) -------------------------------------------------

    @property
    def ready(self) -> bool:
        """True when `/readyz` should answer 200."""
        return self.lifecycle.phase is Phase.READY and not self.certificate_expired

    @property
    def certificate_expired(self) -> bool:
        """True while the served TLS certificate is past its notAfter (always False without
        TLS). Read from the wall clock at each call, so a probe sees the exact moment."""
        not_after = self._certificate_not_after
        return not_after is not None and _expired(not_after, self._wall_clock())

    @property
    def warm(self) -> bool:
        """True once warmup has ended, for any reason (latched)."""
        return self.lifecycle.warm

    @property
    def draining(self) -> bool:
        """True once the replica stops accepting (draining, then done)."""
        return self.lifecycle.stopped_accepting

    @property
    def accepting_work(self) -> bool:
        """True until a shutdown begins (the leave phase, then draining), and while the served
        TLS certificate is not expired (docs/tls.md).

        Unlike `ready` it is True while warming: a warming replica must take Pylon registrations
        (they are what ends warmup) and can answer model discovery from its routing state. The
        gRPC health service answers SERVING exactly while this holds, so it depends on this one
        predicate, not on phase names. While leaving the replica still serves what reaches it,
        but health checkers should move new work elsewhere, exactly as `/readyz` says.
        """
        return self.lifecycle.accepting_work and not self.certificate_expired

    def next_change(self) -> trio.Event:
        """An event set at the next change of `warm`, `ready`, `draining`, `accepting_work` or
        the served certificate.

        Take the event before reading the state, then wait on it: a change that happens in
        between (say, while sending the state to a client) still wakes the waiter. Each change
        sets the current event and installs a fresh one.
        """
        return self._changed

    @property
    def promotion(self) -> Promotion | None:
        return self._promotion

    @property
    def leaving(self) -> bool:
        """True from the start of a shutdown (the leave phase, then draining)."""
        return self.lifecycle.shutting_down

    def state(self) -> ReadinessState:
        """The phase as `/readyz` names it: `done` stays `draining` (nothing else changes when the
        drain finishes), and an expired certificate shows only before a shutdown."""
        reason: str | None
        if self.lifecycle.stopped_accepting:
            phase, reason = "draining", "the replica is draining (shutting down)"
        elif self.lifecycle.shutting_down:
            phase, reason = "leaving", "the replica is shutting down (leave phase)"
        elif self.certificate_expired:
            phase = "certificate_expired"
            reason = (
                f"the served TLS certificate expired at {_utc(self._certificate_not_after)} "
                "(notAfter); a valid pair at --tls-cert-path/--tls-key-path is picked up by "
                "the next reload"
            )
        elif not self.lifecycle.warm:
            phase, reason = "warming", "warming up: waiting for the backend count to stabilize"
        else:
            phase, reason = "ready", None
        return ReadinessState(
            ready=self.ready,
            phase=phase,
            promotion=self._promotion,
            stable_samples=self._stable_samples,
            sampled_backend_count=self._last_count,
            reason=reason,
        )

    async def wait_warm(self) -> None:
        """Return once warmup has ended (immediately if it already has)."""
        await self._promoted.wait()

    # ---- transitions ----------------------------------------------------------------------------

    async def run_warmup(self, read_backend_count: Callable[[], int]) -> None:
        """Sample `read_backend_count` until warmup ends; return when it has.

        Run this as a background task of the replica's nursery, but not as a critical one: it
        returns normally, and its return must not be read as a failure.
        """
        if self._promotion is not None:
            return
        started_at = trio.current_time()
        self._started_at = started_at
        schedule = WarmupSchedule(self._config, started_at)
        with self._warmup_scope:
            while True:
                await trio.sleep_until(schedule.next_wake())
                outcome = schedule.wake(trio.current_time(), read_backend_count)
                self._samples = schedule.samples_taken
                self._record_sample(outcome.sampled, outcome.streak)
                if outcome.promotion is not None:
                    self._promote(outcome.promotion, elapsed=trio.current_time() - started_at)
                    return

    def serve_certificate(self, not_after: float) -> None:
        """A TLS certificate with this notAfter (unix seconds) is served from now on (at start-up
        and after each reload): readiness follows its expiry (`watch_certificate_expiry`)."""
        was_expired = self.certificate_expired
        self._certificate_not_after = not_after
        if was_expired and not self.certificate_expired:
            log.info("the served TLS certificate is valid again: readiness restored")
        self._publish_ready()
        self._notify_change()

    async def watch_certificate_expiry(self) -> None:
        """Announce the moment the served certificate expires (`next_change`, the ready gauge,
        a WARNING), which no reload or probe would otherwise mark; run until cancelled.

        The wait is cut into pieces of at most `EXPIRY_RECHECK_SECONDS` so that a wall clock
        that jumps (NTP) is caught up with.
        """
        while True:
            changed = self.next_change()
            not_after = self._certificate_not_after
            if not_after is None or self.certificate_expired:
                await changed.wait()
                continue
            wait = min(
                not_after - self._wall_clock() + EXPIRY_MARGIN_SECONDS, EXPIRY_RECHECK_SECONDS
            )
            with trio.move_on_after(max(wait, 0.0)):
                await changed.wait()
            if not changed.is_set() and _expired(not_after, self._wall_clock()):
                log.warning(
                    "the served TLS certificate expired at %s: /readyz answers 503 until a "
                    "valid one is reloaded",
                    _utc(not_after),
                )
                self._publish_ready()
                self._notify_change()

    # ---- internals ------------------------------------------------------------------------------

    def _publish_ready(self) -> None:
        if self._metrics is not None:
            self._metrics.ready.set(1 if self.ready else 0)

    def _phase_changed(self, phase: Phase) -> None:
        """The lifecycle moved. Leaving (docs/rolling-restarts.md) and draining each turn
        `/readyz` 503 now and for good and end warmup if it is running, while the replica may
        still serve; promotion is `_promote`'s own doing, and the drain finishing changes nothing
        a probe reads."""
        if phase in (Phase.LEAVING, Phase.DRAINING):
            self._end_readiness()

    def _end_readiness(self) -> None:
        if self._promotion is None:
            elapsed = 0.0 if self._started_at is None else trio.current_time() - self._started_at
            self._promote(PromotionReason.SHUTDOWN, elapsed=elapsed)
        if self._metrics is not None:
            self._metrics.ready.set(0)
        self._notify_change()

    def _notify_change(self) -> None:
        """Wake every `next_change` waiter; later waiters get a fresh event."""
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    def _record_sample(self, count: int | None, streak: int) -> None:
        self._stable_samples = streak
        if count is not None:
            self._last_count = count
        if self._metrics is not None:
            self._metrics.stable_samples.set(streak)
            if count is not None:
                self._metrics.sampled_backend_count.set(count)

    def _promote(self, reason: PromotionReason, *, elapsed: float) -> None:
        if self._promotion is not None:
            return
        self._promotion = Promotion(reason, elapsed, self._samples, self._last_count)
        self.lifecycle.promote()  # warming -> ready; a no-op when a shutdown ended warmup
        self._warmup_scope.cancel()
        self._promoted.set()
        self._notify_change()
        if self._metrics is not None:
            self._metrics.warmup_promotions.labels(reason=reason.value).inc()
            if reason is not PromotionReason.SHUTDOWN:
                self._metrics.time_to_ready_seconds.set(elapsed)
            self._metrics.ready.set(1 if self.ready else 0)
        log.info(
            "readiness warmup ended: reason=%s samples=%d backend_count=%s elapsed=%.3fs",
            reason.value,
            self._samples,
            "n/a" if self._last_count is None else self._last_count,
            elapsed,
        )


def _utc(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _expired(not_after: float, now: float) -> bool:
    return now > not_after  # strictly after: notAfter is the last valid second
