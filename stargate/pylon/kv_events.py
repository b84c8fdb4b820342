"""The Pylon's subscription to its engine's KV events (`--kv-events-endpoint`).

docs/prefix-routing.md, "Precise mode"; the wire format is `stargate.protocol.kv_events`. A ZMQ
SUB socket connects to the engine's PUB endpoint (every topic), and each message goes into a
`KvEventFeed`, which keeps the engine's block set in a `KvBlockTracker`
(`stargate.pylon.kv_blocks`): BlockStored adds, BlockRemoved removes, AllBlocksCleared empties.
The registration streams send the set to the replicas from there.

What the feed does with a stream it cannot follow whole:

* *A gap in `seq`* (messages lost: the publisher's or the socket's high-water mark, a
  subscription that dropped for a while): a WARNING naming the endpoint and the missing count;
  the set is no longer known (a lost BlockRemoved would leave a block the engine dropped), so it
  is emptied (`KvBlockTracker.lose_track`: every replica is sent a reset) and rebuilt from the
  events that follow. From then on it holds only blocks stored after the gap: never a block the
  engine no longer has, but not the ones it stored before (they come back as they are stored
  again). An AllBlocksCleared makes it whole again.
* *`seq` going back* (the engine restarted: a new publisher counts from 0; ZMQ reconnects by
  itself): an INFO line; the set is emptied the same way (a new engine has an empty cache).
* *The first message*: the Pylon may join a running engine; blocks stored before it joined are
  not known until they are stored again (an INFO line when the first seq is not 0).
* *An undecodable message* (not three frames, a bad seq frame, a payload that is not a batch):
  dropped and counted, logged at most once a minute (WARNING, with the count since the last
  line); its events are lost, so it counts as a gap (the set is emptied).
* *Unknown event tags*: counted, skipped; the rest of the batch applies.
* *Silence*: no message within `NO_MESSAGE_WARNING_SECONDS` (10 s) of the start is a WARNING
  naming the endpoint (nobody publishes there, or an idle engine: an engine publishes only when
  its cache changes). The Pylon keeps listening; requests are served all along.

`kv_events_loop` drives the socket from trio without a thread: it reads every message ZMQ has
(`zmq.EVENTS`, as the edge-triggered `zmq.FD` requires), then waits for the FD to be readable,
at most `EVENTS_POLL_SECONDS` (a safety net against a missed edge). It runs in the Pylon's
nursery until cancelled and then closes the socket. This module imports pyzmq and msgpack: the
sidecar imports it only when the endpoint is set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

import trio
import zmq

from stargate.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventDecodeError,
    decode_batch,
    decode_seq,
)
from stargate.pylon.kv_blocks import KvBlockTracker

__all__ = [
    "DECODE_LOG_INTERVAL_SECONDS",
    "EVENTS_POLL_SECONDS",
    "NO_MESSAGE_WARNING_SECONDS",
    "KvEventCounters",
    "KvEventFeed",
    "kv_events_loop",
]

log = logging.getLogger("stargate.pylon.kv_events")

NO_MESSAGE_WARNING_SECONDS: Final = 10.0
DECODE_LOG_INTERVAL_SECONDS: Final = 60.0
"""Undecodable messages and gaps are logged at most this often (the first one at once)."""
EVENTS_POLL_SECONDS: Final = 1.0
RECEIVE_HIGH_WATER_MARK: Final = 100_000
"""Messages ZMQ queues for the Pylon; past it ZMQ drops them (a gap)."""
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
"""A larger message makes ZMQ drop the connection (it reconnects; the Pylon sees a gap)."""
MESSAGES_PER_CHECKPOINT: Final = 256
"""A burst of messages yields to the other tasks this often."""


@dataclass(slots=True)
class KvEventCounters:
    """What the feed has seen since the start."""

    messages: int = 0
    events: int = 0
    unknown_events: int = 0
    undecodable: int = 0
    gaps: int = 0
    missed_messages: int = 0
    restarts: int = 0


class _Throttle:
    """Lets a log line through at most once every `interval` seconds; counts what it held."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.next_at: float | None = None
        self.held = 0

    def ready(self, now: float) -> bool:
        if self.next_at is None or now >= self.next_at:
            self.next_at = now + self.interval
            return True
        self.held += 1
        return False

    def take_held(self) -> int:
        held, self.held = self.held, 0
        return held


class KvEventFeed:
    """The engine's event stream applied to `tracker` (module docstring); pure but for logging:
    the caller passes the instant (`now`, seconds) with each message."""

    def __init__(self, endpoint: str, tracker: KvBlockTracker) -> None:
        self.endpoint = endpoint
        self.tracker = tracker
        self.counters = KvEventCounters()
        self._expected: int | None = None  # the next seq; None before the first message
        self._undecodable_log = _Throttle(DECODE_LOG_INTERVAL_SECONDS)
        self._gap_log = _Throttle(DECODE_LOG_INTERVAL_SECONDS)

    def handle(self, frames: list[bytes], now: float) -> None:
        """One multipart message `[topic, seq, payload]`."""
        counters = self.counters
        try:
            if len(frames) != 3:
                raise KvEventDecodeError(f"{len(frames)} frames, not [topic, seq, payload]")
            seq = decode_seq(frames[1])
            batch = decode_batch(frames[2])
        except KvEventDecodeError as error:
            counters.undecodable += 1
            if self._undecodable_log.ready(now):
                log.warning(
                    "kv events from %s: dropped an undecodable message (%s; %d more since the "
                    "last report, %d in all); its events are lost, so the block set is rebuilt",
                    self.endpoint,
                    error,
                    self._undecodable_log.take_held(),
                    counters.undecodable,
                )
            self.tracker.lose_track()
            if self._expected is not None:
                self._expected += 1  # it most likely had the next seq: no second gap for it
            return
        counters.messages += 1
        self._follow(seq, now)
        counters.unknown_events += batch.unknown
        tracker = self.tracker
        for event in batch.events:
            counters.events += 1
            if isinstance(event, BlockStored):
                tracker.store(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                tracker.remove(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                tracker.clear()

    def _follow(self, seq: int, now: float) -> None:
        expected = self._expected
        self._expected = seq + 1
        if expected is None:
            if seq != 0:
                log.info(
                    "kv events from %s: joined at seq %d; blocks the engine stored before are "
                    "known once stored again",
                    self.endpoint,
                    seq,
                )
            return
        if seq == expected:
            return
        if seq > expected:
            missed = seq - expected
            self.counters.gaps += 1
            self.counters.missed_messages += missed
            if self._gap_log.ready(now):
                log.warning(
                    "kv events from %s: missed %d message(s) (seq %d after %d; %d more gaps "
                    "since the last report); the engine's block set is unknown: emptied and "
                    "rebuilt from the events that follow",
                    self.endpoint,
                    missed,
                    seq,
                    expected - 1,
                    self._gap_log.take_held(),
                )
        else:
            self.counters.restarts += 1
            log.info(
                "kv events from %s: seq went back to %d (after %d): the engine restarted; its "
                "block set starts empty",
                self.endpoint,
                seq,
                expected - 1,
            )
        self.tracker.lose_track()


def _readable(socket: zmq.Socket[bytes]) -> bool:
    """Whether ZMQ has a message for us (`zmq.EVENTS`: its FD only signals a change)."""
    events = socket.get(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)


async def _warn_if_silent(feed: KvEventFeed, seconds: float) -> None:
    await trio.sleep(seconds)
    if feed.counters.messages == 0 and feed.counters.undecodable == 0:
        log.warning(
            "kv events: no message from %s within %.0f s of start: is the engine publishing "
            "there (vLLM: --kv-events-config with a zmq publisher)? An idle engine publishes "
            "nothing. Still listening; precise prefix routing knows no block of this engine "
            "until events arrive",
            feed.endpoint,
            seconds,
        )


async def kv_events_loop(
    endpoint: str,
    tracker: KvBlockTracker,
    *,
    feed: KvEventFeed | None = None,
    warn_after: float = NO_MESSAGE_WARNING_SECONDS,
) -> None:
    """Subscribe to `endpoint` and feed `tracker` until cancelled (module docstring)."""
    feed = feed if feed is not None else KvEventFeed(endpoint, tracker)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = context.socket(zmq.SUB)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HIGH_WATER_MARK)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(endpoint)
        log.info("kv events: subscribed to %s", endpoint)
        fd = socket.get(zmq.FD)
        if not isinstance(fd, int):  # pragma: no cover - an int on every platform with a FD
            raise TypeError(f"zmq.FD is {fd!r}, not a file descriptor")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_warn_if_silent, feed, warn_after)
            while True:
                received = 0
                while _readable(socket):
                    try:
                        frames = socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    feed.handle(frames, trio.current_time())
                    received += 1
                    if received % MESSAGES_PER_CHECKPOINT == 0:
                        await trio.lowlevel.checkpoint()
                with trio.move_on_after(EVENTS_POLL_SECONDS):
                    await trio.lowlevel.wait_readable(fd)
    finally:
        socket.close(linger=0)
        context.term()
