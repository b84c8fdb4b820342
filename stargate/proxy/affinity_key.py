"""A cache-affinity key derived from the leading part of a request's prompt (pure).

docs/data-plane.md, "Derived affinity keys": with `--derive-affinity-key`, a request without an
`x-cache-affinity-key` header is routed as if it had sent `prefix:<hash>`, the hash of its prompt's
leading part, so the cache-affinity balancers (`pulsar`, wait-and-widen's cache-affinity step)
send requests sharing that part (the turns of one conversation, mostly) to the same backends.

The rule, per endpoint (N: `--derive-affinity-key-bytes`):

* `/v1/chat/completions`: the top-level `messages` array, read in order. Every `system` and
  `developer` message counts in full; the other messages, each encoded as its role and content,
  are concatenated and cut at N bytes. Reading stops there: later messages are never looked at.
* `/v1/completions`: `prompt` cut at N bytes (a string: its UTF-8 text; an array of prompts or
  token ids: its JSON text as sent).
* `/v1/responses`: `instructions` in full, plus `input` cut at N bytes (a string: its text; an
  array of items: read like chat messages, `system`/`developer` items in full).
* `/v1/embeddings` (and any other path): no key.

The key is `prefix:` and the 32 hex digits of a BLAKE2b-128 digest of the endpoint, the full part
and the cut part, each framed by its length (so moving bytes between parts changes the key).

Cost: the body is not parsed into a document. A byte scan (regular expressions at C speed) walks
the top-level object to the members it needs (stopping once it has them; the first occurrence of a
duplicate key counts) and skips everything else; only the messages read (those up to the cut) are
decoded, and of a string prompt or input only as many bytes as the cut can need (at most 6 N + 26
raw bytes: an escape is at most 6 bytes for one character). A body that is not JSON, or has no
such member, gets no key (None), never an error; the header-form body is not otherwise checked, so
a body whose leading part parses gets a key even if its tail would not.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from typing import Final

__all__ = ["KEY_PREFIX", "derive_affinity_key"]

KEY_PREFIX: Final = "prefix:"

_FULL_ROLES = frozenset({"system", "developer"})
_WS = re.compile(rb"[ \t\n\r]*+")
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_SCALAR = re.compile(rb"[^,:\[\]{}\s\"]++")
_STRUCTURE = re.compile(rb'["\[\]{}]')
_MAX_KEY_BYTES = 64  # longer top-level keys are skipped unread: no member of interest is longer

# Endpoint → (member counted in full, member cut at N bytes).
_MEMBERS: Final = {
    "/v1/chat/completions": (None, "messages"),
    "/v1/completions": (None, "prompt"),
    "/v1/responses": ("instructions", "input"),
}


class _NotJSON(Exception):
    """The scan met something it cannot read: no key."""


def derive_affinity_key(path: str, body: bytes | bytearray, limit: int) -> str | None:
    """The derived key of a request to `path` with `body`, or None (see the module docstring).

    `limit` is N, the bytes of the conversation (or prompt, or input) that count; at least 1.
    """
    members = _MEMBERS.get(path)
    if members is None or limit < 1:
        return None
    full_name, cut_name = members
    try:
        spans = _top_level_members(body, {n for n in members if n is not None})
        full = b""
        if full_name is not None and full_name in spans:
            start = spans[full_name]
            full = _text(_decode(body, start, _skip_value(body, start)))
        cut = b""
        if cut_name in spans:
            extra_full, cut = _cut_part(body, spans[cut_name], limit)
            full += extra_full
    except (_NotJSON, ValueError, RecursionError):  # ValueError covers UnicodeDecodeError
        return None
    if not full and not cut:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for part in (path.encode(), full, cut):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return KEY_PREFIX + digest.hexdigest()


def _cut_part(body: bytes | bytearray, start: int, limit: int) -> tuple[bytes, bytes]:
    """(what counts in full, what is cut at `limit`) of the member whose value is at `start`."""
    first = body[start : start + 1]
    if first == b'"':
        return b"", _string_prefix(body, start, limit)
    if first != b"[":
        raise _NotJSON
    item = _skip_ws(body, start + 1)
    if body[item : item + 1] == b"]":
        return b"", b""
    if body[item : item + 1] != b"{":
        # Prompts or token ids (completions), not messages: the JSON text as sent.
        return b"", bytes(body[start : min(_skip_value(body, start), start + limit)])
    full: list[bytes] = []
    cut: list[bytes] = []
    size = 0
    for item_start, item_end in _array_items(body, start):
        message = _decode(body, item_start, item_end)
        if isinstance(message, dict) and message.get("role") in _FULL_ROLES:
            full.append(_message(message))
            continue
        encoded = _message(message)
        cut.append(encoded[: limit - size])
        size += len(cut[-1])
        if size >= limit:
            break
    return b"".join(full), b"".join(cut)


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
