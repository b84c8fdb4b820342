"""The request phase machine (`RequestTracker`) and what each call does to the model's live load."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from stargate.pylon.stats.aggregator import StatsAggregator, StatsConfig
from stargate.pylon.stats.live import prompt_work
from stargate.pylon.stats.observer import Endpoint, Phase, RequestTracker

MODEL = "model-a"


class WallClock:
    """unix ms that advance on every read, so any state touch shows in the snapshot."""

    def __init__(self) -> None:
        self.now = 1_700_000_000_000

    def __call__(self) -> int:
        self.now += 1
        return self.now


def make_aggregator(**config: object) -> StatsAggregator:
    stats = StatsAggregator(StatsConfig(**config), WallClock())  # type: ignore[arg-type]
    stats.set_models([MODEL])
    return stats


def track(
    stats: StatsAggregator,
    request_id: str = "req-1",
    *,
    input_tokens: int = 32,
    priority: int = 0,
    now: float = 0.0,
    endpoint: Endpoint = Endpoint.CHAT,
    streaming: bool = True,
) -> RequestTracker:
    return stats.track(
        model=MODEL,
        request_id=request_id,
        endpoint=endpoint,
        streaming=streaming,
        input_tokens=input_tokens,
        priority=priority,
        now=now,
    )


def live_counts(stats: StatsAggregator) -> tuple[int, int, int, int, int]:
    s = stats.snapshot(MODEL, 0.0)
    return (
        s.queue_size,
        s.num_running_queries,
        s.input_processing_queries,
        s.output_generation_queries,
        s.queued_input_size,
    )


def test_the_endpoints_are_the_three_observed_paths() -> None:
    assert [e.value for e in Endpoint] == [
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/embeddings",
    ]


def test_a_streamed_request_moves_forward_through_every_phase() -> None:
    stats = make_aggregator()
    tracker = track(stats, now=10.0)
    assert tracker.phase is Phase.PENDING
    assert live_counts(stats) == (1, 1, 0, 0, 32)

    tracker.headers(10.25)
    assert tracker.phase is Phase.INPUT_PROCESSING
    assert tracker.to_headers == 0.25
    assert live_counts(stats) == (1, 1, 1, 0, 32)

    tracker.output(0, False, 10.5)  # a role-only chunk: output, but no token yet
    assert tracker.phase is Phase.OUTPUT_GENERATION
    assert (tracker.to_first_output, tracker.to_first_token) == (0.5, None)
    tracker.output(3, False, 10.75)
    assert tracker.to_first_token == 0.75
    assert tracker.output_tokens == 3
    assert live_counts(stats) == (0, 1, 0, 1, 0)

    tracker.finish(True, 12.0)
    assert tracker.phase is Phase.COMPLETE
    assert tracker.done
    assert tracker.total == 2.0
    assert live_counts(stats) == (0, 0, 0, 0, 0)


@pytest.mark.parametrize(
    ("steps", "phase"),
    [
        (["finish_ok"], Phase.FAILED),  # a 2xx without output is not a completion
        (["headers", "finish_ok"], Phase.FAILED),
        (["headers", "output", "finish_error"], Phase.FAILED),
        (["headers", "output", "finish_ok"], Phase.COMPLETE),
        (["output", "finish_ok"], Phase.COMPLETE),  # output without a reported head
        (["headers", "cancel"], Phase.CANCELLED),
        (["headers", "output", "cancel"], Phase.CANCELLED),
        (["reject"], Phase.FAILED),
    ],
)
def test_how_a_request_ends(steps: list[str], phase: Phase) -> None:
    stats = make_aggregator()
    tracker = track(stats)
    for step in steps:
        {
            "headers": lambda: tracker.headers(1.0),
            "output": lambda: tracker.output(1, False, 2.0),
            "finish_ok": lambda: tracker.finish(True, 3.0),
            "finish_error": lambda: tracker.finish(False, 3.0),
            "cancel": lambda: tracker.cancel(3.0),
            "reject": tracker.reject,
        }[step]()
    assert tracker.phase is phase
    assert tracker.done
    assert live_counts(stats) == (0, 0, 0, 0, 0)


def test_terminal_phases_are_final() -> None:
    stats = make_aggregator()
    tracker = track(stats)
    tracker.headers(1.0)
    tracker.cancel(2.0)
    before = stats.snapshot(MODEL, 3.0)
    tracker.output(5, True, 3.0)
    tracker.headers(3.0)
    tracker.finish(True, 3.0)
    tracker.reject()
    tracker.cancel(4.0)
    assert tracker.phase is Phase.CANCELLED
    assert (tracker.output_tokens, tracker.to_first_output, tracker.total) == (0, None, 2.0)
    assert stats.snapshot(MODEL, 4.0) == before  # not even the observed-at instant moved


def test_phases_never_move_back() -> None:
    stats = make_aggregator()
    tracker = track(stats)
    tracker.output(1, False, 1.0)
    tracker.headers(2.0)  # a late head report: recorded, the phase stays
    assert tracker.phase is Phase.OUTPUT_GENERATION
    assert tracker.to_headers == 2.0
    assert live_counts(stats) == (0, 1, 0, 1, 0)
    tracker.headers(3.0)
    assert tracker.to_headers == 2.0  # only the first head counts


def test_a_rejected_request_leaves_the_queue_at_once_without_an_end_time() -> None:
    stats = make_aggregator()
    tracker = track(stats, input_tokens=11)
    other = track(stats, "req-2", input_tokens=100)
    tracker.reject()
    assert (tracker.phase, tracker.rejected, tracker.total) == (Phase.FAILED, True, None)
    assert live_counts(stats) == (1, 1, 0, 0, 100)
    other.finish(False, 1.0)


def test_explicit_counters_win_over_estimates_and_never_regress() -> None:
    stats = make_aggregator()
    tracker = track(stats)
    tracker.output(4, False, 1.0)  # a text estimate
    tracker.output(2, True, 1.1)  # the engine's own count replaces it, even lower
    assert (tracker.output_tokens, tracker.explicit) == (2, True)
    tracker.output(9, False, 1.2)  # estimates stop once a counter was seen
    assert tracker.output_tokens == 2
    tracker.output(7, True, 1.3)
    tracker.output(5, True, 1.4)  # a regressing counter keeps the previous count
    assert tracker.output_tokens == 7


def test_a_negative_token_count_is_refused() -> None:
    tracker = track(make_aggregator())
    with pytest.raises(ValueError, match="negative"):
        tracker.output(-1, False, 1.0)


def test_track_refuses_unknown_models_and_negative_inputs() -> None:
    stats = make_aggregator()
    with pytest.raises(KeyError):
        stats.track(
            model="model-b",
            request_id="r",
            endpoint=Endpoint.CHAT,
            streaming=True,
            input_tokens=1,
            priority=0,
            now=0.0,
        )
    with pytest.raises(ValueError, match="negative"):
        track(stats, input_tokens=-1)
    assert live_counts(stats) == (0, 0, 0, 0, 0)


async def test_durations_follow_the_trio_clock(autojump_clock: trio.testing.MockClock) -> None:
    stats = make_aggregator()
    tracker = track(stats, now=trio.current_time())
    await trio.sleep(0.25)
    tracker.headers(trio.current_time())
    await trio.sleep(0.25)
    tracker.output(1, False, trio.current_time())
    await trio.sleep(1.5)
    tracker.finish(True, trio.current_time())
    assert (tracker.to_headers, tracker.to_first_output, tracker.total) == (0.25, 0.5, 2.0)


# ---- property: the incremental live state always equals a recount ---------------------------

_CALLS = st.lists(
    st.tuples(
        st.sampled_from(
            ["track", "headers", "output", "finish_ok", "finish_error", "cancel", "reject"]
        ),
        st.integers(0, 9),  # which tracker
        st.integers(0, 4),  # priority / tokens seed
        st.booleans(),  # explicit
    ),
    max_size=80,
)


@given(_CALLS, st.booleans())
def test_live_counts_always_equal_a_recount_from_the_trackers(
    calls: list[tuple[str, int, int, bool]], fallback: bool
) -> None:
    stats = make_aggregator(fallback_from_start=fallback, initial_input_tps=100.0)
    trackers: list[RequestTracker] = []
    now = 0.0
    for call, index, seed, explicit in calls:
        now += 0.004
        if call == "track" or not trackers:
            trackers.append(
                track(stats, f"req-{len(trackers)}", input_tokens=seed * 7, priority=seed, now=now)
            )
            continue
        tracker = trackers[index % len(trackers)]
        if call == "headers":
            tracker.headers(now)
        elif call == "output":
            tracker.output(tracker.output_tokens + seed, explicit, now)
        elif call == "finish_ok":
            tracker.finish(True, now)
        elif call == "finish_error":
            tracker.finish(False, now)
        elif call == "cancel":
            tracker.cancel(now)
        else:
            tracker.reject()
        live = [t for t in trackers if not t.done]
        snapshot = stats.snapshot(MODEL, now)
        queued = [t for t in live if t.phase in (Phase.PENDING, Phase.INPUT_PROCESSING)]
        assert snapshot.queue_size == len(queued)
        assert snapshot.queued_input_size == sum(t.input_tokens for t in queued)
        assert snapshot.num_running_queries == len(live)
        assert snapshot.total_query_input_size == sum(t.input_tokens for t in live)
        assert snapshot.input_processing_queries == sum(
            t.phase is Phase.INPUT_PROCESSING for t in live
        )
        assert snapshot.output_generation_queries == sum(
            t.phase is Phase.OUTPUT_GENERATION for t in live
        )
        work: dict[int, int] = {}
        for t in live:
            found = prompt_work(t.phase, t.priority, t.input_tokens)
            if found is not None:
                work[found[0]] = work.get(found[0], 0) + found[1]
        assert [key for key, _ in snapshot.queue_time_estimate_ms_by_priority] == sorted(work)
        rated = [t for t in live if t.live_output_tps is not None]
        assert all(t.phase is Phase.OUTPUT_GENERATION for t in rated)
        assert fallback or not rated  # live decode rates are only kept in fallback mode
