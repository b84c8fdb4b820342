"""Outlier ejection: a backend that keeps failing is left out of routing for a while.

docs/outliers.md, "Outlier ejection". Without it, a backend that answers fast 5xx stays in
rotation until its health probe fails (a process that answers `/health` but 500s every request
never does), and keeps its full share: a third of the traffic with three backends. Envoy's
outlier detection, which this follows:

* `consecutive_failures` (K) final 5xx responses in a row, or K transport failures in a row
  (refused, reset, no response head in time: Envoy's local-origin failures), eject the backend;
  a success resets both counts. A 429/503 its Pylon or engine marked retryable
  (`x-stargate-retryable` / `x-stargate-upstream-retryable: true`) is load signalling, not a
  failure: it neither counts nor resets (`classify_response`);
* an ejection lasts `base_ejection` x the number of times the backend has been ejected, at most
  `max_ejection`; the number drops by one for every `decay_interval` the backend spends back in
  rotation, so a backend that recovered for good starts again from `base_ejection`;
* at most `max_ejection_percent` of the backends are ejected at once, but at least one may be
  (Envoy's rule), so a fleet-wide failure never ejects the whole fleet;
* an ejected backend returns when its time is up, with no probe: if it still fails, the next K
  failures eject it again for longer.

This is separate from *demotion* (stargate/routing/state.py: a refused connection takes a
backend out until its health probe passes): both leave a backend out, for different reasons and
with different ends, and neither touches the other.

Pure: no clock (`now` comes in), no I/O, no metrics; what happened comes back as `Ejection`,
`Refusal` and `Return` values for the caller to log and count. The request path asks
`any_ejected` (O(1)) and, only when some backend is ejected, `expire` (O(1) until the earliest
ejection ends) and `ejected`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

__all__ = [
    "Ejection",
    "EjectionPolicy",
    "EjectionReason",
    "OutlierDetector",
    "Refusal",
    "Result",
    "Return",
    "classify_response",
]


@dataclass(frozen=True, slots=True)
class EjectionPolicy:
    """`--outlier-consecutive-failures` (0 = off), `--outlier-base-ejection-ms`,
    `--outlier-max-ejection-ms`, `--outlier-max-ejection-percent` and
    `--outlier-decay-interval-ms`, as seconds."""

    consecutive_failures: int = 5
    base_ejection: float = 30.0
    max_ejection: float = 300.0
    max_ejection_percent: int = 10
    decay_interval: float = 10.0

    def __post_init__(self) -> None:
        if self.consecutive_failures < 0:
            raise ValueError("consecutive failures must not be negative")
        if not self.base_ejection > 0 or not self.decay_interval > 0:
            raise ValueError("ejection times must be greater than 0")
        if self.max_ejection < self.base_ejection:
            raise ValueError("the max ejection time must be at least the base ejection time")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ValueError("max ejection percent must be within 0..100")

    @property
    def enabled(self) -> bool:
        return self.consecutive_failures > 0

    def allowed(self, population: int) -> int:
        """How many of `population` backends may be ejected at once: the percentage, rounded
        down, but at least one (Envoy ejects one regardless)."""
        return max(1, population * self.max_ejection_percent // 100)


class Result(enum.Enum):
    """What one attempt says about its backend's health."""

    SUCCESS = "success"  # a response head that is not a failure: resets the counts
    SERVER_ERROR = "5xx"  # a final 5xx
    TRANSPORT_FAILURE = "transport"  # refused, reset, or no response head in time
    NEUTRAL = "neutral"  # load signalling, or nothing the backend is to blame for


class EjectionReason(enum.Enum):
    """The `reason` label of the ejection series."""

    CONSECUTIVE_5XX = "consecutive_5xx"
    CONSECUTIVE_TRANSPORT_FAILURE = "consecutive_transport_failure"


def classify_response(
    status: int, retryable: bytes | None, upstream_retryable: bytes | None
) -> Result:
    """A response head's `Result`. A 429/503 marked retryable (by the Pylon, or by an engine
    registered without one) says "busy, try elsewhere", not "broken" (stargate/proxy/retry.py):
    neutral. Any other 5xx is a failure; everything else a success."""
    if status in (429, 503) and (_true(retryable) or _true(upstream_retryable)):
        return Result.NEUTRAL
    return Result.SERVER_ERROR if status >= 500 else Result.SUCCESS


def _true(value: bytes | None) -> bool:
    return value is not None and value.strip().lower() == b"true"


@dataclass(frozen=True, slots=True)
class Ejection:
    """A backend was ejected: `consecutive` failures of `reason`, its `ejections`-th time
    (after decay), for `duration` seconds, until `until`."""

    backend_id: str
    reason: EjectionReason
    consecutive: int
    ejections: int
    duration: float
    until: float


@dataclass(frozen=True, slots=True)
class Refusal:
    """A backend reached the threshold but `max_ejection_percent` of the backends were already
    ejected: it stays in rotation. Reported once per run of failures."""

    backend_id: str
    reason: EjectionReason
    consecutive: int
    ejected: int
    allowed: int


@dataclass(frozen=True, slots=True)
class Return:
    """An ejected backend is back in rotation after `duration` seconds."""

    backend_id: str
    duration: float
    ejections: int


class _Record:
    """One backend's counts. Dropped once it has nothing to remember."""

    __slots__ = ("consecutive_5xx", "consecutive_transport", "decay_from", "ejections", "refused")

    def __init__(self, now: float) -> None:
        self.consecutive_5xx = 0
        self.consecutive_transport = 0
        self.ejections = 0  # the multiplier of the base ejection time
        self.decay_from = now  # the multiplier last dropped (or the backend returned) then
        self.refused = False  # a refusal was reported for the current run of failures

    def decay(self, now: float, interval: float) -> None:
        """Drop the multiplier by one per whole `interval` in rotation since `decay_from`."""
        if self.ejections == 0:
            self.decay_from = now
            return
        steps = int((now - self.decay_from) // interval)
        if steps > 0:
            self.ejections = max(0, self.ejections - steps)
            self.decay_from += steps * interval

    @property
    def clean(self) -> bool:
        return not (self.consecutive_5xx or self.consecutive_transport or self.ejections)


class OutlierDetector:
    """Every backend's failure counts and ejections, by backend id."""

    __slots__ = ("_ejected", "_next_expiry", "_records", "_since", "policy")

    def __init__(self, policy: EjectionPolicy) -> None:
        self.policy = policy
        self._records: dict[str, _Record] = {}
        self._ejected: dict[str, float] = {}  # backend id -> when its ejection ends
        self._since: dict[str, float] = {}  # backend id -> when it was ejected
        self._next_expiry = math.inf

    # ---- the request path ------------------------------------------------------------------------

    @property
    def any_ejected(self) -> bool:
        """Some backend is ejected (or its time ran out and `expire` has not run yet). O(1)."""
        return bool(self._ejected)

    @property
    def ejected(self) -> AbstractSet[str]:
        """The backends ejected now (call `expire` first). A live read-only view."""
        return self._ejected.keys()

    def expire(self, now: float) -> list[Return]:
        """End the ejections whose time is up. O(1) until the earliest one ends."""
        if now < self._next_expiry:
            return []
        returned: list[Return] = []
        for backend_id, until in list(self._ejected.items()):
            if until <= now:
                del self._ejected[backend_id]
                since = self._since.pop(backend_id)
                record = self._records.get(backend_id)
                ejections = 0
                if record is not None:
                    record.decay_from = until
                    ejections = record.ejections
                returned.append(Return(backend_id, until - since, ejections))
        self._next_expiry = min(self._ejected.values(), default=math.inf)
        return returned

    def record(
        self, backend_id: str, result: Result, now: float, population: int
    ) -> Ejection | Refusal | None:
        """One attempt's `result` on `backend_id`; `population`: how many backends there are
        (for `max_ejection_percent`). The ejection, or refusal, it caused, if any."""
        policy = self.policy
        if not policy.enabled or result is Result.NEUTRAL:
            return None
        record = self._records.get(backend_id)
        if result is Result.SUCCESS:
            if record is not None:
                record.consecutive_5xx = record.consecutive_transport = 0
                record.refused = False
                record.decay(now, policy.decay_interval)
                if record.clean and backend_id not in self._ejected:
                    del self._records[backend_id]
            return None
        if backend_id in self._ejected:
            return None  # answers to attempts sent before the ejection: already counted for
        if record is None:
            record = self._records[backend_id] = _Record(now)
        if result is Result.SERVER_ERROR:
            record.consecutive_5xx += 1
            record.consecutive_transport = 0  # it answered: the connection is not the problem
            consecutive, reason = record.consecutive_5xx, EjectionReason.CONSECUTIVE_5XX
        else:
            record.consecutive_transport += 1
            consecutive = record.consecutive_transport
            reason = EjectionReason.CONSECUTIVE_TRANSPORT_FAILURE
        if consecutive < policy.consecutive_failures:
            return None
        self.expire(now)
        allowed = policy.allowed(population)
        if len(self._ejected) >= allowed:
            if record.refused:
                return None
            record.refused = True
            return Refusal(backend_id, reason, consecutive, len(self._ejected), allowed)
        record.decay(now, policy.decay_interval)
        record.ejections += 1
        record.consecutive_5xx = record.consecutive_transport = 0
        record.refused = False
        duration = min(policy.base_ejection * record.ejections, policy.max_ejection)
        until = now + duration
        self._ejected[backend_id] = until
        self._since[backend_id] = now
        self._next_expiry = min(self._next_expiry, until)
        return Ejection(backend_id, reason, consecutive, record.ejections, duration, until)

    # ---- housekeeping ----------------------------------------------------------------------------

    def forget(self, is_registered: Callable[[str], bool], now: float) -> list[str]:
        """Drop what is kept for backends that are no longer registered (their ejections end
        with them, unreported: the backend is gone), and records that decayed to nothing.
        Returns the ids whose ejection was dropped. Visits every record: not for the request
        path."""
        dropped: list[str] = []
        for backend_id in list(self._records):
            record = self._records[backend_id]
            if backend_id not in self._ejected:
                record.decay(now, self.policy.decay_interval)
            if not is_registered(backend_id):
                del self._records[backend_id]
                if self._ejected.pop(backend_id, None) is not None:
                    self._since.pop(backend_id, None)
                    dropped.append(backend_id)
            elif record.clean and backend_id not in self._ejected:
                del self._records[backend_id]
        if dropped:
            self._next_expiry = min(self._ejected.values(), default=math.inf)
        return dropped

    def ejection_count(self, backend_id: str, now: float) -> int:
        """How many times the backend has been ejected, after decay (0: no record)."""
        record = self._records.get(backend_id)
        if record is None:
            return 0
        if backend_id not in self._ejected:
            record.decay(now, self.policy.decay_interval)
        return record.ejections

    def __iter__(self) -> Iterator[str]:
        """The backends with a record (tests and debugging)."""
        return iter(self._records)
