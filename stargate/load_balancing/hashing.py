"""The byte layouts the stateful balancers hash (docs/data-plane.md, Hashing).

Every replica of a fleet, whatever its implementation, must hash the same bytes to the same
64-bit value, or the same cache-affinity key lands on different clusters depending on which
replica routed it. So the layouts here are a wire format, pinned by a golden vector in the tests:

* a *tagged field* is the tag's bytes, one `0xff` byte, the value's length as an unsigned 64-bit
  little-endian integer, then the value's bytes (strings are UTF-8);
* a *request prefix* is the version byte `1`, then the tagged fields `seed`, `routing_key` and
  `model_id` (an absent seed or routing key is the empty string);
* Pulsar hashes the prefix, the tagged `cache_affinity_key` (absent: empty), then the tagged
  `cluster_id`;
* the wait-and-widen affinity ring places each virtual node of a cluster at the hash of the
  prefix, the tagged `cluster_id` and the tagged `virtual_node` (the node's index as 8 bytes,
  little-endian), and a key at the hash of the prefix and the tagged `cache_affinity_key`.

The hash is XXH3-64 with seed 0 (the `xxhash` package: a C extension). Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from typing import Final

from xxhash import xxh3_64_intdigest

__all__ = [
    "HASH_VERSION",
    "affinity_key_hash",
    "pulsar_hash",
    "pulsar_prefix",
    "rendezvous_score",
    "ring_prefix",
    "tagged",
    "unit_interval",
    "virtual_node_hash",
]

HASH_VERSION: Final = 1
_U64: Final = 2**64
# (u64::MAX as f64) + 2.0, computed in floating point as the Rust router does: 2**64 exactly,
# since u64::MAX rounds up to 2**64 and adding 2 is below half a unit in the last place.
_UNIT_DENOMINATOR: Final = float(_U64 - 1) + 2.0


def tagged(tag: bytes, value: bytes) -> bytes:
    """One tagged field: tag, 0xff, u64 little-endian length of `value`, `value`."""
    return b"".join((tag, b"\xff", len(value).to_bytes(8, "little"), value))


def ring_prefix(seed: str, routing_key: str | None, model_id: str) -> bytes:
    """Version byte, then the tagged seed, routing key and model id."""
    return b"".join(
        (
            bytes((HASH_VERSION,)),
            tagged(b"seed", seed.encode()),
            tagged(b"routing_key", (routing_key or "").encode()),
            tagged(b"model_id", model_id.encode()),
        )
    )


def pulsar_prefix(
    seed: str, routing_key: str | None, model_id: str, cache_affinity_key: str | None
) -> bytes:
    """The ring prefix followed by the tagged cache-affinity key (absent: empty)."""
    return ring_prefix(seed, routing_key, model_id) + tagged(
        b"cache_affinity_key", (cache_affinity_key or "").encode()
    )


def pulsar_hash(prefix: bytes, cluster_id: str) -> int:
    """XXH3-64 of a Pulsar prefix followed by the tagged cluster id."""
    return xxh3_64_intdigest(prefix + tagged(b"cluster_id", cluster_id.encode()))


def unit_interval(hash64: int) -> float:
    """(hash + 1) / (2**64 - 1 + 2), in floating point: a number in (0, 1].

    Both the conversion of the hash to a float (round to nearest even) and every operation are
    IEEE-754 doubles, as in the Rust router, so the value is bit-identical across replicas.
    """
    return (float(hash64) + 1.0) / _UNIT_DENOMINATOR


def rendezvous_score(weight: float, hash64: int) -> float | None:
    """Weighted rendezvous score weight / -ln(u); None when -ln(u) is not finite and positive
    (u == 1: the cluster does not take part for this key)."""
    exponent = -math.log(unit_interval(hash64))
    if not (math.isfinite(exponent) and exponent > 0.0):
        return None
    return weight / exponent


def virtual_node_hash(prefix: bytes, cluster_id: str, virtual_node: int) -> int:
    """Where one virtual node of a cluster sits on the affinity ring."""
    return xxh3_64_intdigest(
        b"".join(
            (
                prefix,
                tagged(b"cluster_id", cluster_id.encode()),
                tagged(b"virtual_node", virtual_node.to_bytes(8, "little")),
            )
        )
    )


def affinity_key_hash(prefix: bytes, cache_affinity_key: str) -> int:
    """Where a cache-affinity key sits on the affinity ring."""
    return xxh3_64_intdigest(prefix + tagged(b"cache_affinity_key", cache_affinity_key.encode()))
