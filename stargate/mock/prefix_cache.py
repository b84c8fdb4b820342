"""The mock backend's prefix-cache model: an LRU of prompt blocks, as vLLM's prefix caching.

Pure (no I/O, no clock) and deterministic: the state depends only on the prompts looked up, in
order. See docs/mock-backend.md for the model as a whole.

* A prompt is a string (`stargate.mock.shapes.chat_cache_text` and friends build it). It is cut
  into blocks of `block_chars` characters; only whole blocks are cached (a prompt's last, partial
  block never is, so a prompt shorter than one block never hits).
* Block `i` is identified by a chain hash, `h[i] = blake2b(h[i-1] + utf8(block i))` with `h[-1]`
  sixteen zero bytes, so a block's identity covers everything before it.
* `lookup_and_insert` answers how many leading blocks of the prompt are cached (it stops at the
  first one that is not) and then inserts or refreshes every whole block of the prompt. The
  blocks are refreshed last block first, so a prompt's first block is the most recently used:
  when the cache is full, eviction (least recently used first) takes a chain's tail before its
  head, as vLLM's free-block queue does, and a prompt longer than the capacity keeps its first
  `capacity` blocks.
* `ttft_ms` scales the time to first token by the cached fraction of the prompt, and
  `uncached_tokens` counts the prompt tokens left to prefill.
* `capacity_within_kv` puts the cache inside a bounded KV cache (`--kv-cache-tokens`): it may
  hold only the blocks the running sequences leave free (see docs/mock-backend.md).
* With KV events on (`--kv-events-endpoint`, `stargate.mock.kv_events`) the blocks are keyed
  by the router's prefix chain instead (`lookup_and_insert_chain`: integers computed by the
  caller), and a `CacheListener` hears of every change in order: the blocks each operation
  stored (as runs of consecutive chain elements, each with its parent) and removed, and every
  clear.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "DEFAULT_BLOCK_CHARS",
    "DEFAULT_SPEEDUP",
    "BlockKey",
    "CacheListener",
    "Lookup",
    "PrefixCache",
    "StoredRun",
    "block_hashes",
    "capacity_within_kv",
    "tokens_per_block",
    "ttft_ms",
    "uncached_tokens",
]

# 64 characters is about 16 tokens at the mock's four characters a token (vLLM's default block
# size is 16 tokens).
DEFAULT_BLOCK_CHARS = 64
DEFAULT_SPEEDUP = 0.9

# The mock's token estimate (`stargate.mock.shapes.estimate_tokens`): four characters a token.
CHARS_PER_TOKEN = 4

_DIGEST_BYTES = 16
_ROOT = bytes(_DIGEST_BYTES)

BlockKey = bytes | int
"""A block's identity: a blake2b chain digest of the prompt text, or (KV events on) an element
of the router's prefix chain."""


@dataclass(frozen=True, slots=True)
class StoredRun:
    """Consecutive chain elements one insertion added, first to last; `parent` is the element
    before the first (None: the first block of the prompt)."""

    keys: tuple[BlockKey, ...]
    parent: BlockKey | None


class CacheListener(Protocol):
    """Hears of every change of a `PrefixCache`, in order (the KV event publisher)."""

    def blocks_changed(self, stored: Sequence[StoredRun], removed: Sequence[BlockKey]) -> None:
        """One operation stored `stored` and then removed `removed` (either may be empty, never
        both)."""

    def blocks_cleared(self) -> None:
        """The cache was emptied."""


def block_hashes(text: str, block_chars: int) -> list[bytes]:
    """The chain hashes of the whole `block_chars`-character blocks of `text`, in order."""
    if block_chars < 1:
        raise ValueError("block_chars must be at least 1")
    hashes: list[bytes] = []
    previous = _ROOT
    for start in range(0, len(text) - block_chars + 1, block_chars):
        block = text[start : start + block_chars].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + block, digest_size=_DIGEST_BYTES).digest()
        hashes.append(previous)
    return hashes


@dataclass(frozen=True, slots=True)
class Lookup:
    """What one prompt found in the cache.

    `hit_chars` is `hit_blocks * block_chars`; `prompt_chars` the prompt's whole length
    (its partial last block included); `evicted_blocks` how many blocks its insertion pushed out.
    """

    prompt_chars: int
    hit_blocks: int
    hit_chars: int
    evicted_blocks: int = 0

    @property
    def hit_fraction(self) -> float:
        """The cached share of the prompt, in [0, 1] (0 for an empty prompt)."""
        return self.hit_chars / self.prompt_chars if self.prompt_chars else 0.0


def ttft_ms(base_ms: float, hit_fraction: float, speedup: float) -> float:
    """The time to first token of a request: `base_ms * (1 - hit_fraction * speedup)`.

    `speedup` in [0, 1] is the share of `base_ms` a fully cached prompt saves.
    """
    return base_ms * (1.0 - hit_fraction * speedup)


def uncached_tokens(prompt_tokens: int, lookup: Lookup) -> int:
    """The prompt tokens left to prefill: `ceil(prompt_tokens * (1 - hit_fraction))`.

    Computed on integers (`hit_chars` and `prompt_chars`), so a whole number of uncached tokens
    never turns into one more through a rounding error; an empty prompt is all uncached.
    """
    if lookup.prompt_chars == 0:
        return prompt_tokens
    missed = lookup.prompt_chars - lookup.hit_chars
    return -(-prompt_tokens * missed // lookup.prompt_chars)


def tokens_per_block(block_chars: int) -> int:
    """The KV tokens one cache block takes: `ceil(block_chars / 4)`, at least 1."""
    return max(1, -(-block_chars // CHARS_PER_TOKEN))


def capacity_within_kv(blocks: int, block_chars: int, kv_free_tokens: int | None) -> int:
    """The cache's effective capacity in blocks: `blocks` (0 = off stays 0), lowered to the
    whole blocks that fit in `kv_free_tokens` when the KV cache is bounded (None = unbounded)."""
    if blocks == 0 or kv_free_tokens is None:
        return blocks
    return min(blocks, max(0, kv_free_tokens) // tokens_per_block(block_chars))


class PrefixCache:
    """An LRU of at most `capacity` prompt blocks of `block_chars` characters (0 = off).

    `listener` hears of every block stored and removed and of every clear (module docstring)."""

    def __init__(
        self,
        capacity: int = 0,
        block_chars: int = DEFAULT_BLOCK_CHARS,
        listener: CacheListener | None = None,
    ) -> None:
        if capacity < 0:
            raise ValueError("capacity must be non-negative")
        if block_chars < 1:
            raise ValueError("block_chars must be at least 1")
        self._capacity = capacity
        self._block_chars = block_chars
        self._listener = listener
        # Least recently used first; the values are unused.
        self._blocks: OrderedDict[BlockKey, None] = OrderedDict()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def block_chars(self) -> int:
        return self._block_chars

    def __len__(self) -> int:
        """The number of blocks cached now."""
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def clear(self) -> None:
        self._blocks.clear()
        if self._listener is not None:
            self._listener.blocks_cleared()

    def configure(self, capacity: int, block_chars: int) -> int:
        """Change the capacity and block size; returns the number of blocks evicted.

        A new block size empties the cache (its hashes no longer match any prompt's blocks);
        a lower capacity evicts least recently used blocks down to it.
        """
        if capacity < 0:
            raise ValueError("capacity must be non-negative")
        if block_chars < 1:
            raise ValueError("block_chars must be at least 1")
        evicted = 0
        if block_chars != self._block_chars:
            evicted = len(self._blocks)
            self.clear()
        self._capacity = capacity
        self._block_chars = block_chars
        removed = self._evict()
        if removed and self._listener is not None:
            self._listener.blocks_changed((), removed)
        return evicted + len(removed)

    def cached_blocks(self, text: str) -> int:
        """How many leading whole blocks of `text` are cached (no change to the LRU order)."""
        hits = 0
        for block_hash in block_hashes(text, self._block_chars):
            if block_hash not in self._blocks:
                break
            hits += 1
        return hits

    def lookup_and_insert(self, text: str) -> Lookup:
        """Look `text` up, then insert or refresh all its whole blocks (see the module doc)."""
        hashes = block_hashes(text, self._block_chars)
        return self._lookup_and_insert(hashes, len(text))

    def lookup_and_insert_chain(self, chain: Sequence[int], prompt_chars: int) -> Lookup:
        """The same for a prompt whose blocks the caller keyed (KV events on: the router's
        prefix chain, a block `block_chars` bytes of the router's prompt stream). `prompt_chars`
        is the prompt's length; the hit is `hit_blocks * block_chars`, at most `prompt_chars`
        (the router's stream frames a message as the mock's cache text does, but counts UTF-8
        bytes, not characters)."""
        return self._lookup_and_insert(chain, prompt_chars)

    def _lookup_and_insert(self, keys: Sequence[BlockKey], prompt_chars: int) -> Lookup:
        blocks = self._blocks
        hits = 0
        for key in keys:
            if key not in blocks:
                break
            hits += 1
        evicted = 0
        if self._capacity > 0:
            listener = self._listener
            inserted: list[int] = []
            for index in range(len(keys) - 1, -1, -1):
                key = keys[index]
                if key in blocks:
                    blocks.move_to_end(key)
                else:
                    blocks[key] = None
                    inserted.append(index)
            removed = self._evict()
            evicted = len(removed)
            if listener is not None and (inserted or removed):
                listener.blocks_changed(_runs(keys, inserted[::-1]), removed)
        hit_chars = min(hits * self._block_chars, prompt_chars)
        return Lookup(prompt_chars, hits, hit_chars, evicted)

    def _evict(self) -> list[BlockKey]:
        """Evict least recently used blocks down to the capacity; the keys evicted, in order."""
        blocks = self._blocks
        removed: list[BlockKey] = []
        while len(blocks) > self._capacity:
            removed.append(blocks.popitem(last=False)[0])
        return removed


def _runs(keys: Sequence[BlockKey], indices: list[int]) -> list[StoredRun]:
    """The inserted `indices` (ascending) of a prompt's `keys` as runs of consecutive elements."""
    runs: list[StoredRun] = []
    start = 0
    while start < len(indices):
        end = start
        while end + 1 < len(indices) and indices[end + 1] == indices[end] + 1:
            end += 1
        first = indices[start]
        parent = keys[first - 1] if first > 0 else None
        runs.append(StoredRun(tuple(keys[first : indices[end] + 1]), parent))
        start = end + 1
    return runs
