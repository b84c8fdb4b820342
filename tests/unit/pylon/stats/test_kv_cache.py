"""The KV-cache endpoint's body: a model and three token figures, taken verbatim."""

from __future__ import annotations

import json

import pytest

from stargate.pylon.stats.kv_cache import KvCacheStats, parse_kv_cache_stats

BODY = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "kv_cache_capacity_tokens": 65536,
    "kv_cache_used_tokens": 1024,
    "kv_cache_free_tokens": 64512,
}


def body(**changes: object) -> bytes:
    merged = {**BODY, **changes}
    return json.dumps({k: v for k, v in merged.items() if v is not ...}).encode()


def test_a_valid_body() -> None:
    assert parse_kv_cache_stats(body()) == (
        "meta-llama/Llama-3.1-8B-Instruct",
        KvCacheStats(capacity_tokens=65536, used_tokens=1024, free_tokens=64512),
    )


def test_extra_fields_are_ignored() -> None:
    model, stats = parse_kv_cache_stats(
        body(kv_cache_block_size=16, engine={"name": "mock-dynamo"}, kv_cache_hit_rate=0.4)
    )
    assert model == "meta-llama/Llama-3.1-8B-Instruct"
    assert stats == KvCacheStats(65536, 1024, 64512)


def test_the_figures_are_taken_verbatim_even_when_they_do_not_add_up() -> None:
    _, stats = parse_kv_cache_stats(
        body(kv_cache_capacity_tokens=100, kv_cache_used_tokens=90, kv_cache_free_tokens=50)
    )
    assert stats == KvCacheStats(100, 90, 50)
    _, zero = parse_kv_cache_stats(
        body(kv_cache_capacity_tokens=0, kv_cache_used_tokens=0, kv_cache_free_tokens=0)
    )
    assert zero == KvCacheStats(0, 0, 0)
    _, largest = parse_kv_cache_stats(body(kv_cache_capacity_tokens=2**64 - 1))
    assert largest.capacity_tokens == 2**64 - 1


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "not JSON"),
        (b"<html>404</html>", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[]", "not a JSON object"),
        (b"null", "not a JSON object"),
        (body(model=...), "'model'"),
        (body(model=""), "'model'"),
        (body(model=None), "'model'"),
        (body(model=3), "'model'"),
        (body(kv_cache_capacity_tokens=...), "'kv_cache_capacity_tokens'"),
        (body(kv_cache_used_tokens=None), "'kv_cache_used_tokens'"),
        (body(kv_cache_free_tokens=-1), "'kv_cache_free_tokens'"),
        (body(kv_cache_free_tokens=1.0), "'kv_cache_free_tokens'"),
        (body(kv_cache_free_tokens="1"), "'kv_cache_free_tokens'"),
        (body(kv_cache_free_tokens=True), "'kv_cache_free_tokens'"),
        (body(kv_cache_capacity_tokens=2**64), "'kv_cache_capacity_tokens'"),
    ],
)
def test_an_invalid_body_says_what_is_wrong(raw: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_kv_cache_stats(raw)
