"""The stateless HTTP health probe of a backend engine, shared by every part that judges one.

The replica's backend monitors (`stargate/control_plane/health.py`), the Pylon's engine probes
(`stargate/pylon/sidecar.py`) and the process controller's engine supervisor
(`stargate/activator/process.py`) all ask the same question the same way: does the engine
answer its health endpoint with a 2xx in time, and how long did that take. This module answers it
once; what each caller does with the answer (verdicts, INACTIVE models, routes) stays with it.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx
import trio

__all__ = [
    "DEFAULT_HEALTH_PATHS",
    "PROBE_HEADERS",
    "ProbeFailed",
    "http_health_probe",
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
    client: httpx.AsyncClient,
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
    crosses the request on the wire. That says nothing about the backend, so such a request is
    sent once more, within the same `probe_timeout`, as the upstream pool does for proxied
    requests (stargate/proxy/upstream/connection_pool.py). Only a *reused* connection qualifies
    (httpcore's trace events tell whether the request opened one): a fresh connection failing
    that way is a failed probe, and so is a retry that fails.
    """
    if not paths:
        raise ValueError("at least one health path is required")
    base = base_url.rstrip("/")
    for path in paths:
        started = trio.current_time()
        try:
            with trio.fail_after(probe_timeout):
                response = await _get(client, base + path, headers)
        except (httpx.HTTPError, trio.TooSlowError) as error:
            raise ProbeFailed(f"{base}{path}: {error!r}") from None
        elapsed_ns = int((trio.current_time() - started) * 1e9)
        if response.status_code == 404 and path != paths[-1]:
            continue
        if 200 <= response.status_code < 300:
            return max(elapsed_ns, 1)
        raise ProbeFailed(f"{base}{path} answered {response.status_code}")
    raise ProbeFailed(f"{base}: no health endpoint")  # pragma: no cover - loop always returns


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
