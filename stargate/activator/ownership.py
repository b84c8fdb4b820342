"""Who decides for a pool: the contract between pool ownership and the activator.

With several replicas, only one may run a pool's activator (swap decisions, activate and
deactivate calls, the deferred-deactivate re-check), or replicas scale down each other's busy
members (docs/pool-ownership.md). `PoolOwnership` says, per pool, whether this replica is that
one, and if not, where the owner's HTTP listener is, so the proxy can hand it the request.

Two implementations:

* `LocalOwnership`: this replica owns every pool (one replica, or the process controller, whose
  members run on this machine). The activator behaves as it always did.
* `stargate.activator.lease_ownership.LeaseOwnership`: one `coordination.k8s.io/v1` Lease per pool,
  held by at most one replica at a time (docs/pool-ownership.md).

The contract, which both honour:

* `owner(pool)` is a cheap read, never blocks, and is consistent with the last `changed(pool)`
  event set: a caller takes the event, reads `owner`, and waits on the event to hear of the next
  change (the same pattern as `Readiness.next_change`).
* `Owner.is_self` turns False *before* another replica could become the owner (the lease
  implementation flips it when a renewal has not succeeded within the renew deadline, which is
  shorter than the lease duration), so a replica that hears "not yours any more" and stops at once
  never overlaps with the next owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import trio

__all__ = ["NO_OWNER", "SELF", "LocalOwnership", "Owner", "PoolOwnership"]


@dataclass(frozen=True, slots=True)
class Owner:
    """A pool's owner as this replica sees it.

    `is_self`: this replica decides for the pool. Otherwise `address` is the owner's HTTP base URL
    (`http://10.0.0.7:8000`, or `https://` with TLS), or None while no replica owns it (the lease
    is free or expired, or not yet read).
    """

    is_self: bool
    address: str | None = None
    identity: str | None = None  # the owner's --stargate-id, for logs and metrics


SELF = Owner(is_self=True)
NO_OWNER = Owner(is_self=False)


class PoolOwnership(Protocol):
    def owner(self, pool: str) -> Owner:
        """The pool's owner now (see the module docstring for the guarantees)."""
        ...

    def changed(self, pool: str) -> trio.Event:
        """An event set at the next change of `owner(pool)`; take it before reading `owner`."""
        ...


class LocalOwnership:
    """Every pool is this replica's: the single-replica behaviour."""

    def __init__(self) -> None:
        self._never = trio.Event()  # ownership never changes

    def owner(self, pool: str) -> Owner:
        return SELF

    def changed(self, pool: str) -> trio.Event:
        return self._never
