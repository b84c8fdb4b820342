"""Reading and writing a plain TCP socket from trio, with fewer trips through the scheduler.

Reads (`SocketReader`) wait for readability first, then make one `read(2)`; writes
(`write_now`) make one `write(2)` at once, and `send_now` sends the rest, if any, with trio's
`send_all`.

trio's `SocketStream.receive_some` tries the read first and waits only when it fails, which
suits a stream whose data is usually there already. A server's connections, and a client's, are
mostly read when nothing is there yet: the next request on a kept-alive connection, the next
heartbeat of a registration stream, a response head, the next SSE event. For those the first
read is a failed syscall and an exception (`BlockingIOError`) before the same wait: about 5 % of
the replica's CPU at 1,000 Pylons (docs/performance.md, "Control plane"). `SocketReader` waits
first unless the previous read filled the buffer (more is then likely waiting), and still makes
every read a checkpoint, as trio does: a cancellation is raised before a read, never after it
has taken data off the socket. Errors are trio's, as from `receive_some`: `ClosedResourceError` once
the socket is closed, `BrokenResourceError` for a failed read. One task reads a reader at a time.
"""

from __future__ import annotations

import os

import trio

__all__ = ["SocketReader", "send_now", "write_now"]


class SocketReader:
    """The reads of one plain TCP socket, `size` bytes at most each."""

    __slots__ = ("_size", "_sock", "_wait_first")

    def __init__(self, sock: trio.socket.SocketType, size: int) -> None:
        self._sock = sock
        self._size = size
        self._wait_first = True  # the last read did not fill the buffer: wait before reading

    async def receive(self) -> bytes:
        """The bytes available now, waiting for some if there are none (b"" at EOF)."""
        sock = self._sock
        wait = self._wait_first
        if not wait:
            # Raise a pending cancellation before reading, never after: read data is not lost.
            await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if wait:
                if sock.fileno() < 0:
                    raise trio.ClosedResourceError("the connection is closed")
                await trio.lowlevel.wait_readable(sock)
            fd = sock.fileno()
            if fd < 0:
                raise trio.ClosedResourceError("the connection is closed")
            try:
                data = os.read(fd, self._size)
            except BlockingIOError:
                wait = True
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(f"socket read failed: {exc}") from exc
            self._wait_first = len(data) < self._size
            if not wait:
                await trio.lowlevel.cancel_shielded_checkpoint()  # a read that did not wait yields
            return data


def write_now(sock: trio.socket.SocketType, data: bytes | bytearray | memoryview) -> int:
    """Write what the socket's buffer takes of `data` now, without yielding; the bytes written.

    A message to a peer that keeps reading (a request, an ack) nearly always fits whole, and one
    `write(2)` then replaces `send_all`, which yields after the write (a trip through the
    scheduler) and wraps it in four context managers (docs/data-plane.md, "Upstream socket
    I/O"). The caller sends the rest, if any, with `send_all`. Errors are trio's:
    `ClosedResourceError` once the socket is closed, `BrokenResourceError` for a failed write.
    Not a checkpoint: the caller's next await is.
    """
    fd = sock.fileno()
    if fd < 0:
        raise trio.ClosedResourceError("the connection is closed")
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        raise trio.BrokenResourceError(f"socket write failed: {exc}") from exc


async def send_now(
    stream: trio.abc.Stream,
    sock: trio.socket.SocketType | None,
    data: bytes | bytearray | memoryview,
) -> None:
    """Send all of `data` on `stream`: at once with `write_now` when `sock` (its plain TCP socket;
    None for TLS) takes it whole, without yielding; the rest with the stream's `send_all`.

    Not a checkpoint when the write completes at once. Errors are trio's, as from `send_all`.
    """
    if sock is not None:
        sent = write_now(sock, data)
        if sent == len(data):
            return
        data = memoryview(data)[sent:]
    await stream.send_all(data)
