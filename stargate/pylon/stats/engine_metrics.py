"""KV-cache capacity and use, and the engine's request queue, read from its Prometheus metrics.

Beyond the Rust Pylon, which reports KV figures only from a KV-cache JSON endpoint (`kv_cache.py`)
that neither vLLM nor SGLang serves: both engines publish the same facts on `/metrics`, so when no
KV endpoint is configured the Pylon can still give the router's Pulsar balancer its free-KV
figure. This module maps one scrape onto `EngineMetrics`; fetching it is the caller's business.

vLLM (`vllm:` families, labels `model_name` and, one series per data-parallel engine, `engine`):

* capacity = `num_gpu_blocks` x `block_size`, two labels of the info gauge
  `vllm:cache_config_info` (whose value is always 1);
* used = round(`vllm:kv_cache_usage_perc` x capacity), that gauge being the used fraction; vLLM
  0.9 deprecated the older `vllm:gpu_cache_usage_perc` in its favour, read when the new one is
  absent;
* running = `vllm:num_requests_running`, waiting = `vllm:num_requests_waiting`;
* data-parallel engines each have their own cache and queue, so their figures are summed (each
  engine's used tokens from its own fraction and capacity; an info gauge without an `engine`
  label stands for every engine).

SGLang (`sglang:` families, served only with `--enable-metrics`; labels `model_name` and rank
labels):

* capacity = `sglang:max_total_num_tokens`, used = `sglang:num_used_tokens`, else
  round(`sglang:token_usage` x capacity);
* running = `sglang:num_running_reqs`, waiting = `sglang:num_queue_reqs`;
* tensor- and pipeline-parallel ranks (`tp_rank`, `pp_rank`) repeat one scheduler's figures,
  so only the lowest rank present counts (rank 0, normally; the others would multiply it, and a
  release that published only a later rank still reads); data-parallel ranks (`dp_rank`) are
  separate schedulers with separate caches, so they are summed.

When `model` is given, a series whose `model_name` label names another model is left out; a
series without that label (vLLM's info gauge has none) is kept. Without `model`, the series of
several models on one engine (or data-parallel rank) are its queues, added, but its one cache,
repeated under each model's label: the KV figures are taken once (the largest), not added.

Missing pieces leave their field None rather than guessing: no capacity (no info gauge, a
`num_gpu_blocks` of "None" before vLLM profiled its memory, no `max_total_num_tokens`) or no
used figure means `kv` is None, while `running` and `waiting` are still read; an absent gauge
makes its own field None. Used is clamped to [0, capacity] (a fraction is a float, and may round
past either end). `free = capacity - used`. NaN and infinite values are skipped.

Metric names move between engine releases (vLLM renamed its cache-usage gauge in 0.9, SGLang
adds and renames gauges often): when a figure stays None against a new release, compare these
names with the deployed `/metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

from stargate.pylon.stats.kv_cache import KvCacheStats

__all__ = ["EngineMetrics", "parse_engine_metrics"]

_VLLM_CACHE_INFO = "vllm:cache_config_info"
_VLLM_USAGE = "vllm:kv_cache_usage_perc"
_VLLM_USAGE_DEPRECATED = "vllm:gpu_cache_usage_perc"
_VLLM_RUNNING = "vllm:num_requests_running"
_VLLM_WAITING = "vllm:num_requests_waiting"
_VLLM = frozenset(
    {_VLLM_CACHE_INFO, _VLLM_USAGE, _VLLM_USAGE_DEPRECATED, _VLLM_RUNNING, _VLLM_WAITING}
)

_SGLANG_CAPACITY = "sglang:max_total_num_tokens"
_SGLANG_USED = "sglang:num_used_tokens"
_SGLANG_USAGE = "sglang:token_usage"
_SGLANG_RUNNING = "sglang:num_running_reqs"
_SGLANG_WAITING = "sglang:num_queue_reqs"
_SGLANG = frozenset(
    {_SGLANG_CAPACITY, _SGLANG_USED, _SGLANG_USAGE, _SGLANG_RUNNING, _SGLANG_WAITING}
)

# Ranks that repeat one scheduler's figures: only the lowest present is read.
_REPLICA_RANKS = ("tp_rank", "pp_rank")

# One series: its labels and value.
_Series = tuple[Mapping[str, str], float]
# Figures by data-parallel key (the `engine` or `dp_rank` label; None when absent).
_ByKey = dict[str | None, float]


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What one scrape says about the engine: which engine it is, its KV cache (None: not known),
    and its requests running and waiting (None: not published)."""

    engine: Literal["vllm", "sglang"]
    kv: KvCacheStats | None
    running: int | None
    waiting: int | None


def parse_engine_metrics(text: str, model: str | None = None) -> EngineMetrics | None:
    """The vLLM or SGLang figures in a Prometheus text scrape, for `model` when given.

    None when the text has none of the families read here; an `EngineMetrics` with every
    figure None when it has them only for other models; ValueError when the Prometheus parser
    refuses the text.
    """
    names, series = _collect(text, model)
    if names & _VLLM:
        return _vllm(series)
    if names & _SGLANG:
        return _sglang(series)
    return None


def _collect(text: str, model: str | None) -> tuple[set[str], dict[str, list[_Series]]]:
    """The names of the families read here that the text has (whichever model they are for, so
    that the engine is known even when it serves another model), and their samples by name,
    other models' series left out."""
    names: set[str] = set()
    found: dict[str, list[_Series]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in _VLLM and sample.name not in _SGLANG:
                    continue
                names.add(sample.name)
                labels = sample.labels
                if model is not None and labels.get("model_name", model) != model:
                    continue
                found.setdefault(sample.name, []).append((labels, sample.value))
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise ValueError(f"engine metrics are not Prometheus text: {exc}") from exc
    return names, found


def _rank_order(rank: str) -> tuple[int, str]:
    """Numeric order for the decimal ranks engines write ("2" before "10")."""
    return len(rank), rank


def _by_key(series: list[_Series], key_label: str, *, add: bool) -> _ByKey:
    """Finite values by data-parallel key, only the lowest replica rank kept. Series that share
    a key are added when `add` (the queues of the models one engine serves) or else are one
    figure, of which the largest is kept (one cache, repeated per model label)."""
    lowest = {
        label: min(ranks, key=_rank_order)
        for label in _REPLICA_RANKS
        if (ranks := {labels[label] for labels, _ in series if label in labels})
    }
    sums: _ByKey = {}
    for labels, value in series:
        if not math.isfinite(value):
            continue
        if any(labels.get(label, rank) != rank for label, rank in lowest.items()):
            continue
        key = labels.get(key_label)
        if key not in sums:
            sums[key] = value
        elif add:
            sums[key] += value
        else:
            sums[key] = max(sums[key], value)
    return sums


def _for_key(key: str | None, table: Mapping[str | None, int]) -> int | None:
    """`table`'s figure for a data-parallel key: its own, else the one without a key, else the
    only one there is."""
    if key in table:
        return table[key]
    if None in table:
        return table[None]
    if len(table) == 1:
        return next(iter(table.values()))
    return None


def _round(value: float) -> int:
    """Half up: a gauge's value is never negative, and Python's round() goes to even."""
    return math.floor(value + 0.5)


def _count(series: dict[str, list[_Series]], name: str, key_label: str) -> int | None:
    """A count gauge summed over data-parallel keys; None when it is absent."""
    values = _by_key(series.get(name, []), key_label, add=True)
    if not values:
        return None
    return max(0, _round(sum(values.values())))


def _kv(capacities: Mapping[str | None, int], used: dict[str | None, int]) -> KvCacheStats | None:
    """Sum each key's capacity and clamped use; None when a key's capacity is unknown."""
    if not capacities or not used:
        return None
    total = total_used = 0
    for key, tokens in used.items():
        capacity = _for_key(key, capacities)
        if capacity is None:
            return None
        total += capacity
        total_used += min(max(tokens, 0), capacity)
    return KvCacheStats(total, total_used, total - total_used)


def _vllm(series: dict[str, list[_Series]]) -> EngineMetrics:
    capacities: dict[str | None, int] = {}
    for labels, _ in series.get(_VLLM_CACHE_INFO, []):
        try:
            capacity = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            continue  # "None" until vLLM has profiled its memory
        if capacity >= 0:
            # Repeats of one engine's info gauge describe the same cache: not summed.
            key = labels.get("engine")
            capacities[key] = max(capacities.get(key, 0), capacity)
    fractions = _by_key(series.get(_VLLM_USAGE, []), "engine", add=False)
    if not fractions:
        fractions = _by_key(series.get(_VLLM_USAGE_DEPRECATED, []), "engine", add=False)
    used: dict[str | None, int] = {}
    for key, fraction in fractions.items():
        engine_capacity = _for_key(key, capacities)
        if engine_capacity is not None:
            used[key] = _round(fraction * engine_capacity)
    return EngineMetrics(
        engine="vllm",
        kv=_kv(capacities, used) if len(used) == len(fractions) else None,
        running=_count(series, _VLLM_RUNNING, "engine"),
        waiting=_count(series, _VLLM_WAITING, "engine"),
    )


def _sglang(series: dict[str, list[_Series]]) -> EngineMetrics:
    capacities = {
        key: _round(value)
        for key, value in _by_key(series.get(_SGLANG_CAPACITY, []), "dp_rank", add=False).items()
        if value >= 0
    }
    counted = _by_key(series.get(_SGLANG_USED, []), "dp_rank", add=False)
    fractions = _by_key(series.get(_SGLANG_USAGE, []), "dp_rank", add=False)
    used: dict[str | None, int] = {}
    for key, capacity in capacities.items():
        if key in counted:
            used[key] = _round(counted[key])
        elif key in fractions:
            used[key] = _round(fractions[key] * capacity)
    return EngineMetrics(
        engine="sglang",
        kv=_kv(capacities, used) if len(used) == len(capacities) else None,
        running=_count(series, _SGLANG_RUNNING, "dp_rank"),
        waiting=_count(series, _SGLANG_WAITING, "dp_rank"),
    )
