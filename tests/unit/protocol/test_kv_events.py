"""vLLM's KV-event wire format (stargate/protocol/kv_events.py): golden bytes made with msgpack
from the documented formats (as vLLM's msgspec encoder writes them), the round trip of our own
encoder, bad input, and the endpoint syntax."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stargate.protocol.kv_events import (
    U64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventDecodeError,
    block_hash,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    parse_tcp_endpoint,
)


def packed(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


# A vLLM batch as msgspec encodes it (array_like, tag first): every field of BlockStored given.
VLLM_BATCH = [
    1_700_000_000.25,
    [
        ["BlockStored", [11, 12, 13], None, [1, 2, 3, 4], 16, None, "GPU"],
        ["BlockStored", [14], 13, [5], 16],  # trailing defaults omitted (omit_defaults)
        ["BlockRemoved", [11], "GPU"],
        ["BlockRemoved", [12]],
        ["AllBlocksCleared"],
    ],
]


def test_a_vllm_batch_decodes_event_by_event() -> None:
    batch = decode_batch(packed(VLLM_BATCH))
    assert batch == EventBatch(
        ts=1_700_000_000.25,
        events=(
            BlockStored((11, 12, 13), None, (1, 2, 3, 4), 16, None, "GPU"),
            BlockStored((14,), 13, (5,), 16),
            BlockRemoved((11,), "GPU"),
            BlockRemoved((12,)),
            AllBlocksCleared(),
        ),
        unknown=0,
    )


def test_golden_bytes() -> None:
    """The exact bytes of a small batch: array(2) [float64 ts, array(1) [array(5) ["BlockStored",
    array(1) [7], nil, array(0), 64]]]; a decoder must read them, our encoder must write them."""
    golden = bytes.fromhex(
        "92"  # array of 2: [ts, events]
        "cb41d954fc40000000"  # float64 1.7e9
        "91"  # events: array of 1
        "95"  # the event: array of 5
        "ab426c6f636b53746f726564"  # "BlockStored" (fixstr of 11)
        "9107"  # block_hashes [7]
        "c0"  # parent nil
        "90"  # token_ids []
        "40"  # block_size 64
    )
    assert golden == packed([1.7e9, [["BlockStored", [7], None, [], 64]]])
    expected = EventBatch(1.7e9, (BlockStored((7,), None, (), 64),))
    assert decode_batch(golden) == expected
    assert encode_batch(1.7e9, expected.events) == golden


def test_our_encoder_round_trips_and_omits_trailing_defaults() -> None:
    events = (
        BlockStored((1, 2**64 - 1), None, (), 64),
        BlockStored((3,), 2, (9, 9), 16, 7, "CPU"),
        BlockRemoved((1,)),
        BlockRemoved((3,), "CPU"),
        AllBlocksCleared(),
    )
    payload = encode_batch(12.5, events)
    raw = msgpack.unpackb(payload)
    assert raw[1][0] == ["BlockStored", [1, 2**64 - 1], None, [], 64]
    assert raw[1][2] == ["BlockRemoved", [1]]
    assert decode_batch(payload) == EventBatch(12.5, events)
    # vLLM's data-parallel rank (and anything after it) is accepted and ignored.
    assert decode_batch(encode_batch(12.5, events, data_parallel_rank=3)) == EventBatch(
        12.5, events
    )
    assert decode_batch(packed([1, [], 0, "later"])) == EventBatch(1.0, ())


def test_block_hashes_as_bytes_and_signed_integers() -> None:
    digest = bytes(range(32))  # vLLM's ExternalBlockHash as a SHA-256 digest
    assert block_hash(digest) == int.from_bytes(bytes(range(8)), "little")
    assert block_hash(b"\x01") == 1  # shorter than 8 bytes: its value
    assert block_hash(-1) == U64_MASK  # Python's signed hash(): two's complement
    assert block_hash(2**64 - 1) == U64_MASK
    batch = decode_batch(packed([0.0, [["BlockStored", [digest, -2], digest, [], 16]]]))
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (block_hash(digest), U64_MASK - 1)
    assert event.parent_block_hash == block_hash(digest)


def test_unknown_tags_are_counted_and_skipped() -> None:
    batch = decode_batch(
        packed([0.0, [["Future", 1, 2], ["BlockRemoved", [5]], ["AllBlocksCleared", "extra"]]])
    )
    assert batch.unknown == 1
    assert batch.events == (BlockRemoved((5,)), AllBlocksCleared())
    # Fields after the known ones (a newer vLLM) are ignored.
    later = decode_batch(packed([0.0, [["BlockStored", [1], None, [], 16, None, None, "x", 9]]]))
    assert later.events == (BlockStored((1,), None, (), 16),)


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\xc1", id="not-msgpack"),
        pytest.param(packed([1.0, []]) + b"\x00", id="extra-data"),
        pytest.param(b"\x92\xcb\x41", id="truncated"),
        pytest.param(packed({"ts": 1, "events": []}), id="a-map"),
        pytest.param(packed([1.0]), id="no-events"),
        pytest.param(packed(["now", []]), id="ts-not-a-number"),
        pytest.param(packed([True, []]), id="ts-a-boolean"),
        pytest.param(packed([float("nan"), []]), id="ts-nan"),
        pytest.param(packed([1.0, {"a": 1}]), id="events-not-an-array"),
        pytest.param(packed([1.0, [[]]]), id="an-empty-event"),
        pytest.param(packed([1.0, ["BlockStored"]]), id="an-event-not-an-array"),
        pytest.param(packed([1.0, [[7, [1]]]]), id="a-tag-not-a-string"),
        pytest.param(packed([1.0, [["BlockStored"]]]), id="stored-without-hashes"),
        pytest.param(packed([1.0, [["BlockStored", 5]]]), id="hashes-not-an-array"),
        pytest.param(packed([1.0, [["BlockStored", ["x"]]]]), id="a-hash-a-string"),
        pytest.param(packed([1.0, [["BlockStored", [None]]]]), id="a-hash-nil"),
        pytest.param(packed([1.0, [["BlockStored", [True]]]]), id="a-hash-a-boolean"),
        pytest.param(packed([1.0, [["BlockStored", [b""]]]]), id="a-hash-empty-bytes"),
        pytest.param(packed([1.0, [["BlockStored", [1], None, "t"]]]), id="token-ids-a-string"),
        pytest.param(packed([1.0, [["BlockStored", [1], None, [], "x"]]]), id="block-size"),
        pytest.param(packed([1.0, [["BlockStored", [1], None, [], 1, "a"]]]), id="lora-id"),
        pytest.param(packed([1.0, [["BlockStored", [1], None, [], 1, None, 5]]]), id="medium"),
        pytest.param(packed([1.0, [["BlockRemoved"]]]), id="removed-without-hashes"),
        pytest.param(packed([1.0, [["BlockRemoved", [1], 3]]]), id="removed-medium"),
        pytest.param(packed([1.0, [["BlockRemoved", [[1]]]]]), id="a-hash-an-array"),
    ],
)
def test_bad_payloads_raise_a_decode_error(payload: bytes) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_batch(payload)


def test_deeply_nested_garbage_is_a_decode_error_not_a_crash() -> None:
    with pytest.raises(KvEventDecodeError):
        decode_batch(b"\x91" * 100_000)


def test_seq_frames() -> None:
    assert encode_seq(0) == bytes(8)
    assert encode_seq(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    assert decode_seq(encode_seq(2**63 + 5)) == 2**63 + 5
    for bad in (b"", b"\x00" * 7, b"\x00" * 9):
        with pytest.raises(KvEventDecodeError):
            decode_seq(bad)


@pytest.mark.parametrize(
    ("text", "bind", "expected"),
    [
        ("tcp://127.0.0.1:5557", False, "tcp://127.0.0.1:5557"),
        ("  tcp://127.0.0.1:5557 ", True, "tcp://127.0.0.1:5557"),
        ("tcp://[::1]:5557", False, "tcp://[::1]:5557"),
        ("tcp://[0:0::1]:5557", True, "tcp://[::1]:5557"),
        ("tcp://Engine-0.Local:80", False, "tcp://engine-0.local:80"),
        ("tcp://*:5557", True, "tcp://*:5557"),
    ],
)
def test_endpoints(text: str, bind: bool, expected: str) -> None:
    assert parse_tcp_endpoint(text, bind=bind) == expected


@pytest.mark.parametrize(
    ("text", "bind", "message"),
    [
        ("127.0.0.1:5557", False, "tcp://HOST:PORT"),
        ("ipc:///tmp/x", False, "tcp://HOST:PORT"),
        ("tcp://127.0.0.1", False, "tcp://HOST:PORT"),
        ("tcp://:5557", False, "tcp://HOST:PORT"),
        ("tcp://127.0.0.1:0", False, "port"),
        ("tcp://127.0.0.1:65536", False, "port"),
        ("tcp://127.0.0.1:+5", False, "port"),
        ("tcp://::1:5557", False, "brackets"),
        ("tcp://[nope]:5557", False, "IPv6"),
        ("tcp://[127.0.0.1]:5557", False, "IPv6"),
        ("tcp://*:5557", False, "host name"),
        ("tcp://bad_host!:5557", False, "host name"),
        ("tcp://engine:5557", True, "bind to an IP address"),
    ],
)
def test_bad_endpoints(text: str, bind: bool, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tcp_endpoint(text, bind=bind)


# ---- fuzz: whatever arrives, a batch or a decode error, never another exception ----------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=6), max_leaves=40)


@settings(max_examples=300, deadline=None, database=None)
@given(value=_values)
def test_any_msgpack_value_decodes_or_is_a_decode_error(value: Any) -> None:
    for payload in (packed(value), packed([1.0, value]), packed([1.0, [value]])):
        with contextlib.suppress(KvEventDecodeError):
            decode_batch(payload)


@settings(max_examples=300, deadline=None, database=None)
@given(payload=st.binary(max_size=64))
def test_any_bytes_decode_or_are_a_decode_error(payload: bytes) -> None:
    with contextlib.suppress(KvEventDecodeError):
        decode_batch(payload)
