"""A running activator over fake controllers, for tests (here and in later proxy tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from prometheus_client import CollectorRegistry

from stargate.activator.controller import FakeController
from stargate.activator.members import MemberAvailability
from stargate.activator.metrics import ActivatorMetrics
from stargate.activator.pool import Activator, PoolSpec

__all__ = ["Harness", "running_activator"]


@dataclass
class Harness:
    activator: Activator
    availability: MemberAvailability
    fakes: dict[str, FakeController]
    registry: CollectorRegistry
    metrics: ActivatorMetrics
    nursery: trio.Nursery

    def fake(self, pool: str | None = None) -> FakeController:
        if pool is None:
            (only,) = self.fakes.values()
            return only
        return self.fakes[pool]

    def pool(self, name: str | None = None) -> dict[str, Any]:
        snap = self.activator.snapshot()
        if name is None:
            (only,) = snap.values()
            return only
        return snap[name]

    def sample(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@asynccontextmanager
async def running_activator(
    pools: Sequence[PoolSpec],
    *,
    exclusive: bool = False,
    default_ready_delay: float | None = 0.0,
    ready: Sequence[str] = (),
    **activator_kwargs: Any,
) -> AsyncIterator[Harness]:
    """Start an `Activator` over one `FakeController` per pool; members in `ready` start up."""
    availability = MemberAvailability()
    registry = CollectorRegistry()
    metrics = ActivatorMetrics.create(registry)
    async with trio.open_nursery() as nursery:
        fakes = {
            spec.name: FakeController(
                availability,
                spec.members,
                default_ready_delay=default_ready_delay,
                exclusive=exclusive,
                nursery=nursery,
            )
            for spec in pools
        }
        for spec in pools:
            for member in spec.members:
                if member in ready:
                    fakes[spec.name].force(member, up=True)
        activator = Activator(pools, fakes, availability, metrics=metrics, **activator_kwargs)
        await nursery.start(activator.run)
        yield Harness(activator, availability, fakes, registry, metrics, nursery)
        nursery.cancel_scope.cancel()
