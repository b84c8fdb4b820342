"""One backend's cached prefix blocks on a replica, as its Pylon publishes them.

docs/prefix-routing.md, "Precise mode". A Pylon with `--kv-events-endpoint` puts its engine's
block set on its registration messages as deltas (`kv_blocks_reset`, `kv_blocks_added`,
`kv_blocks_removed`); `RoutingState.apply_kv_blocks` applies each message's delta here, in the
order reset (forget the set), added, removed.

The set is bounded (`MAX_KV_BLOCKS`, the Pylon's `--kv-events-max-blocks` default): past it the
oldest added blocks are dropped, so a Pylon configured with a larger bound, or one that
misbehaves, cannot grow a replica's memory without end (about 140 bytes a block). It belongs to
the routing state and is shared by reference: `view` is a live, read-only set view that
`BackendSnapshot.kv_blocks` hands to the balancers, never copied (everything runs on one trio
thread, so a reader never sees a delta half applied).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, KeysView
from typing import Final

__all__ = ["MAX_KV_BLOCKS", "KvBlocks"]

MAX_KV_BLOCKS: Final = 1_000_000


class KvBlocks:
    """A bounded, insertion-ordered set of 64-bit block hashes."""

    __slots__ = ("_blocks", "dropped_over_bound", "max_blocks", "view")

    def __init__(self, max_blocks: int = MAX_KV_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.view: KeysView[int] = self._blocks.keys()
        """The set, live and read-only (an `AbstractSet[int]`)."""
        self.dropped_over_bound = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, *, reset: bool, added: Iterable[int], removed: Iterable[int]) -> None:
        """One message's delta: forget everything when `reset`, then add, then remove."""
        blocks = self._blocks
        if reset:
            blocks.clear()
        bound = self.max_blocks
        for block in added:
            if block in blocks:
                blocks.move_to_end(block)
                continue
            blocks[block] = None
            if len(blocks) > bound:
                blocks.popitem(last=False)
                self.dropped_over_bound += 1
        for block in removed:
            blocks.pop(block, None)

    def clear(self) -> None:
        self._blocks.clear()
