"""`json_scan.top_level_string` against `json.loads` (issue 19, item 2): the scan that finds an
OpenAI-form body's model must accept and refuse exactly the bodies `json.loads` accepts and
refuses, and find the same top-level `model` (the last of duplicates), without building the
document.

The property is differential: random JSON documents, rendered with random whitespace, escapes
(`\\uXXXX` in either case, the short escapes, lone surrogates, keys such as `mod\\u0065l`), number
spellings (exponents, `-0`, `NaN`, `Infinity`, which `json.loads` accepts), raw UTF-8 (encoded
surrogates included) and duplicate `model` keys; then the same documents with a few bytes
inserted, deleted or replaced (structural characters, controls, bytes that are not UTF-8, a
byte-order mark, leading zeros, trailing commas...). Each one goes through both, as `bytes` and as
`bytearray` (the proxy holds a body in either), and the outcomes must be equal: refused, JSON
without a `model` string, or the same model string. Nesting stays shallow: deep nesting is the one
documented difference (`MAX_DEPTH`), tested on its own below.
"""

from __future__ import annotations

import json
import sys
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from random import Random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stargate.proxy.json_scan import MAX_DEPTH, top_level_string, top_level_true

Outcome = tuple[str, str | None]


def reference(body: bytes) -> Outcome:
    """What the proxy did with `json.loads`: refused, no model string, or the model string."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return ("refused", None)
    model = document.get("model") if isinstance(document, dict) else None
    return ("model", model) if isinstance(model, str) else ("no model", None)


def scanned(body: bytes | bytearray, nested: int | None = None) -> Outcome:
    try:
        if nested is None:
            model = top_level_string(body, "model")
        else:
            model = top_level_string(body, "model", nested=nested)
    except ValueError:
        return ("refused", None)
    return ("no model", None) if model is None else ("model", model)


def reference_true(body: bytes) -> bool | None:
    """`"model": true` at the top level by json.loads (None: refused)."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return isinstance(document, dict) and document.get("model") is True


def scanned_true(body: bytes | bytearray, nested: int) -> bool | None:
    """`top_level_true`, the same scan read for the literal `true` (a request's `"stream"`)."""
    try:
        return top_level_true(body, "model", nested=nested)
    except ValueError:
        return None


def check(body: bytes) -> None:
    """The scan agrees with json.loads, on `bytes` and on `bytearray`, and whether it matches
    containers whole in its runs (as it does, 4 deep) or takes every one through its state
    machine (0), or a mix (1); and so does `top_level_true` on whether the key is `true`."""
    expected = reference(body)
    assert scanned(body) == expected, body
    assert scanned(bytearray(body)) == expected, body
    assert scanned(body, nested=0) == expected, body
    assert scanned(body, nested=1) == expected, body
    truth = reference_true(body)
    assert scanned_true(body, 4) == truth, body
    assert scanned_true(bytearray(body), 0) == truth, body


# ---- documents ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Array:
    items: list[Any]


@dataclass(frozen=True)
class Object:
    members: list[tuple[str, Any]]  # a list: keys may repeat


@dataclass(frozen=True)
class Spelled:
    number: str  # a number as written


# Every code point, lone surrogates included (hypothesis leaves them out unless told).
CHARACTERS = st.characters(exclude_categories=())
TEXT = st.one_of(
    st.text(CHARACTERS, max_size=8),
    # What matters in a string: what must or may be escaped, DEL, a character of each UTF-8
    # length, each half of a surrogate pair alone.
    st.text(
        st.sampled_from('ab "\\/\b\f\n\r\t\x00\x1f\x7f\xe9\u20ac\U0001f600\ud800\udc00'), max_size=8
    ),
    st.sampled_from(["model", "m", "gpt-4o", " m ", "", "  "]),
)
KEYS = st.one_of(st.sampled_from(["model", "model", "models", "Model", "messages", "input"]), TEXT)
# Spellings json.loads accepts (NaN and the infinities included), and ones it refuses.
SPELLINGS = ("0", "-0", "1e5", "1E+05", "-0.0e-0", "2.5e-3", "123.456", "1" * 30, "NaN")
SPELLINGS += ("Infinity", "-Infinity")
BAD_SPELLINGS = ("01", "-01", "00", "1.", ".5", "+1", "1e", "1.e5", "- 1", "0x10", "nan", "-NaN")
BAD_SPELLINGS += ("Infinity1", "tru", "nul", "True", "1_000", "\u0661")
NUMBERS = st.one_of(
    st.integers(-(10**25), 10**25),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(SPELLINGS).map(Spelled),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4).map(Array),
        st.lists(st.tuples(KEYS, children), max_size=4).map(Object),
    ),
    max_leaves=10,
)
# Mostly what the proxy sees: an object, often with one or more `model` members, mostly strings.
MODEL_MEMBERS = st.tuples(st.just("model"), st.one_of(TEXT, TEXT, TEXT, SCALARS, VALUES))
MEMBERS = st.one_of(MODEL_MEMBERS, MODEL_MEMBERS, st.tuples(KEYS, VALUES))
DOCUMENTS = st.one_of(
    VALUES,
    st.lists(MEMBERS, min_size=1, max_size=5).map(Object),
    st.lists(MEMBERS, min_size=1, max_size=5).map(Object),
)

WHITESPACE = ("", "", "", " ", "\n", "\t", "\r\n  ", "  ")
SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f", "\n": "\\n"}
SHORT_ESCAPES |= {"\r": "\\r", "\t": "\\t"}


class Renderer:
    """Writes a document as JSON text, its formatting chosen by `random` (drawn by hypothesis,
    so it shrinks): whitespace, how each character of a string is spelled, how a float is. A
    sloppy renderer also slips now and then: a number json.loads refuses, a character that must be
    escaped left raw, a trailing, missing or doubled comma, a missing colon."""

    def __init__(self, random: Random, sloppy: bool) -> None:
        self.random = random
        self.sloppy = sloppy

    def slip(self) -> bool:
        return self.sloppy and self.random.random() > 0.98

    def ws(self) -> str:
        return self.random.choice(WHITESPACE)

    def string(self, text: str) -> str:
        out = ['"']
        for char in text:
            if self.slip():  # a control (refused in a string), or DEL (accepted)
                out.append(self.random.choice(("\x00", "\x1f", "\t", "\n", "\x7f")))
            code = ord(char)
            how = self.random.choice(("raw", "raw", "raw", "short", "lower", "upper"))
            if how == "raw" and ((char not in '"\\' and code >= 0x20) or self.slip()):
                out.append(char)
            elif how == "short" and char in SHORT_ESCAPES:
                out.append(SHORT_ESCAPES[char])
            elif code > 0xFFFF:  # as a surrogate pair
                high, low = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
                out.append(
                    f"\\u{high:04X}\\u{low:04X}" if how == "upper" else f"\\u{high:04x}\\u{low:04x}"
                )
            else:
                out.append(f"\\u{code:04X}" if how == "upper" else f"\\u{code:04x}")
        out.append('"')
        return "".join(out)

    def comma(self) -> str:
        return self.random.choice(("", ",,")) if self.slip() else ","

    def value(self, value: Any) -> str:
        if self.slip():
            return self.random.choice(BAD_SPELLINGS)
        if value is None:
            return "null"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, Spelled):
            return value.number
        if isinstance(value, int):
            return str(value)
        if isinstance(value, float):
            if value != value:
                return "NaN"
            if value in (float("inf"), float("-inf")):
                return "Infinity" if value > 0 else "-Infinity"
            return self.random.choice((repr(value), f"{value:e}", f"{value:E}"))
        if isinstance(value, str):
            return self.string(value)
        if isinstance(value, Array):
            items = [self.ws() + self.value(item) + self.ws() for item in value.items]
        else:
            assert isinstance(value, Object)
            colon = "" if self.slip() else ":"
            items = [
                self.ws() + self.string(key) + self.ws() + colon + self.ws() + self.value(item)
                for key, item in value.members
            ]
        text = "".join(item + self.comma() for item in items[:-1]) + "".join(items[-1:])
        if self.slip():
            text += ","  # a trailing comma
        opening, closing = "[]" if isinstance(value, Array) else "{}"
        return opening + (text or self.ws()) + closing


@st.composite
def documents(draw: st.DrawFn, sloppy: bool = False) -> bytes:
    """JSON text (`sloppy`: not always JSON) of a random document, encoded as UTF-8, raw lone
    surrogates as "surrogatepass" writes them (json.loads reads them back)."""
    renderer = Renderer(draw(st.randoms(use_true_random=False)), sloppy)
    text = renderer.ws() + renderer.value(draw(DOCUMENTS)) + renderer.ws()
    body = text.encode("utf-8", "surrogatepass")
    if renderer.random.random() > 0.95:
        body = b"\xef\xbb\xbf" + body  # a byte-order mark: json.loads skips it
    return body


PIECES = st.one_of(
    st.sampled_from(
        [
            *(bytes([b]) for b in b'{}[],:"\\0123456789-+.eE tfnNI \t\n\r'),
            b"\x00",
            b"\x1f",
            b"\x7f",
            b"\x80",
            b"\xff",
            b"\xc0\x80",  # overlong
            b"\xed\xa0\x80",  # an encoded surrogate
            b"\xf4\x90\x80\x80",  # past U+10FFFF
            b"\xe4\xb8",  # a character cut short
            b"\xef\xbb\xbf",
            b"\\u",
            b"\\ud800",
            b"\\x",
            b"NaN",
            b"Infinity",
            b"-Infinity",
            b"true",
            b"null",
            b"00",
            b"01",
            b"1.",
            b"1e",
            b'"model"',
            b'"model":',
            b',"model":"x"',
            b",]",
            b",}",
        ]
    ),
    st.binary(min_size=1, max_size=3),
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    body = bytearray(draw(documents()))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(body)))
        operation = draw(st.sampled_from(["insert", "delete", "replace"]))
        if operation == "delete":
            del body[at : at + draw(st.integers(1, 3))]
        else:
            piece = draw(PIECES)
            body[at : at + (len(piece) if operation == "replace" else 0)] = piece
    return bytes(body)


FAST = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(documents())
def test_documents_are_read_as_json_loads_reads_them(body: bytes) -> None:
    check(body)


@FAST
@given(documents(sloppy=True))
def test_sloppy_documents_are_refused_or_read_as_json_loads_does(body: bytes) -> None:
    check(body)


@FAST
@given(mutated())
def test_mutated_documents_are_refused_or_read_as_json_loads_does(body: bytes) -> None:
    check(body)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=40))
def test_random_bytes(body: bytes) -> None:
    check(body)


# ---- the cases that matter, spelled out ------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"model": "m"}', ("model", "m")),
        (b'{"model": "a", "x": 1, "model": "b"}', ("model", "b")),  # the last one wins
        (b'{"model": "a", "model": 2}', ("no model", None)),
        (b'{"mod\\u0065l": "escaped key"}', ("model", "escaped key")),
        (b'{"model": "\\u0067pt\\n"}', ("model", "gpt\n")),
        (b'{"model": "\\ud800"}', ("model", "\ud800")),  # a lone surrogate, as json.loads has it
        (b'{"model": "\xed\xa0\x80"}', ("model", "\ud800")),  # the same, encoded
        (b'\xef\xbb\xbf{"model": "bom"}', ("model", "bom")),
        (b'{"x": {"model": "inner"}}', ("no model", None)),
        (b'[{"model": "m"}]', ("no model", None)),
        (b'{"model": "m", "n": NaN, "i": [Infinity, -Infinity]}', ("model", "m")),
        (b'{"model": "m", "x": [1, 2,]}', ("refused", None)),
        (b'{"model": "m",}', ("refused", None)),
        (b'{"model": "m", "x": 01}', ("refused", None)),
        (b'{"model": "m\x01"}', ("refused", None)),
        (b'{"model": "m\x7f"}', ("model", "m\x7f")),
        (b'{"model": "\xff"}', ("refused", None)),
        (b'{"model": "m"} {}', ("refused", None)),
        (b"", ("refused", None)),
        ('{"model": "utf-16"}'.encode("utf-16"), ("model", "utf-16")),  # handed to json.loads
        ('{"model": "utf-32-le"}'.encode("utf-32-le"), ("model", "utf-32-le")),
    ],
)
def test_examples(body: bytes, expected: Outcome) -> None:
    assert reference(body) == expected
    assert scanned(body) == expected
    assert scanned(bytearray(body)) == expected


@contextmanager
def int_max_str_digits(limit: int) -> Iterator[None]:
    saved = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(limit)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(saved)


@pytest.mark.parametrize("limit", [640, 4300, 0])
def test_integers_longer_than_int_accepts_are_refused_as_json_loads_refuses_them(
    limit: int,
) -> None:
    with int_max_str_digits(limit):
        digits = limit or 5000
        for number in (
            "01",
            "-01",
            "00",
            "1" * digits,
            "-" + "1" * digits,
            "1" * (digits + 1),
            "-" + "1" * (digits + 1),
            "1" * (digits + 1) + ".5",
            "1" * (digits + 1) + "e5",
            "1" * (digits + 1) + ".",
        ):
            for body in (
                f'{{"model": "m", "n": {number}}}'.encode(),
                f'{{"model": "m", "n": [1, {number}, 2]}}'.encode(),
                f'{{"model": "m", "n": [{number}]}}'.encode(),
            ):
                check(body)


def test_nesting_up_to_max_depth_is_read_and_deeper_is_refused() -> None:
    inner = b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1)
    assert scanned(b'{"model": "m", "x": ' + inner + b"}") == ("model", "m")
    deeper = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert reference(b'{"model": "m", "x": ' + deeper + b"}") == ("model", "m")
    assert scanned(b'{"model": "m", "x": ' + deeper + b"}") == ("refused", None)
    # Past the interpreter's stack json.loads refused too (RecursionError); the scan stops at
    # MAX_DEPTH, before reading the rest.
    for body in (b"[" * 200_000, b'{"model": "m", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"):
        assert reference(body) == scanned(body) == ("refused", None)


# ---- what it costs ----------------------------------------------------------------------------

TEN_MB = 10 * 2**20
WORDS = "the quick brown fox jumps over the lazy dog, then writes a poem about it.\n"


def chat(text: str = WORDS, ensure_ascii: bool = True) -> bytes:
    content = text * (TEN_MB // 1000 // len(text.encode()))
    messages = [{"role": "user", "content": content} for _ in range(1000)]
    return json.dumps({"model": "m", "messages": messages}, ensure_ascii=ensure_ascii).encode()


def embeddings() -> bytes:
    return json.dumps({"model": "m", "input": [n % 1000 for n in range(2_000_000)]}).encode()


BODIES = {
    "chat": chat,
    "chat-utf8": lambda: chat("日本語のテキストです。改行も。\n", ensure_ascii=False),
    "embeddings": embeddings,
}


@pytest.mark.parametrize("kind", BODIES)
def test_a_10_mb_body_is_scanned_without_allocating_in_proportion(kind: str) -> None:
    body = bytearray(BODIES[kind]())
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        assert top_level_string(body, "model") == "m"
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    # UTF-8 is checked 64 KiB at a time: each piece decodes to a short-lived str of ~200 KB at
    # most. Everything else is constant: no decoded body, no strings, no numbers.
    assert peak < 300_000, f"{kind}: {peak} bytes ({peak / len(body):.3f} body copies)"


@pytest.mark.parametrize("shift", range(4))
def test_utf8_is_checked_across_the_pieces_it_is_checked_in(shift: int) -> None:
    """The check goes 64 KiB at a time, cut before a character: characters of every length, and
    encoded surrogates, around every cut; then a bad byte near one."""
    text = "a" * shift + "é€😀\ud800x" * 40_000
    good = ('{"model": "m", "x": "' + text + '"}').encode("utf-8", "surrogatepass")
    check(good)
    for at in (65_536, 65_537, 131_071, 131_072 + shift):
        for bad in (b"\xff", b"\x80", b"\xe2\x82", b"\xc0\xaf"):
            check(good[:at] + bad + good[at:])
