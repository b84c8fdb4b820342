"""stargate/hypercorn_patches/accept.py: the accept loop under Hypercorn's listeners starts every
connection the kernel has queued in one pass of the scheduler (docs/performance.md, "Side by side
with the peers"), against real loopback sockets."""

from __future__ import annotations

import socket
from typing import Any

import trio

import stargate.serving  # noqa: F401  (installs the patches, this one included)
from stargate.hypercorn_patches import accept

QUEUED = 20


class _CountingNursery:
    """A nursery that counts the handlers started through it."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.started = 0

    def start_soon(self, fn: Any, *args: Any) -> None:
        self.started += 1
        self.nursery.start_soon(fn, *args)


def _listener_with_queued_connections() -> tuple[socket.socket, list[socket.socket]]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    clients = [socket.create_connection(listener.getsockname()) for _ in range(QUEUED)]
    return listener, clients  # every handshake is complete: the kernel has queued them


async def test_every_queued_connection_is_started_before_the_first_handler_runs() -> None:
    """Trio's own loop yields after each accept, so its first handler runs with one or two
    connections started; this loop has started all of them by then."""
    listener, clients = _listener_with_queued_connections()
    seen_by_first: list[int] = []
    done = trio.Event()
    handled = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal handled
        if not seen_by_first:
            seen_by_first.append(counting.started)
        handled += 1
        if handled == QUEUED:
            done.set()

    try:
        async with trio.open_nursery() as nursery:
            counting = _CountingNursery(nursery)
            trio_listener = trio.SocketListener(trio.socket.from_stdlib_socket(listener))
            nursery.start_soon(
                trio._highlevel_serve_listeners._serve_one_listener,  # what serve_listeners calls
                trio_listener,
                counting,
                handler,
            )
            with trio.fail_after(5):
                await done.wait()
            nursery.cancel_scope.cancel()
    finally:
        for client in clients:
            client.close()
    assert trio._highlevel_serve_listeners._serve_one_listener is accept.serve_one_listener
    assert seen_by_first == [QUEUED]


async def test_a_tls_listener_is_left_to_accept_one_at_a_time() -> None:
    assert accept.queued_streams(object(), 10) == []


async def test_taking_the_queue_stops_where_the_kernel_has_nothing_more() -> None:
    listener, clients = _listener_with_queued_connections()
    try:
        listener.setblocking(False)
        trio_listener = trio.SocketListener(trio.socket.from_stdlib_socket(listener))
        taken = accept.queued_streams(trio_listener, 5)
        assert len(taken) == 5  # the limit
        rest = accept.queued_streams(trio_listener, 100)
        assert len(rest) == QUEUED - 5
        assert accept.queued_streams(trio_listener, 100) == []
        for stream in [*taken, *rest]:
            await stream.aclose()
    finally:
        for client in clients:
            client.close()
        listener.close()
