"""The Pylon's block set and the deltas of its registration streams (stargate/pylon/kv_blocks.py):
a replica that applies every delta of a stream, in order, holds the Pylon's set."""

from __future__ import annotations

import random

import pytest

from stargate.protocol import stargate_pb2 as pb
from stargate.pylon.kv_blocks import KvBlockTracker, KvDelta, StreamCursor
from stargate.pylon.snapshot import attach_kv_delta


class Replica:
    """What a replica does with one stream's deltas (stargate/routing/kv_blocks.py's order)."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.messages = 0
        self.resets = 0

    def apply(self, delta: KvDelta) -> None:
        self.messages += 1
        if delta.reset:
            self.resets += 1
            self.blocks.clear()
        assert not set(delta.added) & set(delta.removed)
        self.blocks.update(delta.added)
        self.blocks.difference_update(delta.removed)

    def sync(self, tracker: KvBlockTracker, cursor: StreamCursor) -> None:
        """One heartbeat, and the chunks of a reset back to back (as the sidecar sends them)."""
        self.apply(tracker.delta(cursor))
        while cursor.syncing:
            self.apply(tracker.delta(cursor))


def test_a_new_stream_starts_with_a_reset_of_the_whole_set() -> None:
    tracker = KvBlockTracker()
    tracker.store([1, 2, 3])
    cursor = tracker.cursor()
    assert tracker.delta(cursor) == KvDelta(reset=True, added=(1, 2, 3))
    assert tracker.delta(cursor) == KvDelta()  # nothing changed: nothing on the wire
    assert KvDelta().empty and not KvDelta(reset=True).empty
    # An empty set still starts with a reset: the replica then knows the engine publishes.
    assert KvBlockTracker().delta(StreamCursor()) == KvDelta(reset=True)


def test_later_deltas_carry_the_net_changes_since_the_streams_previous_message() -> None:
    tracker = KvBlockTracker()
    tracker.store([1, 2])
    cursor = tracker.cursor()
    tracker.delta(cursor)
    tracker.store([3, 4])
    tracker.remove([1, 3, 99])  # 3 came and went; 99 was never there
    tracker.store([1])  # removed, then stored again
    tracker.store([2])  # already there: a refresh, no change
    delta = tracker.delta(cursor)
    assert not delta.reset
    assert sorted(delta.added) == [1, 4]
    assert delta.removed == (3,)  # harmless for a replica that never had it
    assert tracker.delta(cursor) == KvDelta()
    assert sorted(tracker.blocks()) == [1, 2, 4]


def test_each_stream_has_its_own_position() -> None:
    tracker = KvBlockTracker()
    early, late = Replica(), Replica()
    early_cursor = tracker.cursor()
    tracker.store([1, 2])
    early.sync(tracker, early_cursor)
    tracker.store([3])
    late_cursor = tracker.cursor()
    late.sync(tracker, late_cursor)
    tracker.remove([1])
    early.sync(tracker, early_cursor)
    late.sync(tracker, late_cursor)
    assert early.blocks == late.blocks == {2, 3}
    assert (early.resets, late.resets) == (1, 1)


def test_the_bound_drops_the_oldest_stored_blocks_and_tells_the_replicas() -> None:
    tracker = KvBlockTracker(max_blocks=3)
    replica, cursor = Replica(), StreamCursor()
    tracker.store([1, 2, 3])
    replica.sync(tracker, cursor)
    tracker.store([1])  # stored again: the newest now
    tracker.store([4, 5])  # 2 and 3 are the oldest
    assert tracker.blocks() == [1, 4, 5]
    assert tracker.dropped_over_bound == 2
    replica.sync(tracker, cursor)
    assert replica.blocks == {1, 4, 5}


def test_a_clear_or_a_lost_track_resets_every_stream() -> None:
    tracker = KvBlockTracker()
    replica, cursor = Replica(), StreamCursor()
    tracker.store([1, 2])
    replica.sync(tracker, cursor)
    tracker.clear()
    tracker.store([3])
    replica.sync(tracker, cursor)
    assert replica.blocks == {3} and replica.resets == 2
    tracker.store([4])
    tracker.lose_track()  # a gap in the event stream: the set is emptied and rebuilt
    tracker.store([5])
    delta = tracker.delta(cursor)
    assert delta == KvDelta(reset=True, added=(5,))
    assert tracker.resets == 2


def test_a_stream_further_behind_than_the_log_gets_a_reset() -> None:
    tracker = KvBlockTracker(max_changes=4)
    replica, cursor = Replica(), StreamCursor()
    replica.sync(tracker, cursor)
    tracker.store(range(1, 4))  # 3 changes: the log holds them
    replica.sync(tracker, cursor)
    assert replica.resets == 1
    tracker.store(range(10, 20))  # 10 changes: more than the log keeps
    replica.sync(tracker, cursor)
    assert replica.resets == 2
    assert replica.blocks == set(tracker.blocks())


def test_a_large_reset_goes_in_chunks_and_the_changes_follow_them() -> None:
    tracker = KvBlockTracker(max_per_message=4)
    tracker.store(range(10))
    cursor = tracker.cursor()
    first = tracker.delta(cursor)
    assert first == KvDelta(reset=True, added=(0, 1, 2, 3)) and cursor.syncing
    tracker.remove([1, 9])  # changes while the chunks go: sent after the last one
    tracker.store([10])
    assert tracker.delta(cursor) == KvDelta(added=(4, 5, 6, 7))
    assert tracker.delta(cursor) == KvDelta(added=(8, 9))  # 9 was removed since: it follows
    assert not cursor.syncing
    last = tracker.delta(cursor)
    assert last.added == (10,) and sorted(last.removed) == [1, 9]

    # A clear in the middle of the chunks starts over with the new set at once.
    cursor = tracker.cursor()
    tracker.delta(cursor)
    tracker.clear()
    tracker.store([42])
    assert tracker.delta(cursor) == KvDelta(reset=True, added=(42,))
    assert not cursor.syncing


@pytest.mark.parametrize("seed", range(5))
def test_random_histories_keep_every_stream_in_step(seed: int) -> None:
    rng = random.Random(seed)
    tracker = KvBlockTracker(max_blocks=50, max_changes=40, max_per_message=7)
    replicas = [(Replica(), StreamCursor()) for _ in range(3)]
    for step in range(400):
        roll = rng.random()
        if roll < 0.5:
            tracker.store(rng.sample(range(120), rng.randint(1, 6)))
        elif roll < 0.9:
            tracker.remove(rng.sample(range(120), rng.randint(1, 6)))
        elif roll < 0.95:
            tracker.clear()
        else:
            tracker.lose_track()
        for index, (replica, cursor) in enumerate(replicas):
            if (step + index) % (index + 1) == 0:  # streams heartbeat at different rates
                replica.sync(tracker, cursor)
                assert replica.blocks == set(tracker.blocks())
    assert len(tracker) <= 50


def test_a_delta_on_the_wire() -> None:
    message = pb.InferenceServerRegistration(inference_server_id="a")
    attach_kv_delta(message, KvDelta())
    assert (
        message.SerializeToString()
        == pb.InferenceServerRegistration(inference_server_id="a").SerializeToString()
    )  # an empty delta costs nothing
    attach_kv_delta(message, KvDelta(reset=True, added=(1, 2**64 - 1), removed=(7,)))
    decoded = pb.InferenceServerRegistration.FromString(message.SerializeToString())
    assert decoded.kv_blocks_reset
    assert list(decoded.kv_blocks_added) == [1, 2**64 - 1]
    assert list(decoded.kv_blocks_removed) == [7]
    # Packed fixed64: field 1001, wire type 2 (a length-delimited run of 8-byte values).
    wire = pb.InferenceServerRegistration(kv_blocks_added=[5, 6]).SerializeToString()
    assert wire == b"\xca\x3e\x10" + (5).to_bytes(8, "little") + (6).to_bytes(8, "little")


def test_bounds_must_be_positive() -> None:
    for bounds in ({"max_blocks": 0}, {"max_changes": 0}, {"max_per_message": 0}):
        with pytest.raises(ValueError):
            KvBlockTracker(**bounds)
