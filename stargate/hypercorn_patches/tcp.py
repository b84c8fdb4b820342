"""Patches of Hypercorn's trio connection (`TCPServer`) and its keep-alive timer
(`TrioSingleTask`): a failing connection task ends only its connection, writes that skip the
scheduler, reads without a generator-based timeout, a send racing the close, the first request
through the drain, and the timer restarted without waiting (docs/http-serving.md;
docs/rolling-restarts.md, "Closing the listener").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import h11
import trio
from hypercorn.events import Closed, RawData
from hypercorn.events import Event as IOEvent
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import TrioSingleTask

from stargate.hypercorn_patches import limits
from stargate.hypercorn_patches.state import log, set_release
from stargate.socket_io import SocketReader

__all__ = ["idle_timeout", "peer", "protocol_send", "read_data", "restart", "run", "stop"]

ServerMethod = Callable[[TCPServer], Awaitable[None]]
Send = Callable[[TCPServer, IOEvent], Awaitable[None]]


def run(original: ServerMethod) -> ServerMethod:
    """`TCPServer.run`, the whole life of one connection, with two behaviours in this order:

    1. The listener's connection count (limits.py), outermost: a connection the count refuses is
       closed before Hypercorn reads anything; one in the reserve or past it is served through
       the gate the count gives (probes only; past the reserve, an answer that it is full), and
       one with a deadline (past the reserve) is cut when it passes, so refused connections hold
       their descriptor only briefly; the slot is freed when the socket closes (`limits.close`)
       or, at the latest, when this returns. It is outermost so the slot covers everything the
       connection does, the handling of a failure included, and is freed whatever happens.
    2. Contained failures: an exception that escapes Hypercorn's connection task would reach the
       nursery trio's `serve_listeners` runs every connection in and end the listener, then the
       replica. It is logged once, with its traceback, and only this connection is closed. A
       refused connection runs no Hypercorn code, so there is nothing to contain for it.
    """

    async def run(self: TCPServer) -> None:
        admit = limits.admission(self.config)
        if admit is None:
            await _contained(original, self)
            return
        admitted = admit(self.app)
        if admitted is None:
            await limits.close_at_once(self)
            return
        self.app, release, deadline = admitted
        set_release(self, release)
        try:
            if deadline is None:
                await _contained(original, self)
            else:
                with trio.move_on_after(deadline):  # the stream closes in trio's handler after
                    await _contained(original, self)
        finally:
            release()

    return run


async def _contained(original: ServerMethod, server: TCPServer) -> None:
    name = peer(server.stream)
    try:
        await original(server)
    except* Exception as group:  # trio.Cancelled and KeyboardInterrupt are not Exceptions
        log.error(
            "closing the connection from %s after an unexpected error in its task",
            name,
            exc_info=group,
        )
        with trio.CancelScope(shield=True), contextlib.suppress(Exception):
            await server.stream.aclose()


def peer(stream: object) -> str:
    """`host:port` of a connection's client, for logs."""
    # A TLS connection (`trio.SSLStream`) has its socket on the stream it wraps.
    stream = getattr(stream, "transport_stream", stream)
    sock = getattr(stream, "socket", None)
    try:
        host, port = sock.getpeername()[:2]  # type: ignore[union-attr]
    except (AttributeError, OSError):
        return "unknown"
    return f"{host}:{port}"


def protocol_send(original: Send) -> Send:
    """`TCPServer.protocol_send`, every write and connection event, with two behaviours in this
    order:

    1. Writes at once (a cost; docs/http-serving.md, "Writes"). Hypercorn takes the connection's
       send lock, opens a shielded cancel scope and calls trio's `send_all` for every write: two
       trips through the scheduler (the lock's checkpoint, and the one trio makes after a
       successful send) and four context managers, about 30 us, for what is usually one
       `send(2)` the kernel completes at once. When the lock is free and the stream is a plain
       TCP socket, this takes the lock without waiting, writes directly, and returns without
       yielding if the kernel took everything; what it did not take is sent as before (shielded,
       under the lock), so order and completeness are as before. An empty write (the end of a
       body framed by `content-length`) writes nothing. It is still a cancellation point, as the
       lock was. Anything else (TLS, a busy lock, a closed or half-closed socket, events that are
       not writes) goes to 2.
    2. A send racing the close (a fix), around Hypercorn's own: sends hold `send_lock`, but
       `TCPServer._close` half-closes the socket (`send_eof`) outside it, and trio refuses a send
       that overlaps with `BusyResourceError`. That means the connection is closing under the
       send: it is handled like a send on a closed connection. (1 handles the same race itself.)

    1 comes first because it is the path nearly every write takes; 2 only ever sees what 1
    leaves to Hypercorn.
    """

    async def send_via_hypercorn(self: TCPServer, event: IOEvent) -> None:
        try:
            await original(self, event)
        except trio.BusyResourceError:
            # Sends hold `send_lock`; only `_close`'s `send_eof` does not: the connection is
            # closing under this send, as if it had already closed (the original's handling).
            if not isinstance(event, RawData):
                raise
            await self.protocol.handle(Closed())

    async def protocol_send(self: TCPServer, event: IOEvent) -> None:
        stream: trio.abc.Stream = self.stream  # annotated as TLS; plain TCP is a SocketStream
        lock = self.send_lock
        if type(event) is not RawData or not isinstance(stream, trio.SocketStream) or lock.locked():
            await send_via_hypercorn(self, event)
            return
        sock = stream.socket
        fd = sock.fileno()
        if fd < 0 or sock.did_shutdown_SHUT_WR:
            await send_via_hypercorn(self, event)  # closed: the original's handling
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        data = event.data
        if not data:
            return
        closed = False
        lock.acquire_nowait()
        try:
            try:
                sent = os.write(fd, data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                with trio.CancelScope(shield=True):
                    await stream.send_all(memoryview(data)[sent:])
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            closed = True
        except trio.BusyResourceError:
            closed = True  # `_close` is half-closing the socket (2 above)
        finally:
            lock.release()
        if closed:
            await self.protocol.handle(Closed())

    return protocol_send


async def read_data(self: TCPServer) -> None:
    """`TCPServer._read_data`, rewritten: every read the connection makes, with two behaviours
    in this order:

    1. Reads without `trio.fail_after`, and on plain TCP waiting for readability before the
       read (`SocketReader`, stargate/socket_io.py) rather than after a failed one (costs;
       docs/http-serving.md, "Reads"). Hypercorn wraps each read in `trio.fail_after(read_timeout
       or inf)`, a generator-based context manager around a cancel scope, entered and left once
       a request (once a heartbeat on a registration stream): about 3 % of the replica's CPU at
       1,000 Pylons, 2 % of a proxied request. With no read timeout (stargate sets none:
       Hypercorn's default) the read has no scope at all, as `fail_after(inf)` never fires;
       with one, a bare cancel scope with the deadline does what `fail_after` did (the
       connection ends when it passes). Everything else is the original's: the same errors end
       the loop, every read goes to the protocol, and `Closed` follows the last.
    2. A counted connection whose client closed its side stops its keep-alive timer
       (`limits.client_closed`), after the loop, as the original's wrapper did.
    """
    timeout = self.config.read_timeout
    stream: trio.abc.Stream = self.stream  # annotated as TLS; plain TCP is a SocketStream
    receive: Callable[[], Awaitable[bytes | bytearray]] = partial(stream.receive_some, MAX_RECV)
    if isinstance(stream, trio.SocketStream):
        receive = SocketReader(stream.socket, MAX_RECV).receive
    while True:
        try:
            if not timeout:  # the original's `fail_after(inf)`
                data = await receive()
            else:
                with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
                    data = await receive()
                if scope.cancelled_caught:
                    break
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            break
        await self.protocol.handle(RawData(bytes(data)))
        if data == b"":
            break
    await self.protocol.handle(Closed())
    await limits.client_closed(self)  # the client closed, or the socket did


async def idle_timeout(self: TCPServer) -> None:
    """`TCPServer._idle_timeout`, rewritten: through the drain, a connection without a request yet
    keeps its keep-alive timeout as its first-request deadline.

    When a server stops accepting, Hypercorn ends every idle connection at once, and a connection
    accepted an instant before, whose request is still on its way, is idle too: its client had
    connected and sent its request, and read a closed connection (or a reset) instead of an
    answer, during every rolling restart under load (tests/faults/test_sigterm_under_load.py). It
    is now closed after its one answer, as every connection is then.
    """
    with trio.move_on_after(self.config.keep_alive_timeout):
        await self.context.terminated.wait()
        if not _had_request(self):
            await trio.sleep_forever()  # until its first request stops this timer
    with trio.CancelScope(shield=True):
        await self._initiate_server_close()


def _had_request(server: TCPServer) -> bool:
    """Whether the connection has received a request (a complete request head) yet."""
    protocol = server.protocol.protocol
    if isinstance(protocol, H2Protocol):
        return bool(protocol.connection.highest_inbound_stream_id)
    connection = protocol.connection  # h11, or a WebSocket's (upgraded by a request)
    return not isinstance(connection, h11.Connection) or connection.their_http_version is not None


# --- the keep-alive timer (a cost; docs/http-serving.md, "Keep-alive timer") ----------------------
#
# Hypercorn stops the timer when a request arrives and restarts it when the response is done:
# each under an async lock (a checkpoint, so a trip through the scheduler) and the restart with
# `nursery.start`, which waits for the new timer task to run up to its `started()`. Together about
# 45 us a request. Neither needs to wait: the new task gets its cancel scope up front
# (`start_soon`), so cancelling it before it runs is the same as cancelling it after, and with no
# await between reading and replacing the handle there is nothing for the lock to serialise. The
# timer itself (`TCPServer._idle_timeout`) is unchanged.


async def _run_in(scope: trio.CancelScope, action: Callable[[], Awaitable[None]]) -> None:
    if scope.cancel_called:
        return  # stopped or restarted before it ran
    with scope:
        await action()


async def restart(
    self: TrioSingleTask, task_group: Any, action: Callable[[], Awaitable[None]]
) -> None:
    """`TrioSingleTask.restart`, rewritten: no lock, no `nursery.start`."""
    if self._handle is not None:
        self._handle.cancel()
    scope = self._handle = trio.CancelScope()
    task_group._nursery.start_soon(_run_in, scope, action)


async def stop(self: TrioSingleTask) -> None:
    """`TrioSingleTask.stop`, rewritten: no lock."""
    if self._handle is not None:
        self._handle.cancel()
    self._handle = None
