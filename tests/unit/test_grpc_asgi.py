"""The gRPC server (`stargate.grpc_asgi`) on a real Hypercorn trio server, real clock.

Clients are the real grpcio client (its blocking API, run in worker threads), a grpcio client in a
subprocess that gets killed, and a raw `h2` client for inputs grpcio cannot produce (truncated
bodies, compressed flags, chunking, malformed `grpc-timeout`, non-gRPC requests).
"""

from __future__ import annotations

import logging
import queue
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import h2.config
import h2.connection
import h2.events
import httpx
import pytest
import trio
from hypercorn.config import Config as HypercornConfig

from stargate import grpc_asgi as grpc_server
from stargate.config import ListenAddress
from stargate.grpc_asgi import (
    GrpcApp,
    GrpcError,
    GrpcMethod,
    GrpcStatus,
    RequestStream,
    RpcContext,
    _parse_timeout,
    _percent_encode,
    stream_stream,
    unary_stream,
    unary_unary,
)
from stargate.h2_server import H2Config, serve_h2
from stargate.protocol import stargate_pb2 as pb
from stargate.protocol import stargate_pb2_grpc as pb_grpc
from stargate.serving import bind_listener, serve_asgi

REGISTER = "/stargate.StargateControlPlane/RegisterInferenceServer"
WATCH = "/stargate.StargateControlPlane/WatchStargates"
LIST_MODELS = "/stargate.StargateModelDiscovery/ListModels"
GONE_WITHIN = 3.0  # real seconds a handler's `finally` may take to run after the client left

R = TypeVar("R")


# --- the app under test ------------------------------------------------------------------------


@dataclass
class Handlers:
    """Test handlers on the real messages, recording what the server saw."""

    contexts: list[RpcContext] = field(default_factory=list)
    started: trio.Event = field(default_factory=trio.Event)
    finished: trio.Event = field(default_factory=trio.Event)
    sent: int = 0
    requests: RequestStream[pb.InferenceServerRegistration] | None = None

    async def echo(
        self,
        requests: RequestStream[pb.InferenceServerRegistration],
        context: RpcContext,
        send: Callable[[pb.InferenceServerAck], Any],
    ) -> None:
        """Acks each registration with its inference_server_id."""
        self.contexts.append(context)
        self.started.set()
        try:
            async for registration in requests:
                await send(
                    pb.InferenceServerAck(reverse_tunnel_target=registration.inference_server_id)
                )
        finally:
            self.finished.set()

    async def never_reads(
        self,
        requests: RequestStream[pb.InferenceServerRegistration],
        context: RpcContext,
        send: Callable[[pb.InferenceServerAck], Any],
    ) -> None:
        self.requests = requests
        self.started.set()
        try:
            await trio.sleep_forever()
        finally:
            self.finished.set()

    async def floods(
        self,
        requests: RequestStream[pb.InferenceServerRegistration],
        context: RpcContext,
        send: Callable[[pb.InferenceServerAck], Any],
    ) -> None:
        """Sends 1 KB acks until flow control blocks it (the client reads none)."""
        self.started.set()
        try:
            while True:
                await send(pb.InferenceServerAck(reverse_tunnel_target="x" * 1024))
                self.sent += 1
        finally:
            self.finished.set()

    async def list_models(self, request: pb.ListModelsRequest, context: RpcContext) -> Any:
        self.contexts.append(context)
        if "missing" in request.model_ids:
            raise GrpcError(GrpcStatus.NOT_FOUND, " no such model: é 100% sure\n")
        if "boom" in request.model_ids:
            raise RuntimeError("secret internals")
        if "nursery" in request.model_ids:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_raise, GrpcError(GrpcStatus.ABORTED, "from a child task"))
        if "hang" in request.model_ids:
            self.started.set()
            try:
                await trio.sleep_forever()
            finally:
                self.finished.set()
        return pb.ListModelsResponse(model_ids=sorted(set(request.model_ids)))

    async def watch(
        self,
        request: pb.WatchStargatesRequest,
        context: RpcContext,
        send: Callable[[pb.WatchStargatesResponse], Any],
    ) -> None:
        self.contexts.append(context)
        for index in range(3):
            if index == 2 and "x-fail" in context.metadata:
                raise ValueError("broke mid-stream")
            info = pb.StargateInfo(stargate_id=f"sg-{index}", advertise_addr=f"10.0.0.{index}:9")
            await send(pb.WatchStargatesResponse(stargates=[info]))

    def methods(self, register: Callable[..., Any] | None = None) -> list[GrpcMethod]:
        return [
            stream_stream(REGISTER, pb.InferenceServerRegistration, register or self.echo),
            unary_stream(WATCH, pb.WatchStargatesRequest, self.watch),
            unary_unary(LIST_MODELS, pb.ListModelsRequest, self.list_models),
        ]


async def _raise(error: Exception) -> None:
    raise error


_SERVER = {"kind": "h2_server"}


@pytest.fixture(autouse=True, params=["h2_server", "hypercorn"])
def server_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test runs on both servers of a GrpcApp: the replica's own (stargate/h2_server.py,
    which delivers request events to the call's callback) and Hypercorn (a reader task)."""
    _SERVER["kind"] = request.param
    yield request.param


@asynccontextmanager
async def serving(app: Callable[..., Any]) -> AsyncIterator[str]:
    """Serve `app` on 127.0.0.1 with the server of this run (`server_kind`); yield the
    `host:port` target."""
    sock = bind_listener("gRPC", ListenAddress("127.0.0.1", 0))
    port = sock.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        if _SERVER["kind"] == "h2_server":
            await nursery.start(serve_h2, app, sock, H2Config(graceful_timeout=2.0), stop.wait)
        else:
            config = HypercornConfig()
            config.graceful_timeout = 2.0
            config.accesslog = None
            await nursery.start(serve_asgi, app, sock, config, stop.wait)
        try:
            yield f"127.0.0.1:{port}"
        finally:
            stop.set()


async def in_thread(function: Callable[[], R]) -> R:
    return await trio.to_thread.run_sync(function)


def _rpc_error(function: Callable[[], object]) -> grpc.RpcError:
    try:
        function()
    except grpc.RpcError as error:
        return error
    raise AssertionError("the call succeeded")


def _collect(responses: Iterator[R]) -> tuple[list[R], grpc.RpcError | None]:
    received: list[R] = []
    try:
        for response in responses:
            received.append(response)
    except grpc.RpcError as error:
        return received, error
    return received, None


async def _wait_until(predicate: Callable[[], bool]) -> None:
    """Poll `predicate` (state a handler changes); callers bound the wait with `fail_after`."""
    while True:
        if predicate():
            return
        await trio.sleep(0.01)


# --- a raw HTTP/2 client -----------------------------------------------------------------------


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    trailers: dict[str, str] | None


def frame(payload: bytes, *, compressed: bool = False) -> bytes:
    return struct.pack(">BI", 1 if compressed else 0, len(payload)) + payload


def unframe(body: bytes) -> list[bytes]:
    messages = []
    while body:
        _, length = struct.unpack(">BI", body[:5])
        messages.append(body[5 : 5 + length])
        body = body[5 + length :]
    return messages


class H2Client:
    """A minimal HTTP/2 client (h2c prior knowledge) for inputs grpcio never produces."""

    def __init__(self, stream: trio.SocketStream, target: str) -> None:
        self.stream = stream
        self.target = target
        self.connection = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.connection.initiate_connection()
        self.response = RawResponse(0, {}, b"", None)
        self.reset = False

    @classmethod
    @asynccontextmanager
    async def connect(cls, target: str) -> AsyncIterator[H2Client]:
        host, port = target.rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        try:
            yield cls(stream, target)
        finally:
            await stream.aclose()

    def request(
        self,
        path: str,
        data_frames: Sequence[bytes] = (),
        *,
        method: str = "POST",
        content_type: str = "application/grpc",
        headers: Sequence[tuple[str, str]] = (),
        end_stream: bool = True,
        te: bool = True,
    ) -> None:
        """Queue stream 1's request: HEADERS, then each item of `data_frames` as a DATA frame."""
        request_headers = [
            (":method", method),
            (":scheme", "http"),
            (":path", path),
            (":authority", self.target),
            *([("te", "trailers")] if te else []),
            ("content-type", content_type),
            *headers,
        ]
        self.connection.send_headers(1, request_headers, end_stream=end_stream and not data_frames)
        self.data(data_frames, end_stream=end_stream)

    def data(self, data_frames: Sequence[bytes], *, end_stream: bool = False) -> None:
        for index, data in enumerate(data_frames):
            last = index == len(data_frames) - 1
            self.connection.send_data(1, data, end_stream=end_stream and last)

    async def flush(self) -> None:
        await self.stream.send_all(self.connection.data_to_send())

    async def read_until_stream_ends(self) -> RawResponse:
        """Read until the server ends (or resets) stream 1, within 5 s."""
        with trio.fail_after(5):
            done = False
            while not done:
                data = await self.stream.receive_some(65536)
                assert data, "connection closed before the response ended"
                for event in self.connection.receive_data(data):
                    done |= self._handle(event)
                await self.flush()
        return self.response

    def _handle(self, event: h2.events.Event) -> bool:
        response = self.response
        if isinstance(event, h2.events.ResponseReceived):
            response.headers = dict(event.headers)
            response.status = int(response.headers.pop(":status"))
        elif isinstance(event, h2.events.DataReceived):
            response.body += event.data
            self.connection.acknowledge_received_data(event.flow_controlled_length, 1)
        elif isinstance(event, h2.events.TrailersReceived):
            response.trailers = dict(event.headers)
        elif isinstance(event, h2.events.StreamReset):
            self.reset = True
        return isinstance(event, h2.events.StreamEnded | h2.events.StreamReset)


async def raw_call(
    target: str,
    path: str,
    data_frames: Sequence[bytes] = (),
    *,
    end_stream: bool = True,
    one_write: bool = False,
    **options: Any,
) -> RawResponse:
    """One request on a new connection. Each of `data_frames` is its own DATA frame, sent in its
    own write (so the server reads it as its own chunk) unless `one_write`."""
    async with H2Client.connect(target) as client:
        client.request(path, (), end_stream=end_stream and not data_frames, **options)
        for index, data in enumerate(data_frames):
            if not one_write:
                await client.flush()
            client.data([data], end_stream=end_stream and index == len(data_frames) - 1)
        await client.flush()
        return await client.read_until_stream_ends()


def _status(response: RawResponse) -> GrpcStatus:
    assert response.status == 200
    assert response.trailers is not None
    return GrpcStatus(int(response.trailers["grpc-status"]))


# --- lifespan and plain HTTP -------------------------------------------------------------------


async def test_lifespan_startup_and_shutdown_are_answered() -> None:
    to_app, app_inbox = trio.open_memory_channel[dict[str, Any]](2)
    app_outbox, from_app = trio.open_memory_channel[dict[str, Any]](2)
    app = GrpcApp([])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, {"type": "lifespan"}, app_inbox.receive, app_outbox.send)
        with trio.fail_after(2):
            await to_app.send({"type": "lifespan.startup"})
            assert await from_app.receive() == {"type": "lifespan.startup.complete"}
            await to_app.send({"type": "lifespan.shutdown"})
            assert await from_app.receive() == {"type": "lifespan.shutdown.complete"}


async def test_non_grpc_requests_get_plain_http_errors_without_trailers() -> None:
    async with serving(GrpcApp(Handlers().methods())) as target:
        response = await raw_call(target, REGISTER, method="GET")
        assert (response.status, response.headers["allow"], response.trailers) == (
            405,
            "POST",
            None,
        )
        for content_type in ("application/json", "application/grpc-web", "text/plain"):
            response = await raw_call(target, REGISTER, [b"{}"], content_type=content_type)
            assert (response.status, response.trailers) == (415, None)
            assert "grpc-status" not in response.headers
        response = await raw_call(
            target, LIST_MODELS, [frame(b"")], content_type="application/grpc+proto"
        )
        assert _status(response) == GrpcStatus.OK
        response = await raw_call(target, LIST_MODELS, [frame(b"")], te=False)
        assert (response.status, response.trailers) == (400, None)

        # HTTP/1.1 cannot carry trailers at all. The replica's server answers it 505 before any
        # app sees it (stargate/h2_server.py); on Hypercorn the app answers, method first.
        async with httpx.AsyncClient(base_url=f"http://{target}") as client:
            response_1 = await client.get(REGISTER)
            assert response_1.status_code == (505 if _SERVER["kind"] == "h2_server" else 405)
            grpc_headers = {"content-type": "application/grpc", "te": "trailers"}
            response_1 = await client.post(REGISTER, content=frame(b""), headers=grpc_headers)
            assert response_1.status_code == 505
            assert "grpc-status" not in response_1.headers


# --- the three kinds of method with grpcio -----------------------------------------------------


async def test_unary_unary_over_grpcio_with_context() -> None:
    handlers = Handlers()
    async with serving(GrpcApp(handlers.methods())) as target:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.StargateModelDiscoveryStub(channel)
            request = pb.ListModelsRequest(model_ids=["b", "a", "b"])
            metadata = (("x-tenant", "acme"), ("authorization", "Bearer t"))
            response = await in_thread(lambda: stub.ListModels(request, metadata=metadata))
            assert list(response.model_ids) == ["a", "b"]
            response = await in_thread(lambda: stub.ListModels(request, timeout=5))
    first, second = handlers.contexts
    assert first.method == LIST_MODELS
    assert first.metadata["x-tenant"] == "acme"
    assert first.metadata["authorization"] == "Bearer t"
    assert first.metadata["content-type"] == "application/grpc"
    assert not any(name.startswith(":") for name in first.metadata)
    assert all(name == name.lower() for name in first.metadata)
    assert first.deadline is None
    assert first.peer.startswith("127.0.0.1:")
    assert int(first.peer.rsplit(":", 1)[1]) > 0
    assert second.deadline is not None
    # grpcio rounds its timeout up a little (for example "5000029u").
    assert second.metadata["grpc-timeout"][-1] in "HMSmun"
    assert 4.0 < second.deadline - trio.current_time() < 5.1


async def test_server_streaming_over_grpcio() -> None:
    async with serving(GrpcApp(Handlers().methods())) as target:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.StargateControlPlaneStub(channel)
            call = stub.WatchStargates(pb.WatchStargatesRequest(), timeout=5)
            responses, error = await in_thread(lambda: _collect(call))
    assert error is None
    assert call.code() == grpc.StatusCode.OK
    assert [r.stargates[0].stargate_id for r in responses] == ["sg-0", "sg-1", "sg-2"]


async def test_bidi_stream_acks_each_registration_then_ends_ok() -> None:
    handlers = Handlers()
    async with serving(GrpcApp(handlers.methods())) as target:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.StargateControlPlaneStub(channel)
            outbox: queue.Queue[pb.InferenceServerRegistration | None] = queue.Queue()
            call = stub.RegisterInferenceServer(iter(outbox.get, None), timeout=10)
            for index in range(5):  # ping-pong: each ack arrives before the next registration
                outbox.put(pb.InferenceServerRegistration(inference_server_id=f"is-{index}"))
                ack = await in_thread(lambda: next(call))
                assert ack.reverse_tunnel_target == f"is-{index}"
            # A 1 MiB message spans many HTTP/2 DATA frames and `http.request` chunks.
            big = pb.InferenceServerRegistration(
                inference_server_id="big", inference_server_url="http://" + "x" * 2**20
            )
            outbox.put(big)
            assert (await in_thread(lambda: next(call))).reverse_tunnel_target == "big"
            outbox.put(None)  # half-close: the handler's loop ends and the call is OK
            rest, error = await in_thread(lambda: _collect(call))
    assert (rest, error, call.code()) == ([], None, grpc.StatusCode.OK)
    assert handlers.finished.is_set()


async def test_messages_split_across_and_packed_into_data_frames() -> None:
    one, two, three = (
        frame(pb.InferenceServerRegistration(inference_server_id=name).SerializeToString())
        for name in ("one", "two", "three")
    )
    frames = [one + two, three[:2], three[2:7], three[7:], b"", frame(b"")]
    async with serving(GrpcApp(Handlers().methods())) as target:
        response = await raw_call(target, REGISTER, frames)
    assert _status(response) == GrpcStatus.OK
    assert response.headers["content-type"] == "application/grpc"
    assert response.headers["grpc-accept-encoding"] == "identity"
    acks = [
        pb.InferenceServerAck.FromString(m).reverse_tunnel_target for m in unframe(response.body)
    ]
    assert acks == ["one", "two", "three", ""]


# --- statuses ----------------------------------------------------------------------------------


async def test_grpc_error_becomes_its_status_with_a_percent_encoded_message() -> None:
    async with serving(GrpcApp(Handlers().methods())) as target:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.StargateModelDiscoveryStub(channel)
            error = await in_thread(
                lambda: _rpc_error(
                    lambda: stub.ListModels(pb.ListModelsRequest(model_ids=["missing"]))
                )
            )
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert error.details() == " no such model: é 100% sure\n"
            # Raised in a child task of the handler's own nursery: still its status.
            error = await in_thread(
                lambda: _rpc_error(
                    lambda: stub.ListModels(pb.ListModelsRequest(model_ids=["nursery"]))
                )
            )
            assert (error.code(), error.details()) == (grpc.StatusCode.ABORTED, "from a child task")
        raw = await raw_call(
            target,
            LIST_MODELS,
            [frame(pb.ListModelsRequest(model_ids=["missing"]).SerializeToString())],
        )
    assert raw.trailers == {
        "grpc-status": "5",
        "grpc-message": "%20no such model: %C3%A9 100%25 sure%0A",
    }


async def test_unexpected_exception_is_unknown_and_logged_and_sent_messages_stay_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="stargate.grpc_asgi")
    async with serving(GrpcApp(Handlers().methods())) as target:
        with grpc.insecure_channel(target) as channel:
            discovery = pb_grpc.StargateModelDiscoveryStub(channel)
            error = await in_thread(
                lambda: _rpc_error(
                    lambda: discovery.ListModels(pb.ListModelsRequest(model_ids=["boom"]))
                )
            )
            assert error.code() == grpc.StatusCode.UNKNOWN
            assert "secret" not in error.details()
            control = pb_grpc.StargateControlPlaneStub(channel)
            call = control.WatchStargates(pb.WatchStargatesRequest(), metadata=(("x-fail", "1"),))
            responses, error = await in_thread(lambda: _collect(call))
    assert len(responses) == 2
    assert error is not None and error.code() == grpc.StatusCode.UNKNOWN
    logged = [r for r in caplog.records if r.name == "stargate.grpc_asgi"]
    assert len(logged) == 2
    assert all(r.exc_info is not None for r in logged)
    assert LIST_MODELS in logged[0].getMessage()


async def test_each_app_answers_only_its_own_methods() -> None:
    handlers = Handlers()
    control = GrpcApp(handlers.methods()[:2])
    discovery = GrpcApp(handlers.methods()[2:])
    async with serving(control) as control_target, serving(discovery) as discovery_target:
        with (
            grpc.insecure_channel(control_target) as control_channel,
            grpc.insecure_channel(discovery_target) as discovery_channel,
        ):
            wrong = pb_grpc.StargateModelDiscoveryStub(control_channel)
            error = await in_thread(
                lambda: _rpc_error(lambda: wrong.ListModels(pb.ListModelsRequest()))
            )
            assert error.code() == grpc.StatusCode.UNIMPLEMENTED
            assert LIST_MODELS in error.details()
            right = pb_grpc.StargateModelDiscoveryStub(discovery_channel)
            assert (
                await in_thread(lambda: right.ListModels(pb.ListModelsRequest()))
            ).model_ids == []
            call = pb_grpc.StargateControlPlaneStub(discovery_channel).WatchStargates(
                pb.WatchStargatesRequest()
            )
            _, error_2 = await in_thread(lambda: _collect(call))
            assert error_2 is not None and error_2.code() == grpc.StatusCode.UNIMPLEMENTED
            assert WATCH in error_2.details()


# --- bad input -----------------------------------------------------------------------------------


async def test_undecodable_bytes_are_internal() -> None:
    async with serving(GrpcApp(Handlers().methods())) as target:
        with grpc.insecure_channel(target) as channel:
            call = channel.unary_unary(
                LIST_MODELS, request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            error = await in_thread(lambda: _rpc_error(lambda: call(b"\x0a\x05ab", timeout=5)))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details().startswith("failed to decode stargate.ListModelsRequest")


async def test_oversized_message_is_resource_exhausted_naming_both_sizes() -> None:
    async with serving(GrpcApp(Handlers().methods(), max_message_bytes=1024)) as target:
        with grpc.insecure_channel(target) as channel:
            call = channel.unary_unary(
                LIST_MODELS, request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            error = await in_thread(lambda: _rpc_error(lambda: call(b"\0" * 2000, timeout=5)))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2000" in error.details() and "1024" in error.details()
            ok = await in_thread(
                lambda: call(pb.ListModelsRequest(model_ids=["a"]).SerializeToString())
            )
            assert pb.ListModelsResponse.FromString(ok).model_ids == ["a"]
        # The prefix alone is enough: the server answers before the 100 MB body (never sent).
        response = await raw_call(
            target, LIST_MODELS, [struct.pack(">BI", 0, 100_000_000)], end_stream=False
        )
    assert _status(response) == GrpcStatus.RESOURCE_EXHAUSTED


async def test_compressed_messages_and_encodings_are_unimplemented() -> None:
    request = pb.ListModelsRequest(model_ids=["a"]).SerializeToString()
    async with serving(GrpcApp(Handlers().methods())) as target:
        response = await raw_call(target, LIST_MODELS, [frame(request, compressed=True)])
        assert _status(response) == GrpcStatus.UNIMPLEMENTED
        assert response.trailers is not None
        assert response.trailers["grpc-message"] == "compressed messages are not supported"
        assert response.headers["grpc-accept-encoding"] == "identity"
        response = await raw_call(
            target, LIST_MODELS, [frame(request)], headers=[("grpc-encoding", "gzip")]
        )
        assert _status(response) == GrpcStatus.UNIMPLEMENTED
        with grpc.insecure_channel(target, compression=grpc.Compression.Gzip) as channel:
            stub = pb_grpc.StargateModelDiscoveryStub(channel)
            error = await in_thread(
                lambda: _rpc_error(lambda: stub.ListModels(pb.ListModelsRequest()))
            )
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_body_ending_inside_a_message_is_internal() -> None:
    async with serving(GrpcApp(Handlers().methods())) as target:
        in_payload = await raw_call(target, LIST_MODELS, [struct.pack(">BI", 0, 10) + b"abc"])
        in_prefix = await raw_call(target, REGISTER, [frame(b""), b"\0\0"])
    assert _status(in_payload) == GrpcStatus.INTERNAL
    assert in_payload.trailers is not None and "truncated" in in_payload.trailers["grpc-message"]
    assert _status(in_prefix) == GrpcStatus.INTERNAL
    assert len(unframe(in_prefix.body)) == 1  # the complete message before it was still handled


async def test_unary_methods_need_exactly_one_request_message() -> None:
    async with serving(GrpcApp(Handlers().methods())) as target:
        with grpc.insecure_channel(target) as channel:
            call = channel.stream_unary(
                LIST_MODELS,
                request_serializer=pb.ListModelsRequest.SerializeToString,
                response_deserializer=pb.ListModelsResponse.FromString,
            )
            none = await in_thread(lambda: _rpc_error(lambda: call(iter([]), timeout=5)))
            two = [pb.ListModelsRequest(), pb.ListModelsRequest()]
            many = await in_thread(lambda: _rpc_error(lambda: call(iter(two), timeout=5)))
    for error in (none, many):
        assert error.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "exactly one request message" in error.details()


async def test_answering_while_the_client_is_still_sending_keeps_the_server_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hypercorn 0.18 crashes on DATA for a stream whose response is complete (hypercorn#329).

    Each request arrives in one write: HEADERS and 20 DATA frames the server has not read yet
    when it answers; the client never half-closes (so the plain responses end after the linger).
    """
    monkeypatch.setattr(grpc_server, "LINGER_SECONDS", 0.1)
    chunks = [frame(b"x" * 1000)] * 20
    app = GrpcApp(Handlers().methods(), max_message_bytes=100)
    async with serving(app) as target:
        for _ in range(3):
            for path, status in (
                ("/no.Such/Method", GrpcStatus.UNIMPLEMENTED),
                (REGISTER, GrpcStatus.RESOURCE_EXHAUSTED),
            ):
                response = await raw_call(target, path, chunks, end_stream=False, one_write=True)
                assert _status(response) == status
        for options, http_status in (
            ({"method": "PUT"}, 405),
            ({"content_type": "application/json"}, 415),
            ({"te": False}, 400),
        ):
            response = await raw_call(
                target, REGISTER, chunks, end_stream=False, one_write=True, **options
            )
            assert response.status == http_status
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.StargateModelDiscoveryStub(channel)
            assert (
                await in_thread(lambda: stub.ListModels(pb.ListModelsRequest()))
            ).model_ids == []


async def test_a_client_that_ignores_the_status_is_closed_after_a_linger(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(grpc_server, "LINGER_SECONDS", 0.2)
    caplog.set_level(logging.WARNING, logger="stargate.grpc_asgi")
    async with serving(GrpcApp(Handlers().methods())) as target:
        async with H2Client.connect(target) as client:
            client.request("/no.Such/Method", [frame(b"")], end_stream=False)
            await client.flush()
            assert _status(await client.read_until_stream_ends()) == GrpcStatus.UNIMPLEMENTED
            with trio.fail_after(3):
                await _wait_until(lambda: "client still sending" in caplog.text)
                await trio.sleep(0.05)
            # The server's HTTP/2 stream is closed now: more DATA gets RST_STREAM, not a crash.
            client.data([frame(b"late")])
            await client.flush()
            await client.read_until_stream_ends()
            assert client.reset
        response = await raw_call(target, LIST_MODELS, [frame(b"")])
    assert _status(response) == GrpcStatus.OK


async def test_hypercorn_survives_an_app_that_answers_before_the_request_body_ends() -> None:
    async def answers_at_once(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await GrpcApp([])(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 413, "headers": []})
        await send({"type": "http.response.body", "body": b"too big"})

    async with serving(answers_at_once) as target:  # type: ignore[arg-type]
        for _ in range(3):
            response = await raw_call(
                target, "/upload", [b"x" * 1000] * 20, end_stream=False, one_write=True
            )
            assert response.status == 413


# --- deadlines -----------------------------------------------------------------------------------


async def test_grpc_timeout_deadline_is_enforced_with_deadline_exceeded_trailers() -> None:
    handlers = Handlers()
    request = frame(pb.ListModelsRequest(model_ids=["hang"]).SerializeToString())
    async with serving(GrpcApp(handlers.methods())) as target:
        start = trio.current_time()
        response = await raw_call(
            target, LIST_MODELS, [request], headers=[("grpc-timeout", "200m")]
        )
        elapsed = trio.current_time() - start
        assert handlers.finished.is_set()
        assert _status(response) == GrpcStatus.DEADLINE_EXCEEDED
        assert 0.2 <= elapsed < 1.0
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.StargateModelDiscoveryStub(channel)
            error = await in_thread(
                lambda: _rpc_error(
                    lambda: stub.ListModels(pb.ListModelsRequest(model_ids=["hang"]), timeout=0.2)
                )
            )
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_malformed_grpc_timeout_is_internal() -> None:
    handlers = Handlers()
    request = frame(pb.ListModelsRequest().SerializeToString())
    async with serving(GrpcApp(handlers.methods())) as target:
        for value in ("abc", "10", "123456789S", "5s", "-1S"):
            response = await raw_call(
                target, LIST_MODELS, [request], headers=[("grpc-timeout", value)]
            )
            assert _status(response) == GrpcStatus.INTERNAL, value
    assert handlers.contexts == []  # the handler never ran


def test_grpc_timeout_units() -> None:
    assert _parse_timeout("2H") == 7200
    assert _parse_timeout("3M") == 180
    assert _parse_timeout("99999999S") == 99999999
    assert _parse_timeout("250m") == pytest.approx(0.25)
    assert _parse_timeout("7u") == pytest.approx(7e-6)
    assert _parse_timeout("0n") == 0
    assert _parse_timeout("1x") is None
    assert _parse_timeout("") is None


def test_grpc_message_percent_encoding() -> None:
    assert _percent_encode("plain text: ok") == b"plain text: ok"
    assert _percent_encode("100%") == b"100%25"
    assert _percent_encode("ü\t") == b"%C3%BC%09"
    assert _percent_encode(" padded ") == b"%20padded%20"


async def test_metadata_joins_repeated_headers() -> None:
    handlers = Handlers()
    headers = [("x-dup", "a"), ("x-dup", "b"), ("X-Upper", "v")]
    async with serving(GrpcApp(handlers.methods())) as target:
        await raw_call(target, LIST_MODELS, [frame(b"")], headers=headers)
    (context,) = handlers.contexts
    assert context.metadata["x-dup"] == "a, b"
    assert context.metadata["x-upper"] == "v"
    assert context.metadata["te"] == "trailers"


# --- the client going away -----------------------------------------------------------------------


async def _open_registration(
    channel: grpc.Channel, handlers: Handlers
) -> tuple[Any, queue.Queue[pb.InferenceServerRegistration | None]]:
    """A bidi call whose handler has acked one registration."""
    outbox: queue.Queue[pb.InferenceServerRegistration | None] = queue.Queue()
    call = pb_grpc.StargateControlPlaneStub(channel).RegisterInferenceServer(iter(outbox.get, None))
    outbox.put(pb.InferenceServerRegistration(inference_server_id="first"))
    assert (await in_thread(lambda: next(call))).reverse_tunnel_target == "first"
    assert handlers.started.is_set() and not handlers.finished.is_set()
    return call, outbox


async def test_call_cancel_runs_the_handlers_finally() -> None:
    handlers = Handlers()
    async with serving(GrpcApp(handlers.methods())) as target:
        with grpc.insecure_channel(target) as channel:
            call, _ = await _open_registration(channel, handlers)
            call.cancel()
            with trio.fail_after(GONE_WITHIN):
                await handlers.finished.wait()


async def test_channel_close_runs_the_handlers_finally() -> None:
    handlers = Handlers()
    async with serving(GrpcApp(handlers.methods())) as target:
        channel = grpc.insecure_channel(target)
        await _open_registration(channel, handlers)
        await in_thread(channel.close)
        with trio.fail_after(GONE_WITHIN):
            await handlers.finished.wait()


CLIENT = """
import queue, sys, time
import grpc
from stargate.protocol import stargate_pb2 as pb, stargate_pb2_grpc as pb_grpc
channel = grpc.insecure_channel(sys.argv[1])
outbox = queue.Queue()
call = pb_grpc.StargateControlPlaneStub(channel).RegisterInferenceServer(iter(outbox.get, None))
outbox.put(pb.InferenceServerRegistration(inference_server_id="doomed"))
print(next(call).reverse_tunnel_target, flush=True)
time.sleep(30)
"""


async def test_client_process_exit_runs_the_handlers_finally() -> None:
    handlers = Handlers()
    async with serving(GrpcApp(handlers.methods())) as target:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-c", CLIENT, target],
            stdout=subprocess.PIPE,
            cwd=Path(__file__).parent.parent,
        )
        try:
            assert process.stdout is not None
            with trio.fail_after(10):
                line = b""
                while not line.endswith(b"\n"):
                    chunk = await process.stdout.receive_some()
                    assert chunk, "the client exited early"
                    line += chunk
            assert line == b"doomed\n"
            assert not handlers.finished.is_set()
        finally:
            process.kill()
            await process.wait()
        with trio.fail_after(GONE_WITHIN):
            await handlers.finished.wait()


async def test_cancel_is_seen_while_the_handler_is_sending() -> None:
    handlers = Handlers()
    async with serving(GrpcApp(handlers.methods(register=handlers.floods))) as target:
        with grpc.insecure_channel(target) as channel:
            call = pb_grpc.StargateControlPlaneStub(channel).RegisterInferenceServer(iter(()))
            with trio.fail_after(5):
                await _wait_until(lambda: handlers.sent >= 100)  # the client reads none
            call.cancel()
            with trio.fail_after(GONE_WITHIN):
                await handlers.finished.wait()


async def test_a_send_loop_yields_so_a_disconnect_can_cancel_it() -> None:
    """Hypercorn's `send` does not checkpoint once the stream is gone; ours must, or a handler
    sending in a loop would spin forever and starve the reader task (found under load)."""
    sends = 0

    async def spin(requests: Any, context: RpcContext, send: Callable[[Any], Any]) -> None:
        nonlocal sends
        while sends < 1000:
            await send(pb.InferenceServerAck())
            sends += 1

    events = [
        {"type": "http.request", "body": b"", "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, Any]:
        if events:
            return events.pop(0)
        await trio.sleep_forever()
        raise AssertionError

    sent: list[dict[str, Any]] = []

    async def send_without_checkpoint(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": REGISTER,
        "headers": [(b"content-type", b"application/grpc"), (b"te", b"trailers")],
        "extensions": {"http.response.trailers": {}},
        "client": ("127.0.0.1", 1234),
    }
    app = GrpcApp([stream_stream(REGISTER, pb.InferenceServerRegistration, spin)])
    with trio.fail_after(2):
        await app(scope, receive, send_without_checkpoint)
    assert sends < 10
    assert all(message["type"] != "http.response.trailers" for message in sent)


async def test_send_blocks_once_a_client_stops_reading() -> None:
    """Fixed in stargate.hypercorn_patches (upstream StreamBuffer.pop released the writer on every
    zero-length pop, so a client that stops reading made the server buffer without bound)."""
    handlers = Handlers()
    async with serving(GrpcApp(handlers.methods(register=handlers.floods))) as target:
        with grpc.insecure_channel(target) as channel:
            call = pb_grpc.StargateControlPlaneStub(channel).RegisterInferenceServer(iter(()))
            try:
                with trio.fail_after(5):
                    last = -1
                    while handlers.sent != last:  # until flow control stops it for 100 ms
                        # grpcio's receive window is about 4 MB: 10 MB of 1 KB acks is too many.
                        assert handlers.sent < 10_000, "send() never blocked"
                        last = handlers.sent
                        await trio.sleep(0.1)
            finally:
                call.cancel()
                with trio.fail_after(GONE_WITHIN):
                    await handlers.finished.wait()


# --- bounded inbound buffering -------------------------------------------------------------------


async def test_cancel_is_seen_while_the_request_buffer_is_full() -> None:
    handlers = Handlers()
    app = GrpcApp(handlers.methods(register=handlers.never_reads))
    async with serving(app) as target:
        with grpc.insecure_channel(target) as channel:
            outbox: queue.Queue[pb.InferenceServerRegistration | None] = queue.Queue()
            call = pb_grpc.StargateControlPlaneStub(channel).RegisterInferenceServer(
                iter(outbox.get, None)
            )
            for index in range(app.max_buffered_messages):
                outbox.put(pb.InferenceServerRegistration(inference_server_id=f"is-{index}"))
            with trio.fail_after(5):
                await handlers.started.wait()
                assert handlers.requests is not None
                buffered = handlers.requests._channel.statistics
                await _wait_until(lambda: buffered().current_buffer_used == 16)
            call.cancel()
            with trio.fail_after(GONE_WITHIN):
                await handlers.finished.wait()


async def test_a_client_too_far_ahead_of_the_handler_gets_resource_exhausted() -> None:
    handlers = Handlers()
    app = GrpcApp(handlers.methods(register=handlers.never_reads), max_buffered_messages=4)
    registrations = [pb.InferenceServerRegistration(inference_server_id="x")] * 40
    async with serving(app) as target:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.StargateControlPlaneStub(channel)
            call = stub.RegisterInferenceServer(iter(registrations), timeout=5)
            responses, error = await in_thread(lambda: _collect(call))
    assert responses == []
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4 request messages" in error.details()
    assert handlers.finished.is_set()
