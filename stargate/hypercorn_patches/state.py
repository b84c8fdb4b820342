"""What the patches keep per listener and per connection, on Hypercorn's own objects.

Per listener: one `Listener` of ours, attached to the listener's Hypercorn config (every
listener is served with a config of its own, `stargate.serving.hypercorn_config`): its
connection count, when it has one (`stargate.http_limits.limit_connections`), and its HTTP/2
connections that have received a request (so `leave` can reach the idle ones). Per connection:
one attribute of ours on Hypercorn's connection object (`TCPServer`: how to release its counted
slot; `H2Protocol`: its GOAWAY rotation). The objects die with the listener or connection; no
module-level map refers to them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.typing import AppWrapper

__all__ = [
    "REFUSES_STREAMS",
    "Admit",
    "Admitted",
    "Listener",
    "Release",
    "Rotation",
    "listener",
    "listener_if_any",
    "log",
    "release_of",
    "rotation_of",
    "set_release",
    "set_rotation",
]

log = logging.getLogger("stargate.hypercorn_fixes")
"""The patches' logger, under the name of the module they came from, so log filters and alerts on
"stargate.hypercorn_fixes" keep matching (docs/http-serving.md, "Contained connection errors")."""

Release = Callable[[], None]
"""Frees a counted connection's slot (idempotent)."""


class Admitted(NamedTuple):
    """How a counted connection is served: with `app`, its slot freed by `release`, and, for a
    connection admitted only to be answered (past the cap and the reserve), `deadline`: the
    seconds it may stay open at most, whatever it is doing then."""

    app: AppWrapper
    release: Release
    deadline: float | None = None


Admit = Callable[[AppWrapper], Admitted | None]
"""A listener's connection count: given the app a new connection would be served with, None to
close it at once, or how to serve it (`Admitted`)."""

REFUSES_STREAMS = "stargate_refuses_streams"
"""An attribute that, true on the app a connection is served with, makes its HTTP/2 side refuse
every stream (REFUSED_STREAM, then a GOAWAY naming stream 0: nothing was processed, so the client
may retry each request elsewhere). HTTP/1.1 requests reach the app, which answers them."""

_LISTENER = "_stargate_listener"
_RELEASE = "_stargate_release"
_ROTATION = "_stargate_rotation"


@dataclass(eq=False)
class Listener:
    """stargate's state for one listener."""

    admit: Admit | None = None
    h2_connections: weakref.WeakSet[H2Protocol] = field(default_factory=weakref.WeakSet)


def listener(config: HypercornConfig) -> Listener:
    """The state of the listener served with `config`, made on first use."""
    state = listener_if_any(config)
    if state is None:
        state = Listener()
        setattr(config, _LISTENER, state)
    return state


def listener_if_any(config: HypercornConfig) -> Listener | None:
    return cast("Listener | None", getattr(config, _LISTENER, None))


def release_of(server: TCPServer) -> Release | None:
    """How to free the slot of a counted connection whose socket has not closed yet."""
    return cast("Release | None", getattr(server, _RELEASE, None))


def set_release(server: TCPServer, release: Release | None) -> None:
    setattr(server, _RELEASE, release)


@dataclass
class Rotation:
    """An HTTP/2 connection that sent GOAWAY: it serves streams up to `last_stream_id`, then
    closes once `drained` (no stream left)."""

    last_stream_id: int
    drained: trio.Event = field(default_factory=trio.Event)


def rotation_of(proto: H2Protocol) -> Rotation | None:
    return cast("Rotation | None", getattr(proto, _ROTATION, None))


def set_rotation(proto: H2Protocol, rotation: Rotation) -> None:
    setattr(proto, _ROTATION, rotation)
