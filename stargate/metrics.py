"""Every Prometheus metric of a replica, defined once, on a registry passed in.

A replica owns a private `CollectorRegistry` (never the process-global default), so tests and
several in-process replicas never share counters, and the exposition has no process collectors,
as in the Rust replica. Every name gets the `--metrics-prefix` (default `stargate_`). Label names
are declared in alphabetical order so the text output matches the Rust exposition.

Series follow the fleet (docs/metrics.md): a label set that names a backend
(`inference_server_id`) or a target (`model`, `routing_key`) that has left every live
registration is removed `SERIES_GRACE_SECONDS` later. Which ones is decided by `SeriesSweeper`
(pure: label sets, liveness and a clock value in, label sets to remove out); `DepartedSeriesSweep`
applies it to the registry, every sweep interval once the runtime starts its `run`. `/metrics` is
rendered in a worker thread with the cyclic garbage collector paused, so a large exposition
delays the trio loop that serves requests by a GIL switch interval at a time rather than
stalling it throughout.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from stargate.asgi import answer_lifespan

__all__ = [
    "BACKEND_CONNECTION_STATES",
    "SERIES_GRACE_SECONDS",
    "SERIES_SWEEP_INTERVAL_SECONDS",
    "BackendConnections",
    "DepartedSeriesSweep",
    "FleetLabels",
    "HttpMetrics",
    "LiveFleet",
    "Metrics",
    "ProxyMetrics",
    "ReadinessMetrics",
    "SeriesKey",
    "SeriesSweeper",
    "TlsMetrics",
    "metrics_asgi_app",
    "sweep_interval",
]

log = logging.getLogger(__name__)

# `_created` series double the exposition for no operator value; the Rust replica has none.
disable_created_metrics()  # type: ignore[no-untyped-call]

READINESS_REASONS = ("stabilized", "deadline", "disabled", "shutdown")


@dataclass(frozen=True, slots=True)
class ReadinessMetrics:
    """The readiness warmup's series (docs/decisions.md, D2; the Rust PRs added none)."""

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
    """The data plane's series (docs/data-plane.md, Metrics)."""

    requests: Counter
    responses: Counter
    attempts: Counter
    retries: Counter
    retry_exhausted: Counter
    selections: Counter
    kv_free_token_fallbacks: Counter
    admission_rejections: Counter
    duration: Histogram
    routing_duration: Histogram
    replay_buffer_bytes: Histogram
    in_flight: Gauge
    # docs/outliers.md, "Metrics and logs".
    outlier_ejections: Counter
    outlier_ejections_refused: Counter
    outlier_ejected: Gauge
    slow_start_left_out: Counter

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
            kv_free_token_fallbacks=counter(
                "routing_kv_free_token_fallback_selections_total",
                "Pulsar choices made after skipping a higher-ranked cluster without room in its "
                "KV cache for the request.",
                "algorithm",
                "model",
                "routing_key",
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
            outlier_ejections=counter(
                "outlier_ejections_total",
                "Backends ejected from routing by outlier detection, by reason "
                "(consecutive_5xx, consecutive_transport_failure).",
                "inference_server_id",
                "reason",
            ),
            outlier_ejections_refused=counter(
                "outlier_ejections_refused_total",
                "Ejections not made because --outlier-max-ejection-percent of the backends were "
                "ejected already, by reason.",
                "reason",
            ),
            outlier_ejected=Gauge(
                f"{prefix}outlier_ejected_backends",
                "Backends ejected by outlier detection now.",
                registry=registry,
            ),
            slow_start_left_out=counter(
                "slow_start_left_out_total",
                "Routing decisions a backend in its slow-start window sat out.",
                "inference_server_id",
            ),
        )

    # The request path writes through these rather than `family.labels(**kwargs)`: each takes
    # its label values in the family's (alphabetical) label order and finds the series with one
    # dict lookup (`_child`), a few hundred nanoseconds instead of 3-5 us per `labels()` call,
    # seven or more of which every proxied request made.

    def count_request(
        self, inference_server_id: str, model: str, routing_key: str, status: str
    ) -> None:
        _child(self.requests, (inference_server_id, model, routing_key, status)).inc()

    def count_response(self, endpoint: str, status_class: str) -> None:
        _child(self.responses, (endpoint, status_class)).inc()

    def count_attempt(
        self, inference_server_id: str, model: str, result: str, routing_key: str
    ) -> None:
        _child(self.attempts, (inference_server_id, model, result, routing_key)).inc()

    def count_retry(self, model: str, reason: str, routing_key: str) -> None:
        _child(self.retries, (model, reason, routing_key)).inc()

    def count_retry_exhausted(self, model: str, reason: str, routing_key: str) -> None:
        _child(self.retry_exhausted, (model, reason, routing_key)).inc()

    def count_selection(self, algorithm: str, model: str, routing_key: str, selection: str) -> None:
        _child(self.selections, (algorithm, model, routing_key, selection)).inc()

    def count_kv_free_token_fallback(self, algorithm: str, model: str, routing_key: str) -> None:
        _child(self.kv_free_token_fallbacks, (algorithm, model, routing_key)).inc()

    def count_admission_rejection(self, model: str, reason: str, routing_key: str) -> None:
        _child(self.admission_rejections, (model, reason, routing_key)).inc()

    def observe_duration(
        self, inference_server_id: str, model: str, routing_key: str, seconds: float
    ) -> None:
        _child(self.duration, (inference_server_id, model, routing_key)).observe(seconds)

    def observe_routing_duration(self, model: str, routing_key: str, seconds: float) -> None:
        _child(self.routing_duration, (model, routing_key)).observe(seconds)

    def observe_replay_buffer(self, model: str, size: int) -> None:
        _child(self.replay_buffer_bytes, (model,)).observe(size)

    def count_outlier_ejection(self, inference_server_id: str, reason: str) -> None:
        _child(self.outlier_ejections, (inference_server_id, reason)).inc()

    def count_outlier_ejection_refused(self, reason: str) -> None:
        _child(self.outlier_ejections_refused, (reason,)).inc()

    def count_slow_start_left_out(self, inference_server_id: str) -> None:
        _child(self.slow_start_left_out, (inference_server_id,)).inc()


def _child(family: Any, values: LabelValues) -> Any:
    """`family.labels(*values)`, found with one dict lookup when the series exists.

    `values` must be strings in the family's label order (as `labels()` would build its key).
    Nothing is cached outside the family: the lookup reads the family's own table of series,
    so a series that `DepartedSeriesSweep` removed is simply not found, and `labels()` creates
    it afresh, as it would have. The read takes no lock: it runs on the trio thread, where the
    series are also created and removed (a scrape thread only copies the table, under the lock),
    and a dict read is atomic under the GIL.
    """
    child = family._metrics.get(values)
    if child is None:
        child = family.labels(*values)
    return child


CONNECTION_REFUSAL_REASONS = ("full", "reserve")


@dataclass(frozen=True, slots=True)
class HttpMetrics:
    """The HTTP listener's client limits (stargate/http_limits.py; docs/http-serving.md)."""

    client_connections: Gauge
    connection_refusals: Counter
    request_body_timeouts: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry, prefix: str) -> HttpMetrics:
        refusals = Counter(
            f"{prefix}http_connection_refusals",
            "Client connections refused on the HTTP listener: full (accepted past "
            "--max-client-connections and the probe reserve, answered 503 or its HTTP/2 streams "
            "refused, then closed), reserve (a non-probe request on a reserve connection, "
            "answered 503).",
            labelnames=("reason",),
            registry=registry,
        )
        for reason in CONNECTION_REFUSAL_REASONS:
            refusals.labels(reason=reason)
        return cls(
            client_connections=Gauge(
                f"{prefix}http_client_connections",
                "Open client connections on the HTTP listener (the probe reserve included).",
                registry=registry,
            ),
            connection_refusals=refusals,
            request_body_timeouts=Counter(
                f"{prefix}http_request_body_timeouts",
                "Requests whose body had not arrived --request-body-timeout-ms after their head "
                "(answered 408, or cut if their response had started).",
                registry=registry,
            ),
        )


@dataclass(frozen=True, slots=True)
class TlsMetrics:
    """The served TLS identity (stargate/tls/reloader.py; docs/tls.md). Created only when TLS is
    configured, so a plaintext replica exports neither series."""

    reloads: Counter
    certificate_expiry: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry, prefix: str) -> TlsMetrics:
        return cls(
            reloads=Counter(
                f"{prefix}tls_reloads",
                "TLS material reloads by material type and result: success (a changed, valid "
                "pair now served to new handshakes), rejected (invalid; the last good one kept).",
                labelnames=("material_type", "result"),
                registry=registry,
            ),
            certificate_expiry=Gauge(
                f"{prefix}tls_certificate_expiry_seconds",
                "notAfter of the served certificate, in seconds since the epoch.",
                labelnames=("material_type",),
                registry=registry,
            ),
        )


@dataclass(frozen=True, slots=True)
class TunnelCounters:
    """The Rust tunnel counters (docs/tunnels.md, "Metrics"): connections evicted from a direct
    backend's set (`stale_connection`: none healthy before an attempt; `proxy_error`: an attempt
    failed on it) and the hot-path re-dials that followed (`success`, `error`)."""

    evictions: Counter
    hot_path_reconnects: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry, prefix: str) -> TunnelCounters:
        return cls(
            evictions=Counter(
                f"{prefix}quic_connection_evictions",
                "QUIC connections evicted from a direct backend's set, by reason.",
                labelnames=("inference_server_id", "reason"),
                registry=registry,
            ),
            hot_path_reconnects=Counter(
                f"{prefix}quic_hot_path_reconnect",
                "Direct backends re-dialed before an attempt, by result.",
                labelnames=("inference_server_id", "result"),
                registry=registry,
            ),
        )


BACKEND_CONNECTION_STATES = ("idle", "in_use", "waiting")

BackendConnectionRow = tuple[str, int, int, int]
"""One backend's `(inference_server_id, in_use, idle, waiting)`."""


class BackendConnections:
    """`proxy_backend_connections{inference_server_id,state}`: each registered backend's upstream
    connections, computed at scrape time (docs/metrics.md, "Upstream connections per backend").

    `in_use` (connections carrying a request or a stream), `idle` (kept alive for the next one)
    and `waiting` (requests queued for a connection because the backend is at
    `--proxy-max-connections-per-backend`). A collector rather than a gauge: the values are the
    connection pool's counters, read when `/metrics` is scraped, so nothing is written per
    request. The rows are set on the trio thread (`update`, from the metrics app's
    `before_render` hook) and only read by the render thread, which never touches the pool or
    the routing state. They list live registrations only, so a departed backend's series leave
    with it, at the first scrape after it left: gauges of a backend that is gone have no last
    increment to keep for a grace period.
    """

    DOC = (
        "Upstream connections per registered backend: in_use, idle (kept alive), and waiting "
        "(requests queued for a connection at --proxy-max-connections-per-backend)."
    )

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.name = f"{prefix}proxy_backend_connections"
        self._rows: tuple[BackendConnectionRow, ...] = ()
        registry.register(self)

    def update(self, rows: Iterable[BackendConnectionRow]) -> None:
        """Replace every row (on the trio thread; the render thread reads the new tuple whole)."""
        self._rows = tuple(rows)

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.name, self.DOC, labels=("inference_server_id", "state"))

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> list[Metric]:
        family = self._family()
        for server_id, in_use, idle, waiting in self._rows:
            family.add_metric((server_id, "idle"), idle)
            family.add_metric((server_id, "in_use"), in_use)
            family.add_metric((server_id, "waiting"), waiting)
        return [family]


class Metrics:
    """All metric families of one replica."""

    def __init__(self, registry: CollectorRegistry, prefix: str = "stargate_") -> None:
        self.registry = registry
        self.prefix = prefix
        self.readiness = ReadinessMetrics.create(registry, prefix)
        self.proxy = ProxyMetrics.create(registry, prefix)
        self.http = HttpMetrics.create(registry, prefix)
        self.active_inference_servers = Gauge(
            f"{prefix}active_inference_servers",
            "Active backends per (routing key, model) target; 0 once a target empties.",
            labelnames=("model", "routing_key"),
            registry=registry,
        )
        self.backend_connections = BackendConnections(registry, prefix)

    def set_active_inference_servers(self, routing_key: str | None, model: str, count: int) -> None:
        """Publish one target's active backend count (the series stays at 0 when it empties)."""
        self.active_inference_servers.labels(model=model, routing_key=routing_key or "").set(count)


# --------------------------------------------------------------------------------------------
# Series that follow the fleet

SERIES_GRACE_SECONDS = 300.0
"""How long the series of a backend or target that left the fleet stay exported.

Long enough that the last increments of a departed backend are scraped (any scrape interval up to
a few minutes) and that a Pylon restarting under the same id keeps its series; short enough that
a fleet whose engine pods restart all day exports only what is live. A constant, not a flag: no
operator need was found that a different value would serve (docs/metrics.md).
"""

SERIES_SWEEP_INTERVAL_SECONDS = 30.0
"""How often `DepartedSeriesSweep.run` looks for series to remove (less for a test's shorter
grace: `sweep_interval`)."""

LabelValues = tuple[str, ...]
SeriesKey = tuple[str, LabelValues]
"""A family's name and one of its label sets."""
Fingerprint = tuple[float, ...]
"""Every sample value of one series: it changes when the series is written."""


def sweep_interval(grace_seconds: float) -> float:
    """The sweep period for a grace period: removal lands within grace + 2 sweeps of leaving."""
    return min(SERIES_SWEEP_INTERVAL_SECONDS, grace_seconds / 4)


@dataclass(frozen=True, slots=True)
class LiveFleet:
    """What the routing state holds now: the ids of live registrations, and the targets and
    models they advertise (any status). Label values: an unkeyed routing key is ""."""

    backends: frozenset[str] = frozenset()
    targets: frozenset[tuple[str, str]] = frozenset()  # (routing_key label, model)
    models: frozenset[str] = frozenset()

    @classmethod
    def of(cls, registrations: Iterable[tuple[str, str | None, Iterable[str]]]) -> LiveFleet:
        """From `(inference_server_id, routing_key, advertised models)` of each registration."""
        backends: set[str] = set()
        targets: set[tuple[str, str]] = set()
        for server_id, routing_key, models in registrations:
            backends.add(server_id)
            targets.update((routing_key or "", model) for model in models)
        return cls(frozenset(backends), frozenset(targets), frozenset(m for _, m in targets))

    def with_targets(self, targets: Iterable[tuple[str, str]]) -> LiveFleet:
        """This fleet with more live `(routing_key label, model)` targets."""
        more = self.targets.union(targets)
        return LiveFleet(self.backends, more, frozenset(m for _, m in more))


@dataclass(frozen=True, slots=True)
class FleetLabels:
    """Where a family's label values name a fleet member: a backend, a model, a routing key.

    A series is live while every member it names is: its backend has a live registration, and
    its model is advertised (under its routing key when the family has one). An empty backend id
    (a local answer) names no backend; a model in `pinned_models` (the empty label, the proxy's
    bounded "unregistered" sentinel) names no target. A series that names nothing is never
    removed: its label set is bounded by construction.
    """

    backend: int | None
    model: int | None
    routing_key: int | None

    @classmethod
    def of(cls, labelnames: Sequence[str]) -> FleetLabels:
        def position(name: str) -> int | None:
            return labelnames.index(name) if name in labelnames else None

        return cls(position("inference_server_id"), position("model"), position("routing_key"))

    def is_live(self, values: LabelValues, fleet: LiveFleet, pinned_models: frozenset[str]) -> bool:
        backend = "" if self.backend is None else values[self.backend]
        if backend and backend not in fleet.backends:
            return False
        if self.model is not None and values[self.model] not in pinned_models:
            model = values[self.model]
            if self.routing_key is None:
                return model in fleet.models
            return (values[self.routing_key], model) in fleet.targets
        return True


@dataclass(frozen=True, slots=True)
class _Stale:
    since: float  # when the series was first seen not live, or last seen changing
    fingerprint: Fingerprint


class SeriesSweeper:
    """Decides which series to remove: those not live, and unchanged, for the grace period.

    Pure (no clock, no registry): each `sweep` gets every series with its liveness, a way to read
    a series' values, and the time. State is kept only for series not live now, so it is bounded
    by what is exported. A series not live that still changes (a stream to a departed backend
    finishing, requests for a model whose backends are all gone) restarts its grace period, so
    series that are written are never removed under the writer. A removed series that is written
    again is created afresh and starts from 0: Prometheus reads that as a counter reset.
    """

    def __init__(self, grace_seconds: float) -> None:
        if grace_seconds <= 0:
            raise ValueError("series grace period must be greater than 0")
        self.grace_seconds = grace_seconds
        self._stale: dict[SeriesKey, _Stale] = {}

    @property
    def tracked(self) -> int:
        """Series not live now whose grace period is running."""
        return len(self._stale)

    def sweep(
        self,
        series: Iterable[tuple[SeriesKey, bool]],
        fingerprint: Callable[[SeriesKey], Fingerprint],
        now: float,
    ) -> list[SeriesKey]:
        """The series to remove now, from `(key, live)` pairs of every series that exists.

        `fingerprint` is only called for series that are not live (once when the grace period
        starts, then when it has run out), so a sweep over a live fleet reads no values.
        """
        stale: dict[SeriesKey, _Stale] = {}
        expired: list[SeriesKey] = []
        for key, live in series:
            if live:
                continue
            state = self._stale.get(key)
            if state is None:
                stale[key] = _Stale(now, fingerprint(key))
            elif now - state.since < self.grace_seconds:
                stale[key] = state
            elif (current := fingerprint(key)) != state.fingerprint:
                stale[key] = _Stale(now, current)
            else:
                expired.append(key)
        self._stale = stale  # forgets series that are live again, gone, or expired now
        return expired


class DepartedSeriesSweep:
    """Applies `SeriesSweeper` to the families of `Metrics` whose labels name fleet members.

    Runs on the trio thread; the scrape renders in a worker thread meanwhile. That is safe:
    prometheus_client guards each family's children with the family's lock (`labels`, `remove`,
    and the copy a scrape iterates), and each value with its own lock. Activator families are not
    swept: their pool and member labels come from the pool file, a fixed set.
    """

    def __init__(
        self,
        metrics: Metrics,
        *,
        grace_seconds: float = SERIES_GRACE_SECONDS,
        pinned_models: Iterable[str] = (),
    ) -> None:
        self._sweeper = SeriesSweeper(grace_seconds)
        self._pinned = frozenset({"", *pinned_models})
        self._seen_targets: set[tuple[str, str]] = set()
        proxy = metrics.proxy
        families: list[MetricWrapperBase] = [
            proxy.requests,
            proxy.attempts,
            proxy.duration,
            proxy.retries,
            proxy.retry_exhausted,
            proxy.selections,
            proxy.kv_free_token_fallbacks,
            proxy.admission_rejections,
            proxy.routing_duration,
            proxy.replay_buffer_bytes,
            proxy.outlier_ejections,
            proxy.slow_start_left_out,
            metrics.active_inference_servers,
        ]
        self._families = {
            family._name: (family, FleetLabels.of(family._labelnames)) for family in families
        }

    @property
    def grace_seconds(self) -> float:
        return self._sweeper.grace_seconds

    def saw_live_target(self, routing_key: str | None, model: str) -> None:
        """A target had active backends at some moment since the last sweep.

        The sweep only sees the fleet at the moment it runs; a model whose only backend keeps
        leaving and coming back can be absent at every sweep while live in between, and its
        gauge reads 0 again each time, so its fingerprint never changes. Targets seen live
        since the last sweep count as live in the next one, which restarts their grace period.
        """
        self._seen_targets.add((routing_key or "", model))

    @property
    def tracked(self) -> int:
        """Series of departed backends and targets whose grace period is running."""
        return self._sweeper.tracked

    def sweep(self, fleet: LiveFleet, now: float) -> int:
        """Remove the series whose grace period ran out; return how many were removed."""
        pinned = self._pinned
        if self._seen_targets:
            fleet = fleet.with_targets(self._seen_targets)
            self._seen_targets = set()

        def series() -> Iterable[tuple[SeriesKey, bool]]:
            for name, (family, labels) in self._families.items():
                for values in _label_sets(family):
                    yield (name, values), labels.is_live(values, fleet, pinned)

        def fingerprint(key: SeriesKey) -> Fingerprint:
            family = self._families[key[0]][0]
            with family._lock:
                child = family._metrics.get(key[1])
            return () if child is None else _fingerprint(child)

        expired = self._sweeper.sweep(series(), fingerprint, now)
        by_family: dict[str, list[LabelValues]] = {}
        for name, values in expired:
            by_family.setdefault(name, []).append(values)
        for name, label_sets in by_family.items():
            _remove(self._families[name][0], label_sets)
        if expired:
            log.debug("removed %d metric series of departed backends and targets", len(expired))
        return len(expired)

    async def run(
        self, live_fleet: Callable[[], LiveFleet], then: Callable[[], None] | None = None
    ) -> NoReturn:
        """Every `sweep_interval`, sweep against the fleet `live_fleet` reads now, so `/metrics`
        (its size, and the time to render it) follows the live fleet rather than every Pylon
        that ever registered; then call `then`, which releases on the same clock what the other
        parts keep for backends that left. Runs until cancelled."""
        interval = sweep_interval(self.grace_seconds)
        while True:
            await trio.sleep(interval)
            self.sweep(live_fleet(), trio.current_time())
            if then is not None:
                then()


def _fingerprint(child: MetricWrapperBase) -> Fingerprint:
    """What changes when a series is written: a counter's or gauge's value, a histogram's sum.

    Read from the value cells rather than through `_samples()`, which formats every bucket and
    costs a hundred times as much (some 50 us per histogram): a sweep after 1,000 backends left
    reads thousands of these on the trio thread. A histogram's sum moves with every observation
    but one of exactly 0, which these histograms never see (durations are positive; a request
    that reaches a backend has a body).
    """
    kind = type(child)  # exact types: `isinstance` against these classes is slow
    if kind is Histogram:
        return (cast(Histogram, child)._sum.get(),)
    if kind is Counter or kind is Gauge:
        return (cast(Counter | Gauge, child)._value.get(),)
    return tuple(sample.value for sample in child._samples())


def _remove(family: MetricWrapperBase, label_sets: Iterable[LabelValues]) -> None:
    """`family.remove(*values)` for each label set, under one acquisition of the family's lock
    (`remove` itself consults the environment twice per call: a third of a mass removal's cost)."""
    with family._lock:
        for values in label_sets:
            family._metrics.pop(values, None)


def _label_sets(family: MetricWrapperBase) -> list[LabelValues]:
    """The label sets a family holds now (prometheus_client has no public listing; its own
    `remove_by_labels` reads the same dict under the same lock)."""
    with family._lock:
        return [tuple(values) for values in family._metrics]


def _render(registry: CollectorRegistry) -> bytes:
    """The text exposition, with the cyclic garbage collector paused while it is built.

    A render allocates some 10 objects per sample, which triggers full collections of the whole
    heap; each holds the GIL, and so stalls the trio thread, for 40-55 ms at 1,000 backends
    (docs/metrics.md). Its garbage has no cycles (reference counting frees it), so pausing the
    collector for the render loses nothing; it resumes right after, unless it was off already.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        return generate_latest(registry)
    finally:
        if collecting:
            gc.enable()


ASGIScope = MutableMapping[str, Any]
ASGIReceive = Callable[[], Awaitable[MutableMapping[str, Any]]]
ASGISend = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def metrics_asgi_app(
    registry: CollectorRegistry,
    *,
    before_render: Callable[[], None] | None = None,
) -> Callable[[ASGIScope, ASGIReceive, ASGISend], Awaitable[None]]:
    """A minimal ASGI app serving `GET /metrics` from `registry`, and nothing else.

    `before_render` runs on the trio thread before each render: where values computed at scrape
    time from loop-owned state are read (`BackendConnections`), since the render thread must not
    touch that state.

    It answers the lifespan protocol itself: Hypercorn's trio worker fails at start-up on an app
    that ignores lifespan (docs/decisions.md, H4), which `prometheus_client.make_asgi_app` does.

    The exposition is rendered in a worker thread: with many backends it takes tens of ms of pure
    Python, which on the trio thread would stall every request and registration stream for that
    long (docs/metrics.md has the figures). One render at a time: concurrent scrapers queue
    rather than run several renders that compete for the GIL.
    """
    render_limiter = trio.CapacityLimiter(1)

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
            if before_render is not None:
                before_render()
            body = await trio.to_thread.run_sync(_render, registry, limiter=render_limiter)
            status = 200
            headers = [(b"content-type", CONTENT_TYPE_LATEST.encode())]
            if scope["method"] == "HEAD":
                headers.append((b"content-length", str(len(body)).encode()))
                body = b""
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app
