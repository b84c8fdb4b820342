"""The trio QUIC driver (stargate/tunnel/quic) over real loopback UDP: streams, ids in both roles,
bounded buffers, resets and stops, closing, the stream-count limit, the HTTP/3 event hook, the
idle timeout, and a server with many clients. The TLS side is in test_quic_tls.py."""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

import pytest
import trio
from aioquic.buffer import Buffer  # type: ignore[attr-defined]
from aioquic.quic import events
from aioquic.quic.packet import QuicPacketType, pull_quic_header

from stargate.tunnel.quic import (
    ConnectFailed,
    ConnectionClosed,
    QuicConnection,
    QuicServer,
    QuicStream,
    TunnelConfiguration,
    client_configuration,
    connect,
    generate_self_signed,
    serve,
    server_configuration,
)
from stargate.tunnel.stream import StreamClosed, StreamReset, TunnelStream

KiB = 1024
MiB = 1024 * KiB


IDENTITY = generate_self_signed()


def server_config(**changes: Any) -> TunnelConfiguration:
    configuration = server_configuration(*IDENTITY, alpn=None)
    for name, value in changes.items():
        setattr(configuration, name, value)
    return configuration


def client_config(**changes: Any) -> TunnelConfiguration:
    configuration = client_configuration(
        insecure=True, trust_pem=None, server_name="stargate", alpn=None
    )
    for name, value in changes.items():
        setattr(configuration, name, value)
    return configuration


@asynccontextmanager
async def quic_pair(
    server: TunnelConfiguration | None = None,
    client: TunnelConfiguration | None = None,
    *,
    deadline: float = 8,
) -> AsyncIterator[tuple[QuicConnection, QuicConnection]]:
    """A connected (client, server-side connection) pair on 127.0.0.1."""
    configuration = server or server_config()
    with trio.fail_after(deadline):
        async with (
            serve("127.0.0.1", 0, lambda: configuration) as listener,
            trio.open_nursery() as nursery,
        ):
            dialed = await connect(
                nursery, "127.0.0.1", listener.port, client or client_config(), timeout=5
            )
            accepted = await listener.connections().receive()
            yield dialed, accepted
            dialed.close()
            nursery.cancel_scope.cancel()


async def read_all(stream: QuicStream) -> bytes:
    chunks = []
    while chunk := await stream.receive():
        chunks.append(chunk)
    return b"".join(chunks)


async def echo_streams(connection: QuicConnection) -> None:
    """Answer every stream the peer opens with b"echo:" + what it sent."""

    async def echo(stream: QuicStream) -> None:
        with suppress(StreamReset, StreamClosed):
            await stream.send(b"echo:" + await read_all(stream), end=True)

    async with trio.open_nursery() as nursery:
        while True:
            try:
                stream = await connection.accept_stream()
            except ConnectionClosed:
                return
            nursery.start_soon(echo, stream)


async def request(connection: QuicConnection, body: bytes) -> bytes:
    stream = await connection.open_stream()
    await stream.send(body, end=True)
    return await read_all(stream)


async def wait_until(predicate: Callable[[], bool], *, step: float = 0.01) -> None:
    while not predicate():  # noqa: ASYNC110 - driver state without an event of its own
        await trio.sleep(step)


async def wait_until_still(value: Callable[[], int], *, quiet: float = 0.15) -> int:
    """Wait until `value()` stopped changing for `quiet` seconds; return it."""
    last = value()
    while True:
        await trio.sleep(quiet)
        if (now := value()) == last:
            return now
        last = now


# Exchanges and stream ids.


async def test_fifty_concurrent_request_response_exchanges() -> None:
    async with quic_pair() as (client, server), trio.open_nursery() as nursery:
        nursery.start_soon(echo_streams, server)
        answers: dict[int, bytes] = {}

        async def one(index: int) -> None:
            answers[index] = await request(client, f"request {index}".encode())

        async with trio.open_nursery() as requests:
            for index in range(50):
                requests.start_soon(one, index)
        assert answers == {i: f"echo:request {i}".encode() for i in range(50)}
        nursery.cancel_scope.cancel()


async def test_three_mebibytes_up_and_down_arrive_byte_exact() -> None:
    payload = os.urandom(3 * MiB)
    async with quic_pair() as (client, server), trio.open_nursery() as nursery:
        nursery.start_soon(echo_streams, server)
        assert await request(client, payload) == b"echo:" + payload
        nursery.cancel_scope.cancel()


async def test_the_dialer_opens_client_bidi_ids_and_the_server_accepts_them_in_order() -> None:
    async with quic_pair() as (client, server):
        opened = [await client.open_stream() for _ in range(3)]
        assert [s.stream_id for s in opened] == [0, 4, 8]
        for stream in reversed(opened):  # arrival order does not change the accept order
            await stream.send(b"x")
        accepted = [await server.accept_stream() for _ in range(3)]
        assert [s.stream_id for s in accepted] == [0, 4, 8]
        assert [await s.receive() for s in accepted] == [b"x", b"x", b"x"]


async def test_the_server_opens_server_bidi_ids_which_the_client_accepts() -> None:
    async with quic_pair() as (client, server):
        opened = []
        for index in range(3):
            opened.append(stream := await server.open_stream())
            await stream.send(f"reverse {index}".encode(), end=True)
        assert [s.stream_id for s in opened] == [1, 5, 9]
        accepted = [await client.accept_stream() for _ in range(3)]
        assert [s.stream_id for s in accepted] == [1, 5, 9]
        assert [await read_all(s) for s in accepted] == [b"reverse 0", b"reverse 1", b"reverse 2"]
        await accepted[1].send(b"answer", end=True)
        assert await read_all(opened[1]) == b"answer"


async def test_fin_reads_as_empty_forever_and_sending_after_fin_is_closed() -> None:
    async with quic_pair() as (client, server):
        stream = await client.open_stream()
        await stream.send(b"last", end=True)
        with pytest.raises(StreamClosed, match="after FIN"):
            await stream.send(b"more")
        accepted = await server.accept_stream()
        assert await read_all(accepted) == b"last"
        assert await accepted.receive() == b""
        assert await accepted.receive() == b""


# Backpressure.


async def test_a_reader_that_does_not_read_bounds_both_sides_until_it_reads() -> None:
    window, chunk, total = 64 * KiB, 32 * KiB, 1 * MiB
    async with quic_pair(server=server_config(max_stream_data=window)) as (client, server):
        stream = await client.open_stream()
        queued = 0
        done = trio.Event()

        async def upload() -> None:
            nonlocal queued
            for offset in range(0, total, chunk):
                queued += chunk
                await stream.send(bytes([offset // chunk % 251]) * chunk, end=queued == total)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(upload)
            accepted = await server.accept_stream()
            stalled_at = await wait_until_still(lambda: queued)
            assert not done.is_set()
            assert accepted.buffered <= window
            assert stream.send_backlog <= client.send_high_water + chunk
            assert stalled_at <= window + client.send_high_water + 2 * chunk

            received = await read_all(accepted)
            assert done.is_set()
        assert len(received) == total
        assert received == b"".join(bytes([i % 251]) * chunk for i in range(total // chunk))


# Resets, stops, closing.


async def test_a_peer_reset_wakes_a_waiting_reader() -> None:
    async with quic_pair() as (client, server):
        stream = await client.open_stream()
        await stream.send(b"x")
        accepted = await server.accept_stream()
        assert await accepted.receive() == b"x"
        async with trio.open_nursery() as nursery:
            failures: list[StreamReset] = []

            async def reader() -> None:
                with pytest.raises(StreamReset) as caught:
                    await accepted.receive()
                failures.append(caught.value)

            nursery.start_soon(reader)
            await trio.sleep(0.05)
            stream.reset(7)
            stream.reset(8)  # idempotent
        assert [f.code for f in failures] == [7]
        with pytest.raises(StreamClosed, match="after reset"):
            await stream.send(b"y")


async def test_stop_makes_the_peer_send_raise_stream_closed() -> None:
    async with quic_pair() as (client, server):
        stream = await client.open_stream()
        await stream.send(b"x")
        accepted = await server.accept_stream()
        assert await accepted.receive() == b"x"
        accepted.stop(5)
        accepted.stop(5)  # idempotent
        with pytest.raises(StreamClosed, match="receiving was stopped"):
            await accepted.receive()
        with pytest.raises(StreamClosed, match=r"stop sending \(code 5\)"):
            with trio.fail_after(2):
                while True:
                    await stream.send(b"y" * 1000)
                    await trio.sleep(0.01)


async def test_a_blocked_writer_is_woken_by_the_peers_stop() -> None:
    async with quic_pair(server=server_config(max_stream_data=16 * KiB)) as (client, server):
        client.send_high_water = 8 * KiB
        stream = await client.open_stream()
        await stream.send(b"x")
        accepted = await server.accept_stream()
        async with trio.open_nursery() as nursery:

            async def writer() -> None:
                with pytest.raises(StreamClosed):
                    while True:
                        await stream.send(b"y" * 16 * KiB)

            nursery.start_soon(writer)
            await wait_until(lambda: stream.send_backlog > client.send_high_water)
            accepted.stop(0)


async def test_closing_the_connection_fails_open_streams_on_both_sides() -> None:
    async with quic_pair() as (client, server):
        stream = await client.open_stream()
        await stream.send(b"x")
        accepted = await server.accept_stream()
        async with trio.open_nursery() as nursery:
            outcomes: list[StreamReset] = []

            async def reader() -> None:
                with pytest.raises(StreamReset) as caught:
                    await stream.receive()
                outcomes.append(caught.value)

            nursery.start_soon(reader)
            await trio.sleep(0.05)
            server.close(0, "going away")
        assert (outcomes[0].code, str(outcomes[0])) == (0, "connection closed")
        assert not server.is_open
        with pytest.raises(StreamReset, match="connection closed"):
            await accepted.receive()  # our own close fails our streams at once
        with pytest.raises(StreamClosed, match="connection closed"):
            await stream.send(b"y")
        with pytest.raises(ConnectionClosed, match="going away"):
            await client.open_stream()
        with pytest.raises(ConnectionClosed):
            await client.accept_stream()
        with trio.fail_after(3):
            await client.wait_closed()
            await server.wait_closed()
        assert "going away" in client.close_reason


async def test_open_stream_past_the_peers_limit_waits_until_a_stream_finishes() -> None:
    async with quic_pair(server=server_config(max_streams_bidi=2)) as (client, server):
        first, second = await client.open_stream(), await client.open_stream()
        await first.send(b"1", end=True)
        await second.send(b"2")
        with trio.move_on_after(0.3) as waited:
            await client.open_stream()
        assert waited.cancelled_caught

        async with trio.open_nursery() as nursery:
            opened: list[QuicStream] = []

            async def opener() -> None:
                opened.append(await client.open_stream())

            nursery.start_soon(opener)
            accepted = await server.accept_stream()
            assert await read_all(accepted) == b"1"
            await trio.sleep(0.1)
            assert not opened  # stream 0 is not finished until the server's FIN is acked
            await accepted.send(b"", end=True)
            assert await read_all(first) == b""
        assert [s.stream_id for s in opened] == [8]


async def test_cancelling_the_dialers_nursery_aborts_the_connection() -> None:
    async with serve("127.0.0.1", 0, server_config) as listener:
        async with trio.open_nursery() as nursery:
            client = await connect(nursery, "127.0.0.1", listener.port, client_config(), timeout=5)
            server = await listener.connections().receive()
            nursery.cancel_scope.cancel()
        assert not client.is_open
        with trio.fail_after(3):
            await client.wait_closed()
            await server.wait_closed()
            await wait_until(lambda: listener.connection_count == 0)


# The HTTP/3 hook.


async def test_events_before_the_event_handler_is_set_are_replayed_in_order() -> None:
    async with quic_pair() as (client, server):
        handshake = await client.open_stream()  # claimed by the demux before the hook
        await handshake.send(b"hello")
        claimed = await server.accept_stream()
        assert await claimed.receive() == b"hello"

        # What an HTTP/3 peer sends before our layer exists: uni and bidi streams.
        quic = client.quic
        sent: list[tuple[int, bytes, bool]] = []
        control = quic.get_next_available_stream_id(is_unidirectional=True)
        request = await client.open_stream()
        for stream_id, data, end in [
            (control, b"\x00settings", False),
            (request.stream_id, b"headers", False),
            (control, b"more", False),
            (request.stream_id, b"body", True),
        ]:
            quic.send_stream_data(stream_id, data, end_stream=end)
            client.transmit()
            sent.append((stream_id, data, end))
            await trio.sleep(0.02)  # one packet each, so the arrival order is the send order
        await wait_until(lambda: len(server._pending) == len(sent))

        seen: list[events.QuicEvent] = []
        server.event_handler = seen.append
        quic.send_stream_data(control, b"after", end_stream=False)
        client.transmit()
        sent.append((control, b"after", False))
        await handshake.send(b"still demuxed", end=True)

        await wait_until(lambda: len(seen) == len(sent))
        assert [
            (e.stream_id, e.data, e.end_stream)
            for e in seen
            if isinstance(e, events.StreamDataReceived)
        ] == sent
        assert await read_all(claimed) == b"still demuxed"
        with pytest.raises(RuntimeError):
            await server.accept_stream()


async def test_a_peer_cycling_through_streams_nobody_accepts_is_refused() -> None:
    server_side = server_config(max_streams_bidi=1, max_streams_uni=1)  # holds at most 18
    async with quic_pair(server=server_side) as (client, server):
        for _ in range(30):  # finished unidirectional streams free their slot at once
            stream_id = client.quic.get_next_available_stream_id(is_unidirectional=True)
            client.quic.send_stream_data(stream_id, b"x", end_stream=True)
        client.transmit()
        with trio.fail_after(3):
            await server.wait_closed()
        assert "too many streams opened and not accepted" in server.close_reason


def test_quic_streams_are_tunnel_streams() -> None:
    def as_tunnel_stream(stream: QuicStream) -> TunnelStream:
        return stream  # the check is mypy's

    assert as_tunnel_stream.__annotations__


# Timers.


async def test_the_idle_timeout_ends_the_connection() -> None:
    async with quic_pair(
        server=server_config(idle_timeout=0.5), client=client_config(idle_timeout=0.5)
    ) as (client, server):
        stream = await client.open_stream()
        await stream.send(b"x")
        accepted = await server.accept_stream()
        started = trio.current_time()
        with trio.fail_after(3):
            await client.wait_closed()
            await server.wait_closed()
        assert 0.4 <= trio.current_time() - started < 2.5
        assert "Idle timeout" in client.close_reason
        with pytest.raises(StreamReset, match="connection closed"):
            await accepted.receive()


# Endpoints.


async def test_a_server_with_twenty_clients_each_doing_requests() -> None:
    made = 0

    def factory() -> TunnelConfiguration:
        nonlocal made
        made += 1
        return server_config()

    with trio.fail_after(8):
        async with serve("127.0.0.1", 0, factory, on_connection=echo_streams) as listener:
            results: dict[tuple[int, int], bytes] = {}

            async def client_task(index: int) -> None:
                async with trio.open_nursery() as nursery:
                    connection = await connect(
                        nursery, "127.0.0.1", listener.port, client_config(), timeout=5
                    )
                    async with trio.open_nursery() as requests:
                        for n in range(5):
                            requests.start_soon(exchange, connection, index, n)
                    connection.close()

            async def exchange(connection: QuicConnection, index: int, n: int) -> None:
                results[index, n] = await request(connection, f"{index}/{n}".encode())

            async with trio.open_nursery() as clients:
                for index in range(20):
                    clients.start_soon(client_task, index)
            assert results == {
                (i, n): f"echo:{i}/{n}".encode() for i in range(20) for n in range(5)
            }
            assert made == 20
            await wait_until(lambda: listener.connection_count == 0)
            assert listener._routes == {}


async def test_a_server_started_as_a_task_hands_connections_to_its_callback() -> None:
    async with trio.open_nursery() as nursery:
        listener = await nursery.start(
            QuicServer.serve, "127.0.0.1", 0, server_config, echo_streams
        )
        dialed = await connect(nursery, "127.0.0.1", listener.port, client_config(), timeout=5)
        with trio.fail_after(5):
            assert await request(dialed, b"ping") == b"echo:ping"
        nursery.cancel_scope.cancel()
    assert not dialed.is_open


async def test_the_server_answers_an_unknown_version_with_version_negotiation() -> None:
    async with serve("127.0.0.1", 0, server_config) as listener:
        probe = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with probe:
            await probe.bind(("127.0.0.1", 0))
            dcid, scid = os.urandom(8), os.urandom(8)
            packet = (
                bytes([0xC0])
                + (0x1A2A3A4A).to_bytes(4, "big")
                + bytes([8])
                + dcid
                + bytes([8])
                + scid
            )
            await probe.sendto(packet.ljust(1200, b"\x00"), ("127.0.0.1", listener.port))
            with trio.fail_after(2):
                reply, _ = await probe.recvfrom(2048)
        header = pull_quic_header(Buffer(data=reply), host_cid_length=8)
        assert header.packet_type == QuicPacketType.VERSION_NEGOTIATION
        assert (header.destination_cid, header.source_cid) == (scid, dcid)
        assert 1 in header.supported_versions
        assert listener.connection_count == 0


async def test_dialing_a_closed_port_fails_fast_as_refused() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    async with trio.open_nursery() as nursery:
        with trio.fail_after(2), pytest.raises(ConnectFailed, match="refused"):
            await connect(nursery, "127.0.0.1", port, client_config(), timeout=5)


async def test_dialing_a_silent_peer_times_out() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))
        async with trio.open_nursery() as nursery:
            with pytest.raises(ConnectFailed, match=r"timed out after 0.3 s"):
                await connect(
                    nursery, "127.0.0.1", silent.getsockname()[1], client_config(), timeout=0.3
                )


# Writes of one loop turn leave together (transmit_soon).


async def test_the_writes_of_one_turn_share_packets() -> None:
    """Twenty streams each writing a small message in the same turn: the frames leave in a
    handful of datagrams, not one datagram (and one `datagrams_to_send` pass) per write."""
    async with quic_pair() as (client, server), trio.open_nursery() as nursery:
        nursery.start_soon(echo_streams, server)
        streams = [await client.open_stream() for _ in range(20)]
        await trio.sleep(0.05)  # the handshake's and the opening's packets are gone
        sent: list[bytes] = []
        original = client._send_datagram

        def counting(data: bytes, addr: Any) -> None:
            sent.append(data)
            original(data, addr)

        client._send_datagram = counting
        async with trio.open_nursery() as writers:
            for stream in streams:
                writers.start_soon(functools.partial(stream.send, b"x" * 40, end=True))
        client._send_datagram = original
        assert 1 <= len(sent) <= 3, len(sent)
        answers = [await read_all(stream) for stream in streams]
        assert answers == [b"echo:" + b"x" * 40] * 20
        nursery.cancel_scope.cancel()


async def test_a_reset_sends_what_was_written_before_it_first() -> None:
    """A stream cut right after a write (a Pylon's output timeout) still delivers that write:
    the reset does not discard what the turn queued."""
    async with quic_pair() as (client, server):
        stream = await client.open_stream()
        await stream.send(b"hello")
        accepted = await server.accept_stream()
        assert await accepted.receive() == b"hello"
        reply = await client.open_stream()
        await reply.send(b"last words")
        reply.reset(0)
        peer = await server.accept_stream()
        received = b""
        with suppress(StreamReset):
            while chunk := await peer.receive():
                received += chunk
        assert received == b"last words"
