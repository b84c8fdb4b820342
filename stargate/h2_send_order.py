"""The order in which an HTTP/2 connection's streams get their turn to send: round robin.

Hypercorn keeps, per HTTP/2 connection, a `priority.PriorityTree`: the RFC 7540 dependency tree
with weights, which its send task asks for the next stream with data. RFC 9113 §5.3.2 deprecated
that scheme, and none of our clients use it: gRPC clients (Pylons, `WatchStargates`) and HTTP
clients send no PRIORITY frames, so every stream hangs off the root with the same weight. The tree
still costs a weighted-fair-queueing walk with a heap for every turn, plus an object per stream;
with a thousand Pylons heartbeating it was about 15% of the replica's CPU (docs/performance.md,
"Control plane"). `RoundRobin` gives every stream with data a turn in order, first come first
served, in O(1) per operation, which is what the tree computes for equal siblings.

It has exactly the interface and the exceptions of the tree as Hypercorn uses it (`insert_stream`,
`remove_stream`, `block`, `unblock`, `reprioritize`, `next()`), and keeps its bound on streams
held at once (`maximum_streams`, stream 0 included), which stargate/hypercorn_patches/h2.py turns
into REFUSED_STREAM. Priority signals are accepted and ignored: a client cannot reorder the
connection's streams, and cannot make a stream depend on one that would starve it.
stargate/hypercorn_patches/h2.py (`init`) installs it on every connection.
"""

from __future__ import annotations

from priority.priority import (
    DeadlockError,
    DuplicateStreamError,
    MissingStreamError,
    PseudoStreamError,
    TooManyStreamsError,
)

__all__ = ["MAXIMUM_STREAMS", "RoundRobin"]

MAXIMUM_STREAMS = 1000
"""Streams held at once, stream 0 included: the bound of Hypercorn's tree, kept."""


class RoundRobin:
    """Streams with data to send, in turn.

    `next()` returns the stream whose turn it is and moves it to the back of the line (it keeps
    its place in the rotation until it is blocked or removed); it raises `DeadlockError` when no
    stream has data. A stream is inserted ready, as in the tree (Hypercorn blocks it at once).
    """

    __slots__ = ("_maximum", "_ready", "_streams")

    def __init__(self, maximum_streams: int = MAXIMUM_STREAMS) -> None:
        if maximum_streams <= 0:
            raise ValueError("maximum_streams must be a positive integer.")
        self._maximum = maximum_streams
        self._streams: set[int] = set()  # every stream held, blocked or not
        self._ready: dict[int, None] = {}  # streams with data, in turn order (insertion order)

    def insert_stream(
        self,
        stream_id: int,
        depends_on: int | None = None,
        weight: int = 16,
        exclusive: bool = False,
    ) -> None:
        if stream_id in self._streams:
            raise DuplicateStreamError(f"Stream {stream_id} already in tree")
        if len(self._streams) + 2 > self._maximum:  # +1 for stream 0, +1 for this one
            raise TooManyStreamsError(
                f"Refusing to insert {self._maximum + 1} streams into priority tree at once"
            )
        self._streams.add(stream_id)
        self._ready[stream_id] = None

    def reprioritize(
        self,
        stream_id: int,
        depends_on: int | None = None,
        weight: int = 16,
        exclusive: bool = False,
    ) -> None:
        self._check(stream_id)

    def remove_stream(self, stream_id: int) -> None:
        self._check(stream_id)
        self._streams.discard(stream_id)
        self._ready.pop(stream_id, None)

    def block(self, stream_id: int) -> None:
        self._check(stream_id)
        self._ready.pop(stream_id, None)

    def unblock(self, stream_id: int) -> None:
        self._check(stream_id)
        if stream_id not in self._ready:
            self._ready[stream_id] = None

    def __iter__(self) -> RoundRobin:
        return self

    def __next__(self) -> int:
        ready = self._ready
        if not ready:
            raise DeadlockError("No unblocked streams to schedule.")
        stream_id = next(iter(ready))
        del ready[stream_id]
        ready[stream_id] = None  # to the back of the line
        return stream_id

    def next(self) -> int:
        return self.__next__()

    def __len__(self) -> int:
        """Streams held (blocked or not), stream 0 not counted."""
        return len(self._streams)

    def _check(self, stream_id: int) -> None:
        if stream_id == 0:
            raise PseudoStreamError("Stream 0 is the root")
        if stream_id not in self._streams:
            raise MissingStreamError(f"Stream {stream_id} not in tree")
