"""Capped exponential backoff with jitter, for reconnecting gRPC streams."""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["Backoff"]


class Backoff:
    """Delays of `initial`, doubling up to `cap`, each scaled by a random factor in
    `[1 - jitter, 1 + jitter]`. `reset()` starts over (after a stream stayed up a while)."""

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
        """The delay before the next attempt (seconds); grows the following one."""
        base = self._current
        self._current = min(self.cap, self._current * self.multiplier)
        return base * self._uniform(1 - self.jitter, 1 + self.jitter)

    def reset(self) -> None:
        self._current = self.initial
