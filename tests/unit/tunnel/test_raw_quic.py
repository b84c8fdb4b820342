"""The raw-quic exchange, both halves, over an in-memory stream pair (docs/tunnels.md, "Raw QUIC").

The wire bytes are the codec's; what is checked here is the exchange: the request head's
`x-method`/`x-path` first, the body split in messages and ended by FIN, the answer's `x-status`
taken out of the head, a missing or invalid status read as 502, the body ending at FIN or at a
trailers message, resets before and after the head, the head deadline, and the Pylon's side.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import trio

from stargate.asgi import BodyTooLarge
from stargate.tunnel.codec import (
    BodyMessage,
    HeadersMessage,
    MessageReader,
    decode_message,
    encode_body,
    encode_headers,
)
from stargate.tunnel.raw_quic import (
    BODY_MESSAGE_BYTES,
    BadTunnelRequest,
    TunnelRequestReader,
    TunnelSink,
    send_request,
)
from stargate.tunnel.stream import StreamClosed
from stargate.upstream import ResponseHeadTimeout, UpstreamProtocolError
from tests.fakes.tunnel_streams import FakeStream, stream_pair


def messages(data: bytes) -> list[HeadersMessage | BodyMessage]:
    reader = MessageReader()
    reader.feed(data)
    out = []
    while (raw := reader.next_message()) is not None:
        out.append(decode_message(raw))
    reader.end()
    return out


async def read_all(stream: FakeStream) -> bytes:
    data = bytearray()
    while chunk := await stream.receive():
        data += chunk
    return bytes(data)


async def answer(
    stream: FakeStream, status: bytes | None, *bodies: bytes, trailers: bool = False
) -> None:
    head = [(b"content-type", b"text/event-stream")]
    if status is not None:
        head.append((b"x-status", status))
    await stream.send(encode_headers(head))
    for body in bodies:
        await stream.send(encode_body(body))
    if trailers:
        await stream.send(encode_headers([(b"x-ignored", b"1")], trailers=True))
    with contextlib.suppress(StreamClosed):  # the reader may stop at the trailers
        await stream.send(b"", end=True)


async def test_the_request_head_names_method_and_path_first_then_the_headers_in_order() -> None:
    client, server = stream_pair()
    body = b"x" * (2 * BODY_MESSAGE_BYTES + 5)
    async with trio.open_nursery() as nursery:
        received: list[bytes] = []

        async def pylon() -> None:
            received.append(await read_all(server))
            await answer(server, b"200", b"data: 1\n\n", b"data: [DONE]\n\n")

        nursery.start_soon(pylon)
        headers = [(b"x-request-id", b"r1"), (b"x-tag", b"a"), (b"x-tag", b"b")]
        response = await send_request(
            client, "POST", b"/v1/chat/completions?trace=1", headers, body, math.inf
        )
        assert response.status == 200
        assert response.headers == [(b"content-type", b"text/event-stream")]
        chunks = [chunk async for chunk in response.aiter_bytes()]
        assert chunks == [b"data: 1\n\n", b"data: [DONE]\n\n"]
        assert response.complete
    sent = messages(received[0])
    assert isinstance(sent[0], HeadersMessage)
    assert sent[0].entries == [
        (b"x-method", b"POST"),
        (b"x-path", b"/v1/chat/completions?trace=1"),
        *headers,
    ]
    assert [len(m.data) for m in sent[1:] if isinstance(m, BodyMessage)] == [
        BODY_MESSAGE_BYTES,
        BODY_MESSAGE_BYTES,
        5,
    ]
    assert b"".join(m.data for m in sent[1:] if isinstance(m, BodyMessage)) == body


async def test_an_empty_body_is_the_head_and_fin() -> None:
    client, server = stream_pair()
    async with trio.open_nursery() as nursery:

        async def pylon() -> None:
            assert len(messages(await read_all(server))) == 1
            await answer(server, b"204")

        nursery.start_soon(pylon)
        response = await send_request(client, "GET", b"/health", [], b"", math.inf)
        assert response.status == 204
        assert await response.read() == b""


@pytest.mark.parametrize("status", [None, b"abc", b"99", b"1000", b"-1", b"200 "])
async def test_a_missing_or_invalid_status_is_a_502_passed_on(status: bytes | None) -> None:
    client, server = stream_pair()
    async with trio.open_nursery() as nursery:

        async def pylon() -> None:
            await read_all(server)
            await answer(server, status, b"body")

        nursery.start_soon(pylon)
        response = await send_request(client, "POST", b"/v1/x", [], b"{}", math.inf)
        assert response.status == 502
        assert all(name != b"x-status" for name, _ in response.headers)
        assert await response.read() == b"body"


async def test_the_body_ends_at_trailers_and_nothing_after_them_is_read() -> None:
    client, server = stream_pair()
    async with trio.open_nursery() as nursery:

        async def pylon() -> None:
            await read_all(server)
            await answer(server, b"200", b"a", trailers=True)

        nursery.start_soon(pylon)
        response = await send_request(client, "POST", b"/v1/x", [], b"{}", math.inf)
        assert await response.read() == b"a"
        assert client.stops == [0]  # the rest of the stream is refused


async def test_a_reset_before_the_head_is_a_protocol_error_and_the_stream_is_abandoned() -> None:
    client, server = stream_pair()
    async with trio.open_nursery() as nursery:

        async def pylon() -> None:
            await read_all(server)
            server.reset(0)

        nursery.start_soon(pylon)
        with pytest.raises(UpstreamProtocolError) as caught:
            await send_request(client, "POST", b"/v1/x", [], b"{}", math.inf)
    assert caught.value.request_sent
    assert client.resets and client.stops


async def test_a_reset_after_the_head_breaks_the_body() -> None:
    client, server = stream_pair()
    first_read = trio.Event()
    async with trio.open_nursery() as nursery:

        async def pylon() -> None:
            await read_all(server)
            await server.send(encode_headers([(b"x-status", b"200")]))
            await server.send(encode_body(b"first"))
            await first_read.wait()  # a reset discards unread data: let the first chunk land
            server.reset(0)

        nursery.start_soon(pylon)
        response = await send_request(client, "POST", b"/v1/x", [], b"{}", math.inf)
        iterator = response.aiter_bytes()
        assert await anext(iterator) == b"first"
        first_read.set()
        with pytest.raises(UpstreamProtocolError):
            await anext(iterator)


async def test_trailers_first_or_a_second_head_is_a_protocol_error() -> None:
    client, server = stream_pair()
    async with trio.open_nursery() as nursery:

        async def pylon() -> None:
            await read_all(server)
            await server.send(encode_body(b"body before head"), end=True)

        nursery.start_soon(pylon)
        with pytest.raises(UpstreamProtocolError, match="expected headers"):
            await send_request(client, "POST", b"/v1/x", [], b"{}", math.inf)


async def test_the_deadline_covers_the_head(autojump_clock: trio.abc.Clock) -> None:
    client, server = stream_pair()
    del server  # never answers
    deadline = trio.current_time() + 30
    with pytest.raises(ResponseHeadTimeout, match="quic request timed out") as caught:
        await send_request(client, "POST", b"/v1/x", [], b"{}", deadline)
    assert trio.current_time() == pytest.approx(deadline)
    assert caught.value.request_sent  # the whole request had been written
    assert client.resets and client.stops


async def test_the_deadline_covers_a_blocked_upload(autojump_clock: trio.abc.Clock) -> None:
    client, server = stream_pair(high_water=1024)
    del server  # never reads
    with pytest.raises(ResponseHeadTimeout) as caught:
        await send_request(client, "POST", b"/v1/x", [], b"x" * 100_000, trio.current_time() + 5)
    assert not caught.value.request_sent


async def test_an_early_answer_while_the_upload_is_blocked_is_read() -> None:
    """A Pylon that refuses on the headers answers before reading the body and stops reading
    (STOP_SENDING): the answer is what the replica gets, not a send error."""
    client, server = stream_pair(high_water=1024)
    async with trio.open_nursery() as nursery:

        async def pylon() -> None:
            await server.receive()
            await server.send(encode_headers([(b"x-status", b"400")]))
            await server.send(encode_body(b'{"detail":"missing required x-model header"}'))
            await server.send(b"", end=True)
            server.stop(0)

        nursery.start_soon(pylon)
        response = await send_request(client, "POST", b"/v1/x", [], b"y" * 100_000, math.inf)
        assert response.status == 400
        assert b"x-model" in await response.read()


async def test_closing_an_unfinished_response_resets_both_ways() -> None:
    client, server = stream_pair()
    async with trio.open_nursery() as nursery:

        async def pylon() -> None:
            await read_all(server)
            await server.send(encode_headers([(b"x-status", b"200")]))
            await server.send(encode_body(b"data: 1\n\n"))

        nursery.start_soon(pylon)
        response = await send_request(client, "POST", b"/v1/x", [], b"{}", math.inf)
        async with response:
            assert await anext(response.aiter_bytes()) == b"data: 1\n\n"
    assert client.resets == [0] and client.stops == [0]
    with pytest.raises(StreamClosed):  # the Pylon learns it at its next write
        await server.send(encode_body(b"data: 2\n\n"))


# ----------------------------------------------------------------------------- the Pylon's side


async def test_the_pylon_reads_the_head_and_the_body_and_answers_with_x_status_last() -> None:
    client, server = stream_pair()
    await client.send(
        encode_headers(
            [(b"x-method", b"POST"), (b"x-path", b"/v1/chat/completions?a=1"), (b"x-model", b"m")]
        )
    )
    await client.send(encode_body(b'{"stream":'))
    await client.send(encode_body(b"true}"), end=True)
    reader = TunnelRequestReader(server)
    head = await reader.head()
    assert head is not None
    assert (head.method, head.path, head.query) == ("POST", "/v1/chat/completions", b"a=1")
    assert head.headers == [(b"x-model", b"m")]
    assert await reader.body(1024) == b'{"stream":true}'
    sink = TunnelSink(server)
    await sink.start(200, [(b"content-type", b"text/event-stream")], body_follows=True)
    await sink.send(b"data: 1\n\n", more=True)
    await sink.send(b"", more=False)
    sent = messages(await read_all(client))
    assert sent[0] == HeadersMessage(
        [(b"content-type", b"text/event-stream"), (b"x-status", b"200")], trailers=False
    )
    assert sent[1:] == [BodyMessage(b"data: 1\n\n")]


@pytest.mark.parametrize(
    ("head", "error"),
    [
        ([(b"x-path", b"/")], "missing required x-method header"),
        ([(b"x-method", b"PO ST"), (b"x-path", b"/")], "invalid x-method header"),
        ([(b"x-method", b"GET")], "missing required x-path header"),
    ],
)
async def test_a_head_without_method_or_path_is_refused(
    head: list[tuple[bytes, bytes]], error: str
) -> None:
    client, server = stream_pair()
    await client.send(encode_headers(head), end=True)
    with pytest.raises(BadTunnelRequest, match=error):
        await TunnelRequestReader(server).head()


async def test_a_body_over_the_limit_is_refused() -> None:
    client, server = stream_pair()
    await client.send(encode_headers([(b"x-method", b"POST"), (b"x-path", b"/")]))
    await client.send(encode_body(b"x" * 11), end=True)
    reader = TunnelRequestReader(server)
    assert await reader.head() is not None
    with pytest.raises(BodyTooLarge):
        await reader.body(10)


async def test_a_stream_that_ends_before_a_head_has_nothing_to_answer() -> None:
    client, server = stream_pair()
    await client.send(b"", end=True)
    with pytest.raises(Exception, match="before the head"):
        await TunnelRequestReader(server).head()
