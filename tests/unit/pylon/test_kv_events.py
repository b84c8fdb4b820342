"""The Pylon's KV-event subscription (stargate/pylon/kv_events.py): what the feed does with every
kind of message, gaps, restarts and garbage (pure, the instant passed in), and the trio loop on a
real ZMQ socket on 127.0.0.1."""

from __future__ import annotations

import logging

import msgpack  # type: ignore[import-untyped]
import pytest
import trio
import zmq

from stargate.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    encode_batch,
    encode_seq,
)
from stargate.pylon.kv_blocks import KvBlockTracker, KvDelta
from stargate.pylon.kv_events import (
    DECODE_LOG_INTERVAL_SECONDS,
    KvEventFeed,
    kv_events_loop,
)

ENDPOINT = "tcp://127.0.0.1:5557"
LOGGER = "stargate.pylon.kv_events"


def message(seq: int, *events: KvEvent, topic: bytes = b"") -> list[bytes]:
    return [topic, encode_seq(seq), encode_batch(1.0, events)]


def stored(*hashes: int) -> BlockStored:
    return BlockStored(hashes, None, (), 16)


def feed() -> KvEventFeed:
    return KvEventFeed(ENDPOINT, KvBlockTracker())


def test_events_build_the_engines_block_set() -> None:
    subject = feed()
    subject.handle(message(0, stored(1, 2, 3), BlockRemoved((2,))), 0.0)
    subject.handle(message(1, stored(4)), 0.0)
    assert subject.tracker.blocks() == [1, 3, 4]
    subject.handle(message(2, AllBlocksCleared(), stored(9)), 0.0)
    assert subject.tracker.blocks() == [9]
    assert subject.counters.messages == 3 and subject.counters.events == 5
    assert subject.counters.gaps == 0


def test_a_gap_empties_the_set_warns_and_the_set_is_rebuilt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    subject = feed()
    cursor = subject.tracker.cursor()
    subject.handle(message(0, stored(1, 2)), 0.0)
    subject.tracker.delta(cursor)
    with caplog.at_level(logging.WARNING, LOGGER):
        subject.handle(message(3, stored(5)), 1.0)  # 1 and 2 were lost
    assert subject.counters.gaps == 1 and subject.counters.missed_messages == 2
    assert subject.tracker.blocks() == [5]  # only what followed the gap
    assert subject.tracker.delta(cursor) == KvDelta(reset=True, added=(5,))
    (record,) = caplog.records
    assert ENDPOINT in record.getMessage() and "missed 2 message(s)" in record.getMessage()
    subject.handle(message(4, stored(6)), 2.0)  # in step again
    assert subject.counters.gaps == 1 and subject.tracker.blocks() == [5, 6]


def test_gap_warnings_are_throttled_to_one_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    subject = feed()
    subject.handle(message(0), 0.0)
    with caplog.at_level(logging.WARNING, LOGGER):
        subject.handle(message(2), 1.0)
        subject.handle(message(4), 2.0)
        subject.handle(message(6), 3.0)
        subject.handle(message(8), 1.0 + DECODE_LOG_INTERVAL_SECONDS)
    assert subject.counters.gaps == 4
    assert len(caplog.records) == 2
    assert "2 more gaps since the last report" in caplog.records[1].getMessage()


def test_the_first_message_may_join_a_running_engine(caplog: pytest.LogCaptureFixture) -> None:
    subject = feed()
    with caplog.at_level(logging.INFO, LOGGER):
        subject.handle(message(41, stored(1)), 0.0)
    assert subject.tracker.blocks() == [1] and subject.counters.gaps == 0
    assert "joined at seq 41" in caplog.text


def test_seq_going_back_is_a_restarted_engine(caplog: pytest.LogCaptureFixture) -> None:
    subject = feed()
    subject.handle(message(0, stored(1)), 0.0)
    subject.handle(message(1, stored(2)), 0.0)
    with caplog.at_level(logging.INFO, LOGGER):
        subject.handle(message(0, stored(7)), 0.0)
    assert subject.counters.restarts == 1 and subject.tracker.blocks() == [7]
    assert "restarted" in caplog.text
    subject.handle(message(1), 0.0)
    assert subject.counters.gaps == 0


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([b"", encode_seq(1)], id="two-frames"),
        pytest.param([b"", encode_seq(1), b"", b""], id="four-frames"),
        pytest.param([b"", b"\x01", encode_batch(1.0, ())], id="short-seq"),
        pytest.param([b"", encode_seq(1), b"\xc1"], id="not-msgpack"),
        pytest.param(
            [b"", encode_seq(1), msgpack.packb([1.0, [["BlockStored", ["x"]]]])],
            id="bad-hash",
        ),
    ],
)
def test_an_undecodable_message_is_dropped_counted_and_loses_track(
    frames: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    subject = feed()
    subject.handle(message(0, stored(1)), 0.0)
    with caplog.at_level(logging.WARNING, LOGGER):
        subject.handle(frames, 1.0)
    assert subject.counters.undecodable == 1
    assert subject.tracker.blocks() == []  # its events are lost: the set is rebuilt
    assert "undecodable" in caplog.text and ENDPOINT in caplog.text
    subject.handle(message(2, stored(3)), 2.0)  # it took seq 1: no second gap for it
    assert subject.counters.gaps == 0 and subject.tracker.blocks() == [3]


def test_undecodable_messages_are_logged_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    subject = feed()
    with caplog.at_level(logging.WARNING, LOGGER):
        for second in range(0, 121, 10):  # 13 messages over two minutes
            subject.handle([b"garbage"], float(second))
    assert subject.counters.undecodable == 13
    assert len(caplog.records) == 3  # at 0, 60 and 120 s
    assert "5 more since the last report" in caplog.records[1].getMessage()


def test_unknown_events_are_counted_and_the_rest_applies() -> None:
    subject = feed()
    payload = msgpack.packb([1.0, [["Later", 1], ["BlockStored", [4], None, [], 16]]])
    subject.handle([b"kv", encode_seq(0), payload], 0.0)
    assert subject.counters.unknown_events == 1 and subject.tracker.blocks() == [4]


# ---- the loop, on real sockets -------------------------------------------------------------


class Publisher:
    """A PUB socket on a free loopback port, as an engine binds it."""

    def __init__(self) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    def send(self, *events: KvEvent) -> None:
        self.socket.send_multipart(message(self.seq, *events, topic=b"kv@engine"))
        self.seq += 1

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


async def test_the_loop_follows_a_real_publisher_and_closes_on_cancel() -> None:
    publisher = Publisher()
    tracker = KvBlockTracker()
    subject = KvEventFeed(publisher.endpoint, tracker)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: kv_events_loop(publisher.endpoint, tracker, feed=subject, warn_after=60)
            )
            with trio.fail_after(10):
                while subject.counters.messages == 0:  # the subscription takes a moment
                    publisher.send()
                    await trio.sleep(0.02)
                for block in range(1, 301):  # more than one burst between checkpoints
                    publisher.send(stored(block))
                publisher.send(BlockRemoved((1, 2)))
                while len(tracker) != 298:  # noqa: ASYNC110 (the feed sets no event)
                    await trio.sleep(0.01)
            assert subject.counters.gaps == 0 and 1 not in tracker and 300 in tracker
            nursery.cancel_scope.cancel()
    finally:
        publisher.close()


async def test_the_loop_warns_when_nothing_arrives_and_keeps_listening(
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = Publisher()
    tracker = KvBlockTracker()
    subject = KvEventFeed(publisher.endpoint, tracker)
    try:
        with caplog.at_level(logging.WARNING, LOGGER):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    lambda: kv_events_loop(
                        publisher.endpoint, tracker, feed=subject, warn_after=0.3
                    )
                )
                await trio.sleep(0.6)
                assert f"no message from {publisher.endpoint} within" in caplog.text
                with trio.fail_after(10):
                    while not len(tracker):
                        publisher.send(stored(5))
                        await trio.sleep(0.02)
                nursery.cancel_scope.cancel()
    finally:
        publisher.close()


async def test_nobody_publishing_is_not_an_error() -> None:
    tracker = KvBlockTracker()
    with trio.move_on_after(0.3):
        await kv_events_loop("tcp://127.0.0.1:9", tracker, warn_after=60)  # nothing listens
    assert len(tracker) == 0
