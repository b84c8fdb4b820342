"""`StatsAggregator`: the sampling rules and the `ModelStats` snapshot, as the Rust Pylon fills it.

Tests named after a Rust test port it with its numbers. The Rust tests feed the collector
`RequestObservation`s; here the same requests go through `RequestTracker` calls (admission,
head, output events, end), which is how the forwarding code reports them. Times are explicit
`now` values in seconds.
"""

from __future__ import annotations

import sys

import pytest

from stargate.pylon.stats.aggregator import StatsAggregator, StatsConfig
from stargate.pylon.stats.observer import Endpoint, RequestTracker
from stargate.routing.stats import ModelStats

MODEL = "model-a"
ENGINE = ("engine_stats_stream",)
MS = 0.001


class WallClock:
    """unix ms that advance on every read, so any state touch shows in the snapshot."""

    def __init__(self) -> None:
        self.now = 1_700_000_000_000

    def __call__(self) -> int:
        self.now += 1
        return self.now


def make(*models: str, **config: object) -> StatsAggregator:
    stats = StatsAggregator(StatsConfig(**config), WallClock())  # type: ignore[arg-type]
    stats.set_models(models or [MODEL])
    return stats


def snap(stats: StatsAggregator, model: str = MODEL) -> ModelStats:
    return stats.snapshot(model, 0.0)


def stream(
    stats: StatsAggregator,
    request_id: str,
    processed: int | None,
    generated: int | None,
    finished: bool,
    at: float,
    model: str = MODEL,
) -> None:
    stats.engine_counters(
        model=model,
        request_id=request_id,
        tokens_processed=processed,
        tokens_generated=generated,
        finished=finished,
        now=at,
    )


def track(
    stats: StatsAggregator,
    request_id: str,
    input_tokens: int,
    *,
    at: float = 0.0,
    priority: int = 0,
    endpoint: Endpoint = Endpoint.CHAT,
    streaming: bool = True,
    calibration: bool = False,
    model: str = MODEL,
) -> RequestTracker:
    return stats.track(
        model=model,
        request_id=request_id,
        endpoint=endpoint,
        streaming=streaming,
        input_tokens=input_tokens,
        priority=priority,
        now=at,
        calibration=calibration,
    )


def chat(
    stats: StatsAggregator,
    request_id: str,
    input_tokens: int,
    output_tokens: int,
    first_output: float,
    total: float,
    *,
    first_token: float | None = None,
    explicit: bool = False,
    ok: bool = True,
    start: float = 0.0,
    streaming: bool = True,
    calibration: bool = False,
) -> RequestTracker:
    """A chat request that completes (the Rust `completed_observation`: head at 20 ms, first
    output at `first_output`, tokens counted at `first_token`, end at `total`)."""
    tracker = track(
        stats, request_id, input_tokens, at=start, streaming=streaming, calibration=calibration
    )
    tracker.headers(start + min(20 * MS, first_output))
    if first_token is None or first_token == first_output:
        tracker.output(output_tokens, explicit, start + first_output)
    else:
        tracker.output(0, explicit, start + first_output)
        tracker.output(output_tokens, explicit, start + first_token)
    tracker.finish(ok, start + total)
    return tracker


def embeddings(
    stats: StatsAggregator,
    request_id: str,
    input_tokens: int,
    to_headers: float,
    total: float,
    *,
    ok: bool = True,
) -> RequestTracker:
    tracker = track(stats, request_id, input_tokens, endpoint=Endpoint.EMBEDDINGS, streaming=False)
    tracker.headers(to_headers)
    tracker.output(0, False, total)
    tracker.finish(ok, total)
    return tracker


def unlabeled(stats: ModelStats) -> bool:
    return stats.stats_capabilities == () and stats.stats_sources == ()


# ---- engine stats stream counters --------------------------------------------------------------


def test_stats_stream_cumulative_request_counters_drive_stats_aggregator() -> None:
    stats = make()
    stream(stats, "req-a", 0, 0, False, 0.0)
    stream(stats, "req-a", 10, 4, False, 0.1)
    s = snap(stats)
    assert (s.output_tps, s.max_output_tps, s.stats_sources) == (40.0, 40.0, ENGINE)
    for tick in range(2, 6):
        assert snap(stats).last_mean_input_tps == 0.0  # 1 to 4 samples: not published yet
        stream(stats, "req-a", tick * 10, 4, False, tick * 0.1)
    assert snap(stats).last_mean_input_tps == 100.0


def test_pinned_configured_input_tps_is_preserved_across_engine_stats_updates() -> None:
    stats = make(initial_input_tps=2200.0, pin_input_tps=True)
    stream(stats, "req-a", 0, 0, False, 0.0)
    assert snap(stats).last_mean_input_tps == 2200.0
    for tick in range(1, 6):
        stream(stats, "req-a", tick * 10, 0, False, tick * 0.1)
    assert snap(stats).last_mean_input_tps == 2200.0


def test_unpinned_configured_input_tps_moves_with_the_first_real_sample() -> None:
    stats = make(initial_input_tps=100.0)
    assert snap(stats).last_mean_input_tps == 100.0
    stream(stats, "req-a", 0, 0, False, 0.0)
    stream(stats, "req-a", 20, 0, False, 0.1)
    assert abs(snap(stats).last_mean_input_tps - 700.0 / 6.0) < sys.float_info.epsilon


def test_first_engine_stream_counter_without_zero_baseline_contributes_tps() -> None:
    stats = make(duration_floor_seconds=0.100)
    stream(stats, "req-first-output", 0, 10, True, 0.0)
    assert (snap(stats).output_tps, snap(stats).max_output_tps) == (100.0, 100.0)
    for index in range(5):
        stream(stats, f"req-first-input-{index}", 10, 0, True, index + 1.0)
    assert snap(stats).last_mean_input_tps == 100.0


def test_first_post_baseline_engine_stream_delta_under_floor_contributes_tps() -> None:
    stats = make(duration_floor_seconds=0.100)
    stream(stats, "req-fast", 0, 0, False, 0.0)
    assert (snap(stats).stats_sources, snap(stats).output_tps) == (ENGINE, 0.0)
    stream(stats, "req-fast", 0, 10, True, 1 * MS)
    assert (snap(stats).output_tps, snap(stats).max_output_tps) == (100.0, 100.0)


def test_engine_stream_sub_floor_deltas_accumulate_after_fast_first_sample() -> None:
    stats = make(duration_floor_seconds=0.010)
    stream(stats, "req-live", 0, 0, False, 0.0)
    stream(stats, "req-live", 0, 1, False, 1 * MS)
    assert (snap(stats).output_tps, snap(stats).max_output_tps) == (100.0, 100.0)
    for tick in range(2, 10):
        stream(stats, "req-live", 0, tick, False, tick * MS)
        assert (snap(stats).output_tps, snap(stats).max_output_tps) == (100.0, 100.0)
    stream(stats, "req-live", 0, 11, False, 11 * MS)
    assert (snap(stats).max_output_tps, snap(stats).output_tps) == (1000.0, 550.0)


def test_engine_stream_missing_counter_fields_do_not_sample_stale_dimensions() -> None:
    stats = make(duration_floor_seconds=0.010)
    stream(stats, "req-partial", None, 0, False, 0.0)
    stream(stats, "req-partial", None, 1, False, 1 * MS)
    assert snap(stats).output_tps == 100.0
    stream(stats, "req-partial", None, 2, False, 2 * MS)  # still under the floor
    stream(stats, "req-partial", 1, None, False, 11 * MS)  # input only
    assert (snap(stats).output_tps, snap(stats).max_output_tps) == (100.0, 100.0)


def test_engine_stream_sub_minimum_deltas_accumulate_until_publishable() -> None:
    stats = make(duration_floor_seconds=0.010, min_output_tokens=5)
    stream(stats, "req-min", 0, 0, False, 0.0)
    for tick in range(1, 10):
        stream(stats, "req-min", 0, tick, False, tick * MS)
        assert snap(stats).max_output_tps == 0.0
    stream(stats, "req-min", 0, 10, False, 10 * MS)
    assert (snap(stats).output_tps, snap(stats).max_output_tps) == (1000.0, 1000.0)


def test_fallback_and_stream_cumulative_counters_share_stats_math() -> None:
    """Output dimension only: SSE usage counters carry no processed-token count."""
    streamed, observed = make(), make()
    tracker = track(observed, "req-shared", 0)
    tracker.headers(0.0)
    for tick in range(6):
        stream(streamed, "req-shared", tick * 10, tick * 2, tick == 5, tick * 0.1)
        tracker.output(tick * 2, True, tick * 0.1)
        a, b = snap(streamed), snap(observed)
        assert (a.output_tps, a.max_output_tps) == (b.output_tps, b.max_output_tps)
    tracker.finish(True, 0.5)
    assert snap(observed).output_tps == snap(streamed).output_tps == 20.0


def test_request_counter_model_reset_finalizes_without_late_replay() -> None:
    """The Rust test ends the request with a fallback counter update; an engine finish here."""
    stats = make("model-a", "model-b")
    stream(stats, "req-reused", 0, 0, False, 0.0, model="model-a")
    assert stats.live_counter_count == 1
    stream(stats, "req-reused", 0, 0, False, 50 * MS, model="model-b")
    assert stats.live_counter_count == 1  # reset for model-b, not a second live request
    stream(stats, "req-reused", 10, 4, True, 150 * MS, model="model-b")
    b = snap(stats, "model-b")
    assert (b.output_tps, b.max_output_tps, b.stats_sources) == (40.0, 40.0, ENGINE)
    assert stats.live_counter_count == 0
    stream(stats, "req-reused", 10, 8, True, 200 * MS, model="model-b")
    assert snap(stats, "model-b") == b  # the late replay counted nothing
    assert stats.live_counter_count == 0
    assert snap(stats, "model-a").output_tps == 0.0


def test_stats_aggregator_ignores_regressions_and_post_finalize_events() -> None:
    stats = make()
    stream(stats, "req-final", 10, 2, False, 0.0)
    stream(stats, "req-final", 20, 4, True, 0.1)
    assert stats.live_counter_count == 0
    before = snap(stats)
    stream(stats, "req-final", 30, 8, False, 0.2)
    assert snap(stats) == before
    stream(stats, "req-live", 20, 4, False, 0.0)
    before = snap(stats)
    stream(stats, "req-live", 19, 5, False, 0.1)
    assert snap(stats) == before


def test_stats_aggregator_rejects_unconfigured_counter_models() -> None:
    stats = make()
    stream(stats, "req-unconfigured", 10, 4, False, 0.0, model="model-b")
    assert (stats.live_counter_count, stats.counter_identity_count) == (0, 0)
    assert snap(stats).stats_sources == ()
    with pytest.raises(KeyError):
        stats.snapshot("model-b", 0.0)


def test_stats_aggregator_sweeps_stale_request_and_model_state() -> None:
    stats = make(request_ttl_seconds=1.0, model_ttl_seconds=1.0)
    for tick in range(6):
        stream(stats, "req-stale", tick * 10, tick * 2, False, tick * 0.1)
    assert stats.live_counter_count == 1
    assert snap(stats).output_tps == 20.0
    stats.sweep(2.0)
    assert stats.live_counter_count == 0
    s = snap(stats)
    assert s.last_mean_input_tps == 100.0
    assert s.output_tps == 0.0
    assert s.max_output_tps == 20.0
    assert (s.queue_size, s.queued_input_size, s.num_running_queries) == (0, 0, 0)
    assert (s.input_processing_queries, s.output_generation_queries) == (0, 0)
    assert s.stats_sources == ENGINE


def test_stats_aggregator_tombstones_stale_request_before_late_finish() -> None:
    stats = make(request_ttl_seconds=1.0, model_ttl_seconds=60.0)
    stream(stats, "req-stale-late", 0, 0, False, 0.0)
    stream(stats, "req-stale-late", 100, 10, False, 0.1)
    assert stats.live_counter_count == 1
    stats.sweep(2.0)
    assert stats.live_counter_count == 0
    before = snap(stats)
    stream(stats, "req-stale-late", 100, 20, True, 2.1)
    assert snap(stats) == before  # not replayed from zero


def test_stats_aggregator_request_counter_identity_has_one_lifecycle_entry() -> None:
    stats = make(request_ttl_seconds=1.0)
    stream(stats, "req-lifecycle", 0, 0, False, 0.0)
    assert (stats.live_counter_count, stats.counter_identity_count) == (1, 1)
    stream(stats, "req-lifecycle", 10, 2, True, 0.1)
    assert (stats.live_counter_count, stats.counter_identity_count) == (0, 1)
    before = snap(stats)
    stream(stats, "req-lifecycle", 20, 4, True, 0.2)
    assert snap(stats) == before
    assert stats.counter_identity_count == 1
    stats.sweep(2.0)
    assert stats.counter_identity_count == 0


def test_repeated_request_finalization_refreshes_tombstone_expiry() -> None:
    stats = make(request_ttl_seconds=1.0)
    track(stats, "req-finalized-twice", 10, at=0.0).cancel(0.0)
    track(stats, "req-finalized-twice", 10, at=0.5).cancel(0.8)
    stats.sweep(1.5)
    stream(stats, "req-finalized-twice", 10, 2, True, 1.6)
    assert snap(stats).stats_sources == ()  # the late engine event was refused whole
    assert stats.counter_identity_count == 1
    stats.sweep(2.0)
    assert stats.counter_identity_count == 0


def test_stats_aggregator_keeps_bounded_request_state_for_many_cumulative_updates() -> None:
    requests, events = 256, 10_000
    stats = make()
    latest = [(0, 0)] * requests
    for index in range(events):
        request_index = index % requests
        step = index // requests + 1
        latest[request_index] = (step * 8, step)
        stream(stats, f"req-{request_index}", step * 8, step, False, index * MS)
    assert stats.live_counter_count == requests
    for request_index, (processed, generated) in enumerate(latest):
        stream(stats, f"req-{request_index}", processed, generated, True, 60 + request_index * MS)
    assert stats.live_counter_count == 0
    assert stats.counter_identity_count == requests


def test_stats_collector_accepts_late_stream_finish_after_terminal_observation() -> None:
    stats = make(fallback_from_start=False)
    stream(stats, "req-stream-race", 0, 0, False, 0.0)
    chat(stats, "req-stream-race", 32, 10, 50 * MS, 1.0)
    stream(stats, "req-stream-race", 0, 10, True, 1.0)
    assert (snap(stats).output_tps, snap(stats).max_output_tps) == (10.0, 10.0)


def test_fallback_terminal_observation_without_trusted_counters_finalizes_stream_request() -> None:
    stats = make()
    stream(stats, "req-stream-race", 5, 3, False, 0.0)
    assert stats.live_counter_count == 1
    chat(stats, "req-stream-race", 11, 10, 0.1, 1.0)
    assert stats.live_counter_count == 0
    assert snap(stats).stats_sources == ENGINE
    before = snap(stats)
    stream(stats, "req-stream-race", 11, 10, True, 0.1)
    assert snap(stats) == before  # finalized: no double count


# ---- OpenAI fallback: samples from observed requests ---------------------------------------------


def test_last_mean_input_tps_stays_sticky_without_new_samples() -> None:
    stats = make()
    for index in range(5):
        chat(stats, f"req-sticky-{index}", 20, 1, 2.0, 2.0)
    assert snap(stats).last_mean_input_tps == 10.0
    stats.sweep(10_000.0)  # long idle: no TTL touches the input mean
    assert snap(stats).last_mean_input_tps == 10.0


def test_fallback_input_throughput_is_owned_by_stats_aggregator() -> None:
    stats = make()
    published = []
    for index in range(5):
        chat(stats, f"req-openai-stream-{index}", 50, 8, 0.5, 1.0)
        published.append(snap(stats).last_mean_input_tps)
    assert published == [0.0, 0.0, 0.0, 0.0, 100.0]
    assert stats.input_tps(MODEL) == 100.0
    track(stats, "req-queued-after-fallback-samples", 32)
    assert snap(stats).queue_time_estimate_ms_by_priority == ((0, 320),)


def test_fallback_input_throughput_ignores_non_terminal_observations() -> None:
    stats = make()
    for index in range(5):
        tracker = track(stats, f"req-live-{index}", 50)
        tracker.headers(20 * MS)
        if index % 2:
            tracker.output(8, False, 0.5)
    assert snap(stats).last_mean_input_tps == 0.0
    # Had the five live requests sampled, the first completion would publish.
    for index in range(5):
        assert snap(stats).last_mean_input_tps == 0.0
        chat(stats, f"req-done-{index}", 50, 8, 0.5, 1.0)
    assert snap(stats).last_mean_input_tps == 100.0


def test_terminal_only_samples_use_request_duration_instead_of_tick_window() -> None:
    stats = make()
    for index in range(5):
        chat(stats, f"req-final-only-{index}", 100, 1, 2.0, 2.0)
    assert snap(stats).last_mean_input_tps == 50.0


def test_terminal_only_samples_do_not_sum_same_tick_request_rates() -> None:
    stats = make()
    for index in range(5):
        chat(stats, f"req-final-only-sequential-{index}", 100, 1, 10 * MS, 10 * MS)
    assert snap(stats).last_mean_input_tps == 10_000.0


def test_completed_request_stats_keep_exact_output_rate_formula() -> None:
    stats = make()
    chat(stats, "req-1", 120, 30, 3.0, 9.0)
    s = snap(stats)
    assert (s.last_mean_input_tps, s.output_tps, s.max_output_tps) == (0.0, 5.0, 5.0)


def test_ignores_observations_below_duration_floor() -> None:
    stats = make(duration_floor_seconds=0.050)
    chat(stats, "req-1", 20, 8, 10 * MS, 20 * MS)
    assert (snap(stats).last_mean_input_tps, snap(stats).output_tps) == (0.0, 0.0)


def test_terminal_usage_chunks_use_first_output_for_output_tps() -> None:
    stats = make()
    chat(stats, "req-1", 20, 8, 2.0, 6.0, first_token=5.995)
    assert (snap(stats).output_tps, snap(stats).max_output_tps) == (2.0, 2.0)


def test_ignores_non_complete_observations() -> None:
    stats = make()
    chat(stats, "req-1", 20, 8, 2.0, 6.0, ok=False)
    assert (snap(stats).last_mean_input_tps, snap(stats).output_tps) == (0.0, 0.0)
    cancelled = track(stats, "req-2", 20)
    cancelled.output(8, False, 2.0)
    cancelled.cancel(6.0)
    assert (snap(stats).last_mean_input_tps, snap(stats).output_tps) == (0.0, 0.0)


def test_embeddings_stats_update_last_mean_input_tps_without_claiming_output_tps() -> None:
    stats = make()
    for index in range(4):
        embeddings(stats, f"req-embedding-{index}", 20, 2.0, 4.0)
        assert snap(stats).last_mean_input_tps == 0.0
    embeddings(stats, "req-embedding-4", 20, 2.0, 4.0)
    s = snap(stats)
    assert (s.last_mean_input_tps, s.output_tps, s.max_output_tps) == (10.0, 0.0, 0.0)
    assert unlabeled(s)
    live_chat = track(stats, "req-live-chat", 10)
    live_chat.output(1, False, 1.0)
    live_chat.output(20, False, 3.0)
    assert snap(stats).output_tps == 10.0  # 20 tokens, 2 s since the first token


def test_fast_embeddings_input_samples_clamp_to_duration_floor() -> None:
    stats = make()
    for index in range(5):
        embeddings(stats, f"req-fast-embedding-{index}", 20, 1 * MS, 4 * MS)
    assert snap(stats).last_mean_input_tps == 2000.0


def test_embeddings_stats_do_not_replace_chat_output_tps() -> None:
    stats = make()
    chat(stats, "req-1", 20, 10, 1.0, 3.0)
    assert snap(stats).output_tps == 5.0
    embeddings(stats, "req-embedding", 20, 1.0, 2.0)
    s = snap(stats)
    assert (s.output_tps, s.max_output_tps) == (5.0, 5.0)
    assert unlabeled(s)


def test_embeddings_observations_do_not_add_output_throughput_labels() -> None:
    stats = make()
    chat(stats, "req-1", 20, 10, 1.0, 3.0)
    embeddings(stats, "req-embedding", 20, 1.0, 2.0, ok=False)
    assert snap(stats).output_tps == 5.0
    assert unlabeled(snap(stats))
    track(stats, "req-embedding-live", 20, endpoint=Endpoint.EMBEDDINGS, streaming=False)
    assert snap(stats).output_tps == 5.0
    assert unlabeled(snap(stats))


def test_publishes_live_queue_and_active_stats() -> None:
    """The Rust test gives the queue estimator a TPS of 100 directly; here it is the seed."""
    stats = make(initial_input_tps=100.0)
    tracker = track(stats, "req-live", 24, priority=2)
    tracker.headers(5 * MS)
    s = snap(stats)
    assert (s.queue_size, s.queued_input_size, s.num_running_queries) == (1, 24, 1)
    assert (s.total_query_input_size, s.input_processing_queries) == (24, 1)
    assert s.output_generation_queries == 0
    assert s.queue_time_estimate_ms_by_priority == ((0, 240),)

    tracker.output(8, False, 2.0)
    tracker.output(8, False, 3.0)
    s = snap(stats)
    assert (s.queue_size, s.queued_input_size, s.num_running_queries) == (0, 0, 1)
    assert (s.total_query_input_size, s.input_processing_queries) == (24, 0)
    assert (s.output_generation_queries, s.output_tps) == (1, 8.0)
    assert s.queue_time_estimate_ms_by_priority == ()


def test_live_stats_math_is_exact_for_simultaneous_queued_and_generating_requests() -> None:
    stats = make()
    track(stats, "req-queued", 30).headers(5 * MS)
    generating = track(stats, "req-generating", 20)
    generating.headers(5 * MS)
    generating.output(6, False, 2.0)
    generating.output(6, False, 5.0)
    s = snap(stats)
    assert (s.queue_size, s.queued_input_size, s.num_running_queries) == (1, 30, 2)
    assert (s.total_query_input_size, s.last_mean_input_tps, s.output_tps) == (50, 0.0, 2.0)


def test_live_input_processing_keeps_full_requested_input_without_retired_progress() -> None:
    stats = make()
    track(stats, "req-input-processing", 100).headers(2.0)
    s = snap(stats)
    assert (s.last_mean_input_tps, s.queued_input_size) == (0.0, 100)
    assert unlabeled(s)
    assert s.stats_observed_at_unix_ms > 0


def test_dirty_fallback_counter_snapshots_preserve_lifecycle_load() -> None:
    stats = make()
    tracker = track(stats, "req-fallback-live-load", 32)
    tracker.headers(10 * MS)
    tracker.output(2, True, 0.0)  # the first counter is a baseline
    assert snap(stats).output_tps == 0.0
    tracker.output(4, True, 0.1)
    s = snap(stats)
    assert (s.output_tps, s.num_running_queries, s.total_query_input_size) == (20.0, 1, 32)
    assert (s.input_processing_queries, s.output_generation_queries) == (0, 1)


def test_chunk_usage_observations_claim_only_chunk_usage_stats() -> None:
    stats = make()
    chat(stats, "req-1", 12, 7, 0.1, 0.5, explicit=True)
    s = snap(stats)
    assert s.stats_capabilities == ("request.output.chunk_usage",)
    assert s.stats_sources == ("chunk_usage",)


def test_quic_tunnel_feeds_chunk_usage_stats_into_stats_collector() -> None:
    stats = make()
    tracker = track(stats, "req-stream-stats", 17)
    tracker.headers(5 * MS)
    tracker.output(1, True, 10 * MS)
    tracker.output(2, True, 20 * MS)
    tracker.finish(True, 30 * MS)
    s = snap(stats)
    assert "request.output.chunk_usage" in s.stats_capabilities
    assert s.stats_observed_at_unix_ms > 0
    assert s.stats_sources == ("chunk_usage",)


def test_stats_collector_enables_openai_fallback_only_after_control_update() -> None:
    stats = make(fallback_from_start=False)
    assert not stats.fallback_enabled

    def trusted(request_id: str) -> None:
        chat(stats, request_id, 20, 10, 1.0, 3.0, first_token=3.0, explicit=True)

    trusted("req-fallback-disabled")
    s = snap(stats)
    assert s.output_tps == 0.0
    assert "chunk_usage" not in s.stats_sources
    stats.enable_fallback()
    assert stats.fallback_enabled
    trusted("req-fallback-enabled")
    s = snap(stats)
    assert s.output_tps == 5.0  # 10 usage tokens over the 2 s since the first output
    assert "chunk_usage" in s.stats_sources


def test_terminal_only_fallback_counter_does_not_clear_observed_output_tps() -> None:
    """Usage counters relayed before the fallback was on opened no counter: the completion then
    gives the request's one output sample, and its closing counter update takes nothing away."""
    stats = make(fallback_from_start=False)
    tracker = track(stats, "req-terminal-only-fallback", 20)
    tracker.headers(20 * MS)
    tracker.output(10, True, 1.0)
    stats.enable_fallback()
    tracker.finish(True, 3.0)
    s = snap(stats)
    assert (s.output_tps, s.max_output_tps) == (5.0, 5.0)
    assert s.stats_sources == ("chunk_usage",)
    assert stats.live_counter_count == 0


def test_stats_collector_keeps_lifecycle_load_when_fallback_stats_disabled() -> None:
    stats = make(fallback_from_start=False)
    stream(stats, "req-prior-stream", 0, 0, False, 0.0)
    stream(stats, "req-prior-stream", 0, 10, True, 1.0)
    track(stats, "req-stream-lifecycle", 32).headers(1.0)
    s = snap(stats)
    assert (s.num_running_queries, s.queue_size, s.queued_input_size) == (1, 1, 32)
    assert (s.total_query_input_size, s.input_processing_queries) == (32, 1)
    assert (s.output_generation_queries, s.output_tps) == (0, 10.0)


def test_stats_aggregator_owns_lifecycle_engine_and_kv_state() -> None:
    stats = make(fallback_from_start=False)
    track(stats, "req-single-owner-lifecycle", 32).output(2, True, 50 * MS)
    s = snap(stats)
    assert (s.num_running_queries, s.output_generation_queries) == (1, 1)
    assert stats.kv_cache(MODEL, 1000, 400, 600, source="kv_cache_stats")
    assert (snap(stats).num_running_queries, snap(stats).kv_cache_capacity_tokens) == (1, 1000)
    stream(stats, "req-single-owner-stream", 0, 0, False, 0.0)
    stream(stats, "req-single-owner-stream", 0, 10, True, 1.0)
    s = snap(stats)
    assert (s.output_tps, s.num_running_queries, s.output_generation_queries) == (10.0, 1, 1)
    assert s.kv_cache_capacity_tokens == 1000
    assert s.stats_sources == ("engine_stats_stream", "kv_cache_stats")


def test_stats_aggregator_keeps_embeddings_observation_with_stream_output_stats() -> None:
    stats = make(fallback_from_start=False)
    stream(stats, "req-stream", 0, 0, False, 0.0)
    stream(stats, "req-stream", 0, 10, True, 1.0)
    assert (snap(stats).output_tps, snap(stats).max_output_tps) == (10.0, 10.0)
    for index in range(5):
        embeddings(stats, f"req-embedding-{index}", 20, 1.0, 2.0)
    s = snap(stats)
    assert (s.output_tps, s.max_output_tps, s.last_mean_input_tps) == (10.0, 10.0, 0.0)
    assert s.stats_sources == ENGINE


def test_stream_mode_embeddings_do_not_double_count_stream_input_tps() -> None:
    stats = make(duration_floor_seconds=0.100, fallback_from_start=False)
    for index in range(5):
        stream(stats, f"req-stream-input-{index}", 10, 0, True, index + 1.0)
    assert snap(stats).last_mean_input_tps == 100.0
    for index in range(5):
        embeddings(stats, f"req-embedding-{index}", 20, 1.0, 2.0)
    assert snap(stats).last_mean_input_tps == 100.0


# ---- calibration and non-streaming requests ------------------------------------------------------


def test_exact_generation_snapshot_drains_already_observed_calibration_traffic() -> None:
    stats = make(duration_floor_seconds=0.0, fallback_from_start=False)
    for index in range(5):
        chat(stats, f"calibration-{index}", 100, 1, 1.0, 2.0, streaming=False, calibration=True)
    assert snap(stats).last_mean_input_tps > 0.0


def test_exact_generation_engine_events_seed_once_and_never_cross_retirement() -> None:
    stats = make(fallback_from_start=False)
    for index in range(4):
        request_id = f"calibration-run-g0-{index}"
        calibration = track(stats, request_id, 100, streaming=False, calibration=True)
        stream(stats, request_id, 0, 0, False, 0.0)  # the engine's echoes of our own request
        stream(stats, request_id, 100, 0, False, 1.0)
        stream(stats, request_id, 100, 0, False, 1.0)
        calibration.headers(1.0)
        calibration.output(1, False, 1.0)
        calibration.finish(True, 1.0)
    assert snap(stats).last_mean_input_tps == 0.0  # four samples: the echoes added none
    assert snap(stats).stats_sources == ()
    stream(stats, "finished-calibration", 0, 0, False, 0.0)
    stream(stats, "finished-calibration", 100, 0, True, 1.0)
    assert snap(stats).last_mean_input_tps == 100.0  # the fifth sample
    assert stats.live_counter_count == 0

    straggler = track(stats, "calibration-run-g0-9", 100, streaming=False, calibration=True)
    stats.set_models([])
    assert (stats.live_counter_count, stats.counter_identity_count) == (0, 0)
    stats.set_models([MODEL])
    straggler.output(1, False, 1.0)
    straggler.finish(True, 1.0)
    s = snap(stats)
    assert (s.last_mean_input_tps, s.num_running_queries, s.stats_sources) == (0.0, 0, ())
    assert stats.counter_identity_count == 0


def test_calibration_top_level_usage_does_not_claim_chunk_usage_stats() -> None:
    stats = make(duration_floor_seconds=0.0)
    chat(stats, "calibration-x", 256, 1, 0.5, 0.5, explicit=True, streaming=False, calibration=True)
    assert unlabeled(snap(stats))
    assert stats.counter_identity_count == 1  # a tombstone only: no usage counter was opened


def test_non_streaming_chat_requests_give_no_samples() -> None:
    stats = make()
    for index in range(5):
        chat(stats, f"req-{index}", 100, 20, 1.0, 1.0, explicit=True, streaming=False)
    s = snap(stats)
    assert (s.last_mean_input_tps, s.output_tps, s.max_output_tps) == (0.0, 0.0, 0.0)
    assert unlabeled(s)


# ---- output_tps = max(live decode mean, window mean) ---------------------------------------------


def test_counter_samples_silence_live_decode_rates_until_the_model_ttl_clears_them() -> None:
    stats = make(model_ttl_seconds=30.0)
    live = track(stats, "req-live", 10)
    live.output(1, False, 1.0)
    live.output(17, False, 3.0)
    assert snap(stats).output_tps == 8.5  # the live decode rate (A)
    stream(stats, "req-engine", 0, 0, False, 3.0)
    stream(stats, "req-engine", 0, 4, True, 4.0)
    assert snap(stats).output_tps == 4.0  # a counter sample exists: A is ignored
    observed_at = snap(stats).stats_observed_at_unix_ms
    stats.sweep(33.9)
    assert snap(stats).output_tps == 4.0
    stats.sweep(34.0)  # 30 s without a counter event
    s = snap(stats)
    assert s.output_tps == 8.5  # the window is gone, A is back
    assert s.max_output_tps == 4.0  # sticky, and only samples count (A is not one)
    assert s.stats_observed_at_unix_ms > observed_at
    observed_at = s.stats_observed_at_unix_ms
    stats.sweep(100.0)
    assert snap(stats).stats_observed_at_unix_ms == observed_at  # nothing left to clear


def test_live_decode_rates_are_only_kept_in_fallback_mode() -> None:
    stats = make(fallback_from_start=False)
    live = track(stats, "req-live", 10)
    live.output(1, False, 1.0)
    live.output(17, False, 3.0)
    assert snap(stats).output_tps == 0.0


# ---- KV cache, labels, observed-at, models ---------------------------------------------------


def test_snapshot_includes_polled_kv_cache_stats() -> None:
    stats = make()
    assert stats.kv_cache(MODEL, 1000, 400, 600, source="kv_cache_stats")
    s = snap(stats)
    assert (s.kv_cache_capacity_tokens, s.kv_cache_used_tokens, s.kv_cache_free_tokens) == (
        1000,
        400,
        600,
    )


def test_kv_cache_poll_updates_model_metrics() -> None:
    stats = make()
    stats.kv_cache(MODEL, 1000, 400, 600, source="kv_cache_stats")
    first = snap(stats)
    stats.kv_cache(MODEL, 1000, 999, 7, source="kv_cache_stats")  # verbatim, not checked
    s = snap(stats)
    assert (s.kv_cache_used_tokens, s.kv_cache_free_tokens) == (999, 7)
    assert s.stats_observed_at_unix_ms > first.stats_observed_at_unix_ms
    assert s.stats_capabilities == ("machine.kv_cache.http",)
    assert s.stats_sources == ("kv_cache_stats",)


def test_rejects_kv_cache_stats_for_unconfigured_models() -> None:
    stats = make()
    assert not stats.kv_cache("model-b", 1000, 400, 600, source="kv_cache_stats")
    assert snap(stats) == make().snapshot(MODEL, 0.0)
    with pytest.raises(ValueError, match="source"):
        stats.kv_cache(MODEL, 1, 1, 0, source="guess")


def test_engine_stream_snapshots_preserve_local_kv_cache_stats() -> None:
    stats = make()
    stats.kv_cache(MODEL, 1000, 400, 600, source="kv_cache_stats")
    stream(stats, "req-stream-kv", 0, 10, True, 0.0)
    s = snap(stats)
    assert (s.kv_cache_capacity_tokens, s.kv_cache_used_tokens, s.kv_cache_free_tokens) == (
        1000,
        400,
        600,
    )
    assert s.stats_capabilities == ("model.throughput.engine_stream", "machine.kv_cache.http")
    assert s.stats_sources == ("engine_stats_stream", "kv_cache_stats")


def test_labels_are_sticky_and_in_the_rust_order() -> None:
    stats = make()
    stats.kv_cache(MODEL, 10, 5, 5, source="engine_metrics")
    stats.kv_cache(MODEL, 10, 5, 5, source="kv_cache_stats")
    stream(stats, "req-1", 0, 1, True, 0.0)
    chat(stats, "req-2", 1, 2, 0.1, 0.2, explicit=True)
    s = snap(stats)
    assert s.stats_capabilities == (
        "request.output.chunk_usage",
        "model.throughput.engine_stream",
        "machine.kv_cache.http",
        "machine.kv_cache.prometheus",
    )
    assert s.stats_sources == (
        "chunk_usage",
        "engine_stats_stream",
        "kv_cache_stats",
        "engine_metrics",
    )
    stats.sweep(1000.0)
    assert snap(stats).stats_sources == s.stats_sources


def test_observed_at_is_zero_before_any_event_and_set_by_each_kind_of_event() -> None:
    stats = make(initial_input_tps=50.0)
    assert snap(stats).stats_observed_at_unix_ms == 0  # a seed is not an event
    readings = []
    track(stats, "req-1", 5)
    readings.append(snap(stats).stats_observed_at_unix_ms)
    stream(stats, "req-2", 0, 0, False, 0.0)  # a counter event without a sample
    readings.append(snap(stats).stats_observed_at_unix_ms)
    stats.kv_cache(MODEL, 1, 1, 0, source="kv_cache_stats")
    readings.append(snap(stats).stats_observed_at_unix_ms)
    assert 0 < readings[0] < readings[1] < readings[2]


def test_max_engine_concurrency_is_never_reported() -> None:
    stats = make()
    for index in range(3):
        track(stats, f"req-{index}", 10)
    assert snap(stats).max_engine_concurrency == 0


def test_input_tps_is_the_published_value_when_usable() -> None:
    stats = make()
    assert stats.input_tps(MODEL) is None
    assert stats.input_tps("model-b") is None
    assert make(initial_input_tps=25.0).input_tps(MODEL) == 25.0


def test_a_model_that_leaves_starts_over_as_a_new_seeded_generation() -> None:
    stats = make(initial_input_tps=100.0)
    stream(stats, "req-1", 0, 0, False, 0.0)
    stream(stats, "req-1", 50, 4, False, 0.1)
    stats.kv_cache(MODEL, 1000, 400, 600, source="kv_cache_stats")
    track(stats, "req-2", 10)
    stats.set_models(["model-b"])
    assert stats.models == frozenset({"model-b"})
    assert stats.live_counter_count == 0
    with pytest.raises(KeyError):
        stats.snapshot(MODEL, 0.0)
    stats.set_models(["model-b", MODEL])
    s = snap(stats)
    assert s == ModelStats(last_mean_input_tps=100.0)
    stats.set_models(["model-b", MODEL])  # unchanged models keep their state
    assert snap(stats) == s


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="pin_input_tps"):
        StatsConfig(pin_input_tps=True)
    with pytest.raises(ValueError, match="initial_input_tps"):
        StatsConfig(initial_input_tps=0.0)
    with pytest.raises(ValueError, match="duration_floor_seconds"):
        StatsConfig(duration_floor_seconds=-1.0)
    with pytest.raises(ValueError, match="negative"):
        StatsConfig(smoothing_window=-1)
