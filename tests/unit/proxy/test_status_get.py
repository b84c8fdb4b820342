"""Status-only GETs without h11 (`ConnectionPool.get_status`, the replica's health probes): the
head parser against h11 on the same bytes, and the exchange against real loopback servers (a kept
connection serves the next probe; anything that leaves it unclean closes it; a stale pooled
connection is retried once, as for proxied requests). stargate/upstream/status_head.py.
"""

from __future__ import annotations

import h11
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from stargate.upstream import (
    ConnectionPool,
    ResponseHeadTimeout,
    UpstreamConfig,
    UpstreamProtocolError,
)
from stargate.upstream.status_head import MAX_HEAD, HeadError, StatusHead, parse_status_head
from tests.unit.proxy.test_upstream import ServerConn, start_server

# --- the head ------------------------------------------------------------------------------------


def test_what_a_probe_needs_is_read_from_the_head() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"
    assert parse_status_head(head) == StatusHead(200, len(head) - 2, True, 2, False)
    chunked = parse_status_head(b"HTTP/1.1 503\r\ntransfer-encoding: Chunked\r\n\r\n")
    assert chunked is not None and (chunked.status, chunked.chunked) == (503, True)
    closing = parse_status_head(b"HTTP/1.1 200 OK\r\nconnection: upgrade, close\r\n\r\n")
    assert closing is not None and not closing.keep_alive
    http10 = parse_status_head(b"HTTP/1.0 200 OK\r\n\r\n")
    assert http10 is not None and not http10.keep_alive
    assert parse_status_head(b"HTTP/1.1 200 OK\r\ncontent-len") is None  # not all there yet
    both = parse_status_head(
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    assert both is not None and (both.chunked, both.content_length, both.keep_alive) == (
        True,
        None,
        False,
    )  # the chunks win (RFC 9112 §6.3), and the connection is not kept


@pytest.mark.parametrize(
    ("head", "message"),
    [
        (b"HTTP/1.1 2000 OK\r\n\r\n", "illegal status line"),
        (b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n", "illegal header line"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n", "Content-Len"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n", "Transfer-Encoding"),
        (b"HTTP/1.1 200 OK\r\nx: " + b"a" * MAX_HEAD, "too long"),
    ],
)
def test_a_malformed_head_is_refused_with_what_is_wrong(head: bytes, message: str) -> None:
    with pytest.raises(HeadError, match=message):
        parse_status_head(head)


def _h11_head(raw: bytes) -> tuple[int, bool] | None:
    """(status, keep-alive) as h11 reads `raw` after a GET, or None if it refuses it."""
    machine = h11.Connection(h11.CLIENT)
    machine.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    machine.send(h11.EndOfMessage())
    machine.receive_data(raw)
    try:
        event = machine.next_event()
    except h11.RemoteProtocolError:
        return None
    assert isinstance(event, h11.Response), event
    return event.status_code, machine._cstate.keep_alive


_LINES = st.sampled_from(
    [
        b"HTTP/1.1 200 OK",
        b"HTTP/1.0 204 No Content",
        b"HTTP/1.1 503",
        b"HTTP/1.1 20 OK",
        b"HTTP/2 200 OK",
        b"HTTP/1.1 404 Not\x00Found",
    ]
)
_FIELDS = st.lists(
    st.sampled_from(
        [
            b"content-length: 5",
            b"Content-Length: 5",
            b"content-length: -1",
            b"transfer-encoding: chunked",
            b"connection: close",
            b"Connection: keep-alive",
            b"x-ok: fine value",
            b"bad name: x",
            b"x-empty:",
            b"x-ctl: a\x01b",
        ]
    ),
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(line=_LINES, fields=_FIELDS)
def test_the_parser_accepts_and_refuses_what_h11_does(line: bytes, fields: list[bytes]) -> None:
    raw = b"\r\n".join([line, *fields]) + b"\r\n\r\n"
    expected = _h11_head(raw)
    try:
        head = parse_status_head(raw)
    except HeadError:
        assert expected is None, raw
        return
    assert head is not None and expected is not None, raw
    assert expected[0] == head.status, raw
    # Keep-alive as h11 reads it, except where we are stricter (both framings: not kept).
    assert head.keep_alive == (expected[1] and not (head.chunked and b"ength: 5" in raw)), raw


# --- the exchange --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
    ],
    ids=["content-length", "chunked", "informational-then-204"],
)
async def test_a_kept_connection_serves_the_next_probe(
    nursery: trio.Nursery, answer: bytes
) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.send_raw(answer)

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        for _ in range(3):
            assert await pool.get_status(server.url("/health"), [(b"x-probe", b"1")]) in (200, 204)
        stats = pool.stats()
        assert (stats.connections_created, stats.in_use_connections) == (1, 0)
    assert server.connections == 1
    request, _ = server.requests[0]
    assert (request.method, request.target) == (b"GET", b"/health")
    assert (b"x-probe", b"1") in list(request.headers)
    assert (b"host", f"127.0.0.1:{server.port}".encode()) in list(request.headers)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 503 Busy\r\nconnection: close\r\ncontent-length: 4\r\n\r\nbusy",
        b"HTTP/1.1 503 Busy\r\ncontent-length: 4\r\n\r\nbusyHTTP/1.1",  # bytes after the body
        b"HTTP/1.0 503 Busy\r\n\r\nto the end",
    ],
    ids=["connection-close", "bytes-after-the-body", "framed-by-the-close"],
)
async def test_an_answer_that_leaves_the_connection_unclean_closes_it(
    nursery: trio.Nursery, answer: bytes
) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.send_raw(answer, close=True)

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        for _ in range(2):
            assert await pool.get_status(server.url("/health"), []) == 503
            assert pool.stats().open_connections == 0
    assert server.connections == 2


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", "ended early"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "malformed"),
        (b"HTTP/1.1 OK\r\n\r\n", "bad response head"),
        (b"HTTP/1.1 200 OK\r\ncontent-", "mid-head"),
    ],
)
async def test_a_cut_or_malformed_answer_is_a_protocol_error_and_closes_the_connection(
    nursery: trio.Nursery, answer: bytes, message: str
) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.send_raw(answer, close=True)

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        with pytest.raises(UpstreamProtocolError, match=message):
            await pool.get_status(server.url("/health"), [])
        stats = pool.stats()
        assert (stats.open_connections, stats.in_use_connections) == (0, 0)


async def test_a_stale_pooled_connection_is_retried_once_on_a_fresh_one(
    nursery: trio.Nursery,
) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.send_raw(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", close=True)

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        assert await pool.get_status(server.url("/health"), []) == 200
        await server.wait_disconnects(1)  # the kept connection is now dead
        assert await pool.get_status(server.url("/health"), []) == 200
        assert pool.stats().stale_retries == 1
    assert server.connections == 2


async def test_a_silent_backend_is_a_head_timeout(nursery: trio.Nursery) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.wait_for_client_close()
        conn.close_after = True

    server = await start_server(nursery, handler)
    config = UpstreamConfig(response_head_timeout=0.1)
    async with ConnectionPool(config) as pool:
        with pytest.raises(ResponseHeadTimeout):
            await pool.get_status(server.url("/health"), [])
        assert pool.stats().open_connections == 0
