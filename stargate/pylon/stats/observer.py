"""One observed request's phases: every state change of a request in one table.

The forwarding code tells a `RequestTracker` what it saw (the engine's response head, each output
event it relayed, the end of the response) and the tracker moves through the phases the Rust
Pylon's observer uses:

    PENDING --headers--> INPUT_PROCESSING --output--> OUTPUT_GENERATION --finish(ok)--> COMPLETE
       \\-------------------------output------------------------^          \\--> FAILED, CANCELLED

Phases only move forward and the three terminal phases are final: a late call (an output event
racing a timeout, a second `finish`) is ignored instead of corrupting the counts. A response ends
COMPLETE only when it was a 2xx that produced output; anything else that ends is FAILED, and a
request the client abandoned (or that timed out, or whose engine connection reset) is CANCELLED.

Each accepted call is forwarded synchronously to the model's stats (the `ModelSink`, implemented
by the aggregator): the Pylon is one trio loop, so there is no channel, and the router's next
heartbeat already counts the request (it drops its own reservation for it on that heartbeat).
"""

from __future__ import annotations

import enum
from typing import Final, Protocol

from stargate.pylon.stats.throughput import elapsed

__all__ = ["Endpoint", "ModelSink", "Phase", "RequestTracker"]


class Endpoint(enum.Enum):
    """The observed endpoints (every other path is forwarded unobserved)."""

    CHAT = "/v1/chat/completions"
    RESPONSES = "/v1/responses"
    EMBEDDINGS = "/v1/embeddings"


class Phase(enum.Enum):
    """Where a request is. The values order the live phases (terminal ones are >= 3)."""

    PENDING = 0  # admitted, no response head yet (Rust: UpstreamConnecting / Pending)
    INPUT_PROCESSING = 1  # response head received, no output yet
    OUTPUT_GENERATION = 2  # first output event seen
    COMPLETE = 3
    FAILED = 4
    CANCELLED = 5

    # Members are singletons: hashing by identity keeps the transition lookups at C speed
    # (Enum's own __hash__ is a Python function, and `output` runs once per streamed chunk).
    __hash__ = object.__hash__

    @property
    def terminal(self) -> bool:
        return self.value >= 3


class _Event(enum.Enum):
    __hash__ = object.__hash__

    HEADERS = "headers"
    OUTPUT = "output"
    FINISH_OK = "finish_ok"
    FINISH_FAILED = "finish_failed"
    CANCEL = "cancel"
    REJECT = "reject"


_P = Phase
_E = _Event
# (phase, event) -> next phase. Terminal phases have no entries: every later event is ignored.
_TRANSITIONS: Final[dict[tuple[Phase, _Event], Phase]] = {
    (_P.PENDING, _E.HEADERS): _P.INPUT_PROCESSING,
    (_P.PENDING, _E.OUTPUT): _P.OUTPUT_GENERATION,  # a head the caller did not report
    (_P.PENDING, _E.FINISH_OK): _P.FAILED,  # a 2xx without output is not a completion
    (_P.PENDING, _E.FINISH_FAILED): _P.FAILED,
    (_P.PENDING, _E.CANCEL): _P.CANCELLED,
    (_P.PENDING, _E.REJECT): _P.FAILED,
    (_P.INPUT_PROCESSING, _E.HEADERS): _P.INPUT_PROCESSING,
    (_P.INPUT_PROCESSING, _E.OUTPUT): _P.OUTPUT_GENERATION,
    (_P.INPUT_PROCESSING, _E.FINISH_OK): _P.FAILED,
    (_P.INPUT_PROCESSING, _E.FINISH_FAILED): _P.FAILED,
    (_P.INPUT_PROCESSING, _E.CANCEL): _P.CANCELLED,
    (_P.INPUT_PROCESSING, _E.REJECT): _P.FAILED,
    (_P.OUTPUT_GENERATION, _E.HEADERS): _P.OUTPUT_GENERATION,
    (_P.OUTPUT_GENERATION, _E.OUTPUT): _P.OUTPUT_GENERATION,
    (_P.OUTPUT_GENERATION, _E.FINISH_OK): _P.COMPLETE,
    (_P.OUTPUT_GENERATION, _E.FINISH_FAILED): _P.FAILED,
    (_P.OUTPUT_GENERATION, _E.CANCEL): _P.CANCELLED,
    (_P.OUTPUT_GENERATION, _E.REJECT): _P.FAILED,
}


class ModelSink(Protocol):
    """The model-level stats a tracker reports to (the aggregator's per-model state)."""

    def lifecycle(self, tracker: RequestTracker, old: Phase, now: float | None) -> None:
        """A head, an end or a rejection was recorded; `tracker.phase` is the new phase (maybe
        `old`). `now` is None only for a rejection."""

    def output_observed(self, tracker: RequestTracker, old: Phase, now: float) -> None:
        """One output event was recorded (`tracker.output_tokens` is the new count)."""


class RequestTracker:
    """One observed request (created only by `StatsAggregator.track`, which admits it PENDING).

    Durations are seconds since the accept instant (`accepted_at`), None until the event
    happened: `to_headers`, `to_first_output`, `to_first_token` (the first output event after
    which the request had a positive token count), `total` (set at the end; None after `reject`).
    `live_output_tps` is maintained by the aggregator (this request's current decode rate).
    """

    __slots__ = (
        "_last_explicit",
        "_sink",
        "accepted_at",
        "calibration",
        "endpoint",
        "explicit",
        "input_tokens",
        "live_output_tps",
        "model",
        "output_tokens",
        "phase",
        "priority",
        "rejected",
        "request_id",
        "streaming",
        "to_first_output",
        "to_first_token",
        "to_headers",
        "total",
    )

    def __init__(
        self,
        sink: ModelSink,
        *,
        request_id: str,
        model: str,
        endpoint: Endpoint,
        streaming: bool,
        input_tokens: int,
        priority: int,
        calibration: bool,
        accepted_at: float,
    ) -> None:
        self._sink = sink
        self.request_id = request_id
        self.model = model
        self.endpoint = endpoint
        self.streaming = streaming
        self.input_tokens = input_tokens
        self.priority = priority
        self.calibration = calibration
        self.accepted_at = accepted_at
        self.phase = Phase.PENDING
        self.output_tokens = 0
        self.explicit = False  # an explicit cumulative counter (SSE chunk usage) was seen
        self._last_explicit = -1
        self.rejected = False
        self.live_output_tps: float | None = None
        self.to_headers: float | None = None
        self.to_first_output: float | None = None
        self.to_first_token: float | None = None
        self.total: float | None = None

    def __repr__(self) -> str:
        return f"<RequestTracker {self.request_id} {self.model} {self.phase.name}>"

    @property
    def done(self) -> bool:
        """The request ended (COMPLETE, FAILED or CANCELLED): later calls are ignored."""
        return self.phase.terminal

    def headers(self, now: float) -> None:
        """The engine's response head arrived."""
        old = self.phase
        new = _TRANSITIONS.get((old, _Event.HEADERS))
        if new is None or self.to_headers is not None:
            return
        self.to_headers = elapsed(now, self.accepted_at)
        self.phase = new
        self._sink.lifecycle(self, old, now)

    def output(self, tokens: int, explicit: bool, now: float) -> None:
        """One output event was relayed; `tokens` is the request's cumulative output count after
        it, `explicit` whether that count is an engine counter (SSE chunk usage) rather than a
        text estimate. A regressing explicit counter keeps the previous count; once an explicit
        counter was seen, estimates are ignored."""
        old = self.phase
        new = _TRANSITIONS.get((old, _Event.OUTPUT))
        if new is None:
            return
        if tokens < 0:
            raise ValueError(f"output token count must not be negative, got {tokens}")
        since_accept = elapsed(now, self.accepted_at)
        if self.to_first_output is None:
            self.to_first_output = since_accept
        if explicit:
            if tokens >= self._last_explicit:
                self.output_tokens = self._last_explicit = tokens
                self.explicit = True
        elif not self.explicit:
            self.output_tokens = tokens
        if self.to_first_token is None and self.output_tokens > 0:
            self.to_first_token = since_accept
        self.phase = new
        self._sink.output_observed(self, old, now)

    def finish(self, ok: bool, now: float) -> None:
        """The response ended: COMPLETE when `ok` (a 2xx) and output was seen, else FAILED."""
        self._end(_Event.FINISH_OK if ok else _Event.FINISH_FAILED, now)

    def cancel(self, now: float) -> None:
        """The client went away, a timeout fired or the engine connection reset."""
        self._end(_Event.CANCEL, now)

    def reject(self) -> None:
        """Queue admission refused the request: it leaves the live queue at once and counts as
        failed, without any sample (it never reached the engine)."""
        old = self.phase
        new = _TRANSITIONS.get((old, _Event.REJECT))
        if new is None:
            return
        self.rejected = True
        self.phase = new
        self._sink.lifecycle(self, old, None)

    def owned_by(self, sink: ModelSink) -> bool:
        """Whether `sink` is the model state this request reports to (a model that left and came
        back is a new state: its old requests no longer count there)."""
        return self._sink is sink

    def _end(self, event: _Event, now: float) -> None:
        old = self.phase
        new = _TRANSITIONS.get((old, event))
        if new is None:
            return
        self.total = elapsed(now, self.accepted_at)
        self.phase = new
        self._sink.lifecycle(self, old, now)
