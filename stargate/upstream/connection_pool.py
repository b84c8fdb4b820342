"""`ConnectionPool`: keep-alive connections to backends, per origin (scheme/host/port), shared by
all requests; and `ConnectionPoolStats`, its counts for tests and metrics.

Why a pool of our own rather than httpx (docs/decisions.md, D10): the proxy is CPU-bound, and
httpx/httpcore spent about half of the proxy's CPU per request. httpcore scans every pooled
connection and `poll()`s each idle socket on every request (an O(pool) cost), httpx keeps a cookie
jar that leaks `Set-Cookie` between users of a shared client, and its models and URL handling add
the rest. A small h11 pool measured about 2x the throughput. This is that pool, made
production-shaped; one connection's exchange and the response are in `connection.py`.

* **Origins and slots**: each origin has a slot per connection in use (at most
  `max_connections_per_origin`); a request waits up to `pool_acquire_timeout` for one, first come
  first served. Whether an origin has a free slot (`has_free_slot`) and its counts (`load`) are
  O(1), so the forwarder can prefer backends below their cap (docs/data-plane.md, "Per-backend
  connections"). Origins with no connections are dropped, so backends that come and go do not
  accumulate; `close_idle_except` closes the idle connections of backends that left, so their
  origins go at once rather than after `idle_expiry`.
* **Idle bookkeeping is O(1) per request**: idle connections are kept newest-last; a request takes
  the newest one and checks only its age. Nothing polls idle sockets; `close_expired()` is the
  periodic housekeeping.
* **Connect timeout** (docs/data-plane.md, Timeouts): TCP connect plus TLS handshake.
* **Stale connections**: a server may close an idle keep-alive connection at any moment, so a
  reused connection that dies before any response byte is retried once on a fresh connection
  (see `ConnectionPool.request`).
* **Release**: every connection is created with the pool's `_release`, bound to its origin, as
  its callback; a response calls it once when it is done, and the connection is pooled only after
  a complete, reusable response (docs/data-plane.md, Cancellation). The pool alone closes
  connections, since it counts them. `connection.py` never sees an `Origin` (it imports nothing
  of this module): the imports go one way.
"""

from __future__ import annotations

import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Self, TypeVar
from urllib.parse import SplitResult, urlsplit

import trio

from stargate.upstream.config import UpstreamConfig, make_ssl_context
from stargate.upstream.connection import (
    Body,
    Connection,
    UpstreamResponse,
    _DeadBeforeResponse,
    build_request,
    request_bytes,
)
from stargate.upstream.errors import (
    ConnectError,
    ConnectionPoolTimeout,
    UpstreamProtocolError,
)

__all__ = ["ConnectionPool", "ConnectionPoolStats", "Origin", "OriginLoad"]

_T = TypeVar("_T")


class Origin:
    """Per scheme/host/port state: the idle stack, the connection slots and the waiters."""

    __slots__ = (
        "full",
        "host",
        "host_header",
        "idle",
        "key",
        "map_key",
        "port",
        "slots",
        "tls",
        "waiting",
    )

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
        self.idle: deque[Connection] = deque()
        # One slot per connection in use. A new connection is opened only while holding a slot
        # and only when no idle one is left, so open connections never exceed the slot count.
        self.slots = trio.Semaphore(max_connections, max_value=max_connections)
        self.waiting = 0  # requests blocked on `slots`
        self.full = False  # every slot held; counted in `ConnectionPool._full`


@dataclass(frozen=True, slots=True)
class OriginLoad:
    """One origin's connections now: in use (slots held), idle (pooled), and the requests
    waiting for a slot (non-zero only at the cap)."""

    in_use: int = 0
    idle: int = 0
    waiting: int = 0


_NO_LOAD = OriginLoad()


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

    # A frozen dataclass, so one shared default is safe (ruff sees that only in its own module).
    def __init__(self, config: UpstreamConfig = UpstreamConfig()) -> None:  # noqa: B008
        self._config = config
        self._ssl_context = self._config.ssl_context
        self._origins: dict[tuple[str, str], Origin] = {}
        self._closed = False
        self._created = 0
        self._open = 0
        self._in_use = 0
        self._stale_retries = 0
        self._full = 0  # origins with every slot held
        # Backend URL -> `_origins` key, for the per-backend questions (parsing a URL costs
        # about 2 us, asked of every candidate while some origin is full); trimmed to the live
        # backends' URLs by `close_idle_except`.
        self._keys: dict[str, tuple[str, str]] = {}

    @property
    def config(self) -> UpstreamConfig:
        """The configuration this pool was built with."""
        return self._config

    @property
    def origin_count(self) -> int:
        """Origins the pool keeps state for: those with a connection open or a request on one."""
        return len(self._origins)

    @property
    def any_full(self) -> bool:
        """True while some origin has every slot held (O(1)); when False, every backend has a
        free slot and callers can skip asking about each."""
        return self._full > 0

    def has_free_slot(self, url: str) -> bool:
        """Whether a request to `url` (a backend base URL, or any URL of its origin) would get a
        connection slot without waiting. O(1); a URL the pool cannot parse counts as free (the
        request itself then fails with the real error)."""
        if not self._full:
            return True
        origin = self._origins.get(self._key(url))
        return origin is None or not origin.full

    def load(self, url: str) -> OriginLoad:
        """The connections of `url`'s origin now (zeros for an origin with none). O(1)."""
        origin = self._origins.get(self._key(url))
        if origin is None:
            return _NO_LOAD
        in_use = self._config.max_connections_per_origin - origin.slots.value
        return OriginLoad(in_use, len(origin.idle), origin.waiting)

    def close_idle_except(self, urls: Iterable[str]) -> int:
        """Close the idle connections of every origin none of `urls` belongs to; return how many
        were closed.

        For backends that left the fleet: their idle connections would otherwise stay open (and
        their origins kept) until `idle_expiry`, a descriptor and some kilobytes each for every
        engine restart. Connections in use are left alone; their origin goes when the last one
        is released. Visits every origin: housekeeping, not for the request path.
        """
        keys = {url: self._key(url) for url in urls}
        self._keys = keys
        keep = set(keys.values())
        closed = 0
        for origin in list(self._origins.values()):
            if origin.map_key in keep:
                continue
            while origin.idle:
                self._close(origin.idle.pop())
                closed += 1
            self._forget_if_unused(origin)
        return closed

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
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: Body = b""
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
        origin, target = self._resolve_open(url)
        try:
            head = build_request(method, origin.host_header, target, headers, body)
        except BaseException:
            self._forget_if_unused(origin)
            raise
        head_timeout = self._config.response_head_timeout
        return await self._on_a_connection(
            origin, lambda conn: conn.exchange(head, body, head_timeout)
        )

    async def get_status(self, url: str, headers: list[tuple[bytes, bytes]]) -> int:
        """A GET whose answer matters only for its status: the replica's health probes
        (stargate/control_plane/health.py). The answer is read to its end without h11
        (`Connection.get_status`), so a kept-alive connection serves the next probe; `url`,
        `headers`, the stale-connection retry and the errors are `request`'s.
        """
        origin, target = self._resolve_open(url)
        try:
            request = request_bytes(build_request("GET", origin.host_header, target, headers, b""))
        except BaseException:
            self._forget_if_unused(origin)
            raise
        head_timeout = self._config.response_head_timeout
        return await self._on_a_connection(
            origin, lambda conn: conn.get_status(request, head_timeout)
        )

    def _resolve_open(self, url: str) -> tuple[Origin, bytes]:
        if self._closed:
            raise RuntimeError("the upstream pool is closed")
        return self._resolve(url)

    async def _on_a_connection(
        self, origin: Origin, exchange: Callable[[Connection], Awaitable[_T]]
    ) -> _T:
        """Take a slot of `origin`, then run `exchange` on an idle connection (again on a fresh
        one if that one was stale: `request` says when) or a new one."""
        try:
            await self._acquire_slot(origin)
        except BaseException:
            self._forget_if_unused(origin)
            raise
        try:
            # A failed exchange leaves its connection mid-message: it is closed here, whatever
            # the error (the pool alone closes connections, since it counts them).
            conn = self._take_idle(origin)
            if conn is not None:
                try:
                    return await exchange(conn)
                except _DeadBeforeResponse:
                    self._close(conn)
                    self._stale_retries += 1
                except BaseException:
                    self._close(conn)
                    raise
            conn = await self._connect(origin)
            try:
                return await exchange(conn)
            except _DeadBeforeResponse as dead:
                self._close(conn)
                raise UpstreamProtocolError(
                    f"{origin.key} closed the connection without responding",
                    request_sent=dead.request_sent,
                ) from dead.__cause__
            except BaseException:
                self._close(conn)
                raise
        except BaseException:
            self._release_slot(origin)
            raise

    def _key(self, url: str) -> tuple[str, str]:
        key = self._keys.get(url)
        if key is None:
            key = self._keys[url] = _map_key(url)
        return key

    # --- request path internals ---

    def _resolve(self, url: str) -> tuple[Origin, bytes]:
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
    ) -> Origin:
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
        return Origin(
            map_key=map_key,
            key=f"{scheme}://{shown}:{port}",
            host=host,
            port=port,
            host_header=host_header,
            tls=tls,
            max_connections=self._config.max_connections_per_origin,
        )

    async def _acquire_slot(self, origin: Origin) -> None:
        slots = origin.slots
        try:
            slots.acquire_nowait()
        except trio.WouldBlock:
            acquired = False
            origin.waiting += 1
            try:
                with trio.move_on_after(self._config.pool_acquire_timeout):
                    await slots.acquire()
                    acquired = True
            finally:
                origin.waiting -= 1
            if not acquired:
                raise ConnectionPoolTimeout(
                    f"no free connection to {origin.key} within "
                    f"{self._config.pool_acquire_timeout}s "
                    f"({self._config.max_connections_per_origin} in use)"
                ) from None
        self._in_use += 1
        if slots.value == 0 and not origin.full:
            origin.full = True
            self._full += 1

    def _release_slot(self, origin: Origin) -> None:
        self._in_use -= 1
        origin.slots.release()
        # A slot released to a waiter passes straight to it: the origin stays full.
        if origin.full and origin.slots.value > 0:
            origin.full = False
            self._full -= 1
        self._forget_if_unused(origin)

    def _take_idle(self, origin: Origin) -> Connection | None:
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

    async def _connect(self, origin: Origin) -> Connection:
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
        # The connection's responses give it back through `_release`, bound to its origin (see
        # `Release`): the connection itself knows only the origin's name.
        return Connection(origin.key, stream, socket_stream, partial(self._release, origin))

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            self._ssl_context = make_ssl_context(self._config.ca_file)
        return self._ssl_context

    # --- connection bookkeeping ---

    def _release(self, origin: Origin, conn: Connection, reusable: bool) -> None:
        """A response is done with `conn`, a connection of `origin`: pool it if it can carry
        another request, else close.

        Bound to the origin, the `Release` callback of every connection this pool creates.
        """
        if reusable and not self._closed and self._config.max_idle_per_origin > 0:
            if conn.ready_for_next():
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

    def _close(self, conn: Connection) -> None:
        if conn.close():
            self._open -= 1

    @staticmethod
    def _close_socket(socket_stream: trio.SocketStream | None) -> None:
        if socket_stream is not None:
            socket_stream.socket.close()

    def _forget_if_unused(self, origin: Origin) -> None:
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


def _map_key(url: str) -> tuple[str, str]:
    """The `_origins` key of a URL: scheme and netloc, as `ConnectionPool._resolve` makes it
    (a key no origin has for a URL that does not parse)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return ("", url)
    return (parts.scheme, parts.netloc)
