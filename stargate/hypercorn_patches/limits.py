"""The Hypercorn side of the HTTP listener's client limits (the policy, the answers and the
request-body deadline are in stargate/http_limits.py; docs/http-serving.md, "Limits").

A listener registered with `gate_connections` (by `http_limits.limit_connections`) has its
connections counted from accept to the close of their socket (`TCPServer.run`, in tcp.py, admits;
`close` below, or at the latest the end of the connection's task, releases), and its HTTP/2
streams answered before their request body reset with NO_ERROR (`reset_answered_early`, run by
`H2Protocol._close_stream` in h2.py). A connection admitted only to be told the listener is full
carries a deadline (`state.Admitted`, enforced by tcp.py) and, through its app, the mark that makes
h2.py refuse its streams (`state.REFUSES_STREAMS`). Other listeners are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import h2.errors
import h2.exceptions
import trio
from h2.stream import StreamState
from hypercorn.config import Config as HypercornConfig
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio.tcp_server import TCPServer

from stargate.hypercorn_patches.state import (
    Admit,
    listener,
    listener_if_any,
    release_of,
    set_release,
)

__all__ = ["admission", "client_closed", "close", "close_at_once", "gate_connections"]

ServerMethod = Callable[[TCPServer], Awaitable[None]]


def gate_connections(config: HypercornConfig, admit: Admit) -> None:
    """Count the connections of the listener served with `config` with `admit`. Call before
    serving."""
    listener(config).admit = admit


def admission(config: HypercornConfig) -> Admit | None:
    """The connection count of the listener served with `config`, if it has one."""
    state = listener_if_any(config)
    return None if state is None else state.admit


async def close_at_once(server: TCPServer) -> None:
    """Close a connection the count refused, before Hypercorn has read anything from it."""
    with trio.CancelScope(shield=True), contextlib.suppress(Exception):
        await server.stream.aclose()


def close(original: ServerMethod) -> ServerMethod:
    """`TCPServer._close`: a counted connection frees its slot once its socket is closed."""

    async def close(self: TCPServer) -> None:
        try:
            await original(self)
        finally:
            release = release_of(self)
            if release is not None:
                set_release(self, None)
                release()

    return close


async def client_closed(server: TCPServer) -> None:
    """Run by `TCPServer._read_data` (tcp.py) when its connection will read nothing more: once
    the client of a counted connection has closed its side, nothing more can arrive, so the
    keep-alive timer is stopped and the socket closes as soon as whatever request was in progress
    has ended (its app hears `http.disconnect` right away).

    A connection the client closes before sending a request used to stay open (CLOSE-WAIT) until
    Hypercorn's keep-alive timer fired, up to 5 s later, and so kept its slot: a TCP health check
    or a port scan held one slot per connection for 5 s.
    """
    if release_of(server) is not None:
        await server.idle_task.stop()


async def reset_answered_early(proto: H2Protocol, stream_id: int) -> None:
    """On a limited listener, once an exchange is over: a stream whose response is complete while
    its request body is not (h2's HALF_CLOSED_LOCAL) is reset with NO_ERROR, RFC 9113 §8.1's way
    to tell the client it may stop sending; the HTTP/2 counterpart of closing an HTTP/1.1
    connection after such an answer."""
    if proto.closed or admission(proto.config) is None:
        return
    stream = proto.connection.streams.get(stream_id)
    if stream is not None and stream.state_machine.state is StreamState.HALF_CLOSED_LOCAL:
        with contextlib.suppress(h2.exceptions.ProtocolError):
            proto.connection.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)
        await proto._flush()
