"""The proxy's request contract: headers in, a `ProxyRequest` or a local error out (pure).

Data-plane spec §1.3 and §7: the model and routing key come from headers only; every header is
validated, in a fixed order, before any routing, so a bad header on an unknown model is a 400, not
a 404. Numeric headers follow the Rust parser (ASCII digits, optional leading `+`, range-checked),
not Python's `int()` (which accepts `1_000` and non-ASCII digits). A repeated header counts by its
first value; a string header that is not visible ASCII counts as absent.

Spec decision 5 adds `--accept-openai-requests`: without `x-model`, the model comes from the JSON
body, a request id is generated and returned, and the input tokens are estimated from the body size.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "ENDPOINTS",
    "ContractError",
    "ProxyRequest",
    "estimate_input_tokens",
    "filter_request_headers",
    "filter_response_headers",
    "first_header",
    "parse_proxy_request",
    "parse_unsigned",
]

ENDPOINTS: Mapping[str, str] = {
    "/v1/chat/completions": "chat_completions",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/v1/completions": "completions",
}

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
ROUTING_WAIT_CAP_MS = 60_000

# Dropped both ways (§2.8): hop-by-hop headers, then Stargate-internal ones.
_DROPPED = frozenset(
    {
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"host",
        b"x-routing-method",
        b"x-stargate-retryable",
        b"x-stargate-retry-reason",
        b"x-stargate-retry-after-ms",
        b"x-stargate-expected-queue-ms",
        b"x-stargate-error-code",
    }
)
# Hypercorn adds its own; forwarding the upstream's would duplicate them (stack-notes P5).
_DROPPED_RESPONSE = _DROPPED | {
    b"date",
    b"server",
    b"x-inference-server-id",
    b"x-inference-server-url",
    b"x-stargate-cluster-id",
}

Headers = list[tuple[bytes, bytes]]


class ContractError(Exception):
    """A locally generated error response: status, optional JSON body (bytes) and headers."""

    def __init__(self, status: int, body: bytes = b"", headers: Headers | None = None) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers or []

    @classmethod
    def openai(cls, status: int, message: str) -> ContractError:
        """An OpenAI-style JSON error, for clients of `--accept-openai-requests`."""
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "code": None}}
        ).encode()
        return cls(status, body, [(b"content-type", b"application/json")])


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    """A validated proxy request: everything routing and forwarding need, nothing else."""

    endpoint: str
    target_path: bytes  # path and query, forwarded verbatim
    request_id: str
    model_id: str
    input_tokens: int
    routing_key: str | None
    routing_method: str | None  # the raw x-routing-method value, trimmed (validated by the LB)
    priority: int
    max_wait_ms: int | None
    request_slo_ms: int | None
    cache_affinity_key: str | None
    retry_budget_ms: int | None
    headers: Headers  # filtered, forwarded to every attempt
    generated_request_id: bool = False


def first_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def _visible_ascii(raw: bytes | None) -> str | None:
    """A string header: trimmed; absent, empty or not visible ASCII counts as absent."""
    if raw is None:
        return None
    if any(byte < 0x20 or byte > 0x7E for byte in raw):
        return None
    text = raw.decode("ascii").strip()
    return text or None


def parse_unsigned(raw: bytes, maximum: int) -> int | None:
    """Rust-style unsigned parse: trimmed ASCII digits, optional leading `+`, at most `maximum`."""
    text = raw.strip(b" \t")
    if text.startswith(b"+"):
        text = text[1:]
    if not text or not text.isdigit() or not text.isascii():
        return None
    value = int(text)
    return value if value <= maximum else None


def _numeric(headers: Headers, name: bytes, maximum: int) -> int | None:
    """An optional numeric header: absent → None; present but empty or invalid → 400."""
    raw = first_header(headers, name)
    if raw is None:
        return None
    value = parse_unsigned(raw, maximum)
    if value is None:
        raise ContractError(400)
    return value


def estimate_input_tokens(body: bytes) -> int:
    """A rough token count for clients that send none: about four bytes per token."""
    return max(1, len(body) // 4)


def filter_request_headers(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    return [(key, value) for key, value in headers if key not in _DROPPED]


def filter_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    return [(key, value) for key, value in headers if key not in _DROPPED_RESPONSE]


def parse_proxy_request(
    path: str,
    query: bytes,
    headers: Headers,
    body: bytes,
    *,
    retry_budget_header: bytes | None,
    accept_openai_requests: bool = False,
) -> ProxyRequest:
    """Validate a proxy request in the Rust order (§1.3 step 1 and 4); raise `ContractError`.

    `headers` must have lower-case names (as ASGI gives them). Algorithm availability (step 2-3)
    is checked by the router, which knows the load-balancer configuration.
    """
    endpoint = ENDPOINTS[path]
    generated = False
    openai_mode = accept_openai_requests and first_header(headers, b"x-model") is None
    request_id = _visible_ascii(first_header(headers, b"x-request-id"))
    if request_id is None:
        if not openai_mode:
            raise ContractError(400)
        request_id, generated = str(uuid.uuid4()), True

    raw_tokens = first_header(headers, b"x-input-tokens")
    if raw_tokens is None and openai_mode:
        input_tokens = estimate_input_tokens(body)
    else:
        input_tokens_or_none = None if raw_tokens is None else parse_unsigned(raw_tokens, U64_MAX)
        if input_tokens_or_none is None:
            raise ContractError(400)
        input_tokens = input_tokens_or_none

    model_id = _visible_ascii(first_header(headers, b"x-model"))
    if model_id is None:
        if not openai_mode:
            raise ContractError(400)
        model_id = _model_from_body(body)

    raw_method = first_header(headers, b"x-routing-method")
    routing_method: str | None = None
    if raw_method is not None:
        try:
            routing_method = raw_method.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ContractError(400) from None
        if not routing_method:
            raise ContractError(400)

    raw_priority = first_header(headers, b"x-priority")
    priority = 0
    if raw_priority is not None:
        parsed = parse_unsigned(raw_priority, U32_MAX)
        if parsed is None:
            raise ContractError(400)
        priority = parsed
    max_wait_ms = _numeric(headers, b"x-max-wait-ms", U64_MAX)
    request_slo_ms = _numeric(headers, b"x-request-slo-ms", U64_MAX)
    retry_budget_ms = (
        None if retry_budget_header is None else _numeric(headers, retry_budget_header, U64_MAX)
    )
    forwarded = filter_request_headers(headers)
    if generated:
        forwarded.append((b"x-request-id", request_id.encode()))
    if openai_mode:
        forwarded.append((b"x-model", model_id.encode()))
        if raw_tokens is None:
            forwarded.append((b"x-input-tokens", str(input_tokens).encode()))
    return ProxyRequest(
        endpoint=endpoint,
        target_path=path.encode() + (b"?" + query if query else b""),
        request_id=request_id,
        model_id=model_id,
        input_tokens=input_tokens,
        routing_key=_visible_ascii(first_header(headers, b"x-routing-key")),
        routing_method=routing_method,
        priority=priority,
        max_wait_ms=None if max_wait_ms is None else min(max_wait_ms, ROUTING_WAIT_CAP_MS),
        request_slo_ms=request_slo_ms or None,
        cache_affinity_key=_visible_ascii(first_header(headers, b"x-cache-affinity-key")),
        retry_budget_ms=retry_budget_ms,
        headers=forwarded,
        generated_request_id=generated,
    )


def _model_from_body(body: bytes) -> str:
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ContractError.openai(400, 'request body must be JSON with a "model" field') from None
    model = document.get("model") if isinstance(document, dict) else None
    if not isinstance(model, str) or not model.strip():
        raise ContractError.openai(400, 'request body has no "model" field')
    return model.strip()
