"""Member availability: which pool members (model ids) are Ready, with change events.

docs/decisions.md, D7: a member is Ready when its model has at least one active backend in the
routing state, i.e. `RoutingState.active_backend_count(RoutingTargetKey(None, model)) > 0`. The
routing state reports every target-count change to one listener; the runtime forwards those calls to
`MemberAvailability.on_target_count`, which turns them into trio events. Nothing polls.

The same class is the in-memory source for tests (`set_available` / `set_count`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import trio

__all__ = ["AvailabilitySource", "MemberAvailability", "TargetKeyLike"]


class AvailabilitySource(Protocol):
    """What the activator needs to know about availability."""

    def is_available(self, model: str) -> bool: ...

    async def wait_changed(self, model: str | None = None) -> None:
        """Return after the next change of `model`'s availability (any model when None)."""
        ...


class TargetKeyLike(Protocol):
    """The shape of `stargate.routing.state.RoutingTargetKey` (kept structural on purpose)."""

    @property
    def routing_key(self) -> str | None: ...

    @property
    def model_id(self) -> str: ...


class MemberAvailability:
    """Active backend counts per model, and events that fire when a model's availability flips.

    No-lost-wakeup rule: `wait_changed` snapshots the current event before its first checkpoint,
    so `while not r.is_available(m): await r.wait_changed(m)` never misses a change (trio only
    switches tasks at checkpoints).
    """

    def __init__(
        self, initial: Mapping[str, int] | None = None, *, routing_key: str | None = None
    ) -> None:
        self._routing_key = routing_key
        self._counts: dict[str, int] = {}
        self._events: dict[str, trio.Event] = {}
        self._any = trio.Event()
        for model, count in (initial or {}).items():
            self._counts[model] = max(0, count)

    # ---- feeding ----------------------------------------------------------------------------

    def on_target_count(self, target: TargetKeyLike, count: int) -> None:
        """The routing state's `on_target_count` listener (only unkeyed targets count)."""
        if target.routing_key == self._routing_key:
            self.set_count(target.model_id, count)

    def seed(self, models: Iterable[str], count_of: Callable[[str], int]) -> None:
        """Read the current counts once at startup, e.g.
        `seed(members, lambda m: state.active_backend_count(RoutingTargetKey(None, m)))`."""
        for model in models:
            self.set_count(model, count_of(model))

    def set_count(self, model: str, count: int) -> None:
        count = max(0, count)
        was_ready = self._counts.get(model, 0) > 0
        if count:
            self._counts[model] = count
        else:
            self._counts.pop(model, None)
        if was_ready != (count > 0):
            self._notify(model)

    def set_available(self, model: str, ready: bool) -> None:
        """Test helper: ready means one active backend."""
        self.set_count(model, 1 if ready else 0)

    # ---- reading ----------------------------------------------------------------------------

    def is_available(self, model: str) -> bool:
        return self._counts.get(model, 0) > 0

    def count(self, model: str) -> int:
        return self._counts.get(model, 0)

    def available_models(self) -> list[str]:
        return sorted(self._counts)

    async def wait_changed(self, model: str | None = None) -> None:
        event = self._any if model is None else self._event(model)
        await event.wait()

    async def wait_available(self, model: str) -> None:
        """Return once `model` is Ready (at once if it already is)."""
        while not self.is_available(model):
            await self.wait_changed(model)

    # ---- internals --------------------------------------------------------------------------

    def _event(self, model: str) -> trio.Event:
        event = self._events.get(model)
        if event is None:
            event = self._events[model] = trio.Event()
        return event

    def _notify(self, model: str) -> None:
        event = self._events.pop(model, None)
        if event is not None:
            event.set()
        self._any.set()
        self._any = trio.Event()
