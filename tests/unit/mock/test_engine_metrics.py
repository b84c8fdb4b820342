"""The mock engine's Prometheus text (stargate/mock/engine_metrics.py), pure: it parses with
prometheus_client's parser, under vLLM's names and labels, with the values it was given."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stargate.mock.engine_metrics import (
    PROMPT_TOKEN_BUCKETS,
    EngineState,
    Histogram,
    ModelMetrics,
    one_two_five_buckets,
    render,
)


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Sample (name, sorted labels) -> value."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def labels(model: str, **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"engine": "0", "model_name": model, **extra}.items()))


def test_buckets_and_observations() -> None:
    assert one_two_five_buckets(100) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    assert one_two_five_buckets(0) == ()
    assert PROMPT_TOKEN_BUCKETS[-1] == 1_000_000
    histogram = Histogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 3.0):
        histogram.observe(value)
    assert histogram.counts == [2, 1, 1]  # a value equal to a bound is in its bucket (le)
    assert (histogram.count, histogram.total) == (4, 6.0)
    with pytest.raises(ValueError):
        Histogram((2.0, 1.0))


def test_every_family_parses_with_its_values_per_model() -> None:
    busy = ModelMetrics(prompt_tokens=120, generation_tokens=48, successes=3)
    busy.ttft.observe(0.2)
    busy.ttft.observe(0.4)
    busy.queue_time.observe(0.0)
    busy.prompt_lengths.observe(40)
    metrics = {"model-a": busy, 'we"ird\\model': ModelMetrics()}
    state = EngineState(
        {"model-a": (2, 5), 'we"ird\\model': (0, 1)}, kv_cache_tokens=1000, kv_used_tokens=250
    )
    samples = parse(render(state, metrics))
    a, weird = labels("model-a"), labels('we"ird\\model')
    assert samples[("vllm:num_requests_running", a)] == 2
    assert samples[("vllm:num_requests_waiting", a)] == 5
    assert samples[("vllm:num_requests_waiting", weird)] == 1
    assert samples[("vllm:kv_cache_usage_perc", a)] == 0.25
    assert samples[("vllm:prompt_tokens_total", a)] == 120
    assert samples[("vllm:generation_tokens_total", a)] == 48
    assert samples[("vllm:generation_tokens_total", weird)] == 0
    success = labels("model-a", finished_reason="stop")
    assert samples[("vllm:request_success_total", success)] == 3
    assert samples[("vllm:time_to_first_token_seconds_count", a)] == 2
    assert samples[("vllm:time_to_first_token_seconds_sum", a)] == pytest.approx(0.6)
    assert samples[("vllm:time_to_first_token_seconds_bucket", labels("model-a", le="0.1"))] == 0
    assert samples[("vllm:time_to_first_token_seconds_bucket", labels("model-a", le="0.25"))] == 1
    assert samples[("vllm:time_to_first_token_seconds_bucket", labels("model-a", le="+Inf"))] == 2
    assert samples[("vllm:request_queue_time_seconds_bucket", labels("model-a", le="0.3"))] == 1
    assert samples[("vllm:request_prompt_tokens_bucket", labels("model-a", le="50.0"))] == 1
    assert samples[("vllm:request_prompt_tokens_bucket", labels("model-a", le="20.0"))] == 0
    info = labels("model-a", block_size="16", num_gpu_blocks="62")
    assert samples[("vllm:cache_config_info", info)] == 1


def test_the_families_have_vllm_types() -> None:
    state = EngineState({"m": (0, 0)}, kv_cache_tokens=160, kv_used_tokens=0)
    types = {
        f.name: f.type for f in text_string_to_metric_families(render(state, {"m": ModelMetrics()}))
    }
    assert types == {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram",
        "vllm:cache_config_info": "gauge",
    }


def test_an_unlimited_kv_cache_has_no_cache_config_and_zero_usage() -> None:
    metrics: dict[str, Any] = {"m": ModelMetrics()}
    text = render(EngineState({"m": (3, 0)}, kv_cache_tokens=0, kv_used_tokens=0), metrics)
    samples = parse(text)
    assert samples[("vllm:kv_cache_usage_perc", labels("m"))] == 0
    assert "vllm:cache_config_info" not in text
    assert text.endswith("\n")
