"""Client-limits part: many concurrent streams at default settings, and the answers past a small
computed connection cap (docs/http-serving.md, "Client connections").

`python -m benchmarks client-limits [--quick]` (or `nox -s bench -- client-limits`). One
`stargate mock-backend` whose streams last about 4 s (40 tokens, 100 ms apart), registered with
each replica over a real registration stream; clients are raw trio sockets (HTTP/1.1, one
connection per stream, `Connection: close`) and hand-driven h2c connections (the `h2` library).

* **Default settings**: a replica with no client-limit flag (`--max-client-connections=auto`),
  its cap computed from the raised open-file limit; 1,000 concurrent streaming requests (200 with
  `--quick`). Counted: completed (200 and `[DONE]`), closed (no answer at all), reset, cut, and
  any other status. The operator's figures before: 393 closed and 5 reset of 1,000 at the fixed
  cap of 384.
* **Past a small computed cap**: a replica started with an open-file limit of 360 (cap computed
  as 100). Twice the cap of connections: the cap taken by streams, the 32-connection probe
  reserve by idle connections, then the rest at once, half HTTP/1.1 and half h2c, each sending a
  streaming request. Counted: 503 `too_many_connections`, REFUSED_STREAM after GOAWAY(0), bare
  closes, resets, and whether the streams holding the cap completed.

Writes bench-results/client-limits.{md,json}.
"""

from __future__ import annotations

import json
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx
import trio

from benchmarks.common import (
    BenchError,
    Deadline,
    PartResult,
    Processes,
    Registration,
    Replica,
    Suite,
    free_ports,
    log_tail,
    md_table,
    metric_sum,
    mock_backend_command,
    num,
    raise_open_file_limit,
    server_python,
    start_printing_server,
    start_replica,
    wait_until,
)

NAME = "client-limits"
TITLE = "client connections: concurrent streams at default settings, answers past the cap"

MODEL = "limits-model"
TOKENS = 40
INTER_TOKEN_MS = 100
SMALL_OPEN_FILES = 360
RESERVE = 32  # stargate.http_limits.CONNECTION_RESERVE
CAP_LINE = re.compile(
    r"max client connections: (\d+), computed from the open-file limit \(([^)]*)\)"
)
BODY = json.dumps(
    {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()
HEADERS = [
    ("x-request-id", "limits"),
    ("x-input-tokens", "1"),
    ("x-model", MODEL),
    ("content-type", "application/json"),
    ("content-length", str(len(BODY))),
]


def _h1_request() -> bytes:
    head = "POST /v1/chat/completions HTTP/1.1\r\nhost: stargate\r\nconnection: close\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in HEADERS)
    return head.encode() + b"\r\n" + BODY


async def _h1(port: int, outcomes: list[str], budget: float) -> None:
    """One streamed request on its own HTTP/1.1 connection: completed, refused (503
    too_many_connections), closed (nothing at all), reset, cut, or `status N`."""
    response = bytearray()
    try:
        with trio.move_on_after(budget):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(_h1_request())
                while chunk := await stream.receive_some(65536):
                    response += chunk
    except (trio.BrokenResourceError, OSError):
        outcomes.append("reset")
        return
    if not response:
        outcomes.append("closed")
        return
    head, _, body = bytes(response).partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status == 200:
        outcomes.append("completed" if b"data: [DONE]" in body else "cut")
    elif status == 503 and b"x-stargate-error-code: too_many_connections" in head.lower():
        outcomes.append("refused 503")
    else:
        outcomes.append(f"status {status}")


async def _h2(port: int, outcomes: list[str], budget: float) -> None:
    """The same request over h2c (prior knowledge): completed, refused 503 (a reserve
    connection), refused_stream (RST_STREAM REFUSED_STREAM, GOAWAY leaving it unprocessed),
    closed, reset, or what else happened."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/v1/chat/completions"),
        (":authority", "stargate"),
        *HEADERS,
    ]
    conn.send_headers(1, headers)
    conn.send_data(1, BODY, end_stream=True)
    status: int | None = None
    body = bytearray()
    outcome = "hung"
    try:
        with trio.move_on_after(budget):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(conn.data_to_send())
                goaway: int | None = None
                while outcome == "hung":
                    data = await stream.receive_some(65536)
                    if not data:
                        outcome = "closed" if status is None else "cut"
                        break
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.ResponseReceived):
                            status = int(dict(event.headers)[b":status"])
                        elif isinstance(event, h2.events.DataReceived):
                            body += event.data
                            conn.acknowledge_received_data(event.flow_controlled_length, 1)
                        elif isinstance(event, h2.events.ConnectionTerminated):
                            goaway = event.last_stream_id
                            if status is None and goaway == 0:
                                outcome = "refused_stream"  # GOAWAY(0): stream 1 unprocessed
                        elif isinstance(event, h2.events.StreamReset):
                            refused = event.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
                            outcome = "refused_stream" if refused else f"reset {event.error_code}"
                        elif isinstance(event, h2.events.StreamEnded):
                            if status == 200:
                                outcome = "completed" if b"data: [DONE]" in body else "cut"
                            elif status == 503:
                                outcome = "refused 503"
                            else:
                                outcome = f"status {status}"
                    if goaway is None:
                        await stream.send_all(conn.data_to_send())
    except (trio.BrokenResourceError, OSError, h2.exceptions.ProtocolError):
        outcome = "reset" if outcome == "hung" else outcome
    outcomes.append(outcome)


def _computed_cap(log_path: Path, process: subprocess.Popen[Any]) -> tuple[int, str]:
    found = CAP_LINE.search(log_path.read_text(errors="replace"))
    if found is None:
        raise BenchError(f"no computed-cap line in the replica's log\n{log_tail(log_path)}")
    return int(found[1]), found[2]


def _register(replica: Replica, url: str, deadline: Deadline) -> Registration:
    registration = Registration(replica.grpc, "limits-engine", url, [MODEL])
    registration.wait_ack(deadline.left(10))

    def routable() -> bool:
        response = httpx.post(
            f"{replica.base}/v1/chat/completions",
            headers=dict(HEADERS[:3]),
            content=json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            timeout=10,
        )
        return response.status_code == 200

    wait_until(
        routable, deadline.left(15), "the engine to be routable", replica.process, replica.log_path
    )
    return registration


WITH_OPEN_FILES = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)
"""`python -c WITH_OPEN_FILES N ARGS...`: the open-file limit N, then the interpreter with ARGS."""


def _small_replica(procs: Processes, log_dir: Path, deadline: Deadline) -> Replica:
    """A replica at default settings whose open-file limit (soft and hard) is 360: set by a tiny
    interpreter that then execs the replica, since a `preexec_fn` (code between fork and exec)
    can crash the child of a process in which gRPC runs threads."""
    http, grpc_port, discovery, metrics = free_ports(4)
    log_path = log_dir / "small.log"
    with log_path.open("wb") as log:
        process = procs.spawn(
            [
                server_python(),
                "-c",
                WITH_OPEN_FILES,
                str(SMALL_OPEN_FILES),
                "-m",
                "stargate",
                "serve",
                "--stargate-id=small",
                f"--http-listen-addr=127.0.0.1:{http}",
                f"--listen-addr=127.0.0.1:{grpc_port}",
                f"--model-discovery-listen-addr=127.0.0.1:{discovery}",
                f"--metrics-listen-addr=127.0.0.1:{metrics}",
                "--readiness-warmup-ms=0",
                "--disable-dns-discovery",
                "--registration-update-idle-timeout-ms=0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stop_signal=signal.SIGINT,
        )
    replica = Replica(process, http, grpc_port, metrics, log_path, time.monotonic())
    wait_until(
        lambda: httpx.get(f"{replica.base}/healthz", timeout=5).status_code == 200,
        deadline.left(30),
        "the small replica's /healthz",
        process,
        log_path,
    )
    return replica


async def _many(port: int, streams: int) -> tuple[Counter[str], float]:
    outcomes: list[str] = []
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(streams):
            nursery.start_soon(_h1, port, outcomes, 60.0)
    return Counter(outcomes), trio.current_time() - started


def _open_connections(replica: Replica) -> float:
    return metric_sum(replica.metrics_text(), "stargate_http_client_connections")


async def _past_the_cap(replica: Replica, cap: int) -> dict[str, Any]:
    """The cap taken by streams and the reserve by idle connections, then the rest of twice the
    cap at once, half HTTP/1.1 and half h2c."""
    port = replica.http
    held: list[str] = []
    extra_h1: list[str] = []
    extra_h2: list[str] = []
    extra = 2 * cap - cap - RESERVE
    idle: list[trio.SocketStream] = []
    async with trio.open_nursery() as nursery:
        for _ in range(cap):
            nursery.start_soon(_h1, port, held, 30.0)
        with trio.fail_after(10):
            while await trio.to_thread.run_sync(_in_flight, replica) < cap:  # noqa: ASYNC110
                await trio.sleep(0.05)
        idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(RESERVE)]
        with trio.fail_after(10):
            while await trio.to_thread.run_sync(_open_connections, replica) < cap + RESERVE:  # noqa: ASYNC110
                await trio.sleep(0.05)
        started = trio.current_time()
        async with trio.open_nursery() as flood:
            for index in range(extra):
                if index % 2:
                    flood.start_soon(_h1, port, extra_h1, 10.0)
                else:
                    flood.start_soon(_h2, port, extra_h2, 10.0)
        answered_in = trio.current_time() - started
        for stream in idle:
            await stream.aclose()
    return {
        "cap": cap,
        "connections": 2 * cap,
        "held": dict(Counter(held)),
        "http1": dict(Counter(extra_h1)),
        "h2c": dict(Counter(extra_h2)),
        "answered_in_s": answered_in,
        "held_before_answers": len(held) == cap and all(o == "completed" for o in held),
    }


def _in_flight(replica: Replica) -> float:
    return metric_sum(replica.metrics_text(), "stargate_proxy_requests_in_flight")


def run(suite: Suite) -> PartResult:
    streams = 200 if suite.quick else 1000
    deadline = Deadline(120 if suite.quick else 240)
    nofile = raise_open_file_limit()
    if nofile != resource.RLIM_INFINITY and nofile < 2 * streams + 256:
        raise BenchError(f"the open-file limit ({nofile}) is too low for {streams} streams")
    procs = Processes()
    began = time.monotonic()
    data: dict[str, Any] = {"streams": streams}
    problems: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="stargate-limits-") as tmp:
            log_dir = Path(tmp)
            _, engine_port = start_printing_server(
                procs,
                mock_backend_command(
                    MODEL, "--tokens", str(TOKENS), "--inter-token-ms", str(INTER_TOKEN_MS)
                ),
                log_dir / "engine.log",
                "the mock backend",
                deadline.left(20),
            )
            url = f"http://127.0.0.1:{engine_port}"

            replica = start_replica(
                procs,
                log_dir,
                "limits-default",
                deadline,
                extra_args=[
                    "--max-client-connections=auto",
                    "--registration-update-idle-timeout-ms=0",
                ],
            )
            cap, limit = _computed_cap(replica.log_path, replica.process)
            registration = _register(replica, url, deadline)
            print(
                f"  default settings: cap {cap} (open-file limit {limit}); {streams} streams",
                file=sys.stderr,
            )
            outcomes, took = trio.run(_many, replica.http, streams)
            registration.close()
            procs.stop(replica.process)
            data["default"] = {
                "cap": cap,
                "open_file_limit": limit,
                "outcomes": dict(outcomes),
                "seconds": took,
            }
            if outcomes != Counter({"completed": streams}):
                problems.append(f"{streams} streams at default settings: {dict(outcomes)}")

            small = _small_replica(procs, log_dir, deadline)
            small_cap, small_limit = _computed_cap(small.log_path, small.process)
            registration = _register(small, url, deadline)
            print(
                f"  open-file limit {small_limit}: cap {small_cap}; {2 * small_cap} connections",
                file=sys.stderr,
            )
            past = trio.run(_past_the_cap, small, small_cap)
            past["refusals_full"] = metric_sum(
                small.metrics_text(), 'stargate_http_connection_refusals_total{reason="full"}'
            )
            registration.close()
            data["past_cap"] = past
            bare = sum(
                past[kind].get("closed", 0) + past[kind].get("reset", 0)
                for kind in ("http1", "h2c")
            )
            if bare or not past["held_before_answers"]:
                problems.append(f"past the cap: {past}")
    finally:
        procs.stop_all()

    default = data["default"]
    past = data["past_cap"]
    counts = default["outcomes"]
    rows = [
        [
            f"default settings, {streams} streams",
            num(default["cap"]),
            str(default["open_file_limit"]),
            num(counts.get("completed", 0)),
            num(counts.get("closed", 0)),
            num(counts.get("reset", 0)),
            num(sum(v for k, v in counts.items() if k not in ("completed", "closed", "reset"))),
            num(default["seconds"], 1),
        ]
    ]
    table = md_table(
        ["run", "computed cap", "open-file limit", "completed", "closed", "reset", "other", "s"],
        rows,
    )
    extra_rows = []
    for kind in ("http1", "h2c"):
        seen = past[kind]
        extra_rows.append(
            [
                "HTTP/1.1" if kind == "http1" else "h2c",
                num(sum(seen.values())),
                num(seen.get("refused 503", 0)),
                num(seen.get("refused_stream", 0)),
                num(seen.get("closed", 0)),
                num(seen.get("reset", 0)),
                num(
                    sum(
                        v
                        for k, v in seen.items()
                        if k not in ("refused 503", "refused_stream", "closed", "reset")
                    )
                ),
            ]
        )
    past_table = md_table(
        [
            "past cap + reserve",
            "clients",
            "503 too_many_connections",
            "REFUSED_STREAM",
            "bare close",
            "reset",
            "other",
        ],
        extra_rows,
    )
    markdown = (
        f"{table}\n\nBefore (the fixed cap of 384, an operator's measurement): of 1,000 "
        "concurrent streams, 393 closed without an answer and 5 reset.\n\n"
        f"Open-file limit {SMALL_OPEN_FILES}: computed cap {past['cap']}; {past['connections']} "
        f"connections: {past['cap']} streams held the cap ({past['held']}), {RESERVE} idle "
        f"connections the probe reserve, then the rest at once (answered in "
        f"{past['answered_in_s']:.2f} s; refusals counted `full`: {past['refusals_full']:.0f}):\n\n"
        f"{past_table}\n"
    )
    return PartResult(
        name=NAME,
        title=TITLE,
        markdown=markdown,
        data=data,
        settings={
            "tokens": TOKENS,
            "inter_token_ms": INTER_TOKEN_MS,
            "small_open_files": SMALL_OPEN_FILES,
        },
        problems=problems,
        elapsed=time.monotonic() - began,
    )
