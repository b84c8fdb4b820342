"""The shutdown sequence (stargate/shutdown.py) with fake steps and a mock clock: which step runs
when, in which order, and what the background nursery's cancel scope is told.

The replica wired with its real parts is tested in test_runtime.py and the e2e rolling-restart
tests; here each rule of the sequence is pinned on its own.
"""

from __future__ import annotations

import signal

import trio
import trio.testing

from stargate.lifecycle import Lifecycle, Outcome, Phase
from stargate.shutdown import Shutdown, ShutdownSteps

DELAY = 5.0
DRAIN_TIMEOUT = 30.0


class Recorder:
    """Fake parts: every step appends its name (with the mock clock's time) to `calls`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.idle = trio.Event()

    def _note(self, name: str) -> None:
        self.calls.append((name, trio.current_time()))

    def steps(self) -> ShutdownSteps:
        async def wait_idle() -> None:
            await self.idle.wait()
            self._note("idle")

        async def release() -> None:
            self._note("release")

        return ShutdownSteps(
            hand_over=lambda nursery: self._note("hand_over"),
            leave=lambda: self._note("leave"),
            stop_accepting=lambda: self._note("stop_accepting"),
            wait_idle=wait_idle,
            release=release,
        )

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def _shutdown(recorder: Recorder, *, leave_phase: bool = True) -> Shutdown:
    return Shutdown(
        Lifecycle(leave_phase=leave_phase),
        recorder.steps(),
        delay_seconds=DELAY,
        drain_timeout_seconds=DRAIN_TIMEOUT,
    )


async def test_sigterm_leaves_then_drains_after_the_delay_then_releases_once_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    shutdown = _shutdown(recorder)
    async with trio.open_nursery() as services:
        shutdown.attach(services)
        start = trio.current_time()
        shutdown.begin()
        assert shutdown.lifecycle.phase is Phase.LEAVING
        assert recorder.names == ["hand_over", "leave"]
        await trio.sleep(DELAY + 1)
        assert recorder.names == ["hand_over", "leave", "stop_accepting"]
        assert recorder.calls[-1][1] == start + DELAY
        # The drain deadline bounds the background work from the moment it stops accepting.
        assert services.cancel_scope.deadline == start + DELAY + DRAIN_TIMEOUT
        recorder.idle.set()
    assert recorder.names == ["hand_over", "leave", "stop_accepting", "idle", "release"]
    assert shutdown.lifecycle.outcome(cancelled=True) is Outcome.COMPLETE


async def test_sigint_drains_at_once_and_a_repeat_begin_changes_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    shutdown = _shutdown(recorder)
    async with trio.open_nursery() as services:
        shutdown.attach(services)
        shutdown.begin(leave=False)
        shutdown.begin(leave=False)
        shutdown.begin()
        assert recorder.names == ["hand_over", "stop_accepting"]
        recorder.idle.set()
    assert recorder.names == ["hand_over", "stop_accepting", "idle", "release"]


async def test_no_leave_phase_configured_means_sigterm_drains_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    shutdown = _shutdown(recorder, leave_phase=False)
    async with trio.open_nursery() as services:
        shutdown.attach(services)
        shutdown.begin()
        assert recorder.names == ["hand_over", "stop_accepting"]
        recorder.idle.set()


async def test_the_drain_deadline_cancels_work_that_never_finishes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    shutdown = _shutdown(recorder)
    async with trio.open_nursery() as services:
        shutdown.attach(services)
        services.start_soon(trio.sleep_forever)  # a stream that never ends
        start = trio.current_time()
        shutdown.begin(leave=False)
    assert trio.current_time() == start + DRAIN_TIMEOUT
    assert "release" not in recorder.names  # never idle: the Leases stay for close to release
    assert shutdown.lifecycle.outcome(cancelled=services.cancel_scope.cancelled_caught) is (
        Outcome.TIMED_OUT
    )


async def test_force_cancels_now_and_the_exit_code_is_1(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    shutdown = _shutdown(recorder)
    async with trio.open_nursery() as services:
        shutdown.attach(services)
        services.start_soon(trio.sleep_forever)
        start = trio.current_time()
        shutdown.begin()
        await trio.sleep(1)
        shutdown.force()
    assert trio.current_time() == start + 1
    assert recorder.names == ["hand_over", "leave", "stop_accepting"]
    assert shutdown.lifecycle.outcome(cancelled=True).exit_code == 1


async def test_a_shutdown_begun_before_attach_goes_on_once_the_nursery_exists(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A signal during start-up: nothing to hand over yet; the delay and drain run once the
    background nursery exists, and parts started after it still get the hand-over."""
    recorder = Recorder()
    shutdown = _shutdown(recorder)
    shutdown.begin()
    assert recorder.names == ["leave"]
    async with trio.open_nursery() as services:
        shutdown.attach(services)
        shutdown.hand_over_if_shutting_down()
        await trio.sleep(DELAY + 1)
        assert recorder.names == ["leave", "hand_over", "stop_accepting"]
        recorder.idle.set()
    assert recorder.names[-2:] == ["idle", "release"]


async def test_a_drain_begun_before_attach_carries_its_deadline_into_the_nursery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    shutdown = _shutdown(recorder)
    start = trio.current_time()
    shutdown.begin(leave=False)
    async with trio.open_nursery() as services:
        shutdown.attach(services)
        assert services.cancel_scope.deadline == start + DRAIN_TIMEOUT
        recorder.idle.set()
    assert recorder.names == ["stop_accepting", "idle", "release"]


async def test_a_critical_task_that_ends_on_its_own_drains_and_fails_the_exit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    shutdown = _shutdown(recorder)

    async def server(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep(2)

    async with trio.open_nursery() as services:
        shutdown.attach(services)
        await services.start(shutdown.critical, "server", server)
        await trio.sleep(3)
        assert recorder.names == ["hand_over", "stop_accepting"]  # no leave phase
        recorder.idle.set()
    assert shutdown.lifecycle.outcome(cancelled=True) is Outcome.FAILED


async def test_signals_sigterm_leaves_and_a_second_signal_forces(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    shutdown = _shutdown(recorder)
    send, receive = trio.open_memory_channel[int](2)
    async with trio.open_nursery() as services:
        shutdown.attach(services)
        services.start_soon(trio.sleep_forever)
        services.start_soon(shutdown.watch, receive)
        await send.send(signal.SIGTERM)
        await trio.sleep(1)
        assert shutdown.lifecycle.phase is Phase.LEAVING
        await send.send(signal.SIGINT)
    assert recorder.names == ["hand_over", "leave", "stop_accepting"]
    assert shutdown.lifecycle.outcome(cancelled=True).exit_code == 1
