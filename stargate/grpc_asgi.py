"""A small gRPC server: a raw ASGI app served over HTTP/2, on the trio loop.

The replica serves it with its lean HTTP/2 server (stargate/h2_server.py, docs/decisions.md D20);
it runs on Hypercorn too, and the rules below that name Hypercorn were written for its quirks
(they cost nothing on the lean server, which has none of them).

Why not a gRPC library (docs/decisions.md, D4): purerpc never notices a client that
goes away, grpcio's server needs threads and a second event loop, and grpclib needs asyncio. Owning
the ~200 lines of gRPC-over-HTTP/2 framing keeps registrations on the one trio loop, where a
disconnect is an ordinary `http.disconnect` and the handler's `finally` blocks run.

What this server speaks:

* Requests: HTTP/2 `POST` with `content-type: application/grpc` (or `application/grpc+proto`) and
  `te: trailers`. A non-POST gets a plain HTTP 405, another content type a plain 415, HTTP/1.x a
  plain 505 and a missing `te: trailers` a plain 400: none of these could carry gRPC trailers.
* Responses: always `200` headers, then zero or more length-prefixed messages, then the
  `grpc-status` / `grpc-message` trailers. Never the ASGI "trailers-only" shortcut: grpcio then
  reports UNKNOWN whatever the status (docs/decisions.md, H5).
* No compression (`grpc-accept-encoding: identity`); a compressed message or a non-identity
  `grpc-encoding` fails the call with UNIMPLEMENTED, as the gRPC spec asks.
* `grpc-timeout` becomes `RpcContext.deadline` and a trio cancel scope; a malformed value fails the
  call with INTERNAL (what grpc-go does) rather than silently running without a deadline.
* A unary method whose request does not hold exactly one message fails with UNIMPLEMENTED: the
  gRPC status-code table lists "request cardinality violation" under UNIMPLEMENTED.

Bad input (a compressed, oversized, truncated or undecodable message) stops the decoding of that
request: a streaming handler first gets the messages decoded before it, then
`RequestStream.receive()` raises the `GrpcError`; for unary methods that error is the call's status.

Inbound flow control: Hypercorn acknowledges HTTP/2 DATA (WINDOW_UPDATE) as soon as it has queued
the chunk for the app, and it queues at most `max_app_queue_size` (10) events per request; when that
queue is full, its single per-connection read loop blocks, so every stream on the connection stalls
and neither a `RST_STREAM` nor the socket closing can be seen. So each call runs a reader task that
always drains ASGI `receive()`. It hands decoded messages to the handler through a buffer of at
most `max_buffered_messages` (16); a client that gets further ahead than that fails its call with
RESOURCE_EXHAUSTED instead of stalling the connection. Memory per call is therefore bounded by about
`max_buffered_messages * max_message_bytes`.

Ending a call: the status trailers are sent with `more_trailers` and the HTTP/2 stream is only
completed once the client has half-closed or reset it (see `_Call._finish`), because Hypercorn 0.18
takes the whole server down when DATA arrives for a stream whose response is complete.

Outbound flow control: none to speak of. Hypercorn 0.18 keeps accepting response data for a client
that has stopped reading (its HTTP/2 send buffer is only bounded while the peer's window is open),
so a handler's `send()` does not block on a stuck client; handlers that stream should bound what
they send to one (for example by sending only the latest state).
"""

from __future__ import annotations

import enum
import logging
import math
import re
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import trio
from google.protobuf.message import DecodeError, Message

from stargate.asgi import answer_lifespan
from stargate.h2_server import DELIVER_EXTENSION

__all__ = [
    "GrpcApp",
    "GrpcError",
    "GrpcMethod",
    "GrpcStatus",
    "RequestStream",
    "RpcContext",
    "stream_stream",
    "unary_stream",
    "unary_unary",
]

log = logging.getLogger(__name__)

T = TypeVar("T", bound=Message)
Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)

ASGIMessage = dict[str, Any]
ASGIReceive = Callable[[], Awaitable[ASGIMessage]]
ASGISend = Callable[[ASGIMessage], Awaitable[None]]

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""grpcio's default maximum receive size, so both ends agree on what is too big."""

DEFAULT_MAX_BUFFERED_MESSAGES = 16
"""Decoded request messages the reader task may hold for a handler that has not read them yet."""

LINGER_SECONDS = 5.0
"""How long a finished call waits for the client to half-close or reset before closing anyway."""

QUIET_SECONDS = 0.1
"""After that, how long the client must have sent nothing before the stream is closed anyway."""

_PREFIX = struct.Struct(">BI")  # compressed flag, message length
_TIMEOUT_RE = re.compile(r"([0-9]{1,8})([HMSmun])")
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_CONTENT_TYPE_RE = re.compile(r"application/grpc(\+proto)?(;.*)?", re.IGNORECASE)
_RESPONSE_HEADERS = [
    (b"content-type", b"application/grpc"),
    (b"grpc-accept-encoding", b"identity"),
]


class GrpcStatus(enum.IntEnum):
    """The standard gRPC status codes; the value is what goes on the wire in `grpc-status`."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class GrpcError(Exception):
    """Raise from a handler to end the call with this status and message (sent as trailers).

    `RequestStream.receive()` also raises it for input the server cannot accept, so a handler that
    does not catch it fails the call with the right status.
    """

    def __init__(self, status: GrpcStatus, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RpcContext:
    """What a handler may want to know about its call, beyond the request messages.

    `metadata` holds the request headers with lower-case names (pseudo-headers excluded; repeated
    names joined with ", "). `deadline` is on the trio clock, from `grpc-timeout`; the handler
    already runs inside a cancel scope with that deadline. `peer` is the client's "ip:port", or ""
    if the server does not know it.
    """

    method: str
    metadata: Mapping[str, str]
    deadline: float | None
    peer: str


class RequestStream(Generic[T]):
    """The request messages of a client-streaming call, in order, as the reader task decodes them.

    The handler reads at its own pace; the reader holds at most `max_buffered_messages` decoded
    messages for it (see the module docstring for what happens beyond that).
    """

    def __init__(self, channel: trio.MemoryReceiveChannel[T]) -> None:
        self._channel = channel
        # Set by the reader task before it closes the channel: the input error that ended the
        # request, raised once the messages decoded before it have been read.
        self._error: GrpcError | None = None

    async def receive(self) -> T | None:
        """Wait for the next message; None once the client has half-closed its side.

        Raises `GrpcError` when the client's input was bad (compressed, too big, truncated or
        undecodable), after every message decoded before the bad one has been returned.
        """
        try:
            return await self._channel.receive()
        except trio.EndOfChannel:
            if self._error is not None:
                raise self._error from None
            return None

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        message = await self.receive()
        if message is None:
            raise StopAsyncIteration
        return message


@dataclass(frozen=True)
class GrpcMethod:
    """One entry of a `GrpcApp`'s method table: which handler answers `path`, and how it is called.

    Build it with `unary_unary`, `unary_stream` or `stream_stream`, which type-check the handler.
    """

    path: str
    kind: Literal["unary_unary", "unary_stream", "stream_stream"]
    request_type: type[Message]
    handler: Callable[..., Awaitable[Any]]


def unary_unary(
    path: str,
    request_type: type[Req],
    handler: Callable[[Req, RpcContext], Awaitable[Message]],
) -> GrpcMethod:
    """A method taking one request and returning one response (its return value)."""
    return GrpcMethod(path, "unary_unary", request_type, handler)


def unary_stream(
    path: str,
    request_type: type[Req],
    handler: Callable[[Req, RpcContext, Callable[[Resp], Awaitable[None]]], Awaitable[None]],
) -> GrpcMethod:
    """A method taking one request and sending any number of responses with `send`."""
    return GrpcMethod(path, "unary_stream", request_type, handler)


def stream_stream(
    path: str,
    request_type: type[Req],
    handler: Callable[
        [RequestStream[Req], RpcContext, Callable[[Resp], Awaitable[None]]], Awaitable[None]
    ],
) -> GrpcMethod:
    """A bidirectional-streaming method: reads a `RequestStream`, sends responses with `send`."""
    return GrpcMethod(path, "stream_stream", request_type, handler)


class GrpcApp:
    """An ASGI app answering the gRPC methods it was given, and only those.

    Serve one per port (for example the control plane on one and model discovery on another): any
    other method path gets UNIMPLEMENTED. `max_message_bytes` bounds one request message;
    `max_buffered_messages` bounds the decoded messages waiting for a handler that has not read
    them yet.
    """

    def __init__(
        self,
        methods: Iterable[GrpcMethod],
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_buffered_messages: int = DEFAULT_MAX_BUFFERED_MESSAGES,
    ) -> None:
        if max_message_bytes < 0:
            raise ValueError("max_message_bytes must not be negative")
        if max_buffered_messages < 1:
            raise ValueError("max_buffered_messages must be at least 1")
        self._methods: dict[str, GrpcMethod] = {}
        for method in methods:
            if method.path in self._methods:
                raise ValueError(f"duplicate gRPC method {method.path}")
            self._methods[method.path] = method
        self.max_message_bytes = max_message_bytes
        self.max_buffered_messages = max_buffered_messages

    @property
    def methods(self) -> Mapping[str, GrpcMethod]:
        """The method table, by path."""
        return self._methods

    async def __call__(
        self, scope: Mapping[str, Any], receive: ASGIReceive, send: ASGISend
    ) -> None:
        """Answer one ASGI scope: lifespan, a plain HTTP refusal, or one gRPC call.

        Every task a call needs lives in a nursery opened here, so when this returns the call is
        over and nothing of it keeps running.
        """
        if scope["type"] == "lifespan":
            # Hypercorn-trio crashes at startup on an app that ignores lifespan
            # (docs/decisions.md, H4).
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            # An HTTP/2 extended CONNECT arrives as a websocket scope: refuse it (403).
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["method"] != "POST":
            await _plain_response(receive, send, 405, "gRPC requires POST\n", [(b"allow", b"POST")])
            return
        content_type = _header(scope, b"content-type") or ""
        if not _CONTENT_TYPE_RE.fullmatch(content_type):
            await _plain_response(receive, send, 415, "content-type must be application/grpc\n")
            return
        if "http.response.trailers" not in scope.get("extensions", {}):
            await _plain_response(receive, send, 505, "gRPC requires HTTP/2\n")
            return
        if (b"te", b"trailers") not in scope["headers"]:
            # Hypercorn sends trailers only to a request carrying exactly this header
            # (docs/decisions.md, H5), and a gRPC status without trailers is no status at all.
            await _plain_response(receive, send, 400, "gRPC requires the header te: trailers\n")
            return
        await _Call(self, scope, receive, send).run()


class _Call:
    """One RPC: a reader feeding the handler, the handler, and the trailers.

    The reader is a task of the call draining `receive()`, or, on a server offering
    `DELIVER_EXTENSION` (stargate/h2_server.py), the server's own task calling `_take`.

    Two cancel scopes: `handler_scope` ends the handler but the call still sends its trailers
    (deadline, or the client getting too far ahead); `call_scope` ends everything with nothing more
    sent (the client went away).
    """

    def __init__(
        self, app: GrpcApp, scope: Mapping[str, Any], receive: ASGIReceive, send: ASGISend
    ) -> None:
        self._receive = receive
        self._send = send
        path: str = scope["path"]
        self.method = app.methods.get(path)
        self.max_message_bytes = app.max_message_bytes
        self.buffer_size = app.max_buffered_messages
        self.deframer = (
            _Deframer(self.method.request_type, self.max_message_bytes)
            if self.method is not None
            else None
        )
        offered = scope.get("extensions", {}).get(DELIVER_EXTENSION)
        self.deliver: Callable[[Callable[[ASGIMessage], bool]], None] | None = (
            offered["deliver"] if offered is not None else None
        )
        metadata = _metadata(scope["headers"])
        deadline: float | None = None
        # An error known before the handler runs; the request body is then not even decoded.
        self.early_error: GrpcError | None = None
        if self.method is None:
            self.early_error = GrpcError(GrpcStatus.UNIMPLEMENTED, f"unknown method {path}")
        elif metadata.get("grpc-encoding", "identity") != "identity":
            self.early_error = GrpcError(
                GrpcStatus.UNIMPLEMENTED,
                f"grpc-encoding {metadata['grpc-encoding']} is not supported"
                " (compressed messages are not supported)",
            )
        elif "grpc-timeout" in metadata:
            timeout = _parse_timeout(metadata["grpc-timeout"])
            if timeout is None:
                self.early_error = GrpcError(
                    GrpcStatus.INTERNAL, f"malformed grpc-timeout {metadata['grpc-timeout']!r}"
                )
            else:
                deadline = trio.current_time() + timeout
        self.context = RpcContext(path, metadata, deadline, _peer(scope.get("client")))
        send_channel, receive_channel = trio.open_memory_channel[Message](self.buffer_size)
        self.inbox = send_channel
        self.requests: RequestStream[Message] = RequestStream(receive_channel)
        self.handler_scope = trio.CancelScope(deadline=math.inf if deadline is None else deadline)
        self.call_scope = trio.CancelScope()
        self.failure: GrpcError | None = None
        self.decoding = self.early_error is None
        self.finished = False
        # Set once the client has half-closed or gone: no more DATA can arrive for this stream.
        self.request_ended = trio.Event()
        self.last_request_event = trio.current_time()

    async def run(self) -> None:
        """Headers, the handler, the status trailers; the reader task runs alongside throughout."""
        async with trio.open_nursery() as nursery:
            if self.deliver is not None:
                self.deliver(self._take)
            else:
                nursery.start_soon(self._read_requests)
            try:
                with self.call_scope:
                    await self._send(
                        {
                            "type": "http.response.start",
                            "status": 200,
                            "headers": _RESPONSE_HEADERS,
                            "trailers": True,
                        }
                    )
                    status, message = await self._invoke()
                    self.finished = True
                    await self._finish(status, message)
            except Exception:
                # Handler errors are trailers already; this is one mixed with the cancellation of
                # a client that went away, or a failure to send. Nothing more can be sent, but the
                # error must not vanish (Hypercorn would log it without saying which method).
                log.exception("gRPC call %s failed", self.path)
            finally:
                self.finished = True
                nursery.cancel_scope.cancel()

    @property
    def path(self) -> str:
        return self.context.method

    async def _finish(self, status: GrpcStatus, message: str) -> None:
        """Send the status, then close the HTTP/2 stream only once the client has stopped sending.

        Hypercorn 0.18 forgets a stream as soon as its response is complete, and a DATA frame that
        then arrives for it raises KeyError in the connection task, which takes the whole server
        down (pgjones/hypercorn#329). A server that ends a call while the client is still sending
        (an error mid-stream, a client too far ahead, an unknown method with a body) hits that
        race. So the trailers go out with `more_trailers` (the client sees END_STREAM and the
        status; Hypercorn keeps the stream), the reader keeps draining the request, and the stream
        is completed after the client half-closes or resets it, which gRPC clients do at once.
        """
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        await self._send(
            {
                "type": "http.response.trailers",
                "headers": _trailers(status, message),
                "more_trailers": True,
            }
        )
        with trio.move_on_after(LINGER_SECONDS):
            await self.request_ended.wait()
        if not self.request_ended.is_set():
            log.warning(
                "gRPC call %s: client still sending %s s after the status; closing once it pauses",
                self.path,
                LINGER_SECONDS,
            )
            # Not while Hypercorn may be part-way through handing this stream a batch of frames.
            while True:
                quiet_from = self.last_request_event + QUIET_SECONDS
                if trio.current_time() >= quiet_from:
                    break
                await trio.sleep_until(quiet_from)
        await self._send({"type": "http.response.trailers", "headers": [], "more_trailers": False})

    async def _invoke(self) -> tuple[GrpcStatus, str]:
        """Run the handler under the deadline and map how it ended to a status."""
        try:
            with self.handler_scope:
                await self._dispatch()
        except Exception as error:
            grpc_error = _as_grpc_error(error)
            if grpc_error is not None:
                outcome = (grpc_error.status, grpc_error.message)
            else:
                log.exception("gRPC handler for %s raised", self.path)
                outcome = (GrpcStatus.UNKNOWN, "unexpected server error")
        else:
            outcome = (GrpcStatus.OK, "")
        self.decoding = False
        if self.failure is not None:
            return self.failure.status, self.failure.message
        if self.handler_scope.cancelled_caught:
            return GrpcStatus.DEADLINE_EXCEEDED, "deadline exceeded"
        return outcome

    async def _dispatch(self) -> None:
        """Call the handler the way its kind expects, reading unary requests for it."""
        if self.early_error is not None:
            raise self.early_error
        method = self.method
        assert method is not None
        if method.kind == "stream_stream":
            await method.handler(self.requests, self.context, self._send_message)
            return
        request = await self._read_single_request()
        if method.kind == "unary_stream":
            await method.handler(request, self.context, self._send_message)
            return
        response = await method.handler(request, self.context)
        if not isinstance(response, Message):
            raise TypeError(f"unary handler returned {type(response).__name__}, not a message")
        await self._send_message(response)

    async def _read_single_request(self) -> Message:
        """The one request message of a unary method, after the client has half-closed."""
        request = await self.requests.receive()
        if request is None:
            raise GrpcError(
                GrpcStatus.UNIMPLEMENTED, f"{self.path} expects exactly one request message, got 0"
            )
        if await self.requests.receive() is not None:
            raise GrpcError(
                GrpcStatus.UNIMPLEMENTED,
                f"{self.path} expects exactly one request message, got more than one",
            )
        return request

    async def _send_message(self, message: Message) -> None:
        """The `send` given to streaming handlers: one length-prefixed message.

        It always yields to the scheduler first: Hypercorn's `send` returns without a checkpoint
        once the stream is gone, so a handler sending in a loop would otherwise spin forever, and
        starve the reader task that would cancel it, after its client went away.
        """
        await trio.lowlevel.checkpoint()
        if self.finished:
            raise RuntimeError(f"the gRPC call {self.path} has already ended")
        data = message.SerializeToString()
        await self._send(
            {
                "type": "http.response.body",
                "body": _PREFIX.pack(0, len(data)) + data,
                "more_body": True,
            }
        )

    async def _read_requests(self) -> None:
        """Drain ASGI `receive()` for the whole call, so a disconnect is seen promptly.

        It never blocks on the handler: decoded messages go into a bounded buffer, and a handler
        that falls further behind fails the call (RESOURCE_EXHAUSTED). After the request body has
        ended (or failed) it keeps waiting, only for `http.disconnect`.
        """
        while not self._take(await self._receive()):
            pass

    def _take(self, event: ASGIMessage) -> bool:
        """Apply one request event (see `_read_requests`); True after the disconnect, the last.

        Also the callback of a server offering `DELIVER_EXTENSION`, which calls it from its own
        task as each event arrives, instead of a reader task of ours waking for it. It never
        blocks.
        """
        kind = event["type"]
        if kind == "http.disconnect":
            self.request_ended.set()
            self.call_scope.cancel()
            return True
        if kind != "http.request":
            return False
        self.last_request_event = trio.current_time()
        more_body = event.get("more_body", False)
        if not more_body:
            self.request_ended.set()
        deframer = self.deframer
        if not self.decoding or deframer is None:
            return False
        messages: list[Message] = []
        error: GrpcError | None = None
        try:
            deframer.feed(event.get("body", b""), messages)
            if not more_body:
                deframer.finish()
        except GrpcError as raised:
            error = raised
        for message in messages:
            try:
                self.inbox.send_nowait(message)
            except trio.WouldBlock:
                self._fail(
                    GrpcError(
                        GrpcStatus.RESOURCE_EXHAUSTED,
                        f"the server is more than {self.buffer_size} request messages behind"
                        " the client",
                    )
                )
                break
        if error is not None:
            self.requests._error = error
        if error is not None or not more_body or not self.decoding:
            self.decoding = False
            self.inbox.close()
        return False

    def _fail(self, error: GrpcError) -> None:
        """End the handler now; the call's trailers carry `error`."""
        if self.failure is None:
            self.failure = error
        self.decoding = False
        self.handler_scope.cancel()


class _Deframer:
    """Splits a request body into gRPC messages, whatever the chunk boundaries are.

    Each message is a 5-byte prefix (compressed flag, big-endian length) and the protobuf bytes.
    The length is checked as soon as the prefix is complete, before any of the body is buffered.
    """

    def __init__(self, message_type: type[Message], max_message_bytes: int) -> None:
        self._type = message_type
        self._max = max_message_bytes
        self._buffer = bytearray()
        self._length: int | None = None  # of the message being buffered, once its prefix is read

    def feed(self, data: bytes, out: list[Message]) -> None:
        """Append every message `data` completes to `out`; raise `GrpcError` on bad input."""
        buffer = self._buffer
        buffer += data
        position = 0
        try:
            while True:
                if self._length is None:
                    if len(buffer) - position < _PREFIX.size:
                        return
                    flag, length = _PREFIX.unpack_from(buffer, position)
                    if flag == 1:
                        raise GrpcError(
                            GrpcStatus.UNIMPLEMENTED, "compressed messages are not supported"
                        )
                    if flag != 0:
                        raise GrpcError(GrpcStatus.INTERNAL, f"invalid message flags 0x{flag:02x}")
                    if length > self._max:
                        raise GrpcError(
                            GrpcStatus.RESOURCE_EXHAUSTED,
                            f"received message of {length} bytes exceeds the limit of"
                            f" {self._max} bytes",
                        )
                    position += _PREFIX.size
                    self._length = length
                if len(buffer) - position < self._length:
                    return
                payload = bytes(buffer[position : position + self._length])
                position += self._length
                self._length = None
                out.append(self._decode(payload))
        finally:
            del buffer[:position]

    def finish(self) -> None:
        """The body has ended: it must not end inside a message."""
        if self._length is not None or self._buffer:
            have = len(self._buffer)
            want = f"{self._length} bytes" if self._length is not None else "a 5-byte prefix"
            raise GrpcError(
                GrpcStatus.INTERNAL,
                f"truncated message: the request ended after {have} bytes of {want}",
            )

    def _decode(self, payload: bytes) -> Message:
        message = self._type()
        try:
            message.ParseFromString(payload)
        except (DecodeError, ValueError, RuntimeError) as error:
            name = self._type.DESCRIPTOR.full_name
            raise GrpcError(GrpcStatus.INTERNAL, f"failed to decode {name}: {error}") from None
        return message


async def _plain_response(
    receive: ASGIReceive,
    send: ASGISend,
    status: int,
    text: str,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """A plain HTTP response, for requests that are not gRPC at all (so no trailers).

    The response is completed only after the request body has (see `_Call._finish` for why).
    """
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": True})
    if await _drain_request(receive):
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _drain_request(receive: ASGIReceive) -> bool:
    """Read and drop the rest of a request body; False if the client went away meanwhile.

    Returns when the body ends or, after `LINGER_SECONDS`, once the client has sent nothing for
    `QUIET_SECONDS`.
    """
    linger_until = trio.current_time() + LINGER_SECONDS
    deadline = linger_until
    while True:
        with trio.move_on_at(deadline) as timer:
            event = await receive()
        if timer.cancelled_caught:
            log.warning("client still sending %s s after the response; closing", LINGER_SECONDS)
            return True
        if event["type"] == "http.disconnect":
            return False
        if event["type"] == "http.request":
            if not event.get("more_body", False):
                return True
            deadline = max(linger_until, trio.current_time() + QUIET_SECONDS)


def _header(scope: Mapping[str, Any], name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def _metadata(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    metadata: dict[str, str] = {}
    for raw_name, raw_value in headers:
        name = bytes(raw_name).decode("latin-1").lower()
        if name.startswith(":"):
            continue
        value = bytes(raw_value).decode("latin-1")
        metadata[name] = f"{metadata[name]}, {value}" if name in metadata else value
    return metadata


def _peer(client: Any) -> str:
    if not client:
        return ""
    host, port = client[0], client[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def _parse_timeout(value: str) -> float | None:
    """Seconds from a `grpc-timeout` value (1 to 8 digits and a unit), or None if malformed."""
    match = _TIMEOUT_RE.fullmatch(value.strip())
    if match is None:
        return None
    return int(match[1]) * _TIMEOUT_UNITS[match[2]]


def _percent_encode(text: str) -> bytes:
    """`grpc-message` encoding: UTF-8, with bytes outside printable ASCII and '%' as %XX.

    A space at either end is encoded too, because header values are stripped on the way out.
    """
    encoded = bytearray()
    raw = text.encode("utf-8")
    last = len(raw) - 1
    for index, byte in enumerate(raw):
        printable = 0x20 <= byte <= 0x7E and byte != 0x25
        if printable and not (byte == 0x20 and index in (0, last)):
            encoded.append(byte)
        else:
            encoded += b"%%%02X" % byte
    return bytes(encoded)


def _trailers(status: GrpcStatus, message: str) -> list[tuple[bytes, bytes]]:
    trailers = [(b"grpc-status", str(int(status)).encode())]
    if message:
        trailers.append((b"grpc-message", _percent_encode(message)))
    return trailers


def _as_grpc_error(error: BaseException) -> GrpcError | None:
    """The `GrpcError` a handler raised, also when its own nursery wrapped it in a group."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error if isinstance(error, GrpcError) else None
