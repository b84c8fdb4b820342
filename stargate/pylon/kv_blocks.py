"""The engine's cached prefix blocks as the Pylon knows them, and the deltas each registration
stream sends (pure: no I/O, no clock).

docs/prefix-routing.md, "Precise mode". `stargate.pylon.kv_events` feeds a `KvBlockTracker`
with the engine's KV events; every registration stream holds a `StreamCursor` and, on each
heartbeat, takes `KvBlockTracker.delta(cursor)`: what the replica at the other end must apply to
the set it has from this stream to hold the Pylon's set.

*The set.* An insertion-ordered set of 64-bit block hashes, at most `max_blocks`
(`--kv-events-max-blocks`): a block stored again moves to the end, and past the bound the oldest
stored blocks are dropped (and sent as removed, so the replicas drop them too).

*The change log.* Every change of the set (a block added or removed) gets the next version
number and goes into a bounded log (`max_changes`). A cursor remembers the version its stream
has sent up to; its delta is the net effect of the log since then (the last change of a block
wins, so a block never is both added and removed in one delta).

*Resets.* A delta is a reset (`KvDelta.reset`: the replica forgets its set, then adds `added`)
when the stream has sent nothing yet (its first heartbeat), when the log no longer holds every
change since its version (more changes than `max_changes` between two of its heartbeats), and
when the Pylon lost track of the engine's set (`lose_track`: a gap in the event stream, an
undecodable message, a restarted engine) or the engine cleared it (`clear`) since its version.
A reset carries the whole set, at most `max_per_message` hashes per message: a larger set is
sent in chunks (`StreamCursor.syncing` stays True until the last one; the sidecar sends them
back to back), and the log's changes follow once the chunks are all sent. The replica applies
a message as: reset (forget), then `added`, then `removed`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "DEFAULT_MAX_BLOCKS",
    "DEFAULT_MAX_CHANGES",
    "DEFAULT_MAX_PER_MESSAGE",
    "KvBlockTracker",
    "KvDelta",
    "StreamCursor",
]

DEFAULT_MAX_BLOCKS: Final = 1_000_000
"""`--kv-events-max-blocks`."""
DEFAULT_MAX_CHANGES: Final = 65_536
"""Changes the log holds: a stream further behind is sent a reset."""
DEFAULT_MAX_PER_MESSAGE: Final = 262_144
"""Hashes of a reset per registration message: 2 MiB of fixed64, so a message stays below the
replica's default `--grpc-max-message-bytes` (4 MiB) with a full log's delta beside it."""


@dataclass(frozen=True, slots=True)
class KvDelta:
    """What one registration message carries: forget the set first (`reset`), then add `added`,
    then remove `removed`."""

    reset: bool = False
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.reset or self.added or self.removed)


@dataclass(slots=True)
class StreamCursor:
    """One registration stream's position: the version it has sent up to (None: nothing yet),
    and the rest of a reset still to send."""

    version: int | None = None
    pending: list[int] = field(default_factory=list)

    @property
    def syncing(self) -> bool:
        """A reset is being sent in chunks: the next message carries the next chunk."""
        return bool(self.pending)


class KvBlockTracker:
    """The engine's block set, its change log, and the deltas of every stream (module doc)."""

    def __init__(
        self,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        *,
        max_changes: int = DEFAULT_MAX_CHANGES,
        max_per_message: int = DEFAULT_MAX_PER_MESSAGE,
    ) -> None:
        if max_blocks < 1 or max_changes < 1 or max_per_message < 1:
            raise ValueError("the KV block bounds must be at least 1")
        self.max_blocks = max_blocks
        self.max_changes = max_changes
        self.max_per_message = max_per_message
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.version = 0
        """Changes ever made (each one's number)."""
        self._log: list[tuple[int, bool]] = []  # (hash, stored) of versions log_start+1, ...
        self._log_start = 0
        self._reset_at = 0
        """The version of the last clear or loss of track: older cursors get a reset."""
        self.dropped_over_bound = 0
        """Blocks dropped because the set was full (`max_blocks`)."""
        self.resets = 0
        """Clears and losses of track."""

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def blocks(self) -> list[int]:
        """The set now, oldest stored first."""
        return list(self._blocks)

    # ---- the engine's events ----

    def store(self, hashes: Iterable[int]) -> None:
        """BlockStored: add (or refresh) blocks; past `max_blocks` the oldest go."""
        blocks = self._blocks
        for block in hashes:
            if block in blocks:
                blocks.move_to_end(block)
                continue
            blocks[block] = None
            self._record(block, True)
            if len(blocks) > self.max_blocks:
                oldest, _ = blocks.popitem(last=False)
                self._record(oldest, False)
                self.dropped_over_bound += 1

    def remove(self, hashes: Iterable[int]) -> None:
        """BlockRemoved: drop blocks (unknown ones are ignored)."""
        blocks = self._blocks
        for block in hashes:
            if block in blocks:
                del blocks[block]
                self._record(block, False)

    def clear(self) -> None:
        """AllBlocksCleared: the engine's cache is empty; every stream is sent a reset."""
        self._blocks.clear()
        self.version += 1
        self._reset_at = self.version
        self._log.clear()
        self._log_start = self.version
        self.resets += 1

    def lose_track(self) -> None:
        """The Pylon missed events (a gap, an undecodable message, a restarted engine): what it
        knows may hold blocks the engine dropped since. The set is emptied and every stream is
        sent a reset; the blocks stored from now on rebuild it (module docstring)."""
        self.clear()

    def _record(self, block: int, stored: bool) -> None:
        self.version += 1
        log = self._log
        log.append((block, stored))
        if len(log) > 2 * self.max_changes:  # trimmed in bulk: amortized O(1) per change
            cut = len(log) - self.max_changes
            del log[:cut]
            self._log_start += cut

    # ---- the streams ----

    def cursor(self) -> StreamCursor:
        """A new stream's cursor: its first delta is a reset."""
        return StreamCursor()

    def delta(self, cursor: StreamCursor) -> KvDelta:
        """What the next message of `cursor`'s stream carries (module docstring); advances the
        cursor."""
        size = self.max_per_message
        version = cursor.version
        if version is None or version < self._reset_at or version < self._log_start:
            snapshot = list(self._blocks)
            cursor.version = self.version
            cursor.pending = snapshot[size:]
            return KvDelta(reset=True, added=tuple(snapshot[:size]))
        if cursor.pending:  # the rest of a reset first; the log's changes follow it
            chunk, cursor.pending = cursor.pending[:size], cursor.pending[size:]
            return KvDelta(added=tuple(chunk))
        if version == self.version:
            return KvDelta()
        net: dict[int, bool] = {}
        for block, stored in self._log[version - self._log_start :]:
            net[block] = stored
        cursor.version = self.version
        return KvDelta(
            added=tuple(block for block, stored in net.items() if stored),
            removed=tuple(block for block, stored in net.items() if not stored),
        )
