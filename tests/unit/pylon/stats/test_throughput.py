"""The throughput arithmetic: input-TPS distribution, counter sampling, the output window.

Tests named after a Rust test port it (same name, same numbers).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stargate.pylon.stats import throughput
from stargate.pylon.stats.throughput import (
    SNAPSHOT_THRESHOLD,
    CounterSampleState,
    OutputWindow,
    TpsDistribution,
    elapsed,
    output_decode_duration,
    output_rate,
    tps_for_units,
)

FLOOR = 0.010


def test_defaults_are_the_rust_stats_collector_config_defaults() -> None:
    assert throughput.SMOOTHING_WINDOW == 8
    assert throughput.MIN_INPUT_TOKENS == 1
    assert throughput.MIN_OUTPUT_TOKENS == 1
    assert throughput.DURATION_FLOOR_SECONDS == 0.010
    assert throughput.REQUEST_TTL_SECONDS == 300.0
    assert throughput.MODEL_TTL_SECONDS == 30.0
    assert SNAPSHOT_THRESHOLD == 5


# ---- TpsDistribution ---------------------------------------------------------------------------


def test_tps_distribution_ignores_non_positive_and_non_finite_samples() -> None:
    distribution = TpsDistribution()
    for sample in [0.0, -1.0, math.nan, math.inf, -math.inf]:
        assert distribution.update(sample) is False
    assert distribution.count == 0
    assert distribution.mean == 0.0
    assert not distribution.has_sufficient_data
    assert distribution.published == 0.0


def test_tps_distribution_requires_five_valid_samples() -> None:
    distribution = TpsDistribution()
    for sample in [10.0, 20.0, 30.0, 40.0]:
        assert distribution.update(sample) is False
    assert not distribution.has_sufficient_data
    assert distribution.published == 0.0

    assert distribution.update(50.0) is True
    assert distribution.has_sufficient_data
    assert distribution.mean == 30.0
    assert distribution.published == 30.0


def test_bootstrap_populates_a_ready_distribution_that_real_samples_update() -> None:
    distribution = TpsDistribution.seed(100.0)
    assert distribution.count == SNAPSHOT_THRESHOLD
    assert (distribution.min, distribution.max, distribution.mean) == (100.0, 100.0, 100.0)
    assert distribution.variance == 0.0
    assert distribution.has_sufficient_data
    assert distribution.published == 100.0

    distribution.update(160.0)
    assert distribution.count == SNAPSHOT_THRESHOLD + 1
    assert distribution.mean == 110.0
    assert (distribution.min, distribution.max) == (100.0, 160.0)
    assert distribution.variance > 0.0
    assert distribution.published == 110.0


def test_one_real_sample_moves_a_seed_of_100_to_700_over_6() -> None:
    distribution = TpsDistribution.seed(100.0)
    distribution.update(200.0)
    assert distribution.published == pytest.approx(700.0 / 6.0, rel=1e-15)


def test_a_pinned_seed_stays_published_whatever_the_samples() -> None:
    distribution = TpsDistribution.seed(2200.0, pin=True)
    assert distribution.pinned
    for _ in range(10):
        assert distribution.update(100.0) is False
    assert distribution.published == 2200.0
    assert distribution.mean < 2200.0  # the samples are still recorded


@pytest.mark.parametrize("value", [0.0, -5.0, math.nan, math.inf])
def test_a_seed_must_be_finite_and_positive(value: float) -> None:
    with pytest.raises(ValueError, match="seed"):
        TpsDistribution.seed(value)


@given(st.lists(st.floats(min_value=1e-3, max_value=1e9), min_size=1, max_size=40))
def test_the_published_value_is_the_running_mean_from_the_fifth_sample(
    samples: list[float],
) -> None:
    distribution = TpsDistribution()
    for sample in samples:
        distribution.update(sample)
    assert distribution.count == len(samples)
    assert distribution.mean == pytest.approx(sum(samples) / len(samples), rel=1e-9)
    expected = distribution.mean if len(samples) >= SNAPSHOT_THRESHOLD else 0.0
    assert distribution.published == expected


# ---- durations and rates -----------------------------------------------------------------------


def test_elapsed_is_whole_nanoseconds_and_never_negative() -> None:
    assert elapsed(0.3, 0.2) == 0.1  # the float difference is 0.09999999999999998
    assert elapsed(1.0, 2.0) == 0.0
    assert elapsed(5.0, 5.0) == 0.0


def test_tps_for_units_needs_units_and_the_floor() -> None:
    assert tps_for_units(10, 0.1, FLOOR) == 100.0
    assert tps_for_units(0, 0.1, FLOOR) is None
    assert tps_for_units(10, 0.009, FLOOR) is None
    assert tps_for_units(10, 0.0, 0.0) is None  # a zero floor never divides by zero


def test_decode_duration_uses_the_first_token_unless_it_leaves_less_than_the_floor() -> None:
    assert output_decode_duration(9.0, 3.0, 3.0, FLOOR) == 6.0
    assert output_decode_duration(9.0, 2.0, 5.0, FLOOR) == 4.0
    # A terminal usage chunk: the first token 5 ms before the end, so from the first output.
    assert output_decode_duration(6.0, 2.0, 5.995, FLOOR) == 4.0
    assert output_decode_duration(6.0, None, None, FLOOR) is None


def test_output_rate_needs_the_minimum_tokens() -> None:
    assert output_rate(30, 9.0, 3.0, 3.0, min_tokens=1, floor=FLOOR) == 5.0
    assert output_rate(8, 6.0, 2.0, 5.995, min_tokens=1, floor=FLOOR) == 2.0
    assert output_rate(4, 9.0, 3.0, 3.0, min_tokens=5, floor=FLOOR) is None
    assert output_rate(8, 0.020, 0.010, 0.010, min_tokens=1, floor=0.050) is None


# ---- CounterSampleState ------------------------------------------------------------------------


def test_an_engine_counter_from_a_zero_baseline_samples_an_instant_first_jump_over_the_floor() -> (
    None
):
    counter = CounterSampleState(0, 5.0)
    assert counter.observe(10, 5.0, 1, 0.100) == 100.0  # 10 tokens / max(0 s, 100 ms)


def test_a_counter_accumulates_steps_under_the_floor_after_its_first_sample() -> None:
    counter = CounterSampleState(0, 0.0)
    assert counter.observe(0, 0.0, 1, FLOOR) is None
    assert counter.observe(1, 0.001, 1, FLOOR) == 100.0  # first sample: max(1 ms, 10 ms)
    for tick in range(2, 10):
        assert counter.observe(tick, tick / 1000, 1, FLOOR) is None
    assert counter.observe(11, 0.011, 1, FLOOR) == 1000.0  # 10 tokens over 10 ms


def test_a_counter_accumulates_steps_under_the_minimum() -> None:
    counter = CounterSampleState(0, 0.0)
    for tick in range(1, 10):
        # under 5 tokens, or 5+ tokens under the floor: both accumulate
        assert counter.observe(tick, tick / 1000, 5, FLOOR) is None
    assert counter.observe(10, 0.010, 5, FLOOR) == 1000.0


def test_a_fallback_counter_starts_from_its_first_value_without_a_sample() -> None:
    counter = CounterSampleState(7, 1.0)
    assert counter.observe(7, 1.0, 1, FLOOR) is None
    assert counter.observe(9, 1.5, 1, FLOOR) == 4.0  # 2 tokens over 0.5 s, not 9


def test_a_missing_value_changes_nothing_and_regressions_are_detected() -> None:
    counter = CounterSampleState(0, 0.0)
    assert counter.observe(None, 1.0, 1, FLOOR) is None
    assert counter.observe(4, 1.0, 1, FLOOR) == 4.0
    assert counter.regressed(3)
    assert not counter.regressed(4)
    assert not counter.regressed(None)


# ---- OutputWindow ------------------------------------------------------------------------------


def test_the_output_window_is_the_mean_of_the_last_eight_samples() -> None:
    window = OutputWindow()
    assert window.mean == 0.0
    for sample in range(1, 11):
        window.push(float(sample))
    assert len(window) == 8
    assert window.mean == sum(range(3, 11)) / 8
    assert window.clear() is True
    assert window.mean == 0.0
    assert window.clear() is False


def test_a_zero_window_keeps_nothing() -> None:
    window = OutputWindow(0)
    window.push(5.0)
    assert len(window) == 0
    assert window.mean == 0.0
