"""One keep-alive HTTP/1.1 connection to a backend (a trio stream plus its h11 state machine) and
the exchange of one request on it: framing and sending the request, receiving the response head,
and `UpstreamResponse`, which reads the body and then hands the connection back.

What the pool around it decides (which connection, how many, how long they idle) is in
`connection_pool.py`; this file knows nothing of it. A response gives its connection back through
the `release` callback the connection was created with, called exactly once, with
`reusable=True` only after a complete, unbroken body (as httpcore's response stream closes
through its connection).

* **Bytes in, bytes out.** No cookie jar (a shared httpx client leaks `Set-Cookie` between its
  users), no redirects, no decompression, no proxy settings from the environment: the proxy
  forwards exactly what the backend sent (docs/decisions.md, D10).
* **Framing is ours** (h11 adds neither header): `host` and `content-length` are set by
  `build_request`, replacing any the caller passed, and the body is always sent with
  `content-length` (never chunked).
* **Head timeout** (docs/data-plane.md, Timeouts): from the first request byte until the response
  head; the body has none, since it may stream for as long as the backend generates tokens.
* **Streaming** (docs/data-plane.md, Streaming): `UpstreamResponse.aiter_bytes()` yields data as
  it arrives; data that is already buffered when the consumer asks is joined into one chunk, which
  saves downstream sends without ever waiting for more.
* **Cancellation** (docs/data-plane.md, Cancellation): a cancelled request or body read leaves
  the connection mid-message, so it is released as not reusable (closed); only a complete,
  reusable response returns it to the pool.
* **Stale connections**: a reused connection that is closed or reset before any byte of the
  response arrived raises the internal `_DeadBeforeResponse`, on which the pool retries once on a
  fresh connection (the reasoning is at `ConnectionPool.request`).

Closing is the pool's job (it counts open connections): after a failed `exchange` the caller
closes the connection, and a response closes it by releasing it as not reusable.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Final, Self, TypeAlias, cast

import h11
import trio
from h11 import _abnf as abnf
from h11._readers import ChunkedReader

from stargate.socket_io import SocketReader, send_now
from stargate.upstream.chunked import ChunkedDecoder, ChunkedError
from stargate.upstream.errors import ResponseHeadTimeout, UpstreamProtocolError
from stargate.upstream.status_head import HeadError, StatusHead, parse_status_head

__all__ = ["Body", "Connection", "Release", "UpstreamResponse", "build_request", "request_bytes"]

# One receive per wake-up: large enough that a whole small response, or a burst of SSE events,
# is one syscall.
_RECEIVE_SIZE: Final = 65536
# Bodies up to this size are sent in the same `send_all` as the head (one copy, one syscall);
# larger ones are sent separately to avoid copying them.
_COALESCE_LIMIT: Final = 65536
# Request headers that this module owns (docs/decisions.md, D10). `transfer-encoding` too: the
# body is always framed with `content-length`, and a leftover `transfer-encoding: chunked` would
# contradict it.
_OWNED_HEADERS: Final = frozenset({b"host", b"content-length", b"transfer-encoding"})
# Methods that send `content-length` only when they actually carry a body (RFC 9110 §8.6: a client
# should not send `content-length: 0` where the method defines no meaning for content).
_BODYLESS_METHODS: Final = frozenset({b"GET", b"HEAD", b"DELETE", b"OPTIONS", b"TRACE"})
# What h11 itself accepts in a request head (its own grammar, RFC 9110/9112).
_FIELD_NAME: Final = re.compile(abnf.field_name.encode("ascii"))
_FIELD_VALUE: Final = re.compile(abnf.field_value.encode("ascii"))
_METHOD: Final = re.compile(abnf.method.encode("ascii"))
_TARGET: Final = re.compile(abnf.request_target.encode("ascii"))

Body: TypeAlias = bytes | bytearray
"""A request body as the proxy holds it: the bytes it received, or the `bytearray` it read them
into (stargate/proxy/app.py). Sent as it is: never copied to `bytes` (docs/data-plane.md, "Request
bodies in memory")."""

Release: TypeAlias = Callable[["Connection", bool], None]
"""Gives a connection back to its owner: `release(conn, reusable)`. Reusable means the response
was complete and unbroken; the owner still checks that the h11 machine can start a new cycle."""


class _DeadBeforeResponse(Exception):
    """Internal: the connection was closed or reset before any byte of the response arrived."""

    def __init__(self, *, request_sent: bool) -> None:
        super().__init__("connection closed before any response byte arrived")
        self.request_sent = request_sent


def build_request(
    method: str,
    host_header: bytes,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    body: Body,
) -> h11.Request:
    """The request head: `headers` as given except the owned ones, plus `host` and (when there is
    a body, or the method defines one) `content-length`. Raises `ValueError` for a bad header.

    Built once per request, before a connection is chosen, so a stale-connection retry sends the
    same head again.
    """
    method_bytes = method.encode("ascii")
    if _METHOD.fullmatch(method_bytes) is None:
        raise ValueError(f"invalid upstream request: bad method {method!r}")
    if _TARGET.fullmatch(target) is None:
        raise ValueError(f"invalid upstream request: bad target {target!r}")
    # h11 would check each header with two regular expressions and build a match dict for each
    # (about a microsecond a header, on every request); the same expressions, run here, refuse
    # the same headers, and h11 is then told the head is already validated (`_parsed`).
    name_ok, value_ok = _FIELD_NAME.fullmatch, _FIELD_VALUE.fullmatch
    if value_ok(host_header) is None:
        raise ValueError(f"invalid upstream request: bad host {host_header!r}")
    out: list[tuple[bytes, bytes]] = [(b"host", host_header)]
    for name, value in headers:
        if name.lower() in _OWNED_HEADERS:
            continue
        if name_ok(name) is None or value_ok(value) is None:
            raise ValueError(f"invalid upstream request: bad header {name!r}: {value!r}")
        out.append((name, value))
    if body or method_bytes not in _BODYLESS_METHODS:
        out.append((b"content-length", b"%d" % len(body)))
    try:
        return h11.Request(method=method_bytes, target=target, headers=out, _parsed=True)
    except h11.LocalProtocolError as exc:
        raise ValueError(f"invalid upstream request: {exc}") from exc


def request_bytes(head: h11.Request) -> bytes:
    """`head` as h11 would write it (a request without a body: `Connection.get_status`)."""
    fields = b"".join(b"%s: %s\r\n" % item for item in head.headers.raw_items())
    return b"%s %s HTTP/1.1\r\n%s\r\n" % (head.method, head.target, fields)


class Connection:
    """One socket (plain or TLS) with its h11 state machine.

    `name` is the origin's `scheme://host:port`, for error messages. `idle_since` and `reused`
    are the pool's bookkeeping; `reused` also decides whether a dead connection is reported as
    `_DeadBeforeResponse` (retryable by the pool) or as an error. Which origin the connection
    belongs to is the pool's own business, kept in its `release` callback.
    """

    __slots__ = (
        "_plain",
        "_reader",
        "closed",
        "h11",
        "idle_since",
        "name",
        "release",
        "reused",
        "socket_stream",
        "stream",
    )

    def __init__(
        self,
        name: str,
        stream: trio.abc.Stream,
        socket_stream: trio.SocketStream,
        release: Release,
    ) -> None:
        self.name = name
        self.stream = stream
        self.socket_stream = socket_stream
        self.release = release
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0
        self.reused = False
        self.closed = False
        # Plain TCP: bytes go straight to the socket (`send`, `receive`); TLS goes through trio.
        self._plain: trio.socket.SocketType | None = (
            socket_stream.socket if stream is socket_stream else None
        )
        self._reader = None if self._plain is None else SocketReader(self._plain, _RECEIVE_SIZE)

    def renew_machine(self) -> None:
        """Give the connection a fresh h11 machine: the response body was read without h11
        (`UpstreamResponse`, a chunked body), so the old machine is stuck in its body."""
        self.h11 = h11.Connection(h11.CLIENT)

    def ready_for_next(self) -> bool:
        """Whether the connection can carry another request, readying it if so: its h11 machine
        finished a keep-alive exchange with nothing left over (it then starts its next cycle), or
        is a fresh one (`renew_machine`: a connection is only released after a request, so an
        idle machine can only be a renewed one)."""
        machine = self.h11
        if machine.our_state is h11.IDLE and machine.their_state is h11.IDLE:
            return True
        if (
            machine.our_state is h11.DONE
            and machine.their_state is h11.DONE
            and machine.trailing_data == (b"", False)
        ):
            machine.start_next_cycle()
            return True
        return False

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send all of `data`.

        On a plain TCP connection with room in the socket's buffer (nearly always: a request is
        small) this is one `write(2)` and returns without yielding; trio's `send_all` would
        yield after it, a trip through the scheduler, and wrap it in four context managers
        (docs/data-plane.md, "Upstream socket I/O"). Whatever the socket did not take is sent
        by `send_all`, as before; errors are trio's (`BrokenResourceError`,
        `ClosedResourceError`).
        """
        sock = self._plain
        await send_now(self.stream, sock if sock is not None and sock.fileno() >= 0 else None, data)

    async def receive(self) -> bytes:
        """The bytes available now, waiting for some if there are none (b"" at EOF).

        On a plain TCP connection this waits for readability *first* (`SocketReader`, in
        stargate/socket_io.py, which says why); TLS goes through trio's `receive_some`.
        Errors are trio's, as from `receive_some`.
        """
        reader = self._reader
        if reader is None:
            return cast(bytes, await self.stream.receive_some(_RECEIVE_SIZE))
        return await reader.receive()

    async def exchange(
        self, head: h11.Request, body: Body, head_timeout: float
    ) -> UpstreamResponse:
        """Write the request and read the response head; the response then holds this connection.

        On any failure (including `_DeadBeforeResponse` and cancellation) the connection is left
        mid-message: the caller must close it.
        """
        request_sent = False
        # A bare cancel scope with a deadline: `trio.fail_after` is the same scope inside a
        # generator-based context manager, which costs more than the scope itself.
        with trio.CancelScope(deadline=trio.current_time() + head_timeout) as timeout:
            await self._send_request(head, body)
            request_sent = True
            response = await self._receive_head()
        if timeout.cancelled_caught:
            raise ResponseHeadTimeout(
                f"no response head from {self.name} within {head_timeout}s",
                request_sent=request_sent,
            )
        return UpstreamResponse(self, response, self.release)

    async def get_status(self, request: bytes, head_timeout: float) -> int:
        """Send `request` (a whole request without a body, `request_bytes`) and read its answer to
        the end, without h11: the status is all the caller wants (the replica's health probes,
        stargate/upstream/status_head.py says why). 1xx heads are skipped.

        Then the connection goes back through `release`: reusable (with a fresh h11 machine)
        after a complete keep-alive answer with nothing after it, closed otherwise. Failures are
        `exchange`'s: `_DeadBeforeResponse` for a reused connection that closed before a byte
        of the answer, `ResponseHeadTimeout`, `UpstreamProtocolError` (a malformed or cut
        answer); the connection is then left mid-message for the caller to close.
        """
        with trio.CancelScope(deadline=trio.current_time() + head_timeout) as timeout:
            head, body = await self._status_head(request)
        if timeout.cancelled_caught:
            raise ResponseHeadTimeout(
                f"no response head from {self.name} within {head_timeout}s", request_sent=True
            )
        reusable = await self._read_to_end(head, body)
        if reusable:
            self.renew_machine()
        self.release(self, reusable)
        return head.status

    async def _status_head(self, request: bytes) -> tuple[StatusHead, bytes]:
        """Send `request`; the final response head and the bytes after it."""
        try:
            await self.send(request)
        except trio.BrokenResourceError as exc:
            if self.reused:
                raise _DeadBeforeResponse(request_sent=False) from exc
            raise UpstreamProtocolError(
                f"connection to {self.name} lost while sending the request", request_sent=False
            ) from exc
        buf = b""
        received = False
        while True:
            try:
                head = parse_status_head(buf)
            except HeadError as exc:
                raise UpstreamProtocolError(
                    f"bad response head from {self.name}: {exc}", request_sent=True
                ) from exc
            if head is None:
                data = await self._receive_in_head(received)
                if not data:
                    raise UpstreamProtocolError(
                        f"{self.name} closed the connection mid-head", request_sent=True
                    )
                received = True
                buf += data
            elif head.status < 200:
                buf = buf[head.size :]  # 1xx: the final head follows
            else:
                return head, buf[head.size :]

    async def _receive_in_head(self, received: bool) -> bytes:
        """The next bytes of a response head (b"" at EOF after some arrived). A connection
        closed or reset before any byte of the response (`received` False) is
        `_DeadBeforeResponse`, which the pool retries once if the connection was reused."""
        try:
            data = await self.receive()
        except trio.BrokenResourceError as exc:
            if not received:
                raise _DeadBeforeResponse(request_sent=True) from exc
            raise UpstreamProtocolError(
                f"connection to {self.name} lost while reading the response head",
                request_sent=True,
            ) from exc
        if not data and not received:
            raise _DeadBeforeResponse(request_sent=True)
        return data

    async def _read_to_end(self, head: StatusHead, body: bytes) -> bool:
        """Read past the body of `head` (`body`: what arrived with it); True when the
        connection can carry another request."""
        try:
            if head.bodyless:
                return head.keep_alive and not body
            if head.chunked:
                decoder = ChunkedDecoder()
                decoder.feed(body)
                while not decoder.done:
                    decoder.feed(await self._receive_more())
                return head.keep_alive and not decoder.extra
            if head.content_length is not None:
                got = len(body)
                while got < head.content_length:
                    got += len(await self._receive_more())
                return head.keep_alive and got == head.content_length
            while await self.receive():  # framed by the close
                pass
            return False
        except ChunkedError as exc:
            raise UpstreamProtocolError(
                f"response body from {self.name} is malformed: {exc}", request_sent=True
            ) from exc
        except trio.BrokenResourceError as exc:
            raise UpstreamProtocolError(
                f"connection to {self.name} lost mid-body", request_sent=True
            ) from exc

    async def _receive_more(self) -> bytes:
        data = await self.receive()
        if not data:
            raise UpstreamProtocolError(
                f"response body from {self.name} ended early", request_sent=True
            )
        return data

    def close(self) -> bool:
        """Close the socket; False if it was already closed."""
        if self.closed:
            return False
        # Closing the socket is synchronous in trio; for TLS this skips close_notify, which HTTP
        # framing makes unnecessary (and which could block on a peer that stopped reading).
        self.closed = True
        self.socket_stream.socket.close()
        return True

    async def _send_request(self, head: h11.Request, body: Body) -> None:
        machine = self.h11
        data = machine.send(head)
        if body:
            # Content-length framing writes the body verbatim; this call only advances h11's
            # bookkeeping, so the body itself is sent below without an extra copy. (h11 takes any
            # bytes-like object here: it only counts it; its annotation says bytes.)
            machine.send_with_data_passthrough(h11.Data(data=cast(bytes, body)))
        machine.send(h11.EndOfMessage())
        try:
            if len(body) <= _COALESCE_LIMIT:
                await self.send(data + body)
            else:
                await self.send(data)
                await self.send(body)
        except trio.BrokenResourceError as exc:
            if self.reused:
                raise _DeadBeforeResponse(request_sent=False) from exc
            raise UpstreamProtocolError(
                f"connection to {self.name} lost while sending the request",
                request_sent=False,
            ) from exc

    async def _receive_head(self) -> h11.Response:
        machine = self.h11
        received = False
        while True:
            try:
                event = machine.next_event()
            except h11.RemoteProtocolError as exc:
                raise UpstreamProtocolError(
                    f"bad response head from {self.name}: {exc}", request_sent=True
                ) from exc
            if event is h11.NEED_DATA:
                data = await self._receive_in_head(received)
                received = True
                machine.receive_data(data)
            elif isinstance(event, h11.Response):
                return event
            elif not isinstance(event, h11.InformationalResponse):  # 1xx: skip, wait for more
                raise UpstreamProtocolError(
                    f"unexpected {type(event).__name__} from {self.name} before the response head",
                    request_sent=True,
                )


# --- the response ---------------------------------------------------------------------------


def _joined(chunks: Sequence[bytes | bytearray]) -> bytes | None:
    if not chunks:
        return None
    if len(chunks) == 1:
        return bytes(chunks[0])
    return b"".join(chunks)


class _BodyIterator:
    """`async for` over the body; a plain iterator rather than an async generator so that a
    consumer breaking out of the loop leaves nothing for the garbage collector to finalize."""

    __slots__ = ("_response",)

    def __init__(self, response: UpstreamResponse) -> None:
        self._response = response

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._response._next_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk


class UpstreamResponse:
    """A response whose head has arrived; the body is read on demand.

    It holds its connection (and the origin's connection slot) until the body is complete or the
    response is closed, so always close it: `async with response:` or `await response.aclose()`.
    A complete body returns the connection to the pool at once; closing before that closes the
    socket (the rest of the body would have to be read to reuse it, and a consumer that stops
    reading, e.g. a disconnected client, must not keep the backend generating).

    Either way the connection goes back through `release`, exactly once: `reusable` is True only
    after a complete, unbroken body.

    Not safe for concurrent use by several tasks.
    """

    __slots__ = (
        "_broken",
        "_complete",
        "_conn",
        "_decoder",
        "_keep_alive",
        "_leftover",
        "_release",
        "headers",
        "http_version",
        "reason",
        "status",
    )

    def __init__(self, conn: Connection, head: h11.Response, release: Release) -> None:
        self._release = release
        self._conn: Connection | None = conn
        self._complete = False
        self._broken = False
        self.status: int = head.status_code
        # h11 lower-cases names while iterating; values and order are as received.
        self.headers: list[tuple[bytes, bytes]] = list(head.headers)
        self.reason: bytes = head.reason
        self.http_version: bytes = head.http_version
        # A chunked body (every SSE stream) is decoded here, not by h11: a `find` and a slice
        # per event instead of h11's generic reader and event machinery (stargate/upstream/
        # chunked.py says why). h11 has read the head; what it holds past it is fed first.
        machine = conn.h11
        self._decoder: ChunkedDecoder | None = None
        self._leftover = b""
        self._keep_alive = False
        if type(machine._reader) is ChunkedReader:
            self._decoder = ChunkedDecoder()
            self._leftover, closed = machine.trailing_data
            # h11's verdict from both heads (HTTP/1.1, no `Connection: close`), read before its
            # machine is replaced on release; a backend that already closed its side is not.
            self._keep_alive = machine._cstate.keep_alive and not closed

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives: each chunk is what was available at that moment (never
        waits to fill a buffer). Raises `UpstreamProtocolError` if the body ends early."""
        return _BodyIterator(self)

    @property
    def complete(self) -> bool:
        """The whole body has been read: the chunk just returned, if any, was the last.

        Lets a relay send the last chunk as the end of its response (one message, not a chunk
        and then an empty end), without ever waiting to learn that it was the last."""
        return self._complete

    async def read(self) -> bytes:
        """The rest of the body."""
        chunks: list[bytes] = []
        while (chunk := await self._next_chunk()) is not None:
            chunks.append(chunk)
        return b"".join(chunks)

    async def aclose(self) -> None:
        """Give the connection back (complete body) or close it (anything else). Idempotent."""
        if self._conn is not None and not self._complete and not self._broken:
            self._drain_buffered()
        self._finish()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<UpstreamResponse {self.status} {self.reason.decode('latin-1')!r}>"

    async def _next_chunk(self) -> bytes | None:
        """The data available now (waiting only if there is none), or None at the end."""
        if self._complete:
            return None
        conn = self._conn
        if conn is None:
            raise RuntimeError("the response is closed")
        if self._broken:
            raise UpstreamProtocolError("the response body already failed", request_sent=True)
        try:
            if self._decoder is None:
                chunks = await self._read_with_h11(conn)
            else:
                chunks = await self._read_decoded(conn, self._decoder)
        except trio.BrokenResourceError as exc:
            self._broken = True
            raise UpstreamProtocolError(
                f"connection to {conn.name} lost mid-body", request_sent=True
            ) from exc
        except BaseException:
            # Cancellation (client disconnect) or a malformed body: the connection is in the
            # middle of a message and can never be reused.
            self._broken = True
            raise
        if self.complete:  # (set by the read)
            # Hand the connection back now: a consumer that read everything but forgets
            # `aclose()` must not pin the slot.
            self._finish()
        return _joined(chunks)

    async def _read_with_h11(self, conn: Connection) -> Sequence[bytes | bytearray]:
        """The data h11 has or next gets for a body it frames (`content-length`, or to EOF)."""
        machine = conn.h11
        chunks: list[bytes | bytearray] = []
        try:
            while self._gather(machine, chunks) and not chunks:
                machine.receive_data(await conn.receive())
        except h11.RemoteProtocolError as exc:
            raise UpstreamProtocolError(
                f"response body from {conn.name} ended early or is malformed: {exc}",
                request_sent=True,
            ) from exc
        return chunks

    async def _read_decoded(self, conn: Connection, decoder: ChunkedDecoder) -> list[bytes]:
        """The data of a chunked body (`ChunkedDecoder`) that is there or next arrives."""
        leftover = self._take_leftover()  # (only before the first read: the rest of a stream
        # pays no decoder call for it; a failure after returned data is raised here)
        chunks = self._decode(conn, decoder, leftover) if leftover or decoder.failed else []
        while not chunks and not decoder.done:
            data = await conn.receive()
            if not data:
                raise UpstreamProtocolError(
                    f"response body from {conn.name} ended early or is malformed: peer "
                    "closed connection without sending complete message body",
                    request_sent=True,
                )
            chunks = self._decode(conn, decoder, data)
        self._complete = decoder.done
        return chunks

    def _take_leftover(self) -> bytes:
        data, self._leftover = self._leftover, b""
        return data

    def _decode(self, conn: Connection, decoder: ChunkedDecoder, data: bytes) -> list[bytes]:
        try:
            return decoder.feed(data)
        except ChunkedError as exc:
            self._broken = True
            raise UpstreamProtocolError(
                f"response body from {conn.name} ended early or is malformed: {exc}",
                request_sent=True,
            ) from exc

    def take_buffered(self) -> bytes | None:
        """The body data that has already arrived, without waiting for more (None if none has);
        `complete` then says whether it was the whole body.

        A small answer usually arrives whole with its head: the relay can then send its head
        and body at once (docs/data-plane.md, "Streaming"). Raises like `aiter_bytes()`.
        """
        conn = self._conn
        if self._complete or conn is None or self._broken:
            return None
        decoder = self._decoder
        if decoder is not None:
            decoded = self._decode(conn, decoder, self._take_leftover())
            if decoder.done:
                self._complete = True
                self._finish()
            return _joined(decoded)
        chunks: list[bytes | bytearray] = []
        try:
            self._gather(conn.h11, chunks)
        except h11.RemoteProtocolError as exc:
            self._broken = True
            raise UpstreamProtocolError(
                f"response body from {conn.name} ended early or is malformed: {exc}",
                request_sent=True,
            ) from exc
        except BaseException:
            self._broken = True
            raise
        if self.complete:  # (set by `_gather`)
            self._finish()
        return _joined(chunks)

    def _gather(self, machine: h11.Connection, chunks: list[bytes | bytearray]) -> bool:
        """Move the body data `machine` already holds into `chunks`; True when it needs more
        bytes, False at the end of the body (`_complete` is then set)."""
        while True:
            event = machine.next_event()
            if isinstance(event, h11.Data):
                if event.data:
                    chunks.append(event.data)
            elif event is h11.NEED_DATA:
                return True
            elif isinstance(event, h11.EndOfMessage):
                self._complete = True
                return False
            else:
                raise UpstreamProtocolError(
                    f"unexpected {type(event).__name__} in the response body",
                    request_sent=True,
                )

    def _drain_buffered(self) -> None:
        """Consume what is already buffered (no I/O): a 204, a HEAD response or a small body
        that arrived with the head can then still return its connection to the pool."""
        assert self._conn is not None
        decoder = self._decoder
        if decoder is not None:
            try:
                decoder.feed(self._take_leftover())
            except ChunkedError:
                self._broken = True
                return
            self._complete = decoder.done
            return
        machine = self._conn.h11
        try:
            while True:
                event = machine.next_event()
                if isinstance(event, h11.EndOfMessage):
                    self._complete = True
                    return
                if not isinstance(event, h11.Data):
                    return
        except h11.RemoteProtocolError:
            self._broken = True

    def _finish(self) -> None:
        # `_conn` is cleared first, so `release` runs at most once however often this is called.
        conn, self._conn = self._conn, None
        if conn is not None:
            reusable = self._complete and not self._broken
            decoder = self._decoder
            if reusable and decoder is not None:
                # h11 never saw this body: the connection carries another request only with a
                # fresh machine, and only if both heads allowed keep-alive and nothing followed.
                reusable = self._keep_alive and not decoder.extra
                if reusable:
                    conn.renew_machine()
            self._release(conn, reusable)
