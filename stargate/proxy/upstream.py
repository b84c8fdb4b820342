"""A keep-alive HTTP/1.1 client pool on trio sockets (h11), for proxying requests to backends.

Why not httpx in the hot path (docs/decisions.md, D10): the proxy is CPU-bound, and httpx/httpcore
spent about half of the proxy's CPU per request. httpcore scans every pooled connection and
`poll()`s each idle socket on every request (an O(pool) cost), httpx keeps a cookie jar that leaks
`Set-Cookie` between users of a shared client, and its models and URL handling add the rest. A small
h11 pool measured about 2x the throughput. This is that pool, made production-shaped:

* **Bytes in, bytes out.** No cookie jar, no redirects, no decompression, no proxy settings from
  the environment: the proxy forwards exactly what the backend sent.
* **Framing is ours** (h11 adds neither header): `host` and `content-length` are set here, replacing
  any the caller passed, and the body is always sent with `content-length` (never chunked).
* **Timeouts** (docs/data-plane.md, Timeouts): a connect timeout (TCP + TLS), a head timeout from
  the first request byte until the response head, and **no** timeout on the body, which may stream
  for as long as the backend generates tokens.
* **Streaming** (docs/data-plane.md, Streaming): `UpstreamResponse.aiter_bytes()` yields data as it
  arrives; data that is already buffered when the consumer asks is joined into one chunk, which
  saves downstream sends without ever waiting for more.
* **Cancellation** (docs/data-plane.md, Cancellation): a cancelled request or body read closes the
  connection; a connection is returned to the pool only after a complete, reusable response.
* **Stale connections**: a server may close an idle keep-alive connection at any moment, so a
  reused connection that dies before any response byte is retried once on a fresh connection
  (see `ConnectionPool.request`).
* **Idle bookkeeping is O(1) per request**: idle connections are kept newest-last; a request takes
  the newest one and checks only its age. Nothing polls idle sockets.

All errors derive from `UpstreamError`, whose `request_sent` attribute is the retry rule: when it
is False the backend cannot have seen a complete request, so retrying (even a POST) is safe.
"""

from __future__ import annotations

import math
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self, cast
from urllib.parse import SplitResult, urlsplit

import h11
import trio

__all__ = [
    "ConnectError",
    "ConnectionPool",
    "ConnectionPoolStats",
    "ConnectionPoolTimeout",
    "ResponseHeadTimeout",
    "UpstreamConfig",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "make_ssl_context",
]

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


def make_ssl_context(ca_file: str | None = None) -> ssl.SSLContext:
    """A client TLS context trusting the system store plus, optionally, one extra CA bundle.

    `ssl.create_default_context(cafile=...)` would load *only* that file and drop the system store;
    backends behind a private CA still need the public roots for everything else, so both are
    loaded. ALPN offers only `http/1.1`, since that is all this pool speaks.
    """
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if ca_file is not None:
        context.load_verify_locations(cafile=ca_file)
    context.set_alpn_protocols(["http/1.1"])
    return context


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """Limits and timeouts of an `ConnectionPool` (all durations in seconds).

    * `connect_timeout`: TCP connect plus TLS handshake of one new connection.
    * `response_head_timeout`: from the start of sending the request until the response head has
      arrived (docs/data-plane.md, Timeouts). The body has no timeout: a streamed completion lasts
      as long as the model generates. `math.inf` disables it.
    * `pool_acquire_timeout`: how long a request waits for a connection slot when the origin is
      at `max_connections_per_origin`.
    * `max_connections_per_origin`: open connections (in use plus idle) per scheme/host/port.
    * `max_idle_per_origin`: idle keep-alive connections kept per origin; extras are closed.
    * `idle_expiry`: an idle connection older than this is closed instead of reused (servers
      close idle connections after their own keep-alive timeout; reusing one that old mostly
      buys a retry).
    * `ssl_context`: used for `https` origins. None builds `make_ssl_context(ca_file)` on the
      first https connection, so plain-http deployments never touch the trust store.
    * `ca_file`: an extra CA bundle for that default context (cannot be combined with
      `ssl_context`: configure the context instead).
    """

    connect_timeout: float = 5.0
    response_head_timeout: float = 30.0
    pool_acquire_timeout: float = 5.0
    max_connections_per_origin: int = 256
    max_idle_per_origin: int = 32
    idle_expiry: float = 60.0
    ssl_context: ssl.SSLContext | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "response_head_timeout"):
            value = getattr(self, name)
            if math.isnan(value) or value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name in ("pool_acquire_timeout", "idle_expiry"):
            value = getattr(self, name)
            if math.isnan(value) or value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.max_connections_per_origin < 1:
            raise ValueError(
                f"max_connections_per_origin must be >= 1, got {self.max_connections_per_origin}"
            )
        if self.max_idle_per_origin < 0:
            raise ValueError(f"max_idle_per_origin must be >= 0, got {self.max_idle_per_origin}")
        if self.ssl_context is not None and self.ca_file is not None:
            raise ValueError("give either ssl_context or ca_file, not both")


# --- errors ---------------------------------------------------------------------------------


class UpstreamError(Exception):
    """Any failure to get a response (head or body) from a backend.

    `request_sent` is the retry rule. False: the backend cannot have received a complete request
    (nothing was sent, or sending failed part-way, and `content-length` framing means a server
    never acts on a truncated request), so retrying is safe even for a POST. True: the backend
    may have received, and be processing, the request; a retry may duplicate work.
    """

    def __init__(self, message: str, *, request_sent: bool) -> None:
        super().__init__(message)
        self.request_sent = request_sent


class ConnectError(UpstreamError):
    """DNS resolution, TCP connect or TLS handshake failed or timed out.

    Nothing was sent: always safe to retry (`request_sent` is False).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, request_sent=False)


class ConnectionPoolTimeout(UpstreamError):
    """No connection slot for the origin freed up within `pool_acquire_timeout`.

    Nothing was sent: safe to retry, though the origin is saturated.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, request_sent=False)


class ResponseHeadTimeout(UpstreamError):
    """The response head did not arrive within `response_head_timeout`.

    `request_sent` tells whether the whole request had been written: usually True (the backend
    is slow or stuck), in which case a retry may duplicate work. The connection is closed.
    """


class UpstreamProtocolError(UpstreamError):
    """The connection failed or the backend misbehaved after sending began.

    Raised when the connection is closed or reset before or while the head is read (after the
    one transparent retry of a stale pooled connection), when the head or the body framing is
    malformed, and from `UpstreamResponse.aiter_bytes()`/`read()` when the body ends early (the
    head was then already delivered, so nothing can be retried at this level). `request_sent` is
    False only when writing the request itself failed.
    """


class _DeadBeforeResponse(Exception):
    """Internal: the connection was closed or reset before any byte of the response arrived."""

    def __init__(self, *, request_sent: bool) -> None:
        super().__init__("connection closed before any response byte arrived")
        self.request_sent = request_sent


# --- connections and origins ----------------------------------------------------------------


class _Origin:
    """Per scheme/host/port state: the idle stack and the connection slots."""

    __slots__ = ("host", "host_header", "idle", "key", "map_key", "port", "slots", "tls")

    def __init__(
        self,
        map_key: tuple[str, str],
        key: str,
        host: str,
        port: int,
        host_header: bytes,
        tls: bool,
        max_connections: int,
    ) -> None:
        self.map_key = map_key
        self.key = key
        self.host = host
        self.port = port
        self.host_header = host_header
        self.tls = tls
        # Oldest first: requests take from the right (newest, least likely to be stale), expiry
        # and the idle cap trim from the left.
        self.idle: deque[_Connection] = deque()
        # One slot per connection in use. A new connection is opened only while holding a slot
        # and only when no idle one is left, so open connections never exceed the slot count.
        self.slots = trio.Semaphore(max_connections, max_value=max_connections)


class _Connection:
    """One socket (plain or TLS) with its h11 state machine."""

    __slots__ = ("closed", "h11", "idle_since", "origin", "reused", "socket_stream", "stream")

    def __init__(
        self, origin: _Origin, stream: trio.abc.Stream, socket_stream: trio.SocketStream
    ) -> None:
        self.origin = origin
        self.stream = stream
        self.socket_stream = socket_stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0
        self.reused = False
        self.closed = False


# --- the response ---------------------------------------------------------------------------


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

    Not safe for concurrent use by several tasks.
    """

    __slots__ = (
        "_broken",
        "_complete",
        "_conn",
        "_pool",
        "headers",
        "http_version",
        "reason",
        "status",
    )

    def __init__(self, pool: ConnectionPool, conn: _Connection, head: h11.Response) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self._complete = False
        self._broken = False
        self.status: int = head.status_code
        # h11 lower-cases names while iterating; values and order are as received.
        self.headers: list[tuple[bytes, bytes]] = list(head.headers)
        self.reason: bytes = head.reason
        self.http_version: bytes = head.http_version

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives: each chunk is what was available at that moment (never
        waits to fill a buffer). Raises `UpstreamProtocolError` if the body ends early."""
        return _BodyIterator(self)

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
        machine = conn.h11
        chunks: list[bytes | bytearray] = []
        try:
            while True:
                event = machine.next_event()
                if isinstance(event, h11.Data):
                    if event.data:
                        chunks.append(event.data)
                elif event is h11.NEED_DATA:
                    if chunks:
                        break
                    # h11 accepts any bytes-like object; its annotation says bytes.
                    data = await conn.stream.receive_some(_RECEIVE_SIZE)
                    machine.receive_data(cast(bytes, data))
                elif isinstance(event, h11.EndOfMessage):
                    self._complete = True
                    break
                else:
                    raise UpstreamProtocolError(
                        f"unexpected {type(event).__name__} in the response body",
                        request_sent=True,
                    )
        except h11.RemoteProtocolError as exc:
            self._broken = True
            raise UpstreamProtocolError(
                f"response body from {conn.origin.key} ended early or is malformed: {exc}",
                request_sent=True,
            ) from exc
        except trio.BrokenResourceError as exc:
            self._broken = True
            raise UpstreamProtocolError(
                f"connection to {conn.origin.key} lost mid-body", request_sent=True
            ) from exc
        except BaseException:
            # Cancellation (client disconnect) or our own error above: the connection is in the
            # middle of a message and can never be reused.
            self._broken = True
            raise
        if self._complete:
            # Hand the connection back now: a consumer that read everything but forgets
            # `aclose()` must not pin the slot.
            self._finish()
        if not chunks:
            return None
        if len(chunks) == 1:
            return bytes(chunks[0])
        return b"".join(chunks)

    def _drain_buffered(self) -> None:
        """Consume what is already buffered (no I/O): a 204, a HEAD response or a small body
        that arrived with the head can then still return its connection to the pool."""
        assert self._conn is not None
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
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._release(conn, reusable=self._complete and not self._broken)


# --- the pool -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConnectionPoolStats:
    """A snapshot for tests and metrics."""

    connections_created: int
    """Connections ever opened (TCP connect, plus TLS handshake for https, succeeded)."""
    open_connections: int
    """Connections open now: in use plus idle."""
    in_use_connections: int
    """Connection slots held by requests and unclosed responses."""
    idle_connections: Mapping[str, int]
    """Idle keep-alive connections per origin (`scheme://host:port`); origins with none are
    omitted."""
    stale_retries: int
    """Requests transparently retried because a pooled connection turned out dead."""


class ConnectionPool:
    """Keep-alive HTTP/1.1 connections to backends, per origin, shared by all requests.

    Use one pool per process (or per event loop) and close it at shutdown:
    `async with ConnectionPool(config) as pool: ...`.
    """

    def __init__(self, config: UpstreamConfig = UpstreamConfig()) -> None:
        self._config = config
        self._ssl_context = self._config.ssl_context
        self._origins: dict[tuple[str, str], _Origin] = {}
        self._closed = False
        self._created = 0
        self._open = 0
        self._in_use = 0
        self._stale_retries = 0

    @property
    def config(self) -> UpstreamConfig:
        """The configuration this pool was built with."""
        return self._config

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every idle connection and refuse new requests.

        Responses still open keep their connections until they are closed, and those are then
        closed rather than pooled.
        """
        self._closed = True
        for origin in list(self._origins.values()):
            while origin.idle:
                self._close(origin.idle.pop())
            self._forget_if_unused(origin)
        await trio.lowlevel.checkpoint()

    def close_expired(self) -> int:
        """Close idle connections older than `idle_expiry`; return how many were closed.

        Requests already skip expired connections, so this is only housekeeping: call it every so
        often (e.g. every `idle_expiry`) so that connections to backends that no longer get
        traffic do not stay open (in CLOSE_WAIT once the backend gives up on them). It visits
        every idle connection, so it does not belong on the request path.
        """
        closed = 0
        deadline = trio.current_time() - self._config.idle_expiry
        for origin in list(self._origins.values()):
            idle = origin.idle
            while idle and idle[0].idle_since < deadline:
                self._close(idle.popleft())
                closed += 1
            self._forget_if_unused(origin)
        return closed

    def stats(self) -> ConnectionPoolStats:
        """Counts of connections: created, open, in use, and idle per origin."""
        return ConnectionPoolStats(
            connections_created=self._created,
            open_connections=self._open,
            in_use_connections=self._in_use,
            idle_connections={
                origin.key: len(origin.idle) for origin in self._origins.values() if origin.idle
            },
            stale_retries=self._stale_retries,
        )

    async def request(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes = b""
    ) -> UpstreamResponse:
        """Send one request and return once the response head has arrived.

        `url` is absolute `http://` or `https://` (backend base URL + path + query); a fragment is
        ignored. `headers` are forwarded as given except `host`, `content-length` and
        `transfer-encoding`, which are set here (any case, any number of copies, replaced).
        Hop-by-hop filtering is the caller's job (docs/data-plane.md, Header filtering); a
        `connection: close` passed here is honoured (the connection is then not reused).

        Stale pooled connections: a server may close an idle keep-alive connection at any time (its
        keep-alive timeout, a restart), and its FIN can cross our request on the wire. When a
        *reused* connection is closed or reset before *any* byte of the response arrived, the
        request is retried once on a fresh connection. Client libraries all handle this race:
        urllib3 and httpcore check each pooled socket for readability before reuse (the per-request
        `poll()` this pool avoids), and Go's net/http retries on a fresh connection when a reused
        one dies before the first response byte. The reasoning for retrying: a server that read the
        request and is working on it answers, if only with a 500; closing without a byte is what a
        server does to a connection it considers idle, so the request was almost certainly never
        processed. Unlike Go (which replays only idempotent requests or unsent ones), every method
        is retried here: the residual risk is a backend that crashed mid-request, where the cost is
        a duplicate inference, and the forwarder retries transport errors anyway
        (docs/data-plane.md, Retries). Only reused connections qualify: a fresh connection failing
        the same way raises `UpstreamProtocolError(request_sent=True)` and is never retried here.

        Raises `ValueError` for a bad URL or header, `RuntimeError` after `aclose()`, and the
        `UpstreamError` subclasses (see their docs for which are safe to retry).
        """
        if self._closed:
            raise RuntimeError("the upstream pool is closed")
        origin, target = self._resolve(url)
        try:
            head = self._build_request(method, origin, target, headers, body)
            await self._acquire_slot(origin)
        except BaseException:
            self._forget_if_unused(origin)
            raise
        try:
            conn = self._take_idle(origin)
            if conn is not None:
                try:
                    return await self._exchange(conn, head, body)
                except _DeadBeforeResponse:
                    self._stale_retries += 1
            conn = await self._connect(origin)
            try:
                return await self._exchange(conn, head, body)
            except _DeadBeforeResponse as dead:
                raise UpstreamProtocolError(
                    f"{origin.key} closed the connection without responding",
                    request_sent=dead.request_sent,
                ) from dead.__cause__
        except BaseException:
            self._release_slot(origin)
            raise

    # --- request path internals ---

    def _resolve(self, url: str) -> tuple[_Origin, bytes]:
        parts = urlsplit(url)
        scheme = parts.scheme
        if scheme not in ("http", "https"):
            raise ValueError(f"upstream URL must be absolute http(s), got {url!r}")
        target = parts.path or "/"
        if parts.query:
            target = f"{target}?{parts.query}"
        map_key = (scheme, parts.netloc)
        origin = self._origins.get(map_key)
        if origin is None:
            origin = self._new_origin(url, map_key, parts.hostname, parts)
            self._origins[map_key] = origin
        try:
            return origin, target.encode("ascii")
        except UnicodeEncodeError:
            raise ValueError(
                f"upstream URL path must be ASCII (percent-encoded): {url!r}"
            ) from None

    def _new_origin(
        self, url: str, map_key: tuple[str, str], host: str | None, parts: SplitResult
    ) -> _Origin:
        scheme, netloc = map_key
        if "@" in netloc:
            raise ValueError(f"upstream URL must not carry credentials: {url!r}")
        if not host:
            raise ValueError(f"upstream URL has no host: {url!r}")
        try:
            explicit_port = parts.port
        except ValueError as exc:
            raise ValueError(f"upstream URL has a bad port: {url!r}") from exc
        tls = scheme == "https"
        port = explicit_port if explicit_port is not None else (443 if tls else 80)
        try:
            host_header = netloc.encode("ascii")
        except UnicodeEncodeError:
            raise ValueError(f"upstream host must be ASCII (IDNA-encoded): {url!r}") from None
        shown = f"[{host}]" if ":" in host else host
        return _Origin(
            map_key=map_key,
            key=f"{scheme}://{shown}:{port}",
            host=host,
            port=port,
            host_header=host_header,
            tls=tls,
            max_connections=self._config.max_connections_per_origin,
        )

    def _build_request(
        self,
        method: str,
        origin: _Origin,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> h11.Request:
        method_bytes = method.encode("ascii")
        out: list[tuple[bytes, bytes]] = [(b"host", origin.host_header)]
        for name, value in headers:
            if name.lower() not in _OWNED_HEADERS:
                out.append((name, value))
        if body or method_bytes not in _BODYLESS_METHODS:
            out.append((b"content-length", b"%d" % len(body)))
        try:
            return h11.Request(method=method_bytes, target=target, headers=out)
        except h11.LocalProtocolError as exc:
            raise ValueError(f"invalid upstream request: {exc}") from exc

    async def _acquire_slot(self, origin: _Origin) -> None:
        try:
            origin.slots.acquire_nowait()
        except trio.WouldBlock:
            acquired = False
            with trio.move_on_after(self._config.pool_acquire_timeout):
                await origin.slots.acquire()
                acquired = True
            if not acquired:
                raise ConnectionPoolTimeout(
                    f"no free connection to {origin.key} within "
                    f"{self._config.pool_acquire_timeout}s "
                    f"({self._config.max_connections_per_origin} in use)"
                ) from None
        self._in_use += 1

    def _release_slot(self, origin: _Origin) -> None:
        self._in_use -= 1
        origin.slots.release()
        self._forget_if_unused(origin)

    def _take_idle(self, origin: _Origin) -> _Connection | None:
        idle = origin.idle
        if not idle:
            return None
        conn = idle.pop()
        if trio.current_time() - conn.idle_since > self._config.idle_expiry:
            # The newest idle connection has expired, so every older one has too.
            self._close(conn)
            while idle:
                self._close(idle.pop())
            return None
        return conn

    async def _connect(self, origin: _Origin) -> _Connection:
        timeout = self._config.connect_timeout
        socket_stream: trio.SocketStream | None = None
        try:
            with trio.fail_after(timeout):
                socket_stream = await trio.open_tcp_stream(origin.host, origin.port)
                stream: trio.abc.Stream = socket_stream
                if origin.tls:
                    tls_stream = trio.SSLStream(
                        socket_stream,
                        self._tls_context(),
                        server_hostname=origin.host,
                        https_compatible=True,
                    )
                    await tls_stream.do_handshake()
                    stream = tls_stream
        except trio.TooSlowError:
            self._close_socket(socket_stream)
            raise ConnectError(f"connecting to {origin.key} timed out after {timeout}s") from None
        except OSError as exc:
            self._close_socket(socket_stream)
            raise ConnectError(f"cannot connect to {origin.key}: {exc}") from exc
        except trio.BrokenResourceError as exc:
            self._close_socket(socket_stream)
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            raise ConnectError(f"TLS handshake with {origin.key} failed: {cause}") from exc
        except BaseException:
            self._close_socket(socket_stream)
            raise
        self._created += 1
        self._open += 1
        return _Connection(origin, stream, socket_stream)

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            self._ssl_context = make_ssl_context(self._config.ca_file)
        return self._ssl_context

    async def _exchange(
        self, conn: _Connection, head: h11.Request, body: bytes
    ) -> UpstreamResponse:
        """Write the request and read the response head on `conn`; close `conn` on any failure."""
        request_sent = False
        try:
            with trio.fail_after(self._config.response_head_timeout):
                await self._send_request(conn, head, body)
                request_sent = True
                response = await self._receive_head(conn)
        except trio.TooSlowError:
            self._close(conn)
            raise ResponseHeadTimeout(
                f"no response head from {conn.origin.key} within "
                f"{self._config.response_head_timeout}s",
                request_sent=request_sent,
            ) from None
        except BaseException:
            self._close(conn)
            raise
        return UpstreamResponse(self, conn, response)

    async def _send_request(self, conn: _Connection, head: h11.Request, body: bytes) -> None:
        machine = conn.h11
        data = machine.send(head)
        if body:
            # Content-length framing writes the body verbatim; this call only advances h11's
            # bookkeeping, so the body itself is sent below without an extra copy.
            machine.send_with_data_passthrough(h11.Data(data=body))
        machine.send(h11.EndOfMessage())
        try:
            if len(body) <= _COALESCE_LIMIT:
                await conn.stream.send_all(data + body)
            else:
                await conn.stream.send_all(data)
                await conn.stream.send_all(body)
        except trio.BrokenResourceError as exc:
            if conn.reused:
                raise _DeadBeforeResponse(request_sent=False) from exc
            raise UpstreamProtocolError(
                f"connection to {conn.origin.key} lost while sending the request",
                request_sent=False,
            ) from exc

    async def _receive_head(self, conn: _Connection) -> h11.Response:
        machine = conn.h11
        received = False
        while True:
            try:
                event = machine.next_event()
            except h11.RemoteProtocolError as exc:
                raise UpstreamProtocolError(
                    f"bad response head from {conn.origin.key}: {exc}", request_sent=True
                ) from exc
            if event is h11.NEED_DATA:
                try:
                    data = await conn.stream.receive_some(_RECEIVE_SIZE)
                except trio.BrokenResourceError as exc:
                    if not received:
                        raise _DeadBeforeResponse(request_sent=True) from exc
                    raise UpstreamProtocolError(
                        f"connection to {conn.origin.key} lost while reading the response head",
                        request_sent=True,
                    ) from exc
                if not data and not received:
                    raise _DeadBeforeResponse(request_sent=True)
                received = True
                machine.receive_data(cast(bytes, data))
            elif isinstance(event, h11.Response):
                return event
            elif not isinstance(event, h11.InformationalResponse):  # 1xx: skip, wait for more
                raise UpstreamProtocolError(
                    f"unexpected {type(event).__name__} from {conn.origin.key} before the "
                    "response head",
                    request_sent=True,
                )

    # --- connection bookkeeping ---

    def _release(self, conn: _Connection, *, reusable: bool) -> None:
        """A response is done with `conn`: pool it if it can carry another request, else close."""
        origin = conn.origin
        if reusable and not self._closed and self._config.max_idle_per_origin > 0:
            machine = conn.h11
            if (
                machine.our_state is h11.DONE
                and machine.their_state is h11.DONE
                and machine.trailing_data == (b"", False)
            ):
                machine.start_next_cycle()
                now = trio.current_time()
                conn.idle_since = now
                conn.reused = True
                idle = origin.idle
                idle.append(conn)
                expired_before = now - self._config.idle_expiry
                while len(idle) > self._config.max_idle_per_origin or (
                    idle[0].idle_since < expired_before
                ):
                    self._close(idle.popleft())
            else:
                self._close(conn)
        else:
            self._close(conn)
        self._release_slot(origin)

    def _close(self, conn: _Connection) -> None:
        # Closing the socket is synchronous in trio; for TLS this skips close_notify, which HTTP
        # framing makes unnecessary (and which could block on a peer that stopped reading).
        if not conn.closed:
            conn.closed = True
            self._open -= 1
            conn.socket_stream.socket.close()

    @staticmethod
    def _close_socket(socket_stream: trio.SocketStream | None) -> None:
        if socket_stream is not None:
            socket_stream.socket.close()

    def _forget_if_unused(self, origin: _Origin) -> None:
        """Drop an origin with no connections, so backends that come and go do not accumulate.

        A full semaphore means no slot is held and nobody waits (slots are handed directly to
        waiters on release), so no request refers to this origin object any more.
        """
        # The identity check keeps a stale origin from removing a same-key successor.
        if (
            not origin.idle
            and origin.slots.value == origin.slots.max_value
            and self._origins.get(origin.map_key) is origin
        ):
            del self._origins[origin.map_key]
