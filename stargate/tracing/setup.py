"""Build the OpenTelemetry SDK for a replica from `TracingConfig` (docs/tracing.md, "Export").

Imported by the runtime only when `--otel-endpoint` is set. Spans go through a
`BatchSpanProcessor` (its own export thread, so exporting never runs on the trio loop) to an
`OTLPSpanExporter` over gRPC: plaintext for an `http://` endpoint, TLS for `https://`. The
replica's tracer provider is its own, not installed as the process-wide one: a process that builds
more than one replica (the tests do) must not have them share, or fight over, a global provider.
The propagator is installed globally, as in the Rust router: W3C TraceContext only.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import trio
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.propagate import set_global_textmap
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from stargate import __version__
from stargate.config import TracingConfig
from stargate.tracing.request import RequestTracer

__all__ = [
    "ACCESS_TOKEN_METADATA",
    "NO_TOKEN_WARNING",
    "SHUTDOWN_TIMEOUT_SECONDS",
    "Tracing",
    "setup_tracing",
]

log = logging.getLogger(__name__)

ACCESS_TOKEN_METADATA = "lightstep-access-token"
"""The gRPC metadata key that carries `tracingAccessToken` (the Rust router's)."""

NO_TOKEN_WARNING = "no tracingAccessToken; OTLP trace export is unauthenticated"

SHUTDOWN_TIMEOUT_SECONDS = 5.0
"""How long the replica's exit waits for the last spans to be exported. A collector that does
not answer must not hold a draining replica past this: its spans are dropped instead."""

# They log a WARNING quoting the client's `tracestate` when it is malformed: client input, one
# line per request. Such a header is ignored either way.
_CLIENT_INPUT_LOGGERS = ("opentelemetry.trace.span", "opentelemetry.trace.propagation.tracecontext")


class Tracing:
    """A replica's tracing: the `RequestTracer` the proxy uses, and the SDK behind it."""

    def __init__(
        self,
        provider: TracerProvider,
        tracer: RequestTracer,
        *,
        shutdown_timeout: float = SHUTDOWN_TIMEOUT_SECONDS,
    ) -> None:
        self.provider = provider
        self.tracer = tracer
        self.shutdown_timeout = shutdown_timeout

    async def aclose(self) -> None:
        """Export what is queued, then stop the export thread, within `shutdown_timeout` seconds.

        The SDK's shutdown blocks (it joins the export thread, which may be retrying an
        unreachable collector), so it runs in a worker thread that is abandoned at the timeout;
        the export thread is a daemon and does not keep the process alive.
        """
        timeout = self.shutdown_timeout
        with trio.move_on_after(timeout) as scope:
            await trio.to_thread.run_sync(self.provider.shutdown, abandon_on_cancel=True)
        if scope.cancelled_caught:
            log.warning(
                "trace export did not finish within %.1f s of shutdown; unexported spans dropped",
                timeout,
            )


def setup_tracing(
    config: TracingConfig,
    access_token: str | None = None,
    *,
    instance_id: str | None = None,
    exporter: SpanExporter | None = None,
) -> Tracing | None:
    """The replica's tracing, or None when `--otel-endpoint` is not set (nothing is recorded).

    `access_token` is the secrets file's `tracingAccessToken`, sent as `lightstep-access-token`
    metadata with every export; without one the export is unauthenticated, which is logged once
    as a WARNING. `instance_id` (the replica's `--stargate-id`) tells replicas apart in a trace
    backend. `exporter` replaces the OTLP exporter (tests).
    """
    if config.endpoint is None:
        return None
    set_global_textmap(TraceContextTextMapPropagator())
    for name in _CLIENT_INPUT_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    attributes: dict[str, str] = {
        "service.name": config.service_name,
        "service.version": __version__,
    }
    if instance_id:
        attributes["service.instance.id"] = instance_id
    # Our own shutdown (`Tracing.aclose`) flushes with a bound; the SDK's atexit hook has none.
    provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
    if exporter is None:
        if not access_token:
            log.warning(NO_TOKEN_WARNING)
        exporter = OTLPSpanExporter(
            endpoint=config.endpoint,
            insecure=config.endpoint.startswith("http://"),
            headers=((ACCESS_TOKEN_METADATA, access_token),) if access_token else None,
        )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info(
        "tracing on: OTLP/gRPC export to %s as service %s",
        _without_userinfo(config.endpoint),
        config.service_name,
    )
    return Tracing(provider, RequestTracer(provider.get_tracer("stargate", __version__)))


def _without_userinfo(endpoint: str) -> str:
    """The endpoint as logged: scheme, host and port, never a `user:password@` part."""
    parts = urlsplit(endpoint)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
