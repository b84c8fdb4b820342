"""A replica's graceful shutdown as I/O: what each phase of `stargate.lifecycle` calls for, in
order (docs/rolling-restarts.md).

`lifecycle.py` decides (which phase comes next, whether a signal forces, the exit code); this
module acts on its answers, in the manner of `warmup.py` and `readiness.py`:

- *leave* (SIGTERM with a nonzero `--shutdown-delay-ms`): the parts stop announcing the replica
  and everything is still served; after the delay, the drain.
- *drain* (SIGINT, a failed critical task, or the end of the delay): the parts stop accepting, the
  background work gets the drain deadline, and once nothing is in flight the held routes and the
  pools' Leases are released and the background work is cancelled.
- *force* (a second signal): whatever still runs is cancelled now; the exit code will be 1.

The parts are reached through `ShutdownSteps`, so this module imports none of them
(`runtime.py` wires them).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import trio

from stargate.lifecycle import Lifecycle, Phase
from stargate.serving import watch_signals

__all__ = ["Shutdown", "ShutdownSteps"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShutdownSteps:
    """What the parts do at each step, each called once."""

    hand_over: Callable[[trio.Nursery], None]
    """At the first step: the pools hand their members over (activator/wiring.py)."""
    leave: Callable[[], None]
    """Stop being announced (publisher, registrations, servers) while still serving."""
    stop_accepting: Callable[[], None]
    """Stop accepting; registration and watch streams end, in-flight work goes on."""
    wait_idle: Callable[[], Awaitable[None]]
    """Return once no request or stream is in flight."""
    release: Callable[[], Awaitable[None]]
    """Once drained: drop the routes held through the drain, give up what other replicas may
    take over (the pools' Leases)."""


class Shutdown:
    """Drives `lifecycle` through the shutdown and runs `steps` at each transition.

    The later steps (the delay, the drain) run in the nursery given to `attach`, the one that
    holds the replica's background work: its cancel scope carries the drain deadline and is
    cancelled when the drain ends. A shutdown that begins before `attach` (a signal during
    start-up) goes on once the nursery exists.
    """

    def __init__(
        self,
        lifecycle: Lifecycle,
        steps: ShutdownSteps,
        *,
        delay_seconds: float,
        drain_timeout_seconds: float,
    ) -> None:
        self.lifecycle = lifecycle
        self._steps = steps
        self._delay_seconds = delay_seconds
        self._drain_timeout_seconds = drain_timeout_seconds
        self._services: trio.Nursery | None = None
        self._drain_deadline: float | None = None

    def attach(self, services: trio.Nursery) -> None:
        """Run the later steps in `services` from now on, resuming a shutdown already begun."""
        self._services = services
        if self.lifecycle.stopped_accepting:
            services.start_soon(self._finish_drain)
        elif self.lifecycle.shutting_down:
            services.start_soon(self._leave_then_drain)
        if self._drain_deadline is not None:
            services.cancel_scope.deadline = self._drain_deadline

    def hand_over_if_shutting_down(self) -> None:
        """For parts started after `attach` (the pools): a shutdown that began while they
        started still reaches them."""
        if self.lifecycle.shutting_down and self._services is not None:
            self._steps.hand_over(self._services)

    def begin(self, *, leave: bool = True) -> None:
        """Start a graceful shutdown (idempotent): unready now, then stop accepting and drain.

        With `leave` (SIGTERM) and a leave phase configured, the replica first serves on for the
        delay while clients and Pylons move to other replicas; nothing but `force()` or a later
        `begin(leave=False)` cuts that short. Without it it stops accepting at once.
        """
        step = self.lifecycle.shutdown_step(leave=leave)
        if step is not None and not self.lifecycle.shutting_down and self._services is not None:
            self._steps.hand_over(self._services)
        if step is Phase.LEAVING:
            self._leave()
        elif step is Phase.DRAINING:
            self._stop_accepting()

    def force(self) -> None:
        """Stop draining now: cancel whatever is still running; the exit code will be 1."""
        self.lifecycle.force()
        self.begin(leave=False)
        if self._services is not None:
            self._services.cancel_scope.cancel()

    async def critical(
        self,
        name: str,
        run: Callable[..., Awaitable[None]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run a task whose ending, other than in a shutdown, shuts the replica down."""
        try:
            await run(task_status=task_status)
        finally:
            if self.lifecycle.fail():
                log.error("%s exited unexpectedly; beginning shutdown", name)
                self.begin(leave=False)

    async def watch(self, signals: AsyncIterator[int]) -> None:
        """SIGTERM (an orchestrator) leaves then drains; SIGINT (a person at a terminal) drains at
        once; a second signal of either kind, or any signal once the replica is already shutting
        down (a critical task failed), forces exit 1."""

        def begin(sig: signal.Signals) -> None:
            log.info("received %s, beginning graceful shutdown", sig.name)
            self.begin(leave=sig != signal.SIGINT)

        def force(sig: signal.Signals) -> None:
            log.warning("received %s during shutdown", sig.name)
            self.force()

        await watch_signals(signals, begin, force, stopping=lambda: self.lifecycle.shutting_down)

    def _leave(self) -> None:
        log.info(
            "leaving: /readyz answers 503 and clients are asked to move on; still serving for "
            "%g s before draining",
            self._delay_seconds,
        )
        self.lifecycle.begin_leaving()
        self._steps.leave()
        if self._services is not None:
            self._services.start_soon(self._leave_then_drain)

    async def _leave_then_drain(self) -> None:
        await trio.sleep(self._delay_seconds)
        self._stop_accepting()

    def _stop_accepting(self) -> None:
        if self.lifecycle.stopped_accepting:
            return
        log.info("entering draining mode")
        self.lifecycle.begin_draining()
        self._steps.stop_accepting()
        self._drain_deadline = trio.current_time() + self._drain_timeout_seconds
        if self._services is not None:
            self._services.start_soon(self._finish_drain)
            self._services.cancel_scope.deadline = self._drain_deadline

    async def _finish_drain(self) -> None:
        """End the servers once nothing is in flight; their remaining connections are idle."""
        await self._steps.wait_idle()
        log.info("in-flight requests and streams finished")
        await self._steps.release()
        self.lifecycle.drained()
        if self._services is not None:
            self._services.cancel_scope.cancel()
