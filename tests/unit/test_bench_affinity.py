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


def test_agreement_compares_the_requests_answered_in_both_passes() -> None:
    first = [_outcome(0, 0, "engine-0"), _outcome(0, 1, "engine-1"), _outcome(1, 0, "engine-2")]
    second = [
        _outcome(0, 0, "engine-0"),
        _outcome(0, 1, "engine-3"),
        _outcome(1, 0, "engine-2", done=False),  # cut: not compared
    ]
    assert affinity.agreement(first, second) == (0.5, 2)
    same, compared = affinity.agreement(first, [])
    assert math.isnan(same) and compared == 0


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
    assert "engine-3 (slow)" in text and "| power-of-n |" in text
    assert "- prefix-aware agreement across replicas: pass (0.990; goal >= 0.99)" in text


def test_the_lb_config_makes_the_algorithm_the_model_s_default() -> None:
    for algorithm in ("power-of-n", "round-robin", "pulsar", "wait-and-widen"):
        definition, reason = affinity.stargate_definition(algorithm)
        assert definition is not None, reason
        config = affinity.lb_config(algorithm, definition)
        assert config["models"] == {affinity.MODEL: definition}
    definition, reason = affinity.stargate_definition("no-such-algorithm")
    assert definition is None and reason


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
