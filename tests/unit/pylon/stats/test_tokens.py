"""Output-token counting: which events are output, explicit counters against text estimates, and
whole (non-streamed) answers. The first five tests carry the Rust parser's test names."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stargate.pylon.stats.sse import SseEvent, SseSplitter, parse_event
from stargate.pylon.stats.tokens import OutputTokenParser, estimate_tokens, explicit_counter

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def sse(obj: object, name: str | None = None) -> SseEvent:
    head = f"event: {name}\n" if name else ""
    return parse_event(f"{head}data: {json.dumps(obj)}\n\n".encode())


def chat_chunk(
    content: str | None, chunk_usage: dict[str, int] | None = None, **extra: object
) -> SseEvent:
    """A vLLM chat.completion.chunk as vLLM streams it."""
    delta: dict[str, object] = {} if content is None else {"content": content}
    obj: dict[str, object] = {
        "id": "chatcmpl-3b1f0c9e",
        "object": "chat.completion.chunk",
        "created": 1718000000,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
        **extra,
    }
    if chunk_usage is not None:
        obj["usage"] = chunk_usage
    return sse(obj)


def usage(completion: int, prompt: int = 12) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


DONE = parse_event(b"data: [DONE]\n\n")


def test_vllm_parser_tracks_continuous_usage_deltas() -> None:
    # stream_options {"include_usage": true, "continuous_usage_stats": true}: every chunk carries
    # the cumulative usage, the role chunk included.
    parser = OutputTokenParser()
    role = sse(
        {
            "id": "chatcmpl-3b1f0c9e",
            "object": "chat.completion.chunk",
            "created": 1718000000,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "usage": usage(0),
        }
    )
    seen = []
    for event in [
        role,
        chat_chunk("Hello", usage(1)),
        chat_chunk(" there", usage(2)),
        chat_chunk(", friend", usage(4)),
        chat_chunk("!", usage(5)),
    ]:
        assert parser.observe_event(event)
        seen.append(parser.tokens)
    assert seen == [0, 1, 2, 4, 5]
    assert parser.explicit
    final = sse(
        {
            "id": "chatcmpl-3b1f0c9e",
            "object": "chat.completion.chunk",
            "created": 1718000000,
            "model": MODEL,
            "choices": [],
            "usage": usage(5),
        }
    )
    assert parser.observe_event(final)
    assert not parser.observe_event(DONE)
    assert parser.tokens == 5


def test_parser_reads_terminal_usage_chunk() -> None:
    # stream_options {"include_usage": true}: chunks carry "usage": null, the last one the total.
    parser = OutputTokenParser()
    for content in ["Hello", " world", ", how", " are", " you?"]:
        assert parser.observe_event(chat_chunk(content, None, usage=None))
    assert parser.tokens == 5 + 1 + 2 + 1 + 1  # "Hello" has no whitespace: its characters
    assert not parser.explicit
    terminal = sse(
        {
            "id": "chatcmpl-3b1f0c9e",
            "object": "chat.completion.chunk",
            "created": 1718000000,
            "model": MODEL,
            "choices": [],
            "usage": usage(7, prompt=20),
        }
    )
    assert parser.observe_event(terminal)
    assert parser.explicit
    assert parser.tokens == 7  # the engine's count replaces the estimate
    assert not parser.observe_event(DONE)
    assert parser.tokens == 7


def responses_event(kind: str, **fields: object) -> SseEvent:
    return sse({"type": kind, "sequence_number": 0, **fields}, name=kind)


def response_object(status: str, usage: object) -> dict[str, object]:
    return {
        "id": "resp_67ccd2bed1ec8190",
        "object": "response",
        "created_at": 1741476542,
        "status": status,
        "model": MODEL,
        "output": [],
        "usage": usage,
    }


def test_parser_reads_responses_delta_and_terminal_usage() -> None:
    parser = OutputTokenParser()
    created = responses_event("response.created", response=response_object("in_progress", None))
    assert not parser.observe_event(created)
    item = {"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant"}
    assert parser.observe_event(
        responses_event("response.in_progress", response=response_object("in_progress", None))
    )
    assert parser.observe_event(
        responses_event("response.output_item.added", output_index=0, item=item)
    )
    assert parser.tokens == 0
    for delta in ["Hi", " there", " friend"]:
        assert parser.observe_event(
            responses_event(
                "response.output_text.delta",
                item_id="msg_1",
                output_index=0,
                content_index=0,
                delta=delta,
            )
        )
    assert parser.tokens == 2 + 1 + 1
    # The done event repeats the whole text under `text`: not counted again.
    assert parser.observe_event(
        responses_event(
            "response.output_text.done",
            item_id="msg_1",
            output_index=0,
            content_index=0,
            text="Hi there friend",
        )
    )
    assert parser.tokens == 4
    assert not parser.explicit
    completed = response_object(
        "completed",
        {
            "input_tokens": 11,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 3,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 14,
        },
    )
    assert parser.observe_event(responses_event("response.completed", response=completed))
    assert parser.explicit
    assert parser.tokens == 3


def test_explicit_counter_disables_later_text_estimates() -> None:
    parser = OutputTokenParser()
    parser.observe_json({"output_tokens_so_far": 2, "choices": [{"delta": {"content": "a b c"}}]})
    assert parser.tokens == 2
    assert parser.explicit
    parser.observe_json({"choices": [{"delta": {"content": "one two three four"}}]})
    parser.observe_json({"delta": "more words here"})
    assert parser.tokens == 2
    parser.observe_json({"output_tokens_so_far": 9})
    assert parser.tokens == 9


def test_parser_never_subtracts_when_cumulative_usage_regresses() -> None:
    parser = OutputTokenParser()
    parser.observe_event(chat_chunk("x", usage(5)))
    parser.observe_event(chat_chunk("y", usage(3)))
    assert parser.tokens == 5
    parser.observe_event(chat_chunk("z", usage(0)))
    assert parser.tokens == 5
    parser.observe_event(chat_chunk("w", usage(8)))
    assert parser.tokens == 8


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("", 0),
        ("   ", 0),
        ("\n\t", 0),
        ("Hello", 5),
        (" world", 1),
        ("Hello world", 2),
        ("a  b\tc\nd ", 4),
        ("你好世界", 4),
        ("你好 世界", 2),
        ("😀", 1),  # characters, not bytes
    ],
)
def test_the_word_rule(text: str, tokens: int) -> None:
    assert estimate_tokens(text) == tokens


@pytest.mark.parametrize(
    "raw",
    [
        b"data: [DONE]\n\n",
        b"data:[DONE]\r\n\r\n",
        b"data: \n\n",
        b"data:\n\n",
        b": keep-alive\n\n",
        b"event: ping\n\n",
        b"\n\n",
        b'event: response.created\ndata: {"type":"other"}\n\n',
        b'data: {"type":"response.created","response":{"usage":null}}\n\n',
    ],
)
def test_events_that_are_not_output(raw: bytes) -> None:
    parser = OutputTokenParser()
    assert not parser.observe_event(parse_event(raw))
    assert parser.tokens == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"data: not json\n\n",
        b'data: {"choices": [\n\n',
        b"data: \xff\xfe\n\n",
        b"data: " + b"[" * 100_000 + b"\n\n",  # nesting json refuses
        b"data: 42\n\n",
        b'data: ["Hello world"]\n\n',
        b'data: {"type":"response.in_progress"}\n\n',
    ],
)
def test_any_other_data_is_output_counting_nothing_unless_it_says(raw: bytes) -> None:
    parser = OutputTokenParser()
    assert parser.observe_event(parse_event(raw))
    assert parser.tokens == 0
    assert not parser.explicit


def test_completions_stream_text_counts_like_delta_content() -> None:
    parser = OutputTokenParser()
    for text in ["Once", " upon a", " time"]:
        chunk = {
            "id": "cmpl-9a8b",
            "object": "text_completion",
            "created": 1718000000,
            "model": MODEL,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
        }
        assert parser.observe_event(sse(chunk))
    assert parser.tokens == 4 + 2 + 1


def test_every_choice_counts() -> None:
    parser = OutputTokenParser()
    parser.observe_json(
        {
            "choices": [
                {"index": 0, "delta": {"content": "a b"}},
                {"index": 1, "delta": {"content": "c"}},
            ]
        }
    )
    assert parser.tokens == 3


@pytest.mark.parametrize(
    "chunk",
    [
        {"choices": [{"delta": {"content": None}}]},
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": ["a", "b"]}}]},
        {"choices": [{"delta": "a b"}]},
        {"choices": {"delta": {"content": "a b"}}},
        {"choices": ["a b"]},
        {"delta": {"content": "a b"}},
        {"delta": 5},
        {"content": "a b"},
        {"choices": [{"delta": {"reasoning_content": "a b"}}]},
        {"choices": [{"message": {"content": "a b"}}]},
    ],
)
def test_text_outside_the_counted_fields_counts_nothing(chunk: dict[str, object]) -> None:
    parser = OutputTokenParser()
    parser.observe_json(chunk)
    assert parser.tokens == 0


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({"usage": {"completion_tokens": 4}}, 4),
        ({"usage": {"completion_tokens": 0}}, 0),
        ({"output_tokens_so_far": 6}, 6),
        ({"response": {"usage": {"output_tokens": 8}}}, 8),
        # Precedence, and an invalid counter falls through to the next.
        ({"usage": {"completion_tokens": 4}, "output_tokens_so_far": 6}, 4),
        ({"usage": {"completion_tokens": -1}, "output_tokens_so_far": 6}, 6),
        ({"usage": None, "response": {"usage": {"output_tokens": 8}}}, 8),
        ({"output_tokens_so_far": "6", "response": {"usage": {"output_tokens": 8}}}, 8),
        # Not counters.
        ({"usage": {"completion_tokens": True}}, None),
        ({"usage": {"completion_tokens": 4.0}}, None),
        ({"usage": {"completion_tokens": "4"}}, None),
        ({"usage": {"completion_tokens": 2**64}}, None),
        ({"usage": {"output_tokens": 4}}, None),  # a streamed chat chunk's usage says completion
        ({"response": {"usage": {"completion_tokens": 4}}}, None),
        ({"output_tokens_so_far": False}, None),
        ({"usage": [4]}, None),
        ([{"usage": {"completion_tokens": 4}}], None),
    ],
)
def test_explicit_counters(obj: object, expected: int | None) -> None:
    assert explicit_counter(obj) == expected
    parser = OutputTokenParser()
    parser.observe_json(obj)
    assert parser.explicit is (expected is not None)


def test_a_u64_counter_is_read() -> None:
    assert explicit_counter({"output_tokens_so_far": 2**64 - 1}) == 2**64 - 1


# Whole answers.


def chat_completion(content: object, usage_: object) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-3b1f0c9e",
            "object": "chat.completion",
            "created": 1718000000,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content, "tool_calls": []},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": usage_,
        }
    ).encode()


def responses_body(usage_: object) -> bytes:
    return json.dumps(
        {
            "id": "resp_67ccd2bed1ec8190",
            "object": "response",
            "status": "completed",
            "model": MODEL,
            "output": [
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "think about it"}],
                },
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "content": [
                        {"type": "output_text", "text": "The answer is 42.", "annotations": []}
                    ],
                },
            ],
            "usage": usage_,
        }
    ).encode()


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        (chat_completion("The answer is 42.", usage(9)), 9),
        (chat_completion("The answer is 42.", None), 4),
        (chat_completion("The answer is 42.", {"completion_tokens": -3}), 4),
        (chat_completion(None, {"prompt_tokens": 3}), 0),
        (responses_body({"input_tokens": 5, "output_tokens": 11, "total_tokens": 16}), 11),
        (responses_body(None), 3 + 4),  # every output item's content text
        (
            json.dumps(
                {
                    "id": "cmpl-9a8b",
                    "object": "text_completion",
                    "model": MODEL,
                    "choices": [
                        {"index": 0, "text": "Once upon a time", "finish_reason": "length"}
                    ],
                    "usage": None,
                }
            ).encode(),
            4,
        ),
        (b"", 0),
        (b"<html>502 Bad Gateway</html>", 0),
        (b"[1, 2]", 0),
        (b'"just a string"', 0),
    ],
)
def test_observe_body(body: bytes, tokens: int) -> None:
    parser = OutputTokenParser()
    assert parser.observe_body(body) == tokens
    assert parser.tokens == tokens
    assert not parser.explicit  # a whole answer's usage is not chunk usage


def test_a_body_prefers_completion_tokens_to_output_tokens() -> None:
    body = json.dumps({"usage": {"completion_tokens": 3, "output_tokens": 5}}).encode()
    assert OutputTokenParser().observe_body(body) == 3


def test_a_stream_split_then_parsed() -> None:
    """The splitter and the parser together, on a stream cut in awkward places."""
    stream = b"".join(
        [
            chat_chunk("", None).raw,
            chat_chunk("Hello", None).raw,
            b": keep-alive\n\n",
            chat_chunk(" world", None).raw.replace(b"\n\n", b"\r\n\r\n"),
            chat_chunk(None, usage(2)).raw,
            DONE.raw,
        ]
    )
    splitter = SseSplitter()
    parser = OutputTokenParser()
    outputs = 0
    for start in range(0, len(stream), 7):
        for event in splitter.feed(stream[start : start + 7]):
            outputs += parser.observe_event(event)
    assert outputs == 4  # every chat chunk, not the comment nor [DONE]
    assert parser.tokens == 2
    assert parser.explicit


# Property: a model of the rules on any sequence of chunks.
TEXTS = st.sampled_from(["", " ", "Hello", " world", "a b c", "你好", "x\ny"])
COUNTERS = st.integers(0, 50)
CHUNKS = st.one_of(
    TEXTS.map(lambda t: ("text", t)),
    COUNTERS.map(lambda n: ("usage", n)),
    COUNTERS.map(lambda n: ("so_far", n)),
    COUNTERS.map(lambda n: ("response", n)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(CHUNKS, max_size=20))
def test_the_count_follows_the_rules_for_any_sequence(chunks: list[tuple[str, object]]) -> None:
    parser = OutputTokenParser()
    estimate = 0
    counters: list[int] = []
    for kind, value in chunks:
        if kind == "text":
            assert isinstance(value, str)
            parser.observe_json({"choices": [{"delta": {"content": value}}]})
            estimate += estimate_tokens(value)
        else:
            assert isinstance(value, int)
            obj = {
                "usage": {"usage": {"completion_tokens": value}},
                "so_far": {"output_tokens_so_far": value},
                "response": {"response": {"usage": {"output_tokens": value}}},
            }[kind]
            parser.observe_json(obj)
            counters.append(value)
        # Before any counter, the sum of the estimates; after, the largest counter so far.
        assert parser.explicit is bool(counters)
        assert parser.tokens == (max(counters) if counters else estimate)
