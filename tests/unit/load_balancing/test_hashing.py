"""The hashed byte layouts (docs/data-plane.md, Hashing): a wire format shared by every replica."""

from __future__ import annotations

import math

import xxhash
from hypothesis import given
from hypothesis import strategies as st

from stargate.load_balancing.hashing import (
    affinity_key_hash,
    pulsar_hash,
    pulsar_prefix,
    rendezvous_score,
    ring_prefix,
    tagged,
    unit_interval,
    virtual_node_hash,
)

GOLDEN_HASH = 0x19443C44EC9F8ABF


def test_golden_vector() -> None:
    """seed-1, rk-1, model-a, key prefix-123, cluster inst-a: the value the Rust router computes.
    A replica that disagrees sends every affinity key somewhere else than its peers do."""
    prefix = pulsar_prefix("seed-1", "rk-1", "model-a", "prefix-123")
    assert pulsar_hash(prefix, "inst-a") == GOLDEN_HASH


def test_golden_vector_byte_by_byte() -> None:
    def field(tag: bytes, value: bytes) -> bytes:
        return tag + b"\xff" + len(value).to_bytes(8, "little") + value

    data = (
        b"\x01"
        + field(b"seed", b"seed-1")
        + field(b"routing_key", b"rk-1")
        + field(b"model_id", b"model-a")
        + field(b"cache_affinity_key", b"prefix-123")
        + field(b"cluster_id", b"inst-a")
    )
    assert data[:5] == b"\x01seed"
    assert data[5:14] == b"\xff\x06\x00\x00\x00\x00\x00\x00\x00"
    assert xxhash.xxh3_64_intdigest(data) == GOLDEN_HASH
    assert (
        pulsar_prefix("seed-1", "rk-1", "model-a", "prefix-123") + tagged(b"cluster_id", b"inst-a")
        == data
    )


def test_absent_fields_hash_as_empty_strings() -> None:
    assert pulsar_prefix("", None, "m", None) == pulsar_prefix("", "", "m", "")
    assert ring_prefix("", None, "m") == ring_prefix("", "", "m")
    # Each field is length-prefixed, so moving bytes between fields changes the input.
    assert pulsar_prefix("ab", "c", "m", None) != pulsar_prefix("a", "bc", "m", None)


def test_ring_layout() -> None:
    prefix = ring_prefix("seed-1", "rk-1", "model-a")
    expected = (
        b"\x01"
        + tagged(b"seed", b"seed-1")
        + tagged(b"routing_key", b"rk-1")
        + tagged(b"model_id", b"model-a")
    )
    assert prefix == expected
    assert virtual_node_hash(prefix, "inst-a", 7) == xxhash.xxh3_64_intdigest(
        expected
        + tagged(b"cluster_id", b"inst-a")
        + tagged(b"virtual_node", (7).to_bytes(8, "little"))
    )
    assert affinity_key_hash(prefix, "k") == xxhash.xxh3_64_intdigest(
        expected + tagged(b"cache_affinity_key", b"k")
    )


def test_unit_interval_bounds() -> None:
    assert unit_interval(0) == 1.0 / 2.0**64
    assert unit_interval(2**64 - 1) == 1.0  # (2**64 - 1 + 1) / 2**64, rounded
    assert unit_interval(2**63) == 0.5


def test_rendezvous_score_skips_u_equal_to_one() -> None:
    assert rendezvous_score(100.0, 2**64 - 1) is None  # -ln(1) = 0: no score
    score = rendezvous_score(100.0, 2**63)
    assert score is not None and math.isclose(score, 100.0 / math.log(2))


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_unit_interval_is_in_zero_one(hash64: int) -> None:
    u = unit_interval(hash64)
    assert 0.0 < u <= 1.0
    score = rendezvous_score(3.0, hash64)
    assert score is None or (math.isfinite(score) and score > 0.0)
