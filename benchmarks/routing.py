"""Routing part: does the replica route by real load through real Pylons, and what does the
Pylon's own hop cost?

`python -m benchmarks routing [--quick] [--profile] [--router-python PATH]
[--routing-window S] [--routing-algorithms a,b]` (or `nox -s bench -- routing`). Two phases:

1. **Routing by real load.** Three `stargate mock-backend` engines that behave like batching
   servers (`--max-num-seqs 4`: four running slots and a FIFO waiting queue; prefill time per
   prompt token, a decode time per token), one of them four times slower than the other two in
   its first-token delay, prefill and decode. Each is behind its own `stargate pylon`
   (`--min-update-interval-ms 1000`, its own `--inference-server-id`), which forwards the
   replica's requests to it, measures them and publishes `ModelStats` to one replica in OpenAI
   mode (`--accept-openai-requests`: plain OpenAI requests, the model from the body, the input
   tokens estimated from the body size and forwarded to the Pylon and the engine). Twelve
   closed-loop streaming clients (each sends its next request when its stream ends; after a
   failed one it pauses 100 ms, as a client would before retrying) send chat completions with
   prompts of 100 to 500 tokens (seeded, the same sequence for every algorithm), for every
   algorithm in turn (`x-routing-method`): a warm-up, then a measured window, then the window's
   requests finish (the engines' queues are empty before the next algorithm starts). Measured
   per algorithm: requests sent in the window, failed ones (any non-200, or a stream that broke
   or lacked its `data: [DONE]`; counted by status), the share of requests served by each engine
   (`x-inference-server-id`), TTFT at the client (request sent to the first SSE chunk with
   content) p50/p99 and completed streams per second; and once, mid-window, `GET
   /debug/routing`: what the balancers saw of each engine (`last_mean_input_tps`,
   `queue_size`, `num_running_queries`). The issue's goals: no algorithm fails a request;
   power-of-n and wait-and-widen give the slow engine at most 15 % of the requests (round-robin
   gives it a third) and halve round-robin's TTFT p99.

2. **The Pylon hop's own cost.** A mock engine with no delays (streams of 100 tokens), a Pylon
   in front of it (`--http-listen-addr` on a free port) registered with a replica. The load
   generators of the proxy part (benchmarks/proxy.py: wrk where installed, else the trio + h11
   client; SSE always the h11 client) send the replica's request form (`x-request-id`,
   `x-model`, `x-input-tokens`) straight to the Pylon, through the replica (replica -> Pylon ->
   engine) and straight to the engine. CPU from `/proc` (utime + stime) around each measured
   run: (a) CPU per non-streamed request of the Pylon and of the replica at 16 keep-alive
   connections; (b) CPU per streamed SSE chunk of each; (c) latency at one connection, the Pylon
   minus the engine direct. Goals: the Pylon adds at most 0.5 ms at p50; it costs no more CPU
   per streamed chunk than the replica (both read over the same replica -> Pylon -> engine
   run, so over the same chunks). `--profile` records a flame graph of the Pylon during that
   streamed run (bench-results/routing.svg).

`--router-python PATH` runs the replica and the Pylons (not the engines, not the load
generators) on another interpreter with whatever stargate its environment has installed, e.g.
an older one for a "before" figure: only flags both versions know are passed, the Pylon's
request path is used only when `stargate pylon --help` lists `--http-listen-addr` (an older
Pylon registers the engine's URL, so the replica forwards straight to it), a 404 from
`/debug/routing` leaves those figures empty, and phase 2 is skipped without a Pylon listener.
Writes bench-results/routing.{md,json,png}. Not in the default suite (about 5 minutes; run it by
name).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import h11
import trio

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
from benchmarks.proxy import (
    MODEL as HOP_MODEL,
)
from benchmarks.proxy import (
    PATH,
    LoadResult,
    LoadSpec,
    merged,
    run_h11,
    run_wrk,
    wrk_script,
)

NAME = "routing"
TITLE = "routing by real load through Pylons, and the Pylon hop's cost"

MODEL = "routing-model"
ALGORITHMS = (
    "round-robin",
    "random",
    "power-of-n",
    "wait-and-widen",
    "pulsar",
    "pulsar-wait-and-widen",
)
REFERENCE = "round-robin"
GOAL_ALGORITHMS = ("power-of-n", "wait-and-widen")
GOAL_SLOW_SHARE = 0.15
GOAL_TTFT_P99_RATIO = 0.5
GOAL_HOP_P50_MS = 0.5

SLOTS = 4
TOKENS = 32
SLOWDOWN = 4.0
PROMPT_TOKENS = (100, 500)
PROMPT_SEED = 7
PROMPTS = 97
FAILURE_PAUSE = 0.1
"""A client pauses this long after a failed request (a client's retry pause): an algorithm that
refuses everything at once would otherwise spin."""
CUT = "cut"
HOP_TOKENS = 100
HEARTBEAT_MS = 1000


@dataclass(frozen=True)
class EngineShape:
    """One mock engine's speed (ms)."""

    name: str
    ttft_ms: float
    prefill_ms_per_token: float
    inter_token_ms: float

    @property
    def slow(self) -> bool:
        return "slow" in self.name

    def flags(self) -> list[str]:
        return [
            "--ttft-ms",
            f"{self.ttft_ms:g}",
            "--prefill-ms-per-token",
            f"{self.prefill_ms_per_token:g}",
            "--inter-token-ms",
            f"{self.inter_token_ms:g}",
            "--tokens",
            str(TOKENS),
            "--max-num-seqs",
            str(SLOTS),
        ]


FAST = EngineShape("engine-fast-1", 20.0, 0.5, 15.0)
ENGINES = (
    FAST,
    EngineShape("engine-fast-2", FAST.ttft_ms, FAST.prefill_ms_per_token, FAST.inter_token_ms),
    EngineShape(
        "engine-slow",
        FAST.ttft_ms * SLOWDOWN,
        FAST.prefill_ms_per_token * SLOWDOWN,
        FAST.inter_token_ms * SLOWDOWN,
    ),
)
SLOW_ID = ENGINES[2].name
FAST_ID = ENGINES[0].name
PUBLISHED_FIELDS = ("last_mean_input_tps", "queue_size", "num_running_queries")


@dataclass(frozen=True)
class Settings:
    clients: int
    warmup: float
    window: float
    drain: float
    algorithms: tuple[str, ...]
    hop_connections: int
    hop_seconds: float
    hop_sse_seconds: float
    hop_warmup: float
    hop_latency_seconds: float
    hop_latency_rounds: int
    load_generator: str
    router_python: str
    isolated: bool
    budget: float


def settings_for(suite: Suite) -> Settings:
    args = suite.args
    quick = suite.quick
    algorithms = ALGORITHMS
    chosen_algorithms = getattr(args, "routing_algorithms", None)
    if chosen_algorithms:
        algorithms = tuple(name.strip() for name in chosen_algorithms.split(",") if name.strip())
        unknown = [name for name in algorithms if name not in ALGORITHMS]
        if unknown:
            raise BenchError(f"unknown algorithm(s) {unknown}; choose from {', '.join(ALGORITHMS)}")
    router = getattr(args, "router_python", None)
    if router and os.sep in router:
        router = os.path.abspath(router)
    chosen = getattr(args, "load_generator", "auto")
    if chosen == "auto":
        chosen = "wrk" if shutil.which("wrk") else "h11"
    elif chosen == "wrk" and not shutil.which("wrk"):
        raise BenchError("--load-generator wrk: wrk is not installed")
    window = getattr(args, "routing_window", None) or (5.0 if quick else 18.0)
    return Settings(
        clients=12,
        warmup=2.0 if quick else 4.0,
        window=window,
        drain=20.0 if quick else 30.0,
        algorithms=algorithms,
        hop_connections=getattr(args, "connections", None) or (8 if quick else 16),
        hop_seconds=getattr(args, "seconds", None) or (2.0 if quick else 8.0),
        hop_sse_seconds=2.0 if quick else 6.0,
        hop_warmup=1.0 if quick else 2.0,
        hop_latency_seconds=2.0 if quick else 8.0,
        hop_latency_rounds=1 if quick else 4,
        load_generator=chosen,
        router_python=router or server_python(),
        isolated=bool(router),
        budget=(150.0 if quick else 330.0) + len(algorithms) * (window + 12.0),
    )


# ---- the routers under test (replica and Pylons, maybe on another interpreter) ------------------


@dataclass(frozen=True)
class RouterInfo:
    """What the interpreter running the replica and the Pylons offers."""

    python: str
    isolated: bool
    pylon_flags: frozenset[str]

    @property
    def pylon_listens(self) -> bool:
        """The Pylon is in the request path (it has its own listener)."""
        return "--http-listen-addr" in self.pylon_flags


def router_info(procs: Processes, settings: Settings, log_dir: Path) -> RouterInfo:
    """Ask `stargate pylon --help` of the router interpreter which flags it knows."""
    help_log = log_dir / "pylon-help.log"
    with help_log.open("wb") as log:
        process = procs.spawn(
            [settings.router_python, "-m", "stargate", "pylon", "--help"],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            isolated=settings.isolated,
        )
    try:
        out, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        procs.stop(process)
        raise BenchError("`stargate pylon --help` did not answer in 60 s") from None
    if process.returncode != 0:
        raise BenchError(
            f"`{settings.router_python} -m stargate pylon --help` exited {process.returncode}:"
            f"\n{log_tail(help_log)}"
        )
    flags = frozenset(
        word.split("=")[0].rstrip(",")
        for word in out.split()
        if word.startswith("--") and len(word) > 2
    )
    return RouterInfo(settings.router_python, settings.isolated, flags)


@dataclass
class PylonProcess:
    process: subprocess.Popen[Any]
    server_id: str
    log_path: Path
    port: int | None
    """Its request listener (None: an older Pylon without one)."""

    @property
    def pid(self) -> int:
        return self.process.pid


def start_pylon(
    procs: Processes,
    router: RouterInfo,
    log_dir: Path,
    server_id: str,
    engine_url: str,
    grpc_port: int,
    log_level: str = "info",
    extra_args: tuple[str, ...] = (),
) -> PylonProcess:
    """A `stargate pylon` for the engine at `engine_url`, seeded with the replica at
    `grpc_port`; with a request listener on a free port when this Pylon has one, returned once
    that port accepts connections (a port lost to another process between the pick and the bind
    makes the Pylon exit: retried on another). Its registration is not waited for (see
    `wait_routable`)."""
    for attempt in range(3):
        args = [
            router.python,
            "-m",
            "stargate",
            "pylon",
            "--upstream",
            engine_url,
            "--stargate",
            f"127.0.0.1:{grpc_port}",
            "--inference-server-id",
            server_id,
            "--min-update-interval-ms",
            str(HEARTBEAT_MS),
            "--log-level",
            log_level,
            *extra_args,
        ]
        port = None
        if router.pylon_listens:
            (port,) = free_ports(1)
            args += ["--http-listen-addr", f"127.0.0.1:{port}"]
        log_path = log_dir / f"pylon-{server_id}-{attempt}.log"
        with log_path.open("wb") as log:
            process = procs.spawn(
                args, stdout=log, stderr=subprocess.STDOUT, isolated=router.isolated
            )
        pylon = PylonProcess(process, server_id, log_path, port)
        if port is None or _accepts(port, process, time.monotonic() + 30):
            return pylon
        procs.stop(process)
        if attempt == 2 or process.returncode == 0:
            raise BenchError(f"the Pylon {server_id} did not listen:\n{log_tail(log_path)}")
    raise AssertionError("unreachable")


def _accepts(port: int, process: subprocess.Popen[Any], until: float) -> bool:
    """Whether loopback `port` accepts a connection before `until` (False once `process` is
    gone)."""
    while time.monotonic() < until and process.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


# ---- phase 1: the closed-loop streaming clients -------------------------------------------------


def make_prompts() -> list[str]:
    """Seeded prompts of 100-500 tokens at about four characters a token, sized so that the
    replica's estimate (request body bytes / 4) is the intended token count."""
    rng = random.Random(PROMPT_SEED)
    words = ["".join(rng.choices("abcdefghiklmnoprstuwy", k=3)) for _ in range(300)]
    framing = len(json.dumps(_chat_body(""), separators=(",", ":")))
    prompts: list[str] = []
    for _ in range(PROMPTS):
        tokens = rng.randint(*PROMPT_TOKENS)
        chars = max(8, tokens * 4 - framing)
        text = " ".join(rng.choice(words) for _ in range(chars // 4 + 1))
        prompts.append(text[:chars])
    return prompts


def _chat_body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": True}


@dataclass
class Outcome:
    """One streaming request of the closed loop."""

    sent_at: float
    status: int = 0
    server: str = ""
    ttft: float = math.nan
    ended_at: float = math.nan
    content_chunks: int = 0
    done: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.error

    @property
    def failure(self) -> str:
        """How it failed, for the count by status ("" when it did not)."""
        if self.ok:
            return ""
        if self.status and self.status != 200:
            return str(self.status)
        if self.error.startswith(CUT):
            return "cut at the drain limit"
        if self.status == 200:
            return "broken stream"
        return self.error.split("(", 1)[0] or "no answer"


class StreamClient:
    """One keep-alive HTTP/1.1 connection (h11 on trio) sending streaming chat requests and
    timing each one's first content chunk."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._host = f"127.0.0.1:{port}".encode()
        self._stream: trio.SocketStream | None = None
        self._conn = h11.Connection(h11.CLIENT)

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def send(self, body: bytes, algorithm: str, outcome: Outcome) -> None:
        """Send one request and read its whole answer into `outcome`."""
        if self._stream is None:
            self._stream = await trio.open_tcp_stream("127.0.0.1", self._port)
            self._conn = h11.Connection(h11.CLIENT)
        conn, stream = self._conn, self._stream
        headers = [
            (b"host", self._host),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-routing-method", algorithm.encode()),
        ]
        outcome.sent_at = trio.current_time()
        await stream.send_all(
            (conn.send(h11.Request(method=b"POST", target=PATH, headers=headers)) or b"")
            + (conn.send(h11.Data(data=body)) or b"")
            + (conn.send(h11.EndOfMessage()) or b"")
        )
        pending = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                conn.receive_data(data)
                if not data and conn.their_state is not h11.DONE:
                    outcome.error = "the connection closed mid-answer"
                    break
            elif isinstance(event, h11.Response):
                outcome.status = event.status_code
                for name, value in event.headers:
                    if name == b"x-inference-server-id":
                        outcome.server = value.decode(errors="replace")
            elif isinstance(event, h11.Data):
                pending += bytes(event.data)
                cut = pending.rfind(b"\n")
                if cut >= 0:
                    self._lines(pending[: cut + 1], outcome)
                    pending = pending[cut + 1 :]
            elif isinstance(event, h11.EndOfMessage):
                if pending:
                    self._lines(pending, outcome)
                break
            elif isinstance(event, h11.ConnectionClosed):
                outcome.error = "the connection closed mid-answer"
                break
        outcome.ended_at = trio.current_time()
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            await self.close()

    @staticmethod
    def _lines(chunk: bytes, outcome: Outcome) -> None:
        for raw in chunk.split(b"\n"):
            line = raw.rstrip(b"\r")
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                outcome.done = True
                continue
            if b'"content"' not in payload:
                continue
            try:
                choices = json.loads(payload).get("choices") or [{}]
                content = (choices[0].get("delta") or {}).get("content")
            except (ValueError, AttributeError, IndexError, TypeError):
                continue
            if content:
                outcome.content_chunks += 1
                if math.isnan(outcome.ttft):
                    outcome.ttft = trio.current_time() - outcome.sent_at


def fetch_routing(base: str) -> dict[str, Any]:
    """`GET /debug/routing` of the replica: the published stats of every engine of MODEL, or the
    status when there is no such endpoint (an older replica: 404)."""
    import httpx

    try:
        with httpx.Client(trust_env=False, timeout=5) as client:
            response = client.get(f"{base}/debug/routing")
    except httpx.HTTPError as error:
        return {"status": 0, "error": repr(error), "backends": {}}
    if response.status_code != 200:
        return {"status": response.status_code, "backends": {}}
    backends: dict[str, Any] = {}
    estimated: dict[str, bool] = {}
    for target in response.json().get("targets", []):
        if target.get("model_id") != MODEL:
            continue
        for cluster in target.get("clusters", []):
            estimated[cluster.get("cluster_id", "")] = bool(cluster.get("input_tps_estimated"))
            for backend in cluster.get("backends", []):
                backends[backend["inference_server_id"]] = {
                    **backend.get("stats", {}),
                    "rtt_ms": backend.get("rtt_ms"),
                }
    return {"status": 200, "backends": backends, "input_tps_estimated": estimated}


async def closed_loop(
    port: int, base: str, algorithm: str, prompts: list[str], settings: Settings
) -> tuple[list[Outcome], dict[str, Any], float]:
    """`settings.clients` closed-loop clients with `algorithm` for the warm-up and the window;
    the window's requests then finish (each cut at the drain limit). (Outcomes of the requests
    sent in the window, the `/debug/routing` reading from mid-window, the window's length.)"""
    bodies = [json.dumps(_chat_body(p), separators=(",", ":")).encode() for p in prompts]
    start = trio.current_time()
    window_start = start + settings.warmup
    window_end = window_start + settings.window
    hard_stop = window_end + settings.drain
    measured: list[Outcome] = []
    snapshot: dict[str, Any] = {}
    issued = 0

    async def client() -> None:
        nonlocal issued
        connection = StreamClient(port)
        try:
            while trio.current_time() < window_end:
                body = bodies[issued % len(bodies)]
                issued += 1
                outcome = Outcome(trio.current_time())
                with trio.move_on_after(max(0.0, hard_stop - trio.current_time())) as scope:
                    try:
                        await connection.send(body, algorithm, outcome)
                    except (OSError, trio.BrokenResourceError, h11.ProtocolError) as error:
                        outcome.error = repr(error)
                        await connection.close()
                if scope.cancelled_caught:
                    outcome.error = outcome.error or f"{CUT}: still running at the drain limit"
                    await connection.close()
                if outcome.sent_at >= window_start:
                    measured.append(outcome)
                if not outcome.ok:
                    await trio.sleep(FAILURE_PAUSE)
        finally:
            await connection.close()

    async def snap() -> None:
        nonlocal snapshot
        await trio.sleep_until(window_start + settings.window / 2)
        snapshot = await trio.to_thread.run_sync(fetch_routing, base)
        snapshot["at_seconds_into_window"] = round(trio.current_time() - window_start, 2)

    async with trio.open_nursery() as nursery:
        for _ in range(settings.clients):
            nursery.start_soon(client)
        nursery.start_soon(snap)
    return measured, snapshot, settings.window


@dataclass
class AlgorithmResult:
    algorithm: str
    requests: int = 0
    ok: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)
    slow_share: float = math.nan
    ttft_p50_ms: float = math.nan
    ttft_p99_ms: float = math.nan
    ttft_mean_ms: float = math.nan
    streams_per_second: float = math.nan
    window_seconds: float = 0.0
    drain_seconds: float = 0.0
    routing: dict[str, Any] = field(default_factory=dict)
    """The mid-window `/debug/routing` reading."""
    retries: dict[str, int] = field(default_factory=dict)
    """The replica's retries on another backend, by reason, from warm-up to drain
    (`proxy_retries_total`)."""
    first_error: str = ""


def summarise(
    algorithm: str, outcomes: list[Outcome], routing: dict[str, Any], window: float
) -> AlgorithmResult:
    result = AlgorithmResult(algorithm, requests=len(outcomes), window_seconds=window)
    result.routing = routing
    ttfts: list[float] = []
    for outcome in outcomes:
        if outcome.server:
            result.served[outcome.server] = result.served.get(outcome.server, 0) + 1
        if outcome.ok:
            result.ok += 1
            if not math.isnan(outcome.ttft):
                ttfts.append(outcome.ttft)
        else:
            result.failed += 1
            why = outcome.failure
            result.failures[why] = result.failures.get(why, 0) + 1
            result.first_error = result.first_error or (outcome.error or f"status {why}")
    served = sum(result.served.values())
    result.served = dict(sorted(result.served.items()))
    if served:
        result.shares = {name: count / served for name, count in result.served.items()}
        result.slow_share = result.shares.get(SLOW_ID, 0.0)
    ttfts.sort()
    result.ttft_p50_ms = percentile(ttfts, 0.50) * 1000
    result.ttft_p99_ms = percentile(ttfts, 0.99) * 1000
    result.ttft_mean_ms = sum(ttfts) / len(ttfts) * 1000 if ttfts else math.nan
    result.streams_per_second = result.ok / window if window > 0 else math.nan
    ends = [o.ended_at for o in outcomes if not math.isnan(o.ended_at)]
    if ends and outcomes:
        window_end = min(o.sent_at for o in outcomes) + window
        result.drain_seconds = max(0.0, max(ends) - window_end)
    return result


# ---- phase 1: the servers ------------------------------------------------------------------------


def probe_body(tokens: int = 1) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": tokens,
    }
    return json.dumps(body, separators=(",", ":")).encode()


def wait_routable(
    replica: Replica, server_ids: list[str], deadline: Deadline, pylons: list[PylonProcess]
) -> None:
    """Until round-robin requests through the replica have reached every engine (each named by
    `x-inference-server-id`)."""
    import httpx

    seen: set[str] = set()
    headers = {"content-type": "application/json", "x-routing-method": "round-robin"}

    def every_engine() -> bool:
        for pylon in pylons:
            if pylon.process.poll() is not None:
                raise BenchError(f"the Pylon {pylon.server_id} exited:\n{log_tail(pylon.log_path)}")
        response = client.post(f"{replica.base}{PATH}", headers=headers, content=probe_body())
        if response.status_code == 200:
            seen.add(response.headers.get("x-inference-server-id", ""))
        else:
            time.sleep(0.2)
        return set(server_ids) <= seen

    with httpx.Client(trust_env=False, timeout=10) as client:
        try:
            wait_until(
                every_engine,
                deadline.left(45),
                "every engine routable through the replica",
                replica.process,
                replica.log_path,
            )
        except BenchError as error:
            tails = "\n".join(f"{p.server_id}:\n{log_tail(p.log_path, 8)}" for p in pylons)
            raise BenchError(f"{error}\nseen: {sorted(seen)}\n{tails}") from None


@dataclass
class LoadPhase:
    results: list[AlgorithmResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    routing_note: str = ""
    pylon_in_path: bool = False
    warnings: list[str] = field(default_factory=list)
    """Warnings and errors from the Pylons' and the replica's logs."""


def run_load_phase(
    settings: Settings, router: RouterInfo, deadline: Deadline, log_dir: Path
) -> LoadPhase:
    phase = LoadPhase(pylon_in_path=router.pylon_listens)
    procs = Processes()
    pylons: list[PylonProcess] = []
    replica: Replica | None = None
    try:
        urls: list[str] = []
        for shape in ENGINES:
            _, port = start_printing_server(
                procs,
                mock_backend_command(MODEL, *shape.flags()),
                log_dir / f"{shape.name}.log",
                f"the mock engine {shape.name}",
                deadline.left(30),
            )
            urls.append(f"http://127.0.0.1:{port}")
        replica = start_replica(
            procs,
            log_dir,
            "routing",
            deadline,
            extra_args=["--accept-openai-requests"],
            python=router.python,
            isolated=router.isolated,
        )
        # Default Pylons, canaries included (a model producing output gets none).
        for shape, url in zip(ENGINES, urls, strict=True):
            pylons.append(start_pylon(procs, router, log_dir, shape.name, url, replica.grpc))
        wait_routable(replica, [shape.name for shape in ENGINES], deadline, pylons)
        print(f"  every engine routable ({len(pylons)} Pylons)", file=sys.stderr)
        prompts = make_prompts()
        for algorithm in settings.algorithms:
            needed = settings.warmup + settings.window + 10
            if deadline.left(1e9) < needed:
                phase.skipped.append(algorithm)
                continue
            retries_before = retries_by_reason(replica)
            outcomes, routing, window = trio.run(
                closed_loop, replica.http, replica.base, algorithm, prompts, settings
            )
            result = summarise(algorithm, outcomes, routing, window)
            retries_after = retries_by_reason(replica)
            result.retries = {
                reason: round(count - retries_before.get(reason, 0.0))
                for reason, count in sorted(retries_after.items())
                if count > retries_before.get(reason, 0.0)
            }
            phase.results.append(result)
            for pylon in pylons:
                if pylon.process.poll() is not None:
                    raise BenchError(
                        f"the Pylon {pylon.server_id} exited:\n{log_tail(pylon.log_path)}"
                    )
            if replica.process.poll() is not None:
                raise BenchError(f"the replica exited\n{log_tail(replica.log_path)}")
            published = routing.get("backends", {})
            slow_tps = num(_field(published, SLOW_ID, "last_mean_input_tps"))
            fast_tps = num(_field(published, FAST_ID, "last_mean_input_tps"))
            print(
                f"  {algorithm:<22} {result.ok:>5}/{result.requests:<5} OK, slow share "
                f"{num(result.slow_share, 3)}, TTFT p50 {num(result.ttft_p50_ms)} ms p99 "
                f"{num(result.ttft_p99_ms)} ms, {num(result.streams_per_second, 2)} streams/s"
                + (f", failures {result.failures}" if result.failures else "")
                + (f", retries {result.retries}" if result.retries else "")
                + (
                    f"; published input TPS slow {slow_tps}, fast {fast_tps}"
                    if published
                    else f"; /debug/routing {routing.get('status')}"
                ),
                file=sys.stderr,
            )
        statuses = {r.routing.get("status") for r in phase.results}
        if statuses and 200 not in statuses:
            phase.routing_note = (
                f"`GET /debug/routing` answered {sorted(s for s in statuses if s is not None)} "
                "(a replica without it): the published stats are not shown"
            )
    finally:
        stop_routers_first(procs, [p.process for p in pylons], replica)
        logs = [p.log_path for p in pylons] + ([replica.log_path] if replica else [])
        phase.warnings = _log_warnings(logs)
    return phase


def stop_routers_first(
    procs: Processes, pylons: list[subprocess.Popen[Any]], replica: Replica | None
) -> None:
    """Stop the Pylons, then the replica, then everything else: an engine stopped first would
    fail the health probes the replica still sends through its Pylon."""
    try:
        for process in pylons:
            procs.stop(process)
        if replica is not None:
            procs.stop(replica.process)
    finally:
        procs.stop_all()


RETRIES_METRIC = "stargate_proxy_retries_total"


def retries_by_reason(replica: Replica) -> dict[str, float]:
    """The replica's `proxy_retries_total` by reason (every model), from its metrics."""
    try:
        text = replica.metrics_text()
    except Exception:  # the figure is a detail: a failed read leaves it empty
        return {}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(RETRIES_METRIC + "{"):
            continue
        labels, _, value = line.rpartition(" ")
        reason = labels.split('reason="', 1)[1].split('"', 1)[0] if 'reason="' in labels else ""
        with contextlib.suppress(ValueError):
            totals[reason] = totals.get(reason, 0.0) + float(value)
    return totals


def _field(backends: dict[str, Any], server: str, name: str) -> float:
    value = backends.get(server, {}).get(name)
    return float(value) if isinstance(value, int | float) else math.nan


LOG_MARKS = (" WARNING ", " ERROR ", "Traceback")
LOG_EXPECTED = ("registration is unauthenticated",)
"""Warnings every benchmark replica logs (no registration token on loopback)."""


def _log_warnings(paths: list[Path], limit: int = 12) -> list[str]:
    """WARNING/ERROR lines of the servers' logs (the first `limit`, with their counts)."""
    found: list[str] = []
    for path in paths:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        bad = [
            line
            for line in lines
            if any(mark in line for mark in LOG_MARKS)
            and not any(known in line for known in LOG_EXPECTED)
        ]
        if bad:
            found.append(f"{path.stem}: {len(bad)} warning/error line(s), first: {bad[0][:300]}")
    return found[:limit]


# ---- phase 2: the Pylon hop ----------------------------------------------------------------------

HOP_TARGETS = {
    "pylon": "Pylon -> engine",
    "replica": "replica -> Pylon -> engine",
    "direct": "engine direct",
}


@dataclass
class HopPhase:
    throughput: dict[str, LoadResult] = field(default_factory=dict)
    sse: dict[str, LoadResult] = field(default_factory=dict)
    latency: dict[str, LoadResult] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    note: str = ""
    profile_note: str = ""


def run_hop_phase(
    settings: Settings, router: RouterInfo, deadline: Deadline, log_dir: Path, suite: Suite
) -> HopPhase:
    import httpx

    phase = HopPhase()
    procs = Processes()
    profiler = Profiler(suite.profile, suite.out_dir, procs, NAME)
    replica: Replica | None = None
    pylon: PylonProcess | None = None
    try:
        engine, engine_port = start_printing_server(
            procs,
            mock_backend_command(HOP_MODEL, "--tokens", str(HOP_TOKENS)),
            log_dir / "hop-engine.log",
            "the hop's mock engine",
            deadline.left(30),
        )
        replica = start_replica(
            procs,
            log_dir,
            "routing-hop",
            deadline,
            extra_args=["--registration-update-idle-timeout-ms=0"],
            python=router.python,
            isolated=router.isolated,
        )
        pylon = start_pylon(
            procs,
            router,
            log_dir,
            "hop-pylon",
            f"http://127.0.0.1:{engine_port}",
            replica.grpc,
            log_level="warning",
        )
        assert pylon.port is not None
        tunnel = {"x-request-id": "hop-ready", "x-model": HOP_MODEL, "x-input-tokens": "10"}
        body = json.dumps({"model": HOP_MODEL, "messages": [{"role": "user", "content": "hi"}]})
        with httpx.Client(trust_env=False, timeout=5) as client:
            for where, port, process, log_path in (
                ("the Pylon", pylon.port, pylon.process, pylon.log_path),
                ("the replica through the Pylon", replica.http, replica.process, replica.log_path),
            ):
                url = f"http://127.0.0.1:{port}{PATH}"
                wait_until(
                    functools.partial(_answers_200, client, url, tunnel, body),
                    deadline.left(30),
                    f"a request through {where} to succeed",
                    process,
                    log_path,
                )
        targets: dict[str, tuple[int, dict[str, int]]] = {
            "pylon": (pylon.port, {"pylon": pylon.pid, "engine": engine.pid}),
            "replica": (
                replica.http,
                {"replica": replica.pid, "pylon": pylon.pid, "engine": engine.pid},
            ),
            "direct": (engine_port, {"engine": engine.pid}),
        }
        plan: list[tuple[str, str, int, float]] = [
            *[("throughput", t, settings.hop_connections, settings.hop_seconds) for t in HOP_ORDER],
            *[("sse", t, settings.hop_connections, settings.hop_sse_seconds) for t in HOP_ORDER],
            *[
                ("latency", t, 1, settings.hop_latency_seconds / settings.hop_latency_rounds)
                for _ in range(settings.hop_latency_rounds)
                for t in ("direct", "pylon", "replica")
            ],
        ]
        use_wrk = settings.load_generator == "wrk"
        for kind, target, connections, seconds in plan:
            label = f"hop {kind} {target}"
            if deadline.left(1e9) < settings.hop_warmup + seconds + 15:
                phase.skipped.append(label)
                continue
            port, pids = targets[target]
            where: dict[str, LoadResult] = getattr(phase, kind)
            warmup = settings.hop_warmup if target not in where else 0.0
            tool = "wrk" if use_wrk and kind != "sse" else "h11"
            print(
                f"  {label}: {connections} connection(s), {seconds:.0f} s ({tool})", file=sys.stderr
            )
            profiling = kind == "sse" and target == "replica"
            with (
                profiler.record(
                    pylon.pid, warmup + seconds + 1, "the Pylon in the streamed run via the replica"
                )
                if profiling
                else contextlib.nullcontext()
            ):
                if tool == "wrk":
                    script = wrk_script(log_dir / f"{kind}-{target}.lua", f"{kind}-{target}")
                    result = run_wrk(script, port, connections, warmup, seconds, pids, label)
                else:
                    spec = LoadSpec(port, kind == "sse", connections, warmup, seconds, pids)
                    result = run_h11(spec, label)
            where[target] = merged(where[target], result) if target in where else result
        for process, what, log_path in (
            (pylon.process, "the Pylon", pylon.log_path),
            (replica.process, "the replica", replica.log_path),
        ):
            if process.poll() is not None:
                raise BenchError(f"{what} exited\n{log_tail(log_path)}")
    finally:
        stop_routers_first(procs, [pylon.process] if pylon else [], replica)
        phase.profile_note = profiler.note
    return phase


HOP_ORDER = ("pylon", "replica")


def _answers_200(client: Any, url: str, headers: dict[str, str], body: str) -> bool:
    return bool(client.post(url, headers=headers, content=body).status_code == 200)


# ---- the report ---------------------------------------------------------------------------------


def _per(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "FAIL")


def judge(load: LoadPhase, hop: HopPhase | None) -> list[tuple[str, str, bool | None]]:
    """The issue's goals as (goal, measured, met) rows; met is None when not measurable."""
    rows: list[tuple[str, str, bool | None]] = []
    by_name = {r.algorithm: r for r in load.results}
    if load.results:
        failed = [r for r in load.results if r.failed]
        rows.append(
            (
                "every algorithm: 0 failed requests",
                ", ".join(f"{r.algorithm} {r.failed:,}" for r in load.results),
                not failed,
            )
        )
    reference = by_name.get(REFERENCE)
    for name in GOAL_ALGORITHMS:
        result = by_name.get(name)
        if result is None:
            continue
        # An algorithm that served nothing (every request refused) misses both goals.
        served = result.ok > 0
        none_served = f"nothing served ({result.failed:,} failed)"
        reference_share = num(reference.slow_share, 3) if reference else "-"
        rows.append(
            (
                f"{name}: slow engine's share ≤ {GOAL_SLOW_SHARE:g}",
                f"{num(result.slow_share, 3)} ({REFERENCE}: {reference_share})"
                if served
                else none_served,
                served and result.slow_share <= GOAL_SLOW_SHARE,
            )
        )
        limit = reference.ttft_p99_ms * GOAL_TTFT_P99_RATIO if reference else math.nan
        rows.append(
            (
                f"{name}: TTFT p99 ≤ {GOAL_TTFT_P99_RATIO:g}x {REFERENCE}'s",
                f"{num(result.ttft_p99_ms)} ms (limit {num(limit)} ms)" if served else none_served,
                None if math.isnan(limit) else served and result.ttft_p99_ms <= limit,
            )
        )
    if hop is not None:
        added = _added_p50(hop)
        rows.append(
            (
                f"Pylon added p50 at one connection ≤ {GOAL_HOP_P50_MS:g} ms",
                f"{num(added, 3)} ms",
                None if math.isnan(added) else added <= GOAL_HOP_P50_MS,
            )
        )
        pylon_us, replica_us = _chunk_costs(hop)
        rows.append(
            (
                "Pylon CPU per streamed chunk ≤ the replica's (same run)",
                f"{num(pylon_us, 1)} µs vs {num(replica_us, 1)} µs",
                None if math.isnan(pylon_us) or math.isnan(replica_us) else pylon_us <= replica_us,
            )
        )
    return rows


def _added_p50(hop: HopPhase) -> float:
    pylon, direct = hop.latency.get("pylon"), hop.latency.get("direct")
    if pylon is None or direct is None:
        return math.nan
    return pylon.q(50) - direct.q(50)


def _chunk_costs(hop: HopPhase) -> tuple[float, float]:
    """(Pylon, replica) CPU µs per streamed chunk over the same replica -> Pylon -> engine run."""
    result = hop.sse.get("replica")
    if result is None:
        return math.nan, math.nan
    return (
        _per(result.cpu.get("pylon", math.nan), result.data_lines) * 1e6,
        _per(result.cpu.get("replica", math.nan), result.data_lines) * 1e6,
    )


def load_markdown(load: LoadPhase, settings: Settings) -> str:
    fast, slow = ENGINES[0], ENGINES[2]
    ids = [shape.name for shape in ENGINES]
    rows = []
    for r in load.results:
        rows.append(
            [
                r.algorithm,
                f"{r.requests:,}",
                f"{r.failed:,}"
                + (
                    " (" + ", ".join(f"{k}: {v:,}" for k, v in sorted(r.failures.items())) + ")"
                    if r.failures
                    else ""
                ),
                " / ".join(num(r.shares.get(i, 0.0) if r.shares else math.nan, 2) for i in ids),
                num(r.slow_share, 3),
                num(r.ttft_p50_ms),
                num(r.ttft_p99_ms),
                num(r.streams_per_second, 2),
                ", ".join(f"{k} {v:,}" for k, v in r.retries.items()) or "0",
            ]
        )
    table = md_table(
        [
            "Algorithm",
            "Requests",
            "Failed (by status)",
            "Share fast-1 / fast-2 / slow",
            "Slow share",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "Streams/s",
            "Replica retries (by reason)",
        ],
        rows,
    )
    published_rows = []
    for r in load.results:
        backends = r.routing.get("backends", {})
        published_rows.append(
            [
                r.algorithm,
                *[
                    num(_field(backends, server, name), 0)
                    for server in (SLOW_ID, FAST_ID)
                    for name in PUBLISHED_FIELDS
                ],
            ]
        )
    published = md_table(
        [
            "Algorithm",
            "Slow: input TPS",
            "Slow: queue",
            "Slow: running",
            "Fast-1: input TPS",
            "Fast-1: queue",
            "Fast-1: running",
        ],
        published_rows,
    )
    path = (
        "replica -> Pylon -> engine (each Pylon in the request path, measuring)"
        if load.pylon_in_path
        else "replica -> engine (this Pylon has no request listener: it registers the engine's "
        "URL and publishes no measurements)"
    )
    text = (
        f"Three `stargate mock-backend` engines, {SLOTS} batch slots each (`--max-num-seqs "
        f"{SLOTS}`, then a FIFO waiting queue), {TOKENS} tokens per answer: two fast "
        f"(`--ttft-ms {fast.ttft_ms:g} --prefill-ms-per-token {fast.prefill_ms_per_token:g} "
        f"--inter-token-ms {fast.inter_token_ms:g}`) and one {SLOWDOWN:g}x slower in all three "
        f"(`--ttft-ms {slow.ttft_ms:g} --prefill-ms-per-token {slow.prefill_ms_per_token:g} "
        f"--inter-token-ms {slow.inter_token_ms:g}`), each behind its own `stargate pylon` "
        f"(heartbeat {HEARTBEAT_MS} ms, canaries on); one replica in OpenAI mode. Path: {path}. "
        f"{settings.clients} closed-loop streaming clients, prompts of "
        f"{PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens (seeded; `x-input-tokens` estimated by "
        f"the replica from the body), per algorithm a {settings.warmup:g} s warm-up and a "
        f"{settings.window:g} s measured window (the requests sent in it; they then finish). "
        "TTFT = request sent to the first SSE chunk with content, at the client; shares are of "
        "the requests an engine answered (`x-inference-server-id`); streams/s = successful "
        "streams of the window / window; replica retries = requests it moved to another "
        "backend (e.g. a Pylon's 429 `queue_estimate_mismatch`), from the replica's "
        "`proxy_retries_total`, warm-up to drain.\n\n"
        f"{table}\n\n"
        "What the balancers saw mid-window (`GET /debug/routing`, the replica's view of each "
        "engine's published `ModelStats` with its own pending reservations applied):\n\n"
        f"{published}"
    )
    if load.routing_note:
        text += f"\n\n{load.routing_note}."
    if load.skipped:
        text += f"\n\nSkipped (time budget): {', '.join(load.skipped)}."
    return text


def hop_markdown(hop: HopPhase, settings: Settings) -> str:
    if hop.note:
        return hop.note
    rows = []
    for target, result in hop.throughput.items():
        rows.append(
            [
                HOP_TARGETS[target],
                f"{result.ok:,}",
                num(_per(result.ok, result.wall)),
                num(result.q(50), 2),
                num(result.q(99), 2),
                num(_per(result.cpu.get("pylon", math.nan), result.ok) * 1e6),
                num(_per(result.cpu.get("replica", math.nan), result.ok) * 1e6),
                num(_per(result.cpu.get("engine", math.nan), result.ok) * 1e6),
                num(_per(result.other_cpu, result.wall) * 100),
            ]
        )
    throughput = md_table(
        [
            "Path",
            "Requests",
            "req/s",
            "p50 ms",
            "p99 ms",
            "Pylon CPU µs/req",
            "Replica CPU µs/req",
            "Engine CPU µs/req",
            "Others' CPU %",
        ],
        rows,
    )
    rows = []
    for target, result in hop.sse.items():
        rows.append(
            [
                HOP_TARGETS[target],
                f"{result.ok:,}",
                num(_per(result.data_lines, result.ok), 1),
                num(_per(result.data_lines, result.wall)),
                num(_per(result.cpu.get("pylon", math.nan), result.data_lines) * 1e6, 1),
                num(_per(result.cpu.get("replica", math.nan), result.data_lines) * 1e6, 1),
                num(_per(result.cpu.get("engine", math.nan), result.data_lines) * 1e6, 1),
                num(_per(result.other_cpu, result.wall) * 100),
            ]
        )
    sse = md_table(
        [
            "Path",
            "Streams",
            "Chunks per stream",
            "Chunks/s",
            "Pylon CPU µs/chunk",
            "Replica CPU µs/chunk",
            "Engine CPU µs/chunk",
            "Others' CPU %",
        ],
        rows,
    )
    direct = hop.latency.get("direct")
    rows = []
    for target in ("direct", "pylon", "replica"):
        result = hop.latency.get(target)
        if result is None:
            continue
        added = direct is not None and target != "direct"
        rows.append(
            [
                HOP_TARGETS[target],
                f"{result.ok:,}",
                num(result.q(50), 3),
                num(result.q(90), 3),
                num(result.q(99), 3),
                num(result.q(99.9), 3),
                num(result.q(50) - direct.q(50), 3) if added and direct else "-",
                num(result.q(99) - direct.q(99), 3) if added and direct else "-",
            ]
        )
    latency = md_table(
        [
            "Path",
            "Requests",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "p99.9 ms",
            "Added p50 ms",
            "Added p99 ms",
        ],
        rows,
    )
    tool = "wrk (1 thread)" if settings.load_generator == "wrk" else "trio + h11 client"
    text = (
        f"A `stargate mock-backend` with no delays ({HOP_TOKENS} tokens per answer) behind one "
        "`stargate pylon` registered with a replica; requests in the replica's form "
        "(`x-request-id`, `x-model`, `x-input-tokens`) straight to the Pylon's listener, through "
        f"the replica, or straight to the engine. Load generator: {tool} (benchmarks/proxy.py). "
        "CPU = utime + stime from `/proc` over the measured run only; in the replica row both "
        "hops carry the same requests and chunks. Others' CPU % is what every other process on "
        "the machine (other users' jobs) used during the run, in % of one core: CPU per unit "
        "grows when the machine is busy.\n\n"
        f"(a) Non-streamed `POST {PATH}`, {settings.hop_connections} keep-alive connections, "
        f"{settings.hop_seconds:g} s after a {settings.hop_warmup:g} s warm-up:\n\n{throughput}\n\n"
        f"(b) Streams of {HOP_TOKENS} tokens with no inter-token delay, "
        f"{settings.hop_connections} connections, {settings.hop_sse_seconds:g} s "
        f"(trio + h11 client):\n\n{sse}\n\n"
        f"(c) Latency at one connection, {settings.hop_latency_seconds:g} s per path in "
        f"{settings.hop_latency_rounds} round(s) interleaved (quantiles: the request-weighted "
        "mean of the rounds'); added = minus the engine direct:\n\n"
        f"{latency}"
    )
    if hop.skipped:
        text += f"\n\nSkipped (time budget): {', '.join(hop.skipped)}."
    return text


def chart(results: list[AlgorithmResult], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not results:
        return False
    names = [r.algorithm for r in results]
    xs = list(range(len(results)))
    colors = ["tab:grey" if name == REFERENCE else "tab:blue" for name in names]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].bar(xs, [r.slow_share for r in results], 0.6, color=colors)
    axes[0].axhline(GOAL_SLOW_SHARE, color="tab:red", linestyle=":", label="goal ≤ 0.15")
    axes[0].axhline(1 / 3, color="grey", linewidth=0.8, label="a third (even spread)")
    axes[0].set_ylabel("slow engine's share of the requests")
    shares = [r.slow_share for r in results if not math.isnan(r.slow_share)]
    axes[0].set_ylim(0, min(1.05, max([0.45, *shares]) + 0.05))
    axes[1].bar(xs, [r.ttft_p99_ms for r in results], 0.6, color=colors)
    reference = next((r for r in results if r.algorithm == REFERENCE), None)
    if reference is not None and not math.isnan(reference.ttft_p99_ms):
        axes[1].axhline(
            reference.ttft_p99_ms * GOAL_TTFT_P99_RATIO,
            color="tab:red",
            linestyle=":",
            label=f"goal ≤ {GOAL_TTFT_P99_RATIO:g}x {REFERENCE}",
        )
    axes[1].set_ylabel("TTFT p99 at the client (ms)")
    for x, result in zip(xs, results, strict=True):
        if result.failed:
            for axis in axes:
                axis.annotate(
                    f"{result.failed:,} of {result.requests:,}\nfailed",
                    (x, 0),
                    xytext=(0, 4),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="tab:red",
                )
    for axis in axes:
        axis.set_xticks(xs, names, fontsize=8, rotation=15)
        axis.set_xlim(-0.6, len(xs) - 0.4)
        axis.grid(True, axis="y", alpha=0.3)
        axis.legend(fontsize=8, loc="best")
    figure.suptitle(
        f"stargate {NAME}: 3 engines (one {SLOWDOWN:g}x slower), 12 closed-loop streams; "
        f"grey = {REFERENCE} (reference)",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


# ---- the part -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _log_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="stargate-routing-") as tmp:
        yield Path(tmp)


def run(suite: Suite) -> PartResult:
    settings = settings_for(suite)
    deadline = Deadline(settings.budget)
    began = time.monotonic()
    procs = Processes()
    notes: list[str] = []
    problems: list[str] = []
    hop: HopPhase | None = None
    with _log_dir() as log_dir:
        try:
            router = router_info(procs, settings, log_dir)
        finally:
            procs.stop_all()
        where = "this checkout" if not router.isolated else f"{router.python}'s own stargate"
        print(
            f"  replica and Pylons: {where}; Pylon in the request path: {router.pylon_listens}",
            file=sys.stderr,
        )
        load = run_load_phase(settings, router, deadline, log_dir)
        if router.pylon_listens:
            hop = run_hop_phase(settings, router, deadline, log_dir, suite)
        else:
            hop = HopPhase(
                note="Skipped: this `stargate pylon` has no request listener "
                "(`--http-listen-addr`), so there is no Pylon hop to measure."
            )
    goals = judge(load, hop if hop is not None and not hop.note else None)
    for goal, measured, met in goals:
        print(f"  {_mark(met)}: {goal}: {measured}", file=sys.stderr)
    goal_table = md_table(
        ["Goal", "Measured", "Met"], [[goal, measured, _mark(met)] for goal, measured, met in goals]
    )
    for result in load.results:
        if result.failed:
            problems.append(
                f"{result.algorithm}: {result.failed:,} of {result.requests:,} requests failed "
                f"({result.failures}; first: {result.first_error[:200]})"
            )
    problems += [f"skipped (time budget): {name}" for name in load.skipped]
    if hop is not None:
        problems += [f"skipped (time budget): {label}" for label in hop.skipped]
        for kind, by_target in (("non-streamed", hop.throughput), ("SSE", hop.sse)):
            for target, result in by_target.items():
                if result.errors or result.ok == 0:
                    problems.append(
                        f"hop {kind} {target}: {result.ok}/{result.requests} OK, statuses "
                        f"{result.statuses}, first error {result.first_error}"
                    )
    notes += [f"server log: {line}" for line in load.warnings]
    python_note = (
        f"The replica and the Pylons ran on `{router.python}` with its own installed stargate "
        "(`--router-python`); the engines and the load generators on this checkout."
        if router.isolated
        else ""
    )
    if python_note:
        notes.insert(0, python_note)
    charts: list[str] = []
    try:
        if chart(load.results, suite.out_dir / f"{NAME}.png"):
            charts.append(f"{NAME}.png")
    except Exception as error:  # a chart is not worth the figures
        notes.append(f"no chart: {error!r}")
    if hop is not None and hop.profile_note:
        notes.append(hop.profile_note)
    elif suite.profile and hop is not None and hop.note:
        notes.append("no flame graph: the Pylon hop was not measured")
    text = (
        f"Goals (the issue's; benchmark goals, not tests):\n\n{goal_table}\n\n"
        f"### 1. Routing by real load\n\n{load_markdown(load, settings)}\n\n"
        f"### 2. The Pylon hop\n\n{hop_markdown(hop, settings) if hop else '-'}"
    )
    data: dict[str, Any] = {
        "goals": [{"goal": g, "measured": m, "met": met} for g, m, met in goals],
        "algorithms": [asdict(r) for r in load.results],
        "pylon_in_request_path": router.pylon_listens,
        "router_python": router.python,
        "hop": None
        if hop is None or hop.note
        else {
            "throughput": {t: asdict(r) for t, r in hop.throughput.items()},
            "sse": {t: asdict(r) for t, r in hop.sse.items()},
            "latency": {t: asdict(r) for t, r in hop.latency.items()},
            "added_p50_ms": _added_p50(hop),
            "cpu_us_per_chunk": dict(zip(("pylon", "replica"), _chunk_costs(hop), strict=True)),
        },
    }
    return PartResult(
        NAME,
        TITLE,
        text,
        data,
        settings={
            **asdict(settings),
            "engines": [asdict(shape) for shape in ENGINES],
            "slots": SLOTS,
            "tokens": TOKENS,
            "prompt_tokens": PROMPT_TOKENS,
            "heartbeat_ms": HEARTBEAT_MS,
            "hop_tokens": HOP_TOKENS,
        },
        problems=problems,
        charts=charts,
        notes=notes,
        elapsed=time.monotonic() - began,
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.routing [options]`: the same as `python -m benchmarks routing`."""
    from benchmarks.__main__ import main as suite_main

    return suite_main(["routing", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
