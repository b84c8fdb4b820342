"""Capped exponential backoff with jitter, for reconnecting gRPC streams, and the rule that cuts a
backoff short when the peer is back.

A backoff alone makes a Pylon slow to notice a restarted replica: after an outage of a few seconds
every Pylon sits at the cap, and the replica's readiness window (a handful of samples) would close
with only some backends registered. So while it waits, the Pylon also tries a cheap TCP connect to
the replica every `RECONNECT_POLL_SECONDS`; `RecoveryDetector` turns those results into "it was
refusing and now accepts": only that transition wakes the retry (and resets the backoff). A peer
that accepts TCP but refuses the stream (a load balancer in front of a down replica, a duplicate
id) never sees such a transition, so polling cannot turn the backoff into a busy loop.
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = [
    "RECONNECT_POLL_SECONDS",
    "RECONNECT_PROBE_TIMEOUT_SECONDS",
    "WORST_RECONNECT_DELAY_SECONDS",
    "Backoff",
    "RecoveryDetector",
]

RECONNECT_POLL_SECONDS = 0.25
"""While a stream waits to reconnect, how often its target is TCP-probed."""
RECONNECT_PROBE_TIMEOUT_SECONDS = 0.2
"""Timeout of one TCP probe. Shorter than the poll period, so probes never overlap and a slow one
cannot delay the next; a peer slower than this to accept counts as not accepting yet."""
WORST_RECONNECT_DELAY_SECONDS = RECONNECT_POLL_SECONDS + RECONNECT_PROBE_TIMEOUT_SECONDS
"""Longest time from a replica (seen refusing before) starting to accept connections to the
Pylon opening its new stream there: the next probe starts within one poll period and completes
within the probe timeout. The stream is acknowledged one round trip later. A replica's readiness
stabilization window (`--warmup-sample-interval-ms` x `--warmup-stabilization-window`) must be
longer than this, or a restarted replica may promote before every Pylon is back."""


class Backoff:
    """Delays of `initial`, doubling up to `cap`, each scaled by a random factor in
    `[1 - jitter, 1 + jitter]` and then capped again: `next()` never exceeds `cap`.

    Jitter is applied inside the cap (not after it) so that `cap` is a real bound: once a fleet
    has been down for a while every Pylon sits at the cap, and the cap is what an operator sizes
    a replica's readiness window against. `reset()` starts over (after a stream stayed up a while,
    or when the peer is known to be back).
    """

    def __init__(
        self,
        initial: float = 0.1,
        cap: float = 5.0,
        *,
        multiplier: float = 2.0,
        jitter: float = 0.2,
        uniform: Callable[[float, float], float] = random.uniform,
    ) -> None:
        if not 0 < initial <= cap:
            raise ValueError("backoff needs 0 < initial <= cap")
        if not 0 <= jitter < 1:
            raise ValueError("backoff jitter must be in [0, 1)")
        self.initial = initial
        self.cap = cap
        self.multiplier = multiplier
        self.jitter = jitter
        self._uniform = uniform
        self._current = initial

    def next(self) -> float:
        """The delay before the next attempt (seconds, at most `cap`); grows the following one."""
        base = self._current
        self._current = min(self.cap, self._current * self.multiplier)
        return min(self.cap, base * self._uniform(1 - self.jitter, 1 + self.jitter))

    def reset(self) -> None:
        self._current = self.initial


class RecoveryDetector:
    """Remembers whether a peer was seen refusing connections; `observe(True)` after that says
    "it is back" once. Probe results are the only input (not stream errors): a stream that fails
    on a peer that accepts TCP is no sign that the peer went down, and counting it would make
    every failed stream re-arm the wake-up."""

    def __init__(self) -> None:
        self.down_seen = False

    def observe(self, accepted: bool) -> bool:
        """Record one probe result; True when the peer accepts after having been seen down."""
        if not accepted:
            self.down_seen = True
            return False
        recovered = self.down_seen
        self.down_seen = False
        return recovered

    def clear(self) -> None:
        """Forget an earlier refusal (a stream there was acknowledged: the peer is up)."""
        self.down_seen = False
