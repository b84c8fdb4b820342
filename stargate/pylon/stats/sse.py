"""Splitting a streamed engine answer into server-sent events, without changing a byte of it.

The Pylon passes every byte of a streamed answer on to the replica as it arrives, and watches it
on the way: the first output event ends the request's input phase, and every event may move its
output-token count (`tokens.py`). So the splitter has two duties that pull against each other:

* it must see whole events, whatever the chunking: an engine (or a proxy between us) may cut a
  chunk in the middle of an event, or put several events in one chunk;
* it must not cost much: it runs once per streamed chunk of every request, and almost every
  chunk is one `data:` line and its blank line, with nothing pending. That case costs one
  `bytes.find` and a few slices; every other case is a regular-expression search per event end,
  never a per-byte Python loop.

An event ends at a blank line: a line feed followed by another one, with an optional carriage
return before the second (`\\n\\n`, `\\r\\n\\r\\n`, and the mixed spellings). A line ends at a
line feed, and one carriage return before it is dropped; a lone carriage return is not treated as
a line end (engines end lines with LF or CRLF, and the old-Mac spelling would make the end of an
event depend on the byte that has not arrived yet).

Each event keeps its bytes exactly as received (`raw`, its blank line included), so that the
`raw` of every event, then `tail()` at the end of the stream, give back the stream byte for byte:
observing a stream never rewrites it.

A pending event is bounded (`max_event_bytes`, 1 MiB by default, the Rust Pylon's bound): an
engine that never ends an event would otherwise grow the buffer without limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NoReturn

__all__ = ["MAX_SSE_EVENT_BYTES", "SseEvent", "SseEventTooLarge", "SseSplitter", "parse_event"]

MAX_SSE_EVENT_BYTES = 1024 * 1024
"""The largest event (its blank line included) the splitter holds, in bytes."""

# The end of an event: a line feed, then a blank line (LF or CRLF).
_EVENT_END = re.compile(rb"\n\r?\n")
# How far before the end of the pending bytes an event end may begin: the longest end is 3 bytes.
_END_OVERLAP = 2


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One server-sent event.

    `raw` is the event as received, its terminating blank line included. `data` is its `data:`
    lines' values joined with a line feed (one space after the colon dropped, as the SSE format
    says), or None when it has no `data` line at all; `name` is the value of its first `event:`
    line, or None. Comment lines (those starting with a colon) are in `raw` only.
    """

    raw: bytes
    data: bytes | None
    name: str | None


class SseEventTooLarge(ValueError):
    """An event grew beyond the splitter's bound before its blank line came.

    `events` holds the whole events the failing `feed` found before the oversized one, so that a
    caller that stops observing the stream still accounts for them.
    """

    def __init__(self, size: int, limit: int, events: list[SseEvent]) -> None:
        super().__init__(f"SSE event of at least {size} bytes exceeds the {limit}-byte bound")
        self.size = size
        self.limit = limit
        self.events = events


def parse_event(raw: bytes) -> SseEvent:
    """The fields of one whole event (`raw` ends with its blank line, or is an unparsed tail)."""
    data: list[bytes] | None = None
    name: str | None = None
    for line in raw.split(b"\n"):
        if line[-1:] == b"\r":
            line = line[:-1]
        if not line or line[0] == 0x3A:  # a blank line, or a comment (`:`)
            continue
        field, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if field == b"data":
            if data is None:
                data = [value]
            else:
                data.append(value)
        elif field == b"event" and name is None:
            name = value.decode("utf-8", "replace")
    if data is None:
        return SseEvent(raw, None, name)
    return SseEvent(raw, data[0] if len(data) == 1 else b"\n".join(data), name)


class SseSplitter:
    """Splits an SSE byte stream, fed chunk by chunk, into whole events.

    `feed` returns the events a chunk completes, in order; bytes of an event not yet ended wait
    for the next chunk. `tail()` gives the bytes of the event still pending (at the end of the
    stream, they are passed on as they are: an unterminated event is not an event). An event
    whose size passes `max_event_bytes` raises `SseEventTooLarge`, and the splitter refuses
    every later chunk: past that point the stream's event boundaries are lost.
    """

    __slots__ = ("_failed_size", "_max", "_pending", "_scanned")

    def __init__(self, max_event_bytes: int = MAX_SSE_EVENT_BYTES) -> None:
        if max_event_bytes < 2:
            raise ValueError(f"max_event_bytes must be at least 2, not {max_event_bytes}")
        self._max = max_event_bytes
        self._pending = bytearray()
        # How many bytes of `_pending` are known to hold no event end.
        self._scanned = 0
        # The size of the event that broke the bound, once one did.
        self._failed_size: int | None = None

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """The events `chunk` completes, in stream order."""
        if self._failed_size is not None:
            raise SseEventTooLarge(self._failed_size, self._max, [])
        if not self._pending:
            return self._split(chunk)
        pending = self._pending
        pending += chunk
        match = _EVENT_END.search(pending, max(0, self._scanned - _END_OVERLAP))
        if match is None:
            self._scanned = len(pending)
            if len(pending) > self._max:
                self._fail(len(pending), [])
            return []
        first = bytes(pending[: match.end()])
        rest = bytes(pending[match.end() :])
        pending.clear()
        self._scanned = 0
        if len(first) > self._max:
            self._fail(len(first), [])
        events = [parse_event(first)]
        if rest:
            try:
                events += self._split(rest)
            except SseEventTooLarge as exc:
                exc.events[:0] = events
                raise
        return events

    def tail(self) -> bytes:
        """The bytes of the event still pending (no blank line has ended it yet)."""
        return bytes(self._pending)

    def _split(self, chunk: bytes) -> list[SseEvent]:
        """Split `chunk` with nothing pending; keep what follows its last event end."""
        size = len(chunk)
        first_newline = chunk.find(b"\n")
        if first_newline >= size - 3 and size <= self._max:
            # The common case: the chunk is one `data:` line and its blank line, nothing else.
            if first_newline == size - 2 and chunk[-1] == 0x0A:
                line = chunk[:-2]
            elif first_newline == size - 3 and chunk[-2:] == b"\r\n":
                line = chunk[:-3]
            else:
                line = b""
            if line[:5] == b"data:":
                if line[-1:] == b"\r":
                    line = line[:-1]
                value = line[5:]
                return [SseEvent(chunk, value[1:] if value[:1] == b" " else value, None)]
        if size <= self._max and chunk[-2:] == b"\n\n" and b"\r" not in chunk:
            # Several one-line `data:` events that arrived together (an engine faster than its
            # reader): one split instead of a search and a parse per event.
            lines = chunk[:-2].split(b"\n\n")
            if all(line[:5] == b"data:" and b"\n" not in line for line in lines):
                return [
                    SseEvent(line + b"\n\n", line[6:] if line[5:6] == b" " else line[5:], None)
                    for line in lines
                ]
        match = _EVENT_END.search(chunk)
        if match is not None and match.end() == size:
            # One whole event, the chunk itself.
            if size > self._max:
                self._fail(size, [])
            return [parse_event(chunk)]
        events: list[SseEvent] = []
        start = 0
        while match is not None:
            end = match.end()
            if end - start > self._max:
                self._fail(end - start, events)
            events.append(parse_event(chunk[start:end]))
            start = end
            match = _EVENT_END.search(chunk, start)
        if start < len(chunk):
            if len(chunk) - start > self._max:
                self._fail(len(chunk) - start, events)
            self._pending += memoryview(chunk)[start:]
            self._scanned = len(chunk) - start
        return events

    def _fail(self, size: int, events: list[SseEvent]) -> NoReturn:
        self._pending.clear()
        self._scanned = 0
        self._failed_size = size
        raise SseEventTooLarge(size, self._max, events)
