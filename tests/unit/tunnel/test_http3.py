"""The http3 exchange over real loopback QUIC, in both orientations (docs/tunnels.md, "HTTP/3").

direct: the replica dialed the Pylon, so it is the QUIC client and its requests use
client-initiated streams (0, 4, ...). reverse: the Pylon dialed the replica, so the replica is the
QUIC server and the HTTP/3 client, and its requests use server-initiated streams (1, 5, ...).
The Pylon side is `serve_http3` with a fake hop. A few tests replace it with a hand-driven H3
server, to send what a well-behaved Pylon never sends.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import FrameType, H3Connection, encode_frame
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic import events

from stargate.pylon.hop import StreamAborted
from stargate.tunnel.http3 import _H3, DATA_FRAME_BYTES, Http3Link, serve_http3
from stargate.tunnel.quic import (
    ALPN_HTTP3,
    SEND_HIGH_WATER,
    QuicConnection,
    client_configuration,
    connect,
    generate_self_signed,
    serve,
    server_configuration,
)
from stargate.tunnel.quic.tls import STREAM_RECEIVE_WINDOW
from stargate.upstream import ResponseHeadTimeout, UpstreamProtocolError

KiB = 1024
MiB = 1024 * KiB
IDENTITY = generate_self_signed()
ORIENTATIONS = pytest.mark.parametrize("orientation", ["direct", "reverse"])

Answer = Callable[[Any, Callable[[int], Awaitable[bytes]], Any], Awaitable[None]]


class FakeHop:
    """Answers with `answer`, records the requests and bodies, and notices cancellation."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[Any] = []
        self.cancelled = trio.Event()

    async def forward(
        self, request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any
    ) -> None:
        self.requests.append(request)
        try:
            await self.answer(request, read_body, sink)
        except trio.Cancelled:
            self.cancelled.set()
            raise


@dataclass
class Tunnel:
    link: Http3Link
    replica: QuicConnection
    pylon: QuicConnection


@asynccontextmanager
async def quic_pair(orientation: str) -> AsyncIterator[tuple[QuicConnection, QuicConnection]]:
    """(replica, pylon) connections on 127.0.0.1, both negotiating ALPN h3."""
    server = server_configuration(*IDENTITY, alpn=ALPN_HTTP3)
    client = client_configuration(
        insecure=True, trust_pem=None, server_name="stargate", alpn=ALPN_HTTP3
    )
    async with (
        serve("127.0.0.1", 0, lambda: server) as listener,
        trio.open_nursery() as nursery,
    ):
        dialed = await connect(nursery, "127.0.0.1", listener.port, client, timeout=5)
        accepted = await listener.connections().receive()
        yield (dialed, accepted) if orientation == "direct" else (accepted, dialed)
        dialed.close()
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def tunnel(orientation: str, hop: FakeHop, *, late: bool = False) -> AsyncIterator[Tunnel]:
    """A replica link and a Pylon serving `hop`. `late`: the Pylon starts its H3 server only once
    the replica's SETTINGS have reached it (the reverse handshake's order)."""
    with trio.fail_after(8):
        async with quic_pair(orientation) as (replica, pylon), trio.open_nursery() as nursery:
            link = Http3Link.replica_side(replica)
            if late:
                control = link.h3._local_control_stream_id
                while not (  # noqa: ASYNC110 - driver state without an event of its own
                    control in pylon.quic._streams
                    and pylon.quic._streams[control].receiver.starting_offset() > 0
                ):
                    await trio.sleep(0.01)
                await trio.sleep(0.1)
            nursery.start_soon(serve_http3, pylon, hop)
            yield Tunnel(link, replica, pylon)
            nursery.cancel_scope.cancel()


def deadline(seconds: float = 5) -> float:
    return trio.current_time() + seconds


async def answer_ok(request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any) -> None:
    body = await read_body(64 * MiB)
    await sink.start(200, [(b"content-type", b"application/json")], body_follows=True)
    await sink.send(b'{"size":%d}' % len(body), more=False)


TUNNEL_HEADERS = [(b"x-request-id", b"r1"), (b"x-model", b"m"), (b"x-input-tokens", b"3")]


# The request.


@ORIENTATIONS
async def test_the_request_head_and_a_3_mib_body_arrive_intact(orientation: str) -> None:
    bodies: list[bytes] = []

    async def answer(request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any) -> None:
        bodies.append(await read_body(64 * MiB))
        await sink.start(200, [], body_follows=True)
        await sink.send(b"ok", more=False)

    hop = FakeHop(answer)
    body = os.urandom(3 * MiB + 5)
    headers = [
        (b"x-request-id", b"r1"),
        (b"x-tag", b"a"),
        (b"Connection", b"keep-alive"),
        (b"host", b"example.com"),
        (b"te", b"trailers"),
        (b"transfer-encoding", b"chunked"),
        (b"upgrade", b"h2c"),
        (b"keep-alive", b"5"),
        (b"proxy-connection", b"close"),
        (b"trailer", b"x-end"),
        (b"x-tag", b"b"),
        (b"content-type", b"application/json"),
    ]
    async with tunnel(orientation, hop) as t:
        assert t.replica.alpn == t.pylon.alpn == "h3"
        for payload in (body, b"{}"):
            response = await t.link.request(
                "POST", b"/v1/chat/completions?trace=1&x=y", headers, payload, deadline()
            )
            async with response:
                assert response.status == 200
                assert await response.read() == b"ok"
                assert response.complete
        # Requests on the replica's own bidirectional streams, whatever its QUIC role.
        assert t.replica.quic.get_next_available_stream_id() == (
            8 if orientation == "direct" else 9
        )
    request = hop.requests[0]
    assert (request.method, request.path, request.query) == (
        "POST",
        "/v1/chat/completions",
        b"trace=1&x=y",
    )
    assert request.headers == [
        (b"x-request-id", b"r1"),
        (b"x-tag", b"a"),
        (b"x-tag", b"b"),
        (b"content-type", b"application/json"),
    ]
    assert bodies == [body, b"{}"]


class RawServer:
    """A hand-driven H3 server (aioquic's own in direct mode): records each request's raw
    header list and answers every request with `head` and b"body", or with `misbehave`."""

    def __init__(
        self,
        connection: QuicConnection,
        orientation: str,
        head: list[tuple[bytes, bytes]],
        *,
        misbehave: bool = False,
    ) -> None:
        quic = connection.quic
        self.h3 = H3Connection(quic) if orientation == "direct" else _H3(quic, http_client=False)
        self.head = head
        self.misbehave = misbehave
        self.requests: list[list[tuple[bytes, bytes]]] = []
        connection.event_handler = self.on_event

    def on_event(self, event: events.QuicEvent) -> None:
        for h3_event in self.h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived):
                self.requests.append(h3_event.headers)
            if isinstance(h3_event, HeadersReceived | DataReceived) and h3_event.stream_ended:
                if self.misbehave:  # DATA is not allowed on a control stream
                    control = self.h3._local_control_stream_id
                    assert control is not None
                    self.h3._quic.send_stream_data(control, encode_frame(FrameType.DATA, b"x"))
                    continue
                # By hand: aioquic would hold a 1xx head back as an interim answer.
                stream_id = h3_event.stream_id
                head = encode_frame(
                    FrameType.HEADERS, self.h3._encode_headers(stream_id, self.head)
                )
                answer = head + encode_frame(FrameType.DATA, b"body")
                self.h3._quic.send_stream_data(stream_id, answer, end_stream=True)


@ORIENTATIONS
async def test_the_request_carries_the_pseudo_headers_and_the_answer_its_headers(
    orientation: str,
) -> None:
    with trio.fail_after(8):
        async with quic_pair(orientation) as (replica, pylon):
            link = Http3Link.replica_side(replica)
            server = RawServer(pylon, orientation, [(b":status", b"201"), (b"x-b", b"2")])
            response = await link.request("GET", b"/health?probe=1", [], b"", deadline())
            assert (response.status, response.headers) == (201, [(b"x-b", b"2")])
            assert await response.read() == b"body"
    assert server.requests == [
        [
            (b":method", b"GET"),
            (b":scheme", b"https"),
            (b":authority", b"stargate"),
            (b":path", b"/health?probe=1"),
        ]
    ]


# The answer.


@ORIENTATIONS
async def test_an_sse_answer_arrives_event_by_event_without_content_length(
    orientation: str,
) -> None:
    sse = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    gates = [trio.Event() for _ in sse]

    async def answer(request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any) -> None:
        await read_body(MiB)
        head = [
            (b"content-type", b"text/event-stream"),
            (b"content-length", b"999"),
            (b"transfer-encoding", b"chunked"),
            (b"x-trace", b"t"),
        ]
        await sink.start(200, head, body_follows=False)
        for index, event in enumerate(sse):
            await gates[index].wait()
            await sink.send(event, more=index < len(sse) - 1)

    async with tunnel(orientation, FakeHop(answer)) as t:
        response = await t.link.request("POST", b"/v1/chat/completions", [], b"{}", deadline())
        assert response.status == 200
        assert response.headers == [(b"content-type", b"text/event-stream"), (b"x-trace", b"t")]
        chunks = response.aiter_bytes()
        for index, event in enumerate(sse):
            gates[index].set()  # the next event is only sent once this one was read
            assert await anext(chunks) == event
        with pytest.raises(StopAsyncIteration):
            await anext(chunks)
        assert response.complete


@ORIENTATIONS
async def test_an_early_400_wins_over_an_upload_the_pylon_never_reads(orientation: str) -> None:
    async def answer(request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any) -> None:
        await sink.start(400, [(b"content-type", b"application/problem+json")], body_follows=True)
        await sink.send(b'{"status":400}', more=False)

    async with tunnel(orientation, FakeHop(answer)) as t:
        started = trio.current_time()
        response = await t.link.request(
            "POST", b"/v1/chat/completions", [], os.urandom(8 * MiB), deadline()
        )
        assert trio.current_time() - started < 2
        assert response.status == 400
        assert response.headers == [(b"content-type", b"application/problem+json")]
        assert await response.read() == b'{"status":400}'
        assert t.link.healthy


@ORIENTATIONS
async def test_a_503_with_retry_headers_passes_through(orientation: str) -> None:
    retry = [
        (b"x-stargate-retryable", b"true"),
        (b"x-stargate-retry-reason", b"upstream_admission_rejected"),
        (b"x-stargate-retry-after-ms", b"2000"),
    ]

    async def answer(request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any) -> None:
        await read_body(MiB)
        await sink.start(503, retry, body_follows=True)
        await sink.send(b"busy", more=False)

    async with tunnel(orientation, FakeHop(answer)) as t:
        response = await t.link.request("POST", b"/v1/chat/completions", [], b"{}", deadline())
        assert (response.status, response.headers) == (503, retry)
        assert await response.read() == b"busy"


@ORIENTATIONS
@pytest.mark.parametrize(
    "status",
    [None, b"abc", b"2000", b"20", b"099", b"101"],
    ids=["missing", "letters", "four-digits", "two-digits", "leading-zero", "switching"],
)
async def test_a_missing_or_invalid_status_reads_as_502(
    orientation: str, status: bytes | None
) -> None:
    head = [(b"x-kept", b"1")] if status is None else [(b":status", status), (b"x-kept", b"1")]
    with trio.fail_after(8):
        async with quic_pair(orientation) as (replica, pylon):
            link = Http3Link.replica_side(replica)
            RawServer(pylon, orientation, head)
            response = await link.request("GET", b"/health", [], b"", deadline())
            assert (response.status, response.headers) == (502, [(b"x-kept", b"1")])
            assert await response.read() == b"body"
            assert link.healthy  # not a connection error, as aioquic would make it


@ORIENTATIONS
async def test_an_h3_connection_error_fails_the_request_and_the_link(orientation: str) -> None:
    with trio.fail_after(8):
        async with quic_pair(orientation) as (replica, pylon):
            link = Http3Link.replica_side(replica)
            RawServer(pylon, orientation, [], misbehave=True)
            with pytest.raises(UpstreamProtocolError) as info:
                await link.request("GET", b"/health", [], b"", deadline())
            assert info.value.request_sent
            assert not link.healthy
            with pytest.raises(UpstreamProtocolError) as refused:
                await link.request("GET", b"/health", [], b"", deadline())
            assert not refused.value.request_sent


# Failures and cancellation.


@ORIENTATIONS
async def test_a_reset_before_the_head_is_a_protocol_error(orientation: str) -> None:
    async def answer(request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any) -> None:
        await read_body(MiB)
        raise RuntimeError("the engine exploded")

    async with tunnel(orientation, FakeHop(answer)) as t:
        with pytest.raises(UpstreamProtocolError) as info:
            await t.link.request("POST", b"/v1/chat/completions", [], b"{}", deadline())
        assert info.value.request_sent
        assert "reset by the peer" in str(info.value)
        assert t.link.healthy  # one stream failed, not the connection


@ORIENTATIONS
async def test_a_reset_after_the_head_breaks_the_body(orientation: str) -> None:
    async def answer(request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any) -> None:
        await read_body(MiB)
        await sink.start(200, [], body_follows=True)
        await sink.send(b"data: 1\n\n", more=True)
        raise StreamAborted("output timeout")

    async with tunnel(orientation, FakeHop(answer)) as t:
        response = await t.link.request("POST", b"/v1/chat/completions", [], b"{}", deadline())
        chunks = response.aiter_bytes()
        assert await anext(chunks) == b"data: 1\n\n"
        with pytest.raises(UpstreamProtocolError) as info:
            await anext(chunks)
        assert info.value.request_sent
        assert not response.complete
        await response.aclose()


@ORIENTATIONS
async def test_the_head_deadline_times_out_and_cancels_the_hop(orientation: str) -> None:
    async def answer(request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any) -> None:
        await read_body(MiB)
        await trio.sleep_forever()

    hop = FakeHop(answer)
    async with tunnel(orientation, hop) as t:
        with pytest.raises(ResponseHeadTimeout) as info:
            await t.link.request("POST", b"/v1/chat/completions", [], b"{}", deadline(0.3))
        assert info.value.request_sent
        with trio.fail_after(2):
            await hop.cancelled.wait()


@ORIENTATIONS
async def test_closing_the_response_mid_body_cancels_the_hop(orientation: str) -> None:
    async def answer(request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any) -> None:
        await read_body(MiB)
        await sink.start(200, [(b"content-type", b"text/event-stream")], body_follows=True)
        await sink.send(b"data: 1\n\n", more=True)
        await trio.sleep_forever()

    hop = FakeHop(answer)
    async with tunnel(orientation, hop) as t:
        response = await t.link.request("POST", b"/v1/chat/completions", [], b"{}", deadline())
        assert await anext(response.aiter_bytes()) == b"data: 1\n\n"
        await response.aclose()
        with trio.fail_after(2):
            await hop.cancelled.wait()
        assert t.link.healthy


@ORIENTATIONS
async def test_the_pylon_closing_the_connection_fails_a_waiting_body_read(orientation: str) -> None:
    first_sent = trio.Event()

    async def answer(request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any) -> None:
        await read_body(MiB)
        await sink.start(200, [], body_follows=True)
        await sink.send(b"data: 1\n\n", more=True)
        first_sent.set()
        await trio.sleep_forever()

    async with tunnel(orientation, FakeHop(answer)) as t:
        response = await t.link.request("POST", b"/v1/chat/completions", [], b"{}", deadline())
        chunks = response.aiter_bytes()
        assert await anext(chunks) == b"data: 1\n\n"
        await first_sent.wait()
        t.pylon.close(0, "going away")
        with trio.fail_after(2), pytest.raises(UpstreamProtocolError) as info:
            await anext(chunks)
        assert "going away" in str(info.value)
        assert not t.link.healthy


@ORIENTATIONS
async def test_a_closed_link_refuses_requests_before_sending(orientation: str) -> None:
    async with tunnel(orientation, FakeHop(answer_ok)) as t:
        was_healthy = t.link.healthy
        t.link.close()
        assert was_healthy and not t.link.healthy
        with pytest.raises(UpstreamProtocolError) as info:
            await t.link.request("GET", b"/health", [], b"", deadline())
        assert not info.value.request_sent


# Ordering, concurrency and flow control.


@ORIENTATIONS
async def test_settings_sent_before_the_pylon_serves_are_kept_for_it(orientation: str) -> None:
    async with tunnel(orientation, FakeHop(answer_ok), late=True) as t:
        response = await t.link.request(
            "POST", b"/v1/embeddings", TUNNEL_HEADERS, b"{}", deadline()
        )
        assert (response.status, await response.read()) == (200, b'{"size":2}')
        server: Any = getattr(t.pylon.event_handler, "__self__", None)
        assert server.h3.received_settings is not None  # the replica's early SETTINGS
        assert t.link.h3.received_settings is not None


@ORIENTATIONS
async def test_a_finished_unknown_uni_stream_is_forgotten_on_both_sides(orientation: str) -> None:
    """Which unidirectional streams are the peer's follows the QUIC role, not the HTTP one: a
    GREASE stream (an unknown type, ignored) is dropped at its FIN, as aioquic does."""
    async with tunnel(orientation, FakeHop(answer_ok)) as t:
        response = await t.link.request("POST", b"/v1/x", [], b"{}", deadline())
        assert response.status == 200
        opened = []
        for sender, receiver in ((t.pylon, t.replica), (t.replica, t.pylon)):
            stream_id = sender.quic.get_next_available_stream_id(is_unidirectional=True)
            sender.quic.send_stream_data(stream_id, encode_uint_var(0x21) + b"grease", True)
            sender.transmit()
            opened.append((receiver, stream_id))
        for receiver, stream_id in opened:
            while not fin_received(receiver, stream_id):  # noqa: ASYNC110 - no event for it
                await trio.sleep(0.01)
        server: Any = getattr(t.pylon.event_handler, "__self__", None)
        assert opened[0][1] not in t.link.h3._stream
        assert opened[1][1] not in server.h3._stream


def fin_received(connection: QuicConnection, stream_id: int) -> bool:
    quic = connection.quic
    if stream_id in quic._streams:
        return quic._streams[stream_id].receiver.is_finished
    return quic._stream_is_discarded(stream_id)


@ORIENTATIONS
async def test_a_stream_reset_before_its_head_is_ended_and_forgotten(orientation: str) -> None:
    hop = FakeHop(answer_ok)
    async with tunnel(orientation, hop) as t:
        response = await t.link.request("POST", b"/v1/x", [], b"{}", deadline())
        assert response.status == 200
        quic = t.replica.quic
        stream_id = quic.get_next_available_stream_id()
        partial = encode_uint_var(FrameType.HEADERS) + encode_uint_var(100) + b"cut"
        quic.send_stream_data(stream_id, partial)
        t.replica.transmit()
        while not (  # noqa: ASYNC110 - driver state without an event of its own
            stream_id in t.pylon.quic._streams
            and t.pylon.quic._streams[stream_id].receiver.starting_offset() == len(partial)
        ):
            await trio.sleep(0.01)
        server: Any = getattr(t.pylon.event_handler, "__self__", None)
        assert stream_id in server.h3._stream
        quic.reset_stream(stream_id, 0x10C)
        t.replica.transmit()
        while not fin_received(t.pylon, stream_id):  # noqa: ASYNC110 - no event for it
            await trio.sleep(0.01)
        assert stream_id not in server.h3._stream
        pylon_stream = t.pylon.quic._streams.get(stream_id)
        assert pylon_stream is None or pylon_stream.sender._reset_error_code is not None
        assert len(hop.requests) == 1


@ORIENTATIONS
async def test_a_complete_answer_before_the_body_stops_the_upload(orientation: str) -> None:
    async def answer(request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any) -> None:
        await sink.start(200, [], body_follows=True)
        await sink.send(b"done", more=False)

    body = os.urandom(16 * MiB)
    async with tunnel(orientation, FakeHop(answer)) as t:
        response = await t.link.request("POST", b"/v1/x", [], body, deadline())
        assert (response.status, await response.read()) == (200, b"done")
        stream = t.pylon.quic._streams.get(0 if orientation == "direct" else 1)
        assert stream is None or stream.receiver.highest_offset < len(body) // 2


@ORIENTATIONS
async def test_twenty_concurrent_requests(orientation: str) -> None:
    async with tunnel(orientation, FakeHop(answer_ok)) as t:
        answers: dict[int, bytes] = {}

        async def one(index: int) -> None:
            body = b"x" * (index * 1000)
            async with await t.link.request("POST", b"/v1/x", [], body, deadline()) as response:
                answers[index] = await response.read()

        async with trio.open_nursery() as nursery:
            for index in range(20):
                nursery.start_soon(one, index)
        assert answers == {i: b'{"size":%d}' % (i * 1000) for i in range(20)}


async def wait_until_still(value: Callable[[], int], *, quiet: float = 0.1) -> int:
    last = value()
    while True:
        await trio.sleep(quiet)
        if (now := value()) == last:
            return now
        last = now


BOUND = STREAM_RECEIVE_WINDOW + SEND_HIGH_WATER + 4 * DATA_FRAME_BYTES
"""One receive window buffered by the reader, plus the writer's backlog and a frame or two."""


@ORIENTATIONS
async def test_an_answer_the_replica_does_not_read_holds_back_the_pylon(orientation: str) -> None:
    sent = 0

    async def answer(request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any) -> None:
        nonlocal sent
        await read_body(MiB)
        await sink.start(200, [], body_follows=True)
        for _ in range(3 * MiB // DATA_FRAME_BYTES):
            await sink.send(b"y" * DATA_FRAME_BYTES, more=True)
            sent += DATA_FRAME_BYTES
        await sink.send(b"", more=False)

    async with tunnel(orientation, FakeHop(answer)) as t:
        response = await t.link.request("POST", b"/v1/x", [], b"{}", deadline())
        assert 0 < await wait_until_still(lambda: sent) <= BOUND
        assert await response.read() == b"y" * 3 * MiB
        assert response.complete


@ORIENTATIONS
async def test_an_upload_the_hop_has_not_read_yet_holds_back_the_replica(orientation: str) -> None:
    gate = trio.Event()
    bodies: list[bytes] = []

    async def answer(request: Any, read_body: Callable[[int], Awaitable[bytes]], sink: Any) -> None:
        await gate.wait()
        bodies.append(await read_body(64 * MiB))
        await sink.start(200, [], body_follows=True)
        await sink.send(b"ok", more=False)

    body = os.urandom(3 * MiB)
    async with tunnel(orientation, FakeHop(answer)) as t, trio.open_nursery() as nursery:
        results: list[int] = []

        async def upload() -> None:
            async with await t.link.request("POST", b"/v1/x", [], body, deadline()) as response:
                results.append(response.status)

        nursery.start_soon(upload)
        stream_id = 0 if orientation == "direct" else 1

        def received() -> int:
            stream = t.pylon.quic._streams.get(stream_id)
            return 0 if stream is None else stream.receiver.starting_offset()

        assert 0 < await wait_until_still(received) <= BOUND
        assert t.link._backlog(stream_id) <= SEND_HIGH_WATER + DATA_FRAME_BYTES
        assert not results
        gate.set()
    assert results == [200]
    assert bodies == [body]
