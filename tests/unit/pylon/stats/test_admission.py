"""Queue admission (the 429 `queue_estimate_mismatch`) and the problem-details answers.

Tests named after a Rust test port it with its numbers.
"""

from __future__ import annotations

import json
import math

import pytest

from stargate.pylon.stats.admission import (
    AdmissionConfig,
    QueueMismatch,
    evaluate,
    mismatch_response,
    mismatch_threshold_ms,
    parse_expected_queue_ms,
)
from stargate.pylon.stats.aggregator import StatsAggregator, StatsConfig
from stargate.pylon.stats.observer import Endpoint, RequestTracker
from stargate.pylon.stats.problems import problem
from stargate.routing.stats import U64_MAX

MODEL = "model-a"


def make(initial_input_tps: float | None = None) -> StatsAggregator:
    stats = StatsAggregator(StatsConfig(initial_input_tps=initial_input_tps), lambda: 1)
    stats.set_models([MODEL])
    return stats


def track(
    stats: StatsAggregator, request_id: str, input_tokens: int, priority: int = 0
) -> RequestTracker:
    return stats.track(
        model=MODEL,
        request_id=request_id,
        endpoint=Endpoint.CHAT,
        streaming=True,
        input_tokens=input_tokens,
        priority=priority,
        now=0.0,
    )


DEFAULT = AdmissionConfig()


def test_threshold_helper_accepts_at_threshold_and_rejects_above() -> None:
    threshold = mismatch_threshold_ms(100, 25, 1.25)
    assert threshold == 125
    assert threshold < 126
    assert threshold >= 125
    assert mismatch_threshold_ms(0, 25, 1.25) == 25
    assert mismatch_threshold_ms(U64_MAX, 25, 1.25) == U64_MAX
    assert mismatch_threshold_ms(100, 25, math.nan) == 125
    assert mismatch_threshold_ms(1000, 25, 1.25) == 1250  # the factor wins above 100 ms


def test_admission_transitions_from_unknown_to_rejected_after_throughput_update() -> None:
    stats = make()
    track(stats, "req-inflight", 100)
    incoming = track(stats, "req-new", 1)
    assert evaluate(stats, incoming, 0, DEFAULT) is None  # no local TPS: unknown, accepted
    # Five input samples of 100 tok/s from the engine stream publish a TPS of 100.
    stats.engine_counters(
        model=MODEL,
        request_id="req-engine",
        tokens_processed=0,
        tokens_generated=0,
        finished=False,
        now=0.0,
    )
    for tick in range(1, 6):
        stats.engine_counters(
            model=MODEL,
            request_id="req-engine",
            tokens_processed=tick * 10,
            tokens_generated=None,
            finished=False,
            now=tick * 0.1,
        )
    assert stats.input_tps(MODEL) == 100.0
    assert evaluate(stats, incoming, 0, DEFAULT) == QueueMismatch(0, 1000, 25)


def test_admission_accepts_missing_or_invalid_expected_queue_header() -> None:
    stats = make(initial_input_tps=100.0)
    track(stats, "req-inflight", 100)
    incoming = track(stats, "req-new", 1)
    for raw in [None, b"nope"]:
        expected = parse_expected_queue_ms(raw)
        assert expected is None
        assert evaluate(stats, incoming, expected, DEFAULT) is None
    assert evaluate(stats, incoming, parse_expected_queue_ms(b"0"), DEFAULT) is not None


def test_admission_excludes_current_request_even_when_observed_before_evaluation() -> None:
    stats = make(initial_input_tps=100.0)
    current = track(stats, "req-current", 10)
    assert stats.actual_queue_ms(current) == 0
    assert evaluate(stats, current, 0, DEFAULT) is None


def test_disabled_admission_accepts_with_distinct_metric_label() -> None:
    stats = make(initial_input_tps=100.0)
    track(stats, "req-inflight", 100)
    incoming = track(stats, "req-new", 1)
    assert evaluate(stats, incoming, 0, AdmissionConfig(enabled=False)) is None
    assert evaluate(stats, incoming, 0, DEFAULT) is not None


def test_queue_model_state_excludes_current_request_after_public_totals_saturate() -> None:
    stats = make(initial_input_tps=1.0)
    current = track(stats, "req-current-huge", U64_MAX)
    track(stats, "req-other", 1)
    assert stats.snapshot(MODEL, 0.0).queued_input_size == U64_MAX
    assert evaluate(stats, current, 0, DEFAULT) == QueueMismatch(0, 1000, 25)


def test_admission_counts_only_work_at_the_request_priority_or_more_urgent() -> None:
    stats = make(initial_input_tps=100.0)
    track(stats, "req-urgent", 10, priority=1)
    track(stats, "req-lazy", 90, priority=9)
    incoming = track(stats, "req-new", 5, priority=4)
    assert stats.actual_queue_ms(incoming) == 100  # 10 tokens at priority <= 4
    # Once submitted, prompt work counts at priority 0: it blocks everyone.
    lazy_submitted = track(stats, "req-lazy-2", 50, priority=9)
    lazy_submitted.headers(0.1)
    assert stats.actual_queue_ms(incoming) == 600
    assert evaluate(stats, incoming, 500, DEFAULT) is None  # threshold 625
    assert evaluate(stats, incoming, 400, DEFAULT) == QueueMismatch(400, 600, 500)


def test_a_request_of_a_retired_model_generation_has_no_local_estimate() -> None:
    stats = make(initial_input_tps=100.0)
    track(stats, "req-inflight", 100)
    stale = track(stats, "req-stale", 1)
    stats.set_models([])
    stats.set_models([MODEL])
    assert stats.actual_queue_ms(stale) is None
    assert evaluate(stats, stale, 0, DEFAULT) is None


def test_quic_tunnel_rejects_queue_estimate_mismatch_before_upstream() -> None:
    stats = make(initial_input_tps=100.0)
    track(stats, "req-already-queued", 100)
    incoming = track(stats, "req-queue-mismatch", 11)
    config = AdmissionConfig(retry_after_ms=125)
    mismatch = evaluate(stats, incoming, parse_expected_queue_ms(b"0"), config)
    assert mismatch == QueueMismatch(expected_ms=0, actual_ms=1000, threshold_ms=25)

    status, headers, body = mismatch_response(mismatch, config)
    incoming.reject()
    assert status == 429
    assert headers == [
        (b"content-type", b"application/problem+json"),
        (b"x-stargate-retryable", b"true"),
        (b"x-stargate-retry-reason", b"queue_estimate_mismatch"),
        (b"x-stargate-retry-after-ms", b"125"),
    ]
    assert json.loads(body) == {
        "type": "about:blank",
        "title": "Too Many Requests",
        "status": 429,
        "detail": "local queue estimate exceeded Stargate routing estimate",
        "reason": "queue_estimate_mismatch",
        "expected_queue_ms": 0,
        "actual_queue_ms": 1000,
        "threshold_ms": 25,
    }
    # The rejected request does not leak into the queue.
    snapshot = stats.snapshot(MODEL, 0.0)
    assert (snapshot.num_running_queries, snapshot.queued_input_size) == (1, 100)


def test_the_retry_after_header_is_sent_only_when_configured() -> None:
    _, headers, _ = mismatch_response(QueueMismatch(1, 2, 3), DEFAULT)
    assert [name for name, _ in headers] == [
        b"content-type",
        b"x-stargate-retryable",
        b"x-stargate-retry-reason",
    ]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"0", 0),
        (b" 42\t", 42),
        (b"+7", 7),
        (b"007", 7),
        (str(U64_MAX).encode(), U64_MAX),
        (str(U64_MAX + 1).encode(), None),
        (b"", None),
        (b"+", None),
        (b"-1", None),
        (b"1_000", None),
        (b"1.5", None),
        ("\u0661".encode(), None),  # an Arabic-Indic digit: Python's int() would take it
        (b"9" * 5000, None),
    ],
)
def test_the_expected_queue_header_is_read_as_rust_reads_a_u64(
    raw: bytes, expected: int | None
) -> None:
    assert parse_expected_queue_ms(raw) == expected


def test_admission_config_validation() -> None:
    assert AdmissionConfig(True, 25, 1.25, None) == DEFAULT
    for bad in [
        {"tolerance_factor": 0.0},
        {"tolerance_factor": math.inf},
        {"min_delta_ms": -1},
        {"retry_after_ms": -5},
    ]:
        with pytest.raises(ValueError, match="must"):
            AdmissionConfig(**bad)  # type: ignore[arg-type]


def test_problem_answers_are_compact_problem_json() -> None:
    status, headers, body = problem(
        503,
        "Service Unavailable",
        "model é is not admitted yet",
        [(b"x-stargate-retryable", b"true")],
    )
    assert status == 503
    assert headers == [
        (b"content-type", b"application/problem+json"),
        (b"x-stargate-retryable", b"true"),
    ]
    assert (
        body
        == (
            '{"type":"about:blank","title":"Service Unavailable","status":503,'
            '"detail":"model é is not admitted yet"}'
        ).encode()
    )
    assert problem(400, "Bad Request", "x")[1] == [(b"content-type", b"application/problem+json")]
