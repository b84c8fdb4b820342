"""The mock engine's KV events: its prefix cache's changes published as vLLM publishes them.

docs/mock-backend.md, "KV events"; the wire format is `stargate.protocol.kv_events`. With
`--kv-events-endpoint tcp://HOST:PORT` the mock binds a ZMQ PUB socket there, keys its prefix
cache by the router's prefix chain (`chain`: `derive_prefix(path, body, block_bytes,
depth).chain` of the raw request, so a block is `block_bytes` bytes of the router's prompt stream
and its hash is the one the replica's balancers compare), and publishes:

* `BlockStored` for every run of blocks a request's insertion added (`parent_block_hash` the
  chain element before the run, None for a prompt's first block; `token_ids` empty;
  `block_size` = `block_bytes // 4`, at least 1: the mock's four characters a token);
* `BlockRemoved` for every block its LRU evicts (a full cache, a lower capacity, a bounded KV
  cache filling up);
* `AllBlocksCleared` when the cache is emptied (`/test-control {"reset": true}`).

One cache operation is one message: its stored runs, then its removals. Nothing is sent from the
request path: `blocks_changed` and `blocks_cleared` put the events, numbered with their `seq`
already, on a bounded memory channel (`BUFFERED_MESSAGES`) and return; `run`, a task in the
server's nursery, encodes and sends them with a non-blocking send. When the channel is full the
message is dropped and counted (`dropped`), and its `seq` is skipped, so a subscriber sees the
gap and knows its view is incomplete (as with ZMQ's own high-water mark).

pyzmq and msgpack are imported only once a publisher binds or sends: the config and the rest of
the mock never load them.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import trio

from stargate.mock.prefix_cache import BlockKey, StoredRun
from stargate.prefix_key import DEFAULT_BLOCK_BYTES, DEFAULT_DEPTH, derive_prefix
from stargate.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    encode_batch,
    encode_seq,
)

if TYPE_CHECKING:
    import zmq

__all__ = [
    "BUFFERED_MESSAGES",
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_DEPTH",
    "KvEventPublisher",
    "KvEventsConfig",
]

log = logging.getLogger(__name__)

BUFFERED_MESSAGES: Final = 4096
"""Messages waiting for the sender task at most; more are dropped (and their seq skipped)."""
SEND_HIGH_WATER_MARK: Final = 100_000
"""ZMQ's own queue per subscriber (messages); past it ZMQ drops, and the subscriber sees a gap."""


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """`--kv-events-endpoint` (None: off), `--kv-events-block-bytes`, `--kv-events-depth`."""

    endpoint: str | None = None
    block_bytes: int = DEFAULT_BLOCK_BYTES
    depth: int = DEFAULT_DEPTH

    def __post_init__(self) -> None:
        if self.block_bytes < 1:
            raise ValueError("kv events block_bytes must be at least 1")
        if self.depth < 1:
            raise ValueError("kv events depth must be at least 1")

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None


Message = tuple[int, float, tuple[KvEvent, ...]]


class KvEventPublisher:
    """The prefix cache's `CacheListener`, and the task that publishes what it hears.

    `bind()` opens the socket (before the server starts), `run()` sends until cancelled, and
    closes it then. `sent`, `dropped` count messages; `seq` is the next message's number."""

    def __init__(
        self,
        config: KvEventsConfig,
        *,
        topic: bytes = b"",
        buffered: int = BUFFERED_MESSAGES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if config.endpoint is None:
            raise ValueError("the KV event publisher needs an endpoint")
        self.config = config
        self.endpoint = config.endpoint
        self.topic = topic
        self.block_size = max(1, config.block_bytes // 4)
        self.sent = 0
        self.dropped = 0
        self._seq = itertools.count()
        self._clock = clock
        self._send, self._receive = trio.open_memory_channel[Message](buffered)
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._socket: zmq.Socket[bytes] | None = None

    # ---- the cache's side (synchronous, never blocks) ----

    def chain(self, path: str, body: bytes) -> tuple[int, ...]:
        """The router's prefix chain of a request to `path` with `body` (empty when the router
        would derive none)."""
        derived = derive_prefix(path, body, self.config.block_bytes, self.config.depth)
        return () if derived is None else derived.chain

    def blocks_changed(self, stored: Sequence[StoredRun], removed: Sequence[BlockKey]) -> None:
        events: list[KvEvent] = [
            BlockStored(
                block_hashes=tuple(_int(key) for key in run.keys),
                parent_block_hash=None if run.parent is None else _int(run.parent),
                token_ids=(),
                block_size=self.block_size,
            )
            for run in stored
        ]
        if removed:
            events.append(BlockRemoved(tuple(_int(key) for key in removed)))
        self._publish(tuple(events))

    def blocks_cleared(self) -> None:
        self._publish((AllBlocksCleared(),))

    def _publish(self, events: tuple[KvEvent, ...]) -> None:
        message = (next(self._seq), self._clock(), events)
        try:
            self._send.send_nowait(message)
        except trio.WouldBlock:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning(
                    "kv events: the sender is %d messages behind; dropped %d so far (the "
                    "subscribers see a gap in seq)",
                    BUFFERED_MESSAGES,
                    self.dropped,
                )
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self.dropped += 1  # the server is stopping: nobody sends any more

    # ---- the socket's side ----

    def bind(self) -> None:
        """Bind the PUB socket; raises `stargate.serving.StartupError` naming the endpoint."""
        import zmq

        from stargate.serving import StartupError

        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        socket = context.socket(zmq.PUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        try:
            socket.bind(self.endpoint)
        except zmq.ZMQError as error:
            socket.close(linger=0)
            context.term()
            raise StartupError(
                f"cannot bind the KV events publisher (--kv-events-endpoint) on {self.endpoint}: "
                f"{error}"
            ) from None
        self._context, self._socket = context, socket
        log.info("kv events: publishing on %s", self.endpoint)

    async def run(self) -> None:
        """Send every message the cache produced, until cancelled; then close the socket."""
        import zmq

        socket = self._socket
        if socket is None:
            raise RuntimeError("bind() the publisher before running it")
        topic = self.topic
        try:
            async for seq, ts, events in self._receive:
                frames = [topic, encode_seq(seq), encode_batch(ts, events)]
                try:
                    socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    self.sent += 1
                except zmq.Again:  # a PUB socket drops instead; this is only a safety net
                    self.dropped += 1
        finally:
            self._send.close()
            self.close()

    def close(self) -> None:
        """Close the socket (idempotent)."""
        socket, context = self._socket, self._context
        self._socket = self._context = None
        if socket is not None:
            socket.close(linger=0)
        if context is not None:
            context.term()


def _int(key: BlockKey) -> int:
    if isinstance(key, int):
        return key
    return int.from_bytes(key[:8], "little")  # text-keyed blocks: never published in practice
