"""The typed errors `Activator.acquire` raises, each with the HTTP mapping the proxy will use.

Upstream (LLMKube router-proxy) maps its sentinels in the proxy handler (docs/activator.md, Errors);
here each error carries its own `status`, `code` and `retry_after` so the proxy integration only
reads them. Only `HoldTimeout`, `IncumbentBusy` and `PoolQueueFull` are retryable (Retry-After: 5).
"""

from __future__ import annotations

__all__ = [
    "ActivatorError",
    "ActivatorStopped",
    "HoldTimeout",
    "IncumbentBusy",
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

    def __init__(self, message: str, *, pool: str, member: str) -> None:
        super().__init__(message)
        self.pool = pool
        self.member = member


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


class UnknownMember(LookupError):
    """The model is not a member of any pool (the proxy should not call `acquire` for it)."""


class ActivatorStopped(RuntimeError):
    """`Activator.run` is not running (not started yet, or shutting down)."""
