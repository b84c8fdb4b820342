"""The raw-quic exchange: one request and its answer on one fresh bidirectional stream.

docs/tunnels.md, "Raw QUIC". Both halves, written against `TunnelStream` alone:

* the replica's `send_request`: a `headers` message (`x-method`, `x-path`, then the forwarded
  headers), the body as `body` messages, FIN; then the answer's head, whose `x-status` is the HTTP
  status (missing or not a status: a 502 passed on as the backend's answer, as Rust does), and a
  `TunnelResponse` that streams the `body` messages until FIN or a `trailers` message;
* the Pylon's `TunnelRequestReader` / `TunnelSink`: the request head (a missing or invalid
  `x-method` or `x-path` resets the stream, no answer), the whole body on demand, and the answer
  written back as a head with `x-status` appended last, one `body` message per chunk, FIN.

The replica's body is whole before the attempt (the replay buffer), so it is written before the
head is awaited rather than raced with it: a Pylon that answers early (a 400 on the headers) and
stops reading makes the write fail with `StreamClosed`, and the answer is then read all the same.
One deadline covers writing and the head (the Rust `--quic-request-timeout-ms` budget).
"""

from __future__ import annotations

import logging

import trio

from stargate.asgi import BodyTooLarge
from stargate.http_headers import Headers
from stargate.tunnel.codec import (
    TOKEN_CHARS,
    BodyMessage,
    HeadersMessage,
    MessageReader,
    RecvGrammar,
    TunnelMessage,
    TunnelProtocolError,
    decode_message,
    encode_body,
    encode_headers,
)
from stargate.tunnel.response import StreamedResponse
from stargate.tunnel.stream import StreamClosed, StreamReset, TunnelStream
from stargate.upstream import ResponseHeadTimeout, UpstreamProtocolError

__all__ = [
    "BODY_MESSAGE_BYTES",
    "BadTunnelRequest",
    "TunnelRequestHead",
    "TunnelRequestReader",
    "TunnelResponse",
    "TunnelSink",
    "send_request",
]

log = logging.getLogger("stargate.tunnel")

BODY_MESSAGE_BYTES = 64 * 1024
"""A request body is written in `body` messages of at most this size (any split is valid)."""


class _MessageSource:
    """The messages of one receiving direction, checked against the grammar."""

    __slots__ = ("_grammar", "_reader", "_stream")

    def __init__(self, stream: TunnelStream) -> None:
        self._stream = stream
        self._reader = MessageReader()
        self._grammar = RecvGrammar()

    async def next(self) -> TunnelMessage | None:
        """The next message, or None at a clean FIN. TunnelProtocolError on a malformed or
        out-of-order message, StreamReset when the peer reset the stream."""
        while True:
            raw = self._reader.next_message()
            if raw is not None:
                message = decode_message(raw)
                self._grammar.on_message(message)
                return message
            data = await self._stream.receive()
            if not data:
                self._reader.end()
                self._grammar.on_eof()
                return None
            self._reader.feed(data)


def _status(head: Headers) -> tuple[int, Headers]:
    """The `x-status` of an answer head and the head without it; a missing, invalid or
    out-of-range status is a 502 (the Rust replica's rule: passed on, never retried as a
    transport failure)."""
    status: int | None = None
    rest: Headers = []
    for name, value in head:
        if name == b"x-status":
            if status is None:
                status = _parse_status(value)
            continue
        rest.append((name, value))
    if not status:
        log.warning("raw QUIC tunnel response missing or invalid x-status header")
        return 502, rest
    return status, rest


def _parse_status(value: bytes) -> int:
    """The status, or 0 when `value` is not one."""
    if not value.isdigit() or len(value) > 5:
        return 0
    status = int(value)
    return status if 100 <= status <= 999 else 0


async def send_request(
    stream: TunnelStream,
    method: str,
    path_and_query: bytes,
    headers: Headers,
    body: bytes | bytearray,
    deadline: float,
) -> TunnelResponse:
    """Send one request on `stream` and return once the answer's head has arrived.

    `deadline` (trio time) bounds writing and the head together; past it ResponseHeadTimeout.
    A reset or a malformed answer before the head is an UpstreamProtocolError. On any failure,
    cancellation included, the stream is reset and stopped. The returned response owns the
    stream: close it (`async with`)."""
    sent = False
    try:
        with trio.move_on_at(deadline) as scope:
            try:
                await stream.send(
                    encode_headers(
                        [(b"x-method", method.encode()), (b"x-path", path_and_query), *headers]
                    ),
                    end=not body,
                )
                view = memoryview(body)
                for start in range(0, len(view), BODY_MESSAGE_BYTES):
                    chunk = view[start : start + BODY_MESSAGE_BYTES]
                    last = start + BODY_MESSAGE_BYTES >= len(view)
                    await stream.send(encode_body(chunk), end=last)
                sent = True
            except StreamClosed:
                pass  # the Pylon answered early and stopped reading: its answer says why
            source = _MessageSource(stream)
            head = await source.next()
        if scope.cancelled_caught:
            raise ResponseHeadTimeout("quic request timed out", request_sent=sent)
        if head is None:
            raise UpstreamProtocolError(
                "tunnel stream ended before the response head", request_sent=sent
            )
        assert isinstance(head, HeadersMessage)  # the grammar's first message
        status, rest = _status(head.entries)
        return TunnelResponse(stream, source, status, rest)
    except (StreamReset, TunnelProtocolError) as error:
        _abandon(stream)
        raise UpstreamProtocolError(
            f"tunnel stream failed before the response head: {error}", request_sent=sent
        ) from error
    except BaseException:
        _abandon(stream)
        raise


def _abandon(stream: TunnelStream) -> None:
    stream.reset(0)
    stream.stop(0)


class TunnelResponse(StreamedResponse):
    """An answer whose head has arrived over a raw-quic stream (a `BackendResponse`): the body
    is its `body` messages, until FIN or a `trailers` message."""

    __slots__ = ("_source", "_stream")

    def __init__(
        self, stream: TunnelStream, source: _MessageSource, status: int, headers: Headers
    ) -> None:
        super().__init__(status, headers)
        self._stream = stream
        self._source = source

    async def _read(self) -> bytes | None:
        try:
            while True:
                message = await self._source.next()
                if message is None or isinstance(message, HeadersMessage):  # FIN or trailers
                    self._stream.stop(0)  # nothing after trailers is read
                    return None
                assert isinstance(message, BodyMessage)
                if message.data:
                    return message.data
        except (StreamReset, TunnelProtocolError) as error:
            raise UpstreamProtocolError(
                f"tunnel response body failed: {error}", request_sent=True
            ) from error

    def _abandon(self) -> None:
        _abandon(self._stream)


# ----------------------------------------------------------------------------- the Pylon's side


class TunnelRequestHead:
    """A request head as the Pylon reads it: method, path, query and the other headers."""

    __slots__ = ("headers", "method", "path", "query")

    def __init__(self, method: str, path: str, query: bytes, headers: Headers) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers


class BadTunnelRequest(Exception):
    """A request head without a valid `x-method` or `x-path`: the stream is reset, unanswered."""


class TunnelRequestReader:
    """The Pylon's reading side of one raw-quic stream."""

    __slots__ = ("_source",)

    def __init__(self, stream: TunnelStream) -> None:
        self._source = _MessageSource(stream)

    async def head(self) -> TunnelRequestHead | None:
        """The request head; None if the stream ended before one (nothing to answer).
        BadTunnelRequest for a missing or invalid `x-method`/`x-path`."""
        message = await self._source.next()
        if message is None:
            return None
        assert isinstance(message, HeadersMessage)
        method: bytes | None = None
        target: bytes | None = None
        headers: Headers = []
        for name, value in message.entries:
            if name == b"x-method":
                method = value if method is None else method
            elif name == b"x-path":
                target = value if target is None else target
            else:
                headers.append((name, value))
        if method is None:
            raise BadTunnelRequest("missing required x-method header")
        if not method or not set(method) <= TOKEN_CHARS:
            raise BadTunnelRequest("invalid x-method header")
        if target is None:
            raise BadTunnelRequest("missing required x-path header")
        path, _, query = target.partition(b"?")
        return TunnelRequestHead(
            method.decode("ascii"), path.decode("latin-1") or "/", query, headers
        )

    async def body(self, limit: int) -> bytes:
        """The whole body (until FIN or a `trailers` message, which is ignored); BodyTooLarge
        past `limit`."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._source.next()
            if message is None or isinstance(message, HeadersMessage):
                return b"".join(chunks)
            assert isinstance(message, BodyMessage)
            size += len(message.data)
            if size > limit:
                raise BodyTooLarge
            chunks.append(message.data)


class TunnelSink:
    """The Pylon's answer on a raw-quic stream: `x-status` appended last to the head, one `body`
    message per chunk, FIN with the last one. A `ResponseSink` of `stargate/pylon/hop.py`."""

    __slots__ = ("_stream", "finished", "started")

    def __init__(self, stream: TunnelStream) -> None:
        self._stream = stream
        self.started = False
        self.finished = False

    async def start(self, status: int, headers: Headers, *, body_follows: bool) -> None:
        del body_follows  # the head is one message either way
        self.started = True
        await self._stream.send(encode_headers([*headers, (b"x-status", str(status).encode())]))

    async def send(self, data: bytes, *, more: bool) -> None:
        if not more:
            self.finished = True
        if data:
            await self._stream.send(encode_body(data), end=not more)
        elif not more:
            await self._stream.send(b"", end=True)
