"""The engine stats stream: NDJSON lines whatever the chunking, the bound on a line, and the event
schema (the last two tests carry the Rust tests' names)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stargate.pylon.stats.engine_stream import (
    MAX_ENGINE_LINE_BYTES,
    EngineCounters,
    EngineEventError,
    EnginePing,
    NdjsonLines,
    parse_engine_event,
)


def feed_all(lines: NdjsonLines, chunks: list[bytes]) -> list[bytes]:
    return [line for chunk in chunks for line in lines.feed(chunk)]


def test_lines_end_at_line_feeds_and_a_carriage_return_is_dropped() -> None:
    stream = b'{"a":1}\n{"b":2}\r\n\n\r\n  \n{"c":3}\n{"d":'
    assert NdjsonLines().feed(stream) == [b'{"a":1}', b'{"b":2}', b'{"c":3}']


def test_a_line_split_at_every_point_comes_out_whole() -> None:
    stream = b'{"v":1,"type":"ping"}\r\n{"v":1}\n'
    for cut in range(len(stream) + 1):
        lines = feed_all(NdjsonLines(), [stream[:cut], stream[cut:]])
        assert lines == [b'{"v":1,"type":"ping"}', b'{"v":1}'], cut


def test_an_unterminated_line_waits() -> None:
    lines = NdjsonLines()
    assert lines.feed(b'{"v":1,') == []
    assert lines.feed(b'"type":"ping"}') == []
    assert lines.feed(b"\n") == [b'{"v":1,"type":"ping"}']


def test_a_line_at_the_bound_is_kept_and_one_past_it_dropped() -> None:
    lines = NdjsonLines(max_line_bytes=4)
    assert lines.feed(b"abcd\nabcde\nxy\n") == [b"abcd", b"xy"]
    # The carriage return counts: it is part of the line until the line ends.
    assert lines.feed(b"abc\r\nabcd\r\nz\n") == [b"abc", b"z"]


def test_a_long_line_across_chunks_is_dropped_whole_and_the_next_one_kept() -> None:
    lines = NdjsonLines(max_line_bytes=8)
    assert lines.feed(b"ok\n0123") == [b"ok"]
    assert lines.feed(b"45678") == []  # 10 bytes: dropped
    assert lines.feed(b"9abc") == []  # still the same line
    assert lines.feed(b"def\nnext") == []
    assert lines.feed(b"\n") == [b"next"]
    # Pending bytes that a chunk's line end makes too long.
    assert lines.feed(b"01234") == []
    assert lines.feed(b"5678\nafter\n") == [b"after"]


def test_a_long_line_is_never_buffered() -> None:
    """However long a line grows, at most the bound is held (the bound is the point: a broken
    engine must not grow the Pylon's memory)."""
    lines = NdjsonLines(max_line_bytes=MAX_ENGINE_LINE_BYTES)
    for _ in range(64):
        assert lines.feed(b"x" * 4096) == []
        assert len(lines._pending) <= MAX_ENGINE_LINE_BYTES
    assert lines.feed(b'\n{"v":1,"type":"ping"}\n') == [b'{"v":1,"type":"ping"}']
    assert MAX_ENGINE_LINE_BYTES == 64 * 1024


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        NdjsonLines(max_line_bytes=0)


def reference_lines(stream: bytes, limit: int) -> list[bytes]:
    """The lines of a whole stream, by the rules, with nothing clever."""
    kept = []
    for line in stream.split(b"\n")[:-1]:  # the part after the last line feed is not a line
        if len(line) > limit:
            continue
        line = line.removesuffix(b"\r")
        if line.strip():
            kept.append(line)
    return kept


PIECES = st.sampled_from([b'{"v":1}', b"x", b"0123456789", b"", b" ", b"\r", b"\n", b"\r\n"])
NDJSON = st.lists(PIECES, max_size=30).map(b"".join)


def chunked(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(stream)) for c in cuts})
    return [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]


@settings(max_examples=400, deadline=None)
@given(
    stream=NDJSON,
    cuts=st.lists(st.integers(0, 300), max_size=12),
    limit=st.integers(1, 16),
)
def test_any_chunking_yields_the_lines_of_the_whole_stream(
    stream: bytes, cuts: list[int], limit: int
) -> None:
    lines = NdjsonLines(max_line_bytes=limit)
    got = []
    for chunk in chunked(stream, cuts):
        got += lines.feed(chunk)
        assert len(lines._pending) <= limit
    assert got == reference_lines(stream, limit)


def test_parses_valid_engine_stats_events() -> None:
    assert parse_engine_event(b'{"v":1,"type":"ping"}') == EnginePing()
    assert parse_engine_event(
        b'{"v":1,"type":"stats","request_id":"req-1","model":"llama",'
        b'"tokens_processed":10,"tokens_generated":4}'
    ) == EngineCounters("req-1", "llama", 10, 4, False)
    # mock-dynamo's sequence: (0, 0) on arrival, (input, 0), (input, i), then finished.
    assert parse_engine_event(
        b'{"v":1,"type":"stats","request_id":"r","model":"m","tokens_processed":0,'
        b'"tokens_generated":0}'
    ) == EngineCounters("r", "m", 0, 0, False)
    assert parse_engine_event(
        b'{"v":1,"type":"stats","request_id":"r","model":"m","tokens_processed":100,'
        b'"tokens_generated":7,"finished":true}'
    ) == EngineCounters("r", "m", 100, 7, True)
    # One counter is enough; null is absent.
    assert parse_engine_event(
        b'{"v":1,"type":"stats","request_id":"r","model":"m","tokens_processed":12}'
    ) == EngineCounters("r", "m", 12, None, False)
    assert parse_engine_event(
        b'{"v":1,"type":"stats","request_id":"r","model":"m","tokens_processed":null,'
        b'"tokens_generated":3,"finished":false}'
    ) == EngineCounters("r", "m", None, 3, False)
    # Finished needs no counter.
    assert parse_engine_event(
        b'{"v":1,"type":"stats","request_id":"r","model":"m","finished":true}'
    ) == EngineCounters("r", "m", None, None, True)
    # Unknown fields are ignored, on pings too; whitespace around the object is JSON's business.
    assert parse_engine_event(
        b' {"v":1,"type":"stats","request_id":"r","model":"m","tokens_generated":1,'
        b'"worker":"w-3","ts_ms":1718000000000,"extra":{"nested":[1]}} '
    ) == EngineCounters("r", "m", None, 1, False)
    assert parse_engine_event(b'{"type":"ping","v":1,"seq":9}') == EnginePing()
    big = 2**64 - 1
    assert parse_engine_event(
        json.dumps(
            {"v": 1, "type": "stats", "request_id": "r", "model": "m", "tokens_processed": big}
        ).encode()
    ) == EngineCounters("r", "m", big, None, False)


STATS = {"v": 1, "type": "stats", "request_id": "r", "model": "m", "tokens_processed": 1}


def stats(**changes: object) -> bytes:
    event = {**STATS, **changes}
    return json.dumps({k: v for k, v in event.items() if v is not ...}).encode()


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"not json",
        b'{"v":1,"type":"ping"',
        b"\xff",
        b"[" * 100_000,
        b"[]",
        b'"ping"',
        b"null",
        b'{"type":"ping"}',
        b'{"v":2,"type":"ping"}',
        b'{"v":"1","type":"ping"}',
        b'{"v":true,"type":"ping"}',
        b'{"v":1.0,"type":"ping"}',
        b'{"v":1}',
        b'{"v":1,"type":"pong"}',
        b'{"v":1,"type":"STATS"}',
        stats(request_id=...),
        stats(request_id=""),
        stats(request_id=7),
        stats(request_id=None),
        stats(model=...),
        stats(model=""),
        stats(model=["m"]),
        stats(tokens_processed=-1),
        stats(tokens_processed=1.5),
        stats(tokens_processed=2.0),
        stats(tokens_processed="3"),
        stats(tokens_processed=True),
        stats(tokens_processed=2**64),
        stats(tokens_generated=-4),
        stats(tokens_generated=False),
        stats(finished="yes"),
        stats(finished=1),
        stats(tokens_processed=...),
        stats(tokens_processed=None, tokens_generated=None),
        stats(tokens_processed=..., finished=False),
    ],
)
def test_rejects_invalid_engine_stats_events(line: bytes) -> None:
    with pytest.raises(EngineEventError):
        parse_engine_event(line)


def test_an_engine_event_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="'tokens_generated' must be a non-negative integer"):
        parse_engine_event(stats(tokens_generated=-1))
