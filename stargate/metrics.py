"""Every Prometheus metric of a replica, defined once, on a registry passed in.

A replica owns a private `CollectorRegistry` (never the process-global default), so tests and
several in-process replicas never share counters, and the exposition has no process collectors,
as in the Rust replica. Every name gets the `--metrics-prefix` (default `stargate_`). Label names
are declared in alphabetical order so the text output matches the Rust exposition.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from stargate.asgi import answer_lifespan

__all__ = ["Metrics", "ProxyMetrics", "ReadinessMetrics", "metrics_asgi_app"]

# `_created` series double the exposition for no operator value; the Rust replica has none.
disable_created_metrics()  # type: ignore[no-untyped-call]

READINESS_REASONS = ("stabilized", "deadline", "disabled", "shutdown")


@dataclass(frozen=True, slots=True)
class ReadinessMetrics:
    """The readiness warmup's series (spec decision 2; the Rust PRs added none)."""

    ready: Gauge
    warmup_promotions: Counter
    time_to_ready_seconds: Gauge
    stable_samples: Gauge
    sampled_backend_count: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry, prefix: str) -> ReadinessMetrics:
        promotions = Counter(
            f"{prefix}readiness_warmup_promotions",
            "Warmup promotions by reason (stabilized, deadline, disabled, shutdown).",
            labelnames=("reason",),
            registry=registry,
        )
        for reason in READINESS_REASONS:
            promotions.labels(reason=reason)
        return cls(
            ready=Gauge(
                f"{prefix}readiness_ready",
                "1 when /readyz answers 200 (warmup over and not draining), else 0.",
                registry=registry,
            ),
            warmup_promotions=promotions,
            time_to_ready_seconds=Gauge(
                f"{prefix}readiness_time_to_ready_seconds",
                "Seconds from warmup start to promotion (0 until the replica becomes ready).",
                registry=registry,
            ),
            stable_samples=Gauge(
                f"{prefix}readiness_stable_samples",
                "Length of the current streak of equal nonzero backend-count samples.",
                registry=registry,
            ),
            sampled_backend_count=Gauge(
                f"{prefix}readiness_sampled_backend_count",
                "Total active backend count read by the last warmup sample.",
                registry=registry,
            ),
        )


# Upstream latency ranges from milliseconds to multi-minute cold loads: buckets reach 600 s.
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
)
ROUTING_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1)
REPLAY_BUCKETS = tuple(
    float(b) for b in (0, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
)


@dataclass(frozen=True, slots=True)
class ProxyMetrics:
    """The data plane's series (control-plane spec §5, data-plane spec §3.10)."""

    requests: Counter
    responses: Counter
    attempts: Counter
    retries: Counter
    retry_exhausted: Counter
    selections: Counter
    admission_rejections: Counter
    duration: Histogram
    routing_duration: Histogram
    replay_buffer_bytes: Histogram
    in_flight: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry, prefix: str) -> ProxyMetrics:
        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"{prefix}{name}", doc, labelnames=labels, registry=registry)

        return cls(
            requests=counter(
                "requests_total",
                "Finished proxied requests by final status (400s are not counted).",
                "inference_server_id",
                "model",
                "routing_key",
                "status",
            ),
            responses=counter(
                "proxy_responses_total",
                "Proxy responses by endpoint and status class (2xx, 4xx, 5xx...).",
                "endpoint",
                "status_class",
            ),
            attempts=counter(
                "proxy_attempts_total",
                "Upstream attempts by result (upstream_<code> or proxy_<code>).",
                "inference_server_id",
                "model",
                "result",
                "routing_key",
            ),
            retries=counter(
                "proxy_retries_total", "Retries by reason.", "model", "reason", "routing_key"
            ),
            retry_exhausted=counter(
                "proxy_retry_exhausted_total",
                "Requests that wanted a retry but could not have one, by reason.",
                "model",
                "reason",
                "routing_key",
            ),
            selections=counter(
                "routing_selections_total",
                "Cluster choices used for attempts.",
                "algorithm",
                "model",
                "routing_key",
                "selection",
            ),
            admission_rejections=counter(
                "admission_rejections_total",
                "Requests refused by input-work admission before routing.",
                "model",
                "reason",
                "routing_key",
            ),
            duration=Histogram(
                f"{prefix}proxy_duration_seconds",
                "Time from request start to the upstream response head.",
                labelnames=("inference_server_id", "model", "routing_key"),
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            routing_duration=Histogram(
                f"{prefix}routing_duration_seconds",
                "Time to select a backend (first selection of a request).",
                labelnames=("model", "routing_key"),
                buckets=ROUTING_BUCKETS,
                registry=registry,
            ),
            replay_buffer_bytes=Histogram(
                f"{prefix}proxy_replay_buffer_bytes",
                "Request body bytes kept for replay, per attempt.",
                labelnames=("model",),
                buckets=REPLAY_BUCKETS,
                registry=registry,
            ),
            in_flight=Gauge(
                f"{prefix}proxy_requests_in_flight",
                "Proxied requests in progress (including streams).",
                registry=registry,
            ),
        )


class Metrics:
    """All metric families of one replica."""

    def __init__(self, registry: CollectorRegistry, prefix: str = "stargate_") -> None:
        self.registry = registry
        self.prefix = prefix
        self.readiness = ReadinessMetrics.create(registry, prefix)
        self.proxy = ProxyMetrics.create(registry, prefix)
        self.active_inference_servers = Gauge(
            f"{prefix}active_inference_servers",
            "Active backends per (routing key, model) target; 0 once a target empties.",
            labelnames=("model", "routing_key"),
            registry=registry,
        )

    def set_active_inference_servers(self, routing_key: str | None, model: str, count: int) -> None:
        """Publish one target's active backend count (the series stays at 0 when it empties)."""
        self.active_inference_servers.labels(model=model, routing_key=routing_key or "").set(count)


ASGIScope = MutableMapping[str, Any]
ASGIReceive = Callable[[], Awaitable[MutableMapping[str, Any]]]
ASGISend = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def metrics_asgi_app(
    registry: CollectorRegistry,
) -> Callable[[ASGIScope, ASGIReceive, ASGISend], Awaitable[None]]:
    """A minimal ASGI app serving `GET /metrics` from `registry`, and nothing else.

    It answers the lifespan protocol itself: Hypercorn's trio worker fails at start-up on an app
    that ignores lifespan (stack-notes P9), which `prometheus_client.make_asgi_app` does.
    """

    async def app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            status, headers, body = 404, [(b"content-type", b"text/plain")], b"not found\n"
        elif scope["method"] not in ("GET", "HEAD"):
            status, headers, body = 405, [(b"allow", b"GET, HEAD")], b""
        else:
            status, body = 200, generate_latest(registry)
            headers = [(b"content-type", CONTENT_TYPE_LATEST.encode())]
            if scope["method"] == "HEAD":
                headers.append((b"content-length", str(len(body)).encode()))
                body = b""
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app
