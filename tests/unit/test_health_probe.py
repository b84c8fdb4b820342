"""The shared HTTP health probe (stargate/health_probe.py) against real loopback servers, through
both of its transports: httpx (the Pylon, the process controller) and the replica's lean probe
pool (stargate/control_plane/health.py, `upstream_get`). Both must judge alike.

The case that matters: a pooled keep-alive connection the backend has closed. Its FIN (or RST)
can cross the next probe on the wire, and the probe then fails with a reset or "server
disconnected" before any response, although the backend is fine. Such a probe is sent once more;
a fresh connection failing the same way, or a retry that fails, is a failed probe.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import h11
import httpx
import pytest
import trio

from stargate.control_plane.health import probe_connections, upstream_get
from stargate.health_probe import HttpGet, ProbeFailed, http_health_probe, httpx_get
from tests.unit.proxy.test_upstream import Server, ServerConn, start_server


def _answers_once_per_connection(*, reset: bool) -> tuple[list[int], object]:
    """A handler answering the first request of each connection, then closing that connection
    without a byte when the next request arrives on it (with an RST when `reset`)."""
    served: dict[ServerConn, int] = {}  # the connections themselves: an id() can be reused
    failures: list[int] = []

    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        count = served.get(conn, 0)
        served[conn] = count + 1
        if count == 0:
            await conn.respond(200, body=b"ok")
            return
        failures.append(1)
        if reset:
            stream = conn.stream
            assert isinstance(stream, trio.SocketStream)
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # Returning without answering ends the connection (test_upstream.Server closes it).

    return failures, handler


@asynccontextmanager
async def _httpx() -> AsyncIterator[HttpGet]:
    async with httpx.AsyncClient() as client:
        yield httpx_get(client)


@asynccontextmanager
async def _probe_connections() -> AsyncIterator[HttpGet]:
    async with probe_connections(2.0) as connections:
        yield upstream_get(connections)


Transport = Callable[[], AbstractAsyncContextManager[HttpGet]]


@pytest.fixture(params=[_httpx, _probe_connections], ids=["httpx", "probe-connections"])
def transport(request: pytest.FixtureRequest) -> Transport:
    factory: Transport = request.param
    return factory


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_pooled_connection_the_backend_closed_is_retried_once(
    nursery: trio.Nursery, reset: bool, transport: Transport
) -> None:
    failures, handler = _answers_once_per_connection(reset=reset)
    server: Server = await start_server(nursery, handler)  # type: ignore[arg-type]
    async with transport() as get:
        assert await http_health_probe(get, server.url(""), 2.0) > 0
        # The second probe reuses the pooled connection, which the backend drops: retried on a
        # fresh one, the probe passes.
        assert await http_health_probe(get, server.url(""), 2.0) > 0
    assert len(failures) == 1
    assert server.connections == 2


async def test_a_fresh_connection_closed_without_an_answer_fails_the_probe(
    nursery: trio.Nursery, transport: Transport
) -> None:
    async def never(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        pass  # close without a byte

    server = await start_server(nursery, never)
    async with transport() as get:
        with pytest.raises(ProbeFailed, match="ProtocolError"):
            await http_health_probe(get, server.url(""), 2.0)
    assert server.connections == 1  # not retried: nothing was reused


async def test_a_retry_that_fails_too_fails_the_probe(
    nursery: trio.Nursery, transport: Transport
) -> None:
    requests = 0

    async def first_only(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        nonlocal requests
        requests += 1
        if requests == 1:
            await conn.respond(200, body=b"ok")

    server = await start_server(nursery, first_only)
    async with transport() as get:
        await http_health_probe(get, server.url(""), 2.0)
        with pytest.raises(ProbeFailed):
            await http_health_probe(get, server.url(""), 2.0)
    assert requests == 3  # the first probe, the reused connection, one retry
    assert server.connections == 2


async def test_refused_and_non_2xx_are_failures_and_404_falls_back(
    nursery: trio.Nursery, transport: Transport
) -> None:
    async def health(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        status = 404 if request.target == b"/health" else 503
        await conn.respond(status, body=b"no")

    server = await start_server(nursery, health)
    async with transport() as get:
        with pytest.raises(ProbeFailed, match="/v1/health/ready answered 503"):
            await http_health_probe(get, server.url(""), 2.0)
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
        with pytest.raises(ProbeFailed, match="ConnectError"):
            await http_health_probe(get, f"http://127.0.0.1:{port}", 2.0)
