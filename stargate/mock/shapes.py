"""Pure helpers for the mock backend: OpenAI payload shapes, SSE framing and token accounting.

Nothing here does I/O or reads a clock; callers pass ids and timestamps in, so every shape is
easy to test on its own.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

__all__ = [
    "SSE_DONE",
    "TOKENS",
    "RequestError",
    "answer_text",
    "chat_cache_text",
    "chat_chunk",
    "chat_completion",
    "chat_prompt_text",
    "chat_usage_chunk",
    "completion",
    "completion_cache_text",
    "completion_chunk",
    "completion_usage_chunk",
    "context_too_long",
    "dumps",
    "embedding_inputs",
    "embedding_vector",
    "embeddings_response",
    "error_body",
    "estimate_tokens",
    "header_token_count",
    "max_tokens_field",
    "models_list",
    "prompt_text",
    "response_object",
    "responses_cache_text",
    "responses_input_text",
    "sse_data",
    "sse_event",
    "token_text",
    "usage",
]

# The answer every request gets, one entry per token, cycled when more tokens are wanted.
TOKENS: tuple[str, ...] = (
    "Hello",
    ",",
    " how",
    " can",
    " I",
    " help",
    " you",
    " today",
    "?",
    " This",
    " is",
    " a",
    " mock",
    " response",
    " from",
    " the",
    " stargate",
    " mock",
    " backend",
    ",",
    " streaming",
    " one",
    " token",
    " at",
    " a",
    " time",
    " for",
    " your",
    " tests",
    ".",
)

SSE_DONE = b"data: [DONE]\n\n"


class RequestError(ValueError):
    """A request the mock refuses with 400 and an OpenAI-style `invalid_request_error`; `code`
    goes in the error object's `code` (OpenAI's, e.g. `context_length_exceeded`)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


def context_too_long(capacity: int, prompt_tokens: int, output_tokens: int) -> RequestError:
    """The 400 of a request whose KV reservation exceeds the whole KV cache (vLLM's wording, so
    a client that recognises "maximum context length" recognises this too)."""
    total = prompt_tokens + output_tokens
    message = (
        f"This model's maximum context length is {capacity} tokens (the size of the mock's KV "
        f"cache). However, you requested {total} tokens ({prompt_tokens} in the prompt, "
        f"{output_tokens} in the completion): the prompt is too long for the KV cache. Please "
        "reduce the length of the prompt or the completion."
    )
    return RequestError(message, "context_length_exceeded")


def dumps(payload: Any) -> bytes:
    """Compact JSON bytes."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def sse_data(payload: Any) -> bytes:
    """One SSE event carrying `payload` as JSON (the chat/completions framing)."""
    return b"data: " + dumps(payload) + b"\n\n"


def sse_event(event: str, payload: Any) -> bytes:
    """One named SSE event (the Responses API framing: `event:` line, then `data:`)."""
    return b"event: " + event.encode() + b"\ndata: " + dumps(payload) + b"\n\n"


def error_body(
    message: str, error_type: str = "invalid_request_error", code: str | int | None = None
) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def token_text(index: int) -> str:
    """The text of answer token `index` (0-based)."""
    return TOKENS[index % len(TOKENS)]


def answer_text(tokens: int) -> str:
    """The whole answer of `tokens` tokens."""
    return "".join(token_text(index) for index in range(tokens))


def estimate_tokens(text: str) -> int:
    """A rough token count for `text` (four characters a token, at least 1)."""
    return max(1, (len(text) + 3) // 4)


def header_token_count(value: bytes | None) -> int | None:
    """`x-input-tokens` as a positive integer, or None when absent or malformed."""
    if value is None:
        return None
    try:
        number = int(value.strip())
    except ValueError:
        return None
    return number if number > 0 else None


def max_tokens_field(body: dict[str, Any], *names: str) -> int | None:
    """The first of `names` present in `body` as a positive integer (None when none is present)."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(f"'{name}' must be a positive integer")
        return value
    return None


def _content_text(content: Any) -> str:
    """Text of a message `content`: a string, or a list of parts with `text` fields."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def chat_prompt_text(body: dict[str, Any]) -> str:
    """The concatenated message contents of a chat request (400 without a `messages` list)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array")
    return "".join(
        _content_text(message.get("content")) for message in messages if isinstance(message, dict)
    )


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt of a completions request: a string or a list of strings (token ids count 1)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        return "".join(item if isinstance(item, str) else "x" for item in prompt)
    raise RequestError("'prompt' must be a string or a non-empty array")


def responses_input_text(body: dict[str, Any]) -> str:
    """The input of a Responses API request: a string or a list of input items."""
    value = body.get("input")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(
            _content_text(item.get("content")) for item in value if isinstance(item, dict)
        )
    raise RequestError("'input' must be a string or an array")


# The prompt text the prefix-cache model sees (stargate/mock/prefix_cache.py). Chat messages and
# Responses input items are framed as `role NUL content NUL` each, in order, a chat template of
# sorts: the text of a conversation starts with the text of its earlier turns, and message
# boundaries are part of it. A NUL or \x01 inside a role or a content (JSON can encode them,
# prompts hardly ever hold them) is escaped as \x01\x02 or \x01\x01, so the framing is
# unambiguous.
_SEPARATOR = "\x00"


def _framed(role: Any, content: Any) -> str:
    parts = []
    for text in (role if isinstance(role, str) else "", _content_text(content)):
        if "\x00" in text or "\x01" in text:
            text = text.replace("\x01", "\x01\x01").replace("\x00", "\x01\x02")
        parts.append(text)
    return parts[0] + _SEPARATOR + parts[1] + _SEPARATOR


def chat_cache_text(body: dict[str, Any]) -> str:
    """The prefix-cache text of a chat request: each message's role and content, framed."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    return "".join(
        _framed(message.get("role"), message.get("content"))
        for message in messages
        if isinstance(message, dict)
    )


def completion_cache_text(body: dict[str, Any]) -> str:
    """The prefix-cache text of a completions request: the prompt string, or the items of a
    prompt array (strings as they are, token ids as compact JSON) joined by NUL."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return _SEPARATOR.join(
            item if isinstance(item, str) else dumps(item).decode() for item in prompt
        )
    return ""


def responses_cache_text(body: dict[str, Any]) -> str:
    """The prefix-cache text of a Responses API request: `instructions` as a system message,
    then the input (a string as one user message, or the items' roles and contents), framed."""
    instructions = body.get("instructions")
    text = _framed("system", instructions) if isinstance(instructions, str) else ""
    value = body.get("input")
    if isinstance(value, str):
        return text + _framed("user", value)
    if isinstance(value, list):
        text += "".join(
            _framed(item.get("role"), item.get("content"))
            for item in value
            if isinstance(item, dict)
        )
    return text


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """Chat and completions `usage`."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_completion(
    response_id: str, created: int, model: str, text: str, prompt_tokens: int, tokens: int
) -> dict[str, Any]:
    """A non-streaming `chat.completion`."""
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": usage(prompt_tokens, tokens),
    }


def chat_chunk(
    response_id: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    *,
    include_usage: bool = False,
    usage_so_far: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`: with `usage: null` when the client asked for usage, or the
    usage so far (vLLM's `continuous_usage_stats`) when `usage_so_far` is given."""
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage_so_far is not None:
        chunk["usage"] = usage_so_far
    elif include_usage:
        chunk["usage"] = None
    return chunk


def chat_usage_chunk(
    response_id: str, created: int, model: str, prompt_tokens: int, tokens: int
) -> dict[str, Any]:
    """The final chunk of a stream with `stream_options.include_usage`: no choices, usage."""
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, tokens),
    }


def completion(
    response_id: str, created: int, model: str, text: str, prompt_tokens: int, tokens: int
) -> dict[str, Any]:
    """A non-streaming `text_completion`."""
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}],
        "usage": usage(prompt_tokens, tokens),
    }


def completion_chunk(
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None = None,
    *,
    include_usage: bool = False,
    usage_so_far: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One streamed `text_completion` chunk (`usage` as in `chat_chunk`)."""
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage_so_far is not None:
        chunk["usage"] = usage_so_far
    elif include_usage:
        chunk["usage"] = None
    return chunk


def completion_usage_chunk(
    response_id: str, created: int, model: str, prompt_tokens: int, tokens: int
) -> dict[str, Any]:
    """The final usage chunk of a completions stream with `stream_options.include_usage`."""
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, tokens),
    }


def response_object(
    response_id: str,
    message_id: str,
    created: int,
    model: str,
    *,
    status: str,
    text: str,
    input_tokens: int,
    output_tokens: int,
) -> dict[str, Any]:
    """A Responses API `response`; in progress it has no output and no usage yet."""
    completed = status == "completed"
    output: list[dict[str, Any]] = []
    if completed:
        output.append(
            {
                "type": "message",
                "id": message_id,
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        )
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "temperature": 1.0,
        "top_p": 1.0,
        "usage": (
            {
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input_tokens + output_tokens,
            }
            if completed
            else None
        ),
    }


def embedding_inputs(value: Any) -> list[int]:
    """Token counts of each embeddings input: a string, a list of strings, token ids, or a list
    of token-id lists (400 for anything else, or for an empty list)."""
    if isinstance(value, str):
        return [estimate_tokens(value)]
    if isinstance(value, list) and value:
        if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            return [len(value)]
        counts = []
        for item in value:
            if isinstance(item, str):
                counts.append(estimate_tokens(item))
            elif isinstance(item, list) and item:
                counts.append(len(item))
            else:
                raise RequestError("'input' items must be strings or non-empty token arrays")
        return counts
    raise RequestError("'input' must be a string or a non-empty array")


def embedding_vector(index: int, dimensions: int = 3) -> list[float]:
    """The deterministic vector of input `index`: `[i, i+0.125, -(i+0.25), i+0.375, ...]`."""
    return [
        (-1.0 if position % 3 == 2 else 1.0) * (index + 0.125 * position)
        for position in range(dimensions)
    ]


def embeddings_response(
    model: str, inputs: int, prompt_tokens: int, *, dimensions: int = 3, base64_format: bool = False
) -> dict[str, Any]:
    """An embeddings `list`; `base64_format` encodes each vector as little-endian float32."""
    data = []
    for index in range(inputs):
        vector = embedding_vector(index, dimensions)
        embedding: list[float] | str = vector
        if base64_format:
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "embedding": embedding, "index": index})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def models_list(models: tuple[str, ...], created: int = 0) -> dict[str, Any]:
    """The OpenAI `GET /v1/models` list."""
    return {
        "object": "list",
        "data": [
            {"id": model, "object": "model", "created": created, "owned_by": "stargate-mock"}
            for model in models
        ],
    }
