"""`SocketReader`, `write_now` and `send_now` (stargate/socket_io.py): a read waits for
readability before it reads, so a connection read before its data arrives costs no failed
`read(2)`; after a read that filled the buffer the next reads first; every read is a checkpoint;
a write is one `write(2)` without a checkpoint, and `send_now` sends the rest with `send_all`; a
closed socket is trio's error."""

from __future__ import annotations

import os
import socket

import pytest
import trio
import trio.testing

from stargate.socket_io import SocketReader, send_now, write_now


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The outcome of every `os.read`: bytes read, or -1 for a read that would have blocked."""
    outcomes: list[int] = []
    read = os.read

    def counting(fd: int, size: int) -> bytes:
        try:
            data = read(fd, size)
        except BlockingIOError:
            outcomes.append(-1)
            raise
        outcomes.append(len(data))
        return data

    monkeypatch.setattr(os, "read", counting)
    return outcomes


async def test_a_read_waits_for_data_instead_of_failing_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ours, peer = trio.socket.socketpair()
    reader = SocketReader(ours, 65536)
    outcomes = _count_reads(monkeypatch)
    received: list[bytes] = []

    async def read_once() -> None:
        received.append(await reader.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_once)
        await trio.testing.wait_all_tasks_blocked()
        assert outcomes == []  # waiting, not reading
        await peer.send(b"heartbeat")
    assert received == [b"heartbeat"]
    assert outcomes == [9]  # one read, and it found the data


async def test_after_a_full_read_the_next_reads_first_and_still_checkpoints(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ours, peer = trio.socket.socketpair()
    reader = SocketReader(ours, 4)
    await peer.send(b"0123456789")
    outcomes = _count_reads(monkeypatch)
    assert await reader.receive() == b"0123"
    assert await reader.receive() == b"4567"  # the buffer was full: read at once
    with trio.CancelScope() as scope:
        scope.cancel()
        await reader.receive()  # data is there, but a read is still a checkpoint
    assert scope.cancelled_caught
    assert await reader.receive() == b"89"
    assert outcomes == [4, 4, 2]  # the cancelled read took nothing off the socket


async def test_a_closed_socket_is_trios_closed_resource_error() -> None:
    ours, _peer = trio.socket.socketpair()
    reader = SocketReader(ours, 65536)
    ours.close()
    with pytest.raises(trio.ClosedResourceError):
        await reader.receive()


async def test_eof_is_an_empty_read() -> None:
    ours, peer = trio.socket.socketpair()
    peer.close()
    assert await SocketReader(ours, 65536).receive() == b""


async def test_write_now_writes_what_the_buffer_takes_without_yielding() -> None:
    ours, peer = trio.socket.socketpair()
    with ours, peer:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        with trio.testing.assert_no_checkpoints():
            assert write_now(ours, b"ack") == 3
            big = b"x" * 10_000_000
            sent = write_now(ours, big)
        assert 0 < sent < len(big)  # the rest is the caller's, for send_all
        assert await peer.recv(3) == b"ack"


async def test_write_now_raises_trios_errors() -> None:
    ours, peer = trio.socket.socketpair()
    peer.close()
    with pytest.raises(trio.BrokenResourceError):
        for _ in range(100):  # the first writes may still land in the buffer
            write_now(ours, b"x" * 65536)
    ours.close()
    with pytest.raises(trio.ClosedResourceError):
        write_now(ours, b"x")


async def test_send_now_writes_at_once_and_sends_what_the_buffer_did_not_take() -> None:
    ours, peer = trio.socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    stream = trio.SocketStream(ours)
    with trio.testing.assert_no_checkpoints():
        await send_now(stream, ours, b"ack")  # whole: no yield
    big = b"x" * 1_000_000
    received = bytearray()

    async def read_all() -> None:
        while len(received) < 3 + len(big):
            received.extend(await peer.recv(65536))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        await send_now(stream, ours, big)  # the rest after the first write, by send_all
    assert bytes(received) == b"ack" + big
    await stream.aclose()
    peer.close()
