"""A lean SSE engine and a lean SSE load-generator shard for the `stream` part, on raw trio
sockets (non-blocking stdlib sockets driven by `trio.lowlevel.wait_readable/wait_writable`).

`stargate mock-backend` (Quart on Hypercorn) cannot emit 1,000 streams x 50 events/s, and an
httpx client cannot read them; these two can, at a few microseconds per event:

* `python -m benchmarks.sse engine --model M [--events 50] [--interval-ms 20]` serves
  `POST /v1/chat/completions` (streaming: an OpenAI `chat.completion.chunk` event at once, then one
  every interval, each its own chunked write, then `data: [DONE]`; `--events` of them, or the
  request body's `"max_tokens"` when it has one, so one engine serves streams of several lengths;
  not streaming: one small `chat.completion`) and `GET /health` (what the replica probes every
  second), HTTP/1.1 keep-alive. One timer loop (a heap of due streams) writes every due event
  straight to its socket; only a socket whose buffer is full gets its own flushing wait. Every
  event carries its emit time as its first JSON field, `{"t": <time.monotonic()>, ...}`
  (CLOCK_MONOTONIC: the same clock in every process of the machine). It prints `listening on http://127.0.0.1:PORT`.
* `python -m benchmarks.sse client` (a JSON spec on stdin, a JSON result line on stdout) runs
  `slots` keep-alive connections, each sending one streaming request after another until the
  measured window ends. It records, for the window only: events received, the lag of each (arrival
  minus its emit time, in a log histogram), time to first event of each stream sent in the window,
  and errors. Times are absolute `time.monotonic()` values chosen by the parent, so shards and the
  parent's CPU readings share one window without talking. Its body asks for `events` tokens
  (`"max_tokens"`). With `once` (a connection burst, benchmarks/peers.py) every slot opens a new
  connection at `start_at + ramp * i / slots`, sends one stream and stops; its time to first event
  then counts from the start of the connect, so it includes the wait to be accepted.
"""

from __future__ import annotations

import argparse
import errno
import heapq
import json
import re
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import trio

from benchmarks.common import Histogram, Processes

MODEL = "bench-model"
PATH = "/v1/chat/completions"

_HEALTH = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-type: text/plain\r\ncontent-length: 0\r\n\r\n"
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_DONE = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
_RECV = 65536
_MAX_TOKENS = re.compile(rb'"max_(?:completion_)?tokens"\s*:\s*(\d+)')


def _trio_time(monotonic: float) -> float:
    """trio's clock reading at the `time.monotonic()` instant `monotonic` (trio's clock has an
    offset of its own)."""
    return trio.current_time() + (monotonic - time.monotonic())


class _Closed(Exception):
    """The peer closed the connection (or reset it)."""


async def _recv(sock: socket.socket) -> bytes:
    """Some bytes from a non-blocking socket (b"" at end of stream); always a checkpoint."""
    try:
        data = sock.recv(_RECV)
    except BlockingIOError:
        pass
    except (ConnectionResetError, BrokenPipeError):
        return b""
    else:
        await trio.lowlevel.cancel_shielded_checkpoint()
        return data
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            return sock.recv(_RECV)
        except BlockingIOError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return b""


async def _send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        except (ConnectionResetError, BrokenPipeError) as error:
            raise _Closed(repr(error)) from None
        view = view[sent:]


def _headers(head: bytes) -> dict[bytes, bytes]:
    headers: dict[bytes, bytes] = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return headers


async def _read_head(sock: socket.socket, buf: bytearray) -> bytes | None:
    """The next message head (without its blank line), or None at a clean end of stream."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(buf[:end])
            del buf[: end + 4]
            return head
        data = await _recv(sock)
        if not data:
            if buf:
                raise _Closed("end of stream inside a message head")
            return None
        buf += data


async def _read_exactly(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        data = await _recv(sock)
        if not data:
            raise _Closed("end of stream inside a body")
        buf += data
    body = bytes(buf[:n])
    del buf[:n]
    return body


async def _read_chunked(sock: socket.socket, buf: bytearray) -> bytes:
    """A whole chunked body (trailers skipped)."""
    parts: list[bytes] = []
    while True:
        while (line_end := buf.find(b"\r\n")) < 0:
            data = await _recv(sock)
            if not data:
                raise _Closed("end of stream inside a chunked body")
            buf += data
        size = int(bytes(buf[:line_end]).split(b";")[0], 16)
        del buf[: line_end + 2]
        if size == 0:
            while (end := buf.find(b"\r\n")) != 0:
                if end > 0:
                    del buf[: end + 2]  # a trailer line
                    continue
                data = await _recv(sock)
                if not data:
                    raise _Closed("end of stream inside trailers")
                buf += data
            del buf[:2]
            return b"".join(parts)
        parts.append((await _read_exactly(sock, buf, size + 2))[:-2])


# ---- the engine ----------------------------------------------------------------------------------


class _Conn:
    """One server connection; `write` is synchronous (from the timer loop or the handler)."""

    __slots__ = ("dead", "events", "kick", "pending", "sock", "streaming")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()
        self.kick: trio.Event | None = None
        self.dead = False
        self.streaming = False
        self.events = 0
        """Events of the stream in progress."""

    def wake(self) -> None:
        if self.kick is not None:
            self.kick.set()

    def write(self, data: bytes) -> None:
        if self.dead:
            return
        if self.pending:
            self.pending += data
            return
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.dead = True
            self.wake()
            return
        if sent < len(data):
            self.pending += data[sent:]
            self.wake()


class Engine:
    """The SSE engine: connection handlers plus one timer loop over every open stream."""

    def __init__(self, model: str, events: int, interval: float) -> None:
        self.events = events
        self.interval = interval
        self.model = model.encode()
        self._heap: list[tuple[float, int, _Conn, int]] = []
        self._sequence = 0
        self._wake = trio.Event()
        self._sleeping_until = float("inf")
        self._tails: dict[tuple[int, int], bytes] = {}
        answer = (
            b'{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,'
            b'"model":"' + self.model + b'","choices":[{"index":0,"message":{"role":"assistant",'
            b'"content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,'
            b'"completion_tokens":1,"total_tokens":11}}'
        )
        self._answer = (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % len(answer)
        ) + answer

    def _tail(self, index: int, events: int) -> bytes:
        """What follows the emit time in event `index` of `events` (its JSON after `{"t":...`),
        built once per (index, events)."""
        tail = self._tails.get((index, events))
        if tail is not None:
            return tail
        delta = b'{"content":" tok%d"}' % index
        if index == 0:
            delta = b'{"role":"assistant","content":"tok0"}'
        finish = b'"stop"' if index == events - 1 else b"null"
        tail = (
            b',"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
            b'"model":"' + self.model + b'","choices":[{"index":0,"delta":' + delta + b","
            b'"finish_reason":' + finish + b"}]}\n\n"
        )
        self._tails[(index, events)] = tail
        return tail

    def _event(self, index: int, events: int) -> bytes:
        payload = b'data: {"t":%.6f%b' % (time.monotonic(), self._tail(index, events))
        return b"%x\r\n%b\r\n" % (len(payload), payload)

    def _schedule(self, due: float, conn: _Conn, index: int) -> None:
        self._sequence += 1
        heapq.heappush(self._heap, (due, self._sequence, conn, index))
        if due < self._sleeping_until:
            self._wake.set()

    def _events_asked(self, body: bytes) -> int:
        """The body's `"max_tokens"` (or `"max_completion_tokens"`, which a router may rename it
        to), else `--events`."""
        found = _MAX_TOKENS.search(body)
        return max(1, int(found.group(1))) if found else self.events

    async def ticker(self) -> None:
        heap = self._heap
        while True:
            now = time.monotonic()
            while heap and heap[0][0] <= now:
                due, _, conn, index = heapq.heappop(heap)
                if conn.dead:
                    continue
                conn.write(self._event(index, conn.events))
                if index + 1 < conn.events:
                    self._sequence += 1
                    heapq.heappush(heap, (due + self.interval, self._sequence, conn, index + 1))
                else:
                    conn.write(_DONE)
                    conn.streaming = False
                    conn.wake()
            self._wake = trio.Event()
            self._sleeping_until = heap[0][0] if heap else float("inf")
            wake_at = self._sleeping_until
            with trio.move_on_at(_trio_time(wake_at) if heap else float("inf")):
                await self._wake.wait()
            self._sleeping_until = float("-inf")

    async def handle(self, sock: socket.socket) -> None:
        conn = _Conn(sock)
        buf = bytearray()
        try:
            while True:
                head = await _read_head(sock, buf)
                if head is None:
                    return
                request_line = head.lstrip(b"\r\n").split(b"\r\n", 1)[0].split(b" ")
                if len(request_line) != 3:  # not a request this engine knows: answer, close
                    await _send_all(sock, _BAD_REQUEST)
                    return
                method, target = request_line[0], request_line[1]
                headers = _headers(head)
                if b"content-length" in headers:
                    body = await _read_exactly(sock, buf, int(headers[b"content-length"]))
                elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                    body = await _read_chunked(sock, buf)
                else:
                    body = b""
                if method == b"GET" and target.startswith(b"/health"):
                    await _send_all(sock, _HEALTH)
                elif method == b"POST" and target.startswith(b"/v1/"):
                    if b'"stream":true' not in body.replace(b" ", b""):
                        await _send_all(sock, self._answer)
                    else:
                        conn.events = self._events_asked(body)
                        await self._stream(conn)
                        if conn.dead:
                            return
                else:
                    await _send_all(sock, _NOT_FOUND)
                if headers.get(b"connection", b"").lower() == b"close":
                    return
        except _Closed:
            return
        finally:
            conn.dead = True
            sock.close()

    async def _stream(self, conn: _Conn) -> None:
        conn.streaming = True
        conn.write(_STREAM_HEAD + self._event(0, conn.events))
        if conn.events > 1:
            self._schedule(time.monotonic() + self.interval, conn, 1)
        else:
            conn.write(_DONE)
            conn.streaming = False
        sock = conn.sock
        while not conn.dead and (conn.streaming or conn.pending):
            if conn.pending:
                await trio.lowlevel.wait_writable(sock)
                try:
                    sent = sock.send(conn.pending)
                except BlockingIOError:
                    continue
                except OSError:
                    conn.dead = True
                    return
                del conn.pending[:sent]
            else:
                conn.kick = trio.Event()
                await conn.kick.wait()
                conn.kick = None

    async def serve(self, listener: socket.socket) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.ticker)
            while True:
                await trio.lowlevel.wait_readable(listener)
                while True:
                    try:
                        sock, _ = listener.accept()
                    except BlockingIOError:
                        break
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    nursery.start_soon(self.handle, sock)


def engine_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sse engine")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--events", type=int, default=50)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", args.port))
    listener.listen(4096)
    listener.setblocking(False)
    print(f"listening on http://127.0.0.1:{listener.getsockname()[1]}", flush=True)
    engine = Engine(args.model, args.events, args.interval_ms / 1000)
    trio.run(engine.serve, listener)


# ---- the stream client (one shard of the load generator) -----------------------------------------


@dataclass
class ClientSpec:
    port: int
    slots: int
    start_at: float
    """monotonic: slot i starts at start_at + ramp * i / slots."""
    ramp: float
    window_start: float
    window_end: float
    """monotonic: no new stream after this; what is in flight is cancelled at `hard_stop`."""
    hard_stop: float
    model: str = MODEL
    events: int = 50
    shard: int = 0
    once: bool = False
    """A connection burst: each slot opens a new connection, sends one stream and stops."""


@dataclass
class ClientResult:
    chunks: int = 0
    """Events (`data:` lines other than [DONE]) that arrived in the window."""
    lag_counts: dict[str, int] = field(default_factory=dict)
    """Histogram bins (index -> count) of arrival minus emit time, window only."""
    ttft: list[float] = field(default_factory=list)
    """Seconds from sending a request to its first event, for requests sent in the window."""
    connect_seconds: list[float] = field(default_factory=list)
    """With `once`: how long each connect took (the TCP handshake and the wait to be accepted
    show here when the listener's queue overflows)."""
    head_seconds: list[float] = field(default_factory=list)
    """With `once`: from the start of each connect to the response head."""
    streams_done: int = 0
    streams_in_window: int = 0
    short_streams: int = 0
    errors: int = 0
    first_error: str = ""
    statuses: dict[str, int] = field(default_factory=dict)
    connections: int = 0
    cpu_seconds: float = 0.0
    window_cpu_seconds: float = 0.0


class _BadResponse(Exception):
    pass


async def _connect(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    code = sock.connect_ex(("127.0.0.1", port))
    if code not in (0, errno.EINPROGRESS):
        sock.close()
        raise OSError(code, errno.errorcode.get(code, "connect failed"))
    if code:
        await trio.lowlevel.wait_writable(sock)
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            sock.close()
            raise OSError(code, errno.errorcode.get(code, "connect failed"))
    return sock


class StreamClient:
    def __init__(self, spec: ClientSpec) -> None:
        self.spec = spec
        self.result = ClientResult()
        self.lag = Histogram()
        body = json.dumps(
            {
                "model": spec.model,
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "max_tokens": spec.events,
            },
            separators=(",", ":"),
        ).encode()
        self._head = (
            b"POST " + PATH.encode() + b" HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
            b"content-type: application/json\r\naccept: text/event-stream\r\n"
            b"x-input-tokens: 10\r\nx-model: " + spec.model.encode() + b"\r\n"
            b"content-length: %d\r\n"
        ) % (spec.port, len(body))
        self._body = body

    def _error(self, error: object) -> None:
        self.result.errors += 1
        if not self.result.first_error:
            self.result.first_error = repr(error)[:300]

    async def slot(self, index: int) -> None:
        spec = self.spec
        await trio.sleep_until(_trio_time(spec.start_at + spec.ramp * index / max(1, spec.slots)))
        sock: socket.socket | None = None
        sequence = 0
        try:
            while time.monotonic() < spec.window_end:
                try:
                    connect_started = time.monotonic()
                    if sock is None:
                        sock = await _connect(spec.port)
                        self.result.connections += 1
                        if spec.once:
                            took = time.monotonic() - connect_started
                            self.result.connect_seconds.append(took)
                    sequence += 1
                    keep = await self._one_stream(
                        sock,
                        f"s{spec.shard}-{index}-{sequence}",
                        connect_started if spec.once else None,
                    )
                except (OSError, _Closed, _BadResponse, ValueError) as error:
                    self._error(error)
                    keep = False
                    if not spec.once:
                        await trio.sleep(0.05)
                if not keep and sock is not None:
                    sock.close()
                    sock = None
                if spec.once:
                    break
        finally:
            if sock is not None:
                sock.close()

    async def _one_stream(
        self, sock: socket.socket, request_id: str, started: float | None = None
    ) -> bool:
        """One streaming request; True when the connection may be reused. Its time to first
        event counts from `started` when given (the connect), else from the send."""
        spec, result, lag = self.spec, self.result, self.lag
        request = self._head + b"x-request-id: " + request_id.encode() + b"\r\n\r\n" + self._body
        sent_at = time.monotonic() if started is None else started
        in_window = spec.window_start <= sent_at < spec.window_end
        await _send_all(sock, request)
        buf = bytearray()
        head = await _read_head(sock, buf)
        if head is None:
            raise _Closed("closed before the response head")
        status = head[9:12].decode()
        if started is not None:
            result.head_seconds.append(time.monotonic() - started)
        result.statuses[status] = result.statuses.get(status, 0) + 1
        headers = _headers(head)
        keep = headers.get(b"connection", b"").lower() != b"close"
        chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        if status != "200":
            if chunked:
                await _read_chunked(sock, buf)
            elif b"content-length" in headers:
                await _read_exactly(sock, buf, int(headers[b"content-length"]))
            else:
                keep = False
            raise _BadResponse(f"status {status}")
        if not chunked:
            raise _BadResponse("a stream without chunked transfer-encoding")
        arrived = time.monotonic()
        events = 0
        first = True
        sse = bytearray()
        window_start, window_end = spec.window_start, spec.window_end
        while True:
            # Decode every whole chunk in `buf`; then read more.
            line_end = buf.find(b"\r\n")
            if line_end >= 0:
                size = int(bytes(buf[:line_end]).split(b";")[0], 16)
                if size == 0:
                    while buf.find(b"\r\n\r\n", line_end) < 0:
                        data = await _recv(sock)
                        if not data:
                            raise _Closed("end of stream inside the last chunk")
                        buf += data
                    break
                end = line_end + 2 + size
                if len(buf) >= end + 2:
                    sse += buf[line_end + 2 : end]
                    del buf[: end + 2]
                    while (event_end := sse.find(b"\n\n")) >= 0:
                        event = bytes(sse[:event_end])
                        del sse[: event_end + 2]
                        if not event.startswith(b"data:"):
                            continue
                        data_field = event[5:].lstrip()
                        if not data_field.startswith(b'{"t":'):
                            continue  # [DONE]
                        emitted = float(data_field[5 : data_field.index(b",", 5)])
                        events += 1
                        if first:
                            first = False
                            if in_window:
                                result.ttft.append(arrived - sent_at)
                        if window_start <= arrived < window_end:
                            result.chunks += 1
                            lag.add(arrived - emitted)
                    continue
            data = await _recv(sock)
            if not data:
                raise _Closed("end of stream inside a response")
            arrived = time.monotonic()
            buf += data
        result.streams_done += 1
        if in_window:
            result.streams_in_window += 1
        if events != spec.events:
            result.short_streams += 1
        return keep

    async def run(self) -> ClientResult:
        spec = self.spec
        cpu_start = time.process_time()
        window_cpu: list[float] = []

        async def read_cpu_at(when: float) -> None:
            await trio.sleep_until(_trio_time(when))
            window_cpu.append(time.process_time())

        with trio.move_on_at(_trio_time(spec.hard_stop)):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_cpu_at, spec.window_start)
                nursery.start_soon(read_cpu_at, spec.window_end)
                for index in range(spec.slots):
                    nursery.start_soon(self.slot, index)
        result = self.result
        result.cpu_seconds = time.process_time() - cpu_start
        if len(window_cpu) == 2:
            result.window_cpu_seconds = window_cpu[1] - window_cpu[0]
        result.lag_counts = {str(i): c for i, c in enumerate(self.lag.counts) if c}
        return result


def spawn_client(procs: Processes, spec: ClientSpec) -> subprocess.Popen[str]:
    """A client shard process (`client_main`) running `spec`, sent on its stdin; its JSON result
    comes on its stdout (read with `communicate`)."""
    shard = procs.spawn(
        [sys.executable, "-m", "benchmarks.sse", "client"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert shard.stdin is not None
    shard.stdin.write(json.dumps(asdict(spec)))
    shard.stdin.close()
    shard.stdin = None  # sent: `communicate` only reads
    return shard


def client_main() -> None:
    spec = ClientSpec(**json.loads(sys.stdin.read()))
    result = trio.run(StreamClient(spec).run)
    sys.stdout.write(json.dumps(asdict(result)) + "\n")


def histogram_from(lag_counts: dict[str, int]) -> Histogram:
    histogram = Histogram()
    for index, count in lag_counts.items():
        histogram.counts[int(index)] += count
    return histogram


def main(argv: list[str] | None = None) -> Any:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["engine"]:
        return engine_main(argv[1:])
    if argv[:1] == ["client"]:
        return client_main()
    raise SystemExit("usage: python -m benchmarks.sse engine [options] | client < spec.json")


if __name__ == "__main__":
    main()
