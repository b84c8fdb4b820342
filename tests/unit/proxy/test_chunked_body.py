"""A chunked upstream body decoded without h11 (stargate/upstream/chunked.py): the decoder against
h11 on the same bytes (what one accepts the other accepts, with the same data), its limits, and
the upstream pool around it (a connection is reused only after a complete keep-alive body with
nothing after it). docs/performance.md, "Streams".
"""

from __future__ import annotations

import itertools

import h11
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from stargate.upstream import ConnectionPool, UpstreamProtocolError
from stargate.upstream.chunked import MAX_LINE, ChunkedDecoder, ChunkedError
from tests.unit.proxy.test_upstream import ServerConn, start_server

HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def _decode(wire: bytes, splits: list[int] | None = None) -> tuple[bytes, bool, bytes]:
    """(data, done, extra) from feeding `wire` in pieces cut at `splits`."""
    decoder = ChunkedDecoder()
    cuts = sorted({0, len(wire), *(splits or [])})
    data = b""
    for start, end in itertools.pairwise(cuts):
        data += b"".join(decoder.feed(wire[start:end]))
    decoder.feed(b"")  # raises an error that came after data in the last piece
    return data, decoder.done, decoder.extra


def _h11_decode(body: bytes) -> tuple[bytes, bool] | None:
    """What h11 makes of `body` after a chunked response head: (data, complete), or None if it
    refuses it."""
    machine = h11.Connection(h11.CLIENT)
    machine.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    machine.send(h11.EndOfMessage())
    machine.receive_data(HEAD + body)
    data = b""
    try:
        while True:
            event = machine.next_event()
            if isinstance(event, h11.Response):
                continue
            if isinstance(event, h11.Data):
                data += event.data
            elif isinstance(event, h11.EndOfMessage):
                return data, True
            else:
                return data, False
    except h11.RemoteProtocolError:
        return None


SSE = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in (b"data: one\n\n", b"data: two\n\n"))


def test_every_split_of_a_stream_decodes_to_the_same_events() -> None:
    wire = SSE + b"0\r\n\r\n"
    for split in range(len(wire) + 1):
        assert _decode(wire, [split]) == (b"data: one\n\ndata: two\n\n", True, b"")
    assert _decode(wire, list(range(len(wire)))) == (b"data: one\n\ndata: two\n\n", True, b"")


def test_a_chunk_is_passed_on_before_it_has_fully_arrived() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"a\r\nhello") == [b"hello"]
    assert decoder.feed(b"world\r") == [b"world"]
    assert not decoder.done
    assert decoder.feed(b"\n0\r\n\r\n") == []
    assert decoder.done


def test_extensions_are_ignored_trailers_dropped_and_what_follows_kept_apart() -> None:
    wire = b"5;name=value\r\nhello\r\n0;last\r\nx-trailer: 1\r\nx-other: 2\r\n\r\nHTTP/1.1"
    assert _decode(wire) == (b"hello", True, b"HTTP/1.1")
    decoder = ChunkedDecoder()
    decoder.feed(b"0\r\n\r\n")
    assert decoder.feed(b"late") == [] and decoder.extra == b"late"


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (b"zz\r\n", "illegal chunk header"),
        (b"123456789012345678901\r\n", "illegal chunk header"),  # more than 20 hex digits
        (b"3\r\nabcXY", "malformed chunk footer"),
        (b"3\r\nabc\n", "malformed chunk footer"),
        (b"0\r\nbad trailer\r\n\r\n", "illegal trailer field"),
        (b"1" * (MAX_LINE + 1), "chunk header too long"),
        (b"1;" + b"x" * MAX_LINE + b"\r\n", "chunk header too long"),
        (b"0\r\n" + b"x-a: " + b"b" * MAX_LINE, "trailer section too long"),
        (b"0\r\n" + b"x-a: b\r\n" * (MAX_LINE // 8 + 1), "trailer section too long"),
    ],
)
def test_broken_framing_is_refused_with_what_is_wrong(wire: bytes, message: str) -> None:
    with pytest.raises(ChunkedError, match=message):
        _decode(wire)  # a footer's error comes after the chunk's data, with the next call


_CHUNK = st.one_of(
    st.binary(min_size=1, max_size=40).map(lambda d: b"%x\r\n%b\r\n" % (len(d), d)),
    st.sampled_from(
        [
            b"3;ext=1\r\nabc\r\n",
            b"0003\r\nabc\r\n",
            b"3 \r\nabc\r\n",
            b"3\r\nabcd\r\n",  # wrong footer
            b"g\r\n",
            b"3\r\nab",  # cut short
            b"\r\n",
        ]
    ),
)
_END = st.sampled_from([b"0\r\n\r\n", b"0\r\nx-t: 1\r\n\r\n", b"0\r\n", b"", b"0\r\nbad\r\n\r\n"])


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(_CHUNK, max_size=6), end=_END, split=st.integers(min_value=0))
def test_the_decoder_accepts_and_refuses_what_h11_does(
    chunks: list[bytes], end: bytes, split: int
) -> None:
    wire = b"".join(chunks) + end
    expected = _h11_decode(wire)
    try:
        data, done, _ = _decode(wire, [split % (len(wire) + 1)])
    except ChunkedError:
        assert expected is None, wire
        return
    assert expected is not None, wire
    h11_data, complete = expected
    assert done == complete, wire
    # h11 may still be holding a partial chunk it has not passed on; what both passed on agrees.
    assert h11_data == data[: len(h11_data)], wire


# --- the pool around it -----------------------------------------------------------------------


async def test_a_complete_keep_alive_body_returns_its_connection(nursery: trio.Nursery) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.send_raw(HEAD + SSE + b"0\r\n\r\n")

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        for _ in range(3):
            async with await pool.request("GET", server.url(), []) as response:
                assert await response.read() == b"data: one\n\ndata: two\n\n"
        assert pool.stats().idle_connections == {server.url().rstrip("/"): 1}
    assert server.connections == 1  # one connection carried all three


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n"
        + SSE
        + b"0\r\n\r\n",
        HEAD + SSE + b"0\r\n\r\nHTTP/1.1 200 OK\r\n",  # bytes after the body
    ],
    ids=["connection-close", "bytes-after-the-body"],
)
async def test_a_body_that_does_not_leave_the_connection_clean_closes_it(
    nursery: trio.Nursery, answer: bytes
) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.send_raw(answer, close=True)

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        for _ in range(2):
            async with await pool.request("GET", server.url(), []) as response:
                assert await response.read() == b"data: one\n\ndata: two\n\n"
            assert pool.stats().open_connections == 0
    assert server.connections == 2


@pytest.mark.parametrize(
    ("tail", "message"),
    [(b"5\r\nabc", "peer closed connection"), (b"5\r\nabcdeXX", "malformed chunk footer")],
)
async def test_a_broken_or_cut_body_is_a_protocol_error_and_the_connection_is_dropped(
    nursery: trio.Nursery, tail: bytes, message: str
) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.send_raw(HEAD + SSE + tail, close=True)

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        async with await pool.request("GET", server.url(), []) as response:
            received: list[bytes] = []
            with pytest.raises(UpstreamProtocolError, match=message) as caught:
                async for chunk in response.aiter_bytes():
                    received.append(chunk)
            assert caught.value.request_sent is True
            assert b"".join(received).startswith(b"data: one\n\ndata: two\n\n")
        assert pool.stats().open_connections == 0
