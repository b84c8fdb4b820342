"""The typed errors `Activator.acquire` raises, each with the HTTP mapping the proxy will use.

Upstream (LLMKube router-proxy) maps its sentinels in the proxy handler (docs/activator.md, Errors);
here each error carries its own `status`, `code` and `retry_after` so the proxy integration only
reads them. The 503s carry Retry-After. `retry_after` is an instance value, set where the error is
raised from the member's measured swap time (docs/activator.md, "Measured waiting"); the class
constants (`RETRY_AFTER_SECONDS`, 5 s, as upstream's fixed value) are the fallback while nothing
is measured. `PoolMemberUnavailable` is the member's breaker, open after repeated failed swaps.

With several replicas sharing pools (docs/pool-ownership.md), only a pool's owner decides for it:
`PoolOwnedElsewhere` tells the proxy to relay the request to the owner, `NoPoolOwner` that no owner
answered within the hold budget, and `PoolOwnerMoved` that a request already relayed once reached a
replica that no longer owns the pool (never relayed twice, so it is answered, retryable at once).
"""

from __future__ import annotations

__all__ = [
    "ActivatorError",
    "ActivatorStopped",
    "HoldTimeout",
    "IncumbentBusy",
    "NoPoolOwner",
    "PoolMemberUnavailable",
    "PoolOwnedElsewhere",
    "PoolOwnerMoved",
    "PoolQueueFull",
    "SwapFailed",
    "UnknownMember",
]

RETRY_AFTER_SECONDS = 5


class ActivatorError(Exception):
    """Base class: `acquire` did not grant the member."""

    status: int = 502
    code: str = "pool_error"
    retry_after: int | None = None

    def __init__(
        self, message: str, *, pool: str, member: str, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.pool = pool
        self.member = member
        if retry_after is not None:
            # Computed where raised; else the class constant stays (the fallback).
            self.retry_after = retry_after


class HoldTimeout(ActivatorError):
    """The hold budget expired before the member was granted (upstream `ErrHoldBudgetExceeded`)."""

    status = 503
    code = "pool_activation_timeout"
    retry_after = RETRY_AFTER_SECONDS


class SwapFailed(ActivatorError):
    """The swap to the member failed or was abandoned at its deadline (a swap error, not a hold
    timeout). `reason` is "error" or "deadline", as in `swap_failures_total{reason}`."""

    status = 502
    code = "pool_swap_failed"

    def __init__(self, message: str, *, pool: str, member: str, reason: str) -> None:
        super().__init__(message, pool=pool, member=member)
        self.reason = reason


class IncumbentBusy(ActivatorError):
    """`if_idle` mode: the member is not resident and the resident has work in flight; nothing was
    started and nothing is held (upstream `ErrIncumbentBusy`)."""

    status = 503
    code = "pool_incumbent_busy"
    retry_after = RETRY_AFTER_SECONDS


class PoolQueueFull(ActivatorError):
    """More than the pool's `max_held` requests are already held (stargate addition)."""

    status = 503
    code = "pool_queue_full"
    retry_after = RETRY_AFTER_SECONDS


class PoolMemberUnavailable(ActivatorError):
    """The member's breaker is open: its last swaps failed in a row, so no swap is started and
    nothing is held until its cooldown ends (docs/activator.md, "Breaker"). The message names the
    last failure; `retry_after` is the time until the breaker half-opens."""

    status = 503
    code = "pool_member_unavailable"
    retry_after = RETRY_AFTER_SECONDS


class PoolOwnedElsewhere(ActivatorError):
    """Another replica owns the member's pool: only it may decide, so the proxy relays the request
    to `address` (its HTTP base URL, such as `http://10.0.0.7:8000`). Raised at once, nothing held.

    `deadline`: the end (trio time) of the hold budget of the `acquire` that raised it, so the
    relay counts the budget once instead of starting it again. The status and code are what a
    replica without a relay answers.
    """

    status = 503
    code = "pool_owned_elsewhere"
    retry_after = 1

    def __init__(
        self,
        pool: str,
        member: str,
        address: str,
        *,
        identity: str | None = None,
        deadline: float | None = None,
    ) -> None:
        super().__init__(
            f"model pool {pool} is owned by another replica ({identity or address})",
            pool=pool,
            member=member,
        )
        self.address = address
        self.identity = identity
        self.deadline = deadline


class NoPoolOwner(ActivatorError):
    """No replica owned the pool (or the owner could not be reached) within the hold budget."""

    status = 503
    code = "pool_owner_unavailable"
    retry_after = RETRY_AFTER_SECONDS


class PoolOwnerMoved(ActivatorError):
    """A relayed request reached a replica that does not own its pool (ownership moved while it
    travelled). Relayed requests are never relayed again, so a loop is impossible; the client
    retries after a second, when every replica sees the new owner."""

    status = 503
    code = "pool_owner_moved"
    retry_after = 1


class UnknownMember(LookupError):
    """The model is not a member of any pool (the proxy should not call `acquire` for it)."""


class ActivatorStopped(RuntimeError):
    """`Activator.run` is not running (not started yet, or shutting down)."""
