"""Counting a request's output tokens from what the engine streams back, as the Rust Pylon does.

The Pylon's output rates are output tokens over time, and the engine rarely says how many tokens
it has produced: vLLM and OpenAI put a `usage` in stream chunks only when the client asked for it
(`stream_options`), and the Pylon does not add that to requests. So the count has two sources:

* **an explicit cumulative counter**, when a chunk carries one: `usage.completion_tokens` (chat
  and completions chunks), else a top-level `output_tokens_so_far`, else
  `response.usage.output_tokens` (the Responses API's `response.completed`). Only non-negative
  integers count (a bool is not one). The first such counter replaces whatever was estimated
  before it (the engine's count is the truth, and the word rule often overshoots it) and makes
  the count explicit for good: from then on it only follows the counters, never moving back when
  one regresses (a cumulative count that went down would read as negative throughput), and text
  estimates stop, since the counter already covers that text;
* **an estimate from the text**, until then: each event adds, over its
  `choices[].delta.content` (or the Responses API's top-level string `delta`), the number of
  whitespace-separated words, or the number of characters when the text has no whitespace at
  all (a run of CJK text, or one token such as `"Hello"`); empty and whitespace-only text adds
  nothing. Beyond the Rust parser, which reads only chat and Responses streams, a
  `/v1/completions` stream's `choices[].text` counts the same way.

Which events are output matters as much as their tokens: the first output event ends the input
phase. Every data event is output except `[DONE]`, an empty one, and `response.created` (the
Responses API's announcement that precedes any output), whether named by its `event:` line or by
its JSON `type`. Data that is not JSON is still output (the engine produced something); it just
counts no tokens.
"""

from __future__ import annotations

from typing import Any

import orjson

from stargate.pylon.stats.sse import SseEvent

__all__ = ["OutputTokenParser", "estimate_tokens", "explicit_counter"]

_U64_MAX = 2**64 - 1
_RESPONSE_CREATED = "response.created"


def estimate_tokens(text: str) -> int:
    """Tokens in `text` by the word rule: its whitespace-separated words, or its characters when it
    has no whitespace; 0 for empty or whitespace-only text."""
    words = text.split()
    if len(words) == 1 and len(words[0]) == len(text):
        return len(text)
    return len(words)


def _counter(value: object) -> int | None:
    """`value` as a token counter: a non-negative integer a u64 holds (a bool is not one)."""
    if type(value) is int and 0 <= value <= _U64_MAX:
        return value
    return None


def _member(obj: object, key: str) -> object:
    return obj.get(key) if isinstance(obj, dict) else None


def explicit_counter(obj: object) -> int | None:
    """The cumulative output-token counter `obj` carries, if any, by the streaming precedence.

    Written for the usual chunk, which has none: each source is one dict lookup that finds
    nothing (or a null `usage`)."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if usage is not None:
        found = _counter(_member(usage, "completion_tokens"))
        if found is not None:
            return found
    so_far = obj.get("output_tokens_so_far")
    if so_far is not None:
        found = _counter(so_far)
        if found is not None:
            return found
    response = obj.get("response")
    if response is not None:
        return _counter(_member(_member(response, "usage"), "output_tokens"))
    return None


def _estimate_chunk(obj: dict[str, Any]) -> int:
    """The text estimate of one streamed chunk."""
    total = 0
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                content = delta.get("content")
                if isinstance(content, str):
                    total += estimate_tokens(content)
            text = choice.get("text")
            if isinstance(text, str):
                total += estimate_tokens(text)
    top_delta = obj.get("delta")
    if isinstance(top_delta, str):
        total += estimate_tokens(top_delta)
    return total


def _estimate_body(obj: dict[str, Any]) -> int:
    """The text estimate of a whole (non-streamed) answer."""
    total = 0
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            content = _member(choice.get("message"), "content")
            if isinstance(content, str):
                total += estimate_tokens(content)
            text = choice.get("text")
            if isinstance(text, str):
                total += estimate_tokens(text)
    output = obj.get("output")
    if isinstance(output, list):
        for item in output:
            parts = _member(item, "content")
            if not isinstance(parts, list):
                continue
            for part in parts:
                text = _member(part, "text")
                if isinstance(text, str):
                    total += estimate_tokens(text)
    return total


def _loads(data: bytes) -> object:
    """`data` as JSON, or None when it is not JSON (bad syntax, bad UTF-8, absurd nesting, a
    number JSON cannot carry such as NaN or an integer past 64 bits).

    orjson, not the standard library: this runs for every event of every stream the Pylon
    relays, and it is three to four times cheaper (docs/performance.md, "The Pylon hop")."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


class OutputTokenParser:
    """One request's output-token count, fed its stream's events (or its whole body).

    `tokens` is the cumulative count so far. It never decreases but once: when the first
    explicit counter replaces a larger text estimate. `explicit` is True once a stream chunk
    carried an explicit counter (what labels the request's stats as coming from chunk usage).
    """

    __slots__ = ("explicit", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.explicit = False

    def observe_event(self, event: SseEvent) -> bool:
        """Count `event`'s tokens; True iff it is an output event (see the module docstring)."""
        data = event.data
        if data is None or event.name == _RESPONSE_CREATED:
            return False
        stripped = data.strip()
        if not stripped or stripped == b"[DONE]":
            return False
        obj = _loads(stripped)
        if isinstance(obj, dict):
            if obj.get("type") == _RESPONSE_CREATED:
                return False
            self.observe_json(obj)
        return True

    def observe_json(self, obj: object) -> None:
        """Apply one streamed chunk's JSON to the count: its explicit counter, else (while no
        counter has been seen) its text estimate."""
        counter = explicit_counter(obj)
        if counter is not None:
            if counter > self.tokens or not self.explicit:
                self.tokens = counter
            self.explicit = True
        elif not self.explicit and isinstance(obj, dict):
            self.tokens += _estimate_chunk(obj)

    def observe_body(self, body: bytes) -> int:
        """The output tokens of a non-streamed JSON answer (chat, completions or responses).

        Its `usage.completion_tokens`, else `usage.output_tokens`, else the word-rule estimate of
        `choices[].message.content`, `choices[].text` and the Responses API's
        `output[].content[].text`; 0 for a body that is not a JSON object. `tokens` is set to
        it (the body is the whole answer). `explicit` is left alone: it names counters read from
        stream chunks, and a whole answer's usage must not claim that label.
        """
        obj = _loads(body)
        if not isinstance(obj, dict):
            self.tokens = 0
            return 0
        usage = obj.get("usage")
        found = _counter(_member(usage, "completion_tokens"))
        if found is None:
            found = _counter(_member(usage, "output_tokens"))
        if found is None:
            found = _estimate_body(obj)
        self.tokens = found
        return found
