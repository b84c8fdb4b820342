"""The mock backend's run-time knobs and counters, and the pure validation of `/test-control`.

`POST /test-control` takes a JSON object whose keys are a subset of `KNOB_KEYS`,
`PREFIX_CACHE_KEYS`, `BATCHING_KEYS` and `reset`; `GET /test-control` answers the same knob keys
(so its output is valid input) together with the served models, the in-flight count, the
engine's queues and the counters. The prefix-cache model's knobs (`PrefixCacheKnobs`) and the
batching model's (`BatchingKnobs`) are kept apart from the generation knobs (`Knobs`):
`apply_control` validates the body as a whole, and `apply_prefix_cache_control` and
`apply_batching_control` read their keys from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from stargate.mock.prefix_cache import DEFAULT_BLOCK_CHARS, DEFAULT_SPEEDUP, Lookup

__all__ = [
    "BATCHING_KEYS",
    "ENDPOINTS",
    "KNOB_KEYS",
    "PREFIX_CACHE_KEYS",
    "BatchingKnobs",
    "ControlError",
    "Counters",
    "DropMidStream",
    "FailNext",
    "Knobs",
    "PrefixCacheCounters",
    "PrefixCacheKnobs",
    "apply_batching_control",
    "apply_control",
    "apply_prefix_cache_control",
]

# Counter keys of `counters.requests`: one per route, plus `not_found` for unknown paths.
ENDPOINTS: tuple[str, ...] = (
    "chat_completions",
    "completions",
    "responses",
    "embeddings",
    "models",
    "health",
    "test_control",
    "not_found",
)

KNOB_KEYS: frozenset[str] = frozenset(
    {
        "ttft_ms",
        "inter_token_ms",
        "tokens",
        "healthy",
        "response_delay_ms",
        "fail_next",
        "drop_mid_stream",
    }
)

PREFIX_CACHE_KEYS: frozenset[str] = frozenset(
    {"prefix_cache_blocks", "prefix_cache_speedup", "prefix_cache_block_chars"}
)


BATCHING_KEYS: frozenset[str] = frozenset({"max_num_seqs", "prefill_ms_per_token"})


class ControlError(ValueError):
    """A `/test-control` body the mock refuses with 400; the message says why."""


@dataclass(frozen=True, slots=True)
class FailNext:
    """The next `count` POST /v1/* requests answer `status` with `body` and `headers`."""

    count: int = 0
    status: int = 503
    body: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "status": self.status,
            "body": self.body,
            "headers": dict(self.headers),
        }


@dataclass(frozen=True, slots=True)
class DropMidStream:
    """The next `count` streaming responses send `after_chunks` SSE events, then abort."""

    count: int = 0
    after_chunks: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "after_chunks": self.after_chunks}


@dataclass(frozen=True, slots=True)
class Knobs:
    """Everything `/test-control` can change; the CLI flags give the first (and reset) values."""

    ttft_ms: float = 0.0
    inter_token_ms: float = 0.0
    tokens: int = 16
    healthy: bool = True
    response_delay_ms: float = 0.0
    fail_next: FailNext = FailNext()
    drop_mid_stream: DropMidStream = DropMidStream()

    def to_json(self) -> dict[str, Any]:
        return {
            "ttft_ms": self.ttft_ms,
            "inter_token_ms": self.inter_token_ms,
            "tokens": self.tokens,
            "healthy": self.healthy,
            "response_delay_ms": self.response_delay_ms,
            "fail_next": self.fail_next.to_json(),
            "drop_mid_stream": self.drop_mid_stream.to_json(),
        }


@dataclass(frozen=True, slots=True)
class PrefixCacheKnobs:
    """The prefix-cache model's knobs (stargate/mock/prefix_cache.py); `blocks` 0 turns it off.

    `speedup` in [0, 1] is the share of `ttft_ms` a fully cached prompt saves; `block_chars` the
    characters of one cache block.
    """

    blocks: int = 0
    speedup: float = DEFAULT_SPEEDUP
    block_chars: int = DEFAULT_BLOCK_CHARS

    def __post_init__(self) -> None:
        if self.blocks < 0:
            raise ValueError("prefix-cache blocks must be non-negative")
        if not 0.0 <= self.speedup <= 1.0:
            raise ValueError("prefix-cache speedup must be between 0 and 1")
        if self.block_chars < 1:
            raise ValueError("prefix-cache block size must be at least 1 character")

    @property
    def enabled(self) -> bool:
        return self.blocks > 0

    def to_json(self) -> dict[str, Any]:
        return {
            "prefix_cache_blocks": self.blocks,
            "prefix_cache_speedup": self.speedup,
            "prefix_cache_block_chars": self.block_chars,
        }


@dataclass(frozen=True, slots=True)
class BatchingKnobs:
    """The batching model's run-time knobs (docs/mock-backend.md, "Batching").

    `max_num_seqs` is the number of running slots (0 = unlimited); `prefill_ms_per_token` the
    prefill time of each uncached prompt token, added to the TTFT. The KV cache's size is not a
    knob: it is fixed for the process's life (`--kv-cache-tokens`).
    """

    max_num_seqs: int = 0
    prefill_ms_per_token: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 0:
            raise ValueError("max_num_seqs must be non-negative")
        if not 0.0 <= self.prefill_ms_per_token < float("inf"):  # also refuses NaN
            raise ValueError("prefill_ms_per_token must be a non-negative finite number")

    def to_json(self) -> dict[str, Any]:
        return {
            "max_num_seqs": self.max_num_seqs,
            "prefill_ms_per_token": self.prefill_ms_per_token,
        }


@dataclass(slots=True)
class PrefixCacheCounters:
    """Prefix-cache lookups (one per chat, completions or Responses request answered while the
    model is on) and what they found."""

    lookups: int = 0
    hits: int = 0  # lookups that found at least one cached block
    hit_chars: int = 0
    prompt_chars: int = 0
    evicted_blocks: int = 0

    def count(self, lookup: Lookup) -> None:
        self.lookups += 1
        if lookup.hit_blocks:
            self.hits += 1
        self.hit_chars += lookup.hit_chars
        self.prompt_chars += lookup.prompt_chars
        self.evicted_blocks += lookup.evicted_blocks

    def to_json(self, cached_blocks: int) -> dict[str, Any]:
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "hit_chars": self.hit_chars,
            "prompt_chars": self.prompt_chars,
            "evicted_blocks": self.evicted_blocks,
            "cached_blocks": cached_blocks,
        }


@dataclass(slots=True)
class Counters:
    """Request counters since start or the last reset."""

    requests_total: int = 0
    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ENDPOINTS, 0))
    injected_failures: int = 0
    dropped_streams: int = 0
    client_disconnects: int = 0
    prefix_cache: PrefixCacheCounters = field(default_factory=PrefixCacheCounters)

    def to_json(self, cached_blocks: int = 0) -> dict[str, Any]:
        """The counters; `cached_blocks` (the prefix cache's size now) goes with its counters."""
        return {
            "requests_total": self.requests_total,
            "requests": dict(self.requests),
            "injected_failures": self.injected_failures,
            "dropped_streams": self.dropped_streams,
            "client_disconnects": self.client_disconnects,
            "prefix_cache": self.prefix_cache.to_json(cached_blocks),
        }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _milliseconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ControlError(f"'{name}' must be a non-negative number of milliseconds")
    if value == float("inf"):
        raise ControlError(f"'{name}' must be finite")
    return float(value)


def _int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f" and at most {maximum}" if maximum is not None else ""
        raise ControlError(f"'{name}' must be an integer at least {minimum}{bound}")
    return int(value)


def _object(name: str, value: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ControlError(f"'{name}' must be an object")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ControlError(f"unknown '{name}' key(s): {', '.join(unknown)}")
    return value


def _fail_next(value: Any) -> FailNext:
    if value is None:
        return FailNext()
    spec = _object("fail_next", value, {"count", "status", "body", "headers"})
    body = spec.get("body")
    if body is not None and not isinstance(body, str):
        raise ControlError("'fail_next.body' must be a string")
    headers = spec.get("headers") or {}
    if not isinstance(headers, dict) or not all(
        isinstance(key, str) and isinstance(item, str) and key.strip()
        for key, item in headers.items()
    ):
        raise ControlError("'fail_next.headers' must be an object of string header values")
    return FailNext(
        count=_int("fail_next.count", spec.get("count", 1), 0),
        status=_int("fail_next.status", spec.get("status", 503), 200, 599),
        body=body,
        headers=tuple((key.strip().lower(), item) for key, item in headers.items()),
    )


def _drop_mid_stream(value: Any) -> DropMidStream:
    if value is None:
        return DropMidStream()
    spec = _object("drop_mid_stream", value, {"count", "after_chunks"})
    return DropMidStream(
        count=_int("drop_mid_stream.count", spec.get("count", 1), 0),
        after_chunks=_int("drop_mid_stream.after_chunks", spec.get("after_chunks", 1), 0),
    )


def apply_control(payload: Any, current: Knobs, defaults: Knobs) -> tuple[Knobs, bool]:
    """Validate a `/test-control` body and return `(new knobs, reset requested)`.

    All-or-nothing: a body with any invalid field raises `ControlError` and changes nothing.
    `reset: true` starts from `defaults`; the body's other fields then apply on top of them.
    `fail_next` and `drop_mid_stream` accept `null` to clear them; their omitted fields default
    to `count` 1, `status` 503 and `after_chunks` 1.
    """
    if not isinstance(payload, dict):
        raise ControlError("the test-control body must be a JSON object")
    unknown = sorted(set(payload) - KNOB_KEYS - PREFIX_CACHE_KEYS - BATCHING_KEYS - {"reset"})
    if unknown:
        raise ControlError(f"unknown test-control key(s): {', '.join(unknown)}")
    reset = payload.get("reset", False)
    if not isinstance(reset, bool):
        raise ControlError("'reset' must be a boolean")
    changes: dict[str, Any] = {}
    for name in ("ttft_ms", "inter_token_ms", "response_delay_ms"):
        if name in payload:
            changes[name] = _milliseconds(name, payload[name])
    if "tokens" in payload:
        changes["tokens"] = _int("tokens", payload["tokens"], 1)
    if "healthy" in payload:
        if not isinstance(payload["healthy"], bool):
            raise ControlError("'healthy' must be a boolean")
        changes["healthy"] = payload["healthy"]
    if "fail_next" in payload:
        changes["fail_next"] = _fail_next(payload["fail_next"])
    if "drop_mid_stream" in payload:
        changes["drop_mid_stream"] = _drop_mid_stream(payload["drop_mid_stream"])
    base = defaults if reset else current
    return dataclasses.replace(base, **changes), reset


def apply_prefix_cache_control(
    payload: dict[str, Any], current: PrefixCacheKnobs, defaults: PrefixCacheKnobs, *, reset: bool
) -> PrefixCacheKnobs:
    """The prefix-cache knobs after a `/test-control` body that `apply_control` accepted.

    Raises `ControlError` for an invalid value (`prefix_cache_blocks` an integer >= 0,
    `prefix_cache_speedup` a number in [0, 1], `prefix_cache_block_chars` an integer >= 1);
    with `reset` the body's values apply on top of `defaults`.
    """
    changes: dict[str, Any] = {}
    if "prefix_cache_blocks" in payload:
        changes["blocks"] = _int("prefix_cache_blocks", payload["prefix_cache_blocks"], 0)
    if "prefix_cache_speedup" in payload:
        value = payload["prefix_cache_speedup"]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 <= value <= 1  # also refuses NaN
        ):
            raise ControlError("'prefix_cache_speedup' must be a number between 0 and 1")
        changes["speedup"] = float(value)
    if "prefix_cache_block_chars" in payload:
        value = payload["prefix_cache_block_chars"]
        changes["block_chars"] = _int("prefix_cache_block_chars", value, 1)
    base = defaults if reset else current
    return dataclasses.replace(base, **changes)


def apply_batching_control(
    payload: dict[str, Any], current: BatchingKnobs, defaults: BatchingKnobs, *, reset: bool
) -> BatchingKnobs:
    """The batching knobs after a `/test-control` body that `apply_control` accepted.

    Raises `ControlError` for an invalid value (`max_num_seqs` an integer >= 0,
    `prefill_ms_per_token` a finite number >= 0); with `reset` the body's values apply on top of
    `defaults`.
    """
    changes: dict[str, Any] = {}
    if "max_num_seqs" in payload:
        changes["max_num_seqs"] = _int("max_num_seqs", payload["max_num_seqs"], 0)
    if "prefill_ms_per_token" in payload:
        value = payload["prefill_ms_per_token"]
        changes["prefill_ms_per_token"] = _milliseconds("prefill_ms_per_token", value)
    base = defaults if reset else current
    return dataclasses.replace(base, **changes)
