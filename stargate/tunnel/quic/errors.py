"""The QUIC driver's connection-level errors (stream-level ones live in `tunnel.stream`)."""

from __future__ import annotations

__all__ = ["ConnectFailed", "ConnectionClosed"]


class ConnectFailed(Exception):
    """A dial did not produce an established connection: it timed out, the peer refused it, or
    the TLS handshake failed (certificate, server name, ALPN mismatch). The message says which."""


class ConnectionClosed(Exception):
    """The connection is closing or closed (by us, by the peer, or by the idle timeout), so no
    stream can be opened or accepted on it any more."""
