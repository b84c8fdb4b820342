"""The QUIC tunnels' Cap'n Proto codec (`stargate/tunnel/codec.py`), pure.

Checked against pycapnp, the reference implementation, loaded from the same `quic.capnp`: our
encoders must produce exactly the bytes of a pycapnp builder sized to one segment (which are the
Rust writers' bytes), and our decoder must read whatever pycapnp writes, several segments and far
pointers included. Then the behaviour the Rust protocol crate's tests pin (entry limits, repeated
names, a bad union discriminant, the handshake's error order, the per-direction grammar, end of
stream inside a message), the streaming reader's limits, and property-style round trips.
"""

from __future__ import annotations

import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import capnp  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stargate.tunnel import codec
from stargate.tunnel.codec import (
    MAX_HEADER_ENTRIES,
    BodyMessage,
    GrammarState,
    HeadersMessage,
    MessageReader,
    RecvGrammar,
    SendGrammar,
    TunnelProtocolError,
    decode_handshake,
    decode_handshake_ack,
    decode_message,
    encode_body,
    encode_handshake,
    encode_handshake_ack,
    encode_headers,
)

SCHEMA: Any = capnp.load(str(Path(codec.__file__).with_name("quic.capnp")))
ROOM = 1024  # spare first-segment words: pycapnp's `to_bytes` writes only the words used


def segment_count(raw: bytes | bytearray) -> int:
    return int(struct.unpack_from("<I", raw)[0]) + 1


def reference_body(data: bytes, first_words: int | None = None) -> bytes:
    message = SCHEMA.Message.new_message(num_first_segment_words=first_words or len(data) // 8 + 8)
    message.init("body").content = data
    return bytes(message.to_bytes())


def reference_map(
    entries: list[tuple[bytes, bytes]], *, trailers: bool = False, first_words: int | None = None
) -> bytes:
    size = sum(len(k) + len(v) for k, v in entries) // 4 + 4 * len(entries) + ROOM
    message = SCHEMA.Message.new_message(num_first_segment_words=first_words or size)
    built = message.init("trailers" if trailers else "headers").init("entries", len(entries))
    for element, (key, value) in zip(built, entries, strict=True):
        element.key = key.decode()
        element.value = value.decode()
    return bytes(message.to_bytes())


def reference_handshake(server_id: str, token: str | None, first_words: int = ROOM) -> bytes:
    message = SCHEMA.Handshake.new_message(num_first_segment_words=first_words)
    message.inferenceServerId = server_id
    if token is not None:
        message.authToken = token
    return bytes(message.to_bytes())


def reference_ack(accepted: bool, reason: str, first_words: int = ROOM) -> bytes:
    message = SCHEMA.HandshakeAck.new_message(num_first_segment_words=first_words)
    message.accepted = accepted
    message.reason = reason
    return bytes(message.to_bytes())


def read_reference(raw: bytes) -> HeadersMessage | BodyMessage:
    """What pycapnp reads from `raw`, in our types (names as sent: pycapnp does not lower them)."""
    with SCHEMA.Message.from_bytes(raw, traversal_limit_in_words=1 << 27) as message:
        which = str(message.which())
        if which == "body":
            return BodyMessage(bytes(message.body.content))
        entries = [(e.key.encode(), e.value.encode()) for e in getattr(message, which).entries]
        return HeadersMessage(entries, which == "trailers")


def words(*values: int) -> bytes:
    """A hand-made single-segment message from its words."""
    return struct.pack(f"<II{len(values)}Q", 0, len(values), *values)


BODY_SIZES = [0, 1, 7, 8, 9, 100 * 1024]
HEADER_MAPS = [
    [],
    [(b"x-method", b"POST")],
    [(b"x-method", b"POST"), (b"x-path", b"/v1/chat/completions?trace=1"), (b"x-model", b"")],
    [(b"accept", b"a/b"), (b"x-request-id", b"12345678"), (b"accept", b"c/d"), (b"accept", b"")],
]


# --- encoders: byte-identical to pycapnp's one-segment builders (the Rust writers' layouts) ----


@pytest.mark.parametrize("size", BODY_SIZES)
def test_encode_body_is_the_reference_layout(size: int) -> None:
    data = bytes(random.Random(size).randbytes(size))
    raw = encode_body(data)
    assert raw == reference_body(data)
    assert len(raw) == 40 + size + (-size % 8)
    assert raw[:8] == struct.pack("<II", 0, 4 + (size + 7) // 8)
    assert encode_body(bytearray(data)) == encode_body(memoryview(data)) == raw


@pytest.mark.parametrize("entries", HEADER_MAPS)
@pytest.mark.parametrize("trailers", [False, True])
def test_encode_headers_is_the_reference_layout(
    entries: list[tuple[bytes, bytes]], trailers: bool
) -> None:
    raw = encode_headers(entries, trailers=trailers)
    assert raw == reference_map(entries, trailers=trailers)
    assert raw[16:18] == (b"\x02\x00" if trailers else b"\x00\x00")  # the union discriminant


def test_empty_map_keeps_its_list_pointer_and_tag() -> None:
    assert encode_headers([]).hex() == (
        "0000000005000000"  # one segment of 5 words
        "0000000001000100"  # root: Message (1 data word, 1 pointer)
        "0000000000000000"  # discriminant 0: headers
        "0000000000000100"  # Map (0 data words, 1 pointer)
        "0100000007000000"  # inline-composite list of 0 words
        "0000000000000200"  # its tag: 0 elements of 0 data words and 2 pointers
    )


@pytest.mark.parametrize("token", [None, "", "s3cr3t-token-value"])
def test_encode_handshake_is_the_reference_layout(token: str | None) -> None:
    raw = encode_handshake("pylon-a", token)
    assert raw == reference_handshake("pylon-a", token)
    with SCHEMA.Handshake.from_bytes(raw) as read:
        assert read._has("authToken") is (token is not None)


@pytest.mark.parametrize(("accepted", "reason"), [(True, ""), (False, "duplicate connection")])
def test_encode_handshake_ack_is_the_reference_layout(accepted: bool, reason: str) -> None:
    raw = encode_handshake_ack(accepted, reason)
    assert raw == reference_ack(accepted, reason)
    assert decode_handshake_ack(raw) == (accepted, reason)


# --- the decoder reads what pycapnp writes ------------------------------------------------------


@pytest.mark.parametrize("size", BODY_SIZES)
def test_decode_reads_multi_segment_bodies(size: int) -> None:
    data = bytes(random.Random(size).randbytes(size))
    raw = reference_body(data, first_words=4)
    assert size < 24 or segment_count(raw) > 1  # below 24 bytes it all fits the first segment
    assert decode_message(raw) == BodyMessage(data)


@pytest.mark.parametrize("entries", HEADER_MAPS[1:])
def test_decode_reads_multi_segment_maps(entries: list[tuple[bytes, bytes]]) -> None:
    raw = reference_map(entries, trailers=True, first_words=4)
    assert segment_count(raw) > 1
    assert decode_message(raw) == HeadersMessage(entries, trailers=True)


def test_decode_reads_multi_segment_handshakes() -> None:
    raw = reference_handshake("pylon-a", "token", first_words=1)
    assert segment_count(raw) > 1
    assert decode_handshake(raw) == ("pylon-a", "token")
    raw = reference_ack(False, "routing key mismatch", first_words=1)
    assert segment_count(raw) > 1
    assert decode_handshake_ack(raw) == (False, "routing key mismatch")


def test_decode_reads_a_70_mib_multi_segment_body() -> None:
    """Past pycapnp's default traversal limit (64 MiB): the fallback passes Rust's (1 GiB)."""
    data = b"\x5a" * (70 * 1024 * 1024)
    raw = reference_body(data, first_words=4)
    assert segment_count(raw) == 2
    decoded = decode_message(raw)
    del raw
    assert isinstance(decoded, BodyMessage)
    assert len(decoded.data) == len(data)
    assert decoded.data == data


def test_single_segment_messages_do_not_import_pycapnp() -> None:
    program = (
        "import sys\n"
        "from stargate.tunnel import codec as c\n"
        "c.decode_message(c.encode_body(b'x'))\n"
        "c.decode_message(c.encode_headers([(b'a', b'b')], trailers=True))\n"
        "c.decode_handshake(c.encode_handshake('id', None))\n"
        "c.decode_handshake_ack(c.encode_handshake_ack(True, ''))\n"
        "print('capnp' in sys.modules)\n"
    )
    root = Path(codec.__file__).parents[2]
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, check=True, cwd=root)
    assert out.stdout == b"False\n"


def test_unusual_but_valid_layouts() -> None:
    # A null root reads as an empty head (every field at its default).
    assert decode_message(words(0)) == HeadersMessage([], trailers=False)
    # A larger Message (as a later schema would write it): the extra words are skipped.
    body = [0x0002_0002_0000_0000, 1, 0, 0x0001_0000_0000_0004, 0, 0x0000_0012_0000_0001]
    assert decode_message(words(*body, int.from_bytes(b"hi\0", "little"))) == BodyMessage(b"hi")
    # A body with a null `content`, and a Body struct with no pointer at all.
    assert decode_message(words(0x0001_0001_0000_0000, 1, 0x0001_0000_0000_0000, 0)) == (
        BodyMessage(b"")
    )
    assert decode_message(words(0x0001_0001_0000_0000, 1, 0xFFFF_FFFC)) == BodyMessage(b"")
    # Entries as a list of pointers (structs of one pointer): key only, the value is empty.
    pointer_list = [0x0001_0001_0000_0000, 0, 0x0001_0000_0000_0000, 0x0000_000E_0000_0001]
    text = [0x0000_0012_0000_0001, int.from_bytes(b"A\0", "little")]
    assert decode_message(words(*pointer_list, *text)) == HeadersMessage([(b"a", b"")], False)
    # A handshake whose id is unset reads as an empty id (the NACK is the caller's business).
    assert decode_handshake(words(0x0002_0000_0000_0000, 0, 0)) == ("", None)


# --- behaviour pinned by the Rust protocol crate's tests ----------------------------------------


@pytest.mark.parametrize("trailers", [False, True])
def test_entry_limit_on_read(trailers: bool) -> None:
    """raw_quic_parser_rejects_excessive_header_and_trailer_entries"""
    entries = [(b"x-a", b"1")] * MAX_HEADER_ENTRIES
    decoded = decode_message(reference_map(entries, trailers=trailers))
    assert decoded == HeadersMessage(entries, trailers)
    raw = reference_map([*entries, (b"x-b", b"2")], trailers=trailers)
    with pytest.raises(TunnelProtocolError, match=r"^too many raw QUIC tunnel headers: 4097$"):
        decode_message(raw)


@pytest.mark.parametrize("trailers", [False, True])
def test_entry_limit_on_write(trailers: bool) -> None:
    """public_header_and_trailer_builders_enforce_entry_limit"""
    entries = [(b"x-a", b"1")] * MAX_HEADER_ENTRIES
    assert decode_message(encode_headers(entries, trailers=trailers)) == (
        HeadersMessage(entries, trailers)
    )
    with pytest.raises(TunnelProtocolError, match=r"^too many raw QUIC tunnel headers: 4097$"):
        encode_headers([*entries, (b"x-b", b"2")], trailers=trailers)


@pytest.mark.parametrize("trailers", [False, True])
def test_repeated_names_round_trip_in_order(trailers: bool) -> None:
    """multi_value_header_and_trailer_roundtrip"""
    entries = [(b"set-cookie", b"a=1"), (b"x-one", b"1"), (b"set-cookie", b"b=2"), (b"x-one", b"")]
    raw = encode_headers(entries, trailers=trailers)
    assert decode_message(raw) == HeadersMessage(entries, trailers)
    assert read_reference(raw) == HeadersMessage(entries, trailers)


@pytest.mark.parametrize("discriminant", [3, 0xFFFF])
def test_unknown_union_discriminant_is_an_error(discriminant: int) -> None:
    """quic_message_reader_preserves_malformed_discriminant_error"""
    raw = bytearray(encode_headers([(b"a", b"b")]))
    raw[16:18] = struct.pack("<H", discriminant)
    with pytest.raises(TunnelProtocolError, match=rf"union discriminant {discriminant}$"):
        decode_message(bytes(raw))
    # The same through pycapnp's path (three segments, far pointers; the root struct stays first).
    raw = bytearray(reference_map([(b"a", b"b"), (b"c", b"d")], first_words=4))
    assert segment_count(raw) == 3
    raw[24:26] = struct.pack("<H", discriminant)
    with pytest.raises(TunnelProtocolError, match=r"union discriminant not in the schema$"):
        decode_message(bytes(raw))


def _handshake_with(server_id: bytes, token: bytes) -> bytes:
    raw = encode_handshake("ab", "cd")
    return raw.replace(b"ab\0", server_id + b"\0").replace(b"cd\0", token + b"\0")


def test_handshake_reports_a_bad_id_before_a_bad_token() -> None:
    """handshake_reports_malformed_inference_id_before_malformed_auth_token"""
    assert decode_handshake(_handshake_with(b"ab", b"cd")) == ("ab", "cd")
    with pytest.raises(TunnelProtocolError, match=r"inference_server_id"):
        decode_handshake(_handshake_with(b"\xff\xfe", b"\xff\xfe"))
    with pytest.raises(TunnelProtocolError, match=r"auth_token"):
        decode_handshake(_handshake_with(b"ab", b"\xff\xfe"))
    assert decode_handshake(encode_handshake("pylon-\u00e9", "t\u00f6ken")) == (
        "pylon-\u00e9",
        "t\u00f6ken",
    )


def state(grammar: SendGrammar | RecvGrammar) -> GrammarState:
    return grammar.state  # read through a call: mypy would keep the narrowing of `.state`


def test_send_grammar_rejects_ordering_violations_and_finish_is_idempotent() -> None:
    """send_stream_rejects_ordering_violations_and_finish_is_idempotent"""
    send = SendGrammar()
    for early in (send.body, send.trailers):
        with pytest.raises(TunnelProtocolError, match=r"^expected headers, got (Body|Trailers)$"):
            early()
    with pytest.raises(TunnelProtocolError, match=r"^stream ended before the head$"):
        send.finish()
    assert state(send) is GrammarState.HEAD
    send.headers()
    with pytest.raises(TunnelProtocolError, match=r"^expected body, trailer or end, got Headers$"):
        send.headers()
    send.body()
    send.body()
    send.trailers()
    with pytest.raises(TunnelProtocolError, match=r"^expected none after trailer, got Body$"):
        send.body()
    with pytest.raises(TunnelProtocolError, match=r"got Trailers$"):
        send.trailers()
    send.finish()
    send.finish()
    assert state(send) is GrammarState.DONE
    with pytest.raises(TunnelProtocolError, match=r"^expected none after end of stream, got Body$"):
        send.body()
    fin_after_head = SendGrammar()
    fin_after_head.headers()
    fin_after_head.finish()
    assert state(fin_after_head) is GrammarState.DONE


HEAD = HeadersMessage([(b"x-status", b"200")], trailers=False)
TRAILERS = HeadersMessage([(b"x-t", b"1")], trailers=True)
BODY = BodyMessage(b"chunk")


def test_recv_grammar_rejects_ordering_violations() -> None:
    """recv_stream_rejects_ordering_violations"""
    for first, got in ((BODY, "Body"), (TRAILERS, "Trailers")):
        with pytest.raises(TunnelProtocolError, match=rf"^expected headers, got {got}$"):
            RecvGrammar().on_message(first)
    recv = RecvGrammar()
    recv.on_message(HEAD)
    with pytest.raises(TunnelProtocolError, match=r"got Headers$"):
        recv.on_message(HEAD)
    with pytest.raises(TunnelProtocolError, match=r"^stream ended before the head$"):
        RecvGrammar().on_eof()


def test_recv_clean_eof_after_the_head_is_an_empty_body() -> None:
    """recv_body_returns_explicit_end_on_clean_eof, recv_trailer_returns_none_on_clean_eof"""
    recv = RecvGrammar()
    recv.on_message(HEAD)
    recv.on_eof()
    recv.on_eof()
    assert state(recv) is GrammarState.DONE
    with pytest.raises(TunnelProtocolError, match=r"after end of stream, got Body$"):
        recv.on_message(BODY)


def test_recv_trailers_after_the_body_then_nothing_but_eof() -> None:
    """recv_trailer_returns_buffered_trailer_after_body_read and
    recv_trailer_rejects_frames_after_trailer"""
    recv = RecvGrammar()
    for message in (HEAD, BODY, BODY, TRAILERS):
        recv.on_message(message)
    assert state(recv) is GrammarState.TRAILERS
    with pytest.raises(TunnelProtocolError, match=r"^expected none after trailer, got Body$"):
        recv.on_message(BODY)
    with pytest.raises(TunnelProtocolError, match=r"^expected none after trailer, got Trailers$"):
        recv.on_message(TRAILERS)
    recv.on_eof()
    assert state(recv) is GrammarState.DONE


def test_recv_trailers_need_a_head_first() -> None:
    """recv_trailer_rejects_body_before_trailers (a body or trailers before any head)"""
    recv = RecvGrammar()
    with pytest.raises(TunnelProtocolError, match=r"^expected headers, got Body$"):
        recv.on_message(BODY)
    assert state(recv) is GrammarState.HEAD


# --- streaming reader ----------------------------------------------------------------------------

STREAM = [
    encode_headers([(b"x-status", b"200"), (b"content-type", b"text/event-stream")]),
    encode_body(b""),
    encode_body(b"data: {}\n\n" * 100),
    reference_body(bytes(range(256)) * 40, first_words=4),  # two segments: a padded table
    encode_headers([(b"x-t", b"1")], trailers=True),
]


def _drain(reader: MessageReader) -> list[bytes]:
    found = []
    while (message := reader.next_message()) is not None:
        found.append(message)
    return found


def test_reader_yields_the_same_messages_fed_one_byte_at_a_time() -> None:
    stream = b"".join(STREAM)
    whole = MessageReader()
    whole.feed(stream)
    assert _drain(whole) == STREAM
    whole.end()
    reader, found = MessageReader(), []
    for i in range(len(stream)):
        reader.feed(stream[i : i + 1])
        found += _drain(reader)
    reader.end()
    assert found == STREAM
    assert [decode_message(m) for m in found][3] == BodyMessage(bytes(range(256)) * 40)


def test_reader_random_splits() -> None:
    stream = b"".join(STREAM)
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, 20)))
        reader, found = MessageReader(), []
        for start, stop in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            reader.feed(memoryview(stream)[start:stop])
            found += _drain(reader)
        reader.end()
        assert found == STREAM


def test_eof_inside_a_message_is_an_error() -> None:
    for cut in (1, 4, 8, 12, len(STREAM[2]) - 1):
        reader = MessageReader()
        reader.feed(STREAM[0] + STREAM[2][:cut])
        assert _drain(reader) == [STREAM[0]]
        with pytest.raises(TunnelProtocolError, match=r"stream ended inside a tunnel message"):
            reader.end()
    MessageReader().end()  # no byte at all: a clean end


def test_reader_refuses_512_segments_or_more() -> None:
    reader = MessageReader()
    reader.feed(struct.pack("<I", 510))  # 511 segments: allowed, table still incomplete
    assert reader.next_message() is None
    reader = MessageReader()
    reader.feed(struct.pack("<I", 511))
    with pytest.raises(TunnelProtocolError, match=r"too many segments in a tunnel message: 512"):
        reader.next_message()
    with pytest.raises(TunnelProtocolError, match=r"too many segments"):
        decode_message(struct.pack("<I", 0xFFFFFFFF) + bytes(12))


def test_reader_refuses_a_big_message_from_its_table_alone() -> None:
    reader = MessageReader(max_message_bytes=1024)
    reader.feed(struct.pack("<II", 0, 127))  # 8 + 127 * 8 = 1024 bytes: allowed
    assert reader.next_message() is None
    reader = MessageReader(max_message_bytes=1024)
    reader.feed(struct.pack("<II", 0, 128))
    with pytest.raises(TunnelProtocolError, match=r"1032 bytes exceeds the 1024-byte limit"):
        reader.next_message()
    reader = MessageReader()  # the default: 64 MiB and 64 KiB, over two segments here
    reader.feed(struct.pack("<IIII", 1, 4 * 1024 * 1024, 4 * 1024 * 1024 + 8 * 1024 + 1, 0))
    with pytest.raises(TunnelProtocolError, match=r"exceeds the 67174400-byte limit"):
        reader.next_message()
    reader = MessageReader(max_message_bytes=1 << 40)  # Rust's traversal limit: 128 Mi words
    reader.feed(struct.pack("<II", 0, 128 * 1024 * 1024 + 1))
    with pytest.raises(TunnelProtocolError, match=r"words is too large"):
        reader.next_message()


# --- validation and malformed input -----------------------------------------------------------


def test_header_names_are_lower_cased_tokens_and_values_visible_ascii() -> None:
    read = decode_message(reference_map([(b"Content-Type", b"a/b"), (b"X-A", b" x\ty ")]))
    assert read == HeadersMessage([(b"content-type", b"a/b"), (b"x-a", b" x\ty ")], False)
    for name in (b"", b"bad name", b"a:b", b"caf\xc3\xa9", b"x" * 65_536):
        with pytest.raises(TunnelProtocolError, match=r"invalid header name"):
            decode_message(reference_map([(b"ok", b"1"), (name, b"v")]))
    assert decode_message(encode_headers([(b"x" * 65_535, b"v")])) == (
        HeadersMessage([(b"x" * 65_535, b"v")], False)
    )
    with pytest.raises(TunnelProtocolError, match=r"^non-ASCII header value for b'b'$"):
        decode_message(reference_map([(b"a", b"1"), (b"b", "\u00e9".encode())]))
    for value in (b"a\nb", b"a\rb", b"\x00", b"\x7f"):
        with pytest.raises(TunnelProtocolError, match=r"^invalid header value for b'a'$"):
            decode_message(reference_map([(b"a", value)]))


def test_encode_headers_refuses_non_ascii() -> None:
    with pytest.raises(TunnelProtocolError, match=r"non-ASCII header value"):
        encode_headers([(b"a", b"caf\xc3\xa9")])


def test_malformed_messages_are_protocol_errors() -> None:
    body = encode_body(b"hello")
    for broken in (
        b"",
        body[:7],
        body[:-8],  # shorter than its table says
        body + bytes(8),  # longer
        words(),  # no root pointer
        words(0x0001_0001_0000_0004),  # a root struct out of bounds
        words(0x0001_0001_0000_0000, 1, 0x0000_0000_0000_0001),  # a list where a struct goes
        words(0x0001_0001_0000_0000, 1, 0x0001_0000_0000_0000, 0x0000_FFFA_0000_0001),
    ):
        with pytest.raises(TunnelProtocolError, match=r"^(truncated|malformed) "):
            decode_message(broken)
    text = bytearray(encode_headers([(b"abc", b"x")]))
    text[text.index(b"abc\0") + 3] = ord("d")  # no NUL at the end of the Text
    with pytest.raises(TunnelProtocolError, match=r"^malformed tunnel Message: "):
        decode_message(bytes(text))


def test_shared_pointers_are_charged_to_the_traversal_limit() -> None:
    """8192 pointers to one 16 KiW text: 128 Mi words read from a 130 KiB message."""
    count, text_words = 4096, 16 * 1024
    head = [0x0001_0001_0000_0000, 0, 0x0001_0000_0000_0000]
    head += [(2 * count) << 35 | 7 << 32 | 1, (2 << 48) | count << 2]
    pointers = [
        (text_words * 8) << 35 | 2 << 32 | ((2 * count - i - 1) << 2) | 1 for i in range(2 * count)
    ]
    raw = words(*head, *pointers, *([int.from_bytes(b"aaaaaaaa", "little")] * text_words))
    raw = raw[:-1] + b"\0"
    with pytest.raises(TunnelProtocolError, match=r"traversal limit"):
        decode_message(raw)


# --- property-style round trips -----------------------------------------------------------------

TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
TOKEN = st.text(alphabet=TOKEN_CHARS, min_size=1, max_size=30)
VALUE = st.text(alphabet=[chr(c) for c in range(0x20, 0x7F)] + ["\t"], max_size=60)
ENTRIES = st.lists(st.tuples(TOKEN, VALUE), max_size=24).map(
    lambda pairs: [(k.encode(), v.encode()) for k, v in pairs]
)


@settings(max_examples=150, deadline=None)
@given(entries=ENTRIES, trailers=st.booleans(), first_words=st.sampled_from([None, 1, 4, 9]))
def test_header_maps_round_trip(
    entries: list[tuple[bytes, bytes]], trailers: bool, first_words: int | None
) -> None:
    expected = HeadersMessage([(k.lower(), v) for k, v in entries], trailers)
    ours = encode_headers(entries, trailers=trailers)
    assert ours == reference_map(entries, trailers=trailers)
    assert decode_message(ours) == expected
    assert read_reference(ours) == HeadersMessage(entries, trailers)
    assert decode_message(reference_map(entries, trailers=trailers, first_words=first_words)) == (
        expected
    )


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=3000), first_words=st.sampled_from([None, 2, 4, 64]))
def test_bodies_round_trip(data: bytes, first_words: int | None) -> None:
    ours = encode_body(data)
    assert ours == reference_body(data)
    assert decode_message(ours) == BodyMessage(data) == read_reference(ours)
    assert decode_message(reference_body(data, first_words=first_words)) == BodyMessage(data)


@settings(max_examples=100, deadline=None)
@given(server_id=st.text(max_size=40), token=st.none() | st.text(max_size=40), ok=st.booleans())
def test_handshakes_round_trip(server_id: str, token: str | None, ok: bool) -> None:
    assert decode_handshake(encode_handshake(server_id, token)) == (server_id, token)
    assert decode_handshake(reference_handshake(server_id, token, first_words=1)) == (
        server_id,
        token,
    )
    assert decode_handshake_ack(encode_handshake_ack(ok, server_id)) == (ok, server_id)


def test_corrupted_messages_fail_only_as_protocol_errors() -> None:
    """Random byte flips anywhere, several segments included: a message or a TunnelProtocolError,
    nothing else (pycapnp's untyped copy would abort the process on some of these)."""
    rng = random.Random(2024)
    samples = [*STREAM, encode_handshake("pylon", "token")]
    outcomes = {"decoded": 0, "refused": 0}
    for _ in range(3000):
        raw = bytearray(rng.choice(samples))
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        try:
            decode_message(bytes(raw))
            outcomes["decoded"] += 1
        except TunnelProtocolError:
            outcomes["refused"] += 1
    assert outcomes["decoded"] > 100 and outcomes["refused"] > 100


def _pycapnp_only(seg: object) -> Any:
    raise codec._Unsupported("forced")


def _outcome(raw: bytes, root: str, read: Any, fallback: Any) -> tuple[str, object]:
    try:
        return "decoded", codec._decode(raw, root, read, fallback)
    except TunnelProtocolError:
        return "refused", None


def test_hand_decoder_agrees_with_pycapnp_on_corrupted_messages() -> None:
    """Random byte flips after the table of one-segment messages: the hand decoder accepts
    exactly what pycapnp's typed reader (forced here) accepts, and reads the same contents."""
    rng = random.Random(99)
    messages = [*STREAM[:3], STREAM[4], encode_headers([(b"A", b"b c"), (b"a", b"")])]
    handshakes = [encode_handshake("pylon", "token"), encode_handshake("p", None)]
    message = ("Message", codec._read_message, codec._capnp_message)
    handshake = ("Handshake", codec._read_pair, codec._capnp_handshake)
    decoded = 0
    for i in range(4000):
        (root, read, fallback), samples = (
            (handshake, handshakes) if i % 4 == 0 else (message, messages)
        )
        raw = bytearray(rng.choice(samples))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(8, len(raw))
            raw[at] = rng.randrange(256) if rng.random() < 0.5 else raw[at] ^ 1 << rng.randrange(8)
        ours = _outcome(bytes(raw), root, read, fallback)
        reference = _outcome(bytes(raw), root, _pycapnp_only, fallback)
        assert ours == reference, bytes(raw).hex()
        decoded += ours[0] == "decoded"
    assert decoded > 300
