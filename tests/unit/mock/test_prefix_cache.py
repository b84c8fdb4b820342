"""The mock backend's prefix-cache model (stargate/mock/prefix_cache.py) with plain strings: block
chain hashes, longest cached prefix, LRU eviction tail first, resizing, and the TTFT formula."""

from __future__ import annotations

import pytest

from stargate.mock.prefix_cache import (
    DEFAULT_BLOCK_CHARS,
    DEFAULT_SPEEDUP,
    Lookup,
    PrefixCache,
    block_hashes,
    ttft_ms,
)


def text(*blocks: str, block_chars: int = 4) -> str:
    """One block of `block_chars` characters per letter: text("a", "b") == "aaaabbbb"."""
    return "".join(letter * block_chars for letter in blocks)


def test_defaults() -> None:
    assert (DEFAULT_BLOCK_CHARS, DEFAULT_SPEEDUP) == (64, 0.9)
    cache = PrefixCache()
    assert (cache.capacity, cache.block_chars, len(cache)) == (0, 64, 0)


def test_block_hashes_cover_whole_blocks_and_chain_on_the_prefix() -> None:
    assert block_hashes("", 4) == []
    assert block_hashes("abc", 4) == []  # a partial block is never a block
    assert len(block_hashes("abcdefghij", 4)) == 2
    first = block_hashes(text("a", "b", "c"), 4)
    assert len(set(first)) == 3
    assert all(len(digest) == 16 for digest in first)
    # The same prefix gives the same hashes, whatever follows it.
    assert block_hashes(text("a", "b", "x") + "tail", 4)[:2] == first[:2]
    # A block's hash covers everything before it: the same block after another prefix differs.
    assert block_hashes(text("x", "b", "c"), 4)[1:] != first[1:]
    assert block_hashes(text("b"), 4)[0] != first[1]
    # Deterministic, across calls (and processes: blake2b, not the salted hash()).
    assert block_hashes(text("a", "b", "c"), 4) == first
    # Characters, not bytes; lone surrogates (valid JSON escapes) hash too.
    assert len(block_hashes("ééééüüüü", 4)) == 2
    assert len(block_hashes("\ud800abc", 4)) == 1
    with pytest.raises(ValueError):
        block_hashes("abcd", 0)


def test_a_repeated_prompt_hits_its_whole_blocks() -> None:
    cache = PrefixCache(capacity=100, block_chars=4)
    prompt = text("a", "b", "c") + "zz"  # 3 whole blocks and a partial one
    assert cache.lookup_and_insert(prompt) == Lookup(prompt_chars=14, hit_blocks=0, hit_chars=0)
    assert len(cache) == 3
    again = cache.lookup_and_insert(prompt)
    assert again == Lookup(prompt_chars=14, hit_blocks=3, hit_chars=12)
    assert again.hit_fraction == pytest.approx(12 / 14)
    assert len(cache) == 3


def test_the_longest_cached_prefix_stops_at_the_first_miss() -> None:
    cache = PrefixCache(capacity=100, block_chars=4)
    cache.lookup_and_insert(text("a", "b", "c", "d"))
    # Shares two blocks, then diverges; its fourth block equals the first prompt's but counts
    # not (its chain hash differs anyway).
    assert cache.lookup_and_insert(text("a", "b", "x", "d")).hit_blocks == 2
    # A longer conversation hits every block of the earlier one.
    assert cache.lookup_and_insert(text("a", "b", "c", "d", "e", "f")).hit_blocks == 4
    assert cache.lookup_and_insert(text("a", "b", "c", "d", "e", "f")).hit_blocks == 6
    # A different first block hits nothing.
    assert cache.lookup_and_insert(text("z", "b", "c", "d")).hit_blocks == 0
    # Shorter than a block: never cached, never a hit.
    assert cache.lookup_and_insert("aaa") == Lookup(3, 0, 0)
    assert cache.lookup_and_insert("aaa") == Lookup(3, 0, 0)
    assert cache.lookup_and_insert("") == Lookup(0, 0, 0)
    assert Lookup(0, 0, 0).hit_fraction == 0.0


def test_cached_blocks_looks_without_inserting() -> None:
    cache = PrefixCache(capacity=100, block_chars=4)
    assert cache.cached_blocks(text("a", "b")) == 0
    assert len(cache) == 0
    cache.lookup_and_insert(text("a", "b"))
    assert cache.cached_blocks(text("a", "b", "c")) == 2
    assert block_hashes(text("a"), 4)[0] in cache


def test_lru_eviction_takes_the_least_recently_used_chain_tail_first() -> None:
    cache = PrefixCache(capacity=4, block_chars=4)
    a = text("a", "a", "a", "a")
    b = text("b", "b")
    cache.lookup_and_insert(a)
    assert len(cache) == 4
    # Two new blocks push out the two least recently used: a's last two blocks, not its first.
    assert cache.lookup_and_insert(b).evicted_blocks == 2
    assert len(cache) == 4
    assert cache.cached_blocks(a) == 2
    assert cache.cached_blocks(b) == 2
    # Using a again refreshes its head and re-inserts its tail; b (now the oldest) goes.
    assert cache.lookup_and_insert(a) == Lookup(16, 2, 8, evicted_blocks=2)
    assert cache.cached_blocks(a) == 4
    assert cache.cached_blocks(b) == 0


def test_a_hit_refreshes_the_blocks() -> None:
    cache = PrefixCache(capacity=2, block_chars=4)
    cache.lookup_and_insert(text("a"))
    cache.lookup_and_insert(text("b"))
    cache.lookup_and_insert(text("a"))  # a is now the most recently used
    cache.lookup_and_insert(text("c"))  # evicts b
    assert cache.cached_blocks(text("a")) == 1
    assert cache.cached_blocks(text("b")) == 0
    assert cache.cached_blocks(text("c")) == 1


def test_a_prompt_longer_than_the_capacity_keeps_its_first_blocks() -> None:
    cache = PrefixCache(capacity=3, block_chars=4)
    prompt = text("a", "b", "c", "d", "e")
    assert cache.lookup_and_insert(prompt).evicted_blocks == 2
    assert len(cache) == 3
    assert cache.lookup_and_insert(prompt).hit_blocks == 3


def test_capacity_zero_caches_nothing() -> None:
    cache = PrefixCache(capacity=0, block_chars=4)
    assert cache.lookup_and_insert(text("a", "b")) == Lookup(8, 0, 0)
    assert cache.lookup_and_insert(text("a", "b")) == Lookup(8, 0, 0)
    assert len(cache) == 0


def test_configure_evicts_down_to_the_capacity_and_a_new_block_size_empties() -> None:
    cache = PrefixCache(capacity=10, block_chars=4)
    cache.lookup_and_insert(text("a", "b", "c"))
    cache.lookup_and_insert(text("x"))
    assert cache.configure(10, 4) == 0
    assert len(cache) == 4
    assert cache.configure(2, 4) == 2  # the least recently used: a's chain, tail first
    assert (cache.capacity, len(cache)) == (2, 2)
    assert cache.cached_blocks(text("a", "b", "c")) == 1
    assert cache.cached_blocks(text("x")) == 1
    assert cache.configure(5, 8) == 2
    assert (cache.capacity, cache.block_chars, len(cache)) == (5, 8, 0)
    cache.lookup_and_insert(text("a", "b", block_chars=8))
    assert cache.configure(0, 8) == 2
    cache.lookup_and_insert(text("a", block_chars=8))
    assert len(cache) == 0
    cache.configure(5, 8)
    cache.lookup_and_insert(text("a", block_chars=8))
    cache.clear()
    assert len(cache) == 0
    for capacity, block_chars in ((-1, 4), (1, 0)):
        with pytest.raises(ValueError):
            cache.configure(capacity, block_chars)
        with pytest.raises(ValueError):
            PrefixCache(capacity, block_chars)


def test_the_same_prompts_in_the_same_order_give_the_same_answers() -> None:
    prompts = [text(*letters) for letters in ("ab", "abc", "xy", "abd", "xyz", "ab", "q", "abc")]
    runs = []
    for _ in range(2):
        cache = PrefixCache(capacity=5, block_chars=4)
        runs.append([cache.lookup_and_insert(prompt) for prompt in prompts])
    assert runs[0] == runs[1]
    assert [lookup.hit_blocks for lookup in runs[0]] == [0, 2, 0, 2, 2, 2, 0, 2]


@pytest.mark.parametrize(
    ("base", "fraction", "speedup", "expected"),
    [
        (100.0, 0.0, 0.9, 100.0),
        (100.0, 1.0, 0.9, 10.0),
        (100.0, 0.5, 0.9, 55.0),
        (100.0, 1.0, 1.0, 0.0),
        (100.0, 1.0, 0.0, 100.0),
        (0.0, 1.0, 0.9, 0.0),
    ],
)
def test_ttft_formula(base: float, fraction: float, speedup: float, expected: float) -> None:
    assert ttft_ms(base, fraction, speedup) == pytest.approx(expected)
