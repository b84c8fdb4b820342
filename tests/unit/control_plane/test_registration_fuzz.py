"""Bad registrations end cleanly and leave the routing state as it was (issue 12, item 4).

Two properties, both in process on the real `RegistrationService` and a real `RoutingState`:

* **Messages** (hypothesis builds `stargate_pb2.InferenceServerRegistration`s with random field
  values: empty, padded, huge and non-ASCII ids; random and near-miss URLs; random model maps with
  random statuses, enum numbers outside the enum, and stats with NaN, infinities and u64 extremes;
  the reverse-tunnel flag), sent in order on one registration stream. The first message is
  admitted exactly when docs/control-plane.md, "Admission", says so (its checks, in their order,
  with their messages; ALREADY_EXISTS for a live id); each later one is applied exactly when it
  keeps the admitted identity. An admitted message shows in the routing state as "Model status"
  says (every listed model advertised, the ACTIVE ones with stats routable), a rejected one
  changes nothing, and however the stream ends the state is back to what it was.
* **Bytes** (hypothesis builds request bodies: random bytes, length prefixes with every flag,
  truncated and oversized frames, and framed messages from the first strategy, cut anywhere into
  DATA chunks), sent through the gRPC transport (`stargate/grpc_asgi.py`, called through ASGI as
  Hypercorn calls it). The call always ends with trailers and the status the docs give: the
  admission status of the decoded messages, or the framing error (`RESOURCE_EXHAUSTED` above
  `--grpc-max-message-bytes`, `UNIMPLEMENTED` for a compressed flag, `INTERNAL` for other flags,
  truncation and undecodable protobuf); never `UNKNOWN` (a handler that raised), and the routing
  state is as it was.

Whatever fails is also never logged with a traceback. The expectations come from the docs through
small independent oracles (`expected_admission`, `expected_call`), not from the code under test.
Neither property found a bug; the last tests inject faults (the URL check skipped, an ended
stream that keeps its routes, a handler that raises on a model without stats, a truncated body
accepted) and check that the properties report each.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from stargate import grpc_asgi
from stargate.control_plane import admission
from stargate.control_plane import registration as registration_module
from stargate.control_plane.registration import RegistrationConfig, RegistrationService
from stargate.grpc_asgi import GrpcApp, GrpcError, GrpcStatus, RequestStream, RpcContext
from stargate.grpc_asgi import stream_stream as grpc_stream_stream
from stargate.protocol import stargate_pb2 as pb
from stargate.routing import (
    BackendRoute,
    ModelStats,
    Registration,
    RegistrationIdentity,
    RoutingState,
    RoutingTargetKey,
)

REGISTER = "/stargate.StargateControlPlane/RegisterInferenceServer"
ACTIVE = pb.INFERENCE_SERVER_STATUS_ACTIVE
PRE_ID = "pre"  # a registration already live when the stream starts
PRE_MODEL = "pre-model"
MAX_MESSAGE_BYTES = 4096  # --grpc-max-message-bytes, small so huge strings exceed it
URL_PREFIX = "invalid inference_server_url: inference_server_url "
U64_MAX = 2**64 - 1


# ---- the routing state, observed --------------------------------------------------------------


class RecordingRoutingState(RoutingState):
    """The real routing state, recording each mutation a registration stream makes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def begin(self, identity: RegistrationIdentity) -> Registration:
        self.calls.append("begin")
        return super().begin(identity)

    def apply(self, registration: Registration, models: Mapping[str, BackendRoute | None]) -> bool:
        self.calls.append("apply")
        return super().apply(registration, models)

    def end(self, registration: Registration, *, notify: bool = True) -> bool:
        self.calls.append("end")
        return super().end(registration, notify=notify)


def fresh_state() -> RecordingRoutingState:
    """A routing state with one live registration (`pre`, serving `pre-model`) already in it."""
    routing = RecordingRoutingState()
    pre = routing.begin(RegistrationIdentity(PRE_ID, PRE_ID, "http://10.0.0.1:8000", None))
    routing.apply(pre, {PRE_MODEL: BackendRoute(ModelStats(), 1_000, 0.0)})
    routing.calls.clear()
    return routing


def state_view(routing: RoutingState) -> tuple[object, ...]:
    """Everything a registration may change, for before/after comparisons."""
    return (
        tuple(r.identity for r in routing.registrations()),
        tuple(sorted(map(repr, routing.targets()))),
        routing.total_active_backend_count(),
        tuple(routing.active_model_ids()),
    )


class InstantProbe:
    """The replica's health probe, passing at once with a fixed RTT."""

    async def __call__(self, url: str) -> int:
        await trio.lowlevel.checkpoint()
        return 1_000


class KeyAuthenticator:
    """Admits every stream with one routing key (None: unscoped)."""

    def __init__(self, routing_key: str | None) -> None:
        self.routing_key = routing_key

    async def authenticate(self, token: str | None) -> str | None:
        await trio.lowlevel.checkpoint()
        return self.routing_key


def service(routing: RoutingState, routing_key: str | None) -> RegistrationService:
    return RegistrationService(
        routing,
        KeyAuthenticator(routing_key),
        InstantProbe(),
        RegistrationConfig(idle_timeout_ms=0),  # no idle timeout: the test ends every stream
    )


@contextmanager
def no_tracebacks_logged() -> Iterator[None]:
    records: list[logging.LogRecord] = []

    class Catcher(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info or record.levelno >= logging.ERROR:
                records.append(record)

    catcher = Catcher(logging.DEBUG)
    root = logging.getLogger()
    root.addHandler(catcher)
    try:
        yield
    finally:
        root.removeHandler(catcher)
    assert not records, [r.getMessage() for r in records]


# ---- strategies ---------------------------------------------------------------------------------


def _repeat(text: str, count: int) -> str:
    return text * count


HUGE = st.builds(_repeat, st.sampled_from(["x", "\u00e9", "\x00", " "]), st.integers(1, 20_000))
SERVER_IDS = st.one_of(
    st.sampled_from(["", " ", "pylon-0", "pylon-0 ", "\u00e9", "\x00", "a/b"]),
    st.just(PRE_ID),  # already live: ALREADY_EXISTS
    st.text(min_size=1, max_size=12),
    HUGE,
)
CLUSTER_IDS = st.one_of(st.sampled_from(["", "c", " ", PRE_ID, "pylon-0"]), st.text(max_size=8))


@dataclass(frozen=True)
class Part:
    text: str
    valid: bool | None  # None: the docs leave it open, the property only checks it ends cleanly


@st.composite
def _weighted(draw: st.DrawFn, good: list[Part], other: list[Part]) -> Part:
    rarely = draw(st.sampled_from([False] * 7 + [True]))  # (hypothesis favours early elements)
    return draw(st.sampled_from(other if other and rarely else good))


def _parts(*items: tuple[str, bool | None]) -> st.SearchStrategy[Part]:
    """One of `items`, an admissible one seven times in eight (most URLs should get through to
    the checks after the URL's)."""
    good = [Part(text, valid) for text, valid in items if valid]
    return _weighted(good, [Part(text, valid) for text, valid in items if not valid])


SCHEMES = _parts(
    ("http://", True),
    ("https://", True),
    ("HTTP://", True),
    ("quic://", False),
    ("grpc://", False),
    ("ftp://", False),
    ("1http://", False),
    ("http:/", False),
    ("", False),
)
USERINFO = _parts(("", True), ("user@", True), ("u:p@", True))
HOSTS = _parts(
    ("10.0.0.7", True),
    ("pylon", True),
    ("pylon-0.pylon.models.svc.cluster.local", True),
    ("[::1]", True),
    ("[2001:db8::7]", True),
    ("", False),
    ("pyl on", False),
    ("[::1]junk", False),
    ("[pylon]", False),
    ("::1", False),
    ("[::1", False),
    ("p\u00e9", None),
    ("-x-", None),
    ("a..b", None),
    ("x" * 300, None),
)
PORTS = _parts(
    ("", True),
    (":", True),
    (":8000", True),
    (":0", True),
    (":65535", True),
    (":65536", False),
    (":-1", False),
    (":+80", False),
    (": 80", False),
    (":http", False),
    (":80:90", False),
    (":\u0668\u0660", False),
)
PATHS = _parts(("", True), ("/", True), ("/v1/prefix?x=1#frag", True), ("/\u00e9", True))


@st.composite
def urls(draw: st.DrawFn) -> tuple[str, bool | None]:
    """A URL and whether docs/control-plane.md, Admission, admits it (None: either)."""
    if draw(st.integers(0, 7)) == 0:
        text = draw(st.one_of(st.text(max_size=30), HUGE, st.just("")))
        return text, (False if text == "" else None)
    parts = [draw(strategy) for strategy in (SCHEMES, USERINFO, HOSTS, PORTS, PATHS)]
    verdicts = [part.valid for part in parts]
    valid = False if False in verdicts else (None if None in verdicts else True)
    return "".join(part.text for part in parts), valid


FLOATS = st.floats(allow_nan=True, allow_infinity=True)
U64 = st.one_of(st.sampled_from([0, 1, U64_MAX]), st.integers(0, U64_MAX))


@st.composite
def model_stats(draw: st.DrawFn) -> pb.ModelStats:
    return pb.ModelStats(
        last_mean_input_tps=draw(FLOATS),
        output_tps=draw(FLOATS),
        queue_size=draw(U64),
        queued_input_size=draw(U64),
        max_output_tps=draw(FLOATS),
        kv_cache_capacity_tokens=draw(U64),
        num_running_queries=draw(U64),
        max_engine_concurrency=draw(U64),
        total_query_input_size=draw(U64),
        queue_time_estimate_ms_by_priority=draw(
            st.dictionaries(st.integers(0, 2**32 - 1), U64, max_size=4)
        ),
        stats_observed_at_unix_ms=draw(U64),
        stats_capabilities=draw(st.lists(st.text(max_size=6), max_size=3)),
    )


STATUSES = st.one_of(st.sampled_from([0, 1, 1, 2]), st.integers(-(2**31), 2**31 - 1))
MODEL_IDS = st.one_of(st.sampled_from(["m", "", " m ", PRE_MODEL, "\u00e9"]), st.text(max_size=8))


@st.composite
def model_registrations(draw: st.DrawFn) -> pb.InferenceServerModelRegistration:
    stats = draw(st.none() | model_stats())
    status: Any = draw(STATUSES)  # also numbers outside the enum, as a newer Pylon may send
    return pb.InferenceServerModelRegistration(stats=stats, status=status)


@dataclass(frozen=True)
class Message:
    """A registration message and whether its URL is admissible (None: either)."""

    wire: pb.InferenceServerRegistration
    url_valid: bool | None


@st.composite
def messages(draw: st.DrawFn) -> Message:
    url, url_valid = draw(urls())
    wire = pb.InferenceServerRegistration(
        inference_server_id=draw(SERVER_IDS),
        inference_server_url=url,
        cluster_id=draw(CLUSTER_IDS),
        reverse_tunnel=draw(st.integers(0, 5)) == 0,
        models=draw(st.dictionaries(MODEL_IDS, model_registrations(), max_size=4)),
    )
    return Message(wire, url_valid)


@st.composite
def streams(draw: st.DrawFn) -> list[Message]:
    """A first message, then up to two more: the same identity with new models (a heartbeat),
    or a random message (most likely a changed identity)."""
    first = draw(messages())
    stream = [first]
    for _ in range(draw(st.integers(0, 2))):
        if draw(st.booleans()):
            wire = pb.InferenceServerRegistration()
            wire.CopyFrom(first.wire)
            wire.ClearField("models")
            for key, value in draw(
                st.dictionaries(MODEL_IDS, model_registrations(), max_size=3)
            ).items():
                wire.models[key].CopyFrom(value)
            stream.append(Message(wire, first.url_valid))
        else:
            stream.append(draw(messages()))
    return stream


# ---- the oracles (from docs/control-plane.md) ---------------------------------------------------


def expected_admission(message: Message, live_ids: set[str]) -> tuple[GrpcStatus, str] | None:
    """The status a first message is refused with (and the start of its message), or None when
    it is admitted. A URL whose fate the docs leave open counts as admissible here; the caller
    also accepts a refusal naming the URL."""
    wire = message.wire
    if not wire.inference_server_id:
        return GrpcStatus.INVALID_ARGUMENT, "inference_server_id is empty"
    if not wire.inference_server_url:
        return GrpcStatus.INVALID_ARGUMENT, "inference_server_url is empty"
    if message.url_valid is False:
        return GrpcStatus.INVALID_ARGUMENT, URL_PREFIX
    if wire.reverse_tunnel:
        return GrpcStatus.INVALID_ARGUMENT, "reverse tunnel flag"
    if wire.inference_server_id in live_ids:
        return GrpcStatus.ALREADY_EXISTS, f"inference_server_id '{wire.inference_server_id}'"
    return None


def identity_change(
    first: pb.InferenceServerRegistration, later: pb.InferenceServerRegistration
) -> str | None:
    """The message a later message is refused with (docs: reverse flag, URL, id, cluster id)."""
    if later.reverse_tunnel:
        return "reverse tunnel flag changed"
    if later.inference_server_url != first.inference_server_url:
        return "inference_server_url changed"
    if later.inference_server_id != first.inference_server_id:
        return "inference_server_id changed"
    if (later.cluster_id or later.inference_server_id) != (
        first.cluster_id or first.inference_server_id
    ):
        return "cluster_id changed"
    return None


def check_applied(
    routing: RoutingState, wire: pb.InferenceServerRegistration, key: str | None
) -> None:
    """docs/control-plane.md, "Model status": every listed model advertised; routable exactly when
    it has stats and says ACTIVE (the probe passes, so it has an RTT)."""
    for model_id, model in wire.models.items():
        target = RoutingTargetKey(key, model_id)
        assert routing.is_advertised(target)
        snapshot = routing.snapshot(target)
        ids = (
            set()
            if snapshot is None
            else {b.inference_server_id for c in snapshot.clusters for b in c.backends}
        )
        routable = model.HasField("stats") and model.status == ACTIVE
        assert (wire.inference_server_id in ids) is routable, (model_id, model)


# ---- driving the service ------------------------------------------------------------------------


@dataclass
class Call:
    acks: int = 0
    error: GrpcError | None = None
    ended: bool = False

    def finished(self) -> bool:
        return self.ended  # a call, so a type checker does not narrow it across awaits


async def register_stream(
    routing: RecordingRoutingState, stream: Sequence[Message], routing_key: str | None
) -> str:
    """Send `stream` on one registration stream and check each step against the oracles; return
    how it ended (for the coverage check)."""
    before = state_view(routing)
    live_ids = {r.identity.inference_server_id for r in routing.registrations()}
    registrations = service(routing, routing_key)
    send, receive = trio.open_memory_channel[pb.InferenceServerRegistration](len(stream) + 1)
    call = Call()

    async def ack(message: pb.InferenceServerAck) -> None:
        assert message == pb.InferenceServerAck()
        call.acks += 1

    async def run() -> None:
        context = RpcContext(REGISTER, {admission.HEARTBEAT_HEADER: "1000"}, None, "")
        try:
            await registrations.register(RequestStream(receive), context, ack)
        except GrpcError as error:
            call.error = error
        call.ended = True

    first = stream[0]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        for index, message in enumerate(stream):
            await send.send(message.wire)
            await trio.testing.wait_all_tasks_blocked()
            if index == 0:
                check_first(routing, first, live_ids, call, before, routing_key)
            elif not call.ended:
                change = identity_change(first.wire, message.wire)
                if change is None:
                    assert call.acks == index + 1
                    check_applied(routing, message.wire, routing_key)
                else:
                    assert call.finished() and call.error is not None
                    assert call.error.status is GrpcStatus.INVALID_ARGUMENT
                    assert call.error.message == change
            if call.ended:
                break
        await send.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert call.finished(), "the stream did not end after the client half-closed"
        registrations.shutdown()
    if call.error is None:
        assert call.acks == len(stream)
    assert state_view(routing) == before, "the stream left the routing state changed"
    return outcome(call)


def outcome(call: Call) -> str:
    if call.error is None:
        return "admitted"
    text = call.error.message
    if text.startswith(URL_PREFIX):
        text = "invalid inference_server_url"
    elif text.startswith("inference_server_id '"):
        text = "already registered"
    return f"{call.error.status.name}: {text}" + (" (after an ack)" if call.acks else "")


def check_first(
    routing: RecordingRoutingState,
    first: Message,
    live_ids: set[str],
    call: Call,
    before: tuple[object, ...],
    routing_key: str | None,
) -> None:
    expected = expected_admission(first, live_ids)
    refused_url = call.error is not None and call.error.message.startswith(URL_PREFIX)
    nonblank = first.wire.inference_server_id and first.wire.inference_server_url
    if first.url_valid is None and refused_url and nonblank:
        # A URL the docs leave open, refused (before the reverse-tunnel and duplicate checks).
        expected = (GrpcStatus.INVALID_ARGUMENT, URL_PREFIX)
    if expected is None:
        assert call.error is None and call.acks == 1, call.error
        check_applied(routing, first.wire, routing_key)
        return
    status, message = expected
    assert call.ended and call.error is not None, "a refused first message was admitted"
    assert (call.error.status, call.error.message[: len(message)]) == (status, message)
    assert call.acks == 0
    assert state_view(routing) == before
    allowed = ["begin"] if status is GrpcStatus.ALREADY_EXISTS else []
    assert routing.calls == allowed, routing.calls


# ---- property 1: messages -----------------------------------------------------------------------

MESSAGE_EXAMPLES = 500
PHASES = tuple(Phase)
NO_SHRINK = (Phase.generate,)  # the fault-injection tests only need a failure, not the smallest


def run_message_property(examples: int, *, shrink: bool = True) -> Counter[str]:
    outcomes: Counter[str] = Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        phases=PHASES if shrink else NO_SHRINK,
        report_multiple_bugs=shrink,
    )
    @given(stream=streams(), routing_key=st.sampled_from([None, "tenant"]))
    def property_holds(stream: list[Message], routing_key: str | None) -> None:
        note(f"stream: {[str(m.wire)[:300] for m in stream]}")
        with no_tracebacks_logged():
            outcomes[trio.run(register_stream, fresh_state(), stream, routing_key)] += 1

    property_holds()
    return outcomes


def test_registration_messages_are_admitted_or_refused_as_documented() -> None:
    outcomes = run_message_property(MESSAGE_EXAMPLES)
    invalid = "INVALID_ARGUMENT: "
    expected = {
        "admitted",
        invalid + "inference_server_id is empty",
        invalid + "inference_server_url is empty",
        invalid + "invalid inference_server_url",
        invalid + "reverse tunnel flag set but no reverse tunnel config",
        "ALREADY_EXISTS: already registered",
        invalid + "inference_server_url changed (after an ack)",
    }
    assert expected <= set(outcomes), outcomes


# ---- property 2: bytes on the gRPC transport ----------------------------------------------------

PREFIX = struct.Struct(">BI")  # the gRPC length prefix: compressed flag, message length


@dataclass(frozen=True)
class Body:
    """A request body, and where it is cut into DATA frames."""

    data: bytes
    chunks: tuple[int, ...]  # where the body is cut into ASGI messages (DATA frames)


def frame(payload: bytes, flag: int = 0, length: int | None = None) -> bytes:
    return PREFIX.pack(flag, len(payload) if length is None else length) + payload


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    """One length-prefixed frame: a message from the message strategy, or random bytes, with
    a flag (0 mostly; 1 is "compressed") and a length that may lie."""
    if draw(st.booleans()):
        payload = draw(messages()).wire.SerializeToString()
    else:
        payload = draw(st.binary(max_size=64))
    flag = draw(st.sampled_from([0, 0, 0, 0, 1, 2, 0x80, 0xFF]))
    length = draw(
        st.one_of(
            st.none(),
            st.none(),
            st.integers(0, len(payload) + 8),
            st.sampled_from([MAX_MESSAGE_BYTES + 1, 2**32 - 1]),
        )
    )
    return frame(payload, flag, length)


@st.composite
def bodies(draw: st.DrawFn) -> Body:
    kind = draw(st.sampled_from(["frames", "frames", "frames", "bytes", "stream", "empty"]))
    if kind == "bytes":
        data = draw(st.binary(max_size=256))
    elif kind == "stream":  # well-formed frames of a stream, then maybe trailing garbage
        data = b"".join(frame(m.wire.SerializeToString()) for m in draw(streams()))
        data += draw(st.sampled_from([b"", b"\x00", b"\x00\x00\x00\x00\x05ab"]))
    elif kind == "empty":
        data = b""
    else:
        data = b"".join(draw(st.lists(frames(), min_size=1, max_size=3)))
    chunks = tuple(draw(st.lists(st.integers(1, max(len(data), 1)), max_size=3)))
    return Body(data, chunks)


def decode_body(data: bytes) -> tuple[list[pb.InferenceServerRegistration], GrpcStatus | None]:
    """The messages `data` frames, in order, and the framing error after them (None: none).

    The rules of stargate/grpc_asgi.py's module docstring: flag 1 is UNIMPLEMENTED (compressed),
    any other nonzero flag INTERNAL, a length above the limit RESOURCE_EXHAUSTED (as soon as the
    prefix is read), a body ending inside a frame INTERNAL, undecodable protobuf INTERNAL.
    """
    decoded: list[pb.InferenceServerRegistration] = []
    position = 0
    while position < len(data):
        if len(data) - position < PREFIX.size:
            return decoded, GrpcStatus.INTERNAL
        flag, length = PREFIX.unpack_from(data, position)
        if flag == 1:
            return decoded, GrpcStatus.UNIMPLEMENTED
        if flag != 0:
            return decoded, GrpcStatus.INTERNAL
        if length > MAX_MESSAGE_BYTES:
            return decoded, GrpcStatus.RESOURCE_EXHAUSTED
        position += PREFIX.size
        if len(data) - position < length:
            return decoded, GrpcStatus.INTERNAL
        message = pb.InferenceServerRegistration()
        try:
            message.ParseFromString(data[position : position + length])
        except Exception:  # DecodeError, and whatever else protobuf raises for garbage
            return decoded, GrpcStatus.INTERNAL
        decoded.append(message)
        position += length
    return decoded, None


def expected_call(data: bytes, live_ids: set[str]) -> set[tuple[GrpcStatus, int]]:
    """The (status, number of acks) pairs the call may end with.

    The URL of a decoded message is not judged here (its rules are the first property's), so a
    refusal naming it is always allowed once the id and URL are non-empty.
    """
    decoded, framing = decode_body(data)
    if not decoded:
        return {(framing or GrpcStatus.OK, 0)}
    first = decoded[0]
    refused = (GrpcStatus.INVALID_ARGUMENT, 0)
    if not first.inference_server_id or not first.inference_server_url:
        return {refused}
    if first.reverse_tunnel:
        return {refused}
    if first.inference_server_id in live_ids:
        return {refused, (GrpcStatus.ALREADY_EXISTS, 0)}
    for index, later in enumerate(decoded[1:], start=1):
        if identity_change(first, later) is not None:
            return {refused, (GrpcStatus.INVALID_ARGUMENT, index)}
    return {refused, (framing or GrpcStatus.OK, len(decoded))}


@dataclass
class GrpcAnswer:
    status: int | None = None
    messages: list[bytes] = field(default_factory=list)
    trailers: dict[bytes, bytes] = field(default_factory=dict)
    complete: trio.Event = field(default_factory=trio.Event)


async def grpc_call(app: GrpcApp, body: Body) -> GrpcAnswer:
    """One call through the ASGI app, as Hypercorn makes it (HTTP/2, trailers): the body cut
    into DATA frames, then `http.disconnect` once the call is complete."""
    cuts = sorted({c for c in body.chunks if 0 < c < len(body.data)})
    pieces = [body.data[a:b] for a, b in zip([0, *cuts], [*cuts, len(body.data)], strict=True)]
    inbox = [
        {"type": "http.request", "body": piece, "more_body": index < len(pieces) - 1}
        for index, piece in enumerate(pieces)
    ]
    answer = GrpcAnswer()
    data = bytearray()

    async def receive() -> dict[str, Any]:
        if inbox:
            return inbox.pop(0)
        await answer.complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
        elif message["type"] == "http.response.body":
            data.extend(message.get("body", b""))
        elif message["type"] == "http.response.trailers":
            answer.trailers.update(dict(message.get("headers", [])))
            if not message.get("more_trailers", False):
                answer.complete.set()

    scope = {
        "type": "http",
        "http_version": "2",
        "method": "POST",
        "scheme": "http",
        "path": REGISTER,
        "raw_path": REGISTER.encode(),
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            (admission.HEARTBEAT_HEADER.encode(), b"1000"),
        ],
        "client": ("127.0.0.1", 50000),
        "extensions": {"http.response.trailers": {}},
    }
    with trio.fail_after(10):
        await app(scope, receive, send)
    while data:
        flag, length = PREFIX.unpack_from(data)
        assert flag == 0
        answer.messages.append(bytes(data[PREFIX.size : PREFIX.size + length]))
        del data[: PREFIX.size + length]
    return answer


async def call_transport(body: Body) -> str:
    routing = fresh_state()
    before = state_view(routing)
    live_ids = {r.identity.inference_server_id for r in routing.registrations()}
    registrations = service(routing, None)
    app = GrpcApp(
        [grpc_stream_stream(REGISTER, pb.InferenceServerRegistration, registrations.register)],
        max_message_bytes=MAX_MESSAGE_BYTES,
    )
    answer = await grpc_call(app, body)
    assert answer.status == 200 and answer.complete.is_set()
    assert b"grpc-status" in answer.trailers, "a gRPC call must end with a status"
    status = GrpcStatus(int(answer.trailers[b"grpc-status"]))
    expected = expected_call(body.data, live_ids)
    message = answer.trailers.get(b"grpc-message")
    note(f"status {status.name} ({message!r}), acks {len(answer.messages)}, expected {expected}")
    assert status is not GrpcStatus.UNKNOWN, "a handler raised"
    assert (status, len(answer.messages)) in expected
    assert all(
        pb.InferenceServerAck.FromString(m) == pb.InferenceServerAck() for m in answer.messages
    )
    assert state_view(routing) == before, "the call left the routing state changed"
    return status.name


BYTES_EXAMPLES = 500


def run_bytes_property(examples: int, *, shrink: bool = True) -> Counter[str]:
    outcomes: Counter[str] = Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        phases=PHASES if shrink else NO_SHRINK,
        report_multiple_bugs=shrink,
    )
    @given(body=bodies())
    def property_holds(body: Body) -> None:
        with no_tracebacks_logged():
            outcomes[trio.run(call_transport, body)] += 1

    property_holds()
    return outcomes


def test_registration_bytes_end_with_a_documented_status() -> None:
    outcomes = run_bytes_property(BYTES_EXAMPLES)
    expected = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "INTERNAL", "UNIMPLEMENTED"}
    assert expected <= set(outcomes), outcomes


# ---- the properties must be able to fail -------------------------------------------------------


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _inject(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """Break the code the way a regression would."""
    if fault == "the URL check is skipped":
        monkeypatch.setattr(admission, "validate_backend_url", lambda url, reverse=False: None)
    elif fault == "an ended stream keeps its routes":
        monkeypatch.setattr(RegistrationService, "_end", lambda self, registration: None)
    elif fault == "a model without stats raises":
        real = admission.routes_for_update

        def routes(message: pb.InferenceServerRegistration, *args: Any) -> Any:
            if any(not model.HasField("stats") for model in message.models.values()):
                raise RuntimeError("injected fault")
            return real(message, *args)

        monkeypatch.setattr(registration_module, "routes_for_update", routes)
    elif fault == "a truncated body is accepted":
        monkeypatch.setattr(grpc_asgi._Deframer, "finish", lambda self: None)


MESSAGE_FAULTS: dict[str, str | tuple[str, ...]] = {
    # Found as an admission that should not be, or as a refusal for the wrong reason.
    "the URL check is skipped": ("a refused first message was admitted", "_server_url"),
    "an ended stream keeps its routes": "left the routing state changed",
    "a model without stats raises": "injected fault",
}
BYTES_FAULTS = {
    "an ended stream keeps its routes": "left the routing state changed",
    "a model without stats raises": "a handler raised",
    "a truncated body is accepted": "assert (<GrpcStatus.OK",
}


@pytest.mark.parametrize("fault", sorted(MESSAGE_FAULTS))
def test_the_message_property_fails_when_a_fault_is_injected(
    monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    _inject(monkeypatch, fault)
    with pytest.raises(BaseException) as caught:
        run_message_property(MESSAGE_EXAMPLES, shrink=False)
    messages = [f"{type(leaf).__name__}: {leaf}" for leaf in _leaves(caught.value)]
    expected = MESSAGE_FAULTS[fault]
    fragments = (expected,) if isinstance(expected, str) else expected
    assert any(f in message for f in fragments for message in messages), messages


@pytest.mark.parametrize("fault", sorted(BYTES_FAULTS))
def test_the_bytes_property_fails_when_a_fault_is_injected(
    monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    _inject(monkeypatch, fault)
    with pytest.raises(BaseException) as caught:
        run_bytes_property(BYTES_EXAMPLES, shrink=False)
    messages = [f"{type(leaf).__name__}: {leaf}" for leaf in _leaves(caught.value)]
    assert any(BYTES_FAULTS[fault] in message for message in messages), messages
