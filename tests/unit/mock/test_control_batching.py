"""`/test-control` validation of the batching knobs (stargate/mock/control.py), pure."""

from __future__ import annotations

from typing import Any

import pytest

from stargate.mock.control import (
    BATCHING_KEYS,
    KNOB_KEYS,
    PREFIX_CACHE_KEYS,
    BatchingKnobs,
    ControlError,
    Knobs,
    apply_batching_control,
    apply_control,
)


def apply(payload: dict[str, Any], current: BatchingKnobs) -> BatchingKnobs:
    """Both steps, as the app runs them."""
    _, reset = apply_control(payload, Knobs(), Knobs())
    return apply_batching_control(payload, current, BatchingKnobs(), reset=reset)


def test_the_defaults_are_off_and_the_json_keys_are_the_control_keys() -> None:
    assert BatchingKnobs() == BatchingKnobs(max_num_seqs=0, prefill_ms_per_token=0.0)
    assert set(BatchingKnobs().to_json()) == BATCHING_KEYS
    assert not BATCHING_KEYS & (KNOB_KEYS | PREFIX_CACHE_KEYS)


def test_values_apply_and_reset_starts_from_the_defaults() -> None:
    changed = apply({"max_num_seqs": 8, "prefill_ms_per_token": 2}, BatchingKnobs())
    assert changed == BatchingKnobs(max_num_seqs=8, prefill_ms_per_token=2.0)
    assert isinstance(changed.prefill_ms_per_token, float)
    assert apply(changed.to_json(), BatchingKnobs()) == changed
    assert apply({"tokens": 3}, changed) == changed
    assert apply({"reset": True}, changed) == BatchingKnobs()
    assert apply({"reset": True, "max_num_seqs": 1}, changed) == BatchingKnobs(max_num_seqs=1)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"max_num_seqs": -1}, "'max_num_seqs' must be an integer at least 0"),
        ({"max_num_seqs": 2.0}, "'max_num_seqs' must be an integer"),
        ({"max_num_seqs": False}, "'max_num_seqs' must be an integer"),
        ({"prefill_ms_per_token": -1}, "'prefill_ms_per_token' must be a non-negative number"),
        ({"prefill_ms_per_token": "1"}, "'prefill_ms_per_token' must be a non-negative number"),
        ({"prefill_ms_per_token": float("nan")}, "'prefill_ms_per_token' must be a non-negative"),
        ({"prefill_ms_per_token": float("inf")}, "'prefill_ms_per_token' must be finite"),
        ({"kv_cache_tokens": 10}, "unknown test-control key(s): kv_cache_tokens"),
    ],
)
def test_bad_values_are_refused_with_a_message_naming_the_key(
    payload: dict[str, Any], message: str
) -> None:
    with pytest.raises(ControlError) as info:
        apply(payload, BatchingKnobs())
    assert message in str(info.value)


@pytest.mark.parametrize(
    "settings",
    [{"max_num_seqs": -1}, {"prefill_ms_per_token": -0.1}, {"prefill_ms_per_token": float("inf")}],
)
def test_the_knobs_refuse_invalid_values(settings: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        BatchingKnobs(**settings)
