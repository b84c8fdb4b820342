"""Every admitted model's stats, and the `ModelStats` a heartbeat carries for it.

`StatsAggregator` owns, per model generation, the live requests (`live.py`), the input-TPS
distribution, the output window and the sticky labels, plus one table of per-request cumulative
counters shared by the two counter sources. It applies the Rust Pylon's sampling rules:

* Engine-stream mode (the engine serves the stats stream): engine counters (`engine_counters`)
  are the only throughput source; request observation only counts the live load.
* OpenAI fallback (`fallback_enabled`: from the start, or after the stream proved unsupported):
  input samples come from completed requests only: chat and responses give input tokens / time
  to first output (which includes the engine's queue wait and the upload, i.e. what a new
  request would see); embeddings give input tokens / time to the response head (at least the
  floor). Explicit SSE usage counters feed counter samples; a request without them gives one
  output sample at completion, output tokens / decode time.
* Calibration requests always use the fallback rules (their engine-stream echoes are ignored),
  so a calibration yields input samples in either mode.
* A non-streaming chat or responses request (the Rust Pylon refuses them; we forward them) gives
  no sample, except a calibration request's input sample (first output = the whole body).
* `output_tps` = max(A, B): B is the mean of the last 8 output samples; A, only in fallback and
  while no counter sample exists for the model, is the mean decode rate of the generating
  requests. `max_output_tps` is the largest output sample ever (sticky, like the input mean).

Nothing here does I/O or reads a clock: `now` is the caller's monotonic time in seconds (it must
not go backwards), and the wall clock for `stats_observed_at_unix_ms` is the injected `unix_ms`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from stargate.pylon.stats.live import LiveRequests
from stargate.pylon.stats.observer import Endpoint, Phase, RequestTracker
from stargate.pylon.stats.throughput import (
    DURATION_FLOOR_SECONDS,
    MIN_INPUT_TOKENS,
    MIN_OUTPUT_TOKENS,
    MODEL_TTL_SECONDS,
    REQUEST_TTL_SECONDS,
    SMOOTHING_WINDOW,
    CounterSampleState,
    OutputWindow,
    TpsDistribution,
    output_rate,
    tps_for_units,
    valid_tps,
)
from stargate.routing.stats import ModelStats

__all__ = [
    "CALIBRATION_ID_PREFIX",
    "CHUNK_USAGE_LABEL",
    "ENGINE_STREAM_LABEL",
    "KV_CACHE_LABELS",
    "StatsAggregator",
    "StatsConfig",
]

# (capability, source) pairs, sticky per model generation, published in this order.
CHUNK_USAGE_LABEL: Final = ("request.output.chunk_usage", "chunk_usage")
ENGINE_STREAM_LABEL: Final = ("model.throughput.engine_stream", "engine_stats_stream")
# KV source -> label: the Rust KV JSON endpoint, then (beyond Rust) the engine's Prometheus text.
KV_CACHE_LABELS: Final = {
    "kv_cache_stats": ("machine.kv_cache.http", "kv_cache_stats"),
    "engine_metrics": ("machine.kv_cache.prometheus", "engine_metrics"),
}
# The Pylon's own calibration requests: their engine-stream counters would count them twice.
CALIBRATION_ID_PREFIX: Final = "calibration-"


@dataclass(frozen=True, slots=True)
class StatsConfig:
    """The sampling rules' parameters (defaults: the Rust `StatsCollectorConfig::default`).

    `initial_input_tps` seeds every new model generation (published at once); `pin_input_tps`
    keeps the published value at the seed. `fallback_from_start` is False for the engine-stream
    modes auto and required: request observation then samples nothing until `enable_fallback`.
    A TTL of 0 disables that sweep.
    """

    smoothing_window: int = SMOOTHING_WINDOW
    min_input_tokens: int = MIN_INPUT_TOKENS
    min_output_tokens: int = MIN_OUTPUT_TOKENS
    duration_floor_seconds: float = DURATION_FLOOR_SECONDS
    request_ttl_seconds: float = REQUEST_TTL_SECONDS
    model_ttl_seconds: float = MODEL_TTL_SECONDS
    initial_input_tps: float | None = None
    pin_input_tps: bool = False
    fallback_from_start: bool = True

    def __post_init__(self) -> None:
        if self.smoothing_window < 0 or self.min_input_tokens < 0 or self.min_output_tokens < 0:
            raise ValueError("the smoothing window and token minimums must not be negative")
        for name in ("duration_floor_seconds", "request_ttl_seconds", "model_ttl_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} must be finite and >= 0, not {value!r}")
        if self.initial_input_tps is not None and not valid_tps(self.initial_input_tps):
            raise ValueError("initial_input_tps must be finite and positive")
        if self.pin_input_tps and self.initial_input_tps is None:
            raise ValueError("pin_input_tps requires initial_input_tps")


class _Counter:
    """One request id's counters: live (`input`/`output` set) or a finalization tombstone that
    keeps late events of the same generation from being counted again."""

    __slots__ = ("inputs", "model", "outputs", "stamp")

    def __init__(
        self,
        model: _Model,
        stamp: float,
        inputs: CounterSampleState | None = None,
        outputs: CounterSampleState | None = None,
    ) -> None:
        self.model = model
        self.stamp = stamp  # last event (live) or finalization (tombstone)
        self.inputs = inputs  # tokens processed
        self.outputs = outputs  # tokens generated


class _Model:
    """One model generation's stats; the `ModelSink` its trackers report to."""

    __slots__ = (
        "_agg",
        "chunk_usage",
        "counter_authoritative",
        "dist",
        "engine_stream",
        "kv",
        "kv_sources",
        "last_counter_event_at",
        "last_output_at",
        "live",
        "max_output_tps",
        "name",
        "observed_at_ms",
        "window",
    )

    def __init__(self, agg: StatsAggregator, name: str) -> None:
        config = agg.config
        self._agg = agg
        self.name = name
        self.live = LiveRequests()
        self.dist = (
            TpsDistribution()
            if config.initial_input_tps is None
            else TpsDistribution.seed(config.initial_input_tps, pin=config.pin_input_tps)
        )
        self.window = OutputWindow(config.smoothing_window)
        self.max_output_tps = 0.0
        # Counter samples own output_tps: live decode rates are then ignored (A in max(A, B)).
        self.counter_authoritative = False
        self.last_counter_event_at: float | None = None  # arms the model TTL
        self.last_output_at: float | None = None  # the last output event of any request
        self.observed_at_ms = 0
        self.chunk_usage = False
        self.engine_stream = False
        self.kv_sources: set[str] = set()
        self.kv = (0, 0, 0)

    def input_sample(self, rate: float) -> None:
        self.dist.update(rate)

    def output_sample(self, rate: float) -> None:
        self.max_output_tps = max(self.max_output_tps, rate)
        self.window.push(rate)

    # ModelSink

    def lifecycle(self, tracker: RequestTracker, old: Phase, now: float | None) -> None:
        new = tracker.phase
        if new is not old:
            if new.terminal:
                self.live.remove(old, tracker.priority, tracker.input_tokens)
                if tracker.live_output_tps is not None:
                    self.live.set_active_output(tracker.live_output_tps, None)
                    tracker.live_output_tps = None
            else:
                self.live.move(old, new, tracker.priority, tracker.input_tokens)
        agg = self._agg
        self.observed_at_ms = agg.unix_ms()
        if now is not None and new.terminal:
            agg._ended(self, tracker, now)

    def output_observed(self, tracker: RequestTracker, old: Phase, now: float) -> None:
        self.last_output_at = now
        if old is not Phase.OUTPUT_GENERATION:
            self.live.move(old, Phase.OUTPUT_GENERATION, tracker.priority, tracker.input_tokens)
        agg = self._agg
        fallback = agg._fallback
        if (
            tracker.streaming
            and tracker.endpoint is not Endpoint.EMBEDDINGS
            and (fallback or tracker.calibration)
        ):
            if fallback:
                config = agg.config
                rate = output_rate(
                    tracker.output_tokens,
                    now - tracker.accepted_at,
                    tracker.to_first_output,
                    tracker.to_first_token,
                    min_tokens=config.min_output_tokens,
                    floor=config.duration_floor_seconds,
                )
                if rate != tracker.live_output_tps:
                    self.live.set_active_output(tracker.live_output_tps, rate)
                    tracker.live_output_tps = rate
            if tracker.explicit:
                self.chunk_usage = True
                if agg._models.get(self.name) is self:
                    # also stamps the observed-at instant
                    agg._counter_event(
                        self, tracker.request_id, None, tracker.output_tokens, False, now, False
                    )
                    return
        self.observed_at_ms = agg.unix_ms()

    def actual_queue_ms(self, tracker: RequestTracker) -> int | None:
        return self.live.actual_queue_ms(tracker, self.dist.published)


class StatsAggregator:
    """The stats of every admitted model (see the module docstring for the rules)."""

    def __init__(self, config: StatsConfig, unix_ms: Callable[[], int]) -> None:
        self.config = config
        self.unix_ms = unix_ms
        self._fallback = config.fallback_from_start
        self._models: dict[str, _Model] = {}
        # request id -> counters, least recently touched first (so the sweep stops early).
        self._counters: OrderedDict[str, _Counter] = OrderedDict()
        self._live_counters = 0

    # Models

    @property
    def models(self) -> frozenset[str]:
        return frozenset(self._models)

    def set_models(self, models: Iterable[str]) -> None:
        """The admitted models. A model that leaves loses all its state (and its requests'
        counters); when it comes back it is a new generation, seeded again if so configured."""
        wanted = dict.fromkeys(models)
        for name in [name for name in self._models if name not in wanted]:
            retired = self._models.pop(name)
            for request_id in [r for r, c in self._counters.items() if c.model is retired]:
                if self._counters.pop(request_id).inputs is not None:
                    self._live_counters -= 1
        for name in wanted:
            if name not in self._models:
                self._models[name] = _Model(self, name)

    # Requests

    def track(
        self,
        *,
        model: str,
        request_id: str,
        endpoint: Endpoint,
        streaming: bool,
        input_tokens: int,
        priority: int,
        now: float,
        calibration: bool = False,
    ) -> RequestTracker:
        """Admit a request: it is PENDING (and counted) at once. KeyError for a model not in
        `set_models` (the caller forwards such requests unobserved)."""
        state = self._models[model]
        if input_tokens < 0 or priority < 0:
            raise ValueError("input tokens and priority must not be negative")
        tracker = RequestTracker(
            state,
            request_id=request_id,
            model=model,
            endpoint=endpoint,
            streaming=streaming,
            input_tokens=input_tokens,
            priority=priority,
            calibration=calibration,
            accepted_at=now,
        )
        state.live.add(Phase.PENDING, priority, input_tokens)
        state.observed_at_ms = self.unix_ms()
        return tracker

    def _ended(self, state: _Model, tracker: RequestTracker, now: float) -> None:
        """A request ended (not rejected): its fallback samples and its counters' finalization."""
        if not (self._fallback or tracker.calibration):
            return
        config = self.config
        floor = config.duration_floor_seconds
        chat = tracker.endpoint is not Endpoint.EMBEDDINGS
        streamed = chat and tracker.streaming
        counter = self._counters.get(tracker.request_id)
        counted = (
            streamed
            and tracker.explicit
            and counter is not None
            and counter.inputs is not None
            and counter.model is state
        )
        if tracker.phase is Phase.COMPLETE and tracker.total is not None:
            duration: float | None = None
            if not chat:
                head = tracker.to_headers
                duration = max(tracker.total if head is None else head, floor)
            elif tracker.streaming or tracker.calibration:
                duration = tracker.to_first_output
            if duration is not None and tracker.input_tokens >= config.min_input_tokens:
                rate = tps_for_units(tracker.input_tokens, duration, floor)
                if rate is not None:
                    state.input_sample(rate)
            if streamed and not counted:
                rate = output_rate(
                    tracker.output_tokens,
                    tracker.total,
                    tracker.to_first_output,
                    tracker.to_first_token,
                    min_tokens=config.min_output_tokens,
                    floor=floor,
                )
                if rate is not None:
                    state.output_sample(rate)
        if self._models.get(state.name) is not state:
            return  # a retired generation: its counters are gone
        if streamed and tracker.explicit:
            state.chunk_usage = True
            self._counter_event(
                state, tracker.request_id, None, tracker.output_tokens, True, now, False
            )
        else:
            self._finalize(state, tracker.request_id, now)

    # Counters

    @property
    def fallback_enabled(self) -> bool:
        return self._fallback

    def enable_fallback(self) -> None:
        """The engine stats stream is unsupported: observe requests instead, for good."""
        self._fallback = True

    @property
    def live_counter_count(self) -> int:
        """Requests with live cumulative counters (a Pylon metric)."""
        return self._live_counters

    @property
    def counter_identity_count(self) -> int:
        """Request ids remembered by the counter table, live or finalized."""
        return len(self._counters)

    def engine_counters(
        self,
        *,
        model: str,
        request_id: str,
        tokens_processed: int | None,
        tokens_generated: int | None,
        finished: bool,
        now: float,
    ) -> None:
        """One engine stats stream event: a request's cumulative counters (and its end).

        Ignored for calibration requests (observed already), for models not admitted, after the
        request's counters were finalized, and when a counter went backwards.
        """
        if request_id.startswith(CALIBRATION_ID_PREFIX):
            return
        state = self._models.get(model)
        if state is None:
            return
        self._counter_event(
            state, request_id, tokens_processed, tokens_generated, finished, now, True
        )

    def _counter_event(
        self,
        state: _Model,
        request_id: str,
        processed: int | None,
        generated: int | None,
        finished: bool,
        now: float,
        engine: bool,
    ) -> None:
        counters = self._counters
        counter = counters.get(request_id)
        config = self.config
        floor = config.duration_floor_seconds
        if counter is not None and counter.model is state:
            inputs, outputs = counter.inputs, counter.outputs
            if inputs is None or outputs is None:
                return  # finalized: a late or replayed event would count twice
            if inputs.regressed(processed) or outputs.regressed(generated):
                return
            input_rate = inputs.observe(processed, now, config.min_input_tokens, floor)
            output_rate_ = outputs.observe(generated, now, config.min_output_tokens, floor)
            if finished:
                counter.inputs = counter.outputs = None
                self._live_counters -= 1
            counter.stamp = now
        else:  # new, reused by another model (reset), or finalized by another generation
            was_live = counter is not None and counter.inputs is not None
            inputs = CounterSampleState(0 if engine or processed is None else processed, now)
            outputs = CounterSampleState(0 if engine or generated is None else generated, now)
            input_rate = inputs.observe(processed, now, config.min_input_tokens, floor)
            output_rate_ = outputs.observe(generated, now, config.min_output_tokens, floor)
            if finished:
                counters[request_id] = _Counter(state, now)
                self._live_counters -= was_live
            else:
                counters[request_id] = _Counter(state, now, inputs, outputs)
                self._live_counters += not was_live
        counters.move_to_end(request_id)
        state.last_counter_event_at = now
        state.observed_at_ms = self.unix_ms()
        if engine:
            state.engine_stream = True
        if input_rate is not None:
            state.input_sample(input_rate)
        if output_rate_ is not None:
            state.counter_authoritative = True
            state.output_sample(output_rate_)

    def _finalize(self, state: _Model, request_id: str, now: float) -> None:
        """A request ended without an explicit counter: tombstone its id so the engine stream
        cannot count it afterwards, closing its live engine counters if any."""
        counter = self._counters.get(request_id)
        live = counter is not None and counter.inputs is not None
        if live and counter is not None and counter.model is not state:
            return  # the id is live for another model: not ours to close
        self._counters[request_id] = _Counter(state, now)
        self._counters.move_to_end(request_id)
        if live:
            self._live_counters -= 1
            state.observed_at_ms = self.unix_ms()

    # Side channels and upkeep

    def kv_cache(self, model: str, capacity: int, used: int, free: int, *, source: str) -> bool:
        """KV-cache figures for `model`, kept verbatim until the next update; False (ignored)
        for a model not admitted. `source` is "kv_cache_stats" (the engine's KV JSON endpoint)
        or "engine_metrics" (its Prometheus metrics)."""
        if source not in KV_CACHE_LABELS:
            raise ValueError(f"unknown KV-cache source {source!r}")
        state = self._models.get(model)
        if state is None:
            return False
        state.kv = (capacity, used, free)
        state.kv_sources.add(source)
        state.observed_at_ms = self.unix_ms()
        return True

    def sweep(self, now: float) -> None:
        """The stale sweep (every second): live counters silent for the request TTL are
        finalized and tombstones older than it forgotten; a model whose counters have been
        silent for the model TTL loses its output window (the input mean and the max stay)."""
        request_ttl = self.config.request_ttl_seconds
        counters = self._counters
        if request_ttl > 0:
            while counters:
                request_id, counter = next(iter(counters.items()))
                if now - counter.stamp < request_ttl:
                    break
                if counter.inputs is None:
                    del counters[request_id]
                else:
                    counters[request_id] = _Counter(counter.model, now)
                    counters.move_to_end(request_id)
                    self._live_counters -= 1
        model_ttl = self.config.model_ttl_seconds
        if model_ttl > 0:
            for state in self._models.values():
                last = state.last_counter_event_at
                if last is None or now - last < model_ttl:
                    continue
                state.last_counter_event_at = None
                if state.window.clear():
                    state.counter_authoritative = False
                    state.observed_at_ms = self.unix_ms()

    # Reading

    def last_output_at(self, model: str) -> float | None:
        """When a request of `model` last produced output (None: never, or an unknown model):
        evidence that the model works, which a canary need not repeat."""
        state = self._models.get(model)
        return None if state is None else state.last_output_at

    def input_tps(self, model: str) -> float | None:
        """The published input TPS when usable (for queue admission), else None."""
        state = self._models.get(model)
        if state is None:
            return None
        tps = state.dist.published
        return tps if valid_tps(tps) else None

    def actual_queue_ms(self, tracker: RequestTracker) -> int | None:
        """The local queue time ahead of `tracker` (its own prompt work excluded), for queue
        admission; None without a usable input TPS or when its model generation was retired."""
        state = self._models.get(tracker.model)
        if state is None or not tracker.owned_by(state):
            return None
        return state.actual_queue_ms(tracker)

    def snapshot(self, model: str, now: float) -> ModelStats:
        """`model`'s stats as the Rust Pylon fills them. KeyError for a model not admitted.

        No field depends on the reading instant (a generating request's decode rate is the one
        of its last event, as in Rust); `now` is taken for symmetry with every other call.
        """
        state = self._models[model]
        live = state.live
        tps = state.dist.published
        active = 0.0 if state.counter_authoritative else live.active_output_tps
        labels: list[tuple[str, str]] = []
        if state.chunk_usage:
            labels.append(CHUNK_USAGE_LABEL)
        if state.engine_stream:
            labels.append(ENGINE_STREAM_LABEL)
        labels.extend(label for src, label in KV_CACHE_LABELS.items() if src in state.kv_sources)
        capacity, used, free = state.kv
        return ModelStats(
            last_mean_input_tps=tps,
            output_tps=max(active, state.window.mean),
            queue_size=live.queue_size,
            queued_input_size=live.queued_input_size,
            max_output_tps=state.max_output_tps,
            kv_cache_capacity_tokens=capacity,
            kv_cache_used_tokens=used,
            kv_cache_free_tokens=free,
            num_running_queries=live.num_running_queries,
            max_engine_concurrency=0,
            total_query_input_size=live.total_query_input_size,
            queue_time_estimate_ms_by_priority=tuple(live.queue_estimates(tps).items()),
            input_processing_queries=live.input_processing_queries,
            output_generation_queries=live.output_generation_queries,
            stats_observed_at_unix_ms=state.observed_at_ms,
            stats_capabilities=tuple(capability for capability, _ in labels),
            stats_sources=tuple(source for _, source in labels),
        )
