"""`/test-control` validation of the prefix-cache knobs (stargate/mock/control.py), pure."""

from __future__ import annotations

from typing import Any

import pytest

from stargate.mock.control import (
    KNOB_KEYS,
    PREFIX_CACHE_KEYS,
    ControlError,
    Counters,
    Knobs,
    PrefixCacheKnobs,
    apply_control,
    apply_prefix_cache_control,
)
from stargate.mock.prefix_cache import Lookup


def apply(payload: dict[str, Any], current: PrefixCacheKnobs) -> PrefixCacheKnobs:
    """Both steps, as the app runs them."""
    _, reset = apply_control(payload, Knobs(), Knobs())
    return apply_prefix_cache_control(payload, current, PrefixCacheKnobs(), reset=reset)


def test_the_defaults_are_off_and_the_json_keys_are_the_control_keys() -> None:
    knobs = PrefixCacheKnobs()
    assert (knobs.blocks, knobs.speedup, knobs.block_chars, knobs.enabled) == (0, 0.9, 64, False)
    assert set(knobs.to_json()) == PREFIX_CACHE_KEYS
    assert not PREFIX_CACHE_KEYS & KNOB_KEYS
    assert PrefixCacheKnobs(blocks=1).enabled


def test_values_apply_and_the_json_is_valid_input() -> None:
    current = PrefixCacheKnobs(blocks=8)
    changed = apply({"prefix_cache_blocks": 100, "prefix_cache_speedup": 1}, current)
    assert changed == PrefixCacheKnobs(blocks=100, speedup=1.0, block_chars=64)
    assert isinstance(changed.speedup, float)
    assert apply({"prefix_cache_block_chars": 16}, changed).block_chars == 16
    assert apply(changed.to_json(), PrefixCacheKnobs()) == changed
    # Other knobs leave these alone; reset starts from the defaults.
    assert apply({"tokens": 3}, changed) == changed
    assert apply({"reset": True}, changed) == PrefixCacheKnobs()
    assert apply({"reset": True, "prefix_cache_blocks": 5}, changed) == PrefixCacheKnobs(blocks=5)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"prefix_cache_blocks": -1}, "'prefix_cache_blocks' must be an integer at least 0"),
        ({"prefix_cache_blocks": 1.5}, "'prefix_cache_blocks' must be an integer"),
        ({"prefix_cache_blocks": True}, "'prefix_cache_blocks' must be an integer"),
        ({"prefix_cache_blocks": "8"}, "'prefix_cache_blocks' must be an integer"),
        ({"prefix_cache_speedup": 1.5}, "'prefix_cache_speedup' must be a number between 0 and 1"),
        ({"prefix_cache_speedup": -0.1}, "'prefix_cache_speedup' must be a number between"),
        ({"prefix_cache_speedup": float("nan")}, "'prefix_cache_speedup' must be a number"),
        ({"prefix_cache_speedup": False}, "'prefix_cache_speedup' must be a number"),
        ({"prefix_cache_speedup": None}, "'prefix_cache_speedup' must be a number"),
        ({"prefix_cache_block_chars": 0}, "'prefix_cache_block_chars' must be an integer at least"),
        ({"prefix_cache_block_chars": 64.0}, "'prefix_cache_block_chars' must be an integer"),
        ({"prefix_cache": 1}, "unknown test-control key(s): prefix_cache"),
    ],
)
def test_bad_values_are_refused_with_a_message_naming_the_key(
    payload: dict[str, Any], message: str
) -> None:
    with pytest.raises(ControlError) as info:
        apply(payload, PrefixCacheKnobs())
    assert message in str(info.value)


@pytest.mark.parametrize(
    "settings", [{"blocks": -1}, {"speedup": 1.1}, {"speedup": float("nan")}, {"block_chars": 0}]
)
def test_the_knobs_refuse_invalid_values(settings: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        PrefixCacheKnobs(**settings)


def test_counters_count_lookups_hits_and_characters() -> None:
    counters = Counters()
    counters.prefix_cache.count(Lookup(prompt_chars=100, hit_blocks=0, hit_chars=0))
    counters.prefix_cache.count(Lookup(prompt_chars=100, hit_blocks=1, hit_chars=64))
    counters.prefix_cache.count(Lookup(10, hit_blocks=0, hit_chars=0, evicted_blocks=3))
    assert counters.to_json(cached_blocks=7)["prefix_cache"] == {
        "lookups": 3,
        "hits": 1,
        "hit_chars": 64,
        "prompt_chars": 210,
        "evicted_blocks": 3,
        "cached_blocks": 7,
    }
    assert Counters().to_json()["prefix_cache"]["lookups"] == 0
