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

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

__all__ = ["Metrics", "ReadinessMetrics", "metrics_asgi_app"]

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


class Metrics:
    """All metric families of one replica."""

    def __init__(self, registry: CollectorRegistry, prefix: str = "stargate_") -> None:
        self.registry = registry
        self.prefix = prefix
        self.readiness = ReadinessMetrics.create(registry, prefix)
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
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
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
