"""Throughput arithmetic: the input-TPS distribution, counter sampling, the output window.

The Rust Pylon's numbers come from three small pieces of state, and the router's balancers read
their results as-is, so each is reproduced exactly:

* `TpsDistribution`: `last_mean_input_tps` is a running (Welford) mean of every valid input
  sample since the model generation began. No window and no decay: an idle engine keeps its last
  known capacity, which is what the router needs to keep ranking it. The mean is published only
  once five samples exist, so one lucky request cannot set a backend's capacity.
* `CounterSampleState`: a cumulative per-request counter (tokens processed or generated) becomes a
  rate only when it advanced by at least the minimum AND at least the 10 ms floor has passed since
  the last sample; smaller steps accumulate, so a burst of tiny chunks cannot report absurd rates.
* `OutputWindow`: the output rate published is the mean of the last eight samples.

Durations are whole nanoseconds (`elapsed`), as Rust's `Duration`s are: a rate computed from
trio's float clock then equals the Rust one instead of differing in the last bits.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Final

__all__ = [
    "DURATION_FLOOR_SECONDS",
    "MIN_INPUT_TOKENS",
    "MIN_OUTPUT_TOKENS",
    "MODEL_TTL_SECONDS",
    "REQUEST_TTL_SECONDS",
    "SMOOTHING_WINDOW",
    "SNAPSHOT_THRESHOLD",
    "CounterSampleState",
    "OutputWindow",
    "TpsDistribution",
    "elapsed",
    "output_decode_duration",
    "output_rate",
    "tps_for_units",
    "valid_tps",
]

# The Rust `StatsCollectorConfig::default` values.
SMOOTHING_WINDOW: Final = 8
MIN_INPUT_TOKENS: Final = 1
MIN_OUTPUT_TOKENS: Final = 1
DURATION_FLOOR_SECONDS: Final = 0.010
REQUEST_TTL_SECONDS: Final = 300.0
MODEL_TTL_SECONDS: Final = 30.0
# Valid input samples needed before the mean is published (a seed counts as this many).
SNAPSHOT_THRESHOLD: Final = 5


def valid_tps(value: float) -> bool:
    """A throughput the router can divide by: finite and positive."""
    return value > 0.0 and math.isfinite(value)


def elapsed(now: float, since: float) -> float:
    """`now - since` rounded to whole nanoseconds, never negative (Rust's saturating `Duration`)."""
    delta = now - since
    return round(delta * 1e9) / 1e9 if delta > 0.0 else 0.0


def tps_for_units(units: int, duration: float, floor: float) -> float | None:
    """units / duration, or None for no units or a duration under the floor (or zero)."""
    if units > 0 and duration >= floor and duration > 0.0:
        return units / duration
    return None


def output_decode_duration(
    total: float, to_first_output: float | None, to_first_token: float | None, floor: float
) -> float | None:
    """How long a request decoded: from its first token when that leaves at least the floor,
    else from its first output event (a terminal usage chunk can carry the first token count
    a few ms before the end, which must not make the rate explode)."""
    if to_first_token is not None:
        since_token = elapsed(total, to_first_token)
        if since_token >= floor:
            return since_token
    if to_first_output is not None:
        return elapsed(total, to_first_output)
    return None


def output_rate(
    tokens: int,
    total: float,
    to_first_output: float | None,
    to_first_token: float | None,
    *,
    min_tokens: int,
    floor: float,
) -> float | None:
    """One request's output rate: its output tokens over its decode duration (None below the
    minimum token count or the duration floor)."""
    if tokens < min_tokens:
        return None
    duration = output_decode_duration(total, to_first_output, to_first_token, floor)
    return None if duration is None else tps_for_units(tokens, duration, floor)


class TpsDistribution:
    """Running statistics of the valid input-TPS samples of one model generation.

    `published` is what `last_mean_input_tps` reports: 0 until `SNAPSHOT_THRESHOLD` samples
    exist, then the mean (or the pinned seed), kept when a later mean would not be valid.
    """

    __slots__ = ("_m2", "_pinned", "_published", "count", "max", "mean", "min", "variance")

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.min = 0.0
        self.max = 0.0
        self.variance = 0.0
        self._m2 = 0.0
        self._published = 0.0
        self._pinned: float | None = None

    @classmethod
    def seed(cls, value: float, *, pin: bool = False) -> TpsDistribution:
        """A distribution that already holds `SNAPSHOT_THRESHOLD` samples of `value`, so `value`
        is published at once and real samples then move it (100 seeded + one 200 -> 700/6).
        With `pin` the published value stays `value` whatever the samples say."""
        if not valid_tps(value):
            raise ValueError(f"a seed input TPS must be finite and positive, not {value!r}")
        seeded = cls()
        seeded.count = SNAPSHOT_THRESHOLD
        seeded.mean = seeded.min = seeded.max = value
        seeded._published = value
        seeded._pinned = value if pin else None
        return seeded

    @property
    def published(self) -> float:
        return self._published

    @property
    def pinned(self) -> bool:
        return self._pinned is not None

    @property
    def has_sufficient_data(self) -> bool:
        return self.count >= SNAPSHOT_THRESHOLD

    def update(self, value: float) -> bool:
        """Add one sample (ignored unless finite and positive); True when `published` changed."""
        if not valid_tps(value):
            return False
        if self.count == 0 or value < self.min:
            self.min = value
        if self.count == 0 or value > self.max:
            self.max = value
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self._m2 += delta * (value - self.mean)
        if self.count > 1:
            self.variance = self._m2 / (self.count - 1)
        if self.count < SNAPSHOT_THRESHOLD or not valid_tps(self.mean):
            return False
        published = self.mean if self._pinned is None else self._pinned
        if published == self._published:
            return False
        self._published = published
        return True


class CounterSampleState:
    """One cumulative counter of one request and the point of its last sample.

    `baseline` is where counting starts: 0 for the engine stats stream (its first event may
    already carry a jump worth a sample), the first observed value for counters read from SSE
    usage (the first event only sets the baseline).
    """

    __slots__ = ("observed", "sampled", "sampled_at")

    def __init__(self, baseline: int, now: float) -> None:
        self.observed = baseline
        self.sampled = baseline
        self.sampled_at = now

    def regressed(self, value: int | None) -> bool:
        return value is not None and value < self.observed

    def observe(self, value: int | None, now: float, min_units: int, floor: float) -> float | None:
        """Record the counter's new value; return a rate (units per second) when it is due.

        A sample needs at least `max(min_units, 1)` new units and at least `floor` seconds since
        the last one; otherwise the units accumulate. The first sample of a counter that started
        at 0 counts at least `floor` seconds, so an instant first jump of N units is N / floor.
        """
        if value is None:
            return None
        prior = self.observed
        self.observed = value
        units = value - self.sampled
        if units < max(min_units, 1):
            return None
        duration = elapsed(now, self.sampled_at)
        if self.sampled == 0 and prior == 0:
            duration = max(duration, floor)
        if duration < floor:
            return None
        self.sampled, self.sampled_at = value, now
        return units / duration if duration > 0.0 else None  # 0 only with a zero floor


class OutputWindow:
    """The last `size` output-TPS samples and their mean (a running sum, as Rust keeps it)."""

    __slots__ = ("_samples", "_sum", "size")

    def __init__(self, size: int = SMOOTHING_WINDOW) -> None:
        self.size = size
        self._samples: deque[float] = deque()
        self._sum = 0.0

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def mean(self) -> float:
        return self._sum / len(self._samples) if self._samples else 0.0

    def push(self, sample: float) -> None:
        if self.size <= 0:
            return
        self._samples.append(sample)
        self._sum += sample
        while len(self._samples) > self.size:
            self._sum -= self._samples.popleft()

    def clear(self) -> bool:
        """Drop every sample; True when there were any."""
        had_samples = bool(self._samples)
        self._samples.clear()
        self._sum = 0.0
        return had_samples
