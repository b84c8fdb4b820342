"""One top-level string (or `true`) of a JSON body, found without parsing the body (the OpenAI
form's model, a request's `"stream": true`).

Why: a request in the OpenAI form (docs/clients.md) names its model in the body, and the replica
routes by it. `json.loads(body)` finds it, but first decodes the whole body to a `str` (a body
copy; up to four for text outside Latin-1) and then builds every string, number, list and dict in
it: two to three extra body copies held while the request is routed, only to read one short string
(docs/data-plane.md, "Request bodies in memory").

`top_level_string(body, "model")` instead scans the body's bytes. It accepts and refuses exactly
the bodies `json.loads` accepts and refuses (same grammar: `NaN`, `Infinity` and `-Infinity`
included, as `json.loads` allows them; UTF-8 checked with "surrogatepass", so encoded surrogates
pass as they do there; a UTF-8 byte-order mark skipped; no control character in a string; an
integer with more digits than `sys.get_int_max_str_digits()` refused, as `int()` refuses it; the
last of duplicate keys wins, however the key is escaped), and decodes nothing but the value it
returns. tests/unit/proxy/test_json_scan.py checks it against `json.loads` on random, sloppy and
mutated documents.

How: the body is checked to be UTF-8 first (as `json.loads` decodes it first), 64 KiB at a time;
then a tokenizer reads it. Compiled regular expressions match, at C speed, runs of array elements
or object members whose values are scalars or containers nested up to `_NESTED` deep (an array of
chat messages, a million numbers, the top level's members: `"model"` among them, whose value's
span the match keeps), each validated as it goes. Only what a run stops at (a container nested
deeper, an error) goes through a small Python state machine with a stack of open containers.
Every repetition is possessive (`*+`, `?+`), so the regex engine keeps no backtracking state that
grows with the input. What the scan allocates does not grow with the body, but for the stack (at
most `MAX_DEPTH` entries), the 64 KiB pieces of the UTF-8 check, and the value it returns.

Cost: about 1.5 ns a byte of string (a regex character class; `json.loads`' string loop is C at
about 1 ns a byte, and then allocates), 30 ns a number (`json.loads`: 50 ns and an `int`), about
1 to 2 µs for each container nested deeper than `_NESTED` (`json.loads`: 0.3 µs and a list or
dict of 60 bytes or more).

Where it differs from `json.loads`, on purpose:

* Nesting deeper than `MAX_DEPTH` is refused. `json.loads` refuses nesting deeper than the
  interpreter's recursion limit lets it go (a `RecursionError`), a depth that depends on the
  Python version and on the caller's stack (about 1,000 on 3.11, more on later versions); no API
  body nests more than a few levels.
* A body that `json.loads` would decode as UTF-16 or UTF-32 (it guesses from the first four bytes,
  `json.detect_encoding`) is handed to `json.loads`: rare, and not worth a second scanner.
"""

from __future__ import annotations

import codecs
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Final, TypeAlias, cast

__all__ = [
    "MAX_DEPTH",
    "Bytes",
    "JSONScanError",
    "prepare",
    "top_level_string",
    "top_level_true",
]

Bytes: TypeAlias = bytes | bytearray
"""What the scan reads: the body as the proxy holds it (stargate/proxy/app.py)."""

MAX_DEPTH: Final = 512
"""Deepest nesting of arrays and objects accepted."""


class JSONScanError(ValueError):
    """The body is not a JSON document `json.loads` would accept (or nests deeper than
    `MAX_DEPTH`)."""


_WS: Final = rb"[ \t\n\r]*+"
# What a string holds as is: bytes from U+0020 up, but `"` and `\` (json.loads refuses only the
# controls U+0000-U+001F in a string; DEL is allowed). Bytes past ASCII are taken as they come:
# `_check_utf8` has checked the whole body first, as json.loads decodes it first. Written as
# ranges, which the regex engine checks faster than the equivalent negated class.
_PLAIN: Final = rb"[ !#-\[\]-\xff]"
# A string, escapes included: unrolled (`plain* (escape plain*)*`), so that the engine loops once
# per escape, not once per run of plain bytes as well.
_STRING: Final = rb'"' + _PLAIN + rb'*+(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})' + _PLAIN + rb'*+)*+"'
_LITERALS: Final = rb"true|false|null|NaN|Infinity|-Infinity"

_QUOTE: Final = 0x22  # "
_COMMA: Final = 0x2C
_COLON: Final = 0x3A
_OPEN_ARRAY: Final = 0x5B  # [
_CLOSE_ARRAY: Final = 0x5D
_OPEN_OBJECT: Final = 0x7B  # {
_CLOSE_OBJECT: Final = 0x7D


def _integer(max_digits: int | None) -> bytes:
    """An integer part, of at most `max_digits` digits when given."""
    if max_digits is None:
        return rb"(?:[1-9][0-9]*+|0)"
    return rb"(?:[1-9][0-9]{0,%d}+|0)" % (max_digits - 1)


def _number(max_digits: int | None) -> bytes:
    """A JSON number, as `json.loads` reads it. With `max_digits`, an integer (no fraction, no
    exponent) of more digits is not one: `int()` refuses it, so `json.loads` raises."""
    integer = _integer(max_digits)
    if max_digits is not None:  # longer, it must have a fraction or an exponent
        integer = rb"(?:%s(?![0-9])|[1-9][0-9]*+(?=\.[0-9]|[eE][-+]?[0-9]))" % integer
    return rb"-?+" + integer + rb"(?:\.[0-9]++)?+(?:[eE][-+]?+[0-9]++)?+"


_NESTED: Final = 4
"""How deep the containers a run matches whole may nest: a chat message with `content` parts or
`tool_calls` is 4 (the message, the list, a part, its `image_url`). Deeper ones go through the
state machine, a microsecond or so per container; a deeper bound makes larger patterns (4: 25 KB,
compiled in about 80 ms, once)."""


@dataclass(frozen=True, slots=True)
class _Runs:
    """Runs of array elements and of object members, each with its comma, or the last one, then
    the closing bracket (not consumed: a run that ends after a value, not a comma, ended there).
    A value is a scalar or a container nested up to a bound, matched whole."""

    elements: re.Pattern[bytes]
    members: re.Pattern[bytes]
    # At the top level: a member with the key sought leaves its value's span in group `value`
    # (the last such member's, as a repeated group keeps its last match).
    top_members: re.Pattern[bytes]


@dataclass(frozen=True, slots=True)
class _Grammar:
    ws: re.Pattern[bytes]
    string: re.Pattern[bytes]
    scalar: re.Pattern[bytes]
    numbers: re.Pattern[bytes]  # a run of numbers in an array (`1, 2.5, -3,`)
    key: re.Pattern[bytes]  # the key sought, however escaped
    # By how deep their values may nest, from 0 (scalars only) to `nested`: a run at depth d takes
    # those of `min(nested, MAX_DEPTH - d)`, so that it opens no container past MAX_DEPTH.
    runs: tuple[_Runs, ...]


def _key_pattern(key: str) -> bytes:
    """The key as a JSON string: each character as it is or as a `\\u` escape (either case)."""
    parts = []
    for char in key:
        digits = "".join(f"[{d}{d.upper()}]" if d.isalpha() else d for d in f"{ord(char):04x}")
        forms = [re.escape(char), r"\\u" + digits]
        if char == "/":
            forms.append(r"\\/")
        parts.append("(?:" + "|".join(forms) + ")")
    return ('"' + "".join(parts) + '"').encode()


@lru_cache(maxsize=8)
def _grammar(max_digits: int | None, key: str, nested: int) -> _Grammar:
    scalar = rb"(?:" + _STRING + rb"|" + _number(max_digits) + rb"|" + _LITERALS + rb")"
    # Numbers with their commas, matched by a lighter pattern than a scalar: an embeddings input
    # is a million of them. An integer part longer than `max_digits` stops it (it cannot tell an
    # integer from a number with an exponent); the general pattern then takes it.
    number = rb"[ ]?+-?+" + _integer(max_digits) + rb"(?:\.[0-9]++)?+,"
    numbers = rb"(?:" + number + rb")*+"
    # Inside a container matched whole, the run of numbers must not end with a trailing comma.
    numbers_inside = numbers + rb"(?!(?<=,)" + _WS + rb"\])"
    values = [scalar]
    for _ in range(nested):
        inner = values[-1]
        array = rb"\[" + numbers_inside + rb"(?:" + _WS + inner + _WS
        array += rb"(?:,(?!" + _WS + rb"\])|(?=\])))*+" + _WS + rb"\]"
        member = _WS + _STRING + _WS + rb":" + _WS + inner + _WS
        obj = rb"\{(?:" + member + rb"(?:,(?!" + _WS + rb"\})|(?=\})))*+" + _WS + rb"\}"
        values.append(rb"(?:" + scalar + rb"|" + array + rb"|" + obj + rb")")
    key_pattern = _key_pattern(key)
    runs = []
    for value in values:
        member = _STRING + _WS + rb":" + _WS + value
        top_member = rb"(?:" + key_pattern + _WS + rb":" + _WS + rb"(?P<value>" + value
        top_member += rb")|" + member + rb")"
        runs.append(
            _Runs(
                elements=re.compile(rb"(?:" + _WS + value + _WS + rb"(?:,|(?=\])))*+"),
                members=re.compile(rb"(?:" + _WS + member + _WS + rb"(?:,|(?=\})))*+"),
                top_members=re.compile(rb"(?:" + _WS + top_member + _WS + rb"(?:,|(?=\})))*+"),
            )
        )
    return _Grammar(
        ws=re.compile(_WS),
        string=re.compile(_STRING),
        scalar=re.compile(scalar),
        numbers=re.compile(numbers),
        key=re.compile(key_pattern),
        runs=tuple(runs),
    )


def prepare(key: str) -> None:
    """Compile the patterns for `key` now (they are otherwise compiled on first use)."""
    _grammar(sys.get_int_max_str_digits() or None, key, _NESTED)


def top_level_string(body: Bytes, key: str, *, nested: int = _NESTED) -> str | None:
    """The value of `key` in the JSON object `body` when it is a string (of duplicates, the last);
    None when `body` is JSON but not an object, has no `key`, or its value is not a string.

    Raises `ValueError` (`JSONScanError`, or what `json.loads` raises) for a body `json.loads`
    refuses, and for nesting deeper than `MAX_DEPTH`. `key` must be ASCII that JSON writes without
    escapes (such as `model`).

    `nested`: how deep the containers that runs match whole may nest (0: none, every container
    goes through the state machine). It changes the speed, never the answer; the tests compare.
    """
    span = _top_level_span(body, key, nested)
    if span is None:
        return None
    if not isinstance(span, tuple):
        value = span.get(key)
        return value if isinstance(value, str) else None
    start, stop = span
    if body[start] != _QUOTE:
        return None
    if body.find(b"\\", start, stop) < 0:  # nothing to unescape: the text between the quotes
        return body[start + 1 : stop - 1].decode("utf-8", "surrogatepass")
    value = json.loads(body[start:stop])
    assert isinstance(value, str)
    return value


def top_level_true(body: Bytes, key: str, *, nested: int = _NESTED) -> bool:
    """Whether `key` in the JSON object `body` is the literal `true` (of duplicates, the last):
    a request's `"stream": true` (stargate/proxy/loading.py), read the same way as
    `top_level_string` reads its model, and with the same errors."""
    span = _top_level_span(body, key, nested)
    if span is None:
        return False
    if not isinstance(span, tuple):
        return span.get(key) is True
    start, stop = span
    return body[start:stop] == b"true"


def _top_level_span(
    body: Bytes, key: str, nested: int
) -> tuple[int, int] | dict[str, object] | None:
    """The span of `key`'s last top-level value when it is a scalar; or the decoded document
    when `json.loads` would read `body` as UTF-16 or UTF-32 (and it is an object); else None."""
    encoding = json.detect_encoding(body)
    if encoding == "utf-8":
        start = 0
    elif encoding == "utf-8-sig":
        start = 3  # json.loads drops the mark
    else:
        return _from_document(body)
    _check_utf8(body)
    max_digits = sys.get_int_max_str_digits()
    grammar = _grammar(max_digits or None, key, nested)
    return _scan(body, start, grammar)


_UTF8_CHUNK: Final = 1 << 16


def _check_utf8(body: Bytes) -> None:
    """Raise `UnicodeDecodeError` unless `body` is UTF-8 (encoded surrogates allowed), as
    `json.loads` decodes it; a piece at a time, so the text it decodes to is never held whole."""
    if body.isascii():
        return
    end = len(body)
    with memoryview(body) as view:
        start = 0
        while start < end:
            stop = min(start + _UTF8_CHUNK, end)
            # Cut before a character, not inside one: a well-formed body has at most three
            # continuation bytes (0x80-0xBF) in a row. (In a malformed one any cut will do: a piece
            # that starts with a continuation byte fails.)
            for _ in range(3):
                if stop < end and 0x80 <= body[stop] < 0xC0:
                    stop -= 1
            codecs.utf_8_decode(view[start:stop], "surrogatepass", True)
            start = stop


def _from_document(body: Bytes) -> dict[str, object] | None:
    try:
        document = json.loads(body)
    except RecursionError:
        raise JSONScanError("nested too deeply") from None
    return document if isinstance(document, dict) else None


_Skip: TypeAlias = Callable[[Bytes, int], re.Match[bytes]]

_VALUE: Final = 0  # a value is next
_KEY: Final = 1  # after `{` or a comma in an object: members, then a key or the closing brace
_ELEMENTS: Final = 2  # after `[` or a comma in an array: elements, then one or the bracket
_AFTER: Final = 3  # after a value: a comma, a closing bracket, or the end of the document


def _scan(body: Bytes, pos: int, grammar: _Grammar) -> tuple[int, int] | None:
    """Validate `body` from `pos`; the span of the top-level key's last value, if a scalar (a
    string, number or literal: not an object or array)."""
    end = len(body)
    ws = cast(_Skip, grammar.ws.match)  # every `*+` pattern matches, if only the empty string
    numbers = cast(_Skip, grammar.numbers.match)
    string = grammar.string.match
    scalar = grammar.scalar.match
    key = grammar.key.fullmatch
    runs_by_depth = grammar.runs
    nested = len(runs_by_depth) - 1
    stack: list[bool] = []  # the open containers, True for an object
    found: tuple[int, int] | None = None
    is_key_value = False  # the value next is the top-level key's
    state = _VALUE
    try:
        while True:
            if state == _VALUE:
                pos = ws(body, pos).end()
                byte = body[pos]
                if byte == _QUOTE:
                    match = string(body, pos)
                    if match is None:
                        raise JSONScanError(f"bad string at {pos}")
                    if is_key_value:
                        found = (pos, match.end())
                    pos, state = match.end(), _AFTER
                elif byte in (_OPEN_OBJECT, _OPEN_ARRAY):
                    if is_key_value:
                        found = None
                    if len(stack) >= MAX_DEPTH:
                        raise JSONScanError(f"nested deeper than {MAX_DEPTH} at {pos}")
                    pos = ws(body, pos + 1).end()
                    if body[pos] == byte + 2:  # `{}` or `[]`
                        pos, state = pos + 1, _AFTER
                    else:
                        stack.append(byte == _OPEN_OBJECT)
                        state = _KEY if byte == _OPEN_OBJECT else _ELEMENTS
                else:
                    match = scalar(body, pos)
                    if match is None:
                        raise JSONScanError(f"expecting a value at {pos}")
                    if is_key_value:
                        found = (pos, match.end())
                    pos, state = match.end(), _AFTER
                is_key_value = False
            elif state == _KEY:
                runs = runs_by_depth[min(nested, MAX_DEPTH - len(stack))]
                top = len(stack) == 1
                match = (runs.top_members if top else runs.members).match(body, pos)
                assert match is not None
                if top and (start := match.start("value")) >= 0:
                    scalar_value = body[start] not in (_OPEN_OBJECT, _OPEN_ARRAY)
                    found = (start, match.end("value")) if scalar_value else None
                pos, state = _after_run(body, pos, match.end())
                if state == _AFTER:
                    continue  # the run ended at the closing brace
                pos = ws(body, pos).end()
                match = string(body, pos)
                if match is None:
                    raise JSONScanError(f"expecting a key at {pos}")
                is_key_value = top and key(body, pos, match.end()) is not None
                pos = ws(body, match.end()).end()
                if body[pos] != _COLON:
                    raise JSONScanError(f"expecting ':' at {pos}")
                pos += 1
            elif state == _ELEMENTS:
                runs = runs_by_depth[min(nested, MAX_DEPTH - len(stack))]
                match = runs.elements.match(body, numbers(body, pos).end())
                assert match is not None
                pos, state = _after_run(body, pos, match.end())
            else:
                pos = ws(body, pos).end()
                if not stack:
                    if pos != end:
                        raise JSONScanError(f"extra data at {pos}")
                    return found
                byte = body[pos]
                if byte == _COMMA:
                    pos, state = pos + 1, _KEY if stack[-1] else _ELEMENTS
                elif byte == (_CLOSE_OBJECT if stack[-1] else _CLOSE_ARRAY):
                    stack.pop()
                    pos += 1
                else:
                    raise JSONScanError(f"expecting ',' or a closing bracket at {pos}")
    except IndexError:
        raise JSONScanError("unexpected end of the document") from None


def _after_run(body: Bytes, start: int, stop: int) -> tuple[int, int]:
    """Where a run from `start` ended, and what comes next: after a value when the run ended at
    the closing bracket, else (it ended after a comma, or matched nothing) a key or a value."""
    if stop > start and body[stop - 1] != _COMMA:
        return stop, _AFTER
    return stop, _VALUE
