"""OpenTelemetry tracing of proxied requests (docs/tracing.md).

Two modules, imported only when `--otel-endpoint` is set, so that a replica without tracing never
loads the OpenTelemetry packages and its request path never touches them:

* `stargate.tracing.setup`: `setup_tracing` builds the SDK (W3C TraceContext propagation, a
  batching OTLP/gRPC exporter) from `TracingConfig` and returns a `Tracing`, whose `aclose`
  flushes it with a bounded timeout when the replica exits.
* `stargate.tracing.request`: `RequestTracer` and the per-request `RequestSpan` / `AttemptSpan`
  that the proxy calls. The proxy holds an optional `RequestTracer` (None when tracing is off)
  and pays one `is None` branch per request and per attempt for it.

This package imports nothing of the proxy (the proxy imports it): what it reads of a request or
of the retry state it names as protocols in `request.py`.
"""
