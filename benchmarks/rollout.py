"""Rolling-restart rehearsal: how many client requests fail while a set of replicas is replaced.

Run with `nox -s rollout -- [options]` (or `python -m benchmarks.rollout [options]` from the
project root). One run rebuilds, on loopback, what a Kubernetes rollout of the chart does:

* N `stargate serve` replicas (a StatefulSet): fixed ports per slot, so a replacement reuses its
  slot's ports as a StatefulSet pod keeps its name; static peers (`--peer`) so every replica
  publishes all of them in `WatchStargates`; `--accept-openai-requests` so a plain OpenAI SDK
  client works.
* M `stargate mock-backend` engines, each behind a `stargate pylon` sidecar seeded with every
  replica (a Pylon seeded with one replica has a separate, known problem we do not measure here).
* A Service simulator: one in-process L4 TCP proxy. Each NEW client connection goes to the next
  endpoint in service (round robin) and keeps it for its whole life, like kube-proxy and conntrack;
  a replica that refuses the connection makes the simulator reset the client's connection (a
  user-space proxy has already accepted it: the reset is what stands in for the refused SYN, and
  the report counts it as `connection_refused`). Endpoints follow a simulated kubelet: `GET /readyz`
  every probe period, joining after `minReadySeconds` of readiness and leaving after
  `failureThreshold` failed probes, and a terminating replica leaves `propagation lag` after its
  SIGTERM whatever it answers (endpoint propagation).
* The rollout, one slot at a time from the highest ordinal down, as a StatefulSet does it: SIGTERM,
  wait for the process to exit (it drains), start the replacement on the same ports, wait until the
  simulator has it in service; then the next slot.
* Steady clients through the simulator during the whole rollout, plus a warm period before and
  after: half use the official `openai` SDK with one pooled client per worker (keep-alive,
  `max_retries=0`, so every failure is visible), half open a fresh connection per request (a raw
  socket and h11); streaming and non-streaming chat completions alternate.

Every request is recorded (start, end, outcome kind, the replica whose connection it used); a
request that does not finish within `--request-timeout` is a `timeout`. Each client worker connects
from its own loopback address (127.1.x.y), so the simulator's per-connection record of which replica
it chose, and whether that replica refused, can be joined to the client's own view. The report is a
table per run on stdout, plus a PNG timeline per run (requests per 100 ms coloured by outcome, and
one band per replica slot with its phase: starting, warming, ready, leaving, draining, down, and
whether the simulator had it in service), and a JSON file with every record.

`--shutdown-delay-ms` is passed to the replicas only when `stargate serve --help` offers it, so the
rehearsal also measures a replica without the leave phase. Exit code: 0 when no request failed in
any run, 1 when some did, 2 when the rehearsal itself could not run (a process did not start, a
bound was exceeded). Every process started is stopped on the way out, Ctrl-C and errors included.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

import h11
import httpx2
import openai
import trio
from openai.types.chat import ChatCompletionMessageParam

from benchmarks.h11_client import read_response

ROOT = Path(__file__).resolve().parent.parent
MODEL = "rollout-model"
CHAT_PATH = "/v1/chat/completions"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
CHAT_BODY = json.dumps({"model": MODEL, "messages": MESSAGES}, separators=(",", ":")).encode()
STREAM_BODY = json.dumps(
    {"model": MODEL, "messages": MESSAGES, "stream": True}, separators=(",", ":")
).encode()

OUTCOMES = (
    "ok",
    "connection_refused",
    "remote_disconnect",
    "http_404",
    "http_503",
    "http_5xx_other",
    "timeout",
    "other",
)
FAILURE_KINDS = OUTCOMES[1:]
E = TypeVar("E", bound=BaseException)

PHASES = ("starting", "warming", "ready", "leaving", "draining", "down")

BUCKET_SECONDS = 0.1
CONNECT_TIMEOUT = 3.0
"""The simulator's connect timeout to a replica (loopback: a refusal is immediate)."""
PROCESS_START_TIMEOUT = 30.0
STOP_GRACE_SECONDS = 10.0
MAX_REQUESTS_PER_WORKER = 100_000
"""A bound on every client loop, far above what any run sends (the stop flag ends it first)."""


class RolloutError(RuntimeError):
    """The rehearsal could not run: a process did not start or died, or a bound was exceeded."""


class Terminated(Exception):
    """The command received SIGTERM (a CI timeout, say)."""


# ---- parameters ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Warmup:
    """The replicas' readiness warmup flags, under a mode name for the report."""

    mode: str
    warmup_ms: int = 60_000
    sample_interval_ms: int = 1_000
    stabilization_window: int = 5

    def args(self) -> list[str]:
        return [
            f"--readiness-warmup-ms={self.warmup_ms}",
            f"--warmup-sample-interval-ms={self.sample_interval_ms}",
            f"--warmup-stabilization-window={self.stabilization_window}",
        ]


STABILIZATION = Warmup("stabilization")
"""The replica's defaults: promoted once 5 samples 1 s apart agree (5 s after registration)."""
FIXED = Warmup("fixed", stabilization_window=1_000_000)
"""A window no sampler can fill, so the 60 s deadline always decides: a fixed warmup."""


@dataclass(frozen=True, slots=True)
class RolloutParams:
    """One rehearsal. Defaults mirror the chart (3 replicas, 2 s probes, 5 s shutdown delay)."""

    replicas: int = 3
    pylons: int = 2
    replace: int | None = None
    """How many slots to replace, highest ordinal first (None: all of them)."""
    warmup: Warmup = STABILIZATION
    probe_period: float = 2.0
    probe_timeout: float = 1.0
    failure_threshold: int = 3
    propagation_lag: float = 1.0
    min_ready_seconds: float = 0.0
    shutdown_delay_ms: int = 5_000
    drain_timeout_ms: int = 30_000
    clients: int = 8
    """Client workers: the first half (rounded up) use the openai SDK, the rest fresh sockets."""
    think_ms: float = 50.0
    request_timeout: float = 30.0
    warm_before: float = 3.0
    warm_after: float = 3.0
    phase_poll: float = 0.1
    """How often the timeline samples each replica's /readyz phase (the kubelet probe is apart)."""
    mock_ttft_ms: int = 20
    mock_inter_token_ms: int = 10
    mock_tokens: int = 8
    out_dir: Path = ROOT / "benchmarks" / "out"
    label: str = "run"

    def validate(self) -> None:
        if self.replicas < 2:
            raise ValueError("--replicas must be at least 2 (one must stay in service)")
        if self.pylons < 1 or self.clients < 1:
            raise ValueError("--pylons and --clients must be positive")
        if self.replace is not None and not 0 <= self.replace <= self.replicas:
            raise ValueError("--replace must be between 0 and --replicas")
        if min(self.probe_period, self.probe_timeout, self.phase_poll, self.request_timeout) <= 0:
            raise ValueError("periods and timeouts must be positive")
        if min(self.propagation_lag, self.min_ready_seconds, self.think_ms) < 0:
            raise ValueError("--propagation-lag, --min-ready-seconds and --think-ms must be >= 0")
        if min(self.warm_before, self.warm_after) < 0 or self.failure_threshold < 1:
            raise ValueError("warm periods must be >= 0 and --failure-threshold >= 1")
        if self.shutdown_delay_ms < 0 or self.drain_timeout_ms < 0:
            raise ValueError("--shutdown-delay-ms and --drain-timeout-ms must be >= 0")

    @property
    def slots_to_replace(self) -> list[int]:
        count = self.replicas if self.replace is None else self.replace
        return list(reversed(range(self.replicas)))[:count]

    def join_bound(self) -> float:
        """Longest wait for a started replica to be in service before the rehearsal gives up."""
        return (
            self.warmup.warmup_ms / 1000
            + self.probe_period * (self.failure_threshold + 2)
            + self.min_ready_seconds
            + PROCESS_START_TIMEOUT
        )

    def exit_bound(self) -> float:
        """Longest wait for a terminating replica to exit (then it is killed, as the kubelet
        would after terminationGracePeriodSeconds)."""
        return (self.shutdown_delay_ms + self.drain_timeout_ms) / 1000 + 10.0

    def budget(self) -> float:
        """The whole run's bound: bring-up, every slot's replacement, warm periods, teardown."""
        per_slot = self.exit_bound() + self.propagation_lag + self.join_bound()
        return (
            self.join_bound()
            + PROCESS_START_TIMEOUT
            + len(self.slots_to_replace) * per_slot
            + self.warm_before
            + self.warm_after
            + self.request_timeout
            + 30.0
        )


# ---- records -------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestRecord:
    """One client request, as the client saw it (plus the replica its connection went to)."""

    worker: int
    client: Literal["sdk", "fresh"]
    stream: bool
    start: float
    end: float
    kind: str
    detail: str = ""
    slot: int | None = None
    generation: int | None = None


@dataclass(slots=True)
class ConnectionRecord:
    """One client connection, as the Service simulator saw it."""

    client_ip: str
    client_port: int
    accepted: float
    slot: int | None = None
    generation: int | None = None
    upstream: str = "pending"  # connected, refused, connect_error or no_endpoint
    closed: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    reset: bool = False


@dataclass(frozen=True, slots=True)
class SlotEvent:
    """Something the orchestrator did or saw: sigterm, exited, started, in_service, removed."""

    at: float
    slot: int
    what: str
    detail: str = ""


@dataclass
class RolloutReport:
    """Everything one run recorded; times are `time.monotonic()` seconds."""

    params: RolloutParams
    shutdown_delay_flag: bool
    origin: float
    end: float
    rollout_start: float
    rollout_end: float
    requests: list[RequestRecord]
    connections: list[ConnectionRecord]
    phases: dict[int, list[tuple[float, str]]]
    events: list[SlotEvent]
    log_dir: Path

    @property
    def rollout_seconds(self) -> float:
        return self.rollout_end - self.rollout_start

    @property
    def failed(self) -> int:
        return sum(1 for record in self.requests if record.kind != "ok")

    def failures_by_kind(self) -> dict[str, int]:
        counts = Counter(record.kind for record in self.requests if record.kind != "ok")
        return {kind: counts.get(kind, 0) for kind in FAILURE_KINDS}

    def phases_seen(self) -> set[str]:
        return {phase for samples in self.phases.values() for _, phase in samples}

    def exits(self) -> list[str]:
        """How each terminated replica ended: exit code and seconds from SIGTERM to exit (the
        leave phase plus the drain; a kill means the grace period ran out)."""
        sigterms: dict[int, float] = {}
        lines = []
        for event in self.events:
            if event.what == "sigterm":
                sigterms[event.slot] = event.at
            elif event.what in ("exited", "killed") and event.slot in sigterms:
                since = event.at - sigterms[event.slot]
                lines.append(
                    f"replica-{event.slot} {event.what} {since:.2f} s after SIGTERM "
                    f"({event.detail})"
                )
                if event.what == "exited":
                    del sigterms[event.slot]
        return lines

    def describe_failures(self) -> str:
        """A readable breakdown: count per kind, by client kind, replica and detail."""
        lines = [
            f"{self.failed} of {len(self.requests)} requests failed "
            f"({self.params.warmup.mode} warmup, rollout {self.rollout_seconds:.1f} s, "
            f"--shutdown-delay-ms {'passed' if self.shutdown_delay_flag else 'not offered'}, "
            f"phases seen: {', '.join(sorted(self.phases_seen()))})"
        ]
        for kind in FAILURE_KINDS:
            failed = [record for record in self.requests if record.kind == kind]
            if not failed:
                continue
            clients = Counter(record.client for record in failed)
            slots = Counter(
                "?" if record.slot is None else f"replica-{record.slot}" for record in failed
            )
            details = Counter(record.detail for record in failed)
            lines.append(
                f"  {kind}: {len(failed)} (sdk {clients['sdk']}, fresh {clients['fresh']}; "
                + ", ".join(f"{name} {count}" for name, count in sorted(slots.items()))
                + ")"
            )
            for detail, count in details.most_common(3):
                lines.append(f"      {count} x {detail[:160]}")
        lines.extend(f"  {line}" for line in self.exits())
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        def rel(value: float) -> float:
            return round(value - self.origin, 4)

        return {
            "params": {**asdict(self.params), "out_dir": str(self.params.out_dir)},
            "shutdown_delay_flag": self.shutdown_delay_flag,
            "rollout_seconds": self.rollout_seconds,
            "failures_by_kind": self.failures_by_kind(),
            "requests": [
                {**asdict(record), "start": rel(record.start), "end": rel(record.end)}
                for record in self.requests
            ],
            "connections": [
                {
                    **asdict(record),
                    "accepted": rel(record.accepted),
                    "closed": None if record.closed is None else rel(record.closed),
                }
                for record in self.connections
            ],
            "phases": {
                f"replica-{slot}": [[rel(at), phase] for at, phase in samples]
                for slot, samples in self.phases.items()
            },
            "events": [{**asdict(event), "at": rel(event.at)} for event in self.events],
        }


# ---- small HTTP helpers --------------------------------------------------------------------------


async def http_get(port: int, path: str, seconds: float) -> tuple[int, bytes] | None:
    """GET `path` on 127.0.0.1:`port` over a fresh connection (as the kubelet probes); None when
    there is no complete answer within `seconds`."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with trio.fail_after(seconds):
            await sock.connect(("127.0.0.1", port))
            stream = trio.SocketStream(sock)
            conn = h11.Connection(h11.CLIENT)
            request = h11.Request(
                method="GET",
                target=path,
                headers=[("host", f"127.0.0.1:{port}"), ("connection", "close")],
            )
            await stream.send_all(
                (conn.send(request) or b"") + (conn.send(h11.EndOfMessage()) or b"")
            )
            return await read_response(conn, stream)
    except (OSError, trio.TooSlowError, trio.BrokenResourceError, h11.ProtocolError):
        return None
    finally:
        sock.close()


def _json(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _error_code(body: object) -> str:
    """The OpenAI error document's `code` (or the message), for the failure details."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            return str(inner.get("code") or inner.get("message") or inner)[:120]
    return str(body)[:120]


def _status_kind(status: int) -> str:
    if status == 404:
        return "http_404"
    if status == 503:
        return "http_503"
    if 500 <= status <= 599:
        return "http_5xx_other"
    return "other"


# ---- the clients (plain threads) -----------------------------------------------------------------


class ServerDisconnected(ConnectionError):
    """The server (through the simulator) closed the connection before the response ended."""


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen and len(seen) < 20:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def classify(error: BaseException) -> tuple[str, str]:
    """An exception a client request raised -> (outcome kind, detail)."""
    chain = _chain(error)
    detail = f"{type(error).__name__}: {error}"
    if len(chain) > 1:  # the SDK wraps the cause: name it too ("Connection error." says little)
        root = chain[-1]
        detail += f" <- {type(root).__name__}: {root}"
    detail = detail[:200]
    for item in chain:
        if isinstance(item, openai.APIStatusError):
            return _status_kind(item.status_code), f"{item.status_code} {_error_code(item.body)}"
    timeouts = (openai.APITimeoutError, httpx2.TimeoutException, TimeoutError)
    if any(isinstance(item, timeouts) for item in chain):
        return "timeout", detail
    if any(isinstance(item, ConnectionRefusedError) for item in chain):
        return "connection_refused", detail
    disconnects = (
        ConnectionResetError,
        BrokenPipeError,
        ConnectionAbortedError,
        ServerDisconnected,
        h11.RemoteProtocolError,
        httpx2.RemoteProtocolError,
        httpx2.ReadError,
        httpx2.WriteError,
    )
    if any(isinstance(item, disconnects) for item in chain):
        return "remote_disconnect", detail
    return "other", detail


def judge_response(status: int, body: bytes, stream: bool) -> tuple[str, str]:
    """A complete raw HTTP response -> (outcome kind, detail)."""
    if status != 200:
        return _status_kind(status), f"{status} {_error_code(_json(body) or body[:120])}"
    if stream:
        if b"data: [DONE]" in body:
            return "ok", ""
        return "other", "200 stream without data: [DONE]"
    document = _json(body)
    if document is not None and document.get("choices"):
        return "ok", ""
    return "other", "200 without choices"


def fresh_request(source_ip: str, port: int, stream: bool, timeout: float) -> tuple[str, str]:
    """One request on a new connection (raw socket + h11), closed afterwards."""
    deadline = time.monotonic() + timeout
    body = STREAM_BODY if stream else CHAT_BODY

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no complete response within {timeout:g} s")
        return remaining

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((source_ip, 0))
            sock.settimeout(left())
            sock.connect(("127.0.0.1", port))
            conn = h11.Connection(h11.CLIENT)
            headers = [
                ("host", f"127.0.0.1:{port}"),
                ("content-type", "application/json"),
                ("content-length", str(len(body))),
            ]
            request = h11.Request(method="POST", target=CHAT_PATH, headers=headers)
            sock.settimeout(left())
            sock.sendall(
                (conn.send(request) or b"")
                + (conn.send(h11.Data(data=body)) or b"")
                + (conn.send(h11.EndOfMessage()) or b"")
            )
            status = 0
            parts: list[bytes] = []
            for _ in range(1_000_000):  # and by the deadline: a read waits at most what is left
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError as error:  # h11's words for an early close
                    raise ServerDisconnected("connection closed before the response") from error
                if event is h11.NEED_DATA:
                    sock.settimeout(left())
                    conn.receive_data(sock.recv(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    parts.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise ServerDisconnected("connection closed before the response")
            else:
                return "other", "too many HTTP events"
        return judge_response(status, b"".join(parts), stream)
    except Exception as error:
        return classify(error)


def sdk_request(client: openai.OpenAI, stream: bool) -> tuple[str, str]:
    """One chat completion through the official SDK (its pooled connection, no retries)."""
    try:
        if stream:
            finished = False
            chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
            with chunks:
                for chunk in chunks:
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finished = True
            return ("ok", "") if finished else ("other", "stream ended without finish_reason")
        completion = client.chat.completions.create(model=MODEL, messages=MESSAGES)
        return ("ok", "") if completion.choices else ("other", "200 without choices")
    except Exception as error:
        return classify(error)


def source_ip(worker: int) -> str:
    """Each worker's own loopback source address, so its connections can be told apart."""
    return f"127.1.{worker // 200}.{worker % 200 + 1}"


class ClientWorker:
    """One client: sequential requests, alternating streaming and not, until told to stop."""

    def __init__(
        self,
        index: int,
        kind: Literal["sdk", "fresh"],
        port: int,
        params: RolloutParams,
        stop: threading.Event,
    ) -> None:
        self.index = index
        self.kind: Literal["sdk", "fresh"] = kind
        self.ip = source_ip(index)
        self.port = port
        self.params = params
        self.stop = stop
        self.records: list[RequestRecord] = []
        self.in_flight: tuple[float, bool] | None = None
        self.crash: BaseException | None = None

    def run(self) -> None:
        client: openai.OpenAI | None = None
        try:
            if self.kind == "sdk":
                transport = httpx2.HTTPTransport(local_address=self.ip)
                client = openai.OpenAI(
                    base_url=f"http://127.0.0.1:{self.port}/v1",
                    api_key="unused",
                    max_retries=0,
                    timeout=self.params.request_timeout,
                    http_client=openai.DefaultHttpxClient(transport=transport, trust_env=False),
                )
            for sequence in range(MAX_REQUESTS_PER_WORKER):
                if self.stop.is_set():
                    break
                stream = (sequence + self.index) % 2 == 0
                start = time.monotonic()
                self.in_flight = (start, stream)
                if client is not None:
                    kind, detail = sdk_request(client, stream)
                else:
                    kind, detail = fresh_request(
                        self.ip, self.port, stream, self.params.request_timeout
                    )
                end = time.monotonic()
                if kind == "ok" and end - start > self.params.request_timeout:
                    # The SDK's timeout bounds each read, not the request: apply ours here.
                    kind, detail = "timeout", f"took {end - start:.1f} s"
                self.records.append(
                    RequestRecord(self.index, self.kind, stream, start, end, kind, detail)
                )
                self.in_flight = None
                self.stop.wait(self.params.think_ms / 1000)
        except BaseException as error:  # recorded and re-raised by the orchestrator
            self.crash = error
        finally:
            if client is not None:
                client.close()


# ---- the Service simulator -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SlotPorts:
    http: int
    grpc: int
    discovery: int
    metrics: int


@dataclass
class Slot:
    """One StatefulSet ordinal: its ports, its current process and its endpoint state."""

    index: int
    ports: SlotPorts
    generation: int = 0
    process: trio.Process | None = None
    terminating: bool = False
    in_service: bool = False
    ready_since: float | None = None
    probe_failures: int = 0
    joined: trio.Event = field(default_factory=trio.Event)
    removed: trio.Event = field(default_factory=trio.Event)

    @property
    def name(self) -> str:
        return f"replica-{self.index}"


def _abort(stream: trio.SocketStream) -> None:
    """Close with a reset (SO_LINGER 0), as conntrack passes an RST on."""
    with suppress(OSError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    stream.socket.close()


class ServiceSimulator:
    """kube-proxy for one ClusterIP Service: per-connection round robin over ready endpoints."""

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self.connections: list[ConnectionRecord] = []
        self._next = 0

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=1024)
        task_status.started(int(listeners[0].socket.getsockname()[1]))
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        try:
            peer = client.socket.getpeername()
        except OSError:  # the client is already gone
            peer = ("?", 0)
        record = ConnectionRecord(str(peer[0]), int(peer[1]), time.monotonic())
        self.connections.append(record)
        upstream: trio.SocketStream | None = None
        try:
            endpoints = [slot for slot in self.slots if slot.in_service]
            if not endpoints:
                record.upstream = "no_endpoint"
                _abort(client)
                return
            slot = endpoints[self._next % len(endpoints)]
            self._next += 1
            record.slot, record.generation = slot.index, slot.generation
            sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                with trio.fail_after(CONNECT_TIMEOUT):
                    await sock.connect(("127.0.0.1", slot.ports.http))
            except (OSError, trio.TooSlowError) as error:
                sock.close()
                refused = isinstance(error, ConnectionRefusedError)
                record.upstream = "refused" if refused else "connect_error"
                _abort(client)
                return
            record.upstream = "connected"
            upstream = trio.SocketStream(sock)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, client, upstream, record, True, nursery.cancel_scope)
                nursery.start_soon(
                    self._pump, upstream, client, record, False, nursery.cancel_scope
                )
            if record.reset:
                _abort(client)
                _abort(upstream)
        finally:
            record.closed = time.monotonic()
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(client)
                if upstream is not None:
                    await trio.aclose_forcefully(upstream)

    @staticmethod
    async def _pump(
        source: trio.SocketStream,
        sink: trio.SocketStream,
        record: ConnectionRecord,
        up: bool,
        scope: trio.CancelScope,
    ) -> None:
        """Copy one direction; pass a FIN on as a half-close, a reset as a reset of both."""
        try:
            while True:  # ends at EOF, on an error, or when the run cancels the simulator
                data = await source.receive_some(65536)
                if not data:
                    with suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        await sink.send_eof()
                    return
                await sink.send_all(data)
                if up:
                    record.bytes_up += len(data)
                else:
                    record.bytes_down += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            record.reset = True
            scope.cancel()


# ---- processes -----------------------------------------------------------------------------------


class Processes:
    """Every child this run starts, with its log; `stop_all` ends each one by its own handle."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[tuple[str, trio.Process, Path]] = []

    async def spawn(self, name: str, args: Sequence[str]) -> tuple[trio.Process, Path]:
        log_path = self.log_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with log_path.open("wb") as log:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "stargate", *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=env,
                start_new_session=True,  # Ctrl-C reaches only us; we stop the children ourselves
            )
        self.started.append((name, process, log_path))
        return process, log_path

    async def stop_all(self) -> None:
        """SIGINT to replicas (it skips the shutdown delay), SIGTERM to the rest; then kill."""
        for name, process, _ in self.started:
            if process.returncode is None:
                with suppress(OSError):
                    process.send_signal(
                        signal.SIGINT if name.startswith("replica") else signal.SIGTERM
                    )
        with trio.move_on_after(STOP_GRACE_SECONDS):
            for _, process, _ in self.started:
                await process.wait()
        for _, process, _ in self.started:
            if process.returncode is None:
                with suppress(OSError):
                    process.kill()
                await process.wait()


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


BRING_UP_ATTEMPTS = 3
"""How often a run starts over with fresh ports when one was taken before a replica bound it."""


def free_ports(count: int) -> list[int]:
    """Distinct loopback ports that were free a moment ago, picked *below* the kernel's
    ephemeral range: the thousands of client connections of a run take their local ports from
    that range, and one of them could otherwise take a slot's port while its replica restarts."""
    low = _ephemeral_low()
    chosen: list[int] = []
    rng = random.Random()
    for _ in range(count * 50):
        if len(chosen) == count:
            return chosen
        port = rng.randrange(PORT_FLOOR, low)
        if port in chosen:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
    raise RolloutError(f"could not find {count} free ports in [{PORT_FLOOR}, {low})")


PORT_FLOOR = 20_000


def _ephemeral_low() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return max(PORT_FLOOR + 1_000, int(text.split()[0]))
    except (OSError, ValueError, IndexError):
        return 32_768


_DELAY_FLAG: bool | None = None


async def serve_offers_shutdown_delay() -> bool:
    """Whether this `stargate serve` has `--shutdown-delay-ms` (read from its --help, once)."""
    global _DELAY_FLAG
    if _DELAY_FLAG is None:
        with trio.fail_after(PROCESS_START_TIMEOUT):
            result = await trio.run_process(
                [sys.executable, "-m", "stargate", "serve", "--help"],
                capture_stdout=True,
                capture_stderr=True,
                cwd=ROOT,
            )
        _DELAY_FLAG = b"--shutdown-delay-ms" in result.stdout
    return _DELAY_FLAG


# ---- the rehearsal -------------------------------------------------------------------------------


class Rehearsal:
    """One run: bring-up, clients, the rollout, teardown; then the report."""

    def __init__(self, params: RolloutParams, log_dir: Path, delay_flag: bool) -> None:
        self.params = params
        self.delay_flag = delay_flag
        self.procs = Processes(log_dir)
        self.log_dir = log_dir
        ports = free_ports(4 * params.replicas + params.pylons)
        self.slots = [
            Slot(index, SlotPorts(*ports[4 * index : 4 * index + 4]))
            for index in range(params.replicas)
        ]
        self.mock_ports = ports[4 * params.replicas :]
        self.simulator = ServiceSimulator(self.slots)
        self.events: list[SlotEvent] = []
        self.phases: dict[int, list[tuple[float, str]]] = {slot.index: [] for slot in self.slots}
        self.stop_clients = threading.Event()
        self.stopping = False
        self.stage = "starting"

    def event(self, slot: Slot, what: str, detail: str = "") -> None:
        self.events.append(SlotEvent(time.monotonic(), slot.index, what, detail))

    def set_service(self, slot: Slot, in_service: bool, why: str) -> None:
        if slot.in_service == in_service:
            return
        slot.in_service = in_service
        self.event(slot, "in_service" if in_service else "removed", why)
        if in_service:
            slot.joined.set()
        else:
            slot.removed.set()

    # ---- replicas -----------------------------------------------------------------------------

    def replica_args(self, slot: Slot) -> list[str]:
        params = self.params
        peers = [
            f"--peer={other.name}=127.0.0.1:{other.ports.grpc}"
            for other in self.slots
            if other is not slot
        ]
        delay = [f"--shutdown-delay-ms={params.shutdown_delay_ms}"] if self.delay_flag else []
        return [
            "serve",
            f"--stargate-id={slot.name}",
            f"--http-listen-addr=127.0.0.1:{slot.ports.http}",
            f"--listen-addr=127.0.0.1:{slot.ports.grpc}",
            f"--model-discovery-listen-addr=127.0.0.1:{slot.ports.discovery}",
            f"--metrics-port={slot.ports.metrics}",
            f"--advertise-addr=127.0.0.1:{slot.ports.grpc}",
            *peers,
            "--accept-openai-requests",
            f"--shutdown-drain-timeout-ms={params.drain_timeout_ms}",
            *delay,
            *params.warmup.args(),
            "--log-level=info",
        ]

    async def start_replica(self, slot: Slot, nursery: trio.Nursery) -> None:
        slot.generation += 1
        slot.terminating = False
        slot.in_service = False
        slot.ready_since = None
        slot.probe_failures = 0
        slot.joined = trio.Event()
        slot.removed = trio.Event()
        process, log_path = await self.procs.spawn(
            f"{slot.name}.gen{slot.generation}", self.replica_args(slot)
        )
        slot.process = process
        self.event(slot, "started", f"generation {slot.generation}, pid {process.pid}")
        nursery.start_soon(self.watch_replica, slot, slot.generation, process, log_path)
        nursery.start_soon(self.kubelet_probe, slot, slot.generation, process)

    async def watch_replica(
        self, slot: Slot, generation: int, process: trio.Process, log_path: Path
    ) -> None:
        """Record the exit; an exit nobody asked for ends the rehearsal (start failures too)."""
        code = await process.wait()
        self.event(slot, "exited", f"generation {generation}: code {code}")
        if slot.generation == generation and not slot.terminating and not self.stopping:
            raise RolloutError(
                f"{slot.name} (generation {generation}) exited with code {code} during "
                f"{self.stage}\n{log_tail(log_path)}"
            )

    async def kubelet_probe(self, slot: Slot, generation: int, process: trio.Process) -> None:
        """The readiness probe of one pod: GET /readyz every period, for the pod's life."""
        params = self.params
        next_probe = time.monotonic()
        while slot.generation == generation and process.returncode is None:
            answer = await http_get(slot.ports.http, "/readyz", params.probe_timeout)
            now = time.monotonic()
            if answer is not None and answer[0] == 200:
                slot.probe_failures = 0
                if slot.ready_since is None:
                    slot.ready_since = now
            else:
                slot.probe_failures += 1
                if slot.probe_failures >= params.failure_threshold:
                    slot.ready_since = None
                    self.set_service(slot, False, "readiness probe failed")
            next_probe += params.probe_period
            # Between probes, join as soon as minReadySeconds of readiness have passed.
            while slot.generation == generation and process.returncode is None:
                now = time.monotonic()
                if (
                    slot.ready_since is not None
                    and not slot.terminating
                    and now - slot.ready_since >= params.min_ready_seconds
                ):
                    self.set_service(slot, True, "ready")
                if now >= next_probe:
                    break
                await trio.sleep(min(0.05, next_probe - now))

    async def propagate_removal(self, slot: Slot, generation: int) -> None:
        """The endpoint leaves every proxy `propagation lag` after the pod starts terminating."""
        await trio.sleep(self.params.propagation_lag)
        if slot.generation == generation:
            self.set_service(slot, False, "terminating (endpoint propagation)")
            slot.removed.set()

    async def observe_phases(self, slot: Slot) -> None:
        """Sample the slot's phase for the timeline (runs until the rehearsal cancels it)."""
        poll = self.params.phase_poll
        samples = self.phases[slot.index]
        while True:
            process = slot.process
            if process is None or process.returncode is not None:
                phase = "down"
            else:
                answer = await http_get(slot.ports.http, "/readyz", self.params.probe_timeout)
                document = None if answer is None else _json(answer[1])
                phase = str(document.get("phase")) if document and document.get("phase") else ""
                if not phase:
                    phase = "draining" if slot.terminating else "starting"
            if not samples or samples[-1][1] != phase:
                samples.append((time.monotonic(), phase))
            await trio.sleep(poll)

    async def wait_in_service(self, slot: Slot) -> float:
        bound = self.params.join_bound()
        with trio.move_on_after(bound):
            await slot.joined.wait()
            return time.monotonic()
        raise RolloutError(
            f"{slot.name} was not in service within {bound:.0f} s during {self.stage}\n"
            f"{log_tail(self.log_dir / f'{slot.name}.gen{slot.generation}.log')}"
        )

    async def replace_slot(self, slot: Slot, nursery: trio.Nursery) -> float:
        """SIGTERM, wait for the exit and the endpoint removal, start anew, wait for service."""
        process = slot.process
        assert process is not None
        self.stage = f"the replacement of {slot.name}"
        slot.terminating = True
        self.event(slot, "sigterm")
        process.send_signal(signal.SIGTERM)
        nursery.start_soon(self.propagate_removal, slot, slot.generation)
        with trio.move_on_after(self.params.exit_bound()):
            await process.wait()
        if process.returncode is None:
            self.event(slot, "killed", "did not exit within the grace period")
            process.kill()
            await process.wait()
        slot.process = None
        # A StatefulSet creates the new pod once the old one is gone, its endpoint with it.
        with trio.move_on_after(self.params.propagation_lag + 1.0):
            await slot.removed.wait()
        await self.start_replica(slot, nursery)
        return await self.wait_in_service(slot)

    # ---- the rest of the cast -----------------------------------------------------------------

    async def start_engines(self, nursery: trio.Nursery) -> None:
        params = self.params
        engines: list[tuple[trio.Process, Path, int]] = []
        for index, port in enumerate(self.mock_ports):
            process, log_path = await self.procs.spawn(
                f"engine-{index}",
                [
                    "mock-backend",
                    f"--port={port}",
                    f"--model={MODEL}",
                    f"--ttft-ms={params.mock_ttft_ms}",
                    f"--inter-token-ms={params.mock_inter_token_ms}",
                    f"--tokens={params.mock_tokens}",
                    "--log-level=warning",
                ],
            )
            engines.append((process, log_path, port))
        for index, (process, log_path, port) in enumerate(engines):
            with trio.move_on_after(PROCESS_START_TIMEOUT):
                while process.returncode is None:
                    answer = await http_get(port, "/health", 1.0)
                    if answer is not None and answer[0] == 200:
                        break
                    await trio.sleep(0.05)
            if process.returncode is not None or answer is None or answer[0] != 200:
                raise RolloutError(f"mock engine {index} did not start\n{log_tail(log_path)}")
        seeds = [f"--stargate=127.0.0.1:{slot.ports.grpc}" for slot in self.slots]
        for index, (_, _, port) in enumerate(engines):
            await self.procs.spawn(
                f"pylon-{index}",
                [
                    "pylon",
                    f"--upstream=http://127.0.0.1:{port}",
                    *seeds,
                    f"--inference-server-id=rollout-engine-{index}",
                    f"--model-name={MODEL}",
                    "--log-level=info",
                ],
            )
        for name, process, log_path in self.procs.started:
            if name.startswith(("engine", "pylon")):
                nursery.start_soon(self.watch_helper, name, process, log_path)

    async def watch_helper(self, name: str, process: trio.Process, log_path: Path) -> None:
        """An engine or Pylon that dies would skew the measure: end the rehearsal instead."""
        code = await process.wait()
        if not self.stopping:
            raise RolloutError(f"{name} exited with code {code}\n{log_tail(log_path)}")

    # ---- the run ------------------------------------------------------------------------------

    async def run(self) -> RolloutReport:
        params = self.params
        workers: list[ClientWorker] = []
        threads: list[threading.Thread] = []
        try:
            with trio.fail_after(params.budget()):
                async with trio.open_nursery() as nursery:
                    self.stage = "bring-up"
                    for slot in self.slots:
                        await self.start_replica(slot, nursery)
                    await self.start_engines(nursery)
                    port = await nursery.start(self.simulator.serve)
                    for slot in self.slots:
                        nursery.start_soon(self.observe_phases, slot)
                    for slot in self.slots:
                        await self.wait_in_service(slot)

                    self.stage = "the warm period before the rollout"
                    sdk_workers = math.ceil(params.clients / 2)
                    for index in range(params.clients):
                        kind: Literal["sdk", "fresh"] = "sdk" if index < sdk_workers else "fresh"
                        workers.append(ClientWorker(index, kind, port, params, self.stop_clients))
                    origin = time.monotonic()
                    for worker in workers:
                        thread = threading.Thread(
                            target=worker.run, name=f"rollout-client-{worker.index}", daemon=True
                        )
                        thread.start()
                        threads.append(thread)
                    await trio.sleep(params.warm_before)

                    rollout_start = time.monotonic()
                    rollout_end = rollout_start
                    for index in params.slots_to_replace:
                        rollout_end = await self.replace_slot(self.slots[index], nursery)

                    self.stage = "the warm period after the rollout"
                    await trio.sleep(params.warm_after)
                    self.stage = "stopping the clients"
                    self.stop_clients.set()
                    await trio.to_thread.run_sync(_join_all, threads, params.request_timeout + 5.0)
                    end = time.monotonic()
                    self.stopping = True
                    nursery.cancel_scope.cancel()
        except trio.TooSlowError:
            raise RolloutError(
                f"the run exceeded its {params.budget():.0f} s budget during {self.stage}"
            ) from None
        except BaseExceptionGroup as group:
            failure = first_of(group, RolloutError)
            if failure is None:
                raise
            raise failure from None
        finally:
            self.stop_clients.set()
            self.stopping = True
            with trio.CancelScope(shield=True):
                await self.procs.stop_all()
        for worker in workers:
            if worker.crash is not None:
                raise RolloutError(f"client worker {worker.index} crashed: {worker.crash!r}")
        requests = collect_requests(workers, end)
        attribute(requests, self.simulator.connections)
        return RolloutReport(
            params=params,
            shutdown_delay_flag=self.delay_flag,
            origin=origin,
            end=end,
            rollout_start=rollout_start,
            rollout_end=rollout_end,
            requests=requests,
            connections=list(self.simulator.connections),
            phases={index: list(samples) for index, samples in self.phases.items()},
            events=list(self.events),
            log_dir=self.log_dir,
        )


def first_of(error: BaseException, kind: type[E]) -> E | None:
    """The first `kind` exception in `error` or, recursively, in its groups (trio nurseries wrap
    every exception in a group)."""
    if isinstance(error, kind):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = first_of(inner, kind)
            if found is not None:
                return found
    return None


def _join_all(threads: Iterable[threading.Thread], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def collect_requests(workers: Iterable[ClientWorker], end: float) -> list[RequestRecord]:
    """Every request sent; one still in flight after the clients were joined is a timeout."""
    requests: list[RequestRecord] = []
    for worker in workers:
        requests.extend(worker.records)
        if worker.in_flight is not None:
            start, stream = worker.in_flight
            requests.append(
                RequestRecord(
                    worker.index, worker.kind, stream, start, end, "timeout", "still in flight"
                )
            )
    requests.sort(key=lambda record: record.start)
    return requests


def attribute(requests: list[RequestRecord], connections: list[ConnectionRecord]) -> None:
    """Join each request to the simulator's connection it used.

    A worker makes one request at a time from its own source address, so its request used the
    latest connection from that address accepted before the request ended. That gives the replica
    (slot and generation), and turns a reset the simulator sent because the replica refused the
    connection (or no endpoint was ready) into `connection_refused`, which is what a client sees
    when kube-proxy sends its SYN to a pod that no longer listens.
    """
    by_ip: dict[str, list[ConnectionRecord]] = {}
    for connection in sorted(connections, key=lambda item: item.accepted):
        by_ip.setdefault(connection.client_ip, []).append(connection)
    accepted = {ip: [item.accepted for item in items] for ip, items in by_ip.items()}
    for request in requests:
        items = by_ip.get(source_ip(request.worker))
        if not items:
            continue
        position = bisect_right(accepted[source_ip(request.worker)], request.end) - 1
        if position < 0:
            continue
        connection = items[position]
        request.slot, request.generation = connection.slot, connection.generation
        if request.kind == "remote_disconnect" and connection.upstream in (
            "refused",
            "no_endpoint",
        ):
            request.kind = "connection_refused"
            request.detail = f"simulator: upstream {connection.upstream} ({request.detail})"


async def rehearse(params: RolloutParams) -> RolloutReport:
    """Run one rehearsal and return what it recorded (raises RolloutError if it cannot run)."""
    params.validate()
    log_dir = params.out_dir / "logs" / params.label
    log_dir.mkdir(parents=True, exist_ok=True)
    delay_flag = await serve_offers_shutdown_delay()
    for attempt in range(1, BRING_UP_ATTEMPTS + 1):
        try:
            return await Rehearsal(params, log_dir, delay_flag).run()
        except RolloutError as error:
            # Ports are picked free, then bound by the replicas: on a busy machine another
            # process may take one in between. Nothing was measured yet: start over.
            text = str(error)
            if attempt == BRING_UP_ATTEMPTS or not (
                "during bring-up" in text and "Address already in use" in text
            ):
                raise
            print(f"{params.label}: a picked port was taken during bring-up; retrying")
    raise AssertionError("unreachable")


# ---- the report ----------------------------------------------------------------------------------

OUTCOME_COLOURS = {
    "ok": "#a1d99b",
    "connection_refused": "#d62728",
    "remote_disconnect": "#ff7f0e",
    "http_404": "#9467bd",
    "http_503": "#8c564b",
    "http_5xx_other": "#e377c2",
    "timeout": "#000000",
    "other": "#7f7f7f",
}
PHASE_COLOURS = {
    "starting": "#e0e0e0",
    "warming": "#9ecae1",
    "ready": "#31a354",
    "leaving": "#fdae6b",
    "draining": "#de2d26",
    "down": "#636363",
}
SHORT_KINDS = {
    "connection_refused": "refused",
    "remote_disconnect": "disconnect",
    "http_404": "404",
    "http_503": "503",
    "http_5xx_other": "5xx",
    "timeout": "timeout",
    "other": "other",
}


def table(reports: Sequence[RolloutReport]) -> str:
    """One row per run: mode, requests, failed by kind, rollout seconds."""
    headers = [
        "run",
        "warmup",
        "delay flag",
        "leaving seen",
        "requests",
        "failed",
        *SHORT_KINDS.values(),
        "rollout s",
    ]
    rows = []
    for report in reports:
        by_kind = report.failures_by_kind()
        rows.append(
            [
                report.params.label,
                report.params.warmup.mode,
                "passed" if report.shutdown_delay_flag else "absent",
                "yes" if "leaving" in report.phases_seen() else "no",
                str(len(report.requests)),
                str(report.failed),
                *(str(by_kind[kind]) for kind in SHORT_KINDS),
                f"{report.rollout_seconds:.1f}",
            ]
        )
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        first = [cell.ljust(width) for cell, width in zip(cells[:2], widths[:2], strict=True)]
        rest = [cell.rjust(width) for cell, width in zip(cells[2:], widths[2:], strict=True)]
        return "  ".join(first + rest).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def plot(report: RolloutReport, path: Path) -> Path:
    """The timeline PNG: outcomes per 100 ms bucket above, one phase band per replica below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin, span = report.origin, report.end - report.origin
    buckets = max(1, math.ceil(span / BUCKET_SECONDS))
    counts = {kind: [0] * buckets for kind in OUTCOMES}
    for record in report.requests:
        index = min(buckets - 1, max(0, int((record.start - origin) / BUCKET_SECONDS)))
        counts[record.kind][index] += 1
    xs = [index * BUCKET_SECONDS for index in range(buckets)]

    slots = sorted(report.phases)
    figure, (top, bottom) = plt.subplots(
        2,
        1,
        sharex=True,
        figsize=(14, 6 + 0.45 * len(slots)),
        layout="constrained",
        gridspec_kw={"height_ratios": [3, 0.6 + 0.45 * len(slots)]},
    )
    base = [0] * buckets
    for kind in OUTCOMES:
        heights = counts[kind]
        if not any(heights):
            continue
        total = sum(heights)
        top.bar(
            xs,
            heights,
            width=BUCKET_SECONDS,
            bottom=base,
            align="edge",
            color=OUTCOME_COLOURS[kind],
            label=f"{kind} ({total})",
            linewidth=0,
        )
        base = [low + high for low, high in zip(base, heights, strict=True)]
    # On a long timeline a failed 100 ms bar is a hairline: mark each bucket with failures above.
    peak = max(base, default=0) or 1
    for kind in FAILURE_KINDS:
        marks = [x + BUCKET_SECONDS / 2 for x, count in zip(xs, counts[kind], strict=True) if count]
        if marks:
            top.plot(
                marks, [peak * 1.06] * len(marks), "v", color=OUTCOME_COLOURS[kind], markersize=5
            )
    top.set_ylim(0, peak * 1.12)
    for event in report.events:
        at = event.at - origin
        if event.what == "sigterm":
            top.axvline(at, color="#d62728", linestyle="--", linewidth=1)
            top.annotate(
                f"SIGTERM replica-{event.slot}",
                (at, 0.01),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="bottom",
                ha="right",
                fontsize=8,
            )
        elif event.what == "in_service" and at > 0:
            top.axvline(at, color="#31a354", linestyle=":", linewidth=1)
    top.set_ylabel(f"requests per {BUCKET_SECONDS * 1000:.0f} ms (by start)")
    top.legend(loc="lower left", bbox_to_anchor=(0, 1.0), fontsize=8, ncol=4, frameon=False)
    figure.suptitle(
        f"{report.params.label}: {report.failed} of {len(report.requests)} requests failed; "
        f"{report.params.replicas} replicas, {report.params.warmup.mode} warmup, rollout "
        f"{report.rollout_seconds:.1f} s, shutdown delay "
        + (f"{report.params.shutdown_delay_ms} ms" if report.shutdown_delay_flag else "absent")
    )

    for row, slot in enumerate(slots):
        y = (len(slots) - 1 - row) * 1.0
        samples = report.phases[slot]
        for position, (at, phase) in enumerate(samples):
            until = samples[position + 1][0] if position + 1 < len(samples) else report.end
            start, stop = max(at, origin), min(until, report.end)
            if stop > start:
                bottom.broken_barh(
                    [(start - origin, stop - start)],
                    (y + 0.25, 0.6),
                    facecolors=PHASE_COLOURS.get(phase, "#ffffff"),
                )
        # The simulator's view: a thin black strip while the endpoint is in service.
        since: float | None = None
        changes = [e for e in report.events if e.slot == slot]
        for event in changes:
            if event.what == "in_service":
                since = event.at
            elif event.what == "removed" and since is not None:
                bottom.broken_barh(
                    [(max(since, origin) - origin, event.at - max(since, origin))],
                    (y + 0.05, 0.12),
                    facecolors="#000000",
                )
                since = None
        if since is not None:
            start = max(since, origin)
            bottom.broken_barh(
                [(start - origin, report.end - start)], (y + 0.05, 0.12), facecolors="#000000"
            )
    bottom.set_yticks([(len(slots) - 1 - row) + 0.5 for row in range(len(slots))])
    bottom.set_yticklabels([f"replica-{slot}" for slot in slots])
    bottom.set_ylim(0, len(slots))
    bottom.set_xlim(0, span)
    bottom.set_xlabel("seconds since the clients started")
    handles = [Patch(color=PHASE_COLOURS[phase], label=phase) for phase in PHASES]
    handles.append(Patch(color="#000000", label="in service (simulator)"))
    bottom.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=7)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


# ---- the command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[RolloutParams, list[Warmup], int]:
    defaults = RolloutParams()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rollout",
        description=(__doc__ or "").split("\n\n")[0]
        + " Exit code: 0 no request failed, 1 some did, 2 the rehearsal could not run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--replicas", type=int, default=defaults.replicas, help="`stargate serve` replicas")
    add("--pylons", type=int, default=defaults.pylons, help="mock engine + Pylon pairs")
    add("--replace", type=int, help="slots to replace, highest ordinal first; None: all")
    add("--probe-period", type=float, default=defaults.probe_period, help="readiness probe, s")
    add("--probe-timeout", type=float, default=defaults.probe_timeout, help="probe timeout, s")
    add(
        "--failure-threshold",
        type=int,
        default=defaults.failure_threshold,
        help="failed probes that take a replica out of the Service",
    )
    add(
        "--propagation-lag",
        type=float,
        default=defaults.propagation_lag,
        help="seconds from SIGTERM until the endpoint leaves the Service",
    )
    add(
        "--min-ready-seconds",
        type=float,
        default=defaults.min_ready_seconds,
        help="continuous readiness before a replica joins (and the rollout moves on)",
    )
    add(
        "--warmup",
        choices=["stabilization", "fixed", "both"],
        default="stabilization",
        help="stabilization: the replica defaults (1 s samples, window 5); fixed: a 60 s warmup "
        "the deadline always decides; both: each mode --runs times",
    )
    add(
        "--shutdown-delay-ms",
        type=int,
        default=defaults.shutdown_delay_ms,
        help="passed to the replicas when `stargate serve` offers it",
    )
    add("--drain-timeout-ms", type=int, default=defaults.drain_timeout_ms, help="replica drain")
    add("--clients", type=int, default=defaults.clients, help="half SDK (pooled), half fresh")
    add("--think-ms", type=float, default=defaults.think_ms, help="pause between requests")
    add(
        "--request-timeout",
        type=float,
        default=defaults.request_timeout,
        help="seconds after which a request counts as a timeout",
    )
    add(
        "--warm-seconds",
        type=float,
        default=defaults.warm_before,
        help="client traffic before the first SIGTERM and after the last replacement is ready",
    )
    add("--out", type=Path, default=defaults.out_dir, help="output directory")
    add("--runs", type=int, default=1, help="repeat each warmup mode this many times")
    args = parser.parse_args(argv)
    params = RolloutParams(
        replicas=args.replicas,
        pylons=args.pylons,
        replace=args.replace,
        probe_period=args.probe_period,
        probe_timeout=args.probe_timeout,
        failure_threshold=args.failure_threshold,
        propagation_lag=args.propagation_lag,
        min_ready_seconds=args.min_ready_seconds,
        shutdown_delay_ms=args.shutdown_delay_ms,
        drain_timeout_ms=args.drain_timeout_ms,
        clients=args.clients,
        think_ms=args.think_ms,
        request_timeout=args.request_timeout,
        warm_before=args.warm_seconds,
        warm_after=args.warm_seconds,
        out_dir=args.out,
    )
    try:
        params.validate()
    except ValueError as error:
        parser.error(str(error))
    if args.runs < 1:
        parser.error("--runs must be positive")
    modes = {"stabilization": [STABILIZATION], "fixed": [FIXED], "both": [STABILIZATION, FIXED]}
    return params, modes[args.warmup], args.runs


async def run_all(
    params: RolloutParams, modes: list[Warmup], runs: int, out: IO[str]
) -> list[RolloutReport]:
    """Every requested run in turn, each reported as soon as it ends; SIGTERM stops cleanly."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = params.out_dir / f"rollout-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    reports: list[RolloutReport] = []
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def on_sigterm() -> None:
                async for _ in signals:
                    raise Terminated  # unwinds like Ctrl-C: every process is still stopped

            nursery.start_soon(on_sigterm)
            for warmup in modes:
                for run in range(1, runs + 1):
                    label = f"{warmup.mode}-run{run}"
                    print(f"{label}: starting", file=sys.stderr, flush=True)
                    started = time.monotonic()
                    report = await rehearse(
                        replace(params, warmup=warmup, out_dir=out_dir, label=label)
                    )
                    reports.append(report)
                    png = plot(report, out_dir / f"{label}.png")
                    data = out_dir / f"{label}.json"
                    data.write_text(json.dumps(report.to_json()))
                    print(table([report]), file=out)
                    print(report.describe_failures(), file=out)
                    print(f"  wall time {time.monotonic() - started:.1f} s", file=out)
                    print(f"  timeline: {png}", file=out)
                    print(f"  records:  {data}", file=out)
                    print(f"  logs:     {report.log_dir}", file=out, flush=True)
            nursery.cancel_scope.cancel()
    return reports


def main(argv: list[str] | None = None) -> int:
    params, modes, runs = parse_args(argv)
    try:
        reports = trio.run(run_all, params, modes, runs, sys.stdout)
    except BaseException as error:  # trio may hand these over inside exception groups
        if first_of(error, KeyboardInterrupt) is not None:
            print("interrupted", file=sys.stderr)
            return 130
        if first_of(error, Terminated) is not None:
            print("terminated", file=sys.stderr)
            return 128 + signal.SIGTERM
        failure = first_of(error, RolloutError)
        if failure is None:
            raise
        print(f"rollout rehearsal failed: {failure}", file=sys.stderr)
        return 2
    if len(reports) > 1:
        print()
        print(table(reports))
    return 1 if any(report.failed for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
