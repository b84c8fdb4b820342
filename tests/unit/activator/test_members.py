"""Availability adapter, fake controller, metrics and lifetime of the activator."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from stargate.activator import (
    Activator,
    ActivatorMetrics,
    ActivatorStopped,
    FakeController,
    MemberAvailability,
    PhaseReporter,
    PoolSpec,
)
from stargate.activator.testing import running_activator
from stargate.routing.state import RoutingTargetKey


async def test_readiness_follows_unkeyed_target_counts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    availability = MemberAvailability()
    woke: list[str] = []

    async def waiter() -> None:
        await availability.wait_available("coder")
        woke.append("coder")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        availability.on_target_count(RoutingTargetKey("tenant", "coder"), 2)  # keyed: ignored
        await trio.testing.wait_all_tasks_blocked()
        assert woke == [] and not availability.is_available("coder")
        availability.on_target_count(RoutingTargetKey(None, "coder"), 1)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == ["coder"] and availability.count("coder") == 1
    availability.on_target_count(RoutingTargetKey(None, "coder"), 0)
    assert not availability.is_available("coder") and availability.available_models() == []
    availability.seed(["a", "b"], lambda m: 3 if m == "a" else 0)
    assert availability.available_models() == ["a"]


async def test_wait_changed_fires_only_on_flips(autojump_clock: trio.testing.MockClock) -> None:
    availability = MemberAvailability({"m": 1})
    changes = 0

    async def watcher() -> None:
        nonlocal changes
        while True:
            await availability.wait_changed()
            changes += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watcher)
        await trio.testing.wait_all_tasks_blocked()
        availability.set_count("m", 4)  # still ready: no event
        await trio.testing.wait_all_tasks_blocked()
        availability.set_count("m", 0)
        await trio.testing.wait_all_tasks_blocked()
        assert changes == 1
        nursery.cancel_scope.cancel()


async def test_fake_controller_models_replicas(autojump_clock: trio.testing.MockClock) -> None:
    availability = MemberAvailability()
    async with trio.open_nursery() as nursery:
        fake = FakeController(
            availability, ("a", "b"), exclusive=True, default_ready_delay=1.0, nursery=nursery
        )
        assert isinstance(fake, PhaseReporter)
        await fake.activate("a")
        assert await fake.phase("a") == "Pending"
        await trio.sleep(1.0)
        assert await fake.phase("a") == "Ready"
        await fake.activate("a")  # idempotent by check
        await fake.activate("b")  # exclusive: a is stopped first
        assert await fake.phase("a") == "Stopped" and fake.up_members() == ["b"]
        await fake.deactivate("b")
        await trio.sleep(2.0)  # the pending availability of b was cancelled by the deactivate
        assert not availability.is_available("b")
        assert fake.calls == [
            ("activate", "a"),
            ("activate", "a"),
            ("activate", "b"),
            ("deactivate", "b"),
        ]


def test_metric_names_and_labels() -> None:
    registry = CollectorRegistry()
    metrics = ActivatorMetrics.create(registry)
    metrics.swaps.labels(**{"from": ""}, pool="p", router="r", to="m").inc()
    metrics.swap_failures.labels(member="m", pool="p", reason="deadline", router="r").inc()
    metrics.swap_duration.labels(pool="p", router="r").observe(1100)
    metrics.hold_duration.labels(member="m", pool="p", router="r").observe(1100)
    metrics.resident.labels(member="m", namespace="ns", pool="p").set(1)
    metrics.held_requests.labels(member="m", pool="p", router="r").set(2)
    metrics.coalesced.labels(member="m", pool="p", router="r").inc()
    metrics.busy_skips.labels(member="m", pool="p", router="r").inc()
    text = generate_latest(registry).decode()
    for line in (
        'llmkube_modelpool_swaps_total{from="",pool="p",router="r",to="m"} 1.0',
        "llmkube_modelpool_swap_failures_total"
        '{member="m",pool="p",reason="deadline",router="r"} 1.0',
        'llmkube_modelpool_swap_duration_seconds_bucket{le="1200.0",pool="p",router="r"} 1.0',
        "llmkube_modelpool_hold_duration_seconds_bucket"
        '{le="1200.0",member="m",pool="p",router="r"} 1.0',
        'llmkube_modelpool_resident{member="m",namespace="ns",pool="p"} 1.0',
        'llmkube_modelpool_held_requests{member="m",pool="p",router="r"} 2.0',
        'llmkube_modelpool_coalesced_total{member="m",pool="p",router="r"} 1.0',
        'llmkube_modelpool_busy_skips_total{member="m",pool="p",router="r"} 1.0',
    ):
        assert line in text, line
    # Upstream's buckets are kept as a prefix (dashboards), extended to 1200 s.
    assert 'llmkube_modelpool_swap_duration_seconds_bucket{le="512.0"' in text
    assert 'llmkube_modelpool_hold_duration_seconds_bucket{le="204.8"' in text


async def test_held_requests_gauge_and_hold_context_manager(
    autojump_clock: trio.testing.MockClock,
) -> None:
    spec = PoolSpec("p", ("a", "b"))
    async with running_activator([spec], default_ready_delay=5.0, router_name="") as h:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(h.activator.acquire, "a")
            await trio.testing.wait_all_tasks_blocked()
            assert (
                h.sample("llmkube_modelpool_held_requests", member="a", pool="p", router="default")
                == 1
            )
        assert (
            h.sample("llmkube_modelpool_held_requests", member="a", pool="p", router="default") == 0
        )
        assert (
            h.sample(
                "llmkube_modelpool_hold_duration_seconds_count",
                member="a",
                pool="p",
                router="default",
            )
            == 1
        )
        async with h.activator.hold("a") as grant:
            assert h.pool()["in_flight"] == {"a": 2}
        assert grant.released


async def test_shutdown_wakes_waiters(autojump_clock: trio.testing.MockClock) -> None:
    availability = MemberAvailability()
    fake = FakeController(availability, ("a", "b"), default_ready_delay=None)
    activator = Activator([PoolSpec("p", ("a", "b"))], {"p": fake}, availability)
    errors: list[BaseException] = []

    async def runner() -> None:
        try:
            await activator.acquire("a", hold_budget=100.0)
        except ActivatorStopped as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        run_scope = trio.CancelScope()

        async def run_activator(task_status: trio.TaskStatus[None]) -> None:
            with run_scope:
                await activator.run(task_status=task_status)

        await nursery.start(run_activator)
        nursery.start_soon(runner)
        await trio.testing.wait_all_tasks_blocked()
        assert activator.snapshot()["p"]["swapping"] is True
        run_scope.cancel()
    assert len(errors) == 1 and trio.current_time() < 1.0
    assert activator.snapshot()["p"]["swapping"] is False
    with pytest.raises(ActivatorStopped):
        await activator.acquire("a")
