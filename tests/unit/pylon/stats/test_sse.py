"""The SSE splitter: whole events whatever the chunking, their fields, the bytes kept exactly, and
the bound on a pending event."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stargate.pylon.stats.sse import (
    MAX_SSE_EVENT_BYTES,
    SseEvent,
    SseEventTooLarge,
    SseSplitter,
    parse_event,
)

CHAT_CHUNK = (
    b'data: {"id":"chatcmpl-8f2a","object":"chat.completion.chunk","created":1718000000,'
    b'"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,'
    b'"delta":{"content":" world"},"logprobs":null,"finish_reason":null}]}\n\n'
)


def feed_all(splitter: SseSplitter, chunks: list[bytes]) -> list[SseEvent]:
    return [event for chunk in chunks for event in splitter.feed(chunk)]


def test_one_whole_event_per_chunk() -> None:
    splitter = SseSplitter()
    [event] = splitter.feed(CHAT_CHUNK)
    assert event.raw == CHAT_CHUNK
    assert event.data == CHAT_CHUNK[len(b"data: ") : -2]
    assert event.name is None
    assert splitter.tail() == b""


def test_several_events_in_one_chunk_come_out_in_order() -> None:
    events = SseSplitter().feed(b"data: 1\n\ndata: 2\r\n\r\nevent: done\ndata: [DONE]\n\n")
    assert [e.raw for e in events] == [
        b"data: 1\n\n",
        b"data: 2\r\n\r\n",
        b"event: done\ndata: [DONE]\n\n",
    ]
    assert [e.data for e in events] == [b"1", b"2", b"[DONE]"]
    assert [e.name for e in events] == [None, None, "done"]


def test_an_event_split_at_every_point_comes_out_whole() -> None:
    stream = CHAT_CHUNK + b"data: next\r\n\r\n"
    for cut in range(len(stream) + 1):
        splitter = SseSplitter()
        events = feed_all(splitter, [stream[:cut], stream[cut:]])
        assert [e.raw for e in events] == [CHAT_CHUNK, b"data: next\r\n\r\n"], cut
        assert splitter.tail() == b""


def test_a_stream_fed_byte_by_byte() -> None:
    stream = b"event: a\ndata: x\n\n: keep-alive\n\ndata: y\r\n\r\ndata: z"
    splitter = SseSplitter()
    events = feed_all(splitter, [stream[i : i + 1] for i in range(len(stream))])
    assert [e.data for e in events] == [b"x", None, b"y"]
    assert splitter.tail() == b"data: z"
    assert b"".join(e.raw for e in events) + splitter.tail() == stream


@pytest.mark.parametrize(
    "end",
    [b"\n\n", b"\r\n\r\n", b"\r\n\n", b"\n\r\n"],
    ids=["lf", "crlf", "crlf-then-lf", "lf-then-crlf"],
)
def test_a_blank_line_ends_an_event_in_every_spelling(end: bytes) -> None:
    splitter = SseSplitter()
    [event] = splitter.feed(b"data: a" + end + b"data: b")
    assert event.raw == b"data: a" + end
    assert event.data == b"a"
    assert splitter.tail() == b"data: b"


@pytest.mark.parametrize(
    ("raw", "data"),
    [
        (b"data: x\n\n", b"x"),
        (b"data:x\n\n", b"x"),
        (b"data:  x\n\n", b" x"),
        (b"data:\n\n", b""),
        (b"data: \n\n", b""),
        (b"data: x\r\n\r\n", b"x"),
        (b"data: x\r\n\n", b"x"),
        (b"data: x\n\r\n", b"x"),
        (b"data: a\rb\n\n", b"a\rb"),
        (b"data: x\r\r\n\n", b"x\r"),
        (b"data\n\n", b""),
        (b"datum: x\n\n", None),
        (b"event: x\n\n", None),
        (b": data: x\n\n", None),
        (b"\n\n", None),
        (b"\r\n\r\n", None),
    ],
)
def test_a_chunk_that_is_one_line_and_its_blank_line(raw: bytes, data: bytes | None) -> None:
    """The cheap path for the usual chunk gives what the general parser gives."""
    splitter = SseSplitter()
    assert splitter.feed(raw) == [parse_event(raw)]
    assert parse_event(raw).data == data
    assert splitter.tail() == b""


@pytest.mark.parametrize("raw", [b"", b"x", b"\n", b"da", b"data: x\n", b"data: x\r\n\r"])
def test_a_chunk_without_a_whole_event_is_kept(raw: bytes) -> None:
    splitter = SseSplitter()
    assert splitter.feed(raw) == []
    assert splitter.tail() == raw


def test_a_lone_carriage_return_is_not_a_line_end() -> None:
    splitter = SseSplitter()
    assert splitter.feed(b"data: a\r\rdata: b\n") == []
    [event] = splitter.feed(b"\n")
    assert event.data == b"a\r\rdata: b"


def test_data_lines_are_joined_and_one_space_is_dropped() -> None:
    event = parse_event(b"data: first\ndata:second\ndata:  third\ndata\ndata: \n\n")
    assert event.data == b"first\nsecond\n third\n\n"


def test_the_first_event_name_is_kept() -> None:
    event = parse_event(b"event: response.created\nevent: other\ndata: {}\n\n")
    assert event.name == "response.created"
    assert parse_event(b"event:delta\r\ndata: x\r\n\r\n").name == "delta"


def test_comments_and_unknown_fields_are_not_data() -> None:
    event = parse_event(b": ping\nid: 7\nretry: 100\n:data: no\n\n")
    assert event == SseEvent(b": ping\nid: 7\nretry: 100\n:data: no\n\n", None, None)
    with_data = parse_event(b": comment\ndata: yes\n: another\n\n")
    assert with_data.data == b"yes"


def test_an_empty_data_line_is_data() -> None:
    assert parse_event(b"data:\n\n").data == b""
    assert parse_event(b"event: x\n\n").data is None


def test_extra_blank_lines_make_empty_events() -> None:
    stream = b"data: a\n\n\n\ndata: b\n\n"
    events = SseSplitter().feed(stream)
    assert [e.raw for e in events] == [b"data: a\n\n", b"\n\n", b"data: b\n\n"]
    assert [e.data for e in events] == [b"a", None, b"b"]


def test_the_tail_is_the_unterminated_event() -> None:
    splitter = SseSplitter()
    assert splitter.feed(b"data: a\n\ndata: par") == [parse_event(b"data: a\n\n")]
    assert splitter.tail() == b"data: par"
    assert splitter.feed(b"tial\n") == []
    assert splitter.tail() == b"data: partial\n"
    [event] = splitter.feed(b"\n")
    assert event.data == b"partial"
    assert splitter.tail() == b""


def test_an_event_at_the_bound_is_accepted() -> None:
    event = b"data: " + b"x" * 2 + b"\n\n"  # 10 bytes
    assert SseSplitter(max_event_bytes=10).feed(event)[0].raw == event
    splitter = SseSplitter(max_event_bytes=10)
    assert splitter.feed(event[:9]) == []
    assert splitter.feed(event[9:])[0].raw == event


def test_a_whole_event_past_the_bound_raises() -> None:
    with pytest.raises(SseEventTooLarge) as caught:
        SseSplitter(max_event_bytes=10).feed(b"data: xyz\n\n")
    assert caught.value.size == 11
    assert caught.value.limit == 10
    assert isinstance(caught.value, ValueError)


def test_a_pending_event_past_the_bound_raises_before_it_ends() -> None:
    splitter = SseSplitter(max_event_bytes=16)
    assert splitter.feed(b"data: 0123456") == []
    with pytest.raises(SseEventTooLarge):
        splitter.feed(b"789a")  # 17 bytes pending, no end in sight
    # Past the bound the stream's boundaries are lost: every later chunk is refused.
    with pytest.raises(SseEventTooLarge):
        splitter.feed(b"\n\ndata: ok\n\n")
    # At the bound while pending, past it once its blank line comes.
    ending = SseSplitter(max_event_bytes=16)
    assert ending.feed(b"data: 0123456789") == []
    with pytest.raises(SseEventTooLarge) as caught:
        ending.feed(b"\n\ndata: ok\n\n")
    assert caught.value.size == 18


def test_the_events_before_an_oversized_one_travel_with_the_error() -> None:
    splitter = SseSplitter(max_event_bytes=16)
    with pytest.raises(SseEventTooLarge) as caught:
        splitter.feed(b"data: a\n\ndata: b\n\ndata: " + b"x" * 20)
    assert [e.data for e in caught.value.events] == [b"a", b"b"]
    middle = SseSplitter(max_event_bytes=16)
    with pytest.raises(SseEventTooLarge) as caught:
        middle.feed(b"data: a\n\ndata: " + b"x" * 20 + b"\n\ndata: b\n\n")
    assert [e.data for e in caught.value.events] == [b"a"]
    pending = SseSplitter(max_event_bytes=16)
    pending.feed(b"data: a")
    with pytest.raises(SseEventTooLarge) as caught:
        pending.feed(b"\n\ndata: " + b"y" * 20 + b"\n\n")
    assert [e.data for e in caught.value.events] == [b"a"]


def test_the_default_bound_is_one_mebibyte() -> None:
    assert MAX_SSE_EVENT_BYTES == 1024 * 1024
    big = b"data: " + b"x" * (MAX_SSE_EVENT_BYTES - 8) + b"\n\n"
    splitter = SseSplitter()
    chunks = [big[i : i + 65536] for i in range(0, len(big), 65536)]
    [event] = feed_all(splitter, chunks)
    assert len(event.raw) == MAX_SSE_EVENT_BYTES
    with pytest.raises(SseEventTooLarge):
        SseSplitter().feed(b"data: " + b"x" * MAX_SSE_EVENT_BYTES)


def test_a_bound_too_small_for_any_event_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        SseSplitter(max_event_bytes=1)


def reference_events(stream: bytes) -> tuple[list[bytes], bytes]:
    """The events of a whole stream, found one byte at a time: a line feed followed by a line
    feed, or by a carriage return and a line feed, ends an event."""
    raws: list[bytes] = []
    start = 0
    i = 0
    while i < len(stream):
        if stream[i : i + 1] == b"\n":
            if stream[i + 1 : i + 2] == b"\n":
                end = i + 2
            elif stream[i + 1 : i + 3] == b"\r\n":
                end = i + 3
            else:
                end = 0
            if end:
                raws.append(stream[start:end])
                start = i = end
                continue
        i += 1
    return raws, stream[start:]


LINES = st.sampled_from(
    [b"data: x", b"data:y", b"data", b"event: e", b": c", b"", b"id: 1", b"data: \xe2\x82"]
)
ENDS = st.sampled_from([b"\n", b"\r\n", b"\r"])
STREAMS = st.lists(st.tuples(LINES, ENDS).map(b"".join), max_size=24).map(b"".join)


def chunked(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(stream)) for c in cuts})
    return [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]


@settings(max_examples=400, deadline=None)
@given(stream=STREAMS, cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_chunking_yields_the_same_events_and_the_same_bytes(
    stream: bytes, cuts: list[int]
) -> None:
    splitter = SseSplitter()
    events = feed_all(splitter, chunked(stream, cuts))
    raws, tail = reference_events(stream)
    assert [e.raw for e in events] == raws
    assert splitter.tail() == tail
    assert b"".join(e.raw for e in events) + splitter.tail() == stream
    assert events == [parse_event(raw) for raw in raws]


@settings(max_examples=200, deadline=None)
@given(stream=STREAMS, cuts=st.lists(st.integers(0, 200), max_size=12))
def test_the_bound_raises_for_any_chunking_exactly_when_an_event_passes_it(
    stream: bytes, cuts: list[int]
) -> None:
    limit = 16
    raws, tail = reference_events(stream)
    too_large = any(len(raw) > limit for raw in raws) or len(tail) > limit
    splitter = SseSplitter(max_event_bytes=limit)
    seen: list[SseEvent] = []
    try:
        for chunk in chunked(stream, cuts):
            seen += splitter.feed(chunk)
    except SseEventTooLarge as exc:
        seen += exc.events
        assert too_large
        # Every event before the oversized one was handed over, and no other.
        first_bad = next((i for i, raw in enumerate(raws) if len(raw) > limit), len(raws))
        assert [e.raw for e in seen] == raws[:first_bad]
    else:
        assert not too_large
        assert [e.raw for e in seen] == raws
