"""A trio driver over aioquic's sans-IO QUIC connection, and the tunnels' TLS configurations.

* `tls`: server and client `QuicConfiguration`s (ALPN, SNI, certificates; quinn's transport
  defaults), `derive_sni`, the self-signed identity.
* `flow`: aioquic's connection with receive credit that follows what the application consumed.
* `driver`: `QuicConnection` (timers, event dispatch, stream demultiplexing, the HTTP/3 hook).
* `streams`: `QuicStream`, the `TunnelStream` implementation (bounded buffers, resets).
* `endpoint`: UDP sockets: `connect` (dial) and `serve` (listen, route by connection id).
"""

from __future__ import annotations

from .driver import SEND_HIGH_WATER, EventHandler, QuicConnection
from .endpoint import QuicServer, connect, serve
from .errors import ConnectFailed, ConnectionClosed
from .streams import QuicStream
from .tls import (
    ALPN_HTTP3,
    ALPN_RAW_QUIC,
    TunnelConfiguration,
    client_configuration,
    derive_sni,
    generate_self_signed,
    server_configuration,
)

__all__ = [
    "ALPN_HTTP3",
    "ALPN_RAW_QUIC",
    "SEND_HIGH_WATER",
    "ConnectFailed",
    "ConnectionClosed",
    "EventHandler",
    "QuicConnection",
    "QuicServer",
    "QuicStream",
    "TunnelConfiguration",
    "client_configuration",
    "connect",
    "derive_sni",
    "generate_self_signed",
    "serve",
    "server_configuration",
]
