"""The proxy's request contract: headers in, a `ProxyRequest` or a local error out (pure).

docs/data-plane.md, "Header contract": the model and routing key come from headers only; every
header is validated, in a fixed order, before any routing, so a bad header on an unknown model is a
400, not a 404. Numeric headers follow the Rust parser (ASCII digits, optional leading `+`,
range-checked), not Python's `int()` (which accepts `1_000` and non-ASCII digits). A repeated header
counts by its first value; a string header that is not visible ASCII counts as absent.

docs/decisions.md, D5 adds `--accept-openai-requests`: without `x-model`, the model comes from the
JSON body (read by a scan of its bytes, stargate/proxy/json_scan.py: the body is never parsed into
objects), a request id is generated and returned, and the input tokens are estimated from the body
size. Such a request is in the *OpenAI form*, and every answer the replica makes itself for it has
the OpenAI error body; a request in the Rust header form gets the Rust answers byte for byte
(docs/clients.md, "Error bodies").

Header hygiene beyond the Rust list (docs/clients.md, "Headers"): only the `x-model` and
`x-request-id` values the replica used are forwarded, headers named in `Connection` are dropped
both ways, and `X-Forwarded-For` / `X-Forwarded-Proto` tell the backend who the client is.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from stargate.asgi import visible_query
from stargate.http_headers import (
    HOP_BY_HOP,
    Headers,
    connection_options,
    first_header,
    parse_unsigned,
)
from stargate.proxy.json_scan import top_level_string

__all__ = [
    "ENDPOINTS",
    "HOP_BY_HOP",
    "ContractError",
    "Headers",
    "ProxyRequest",
    "connection_options",
    "estimate_input_tokens",
    "filter_request_headers",
    "filter_response_headers",
    "first_header",
    "is_openai_form",
    "limit_answer",
    "parse_proxy_request",
    "parse_unsigned",
    "with_forwarding",
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

# Dropped both ways (docs/data-plane.md, Header filtering): hop-by-hop headers, then
# Stargate-internal ones.
_DROPPED = HOP_BY_HOP | frozenset(
    {
        b"x-routing-method",
        b"x-stargate-retryable",
        b"x-stargate-retry-reason",
        b"x-stargate-retry-after-ms",
        b"x-stargate-expected-queue-ms",
        b"x-stargate-error-code",
        b"x-stargate-pool-relayed",  # between replicas only (stargate/proxy/owner_relay.py)
    }
)
# Forwarded once, with the value the replica routed by (a duplicate could disagree with it).
_SINGLE = (b"x-model", b"x-request-id")
# Hypercorn adds its own; forwarding the upstream's would duplicate them
# (docs/decisions.md, H3).
_DROPPED_RESPONSE = _DROPPED | {
    b"date",
    b"server",
    b"x-inference-server-id",
    b"x-inference-server-url",
    b"x-stargate-cluster-id",
}


class ContractError(Exception):
    """A locally generated answer: status, the Rust-form body (bytes) and headers, plus what an
    OpenAI-form answer says (`message`, `code`, `param`; see `answer`)."""

    def __init__(
        self,
        status: int,
        body: bytes = b"",
        headers: Headers | None = None,
        *,
        message: str | None = None,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers or []
        self.message = message
        self.code = code
        self.param = param

    def answer(self, openai_form: bool) -> tuple[Headers, bytes]:
        """The headers and body to send: the Rust answer, or the OpenAI error document.

        The OpenAI form always has a JSON body and an `x-stargate-error-code` header, so an SDK
        shows a message that says what is wrong and an operator can still grep the code.
        """
        if not openai_form:
            return self.headers, self.body
        code = self.code or _DEFAULT_CODES.get(self.status, f"http_{self.status}")
        error = {
            "message": self.message or _DEFAULT_MESSAGES.get(self.status, "request failed"),
            "type": "invalid_request_error" if self.status < 500 else "server_error",
            "param": self.param,
            "code": code,
        }
        headers = [h for h in self.headers if h[0] not in _ANSWER_HEADERS]
        headers += [
            (b"content-type", b"application/json"),
            (b"x-stargate-error-code", code.encode()),
        ]
        return headers, json.dumps({"error": error}).encode()


_ANSWER_HEADERS = frozenset({b"content-type", b"x-stargate-error-code", b"content-length"})
_DEFAULT_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    502: "upstream_failed",
    503: "unavailable",
}
_DEFAULT_MESSAGES = {
    400: "invalid request",
    404: "not found",
    405: "method not allowed: use POST",
    413: "request body too large",
    502: "the upstream request failed",
    503: "no backend can take this request now; retry later",
}


def _bad_header(name: str, rule: str) -> ContractError:
    return ContractError(400, message=f"header {name} {rule}", code="invalid_header")


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
    openai_form: bool = False  # model from the body: answers are OpenAI-shaped
    # Derived from the body with --derive-affinity-key (docs/prefix-routing.md): the prompt's
    # block-hash chain and its group, for the prefix-aware balancer. Routing only.
    prefix_chain: tuple[int, ...] = ()
    prefix_group: int | None = None


def _visible_ascii(raw: bytes | None) -> str | None:
    """A string header: trimmed; absent, empty or not visible ASCII counts as absent."""
    if raw is None:
        return None
    if any(byte < 0x20 or byte > 0x7E for byte in raw):
        return None
    text = raw.decode("ascii").strip()
    return text or None


def _numeric(headers: Headers, name: bytes, maximum: int) -> int | None:
    """An optional numeric header: absent → None; present but empty or invalid → 400."""
    raw = first_header(headers, name)
    if raw is None:
        return None
    value = parse_unsigned(raw, maximum)
    if value is None:
        raise _bad_header(name.decode(), "must be an unsigned integer")
    return value


def estimate_input_tokens(body: bytes | bytearray) -> int:
    """A rough token count for clients that send none: about four bytes per token."""
    return max(1, len(body) // 4)


def filter_request_headers(
    headers: Iterable[tuple[bytes, bytes]], *, drop: Iterable[bytes] = ()
) -> Headers:
    """The client's headers minus the hop-by-hop and internal ones; `drop` names more to leave
    out. Of `x-model` and `x-request-id` only the first value is kept (the one routed by)."""
    headers = list(headers)
    dropped = _DROPPED | connection_options(headers) | frozenset(drop)
    kept: Headers = []
    seen: set[bytes] = set()
    for key, value in headers:
        if key in dropped:
            continue
        if key in _SINGLE:
            if key in seen:
                continue
            seen.add(key)
        kept.append((key, value))
    return kept


def filter_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    headers = list(headers)
    dropped = _DROPPED_RESPONSE | connection_options(headers)
    return [(key, value) for key, value in headers if key not in dropped]


def with_forwarding(forwarded: Headers, client: tuple[str, int] | None, scheme: str) -> Headers:
    """`forwarded` with the client address appended to `X-Forwarded-For` (one header, as
    nginx's `$proxy_add_x_forwarded_for` makes it), and `X-Forwarded-Proto` added unless a proxy
    in front already set it: that proxy knows whether the client used TLS (docs/clients.md)."""
    chain = [value for key, value in forwarded if key == b"x-forwarded-for"]
    if client:
        chain.append(client[0].encode())
    headers = [h for h in forwarded if h[0] != b"x-forwarded-for"]
    if chain:
        headers.append((b"x-forwarded-for", b", ".join(chain)))
    if first_header(forwarded, b"x-forwarded-proto") is None:
        headers.append((b"x-forwarded-proto", scheme.encode()))
    return headers


def is_openai_form(headers: Iterable[tuple[bytes, bytes]], accept_openai_requests: bool) -> bool:
    """True for a plain OpenAI request: the flag is on and there is no `x-model` header."""
    return accept_openai_requests and first_header(headers, b"x-model") is None


def limit_answer(
    headers: Iterable[tuple[bytes, bytes]],
    status: int,
    code: str,
    message: str,
    *,
    accept_openai_requests: bool,
) -> tuple[Headers, bytes]:
    """An answer of the HTTP listener's client limits (408 `request_body_timeout`, 503
    `too_many_connections`; stargate/http_limits.py) in the request's dialect: a bare status with
    `x-stargate-error-code`, or the OpenAI error document for an OpenAI-form request."""
    error = ContractError(
        status, b"", [(b"x-stargate-error-code", code.encode())], message=message, code=code
    )
    return error.answer(is_openai_form(headers, accept_openai_requests))


def parse_proxy_request(
    path: str,
    query: bytes,
    headers: Headers,
    body: bytes | bytearray,
    *,
    retry_budget_header: bytes | None,
    accept_openai_requests: bool = False,
    client: tuple[str, int] | None = None,
    scheme: str = "http",
    http1: bool = False,
) -> ProxyRequest:
    """Validate a proxy request in the Rust order; raise `ContractError`.

    docs/data-plane.md, Header contract, validation steps 1 and 4.

    `headers` must have lower-case names (as ASGI gives them). Algorithm availability (step 2-3)
    is checked by the forwarder, which knows the load-balancer configuration. `http1`: the request
    came through the HTTP/1.1 parser, which already refused every header name, value and target
    byte HTTP/1.1 cannot carry, so those checks (needed for HTTP/2) are skipped on the hot path.
    """
    endpoint = ENDPOINTS[path]
    generated = False
    openai_mode = is_openai_form(headers, accept_openai_requests)
    request_id = _visible_ascii(first_header(headers, b"x-request-id"))
    if request_id is None:
        if not openai_mode:
            raise _bad_header("x-request-id", "is required (visible ASCII)")
        request_id, generated = str(uuid.uuid4()), True

    raw_tokens = first_header(headers, b"x-input-tokens")
    if raw_tokens is None and openai_mode:
        input_tokens = estimate_input_tokens(body)
    else:
        input_tokens_or_none = None if raw_tokens is None else parse_unsigned(raw_tokens, U64_MAX)
        if input_tokens_or_none is None:
            raise _bad_header("x-input-tokens", "must be an unsigned 64-bit integer")
        input_tokens = input_tokens_or_none

    model_id = _visible_ascii(first_header(headers, b"x-model"))
    if model_id is None:
        if not openai_mode:
            raise _bad_header("x-model", "is required (visible ASCII)")
        model_id = _model_from_body(body)

    raw_method = first_header(headers, b"x-routing-method")
    routing_method: str | None = None
    if raw_method is not None:
        try:
            routing_method = raw_method.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise _bad_header("x-routing-method", "must be UTF-8") from None
        if not routing_method:
            raise _bad_header("x-routing-method", "must name an algorithm")

    raw_priority = first_header(headers, b"x-priority")
    priority = 0
    if raw_priority is not None:
        parsed = parse_unsigned(raw_priority, U32_MAX)
        if parsed is None:
            raise _bad_header("x-priority", "must be an unsigned 32-bit integer")
        priority = parsed
    max_wait_ms = _numeric(headers, b"x-max-wait-ms", U64_MAX)
    request_slo_ms = _numeric(headers, b"x-request-slo-ms", U64_MAX)
    retry_budget_ms = (
        None if retry_budget_header is None else _numeric(headers, retry_budget_header, U64_MAX)
    )
    # A generated id replaces whatever invalid value the client sent.
    forwarded = filter_request_headers(headers, drop=(b"x-request-id",) if generated else ())
    if not http1:
        _check_forwardable(forwarded)
    if generated:
        forwarded.append((b"x-request-id", request_id.encode()))
    if openai_mode:
        forwarded.append((b"x-model", model_id.encode()))
        if raw_tokens is None:
            forwarded.append((b"x-input-tokens", str(input_tokens).encode()))
    target_query = query if http1 else visible_query(query)
    return ProxyRequest(
        endpoint=endpoint,
        target_path=path.encode() + (b"?" + target_query if query else b""),
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
        headers=with_forwarding(forwarded, client, scheme),
        generated_request_id=generated,
        openai_form=openai_mode,
    )


# What an HTTP/1.1 message can carry (RFC 9110 §5.1 and §5.5, as h11 enforces them): a token for a
# name; for a value, no NUL and no whitespace but spaces and tabs (no server hands the app a value
# with spaces around it: h11 strips them, h2 refuses them).
_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(rb"[^\x00\n\r\x0b\x0c]*")


def _check_forwardable(headers: Headers) -> None:
    """400 for a header the upstream pool could not send.

    The pool speaks HTTP/1.1, but HTTP/2 lets through names such as `;` or `x(y` and values with
    a form feed or vertical tab (RFC 9113 §8.2.1 forbids only controls and upper case in names,
    NUL, CR and LF in values). Forwarded, they made the pool raise: a 500 with a traceback for a
    client's bad header (found by tests/unit/proxy/test_bad_input.py). RFC 9113 §8.2.1 lets a
    server treat such a request as malformed, which is what this does, naming the header.
    """
    for name, value in headers:
        if not _TOKEN.fullmatch(name):
            raise _bad_header(repr(name.decode("latin-1")), "is not a valid header name")
        if not _FIELD_VALUE.fullmatch(value):
            raise _bad_header(name.decode("latin-1"), "has a value HTTP/1.1 cannot carry")


def _model_from_body(body: bytes | bytearray) -> str:
    """The body's top-level `model` string: a scan that accepts and refuses what `json.loads`
    does, without building the document (stargate/proxy/json_scan.py)."""
    try:
        model = top_level_string(body, "model")
    except (ValueError, RecursionError):
        # ValueError covers UnicodeDecodeError. Nesting deeper than json_scan.MAX_DEPTH is refused
        # there; RecursionError stays for a body handed to json.loads (UTF-16 or UTF-32).
        raise _bad_body('request body must be JSON with a "model" field') from None
    if model is None or not model.strip():
        raise _bad_body('request body has no "model" field')
    model = model.strip()
    # It is forwarded as `x-model`: a lone surrogate (JSON can spell one, `"\ud800"`) cannot be
    # encoded, and some characters cannot be carried (see `_check_forwardable`); both were 500s.
    try:
        forwardable = _FIELD_VALUE.fullmatch(model.encode()) is not None
    except UnicodeEncodeError:
        forwardable = False
    if not forwardable:
        raise _bad_body('the "model" field has characters an HTTP header cannot carry')
    return model


def _bad_body(message: str) -> ContractError:
    return ContractError(400, message=message, code="invalid_body", param="model")
