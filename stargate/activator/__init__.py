"""ModelPool activation: members of a pool share one exclusive slot, swapped on demand.

A Python/trio replica of LLMKube's router-proxy activator with the #1837 fix (PR #1838,
docs/activator.md); the README's "Model pools" section describes it. The proxy calls
`Activator.acquire(model)` before dispatching to a pooled member and `Grant.release()` when the
response body ends.
"""

from stargate.activator.controller import FakeController, MemberController, PhaseReporter
from stargate.activator.errors import (
    ActivatorError,
    ActivatorStopped,
    HoldTimeout,
    IncumbentBusy,
    NoPoolOwner,
    PoolMemberUnavailable,
    PoolOwnedElsewhere,
    PoolOwnerMoved,
    PoolQueueFull,
    SwapFailed,
    UnknownMember,
)
from stargate.activator.members import AvailabilitySource, MemberAvailability
from stargate.activator.metrics import ActivatorMetrics
from stargate.activator.ownership import LocalOwnership, Owner, PoolOwnership
from stargate.activator.pool import Activator, Grant, PoolSpec

__all__ = [
    "Activator",
    "ActivatorError",
    "ActivatorMetrics",
    "ActivatorStopped",
    "AvailabilitySource",
    "FakeController",
    "Grant",
    "HoldTimeout",
    "IncumbentBusy",
    "LocalOwnership",
    "MemberAvailability",
    "MemberController",
    "NoPoolOwner",
    "Owner",
    "PhaseReporter",
    "PoolMemberUnavailable",
    "PoolOwnedElsewhere",
    "PoolOwnerMoved",
    "PoolOwnership",
    "PoolQueueFull",
    "PoolSpec",
    "SwapFailed",
    "UnknownMember",
]
