"""Slow start: a backend that joins a target ramps up to its full share over a window.

docs/outliers.md, "Slow start". A freshly registered engine has cold caches and is still
compiling kernels; given its full share on its first heartbeat it answers slowly and, with a
stat-driven balancer, looks empty (no queue yet) and attracts even more. Envoy's rule, which this
follows: while a backend is in its window its weight is scaled by

    factor = max(min_weight_percent / 100, (time_in_window / window) ** (1 / aggression))

(aggression 1.0: a linear ramp). Our balancers have no weights (round robin, power-of-n, pulsar,
wait-and-widen, prefix-aware, random, ...), and several decide from the backends' published
queues, which a fresh engine's look best of all. So the factor is applied in front of every
balancer instead: for each routing decision, each candidate still in its window is left out of
the candidate set with probability `1 - factor`. Over many decisions the backend then gets about
`factor` of the share the balancer would give it, whatever the balancer is. Two guards keep it
honest:

* a ramping backend is only left out while some candidate of the decision is *established* (out
  of its window): when every candidate is new there is nobody to shift the traffic to (Envoy
  notes its slow start is "not very effective" then, for the same reason), and a fleet that
  registers together is never slowed down against itself;
* the set is never left empty: established candidates are never left out.

Backends that joined before the replica's warmup ended (`SlowStart.settle`) are the initial
fleet: they were serving other replicas already, and ramping them would only slow this replica's
start. They never ramp.

Pure: no clock (`now` comes in), no I/O, the randomness is a `draw` callable. The routing state
keeps each backend entry's join time (`BackendSnapshot.joined_at`) and the latest one
(`RoutingState.last_join`), so `SlowStart.active` answers "is anyone in a window?" in O(1) and
the request path pays nothing once every backend has ramped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["SlowStart", "SlowStartPolicy", "ramp_factor"]


@dataclass(frozen=True, slots=True)
class SlowStartPolicy:
    """`--slow-start-window-ms` (as seconds; 0 = off), `--slow-start-aggression`,
    `--slow-start-min-weight-percent`."""

    window: float = 30.0
    aggression: float = 1.0
    min_weight_percent: float = 10.0

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError(f"slow start window must not be negative, got {self.window}")
        if not self.aggression > 0:
            raise ValueError(f"slow start aggression must be greater than 0, got {self.aggression}")
        if not 0 <= self.min_weight_percent <= 100:
            raise ValueError(
                f"slow start min weight percent must be within 0..100, got "
                f"{self.min_weight_percent}"
            )

    @property
    def enabled(self) -> bool:
        return self.window > 0


def ramp_factor(policy: SlowStartPolicy, elapsed: float) -> float:
    """The share factor of a backend `elapsed` seconds into its window (1.0 once past it)."""
    if not policy.enabled or elapsed >= policy.window:
        return 1.0
    progress = max(elapsed, 0.0) / policy.window
    return max(policy.min_weight_percent / 100, math.pow(progress, 1 / policy.aggression))


class SlowStart:
    """The slow-start rule of one replica: the policy and when its initial fleet settled."""

    __slots__ = ("policy", "settled_at")

    def __init__(self, policy: SlowStartPolicy) -> None:
        self.policy = policy
        self.settled_at = -math.inf
        """Backends that joined at or before this instant are the initial fleet (no ramp)."""

    def settle(self, now: float) -> None:
        """The replica's warmup ended: every backend that joined so far is the initial fleet."""
        self.settled_at = max(self.settled_at, now)

    def active(self, last_join: float, now: float) -> bool:
        """Whether some backend may be in its window: `last_join` is the latest join time of
        any backend entry (`RoutingState.last_join`). O(1), for every request."""
        policy = self.policy
        return policy.window > 0 and last_join > self.settled_at and now - last_join < policy.window

    def ramping(self, joined_at: float, now: float) -> bool:
        """The backend that joined its target at `joined_at` is in its window."""
        return joined_at > self.settled_at and now - joined_at < self.policy.window

    def factor(self, joined_at: float, now: float) -> float:
        """Its share factor now (1.0 when it is not ramping)."""
        if not self.ramping(joined_at, now):
            return 1.0
        return ramp_factor(self.policy, now - joined_at)

    def left_out(
        self, candidates: Iterable[tuple[str, float]], now: float, draw: Callable[[], float]
    ) -> set[str]:
        """Which of one decision's candidates (backend id, join time) sit this decision out:
        each ramping one with probability `1 - factor` (`draw` is uniform in [0, 1)), and none
        unless some candidate is established."""
        ramping: list[tuple[str, float]] = []
        established = False
        for backend_id, joined_at in candidates:
            if self.ramping(joined_at, now):
                ramping.append((backend_id, ramp_factor(self.policy, now - joined_at)))
            else:
                established = True
        if not established:
            return set()
        return {backend_id for backend_id, factor in ramping if draw() >= factor}
