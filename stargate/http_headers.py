"""HTTP header helpers shared by the replica's proxy and the Pylon (pure).

Both forward requests between two HTTP parties and must agree on what belongs to one connection
(hop-by-hop headers, never forwarded) and on how a numeric header is read (the Rust parser's
rules, not Python's `int()`).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["HOP_BY_HOP", "Headers", "connection_options", "first_header", "parse_unsigned"]

Headers = list[tuple[bytes, bytes]]

# Headers that describe one connection, never the request (RFC 9110 §7.6.1; `http2-settings`,
# RFC 9113 §3.2.1), and `host`, which the upstream connection sets.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"http2-settings",
        b"host",
    }
)


def first_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def connection_options(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names listed in `Connection` (RFC 9110 §7.6.1): hop-by-hop, never forwarded."""
    names: set[bytes] = set()
    for key, value in headers:
        if key == b"connection":
            names.update(n.strip().lower() for n in value.split(b",") if n.strip())
    return frozenset(names)


def parse_unsigned(raw: bytes, maximum: int) -> int | None:
    """Rust-style unsigned parse: trimmed ASCII digits, optional leading `+`, at most `maximum`."""
    text = raw.strip(b" \t")
    if text.startswith(b"+"):
        text = text[1:]
    if not text or not text.isdigit() or not text.isascii():
        return None
    # More digits than the maximum has (leading zeros aside) is out of range. Checked before
    # `int()`, which raises ValueError past 4300 digits (Python's conversion limit): a 500 with a
    # traceback for `x-input-tokens: 999...` (found by tests/unit/proxy/test_bad_input.py).
    digits = text.lstrip(b"0")
    if len(digits) > len(str(maximum)):
        return None
    value = int(digits or b"0")
    return value if value <= maximum else None
