"""Routing keys derived from a request's prompt: a key per conversation and a chain of block
hashes that follows the prompt's prefix (pure).

docs/prefix-routing.md has the design and its trade-offs; docs/data-plane.md, "Derived affinity
keys", the contract. With `--derive-affinity-key`, a request without an `x-cache-affinity-key`
header is routed as if it had sent `prefix:<16 hex digits>`, and carries its prefix chain and
group for the `prefix-aware` balancer.

*The prompt stream.* The prompt is read as one byte stream of segments, in order:

* `/v1/chat/completions`: each message of the top-level `messages` array, as its role and content
  (`_message`);
* `/v1/completions`: `prompt` (a string: its UTF-8 text; an array of prompts or token ids: its
  JSON text as sent), one segment;
* `/v1/responses`: `instructions` as a leading system segment, then `input` (a string: one
  segment; an array of items: read like chat messages);
* `/v1/embeddings` (and any other path): nothing, so no key.

Only the first `block_bytes * depth` bytes of the stream count (the *cap*); reading stops there.

*The conversation key.* The *opening* is the leading `system`/`developer` segments plus the first
other segment (the first user turn), cut at the cap. Each turn of a chat resends the history, so
every turn of one conversation starts with the same opening: the key, the 64-bit XXH3 hash of the
path and the opening, is the same for all of them. Conversations differ in their opening as soon
as their first user messages differ.

*The chain.* The stream's whole blocks of `block_bytes` bytes, up to `depth` of them, hash as a
chain: `h[0]` is the hash of the path, `h[i]` the hash of `h[i-1]` (8 bytes, little-endian) and
block i. A block's hash covers everything before it, as an engine's prefix-cache block does, so
two requests share `h[i]` exactly when they share their first `i` blocks.

*The group.* The chain element at the last whole block of the leading `system`/`developer`
segments (None when they fill less than one block): the conversations of one application (one
system prompt) share it, and it is what their KV caches can share across conversations.

Cost: the body is not parsed into a document. A byte scan (regular expressions at C speed) walks
the top-level object to the members it needs (stopping once it has them; the first occurrence of a
duplicate key counts) and skips everything else; only the messages read (those up to the cap) are
decoded, and of a string prompt or input only as many bytes as the cap can need (at most
6 * cap + 26 raw bytes: an escape is at most 6 bytes for one character). A body that is not JSON,
or has no such member, gets no key (None), never an error; the header-form body is not otherwise
checked, so a body whose leading part parses gets a key even if its tail would not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from xxhash import xxh3_64_intdigest

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_DEPTH",
    "KEY_PREFIX",
    "MAX_CAP_BYTES",
    "DerivedPrefix",
    "chain_hashes",
    "derive_affinity_key",
    "derive_prefix",
]

KEY_PREFIX: Final = "prefix:"
DEFAULT_BLOCK_BYTES: Final = 256
"""`--derive-affinity-key-block-bytes`."""
DEFAULT_DEPTH: Final = 64
"""`--derive-affinity-key-depth`: the chain covers 16 KiB of prompt by default."""
MAX_CAP_BYTES: Final = 1 << 24
"""block bytes x depth may not exceed 16 MiB (a config error above it)."""

_FULL_ROLES = frozenset({"system", "developer"})
_WS = re.compile(rb"[ \t\n\r]*+")
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_SCALAR = re.compile(rb"[^,:\[\]{}\s\"]++")
_STRUCTURE = re.compile(rb'["\[\]{}]')
_MAX_KEY_BYTES = 64  # longer top-level keys are skipped unread: no member of interest is longer

# Endpoint -> (member read as a leading system segment, member read as the conversation).
_MEMBERS: Final = {
    "/v1/chat/completions": (None, "messages"),
    "/v1/completions": (None, "prompt"),
    "/v1/responses": ("instructions", "input"),
}


@dataclass(frozen=True, slots=True)
class DerivedPrefix:
    """What one request's prompt gives the balancers (module docstring).

    `key` is the conversation key (`prefix:` and 16 hex digits); `chain` the block hashes, first
    block first (empty for a prompt shorter than one block); `group` the chain element that ends
    the leading system/developer part, or None.
    """

    key: str
    chain: tuple[int, ...]
    group: int | None


class _NotJSON(Exception):
    """The scan met something it cannot read: no key."""


class _Stream:
    """The prompt stream as it is read: its segments up to the cap, and where the leading
    system part and the opening end."""

    __slots__ = ("cap", "opening_end", "parts", "size", "system_end")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.parts: list[bytes] = []
        self.size = 0
        self.system_end: int | None = None  # set once a non-system segment is read
        self.opening_end: int | None = None

    @property
    def full(self) -> bool:
        return self.size >= self.cap

    def add(self, segment: bytes, system: bool) -> None:
        if self.full:
            return
        if system and self.system_end is not None:
            system = False  # a system message after the first turn is just part of the history
        segment = segment[: self.cap - self.size]
        self.parts.append(segment)
        self.size += len(segment)
        if not system and self.system_end is None:
            self.system_end = self.size - len(segment)
            self.opening_end = self.size

    def data(self) -> bytes:
        return b"".join(self.parts)


def derive_affinity_key(
    path: str,
    body: bytes | bytearray,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    depth: int = DEFAULT_DEPTH,
) -> str | None:
    """The conversation key of a request to `path` with `body`, or None (module docstring)."""
    derived = derive_prefix(path, body, block_bytes, depth)
    return None if derived is None else derived.key


def derive_prefix(
    path: str, body: bytes | bytearray, block_bytes: int, depth: int
) -> DerivedPrefix | None:
    """The key, chain and group of a request to `path` with `body`, or None (module docstring).

    `block_bytes` and `depth` are at least 1.
    """
    members = _MEMBERS.get(path)
    if members is None or block_bytes < 1 or depth < 1:
        return None
    system_name, stream_name = members
    stream = _Stream(block_bytes * depth)
    try:
        spans = _top_level_members(body, {n for n in members if n is not None})
        if system_name is not None and system_name in spans:
            start = spans[system_name]
            stream.add(_text(_decode(body, start, _skip_value(body, start))), system=True)
        if stream_name in spans:
            _read_stream(body, spans[stream_name], stream)
    except (_NotJSON, ValueError, RecursionError):  # ValueError covers UnicodeDecodeError
        return None
    data = stream.data()
    if not data:
        return None
    opening_end = stream.opening_end if stream.opening_end is not None else len(data)
    root = xxh3_64_intdigest(_framed(path.encode()))
    key = xxh3_64_intdigest(_framed(path.encode()) + data[:opening_end])
    chain = chain_hashes(root, data, block_bytes, depth)
    system_end = stream.system_end if stream.system_end is not None else len(data)
    system_blocks = min(system_end // block_bytes, len(chain))
    group = chain[system_blocks - 1] if system_blocks else None
    return DerivedPrefix(f"{KEY_PREFIX}{key:016x}", chain, group)


def chain_hashes(root: int, data: bytes, block_bytes: int, depth: int) -> tuple[int, ...]:
    """The chain hashes of the whole `block_bytes` blocks of `data`, at most `depth` of them:
    each the XXH3-64 of the previous one (8 bytes, little-endian; `root` before the first) and
    the block."""
    hashes: list[int] = []
    previous = root
    for start in range(0, min(len(data), block_bytes * depth) - block_bytes + 1, block_bytes):
        previous = xxh3_64_intdigest(
            previous.to_bytes(8, "little") + data[start : start + block_bytes]
        )
        hashes.append(previous)
    return tuple(hashes)


def _framed(value: bytes) -> bytes:
    return len(value).to_bytes(8, "little") + value


def _read_stream(body: bytes | bytearray, start: int, stream: _Stream) -> None:
    """Add the segments of the member whose value is at `start` to `stream`, up to its cap."""
    first = body[start : start + 1]
    if first == b'"':
        stream.add(_string_prefix(body, start, stream.cap - stream.size), system=False)
        return
    if first != b"[":
        raise _NotJSON
    item = _skip_ws(body, start + 1)
    if body[item : item + 1] == b"]":
        return
    if body[item : item + 1] != b"{":
        # Prompts or token ids (completions), not messages: the JSON text as sent.
        limit = stream.cap - stream.size
        stream.add(bytes(body[start : min(_skip_value(body, start), start + limit)]), system=False)
        return
    for item_start, item_end in _array_items(body, start):
        message = _decode(body, item_start, item_end)
        # A role that is not a string (a list, an object) is no system role, and not hashable.
        role = message.get("role") if isinstance(message, dict) else None
        system = isinstance(role, str) and role in _FULL_ROLES
        stream.add(_message(message), system)
        if stream.full:
            return


def _message(item: object) -> bytes:
    """A message (or Responses input item) as role and content; without a role or content, its
    JSON with sorted keys. Other fields (`name`, `refusal`, ...) do not count: a client that sends
    an earlier answer back with more or fewer of them keeps the key."""
    if isinstance(item, dict) and isinstance(item.get("role"), str) and "content" in item:
        content = item["content"]
        if content is not None:
            return _encode(item["role"]) + b"\x1f" + _text(content) + b"\x1e"
    return _canonical(item) + b"\x1e"


def _text(value: object) -> bytes:
    """A content value's text: a string as is; content parts' `text` fields in order (other parts,
    such as images, as sorted JSON); anything else as sorted JSON."""
    if isinstance(value, str):
        return _encode(value)
    if isinstance(value, list):
        parts = []
        for part in value:
            text = part.get("text") if isinstance(part, dict) else None
            parts.append(_encode(text) if isinstance(text, str) else _canonical(part))
        return b"\x1d".join(parts)
    return _canonical(value)


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # JSON can spell a lone surrogate


def _canonical(value: object) -> bytes:
    return _encode(json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False))


def _string_prefix(body: bytes | bytearray, start: int, limit: int) -> bytes:
    """The first `limit` UTF-8 bytes of the JSON string at `start`, reading at most
    6 * limit + 26 of its raw bytes (every character takes at most 6 raw bytes, `\\uXXXX`)."""
    stop = start + 6 * limit + 26
    whole = _STRING.match(body, start, stop)
    if whole is not None:
        return _text(_decode(body, start, whole.end()))[:limit]
    if stop > len(body):
        raise _NotJSON  # the body ends inside the string
    raw = bytes(body[start + 1 : stop - 1])
    for cut in range(13):  # a cut escape or UTF-8 sequence is at most 12 bytes long
        try:
            text = json.loads(b'"' + raw[: len(raw) - cut] + b'"')
        except ValueError:
            continue
        return _encode(text)[:limit]
    raise _NotJSON


def _decode(body: bytes | bytearray, start: int, end: int) -> object:
    return json.loads(bytes(body[start:end]))


def _skip_ws(body: bytes | bytearray, pos: int) -> int:
    match = _WS.match(body, pos)
    return pos if match is None else match.end()


def _skip_value(body: bytes | bytearray, pos: int) -> int:
    """The end of the JSON value at `pos` (not validated: brackets are only counted)."""
    first = body[pos : pos + 1]
    if first == b'"':
        match = _STRING.match(body, pos)
        if match is None:
            raise _NotJSON
        return match.end()
    if first in (b"[", b"{"):
        depth = 0
        while True:
            found = _STRUCTURE.search(body, pos)
            if found is None:
                raise _NotJSON
            char = found.group()
            if char == b'"':
                string = _STRING.match(body, found.start())
                if string is None:
                    raise _NotJSON
                pos = string.end()
                continue
            pos = found.end()
            depth += 1 if char in (b"[", b"{") else -1
            if depth == 0:
                return pos
    match = _SCALAR.match(body, pos)
    if match is None:
        raise _NotJSON
    return match.end()


def _top_level_members(body: bytes | bytearray, wanted: set[str]) -> dict[str, int]:
    """Where the `wanted` members' values start in the top-level object (first occurrence)."""
    pos = 3 if body[:3] == b"\xef\xbb\xbf" else 0
    pos = _skip_ws(body, pos)
    if body[pos : pos + 1] != b"{":
        raise _NotJSON
    spans: dict[str, int] = {}
    pos = _skip_ws(body, pos + 1)
    if body[pos : pos + 1] == b"}":
        return spans
    while True:
        key = _STRING.match(body, pos)
        if key is None:
            raise _NotJSON
        name = _decode(body, pos, key.end()) if key.end() - pos <= _MAX_KEY_BYTES else None
        pos = _skip_ws(body, key.end())
        if body[pos : pos + 1] != b":":
            raise _NotJSON
        value_start = _skip_ws(body, pos + 1)
        if isinstance(name, str) and name in wanted and name not in spans:
            spans[name] = value_start
            if len(spans) == len(wanted):
                return spans  # the value itself is read by the caller, only as far as it needs
        pos = _skip_ws(body, _skip_value(body, value_start))
        separator = body[pos : pos + 1]
        if separator == b"}":
            return spans
        if separator != b",":
            raise _NotJSON
        pos = _skip_ws(body, pos + 1)


def _array_items(body: bytes | bytearray, start: int) -> Iterator[tuple[int, int]]:
    """The spans of the items of the array at `start`, read lazily."""
    pos = _skip_ws(body, start + 1)
    if body[pos : pos + 1] == b"]":
        return
    while True:
        end = _skip_value(body, pos)
        yield pos, end
        pos = _skip_ws(body, end)
        separator = body[pos : pos + 1]
        if separator == b"]":
            return
        if separator != b",":
            raise _NotJSON
        pos = _skip_ws(body, pos + 1)
