"""A mock OpenAI-compatible inference server (`stargate mock-backend`) for demos, tests and
benchmarks: deterministic answers, streaming and not, with latencies, failures, dropped streams,
a prefix-cache model and a batching model (running slots, a KV cache, a FIFO queue, reported
through vLLM's `/metrics`, `/kv-cache/stats` and an NDJSON stats stream) controllable at run time
through `/test-control`."""

from stargate.mock.app import DroppedConnection, MockBackend, MockBackendConfig
from stargate.mock.cli import mock_backend_command, run_mock_backend
from stargate.mock.control import BatchingKnobs, DropMidStream, FailNext, Knobs, PrefixCacheKnobs

__all__ = [
    "BatchingKnobs",
    "DropMidStream",
    "DroppedConnection",
    "FailNext",
    "Knobs",
    "MockBackend",
    "MockBackendConfig",
    "PrefixCacheKnobs",
    "mock_backend_command",
    "run_mock_backend",
]
