"""The mock engine: the trio side of the batching model (docs/mock-backend.md, "Batching").

`stargate.mock.scheduler.Scheduler` decides who runs; this module makes requests wait for those
decisions and reports what happens to them (the vLLM metrics of `stargate.mock.engine_metrics`
and the stats stream of `stargate.mock.stats_stream`). A request enters with
`with engine.sequence(info) as sequence:`, a context manager whose exit always takes it out
again, so a request cancelled anywhere (its client left while it waited, or mid-stream) can
never keep a slot or a KV reservation. Nothing here starts a task: a waiting request waits in
its own task on its own `trio.Event`, set by whichever task freed the room it needed.

Every request of the mock passes through here, so the per-request work is kept to a few plain
operations (a class, not a generator, as the context manager; no event unless one must wait).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import NamedTuple

import trio

from stargate.mock.engine_metrics import EngineState, ModelMetrics, render
from stargate.mock.scheduler import Scheduler
from stargate.mock.stats_stream import StatsHub, finished_line, stats_line

__all__ = ["Engine", "RunningSequence", "SequenceInfo"]


class SequenceInfo(NamedTuple):
    """What the engine knows of a request: who it is and the tokens it will hold (a named
    tuple: one is made per request, and a tuple is the cheapest immutable record)."""

    request_id: str
    model: str
    prompt_tokens: int
    output_tokens: int

    @property
    def kv_tokens(self) -> int:
        """Its KV reservation: the prompt and every token it will generate."""
        return self.prompt_tokens + self.output_tokens


class RunningSequence:
    """One request inside the engine: it arrives when its `with` block is entered and leaves
    when the block is left, however (see `Engine.sequence`).

    The request's task reports its progress (`prefilled`, `generated`, `finish`); each report
    updates the metrics and, when someone listens, the stats stream.
    """

    __slots__ = (
        "_admitted",
        "_closed",
        "_engine",
        "_event",
        "_generated",
        "_metrics",
        "arrived_at",
        "info",
        "ticket",
    )

    def __init__(self, engine: Engine, ticket: int, info: SequenceInfo) -> None:
        self._engine = engine
        self.ticket = ticket
        self.info = info
        self.arrived_at = 0.0
        self._metrics = engine.metrics[info.model]
        self._admitted = False
        self._event: trio.Event | None = None
        self._generated = 0
        self._closed = False

    def __enter__(self) -> RunningSequence:
        self._engine._arrive(self)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def admitted(self) -> bool:
        return self._admitted

    async def admission(self) -> None:
        """Wait until the engine gives this request a running slot (returns at once if it got
        one on arrival). Cancelling the wait is safe: leaving the context takes it out."""
        if self._admitted:
            return
        if self._event is None:
            self._event = trio.Event()
        await self._event.wait()

    def prefilled(self) -> None:
        """The prompt is processed and the first token is due now: the TTFT (from arrival, so
        queueing included, as vLLM measures it) and the prompt tokens are counted."""
        metrics, prompt = self._metrics, self.info.prompt_tokens
        metrics.ttft.observe(trio.current_time() - self.arrived_at)
        metrics.prompt_tokens += prompt
        metrics.prompt_lengths.observe(prompt)
        self._engine.publish_progress(self.info, prompt, 0)

    def generated(self, count: int) -> None:
        """`count` tokens have been generated so far."""
        self._metrics.generation_tokens += count - self._generated
        self._generated = count
        self._engine.publish_progress(self.info, self.info.prompt_tokens, count)

    def finish(self) -> None:
        """The generation is complete: count a success and free the slot at once (what is still
        sent after the last token holds no engine resources)."""
        if not self._closed:
            self._metrics.successes += 1
            self.close()

    def close(self) -> None:
        """Leave the engine, finished or not (idempotent; a sequence that never arrived, its
        `with` block not entered or refused, has nothing to leave)."""
        if self._closed or self.ticket not in self._engine._sequences:
            self._closed = True
            return
        self._closed = True
        self._engine._leave(self)

    def _admit(self, now: float) -> None:
        self._admitted = True
        self._metrics.queue_time.observe(now - self.arrived_at)
        if self._event is not None:
            self._event.set()


class Engine:
    """The running slots, the KV cache and the waiting queue of one mock process, shared by its
    models, with the per-model metrics and the stats stream's subscribers.

    `on_kv_change` is called after the KV reservations changed (only when the KV cache is
    bounded): the app fits its prefix cache into what the running sequences leave free.
    """

    def __init__(
        self,
        models: Sequence[str],
        *,
        max_num_seqs: int = 0,
        kv_cache_tokens: int = 0,
        stats: StatsHub | None = None,
        on_kv_change: Callable[[], None] | None = None,
    ) -> None:
        self.scheduler = Scheduler(max_num_seqs, kv_cache_tokens)
        self.metrics = {model: ModelMetrics() for model in models}
        self.stats = stats if stats is not None else StatsHub()
        self._sequences: dict[int, RunningSequence] = {}
        self._tickets = itertools.count(1)
        self._on_kv_change = on_kv_change if kv_cache_tokens else None

    # ---------------------------------------------------------------- requests

    def sequence(self, info: SequenceInfo) -> RunningSequence:
        """A request, for a `with` block: on entry it arrives (queued, or admitted at once;
        ValueError if it could never fit the KV cache), on exit it leaves, whatever happened,
        releasing its slot and KV reservation or its place in the queue."""
        return RunningSequence(self, next(self._tickets), info)

    def complete_at_once(self, info: SequenceInfo) -> bool:
        """For a generation that takes no time (no TTFT, no prefill, no decode delay): if it
        would be admitted the moment it arrives, live its whole life now (arrival, admission,
        prefill, every token, success) and return True; otherwise change nothing and return
        False (the caller then waits in a `sequence` as usual).

        This is the mock's hot path (the default settings), so with an unbounded KV cache it
        is the same bookkeeping as a `sequence` without the calls; with a bounded one the
        reservation still passes through the prefix cache's fitting, so it takes the long way.
        """
        prompt, output = info.prompt_tokens, info.output_tokens
        scheduler = self.scheduler
        if not scheduler.can_admit_now(prompt + output):
            return False
        if scheduler.kv_cache_tokens:
            with self.sequence(info) as sequence:
                sequence.prefilled()
                sequence.generated(output)
                sequence.finish()
            return True
        metrics = self.metrics[info.model]
        metrics.queue_time.observe(0.0)
        metrics.ttft.observe(0.0)
        metrics.prompt_lengths.observe(prompt)
        metrics.prompt_tokens += prompt
        metrics.generation_tokens += output
        metrics.successes += 1
        if self.stats.active:
            request_id, model, publish = info.request_id, info.model, self.stats.publish
            publish(stats_line(request_id, model, 0, 0))
            publish(stats_line(request_id, model, prompt, 0))
            publish(stats_line(request_id, model, prompt, output))
            publish(finished_line(request_id, model))
        return True

    def _arrive(self, sequence: RunningSequence) -> None:
        info = sequence.info
        admitted = self.scheduler.submit(sequence.ticket, info.kv_tokens)  # raises if too large
        now = trio.current_time()
        sequence.arrived_at = now
        self._sequences[sequence.ticket] = sequence
        self.publish_progress(info, 0, 0)
        if admitted:
            sequence._admit(now)
            self._kv_changed()

    def set_max_num_seqs(self, max_num_seqs: int) -> None:
        """Change the slot count at run time; more slots admit waiting requests at once."""
        if self._wake(self.scheduler.set_max_num_seqs(max_num_seqs)):
            self._kv_changed()

    def publish_progress(self, info: SequenceInfo, processed: int, generated: int) -> None:
        if self.stats.active:
            line = stats_line(info.request_id, info.model, processed, generated)
            self.stats.publish(line)

    def _leave(self, sequence: RunningSequence) -> None:
        del self._sequences[sequence.ticket]
        woken = self._wake(self.scheduler.leave(sequence.ticket))
        if woken or sequence.admitted:
            self._kv_changed()
        if self.stats.active:
            self.stats.publish(finished_line(sequence.info.request_id, sequence.info.model))

    def _wake(self, tickets: list[int]) -> bool:
        """Admit these (queued) requests; True if there were any."""
        if not tickets:
            return False
        now = trio.current_time()
        for ticket in tickets:
            self._sequences[ticket]._admit(now)
        return bool(tickets)

    def _kv_changed(self) -> None:
        if self._on_kv_change is not None:
            self._on_kv_change()

    # ---------------------------------------------------------------- observation

    @property
    def running(self) -> int:
        return self.scheduler.running

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting

    @property
    def kv_used(self) -> int:
        return self.scheduler.kv_used

    def state(self) -> EngineState:
        """The gauges now: per model (running, waiting), and the KV cache."""
        queues = dict.fromkeys(self.metrics, (0, 0))
        for sequence in self._sequences.values():
            running, waiting = queues[sequence.info.model]
            if sequence.admitted:
                queues[sequence.info.model] = (running + 1, waiting)
            else:
                queues[sequence.info.model] = (running, waiting + 1)
        return EngineState(queues, self.scheduler.kv_cache_tokens, self.scheduler.kv_used)

    def render_metrics(self) -> str:
        """The `/metrics` text (Prometheus, vLLM's names)."""
        return render(self.state(), self.metrics)
