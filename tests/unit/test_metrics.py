"""The metrics registry and its ASGI exposition app."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from trio.testing import MockClock

from stargate.metrics import (
    LATENCY_BUCKETS,
    DepartedSeriesSweep,
    FleetLabels,
    LiveFleet,
    Metrics,
    SeriesKey,
    SeriesSweeper,
    metrics_asgi_app,
    sweep_interval,
)


def _client(registry: CollectorRegistry) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=metrics_asgi_app(registry))
    return httpx.AsyncClient(transport=transport, base_url="http://metrics")


async def test_metrics_endpoint_serves_the_private_registry_with_the_prefix() -> None:
    registry = CollectorRegistry()
    Metrics(registry, prefix="llm_request_router_")
    async with _client(registry) as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert "llm_request_router_readiness_ready 0.0" in text
    assert 'llm_request_router_readiness_warmup_promotions_total{reason="deadline"} 0.0' in text
    assert "stargate_" not in text
    assert "_created" not in text
    assert "process_" not in text  # no process collectors, as in the Rust replica


async def test_two_registries_do_not_share_counters() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    Metrics(first).readiness.warmup_promotions.labels(reason="deadline").inc()
    Metrics(second)
    sample = 'stargate_readiness_warmup_promotions_total{reason="deadline"}'
    assert first.get_sample_value(sample.split("{")[0], {"reason": "deadline"}) == 1.0
    assert second.get_sample_value(sample.split("{")[0], {"reason": "deadline"}) == 0.0


async def test_other_paths_and_methods_are_refused() -> None:
    async with _client(CollectorRegistry()) as client:
        assert (await client.get("/")).status_code == 404
        assert (await client.get("/metrics/extra")).status_code == 404
        response = await client.post("/metrics")
        assert response.status_code == 405
        assert response.headers["allow"] == "GET, HEAD"
        head = await client.head("/metrics")
        assert head.status_code == 200 and head.content == b""


# ---- series that follow the fleet ---------------------------------------------------------------


def _key(*values: str) -> SeriesKey:
    return ("family", values)


def test_sweeper_removes_a_series_not_live_and_unchanged_for_the_grace_period() -> None:
    sweeper = SeriesSweeper(grace_seconds=10)
    values = {_key("gone"): (1.0,), _key("live"): (5.0,)}
    series = [(_key("gone"), False), (_key("live"), True)]
    assert sweeper.sweep(series, values.__getitem__, now=100) == []  # grace starts now
    assert sweeper.sweep(series, values.__getitem__, now=109.9) == []
    assert sweeper.sweep(series, values.__getitem__, now=110) == [_key("gone")]
    assert sweeper.tracked == 0  # nothing is remembered about removed or live series


def test_sweeper_restarts_the_grace_period_of_a_series_that_is_still_written() -> None:
    sweeper = SeriesSweeper(grace_seconds=10)
    values = {_key("gone"): (1.0,)}
    series = [(_key("gone"), False)]
    sweeper.sweep(series, values.__getitem__, now=0)
    values[_key("gone")] = (2.0,)  # a stream to the departed backend finished
    assert sweeper.sweep(series, values.__getitem__, now=10) == []
    assert sweeper.sweep(series, values.__getitem__, now=19) == []
    assert sweeper.sweep(series, values.__getitem__, now=20) == [_key("gone")]


def test_sweeper_forgets_a_series_that_is_live_again() -> None:
    sweeper = SeriesSweeper(grace_seconds=10)
    values = {_key("flap"): (1.0,)}
    sweeper.sweep([(_key("flap"), False)], values.__getitem__, now=0)
    sweeper.sweep([(_key("flap"), True)], values.__getitem__, now=5)  # the Pylon came back
    assert sweeper.tracked == 0
    # It leaves again: a whole new grace period, not the rest of the old one.
    assert sweeper.sweep([(_key("flap"), False)], values.__getitem__, now=12) == []
    assert sweeper.sweep([(_key("flap"), False)], values.__getitem__, now=21) == []
    assert sweeper.sweep([(_key("flap"), False)], values.__getitem__, now=22) == [_key("flap")]


def test_sweeper_reads_values_only_of_series_that_are_not_live() -> None:
    read: list[SeriesKey] = []

    def fingerprint(key: SeriesKey) -> tuple[float, ...]:
        read.append(key)
        return (0.0,)

    sweeper = SeriesSweeper(grace_seconds=10)
    live = [(_key(str(i)), True) for i in range(1000)]
    for now in range(0, 100, 10):
        sweeper.sweep(live, fingerprint, now=now)
    assert read == []
    with pytest.raises(ValueError):
        SeriesSweeper(grace_seconds=0)


FLEET = LiveFleet.of([("b1", None, ["m1", "m2"]), ("b2", "key", ["m1"])])


@pytest.mark.parametrize(
    ("labelnames", "values", "live"),
    [
        (("inference_server_id", "model", "routing_key"), ("b1", "m1", ""), True),
        (("inference_server_id", "model", "routing_key"), ("gone", "m1", ""), False),
        # b1 is live but no longer advertises m3
        (("inference_server_id", "model", "routing_key"), ("b1", "m3", ""), False),
        # routing keys are part of the target: m2 is not advertised under "key"
        (("inference_server_id", "model", "routing_key"), ("b2", "m2", "key"), False),
        (("inference_server_id", "model", "routing_key"), ("b2", "m1", "key"), True),
        # a local answer names no backend; its model decides
        (("inference_server_id", "model", "routing_key", "status"), ("", "m1", "", "503"), True),
        (("inference_server_id", "model", "routing_key", "status"), ("", "m9", "", "503"), False),
        # pinned model labels (the unregistered sentinel, "") are bounded: never removed
        (("model", "reason", "routing_key"), ("__unregistered__", "x", "__unregistered__"), True),
        (("model", "reason", "routing_key"), ("", "x", ""), True),
        # a model-only family: any routing key counts
        (("model",), ("m2",), True),
        (("model",), ("m9",), False),
        (("endpoint", "status_class"), ("chat_completions", "2xx"), True),
    ],
)
def test_fleet_labels_decide_liveness(
    labelnames: tuple[str, ...], values: tuple[str, ...], live: bool
) -> None:
    pinned = frozenset({"", "__unregistered__"})
    assert FleetLabels.of(labelnames).is_live(values, FLEET, pinned) is live


def test_sweep_removes_departed_series_from_the_exposition() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    sweep = DepartedSeriesSweep(metrics, grace_seconds=60, pinned_models=("__unregistered__",))
    proxy = metrics.proxy
    for backend in ("stays", "leaves"):
        labels = {"inference_server_id": backend, "model": "m", "routing_key": ""}
        proxy.requests.labels(status="200", **labels).inc()
        proxy.attempts.labels(result="upstream_200", **labels).inc()
        proxy.duration.labels(**labels).observe(0.2)
    proxy.requests.labels(
        inference_server_id="", model="__unregistered__", routing_key="", status="404"
    ).inc()
    proxy.retries.labels(model="old", reason="connect_failover", routing_key="").inc()
    metrics.set_active_inference_servers(None, "m", 1)
    metrics.set_active_inference_servers(None, "old", 0)
    fleet = LiveFleet.of([("stays", None, ["m"])])

    assert sweep.sweep(fleet, now=0) == 0
    assert sweep.sweep(fleet, now=59) == 0
    assert sweep.sweep(fleet, now=60) == 3 + 1 + 1  # the leaver's three, "old"'s two
    text = generate_latest(registry).decode()
    assert '"leaves"' not in text and 'model="old"' not in text
    assert text.count('inference_server_id="stays"') == 2 + len(LATENCY_BUCKETS) + 3
    assert 'model="__unregistered__"' in text
    assert 'stargate_active_inference_servers{model="m",routing_key=""} 1.0' in text
    # A backend that comes back starts its counters from 0 (Prometheus: a counter reset).
    proxy.requests.labels(inference_server_id="leaves", model="m", routing_key="", status="200")
    assert (
        registry.get_sample_value(
            "stargate_requests_total",
            {"inference_server_id": "leaves", "model": "m", "routing_key": "", "status": "200"},
        )
        == 0.0
    )


def test_the_proxy_writers_write_the_series_labels_would_and_follow_the_sweep() -> None:
    """`ProxyMetrics.count_*` / `observe_*` find series without `labels()` (stargate/metrics.py,
    `_child`): the same series, and one the sweep removed is written afresh, never into a series
    that is no longer exported."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    sweep = DepartedSeriesSweep(metrics, grace_seconds=60)
    proxy = metrics.proxy
    labels = {"inference_server_id": "b", "model": "m", "routing_key": ""}

    def requests() -> float | None:
        return registry.get_sample_value("stargate_requests_total", {**labels, "status": "200"})

    proxy.requests.labels(status="200", **labels).inc()
    proxy.count_request("b", "m", "", "200")
    proxy.count_request("b", "m", "", "200")
    assert requests() == 3.0
    proxy.count_attempt("b", "m", "upstream_200", "")
    proxy.observe_duration("b", "m", "", 0.2)
    proxy.observe_routing_duration("m", "", 0.0001)
    proxy.observe_replay_buffer("m", 10)
    proxy.count_selection("p2c", "m", "", "primary")
    proxy.count_retry("m", "connect_failover", "")
    proxy.count_retry_exhausted("m", "no_eligible_backend", "")
    proxy.count_admission_rejection("m", "queue", "")
    proxy.count_response("chat_completions", "2xx")
    value = registry.get_sample_value
    assert value("stargate_proxy_attempts_total", {**labels, "result": "upstream_200"}) == 1.0
    assert value("stargate_proxy_duration_seconds_count", labels) == 1.0
    assert value("stargate_routing_duration_seconds_count", {"model": "m", "routing_key": ""}) == 1
    assert value("stargate_proxy_replay_buffer_bytes_sum", {"model": "m"}) == 10.0
    selection = {"algorithm": "p2c", "model": "m", "routing_key": "", "selection": "primary"}
    assert value("stargate_routing_selections_total", selection) == 1.0
    reason = {"model": "m", "routing_key": ""}
    assert value("stargate_proxy_retries_total", {**reason, "reason": "connect_failover"}) == 1
    exhausted = {**reason, "reason": "no_eligible_backend"}
    assert value("stargate_proxy_retry_exhausted_total", exhausted) == 1.0
    assert value("stargate_admission_rejections_total", {**reason, "reason": "queue"}) == 1.0
    responses = {"endpoint": "chat_completions", "status_class": "2xx"}
    assert value("stargate_proxy_responses_total", responses) == 1.0

    gone = LiveFleet.of([])
    sweep.sweep(gone, now=0)
    assert sweep.sweep(gone, now=60) > 0
    assert requests() is None  # removed
    proxy.count_request("b", "m", "", "200")  # the backend is back: a fresh series
    assert requests() == 1.0


async def test_scrape_renders_off_the_trio_thread() -> None:
    """A slow render (here a collector that takes 300 ms) must not stall the loop: other tasks
    keep running while `/metrics` is being produced."""

    class SlowCollector(Collector):
        def collect(self) -> Iterable[Metric]:
            time.sleep(0.3)
            return []

    registry = CollectorRegistry()
    registry.register(SlowCollector())
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.sleep(0.01)
            ticks += 1

    async with trio.open_nursery() as nursery, _client(registry) as client:
        nursery.start_soon(ticker)
        response = await client.get("/metrics")
        nursery.cancel_scope.cancel()
    assert response.status_code == 200
    assert ticks >= 10  # ~30 on an idle machine; 0 if the render ran on this thread


async def test_scrape_pauses_the_collector_only_while_rendering() -> None:
    seen: list[bool] = []

    class Probe(Collector):
        def collect(self) -> Iterable[Metric]:
            seen.append(gc.isenabled())
            return []

    registry = CollectorRegistry()
    registry.register(Probe())
    async with _client(registry) as client:
        assert gc.isenabled()
        assert (await client.get("/metrics")).status_code == 200
        assert seen == [False] and gc.isenabled()
        gc.disable()  # someone else's choice is kept
        try:
            assert (await client.get("/metrics")).status_code == 200
            assert not gc.isenabled()
        finally:
            gc.enable()


def test_a_target_live_between_sweeps_keeps_its_series() -> None:
    """A model whose only backend keeps leaving and coming back may be absent at every sweep;
    its gauge reads 0 each time, yet it was live in between, so its grace period restarts."""
    metrics = Metrics(CollectorRegistry())
    sweep = DepartedSeriesSweep(metrics, grace_seconds=10)
    empty = LiveFleet.of([])
    metrics.set_active_inference_servers(None, "flap", 0)
    assert sweep.sweep(empty, now=0) == 0
    for now in range(5, 30, 5):  # between each two sweeps it was live for a moment
        metrics.set_active_inference_servers(None, "flap", 1)
        sweep.saw_live_target(None, "flap")
        metrics.set_active_inference_servers(None, "flap", 0)
        assert sweep.sweep(empty, now=now) == 0
    # It stops coming back: removed a grace period after it was last seen live.
    assert sweep.sweep(empty, now=30) == 0
    assert sweep.sweep(empty, now=39) == 0
    assert sweep.sweep(empty, now=40) == 1


async def test_the_sweep_runs_every_sweep_interval_then_its_follow_up(
    autojump_clock: MockClock,
) -> None:
    """`run` reads the live fleet at each sweep, then calls `then` on the same clock (the runtime
    releases what other parts keep for departed backends there)."""
    metrics = Metrics(CollectorRegistry())
    sweep = DepartedSeriesSweep(metrics, grace_seconds=40)
    interval = sweep_interval(40)
    metrics.proxy.retries.labels(model="gone", reason="connect_failover", routing_key="").inc()
    events: list[tuple[str, float]] = []

    def fleet() -> LiveFleet:
        events.append(("fleet", trio.current_time()))
        return LiveFleet.of([])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: sweep.run(fleet, then=lambda: events.append(("then", trio.current_time())))
        )
        await trio.sleep(2.5 * interval)
        assert events == [
            ("fleet", interval),
            ("then", interval),
            ("fleet", 2 * interval),
            ("then", 2 * interval),
        ]
        assert sweep.tracked == 1  # the departed model's retries, in their grace period
        await trio.sleep(40)
        assert sweep.tracked == 0  # removed once the grace period ran out
        nursery.cancel_scope.cancel()
