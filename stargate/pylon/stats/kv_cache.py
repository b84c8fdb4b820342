"""The KV-cache stats endpoint's answer: one model's KV capacity, use and free space, in tokens.

When the operator names a KV-cache endpoint, the Pylon polls it and reports the three figures
to the router, whose Pulsar balancer can then prefer backends with free KV space. The body is a
JSON object: a non-empty string `model` and the non-negative integers
`kv_cache_capacity_tokens`, `kv_cache_used_tokens` and `kv_cache_free_tokens`; other fields are
ignored, so an engine may say more. The figures are taken as the engine gives them, not checked
against each other (as the Rust Pylon does): the engine is the authority on its cache, and
refusing a poll whose figures do not add up would leave the router with older figures instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["KvCacheStats", "parse_kv_cache_stats"]

_U64_MAX = 2**64 - 1
_FIELDS = ("kv_cache_capacity_tokens", "kv_cache_used_tokens", "kv_cache_free_tokens")


@dataclass(frozen=True, slots=True)
class KvCacheStats:
    """A model's KV cache, in tokens."""

    capacity_tokens: int
    used_tokens: int
    free_tokens: int


def parse_kv_cache_stats(body: bytes) -> tuple[str, KvCacheStats]:
    """The model and KV figures of one answer; ValueError saying what is wrong otherwise."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"KV-cache stats body is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"KV-cache stats body is not a JSON object: {type(obj).__name__}")
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError(f"KV-cache stats need a non-empty string 'model', got {model!r}")
    values: list[int] = []
    for field in _FIELDS:
        value = obj.get(field)
        if type(value) is not int or not 0 <= value <= _U64_MAX:
            raise ValueError(
                f"KV-cache stats {field!r} must be a non-negative integer, got {value!r}"
            )
        values.append(value)
    capacity, used, free = values
    return model, KvCacheStats(capacity, used, free)
