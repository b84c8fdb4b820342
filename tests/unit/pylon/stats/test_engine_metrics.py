"""vLLM and SGLang `/metrics` scrapes mapped onto KV capacity and use and the request queue, on
exposition text written the way each engine writes it (HELP and TYPE lines, process metrics,
counters and histograms that must be ignored)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stargate.pylon.stats.engine_metrics import EngineMetrics, parse_engine_metrics
from stargate.pylon.stats.kv_cache import KvCacheStats

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
QWEN = "Qwen/Qwen2.5-7B-Instruct"

PROCESS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 18042.0
python_gc_objects_collected_total{generation="1"} 3917.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.147483648e+09
# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} 42.0
"""

VLLM = (
    PROCESS
    + f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{LLAMA}"}} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{LLAMA}"}} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{LLAMA}"}} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="{LLAMA}"}} 51200.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="{LLAMA}"}} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="{LLAMA}"}} 204800.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="{LLAMA}"}} 40960.0
# HELP vllm:request_prompt_tokens Number of prefill tokens processed.
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_sum{{engine="0",model_name="{LLAMA}"}} 204800.0
vllm:request_prompt_tokens_bucket{{engine="0",le="1.0",model_name="{LLAMA}"}} 0.0
vllm:request_prompt_tokens_bucket{{engine="0",le="1024.0",model_name="{LLAMA}"}} 12.0
vllm:request_prompt_tokens_bucket{{engine="0",le="8192.0",model_name="{LLAMA}"}} 40.0
vllm:request_prompt_tokens_bucket{{engine="0",le="+Inf",model_name="{LLAMA}"}} 40.0
vllm:request_prompt_tokens_count{{engine="0",model_name="{LLAMA}"}} 40.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="{LLAMA}"}} 3.25
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="{LLAMA}"}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",model_name="{LLAMA}"}} 31.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{LLAMA}"}} 40.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="{LLAMA}"}} 40.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",calculate_kv_scales="False",\
cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",\
is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="2048",\
num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",\
swap_space="4",swap_space_bytes="4294967296"}} 1.0
"""
)


def test_a_vllm_scrape() -> None:
    assert parse_engine_metrics(VLLM) == EngineMetrics(
        engine="vllm",
        kv=KvCacheStats(capacity_tokens=2048 * 16, used_tokens=8192, free_tokens=24576),
        running=3,
        waiting=2,
    )
    assert parse_engine_metrics(VLLM, model=LLAMA) == parse_engine_metrics(VLLM)


def test_a_vllm_scrape_for_another_model_says_nothing_about_it() -> None:
    assert parse_engine_metrics(VLLM, model="other") == EngineMetrics("vllm", None, None, None)


def vllm_gauge(name: str, value: str, engine: str = "0", model: str = LLAMA) -> str:
    return (
        f"# HELP {name} A gauge.\n# TYPE {name} gauge\n"
        f'{name}{{engine="{engine}",model_name="{model}"}} {value}\n'
    )


def cache_info(blocks: str, block_size: str = "16", engine: str | None = "0") -> str:
    labels = f'block_size="{block_size}",cache_dtype="auto",num_gpu_blocks="{blocks}"'
    if engine is not None:
        labels += f',engine="{engine}"'
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f"vllm:cache_config_info{{{labels}}} 1.0\n"
    )


def test_vllm_data_parallel_engines_are_summed() -> None:
    text = "".join(
        [
            # Each family's series together, as prometheus_client writes them.
            "# TYPE vllm:num_requests_running gauge\n",
            f'vllm:num_requests_running{{engine="0",model_name="{LLAMA}"}} 2.0\n',
            f'vllm:num_requests_running{{engine="1",model_name="{LLAMA}"}} 3.0\n',
            "# TYPE vllm:num_requests_waiting gauge\n",
            f'vllm:num_requests_waiting{{engine="0",model_name="{LLAMA}"}} 0.0\n',
            f'vllm:num_requests_waiting{{engine="1",model_name="{LLAMA}"}} 1.0\n',
            "# TYPE vllm:kv_cache_usage_perc gauge\n",
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{LLAMA}"}} 0.5\n',
            f'vllm:kv_cache_usage_perc{{engine="1",model_name="{LLAMA}"}} 0.25\n',
            "# TYPE vllm:cache_config_info gauge\n",
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n',
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="2000"} 1.0\n',
        ]
    )
    # Each engine's use from its own fraction of its own cache: 8000 of 16000, 8000 of 32000.
    assert parse_engine_metrics(text) == EngineMetrics(
        "vllm", KvCacheStats(48000, 16000, 32000), running=5, waiting=1
    )


def test_a_vllm_info_gauge_without_an_engine_label_stands_for_every_engine() -> None:
    text = (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{LLAMA}"}} 0.5\n'
        f'vllm:kv_cache_usage_perc{{engine="1",model_name="{LLAMA}"}} 0.25\n'
    ) + cache_info("1000", engine=None)
    metrics = parse_engine_metrics(text)
    assert metrics is not None
    assert metrics.kv == KvCacheStats(32000, 12000, 20000)


def test_vllm_engines_without_a_matching_info_gauge_leave_kv_unknown() -> None:
    text = (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{LLAMA}"}} 0.5\n'
        f'vllm:kv_cache_usage_perc{{engine="2",model_name="{LLAMA}"}} 0.5\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="10"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="10"} 1.0\n'
    )
    assert parse_engine_metrics(text) == EngineMetrics("vllm", None, None, None)


def test_repeats_of_one_engines_info_gauge_are_one_cache() -> None:
    text = vllm_gauge("vllm:kv_cache_usage_perc", "0.5") + (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="10",pid="11"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="10",pid="12"} 1.0\n'
    )
    metrics = parse_engine_metrics(text)
    assert metrics is not None
    assert metrics.kv == KvCacheStats(160, 80, 80)


def test_the_deprecated_vllm_usage_gauge_is_read_when_the_new_one_is_absent() -> None:
    old = vllm_gauge("vllm:gpu_cache_usage_perc", "0.75") + cache_info("100")
    metrics = parse_engine_metrics(old)
    assert metrics is not None
    assert metrics.kv == KvCacheStats(1600, 1200, 400)
    both = old + vllm_gauge("vllm:kv_cache_usage_perc", "0.5")
    metrics = parse_engine_metrics(both)
    assert metrics is not None
    assert metrics.kv == KvCacheStats(1600, 800, 800)


@pytest.mark.parametrize(
    ("text", "kv"),
    [
        # Before vLLM profiled its memory, or an info gauge that is not the one we know.
        (vllm_gauge("vllm:kv_cache_usage_perc", "0.5") + cache_info("None"), None),
        (vllm_gauge("vllm:kv_cache_usage_perc", "0.5") + cache_info("100", "sixteen"), None),
        (vllm_gauge("vllm:kv_cache_usage_perc", "0.5"), None),
        (cache_info("100"), None),
        (vllm_gauge("vllm:kv_cache_usage_perc", "NaN") + cache_info("100"), None),
        (vllm_gauge("vllm:kv_cache_usage_perc", "+Inf") + cache_info("100"), None),
        # Half up (Python's round would give 0), and clamped into [0, capacity].
        (vllm_gauge("vllm:kv_cache_usage_perc", "0.03125") + cache_info("1"), (16, 1, 15)),
        (vllm_gauge("vllm:kv_cache_usage_perc", "0.0") + cache_info("1"), (16, 0, 16)),
        (vllm_gauge("vllm:kv_cache_usage_perc", "1.02") + cache_info("1"), (16, 16, 0)),
        (vllm_gauge("vllm:kv_cache_usage_perc", "-0.1") + cache_info("1"), (16, 0, 16)),
        (vllm_gauge("vllm:kv_cache_usage_perc", "0.5") + cache_info("0"), (0, 0, 0)),
    ],
)
def test_vllm_kv_edges(text: str, kv: tuple[int, int, int] | None) -> None:
    metrics = parse_engine_metrics(text)
    assert metrics is not None
    assert metrics.engine == "vllm"
    assert metrics.kv == (None if kv is None else KvCacheStats(*kv))


def test_vllm_queue_without_kv_figures() -> None:
    text = vllm_gauge("vllm:num_requests_running", "7") + vllm_gauge(
        "vllm:num_requests_waiting", "4"
    )
    assert parse_engine_metrics(text) == EngineMetrics("vllm", None, running=7, waiting=4)


def test_the_model_filter_keeps_the_named_model_and_unlabelled_series() -> None:
    text = (
        vllm_gauge("vllm:num_requests_running", "7")
        + f'vllm:num_requests_running{{engine="0",model_name="{QWEN}"}} 100.0\n'
        + "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 4.0\n"
    )
    assert parse_engine_metrics(text, model=LLAMA) == EngineMetrics("vllm", None, 7, 4)
    assert parse_engine_metrics(text, model=QWEN) == EngineMetrics("vllm", None, 100, 4)
    assert parse_engine_metrics(text) == EngineMetrics("vllm", None, 107, 4)


def test_one_engine_serving_two_models_has_one_cache() -> None:
    """A single engine that labels its cache usage under each model it serves (as the mock
    engine does): the queues add up, the cache is counted once."""
    text = "".join(
        [
            "# TYPE vllm:num_requests_running gauge\n",
            f'vllm:num_requests_running{{engine="0",model_name="{LLAMA}"}} 2.0\n',
            f'vllm:num_requests_running{{engine="0",model_name="{QWEN}"}} 5.0\n',
            "# TYPE vllm:kv_cache_usage_perc gauge\n",
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{LLAMA}"}} 0.5\n',
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{QWEN}"}} 0.5\n',
        ]
    ) + cache_info("100")
    assert parse_engine_metrics(text) == EngineMetrics(
        "vllm", KvCacheStats(1600, 800, 800), running=7, waiting=None
    )
    assert parse_engine_metrics(text, model=QWEN) == EngineMetrics(
        "vllm", KvCacheStats(1600, 800, 800), running=5, waiting=None
    )


SGLANG_LABELS = (
    'engine_type="unified",model_name="{model}",moe_ep_rank="0",pp_rank="0",tp_rank="{tp}"'
)


def sglang_family(name: str, kind: str, values: tuple[str, str], model: str = QWEN) -> str:
    """One gauge or counter as SGLang writes it with tensor parallelism 2: a series per rank."""
    lines = [f"# HELP {name} {name.split(':')[1].replace('_', ' ')}.", f"# TYPE {name} {kind}"]
    for tp, value in enumerate(values):
        labels = SGLANG_LABELS.format(model=model, tp=tp)
        lines.append(f"{name}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


SGLANG = (
    PROCESS
    + sglang_family("sglang:prompt_tokens_total", "counter", ("8.128902e+06", "8.128902e+06"))
    + sglang_family("sglang:generation_tokens_total", "counter", ("7.557572e+06", "7.557572e+06"))
    + sglang_family("sglang:num_running_reqs", "gauge", ("4.0", "4.0"))
    + sglang_family("sglang:num_used_tokens", "gauge", ("51234.0", "51234.0"))
    + sglang_family("sglang:token_usage", "gauge", ("0.26", "0.26"))
    + sglang_family("sglang:max_total_num_tokens", "gauge", ("200000.0", "200000.0"))
    + sglang_family("sglang:gen_throughput", "gauge", ("812.5", "812.5"))
    + sglang_family("sglang:num_queue_reqs", "gauge", ("1.0", "1.0"))
    + sglang_family("sglang:cache_hit_rate", "gauge", ("0.0075", "0.0075"))
    + f"""\
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{{model_name="{QWEN}"}} 2.3518979474117756e+06
sglang:time_to_first_token_seconds_bucket{{le="0.001",model_name="{QWEN}"}} 0.0
sglang:time_to_first_token_seconds_bucket{{le="0.5",model_name="{QWEN}"}} 3.0
sglang:time_to_first_token_seconds_bucket{{le="+Inf",model_name="{QWEN}"}} 11008.0
sglang:time_to_first_token_seconds_count{{model_name="{QWEN}"}} 11008.0
# HELP sglang:queue_time_seconds Histogram of queueing time in seconds.
# TYPE sglang:queue_time_seconds histogram
sglang:queue_time_seconds_sum{{model_name="{QWEN}"}} 12.5
sglang:queue_time_seconds_bucket{{le="0.0",model_name="{QWEN}"}} 0.0
sglang:queue_time_seconds_bucket{{le="+Inf",model_name="{QWEN}"}} 11008.0
sglang:queue_time_seconds_count{{model_name="{QWEN}"}} 11008.0
"""
)


def test_an_sglang_scrape_reads_tensor_parallel_rank_0_only() -> None:
    assert parse_engine_metrics(SGLANG) == EngineMetrics(
        engine="sglang",
        kv=KvCacheStats(capacity_tokens=200000, used_tokens=51234, free_tokens=148766),
        running=4,
        waiting=1,
    )
    assert parse_engine_metrics(SGLANG, model=QWEN) == parse_engine_metrics(SGLANG)
    assert parse_engine_metrics(SGLANG, model=LLAMA) == EngineMetrics("sglang", None, None, None)


def test_sglang_token_usage_stands_in_for_used_tokens() -> None:
    text = SGLANG.replace("sglang:num_used_tokens", "sglang:some_renamed_gauge")
    metrics = parse_engine_metrics(text)
    assert metrics is not None
    assert metrics.kv == KvCacheStats(200000, 52000, 148000)


def test_sglang_without_a_pool_size_has_no_kv_figures() -> None:
    text = SGLANG.replace("sglang:max_total_num_tokens", "sglang:renamed_pool_size")
    assert parse_engine_metrics(text) == EngineMetrics("sglang", None, running=4, waiting=1)
    no_use = SGLANG.replace("sglang:num_used_tokens", "sglang:a").replace(
        "sglang:token_usage", "sglang:b"
    )
    assert parse_engine_metrics(no_use) == EngineMetrics("sglang", None, running=4, waiting=1)


def sglang_dp(name: str, values: dict[tuple[str, str], str]) -> str:
    """A gauge with data-parallel ranks, each with its tensor-parallel ranks."""
    lines = [f"# TYPE {name} gauge"]
    for (dp, tp), value in values.items():
        lines.append(f'{name}{{dp_rank="{dp}",model_name="{QWEN}",tp_rank="{tp}"}} {value}')
    return "\n".join(lines) + "\n"


def test_sglang_data_parallel_ranks_are_summed() -> None:
    text = (
        sglang_dp("sglang:max_total_num_tokens", {(d, t): "100000" for d in "01" for t in "01"})
        + sglang_dp(
            "sglang:num_used_tokens",
            {("0", "0"): "1000", ("0", "1"): "1000", ("1", "0"): "3000", ("1", "1"): "3000"},
        )
        + sglang_dp(
            "sglang:num_running_reqs",
            {("0", "0"): "2", ("0", "1"): "2", ("1", "0"): "5", ("1", "1"): "5"},
        )
        + sglang_dp("sglang:num_queue_reqs", {("0", "0"): "0", ("1", "0"): "3"})
    )
    assert parse_engine_metrics(text) == EngineMetrics(
        "sglang", KvCacheStats(200000, 4000, 196000), running=7, waiting=3
    )


def test_sglang_reads_the_lowest_rank_present() -> None:
    # A release that published only from the last pipeline stage still reads, once.
    text = (
        "# TYPE sglang:num_running_reqs gauge\n"
        f'sglang:num_running_reqs{{model_name="{QWEN}",pp_rank="1",tp_rank="0"}} 6.0\n'
        "# TYPE sglang:num_queue_reqs gauge\n"
        f'sglang:num_queue_reqs{{model_name="{QWEN}",tp_rank="10"}} 1.0\n'
        f'sglang:num_queue_reqs{{model_name="{QWEN}",tp_rank="2"}} 2.0\n'
    )
    assert parse_engine_metrics(text) == EngineMetrics("sglang", None, running=6, waiting=2)


def test_sglang_used_tokens_are_clamped_to_the_pool() -> None:
    text = sglang_dp("sglang:max_total_num_tokens", {("0", "0"): "100"}) + sglang_dp(
        "sglang:num_used_tokens", {("0", "0"): "130"}
    )
    metrics = parse_engine_metrics(text)
    assert metrics is not None
    assert metrics.kv == KvCacheStats(100, 100, 0)


@pytest.mark.parametrize(
    "text",
    [
        "",
        PROCESS,
        "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n",
        # Only families this module does not read.
        VLLM.replace("vllm:", "vllm:unread_"),
        SGLANG.replace("sglang:", "sglang_old_"),
    ],
)
def test_a_scrape_without_known_families_is_none(text: str) -> None:
    assert parse_engine_metrics(text) is None


@pytest.mark.parametrize(
    "text",
    [
        'vllm:num_requests_running{engine="0" 3.0\n',
        "vllm:num_requests_running not-a-number\n",
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=0} 3\n",
    ],
)
def test_text_the_prometheus_parser_refuses_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="not Prometheus text"):
        parse_engine_metrics(text)


PROMETHEUS_PIECES = st.sampled_from(
    [
        "vllm:num_requests_running",
        "vllm:cache_config_info",
        "sglang:num_used_tokens",
        "# TYPE ",
        "# HELP ",
        " gauge",
        " histogram",
        "{",
        "}",
        'engine="0"',
        'tp_rank="1"',
        'num_gpu_blocks="None"',
        "=",
        '"',
        ",",
        " ",
        "\n",
        "1.5",
        "NaN",
        "-Inf",
        "\\",
        "_bucket",
    ]
)


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.lists(PROMETHEUS_PIECES, max_size=30).map("".join), st.text(max_size=80)))
def test_any_text_is_read_or_refused_with_a_value_error(text: str) -> None:
    try:
        metrics = parse_engine_metrics(text, model=LLAMA)
    except ValueError:
        return
    if metrics is not None and metrics.kv is not None:
        kv = metrics.kv
        assert 0 <= kv.used_tokens <= kv.capacity_tokens
        assert kv.free_tokens == kv.capacity_tokens - kv.used_tokens
