"""vLLM's KV-cache event stream: the wire format (pure, no I/O).

docs/prefix-routing.md, "Precise mode". An engine publishes what its prefix cache stores and
evicts on a ZMQ PUB socket; `stargate mock-backend --kv-events-endpoint` publishes it, and
`stargate pylon --kv-events-endpoint` subscribes to it. The format is vLLM's
(`vllm/distributed/kv_events.py`), so a Pylon reads a real vLLM engine as well as the mock:

* every message is multipart `[topic, seq, payload]`: `topic` any bytes (vLLM's `topic`
  setting, empty by default; a subscriber takes every topic), `seq` an 8-byte big-endian
  counter from 0 per publisher, one per message, and `payload` msgpack;
* the payload is an array `[ts, [event, ...]]` (msgspec's `array_like` struct `EventBatch`;
  vLLM may append a data-parallel rank, and any further trailing item is ignored too), `ts` a
  float (seconds since the epoch);
* an event is an array whose first item is its tag (msgspec's `array_like=True, tag=True`):
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
  `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`. Trailing fields at their
  default may be omitted (msgspec's `omit_defaults`), and fields after the known ones (a newer
  vLLM) are ignored.

*Block hashes.* A hash is an integer: an unsigned 64-bit one is taken as is; a negative one
(older vLLM published Python's signed `hash()`) as its two's complement, so it is always in
[0, 2**64). vLLM's `ExternalBlockHash` may also be bytes (a SHA-256 digest): then its first 8
bytes, read as an unsigned little-endian integer, are the hash. Block hashes are compared only
with each other (the replica matches them against the router's prefix chain,
`stargate.prefix_key`, which the mock engine publishes), never interpreted.

*Bad input.* `decode_batch` raises `KvEventDecodeError` for anything it cannot read whole: not
msgpack, not the batch shape, a known event with a field of the wrong type, a hash that is
neither an integer nor bytes. An event with an unknown tag is not an error: it is counted in
`EventBatch.unknown` and skipped (a newer engine may publish kinds a Pylon does not know).

msgpack is imported on first use, not with this module: the command-line flags parse their
endpoints here, and a process that does not use KV events never loads it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from stargate.addresses import canonical_host, format_host_port, ip_literal, is_host_name

__all__ = [
    "U64_MASK",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KvEvent",
    "KvEventDecodeError",
    "block_hash",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
    "parse_tcp_endpoint",
]

U64_MASK: Final = (1 << 64) - 1
SEQ_BYTES: Final = 8


class KvEventDecodeError(ValueError):
    """A KV event message that cannot be read (module docstring, "Bad input")."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks the engine's prefix cache now holds: `block_hashes` in chain order, the first one's
    parent `parent_block_hash` (None: the first block of a prompt)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine's prefix cache evicted."""

    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine emptied its prefix cache (vLLM's `reset_prefix_cache`)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One message's payload: its timestamp, its known events in order, and how many events
    with an unknown tag it skipped."""

    ts: float
    events: tuple[KvEvent, ...]
    unknown: int = 0


# ---- block hashes ---------------------------------------------------------------------------


def block_hash(value: object) -> int:
    """A wire block hash as an unsigned 64-bit integer (module docstring, "Block hashes")."""
    if isinstance(value, bool):
        raise KvEventDecodeError("a block hash is a boolean")
    if isinstance(value, int):
        return value & U64_MASK
    if isinstance(value, bytes | bytearray):
        if not value:
            raise KvEventDecodeError("a block hash is empty bytes")
        return int.from_bytes(value[:8], "little")
    raise KvEventDecodeError(f"a block hash is a {type(value).__name__}")


def _hashes(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KvEventDecodeError(f"{what}: block_hashes is not an array")
    return tuple(block_hash(item) for item in value)


def _optional_hash(value: object) -> int | None:
    return None if value is None else block_hash(value)


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KvEventDecodeError(f"{what} is not an integer")
    return value


def _optional_int(value: object, what: str) -> int | None:
    return None if value is None else _int(value, what)


def _optional_str(value: object, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise KvEventDecodeError(f"{what} is not a string")


# ---- events -----------------------------------------------------------------------------------


def _block_stored(fields: list[Any]) -> BlockStored:
    if not fields:
        raise KvEventDecodeError("BlockStored without block_hashes")
    padded = [*fields[:6], *([None] * (6 - min(len(fields), 6)))]
    hashes, parent, token_ids, block_size, lora_id, medium = padded
    if token_ids is None:
        tokens: tuple[int, ...] = ()
    elif isinstance(token_ids, list):
        tokens = tuple(_int(token, "BlockStored token id") for token in token_ids)
    else:
        raise KvEventDecodeError("BlockStored: token_ids is not an array")
    return BlockStored(
        block_hashes=_hashes(hashes, "BlockStored"),
        parent_block_hash=_optional_hash(parent),
        token_ids=tokens,
        block_size=0 if block_size is None else _int(block_size, "BlockStored block_size"),
        lora_id=_optional_int(lora_id, "BlockStored lora_id"),
        medium=_optional_str(medium, "BlockStored medium"),
    )


def _block_removed(fields: list[Any]) -> BlockRemoved:
    if not fields:
        raise KvEventDecodeError("BlockRemoved without block_hashes")
    medium = fields[1] if len(fields) > 1 else None
    return BlockRemoved(
        block_hashes=_hashes(fields[0], "BlockRemoved"),
        medium=_optional_str(medium, "BlockRemoved medium"),
    )


def _event(item: object) -> KvEvent | None:
    """One wire event, or None for an unknown tag."""
    if not isinstance(item, list) or not item:
        raise KvEventDecodeError("an event is not a non-empty array")
    tag, fields = item[0], item[1:]
    if not isinstance(tag, str):
        raise KvEventDecodeError("an event's tag is not a string")
    if tag == "BlockStored":
        return _block_stored(fields)
    if tag == "BlockRemoved":
        return _block_removed(fields)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _wire_event(event: KvEvent) -> list[Any]:
    """The array form of one event, trailing defaults omitted (as msgspec's `omit_defaults`)."""
    if isinstance(event, BlockStored):
        fields: list[Any] = [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
        ]
        while len(fields) > 5 and fields[-1] is None:
            fields.pop()
        return fields
    if isinstance(event, BlockRemoved):
        removed: list[Any] = ["BlockRemoved", list(event.block_hashes)]
        if event.medium is not None:
            removed.append(event.medium)
        return removed
    return ["AllBlocksCleared"]


# ---- messages ---------------------------------------------------------------------------------


def encode_seq(seq: int) -> bytes:
    """The `seq` frame: 8 bytes, big-endian."""
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise KvEventDecodeError(f"the seq frame has {len(frame)} bytes, not {SEQ_BYTES}")
    return int.from_bytes(frame, "big")


def encode_batch(
    ts: float, events: Iterable[KvEvent], data_parallel_rank: int | None = None
) -> bytes:
    """The msgpack payload of one message (`[ts, [event, ...]]`, plus the rank when given)."""
    import msgpack  # type: ignore[import-untyped]  # first use only (module docstring)

    batch: list[Any] = [float(ts), [_wire_event(event) for event in events]]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    payload: bytes = msgpack.packb(batch, use_bin_type=True)
    return payload


def decode_batch(payload: bytes) -> EventBatch:
    """One message's payload; raises `KvEventDecodeError` (module docstring, "Bad input")."""
    import msgpack  # first use only (module docstring)

    try:
        batch = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=False)
    except Exception as error:  # msgpack raises several kinds for malformed input
        raise KvEventDecodeError(f"not msgpack: {type(error).__name__}: {error}") from None
    if not isinstance(batch, list) or len(batch) < 2:
        raise KvEventDecodeError("the payload is not an array [ts, events, ...]")
    ts, items = batch[0], batch[1]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise KvEventDecodeError("the batch's ts is not a finite number")
    if not isinstance(items, list):
        raise KvEventDecodeError("the batch's events are not an array")
    events: list[KvEvent] = []
    unknown = 0
    for item in items:
        event = _event(item)
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return EventBatch(float(ts), tuple(events), unknown)


# ---- endpoints --------------------------------------------------------------------------------


def parse_tcp_endpoint(text: str, *, bind: bool = False) -> str:
    """A ZMQ TCP endpoint, `tcp://HOST:PORT` (port 1-65535), in canonical form.

    HOST is an IP address (IPv6 in brackets) or a host name; to `bind` (the publisher), an IP
    address or `*` (every interface), as ZMQ binds. Raises ValueError naming what is wrong."""
    value = text.strip()
    if not value.startswith("tcp://"):
        raise ValueError(f"{text!r} is not a tcp://HOST:PORT endpoint")
    rest = value[len("tcp://") :]
    host, colon, port_text = rest.rpartition(":")
    if not colon or not host or not port_text:
        raise ValueError(f"{text!r} is not a tcp://HOST:PORT endpoint")
    if not (port_text.isascii() and port_text.isdigit() and 1 <= int(port_text) <= 65535):
        raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
    port = int(port_text)
    if host.startswith("[") and host.endswith("]"):
        inner = host[1:-1]
        if ip_literal(inner) is None or ":" not in inner:
            raise ValueError(f"{text!r}: {host} is not an IPv6 address")
        return f"tcp://{format_host_port(canonical_host(inner), port)}"
    if ":" in host:
        raise ValueError(f"{text!r}: an IPv6 address must be written in brackets")
    if host == "*" and bind:
        return f"tcp://*:{port}"
    if ip_literal(host) is not None:
        return f"tcp://{format_host_port(canonical_host(host), port)}"
    if bind:
        raise ValueError(f"{text!r}: bind to an IP address or * (every interface)")
    if not is_host_name(host):
        raise ValueError(f"{text!r}: {host!r} is neither an IP address nor a host name")
    return f"tcp://{format_host_port(canonical_host(host), port)}"
