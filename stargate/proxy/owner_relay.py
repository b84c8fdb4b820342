"""Relaying a pool request to the replica that owns its pool (docs/pool-ownership.md, "Relaying
requests to the owner").

With several replicas only a pool's owner decides its swaps, and it can only keep "drain before
swap" and `ifIdle` true fleet-wide if it sees every request for the pool. So a replica that does
not own a request's pool (`PoolOwnedElsewhere` from `Activator.acquire`) hands the whole request to
the owner, which applies the entire contract itself (header checks, hold budget, routing), and
streams the owner's answer back as it arrives.

The rules, each for a reason:

* **Headers as received**, minus the hop-by-hop ones (they describe the client's connection, and
  an `Upgrade: h2c` would switch the owner's end of our connection to HTTP/2), plus the client's
  address in `X-Forwarded-For` (the owner adds ours after it) and the marker
  `x-stargate-pool-relayed: <pool>`.
* **Never loop**: a request carrying the marker is never relayed again; a replica that receives
  one for a pool it does not own answers 503 `pool_owner_moved`, `Retry-After: 1`
  (stargate/proxy/app.py). Here that answer means the owner moved while the request travelled:
  nothing was processed, so it is retried like an unreachable owner.
* **Unreachable owner** (no response head: refused, reset, nothing answered): nothing reached a
  backend, and the body is buffered, so wait for the next ownership change within the hold budget
  and try again, at the new owner or here (then the request is served locally).
* **The hold budget is counted once**: the follower waits for an owner until the end of the hold
  budget of its own `acquire` (`PoolOwnedElsewhere.deadline`), and for the owner's head until that
  plus the response-header timeout; the owner applies the hold budget itself. The connection pool
  used here must therefore not time heads out sooner (give it `response_head_timeout=math.inf`,
  as `owner_relay`, the replica's builder, does).
* **Client disconnect** cancels the relay, which closes the connection to the owner, which
  cancels the owner's request (its `DisconnectHook`, stargate/asgi.py).

Logs: each relay at DEBUG, failures at WARNING; never a body, never a header value.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Iterable

import trio

from stargate.activator import (
    Activator,
    ActivatorError,
    Grant,
    NoPoolOwner,
    Owner,
    PoolOwnedElsewhere,
    PoolOwnerMoved,
)
from stargate.asgi import ASGIScope, ASGISend
from stargate.config import ProxyConfig
from stargate.logs import LoggedError
from stargate.proxy.contract import (
    HOP_BY_HOP,
    Headers,
    ProxyRequest,
    connection_options,
    first_header,
    with_forwarding,
)
from stargate.proxy.response_body import BodyBroke, send_response
from stargate.upstream import ConnectionPool, UpstreamError, UpstreamResponse, upstream_config

__all__ = [
    "RELAYED_HEADER",
    "OwnerRelay",
    "RelayBodyError",
    "RelayFailed",
    "is_relayed",
    "owner_relay",
    "relay_request_headers",
    "relay_response_headers",
]

log = logging.getLogger(__name__)

RELAYED_HEADER = b"x-stargate-pool-relayed"
"""The marker on a relayed request; its value is the pool's name."""

# Hypercorn adds its own (docs/decisions.md, H3).
_DROPPED_RESPONSE = HOP_BY_HOP | {b"date", b"server"}


class RelayFailed(ActivatorError):
    """The request could not be sent to the owner (a header or an owner address the HTTP/1.1
    connection pool cannot carry), or the owner's head did not arrive in time."""

    status = 502
    code = "pool_relay_failed"


class RelayBodyError(LoggedError):
    """The owner's body failed mid-stream; raised to make Hypercorn close the client connection,
    so the client can tell (its cause is already logged)."""


class _Attempt(enum.Enum):
    RELAYED = "relayed"  # the owner's answer went to the client
    UNREACHABLE = "unreachable"  # no response head: nothing was processed
    MOVED = "moved"  # the owner said it no longer owns the pool: nothing was processed


def is_relayed(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """The request was already relayed once (it carries the marker)."""
    return first_header(headers, RELAYED_HEADER) is not None


def relay_request_headers(
    headers: Iterable[tuple[bytes, bytes]],
    pool: str,
    client: tuple[str, int] | None,
    scheme: str,
) -> Headers:
    """The headers sent to the owner: the client's as received, minus hop-by-hop ones and any
    marker, plus the client's address in `X-Forwarded-For` (and `X-Forwarded-Proto` unless a
    proxy in front set it) and the marker."""
    received = list(headers)
    dropped = HOP_BY_HOP | connection_options(received) | {RELAYED_HEADER}
    kept = [(key, value) for key, value in received if key not in dropped]
    return [*with_forwarding(kept, client, scheme), (RELAYED_HEADER, pool.encode())]


def relay_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """The owner's response headers as it sent them, minus hop-by-hop ones and the two Hypercorn
    writes itself."""
    received = list(headers)
    dropped = _DROPPED_RESPONSE | connection_options(received)
    return [(key, value) for key, value in received if key not in dropped]


def _owner_moved(response: UpstreamResponse) -> bool:
    """The owner's answer is "this pool is not mine" (never relayed: the request was not run)."""
    return (
        response.status == 503
        and first_header(response.headers, b"x-stargate-error-code") == PoolOwnerMoved.code.encode()
    )


def _moved_since(owner: Owner, address: str) -> bool:
    """Ownership is no longer at `address`: here, or at another known owner."""
    return owner.is_self or (owner.address is not None and owner.address != address)


class OwnerRelay:
    """Hands pool requests this replica does not own to their owner (module docstring).

    `pool` is an upstream connection pool whose head timeout is no shorter than any pool's hold
    budget plus `response_header_timeout` (`math.inf`: the deadline is applied here).
    """

    def __init__(
        self, pool: ConnectionPool, activator: Activator, *, response_header_timeout: float
    ) -> None:
        self._pool = pool
        self._activator = activator
        self._header_timeout = response_header_timeout

    @property
    def connections(self) -> ConnectionPool:
        """The connections to owners: their owner closes them, and expires their idle ones."""
        return self._pool

    async def relay(
        self,
        send: ASGISend,
        scope: ASGIScope,
        request: ProxyRequest,
        body: bytes | bytearray,
        elsewhere: PoolOwnedElsewhere,
        count: Callable[[int], None],
    ) -> Grant | None:
        """Relay `request` to the owner named by `elsewhere` and stream its answer to `send`
        (None), or, when ownership came here meanwhile, acquire locally (the grant: the caller
        forwards as usual). `count(status)` is called just before the owner's head is sent.

        Raises `NoPoolOwner` (no owner answered within the hold budget), `PoolOwnerMoved` (the
        owner kept saying it was not the owner), `RelayFailed`, any `ActivatorError` of a local
        acquire, and `RelayBodyError` when the owner's body fails mid-stream.
        """
        activator = self._activator
        pool = elsewhere.pool
        hold_deadline = elsewhere.deadline
        if hold_deadline is None:
            hold_deadline = trio.current_time() + activator.hold_budget(request.model_id)
        head_deadline = hold_deadline + self._header_timeout
        headers = relay_request_headers(
            scope["headers"], pool, scope.get("client"), scope.get("scheme", "http")
        )
        method: str = scope.get("method", "POST")
        outcome = "cancelled"
        try:
            while True:
                event = activator.ownership.changed(pool)  # before the owner is tried again
                address = elsewhere.address
                attempt = await self._attempt(
                    send, method, address, request, headers, body, head_deadline, count, pool
                )
                if attempt is _Attempt.RELAYED:
                    outcome = "relayed"
                    return None
                if not _moved_since(activator.ownership.owner(pool), address):
                    with trio.move_on_at(hold_deadline):
                        await event.wait()
                remaining = hold_deadline - trio.current_time()
                if remaining <= 0:
                    if attempt is _Attempt.MOVED:
                        outcome = "owner_moved"
                        raise PoolOwnerMoved(
                            f"the owner of model pool {pool} moved; retry",
                            pool=pool,
                            member=request.model_id,
                        )
                    outcome = "owner_unavailable"
                    raise NoPoolOwner(
                        f"no reachable owner of model pool {pool} within the hold budget",
                        pool=pool,
                        member=request.model_id,
                    )
                try:
                    grant = await activator.acquire(request.model_id, hold_budget=remaining)
                except PoolOwnedElsewhere as again:
                    elsewhere = again
                    continue
                except NoPoolOwner:
                    outcome = "owner_unavailable"
                    raise
                except ActivatorError:
                    outcome = "local"
                    raise
                outcome = "local"
                return grant
        except RelayFailed:
            outcome = "failed"
            raise
        except RelayBodyError:
            outcome = "failed"
            raise
        finally:
            activator.count_relayed(pool, outcome)

    async def _attempt(
        self,
        send: ASGISend,
        method: str,
        address: str,
        request: ProxyRequest,
        headers: Headers,
        body: bytes | bytearray,
        head_deadline: float,
        count: Callable[[int], None],
        pool: str,
    ) -> _Attempt:
        """One try at the owner at `address`."""
        rid = request.request_id
        url = address.rstrip("/") + request.target_path.decode("latin-1")
        response: UpstreamResponse | None = None
        with trio.move_on_at(head_deadline):
            try:
                response = await self._pool.request(method, url, headers, body)
            except ValueError as error:
                log.warning(
                    "pool request not relayable",
                    extra={"request_id": rid, "pool": pool, "owner": address, "error": str(error)},
                )
                raise RelayFailed(
                    f"the request for model pool {pool} cannot be relayed to its owner",
                    pool=pool,
                    member=request.model_id,
                ) from None
            except UpstreamError as error:
                message = " ".join(str(error).split()) or type(error).__name__
                log.warning(
                    "pool owner unreachable",
                    extra={"request_id": rid, "pool": pool, "owner": address, "error": message},
                )
                return _Attempt.UNREACHABLE
        if response is None:
            log.warning(
                "pool owner answered too late",
                extra={"request_id": rid, "pool": pool, "owner": address},
            )
            raise RelayFailed(
                f"the owner of model pool {pool} did not answer in time",
                pool=pool,
                member=request.model_id,
            )
        if _owner_moved(response):
            await response.aclose()
            log.debug("pool owner moved", extra={"request_id": rid, "pool": pool, "owner": address})
            return _Attempt.MOVED
        log.debug(
            "pool request relayed",
            extra={
                "request_id": rid,
                "pool": pool,
                "owner": address,
                "upstream_status": response.status,
            },
        )
        await self._stream(send, response, count, (rid, pool, address))
        return _Attempt.RELAYED

    async def _stream(
        self,
        send: ASGISend,
        response: UpstreamResponse,
        count: Callable[[int], None],
        where: tuple[str, str, str],
    ) -> None:
        """The owner's answer to the client as it arrives (SSE events unbuffered), as
        `ProxyApp._stream` relays a backend's."""
        async with response:
            count(response.status)
            start = {
                "type": "http.response.start",
                "status": response.status,
                "headers": relay_response_headers(response.headers),
            }
            try:
                await send_response(send, response, start)
            except BodyBroke as broke:
                message = str(broke)
                log.warning(
                    "pool owner body failed mid-stream",
                    extra={
                        "request_id": where[0],
                        "pool": where[1],
                        "owner": where[2],
                        "bytes": broke.relayed,
                        "error": message,
                    },
                )
                raise RelayBodyError(message) from None


def owner_relay(
    proxy: ProxyConfig, activator: Activator | None, *, shared: bool
) -> OwnerRelay | None:
    """A replica's relay, or None unless its pools are `shared` between replicas (Lease ownership,
    docs/pool-ownership.md): a replica that decides every pool alone owns every request it gets.

    The relay has connections of its own (`OwnerRelay.connections`), set by the proxy's flags
    except the head timeout: the owner may hold the request for a whole hold budget before it
    answers, so only the relay's deadline bounds the head (module docstring).
    """
    if activator is None or not shared:
        return None
    return OwnerRelay(
        ConnectionPool(upstream_config(proxy, response_head_timeout=math.inf)),
        activator,
        response_header_timeout=proxy.response_header_timeout_ms / 1000,
    )
