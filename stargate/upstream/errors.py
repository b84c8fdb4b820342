"""What can go wrong talking to a backend: the `UpstreamError` family.

A file of their own because both halves raise them: `connection_pool.py` (connect, slot wait) and
`connection.py` (head timeout, protocol errors), and callers (the forwarder, the proxy routes)
catch them by class. All of them derive from `UpstreamError`, whose `request_sent` attribute is
the retry rule: when it is False the backend cannot have seen a complete request, so retrying
(even a POST) is safe.
"""

from __future__ import annotations

__all__ = [
    "ConnectError",
    "ConnectionPoolTimeout",
    "ResponseHeadTimeout",
    "UpstreamError",
    "UpstreamProtocolError",
]


class UpstreamError(Exception):
    """Any failure to get a response (head or body) from a backend.

    `request_sent` is the retry rule. False: the backend cannot have received a complete request
    (nothing was sent, or sending failed part-way, and `content-length` framing means a server
    never acts on a truncated request), so retrying is safe even for a POST. True: the backend
    may have received, and be processing, the request; a retry may duplicate work.
    """

    def __init__(self, message: str, *, request_sent: bool) -> None:
        super().__init__(message)
        self.request_sent = request_sent


class ConnectError(UpstreamError):
    """DNS resolution, TCP connect or TLS handshake failed or timed out.

    Nothing was sent: always safe to retry (`request_sent` is False).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, request_sent=False)


class ConnectionPoolTimeout(UpstreamError):
    """No connection slot for the origin freed up within `pool_acquire_timeout`.

    Nothing was sent: safe to retry, though the origin is saturated.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, request_sent=False)


class ResponseHeadTimeout(UpstreamError):
    """The response head did not arrive within `response_head_timeout`.

    `request_sent` tells whether the whole request had been written: usually True (the backend
    is slow or stuck), in which case a retry may duplicate work. The connection is closed.
    """


class UpstreamProtocolError(UpstreamError):
    """The connection failed or the backend misbehaved after sending began.

    Raised when the connection is closed or reset before or while the head is read (after the
    one transparent retry of a stale pooled connection), when the head or the body framing is
    malformed, and from `UpstreamResponse.aiter_bytes()`/`read()` when the body ends early (the
    head was then already delivered, so nothing can be retried at this level). `request_sent` is
    False only when writing the request itself failed.
    """
