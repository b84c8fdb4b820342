"""The mock engine's Prometheus metrics, under vLLM's names, so that anything that scrapes a vLLM
engine for its load (a router, a dashboard, an autoscaler) reads real numbers from the mock.

Pure (no I/O, no clock): the request path only adds to plain ints and floats (`ModelMetrics`,
`Histogram.observe` is one bisect and two additions), and the text is formatted on scrape by
`render`, in the Prometheus text format 0.0.4 as `prometheus_client` writes it (without its
`_created` series). Every series is labelled `model_name` and `engine="0"`, one per served model.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "BLOCK_SIZE",
    "PROMPT_TOKEN_BUCKETS",
    "QUEUE_TIME_BUCKETS",
    "TTFT_BUCKETS",
    "EngineState",
    "Histogram",
    "ModelMetrics",
    "one_two_five_buckets",
    "render",
]

# vLLM's default KV block size, in tokens; `vllm:cache_config_info` reports the KV cache in these.
BLOCK_SIZE = 16

# vLLM's buckets for these histograms (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
QUEUE_TIME_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's `build_1_2_5_buckets`)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


# vLLM bounds them by the model's context length; the mock has none, so a million tokens.
PROMPT_TOKEN_BUCKETS = one_two_five_buckets(1_000_000)


@dataclass(slots=True)
class Histogram:
    """A Prometheus histogram: per-bucket counts (cumulated on render), a sum and a count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(self.bounds):
            raise ValueError("histogram bounds must be sorted")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (`le`).
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(slots=True)
class ModelMetrics:
    """One served model's counters and histograms, since the process started (`reset` on
    `/test-control` leaves them alone: Prometheus counters only go up)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    successes: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(QUEUE_TIME_BUCKETS))
    prompt_lengths: Histogram = field(default_factory=lambda: Histogram(PROMPT_TOKEN_BUCKETS))


@dataclass(frozen=True, slots=True)
class EngineState:
    """The gauges at scrape time: per model `(running, waiting)`, and the KV cache (capacity 0 =
    unlimited: usage 0 and no `vllm:cache_config_info` series)."""

    queues: dict[str, tuple[int, int]]
    kv_cache_tokens: int
    kv_used_tokens: int

    @property
    def num_gpu_blocks(self) -> int:
        """The KV cache in vLLM blocks of `BLOCK_SIZE` tokens (rounded down)."""
        return self.kv_cache_tokens // BLOCK_SIZE

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_cache_tokens if self.kv_cache_tokens else 0.0


def _number(value: float) -> str:
    """A sample value or bucket bound as prometheus_client writes it (`1.0`, `+Inf`)."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in pairs) + "}"


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: Sequence[tuple[str, str]], value: float) -> None:
        self.lines.append(f"{name}{_labels(labels)} {_number(value)}")

    def histogram(self, name: str, labels: Sequence[tuple[str, str]], data: Histogram) -> None:
        cumulative = 0
        for bound, count in zip((*data.bounds, math.inf), data.counts, strict=True):
            cumulative += count
            self.sample(f"{name}_bucket", [*labels, ("le", _number(bound))], cumulative)
        self.sample(f"{name}_count", labels, cumulative)
        self.sample(f"{name}_sum", labels, data.total)


_COUNTERS: tuple[tuple[str, str, Callable[[ModelMetrics], int]], ...] = (
    ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", lambda m: m.prompt_tokens),
    (
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        lambda m: m.generation_tokens,
    ),
)
_HISTOGRAMS: tuple[tuple[str, str, Callable[[ModelMetrics], Histogram]], ...] = (
    (
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        lambda m: m.ttft,
    ),
    (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        lambda m: m.queue_time,
    ),
    (
        "vllm:request_prompt_tokens",
        "Number of prefill tokens processed.",
        lambda m: m.prompt_lengths,
    ),
)


def render(state: EngineState, metrics: dict[str, ModelMetrics]) -> str:
    """The `/metrics` text: one series per model in `metrics` (in its order)."""
    out = _Writer()
    series = [(model, [("engine", "0"), ("model_name", model)]) for model in metrics]
    for name, help_text, position in (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", 0),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", 1),
    ):
        out.family(name, "gauge", help_text)
        for model, labels in series:
            out.sample(name, labels, state.queues.get(model, (0, 0))[position])
    name = "vllm:kv_cache_usage_perc"
    out.family(name, "gauge", "KV-cache usage. 1 means 100 percent usage.")
    for _, labels in series:
        out.sample(name, labels, state.kv_usage)
    for name, help_text, count in _COUNTERS:
        out.family(name, "counter", help_text)
        for model, labels in series:
            out.sample(name, labels, count(metrics[model]))
    name = "vllm:request_success_total"
    out.family(name, "counter", "Count of successfully processed requests.")
    for model, labels in series:
        out.sample(name, [*labels, ("finished_reason", "stop")], metrics[model].successes)
    for name, help_text, histogram in _HISTOGRAMS:
        out.family(name, "histogram", help_text)
        for model, labels in series:
            out.histogram(name, labels, histogram(metrics[model]))
    if state.kv_cache_tokens:
        name = "vllm:cache_config_info"
        out.family(name, "gauge", "Information of the LLMEngine CacheConfig")
        config = [("block_size", str(BLOCK_SIZE)), ("num_gpu_blocks", str(state.num_gpu_blocks))]
        for _, labels in series:
            out.sample(name, [*labels, *config], 1)
    return "\n".join(out.lines) + "\n"
