"""The HTTP/2 send order (stargate/h2_send_order.py): round robin among streams with data, with
the priority tree's interface, exceptions and bound on streams."""

from __future__ import annotations

import pytest
from priority.priority import (
    DeadlockError,
    DuplicateStreamError,
    MissingStreamError,
    PriorityTree,
    PseudoStreamError,
    TooManyStreamsError,
)

from stargate.h2_send_order import RoundRobin


def _turns(scheduler: RoundRobin | PriorityTree, count: int) -> list[int]:
    return [next(scheduler) for _ in range(count)]


def test_streams_with_data_take_turns_in_arrival_order() -> None:
    order = RoundRobin()
    for stream_id in (1, 3, 5):
        order.insert_stream(stream_id)
    assert _turns(order, 7) == [1, 3, 5, 1, 3, 5, 1]
    order.block(3)
    assert _turns(order, 4) == [5, 1, 5, 1]
    order.unblock(3)  # back at the end of the line
    assert _turns(order, 3) == [5, 1, 3]
    order.remove_stream(5)
    assert _turns(order, 4) == [1, 3, 1, 3]


def test_the_same_turns_as_the_tree_gives_equal_siblings() -> None:
    """Clients that send no priority signals (all of ours) see no change of order."""
    order, tree = RoundRobin(), PriorityTree()
    for scheduler in (order, tree):
        for stream_id in (1, 3, 5, 7):
            scheduler.insert_stream(stream_id)
        scheduler.block(5)
    assert _turns(order, 9) == _turns(tree, 9)


def test_nothing_ready_is_a_deadlock_as_in_the_tree() -> None:
    order = RoundRobin()
    with pytest.raises(DeadlockError):
        next(order)
    order.insert_stream(1)
    order.block(1)
    order.block(1)  # idempotent
    with pytest.raises(DeadlockError):
        next(order)
    order.unblock(1)
    order.unblock(1)  # idempotent: one turn per round, not two
    assert _turns(order, 2) == [1, 1]


def test_priority_signals_are_ignored_but_checked() -> None:
    order = RoundRobin()
    order.insert_stream(1)
    order.insert_stream(3, depends_on=1, weight=256, exclusive=True)
    order.reprioritize(1, depends_on=3, weight=1)
    assert _turns(order, 4) == [1, 3, 1, 3]
    with pytest.raises(MissingStreamError):
        order.reprioritize(9)
    with pytest.raises(MissingStreamError):
        order.block(9)
    with pytest.raises(MissingStreamError):
        order.unblock(9)
    with pytest.raises(MissingStreamError):
        order.remove_stream(9)
    with pytest.raises(PseudoStreamError):
        order.block(0)
    with pytest.raises(DuplicateStreamError):
        order.insert_stream(1)


def test_the_bound_counts_stream_zero_like_the_tree() -> None:
    order, tree = RoundRobin(maximum_streams=3), PriorityTree(maximum_streams=3)
    for scheduler in (order, tree):
        scheduler.insert_stream(1)
        scheduler.insert_stream(3)
        with pytest.raises(TooManyStreamsError):
            scheduler.insert_stream(5)
        scheduler.remove_stream(1)
        scheduler.insert_stream(5)  # room again
    assert len(order) == 2
    with pytest.raises(ValueError):
        RoundRobin(maximum_streams=0)
