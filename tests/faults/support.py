"""Shared pieces of the fault suite: the per-test tally, a raw-socket backend for the faults an
ASGI app cannot produce (so not a `stargate mock-backend` knob), and small probes of a process
(descriptors, sockets, threads, metrics)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "RawBackend",
    "RawMode",
    "Tally",
    "describe_sockets",
    "metric_sum",
    "open_fds",
    "os_threads",
]


@dataclass
class Tally:
    """What one test did: faults injected, requests sent, requests lost (accepted but not
    completed, or answered other than documented), and how many of the lost ones a known bug
    explains (a loss an xfail test pins down). Safe to update from threads."""

    faults: int = 0
    sent: int = 0
    lost: int = 0
    known: int = 0
    notes: dict[str, Any] = field(default_factory=dict)  # what else the test wants on record
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def inject(self, count: int = 1) -> None:
        with self._lock:
            self.faults += count

    def send(self, count: int = 1) -> None:
        with self._lock:
            self.sent += count

    def lose(self, count: int = 1, *, known_bug: bool = False) -> None:
        with self._lock:
            self.lost += count
            if known_bug:
                self.known += count

    def add(self, line: dict[str, Any]) -> None:
        self.faults += int(line["faults"])
        self.sent += int(line["sent"])
        self.lost += int(line["lost"])
        self.known += int(line.get("known", 0))

    def as_dict(self) -> dict[str, Any]:
        return {
            "faults": self.faults,
            "sent": self.sent,
            "lost": self.lost,
            "known": self.known,
            "notes": self.notes,
        }


def open_fds(pid: int) -> int:
    """How many file descriptors `pid` has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def os_threads(pid: int) -> int:
    """How many OS threads `pid` runs."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line for {pid}")


# ---- a raw-socket backend -----------------------------------------------------------------------

RawMode = Literal["ok", "malformed", "close_after_response", "reset_after_response"]

_HEALTH = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
# Not HTTP at all: what a backend port taken over by another protocol (or a crashed engine's
# garbage) looks like to an HTTP/1.1 client.
_MALFORMED = b"SSH-2.0-OpenSSH_9.6\r\n\x00\x01\x02 not an http response\r\n\r\n"


class RawBackend:
    """An HTTP/1.1 backend written on bare sockets, so it can break HTTP in ways a server library
    will not: `GET /health` always answers 200 (keep-alive, so the replica's probe passes); every
    other request gets the current `mode`:

    * `ok`: a 200 chat-completion JSON with `content-length`, connection kept alive;
    * `malformed`: bytes that are not an HTTP response, then the connection is closed;
    * `close_after_response`: a complete, valid 200 with no `Connection: close`, then the
      connection is closed at once (FIN): the keep-alive connection the client just pooled is
      dead before the client's next request on it, as when a server's keep-alive timeout fires;
    * `reset_after_response`: the same, but the close is an RST (`SO_LINGER` 0).

    Counts the connections it accepted (`connections`) and the requests it answered, by mode or
    `health` (`count(kind)`)."""

    def __init__(self, mode: RawMode = "ok") -> None:
        self.mode: RawMode = mode
        self._lock = threading.Lock()
        self.connections = 0
        self.requests: dict[str, int] = {}
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, daemon=True)
        self._accepter.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def count(self, kind: str) -> int:
        with self._lock:
            return self.requests.get(kind, 0)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._accepter.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        buffer = b""
        try:
            while True:
                request, buffer = _read_request(conn, buffer)
                if request is None:
                    return
                method, path = request
                if method == "GET" and path == "/health":
                    conn.sendall(_HEALTH)
                    self._counted("health")
                    continue
                mode = self.mode
                self._counted(mode)
                if mode == "malformed":
                    conn.sendall(_MALFORMED)
                    return
                conn.sendall(_completion())
                if mode == "close_after_response":
                    return
                if mode == "reset_after_response":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
        except OSError:
            return
        finally:
            conn.close()

    def _counted(self, kind: str) -> None:
        with self._lock:
            self.requests[kind] = self.requests.get(kind, 0) + 1


def _read_request(conn: socket.socket, buffer: bytes) -> tuple[tuple[str, str] | None, bytes]:
    """One request (method, path) with its body consumed; None when the peer closed."""
    while b"\r\n\r\n" not in buffer:
        data = conn.recv(65536)
        if not data:
            return None, b""
        buffer += data
    head, _, rest = buffer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    while len(rest) < length:
        data = conn.recv(65536)
        if not data:
            return None, b""
        rest += data
    return (method, path), rest[length:]


def _completion() -> bytes:
    body = json.dumps(
        {
            "id": "chatcmpl-raw",
            "object": "chat.completion",
            "model": "raw-model",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "raw"},
                    "finish_reason": "stop",
                }
            ],
        }
    ).encode()
    head = (
        f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of metric `name` in a Prometheus exposition whose labels include
    `labels` (0 when there is none)."""
    total = 0.0
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    for line in text.splitlines():
        if line.startswith((f"{name}{{", f"{name} ")) and all(label in line for label in wanted):
            total += float(line.rsplit(" ", 1)[1])
    return total


def describe_sockets(pid: int) -> list[str]:
    """The TCP sockets among `pid`'s descriptors as `local->remote STATE` (for failure messages)."""
    inodes = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{name}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    states = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN"}
    found = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    local = int(fields[1].rsplit(":", 1)[1], 16)
                    remote = int(fields[2].rsplit(":", 1)[1], 16)
                    found.append(f"{local}->{remote} {states.get(fields[3], fields[3])}")
    return sorted(found)
