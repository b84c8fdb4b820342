"""Decoding a chunked response body (RFC 9112 §7.1) without h11: the state machine of the
upstream body's framing, pure (bytes in, body pieces out, no I/O).

Why not h11, which reads the head: an SSE stream is one chunk per event, and h11 turns each into
a `Data` event through its generic reader, event validation and state machine, about 10 us an
event, a tenth of what the replica spent per relayed event (docs/performance.md, "Streams").
Decoding the framing takes a `find` and a slice. The grammar is h11's own (its
`chunk_header` and `header_field` expressions), so what h11 refused is refused here:

* a chunk header is 1-20 hex digits, optional extensions (ignored, as h11 ignores them),
  optional whitespace, CRLF; a chunk's data is followed by CRLF;
* after the last chunk (size 0), trailer fields until an empty line; they are checked and
  dropped (h11 handed them to nobody either);
* a header or trailer line longer than `MAX_LINE` (h11's limit for an incomplete event) is an
  error rather than a buffer that grows with a broken backend's output.

Contract: `feed()` takes the bytes as they arrive and returns the body data they completed, in
order, as soon as any arrives (a chunk's data is passed on before the chunk has fully arrived,
as h11 does); `done` says the body has ended; `extra` holds any bytes that came after it (a
connection with such bytes cannot be reused). `ChunkedError` means the framing is broken: the
connection must be closed. Data decoded before the break in the same `feed()` is still returned
(h11 passes it on too), and the error is raised by the next call, `feed(b"")` included.
"""

from __future__ import annotations

import re
from typing import Final

from h11 import _abnf as abnf

__all__ = ["MAX_LINE", "ChunkedDecoder", "ChunkedError"]

MAX_LINE: Final = 16 * 1024
"""The longest chunk header or trailer section accepted (h11's default
`max_incomplete_event_size`)."""

_CHUNK_HEADER: Final = re.compile(abnf.chunk_header.encode("ascii"))
_TRAILER_FIELD: Final = re.compile(abnf.header_field.encode("ascii"))

# The states, in the order a chunk goes through them.
_SIZE: Final = 0  # expecting a chunk header
_DATA: Final = 1  # inside a chunk's data (`_remaining` bytes to go)
_DATA_END: Final = 2  # expecting the CRLF after a chunk's data
_TRAILER: Final = 3  # after the last chunk: trailer lines until an empty one
_DONE: Final = 4


class ChunkedError(Exception):
    """The chunked framing is broken (the message names how)."""


class ChunkedDecoder:
    """The framing of one chunked body. Not thread-safe; one per response."""

    __slots__ = ("_buffer", "_error", "_remaining", "_state", "_trailer", "extra")

    def __init__(self) -> None:
        self._buffer = b""
        self._remaining = 0
        self._state = _SIZE
        self._trailer = 0  # bytes of trailer section read so far
        self._error: ChunkedError | None = None  # the framing broke after data was returned
        self.extra = b""

    @property
    def failed(self) -> bool:
        """The framing broke after data was returned: the next `feed()` raises."""
        return self._error is not None

    @property
    def done(self) -> bool:
        """The last chunk and the trailer section have arrived: the body is complete."""
        return self._state == _DONE

    def feed(self, data: bytes) -> list[bytes]:
        """The body data completed by `data` (possibly none). Raises `ChunkedError`."""
        if self._error is not None:
            raise self._error
        if self._state == _DONE:
            self.extra += data
            return []
        buf = self._buffer + data if self._buffer else data
        out: list[bytes] = []
        try:
            return self._decode(buf, out)
        except ChunkedError as error:
            self._error = error
            if not out:
                raise
            return out  # the error comes with the next call

    def _decode(self, buf: bytes, out: list[bytes]) -> list[bytes]:
        pos = 0
        size = len(buf)
        state = self._state
        while pos < size:
            if state == _DATA:
                take = min(self._remaining, size - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._remaining -= take
                if self._remaining:
                    break
                state = _DATA_END
            elif state == _SIZE:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > MAX_LINE:
                        raise ChunkedError("chunk header too long")
                    break
                if end - pos > MAX_LINE:
                    raise ChunkedError("chunk header too long")
                match = _CHUNK_HEADER.fullmatch(buf, pos, end + 2)
                if match is None:
                    raise ChunkedError(f"illegal chunk header: {buf[pos : end + 2]!r}")
                pos = end + 2
                self._remaining = int(match["chunk_size"], 16)
                state = _DATA if self._remaining else _TRAILER
            elif state == _DATA_END:
                if size - pos < 2:
                    if buf[pos:] != b"\r":
                        raise ChunkedError(f"malformed chunk footer: {buf[pos:]!r}")
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ChunkedError(f"malformed chunk footer: {buf[pos : pos + 2]!r}")
                pos += 2
                state = _SIZE
            else:  # _TRAILER
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if self._trailer + size - pos > MAX_LINE:
                        raise ChunkedError("trailer section too long")
                    break
                self._trailer += end + 2 - pos
                if self._trailer > MAX_LINE:
                    raise ChunkedError("trailer section too long")
                if end == pos:
                    pos += 2
                    state = _DONE
                    self.extra = buf[pos:]
                    pos = size
                    break
                if _TRAILER_FIELD.fullmatch(buf, pos, end) is None:
                    raise ChunkedError(f"illegal trailer field: {buf[pos:end]!r}")
                pos = end + 2
        self._state = state
        self._buffer = buf[pos:] if pos < size else b""
        return out
