"""How long a model's requests wait for a backend: the `Retry-After` of its routing 503s
(docs/data-plane.md, "Forwarding", step 4).

Why: a request that found every backend busy waits within its `x-max-wait-ms` for one to become
choosable, and gets a 503 when none did. A client that retries at once finds the same busy
fleet; one told to come back after the time requests of that model have recently waited for a
backend retries when one is likely free. So each request that waited and then had its backend
chosen adds its wait (from its start to the choice) to an exponentially weighted moving average
per model, and a 503 of that model says `Retry-After: <average, rounded up>`, at least 1 s and at
most 60 s. With no recent measurement (none, or the last one older than `stale_after`: a wait
measured long ago says nothing about now) the 503 has no `Retry-After`, as before.

Pure and O(1) per call: the caller passes the time. The map is bounded (`max_models`; the oldest
entry goes first), and its keys are the `model` metric label, which client input never creates
(stargate/proxy/plan.py).
"""

from __future__ import annotations

import math

__all__ = ["RoutingWaits"]


class RoutingWaits:
    """EWMA of the routing wait per model, and the `Retry-After` it gives."""

    __slots__ = ("_ceiling", "_floor", "_max_models", "_stale_after", "_waits", "_weight")

    def __init__(
        self,
        *,
        weight: float = 0.3,
        floor: int = 1,
        ceiling: int = 60,
        stale_after: float = 300.0,
        max_models: int = 4096,
    ) -> None:
        if not 0 < weight <= 1:
            raise ValueError("weight must be in (0, 1]")
        if not 1 <= floor <= ceiling:
            raise ValueError("need 1 <= floor <= ceiling")
        self._weight = weight  # of a new sample
        self._floor = floor
        self._ceiling = ceiling
        self._stale_after = stale_after
        self._max_models = max_models
        # model -> (the average in seconds, when the last sample came)
        self._waits: dict[str, tuple[float, float]] = {}

    def observe(self, model: str, waited: float, now: float) -> None:
        """A request for `model` waited `waited` seconds before its backend was chosen."""
        waits = self._waits
        entry = waits.pop(model, None)  # re-inserted last: the oldest entry is the first
        if entry is None or now - entry[1] > self._stale_after:
            average = waited
        else:
            average = entry[0] + self._weight * (waited - entry[0])
        waits[model] = (average, now)
        if len(waits) > self._max_models:
            del waits[next(iter(waits))]

    def average(self, model: str, now: float) -> float | None:
        """The current average wait in seconds, or None without a recent sample."""
        entry = self._waits.get(model)
        if entry is None or now - entry[1] > self._stale_after:
            return None
        return entry[0]

    def retry_after(self, model: str, now: float) -> int | None:
        """Whole seconds for a 503's `Retry-After` (the average rounded up, within the bounds),
        or None without a recent sample."""
        average = self.average(model, now)
        if average is None:
            return None
        return min(self._ceiling, max(self._floor, math.ceil(average)))

    def __len__(self) -> int:
        return len(self._waits)
