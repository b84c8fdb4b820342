"""The pool's limits and timeouts (`UpstreamConfig`), its TLS context (`make_ssl_context`), and the
replica's connections to backends as its proxy flags set them (`upstream_config`).

Timeouts (docs/data-plane.md, Timeouts): a connect timeout (TCP + TLS), a head timeout from the
first request byte until the response head, and **no** timeout on the body, which may stream for
as long as the backend generates tokens.
"""

from __future__ import annotations

import math
import ssl
from dataclasses import dataclass

from stargate.config import ProxyConfig

__all__ = ["UpstreamConfig", "make_ssl_context", "upstream_ca_file", "upstream_config"]


def make_ssl_context(ca_file: str | None = None) -> ssl.SSLContext:
    """A client TLS context trusting the system store plus, optionally, one extra CA bundle.

    `ssl.create_default_context(cafile=...)` would load *only* that file and drop the system store;
    backends behind a private CA still need the public roots for everything else, so both are
    loaded. ALPN offers only `http/1.1`, since that is all this pool speaks.
    """
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if ca_file is not None:
        context.load_verify_locations(cafile=ca_file)
    context.set_alpn_protocols(["http/1.1"])
    return context


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """Limits and timeouts of an `ConnectionPool` (all durations in seconds).

    * `connect_timeout`: TCP connect plus TLS handshake of one new connection.
    * `response_head_timeout`: from the start of sending the request until the response head has
      arrived (docs/data-plane.md, Timeouts). The body has no timeout: a streamed completion lasts
      as long as the model generates. `math.inf` disables it.
    * `pool_acquire_timeout`: how long a request waits for a connection slot when the origin is
      at `max_connections_per_origin`.
    * `max_connections_per_origin`: open connections (in use plus idle) per scheme/host/port,
      so also the concurrent requests and streams to one backend: a stream holds its connection
      to its end. `--proxy-max-connections-per-backend` sets it; its default is that flag's,
      since engines batch hundreds of sequences at once.
    * `max_idle_per_origin`: idle keep-alive connections kept per origin; extras are closed.
    * `idle_expiry`: an idle connection older than this is closed instead of reused (servers
      close idle connections after their own keep-alive timeout; reusing one that old mostly
      buys a retry).
    * `ssl_context`: used for `https` origins. None builds `make_ssl_context(ca_file)` on the
      first https connection, so plain-http deployments never touch the trust store.
    * `ca_file`: an extra CA bundle for that default context (cannot be combined with
      `ssl_context`: configure the context instead).
    """

    connect_timeout: float = 5.0
    response_head_timeout: float = 30.0
    pool_acquire_timeout: float = 5.0
    max_connections_per_origin: int = 1024
    max_idle_per_origin: int = 32
    idle_expiry: float = 60.0
    ssl_context: ssl.SSLContext | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "response_head_timeout"):
            value = getattr(self, name)
            if math.isnan(value) or value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name in ("pool_acquire_timeout", "idle_expiry"):
            value = getattr(self, name)
            if math.isnan(value) or value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.max_connections_per_origin < 1:
            raise ValueError(
                f"max_connections_per_origin must be >= 1, got {self.max_connections_per_origin}"
            )
        if self.max_idle_per_origin < 0:
            raise ValueError(f"max_idle_per_origin must be >= 0, got {self.max_idle_per_origin}")
        if self.ssl_context is not None and self.ca_file is not None:
            raise ValueError("give either ssl_context or ca_file, not both")


def upstream_ca_file(proxy: ProxyConfig) -> str | None:
    """`--upstream-ca-file`, the extra CA bundle every connection to a backend trusts (the
    proxy's, and the health probes' own)."""
    return None if proxy.upstream_ca_file is None else str(proxy.upstream_ca_file)


def upstream_config(
    proxy: ProxyConfig, *, response_head_timeout: float | None = None
) -> UpstreamConfig:
    """The replica's connections to backends as the proxy's flags set them: the connect timeout,
    the response head timeout, the extra CA bundle and the per-backend connection cap.

    `response_head_timeout` replaces `--proxy-response-header-timeout-ms` for connections whose
    user bounds heads itself: the owner relay's (stargate/proxy/owner_relay.py) take `math.inf`,
    since a pool's owner may hold a request for a whole hold budget before it answers. The other
    limits keep `UpstreamConfig`'s defaults, which no flag sets.
    """
    if response_head_timeout is None:
        response_head_timeout = proxy.response_header_timeout_ms / 1000
    return UpstreamConfig(
        connect_timeout=proxy.connect_timeout_ms / 1000,
        response_head_timeout=response_head_timeout,
        ca_file=upstream_ca_file(proxy),
        max_connections_per_origin=proxy.max_connections_per_backend,
    )
