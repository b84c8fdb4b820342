"""The Cap'n Proto messages of the QUIC tunnels (`quic.capnp`), their framing and grammar (pure).

Every request and response crosses a tunnel as a few `Message`s (one head, body chunks, maybe
trailers), so their codec is on the hot path. It is written by hand with `struct`: the encoders
emit exactly the single-segment layouts the Rust writers emit (a body costs 40 bytes plus padding
and one copy of the data), and the decoder reads single-segment messages directly, following the
pointers as Cap'n Proto defines them. Anything else valid (several segments, far pointers, lists
laid out differently) is read by pycapnp, the reference implementation, through its typed API, and
judged by the same checks. pycapnp is imported on that path only: a replica that never sees such
a message never loads it.

Wire facts (the Rust protocol crate): a stream carries standard stream-serialised messages back
to back (u32 segment count - 1, u32 word count per segment, padding to a word, the segments),
with the reader limits of capnp-rust (fewer than 512 segments, at most 128 Mi words); a header
map holds at most 4096 entries; names are HTTP tokens (read lower-cased) and values visible ASCII;
and each direction is one head, any bodies, optional trailers, then FIN.
"""

from __future__ import annotations

import enum
import functools
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from stargate.http_headers import Headers

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_HEADER_ENTRIES",
    "MAX_LIST_BYTES",
    "TOKEN_CHARS",
    "BodyMessage",
    "GrammarState",
    "HeadersMessage",
    "MessageReader",
    "RecvGrammar",
    "SendGrammar",
    "TunnelMessage",
    "TunnelProtocolError",
    "decode_handshake",
    "decode_handshake_ack",
    "decode_message",
    "encode_body",
    "encode_handshake",
    "encode_handshake_ack",
    "encode_headers",
]

MAX_HEADER_ENTRIES: Final = 4096
MAX_LIST_BYTES: Final = 536_870_911  # a list's element count has 29 bits
MAX_SEGMENTS: Final = 512  # capnp-rust refuses a segment table this long or longer
TRAVERSAL_LIMIT_WORDS: Final = 128 * 1024 * 1024  # the Rust readers' limit (1 GiB)
NESTING_LIMIT: Final = 64
# The Pylon's body limit plus room for a message's own words.
DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024 + 64 * 1024
MAX_HEADER_NAME_BYTES: Final = 65_535  # the `http` crate's limit

_HEADERS, _BODY, _TRAILERS = 0, 1, 2  # the union discriminants of `Message`
_BYTE_ELEMENTS, _COMPOSITE_ELEMENTS = 2, 7
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_TWO_U32 = struct.Struct("<II")
_BODY_HEAD = struct.Struct("<IIQQQQ")
_ZEROS = bytes(8)

T = TypeVar("T")


class TunnelProtocolError(Exception):
    """A malformed tunnel message, or messages out of the order the grammar allows."""


@dataclass(frozen=True, slots=True)
class HeadersMessage:
    """A head (`trailers=False`) or trailers: entries in wire order, names lower-cased."""

    entries: Headers
    trailers: bool


@dataclass(frozen=True, slots=True)
class BodyMessage:
    """One chunk of a body."""

    data: bytes


TunnelMessage = HeadersMessage | BodyMessage


# --- encoding ------------------------------------------------------------------------------------


def _struct_pointer(offset: int, data_words: int, pointers: int) -> int:
    return ((offset << 2) & 0xFFFFFFFF) | data_words << 32 | pointers << 48


def _list_pointer(offset: int, element_size: int, count: int) -> int:
    return ((offset << 2) & 0xFFFFFFFF) | 1 | element_size << 32 | count << 35


# The zeros after a text of n bytes: its NUL and the padding to a word.
_TEXT_PADS = [bytes(8 - n) for n in range(8)]


def _texts(
    texts: Sequence[bytes], first_pointer: int, first_free: int
) -> tuple[list[int], list[bytes], int]:
    """Pointers, laid out from word `first_pointer`, to `texts` laid out from word `first_free`
    (each NUL-terminated and zero-padded to a word), the bytes of the texts and the next free word.
    """
    pointers: list[int] = []
    chunks: list[bytes] = []
    offset = first_free - first_pointer - 1  # from the first pointer to the first text
    for text in texts:
        size = len(text)
        if size >= MAX_LIST_BYTES:
            raise TunnelProtocolError("raw QUIC tunnel header too large")
        pointers.append(offset << 2 | 0x2_0000_0001 | (size + 1) << 35)  # a byte list
        chunks += (text, _TEXT_PADS[size & 7])
        offset += ((size + 8) >> 3) - 1  # the next text is further, the next pointer too
    return pointers, chunks, first_pointer + len(texts) + offset + 1


def encode_headers(entries: Sequence[tuple[bytes, bytes]], *, trailers: bool = False) -> bytes:
    """A head (or trailers) message in the Rust writers' layout: the root `Message`, the `Map`,
    the entry list (tag word, key and value pointers), then the texts in entry order.

    Names and values must be ASCII (the caller's header parser checked the rest): a Text must be
    UTF-8, and the Rust reader rejects any non-ASCII value.
    """
    count = len(entries)
    if count > MAX_HEADER_ENTRIES:
        raise TunnelProtocolError(f"too many raw QUIC tunnel headers: {count}")
    flat = [text for entry in entries for text in entry]
    if not b"".join(flat).isascii():
        raise TunnelProtocolError("non-ASCII header value")
    first_pointer = 5  # root, Message data, Message pointer, Map's list pointer, list tag
    pointers, chunks, end = _texts(flat, first_pointer, first_pointer + 2 * count)
    head = struct.pack(
        f"<II{first_pointer + 2 * count}Q",
        0,
        end,
        _struct_pointer(0, 1, 1),
        _TRAILERS if trailers else _HEADERS,
        _struct_pointer(0, 0, 1),
        _list_pointer(0, _COMPOSITE_ELEMENTS, 2 * count),
        _struct_pointer(count, 0, 2),  # the tag: its offset field is the element count
        *pointers,
    )
    return b"".join((head, *chunks))


_BODY_ROOT = _struct_pointer(0, 1, 1)
_BODY_STRUCT = _struct_pointer(0, 0, 1)
# The words of a body message between its segment table and its byte-list pointer.
_BODY_LAYOUT = struct.pack("<QQQ", _BODY_ROOT, _BODY, _BODY_STRUCT)
_BODY_WORDS = struct.Struct("<II24xII")  # segment count - 1, segment words, list pointer


def encode_body(data: bytes | bytearray | memoryview) -> bytes:
    """A body message in the Rust writers' layout: 40 bytes, the data, zero padding to a word."""
    size = len(data)
    if size > MAX_LIST_BYTES:
        raise TunnelProtocolError("raw QUIC tunnel body too large")
    head = _BODY_HEAD.pack(
        0, 4 + ((size + 7) >> 3), _BODY_ROOT, _BODY, _BODY_STRUCT, _list_pointer(0, 2, size)
    )
    return b"".join((head, data, _ZEROS[: -size & 7]))


def encode_handshake(inference_server_id: str, auth_token: str | None) -> bytes:
    """The Pylon's reverse-tunnel `Handshake`; `authToken` is left unset (null) when None."""
    texts = [inference_server_id.encode()]
    if auth_token is not None:
        texts.append(auth_token.encode())
    pointers, chunks, end = _texts(texts, 1, 3)
    pointers += [0] * (2 - len(pointers))
    head = struct.pack("<IIQQQ", 0, end, _struct_pointer(0, 0, 2), *pointers)
    return b"".join((head, *chunks))


def encode_handshake_ack(accepted: bool, reason: str) -> bytes:
    """The replica's `HandshakeAck` (an empty reason when accepted)."""
    pointers, chunks, end = _texts([reason.encode()], 2, 3)
    head = struct.pack("<IIQQQ", 0, end, _struct_pointer(0, 1, 1), int(accepted), *pointers)
    return b"".join((head, *chunks))


# --- decoding ------------------------------------------------------------------------------------


class _Unsupported(Exception):
    """A layout the hand decoder leaves to pycapnp (which may well find it malformed)."""


def _offset(low: int) -> int:
    """The signed 30-bit word offset in a pointer's low half."""
    return ((low ^ 0x80000000) - 0x80000000) >> 2


class _Segment:
    """Reads the one segment of a message held whole in `buf` (segment table first). A pointer is
    named by the index of its word (-1: absent, read as null, the field's default) and read as two
    u32 halves: small ints are much cheaper than 64-bit ones. Every object read is charged to the
    traversal budget, as Cap'n Proto readers do, so pointers that share their target cannot make
    a small message expensive."""

    __slots__ = ("budget", "buf", "words")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.words = (len(buf) - 8) >> 3
        self.budget = TRAVERSAL_LIMIT_WORDS
        if self.words == 0:
            raise _Unsupported("no root pointer")

    def _charge(self, words: int) -> None:
        self.budget -= words
        if self.budget < 0:
            raise TunnelProtocolError("tunnel message exceeds the traversal limit")

    def _halves(self, at: int) -> tuple[int, int]:
        return _TWO_U32.unpack_from(self.buf, 8 + (at << 3)) if at >= 0 else (0, 0)

    def struct(self, at: int) -> tuple[int, int, int]:
        """(first word, data words, pointer count) of the struct at `at`; a null one is empty."""
        low, high = self._halves(at)
        if low | high == 0:
            return 0, 0, 0
        if low & 3:
            raise _Unsupported("expected a struct pointer")
        start, data, pointers = at + 1 + _offset(low), high & 0xFFFF, high >> 16
        if start < 0 or start + data + pointers > self.words:
            raise _Unsupported("struct out of bounds")
        self._charge(data + pointers or 1)
        return start, data, pointers

    def data(self, at: int) -> bytes:
        """A Data field (a byte list; null reads as empty)."""
        low, high = self._halves(at)
        if low | high == 0:
            return b""
        start, size = at + 1 + _offset(low), high >> 3
        if low & 3 != 1 or high & 7 != _BYTE_ELEMENTS:
            raise _Unsupported("expected a byte list")
        if start < 0 or start + ((size + 7) >> 3) > self.words:
            raise _Unsupported("list out of bounds")
        self._charge((size + 7) >> 3)
        return self.buf[8 + (start << 3) : 8 + (start << 3) + size]

    def texts(self, ats: Sequence[int]) -> list[bytes | None]:
        """The Text fields at `ats`, without their NUL; None for a null pointer (unset)."""
        buf, budget, end = self.buf, self.budget, 8 + (self.words << 3)
        found: list[bytes | None] = []
        # All pointers read in one call when they are consecutive, as in every writer's layout.
        if isinstance(ats, range) and ats.step == 1:
            halves: Sequence[int] = struct.unpack_from(
                f"<{2 * len(ats)}I", buf, 8 + (ats.start << 3)
            )
        else:
            halves = [h for at in ats for h in self._halves(at)]
        for at, low, high in zip(ats, halves[0::2], halves[1::2], strict=True):
            if low & 3 != 1 or high & 7 != _BYTE_ELEMENTS:
                if low | high:
                    raise _Unsupported("expected a Text")
                found.append(None)
                continue
            start = 8 + ((at + 1 + (((low ^ 0x80000000) - 0x80000000) >> 2)) << 3)  # `_offset`
            size = high >> 3
            budget -= (size + 7) >> 3
            if start < 8 or start + size + (-size & 7) > end or not size or buf[start + size - 1]:
                raise _Unsupported("text out of bounds or not NUL-terminated")
            if budget < 0:
                raise TunnelProtocolError("tunnel message exceeds the traversal limit")
            found.append(buf[start : start + size - 1])
        self.budget = budget
        return found

    def struct_list(self, at: int) -> tuple[int, int, int, int]:
        """(first element word, count, data words, pointer count) of a struct list."""
        low, high = self._halves(at)
        if low | high == 0:
            return 0, 0, 0, 0
        start, size = at + 1 + _offset(low), high >> 3
        if low & 3 != 1 or high & 7 != _COMPOSITE_ELEMENTS:  # other encodings are pycapnp's
            raise _Unsupported("expected an inline-composite list")
        if start < 0 or start + 1 + size > self.words:
            raise _Unsupported("list out of bounds")
        low, high = self._halves(start)  # the tag: a struct pointer whose offset is the count
        count, data, pointers = low >> 2, high & 0xFFFF, high >> 16
        if low & 3 or count * (data + pointers) > size:
            raise _Unsupported("bad struct list tag")
        self._charge(max(size, count) + 1)
        return start + 1, count, data, pointers


# A header name's bytes: token characters map to themselves lower-cased, all others to NUL.
TOKEN_CHARS = frozenset(
    b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
)
"""The bytes of an HTTP token (RFC 9110): header names, and the method of a raw-quic head."""
_NAME_TABLE = bytes(c if c in TOKEN_CHARS else 0 for c in range(256)).lower()
_BAD_VALUE = re.compile(rb"[^\t\x20-\x7e]")


def _check_header(name: bytes, lowered: bytes, value: bytes) -> None:
    if not lowered or b"\0" in lowered or len(lowered) > MAX_HEADER_NAME_BYTES:
        raise TunnelProtocolError(f"invalid header name {name!r:.100}")
    if _BAD_VALUE.search(value) is not None:
        kind = "invalid" if value.isascii() else "non-ASCII"
        raise TunnelProtocolError(f"{kind} header value for {lowered!r:.100}")


def _headers(texts: list[bytes | None]) -> Headers:
    """Entries (key, value, key, value...) as the Rust reader's `http` types take them: names
    are tokens, read lower-cased; values are visible ASCII, spaces and tabs."""
    flat = [text or b"" for text in texts]  # null reads as empty
    names, values = flat[0::2], flat[1::2]
    lowered = [name.translate(_NAME_TABLE) for name in names]
    joined = b"".join(lowered)
    if (
        not all(lowered)
        or b"\0" in joined
        or (len(joined) > MAX_HEADER_NAME_BYTES and max(map(len, lowered)) > MAX_HEADER_NAME_BYTES)
        or _BAD_VALUE.search(b" ".join(values)) is not None
    ):
        for entry in zip(names, lowered, values, strict=True):
            _check_header(*entry)
    return list(zip(lowered, values, strict=True))


def _map_message(which: int, count: int, texts: Callable[[], list[bytes | None]]) -> TunnelMessage:
    if count > MAX_HEADER_ENTRIES:
        raise TunnelProtocolError(f"too many raw QUIC tunnel headers: {count}")
    return HeadersMessage(_headers(texts()), which == _TRAILERS)


def _read_message(seg: _Segment) -> TunnelMessage:
    start, data, pointers = seg.struct(0)
    which = _U16.unpack_from(seg.buf, 8 + (start << 3))[0] if data else _HEADERS
    field = start + data if pointers else -1
    if which == _BODY:
        start, data, pointers = seg.struct(field)
        return BodyMessage(seg.data(start + data if pointers else -1))
    if which not in (_HEADERS, _TRAILERS):
        raise TunnelProtocolError(f"malformed raw QUIC tunnel message: union discriminant {which}")
    start, data, pointers = seg.struct(field)
    first, count, data, pointers = seg.struct_list(start + data if pointers else -1)
    if data == 0 and pointers == 2:  # what every writer sends: the two pointers, back to back
        ats: Sequence[int] = range(first, first + 2 * count)
    else:
        elements = [first + i * (data + pointers) + data for i in range(count)]
        ats = [at + i if pointers > i else -1 for at in elements for i in (0, 1)]
    return _map_message(which, count, lambda: seg.texts(ats))


def _read_pair(seg: _Segment) -> tuple[bool, bytes | None, bytes | None]:
    """A Handshake or HandshakeAck root: (bit 0 of the data, first text, second text)."""
    start, data, pointers = seg.struct(0)
    flag = bool(seg.buf[8 + (start << 3)] & 1) if data else False
    first, second = seg.texts([start + data + i if pointers > i else -1 for i in (0, 1)])
    return flag, first, second


# pycapnp's side: the same results read through its typed API. (Only through it: its untyped
# copy and size computations abort the process on some malformed input instead of raising.)


def _capnp_text(struct_reader: Any, field: str) -> bytes | None:
    if not struct_reader._has(field):
        return None
    try:
        return bytes(struct_reader._get(field).encode())
    except UnicodeDecodeError as exc:  # pycapnp decodes Text; judge the bytes as ours are
        return bytes(exc.object)


def _capnp_message(reader: Any) -> TunnelMessage:
    try:
        which = reader._which_str()
    except Exception:  # pycapnp's error for a discriminant its schema lacks
        raise TunnelProtocolError(
            "malformed raw QUIC tunnel message: union discriminant not in the schema"
        ) from None
    if which == "body":
        return BodyMessage(bytes(reader.body.content))
    entries = getattr(reader, which).entries
    return _map_message(
        _TRAILERS if which == "trailers" else _HEADERS,
        len(entries),
        lambda: [_capnp_text(e, f) for e in entries for f in ("key", "value")],
    )


def _capnp_handshake(reader: Any) -> tuple[bool, bytes | None, bytes | None]:
    return False, _capnp_text(reader, "inferenceServerId"), _capnp_text(reader, "authToken")


def _capnp_ack(reader: Any) -> tuple[bool, bytes | None, bytes | None]:
    return bool(reader.accepted), _capnp_text(reader, "reason"), None


def _table(buf: bytes | bytearray) -> tuple[int, tuple[int, ...]] | None:
    """(table bytes, words per segment) of the message starting `buf`; None if incomplete."""
    if len(buf) < 4:
        return None
    count = _U32.unpack_from(buf)[0] + 1
    if count >= MAX_SEGMENTS:
        raise TunnelProtocolError(f"too many segments in a tunnel message: {count}")
    table_bytes = (count + 2) // 2 * 8
    if len(buf) < table_bytes:
        return None
    sizes = struct.unpack_from(f"<{count}I", buf, 4)
    if sum(sizes) > TRAVERSAL_LIMIT_WORDS:
        raise TunnelProtocolError(f"tunnel message of {sum(sizes)} words is too large")
    return table_bytes, sizes


@functools.cache
def _schema() -> Any:
    import capnp  # type: ignore[import-untyped]  # deferred: see the module docstring

    return capnp.load(str(Path(__file__).with_name("quic.capnp")))


def _decode(
    raw: bytes | bytearray | memoryview,
    root: str,
    read: Callable[[_Segment], T],
    fallback: Callable[[Any], T],
) -> T:
    buf = raw if type(raw) is bytes else bytes(raw)  # a fresh `bytes` is word-aligned for pycapnp
    if len(buf) >= 8 and len(buf) & 7 == 0 and _TWO_U32.unpack_from(buf) == (0, len(buf) // 8 - 1):
        try:
            return read(_Segment(buf))  # one segment: what every writer sends
        except _Unsupported:
            pass
    table = _table(buf)
    if table is None or table[0] + 8 * sum(table[1]) != len(buf):
        raise TunnelProtocolError("truncated or oversized tunnel message")
    try:
        with getattr(_schema(), root).from_bytes(
            buf, traversal_limit_in_words=TRAVERSAL_LIMIT_WORDS, nesting_limit=NESTING_LIMIT
        ) as reader:
            return fallback(reader)
    except TunnelProtocolError:
        raise
    except Exception as exc:  # pycapnp's KjException, mostly (its description has no stack)
        reason = getattr(exc, "description", None) or exc
        raise TunnelProtocolError(f"malformed tunnel {root}: {reason}") from exc


def decode_message(raw: bytes | bytearray | memoryview) -> TunnelMessage:
    """One whole serialised `Message` (segment table included), validated as the Rust reader
    validates it."""
    buf = raw if type(raw) is bytes else bytes(raw)
    # The Rust writers' body layout, most of the messages: recognised and read in a few steps.
    if len(buf) >= 40 and buf.startswith(_BODY_LAYOUT, 8):
        segments, words, low, high = _BODY_WORDS.unpack_from(buf)
        size = high >> 3
        if (
            segments == 0
            and low == 1
            and high & 7 == _BYTE_ELEMENTS
            and words == 4 + ((size + 7) >> 3)
            and len(buf) == 8 + (words << 3)
        ):
            return BodyMessage(buf[40 : 40 + size])
    return _decode(buf, "Message", _read_message, _capnp_message)


def _utf8(text: bytes | None, what: str) -> str | None:
    try:
        return None if text is None else text.decode()
    except UnicodeDecodeError:
        raise TunnelProtocolError(f"malformed {what}: not valid UTF-8") from None


def decode_handshake(raw: bytes | bytearray | memoryview) -> tuple[str, str | None]:
    """(inference server id, auth token or None when unset); the id is checked first."""
    _, server_id, token = _decode(raw, "Handshake", _read_pair, _capnp_handshake)
    server_id_text = _utf8(server_id, "handshake inference_server_id") or ""
    return server_id_text, _utf8(token, "handshake auth_token")


def decode_handshake_ack(raw: bytes | bytearray | memoryview) -> tuple[bool, str]:
    """(accepted, reason)."""
    accepted, reason, _ = _decode(raw, "HandshakeAck", _read_pair, _capnp_ack)
    return accepted, _utf8(reason, "handshake ack reason") or ""


# --- framing -------------------------------------------------------------------------------------


class MessageReader:
    """Cuts a stream into whole messages. `feed` bytes as they arrive, however split; then
    `next_message` until None (one message's bytes, segment table included, or None while more
    are needed); `end` at FIN fails if part of a message is buffered. A message's size is known
    from its segment table, so one over `max_message_bytes` fails before its bytes arrive."""

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._buffer = bytearray()
        self._size: int | None = None  # of the message at the buffer's start, once known
        self._max = max_message_bytes

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Buffers bytes received from the stream."""
        self._buffer += data

    def next_message(self) -> bytes | None:
        """The next whole message, or None until more bytes are fed."""
        if self._size is None:
            table = _table(self._buffer)
            if table is None:
                return None
            size = table[0] + 8 * sum(table[1])
            if size > self._max:
                raise TunnelProtocolError(
                    f"tunnel message of {size} bytes exceeds the {self._max}-byte limit"
                )
            self._size = size
        if len(self._buffer) < self._size:
            return None
        with memoryview(self._buffer) as view:
            message = view[: self._size].tobytes()
        del self._buffer[: self._size]
        self._size = None
        return message

    def end(self) -> None:
        """At FIN: a clean end only at a message boundary."""
        if self._buffer:
            raise TunnelProtocolError(
                f"stream ended inside a tunnel message ({len(self._buffer)} bytes buffered)"
            )


# --- grammar -------------------------------------------------------------------------------------


class GrammarState(enum.Enum):
    """Where one direction of a request stream is: before its head, in its body, after its
    trailers, or finished (FIN sent or received)."""

    HEAD = "head"
    BODY = "body"
    TRAILERS = "trailers"
    DONE = "done"


_S = GrammarState
# Every state change of both directions: (state, event) -> next state. Anything else is an error.
_TRANSITIONS: Final = {
    (_S.HEAD, "Headers"): _S.BODY,
    (_S.BODY, "Body"): _S.BODY,
    (_S.BODY, "Trailers"): _S.TRAILERS,
    (_S.BODY, "end"): _S.DONE,
    (_S.TRAILERS, "end"): _S.DONE,
    (_S.DONE, "end"): _S.DONE,
}
_EXPECTED: Final = {
    _S.HEAD: "expected headers",
    _S.BODY: "expected body, trailer or end",
    _S.TRAILERS: "expected none after trailer",
    _S.DONE: "expected none after end of stream",
}


def _advance(state: GrammarState, event: str) -> GrammarState:
    try:
        return _TRANSITIONS[state, event]
    except KeyError:
        if event == "end" and state is _S.HEAD:
            raise TunnelProtocolError("stream ended before the head") from None
        raise TunnelProtocolError(f"{_EXPECTED[state]}, got {event}") from None


class SendGrammar:
    """The order of what one side sends: call each method before sending what it names."""

    def __init__(self) -> None:
        self.state = GrammarState.HEAD

    def headers(self) -> None:
        """Before the head."""
        self.state = _advance(self.state, "Headers")

    def body(self) -> None:
        """Before a body chunk."""
        self.state = _advance(self.state, "Body")

    def trailers(self) -> None:
        """Before the trailers."""
        self.state = _advance(self.state, "Trailers")

    def finish(self) -> None:
        """Before FIN; finishing twice is allowed."""
        self.state = _advance(self.state, "end")


class RecvGrammar:
    """The order of what one side receives, checked message by message and at FIN."""

    def __init__(self) -> None:
        self.state = GrammarState.HEAD

    def on_message(self, message: TunnelMessage) -> None:
        """A decoded message arrived."""
        if isinstance(message, BodyMessage):
            event = "Body"
        else:
            event = "Trailers" if message.trailers else "Headers"
        self.state = _advance(self.state, event)

    def on_eof(self) -> None:
        """FIN arrived (at a message boundary: `MessageReader.end` checks that)."""
        self.state = _advance(self.state, "end")
