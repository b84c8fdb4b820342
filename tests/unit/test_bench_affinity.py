"""benchmarks/affinity.py without its servers: the trace, the offline bound, the figures of a pass
(block hit rate, stickiness, agreement, spread), the goals, the report, and one pass of the real
client against a small recording server (what a plain OpenAI client sends, in what order)."""

from __future__ import annotations

import http.server
import json
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from benchmarks import affinity
from benchmarks.affinity import (
    BLOCK_CHARS,
    ENGINE_IDS,
    KV_BLOCK_BYTES,
    KV_DEPTH,
    PRECISE,
    Agreement,
    Conversation,
    Outcome,
    PassResult,
    Run,
    Settings,
    Trace,
)
from benchmarks.common import Deadline, Processes, Suite
from stargate.mock.shapes import chat_cache_text
from stargate.prefix_key import derive_prefix

SMALL = Settings(3, 600, 12, 4, 3, (50, 120), (40, 90), 5, 60.0)


def test_the_trace_is_seeded_and_shaped_as_the_issue_measured_it() -> None:
    full = affinity.settings_for(Suite(False, False, Path("."), None))
    assert (full.system_prompts, full.conversations, full.turns, full.users) == (20, 200, 5, 16)
    trace = affinity.build_trace(full)
    assert trace == affinity.build_trace(full)  # byte-identical for every router
    assert len(trace.systems) == 20 and len(set(trace.systems)) == 20
    assert all(len(system) == full.system_chars for system in trace.systems)
    assert trace.requests == 1000
    assert len({c.system for c in trace.conversations}) > 10  # spread over the system prompts
    quick = affinity.settings_for(Suite(True, False, Path("."), None))
    assert (quick.system_prompts, quick.conversations, quick.users) == (8, 40, 8)
    assert affinity.build_trace(quick) != trace


def test_each_turn_resends_the_whole_history() -> None:
    trace = affinity.build_trace(SMALL)
    conversation = trace.conversations[0]
    for turn in range(1, len(conversation.turns)):
        before, now = conversation.messages(turn - 1), conversation.messages(turn)
        assert now[: len(before)] == before
        assert now[len(before)] == {"role": "assistant", "content": conversation.turns[turn - 1][1]}
        assert now[-1] == {"role": "user", "content": conversation.turns[turn][0]}
        assert affinity.prompt_text(conversation, turn).startswith(
            affinity.prompt_text(conversation, turn - 1)
        )
    assert conversation.messages(0)[0] == {"role": "system", "content": conversation.system}
    body = affinity.chat_body(conversation, 2)
    assert body == {
        "model": affinity.MODEL,
        "messages": conversation.messages(2),
        "stream": True,
        "max_tokens": affinity.TOKENS,
    }


def test_the_bound_counts_what_one_infinite_cache_would_hit() -> None:
    # "system NUL" + 120 + "NUL" is 128 characters: two whole blocks shared by both conversations.
    system = "s" * 120
    first = Conversation(0, system, (("p" * 100, "a" * 70), ("p" * 90, "a" * 60)))
    second = Conversation(1, system, (("q" * 130, "b" * 50), ("q" * 40, "b" * 30)))
    trace = Trace((system,), (first, second))
    texts = {(c.index, t): affinity.prompt_text(c, t) for c in (first, second) for t in (0, 1)}
    whole = sum(len(text) // BLOCK_CHARS for text in texts.values())
    hits = (
        0  # the very first prompt
        + len(texts[(0, 0)]) // BLOCK_CHARS  # turn 2 finds turn 1's whole blocks
        + 2  # the other conversation's first turn finds the system prompt's two blocks
        + len(texts[(1, 0)]) // BLOCK_CHARS
    )
    assert affinity.infinite_cache_bound(trace) == pytest.approx(hits / whole)


def test_the_bound_does_not_depend_on_the_order_of_the_conversations() -> None:
    trace = affinity.build_trace(SMALL)
    backwards = Trace(trace.systems, tuple(reversed(trace.conversations)))
    bound = affinity.infinite_cache_bound(trace)
    assert 0.5 < bound < 1.0
    assert affinity.infinite_cache_bound(backwards) == pytest.approx(bound)


def test_precise_mode_s_blocks_are_the_router_s_chain_of_the_request() -> None:
    trace = affinity.build_trace(SMALL)
    conversation = trace.conversations[1]
    chains = [affinity.router_chain(conversation, turn) for turn in range(SMALL.turns)]
    for turn in range(1, SMALL.turns):  # a turn's chain extends the turn before's
        assert chains[turn][: len(chains[turn - 1])] == chains[turn - 1]
        assert len(chains[turn]) > len(chains[turn - 1])
    # What the mock computes from the raw body, however the client spelled its JSON.
    body = json.dumps(affinity.chat_body(conversation, 2), separators=(",", ":")).encode()
    derived = derive_prefix("/v1/chat/completions", body, KV_BLOCK_BYTES, KV_DEPTH)
    assert derived is not None and derived.chain == chains[2]
    # The router's stream frames messages as the mock's text does; this trace is ASCII, so a
    # block of 64 bytes is one of 64 characters and both count the same whole blocks.
    assert KV_BLOCK_BYTES == BLOCK_CHARS
    assert affinity.prompt_blocks(trace, precise=True) == affinity.prompt_blocks(trace)
    assert affinity.prompt_blocks(trace)[(1, 2)] == len(chains[2])
    assert affinity.infinite_cache_bound(trace, precise=True) == pytest.approx(
        affinity.infinite_cache_bound(trace)
    )


def test_the_precise_bound_counts_bytes_of_the_router_s_stream() -> None:
    # "é" is one character of the mock's text but two bytes of the router's stream: the precise
    # blocks are more, and the bound is computed on them.
    system = "é" * 100
    trace = Trace(
        (system,),
        (
            Conversation(0, system, (("p" * 100, "a" * 70), ("p" * 90, "a" * 60))),
            Conversation(1, system, (("q" * 130, "b" * 50),)),
        ),
    )
    plain, precise = affinity.prompt_blocks(trace), affinity.prompt_blocks(trace, True)
    assert all(precise[key] > plain[key] for key in plain)
    bound = affinity.infinite_cache_bound(trace, precise=True)
    assert 0 < bound < 1 and bound != pytest.approx(affinity.infinite_cache_bound(trace))


def _outcome(conversation: int, turn: int, engine: str, **fields: Any) -> Outcome:
    values: dict[str, Any] = {"status": 200, "done": True, "engine": engine, **fields}
    return Outcome(conversation, turn, 0, **values)


def test_stickiness_counts_turns_on_the_engine_of_the_previous_turn() -> None:
    outcomes = [
        _outcome(0, 0, "engine-0"),
        _outcome(0, 1, "engine-0"),  # stays
        _outcome(0, 2, "engine-1"),  # moves
        _outcome(0, 3, "engine-1"),  # stays
        _outcome(1, 0, "engine-2"),
        _outcome(1, 1, "engine-2", status=503),  # failed: no pair with it
        _outcome(1, 2, "engine-2"),
    ]
    assert affinity.stickiness(outcomes) == pytest.approx(2 / 3)
    assert math.isnan(affinity.stickiness([_outcome(0, 0, "engine-0")]))


def _paired(conversation: int, turn: int, engine: str, shadow: str, **fields: Any) -> Outcome:
    """A request through replica A (`engine`) and its shadow through replica B (`shadow`)."""
    outcome = _outcome(conversation, turn, engine, **fields)
    outcome.shadow = _outcome(conversation, turn, shadow)
    return outcome


def test_agreement_compares_each_request_with_its_shadow() -> None:
    outcomes = [
        _paired(0, 0, "engine-0", "engine-0"),
        _paired(0, 1, "engine-1", "engine-3"),  # B chose another engine
        _paired(1, 0, "engine-2", "engine-2"),
        _paired(1, 1, "engine-2", "engine-2"),
        _paired(2, 0, "engine-1", "engine-1", status=503),  # A failed: not compared
        _outcome(2, 1, "engine-1"),  # no shadow: not compared
    ]
    cut = outcomes[3].shadow
    assert cut is not None
    cut.done = False  # the shadow was cut: not compared
    shadowless = _paired(3, 0, "engine-0", "")  # no engine named: not compared either
    assert affinity.agreement(outcomes) == (2 / 3, 3)
    assert affinity.agreement([*outcomes, shadowless]) == (2 / 3, 3)
    cut.done = True
    assert affinity.agreement(outcomes) == (3 / 4, 4)
    # The pairing is per request, not per (conversation, turn) across lists: a shadow that
    # agrees with another request's engine does not count.
    crossed = [_paired(0, 0, "engine-0", "engine-1"), _paired(0, 0, "engine-1", "engine-0")]
    assert affinity.agreement(crossed) == (0.0, 2)
    same, compared = affinity.agreement([])
    assert math.isnan(same) and compared == 0
    same, compared = affinity.agreement([_outcome(0, 0, "engine-0")])  # a pass without shadows
    assert math.isnan(same) and compared == 0


def test_the_shadow_is_the_request_s_body_with_one_token() -> None:
    trace = affinity.build_trace(SMALL)
    conversation = trace.conversations[2]
    for turn in range(SMALL.turns):
        body = affinity.chat_body(conversation, turn)
        original = json.dumps(body)
        shadow = affinity.shadow_body(body)
        assert json.dumps(body) == original  # the request's own body is untouched
        assert shadow == {**body, "max_tokens": 1}
        assert shadow["stream"] is body["stream"] is True
        assert shadow["messages"] == conversation.messages(turn)
        # The same prompt: the mock's text, and the replicas' derived key, chain and group.
        assert chat_cache_text(shadow) == affinity.prompt_text(conversation, turn)
        derived = [
            derive_prefix(affinity.CHAT_PATH, json.dumps(b).encode(), KV_BLOCK_BYTES, KV_DEPTH)
            for b in (body, shadow)
        ]
        assert derived[0] is not None and derived[0] == derived[1]
        assert derived[0].chain == affinity.router_chain(conversation, turn)
    assert affinity.shadow_body({"model": "m", "messages": [], "stream": False}) == {
        "model": "m",
        "messages": [],
        "stream": False,
        "max_tokens": 1,
    }


def test_a_paired_pass_s_hit_rate_leaves_out_the_race_with_the_request_s_own_shadow() -> None:
    blocks = 10
    outcomes = [
        # The shadow arrived first on the same engine: A found the whole prompt; the shadow's
        # hit (3 blocks) is what the cache held before the pair.
        _paired(0, 0, "engine-0", "engine-0", hit_chars=10 * BLOCK_CHARS, prompt_blocks=blocks),
        # A arrived first: its own hit (4) is the lesser.
        _paired(0, 1, "engine-1", "engine-1", hit_chars=4 * BLOCK_CHARS, prompt_blocks=blocks),
        # The shadow went elsewhere: A's hit as it is.
        _paired(1, 0, "engine-2", "engine-3", hit_chars=6 * BLOCK_CHARS, prompt_blocks=blocks),
        # No shadow at all (a single-replica pass).
        _outcome(1, 1, "engine-2", hit_chars=7 * BLOCK_CHARS, prompt_blocks=blocks),
    ]
    assert outcomes[0].shadow is not None and outcomes[1].shadow is not None
    outcomes[0].shadow.hit_chars = 3 * BLOCK_CHARS
    outcomes[1].shadow.hit_chars = 10 * BLOCK_CHARS
    assert affinity.block_hit_rate(outcomes) == pytest.approx(27 / 40)  # raw
    assert affinity.unshadowed_block_hit_rate(outcomes) == pytest.approx(20 / 40)
    # A shadow that got no answer from the engine did not touch its cache.
    outcomes[0].shadow.status = 503
    assert affinity.unshadowed_block_hit_rate(outcomes) == pytest.approx(27 / 40)
    plain = [_outcome(0, 0, "engine-0", hit_chars=BLOCK_CHARS, prompt_blocks=4)]
    assert affinity.unshadowed_block_hit_rate(plain) == affinity.block_hit_rate(plain) == 0.25
    assert math.isnan(affinity.unshadowed_block_hit_rate([]))


def test_the_send_skew_of_each_pair() -> None:
    outcomes = [_paired(0, t, "engine-0", "engine-0", sent=10.0 + t) for t in range(3)]
    for t, outcome in enumerate(outcomes):
        assert outcome.shadow is not None
        outcome.shadow.sent = 10.0 + t + (0.002, -0.001, 0.0005)[t]
    outcomes.append(_outcome(1, 0, "engine-1", sent=3.0))  # no shadow
    assert affinity.send_skews_ms(outcomes) == pytest.approx([0.5, 1.0, 2.0])


def test_the_spread_and_the_block_hit_rate_count_answered_requests_only() -> None:
    outcomes = [
        _outcome(0, 0, "engine-0", hit_chars=0, prompt_blocks=10),
        _outcome(0, 1, "engine-0", hit_chars=10 * BLOCK_CHARS, prompt_blocks=14),
        _outcome(1, 0, "engine-1", hit_chars=5 * BLOCK_CHARS, prompt_blocks=6),
        _outcome(1, 1, "engine-1", error="ReadTimeout", hit_chars=640, prompt_blocks=99),
    ]
    assert affinity.block_hit_rate(outcomes) == pytest.approx(15 / 30)
    counts = affinity.per_engine(outcomes)
    assert counts == {"engine-0": 2, "engine-1": 1, "engine-2": 0, "engine-3": 0}
    assert affinity.max_min_ratio(counts) == math.inf
    assert affinity.max_min_ratio(dict(zip(ENGINE_IDS, (30, 25, 20, 24), strict=True))) == 1.5
    assert math.isnan(affinity.max_min_ratio(dict.fromkeys(ENGINE_IDS, 0)))


def test_summarise_puts_a_pass_together() -> None:
    conversation = affinity.build_trace(SMALL).conversations[0]
    chars = {(0, t): len(affinity.prompt_text(conversation, t)) for t in range(4)}
    outcomes = [
        _outcome(0, t, ENGINE_IDS[t % 2], ttft_ms=10.0 * (t + 1), prompt_chars=chars[(0, t)])
        for t in range(4)
    ]
    outcomes[3].prompt_chars += 1  # a router that changed the prompt
    result = affinity.summarise(
        "r", "stargate", "a", outcomes, 1.0, True, dict.fromkeys(ENGINE_IDS, 1), chars
    )
    assert (result.requests, result.failed, result.prompt_mismatches) == (4, 0, 1)
    assert result.stickiness == 0.0
    assert result.shares == {"engine-0": 0.5, "engine-1": 0.5, "engine-2": 0.0, "engine-3": 0.0}
    assert (result.ttft_p50_ms, result.ttft_p99_ms) == (20.0, 40.0)


def _result(router: str, **fields: Any) -> PassResult:
    kind, _, algorithm = router.partition(" ")
    return PassResult(router, kind, algorithm, **fields)


def test_the_goals_are_judged_on_prefix_aware_and_missing_figures_are_not_measured() -> None:
    run = Run(
        passes=[
            _result("stargate prefix-aware", block_hit_rate=0.79, stickiness=0.96, max_min=1.2),
            _result("sglang-router cache_aware", block_hit_rate=0.80),
        ],
        agreements=[Agreement("prefix-aware", 0.98, 100), Agreement("pulsar", 1.0, 100)],
        slow=[_result("stargate prefix-aware", shares={"engine-3": 0.2})],
    )
    met = {goal.what.split(" ", 1)[1]: goal.met for goal in affinity.judge(run)}
    assert met == {
        "block hit rate vs sglang-router cache_aware": True,  # 0.79 >= 0.80 - 0.02
        "stickiness": True,
        "max/min requests per engine": True,
        "slow engine's share": False,
        "agreement across replicas": False,
    }
    run.passes[0].block_hit_rate = 0.77
    run.passes[0].max_min = math.inf  # an engine that got nothing
    goals = affinity.judge(run)
    assert [goal.met for goal in goals][:3] == [False, True, False]
    assert "0.770 vs 0.800" in affinity._verdict(goals[0])
    assert [goal.met for goal in affinity.judge(Run())] == [None] * 5
    assert affinity._verdict(affinity.judge(Run())[0]).startswith("n/a")


def test_the_goals_are_judged_for_prefix_aware_and_its_precise_mode() -> None:
    run = Run(
        passes=[
            _result("stargate prefix-aware", block_hit_rate=0.75, stickiness=0.99, max_min=1.2),
            _result(f"stargate {PRECISE}", block_hit_rate=0.79, stickiness=0.94, max_min=1.5),
            _result("sglang-router cache_aware", block_hit_rate=0.80),
        ],
        agreements=[Agreement("prefix-aware", 0.99, 100), Agreement(PRECISE, 0.97, 100)],
        slow=[
            _result("stargate prefix-aware", shares={"engine-3": 0.05}),
            _result(f"stargate {PRECISE}", shares={"engine-3": 0.2}),
        ],
    )
    goals = affinity.judge_all(run)
    assert [goal.what for goal in goals[5:]] == [
        "prefix-aware, precise block hit rate vs sglang-router cache_aware",
        "prefix-aware, precise stickiness",
        "prefix-aware, precise max/min requests per engine",
        "prefix-aware, precise slow engine's share",
        "prefix-aware, precise agreement across replicas",
    ]
    assert goals[:5] == affinity.judge(run)  # prefix-aware's own, first
    assert [goal.met for goal in goals] == [
        *(False, True, True, True, True),  # prefix-aware: 0.75 < 0.80 - 0.02
        *(True, False, False, False, False),  # precise: 0.79 >= 0.78, the rest missed
    ]
    assert affinity._verdict(goals[5]) == (
        "pass (0.790 vs 0.800; goal at least cache_aware's - 0.02)"
    )
    assert affinity._verdict(goals[6]).startswith("MISS (0.940;")
    # Without a precise pass, its goals are not measured (and prefix-aware's are unchanged).
    run.passes, run.agreements, run.slow = run.passes[::2], run.agreements[:1], run.slow[:1]
    assert [goal.met for goal in affinity.judge_all(run)][5:] == [None] * 5


def test_the_report_shows_precise_mode_in_every_table() -> None:
    run = Run(
        passes=[
            _result("stargate prefix-aware", requests=5, block_hit_rate=0.5),
            _result(f"stargate {PRECISE}", requests=5, block_hit_rate=0.6, stickiness=0.9),
        ],
        agreements=[Agreement("prefix-aware", 0.99, 5), Agreement(PRECISE, 0.98, 5)],
        slow=[
            _result(
                f"stargate {PRECISE}",
                shares=dict(zip(ENGINE_IDS, (0.3, 0.3, 0.3, 0.1), strict=True)),
            )
        ],
        bound=0.8,
        precise_bound=0.79,
    )
    trace = affinity.build_trace(SMALL)
    text = affinity.markdown(run, affinity.judge_all(run), trace, SMALL, "0.3.2")
    assert "| stargate prefix-aware, precise | 0.600 |" in text
    assert "| prefix-aware, precise | 0.980 | 5 |" in text
    assert "| prefix-aware, precise | 0.300 | 0.300 | 0.300 | 0.100 |" in text
    assert "hits 0.800 of the blocks (0.790 of precise mode's blocks" in text
    assert "**Precise mode**" in text and "64 *bytes of the router's prompt stream*" in text
    assert "- prefix-aware, precise agreement across replicas: MISS (0.980; goal >= 0.99)" in text
    assert "- prefix-aware agreement across replicas: pass (0.990; goal >= 0.99)" in text
    plain = Run(passes=run.passes[:1])
    assert "**Precise mode**" not in affinity.markdown(plain, [], trace, SMALL, "0.3.2")


def test_the_report_has_the_issue_s_columns_and_every_table() -> None:
    run = Run(
        passes=[
            _result(
                "stargate prefix-aware",
                requests=5,
                block_hit_rate=0.5,
                stickiness=1.0,
                retries={"queue_estimate_mismatch": 3},
            ),
            _result("sglang-router cache_aware", requests=5, block_hit_rate=0.6),
            _result("stargate round-robin", requests=5),
        ],
        agreements=[Agreement("prefix-aware", 0.99, 5)],
        slow=[_result("stargate power-of-n", shares={"engine-3": 0.1})],
        bound=0.8,
    )
    trace = affinity.build_trace(SMALL)
    text = affinity.markdown(run, affinity.judge(run), trace, SMALL, "0.3.2")
    assert (
        "| Router | Block hit rate | TTFT p50 ms | TTFT p99 ms | Stickiness | "
        "Max/min requests per engine |" in text
    )
    assert "| stargate prefix-aware | 0.500 |" in text
    assert "hits 0.800 of the blocks" in text
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()]
    spread = {row[0]: row for row in rows if len(row) == 8}  # router, OK, 4 shares, retries, s
    assert spread["Router"][6] == "Replica retries"
    assert spread["stargate prefix-aware"][6] == "3 queue_estimate_mismatch"
    assert spread["stargate round-robin"][6] == "0"
    assert spread["sglang-router cache_aware"][6] == "-"
    assert "| prefix-aware | 0.990 | 5 |" in text
    assert (
        "| Algorithm | Agreement | Requests compared | A's block hit rate | A's stickiness |"
        in text
    )
    assert "caches reset" not in text and "second pass" not in text
    assert "engine-3 (slow)" in text and "| power-of-n |" in text
    assert "- prefix-aware agreement across replicas: pass (0.990; goal >= 0.99)" in text


def test_the_agreement_table_is_of_the_paired_passes() -> None:
    paired = _result(
        "stargate prefix-aware, paired",
        block_hit_rate=0.81,
        stickiness=0.97,
        retries={"queue_estimate_mismatch": 3},
    )
    agreements = [
        Agreement(
            "prefix-aware",
            0.995,
            1000,
            0.76,
            paired,
            0,
            1.25,
            9.5,
            {"queue_estimate_mismatch": 4, "queue_check_waived": 1},
        ),
        Agreement("pulsar", 0.9, 990, math.nan, None, 10),
    ]
    text = affinity.agreement_section(agreements)
    assert "| prefix-aware | 0.995 | 1,000 | 0.760 | 0.970 |" in text
    assert "| pulsar | 0.900 | 990 | - | - |" in text
    assert "shadow copy to replica B" in text and '`"max_tokens": 1`' in text
    assert "a second engine's cache" in text and "double the engines' requests" in text
    assert "Raw: prefix-aware 0.810." in text
    assert "prefix-aware p50 1.2, max 9.5" in text  # the send skew
    assert "10 shadows failed." in text
    assert "A / B (a retried request" in text and "prefix-aware 3 / 5; pulsar 0 / 0." in text
    assert "caches reset" not in text and "second pass" not in text


def test_retries_are_counted_between_two_reads() -> None:
    before = {"queue_estimate_mismatch": 2.0, "connect": 1.0}
    after = {"queue_estimate_mismatch": 7.0, "connect": 1.0, "queue_check_waived": 1.0}
    assert affinity.retries_delta(before, after) == {
        "queue_check_waived": 1,
        "queue_estimate_mismatch": 5,
    }
    assert affinity.retries_delta({}, {}) == {}


def test_the_lb_config_makes_the_algorithm_the_model_s_default() -> None:
    for algorithm in ("power-of-n", "round-robin", "pulsar", "wait-and-widen"):
        definition, reason = affinity.stargate_definition(algorithm)
        assert definition is not None, reason
        config = affinity.lb_config(algorithm, definition)
        assert config["models"] == {affinity.MODEL: definition}
    definition, reason = affinity.stargate_definition("no-such-algorithm")
    assert definition is None and reason


def test_precise_mode_is_prefix_aware_s_config_with_kv_event_flags() -> None:
    assert affinity.split_variant(PRECISE) == ("prefix-aware", True)
    assert affinity.split_variant("prefix-aware") == ("prefix-aware", False)
    assert affinity.slug(PRECISE) == "prefix-aware-precise"
    assert PRECISE in affinity.STARGATE_ALGORITHMS
    assert PRECISE in affinity.AGREEMENT_ALGORITHMS and PRECISE in affinity.SLOW_ALGORITHMS
    assert affinity.GOAL_ALGORITHMS == ("prefix-aware", PRECISE)
    definition, reason = affinity.stargate_definition(PRECISE)
    assert definition is not None, reason
    assert (definition, reason) == affinity.stargate_definition("prefix-aware")
    config = affinity.lb_config(PRECISE, definition)
    assert config == affinity.lb_config("prefix-aware", definition)
    assert config["default"] == "prefix-aware"


def _flags(args: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`--flag value` pairs of a command line (after its first `--`)."""
    start = next(i for i, arg in enumerate(args) if arg.startswith("--"))
    rest = args[start:]
    return dict(zip(rest[::2], rest[1::2], strict=True))


def test_precise_mode_s_engines_pylons_and_replicas_get_the_kv_event_flags() -> None:
    endpoint = "tcp://127.0.0.1:5557"
    plain = affinity.engine_command("engine-2")
    precise = affinity.engine_command("engine-2", endpoint)
    assert precise[: len(plain) - 2] == plain[:-2]  # the same engine, then the log level
    assert _flags(plain) == {
        "--port": "0",
        "--model": affinity.MODEL,
        "--ttft-ms": "200",
        "--inter-token-ms": "5",
        "--tokens": "8",
        "--prefix-cache-blocks": "512",
        "--prefix-cache-block-chars": "64",
        "--prefix-cache-speedup": "0.9",
        "--engine-id": "engine-2",
        "--log-level": "warning",
    }
    assert _flags(precise) == _flags(plain) | {
        "--kv-events-endpoint": endpoint,
        "--kv-events-block-bytes": "64",
        "--kv-events-depth": "256",
    }
    seeds = ["--stargate", "127.0.0.1:9000"]
    assert affinity.pylon_args(seeds) == ("--canary-interval-ms", "0", *seeds)
    assert affinity.pylon_args(seeds, endpoint) == (
        *affinity.pylon_args(seeds),
        "--kv-events-endpoint",
        endpoint,
    )
    config = Path("/tmp/lb.json")
    assert affinity.replica_args(config) == [
        "--accept-openai-requests",
        "--derive-affinity-key",
        "--lb-config-path=/tmp/lb.json",
    ]
    assert affinity.replica_args(config, precise=True) == [
        *affinity.replica_args(config),
        "--derive-affinity-key-block-bytes",
        "64",
        "--derive-affinity-key-depth",
        "256",
    ]
    endpoints = affinity.kv_endpoints()
    assert len(set(endpoints)) == len(ENGINE_IDS)
    assert all(e.startswith("tcp://127.0.0.1:") for e in endpoints)


def _debug_routing(counts: dict[str, int], model: str = affinity.MODEL) -> dict[str, Any]:
    backends = [{"inference_server_id": e, "kv_blocks": n, "stats": {}} for e, n in counts.items()]
    return {"targets": [{"model_id": model, "clusters": [{"backends": backends}]}]}


def test_the_kv_block_counts_come_from_debug_routing() -> None:
    counts = dict(zip(ENGINE_IDS, (3, 1, 0, 7), strict=True))
    assert affinity.kv_block_counts(_debug_routing(counts)) == counts
    assert affinity.kv_block_counts(_debug_routing(counts, "other-model")) == {}
    assert affinity.kv_block_counts({"targets": []}) == {}
    assert not affinity.every_engine_has(counts, "some")  # engine-2 has none yet
    assert affinity.every_engine_has(counts | {"engine-2": 1}, "some")
    assert affinity.every_engine_has(dict.fromkeys(ENGINE_IDS, 0), "none")
    assert not affinity.every_engine_has(counts, "none")
    three = dict.fromkeys(ENGINE_IDS[:3], 0)  # an engine the replica does not know yet
    assert not affinity.every_engine_has(three, "none")
    assert not affinity.every_engine_has(dict.fromkeys(ENGINE_IDS[:3], 5), "some")


# ---- one pass of the real client ----------------------------------------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers a streaming chat request like the mock (its headers, `data:` events), naming an
    engine by conversation, and records what arrived and when it was answered."""

    protocol_version = "HTTP/1.1"
    log: ClassVar[list[dict[str, Any]]] = []
    lock: ClassVar[threading.Lock] = threading.Lock()
    in_flight: ClassVar[int] = 0
    most_in_flight: ClassVar[int] = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        arrived = time.monotonic()
        time.sleep(0.03)
        conversation = int(body["messages"][1]["content"].split("]")[0].lstrip("["))
        events = b'data: {"x": 1}\n\ndata: {"x": 2}\n\ndata: [DONE]\n\n'
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(events)))
        self.send_header("x-mock-engine-id", ENGINE_IDS[conversation % 4])
        self.send_header("x-mock-prefix-cache-hit-chars", str(BLOCK_CHARS))
        self.send_header("x-mock-prefix-cache-prompt-chars", str(len(chat_cache_text(body))))
        self.end_headers()
        self.wfile.write(events)
        self.wfile.flush()
        with cls.lock:
            cls.in_flight -= 1
            cls.log.append(
                {
                    "path": self.path,
                    "headers": dict(self.headers),
                    "body": body,
                    "arrived": arrived,
                    "answered": time.monotonic(),
                }
            )

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    _Recorder.log, _Recorder.in_flight, _Recorder.most_in_flight = [], 0, 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_pass_plays_each_conversation_in_order_as_a_plain_openai_client(recorder: str) -> None:
    trace = affinity.build_trace(SMALL)
    outcomes, complete = affinity.replay(recorder, trace, SMALL.users, Deadline(60))
    assert complete
    assert len(outcomes) == len(_Recorder.log) == trace.requests
    assert _Recorder.most_in_flight == SMALL.users  # the users play at once, never more
    by_request: dict[tuple[int, int], dict[str, Any]] = {}
    for entry in _Recorder.log:
        assert entry["path"] == "/v1/chat/completions"
        assert [name for name in entry["headers"] if name.lower().startswith("x-")] == []
        messages = entry["body"]["messages"]
        conversation = int(messages[1]["content"].split("]")[0].lstrip("["))
        turn = (len(messages) - 2) // 2
        by_request[(conversation, turn)] = entry
        assert entry["body"] == affinity.chat_body(trace.conversations[conversation], turn)
    for (conversation, turn), entry in by_request.items():
        if turn:  # a turn starts once the previous one was answered
            assert entry["arrived"] >= by_request[(conversation, turn - 1)]["answered"]
    for outcome in outcomes:
        assert outcome.ok
        assert outcome.engine == ENGINE_IDS[outcome.conversation % 4]
        assert outcome.hit_blocks == 1
        text = affinity.prompt_text(trace.conversations[outcome.conversation], outcome.turn)
        assert (outcome.prompt_chars, outcome.prompt_blocks) == (
            len(text),
            len(text) // BLOCK_CHARS,
        )
        assert 25 <= outcome.ttft_ms < 5000
    users = {o.user for o in outcomes}
    assert users == set(range(SMALL.users))
    assert affinity.stickiness(outcomes) == 1.0


def test_a_paired_pass_sends_each_request_and_its_shadow_together(recorder: str) -> None:
    trace = affinity.build_trace(SMALL)
    outcomes, complete = affinity.replay(
        recorder, trace, SMALL.users, Deadline(60), shadow_base=recorder
    )
    assert complete
    assert len(outcomes) == trace.requests and len(_Recorder.log) == 2 * trace.requests
    assert _Recorder.most_in_flight == 2 * SMALL.users  # each user's pair at once
    arrivals: dict[tuple[int, int, bool], dict[str, Any]] = {}
    for entry in _Recorder.log:
        messages = entry["body"]["messages"]
        conversation = int(messages[1]["content"].split("]")[0].lstrip("["))
        turn = (len(messages) - 2) // 2
        shadow = entry["body"]["max_tokens"] == 1
        body = affinity.chat_body(trace.conversations[conversation], turn)
        assert entry["body"] == (affinity.shadow_body(body) if shadow else body)
        assert [name for name in entry["headers"] if name.lower().startswith("x-")] == []
        arrivals[(conversation, turn, shadow)] = entry
    assert len(arrivals) == 2 * trace.requests
    for (conversation, turn, _), entry in arrivals.items():
        # Sent together: each arrived before the other was answered (the server takes 30 ms).
        other = arrivals[(conversation, turn, not _)]
        assert entry["arrived"] < other["answered"]
        if turn:  # the next turn waits for both of the previous turn's answers
            for before in (True, False):
                assert entry["arrived"] >= arrivals[(conversation, turn - 1, before)]["answered"]
    for outcome in outcomes:
        assert outcome.ok and outcome.shadow is not None and outcome.shadow.ok
        assert (outcome.shadow.conversation, outcome.shadow.turn) == (
            outcome.conversation,
            outcome.turn,
        )
        assert outcome.shadow.engine == outcome.engine == ENGINE_IDS[outcome.conversation % 4]
        assert outcome.shadow.prompt_chars == outcome.prompt_chars
    assert affinity.agreement(outcomes) == (1.0, trace.requests)
    skews = affinity.send_skews_ms(outcomes)
    assert len(skews) == trace.requests and skews[-1] < 1000
    # Without a shadow base, no shadow.
    _Recorder.log = []
    plain, _ = affinity.replay(recorder, trace, SMALL.users, Deadline(60))
    assert all(o.shadow is None for o in plain) and len(_Recorder.log) == trace.requests


def test_a_pass_counts_the_whole_blocks_it_is_given(recorder: str) -> None:
    trace = Trace((), affinity.build_trace(SMALL).conversations[:2])
    blocks = {(c.index, t): 7 + t for c in trace.conversations for t in range(SMALL.turns)}
    outcomes, complete = affinity.replay(recorder, trace, 2, Deadline(60), blocks)
    assert complete and len(outcomes) == 2 * SMALL.turns
    assert all(o.prompt_blocks == 7 + o.turn for o in outcomes)


def test_a_pass_past_its_deadline_says_it_is_incomplete(recorder: str) -> None:
    trace = affinity.build_trace(SMALL)
    outcomes, complete = affinity.replay(recorder, trace, SMALL.users, Deadline(0))
    assert not complete and outcomes == []


# ---- common.Processes.stop_together -------------------------------------------------------------

STUBBORN = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def test_stop_together_shares_one_timeout_then_kills() -> None:
    procs = Processes()
    started = [
        procs.spawn([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    polite = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for process in started:
            assert process.stdout is not None and process.stdout.readline() == "ready\n"
        began = time.monotonic()
        procs.stop_together([*started, polite], 0.5)
        assert time.monotonic() - began < 3  # one shared timeout, not one per process
        assert [p.returncode for p in started] == [-signal.SIGKILL] * 3
        assert polite.returncode == -signal.SIGTERM
    finally:
        procs.stop_all()
