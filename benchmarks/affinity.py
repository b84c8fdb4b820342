"""Affinity part: issue 26's multi-turn chat trace through stargate's load balancers and through
sglang-router, side by side, against engines with prefix caches.

`python -m benchmarks affinity [--quick]` (or `nox -s bench -- affinity`).

**The trace** (seeded, byte-identical for every router): 20 shared system prompts of ~1,600
characters; 200 conversations of 5 turns, each on a seeded random system prompt; turn k's messages
are the system prompt, every earlier user message and assistant answer, then the new user message
(the answers are the trace's own fixed text, so the trace does not depend on what an engine
answers). 16 concurrent users: each takes the next conversation from a shared queue and plays its
turns in order, a turn starting when the previous one has completed. Every request is what a
plain OpenAI client sends: a streaming `POST /v1/chat/completions` with the model in the body and
no `x-*` header at all (no `x-cache-affinity-key`). `--quick`: 8 system prompts, 40
conversations, 8 users.

**The engines**: four `stargate mock-backend` processes, each modelling an LRU prefix cache of
512 blocks of 64 characters (`--prefix-cache-blocks 512`; TTFT = 200 ms x (1 - cached share x
0.9), then 8 tokens 5 ms apart; docs/mock-backend.md) and naming itself on every answer
(`--engine-id engine-N`: `x-mock-engine-id`, which tells which engine served a request behind any
router). Before every pass each engine's cache and counters are reset (`/test-control {"reset":
true}`).

**The routers**, each a pass of the whole trace:

* stargate: a fresh `stargate serve` (`--accept-openai-requests --derive-affinity-key`, an LB
  config file whose entry for the model is the algorithm under test, so plain clients get it by
  default) and four fresh `stargate pylon`s, one in front of each engine
  (`--inference-server-id engine-N`, canaries off), which register with the replica and measure
  every request they forward (the stats the balancers read are real); the benchmark's own probes
  (`x-routing-method: round-robin`, before the engines are reset) wait until every engine is
  routable through every replica. Algorithms: power-of-n, round-robin, pulsar (seed "bench"),
  wait-and-widen (seed "bench", `cache_affinity_backend_selection_count` 1), prefix-aware, and
  prefix-aware in precise mode (below); an algorithm this checkout's `create_balancer` does not
  know (yet) is skipped with a note.
* stargate prefix-aware, precise (docs/prefix-routing.md, "Precise mode"): the same LB config,
  but against four more engines, started for its first pass with the same settings plus
  `--kv-events-endpoint tcp://127.0.0.1:<free port>` (one each), `--kv-events-block-bytes 64` and
  `--kv-events-depth 256`: each publishes its cache's changes as vLLM's KV events, and its cache
  is keyed by the router's prefix chain, so it holds 512 blocks of 64 *bytes of the router's
  prompt stream* (the other engines' blocks are 64 *characters of the mock's rendering*: the same
  framing, and for this ASCII trace the same length). Each Pylon follows its engine's events
  (`--kv-events-endpoint`), the replicas derive the same chain (`--derive-affinity-key-block-bytes
  64 --derive-affinity-key-depth 256`), and the balancer sees each engine's cached blocks
  (`BackendSnapshot.kv_blocks`; step 4b promotes the engine holding the longest leading run of
  the request's chain). Before handing the routers over, round-robin probes with new prompts of a
  few blocks run until every replica's `/debug/routing` shows cached blocks (`kv_blocks` > 0) of
  every engine (ZMQ's slow joiner misses what is published before the subscription is up); each
  pass then resets the engines (which publishes AllBlocksCleared) and starts once every replica
  shows 0 blocks for every engine. Whole prompt blocks there are the chain's length.
* sglang-router (`python -m sglang_router.launch_router --worker-urls <the four engines> --policy
  cache_aware|round_robin`, 0.3.2 on PyPI; `nox -s bench` installs it), straight in front of the
  engines. At start it asks each worker for `GET /health`, then `/server_info`, `/get_server_info`,
  `/model_info` and `/get_model_info` (the mock answers those 404, which it tolerates: the model is
  "unknown"); the benchmark waits for `GET /readiness` to count four healthy workers. Without an
  importable `sglang_router` these rows are skipped with a note.

**Measured per router**: the block hit rate (cached prompt blocks / whole prompt blocks, summed
over the engines: from each answer's `x-mock-prefix-cache-hit-chars`; a prompt's whole blocks from
the trace's own text, cross-checked against `x-mock-prefix-cache-prompt-chars`; in precise mode
from the router's chain of the request), TTFT p50/p99 at
the client (request sent to the first `data:` event), turn stickiness (the share of turns k > 1
served by the engine that served turn k-1 of the same conversation), each engine's share of the
requests and max/min requests per engine. The bound: the block hit rate of one infinite cache
seeing the whole trace (offline, `stargate.mock.prefix_cache`), also with precise mode's blocks
(the mock's cache keyed by the router's chain).

**Agreement across replicas** (prefix-aware, its precise mode and pulsar): replica B runs beside
replica A (same config, separate processes, the same four Pylons registered with both; the main
table's row is A's pass alone). A further pass, the engines reset, sends every request of the trace
to replica A (the measured request: its hit rate, TTFT and stickiness count as in any pass) and,
started together with it from the same thread pool, a shadow copy to replica B: the same body with
`"max_tokens": 1` (the same prompt, hence the same derived key and chain; only the answer is
shorter). The turn is over once both have answered. Agreement is the share of requests whose shadow
reached the engine that served A's request (both answered). A routing decision takes microseconds,
and what the replicas decide on changes at the Pylons' messages (stats, and in precise mode the
engines' KV events, a heartbeat after they happen), so both replicas decide on the same state; the
send skew of each pair is measured. Agreement counts the engine that answered: a request a Pylon
refuses (queue admission's retryable 429) ends on another engine than its replica chose, so both
replicas' retries in that pass are reported beside it. The shadows perturb the pass: a disagreeing
one puts the prompt into a second engine's cache, and they double the engines' requests, so that
pass's hit rate and stickiness are reported apart from the main table. The mock looks a prompt up
and stores its blocks when the request arrives, so of a pair on one engine the later arrival finds
the whole prompt cached: A's block hit rate there counts the lesser of the pair's hits (what the
earlier one found: the state before the pair), the raw figure beside it.

**A slow engine** (prefix-aware, its precise mode and power-of-n): engine-3's TTFT and
inter-token time four times the others' (`/test-control`), fresh replica and Pylons: each
engine's share of the requests.

The issue's goals, for prefix-aware and for its precise mode (printed as pass/MISS, a miss does
not fail the run): block hit rate at least sglang-router cache_aware's - 0.02, stickiness >=
0.95, max/min <= 1.3, the slow engine's share <= 0.15, agreement >= 0.99. Writes
bench-results/affinity.{md,json,png}.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import math
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BenchError,
    Deadline,
    PartResult,
    Processes,
    Profiler,
    Replica,
    Suite,
    free_ports,
    log_tail,
    md_table,
    mock_backend_command,
    num,
    percentile,
    server_python,
    start_printing_server,
    start_replica,
    wait_until,
)

NAME = "affinity"
TITLE = "issue 26's chat trace: prefix-cache hits, TTFT, stickiness and spread, stargate vs sglang"

MODEL = "affinity-model"
ENGINES = 4
ENGINE_IDS = tuple(f"engine-{i}" for i in range(ENGINES))
CACHE_BLOCKS = 512
BLOCK_CHARS = 64
SPEEDUP = 0.9
TTFT_MS = 200.0
INTER_TOKEN_MS = 5.0
TOKENS = 8
SLOWDOWN = 4.0
SLOW_ENGINE = ENGINE_IDS[-1]
SEED = "bench"
PYLON_STOP_SECONDS = 3.0

PRECISE_SUFFIX = ", precise"
PRECISE = "prefix-aware" + PRECISE_SUFFIX
"""prefix-aware in precise mode: engines that publish KV events, Pylons that follow them."""
KV_BLOCK_BYTES = 64
"""Precise mode's block: bytes of the router's prompt stream (the mock's and the replica's)."""
KV_DEPTH = 256
"""Precise mode's chain depth: KV_BLOCK_BYTES x KV_DEPTH = 16 KiB of a prompt, more than the
longest of the trace's."""
KV_EVENTS_TIMEOUT = 30.0
"""How long the engines' first KV events may take to reach every replica."""
CHAT_PATH = "/v1/chat/completions"

STARGATE_ALGORITHMS = (
    "power-of-n",
    "round-robin",
    "pulsar",
    "wait-and-widen",
    "prefix-aware",
    PRECISE,
)
SGLANG_POLICIES = ("cache_aware", "round_robin")
SGLANG_VERSION = "0.3.2"
AGREEMENT_ALGORITHMS = ("prefix-aware", PRECISE, "pulsar")
SLOW_ALGORITHMS = ("prefix-aware", PRECISE, "power-of-n")
GOAL_ALGORITHM = "prefix-aware"
GOAL_ALGORITHMS = (GOAL_ALGORITHM, PRECISE)
GOAL_HIT_MARGIN = 0.02
GOAL_STICKINESS = 0.95
GOAL_MAX_MIN = 1.3
GOAL_SLOW_SHARE = 0.15
GOAL_AGREEMENT = 0.99

DEFINITIONS: dict[str, tuple[str | dict[str, Any], ...]] = {
    "power-of-n": ("power-of-n",),
    "round-robin": ("round-robin",),
    "pulsar": ({"algorithm": "pulsar", "seed": SEED},),
    "wait-and-widen": (
        {"algorithm": "wait-and-widen", "seed": SEED, "cache_affinity_backend_selection_count": 1},
    ),
    # Its settings are not known here yet: with the common seed if it takes one, else bare.
    "prefix-aware": ({"algorithm": "prefix-aware", "seed": SEED}, "prefix-aware"),
}
"""Each algorithm's LB-config entry for the model, the first of the candidates that parses (a
precise variant takes its algorithm's: precise mode is the engines', Pylons' and replicas' flags,
not a setting of the balancer)."""


def split_variant(name: str) -> tuple[str, bool]:
    """(the algorithm, whether precise) of a pass's algorithm name ("prefix-aware, precise")."""
    if name.endswith(PRECISE_SUFFIX):
        return name[: -len(PRECISE_SUFFIX)], True
    return name, False


def slug(name: str) -> str:
    """`name` as a directory name ("prefix-aware-precise")."""
    return name.replace(", ", "-").replace(" ", "-")


HIT_CHARS_HEADER = "x-mock-prefix-cache-hit-chars"
PROMPT_CHARS_HEADER = "x-mock-prefix-cache-prompt-chars"
ENGINE_HEADER = "x-mock-engine-id"
SERVER_HEADER = "x-inference-server-id"
"""The replica's name of the backend (the Pylon's `--inference-server-id`); the fallback when an
engine does not name itself."""

WORDS = tuple(
    "".join(random.Random(f"word-{i}").choices("abcdefghiklmnoprstuwy", k=2 + i % 8))
    for i in range(400)
)


@dataclass(frozen=True)
class Settings:
    system_prompts: int
    system_chars: int
    conversations: int
    turns: int
    users: int
    user_chars: tuple[int, int]
    answer_chars: tuple[int, int]
    seed: int
    budget: float


def settings_for(suite: Suite) -> Settings:
    if suite.quick:
        return Settings(8, 1600, 40, 5, 8, (200, 600), (100, 300), 26, 420.0)
    return Settings(20, 1600, 200, 5, 16, (200, 600), (100, 300), 26, 1200.0)


# ---- the trace ----------------------------------------------------------------------------------


def _text(rng: random.Random, chars: int) -> str:
    """`chars` characters of seeded words."""
    words: list[str] = []
    length = 0
    while length <= chars:  # the join is one space shorter than the words and their spaces
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:chars]


@dataclass(frozen=True)
class Conversation:
    index: int
    system: str
    turns: tuple[tuple[str, str], ...]
    """(user message, assistant answer) per turn."""

    def messages(self, turn: int) -> list[dict[str, str]]:
        """Turn `turn`'s messages: the system prompt, every earlier exchange, its user message."""
        messages = [{"role": "system", "content": self.system}]
        for user, answer in self.turns[:turn]:
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": answer},
            ]
        messages.append({"role": "user", "content": self.turns[turn][0]})
        return messages


@dataclass(frozen=True)
class Trace:
    systems: tuple[str, ...]
    conversations: tuple[Conversation, ...]

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


def build_trace(settings: Settings) -> Trace:
    """The seeded trace: the same text for every router and every run."""
    rng = random.Random(settings.seed)
    systems = tuple(
        f"System prompt {i}: you are assistant {i}. "
        + _text(rng, settings.system_chars - len(f"System prompt {i}: you are assistant {i}. "))
        for i in range(settings.system_prompts)
    )
    conversations = tuple(
        Conversation(
            index,
            rng.choice(systems),
            tuple(
                (
                    f"[{index}] " + _text(rng, rng.randint(*settings.user_chars)),
                    _text(rng, rng.randint(*settings.answer_chars)),
                )
                for _ in range(settings.turns)
            ),
        )
        for index in range(settings.conversations)
    )
    return Trace(systems, conversations)


def prompt_text(conversation: Conversation, turn: int) -> str:
    """The text the mock's prefix cache sees for a turn (its chat framing)."""
    from stargate.mock.shapes import chat_cache_text

    return chat_cache_text({"messages": conversation.messages(turn)})


def router_chain(conversation: Conversation, turn: int) -> tuple[int, ...]:
    """The blocks of a turn in precise mode: the router's prefix chain of its request body
    (KV_BLOCK_BYTES bytes of the router's prompt stream each), which is what an engine started
    with `--kv-events-endpoint` keys its cache by, and what it publishes."""
    from stargate.prefix_key import derive_prefix

    body = json.dumps(chat_body(conversation, turn)).encode()
    derived = derive_prefix(CHAT_PATH, body, KV_BLOCK_BYTES, KV_DEPTH)
    return () if derived is None else derived.chain


def prompt_blocks(trace: Trace, precise: bool = False) -> dict[tuple[int, int], int]:
    """Each request's whole prompt blocks, by (conversation, turn): of the mock's text in
    BLOCK_CHARS characters, or (precise) the length of the router's chain."""
    return {
        (c.index, t): len(router_chain(c, t)) if precise else len(prompt_text(c, t)) // BLOCK_CHARS
        for c in trace.conversations
        for t in range(len(c.turns))
    }


def infinite_cache_bound(trace: Trace, precise: bool = False) -> float:
    """The block hit rate of one infinite cache seeing every request of the trace (the mock's
    lookup: leading whole blocks until the first miss); with `precise`, the mock's cache keyed by
    the router's chain, as in precise mode. Every order a run can take gives the same figure: a
    turn's text extends its previous turn's, and of a system prompt only its first conversation's
    first turn misses, whichever conversation that is."""
    from stargate.mock.prefix_cache import Lookup, PrefixCache

    requests = [
        (conversation, turn)
        for conversation in trace.conversations
        for turn in range(len(conversation.turns))
    ]
    chains = [router_chain(c, t) for c, t in requests] if precise else []
    texts = [prompt_text(c, t) for c, t in requests]
    whole = (
        sum(len(chain) for chain in chains)
        if precise
        else sum(len(text) // BLOCK_CHARS for text in texts)
    )
    cache = PrefixCache(max(1, whole), KV_BLOCK_BYTES if precise else BLOCK_CHARS)

    def lookup(index: int) -> Lookup:
        if precise:
            return cache.lookup_and_insert_chain(chains[index], len(texts[index]))
        return cache.lookup_and_insert(texts[index])

    hits = sum(lookup(index).hit_blocks for index in range(len(requests)))
    return hits / whole if whole else math.nan


# ---- one pass of the trace ----------------------------------------------------------------------


@dataclass
class Outcome:
    """One request of a pass."""

    conversation: int
    turn: int
    user: int
    status: int = 0
    engine: str = ""
    ttft_ms: float = math.nan
    hit_chars: int = 0
    prompt_chars: int = -1
    """From the engine's header; -1 when it sent none."""
    prompt_blocks: int = 0
    """Whole blocks of the trace's own prompt text."""
    done: bool = False
    error: str = ""
    sent: float = math.nan
    """When the request was sent (`time.monotonic()`)."""
    shadow: Outcome | None = None
    """In a paired pass, the shadow copy of this request sent to replica B."""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.error

    @property
    def hit_blocks(self) -> int:
        return self.hit_chars // BLOCK_CHARS


def chat_body(conversation: Conversation, turn: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": conversation.messages(turn),
        "stream": True,
        "max_tokens": TOKENS,
    }


def shadow_body(body: dict[str, Any]) -> dict[str, Any]:
    """The shadow copy of a request's `body` sent to replica B: the same model, messages and
    `stream`, with `"max_tokens": 1` (the same prompt, hence the same derived key and chain)."""
    return {**body, "max_tokens": 1}


def _one_request(
    client: Any,
    url: str,
    conversation: Conversation,
    turn: int,
    user: int,
    blocks: int,
    shadow: bool = False,
) -> Outcome:
    """A plain OpenAI client's streaming chat request: the body, and no `x-*` header; with
    `shadow`, the request's shadow copy (`shadow_body`)."""
    import httpx

    body = chat_body(conversation, turn)
    if shadow:
        body = shadow_body(body)
    outcome = Outcome(conversation.index, turn, user, prompt_blocks=blocks)
    began = outcome.sent = time.monotonic()
    try:
        with client.stream("POST", url, json=body) as response:
            outcome.status = response.status_code
            headers = response.headers
            outcome.engine = headers.get(ENGINE_HEADER) or headers.get(SERVER_HEADER, "")
            outcome.hit_chars = int(headers.get(HIT_CHARS_HEADER, 0))
            outcome.prompt_chars = int(headers.get(PROMPT_CHARS_HEADER, -1))
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                if math.isnan(outcome.ttft_ms):
                    outcome.ttft_ms = (time.monotonic() - began) * 1000
                if line[5:].strip() == "[DONE]":
                    outcome.done = True
    except (httpx.HTTPError, ValueError) as error:
        outcome.error = repr(error)
    return outcome


def replay(
    base: str,
    trace: Trace,
    users: int,
    deadline: Deadline,
    blocks: dict[tuple[int, int], int] | None = None,
    shadow_base: str | None = None,
) -> tuple[list[Outcome], bool]:
    """One pass: `users` threads, each taking the next conversation from a shared queue and
    playing its turns in order (a turn starts when the previous one completed); (every outcome,
    whether the whole trace fitted in the time budget). `blocks`: each request's whole prompt
    blocks (default: the mock's text, `prompt_blocks`).

    With `shadow_base` (replica B), a paired pass: each request is submitted to a thread pool
    together with its shadow copy to `shadow_base` (`shadow_body`), and the turn is over once
    both have answered; each outcome carries its shadow's (`Outcome.shadow`)."""
    import httpx

    pending: queue.Queue[Conversation] = queue.Queue()
    for conversation in trace.conversations:
        pending.put(conversation)
    if blocks is None:
        blocks = prompt_blocks(trace)
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    cut = threading.Event()
    url = f"{base}{CHAT_PATH}"
    shadow_url = f"{shadow_base}{CHAT_PATH}" if shadow_base is not None else None
    connections = users * (4 if shadow_url is not None else 2)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(60.0, connect=10.0)
    with (
        httpx.Client(trust_env=False, timeout=timeout, limits=limits) as client,
        ThreadPoolExecutor(2 * users) as pool,  # its threads start with a paired pass's pairs
    ):

        def request(conversation: Conversation, turn: int, user: int) -> Outcome:
            whole = blocks[(conversation.index, turn)]
            if shadow_url is None:
                return _one_request(client, url, conversation, turn, user, whole)
            measured = pool.submit(_one_request, client, url, conversation, turn, user, whole)
            shadow = pool.submit(
                _one_request, client, shadow_url, conversation, turn, user, whole, shadow=True
            )
            outcome = measured.result()
            outcome.shadow = shadow.result()
            return outcome

        def play(user: int) -> None:
            while True:
                if deadline.left(1e9) <= 0:
                    cut.set()
                    return
                try:
                    conversation = pending.get_nowait()
                except queue.Empty:
                    return
                for turn in range(len(conversation.turns)):
                    outcome = request(conversation, turn, user)
                    with lock:
                        outcomes.append(outcome)

        threads = [threading.Thread(target=play, args=(u,), daemon=True) for u in range(users)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return outcomes, not cut.is_set() and pending.empty()


# ---- what a pass measured -----------------------------------------------------------------------


def block_hit_rate(outcomes: Sequence[Outcome]) -> float:
    """Cached prompt blocks / whole prompt blocks over the answered requests."""
    good = [o for o in outcomes if o.ok]
    whole = sum(o.prompt_blocks for o in good)
    return sum(o.hit_blocks for o in good) / whole if whole else math.nan


def stickiness(outcomes: Sequence[Outcome]) -> float:
    """The share of turns k > 1 (both answered) served by the engine of turn k-1."""
    engines = {(o.conversation, o.turn): o.engine for o in outcomes if o.ok and o.engine}
    pairs = [
        (engine, engines[(conversation, turn - 1)])
        for (conversation, turn), engine in engines.items()
        if turn > 0 and (conversation, turn - 1) in engines
    ]
    return sum(1 for a, b in pairs if a == b) / len(pairs) if pairs else math.nan


def _answered_pairs(outcomes: Sequence[Outcome]) -> list[tuple[Outcome, Outcome]]:
    """(request, its shadow) of a paired pass where both were answered and named an engine."""
    return [
        (o, o.shadow)
        for o in outcomes
        if o.ok and o.engine and o.shadow is not None and o.shadow.ok and o.shadow.engine
    ]


def agreement(outcomes: Sequence[Outcome]) -> tuple[float, int]:
    """Of a paired pass's requests answered together with their shadow, the share whose shadow
    reached the same engine (through replica B) as the request (through replica A); and how
    many were compared."""
    pairs = _answered_pairs(outcomes)
    if not pairs:
        return math.nan, 0
    return sum(1 for a, b in pairs if a.engine == b.engine) / len(pairs), len(pairs)


def unshadowed_block_hit_rate(outcomes: Sequence[Outcome]) -> float:
    """A paired pass's block hit rate without the race of a request and its own shadow: the
    mock stores a prompt's blocks when it arrives, so of a pair on one engine the later arrival
    finds the whole prompt cached; such a request counts the lesser of the two hits (the
    earlier arrival's: the cache before the pair). Otherwise as `block_hit_rate`."""
    good = [o for o in outcomes if o.ok]
    whole = sum(o.prompt_blocks for o in good)
    if not whole:
        return math.nan
    hits = 0
    for o in good:
        shadow = o.shadow
        if shadow is not None and shadow.status == 200 and shadow.engine == o.engine:
            hits += min(o.hit_blocks, shadow.hit_blocks)
        else:
            hits += o.hit_blocks
    return hits / whole


def send_skews_ms(outcomes: Sequence[Outcome]) -> list[float]:
    """|sent(request) - sent(its shadow)| in milliseconds, sorted, for every pair sent."""
    return sorted(
        abs(o.sent - o.shadow.sent) * 1000
        for o in outcomes
        if o.shadow is not None and not math.isnan(o.sent) and not math.isnan(o.shadow.sent)
    )


def per_engine(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """Answered requests per engine (every engine named, those with none at 0; an unexpected
    name is counted too)."""
    counts = dict.fromkeys(ENGINE_IDS, 0)
    for outcome in outcomes:
        if outcome.ok:
            name = outcome.engine or "(unnamed)"
            counts[name] = counts.get(name, 0) + 1
    return counts


def max_min_ratio(counts: dict[str, int]) -> float:
    """The busiest engine's requests over the least busy one's (inf when one got none)."""
    values = [counts.get(engine, 0) for engine in ENGINE_IDS]
    if not any(values):
        return math.nan
    return max(values) / min(values) if min(values) else math.inf


@dataclass
class PassResult:
    """One router's pass of the trace."""

    router: str
    kind: str
    """"stargate" or "sglang"."""
    algorithm: str
    requests: int = 0
    failed: int = 0
    complete: bool = True
    wall_s: float = math.nan
    block_hit_rate: float = math.nan
    ttft_p50_ms: float = math.nan
    ttft_p99_ms: float = math.nan
    stickiness: float = math.nan
    max_min: float = math.nan
    per_engine: dict[str, int] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)
    engine_lookups: dict[str, int] = field(default_factory=dict)
    """Each engine's own count of prefix-cache lookups (retries included)."""
    prompt_mismatches: int = 0
    """Answers whose prompt length differs from the trace's text (a router that changed it)."""
    retries: dict[str, int] = field(default_factory=dict)
    """stargate: the replica's retries during the pass, by reason (`proxy_retries_total`)."""
    first_failure: str = ""


def summarise(
    router: str,
    kind: str,
    algorithm: str,
    outcomes: Sequence[Outcome],
    wall: float,
    complete: bool,
    lookups: dict[str, int],
    trace_chars: dict[tuple[int, int], int],
) -> PassResult:
    result = PassResult(router, kind, algorithm, len(outcomes), complete=complete, wall_s=wall)
    good = [o for o in outcomes if o.ok]
    result.failed = len(outcomes) - len(good)
    bad = next((o for o in outcomes if not o.ok), None)
    if bad is not None:
        result.first_failure = f"status {bad.status} {bad.error or '(no [DONE])'}"[:300]
    result.block_hit_rate = block_hit_rate(outcomes)
    ttfts = sorted(o.ttft_ms for o in good if not math.isnan(o.ttft_ms))
    result.ttft_p50_ms = percentile(ttfts, 0.5)
    result.ttft_p99_ms = percentile(ttfts, 0.99)
    result.stickiness = stickiness(outcomes)
    result.per_engine = per_engine(outcomes)
    result.max_min = max_min_ratio(result.per_engine)
    total = sum(result.per_engine.values())
    result.shares = {e: n / total for e, n in result.per_engine.items()} if total else {}
    result.engine_lookups = lookups
    result.prompt_mismatches = sum(
        1
        for o in good
        if o.prompt_chars >= 0 and o.prompt_chars != trace_chars[(o.conversation, o.turn)]
    )
    return result


# ---- the engines --------------------------------------------------------------------------------


def engine_command(engine: str, kv_endpoint: str | None = None) -> list[str]:
    """The mock engine `engine`; with `kv_endpoint` (precise mode), publishing its cache's KV
    events there, its cache keyed by the router's chain (KV_BLOCK_BYTES, KV_DEPTH)."""
    flags = [
        "--ttft-ms",
        f"{TTFT_MS:g}",
        "--inter-token-ms",
        f"{INTER_TOKEN_MS:g}",
        "--tokens",
        str(TOKENS),
        "--prefix-cache-blocks",
        str(CACHE_BLOCKS),
        "--prefix-cache-block-chars",
        str(BLOCK_CHARS),
        "--prefix-cache-speedup",
        f"{SPEEDUP:g}",
        "--engine-id",
        engine,
    ]
    if kv_endpoint is not None:
        flags += [
            "--kv-events-endpoint",
            kv_endpoint,
            "--kv-events-block-bytes",
            str(KV_BLOCK_BYTES),
            "--kv-events-depth",
            str(KV_DEPTH),
        ]
    return mock_backend_command(MODEL, *flags)


def kv_endpoints() -> list[str]:
    """A KV-event endpoint per engine, on loopback ports free a moment ago."""
    return [f"tcp://127.0.0.1:{port}" for port in free_ports(ENGINES)]


def start_engines(
    procs: Processes,
    log_dir: Path,
    deadline: Deadline,
    endpoints: Sequence[str] | None = None,
) -> list[str]:
    """The four engines' URLs; with `endpoints` (one per engine), engines in precise mode."""
    urls: list[str] = []
    for index, engine in enumerate(ENGINE_IDS):
        endpoint = endpoints[index] if endpoints is not None else None
        name = engine if endpoint is None else f"{engine}-precise"
        _, port = start_printing_server(
            procs,
            engine_command(engine, endpoint),
            log_dir / f"{name}.log",
            f"the mock {name}",
            deadline.left(30),
        )
        urls.append(f"http://127.0.0.1:{port}")
    return urls


def _control(client: Any, url: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
    if payload is None:
        response = client.get(f"{url}/test-control")
    else:
        response = client.post(f"{url}/test-control", json=payload)
    if response.status_code != 200:
        raise BenchError(f"{url}/test-control answered {response.status_code}: {response.text}")
    answer: dict[str, Any] = response.json()
    return answer


def reset_engines(urls: Sequence[str], slow: bool) -> None:
    """Empty every cache and counter; with `slow`, engine-3 is SLOWDOWN times slower."""
    import httpx

    with httpx.Client(trust_env=False, timeout=10) as client:
        for engine, url in zip(ENGINE_IDS, urls, strict=True):
            payload: dict[str, Any] = {"reset": True}
            if slow and engine == SLOW_ENGINE:
                payload |= {
                    "ttft_ms": TTFT_MS * SLOWDOWN,
                    "inter_token_ms": INTER_TOKEN_MS * SLOWDOWN,
                }
            _control(client, url, payload)


def engine_lookups(urls: Sequence[str]) -> dict[str, int]:
    import httpx

    with httpx.Client(trust_env=False, timeout=10) as client:
        return {
            engine: int(_control(client, url)["counters"]["prefix_cache"]["lookups"])
            for engine, url in zip(ENGINE_IDS, urls, strict=True)
        }


# ---- the routers --------------------------------------------------------------------------------


def lb_config(algorithm: str, definition: str | dict[str, Any]) -> dict[str, Any]:
    """The replica's LB config: `definition` is the model's algorithm (what a plain client gets);
    round-robin may be asked for by header, which only the benchmark's own probes do. A precise
    variant's config is its algorithm's."""
    return {
        "default": split_variant(algorithm)[0],
        "request_algorithms": {"round-robin": "round-robin"},
        "models": {MODEL: definition},
    }


def stargate_definition(algorithm: str) -> tuple[str | dict[str, Any] | None, str]:
    """The first LB-config entry for `algorithm` that this checkout parses and builds a balancer
    for (`create_balancer`); (None, why) when none does."""
    reason = f"no definition for {algorithm}"
    for candidate in DEFINITIONS.get(split_variant(algorithm)[0], ()):
        try:
            from stargate.load_balancing.config import parse_lb_config, resolve
            from stargate.load_balancing.registry import create_balancer

            config = parse_lb_config(lb_config(algorithm, candidate))
            create_balancer(resolve(config, MODEL, None))
        except Exception as error:  # unknown name, unknown field, not built: try the next
            reason = f"{type(error).__name__}: {error}"
            continue
        return candidate, ""
    return None, reason


@dataclass
class StargateRouters:
    """Fresh replicas (one config) and a fresh Pylon per engine registered with all of them."""

    replicas: list[Replica]
    pylons: list[subprocess.Popen[Any]]

    @property
    def bases(self) -> list[str]:
        return [replica.base for replica in self.replicas]


def replica_args(config_path: Path, precise: bool = False) -> list[str]:
    """A replica's flags: plain OpenAI clients, derived keys, the LB config; in precise mode the
    chain the engines key their caches by (KV_BLOCK_BYTES, KV_DEPTH)."""
    args = [
        "--accept-openai-requests",
        "--derive-affinity-key",
        f"--lb-config-path={config_path}",
    ]
    if precise:
        args += [
            "--derive-affinity-key-block-bytes",
            str(KV_BLOCK_BYTES),
            "--derive-affinity-key-depth",
            str(KV_DEPTH),
        ]
    return args


def pylon_args(seeds: Sequence[str], kv_endpoint: str | None = None) -> tuple[str, ...]:
    """A Pylon's flags besides its engine and first replica: canaries off, the other replicas
    (`seeds`: `--stargate HOST:PORT` pairs), and in precise mode its engine's KV events."""
    args = ("--canary-interval-ms", "0", *seeds)
    if kv_endpoint is not None:
        args += ("--kv-events-endpoint", kv_endpoint)
    return args


@contextlib.contextmanager
def stargate_routers(
    procs: Processes,
    log_dir: Path,
    algorithm: str,
    definition: str | dict[str, Any],
    replicas: int,
    urls: Sequence[str],
    deadline: Deadline,
    endpoints: Sequence[str] | None = None,
) -> Iterator[StargateRouters]:
    """With `endpoints` (the engines' KV-event endpoints, one per engine: precise mode), each
    Pylon follows its engine's, and the routers are handed over once every replica has heard
    from every engine (`wait_kv_events`)."""
    from benchmarks.routing import RouterInfo, start_pylon

    log_dir.mkdir(parents=True, exist_ok=True)
    config_path = log_dir / "lb.json"
    config_path.write_text(json.dumps(lb_config(algorithm, definition)))
    routers = StargateRouters([], [])
    try:
        for letter in "AB"[:replicas]:
            routers.replicas.append(
                start_replica(
                    procs,
                    log_dir,
                    f"replica-{letter}",
                    deadline,
                    extra_args=replica_args(config_path, endpoints is not None),
                )
            )
        info = RouterInfo(server_python(), False, frozenset({"--http-listen-addr"}))
        seeds: list[str] = []
        for replica in routers.replicas[1:]:
            seeds += ["--stargate", f"127.0.0.1:{replica.grpc}"]
        for index, (engine, url) in enumerate(zip(ENGINE_IDS, urls, strict=True)):
            pylon = start_pylon(
                procs,
                info,
                log_dir,
                engine,
                url,
                routers.replicas[0].grpc,
                log_level="warning",
                extra_args=pylon_args(seeds, endpoints[index] if endpoints else None),
            )
            routers.pylons.append(pylon.process)
        for replica in routers.replicas:
            wait_routable(replica, deadline, log_dir)
        if endpoints is not None:
            wait_kv_events(routers.replicas, deadline, log_dir)
        yield routers
    finally:
        # The Pylons before the replicas (no health probe of a gone Pylon), all at once: a Pylon
        # can take tens of seconds to exit after SIGTERM, and nothing of it is measured any more.
        procs.stop_together(routers.pylons, PYLON_STOP_SECONDS)
        procs.stop_together([replica.process for replica in routers.replicas], 5)


def wait_routable(replica: Replica, deadline: Deadline, log_dir: Path) -> None:
    """Until round-robin probes through `replica` have reached every engine's Pylon."""
    import httpx

    seen: set[str] = set()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    headers = {"x-routing-method": "round-robin"}  # the probe's own; never the trace's

    def every_engine() -> bool:
        response = client.post(f"{replica.base}/v1/chat/completions", json=body, headers=headers)
        if response.status_code == 200:
            seen.add(response.headers.get(SERVER_HEADER, ""))
        else:
            time.sleep(0.2)
        return set(ENGINE_IDS) <= seen

    with httpx.Client(trust_env=False, timeout=10) as client:
        try:
            wait_until(
                every_engine,
                deadline.left(60),
                "every engine routable through the replica",
                replica.process,
                replica.log_path,
            )
        except BenchError as error:
            tails = "\n".join(
                f"{path.name}:\n{log_tail(path, 6)}" for path in sorted(log_dir.glob("pylon-*.log"))
            )
            raise BenchError(f"{error}\nseen: {sorted(seen)}\n{tails}") from None


def kv_block_counts(debug_routing: dict[str, Any]) -> dict[str, int]:
    """Backend id -> the count of cached blocks (`kv_blocks`) a replica's `/debug/routing`
    shows for MODEL."""
    return {
        backend["inference_server_id"]: int(backend.get("kv_blocks", 0))
        for target in debug_routing.get("targets", ())
        if target.get("model_id") == MODEL
        for cluster in target.get("clusters", ())
        for backend in cluster.get("backends", ())
    }


def every_engine_has(counts: dict[str, int], blocks: str) -> bool:
    """Whether `counts` (`kv_block_counts`) names every engine with some cached blocks
    (`blocks` "some") or none at all ("none")."""
    if not set(ENGINE_IDS) <= counts.keys():
        return False
    if blocks == "some":
        return all(counts[engine] > 0 for engine in ENGINE_IDS)
    return all(counts[engine] == 0 for engine in ENGINE_IDS)


def _counts(client: Any, replicas: Sequence[Replica]) -> list[dict[str, int]]:
    return [kv_block_counts(client.get(f"{r.base}/debug/routing").json()) for r in replicas]


def wait_kv_events(replicas: Sequence[Replica], deadline: Deadline, log_dir: Path) -> None:
    """Until every replica knows cached blocks of every engine: the engines' KV events reach the
    replicas through the Pylons. A subscriber misses what was published before its subscription
    was up (ZMQ's slow joiner) and an engine publishes a prompt's blocks only once, so round-robin
    probes through the first replica send a new prompt of a few blocks each time (the probe's own
    header; the pass resets the engines afterwards)."""
    import httpx

    sent = 0
    seen: list[dict[str, int]] = []
    headers = {"x-routing-method": "round-robin"}

    def known() -> bool:
        nonlocal sent
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"kv events {sent}: " + "warm up " * 40}],
            "max_tokens": 1,
        }
        sent += 1
        client.post(f"{replicas[0].base}{CHAT_PATH}", json=body, headers=headers)
        seen[:] = _counts(client, replicas)
        return all(every_engine_has(counts, "some") for counts in seen)

    with httpx.Client(trust_env=False, timeout=10) as client:
        try:
            wait_until(
                known,
                deadline.left(KV_EVENTS_TIMEOUT),
                "every engine's KV events on every replica",
                replicas[0].process,
                replicas[0].log_path,
            )
        except BenchError as error:
            tails = "\n".join(
                f"{path.name}:\n{log_tail(path, 6)}" for path in sorted(log_dir.glob("pylon-*.log"))
            )
            raise BenchError(
                f"{error}\nkv_blocks per replica after {sent} probes: {seen}\n{tails}"
            ) from None


def wait_kv_cleared(replicas: Sequence[Replica], deadline: Deadline) -> None:
    """Until every replica shows no cached block of any engine (after a reset of the engines,
    whose AllBlocksCleared reaches the replicas at the Pylons' next heartbeat)."""
    import httpx

    seen: list[dict[str, int]] = []

    def cleared() -> bool:
        seen[:] = _counts(client, replicas)
        return all(every_engine_has(counts, "none") for counts in seen)

    with httpx.Client(trust_env=False, timeout=10) as client:
        try:
            wait_until(
                cleared,
                deadline.left(KV_EVENTS_TIMEOUT),
                "the engines' reset on every replica",
                replicas[0].process,
                replicas[0].log_path,
            )
        except BenchError as error:
            raise BenchError(f"{error}\nkv_blocks per replica: {seen}") from None


def sglang_router_available() -> str:
    """ "" when `sglang_router` is importable here, else why not."""
    if importlib.util.find_spec("sglang_router") is None:
        return (
            f"sglang_router is not importable (pip install sglang-router=={SGLANG_VERSION}; "
            "`nox -s bench` installs it)"
        )
    return ""


def sglang_router_version() -> str:
    try:
        return importlib.metadata.version("sglang-router")
    except importlib.metadata.PackageNotFoundError:
        return "?"


@contextlib.contextmanager
def sglang_router(
    procs: Processes, log_dir: Path, policy: str, urls: Sequence[str], deadline: Deadline
) -> Iterator[str]:
    """`sglang_router.launch_router` in front of the engines; its base URL once `/readiness`
    counts every engine healthy."""
    import httpx

    log_dir.mkdir(parents=True, exist_ok=True)
    port, metrics_port = free_ports(2)
    log_path = log_dir / f"sglang-{policy}.log"
    with log_path.open("wb") as log:
        process = procs.spawn(
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker-urls",
                *urls,
                "--policy",
                policy,
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(metrics_port),
                "--log-level",
                "warn",
                "--shutdown-grace-period-secs",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(trust_env=False, timeout=5) as client:

            def ready() -> bool:
                response = client.get(f"{base}/readiness")
                healthy = response.json().get("healthy_workers", 0) if response.is_success else 0
                return bool(healthy == len(urls))

            wait_until(ready, deadline.left(60), f"sglang-router {policy}", process, log_path)
        yield base
    finally:
        procs.stop(process)


# ---- the part -----------------------------------------------------------------------------------


@dataclass
class Agreement:
    """A paired pass: every request through replica A, its shadow through replica B."""

    algorithm: str
    same_engine: float = math.nan
    """The agreement: the share of compared requests whose shadow reached A's engine."""
    compared: int = 0
    block_hit_rate: float = math.nan
    """A's, without the race of a request and its own shadow (`unshadowed_block_hit_rate`)."""
    paired: PassResult | None = None
    """A's requests of the paired pass (its block hit rate the raw one)."""
    shadows_failed: int = 0
    skew_p50_ms: float = math.nan
    skew_max_ms: float = math.nan
    """The send skew of a request and its shadow (`send_skews_ms`)."""
    retries_b: dict[str, int] = field(default_factory=dict)
    """Replica B's retries during the pass, by reason (A's are the paired pass's `retries`): a
    retried request or shadow ends on another engine than its replica chose."""


@dataclass
class Goal:
    what: str
    target: str
    value: float
    met: bool | None
    """None: not measured (the router or the algorithm was skipped)."""
    detail: str = ""


@dataclass
class Run:
    """Everything one run measured."""

    passes: list[PassResult] = field(default_factory=list)
    agreements: list[Agreement] = field(default_factory=list)
    slow: list[PassResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    bound: float = math.nan
    precise_bound: float = math.nan
    """The bound with precise mode's blocks (the mock's cache keyed by the router's chain)."""


def retries_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """A replica's retries by reason between two reads of its counters (`retries_by_reason`)."""
    return {
        reason: round(count - before.get(reason, 0.0))
        for reason, count in sorted(after.items())
        if count > before.get(reason, 0.0)
    }


class Bench:
    """The engines (started once) and every pass over them."""

    def __init__(
        self,
        procs: Processes,
        log_dir: Path,
        trace: Trace,
        settings: Settings,
        deadline: Deadline,
        profiler: Profiler,
    ) -> None:
        self.procs = procs
        self.profiler = profiler
        self.log_dir = log_dir
        self.trace = trace
        self.settings = settings
        self.deadline = deadline
        self.urls: list[str] = []
        self.precise_urls: list[str] = []
        """The engines of precise mode (started with its first pass)."""
        self.endpoints: list[str] = []
        """Their KV-event endpoints."""
        self.run = Run()
        self.chars = {
            (c.index, t): len(prompt_text(c, t))
            for c in trace.conversations
            for t in range(len(c.turns))
        }
        self.blocks = prompt_blocks(trace)
        self.precise_blocks = prompt_blocks(trace, precise=True)

    def engines(self, precise: bool) -> tuple[list[str], list[str] | None]:
        """(the engines' URLs, their KV-event endpoints or None) for a pass; precise mode's
        engines are started the first time they are asked for."""
        if not precise:
            return self.urls, None
        if not self.precise_urls:
            endpoints = kv_endpoints()
            self.precise_urls = start_engines(self.procs, self.log_dir, self.deadline, endpoints)
            self.endpoints = endpoints
        return self.precise_urls, self.endpoints

    def one_pass(
        self,
        base: str,
        router: str,
        kind: str,
        algorithm: str,
        *,
        slow: bool = False,
        replica: Replica | None = None,
        precise: Sequence[Replica] = (),
        shadow_base: str | None = None,
    ) -> tuple[PassResult, list[Outcome]]:
        """One pass through `base`; with `replica` (the one behind `base`), its retries during
        the pass by reason (a retried request may end on another engine). With `precise` (every
        replica of the pass's routers), the pass is in precise mode: precise mode's engines and
        blocks, and it starts once the engines' reset has reached every replica. With
        `shadow_base`, a paired pass (`replay`): the result is of the requests through `base`,
        each outcome carries its shadow's."""
        from benchmarks.routing import retries_by_reason

        urls = self.precise_urls if precise else self.urls
        reset_engines(urls, slow)
        if precise:
            wait_kv_cleared(precise, self.deadline)
        retries_before = retries_by_reason(replica) if replica is not None else {}
        started = time.monotonic()
        outcomes, complete = replay(
            base,
            self.trace,
            self.settings.users,
            self.deadline,
            self.precise_blocks if precise else self.blocks,
            shadow_base,
        )
        wall = time.monotonic() - started
        retries_after = retries_by_reason(replica) if replica is not None else {}
        result = summarise(
            router,
            kind,
            algorithm,
            outcomes,
            wall,
            complete,
            engine_lookups(urls),
            self.chars,
        )
        result.retries = retries_delta(retries_before, retries_after)
        self._check(result)
        shares = " ".join(f"{num(result.shares.get(e, 0) * 100)}" for e in ENGINE_IDS)
        print(
            f"  {router:<28}{' (slow engine)' if slow else ''} {result.requests - result.failed}"
            f"/{self.trace.requests} OK, blocks hit {num(result.block_hit_rate * 100, 1)} %, "
            f"TTFT p50 {num(result.ttft_p50_ms)} p99 {num(result.ttft_p99_ms)} ms, stickiness "
            f"{num(result.stickiness, 3)}, max/min {num(result.max_min, 2)}, shares % {shares} "
            f"({wall:.1f} s)" + (f", replica retries {result.retries}" if result.retries else ""),
            file=sys.stderr,
        )
        return result, outcomes

    def _check(self, result: PassResult) -> None:
        label = result.router
        if not result.complete:
            self.run.problems.append(
                f"{label}: the time budget ended the pass after {result.requests} of "
                f"{self.trace.requests} requests"
            )
        if result.failed:
            self.run.problems.append(
                f"{label}: {result.failed} requests failed (first: {result.first_failure})"
            )
        if result.prompt_mismatches:
            self.run.problems.append(
                f"{label}: {result.prompt_mismatches} answers counted a prompt of another length "
                "than the trace's"
            )
        unnamed = set(result.per_engine) - set(ENGINE_IDS)
        if unnamed:
            self.run.problems.append(f"{label}: answers from unknown engines {sorted(unnamed)}")

    def has_time(self, what: str, seconds: float) -> bool:
        if self.deadline.left(1e9) >= seconds:
            return True
        self.run.skipped.append(f"{what}: the time budget ran out")
        return False

    def stargate(self, algorithm: str) -> None:
        definition, reason = stargate_definition(algorithm)
        if definition is None:
            self.run.skipped.append(f"stargate {algorithm}: not available here ({reason})")
            print(f"  stargate {algorithm}: skipped ({reason})", file=sys.stderr)
            return
        label = f"stargate {algorithm}"
        if not self.has_time(label, 20):
            return
        replicas = 2 if algorithm in AGREEMENT_ALGORITHMS else 1
        precise = split_variant(algorithm)[1]
        urls, endpoints = self.engines(precise)
        with stargate_routers(
            self.procs,
            self.log_dir / slug(algorithm),
            algorithm,
            definition,
            replicas,
            urls,
            self.deadline,
            endpoints,
        ) as routers:
            replica = routers.replicas[0]
            watched = routers.replicas if precise else []
            with self.profiler.record(replica.pid, 120, f"the {algorithm} pass"):
                first, _ = self.one_pass(
                    replica.base, label, "stargate", algorithm, replica=replica, precise=watched
                )
            self.run.passes.append(first)
            if replicas == 2 and self.has_time(f"{label}, paired with replica B", 20):
                self.run.agreements.append(self.paired(routers, label, algorithm, watched))

    def paired(
        self, routers: StargateRouters, label: str, algorithm: str, watched: Sequence[Replica]
    ) -> Agreement:
        """The paired pass: every request through replica A, its shadow through replica B."""
        from benchmarks.routing import retries_by_reason

        before = retries_by_reason(routers.replicas[1])
        paired, outcomes = self.one_pass(
            routers.bases[0],
            f"{label}, paired",
            "stargate",
            algorithm,
            replica=routers.replicas[0],
            precise=watched,
            shadow_base=routers.bases[1],
        )
        after = retries_by_reason(routers.replicas[1])
        same, compared = agreement(outcomes)
        skews = send_skews_ms(outcomes)
        shadows = [o.shadow for o in outcomes if o.shadow is not None]
        failed = [s for s in shadows if not s.ok]
        result = Agreement(
            algorithm,
            same,
            compared,
            unshadowed_block_hit_rate(outcomes),
            paired,
            len(failed),
            percentile(skews, 0.5),
            skews[-1] if skews else math.nan,
            retries_delta(before, after),
        )
        if failed:
            self.run.problems.append(
                f"{label}, paired: {len(failed)} shadows through replica B failed (first: status "
                f"{failed[0].status} {failed[0].error or '(no [DONE])'})"[:400]
            )
        print(
            f"  {label}: {num(same * 100, 1)} % of {compared} requests' shadows through replica B "
            f"on replica A's engine; A's blocks hit {num(result.block_hit_rate * 100, 1)} % "
            f"(raw {num(paired.block_hit_rate * 100, 1)} %); send skew p50 "
            f"{num(result.skew_p50_ms, 1)} max {num(result.skew_max_ms, 1)} ms; replica retries "
            f"A {paired.retries or 0}, B {result.retries_b or 0}",
            file=sys.stderr,
        )
        return result

    def stargate_slow(self, algorithm: str) -> None:
        definition, reason = stargate_definition(algorithm)
        label = f"stargate {algorithm}"
        if definition is None:
            self.run.skipped.append(f"{label} with a slow engine: not available here ({reason})")
            return
        if not self.has_time(f"{label} with a slow engine", 20):
            return
        precise = split_variant(algorithm)[1]
        urls, endpoints = self.engines(precise)
        with stargate_routers(
            self.procs,
            self.log_dir / f"{slug(algorithm)}-slow",
            algorithm,
            definition,
            1,
            urls,
            self.deadline,
            endpoints,
        ) as routers:
            result, _ = self.one_pass(
                routers.bases[0],
                label,
                "stargate",
                algorithm,
                slow=True,
                replica=routers.replicas[0],
                precise=routers.replicas if precise else [],
            )
            self.run.slow.append(result)

    def sglang(self, policy: str) -> None:
        label = f"sglang-router {policy}"
        missing = sglang_router_available()
        if missing:
            self.run.skipped.append(f"{label}: {missing}")
            print(f"  {label}: skipped ({missing})", file=sys.stderr)
            return
        if not self.has_time(label, 20):
            return
        with sglang_router(
            self.procs, self.log_dir / "sglang", policy, self.urls, self.deadline
        ) as base:
            result, _ = self.one_pass(base, label, "sglang", policy)
            self.run.passes.append(result)

    def guarded(self, what: str, step: Any, *args: Any) -> None:
        """Run one router's passes; a failure to start it is a problem of this run, not its end."""
        import httpx

        try:
            step(*args)
        except (BenchError, OSError, httpx.HTTPError) as error:
            first = str(error).splitlines()[0] if str(error) else repr(error)
            self.run.problems.append(f"{what}: {first}")
            print(f"  {what} failed: {error}", file=sys.stderr)


def run(suite: Suite) -> PartResult:
    settings = settings_for(suite)
    deadline = Deadline(settings.budget)
    began = time.monotonic()
    trace = build_trace(settings)
    procs = Processes()
    profiler = Profiler(suite.profile, suite.out_dir, procs, NAME)
    bench: Bench | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="stargate-affinity-") as tmp:
            bench = Bench(procs, Path(tmp), trace, settings, deadline, profiler)
            bench.run.bound = infinite_cache_bound(trace)
            bench.run.precise_bound = infinite_cache_bound(trace, precise=True)
            print(
                f"  trace: {len(trace.conversations)} conversations x {settings.turns} turns over "
                f"{len(trace.systems)} system prompts, {settings.users} users; one infinite "
                f"cache would hit {bench.run.bound * 100:.1f} % of the blocks "
                f"({bench.run.precise_bound * 100:.1f} % of precise mode's)",
                file=sys.stderr,
            )
            bench.urls = start_engines(procs, Path(tmp), deadline)
            for algorithm in STARGATE_ALGORITHMS:
                bench.guarded(f"stargate {algorithm}", bench.stargate, algorithm)
            for policy in SGLANG_POLICIES:
                bench.guarded(f"sglang-router {policy}", bench.sglang, policy)
            for algorithm in SLOW_ALGORITHMS:
                bench.guarded(f"stargate {algorithm}, slow", bench.stargate_slow, algorithm)
    finally:
        procs.stop_all()
    measured = bench.run if bench is not None else Run()
    if not measured.passes:
        raise BenchError("no router was measured: " + "; ".join(measured.problems))
    goals = judge_all(measured)
    for goal in goals:
        print(f"  goal {goal.what}: {_verdict(goal)}", file=sys.stderr)
    chart = suite.out_dir / f"{NAME}.png"
    charts = [chart.name] if draw_chart(measured, chart) else []
    notes = [profiler.note] if profiler.note else []
    notes += [f"skipped: {what}" for what in measured.skipped]
    sglang = sglang_router_version() if not sglang_router_available() else ""
    return PartResult(
        NAME,
        TITLE,
        markdown(measured, goals, trace, settings, sglang),
        {
            "bound_block_hit_rate": measured.bound,
            "bound_block_hit_rate_precise": measured.precise_bound,
            "routers": [asdict(p) for p in measured.passes],
            "agreement": [
                {
                    "algorithm": a.algorithm,
                    "agreement": a.same_engine,
                    "compared": a.compared,
                    "block_hit_rate_a": a.block_hit_rate,
                    "block_hit_rate_a_raw": a.paired.block_hit_rate if a.paired else math.nan,
                    "stickiness_a": a.paired.stickiness if a.paired else math.nan,
                    "shadows_failed": a.shadows_failed,
                    "send_skew_p50_ms": a.skew_p50_ms,
                    "send_skew_max_ms": a.skew_max_ms,
                    "retries_a": a.paired.retries if a.paired else {},
                    "retries_b": a.retries_b,
                }
                for a in measured.agreements
            ],
            "paired_passes": [asdict(a.paired) for a in measured.agreements if a.paired],
            "slow_engine": [asdict(p) for p in measured.slow],
            "goals": [asdict(g) for g in goals],
            "skipped": measured.skipped,
            "requests_per_pass": trace.requests,
            "sglang_router_version": sglang,
        },
        settings={
            **asdict(settings),
            "engines": ENGINES,
            "cache_blocks_per_engine": CACHE_BLOCKS,
            "block_chars": BLOCK_CHARS,
            "precise_block_bytes": KV_BLOCK_BYTES,
            "precise_depth": KV_DEPTH,
            "speedup": SPEEDUP,
            "ttft_ms": TTFT_MS,
            "inter_token_ms": INTER_TOKEN_MS,
            "tokens": TOKENS,
            "slowdown": SLOWDOWN,
            "slow_engine": SLOW_ENGINE,
            "definitions": DEFINITIONS,
        },
        problems=measured.problems,
        charts=charts,
        notes=notes,
        elapsed=time.monotonic() - began,
    )


# ---- the verdict and the report -----------------------------------------------------------------


def _pass(run: Run, router: str) -> PassResult | None:
    return next((p for p in run.passes if p.router == router), None)


def judge_all(run: Run) -> list[Goal]:
    """The issue's goals for every algorithm judged (GOAL_ALGORITHMS), in that order."""
    return [goal for algorithm in GOAL_ALGORITHMS for goal in judge(run, algorithm)]


def judge(run: Run, algorithm: str = GOAL_ALGORITHM) -> list[Goal]:
    """The issue's goals for `algorithm` (met None when a figure is missing)."""
    goal = _pass(run, f"stargate {algorithm}")
    sglang = _pass(run, "sglang-router cache_aware")
    goals: list[Goal] = []

    def add(what: str, target: str, value: float, ok: bool, detail: str = "") -> None:
        met = None if math.isnan(value) else ok
        goals.append(Goal(what, target, value, met, detail or num(value, 3)))

    reference = sglang.block_hit_rate if sglang is not None else math.nan
    hit = goal.block_hit_rate if goal is not None else math.nan
    add(
        f"{algorithm} block hit rate vs sglang-router cache_aware",
        f"at least cache_aware's - {GOAL_HIT_MARGIN:g}",
        hit - reference,
        hit - reference >= -GOAL_HIT_MARGIN,
        f"{num(hit, 3)} vs {num(reference, 3)}",
    )
    value = goal.stickiness if goal is not None else math.nan
    add(f"{algorithm} stickiness", f">= {GOAL_STICKINESS:g}", value, value >= GOAL_STICKINESS)
    value = goal.max_min if goal is not None else math.nan
    add(
        f"{algorithm} max/min requests per engine",
        f"<= {GOAL_MAX_MIN:g}",
        value,
        value <= GOAL_MAX_MIN,
    )
    slow = next((p for p in run.slow if p.algorithm == algorithm), None)
    value = slow.shares.get(SLOW_ENGINE, math.nan) if slow is not None else math.nan
    add(
        f"{algorithm} slow engine's share",
        f"<= {GOAL_SLOW_SHARE:g}",
        value,
        value <= GOAL_SLOW_SHARE,
    )
    agreed = next((a for a in run.agreements if a.algorithm == algorithm), None)
    value = agreed.same_engine if agreed is not None else math.nan
    add(
        f"{algorithm} agreement across replicas",
        f">= {GOAL_AGREEMENT:g}",
        value,
        value >= GOAL_AGREEMENT,
    )
    return goals


def _verdict(goal: Goal) -> str:
    if goal.met is None:
        return f"n/a (not measured; goal {goal.target})"
    return f"{'pass' if goal.met else 'MISS'} ({goal.detail}; goal {goal.target})"


def _retries(result: PassResult) -> str:
    if result.kind != "stargate":
        return "-"
    return ", ".join(f"{n:,} {reason}" for reason, n in result.retries.items()) or "0"


def _shares(result: PassResult) -> list[str]:
    return [num(result.shares.get(e, math.nan), 3) for e in ENGINE_IDS]


def markdown(run: Run, goals: list[Goal], trace: Trace, settings: Settings, sglang: str) -> str:
    main = md_table(
        [
            "Router",
            "Block hit rate",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "Stickiness",
            "Max/min requests per engine",
        ],
        [
            [
                p.router,
                num(p.block_hit_rate, 3),
                num(p.ttft_p50_ms),
                num(p.ttft_p99_ms),
                num(p.stickiness, 3),
                num(p.max_min, 2),
            ]
            for p in run.passes
        ],
    )
    spread = md_table(
        ["Router", "OK requests", *[f"{e} share" for e in ENGINE_IDS], "Replica retries", "Pass s"],
        [
            [
                p.router,
                f"{p.requests - p.failed:,}/{trace.requests:,}",
                *_shares(p),
                _retries(p),
                num(p.wall_s),
            ]
            for p in run.passes
        ],
    )
    sections = [
        f"{ENGINES} `stargate mock-backend` engines, each an LRU prefix cache of {CACHE_BLOCKS} "
        f"blocks of {BLOCK_CHARS} characters (TTFT {TTFT_MS:g} ms x (1 - cached share x "
        f"{SPEEDUP:g}), {TOKENS} tokens {INTER_TOKEN_MS:g} ms apart). Trace: "
        f"{len(trace.conversations)} conversations x {settings.turns} turns "
        f"({trace.requests:,} streaming chat requests, each resending the whole history) over "
        f"{len(trace.systems)} shared system prompts of ~{settings.system_chars:,} characters, "
        f"{settings.users} concurrent users; plain OpenAI requests (no `x-*` header). stargate: "
        "a fresh replica (`--accept-openai-requests --derive-affinity-key`, the algorithm as the "
        "model's LB config entry) and a fresh `stargate pylon` per engine for every pass; "
        f"sglang-router {sglang or '(not installed)'} straight in front of the engines. Caches "
        "and counters reset before every pass. Block hit rate = cached prompt blocks / whole "
        "prompt blocks; TTFT at the client (to the first `data:` event); stickiness = turns "
        "served by the engine of the conversation's previous turn.",
    ]
    if any(split_variant(p.algorithm)[1] for p in [*run.passes, *run.slow]):
        sections.append(
            "**Precise mode** (`prefix-aware, precise`): four more engines with the same settings "
            "that publish their cache's KV events (`--kv-events-endpoint`, one each), so their "
            f"cache holds {CACHE_BLOCKS} blocks of {KV_BLOCK_BYTES} *bytes of the router's "
            "prompt stream*, keyed by the router's prefix chain (`--kv-events-block-bytes "
            f"{KV_BLOCK_BYTES} --kv-events-depth {KV_DEPTH}`), where the other passes' engines "
            f"cut {BLOCK_CHARS} *characters of the mock's rendering* of the prompt (the same "
            "framing and, for this ASCII trace, the same length); their Pylons follow the events "
            "(`--kv-events-endpoint`), the replicas derive the same chain "
            f"(`--derive-affinity-key-block-bytes {KV_BLOCK_BYTES} --derive-affinity-key-depth "
            f"{KV_DEPTH}`), and the balancer reads each engine's cached blocks "
            "(`BackendSnapshot.kv_blocks`). Each pass starts once every replica has seen every "
            "engine's events and then the engines' reset (`/debug/routing`'s `kv_blocks`)."
        )
    bound = f"**Bound**: one infinite cache seeing the whole trace hits {num(run.bound, 3)} of the "
    if math.isnan(run.precise_bound):
        bound += "blocks."
    else:
        bound += (
            f"blocks ({num(run.precise_bound, 3)} of precise mode's blocks: the mock's cache "
            "keyed by the router's chain)."
        )
    sections += [bound, main, spread]
    if run.agreements:
        sections.append(agreement_section(run.agreements))
    if run.slow:
        sections.append(
            f"**A slow engine**: {SLOW_ENGINE}'s TTFT and inter-token time x{SLOWDOWN:g}; each "
            "engine's share of the requests:\n\n"
            + md_table(
                [
                    "Algorithm",
                    *[f"{e}{' (slow)' if e == SLOW_ENGINE else ''}" for e in ENGINE_IDS],
                    "Block hit rate",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                ],
                [
                    [
                        p.algorithm,
                        *_shares(p),
                        num(p.block_hit_rate, 3),
                        num(p.ttft_p50_ms),
                        num(p.ttft_p99_ms),
                    ]
                    for p in run.slow
                ],
            )
        )
    sections.append(
        "**The issue's goals**:\n\n"
        + "\n".join(f"- {goal.what}: {_verdict(goal)}" for goal in goals)
    )
    return "\n\n".join(sections)


def _retry_count(retries: dict[str, int]) -> str:
    return f"{sum(retries.values()):,}"


def agreement_section(agreements: Sequence[Agreement]) -> str:
    """The agreement across replicas: the paired passes' table and what it counts."""
    table = md_table(
        [
            "Algorithm",
            "Agreement",
            "Requests compared",
            "A's block hit rate",
            "A's stickiness",
        ],
        [
            [
                a.algorithm,
                num(a.same_engine, 3),
                f"{a.compared:,}",
                num(a.block_hit_rate, 3),
                num(a.paired.stickiness if a.paired else math.nan, 3),
            ]
            for a in agreements
        ],
    )
    raw = "; ".join(
        f"{a.algorithm} {num(a.paired.block_hit_rate, 3)}" for a in agreements if a.paired
    )
    skews = "; ".join(
        f"{a.algorithm} p50 {num(a.skew_p50_ms, 1)}, max {num(a.skew_max_ms, 1)}"
        for a in agreements
    )
    retries = "; ".join(
        f"{a.algorithm} {_retry_count(a.paired.retries if a.paired else {})} / "
        f"{_retry_count(a.retries_b)}"
        for a in agreements
    )
    failed = sum(a.shadows_failed for a in agreements)
    return (
        "**Agreement across replicas**: replica B (same config, the same Pylons) runs beside "
        "replica A. One more pass of the trace, engines reset, sends each request to replica A "
        "and, started together with it, a shadow copy to replica B: the same body with "
        '`"max_tokens": 1` (the same prompt, so the same derived key and chain); a turn is over '
        "once both have answered. Agreement = the share of the requests (both answered) whose "
        "shadow reached the engine that served A's request. A's block hit rate and stickiness "
        "are of that pass, apart from the main table: a disagreeing shadow puts the prompt into "
        "a second engine's cache (a small perturbation that hit rate includes), and the shadows "
        "double the engines' requests. The mock stores a prompt's blocks when it arrives, so of "
        "a pair on one engine the later arrival finds the whole prompt cached; A's block hit "
        "rate counts the lesser of the pair's hits there (the cache before the pair). Raw: "
        f"{raw or '-'}. Send skew of a request and its shadow, ms: {skews or '-'}. The replicas' "
        "retries during that pass, A / B (a retried request ends on another engine than its "
        f"replica chose; by reason in the JSON): {retries or '-'}."
        + (f" {failed:,} shadows failed." if failed else "")
        + "\n\n"
        + table
    )


def draw_chart(run: Run, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    passes = run.passes
    xs = list(range(len(passes)))
    width = 0.38
    figure, axis = plt.subplots(figsize=(max(7.0, 1.3 * len(passes) + 2), 4.8))
    axis.bar(
        [x - width / 2 for x in xs],
        [p.block_hit_rate for p in passes],
        width,
        label="block hit rate",
    )
    axis.bar([x + width / 2 for x in xs], [p.stickiness for p in passes], width, label="stickiness")
    if not math.isnan(run.bound):
        axis.axhline(run.bound, color="grey", linestyle=":", label="bound: one infinite cache")
    axis.axhline(
        GOAL_STICKINESS,
        color="tab:red",
        linestyle=":",
        linewidth=0.8,
        label=f"goal: stickiness {GOAL_STICKINESS:g}",
    )
    axis.set_ylim(0, 1.22)
    axis.set_xticks(xs, [p.router.replace(" ", "\n", 1) for p in passes], fontsize=8)
    axis.grid(True, axis="y", alpha=0.3)
    axis.legend(fontsize=7, loc="upper center", ncol=4)
    axis.set_title(f"stargate {NAME}: block hit rate and stickiness per router", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
