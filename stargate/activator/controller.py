"""The member-controller boundary, and a scriptable in-memory fake for tests.

A controller owns one pool. The activator calls it with no retries and returns its errors as-is
(docs/activator.md, Controllers):

* `activate(member)`: make `member` the pool's desired owner (upstream: scale to 1). Must be
  idempotent. Slot exclusivity is the controller's job, as it is LLMKube's operator's: it unloads
  the incumbent before the member starts. The activator guarantees the incumbent is idle (drain
  before swap) and that no request is granted on any member while a swap runs. Availability is not
  reported here: the member becomes Ready when its backend registers (docs/decisions.md, D7), which
  the activator watches through its `AvailabilitySource`.
* `deactivate(member)`: cancel a pending activation (scale to 0). An already-stopped member is a
  no-op. The activator calls it under the pool lock with a timeout; a timed-out call must be
  treated as possibly applied.
* `phase(member)` (optional, `PhaseReporter`): a diagnostic phase string, or None when unknown.
  Never used for availability.

The Kubernetes and process controllers implement this protocol elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import trio

from stargate.activator.members import MemberAvailability

__all__ = ["ControllerCall", "FakeController", "MemberController", "PhaseReporter"]


class MemberController(Protocol):
    async def activate(self, member: str) -> None: ...

    async def deactivate(self, member: str) -> None: ...


@runtime_checkable
class PhaseReporter(Protocol):
    async def phase(self, member: str) -> str | None: ...


ControllerCall = tuple[str, str]  # (method, member)


class FakeController:
    """An in-memory pool of members with replicas, scriptable per member.

    Models LLMKube's operator closely enough for the #1837 tests (docs/activator.md,
    Tests: the stale-deactivate window):

    * `activate` is idempotent *by check*: at replicas >= 1 it does nothing (never re-asserts);
      otherwise it sets replicas to 1 and, after `ready_delay[member]` seconds (None: never),
      makes the member Ready through the shared `MemberAvailability`, but only while replicas are
      still 1 (a deactivate in between cancels it);
    * `deactivate` sets replicas to 0 and the member not Ready;
    * with `exclusive=True`, activating a member also stops every other member (the operator's
      flip; upstream it waits for the incumbent to go first).

    Scripting (per member, all plain attributes so tests can change them at any time):
    `fail_activate` / `fail_deactivate` (member -> exception to raise), `hang_activate` /
    `hang_deactivate` (members whose call sleeps forever; they honour cancellation),
    `activate_gate` (member -> event the call waits for before acting), `ready_delay`
    (member -> seconds or None; missing means `default_ready_delay`). `on_call(method, member)`
    is called synchronously when a call arrives (for invariant checks).

    Delayed availability needs a nursery: pass one, or call `bind(nursery)` before the first
    activate with a nonzero delay. A delay of 0 makes the member Ready synchronously.
    """

    def __init__(
        self,
        availability: MemberAvailability,
        members: Sequence[str] = (),
        *,
        default_ready_delay: float | None = 0.0,
        exclusive: bool = False,
        nursery: trio.Nursery | None = None,
    ) -> None:
        self.availability = availability
        self.members = tuple(members)
        self.default_ready_delay = default_ready_delay
        self.exclusive = exclusive
        self._nursery = nursery
        self.replicas: dict[str, int] = {}
        self.calls: list[ControllerCall] = []
        self.fail_activate: dict[str, BaseException] = {}
        self.fail_deactivate: dict[str, BaseException] = {}
        self.hang_activate: set[str] = set()
        self.hang_deactivate: set[str] = set()
        self.activate_gate: dict[str, trio.Event] = {}
        self.ready_delay: dict[str, float | None] = {}
        self._epoch: dict[str, int] = {}
        self.on_call: Callable[[str, str], None] | None = None

    def bind(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    # ---- the protocol -----------------------------------------------------------------------

    async def activate(self, member: str) -> None:
        self._record("activate", member)
        await trio.lowlevel.checkpoint()
        if member in self.hang_activate:
            await trio.sleep_forever()
        gate = self.activate_gate.get(member)
        if gate is not None:
            await gate.wait()
        error = self.fail_activate.get(member)
        if error is not None:
            raise error
        if self.replicas.get(member, 0) >= 1:
            return  # idempotent by check: never re-asserted
        if self.exclusive:
            for other in self.members:
                if other != member and self.replicas.get(other, 0) >= 1:
                    self._stop(other)
        self.replicas[member] = 1
        epoch = self._bump(member)
        delay = self.ready_delay.get(member, self.default_ready_delay)
        if delay is None:
            return
        if delay <= 0:
            self.availability.set_available(member, True)
            return
        if self._nursery is None:
            raise RuntimeError("FakeController needs a nursery for delayed availability")
        self._nursery.start_soon(self._become_ready, member, epoch, delay)

    async def deactivate(self, member: str) -> None:
        self._record("deactivate", member)
        await trio.lowlevel.checkpoint()
        if member in self.hang_deactivate:
            await trio.sleep_forever()
        error = self.fail_deactivate.get(member)
        if error is not None:
            raise error
        self._stop(member)

    async def phase(self, member: str) -> str | None:
        await trio.lowlevel.checkpoint()
        if self.availability.is_available(member):
            return "Ready"
        return "Pending" if self.replicas.get(member, 0) >= 1 else "Stopped"

    # ---- test helpers -----------------------------------------------------------------------

    def force(self, member: str, *, up: bool, ready: bool | None = None) -> None:
        """Change a member behind the activator's back (an operator or a crash did it)."""
        self.replicas[member] = 1 if up else 0
        self._bump(member)
        self.availability.set_available(member, up if ready is None else ready)

    def make_ready(self, member: str) -> None:
        """Make a member that is up (replicas 1) Ready now."""
        if self.replicas.get(member, 0) >= 1:
            self.availability.set_available(member, True)

    def count(self, method: str, member: str) -> int:
        return sum(1 for call in self.calls if call == (method, member))

    def activations(self, member: str) -> int:
        return self.count("activate", member)

    def deactivations(self, member: str) -> int:
        return self.count("deactivate", member)

    def up_members(self) -> list[str]:
        return sorted(m for m, r in self.replicas.items() if r >= 1)

    # ---- internals --------------------------------------------------------------------------

    def _record(self, method: str, member: str) -> None:
        self.calls.append((method, member))
        if self.on_call is not None:
            self.on_call(method, member)

    def _bump(self, member: str) -> int:
        epoch = self._epoch.get(member, 0) + 1
        self._epoch[member] = epoch
        return epoch

    def _stop(self, member: str) -> None:
        self.replicas[member] = 0
        self._bump(member)
        self.availability.set_available(member, False)

    async def _become_ready(self, member: str, epoch: int, delay: float) -> None:
        await trio.sleep(delay if math.isfinite(delay) else math.inf)
        if self._epoch.get(member) == epoch and self.replicas.get(member, 0) >= 1:
            self.availability.set_available(member, True)
