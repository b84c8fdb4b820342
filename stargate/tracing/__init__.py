"""OpenTelemetry tracing of proxied requests (docs/tracing.md).

Two modules, imported only when `--otel-endpoint` is set, so that a replica without tracing never
loads the OpenTelemetry packages and its request path never touches them:

* `stargate.tracing.setup`: `setup_tracing` builds the SDK (W3C TraceContext propagation, a
  batching OTLP/gRPC exporter) from `TracingConfig` and returns a `Tracing`, whose `aclose`
  flushes it with a bounded timeout when the replica exits.
* `stargate.tracing.request`: `RequestTracer` and the per-request `RequestSpan` / `AttemptSpan`
  that the proxy calls. The proxy holds an optional `RequestTracer` (None when tracing is off)
  and pays one `is None` branch per request and per attempt for it.

The package itself holds only `start_tracing`, which the runtime calls at start-up and which
imports `setup` only when tracing is on.

This package imports nothing of the proxy (the proxy imports it): what it reads of a request or
of the retry state it names as protocols in `request.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stargate.config import ServeConfig
from stargate.secrets_file import SecretsFileError, tracing_access_token
from stargate.serving import StartupError

if TYPE_CHECKING:  # loaded only with --otel-endpoint (`start_tracing`)
    from stargate.tracing.setup import Tracing

__all__ = ["start_tracing"]


def start_tracing(config: ServeConfig) -> Tracing | None:
    """OpenTelemetry tracing with --otel-endpoint, else None (the SDK is not even imported: a
    replica without tracing never loads it; docs/tracing.md). A tracing token that cannot be read
    from the secrets file fails start-up (`StartupError`, naming the file and key, never a
    value)."""
    if not config.tracing.enabled:
        return None
    from stargate.tracing.setup import setup_tracing

    try:
        # Read once: the exporter's gRPC metadata is fixed when it is built (docs/tracing.md,
        # Token).
        path = config.secrets.path
        token = None if path is None else tracing_access_token(path)
        return setup_tracing(config.tracing, token, instance_id=config.stargate_id)
    except SecretsFileError as error:
        raise StartupError(f"cannot start the trace exporter: {error}") from error
