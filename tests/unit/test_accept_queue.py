"""Closing a listener without resetting what the kernel already accepted (stargate/accept_queue.py,
docs/rolling-restarts.md "Closing the listener"), and the two drain races of a server served with
`serving.serve_asgi`: a connection still in the kernel's accept queue when the shutdown begins, and
a connection accepted just before it whose request arrives after (hypercorn_patches
`_wait_for_first_request`). Real sockets on loopback; Linux only, like the filter."""

from __future__ import annotations

import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
import trio
import trio.testing

from stargate.accept_queue import queued_connections, stop_new_connections
from stargate.asgi import ASGIReceive, ASGIScope, ASGISend, answer_lifespan
from stargate.config import ListenAddress
from stargate.serving import bind_listener, hypercorn_config, serve_asgi

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SO_ATTACH_FILTER and TCP_INFO")

REQUEST = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


@contextmanager
def _listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield sock
    finally:
        sock.close()


def _handshake_completes(address: tuple[str, int], timeout: float = 0.3) -> bool:
    client = socket.socket()
    client.settimeout(timeout)
    try:
        client.connect(address)
    except TimeoutError:
        return False
    finally:
        client.close()
    return True


def test_queued_connections_is_the_accept_queue_length() -> None:
    with _listener() as sock:
        assert queued_connections(sock) == 0
        clients = [socket.create_connection(sock.getsockname()) for _ in range(3)]
        assert queued_connections(sock) == 3
        accepted, _ = sock.accept()
        assert queued_connections(sock) == 2
        for each in [accepted, *clients]:
            each.close()


async def test_after_stop_no_handshake_completes_and_queued_connections_still_work() -> None:
    with _listener() as sock:
        address = sock.getsockname()
        queued = socket.create_connection(address)
        queued.sendall(b"sent before the stop")
        with trio.move_on_after(0.05):
            await stop_new_connections(sock)  # nobody accepts: it would wait its full second
        assert not _handshake_completes(address)  # the SYN is dropped
        assert queued_connections(sock) == 1
        accepted, _ = sock.accept()
        assert accepted.recv(100) == b"sent before the stop"
        accepted.sendall(b"answer")
        assert queued.recv(100) == b"answer"
        accepted.close()
        queued.close()
    refused = socket.socket()
    with pytest.raises(ConnectionRefusedError):
        refused.connect(address)  # closed: the client's retransmitted SYN is refused
    refused.close()


async def test_stop_returns_once_the_accept_loop_has_taken_the_queue() -> None:
    with _listener() as sock:
        clients = [socket.create_connection(sock.getsockname()) for _ in range(2)]
        taken: list[socket.socket] = []

        async def accept_loop() -> None:
            await trio.sleep(0.1)
            for _ in clients:
                taken.append(sock.accept()[0])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_loop)
            started = trio.current_time()
            await stop_new_connections(sock)
            assert trio.current_time() - started < 0.9  # before its deadline
            assert len(taken) == 2 and queued_connections(sock) == 0
        for each in [*taken, *clients]:
            each.close()


# --- the drain of a served listener --------------------------------------------------------------


async def _app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"served"})


@asynccontextmanager
async def _served(
    on_stop: Callable[[socket.socket], None] = lambda sock: None,
) -> AsyncIterator[tuple[socket.socket, trio.Event]]:
    """Serve `_app`; once the yielded event is set, `on_stop(listener)` runs as the last step
    of the shutdown trigger, with no checkpoint before the server acts on it."""
    sock = bind_listener("HTTP", ListenAddress("127.0.0.1", 0))
    stop = trio.Event()

    async def trigger() -> None:
        await stop.wait()
        on_stop(sock)

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_asgi, _app, sock, hypercorn_config(5.0), trigger)
        try:
            yield sock, stop
        finally:
            stop.set()


async def _answer(client: trio.SocketStream) -> bytes:
    received = b""
    with trio.fail_after(5):
        while chunk := await client.receive_some(65536):
            received += chunk
    return received


async def test_a_connection_queued_when_the_shutdown_begins_is_served() -> None:
    queued: list[socket.socket] = []

    def connect(sock: socket.socket) -> None:
        # Connected and its request sent as the shutdown begins, with no checkpoint after: the
        # server's accept loop has not run, so the connection is in the kernel's queue.
        raw = socket.create_connection(sock.getsockname())
        raw.sendall(REQUEST)
        assert queued_connections(sock) == 1
        queued.append(raw)

    async with _served(connect) as (_, stop):
        stop.set()
        with trio.fail_after(5):
            while not queued:  # noqa: ASYNC110 (set inside the server's shutdown trigger)
                await trio.sleep(0.001)
        raw = queued[0]
        raw.setblocking(False)
        client = trio.SocketStream(trio.socket.from_stdlib_socket(raw))
        answer = await _answer(client)
        await client.aclose()
    assert answer.startswith(b"HTTP/1.1 200 ")  # whole, then closed (`_answer` reads to the end)
    assert answer.endswith(b"6\r\nserved\r\n0\r\n\r\n")


async def test_a_connection_accepted_before_the_drain_gets_its_first_request_served() -> None:
    async with _served() as (sock, stop):
        client = await trio.open_tcp_stream(*sock.getsockname()[:2])
        while queued_connections(sock):  # noqa: ASYNC110 (the kernel's queue has no event)
            await trio.sleep(0.001)
        await trio.testing.wait_all_tasks_blocked()  # accepted, idle, its keep-alive timer on
        stop.set()
        await trio.sleep(0.2)  # the drain has begun: Hypercorn closed idle connections at once
        await client.send_all(REQUEST)
        answer = await _answer(client)
        await client.aclose()
    assert answer.startswith(b"HTTP/1.1 200 ")  # whole, then closed (`_answer` reads to the end)
    assert answer.endswith(b"6\r\nserved\r\n0\r\n\r\n")
