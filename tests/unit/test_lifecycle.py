"""The replica's lifecycle (stargate/lifecycle.py) as pure logic, exhaustively.

Every transition is checked from every phase against one table, then every sequence of events up
to four long and every order of the six events, with and without a leave phase, is replayed
against the same table and the rules that hold across steps (one-way, idempotent, latched). The
rules protect the shutdown contract of docs/rolling-restarts.md: a replica never becomes ready
again once it began to leave, never resumes accepting once it drains, never runs a step of the
shutdown twice however signals and failures interleave, and exits 1 exactly when work was cut
or something went wrong.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from stargate.lifecycle import Lifecycle, Outcome, Phase

W, R, L, D, X = Phase.WARMING, Phase.READY, Phase.LEAVING, Phase.DRAINING, Phase.DONE
ORDER = [W, R, L, D, X]

Event = Callable[[Lifecycle], object]

EVENTS: dict[str, Event] = {
    "promote": Lifecycle.promote,
    "begin_leaving": Lifecycle.begin_leaving,
    "begin_draining": Lifecycle.begin_draining,
    "drained": Lifecycle.drained,
    "force": Lifecycle.force,
    "fail": Lifecycle.fail,
}

# (phase, event) -> the phase after it, with a leave phase. An event not listed for a phase does
# not apply there and changes nothing.
MOVES: dict[tuple[Phase, str], Phase] = {
    (W, "promote"): R,
    (W, "begin_leaving"): L,
    (R, "begin_leaving"): L,
    (W, "begin_draining"): D,
    (R, "begin_draining"): D,
    (L, "begin_draining"): D,
    (D, "drained"): X,
}

# How to reach each phase from a fresh lifecycle.
PATHS: dict[Phase, tuple[str, ...]] = {
    W: (),
    R: ("promote",),
    L: ("promote", "begin_leaving"),
    D: ("promote", "begin_draining"),
    X: ("promote", "begin_draining", "drained"),
}


def _expected_move(phase: Phase, event: str, *, leave_phase: bool) -> Phase:
    if event == "begin_leaving" and not leave_phase:
        return phase  # no leave phase: a shutdown goes straight to draining
    return MOVES.get((phase, event), phase)


def _at(phase: Phase, *, leave_phase: bool = True) -> Lifecycle:
    lifecycle = Lifecycle(leave_phase=True)
    for event in PATHS[phase]:
        EVENTS[event](lifecycle)
    lifecycle.leave_phase = leave_phase  # reached through a leave phase where needed
    assert lifecycle.phase is phase
    return lifecycle


def _watched(lifecycle: Lifecycle) -> list[Phase]:
    seen: list[Phase] = []
    lifecycle.watch(seen.append)
    return seen


# ---- each transition, from each phase -----------------------------------------------------------


# Every phase with a leave phase, and every phase but leaving (never reached) without one.
START = [(p, True) for p in ORDER] + [(p, False) for p in ORDER if p is not L]


@pytest.mark.parametrize("event", ["promote", "begin_leaving", "begin_draining", "drained"])
@pytest.mark.parametrize(
    ("phase", "leave_phase"),
    START,
    ids=[f"{p.value}-{'leave' if leave else 'no-leave'}" for p, leave in START],
)
def test_each_phase_transition_from_each_phase(phase: Phase, event: str, leave_phase: bool) -> None:
    """A transition moves only from the phases its guard names, to the one its table names, and
    says whether it moved; one that does not apply changes nothing and tells no listener (so the
    caller never repeats the I/O of a step already taken)."""
    lifecycle = _at(phase, leave_phase=leave_phase)
    seen = _watched(lifecycle)
    expected = _expected_move(phase, event, leave_phase=leave_phase)
    moved = EVENTS[event](lifecycle)
    assert lifecycle.phase is expected
    assert moved is (expected is not phase)
    assert seen == ([] if expected is phase else [expected])
    assert not lifecycle.forced and not lifecycle.failed


@pytest.mark.parametrize("phase", ORDER, ids=[p.value for p in ORDER])
def test_force_is_latched_in_every_phase_and_moves_nothing(phase: Phase) -> None:
    """A second signal must exit 1 whenever it comes, even after the drain finished (the operator
    cut the close-down short); draining at once is the runtime's step, not this flag's."""
    lifecycle = _at(phase)
    seen = _watched(lifecycle)
    lifecycle.force()
    lifecycle.force()
    assert lifecycle.forced and lifecycle.phase is phase and seen == []
    assert lifecycle.outcome(cancelled=False) is Outcome.FORCED


@pytest.mark.parametrize(
    ("phase", "counts"), [(W, True), (R, True), (L, True), (D, False), (X, False)]
)
def test_a_critical_task_ending_is_a_failure_only_before_the_drain(
    phase: Phase, counts: bool
) -> None:
    """A server ending on its own while the replica still serves (warming, ready, even leaving)
    is a failure: exit 1. Once draining, servers ending is the drain itself, not a failure."""
    lifecycle = _at(phase)
    assert lifecycle.fail() is counts
    assert lifecycle.failed is counts
    assert lifecycle.phase is phase  # the runtime drains next, through `begin_draining`


# ---- the shutdown request -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "leave", "leave_phase", "step"),
    [
        (W, True, True, L),  # SIGTERM while warming: leave first
        (R, True, True, L),  # SIGTERM: leave first
        (W, True, False, D),  # SIGTERM without a delay: drain at once
        (R, True, False, D),
        (W, False, True, D),  # SIGINT, a failure: drain at once
        (R, False, True, D),
        (W, False, False, D),
        (R, False, False, D),
        (L, True, True, None),  # a second SIGTERM does not cut the delay short
        (L, False, True, D),  # SIGINT or a failure while leaving: drain now
        (D, True, True, None),  # once draining, nothing more to start
        (D, False, True, None),
        (D, True, False, None),
        (D, False, False, None),
        (X, True, True, None),
        (X, False, True, None),
        (X, True, False, None),
        (X, False, False, None),
    ],
)
def test_shutdown_step(phase: Phase, leave: bool, leave_phase: bool, step: Phase | None) -> None:
    """Where a shutdown request leads, without moving: the runtime logs, then takes the step,
    then does its I/O, so the guard must be readable before the move. Taking the step it names
    always succeeds."""
    lifecycle = _at(phase, leave_phase=leave_phase)
    assert lifecycle.shutdown_step(leave=leave) is step
    assert lifecycle.phase is phase  # a query
    if step is L:
        assert lifecycle.begin_leaving()
    elif step is D:
        assert lifecycle.begin_draining()
    assert lifecycle.phase is (phase if step is None else step)


# ---- every order of events ----------------------------------------------------------------------


def _sequences() -> list[tuple[str, ...]]:
    names = list(EVENTS)
    short = [seq for n in range(5) for seq in itertools.product(names, repeat=n)]
    return short + list(itertools.permutations(names))


SEQUENCES = _sequences()


def _replay(events: Sequence[str], *, leave_phase: bool) -> None:
    lifecycle = Lifecycle(leave_phase=leave_phase)
    seen = _watched(lifecycle)
    expected_seen: list[Phase] = []
    phase = W
    forced = failed = warm = False
    for event in events:
        before = lifecycle.phase
        assert before is phase
        shutting_down = lifecycle.shutting_down
        EVENTS[event](lifecycle)
        phase = _expected_move(before, event, leave_phase=leave_phase)
        assert lifecycle.phase is phase, (events, event)
        if phase is not before:
            expected_seen.append(phase)
        # One-way: never back to an earlier phase; leaving only with a leave phase.
        assert ORDER.index(phase) >= ORDER.index(before)
        assert leave_phase or phase is not L
        # Latched: warm, shutting down, forced, failed stay once set.
        warm = warm or phase is not W
        assert lifecycle.warm is warm
        assert lifecycle.shutting_down or not shutting_down
        forced = forced or event == "force"
        failed = failed or (event == "fail" and before not in (D, X))
        assert lifecycle.forced is forced and lifecycle.failed is failed
        # The predicates are views of one phase.
        assert lifecycle.accepting_work is (phase in (W, R))
        assert lifecycle.shutting_down is (phase in (L, D, X))
        assert lifecycle.stopped_accepting is (phase in (D, X))
    assert seen == expected_seen  # every change announced once, in order; nothing else
    for cancelled in (False, True):
        outcome = lifecycle.outcome(cancelled=cancelled)
        if forced:
            assert outcome is Outcome.FORCED
        elif failed:
            assert outcome is Outcome.FAILED
        elif cancelled and phase is not X:
            assert outcome is Outcome.TIMED_OUT
        else:
            assert outcome is Outcome.COMPLETE
        assert outcome.exit_code == (0 if outcome is Outcome.COMPLETE else 1)


@pytest.mark.parametrize("leave_phase", [True, False], ids=["leave-phase", "no-leave-phase"])
def test_every_order_of_events_follows_the_table_and_the_latches(leave_phase: bool) -> None:
    """Signals, failures, promotion and the drain's end interleave in any order in a real
    shutdown (a SIGTERM during warmup, a server failing while leaving, a second signal after the
    drain): whatever the order, each step is the table's, nothing goes back, the flags latch, and
    the exit code follows from the flags and the phase alone."""
    for events in SEQUENCES:
        _replay(events, leave_phase=leave_phase)


# ---- the exit code ------------------------------------------------------------------------------


def test_a_drain_that_finishes_exits_0() -> None:
    """The finished drain cancels the servers itself: that cancellation is no timeout."""
    lifecycle = _at(X)
    assert lifecycle.outcome(cancelled=True) is Outcome.COMPLETE
    assert Outcome.COMPLETE.exit_code == 0


@pytest.mark.parametrize("phase", [L, D])
def test_a_cancellation_before_the_drain_finished_is_the_deadline(phase: Phase) -> None:
    """In-flight work was cut: exit 1, so an orchestrator sees requests may have failed."""
    lifecycle = _at(phase)
    assert lifecycle.outcome(cancelled=True) is Outcome.TIMED_OUT
    assert Outcome.TIMED_OUT.exit_code == 1


def test_a_forced_exit_is_named_before_a_failure() -> None:
    """Both exit 1; the log names the signal, the operator's own doing, first."""
    lifecycle = _at(R)
    lifecycle.fail()
    lifecycle.force()
    assert lifecycle.outcome(cancelled=True) is Outcome.FORCED


def test_a_failure_exits_1_even_when_the_drain_then_finishes() -> None:
    """A server that died took requests with it, however cleanly the rest drained."""
    lifecycle = _at(R)
    assert lifecycle.fail()
    lifecycle.begin_draining()
    lifecycle.drained()
    assert lifecycle.outcome(cancelled=True) is Outcome.FAILED


def test_only_a_complete_shutdown_exits_0() -> None:
    """A failed start-up, like every other ending but a complete one, exits 1."""
    assert {o: o.exit_code for o in Outcome} == {
        Outcome.STARTUP_FAILED: 1,
        Outcome.FORCED: 1,
        Outcome.FAILED: 1,
        Outcome.TIMED_OUT: 1,
        Outcome.COMPLETE: 0,
    }


# ---- listeners ----------------------------------------------------------------------------------


def test_listeners_see_the_new_phase_in_order_of_watching() -> None:
    """Readiness reacts to a change by reading the lifecycle: the phase is the new one when it is
    told, and listeners run in the order they were added."""
    lifecycle = Lifecycle()
    calls: list[tuple[str, Phase, Phase]] = []
    lifecycle.watch(lambda phase: calls.append(("first", phase, lifecycle.phase)))
    lifecycle.watch(lambda phase: calls.append(("second", phase, lifecycle.phase)))
    lifecycle.begin_leaving()
    assert calls == [("first", L, L), ("second", L, L)]


def test_a_fresh_lifecycle_is_warming_and_accepting() -> None:
    """A replica accepts work from the start (Pylon registrations end warmup), unready until
    promoted."""
    lifecycle = Lifecycle()
    assert lifecycle.phase is W and lifecycle.leave_phase
    assert lifecycle.accepting_work and not lifecycle.warm and not lifecycle.shutting_down
    assert lifecycle.outcome(cancelled=False) is Outcome.COMPLETE


def test_the_lifecycle_is_pure() -> None:
    """No event loop, clock, socket or I/O library: the rules stay testable as above, and the
    runtime alone owns time (the drain deadline, the leave delay) and I/O."""
    source = Path(__file__).resolve().parents[2] / "stargate" / "lifecycle.py"
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "enum", "collections"}, imported
