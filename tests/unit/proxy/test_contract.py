"""The proxy request contract (docs/data-plane.md, Header contract): pure header validation."""

from __future__ import annotations

import json

import pytest

from stargate.proxy.contract import (
    ContractError,
    ProxyRequest,
    filter_request_headers,
    filter_response_headers,
    parse_proxy_request,
    parse_unsigned,
)

VALID = [(b"x-request-id", b"r-1"), (b"x-input-tokens", b"12"), (b"x-model", b"m")]


def _parse(
    headers: list[tuple[bytes, bytes]], body: bytes = b"{}", **kwargs: object
) -> ProxyRequest:
    options: dict[str, object] = {"retry_budget_header": b"x-stargate-max-wait-ms"}
    options.update(kwargs)
    return parse_proxy_request(
        "/v1/chat/completions",
        b"",
        headers,
        body,
        **options,  # type: ignore[arg-type]
    )


def _status(headers: list[tuple[bytes, bytes]], **kwargs: object) -> int:
    with pytest.raises(ContractError) as caught:
        _parse(headers, **kwargs)
    assert caught.value.body == b"" or kwargs.get("accept_openai_requests")
    return caught.value.status


def test_valid_request_parses_every_field() -> None:
    request = _parse(
        [
            *VALID,
            (b"x-routing-key", b" tenant "),
            (b"x-routing-method", b" Round_Robin "),
            (b"x-priority", b"+7"),
            (b"x-max-wait-ms", b"90000"),
            (b"x-request-slo-ms", b"0"),
            (b"x-cache-affinity-key", b"k"),
            (b"x-stargate-max-wait-ms", b"250"),
        ]
    )
    assert (request.request_id, request.model_id, request.input_tokens) == ("r-1", "m", 12)
    assert request.routing_key == "tenant"
    assert request.routing_method == "Round_Robin"
    assert request.priority == 7
    assert request.max_wait_ms == 60_000  # capped
    assert request.request_slo_ms is None  # 0 behaves like absent
    assert request.cache_affinity_key == "k"
    assert request.retry_budget_ms == 250
    assert request.endpoint == "chat_completions"


@pytest.mark.parametrize("missing", [b"x-request-id", b"x-input-tokens", b"x-model"])
def test_each_required_header_is_a_bare_400(missing: bytes) -> None:
    assert _status([h for h in VALID if h[0] != missing]) == 400


@pytest.mark.parametrize(
    "value", [b"", b" ", b"-1", b"1_000", b"\xd9\xa1", b"18446744073709551616", b"1.5", b"abc"]
)
def test_input_tokens_follow_the_rust_parser(value: bytes) -> None:
    headers = [(b"x-request-id", b"r"), (b"x-input-tokens", value), (b"x-model", b"m")]
    assert _status(headers) == 400


def test_zero_input_tokens_and_plus_sign_are_valid() -> None:
    assert _parse([(b"x-request-id", b"r"), (b"x-input-tokens", b" +0 "), (b"x-model", b"m")])


def test_non_ascii_request_id_counts_as_absent() -> None:
    headers = [(b"x-request-id", "r\u00e9".encode()), *VALID[1:]]
    assert _status(headers) == 400


def test_non_ascii_routing_key_silently_becomes_unscoped() -> None:
    assert _parse([*VALID, (b"x-routing-key", "t\u00e9".encode())]).routing_key is None


def test_repeated_header_uses_the_first_value() -> None:
    request = _parse([*VALID, (b"x-input-tokens", b"99")])
    assert request.input_tokens == 12


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (b"x-priority", b""),
        (b"x-priority", b"4294967296"),
        (b"x-max-wait-ms", b""),
        (b"x-request-slo-ms", b"x"),
        (b"x-stargate-max-wait-ms", b""),
        (b"x-routing-method", b"  "),
        (b"x-routing-method", b"\xff"),
    ],
)
def test_invalid_optional_headers_are_400(name: bytes, value: bytes) -> None:
    assert _status([*VALID, (name, value)]) == 400


def test_validation_order_reports_400_before_anything_else() -> None:
    # Missing request id AND a bad priority: still a plain 400 (no routing, no 404).
    assert (
        _status([(b"x-input-tokens", b"1"), (b"x-model", b"unknown"), (b"x-priority", b"x")]) == 400
    )


def test_disabled_retry_budget_header_is_not_parsed() -> None:
    request = _parse([*VALID, (b"x-stargate-max-wait-ms", b"junk")], retry_budget_header=None)
    assert request.retry_budget_ms is None


def test_query_string_is_forwarded_verbatim() -> None:
    request = parse_proxy_request(
        "/v1/embeddings", b"trace=1&x=%20", VALID, b"{}", retry_budget_header=None
    )
    assert request.target_path == b"/v1/embeddings?trace=1&x=%20"
    assert request.endpoint == "embeddings"


def test_request_headers_drop_hop_by_hop_and_internal_ones() -> None:
    headers = [
        (b"connection", b"keep-alive, x-custom"),
        (b"x-custom", b"kept"),
        (b"host", b"router"),
        (b"te", b"trailers"),
        (b"transfer-encoding", b"chunked"),
        (b"x-routing-method", b"random"),
        (b"x-stargate-retryable", b"true"),
        (b"x-stargate-expected-queue-ms", b"5"),
        (b"authorization", b"Bearer t"),
        (b"x-stargate-max-wait-ms", b"100"),
        (b"traceparent", b"00-abc"),
    ]
    assert filter_request_headers(headers) == [
        # x-custom is named in Connection: hop-by-hop (RFC 9110 §7.6.1), so it is removed too
        (b"authorization", b"Bearer t"),
        (b"x-stargate-max-wait-ms", b"100"),
        (b"traceparent", b"00-abc"),
    ]


def test_response_headers_drop_duplicates_hypercorn_adds_and_routing_headers() -> None:
    headers = [
        (b"date", b"x"),
        (b"server", b"engine"),
        (b"content-type", b"text/event-stream"),
        (b"x-inference-server-id", b"spoofed"),
        (b"x-stargate-retry-after-ms", b"100"),
        (b"content-length", b"5"),
    ]
    assert filter_response_headers(headers) == [
        (b"content-type", b"text/event-stream"),
        (b"content-length", b"5"),
    ]


def test_parse_unsigned_ranges() -> None:
    assert parse_unsigned(b"4294967295", 2**32 - 1) == 2**32 - 1
    assert parse_unsigned(b"4294967296", 2**32 - 1) is None
    assert parse_unsigned(b"++1", 10) is None


def test_openai_mode_takes_the_model_from_the_body_and_generates_an_id() -> None:
    body = json.dumps({"model": "gpt-x", "messages": [{"role": "user", "content": "hi" * 40}]})
    request = _parse([], body.encode(), accept_openai_requests=True)
    assert request.model_id == "gpt-x"
    assert request.generated_request_id
    assert len(request.request_id) == 36
    assert request.input_tokens >= 1
    forwarded = dict(request.headers)
    assert forwarded[b"x-model"] == b"gpt-x"
    assert forwarded[b"x-request-id"] == request.request_id.encode()
    assert int(forwarded[b"x-input-tokens"]) == request.input_tokens


def test_openai_mode_keeps_headers_that_are_sent() -> None:
    request = _parse(VALID, b"{}", accept_openai_requests=True)
    assert (request.model_id, request.request_id, request.generated_request_id) == (
        "m",
        "r-1",
        False,
    )


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b'{"messages": []}',
        b'{"model": "  "}',
        b"[" * 200_000,  # deeper than the interpreter's stack: RecursionError inside json
        b'{"model": "m", "messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
    ],
    ids=["not-json", "array", "no-model", "blank-model", "deep-open", "deep-balanced"],
)
def test_openai_mode_rejects_bodies_without_a_model_with_a_json_error(body: bytes) -> None:
    with pytest.raises(ContractError) as caught:
        _parse([], body, accept_openai_requests=True)
    assert caught.value.status == 400
    headers, answer = caught.value.answer(openai_form=True)
    error = json.loads(answer)["error"]
    assert "model" in error["message"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "model",
        "invalid_body",
    )
    assert (b"content-type", b"application/json") in headers
