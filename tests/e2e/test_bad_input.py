"""Bad input on a real replica's HTTP listener never takes it down (issue 12, item 4).

A real `stargate serve` (`--accept-openai-requests`, a 64 KiB replay limit, a 1 s request-body
timeout so truncated bodies end quickly) with a real mock backend registered over a real
registration stream. Raw sockets send about a hundred random HTTP/1.1 requests built by a seeded
`random.Random` (not hypothesis: the point is the real server's parser and framing, once): random
methods, targets (proxy routes, near misses, percent-encodings, absolute form, bytes a request
line may not hold), header sets (the contract's headers with bad values, random names, bytes
outside ASCII, bare LFs, obsolete line folding, lines without a colon, an oversized head), bodies
(random bytes, JSON with and without a model, deep nesting, over the limit) and framing (a right,
wrong, missing, malformed or repeated `Content-Length`, chunked bodies good and bad, both
headers together). Each gets a documented status (docs/data-plane.md, docs/clients.md,
docs/http-serving.md, and what Hypercorn answers to a head h11 cannot parse: 400, 431 for an
oversized head, 501 for an unknown transfer coding) or a closed connection. Afterwards `/healthz`
is 200, the backend is still routable, and the log has no traceback.

HTTP/2 (h2c) adds what HTTP/1.1 cannot carry: header names and values, and query bytes, that h2
accepts and an HTTP/1.1 backend connection cannot (each was a 500 before
stargate/proxy/contract.py checked them), and a query that is not UTF-8 on an admin path (a 500
before stargate/admin_app.py percent-encoded it).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import socket
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import h2.config
import h2.connection
import h2.events
import h11
import httpx
import pytest

from tests.e2e.processes import (
    MockBackendProcess,
    Ports,
    StargateProcess,
    launch,
    launch_mock_backend,
    stop,
    wait_until,
)
from tests.e2e.test_h2_streams import start_replica
from tests.fakes.pylon import PylonStream, registration

MODEL = "model-a"
SEED = 20_260_412
REQUESTS = 100
LIMIT = 65_536
# Documented answers: the proxy's (200 from the backend, 400, 404, 405, 413, 503), the admin
# app's (200, 400, 404, 405), the listener's (408 for a body that stalls, 503 past the connection
# cap) and Hypercorn's for a head h11 cannot parse (400; 431 when the head is too large, 501 for
# a transfer coding other than chunked).
DOCUMENTED = {200, 400, 404, 405, 408, 413, 431, 501, 503}
# Valid on every proxy route of the mock backend (chat reads `messages`, completions `prompt`,
# embeddings and responses `input`).
CHAT = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi"}
).encode()


@dataclass
class Replica:
    ports: Ports
    process: StargateProcess
    backend: MockBackendProcess

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"

    def log_mark(self) -> int:
        return len(self.process.log)

    def log_since(self, mark: int) -> str:
        return self.process.log[mark:]

    def models(self) -> list[str]:
        models: list[str] = httpx.get(f"{self.base}/v1/models", timeout=5).json()["model_ids"]
        return models


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    log_dir = tmp_path_factory.mktemp("bad-input")
    backend = launch_mock_backend("--model", MODEL)
    ports, process = start_replica(
        lambda ports: launch(
            log_dir / f"replica-{ports.http}.log",
            "serve",
            *ports.args(),
            "--readiness-warmup-ms=0",
            "--disable-dns-discovery",
            "--registration-update-idle-timeout-ms=0",
            "--accept-openai-requests",
            f"--proxy-max-replay-body-bytes={LIMIT}",
            "--request-body-timeout-ms=1000",
        )
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{ports.grpc}")
    stream = PylonStream(channel)
    handle = Replica(ports, process, backend)
    try:
        stream.exchange(registration("backend-0", backend.url, [MODEL]))
        wait_until(lambda: handle.models() == [MODEL], 10, "the backend to be routable")
        yield handle
    finally:
        stream.cancel()
        channel.close()
        stop(process)
        backend.stop()


def tracebacks(log: str) -> list[str]:
    """The log records (each starts with its timestamp) that carry a traceback."""
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", log)
    return [record for record in records if "Traceback" in record]


# ---- random HTTP/1.1 requests --------------------------------------------------------------------

PROXY_PATHS = ["/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/completions"]
OTHER_PATHS = [
    "/",
    "/healthz",
    "/readyz",
    "/v1/models",
    "/v1/models?model_ids=",
    "/v1/models/model-a",
    "/v1/models/a%2Fb",
    "/debug/state",
    "/v1/chat/completions/",
    "/V1/chat/completions",
    "//v1/chat/completions",
    "/v1/chat%2Fcompletions",
    "/v1/chat/completions;x",
    "/%ff",
    "/%",
    "*",
]
CONTRACT = [
    "x-model",
    "x-input-tokens",
    "x-request-id",
    "x-routing-key",
    "x-routing-method",
    "x-priority",
    "x-max-wait-ms",
    "x-request-slo-ms",
    "x-cache-affinity-key",
    "x-stargate-max-wait-ms",
]
VALUES = [
    b"",
    b"model-a",
    b"nobody",
    b"0",
    b"10",
    b"+5",
    b"-1",
    b"1_000",
    "\u0661\u0662".encode(),
    b"18446744073709551616",
    b"9" * 5000,
    b"round-robin",
    b"Round_Robin",
    b"bogus",
    b"caf\xc3\xa9",
    b"\xff\xfe",
    b"a\x01b",
    b"\x7f",
]


@dataclass(frozen=True)
class RawRequest:
    data: bytes
    method: str  # as the server will read it, for parsing the answer (HEAD has no body)
    label: str


def _target(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.6:
        path = rng.choice(PROXY_PATHS)
    elif roll < 0.9:
        path = rng.choice(OTHER_PATHS)
    else:
        path = rng.choice(PROXY_PATHS).replace("/", "%2F", rng.randint(1, 2))
    if rng.random() < 0.15:
        path = rng.choice(["http://stargate.test", "HTTPS://h:1", "http://u@h"]) + path
    if rng.random() < 0.2:
        path += "?" + rng.choice(["a=b", "model_ids=model-a", "x=%ff", "q", ""])
    return path


def _body(rng: random.Random) -> bytes:
    roll = rng.random()
    if roll < 0.5:
        document: dict[str, object] = {"messages": [{"role": "user", "content": "hi"}]}
        if rng.random() < 0.8:
            document["model"] = rng.choice([MODEL, MODEL, "nobody", "", 7, None, "\ud800"])
        return json.dumps(document).encode()
    if roll < 0.65:
        return rng.randbytes(rng.randint(0, 200))
    if roll < 0.75:
        depth = rng.choice([100, 3000, 20_000])
        return b"[" * depth + b"]" * depth
    if roll < 0.85:
        return b"x" * (LIMIT + rng.randint(1, 1000))
    return b""


def _chunked(body: bytes, rng: random.Random) -> bytes:
    if rng.random() < 0.2:  # malformed: a bad size line, or no last chunk
        return rng.choice([b"zz\r\n" + body + b"\r\n0\r\n\r\n", b"%x\r\n" % len(body) + body])
    return (b"%x\r\n" % len(body) + body + b"\r\n" if body else b"") + b"0\r\n\r\n"


def random_request(rng: random.Random, index: int) -> RawRequest:
    """A third of the requests are well formed (a chat for the registered model, in the header
    form or the OpenAI form); the others go wrong in each respect with probability 0.3."""
    clean = rng.random() < 0.35

    def odd(probability: float = 0.3) -> bool:
        return not clean and rng.random() < probability

    method = "POST"
    if odd():
        method = rng.choice(["GET", "HEAD", "PUT", "OPTIONS", "post", "FOO", "P@ST"])
    version = rng.choice([b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.x", b""]) if odd(0.1) else b"HTTP/1.1"
    target = (_target(rng) if odd() else rng.choice(PROXY_PATHS)).encode()
    if odd(0.05):
        target = rng.choice([b"/v1/chat/completions\x01", b"/caf\xc3\xa9", b"/a b"])
    headers: list[tuple[bytes, bytes]] = [(b"Host", b"stargate.test")]
    if not odd(0.4):
        headers += [(b"x-request-id", b"bad-input-%d" % index), (b"x-input-tokens", b"10")]
        if rng.random() < 0.7:  # else the OpenAI form: the model comes from the body
            headers.append((b"x-model", MODEL.encode()))
    for _ in range(rng.choice([1, 2, 4]) if odd(0.5) else 0):
        name = rng.choice(CONTRACT).encode()
        if rng.random() < 0.2:
            name = rng.choice([b"X-Random", b"x(y)", b"x y", b"", b"x-\xff", b"x-note "])
        headers.insert(rng.randint(0, len(headers)), (name, rng.choice(VALUES)))
    body = _body(rng) if odd(0.5) else CHAT
    framing = "length"
    if odd():
        framing = rng.choice(["none", "short", "long", "bad", "twice", "chunked", "chunked"])
    if framing == "length":
        headers.append((b"Content-Length", b"%d" % len(body)))
    elif framing == "short":  # declares less: the rest reads as a next request
        headers.append((b"Content-Length", b"%d" % max(len(body) - 3, 0)))
    elif framing == "long":  # declares more: the body never completes (408 after 1 s)
        headers.append((b"Content-Length", b"%d" % (len(body) + 10)))
    elif framing == "bad":
        headers.append((b"Content-Length", rng.choice([b"abc", b"-1", b"1_0", b"", b"9" * 30])))
    elif framing == "twice":
        headers += [(b"Content-Length", b"%d" % len(body)), (b"Content-Length", b"0")]
    elif framing == "chunked":
        coding = rng.choice([b"chunked", b"chunked", b"gzip", b"gzip, chunked"])
        headers.append((b"Transfer-Encoding", coding))
        if rng.random() < 0.2:
            headers.append((b"Content-Length", b"%d" % len(body)))
        body = _chunked(body, rng)
    crlf = b"\n" if odd(0.05) else b"\r\n"
    lines = [method.encode() + b" " + target + b" " + version]
    lines += [name + b": " + value for name, value in headers]
    if odd(0.05):
        lines.insert(2, rng.choice([b" folded", b"no colon here", b"x-big: " + b"a" * 20_000]))
    data = crlf.join(lines) + crlf + crlf + body
    parse_method = method.upper() if method.isalpha() else "GET"
    return RawRequest(data, parse_method, f"#{index} {method} {target!r} {framing}")


@dataclass(frozen=True)
class Answer:
    status: int | None  # None: the connection closed without an answer
    upstream: bool  # made by the backend (it carries x-inference-server-id), passed through


def exchange(port: int, request: RawRequest) -> Answer:
    """Send `request` on a new connection and read the first answer. h11 only parses the answer
    (it never sees our bytes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        with contextlib.suppress(OSError):  # the server may answer and close before reading all
            sock.sendall(request.data)
        parser = h11.Connection(h11.CLIENT)
        parser.send(h11.Request(method=request.method, target="/", headers=[("host", "x")]))
        parser.send(h11.EndOfMessage())
        answer = Answer(None, False)
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            parser.receive_data(data)
            while True:
                try:
                    event = parser.next_event()
                except h11.RemoteProtocolError:
                    return answer  # closed mid-answer
                if event is h11.NEED_DATA:
                    break
                if isinstance(event, h11.Response):
                    upstream = any(name == b"x-inference-server-id" for name, _ in event.headers)
                    answer = Answer(event.status_code, upstream)
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    return answer
            if not data:
                return answer


def test_random_requests_get_documented_answers(replica: Replica) -> None:
    mark = replica.log_mark()
    rng = random.Random(SEED)
    requests = [random_request(rng, index) for index in range(REQUESTS)]
    # One at a time: test_stalled_bodies_at_once_are_answered_408_without_a_traceback below has
    # many at once.
    answers = [exchange(replica.ports.http, request) for request in requests]
    # The replica's own answers must be documented; the backend's pass through unchanged,
    # whatever they are.
    undocumented = [
        (request.label, answer.status)
        for request, answer in zip(requests, answers, strict=True)
        if answer.status is not None and not answer.upstream and answer.status not in DOCUMENTED
    ]
    assert not undocumented, undocumented
    seen = Counter((answer.status, answer.upstream) for answer in answers)
    assert seen[200, True] and seen[400, False] and seen[413, False], seen

    assert httpx.get(f"{replica.base}/healthz", timeout=5).status_code == 200
    assert replica.models() == [MODEL]  # the registration and its route survived
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{replica.base}/v1/chat/completions", json=chat, timeout=10).is_success
    assert replica.process.process.poll() is None
    logged = tracebacks(replica.log_since(mark))
    assert not logged, logged


# ---- HTTP/2: what HTTP/1.1 cannot carry ----------------------------------------------------------


def h2_request(
    port: int, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes = b""
) -> int | None:
    """One h2c request with prior knowledge, sent byte for byte (no client-side checks); its
    status, or None if the stream or connection ended without one."""
    config = h2.config.H2Configuration(
        client_side=True,
        header_encoding=None,
        validate_outbound_headers=False,
        normalize_outbound_headers=False,
        validate_inbound_headers=False,
    )
    connection = h2.connection.H2Connection(config)
    connection.initiate_connection()
    method = b"POST" if body else b"GET"
    request = [
        (b":method", method),
        (b":scheme", b"http"),
        (b":path", path),
        (b":authority", b"stargate.test"),
        *headers,
    ]
    connection.send_headers(1, request, end_stream=not body)
    if body:
        connection.send_data(1, body, end_stream=True)
    status: int | None = None
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(connection.data_to_send())
        while True:
            data = sock.recv(65536)
            if not data:
                return status
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers)[b":status"])
                elif isinstance(
                    event,
                    h2.events.StreamEnded | h2.events.StreamReset | h2.events.ConnectionTerminated,
                ):
                    return status  # the stream ended, or (GOAWAY) the connection
            pending = connection.data_to_send()
            if pending:
                sock.sendall(pending)


VALID = [
    (b"x-request-id", b"h2-bad-input"),
    (b"x-input-tokens", b"1"),
    (b"x-model", MODEL.encode()),
]


@pytest.mark.parametrize(
    ("path", "extra", "status"),
    [
        (b"/v1/chat/completions", [(b";", b"x")], 400),  # not a token: no HTTP/1.1 name
        (b"/v1/chat/completions", [(b"x(y)", b"")], 400),
        (b"/v1/chat/completions", [(b"x-note", b"a\x0cb")], 400),  # a form feed
        (b"/v1/chat/completions?\x01", [], 200),  # forwarded as %01
        (b"/v1/chat/completions?model=caf\xc3\xa9", [], 200),
    ],
)
def test_http2_input_an_http1_backend_connection_cannot_carry(
    replica: Replica, path: bytes, extra: list[tuple[bytes, bytes]], status: int
) -> None:
    mark = replica.log_mark()
    assert h2_request(replica.ports.http, path, [*VALID, *extra], CHAT) == status
    assert "Traceback" not in replica.log_since(mark)


def test_http2_query_that_is_not_utf8_on_an_admin_path(replica: Replica) -> None:
    """Quart decodes the query string as strict UTF-8: `GET /healthz?\\x80` over h2c raised
    UnicodeDecodeError in the admin app, a 500 with a traceback (fixed in stargate/admin_app.py;
    tests/unit/proxy/test_bad_input.py, test_admin_app_survives_a_query_that_is_not_utf8)."""
    mark = replica.log_mark()
    status = h2_request(replica.ports.http, b"/healthz?\x80", [])
    assert status == 200 and "Traceback" not in replica.log_since(mark)


@pytest.mark.parametrize("name", ["x-input-tokens", "x-priority", "x-stargate-max-wait-ms"])
def test_a_number_past_pythons_int_limit_is_a_400(replica: Replica, name: str) -> None:
    """`int()` refuses more than 4300 digits with ValueError; that was a 500 with a traceback
    (fixed in stargate/proxy/contract.py, parse_unsigned)."""
    mark = replica.log_mark()
    headers = {"x-request-id": "digits", "x-input-tokens": "1", "x-model": MODEL, name: "9" * 4301}
    response = httpx.post(f"{replica.base}/v1/chat/completions", headers=headers, content=CHAT)
    assert (response.status_code, response.content) == (400, b"")
    assert "Traceback" not in replica.log_since(mark)


STALLED = RawRequest(
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: stargate.test\r\nx-request-id: stalled\r\n"
    b"x-input-tokens: 1\r\nx-model: model-a\r\nContent-Length: 20\r\n\r\n{}",
    "POST",
    "a body 18 bytes short",
)


def test_stalled_bodies_at_once_are_answered_408_without_a_traceback(replica: Replica) -> None:
    """A stalled body is answered 408, but the answer's last send raised trio.BusyResourceError
    ('another task is currently sending data on this SocketStream'), logged by Hypercorn as
    'Error in ASGI Framework' with a traceback: now and then for a single stalled body, nearly
    always among 32 at once (each connection declaring 20 bytes and sending 2), though every
    client got its 408. The client closing after its answer made Hypercorn's reading task
    half-close the socket outside its send lock (fixed in stargate/hypercorn_patches/tcp.py;
    tests/unit/test_http_limits.py reproduces it in process)."""
    mark = replica.log_mark()
    with ThreadPoolExecutor(max_workers=32) as pool:
        for _ in range(4):  # four rounds of 32 at once: the race shows in (nearly) every one
            answers = list(pool.map(lambda r: exchange(replica.ports.http, r), [STALLED] * 32))
            assert {answer.status for answer in answers} == {408}
    assert not tracebacks(replica.log_since(mark))


def test_a_long_host_label_on_a_probe_is_not_a_500(replica: Replica) -> None:
    """Werkzeug cannot IDNA-encode a Host label over 63 characters and raised BadHost out of the
    admin app: `GET /healthz` with `Host: aaa...a` (64 letters) over HTTP/1.1 was a 500 with a
    traceback (fixed in stargate/admin_app.py; tests/unit/proxy/test_bad_input.py,
    test_a_bad_host_header_is_not_a_500)."""
    mark = replica.log_mark()
    probe = RawRequest(b"GET /healthz HTTP/1.1\r\nHost: " + b"a" * 64 + b"\r\n\r\n", "GET", "host")
    assert exchange(replica.ports.http, probe).status == 200
    assert not tracebacks(replica.log_since(mark))
