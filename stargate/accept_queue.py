"""Closing a listening socket without resetting the connections the kernel already accepted.

The kernel completes a client's TCP handshake on its own and queues the connection until the
server calls `accept()`. Closing the listening socket resets every connection still in that
queue: the client had connected, sent its request, and reads `Connection reset by peer`
(an error it cannot tell from a crash, so a non-idempotent request is lost). Under load the
queue is rarely empty, since the accept loop runs between other work, so a plain close at the
end of the leave phase loses a request now and then (docs/rolling-restarts.md, "Closing the
listener").

`stop_new_connections(sock)` ends that race in two steps:

1. A socket filter that drops every SYN is attached to the listening socket (Linux,
   `SO_ATTACH_FILTER`): no new handshake starts from now on. The client retransmits its SYN
   about a second later, meets the closed port and is refused, which it can retry safely
   (nothing was sent). Handshakes already under way still complete (their ACKs pass) and join
   the queue; connections inherit the filter, which never matches on an established one.
2. It waits until the server's accept loop, still running, has taken every queued connection
   (the queue length is `tcpi_unacked` of the listener's `TCP_INFO`), so those are served.

Then the caller closes the socket. Where the filter or `TCP_INFO` is unavailable (not Linux)
it returns at once: the plain close, as before.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import struct

import trio

__all__ = ["ACCEPT_QUEUE_TIMEOUT_S", "queued_connections", "stop_new_connections"]

log = logging.getLogger(__name__)

# How long to wait for the accept loop to empty the queue; past it the socket closes anyway (an
# accept loop that cannot accept, for example with the file-descriptor table full, never will).
ACCEPT_QUEUE_TIMEOUT_S = 1.0
_POLL_INTERVAL_S = 0.005

_SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)  # Linux's value
# A classic BPF program run on each packet from its TCP header on: load the flags byte, keep SYN
# and ACK, and drop the packet (return 0) if only SYN is set; keep it whole otherwise.
_INSTRUCTIONS = (
    (0x30, 0, 0, 13),  # ldb [13]          the TCP flags
    (0x54, 0, 0, 0x12),  # and #SYN|ACK
    (0x15, 0, 1, 0x02),  # jeq #SYN, drop, keep
    (0x06, 0, 0, 0),  # drop: ret #0
    (0x06, 0, 0, 0xFFFFFFFF),  # keep: ret #everything
)
_DROP_SYN = ctypes.create_string_buffer(
    b"".join(struct.pack("=HBBI", *instruction) for instruction in _INSTRUCTIONS)
)
# struct sock_fprog {unsigned short len; struct sock_filter *filter;}, native alignment.
_DROP_SYN_PROGRAM = struct.pack("HP", len(_INSTRUCTIONS), ctypes.addressof(_DROP_SYN))
# struct tcp_info: 8 one-byte fields, then rto, ato, snd_mss, rcv_mss, unacked (u32 each). For a
# listening socket, `unacked` is the accept queue's length.
_TCP_INFO_UNACKED = struct.Struct("=8x4xIIII")


def queued_connections(sock: socket.socket) -> int | None:
    """Connections the kernel has queued on listening socket `sock` for `accept()`, or None
    where the platform does not say."""
    tcp_info = getattr(socket, "TCP_INFO", None)
    if tcp_info is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, tcp_info, 64)
    except OSError:
        return None
    if len(info) < _TCP_INFO_UNACKED.size:
        return None
    return int(_TCP_INFO_UNACKED.unpack_from(info)[3])


def _refuse_handshakes(sock: socket.socket) -> bool:
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, _DROP_SYN_PROGRAM)
    except OSError as error:
        log.debug("cannot filter the listening socket (%s): closing it as is", error)
        return False
    return True


async def stop_new_connections(sock: socket.socket) -> None:
    """Let no new connection complete on listening socket `sock`, then wait (at most
    `ACCEPT_QUEUE_TIMEOUT_S`) until the server's accept loop has taken the ones already queued.

    Call it while the accept loop still runs; close the socket after it returns. Cancellation
    leaves the filter in place (the socket is about to close anyway).
    """
    if sock.fileno() < 0 or not _refuse_handshakes(sock):
        return
    with trio.move_on_after(ACCEPT_QUEUE_TIMEOUT_S):
        while queued_connections(sock):  # noqa: ASYNC110 (the kernel's queue has no event)
            await trio.sleep(_POLL_INTERVAL_S)
