"""A running activator over fake controllers, for tests (here and in later proxy tests), and a
`FakeOwnership` whose owner per pool the test sets."""

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
from stargate.activator.ownership import NO_OWNER, SELF, Owner
from stargate.activator.pool import Activator, PoolSpec

__all__ = ["FakeOwnership", "Harness", "running_activator"]


class FakeOwnership:
    """A `PoolOwnership` the test drives: `set_owner(pool, owner)` (or `own`, `disown`,
    `elsewhere`) changes a pool's owner and fires its change event at once. Every pool starts with
    `initial` (no owner by default). `reads` counts `owner()` calls, to show who asked."""

    def __init__(self, initial: Owner = NO_OWNER) -> None:
        self._initial = initial
        self._owners: dict[str, Owner] = {}
        self._events: dict[str, trio.Event] = {}
        self.reads = 0

    def owner(self, pool: str) -> Owner:
        self.reads += 1
        return self._owners.get(pool, self._initial)

    def changed(self, pool: str) -> trio.Event:
        event = self._events.get(pool)
        if event is None:
            event = self._events[pool] = trio.Event()
        return event

    def set_owner(self, pool: str, owner: Owner, *, notify: bool = True) -> None:
        """`notify=False` changes the owner without firing the event yet (`fire` does later): a
        source may turn `is_self` off before its change is seen (stargate/activator/ownership.py).
        """
        self._owners[pool] = owner
        if notify:
            self.fire(pool)

    def fire(self, pool: str) -> None:
        event = self._events.pop(pool, None)
        if event is not None:
            event.set()

    def own(self, pool: str) -> None:
        self.set_owner(pool, SELF)

    def disown(self, pool: str) -> None:
        """Nobody owns the pool (a lease expired, not yet taken)."""
        self.set_owner(pool, NO_OWNER)

    def elsewhere(self, pool: str, address: str, identity: str | None = None) -> None:
        self.set_owner(pool, Owner(is_self=False, address=address, identity=identity))


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
