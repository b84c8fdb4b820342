"""Four of `stargate/hypercorn_fixes.py`'s patches, on Hypercorn's own objects: writes that the
socket takes at once do not go through the scheduler (`_write_at_once`), nor do restarts of the
keep-alive timer (`_restart_idle_timers_at_once`), and every HTTP exchange has a
`DisconnectHook` (`_hook_disconnects`), and a head marked `BODY_FOLLOWS` is written with its body
(`_write_head_with_body`). docs/http-serving.md, "Writes", "Keep-alive timer", "Disconnect hook"
and "Head with the body". The other fixes are covered where their symptoms show:
tests/e2e/test_h2_streams.py, tests/e2e/test_connection_close.py, tests/unit/test_http_limits.py,
tests/unit/test_grpc_asgi.py.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from types import SimpleNamespace

import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask, WorkerContext

from stargate.asgi import (
    BODY_FOLLOWS,
    ASGIReceive,
    ASGIScope,
    ASGISend,
    DisconnectHook,
    answer_lifespan,
    disconnect_hook,
)
from stargate.config import ListenAddress
from stargate.serving import bind_listener, hypercorn_config, serve_asgi

# --- writes --------------------------------------------------------------------------------------


class _Protocol:
    """Stands for Hypercorn's protocol: records the events handed back to it."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    async def handle(self, event: Event) -> None:
        self.events.append(event)


def _server(sock: trio.socket.SocketType) -> tuple[TCPServer, _Protocol]:
    server = TCPServer(
        None,  # type: ignore[arg-type]  # the app: never reached by `protocol_send`
        HypercornConfig(),
        WorkerContext(None),
        {},
        trio.SocketStream(sock),  # type: ignore[arg-type]  # annotated as TLS; plain is allowed
    )
    protocol = _Protocol()
    server.protocol = protocol  # type: ignore[assignment]
    return server, protocol


async def _read_exactly(sock: trio.socket.SocketType, size: int) -> bytes:
    data = b""
    while len(data) < size:
        piece = await sock.recv(65536)
        assert piece, "closed early"
        data += piece
    return data


async def test_a_write_the_socket_takes_whole_does_not_go_through_the_scheduler() -> None:
    """Hypercorn's write takes its lock (a checkpoint) and trio's `send_all` yields after the
    send: another task ran in the middle of every write. Now one that fits is one syscall."""
    ours, peer = trio.socket.socketpair()
    server, protocol = _server(ours)
    ran: list[str] = []

    async def other() -> None:
        ran.append("other")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        await server.protocol_send(RawData(data=b"HTTP/1.1 200 OK\r\n\r\n"))
        await server.protocol_send(RawData(data=b"body"))
        assert ran == []  # nothing else ran: no trip through the scheduler
    assert await _read_exactly(peer, 23) == b"HTTP/1.1 200 OK\r\n\r\nbody"
    assert protocol.events == []
    assert not server.send_lock.locked()


async def test_an_empty_write_writes_nothing_but_stays_a_cancellation_point() -> None:
    ours, peer = trio.socket.socketpair()
    server, _ = _server(ours)
    await server.protocol_send(RawData(data=b""))
    with trio.CancelScope() as scope:
        scope.cancel()
        await server.protocol_send(RawData(data=b"never"))
    assert scope.cancelled_caught
    await server.protocol_send(RawData(data=b"after"))
    assert await _read_exactly(peer, 5) == b"after"


async def test_what_the_socket_does_not_take_follows_in_order() -> None:
    """A write larger than the socket buffer: the rest goes through `send_all` under the lock
    (shielded), and a second write waits for it."""
    ours, peer = trio.socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    server, protocol = _server(ours)
    big = bytes(range(256)) * 4096  # 1 MiB
    received = b""

    async def reader() -> None:
        nonlocal received
        received = await _read_exactly(peer, len(big) + 5)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.protocol_send, RawData(data=big))
        await trio.testing.wait_all_tasks_blocked()  # the big write: the socket is full
        assert server.send_lock.locked()
        nursery.start_soon(reader)
        await server.protocol_send(RawData(data=b"after"))
    assert received == big + b"after"
    assert protocol.events == []
    assert not server.send_lock.locked()


async def test_a_write_to_a_reset_connection_reports_it_closed() -> None:
    ours, peer = trio.socket.socketpair()
    server, protocol = _server(ours)
    peer.close()
    await server.protocol_send(RawData(data=b"x" * 100))
    await server.protocol_send(RawData(data=b"x" * 100))  # EPIPE at the latest
    assert any(isinstance(event, Closed) for event in protocol.events)
    assert not server.send_lock.locked()


# --- the keep-alive timer ------------------------------------------------------------------------


async def test_the_keep_alive_timer_restarts_and_stops_without_the_scheduler() -> None:
    """Hypercorn's restart waited on a lock and for the new task to start, its stop on the lock:
    other tasks ran in the middle of both, on every request. The timer still runs, and is
    cancelled by the next restart or a stop whether or not it has started."""
    timer = TrioSingleTask()
    events: list[str] = []

    async def action(name: str) -> None:
        events.append(f"{name} started")
        try:
            await trio.sleep_forever()
        finally:
            events.append(f"{name} cancelled")

    async def other() -> None:
        events.append("other")

    async with trio.open_nursery() as nursery:
        group = SimpleNamespace(_nursery=nursery)
        nursery.start_soon(other)
        await timer.restart(group, partial(action, "first"))
        await timer.restart(group, partial(action, "second"))  # cancels "first" before it runs
        await timer.stop()
        assert events == []  # nothing else ran in the middle
        await trio.testing.wait_all_tasks_blocked()
        assert "first started" not in events and "second started" not in events
        await timer.restart(group, partial(action, "third"))
        await trio.testing.wait_all_tasks_blocked()
        assert events[-1] == "third started"
        await timer.stop()
    assert events[-1] == "third cancelled"


# --- the disconnect hook -------------------------------------------------------------------------


@asynccontextmanager
async def _served(app: object) -> AsyncIterator[int]:
    sock = bind_listener("HTTP", ListenAddress("127.0.0.1", 0))
    port = sock.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_asgi, app, sock, hypercorn_config(2.0), stop.wait)
        try:
            yield port
        finally:
            stop.set()


REQUEST = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi"


async def test_a_client_leaving_fires_the_hook_without_a_task_in_receive() -> None:
    hooks: list[DisconnectHook | None] = []
    registered = trio.Event()
    cancelled = trio.Event()

    async def app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        hook = disconnect_hook(scope)
        hooks.append(hook)
        assert (await receive())["type"] == "http.request"
        assert hook is not None
        with trio.CancelScope() as gone:
            hook.on_disconnect(gone.cancel)
            registered.set()
            await trio.sleep_forever()  # until the client leaves; nobody waits in receive()
        assert gone.cancelled_caught
        cancelled.set()
        assert (await receive())["type"] == "http.disconnect"  # still delivered

    async with _served(app) as port:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(REQUEST)
        with trio.fail_after(5):
            await registered.wait()
            await client.aclose()
            await cancelled.wait()
    assert isinstance(hooks[0], DisconnectHook)


async def test_the_end_of_a_complete_exchange_does_not_fire_the_hook() -> None:
    """Hypercorn reports `http.disconnect` from inside the final `send()` of every exchange;
    that is not the client leaving, and cancelling there would cancel Hypercorn's bookkeeping
    (complete_response_before_disconnect)."""
    calls: list[str] = []
    done = trio.Event()

    async def app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        hook = disconnect_hook(scope)
        assert hook is not None
        await receive()
        hook.on_disconnect(lambda: calls.append("fired"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        assert hook.disconnected  # the exchange is over, as Hypercorn reported in that send
        await trio.sleep(0.05)
        done.set()

    async with _served(app) as port:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(REQUEST)
        with trio.fail_after(5):
            await done.wait()
        await client.aclose()
    assert calls == []


def test_a_hook_registered_after_the_client_left_fires_at_once() -> None:
    hook = DisconnectHook()
    hook.fire()
    calls: list[str] = []
    hook.on_disconnect(lambda: calls.append("fired"))
    assert calls == ["fired"]
    hook.on_disconnect(None)
    hook.fire()
    assert calls == ["fired"]


# --- the head with the body ----------------------------------------------------------------------


async def _answer_in_two_steps(body_follows: bool) -> tuple[bytes, bytes]:
    """What the client has received after the app sent its head, then after its body."""
    head_sent = trio.Event()
    send_body = trio.Event()

    async def app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        await receive()
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"2")],
        }
        if body_follows:
            start[BODY_FOLLOWS] = True
        await send(start)
        head_sent.set()
        await send_body.wait()
        await send({"type": "http.response.body", "body": b"ok"})

    async with _served(app) as port:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(REQUEST)
        with trio.fail_after(5):
            await head_sent.wait()
            before = b""
            with trio.move_on_after(0.2):
                before = await client.receive_some(65536)
            send_body.set()
            after = before
            while not after.endswith(b"ok"):
                after += await client.receive_some(65536)
        await client.aclose()
    return before, after


async def test_a_head_marked_body_follows_is_written_with_the_body() -> None:
    before, after = await _answer_in_two_steps(body_follows=True)
    assert before == b""  # held: it goes out with the body, in one write
    assert after.startswith(b"HTTP/1.1 200 ") and after.endswith(b"\r\n\r\nok")


async def test_an_unmarked_head_is_written_at_once() -> None:
    before, after = await _answer_in_two_steps(body_follows=False)
    assert before.startswith(b"HTTP/1.1 200 ") and before.endswith(b"\r\n\r\n")
    assert after == before + b"ok"
