"""The engine stats stream: NDJSON lines of per-request cumulative token counters.

An engine that serves it (Dynamo, and the mock engine; vLLM and SGLang do not) tells the Pylon,
for each request, how many prompt tokens it has processed and how many it has generated, which
is more exact than what the Pylon can infer by watching answers. The stream is one JSON object
per line:

* `{"v": 1, "type": "ping"}`: keeps the stream alive, says nothing;
* `{"v": 1, "type": "stats", "request_id": ..., "model": ..., "tokens_processed": N,
  "tokens_generated": N, "finished": bool}`: the request's counters so far. Either counter may be
  left out (or null), but not both unless the event says the request finished (an event with
  nothing to say is a broken engine, not a quiet one). Fields this version does not know are
  ignored, so an engine may add some; a different `v` is a different schema and is refused.

Only the pure parts are here: cutting the byte stream into lines and reading one line. A line
longer than 64 KiB is dropped whole (a sane event is under 200 bytes; a longer line is a broken
or hostile engine, and buffering it would let it grow the Pylon's memory without bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

__all__ = [
    "MAX_ENGINE_LINE_BYTES",
    "EngineCounters",
    "EngineEventError",
    "EnginePing",
    "NdjsonLines",
    "parse_engine_event",
]

MAX_ENGINE_LINE_BYTES = 64 * 1024
"""The longest line kept, in bytes, its `\\n` not counted (a `\\r` before it is)."""

_U64_MAX = 2**64 - 1


class NdjsonLines:
    """Cuts a byte stream, fed chunk by chunk, into lines.

    A line ends at `\\n`; one `\\r` before it is dropped; blank (empty or whitespace-only) lines
    are skipped. A line longer than `max_line_bytes` is dropped whole, however the chunks cut it,
    and no more than `max_line_bytes` of a line is ever held. The bytes after the last `\\n` wait
    for the next chunk (an unterminated last line is not a line).
    """

    __slots__ = ("_dropping", "_max", "_pending")

    def __init__(self, max_line_bytes: int = MAX_ENGINE_LINE_BYTES) -> None:
        if max_line_bytes < 1:
            raise ValueError(f"max_line_bytes must be positive, not {max_line_bytes}")
        self._max = max_line_bytes
        self._pending = bytearray()
        # The current line is too long: skip to its end.
        self._dropping = False

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines `chunk` completes, in stream order."""
        lines: list[bytes] = []
        start = 0
        if self._dropping:
            newline = chunk.find(b"\n")
            if newline < 0:
                return lines
            self._dropping = False
            start = newline + 1
        elif self._pending:
            pending = self._pending
            newline = chunk.find(b"\n")
            if newline < 0:
                if len(pending) + len(chunk) > self._max:
                    pending.clear()
                    self._dropping = True
                else:
                    pending += chunk
                return lines
            if len(pending) + newline <= self._max:
                pending += memoryview(chunk)[:newline]
                _keep(bytes(pending), lines)
            pending.clear()
            start = newline + 1
        newline = chunk.find(b"\n", start)
        while newline >= 0:
            if newline - start <= self._max:
                _keep(chunk[start:newline], lines)
            start = newline + 1
            newline = chunk.find(b"\n", start)
        if len(chunk) - start > self._max:
            self._dropping = True
        elif start < len(chunk):
            self._pending += memoryview(chunk)[start:]
        return lines


def _keep(line: bytes, lines: list[bytes]) -> None:
    if line[-1:] == b"\r":
        line = line[:-1]
    if line.strip():
        lines.append(line)


@dataclass(frozen=True, slots=True)
class EnginePing:
    """A keep-alive event: the stream is up, nothing changed."""


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """One request's cumulative counters: prompt tokens processed and output tokens generated so
    far (None: this event does not say), and whether the request finished."""

    request_id: str
    model: str
    tokens_processed: int | None
    tokens_generated: int | None
    finished: bool


class EngineEventError(ValueError):
    """A line of the engine stats stream that is not a valid event (the line is skipped)."""


def _name(obj: dict[str, object], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise EngineEventError(f"stats event needs a non-empty string {key!r}, got {value!r}")
    return value


def _optional_counter(obj: dict[str, object], key: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= _U64_MAX:
        raise EngineEventError(f"{key!r} must be a non-negative integer, got {value!r}")
    return value


def parse_engine_event(line: bytes) -> EnginePing | EngineCounters:
    """One line of the stream as an event; `EngineEventError` says why a line is not one."""
    try:
        obj = orjson.loads(line)  # one line per token of every stream: the cheaper parser
    except orjson.JSONDecodeError as exc:
        raise EngineEventError(f"engine stats line is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise EngineEventError(f"engine stats line is not a JSON object: {type(obj).__name__}")
    version = obj.get("v")
    if type(version) is not int or version != 1:
        raise EngineEventError(f"unsupported engine stats version {version!r} (expected 1)")
    kind = obj.get("type")
    if kind == "ping":
        return EnginePing()
    if kind != "stats":
        raise EngineEventError(f"unknown engine stats event type {kind!r}")
    request_id = _name(obj, "request_id")
    model = _name(obj, "model")
    processed = _optional_counter(obj, "tokens_processed")
    generated = _optional_counter(obj, "tokens_generated")
    finished = obj.get("finished")
    if finished is None:
        finished = False
    elif not isinstance(finished, bool):
        raise EngineEventError(f"'finished' must be a boolean, got {finished!r}")
    if processed is None and generated is None and not finished:
        raise EngineEventError("stats event carries no counter and is not finished")
    return EngineCounters(request_id, model, processed, generated, finished)
