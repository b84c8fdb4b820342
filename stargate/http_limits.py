"""Limits on what one client can hold on the replica's HTTP listener: a request body that stalls,
and connections that pile up (docs/http-serving.md, "Limits").

Hypercorn closes a connection whose request head does not arrive within its keep-alive timeout
(5 s), but once a head is complete nothing bounds the body: a client that sends it at one byte a
second, or never, held its connection, counted as a request in flight, and kept every graceful
shutdown waiting until the drain deadline. And nothing bounds connections: some 35 such clients
on a replica with a scaled-down descriptor table left no descriptor for the kubelet's probes or
for real requests. Two limits close that:

* **Request body time** (`limit_request_body_time`, `--request-body-timeout-ms`): a request whose
  body has not fully arrived that long after its head is answered 408 and its connection closed
  (HTTP/2: the stream is reset, the connection stays). Its app is cancelled, so it stops counting
  as in flight and no longer holds a drain. A response already under way is cut instead.
* **Client connections** (`ConnectionLimit`, `--max-client-connections`): the listener counts its
  open connections. Up to the cap they are served as usual; past it, up to `CONNECTION_RESERVE`
  more are accepted but serve only the probes (`PROBE_PATHS`), every other request there getting
  503 `too_many_connections` with `Connection: close`, so the kubelet keeps reaching `/healthz`
  and `/readyz` when clients have taken every slot. A reserve connection is promoted to a normal
  one when a normal one closes. Past the reserve a connection is still accepted, but only to be
  told the replica is full: its HTTP/1.1 request is answered the same 503 and the connection
  closed, its HTTP/2 streams are refused (REFUSED_STREAM, then GOAWAY naming stream 0: nothing
  was processed, the client may retry elsewhere), and whatever it does it is closed
  `REFUSAL_DEADLINE` after its accept, so refused connections hold a descriptor only briefly and
  cannot pile up. A client past the cap thus gets an answer it can act on, where it used to see a
  bare close it could not tell from a crash.

  The cap is computed from the descriptor budget unless given (`connection_cap`): at start-up the
  soft `RLIMIT_NOFILE` is raised to the hard limit (as Go's runtime does), and the cap is what
  fits in it at two descriptors per connection (the client's and the upstream connection its
  request may hold) after the reserve and `DESCRIPTOR_HEADROOM` (`computed_cap`, the inverse of
  `descriptors_needed`). A cap given explicitly wins, with a warning when it does not fit.

Both apply to the HTTP listener only (proxy routes and the admin app): gRPC registration streams
are long-lived by design, and Pylon channels are not client connections (`limit_http_clients`
puts both on the HTTP listener). The body limit is an ASGI wrapper (`limit_request_body_time`).
The connection count is this module's policy (`ConnectionLimit`, the reserve's gate); Hypercorn
applies it to the listeners registered with `limit_connections` through the patches of
stargate/hypercorn_patches/ (limits.py there), installed when `stargate/serving.py` is imported.
On those listeners an HTTP/2 stream whose response is complete while its request body is not is
reset with NO_ERROR (RFC 9113 §8.1), the HTTP/2 counterpart of closing an HTTP/1.1 connection
after such an answer.

The answers the limits make follow the error contract (docs/clients.md, "Error bodies"): a bare
status with `x-stargate-error-code`, or, through the `Refusal` the runtime passes, the OpenAI error
document for an OpenAI-form request.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import resource
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.typing import AppWrapper

from stargate import hypercorn_patches
from stargate.asgi import ASGIApp, ASGIMessage, ASGIReceive, ASGIScope, ASGISend
from stargate.metrics import HttpMetrics

__all__ = [
    "CONNECTION_RESERVE",
    "DESCRIPTOR_HEADROOM",
    "MIN_COMPUTED_CAP",
    "PROBE_PATHS",
    "REFUSAL_DEADLINE",
    "UNLIMITED_OPEN_FILES",
    "Admission",
    "ConnectionLimit",
    "Refusal",
    "admission",
    "apply",
    "bare_refusal",
    "check_open_file_limit",
    "computed_cap",
    "connection_cap",
    "descriptors_needed",
    "limit_connections",
    "limit_http_clients",
    "limit_request_body_time",
    "raise_open_file_limit",
]

log = logging.getLogger(__name__)

CONNECTION_RESERVE = 32
"""Connections accepted past `--max-client-connections` that serve only the probes: room for the
kubelet's probes (a new connection each, every few seconds) and an operator's curl."""

PROBE_PATHS = frozenset({"/healthz", "/readyz"})
"""The paths a reserve connection serves (the admin app's probes, stargate/admin_app.py)."""

DESCRIPTOR_HEADROOM = 128
"""Descriptors a replica needs besides its client connections and their upstream connections:
the four listeners, Pylon registration channels, backend health probes, idle upstream keep-alive
connections, log files, and the connections past the reserve while they are answered. An idle
replica holds about 30 of them (docs/http-serving.md, "Limits")."""

MIN_COMPUTED_CAP = 8
"""The computed cap's floor, for an open-file limit too small to fit the reserve and the headroom
(below 176 descriptors): such a replica is misconfigured (the start-up warning says so), but still
serves a few connections, and its probes, rather than refusing everything."""

UNLIMITED_OPEN_FILES = 1_048_576
"""What an unlimited open-file limit (`RLIM_INFINITY`) counts as when computing the cap: Linux
never grants one process more descriptors than `fs.nr_open`, 1,048,576 by default (also
containerd's default hard limit), so no replica can use more; memory bounds connections long
before that (README, "What one replica holds")."""

REFUSAL_DEADLINE = 2.0
"""Seconds a connection accepted past the cap and the reserve stays open at most: room for its
request head to arrive (one round trip after the handshake) and for the answer, even on a busy
event loop; then it is closed whatever it is doing, so a flood of idle connections past the cap
cannot hold descriptors."""

Headers = list[tuple[bytes, bytes]]

Refusal = Callable[[Iterable[tuple[bytes, bytes]], int, str, str], tuple[Headers, bytes]]
"""Builds a limit's answer from the request's headers, the status, the error code and a message:
the headers (with `x-stargate-error-code`) and the body."""


def bare_refusal(
    headers: Iterable[tuple[bytes, bytes]], status: int, code: str, message: str
) -> tuple[Headers, bytes]:
    """The Rust-form answer: no body, the code in `x-stargate-error-code`."""
    return [(b"x-stargate-error-code", code.encode())], b""


async def _refuse(
    scope: ASGIScope,
    send: ASGISend,
    refusal: Refusal,
    status: int,
    code: str,
    message: str,
    extra: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Answer `status` and end the exchange: `Connection: close` on HTTP/1.x (the connection
    closes after it); on HTTP/2, which has no such header, the stream ends."""
    headers, body = refusal(scope["headers"], status, code, message)
    headers = [*headers, *extra, (b"content-length", str(len(body)).encode())]
    if scope.get("http_version") in ("1.0", "1.1"):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# --- request body time ---------------------------------------------------------------------------


@dataclass
class _BodyWatch:
    """One exchange's body: whether it has all arrived (or the client left), whether the app has
    started its response, and whether the deadline passed first."""

    arrived: trio.Event
    started: bool = False
    expired: bool = False


def limit_request_body_time(
    app: ASGIApp,
    timeout: float,
    refusal: Refusal = bare_refusal,
    *,
    metrics: HttpMetrics | None = None,
) -> ASGIApp:
    """Wrap `app` so a request body must have fully arrived `timeout` seconds after the head.

    The app starts when Hypercorn has the head, and reads the body through `receive()`; every app
    on the HTTP listener reads it as it arrives (the proxy buffers it for replay, Quart reads it
    eagerly), so a body the app has not seen by the deadline has not arrived. Then the app is
    cancelled (as a shutdown would), and the exchange is answered 408 `request_body_timeout`
    with `Connection: close`, or, if the app had started a response, ended unfinished: Hypercorn
    then closes an HTTP/1.1 connection, and resets an HTTP/2 stream. A 408 on HTTP/2 ends its
    stream; the reset after it asks the client to stop sending (`apply()`).
    """

    async def limited(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        watch = _BodyWatch(trio.Event())

        async def receive_watched() -> ASGIMessage:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                watch.arrived.set()  # the whole body, or the client left
            return message

        async def send_watched(message: ASGIMessage) -> None:
            if message["type"] == "http.response.start":
                watch.started = True
            await send(message)

        async def expire(app_scope: trio.CancelScope) -> None:
            with trio.move_on_after(timeout):
                await watch.arrived.wait()
                return
            watch.expired = True
            app_scope.cancel()

        with trio.CancelScope() as app_scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(expire, app_scope)
                await app(scope, receive_watched, send_watched)
                nursery.cancel_scope.cancel()
        if not watch.expired:
            return
        if metrics is not None:
            metrics.request_body_timeouts.inc()
        log.debug(
            "request body not complete %g s after its head: %s %s from %s",
            timeout,
            scope.get("method"),
            scope.get("path"),
            _client(scope),
        )
        if not watch.started:
            message = f"the request body did not arrive within {timeout:g} s"
            async with trio.open_nursery() as nursery:
                # The app no longer reads: keep Hypercorn's queue to it (10 messages) moving, or
                # the `http.disconnect` the answer's last send produces could wait on it forever.
                nursery.start_soon(_discard, receive)
                await _refuse(scope, send, refusal, 408, "request_body_timeout", message)
                nursery.cancel_scope.cancel()

    return limited


async def _discard(receive: ASGIReceive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _client(scope: ASGIScope) -> str:
    client = scope.get("client")
    return "unknown" if not client else f"{client[0]}:{client[1]}"


# --- client connections --------------------------------------------------------------------------


class Admission(enum.Enum):
    """What a newly accepted connection gets."""

    SERVE = "serve"  # a normal slot
    RESERVE = "reserve"  # a reserve slot: probes only
    REFUSE = "refuse"  # answered that the replica is full, closed by `REFUSAL_DEADLINE`


def admission(open_connections: int, cap: int, reserve: int) -> Admission:
    """The decision for a new connection while `open_connections` (normal and reserve) are open
    (pure). `cap` 0 means unlimited."""
    if cap == 0 or open_connections < cap:
        return Admission.SERVE
    if open_connections < cap + reserve:
        return Admission.RESERVE
    return Admission.REFUSE


def descriptors_needed(cap: int, reserve: int = CONNECTION_RESERVE) -> int:
    """File descriptors a replica may need at `cap` client connections: two per normal slot (the
    client connection and the upstream connection its request may hold), one per reserve slot
    (probes hold no upstream connection), plus `DESCRIPTOR_HEADROOM`."""
    return 2 * cap + reserve + DESCRIPTOR_HEADROOM


def computed_cap(open_files: int, reserve: int = CONNECTION_RESERVE) -> int:
    """The largest cap whose `descriptors_needed` fits in `open_files` (pure): `(open_files -
    reserve - DESCRIPTOR_HEADROOM) // 2`, at least `MIN_COMPUTED_CAP`. An unlimited limit
    (`resource.RLIM_INFINITY`, or anything negative) counts as `UNLIMITED_OPEN_FILES`."""
    if open_files < 0 or open_files == resource.RLIM_INFINITY:
        open_files = UNLIMITED_OPEN_FILES
    return max(MIN_COMPUTED_CAP, (open_files - reserve - DESCRIPTOR_HEADROOM) // 2)


@dataclass(eq=False)
class _Slot:
    reserved: bool
    refused: bool = False  # past the reserve: answered, then closed
    released: bool = False


class ConnectionLimit:
    """The open client connections of one listener, and what each new one gets (`admission`).

    Invariant: the normal slots in use are `min(open, cap)`; when a normal connection closes, the
    oldest reserve connection (if any) takes its slot. Connections past the reserve (`refusing`)
    are counted apart: they take no slot and are never promoted.
    """

    def __init__(
        self,
        cap: int,
        reserve: int = CONNECTION_RESERVE,
        *,
        refusal: Refusal = bare_refusal,
        metrics: HttpMetrics | None = None,
    ) -> None:
        if cap < 0 or reserve < 0:
            raise ValueError("connection cap and reserve must not be negative")
        self.cap = cap
        self.reserve = reserve
        self.refusal = refusal
        self.metrics = metrics
        self.open = 0
        self.refusing = 0
        self._reserved: deque[_Slot] = deque()

    def admit(self) -> _Slot:
        """Count a new connection: its slot (`refused` past the reserve: counted as a refusal
        now, answered and closed by its gate)."""
        decision = admission(self.open, self.cap, self.reserve)
        if decision is Admission.REFUSE:
            self.refused("full")
            self.refusing += 1
            self._publish()
            return _Slot(reserved=False, refused=True)
        slot = _Slot(reserved=decision is Admission.RESERVE)
        if slot.reserved:
            self._reserved.append(slot)
        self.open += 1
        self._publish()
        return slot

    def release(self, slot: _Slot) -> None:
        """The connection closed (idempotent)."""
        if slot.released:
            return
        slot.released = True
        if slot.refused:
            self.refusing -= 1
            self._publish()
            return
        self.open -= 1
        if slot.reserved:
            self._reserved.remove(slot)
        elif self._reserved:
            self._reserved.popleft().reserved = False
        self._publish()

    def refused(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.connection_refusals.labels(reason=reason).inc()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.client_connections.set(self.open + self.refusing)


class _Gate:
    """The app of a connection accepted in the reserve or past it: probes pass; any other request
    is answered 503 `too_many_connections` with `Connection: close` (a reserve connection: until
    it is promoted to a normal slot). Past the reserve its HTTP/2 side refuses every stream
    instead (`REFUSES_STREAMS`, read by stargate/hypercorn_patches/h2.py)."""

    def __init__(self, app: AppWrapper, slot: _Slot, limit: ConnectionLimit) -> None:
        self.app = app
        self.slot = slot
        self.limit = limit
        setattr(self, hypercorn_patches.REFUSES_STREAMS, slot.refused)

    async def __call__(
        self,
        scope: ASGIScope,
        receive: ASGIReceive,
        send: ASGISend,
        sync_spawn: Callable[..., Any],
        call_soon: Callable[..., Any],
    ) -> None:
        limited = self.slot.reserved or self.slot.refused
        if scope["type"] == "http" and limited and scope["path"] not in PROBE_PATHS:
            if not self.slot.refused:  # a refused connection was counted when accepted
                self.limit.refused("reserve")
            await _refuse(
                scope,
                send,
                self.limit.refusal,
                503,
                "too_many_connections",
                "the replica has no connection slot free; retry later",
                [(b"retry-after", b"1")],
            )
            return
        await self.app(scope, receive, send, sync_spawn, call_soon)  # type: ignore[arg-type]


def limit_connections(config: HypercornConfig, limit: ConnectionLimit) -> None:
    """Count the connections of the listener served with `config` against `limit`, and reset its
    HTTP/2 streams answered before their request body (module docstring). Call before serving.

    A connection is counted from its accept to the close of its socket; one in the reserve is
    served through `_Gate`, and so is one past it, which is closed `REFUSAL_DEADLINE` after its
    accept at the latest."""

    def admit(app: AppWrapper) -> hypercorn_patches.Admitted:
        slot = limit.admit()
        if slot.reserved or slot.refused:
            app = cast(AppWrapper, _Gate(app, slot, limit))
        release = functools.partial(limit.release, slot)
        return hypercorn_patches.Admitted(app, release, REFUSAL_DEADLINE if slot.refused else None)

    hypercorn_patches.gate_connections(config, admit)


def limit_http_clients(
    app: ASGIApp,
    listener: HypercornConfig,
    *,
    body_timeout: float | None,
    max_connections: int,
    refusal: Refusal = bare_refusal,
    metrics: HttpMetrics | None = None,
) -> ASGIApp:
    """Put both limits on the HTTP listener: the request body time on `app` (none when
    `body_timeout` is None: `--request-body-timeout-ms 0`), the connection count on the listener
    served with `listener` (`--max-client-connections`, limited in place). Returns the app to
    serve. Call before serving; gRPC listeners get neither (module docstring)."""
    if body_timeout is not None:
        app = limit_request_body_time(app, body_timeout, refusal, metrics=metrics)
    limit_connections(listener, ConnectionLimit(max_connections, refusal=refusal, metrics=metrics))
    return app


def raise_open_file_limit() -> int:
    """Raise the soft `RLIMIT_NOFILE` to the hard limit, as Go's runtime does at start-up, and
    return the soft limit now in force (`resource.RLIM_INFINITY` when unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # e.g. an unlimited hard limit on macOS
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft


def connection_cap(configured: int | None, reserve: int = CONNECTION_RESERVE) -> int:
    """At start-up: raise the open-file limit, and return the cap in force: `configured` when
    given (0 = unlimited), warning if it may not fit (`check_open_file_limit`), else the one
    computed from the limit (`computed_cap`), logged at INFO with its arithmetic."""
    if configured is not None:
        check_open_file_limit(configured, reserve)
        return configured
    soft = _raised_open_file_limit()
    cap = computed_cap(soft, reserve)
    unlimited = soft < 0 or soft == resource.RLIM_INFINITY
    limit = f"unlimited, counted as {UNLIMITED_OPEN_FILES}" if unlimited else str(soft)
    log.info(
        "max client connections: %d, computed from the open-file limit (%s): (limit - %d reserve "
        "- %d headroom) / 2 descriptors per connection (client and upstream)%s; "
        "--max-client-connections sets it",
        cap,
        limit,
        reserve,
        DESCRIPTOR_HEADROOM,
        f", at least {MIN_COMPUTED_CAP}" if cap == MIN_COMPUTED_CAP else "",
    )
    if not unlimited and soft < descriptors_needed(cap, reserve):
        _warn_short(soft, cap, reserve)
    return cap


def _raised_open_file_limit() -> int:
    before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    soft = raise_open_file_limit()
    if soft != before:
        log.info("raised the open-file limit (RLIMIT_NOFILE) from %d to %d", before, soft)
    return soft


def check_open_file_limit(cap: int, reserve: int = CONNECTION_RESERVE) -> None:
    """At start-up, for a cap given explicitly: raise the open-file limit, and warn if it is below
    `descriptors_needed`."""
    soft = _raised_open_file_limit()
    if cap == 0 or soft == resource.RLIM_INFINITY:
        return
    if soft < descriptors_needed(cap, reserve):
        _warn_short(soft, cap, reserve)


def _warn_short(soft: int, cap: int, reserve: int) -> None:
    needed = descriptors_needed(cap, reserve)
    if soft < needed:
        log.warning(
            "the open-file limit (%d) is below the %d descriptors --max-client-connections=%d may "
            "need (2 x %d client and upstream connections + %d reserve + %d for listeners, Pylon "
            "channels and health probes): past it, accepting fails and probes time out; raise "
            "the limit (ulimit -n, the container's nofile) or lower --max-client-connections",
            soft,
            needed,
            cap,
            cap,
            reserve,
            DESCRIPTOR_HEADROOM,
        )


# --- the Hypercorn hooks -------------------------------------------------------------------------


def apply() -> None:
    """Install the Hypercorn patches, the hooks of these limits among them (idempotent; importing
    `stargate.serving` does it). Kept for callers of the old name: `hypercorn_patches.install()`."""
    hypercorn_patches.install()
