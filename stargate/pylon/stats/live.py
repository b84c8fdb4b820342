"""The live requests of one model: counts by phase, prompt work by priority, queue estimates.

"Live" is admitted and not yet ended. These numbers are what the router's balancers weigh most
after the input TPS (`queue_size`, `queued_input_size`, the per-priority queue map, running
queries), and the router drops its own reservation for a request at the next heartbeat, so they
must count a request from the moment it is admitted.

Prompt work is the input a request still makes the engine process ahead of others: a PENDING
request's input tokens at its own priority (lower number = more urgent); an INPUT_PROCESSING
request's at priority 0, since the engine is already on it and it blocks everyone; nothing once
it generates output, and nothing for a 0-token request. The queue estimate for a priority is the
work at that priority and every more urgent one, divided by the input TPS.

Every sum is kept incrementally: a phase change is O(1) (O(#priorities) when a priority appears
or empties), an estimate O(#priorities), never O(live requests), because this runs on every
request event of a busy engine.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from typing import Protocol

from stargate.pylon.stats.observer import Phase
from stargate.pylon.stats.throughput import valid_tps
from stargate.routing.stats import U64_MAX, reservation_delta_ms

__all__ = ["LiveRequests", "TrackedRequest", "prompt_work", "queue_time_ms"]


def queue_time_ms(tokens: int, tps: float) -> int | None:
    """ceil(tokens / tps x 1000) ms: 0 for no tokens, None when `tps` is not finite and positive
    or the result is not representable as a u64 (1 token at 3 tok/s = 334 ms). The router's
    reservation rule, so both sides of the admission check agree to the millisecond."""
    return reservation_delta_ms(tokens, tps)


def _saturated_ms(tokens: int, tps: float) -> int:
    """`queue_time_ms` for a valid `tps`, u64 max when the work or the result does not fit."""
    if tokens > U64_MAX:
        return U64_MAX
    ms = queue_time_ms(tokens, tps)
    return U64_MAX if ms is None else ms


def prompt_work(phase: Phase, priority: int, input_tokens: int) -> tuple[int, int] | None:
    """(priority the work counts at, tokens) for one request, or None when it adds none."""
    if input_tokens == 0:
        return None
    if phase is Phase.PENDING:
        return priority, input_tokens
    if phase is Phase.INPUT_PROCESSING:
        return 0, input_tokens
    return None


class TrackedRequest(Protocol):
    """What the live state needs of a request (a `RequestTracker`)."""

    @property
    def phase(self) -> Phase: ...

    @property
    def priority(self) -> int: ...

    @property
    def input_tokens(self) -> int: ...


class LiveRequests:
    """Counts and sums over one model's live requests, updated by phase changes.

    The caller reports every change: `add` at admission (PENDING), `move` for each forward
    step, `remove` at the end, with the request's priority and input tokens; `set_active_output`
    when a generating request's decode rate changes. Only live phases may be passed.
    """

    __slots__ = (
        "_active_count",
        "_active_sum",
        "_counts",
        "_keys",
        "_queued_input",
        "_total_input",
        "_work",
    )

    def __init__(self) -> None:
        self._counts = [0, 0, 0]  # PENDING, INPUT_PROCESSING, OUTPUT_GENERATION
        self._total_input = 0
        self._queued_input = 0
        self._work: dict[int, int] = {}  # priority -> prompt work, only nonzero entries
        self._keys: list[int] = []  # sorted keys of _work
        self._active_sum = 0.0
        self._active_count = 0

    def add(self, phase: Phase, priority: int, input_tokens: int) -> None:
        self._counts[phase.value] += 1
        self._total_input += input_tokens
        self._add_work(phase, priority, input_tokens, 1)

    def remove(self, phase: Phase, priority: int, input_tokens: int) -> None:
        self._counts[phase.value] -= 1
        self._total_input -= input_tokens
        self._add_work(phase, priority, input_tokens, -1)

    def move(self, old: Phase, new: Phase, priority: int, input_tokens: int) -> None:
        if old is new:
            return
        self._counts[old.value] -= 1
        self._counts[new.value] += 1
        self._add_work(old, priority, input_tokens, -1)
        self._add_work(new, priority, input_tokens, 1)

    def set_active_output(self, old: float | None, new: float | None) -> None:
        """Replace one generating request's decode rate (None = it has none)."""
        if old is not None:
            self._active_sum -= old
            self._active_count -= 1
        if new is not None:
            self._active_sum += new
            self._active_count += 1
        if self._active_count == 0:
            self._active_sum = 0.0  # no drift left behind by the running sum

    def _add_work(self, phase: Phase, priority: int, input_tokens: int, sign: int) -> None:
        work = prompt_work(phase, priority, input_tokens)
        if work is None:
            return
        key, tokens = work
        self._queued_input += sign * tokens
        total = self._work.get(key, 0) + sign * tokens
        if total:
            if key not in self._work:
                insort(self._keys, key)
            self._work[key] = total
        else:
            del self._work[key]
            self._keys.remove(key)

    @property
    def pending_queries(self) -> int:
        return self._counts[0]

    @property
    def input_processing_queries(self) -> int:
        return self._counts[1]

    @property
    def output_generation_queries(self) -> int:
        return self._counts[2]

    @property
    def queue_size(self) -> int:
        """PENDING + INPUT_PROCESSING requests."""
        return self._counts[0] + self._counts[1]

    @property
    def num_running_queries(self) -> int:
        """Every live request."""
        return self._counts[0] + self._counts[1] + self._counts[2]

    @property
    def queued_input_size(self) -> int:
        """Input tokens of the PENDING and INPUT_PROCESSING requests (u64-saturated)."""
        return min(self._queued_input, U64_MAX)

    @property
    def total_query_input_size(self) -> int:
        """Input tokens of every live request (u64-saturated)."""
        return min(self._total_input, U64_MAX)

    @property
    def active_output_tps(self) -> float:
        """Mean decode rate of the generating requests that have one, 0 when none has."""
        return self._active_sum / self._active_count if self._active_count else 0.0

    @property
    def prompt_work_by_priority(self) -> dict[int, int]:
        return dict(self._work)

    def queue_estimates(self, tps: float) -> dict[int, int]:
        """priority -> ms of the prompt work at that priority and every more urgent one, for each
        priority with work, in ascending priority order; empty when `tps` is not usable."""
        if not valid_tps(tps):
            return {}
        estimates: dict[int, int] = {}
        cumulative = 0
        for key in self._keys:
            cumulative += self._work[key]
            estimates[key] = _saturated_ms(cumulative, tps)
        return estimates

    def actual_queue_ms(self, request: TrackedRequest, tps: float) -> int | None:
        """The queue time ahead of `request` for admission: the prompt work at priorities up to
        its own, minus its own work; None when `tps` is not usable."""
        if not valid_tps(tps):
            return None
        priority = request.priority
        tokens = sum(self._work[key] for key in self._keys[: bisect_right(self._keys, priority)])
        own = prompt_work(request.phase, priority, request.input_tokens)
        if own is not None and own[0] <= priority:
            tokens -= own[1]
        return _saturated_ms(max(tokens, 0), tps)
