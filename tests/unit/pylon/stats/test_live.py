"""One model's live requests: phase counts, prompt work by priority, queue estimates.

Tests named after a Rust test port it (same name, same numbers); the Rust request guard's
`on_backend_submission` is our move to INPUT_PROCESSING and `observe_output` the move to
OUTPUT_GENERATION.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from stargate.pylon.stats.live import LiveRequests, prompt_work, queue_time_ms
from stargate.pylon.stats.observer import Phase
from stargate.routing.stats import U64_MAX

P, IP, OG = Phase.PENDING, Phase.INPUT_PROCESSING, Phase.OUTPUT_GENERATION


@dataclass
class Request:
    phase: Phase
    priority: int
    input_tokens: int


# ---- the queue-time rule (Rust protocol common) ------------------------------------------------


def test_queue_time_delta_returns_zero_for_zero_input_tokens() -> None:
    assert queue_time_ms(0, 1.0) == 0
    assert queue_time_ms(0, math.nan) == 0


def test_queue_time_delta_rejects_invalid_throughput() -> None:
    for tps in [0.0, -1.0, math.nan, math.inf, -math.inf]:
        assert queue_time_ms(1, tps) is None


def test_queue_time_delta_rounds_up_fractional_milliseconds() -> None:
    assert queue_time_ms(1, 3.0) == 334


def test_queue_time_delta_returns_none_on_overflow() -> None:
    assert queue_time_ms(U64_MAX, sys.float_info.min) is None


# ---- prompt work -------------------------------------------------------------------------------


def test_prompt_work_is_pending_at_its_priority_and_input_processing_at_zero() -> None:
    assert prompt_work(P, 4, 30) == (4, 30)
    assert prompt_work(IP, 4, 30) == (0, 30)
    assert prompt_work(OG, 4, 30) is None
    assert prompt_work(P, 4, 0) is None
    assert prompt_work(Phase.COMPLETE, 4, 30) is None


# ---- LiveRequests (Rust queue_admission tests) -------------------------------------------------


def test_live_request_state_publishes_cumulative_priority_queue_estimates() -> None:
    live = LiveRequests()
    live.add(P, 2, 20)
    live.add(P, 4, 30)
    live.add(P, 1, 0)
    live.move(P, IP, 4, 30)  # req-p4 submitted
    assert live.queue_size == 3

    live.move(P, IP, 1, 0)  # req-zero submitted
    assert live.queue_size == 3
    assert live.queued_input_size == 50
    assert live.num_running_queries == 3
    assert live.queue_estimates(100.0) == {0: 300, 2: 500}

    live.remove(IP, 1, 0)
    assert live.queue_size == 2


def test_live_request_state_publishes_explicit_empty_priority_estimates_after_prompt_queue_drains() -> (  # noqa: E501
    None
):
    live = LiveRequests()
    live.add(P, 2, 20)
    assert live.queue_estimates(100.0) == {2: 200}
    assert live.queue_estimates(0.0) == {}  # no usable TPS: no map, whatever the work

    live.remove(P, 2, 20)
    assert live.queue_estimates(100.0) == {}
    assert live.prompt_work_by_priority == {}


def test_live_request_state_excludes_output_generation_and_drains_on_drop() -> None:
    live = LiveRequests()
    live.add(P, 2, 20)
    live.move(P, OG, 2, 20)
    assert (live.queue_size, live.queued_input_size, live.output_generation_queries) == (0, 0, 1)
    assert live.total_query_input_size == 20

    live.remove(OG, 2, 20)
    assert live.num_running_queries == 0
    assert live.total_query_input_size == 0


def test_backend_submission_does_not_apply_retired_progress_contract() -> None:
    live = LiveRequests()
    live.add(P, 0, 100)
    live.move(P, IP, 0, 100)
    assert live.queued_input_size == 100
    assert live.input_processing_queries == 1


def test_queue_model_state_saturates_unrepresentable_valid_throughput_estimates() -> None:
    live = LiveRequests()
    live.add(P, 0, U64_MAX)
    assert live.queue_estimates(sys.float_info.min) == {0: U64_MAX}
    incoming = Request(P, 0, 1)
    live.add(P, 0, 1)
    assert live.actual_queue_ms(incoming, sys.float_info.min) == U64_MAX


def test_queue_model_state_excludes_current_request_after_public_totals_saturate() -> None:
    live = LiveRequests()
    current = Request(P, 0, U64_MAX)
    live.add(P, 0, U64_MAX)
    live.add(P, 0, 1)
    assert live.queued_input_size == U64_MAX
    assert live.total_query_input_size == U64_MAX
    assert live.actual_queue_ms(current, 1.0) == 1000


def test_one_live_request_transition_updates_queue_and_active_output_load() -> None:
    live = LiveRequests()
    live.add(P, 0, 100)
    live.add(P, 0, 100)
    for rate in (20.0, 10.0):
        live.move(P, OG, 0, 100)
        live.set_active_output(None, rate)
    assert live.output_generation_queries == 2
    assert live.active_output_tps == 15.0

    live.remove(OG, 0, 100)
    live.set_active_output(20.0, None)
    assert live.output_generation_queries == 1
    assert live.active_output_tps == 10.0

    live.set_active_output(10.0, None)
    assert live.active_output_tps == 0.0


def test_admission_work_counts_only_priorities_up_to_the_request_own() -> None:
    live = LiveRequests()
    live.add(P, 0, 10)
    live.add(P, 3, 20)
    live.add(P, 7, 40)
    mine = Request(P, 3, 20)  # the second one
    # priorities <= 3: 10 + 20, minus its own 20 -> 10 tokens at 100 tok/s
    assert live.actual_queue_ms(mine, 100.0) == 100
    assert live.actual_queue_ms(Request(P, 7, 40), 100.0) == 300  # the third: 10 + 20
    assert live.actual_queue_ms(Request(OG, 7, 40), 100.0) == 700  # generating: none its own
    assert live.actual_queue_ms(mine, math.nan) is None


# ---- properties --------------------------------------------------------------------------------

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "advance", "remove"]),
        st.integers(0, 7),  # which request (by index modulo the live ones)
        st.integers(0, 5),  # priority
        st.integers(0, 1000),  # input tokens
    ),
    max_size=60,
)


def _recount(requests: list[Request]) -> dict[str, object]:
    work: dict[int, int] = {}
    for request in requests:
        found = prompt_work(request.phase, request.priority, request.input_tokens)
        if found is not None:
            work[found[0]] = work.get(found[0], 0) + found[1]
    return {
        "queue_size": sum(r.phase in (P, IP) for r in requests),
        "queued_input_size": sum(r.input_tokens for r in requests if r.phase in (P, IP)),
        "num_running_queries": len(requests),
        "total_query_input_size": sum(r.input_tokens for r in requests),
        "input_processing_queries": sum(r.phase is IP for r in requests),
        "output_generation_queries": sum(r.phase is OG for r in requests),
        "prompt_work_by_priority": work,
    }


def _counted(live: LiveRequests) -> dict[str, object]:
    return {name: getattr(live, name) for name in _recount([])}


@given(_OPS)
def test_the_incremental_sums_equal_a_recount_after_any_sequence(
    ops: list[tuple[str, int, int, int]],
) -> None:
    live = LiveRequests()
    requests: list[Request] = []
    for op, index, priority, tokens in ops:
        if op == "add" or not requests:
            requests.append(Request(P, priority, tokens))
            live.add(P, priority, tokens)
            continue
        request = requests[index % len(requests)]
        if op == "advance" and request.phase is not OG:
            new = IP if request.phase is P else OG
            live.move(request.phase, new, request.priority, request.input_tokens)
            request.phase = new
        elif op == "remove":
            live.remove(request.phase, request.priority, request.input_tokens)
            requests.remove(request)
        assert _counted(live) == _recount(requests)
    assert _counted(live) == _recount(requests)


@given(_OPS, st.floats(min_value=0.5, max_value=1e6))
def test_queue_estimates_grow_with_priority_and_match_admission(
    ops: list[tuple[str, int, int, int]], tps: float
) -> None:
    live = LiveRequests()
    requests: list[Request] = []
    for op, index, priority, tokens in ops:
        if op == "add" or not requests:
            requests.append(Request(P, priority, tokens))
            live.add(P, priority, tokens)
        elif op == "advance":
            request = requests[index % len(requests)]
            if request.phase is P:
                live.move(P, IP, request.priority, request.input_tokens)
                request.phase = IP
    estimates = live.queue_estimates(tps)
    assert list(estimates) == sorted(estimates)
    values = list(estimates.values())
    assert values == sorted(values)
    work = _recount(requests)["prompt_work_by_priority"]
    assert isinstance(work, dict)
    assert set(estimates) == set(work)
    # A newcomer (nothing of its own to exclude) waits for the estimate of the most urgent key at
    # or below its priority, 0 when there is none: the replica's reading of the map.
    for priority in range(7):
        below = [key for key in estimates if key <= priority]
        expected = estimates[max(below)] if below else 0
        assert live.actual_queue_ms(Request(P, priority, 0), tps) == expected
