"""A replica's phases as pure logic: no clock, no I/O, no trio.

    warming -> ready -> leaving -> draining -> done

The replica (`stargate.runtime.Replica`) drives this state machine and does the I/O each
transition calls for (closing listeners, ending streams, cancelling what is left); readiness
(`stargate.readiness.Readiness`) reads it for `/readyz` and gRPC health and is told of each change
(`watch`). Keeping the rules here, in one place, lets them be tested exhaustively without a loop
(tests/unit/test_lifecycle.py), like the warmup rule in `stargate.warmup`. The phases are those of
docs/architecture.md ("Readiness") and docs/rolling-restarts.md:

* **warming**: serving, but `/readyz` is 503 until the warmup sampler promotes the replica;
* **ready**: promoted. Promotion is latched: nothing but a shutdown makes the replica unready;
* **leaving** (SIGTERM with `--shutdown-delay-ms` > 0): still serving everything, while clients
  and Pylons are told to move on;
* **draining**: the listeners stop accepting, streams end, in-flight work finishes;
* **done**: nothing was left in flight (the drain finished on its own).

The rules, each a guard of one transition:

* every transition is one-way and idempotent: a phase is never left for an earlier one, and a
  transition that does not apply returns False and changes nothing, so two signals, or a signal
  and a failing server, never run a step twice or undo one;
* `promote` only ends warming: a warmup that ends after a shutdown began promotes nothing;
* `begin_leaving` only from warming or ready, and only with a leave phase; without one a shutdown
  goes straight to draining (`shutdown_step`);
* `begin_draining` from any phase before it; `drained` only from draining;
* `force` (a second signal) is latched in any phase; `fail` (a critical task ended on its own)
  only counts before draining, since once draining the servers ending is the drain itself;
* the exit code (`outcome`): forced, failed, or a drain cut by its deadline exit 1; otherwise 0.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

__all__ = ["Lifecycle", "Outcome", "Phase"]


class Phase(enum.Enum):
    """Where the replica is in its life, in order."""

    WARMING = "warming"
    READY = "ready"
    LEAVING = "leaving"
    DRAINING = "draining"
    DONE = "done"


_ORDER = tuple(Phase)
_ACCEPTING = frozenset({Phase.WARMING, Phase.READY})
_STOPPED = frozenset({Phase.DRAINING, Phase.DONE})


class Outcome(enum.Enum):
    """How a replica's run ended, and so the process exit code (`exit_code`)."""

    STARTUP_FAILED = "start-up failed"  # nothing was served
    FORCED = "forced"  # a second signal cut the drain short
    FAILED = "failed"  # a critical task (a server) ended on its own
    TIMED_OUT = "timed out"  # the drain deadline cut in-flight work
    COMPLETE = "complete"  # the drain finished, or every task ended on its own

    @property
    def exit_code(self) -> int:
        """0 only for a complete shutdown: an orchestrator reads anything else as a failure."""
        return 0 if self is Outcome.COMPLETE else 1


PhaseListener = Callable[[Phase], None]
"""Called with the new phase after each change (never for a transition that does not apply)."""


class Lifecycle:
    """The replica's phase, its transitions and their guards, and the exit code rule.

    `leave_phase` is whether a SIGTERM first leaves (`--shutdown-delay-ms` > 0) or drains at once.
    """

    def __init__(self, *, leave_phase: bool = True) -> None:
        self.leave_phase = leave_phase
        self._phase = Phase.WARMING
        self._forced = False
        self._failed = False
        self._listeners: list[PhaseListener] = []

    # ---- reads ----------------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def warm(self) -> bool:
        """Warmup is over, for good: promoted, or a shutdown began (which ends warmup)."""
        return self._phase is not Phase.WARMING

    @property
    def accepting_work(self) -> bool:
        """No shutdown has begun: new work is welcome (warming included)."""
        return self._phase in _ACCEPTING

    @property
    def shutting_down(self) -> bool:
        """A shutdown has begun: leaving, draining or done."""
        return self._phase not in _ACCEPTING

    @property
    def stopped_accepting(self) -> bool:
        """The listeners stop accepting: draining or done."""
        return self._phase in _STOPPED

    @property
    def forced(self) -> bool:
        return self._forced

    @property
    def failed(self) -> bool:
        return self._failed

    def shutdown_step(self, *, leave: bool) -> Phase | None:
        """The phase a shutdown request moves to from here, without moving: `LEAVING` for the
        first request with `leave` (SIGTERM) when there is a leave phase, `DRAINING` for the
        first one otherwise (SIGINT, a failure, no delay) or for one without `leave` while
        leaving, None when it changes nothing (a SIGTERM while leaving, anything once draining).
        """
        if self._phase in _ACCEPTING:
            return Phase.LEAVING if leave and self.leave_phase else Phase.DRAINING
        if self._phase is Phase.LEAVING and not leave:
            return Phase.DRAINING
        return None

    def outcome(self, *, cancelled: bool) -> Outcome:
        """How the run ended, once its task group has: `cancelled` is whether that group was
        cancelled (a forced exit, the drain deadline, or the finished drain ending the servers).

        A forced exit is named first, then a failure: both exit 1 whatever the drain did. A
        cancellation that was not the finished drain is the deadline.
        """
        if self._forced:
            return Outcome.FORCED
        if self._failed:
            return Outcome.FAILED
        if cancelled and self._phase is not Phase.DONE:
            return Outcome.TIMED_OUT
        return Outcome.COMPLETE

    def watch(self, listener: PhaseListener) -> None:
        """Call `listener` with the new phase after every change, in the order of `watch` calls."""
        self._listeners.append(listener)

    # ---- transitions ----------------------------------------------------------------------------

    def promote(self) -> bool:
        """Warmup ended: warming -> ready. Nothing else is promoted (a shutdown ended warmup)."""
        return self._move(Phase.READY, only_from=(Phase.WARMING,))

    def begin_leaving(self) -> bool:
        """The leave phase begins: warming or ready -> leaving, only with a leave phase."""
        return self.leave_phase and self._move(Phase.LEAVING, only_from=_ACCEPTING)

    def begin_draining(self) -> bool:
        """The listeners stop accepting: warming, ready or leaving -> draining."""
        return self._move(Phase.DRAINING, only_from=(Phase.WARMING, Phase.READY, Phase.LEAVING))

    def drained(self) -> bool:
        """Nothing is left in flight: draining -> done."""
        return self._move(Phase.DONE, only_from=(Phase.DRAINING,))

    def force(self) -> None:
        """A second signal: the exit code will be 1, whatever the phase (the runtime then drains
        at once and cancels what is left)."""
        self._forced = True

    def fail(self) -> bool:
        """A critical task ended on its own; True if that is a failure (the exit code will be 1
        and the runtime drains at once), False once draining, where servers ending is expected."""
        if self._phase in _STOPPED:
            return False
        self._failed = True
        return True

    def _move(self, to: Phase, *, only_from: tuple[Phase, ...] | frozenset[Phase]) -> bool:
        if self._phase not in only_from:
            return False
        assert _ORDER.index(to) > _ORDER.index(self._phase)  # one-way, by construction
        self._phase = to
        for listener in self._listeners:
            listener(to)
        return True
