"""Outlier ejection's rules (stargate/routing/outliers.py, docs/outliers.md), under a mock clock:
ejection after K consecutive failures, growing and capped intervals, decay, the max-percent cap
(at least one), success resetting, load signalling not counted, and the forwarder leaving an
ejected backend out of every decision (and taking it back when its time is up)."""

from __future__ import annotations

import pytest
from trio.testing import MockClock

from stargate.routing.outliers import (
    Ejection,
    EjectionPolicy,
    EjectionReason,
    OutlierDetector,
    Refusal,
    Result,
    Return,
    classify_response,
)

POLICY = EjectionPolicy(
    consecutive_failures=5,
    base_ejection=30.0,
    max_ejection=300.0,
    max_ejection_percent=10,
    decay_interval=10.0,
)
FLEET = 3  # backends registered: 10 % of 3 rounds down to 0, but one may always be ejected


def _fail(
    detector: OutlierDetector,
    clock: MockClock,
    backend: str,
    times: int,
    result: Result = Result.SERVER_ERROR,
    population: int = FLEET,
) -> list[Ejection | Refusal]:
    events = []
    for _ in range(times):
        event = detector.record(backend, result, clock.current_time(), population)
        if event is not None:
            events.append(event)
        clock.jump(0.01)
    return events


def _expire(detector: OutlierDetector, clock: MockClock) -> list[Return]:
    return detector.expire(clock.current_time())


def test_k_consecutive_5xx_eject_for_the_base_time_then_the_backend_returns() -> None:
    clock = MockClock()
    detector = OutlierDetector(POLICY)
    assert _fail(detector, clock, "a", 4) == []
    assert set(detector.ejected) == set()
    start = clock.current_time()
    (event,) = _fail(detector, clock, "a", 1)
    assert isinstance(event, Ejection)
    assert (event.backend_id, event.reason, event.consecutive) == (
        "a",
        EjectionReason.CONSECUTIVE_5XX,
        5,
    )
    assert (event.ejections, event.duration) == (1, 30.0)
    assert event.until == pytest.approx(start + 30.0)
    assert detector.any_ejected and set(detector.ejected) == {"a"}
    clock.jump(29.9)
    assert _expire(detector, clock) == [] and set(detector.ejected) == {"a"}
    clock.jump(0.2)
    (back,) = _expire(detector, clock)
    assert (back.backend_id, back.ejections) == ("a", 1)
    assert back.duration == pytest.approx(30.0)
    assert set(detector.ejected) == set()


def test_a_success_resets_the_consecutive_count() -> None:
    clock = MockClock()
    detector = OutlierDetector(POLICY)
    for _ in range(10):
        assert _fail(detector, clock, "a", 4) == []
        detector.record("a", Result.SUCCESS, clock.current_time(), FLEET)
    assert not detector.any_ejected
    assert list(detector) == []  # nothing left to remember: the record is dropped


def test_transport_failures_count_on_their_own_and_a_5xx_resets_them() -> None:
    clock = MockClock()
    detector = OutlierDetector(POLICY)
    assert _fail(detector, clock, "a", 4, Result.TRANSPORT_FAILURE) == []
    assert _fail(detector, clock, "a", 1) == []  # it answered: the connection count restarts
    assert _fail(detector, clock, "a", 4, Result.TRANSPORT_FAILURE) == []
    (event,) = _fail(detector, clock, "a", 1, Result.TRANSPORT_FAILURE)
    assert isinstance(event, Ejection)
    assert event.reason is EjectionReason.CONSECUTIVE_TRANSPORT_FAILURE


def test_retryable_load_signals_neither_count_nor_reset() -> None:
    assert classify_response(503, b"true", None) is Result.NEUTRAL
    assert classify_response(503, None, b" True ") is Result.NEUTRAL  # an engine without a Pylon
    assert classify_response(429, b"true", None) is Result.NEUTRAL
    assert classify_response(503, None, None) is Result.SERVER_ERROR  # a bare 503 is a failure
    assert classify_response(503, b"false", None) is Result.SERVER_ERROR
    assert classify_response(500, b"true", None) is Result.SERVER_ERROR  # only 429/503 signal
    assert classify_response(502, None, None) is Result.SERVER_ERROR
    assert classify_response(429, None, None) is Result.SUCCESS
    assert classify_response(404, None, None) is Result.SUCCESS
    assert classify_response(200, None, None) is Result.SUCCESS
    clock = MockClock()
    detector = OutlierDetector(POLICY)
    assert _fail(detector, clock, "a", 50, Result.NEUTRAL) == []
    assert _fail(detector, clock, "a", 4) == []
    assert _fail(detector, clock, "a", 3, Result.NEUTRAL) == []  # not a success either
    assert len(_fail(detector, clock, "a", 1)) == 1


def test_ejections_grow_with_their_number_and_are_capped_at_the_max() -> None:
    clock = MockClock()
    detector = OutlierDetector(POLICY)
    durations = []
    for _ in range(13):
        (event,) = _fail(detector, clock, "a", 5)
        assert isinstance(event, Ejection)
        durations.append(event.duration)
        clock.jump(event.duration)
        (back,) = _expire(detector, clock)
        assert back.backend_id == "a"
    assert durations == [30.0 * n for n in range(1, 11)] + [300.0] * 3


def test_failures_while_ejected_are_not_counted_again() -> None:
    clock = MockClock()
    detector = OutlierDetector(POLICY)
    assert len(_fail(detector, clock, "a", 5)) == 1
    # Answers to attempts sent before the ejection arrive now: no second ejection, no longer one.
    assert _fail(detector, clock, "a", 40) == []
    clock.jump(30)
    (back,) = _expire(detector, clock)
    assert back.ejections == 1
    # Back in rotation with a clean count: four failures are not enough.
    assert _fail(detector, clock, "a", 4) == []
    (event,) = _fail(detector, clock, "a", 1)
    assert isinstance(event, Ejection) and event.duration == 60.0


def test_the_ejection_count_decays_while_the_backend_stays_in_rotation() -> None:
    clock = MockClock()
    detector = OutlierDetector(POLICY)
    for expected in (30.0, 60.0, 90.0):
        (event,) = _fail(detector, clock, "a", 5)
        assert isinstance(event, Ejection) and event.duration == expected
        clock.jump(event.duration)
        _expire(detector, clock)
    assert detector.ejection_count("a", clock.current_time()) == 3
    clock.jump(10.5)  # one decay interval back in rotation
    assert detector.ejection_count("a", clock.current_time()) == 2
    (event,) = _fail(detector, clock, "a", 5)
    assert isinstance(event, Ejection) and (event.ejections, event.duration) == (3, 90.0)
    clock.jump(90)
    _expire(detector, clock)
    clock.jump(1000)  # healthy for long: back to the base time, and nothing is kept
    detector.record("a", Result.SUCCESS, clock.current_time(), FLEET)
    assert list(detector) == []
    (event,) = _fail(detector, clock, "a", 5)
    assert isinstance(event, Ejection) and (event.ejections, event.duration) == (1, 30.0)


def test_ejection_time_does_not_count_as_healthy_for_decay() -> None:
    clock = MockClock()
    detector = OutlierDetector(POLICY)
    assert len(_fail(detector, clock, "a", 5)) == 1
    clock.jump(25)  # still ejected: no decay
    assert detector.ejection_count("a", clock.current_time()) == 1
    clock.jump(5.5)
    _expire(detector, clock)
    clock.jump(9)  # back for 9 s of a 10 s interval
    assert detector.ejection_count("a", clock.current_time()) == 1
    clock.jump(1.5)
    assert detector.ejection_count("a", clock.current_time()) == 0


@pytest.mark.parametrize(
    ("population", "percent", "allowed"),
    [(3, 10, 1), (1, 10, 1), (10, 10, 1), (20, 10, 2), (29, 10, 2), (30, 10, 3), (4, 50, 2)],
)
def test_never_more_than_max_percent_are_ejected_but_at_least_one(
    population: int, percent: int, allowed: int
) -> None:
    policy = EjectionPolicy(consecutive_failures=5, max_ejection_percent=percent)
    assert policy.allowed(population) == allowed
    clock = MockClock()
    detector = OutlierDetector(policy)
    backends = [f"b{i}" for i in range(population)]
    ejected: list[str] = []
    refused: list[str] = []
    for backend in backends:  # every backend fails: a fleet-wide failure
        for event in _fail(detector, clock, backend, 5, population=population):
            (ejected if isinstance(event, Ejection) else refused).append(event.backend_id)
        assert len(detector.ejected) <= allowed
    assert len(ejected) == allowed and len(detector.ejected) == allowed
    assert refused == backends[allowed:]  # each refusal reported once per run of failures
    # More failures of the last one: ignored while ejected, or its refusal was reported already.
    assert _fail(detector, clock, backends[-1], 10, population=population) == []


def test_a_refused_backend_is_ejected_once_room_frees_up() -> None:
    clock = MockClock()
    detector = OutlierDetector(POLICY)
    assert isinstance(_fail(detector, clock, "a", 5)[0], Ejection)
    (refusal,) = _fail(detector, clock, "b", 5)
    assert isinstance(refusal, Refusal) and (refusal.ejected, refusal.allowed) == (1, 1)
    assert _fail(detector, clock, "b", 3) == []  # still over the threshold: not reported again
    clock.jump(30)
    (event,) = _fail(detector, clock, "b", 1)  # "a" returned on the way: room for "b"
    assert isinstance(event, Ejection) and event.backend_id == "b"
    assert set(detector.ejected) == {"b"}


def test_expiry_is_o1_until_the_earliest_ejection_ends() -> None:
    clock = MockClock()
    policy = EjectionPolicy(consecutive_failures=1, max_ejection_percent=100)
    detector = OutlierDetector(policy)
    _fail(detector, clock, "a", 1, population=10)
    clock.jump(10)
    _fail(detector, clock, "b", 1, population=10)
    clock.jump(20.5)
    assert [r.backend_id for r in _expire(detector, clock)] == ["a"]
    assert set(detector.ejected) == {"b"}
    clock.jump(10)
    assert [r.backend_id for r in _expire(detector, clock)] == ["b"]


def test_forget_drops_departed_backends_and_their_ejections() -> None:
    clock = MockClock()
    detector = OutlierDetector(POLICY)
    _fail(detector, clock, "gone", 5)
    _fail(detector, clock, "here", 2)
    dropped = detector.forget(lambda backend: backend == "here", clock.current_time())
    assert dropped == ["gone"] and not detector.any_ejected
    assert list(detector) == ["here"]
    assert _expire(detector, clock) == []


def test_off_means_never_ejected() -> None:
    clock = MockClock()
    detector = OutlierDetector(EjectionPolicy(consecutive_failures=0))
    assert _fail(detector, clock, "a", 100) == []
    assert _fail(detector, clock, "a", 100, Result.TRANSPORT_FAILURE) == []
    assert not detector.any_ejected and list(detector) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"consecutive_failures": -1},
        {"base_ejection": 0},
        {"decay_interval": 0},
        {"base_ejection": 30, "max_ejection": 10},
        {"max_ejection_percent": 101},
        {"max_ejection_percent": -1},
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        EjectionPolicy(**kwargs)  # type: ignore[arg-type]
