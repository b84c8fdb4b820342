"""The stateless HTTP health probe of a backend engine, shared by every part that judges one.

The replica's backend monitors (`stargate/control_plane/health.py`), the Pylon's engine probes
(`stargate/pylon/sidecar.py`) and the process controller's engine supervisor
(`stargate/activator/process.py`) all ask the same question the same way: does the engine
answer its health endpoint with a 2xx in time, and how long did that take. This module answers it
once; what each caller does with the answer (verdicts, INACTIVE models, routes) stays with it.

The judgement is separate from the HTTP client that carries it (`HttpGet`): the replica probes
up to a thousand backends a second through a connection pool of the proxy's kind, reading each
answer without h11 (`stargate/control_plane/health.py`, `upstream_get`), where httpx cost about
1 ms of CPU per probe (docs/performance.md); the Pylon and the process controller probe one
engine or a few, through httpx (`httpx_get`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import httpx
import trio

__all__ = [
    "DEFAULT_HEALTH_PATHS",
    "PROBE_HEADERS",
    "HttpGet",
    "ProbeFailed",
    "http_health_probe",
    "httpx_get",
]

DEFAULT_HEALTH_PATHS: tuple[str, ...] = ("/health", "/v1/health/ready")
"""Tried in order: `/health`, then `/v1/health/ready` where `/health` is 404."""

PROBE_HEADERS: Mapping[str, str] = {
    "x-request-id": "stargate-health",
    "x-model": "stargate-health",
    "x-input-tokens": "0",
}
"""Headers the replica and the Pylon send with each probe."""


class ProbeFailed(Exception):
    """The backend did not answer its health endpoint with a 2xx in time."""


HttpGet = Callable[[str, Mapping[str, str]], Awaitable[int]]
"""`GET url` with `headers`, the whole body read; returns the status code. A transport failure
(refused, reset, closed without an answer, a malformed response) raises ProbeFailed naming it.
A reused keep-alive connection that turns out closed before any response byte is retried once on
a fresh connection: that says nothing about the backend (see `http_health_probe`). The caller
bounds the time."""


# The errors of a connection the server closed or reset: a reused keep-alive connection that
# fails with one of them before the response head is retried once (see `http_health_probe`).
# Not `httpx.ConnectError` (a fresh connection was refused: the backend is down) nor a timeout.
_STALE_CONNECTION_ERRORS = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class _Exchange:
    """What httpcore's trace extension tells about one request: whether it opened a connection
    (else it reused a pooled one) and whether the response head arrived."""

    __slots__ = ("connected", "head_received")

    def __init__(self) -> None:
        self.connected = False
        self.head_received = False

    async def trace(self, event: str, info: Mapping[str, object]) -> None:
        if event.startswith("connection.connect_tcp."):
            self.connected = True
        elif event.endswith(".receive_response_headers.complete"):
            self.head_received = True

    @property
    def stale(self) -> bool:
        """A reused connection that died before the response head: the server had closed it."""
        return not self.connected and not self.head_received


async def http_health_probe(
    get: HttpGet,
    base_url: str,
    probe_timeout: float,
    paths: tuple[str, ...] = DEFAULT_HEALTH_PATHS,
    *,
    headers: Mapping[str, str] = PROBE_HEADERS,
) -> int:
    """One health check: the first of `paths` that is not 404 must answer 2xx, body read.

    Returns the round-trip time in nanoseconds (at least 1) or raises ProbeFailed (refused,
    timed out after `probe_timeout` seconds, non-2xx). Shared by the replica's backend probes, the
    Pylon's engine probes and the process controller, so all judge an engine's health the same
    way.

    A pooled keep-alive connection the backend has closed (its keep-alive timeout, a restart) can
    fail the next request before any response, with a reset or a close, when the backend's FIN
    crosses the request on the wire. That says nothing about the backend, so `get` sends such a
    request once more, within the same `probe_timeout`, as the upstream pool does for proxied
    requests (stargate/upstream/connection_pool.py). Only a *reused* connection qualifies:
    a fresh connection failing that way is a failed probe, and so is a retry that fails.
    """
    if not paths:
        raise ValueError("at least one health path is required")
    base = base_url.rstrip("/")
    for path in paths:
        started = trio.current_time()
        # A bare cancel scope, not `trio.fail_after` (the same scope inside a generator-based
        # context manager): the replica runs one probe per backend a second, and at 1,000
        # backends the generator's cost was 2 % of its CPU (docs/performance.md).
        status = 0
        try:
            with trio.CancelScope(deadline=started + probe_timeout) as timeout:
                status = await get(base + path, headers)
        except ProbeFailed as error:
            raise ProbeFailed(f"{base}{path}: {error}") from None
        if timeout.cancelled_caught:
            raise ProbeFailed(f"{base}{path}: no answer within {probe_timeout:g} s")
        elapsed_ns = int((trio.current_time() - started) * 1e9)
        if status == 404 and path != paths[-1]:
            continue
        if 200 <= status < 300:
            return max(elapsed_ns, 1)
        raise ProbeFailed(f"{base}{path} answered {status}")
    raise ProbeFailed(f"{base}: no health endpoint")  # pragma: no cover - loop always returns


def httpx_get(client: httpx.AsyncClient) -> HttpGet:
    """`HttpGet` through an httpx client (the Pylon's and the process controller's)."""

    async def get(url: str, headers: Mapping[str, str]) -> int:
        try:
            return (await _get(client, url, headers)).status_code
        except httpx.HTTPError as error:
            raise ProbeFailed(repr(error)) from None

    return get


async def _get(client: httpx.AsyncClient, url: str, headers: Mapping[str, str]) -> httpx.Response:
    """GET `url` and read the body; once more on a fresh connection if a reused one was stale."""
    exchange = _Exchange()
    try:
        response = await client.get(
            url, headers=dict(headers), extensions={"trace": exchange.trace}
        )
        await response.aread()
    except _STALE_CONNECTION_ERRORS:
        if not exchange.stale:
            raise
        # httpcore has dropped the dead connection: the retry reuses another idle one to the
        # backend, if any, or opens one.
        response = await client.get(url, headers=dict(headers))
        await response.aread()
    return response
