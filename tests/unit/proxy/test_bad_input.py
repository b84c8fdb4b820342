"""Bad input on the HTTP listener is never a 500 (issue 12, item 4): a property test.

Whatever a client sends (any method; any request target: every proxy route of
`stargate.proxy.contract.ENDPOINTS`, near misses, percent-encodings, absolute form; any header set:
the contract's headers with valid, empty, huge, non-ASCII, signed, underscored, unicode-digit and
overflowing values, duplicates, plus random names; any body: random bytes, random JSON, deeply
nested JSON, JSON with and without a `model`), the replica's HTTP app answers with a status the
docs list, in the shape they promise (docs/data-plane.md, "Local answers and error bodies";
docs/clients.md, "Error bodies" and "Paths"):

* a proxy route: 200 from the backend (with the `x-inference-server-*` headers), or a local 400,
  404, 405, 413 or 503; never 500 (and never 502 here: the backend is healthy). In the Rust form
  only the 404 `no_eligible_candidates` and the 503 `input_work_limit_exceeded` have a body and
  `x-stargate-error-code`; in the OpenAI form every local answer is the OpenAI error document with
  `x-stargate-error-code` equal to its `code`, from the documented table;
* any other path (the admin app): 200, 400, 404, 405 or 503, an error never with an HTML body;
* the routing state is left as it was (no backend demoted, no route added or lost), nothing is
  logged with a traceback, and the app returns (no hang, no exception).

Why in process: the HTTP app (`ProxyApp` in front of the admin Quart app, as stargate/runtime.py
builds it, without the listener's wrappers) is called through ASGI with scopes built the way
Hypercorn builds them, against a real
`RoutingState` and a real backend (an h11 server in the same trio loop) reached through the real
upstream pool; a fresh replica per example costs a few milliseconds, so hundreds of examples run in
seconds. Inputs are what Hypercorn can deliver: each example draws a transport, HTTP/1.1 (h11's
header and request-target rules) or HTTP/2 (h2's, RFC 9113 §8.2.1), and its header names, values
and target obey that transport's rules. Raw bytes on a real socket are in
tests/e2e/test_bad_input.py.

The property found four 500s, fixed in stargate/proxy/contract.py, and in the admin app two more
(a `Host` Werkzeug cannot IDNA-encode, a query that is not UTF-8), an HTML redirect for doubled
slashes and an HTML `OPTIONS` answer, fixed in stargate/admin_app.py, plus a 413 that the
documented validation order makes a 400, fixed in stargate/proxy/app.py (examples kept below).
The last tests inject faults (a forwarder that raises, a Rust-form 400 with a body, a request
that demotes its backend, an HTML 404) and check that the property reports each.
"""

from __future__ import annotations

import json
import logging
import string
from collections import Counter
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, cast
from urllib.parse import unquote

import h11
import pytest
import trio
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from stargate.admin_app import create_admin_app
from stargate.asgi import ASGIApp
from stargate.config import ProxyConfig, WarmupConfig
from stargate.load_balancing.config import parse_lb_config
from stargate.metrics import Metrics
from stargate.proxy.app import ProxyApp
from stargate.proxy.contract import ENDPOINTS, ContractError
from stargate.proxy.forwarder import Forwarder
from stargate.readiness import Readiness
from stargate.routing import (
    BackendRoute,
    ModelStats,
    RegistrationIdentity,
    RoutingState,
    RoutingTargetKey,
)
from stargate.upstream import ConnectionPool

Headers = list[tuple[bytes, bytes]]
Transport = Literal["h11", "h2"]

LIMIT = 4096
"""`--proxy-max-replay-body-bytes` for these tests: small, so 413 is reachable with small bodies."""

TENANT = "tenant"
ACTIVE_MODELS = ("m", "work", "aff", "pinned")
"""Routable unscoped (`m` also under the routing key `tenant`)."""
IDLE_MODEL = "idle"  # advertised INACTIVE: a 503, not a 404
SERVER_IDS = ("b1", "b2")

# docs/data-plane.md, Load balancer config: `work` has an input-work limit that any request with
# tokens exceeds (503 input_work_limit_exceeded), `aff` requires a cache-affinity key (400 without
# it), and only `random` and `power-of-n` may be selected by `x-routing-method` (400 otherwise).
LB_CONFIG = {
    "default": "power-of-n",
    "request_algorithms": {"random": "random", "power-of-n": "power-of-n"},
    "models": {
        "work": {"algorithm": "power-of-n", "max_input_work_seconds": 0.000001},
        "aff": {"algorithm": "round-robin", "require_cache_affinity_key": True},
        "pinned": "round-robin",
    },
}

# docs/clients.md, "Error bodies": the codes of the OpenAI form, by status. 405 has no documented
# code (the table lists none), only the document's shape.
OPENAI_CODES: dict[int, frozenset[str] | None] = {
    400: frozenset({"invalid_header", "invalid_body", "encoded_path"}),
    404: frozenset({"no_eligible_candidates"}),
    405: None,
    413: frozenset({"request_too_large"}),
    503: frozenset(
        {
            "no_active_backend",
            "no_available_backend",
            "no_eligible_backend",
            "input_work_limit_exceeded",
        }
    ),
}
RUST_404 = b'{"error":"no eligible candidates","code":"no_eligible_candidates"}'
RUST_503_WORK = (
    b'{"error":"input work admission limit exceeded","code":"input_work_limit_exceeded"}'
)
UPSTREAM_HEADERS = (b"x-inference-server-id", b"x-inference-server-url", b"x-stargate-cluster-id")


# ---- the backend: an h11 server in the test's trio loop ------------------------------------------


@dataclass
class Received:
    """One request as the backend saw it."""

    target: bytes
    headers: Headers
    body: bytes


@dataclass
class Backend:
    """A keep-alive HTTP/1.1 server answering every request 200 with a small JSON body."""

    received: list[Received] = field(default_factory=list)

    async def serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        request: h11.Request | None = None
        body = bytearray()
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Request):
                    request, body = event, bytearray()
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    assert request is not None
                    self.received.append(
                        Received(request.target, list(request.headers), bytes(body))
                    )
                    payload = b'{"from":"backend"}'
                    head = h11.Response(
                        status_code=200,
                        headers=[
                            (b"content-type", b"application/json"),
                            (b"content-length", b"%d" % len(payload)),
                        ],
                    )
                    data = conn.send(head) or b""
                    data += conn.send(h11.Data(data=payload)) or b""
                    data += conn.send(h11.EndOfMessage()) or b""
                    await stream.send_all(data)
                    conn.start_next_cycle()
                else:  # ConnectionClosed
                    return
        except (trio.BrokenResourceError, h11.RemoteProtocolError):
            pass
        finally:
            await trio.aclose_forcefully(stream)


# ---- the replica's HTTP app, in process ----------------------------------------------------------


@dataclass
class InProcessReplica:
    routing: RoutingState
    app: ProxyApp
    backend: Backend
    pool: ConnectionPool

    def routing_view(self) -> tuple[object, ...]:
        """What a request must never change: routes, advertisements, demotions, registrations."""
        routing = self.routing
        keys = [RoutingTargetKey(None, m) for m in (*ACTIVE_MODELS, IDLE_MODEL)]
        keys.append(RoutingTargetKey(TENANT, "m"))
        return (
            routing.total_active_backend_count(),
            tuple(routing.active_model_ids()),
            tuple((key, routing.is_advertised(key)) for key in keys),
            routing.demoted,
            tuple(r.identity for r in routing.registrations()),
        )


async def open_replica(nursery: trio.Nursery, accept_openai_requests: bool) -> InProcessReplica:
    """A replica's HTTP app as `stargate serve` builds it (stargate/runtime.py), with one backend
    registered twice (unscoped as `b1`, under the routing key `tenant` as `b2`)."""
    backend = Backend()
    listeners = await nursery.start(partial(trio.serve_tcp, backend.serve, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    routing = RoutingState()
    route = BackendRoute(ModelStats(last_mean_input_tps=1.0), 1_000_000, 0.0)
    unscoped = routing.begin(RegistrationIdentity("b1", "b1", url, None))
    routing.apply(unscoped, {**dict.fromkeys(ACTIVE_MODELS, route), IDLE_MODEL: None})
    scoped = routing.begin(RegistrationIdentity("b2", "c2", url, TENANT))
    routing.apply(scoped, {"m": route})
    metrics = Metrics(CollectorRegistry(), "test_")
    config = ProxyConfig(accept_openai_requests=accept_openai_requests, max_replay_body_bytes=LIMIT)
    pool = ConnectionPool()
    forwarder = Forwarder(routing, pool, config, parse_lb_config(LB_CONFIG), metrics.proxy)
    admin = create_admin_app(
        Readiness(WarmupConfig(warmup_ms=0), metrics.readiness),
        routing,
        stargate_id="bad-input",
        accept_openai_requests=accept_openai_requests,
    )
    app = ProxyApp(forwarder, config, metrics.proxy, cast(ASGIApp, admin))
    return InProcessReplica(routing, app, backend, pool)


@dataclass
class Answer:
    status: int
    headers: Headers
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        values = [value for key, value in self.headers if key.lower() == name]
        assert len(values) <= 1, f"{name!r} repeated in the answer: {values}"
        return values[0] if values else None


@dataclass(frozen=True)
class Request:
    """One request as Hypercorn hands it to the app (names lower-case, values validated)."""

    transport: Transport
    method: str
    target: bytes  # the request target, query included
    headers: Headers
    body: bytes
    chunks: tuple[int, ...]  # where the body is split into ASGI messages
    route: str | None  # the proxy path the target names, if any
    encoded: bool  # the target spells its proxy path with percent-encoding
    valid: bool  # built as a request the contract accepts for a routable model

    def scope(self) -> dict[str, Any]:
        """The ASGI scope, as hypercorn/protocol/http_stream.py builds it."""
        path, _, query = self.target.partition(b"?")
        return {
            "type": "http",
            "http_version": "1.1" if self.transport == "h11" else "2",
            "asgi": {"spec_version": "2.1", "version": "3.0"},
            "method": self.method,
            "scheme": "http",
            "path": unquote(path.decode("ascii")),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": list(self.headers),
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000),
            "state": {},
            "extensions": {"http.response.trailers": {}} if self.transport == "h2" else {},
        }

    def messages(self) -> list[dict[str, Any]]:
        cuts = sorted({cut for cut in self.chunks if 0 < cut < len(self.body)})
        pieces = [self.body[a:b] for a, b in zip([0, *cuts], [*cuts, len(self.body)], strict=True)]
        return [
            {"type": "http.request", "body": piece, "more_body": index < len(pieces) - 1}
            for index, piece in enumerate(pieces)
        ]


async def exchange(app: ProxyApp, request: Request) -> Answer:
    """Call the app once, as Hypercorn would: the body, then `http.disconnect` only once the
    response is complete. The app must answer and return within 5 s."""
    inbox = request.messages()
    complete = trio.Event()
    start: dict[str, Any] | None = None
    body = bytearray()

    async def receive() -> dict[str, Any]:
        if inbox:
            return inbox.pop(0)
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal start
        assert not complete.is_set(), f"sent after the response was complete: {message}"
        if message["type"] == "http.response.start":
            assert start is None, "two response heads"
            start = message
        elif message["type"] == "http.response.body":
            assert start is not None, "a body before the head"
            body.extend(message.get("body", b""))
            if not message.get("more_body", False):
                complete.set()

    with trio.fail_after(5):
        await app(request.scope(), receive, send)  # type: ignore[arg-type]
    assert start is not None and complete.is_set(), "the app returned without a complete answer"
    headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]
    return Answer(start["status"], headers, bytes(body))


class TracebackCatcher(logging.Handler):
    """Records every log record that carries an exception (or is ERROR or above)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(record)


@contextmanager
def no_tracebacks_logged() -> Iterator[None]:
    catcher = TracebackCatcher()
    root = logging.getLogger()
    root.addHandler(catcher)
    try:
        yield
    finally:
        root.removeHandler(catcher)
    assert not catcher.records, [r.getMessage() for r in catcher.records]


# ---- strategies ----------------------------------------------------------------------------------

CONTRACT_HEADERS = (
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
    "content-length",
    "transfer-encoding",
)
OTHER_HEADERS = (
    "connection",
    "content-type",
    "host",
    "te",
    "upgrade",
    "keep-alive",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-stargate-retryable",
    "x-stargate-error-code",
    "x-inference-server-id",
    # Not tokens: HTTP/2 delivers them, HTTP/1.1 cannot (h11 refuses them on both sides).
    ";",
    "x(y)",
    '"quoted"',
    "a@b",
    "{}",
    "x/y",
)
TOKEN_CHARS = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
# HTTP/2 lets through visible ASCII that is not a token character (RFC 9113 §8.2.1 forbids only
# controls, space, upper case, DEL, non-ASCII and a colon after the first character).
H2_NAME_CHARS = string.ascii_lowercase + string.digits + "!#$%&'*+-.^_`|~\"(),/;<=>?@[\\]{}"
# h2 refuses these in a request (connection-specific, RFC 9113 §8.2.2).
H2_REFUSED = frozenset(
    {b"connection", b"transfer-encoding", b"keep-alive", b"proxy-connection", b"upgrade"}
)

INTERESTING_VALUES = (
    *ACTIVE_MODELS,
    IDLE_MODEL,
    "unknown-model",
    TENANT,
    "M",
    "m ",
    "0",
    "1",
    "10",
    "+5",
    "+",
    "++1",
    "-1",
    "-0",
    "1_000",
    "0x10",
    "1e3",
    "1.5",
    "00000000000000000000000000000001",
    "\u0661\u0662\u0663",  # Arabic-Indic digits: `int()` reads them, the contract must not
    "\uff11\uff12",  # fullwidth digits
    "\u00b2",  # superscript two: `str.isdigit()` says yes
    "4294967295",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "9" * 40,
    "round-robin",
    "Round_Robin",
    "RANDOM",
    "power_of_n",
    "powerOf2",
    "wait-and-widen",
    "pulsar",
    "chunked",
    "gzip, chunked",
    "close",
    "keep-alive, x-model",
    "x-request-id, x-input-tokens",
    "trailers",
    "application/json",
    "true",
    "req-1",
    "caf\u00e9",
    "\U0001f680",
    "a\x0cb",  # a form feed: HTTP/2 delivers it, HTTP/1.1 does not
    "\x0b",
    "a\x01b",  # controls h11 does accept
    "\x7f",
    "tab\tinside",
)


@st.composite
def raw_values(draw: st.DrawFn) -> bytes:
    """A header value before the transport's rules: valid, empty, huge, non-ASCII, numeric
    near-misses, overflowing, or random bytes."""
    kind = draw(
        st.sampled_from(
            ["interesting"] * 3
            + ["model"] * 2
            + ["number"] * 2
            + ["empty", "huge", "text", "bytes"]
        )
    )
    if kind == "interesting":
        return draw(st.sampled_from(INTERESTING_VALUES)).encode()
    if kind == "model":
        return draw(st.sampled_from([*ACTIVE_MODELS, IDLE_MODEL, "unknown-model", TENANT])).encode()
    if kind == "empty":
        return b""
    if kind == "huge":  # 4301 digits: one past Python's int() conversion limit
        length = draw(st.sampled_from([21, 4301, 8000]) | st.integers(1, 8000))
        return draw(st.sampled_from([b"9", b"0", b"a", b"\xff", b"1_"])) * length
    if kind == "text":
        return draw(st.text(max_size=40)).encode()
    if kind == "number":
        return draw(numbers())
    return draw(st.binary(max_size=40))


@st.composite
def numbers(draw: st.DrawFn) -> bytes:
    """Almost numbers: signs, underscores, unicode digits, leading zeros, overflow (u32, u64,
    and past the 4300 digits at which Python's `int()` raises)."""
    sign = draw(st.sampled_from(["", "", "+", "-", "++"]))
    digits = draw(
        st.one_of(
            st.integers(0, 2**70).map(str),
            st.integers(0, 2**70).map("{:_}".format),
            st.sampled_from(
                [
                    "4294967295",
                    "4294967296",
                    "18446744073709551615",
                    "18446744073709551616",
                    "0" * 30 + "7",
                    "9" * 4301,
                    "0" * 4301,
                    "1" + "0" * 5000,
                    "\u0661\u0662\u0663",
                    "\uff11\uff12",
                    "\u00b2",
                    "1e3",
                    "0x10",
                    "1.0",
                    "",
                ]
            ),
        )
    )
    padding = draw(st.sampled_from(["", " ", "\t"]))
    return f"{padding}{sign}{digits}{padding}".encode()


def deliverable_name(transport: Transport, raw: str) -> bytes | None:
    """The name as the app gets it over `transport`, or None if the transport would refuse it."""
    name = raw.lower().encode()
    if transport == "h11":
        return name if name and all(chr(c) in TOKEN_CHARS for c in name) else None
    if not name or any(c <= 0x20 or c >= 0x7F for c in name) or b":" in name[1:]:
        return None
    return None if name in H2_REFUSED else name


def deliverable_value(transport: Transport, name: bytes, raw: bytes) -> bytes | None:
    """The value as the app gets it over `transport` (h11 strips surrounding whitespace and
    refuses NUL and other whitespace; h2 refuses NUL, CR and LF, and surrounding whitespace)."""
    if transport == "h11":
        value = raw.replace(b"\x00", b"")
        for space in (b"\n", b"\r", b"\x0b", b"\x0c"):
            value = value.replace(space, b"")
        return value.strip(b" \t")
    value = raw.replace(b"\x00", b"").replace(b"\n", b"").replace(b"\r", b"").strip(b" \t")
    if name == b"te" and value.lower() != b"trailers":
        return None
    return value


@st.composite
def header_names(draw: st.DrawFn, transport: Transport) -> str:
    kind = draw(st.sampled_from(["contract", "contract", "other", "random"]))
    if kind == "contract":
        name = draw(st.sampled_from(CONTRACT_HEADERS))
        return name.upper() if draw(st.booleans()) and transport == "h11" else name
    if kind == "other":
        return draw(st.sampled_from(OTHER_HEADERS))
    chars = TOKEN_CHARS if transport == "h11" else H2_NAME_CHARS
    return draw(st.text(alphabet=chars, min_size=1, max_size=20))


VALID_BASE: Headers = [(b"x-request-id", b"req-1"), (b"x-input-tokens", b"10"), (b"x-model", b"m")]


@st.composite
def header_sets(draw: st.DrawFn, transport: Transport) -> tuple[Headers, bool]:
    """A header list, and whether it is an untouched valid request for a routable model.

    Starts from the contract's three headers (for a model that is routable, advertised but
    inactive, limited by input work, in need of an affinity key, or unknown), a plain OpenAI
    client's headers (no `x-model`) or nothing, then edits them: replace a header's value, add
    one anywhere (duplicates included), or drop one.
    """
    base = draw(st.sampled_from(["valid", "valid", "openai", "none"]))
    model = draw(st.sampled_from(["m", "m", "m", "pinned", IDLE_MODEL, "work", "aff", "unknown"]))
    start = [*VALID_BASE[:2], (b"x-model", model.encode())]
    headers: Headers = list(start) if base == "valid" else []
    if base == "openai":
        headers = [h for h in VALID_BASE if h[0] != b"x-model" and draw(st.booleans())]
    clean = draw(st.integers(0, 2)) == 0  # a third of the requests keep their base as it is
    edits = (
        []
        if clean
        else draw(
            st.lists(
                st.tuples(
                    st.sampled_from(["set", "set", "add", "drop"]),
                    header_names(transport),
                    raw_values(),
                    st.integers(0, 20),
                ),
                max_size=6,
            )
        )
    )
    for action, raw_name, raw_value, position in edits:
        name = deliverable_name(transport, raw_name)
        value = None if name is None else deliverable_value(transport, name, raw_value)
        if name is None or value is None:
            continue
        index = next((i for i, (key, _) in enumerate(headers) if key == name), None)
        if action == "drop":
            headers = [h for h in headers if h[0] != name]
        elif action == "set" and index is not None:
            headers[index] = (name, value)
        else:
            headers.insert(min(position, len(headers)), (name, value))
    return headers, base == "valid" and headers == start and model in ("m", "pinned")


NEAR_MISSES = (
    "/",
    "*",
    "/v1",
    "/v1/",
    "/healthz",
    "/readyz",
    "/debug/state",
    "/v1/models",
    "/v1/models/m",
    "/v1/models/idle",
    "/v1/models/%2Fm",
    "/v1//models",
    "/v1/models/a%2Fb",
    "/v1/models/%",
    "/v1/models/%zz",
    "/v1/models/%ff%fe",
    "/%",
    "/%zz",
    "/%ff",
    "/v1/models?model_ids=",
    "/v1/models?model_ids=m&model_ids=%20",
    "/v1/models?model_ids=%ff",
    "/metrics",
)


def _near_misses(endpoint: str) -> list[str]:
    return [
        endpoint + "/",
        "/" + endpoint,
        endpoint.upper(),
        endpoint.replace("/v1", "", 1),
        endpoint + "/x",
        endpoint.replace("/", "//", 2),
        endpoint + ";x",
        endpoint + "#frag",
        endpoint.replace("/v1/", "/v1/./", 1),
        endpoint.replace("/v1/", "/v1/x/../", 1),
        endpoint[:-1],
        endpoint + "%00",
        "ftp://host" + endpoint,
    ]


@st.composite
def percent_encoded(draw: st.DrawFn, endpoint: str) -> str:
    """`endpoint` with at least one character written as %XX (either hex case)."""
    positions = draw(
        st.sets(st.integers(1, len(endpoint) - 1), min_size=1, max_size=len(endpoint) - 1)
    )
    out = []
    for index, char in enumerate(endpoint):
        if index in positions:
            escape = f"%{ord(char):02X}"
            out.append(escape.lower() if draw(st.booleans()) else escape)
        else:
            out.append(char)
    return "".join(out)


@st.composite
def targets(draw: st.DrawFn, transport: Transport) -> tuple[bytes, str | None, bool]:
    """A request target, the proxy route it names (if any) and whether it is percent-encoded."""
    endpoint = draw(st.sampled_from(sorted(ENDPOINTS)))
    kind = draw(st.sampled_from(["proxy"] * 7 + ["encoded", "near", "other"]))
    route: str | None = endpoint
    encoded = False
    if kind == "proxy":
        path = endpoint
    elif kind == "encoded":
        path, encoded = draw(percent_encoded(endpoint)), True
    elif kind == "near":
        path, route = draw(st.sampled_from(_near_misses(endpoint))), None
    else:
        path, route = draw(st.sampled_from(NEAR_MISSES)), None
    if draw(st.booleans()):  # absolute form (RFC 9112 §3.2.2): served as its path
        authority = draw(st.sampled_from(["host", "h:1", "127.0.0.1:8000", "[::1]:80", "u@h"]))
        scheme = draw(st.sampled_from(["http", "https", "HTTP"]))
        if path.startswith("/"):
            path = f"{scheme}://{authority}{path}"
    target = path.encode()
    if draw(st.booleans()):
        query = draw(st.sampled_from([b"", b"a=b", b"model=m", b"x=%ff", b"model_ids=", b"q"]))
        if transport == "h2" and draw(st.booleans()):
            # HTTP/2 checks nothing in :path but NUL, CR and LF (and h2 keeps the rest).
            query += deliverable_value("h2", b":path", draw(st.binary(max_size=12))) or b""
        target += b"?" + query
    return target, route, encoded


MODEL_VALUES = st.one_of(
    st.sampled_from([*ACTIVE_MODELS, IDLE_MODEL, "unknown-model"]),
    # Blank, padded, or not sendable as the `x-model` it is forwarded as (a lone surrogate, which
    # JSON spells "\ud800", cannot even be encoded).
    st.sampled_from(["", " ", " m ", "M", "\ud800", "m\ud800", "m\x0cx", "a\nb", "m\x00"]),
    st.text(max_size=20),
    st.one_of(st.integers(), st.none(), st.lists(st.just("m"), max_size=2)),
)
JSON_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["chat"] * 3 + ["json", "bytes", "nested", "large", "empty"]))
    if kind == "chat":  # JSON with (or without) a model, as OpenAI clients send it
        document: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
        if draw(st.booleans()):
            document["model"] = draw(MODEL_VALUES)
        if draw(st.booleans()):
            document["stream"] = draw(JSON_LEAVES)
        return json.dumps(document).encode()
    if kind == "json":
        return json.dumps(draw(JSON_VALUES)).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=512))
    if kind == "nested":  # deeper than the interpreter's recursion limit, within the body limit
        depth = draw(st.integers(500, LIMIT // 2 - 20))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        depth = min(depth, (LIMIT - 20) // (len(opener) + len(closer)))
        inner = b'{"model":"m"}'
        closed = draw(st.booleans())
        return opener * depth + inner + (closer * depth if closed else b"")
    if kind == "large":
        return b'{"model":"m","pad":"' + b"x" * draw(st.integers(LIMIT - 20, 3 * LIMIT)) + b'"}'
    return b""


METHODS = ("GET", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT", "PRI")


Focus = Literal["anything", "numbers", "bodies"]

NUMERIC_HEADERS = (
    b"x-input-tokens",
    b"x-priority",
    b"x-max-wait-ms",
    b"x-request-slo-ms",
    b"x-stargate-max-wait-ms",
    b"content-length",
)


@st.composite
def requests(draw: st.DrawFn, focus: Focus = "anything") -> Request:
    """A request: anything at all, or (`focus`) a POST to a proxy route whose only oddities are
    its numeric headers, or an OpenAI-form POST whose only oddity is its body. The focused kinds
    make rare classes of bad input (a 4301-digit number, a lone surrogate) likely enough to be
    found in a few hundred examples."""
    transport: Transport = draw(st.sampled_from(["h11", "h2"]))
    if focus == "numbers":
        headers = list(VALID_BASE)
        for name, value in draw(
            st.lists(st.tuples(st.sampled_from(NUMERIC_HEADERS), numbers()), min_size=1, max_size=3)
        ):
            clean = deliverable_value(transport, name, value)
            headers = [h for h in headers if h[0] != name] + [(name, clean or b"")]
        body = json.dumps({"model": "m"}).encode()
        return Request(
            transport,
            "POST",
            b"/v1/chat/completions",
            headers,
            body,
            (),
            "/v1/chat/completions",
            False,
            False,
        )
    if focus == "bodies":
        headers = [h for h in VALID_BASE if h[0] != b"x-model" and draw(st.booleans())]
        if draw(st.booleans()):
            body = draw(bodies())
        else:  # a chat for a known model, with random extra fields
            document = draw(st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3))
            document["model"] = draw(st.sampled_from([*ACTIVE_MODELS, IDLE_MODEL, "unknown"]))
            body = json.dumps(document).encode()
        endpoint = draw(st.sampled_from(sorted(ENDPOINTS)))
        return Request(
            transport, "POST", endpoint.encode(), headers, body, (), endpoint, False, False
        )
    which = draw(st.integers(0, 9))  # mostly POST, the proxy's method
    if which < 7:
        method = "POST"
    elif which < 9:
        method = draw(st.sampled_from(METHODS))
    else:  # any token; Hypercorn upper-cases it
        method = draw(st.text(alphabet=TOKEN_CHARS, min_size=1, max_size=8)).upper()
    target, route, encoded = draw(targets(transport))
    headers, untouched = draw(header_sets(transport))
    body = draw(bodies())
    chunks = tuple(draw(st.lists(st.integers(0, max(len(body), 1)), max_size=3)))
    valid = (
        untouched and route is not None and not encoded and method == "POST" and len(body) <= LIMIT
    )
    return Request(transport, method, target, headers, body, chunks, route, encoded, valid)


# ---- the oracle ----------------------------------------------------------------------------------


def first(headers: Headers, name: bytes) -> bytes | None:
    return next((value for key, value in headers if key == name), None)


def check_openai_error(answer: Answer) -> None:
    """docs/clients.md, "Error bodies": the OpenAI error document, its code in the header."""
    assert answer.header(b"content-type") == b"application/json"
    document = json.loads(answer.body)
    assert set(document) == {"error"}
    error = document["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    expected_type = "invalid_request_error" if answer.status < 500 else "server_error"
    assert error["type"] == expected_type
    assert error["param"] in (None, "model")
    codes = OPENAI_CODES[answer.status]
    assert isinstance(error["code"], str) and error["code"]
    if codes is not None:
        assert error["code"] in codes
    assert answer.header(b"x-stargate-error-code") == error["code"].encode()


def check_rust_error(answer: Answer) -> None:
    """docs/data-plane.md, "Local answers": two bodies with a code header, every other local
    answer a bare status."""
    code = answer.header(b"x-stargate-error-code")
    if answer.status == 404:
        assert answer.body == RUST_404 and code == b"no_eligible_candidates"
    elif answer.status == 503 and answer.body:
        assert answer.body == RUST_503_WORK and code == b"input_work_limit_exceeded"
    else:
        assert answer.body == b"" and code is None


def check_proxy_answer(request: Request, answer: Answer, openai_form: bool) -> None:
    if request.method != "POST":
        assert answer.status == 405 and answer.header(b"allow") == b"POST"
    elif request.encoded:
        assert answer.status == 400
    else:
        assert answer.status in (200, 400, 404, 413, 503)
    if request.valid:
        assert answer.status == 200, "a valid request for a routable model must be served"
    if answer.status == 200:
        assert all(answer.header(name) for name in UPSTREAM_HEADERS)
        assert (answer.header(b"x-inference-server-id") or b"").decode() in SERVER_IDS
        assert answer.body == b'{"from":"backend"}'
        return
    assert all(answer.header(name) is None for name in UPSTREAM_HEADERS)
    if openai_form:
        check_openai_error(answer)
        if answer.status == 400 and request.encoded and request.method == "POST":
            assert json.loads(answer.body)["error"]["code"] == "encoded_path"
    else:
        check_rust_error(answer)


def check_admin_answer(request: Request, answer: Answer) -> None:
    """docs/clients.md, "Paths": probes and framework errors are never HTML."""
    assert answer.status in (200, 400, 404, 405, 503)
    if answer.status in (404, 405):
        content_type = answer.header(b"content-type") or b""
        if content_type != b"application/json":  # /v1/models/{id}: the OpenAI 404
            assert answer.body == b""
    if answer.status == 405:
        assert answer.header(b"allow")
    assert b"text/html" not in (answer.header(b"content-type") or b"")


def check_forwarded(request: Request, received: list[Received], openai_form: bool) -> None:
    """A served request reached the backend once, with one x-model and one x-request-id."""
    assert len(received) == 1
    seen = received[0]
    assert seen.body == request.body
    models = [value for key, value in seen.headers if key == b"x-model"]
    ids = [value for key, value in seen.headers if key == b"x-request-id"]
    assert len(models) == 1 and len(ids) == 1
    assert models[0].decode() in ACTIVE_MODELS
    if not openai_form:
        assert models[0] == (first(request.headers, b"x-model") or b"").strip(b" \t")


async def check_request(accept_openai_requests: bool, request: Request) -> int:
    """Run one request against a fresh replica and check every property; return the status."""
    note(f"scope: {request.scope()}")
    async with trio.open_nursery() as nursery:
        replica = await open_replica(nursery, accept_openai_requests)
        before = replica.routing_view()
        answer = await exchange(replica.app, request)
        note(f"answer: {answer}")
        assert answer.status != 500
        assert b"Traceback" not in answer.body
        openai_form = accept_openai_requests and first(request.headers, b"x-model") is None
        if request.route is not None:
            check_proxy_answer(request, answer, openai_form)
        else:
            check_admin_answer(request, answer)
            assert not replica.backend.received, "a non-proxy path reached the backend"
        if answer.status == 200 and request.route is not None:
            check_forwarded(request, replica.backend.received, openai_form)
        elif request.route is not None:
            assert not replica.backend.received, "a local answer, yet the backend saw it"
        assert replica.routing_view() == before, "a request changed the routing state"
        await replica.pool.aclose()
        nursery.cancel_scope.cancel()
    return answer.status


# ---- the properties ------------------------------------------------------------------------------

EXAMPLES = 800
FOCUSED_EXAMPLES = 300
PHASES = tuple(Phase)
NO_SHRINK = (Phase.generate,)  # the fault-injection tests only need a failure, not the smallest


def run_property(
    accept_openai_requests: bool, examples: int, focus: Focus = "anything", *, shrink: bool = True
) -> Counter[int]:
    """Run the property over `examples` requests; the statuses seen, for the coverage check."""
    statuses: Counter[int] = Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        phases=PHASES if shrink else NO_SHRINK,
        report_multiple_bugs=shrink,
    )
    @given(request=requests(focus))
    def property_holds(request: Request) -> None:
        with no_tracebacks_logged():
            statuses[trio.run(check_request, accept_openai_requests, request)] += 1

    property_holds()
    return statuses


@pytest.mark.parametrize("accept_openai_requests", [False, True], ids=["rust", "openai"])
def test_bad_input_is_never_a_500(accept_openai_requests: bool) -> None:
    statuses = run_property(accept_openai_requests, EXAMPLES)
    # The generator must reach every documented answer, or the property proves little.
    assert {200, 400, 404, 405, 413, 503} <= set(statuses), statuses


def test_numeric_headers_are_never_a_500() -> None:
    statuses = run_property(False, FOCUSED_EXAMPLES, "numbers")
    assert {200, 400} <= set(statuses), statuses


def test_openai_form_bodies_are_never_a_500() -> None:
    statuses = run_property(True, FOCUSED_EXAMPLES, "bodies")
    assert {200, 400, 404, 413, 503} <= set(statuses), statuses


# ---- examples worth keeping ----------------------------------------------------------------------


def _request(
    headers: Headers,
    body: bytes = b"{}",
    *,
    target: bytes = b"/v1/chat/completions",
    method: str = "POST",
    transport: Transport = "h11",
) -> Request:
    return Request(
        transport, method, target, headers, body, (), "/v1/chat/completions", False, False
    )


def _answer(accept_openai_requests: bool, request: Request) -> tuple[Answer, list[Received]]:
    """One request against a fresh replica: the answer and what the backend received."""

    async def run() -> tuple[Answer, list[Received]]:
        async with trio.open_nursery() as nursery:
            replica = await open_replica(nursery, accept_openai_requests)
            answer = await exchange(replica.app, request)
            await replica.pool.aclose()
            nursery.cancel_scope.cancel()
        return answer, replica.backend.received

    return trio.run(run)


def _code(answer: Answer) -> str:
    code: str = json.loads(answer.body)["error"]["code"]
    assert answer.header(b"x-stargate-error-code") == code.encode()
    return code


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (b"x-input-tokens", "\u0661\u0662".encode()),
        (b"x-input-tokens", b"1_000"),
        (b"x-input-tokens", b"18446744073709551616"),
        (b"x-priority", b"4294967296"),
        (b"x-priority", b""),
        (b"x-request-slo-ms", b"-1"),
        (b"x-stargate-max-wait-ms", b"+"),
        (b"x-routing-method", b"round-robin"),  # not allowed by LB_CONFIG
        (b"x-routing-method", b"\xff"),
        # Found by the property: past 4300 digits `int()` raised ValueError, a 500.
        (b"x-input-tokens", b"9" * 4301),
        (b"x-max-wait-ms", b"1" + b"0" * 5000),
    ],
)
def test_contract_violations_are_bare_400s(name: bytes, value: bytes) -> None:
    headers = [h for h in VALID_BASE if h[0] != name] + [(name, value)]
    answer, _ = _answer(False, _request(headers))
    assert (answer.status, answer.body, answer.header(b"x-stargate-error-code")) == (400, b"", None)


def test_leading_zeros_do_not_count_against_the_range() -> None:
    headers = [*VALID_BASE, (b"x-priority", b"0" * 4301 + b"7"), (b"content-length", b"9" * 5000)]
    answer, received = _answer(False, _request(headers))
    assert answer.status == 200 and len(received) == 1


def test_deep_json_in_the_openai_form_is_a_400_invalid_body() -> None:
    answer, _ = _answer(True, _request([], b"[" * 2000 + b"]" * 2000))
    assert answer.status == 400 and _code(answer) == "invalid_body"


# Found by the property (each was a 500 with a traceback), fixed in stargate/proxy/contract.py.


@pytest.mark.parametrize(
    "header",
    [
        (b";", b"x"),  # HTTP/2 allows any visible ASCII in a name; HTTP/1.1 only a token
        (b"x(y)", b""),
        (b"x-note", b"a\x0cb"),  # HTTP/2 allows a form feed in a value; HTTP/1.1 does not
        (b"x-note", b"\x0b"),
    ],
)
@pytest.mark.parametrize("accept_openai_requests", [False, True], ids=["rust", "openai"])
def test_a_header_http1_cannot_carry_is_a_400_not_a_500(
    accept_openai_requests: bool, header: tuple[bytes, bytes]
) -> None:
    for headers in ([*VALID_BASE, header], [*VALID_BASE[:2], header]):  # Rust form, OpenAI form
        request = _request(headers, b'{"model": "m"}', transport="h2")
        answer, received = _answer(accept_openai_requests, request)
        assert answer.status == 400 and not received
        if accept_openai_requests and len(headers) == 3:
            assert _code(answer) == "invalid_header"
            assert header[0].decode() in json.loads(answer.body)["error"]["message"]
        elif len(headers) == 4:
            assert answer.body == b""


@pytest.mark.parametrize(
    ("query", "forwarded"),
    [
        (b"\x01", b"%01"),
        (b"model=caf\xc3\xa9", b"model=caf%C3%A9"),
        (b"a=1&b=%ff", b"a=1&b=%ff"),  # already valid: unchanged
    ],
)
def test_an_http2_query_outside_visible_ascii_is_forwarded_percent_encoded(
    query: bytes, forwarded: bytes
) -> None:
    request = _request(VALID_BASE, target=b"/v1/chat/completions?" + query, transport="h2")
    answer, received = _answer(False, request)
    assert answer.status == 200
    assert [r.target for r in received] == [b"/v1/chat/completions?" + forwarded]


@pytest.mark.parametrize("model", ["\ud800", "m\x0cx", "a\nb"])
def test_a_body_model_an_http_header_cannot_carry_is_a_400_invalid_body(model: str) -> None:
    answer, received = _answer(True, _request([], json.dumps({"model": model}).encode()))
    assert answer.status == 400 and _code(answer) == "invalid_body" and not received


# Found by the property in the admin app (Quart and Werkzeug), fixed in stargate/admin_app.py.


def test_admin_app_survives_a_query_that_is_not_utf8() -> None:
    """Quart decodes the query string as strict UTF-8 (quart/routing.py, bind_to_request), and
    HTTP/2 delivers any byte but NUL, CR and LF in :path: `GET /healthz?\\x80` over h2 raised
    UnicodeDecodeError, a 500 with a traceback."""
    request = Request("h2", "GET", b"/healthz?\x80", [], b"", (), None, False, False)
    answer, _ = _answer(False, request)
    assert answer.status == 200


def test_a_query_that_is_not_utf8_stays_percent_encoded_in_the_model_filter() -> None:
    request = Request("h2", "GET", b"/v1/models?model_ids=\x80", [], b"", (), None, False, False)
    answer, _ = _answer(False, request)
    assert answer.status == 200 and json.loads(answer.body) == {"model_ids": []}


@pytest.mark.parametrize("host", [b"a" * 64, b"a..b", b"x" * 300])
def test_a_bad_host_header_is_not_a_500(host: bytes) -> None:
    """Werkzeug's Map.bind IDNA-encodes the Host header and raises BadHost when it cannot (a
    label over 63 characters, an empty label): `GET /healthz` with `Host: aaa...a` (64 letters)
    escaped the admin app's error handler, a 500 with a traceback, over HTTP/1.1 too
    (tests/e2e/test_bad_input.py shows it on a real replica)."""
    request = Request("h11", "GET", b"/healthz", [(b"host", host)], b"", (), None, False, False)
    answer, _ = _answer(False, request)
    assert answer.status in (200, 400)


@pytest.mark.parametrize(
    ("accept_openai_requests", "target"),
    [(False, b"/v1//models"), (True, b"/v1//models"), (True, b"/v1/models/%2Fm")],
)
def test_doubled_slashes_are_not_an_html_redirect(
    accept_openai_requests: bool, target: bytes
) -> None:
    """Werkzeug merged doubled slashes by redirecting: `GET /v1//models` (and, with
    --accept-openai-requests, `GET /v1/models/%2Fm`, the model id '/m') was a 308 with an HTML
    body to another path (/v1/models/m: another model), not a documented answer; docs/clients.md
    says framework answers are never HTML."""
    request = Request("h11", "GET", target, [], b"", (), None, False, False)
    answer, _ = _answer(accept_openai_requests, request)
    assert answer.status in (200, 404)
    assert b"text/html" not in (answer.header(b"content-type") or b"")
    if target.startswith(b"/v1/models/"):  # the model '/m' does not exist: OpenAI's 404
        assert json.loads(answer.body)["error"]["code"] == "model_not_found"
    else:
        assert answer.body == b""


def test_options_is_not_html() -> None:
    """Quart's automatic OPTIONS answer was an empty 200 labelled text/html, against
    docs/clients.md "Probes and framework errors are never HTML"."""
    request = Request("h11", "OPTIONS", b"/healthz", [], b"", (), None, False, False)
    answer, _ = _answer(False, request)
    assert answer.status == 200 and answer.body == b""
    assert b"text/html" not in (answer.header(b"content-type") or b"")


# Found by the property, fixed in stargate/proxy/app.py.


def test_a_bad_header_is_a_400_even_when_the_declared_body_is_too_large() -> None:
    """docs/data-plane.md (Header contract, validation order) puts the 413 for a declared
    content-length above the limit after every header check, but the body was read first: a
    bad header with an oversized body was a 413, not the documented 400."""
    headers = [*VALID_BASE[::2], (b"x-input-tokens", b"-1"), (b"content-length", b"99999")]
    answer, _ = _answer(False, _request(headers, b"{}"))
    assert answer.status == 400


def test_the_openai_form_reads_its_body_first() -> None:
    """In the OpenAI form the model is in the body, so a body above the limit is a 413 before
    the headers are checked (docs/data-plane.md, Header contract)."""
    headers = [(b"x-input-tokens", b"-1"), (b"content-length", b"99999")]
    answer, _ = _answer(True, _request(headers, b"{}"))
    assert answer.status == 413 and _code(answer) == "request_too_large"


# ---- the property must be able to fail -----------------------------------------------------------


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _inject(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """Break one handler the way a regression would."""
    if fault == "the forwarder raises":

        async def boom(*args: object, **kwargs: object) -> object:
            raise RuntimeError("injected fault")

        monkeypatch.setattr(Forwarder, "forward_plan", boom)
    elif fault == "a Rust-form 400 gets a body":
        real_answer = ContractError.answer

        def answer(self: ContractError, openai_form: bool) -> tuple[Headers, bytes]:
            headers, body = real_answer(self, openai_form)
            return headers, body if body or self.status != 400 else b"bad request"

        monkeypatch.setattr(ContractError, "answer", answer)
    elif fault == "a request demotes its backend":
        real_forward = Forwarder.forward_plan

        async def forward(self: Forwarder, *args: Any, **kwargs: Any) -> Any:
            outcome = await real_forward(self, *args, **kwargs)
            self._routing.demote("b1")
            return outcome

        monkeypatch.setattr(Forwarder, "forward_plan", forward)
    elif fault == "the admin app answers 404 with HTML":
        real_call = ProxyApp.__call__

        async def call(self: ProxyApp, scope: Any, receive: Any, send: Any) -> None:
            async def html(message: MutableMapping[str, Any]) -> None:
                start = message["type"] == "http.response.start"
                plain = (b"content-type", b"text/plain; charset=utf-8") in message.get(
                    "headers", ()
                )
                if start and message["status"] == 404 and plain:  # the admin app's 404
                    message = {**message, "headers": [(b"content-type", b"text/html")]}
                await send(message)

            await real_call(self, scope, receive, html)

        monkeypatch.setattr(ProxyApp, "__call__", call)


FAULTS = {
    "the forwarder raises": "injected fault",
    "a Rust-form 400 gets a body": "b'bad request' == b''",
    "a request demotes its backend": "changed the routing state",
    "the admin app answers 404 with HTML": "text/html",
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_the_property_fails_when_a_fault_is_injected(
    monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    _inject(monkeypatch, fault)
    with pytest.raises(BaseException) as caught:  # hypothesis re-raises the shrunk failure
        run_property(False, 300, shrink=False)
    messages = [f"{type(leaf).__name__}: {leaf}" for leaf in _leaves(caught.value)]
    assert any(FAULTS[fault] in message for message in messages), messages
