"""A keep-alive HTTP/1.1 client pool on trio sockets (h11): the replica forwards to backends
with it, the Pylon to its engine.

Not httpx, whose per-request CPU the proxy cannot afford (docs/decisions.md, D10). Laid out like
httpcore, one concern per file:

* `config.py`: `UpstreamConfig` (limits and timeouts), `make_ssl_context`, and the replica's
  connections to backends as its proxy flags set them (`upstream_config`, `upstream_ca_file`).
* `errors.py`: the `UpstreamError` family; `request_sent` is the retry rule.
* `connection.py`: one connection (socket + h11 state machine) and its exchange: request framing,
  sending, the response head, and `UpstreamResponse`, which streams the body and gives the
  connection back through a release callback.
* `connection_pool.py`: `ConnectionPool`: origins, idle connections, slots, the acquire timeout,
  idle expiry, the one retry of a stale reused connection; and `ConnectionPoolStats`.
* `response.py`: `BackendResponse`, the surface of a response whatever the transport (the
  tunnels' responses have it too).
* `upkeep.py`: `ConnectionPools`, a process's pools kept up (idle expiry, departed backends)
  and closed as one.

Import from here; the submodules' other names are internal.
"""

from stargate.upstream.config import (
    UpstreamConfig,
    make_ssl_context,
    upstream_ca_file,
    upstream_config,
)
from stargate.upstream.connection import UpstreamResponse
from stargate.upstream.connection_pool import ConnectionPool, ConnectionPoolStats
from stargate.upstream.errors import (
    ConnectError,
    ConnectionPoolTimeout,
    ResponseHeadTimeout,
    UpstreamError,
    UpstreamProtocolError,
)
from stargate.upstream.response import BackendResponse
from stargate.upstream.upkeep import ConnectionPools

__all__ = [
    "BackendResponse",
    "ConnectError",
    "ConnectionPool",
    "ConnectionPoolStats",
    "ConnectionPoolTimeout",
    "ConnectionPools",
    "ResponseHeadTimeout",
    "UpstreamConfig",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "make_ssl_context",
    "upstream_ca_file",
    "upstream_config",
]
