"""The patches of stargate/hypercorn_patches/: the table and its guard (a version or a target's
source the table was not written for is refused, with what to do), and some patches on Hypercorn's
own objects: writes that the socket takes at once do not go through the scheduler
(`tcp.protocol_send`), nor do restarts of the keep-alive timer (`tcp.restart`, `tcp.stop`), every
HTTP exchange has a `DisconnectHook` (`app.spawn_app`), a head marked `BODY_FOLLOWS` is written
with its body (`h11`), and PRIORITY frames park nothing (`h2.priority_updated`).
docs/http-serving.md, "The patch table", "Writes", "Keep-alive timer", "Disconnect hook" and "Head
with the body". The other patches are covered where their symptoms show (each row of the table
names its test): tests/e2e/test_h2_streams.py, tests/e2e/test_connection_close.py,
tests/unit/test_http_limits.py, tests/unit/test_grpc_asgi.py.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import h2.config
import h2.connection
import h2.events
import h11
import pytest
import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask, WorkerContext

from stargate import hypercorn_patches
from stargate.asgi import (
    BODY_FOLLOWS,
    ASGIReceive,
    ASGIScope,
    ASGISend,
    DisconnectHook,
    answer_lifespan,
    disconnect_hook,
)
from stargate.config import ListenAddress
from stargate.hypercorn_patches import PatchTableMismatch, table
from stargate.serving import bind_listener, hypercorn_config, serve_asgi

ROOT = Path(__file__).resolve().parents[2]

# --- the table and its guard ---------------------------------------------------------------------


def test_the_installed_stack_is_the_one_the_table_was_written_for() -> None:
    hypercorn_patches.verify()  # importing stargate.serving installed them: originals are kept


def test_a_target_whose_source_changed_is_refused_with_what_to_do() -> None:
    changed = dataclasses.replace(table.PATCHES[0], fingerprint="0123456789abcdef")
    with pytest.raises(PatchTableMismatch) as refused:
        hypercorn_patches.verify([changed, *table.PATCHES[1:]])
    message = str(refused.value)
    assert f"{changed.target} has changed since the table was written" in message
    assert "the table has 0123456789abcdef" in message
    assert "pip install 'hypercorn>=0.18,<0.19' 'h11>=0.16,<0.17' 'h2>=4.4,<4.5'" in message
    assert "python -m stargate.hypercorn_patches --update" in message
    assert message.count("\n  - ") == 1  # only what differs


@pytest.mark.parametrize(("name", "version"), [("hypercorn", "0.19.0"), ("h2", "4.3.0")])
def test_a_version_the_table_was_not_written_for_is_refused(name: str, version: str) -> None:
    installed = hypercorn_patches.installed_versions()

    def version_of(distribution: str) -> str | None:
        return version if distribution == name else installed[distribution]

    with pytest.raises(PatchTableMismatch) as refused:
        hypercorn_patches.verify(version_of=version_of)
    message = str(refused.value)
    low, high = table.WRITTEN_FOR[name]
    assert f"{name} {version} is installed; the table was written for {name} >={low},<{high}" in (
        message
    )
    assert "pip install" in message and "--update" in message


def test_install_refuses_before_patching_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused table leaves Hypercorn as it is: nothing half-patched."""
    monkeypatch.setattr(hypercorn_patches, "_installed", False)
    changed = dataclasses.replace(table.PATCHES[-1], fingerprint="0123456789abcdef")
    monkeypatch.setattr(table, "PATCHES", (*table.PATCHES[:-1], changed))
    monkeypatch.setattr(hypercorn_patches, "_place", _no_place)
    with pytest.raises(PatchTableMismatch):
        hypercorn_patches.install()
    assert not hypercorn_patches._installed


def _no_place(target: str) -> object:
    raise AssertionError(f"{target} patched although the table was refused")


def test_version_tuples_compare_releases() -> None:
    assert table.version_tuple("0.18.0") == (0, 18, 0)
    assert table.version_tuple("0.19.0rc1") == (0, 19, 0)
    assert table.version_tuple("0.18") < table.version_tuple("0.18.5") < table.version_tuple("0.19")


def test_every_target_is_patched_once_by_a_replacement_that_exists() -> None:
    targets = [patch.target for patch in table.PATCHES]
    assert len(targets) == len(set(targets))
    for patch in table.PATCHES:
        assert callable(hypercorn_patches._replacement(patch)), patch.replacement
        assert patch.behaviours, patch.target
        assert patch.distribution in table.WRITTEN_FOR, patch.target


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    anchors = set()
    for line in doc.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_every_behaviour_names_a_doc_section_and_a_test_that_exist() -> None:
    for patch in table.PATCHES:
        for behaviour in patch.behaviours:
            doc, _, anchor = behaviour.doc.partition("#")
            assert anchor in _anchors(ROOT / doc), behaviour.doc
            if behaviour.test.startswith("none: "):
                continue  # no test fails without it, and the row says why
            path, _, name = behaviour.test.partition("::")
            source = (ROOT / path).read_text()
            assert re.search(rf"^(async )?def {name}\(", source, re.MULTILINE), behaviour.test


# --- writes --------------------------------------------------------------------------------------


class _Protocol:
    """Stands for Hypercorn's protocol: records the events handed back to it."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    async def handle(self, event: Event) -> None:
        self.events.append(event)


def _server(sock: trio.socket.SocketType) -> tuple[TCPServer, _Protocol]:
    server = TCPServer(
        None,  # type: ignore[arg-type]  # the app: never reached by `protocol_send`
        HypercornConfig(),
        WorkerContext(None),
        {},
        trio.SocketStream(sock),  # type: ignore[arg-type]  # annotated as TLS; plain is allowed
    )
    protocol = _Protocol()
    server.protocol = protocol  # type: ignore[assignment]
    return server, protocol


async def _read_exactly(sock: trio.socket.SocketType, size: int) -> bytes:
    data = b""
    while len(data) < size:
        piece = await sock.recv(65536)
        assert piece, "closed early"
        data += piece
    return data


async def test_a_write_the_socket_takes_whole_does_not_go_through_the_scheduler() -> None:
    """Hypercorn's write takes its lock (a checkpoint) and trio's `send_all` yields after the
    send: another task ran in the middle of every write. Now one that fits is one syscall."""
    ours, peer = trio.socket.socketpair()
    server, protocol = _server(ours)
    ran: list[str] = []

    async def other() -> None:
        ran.append("other")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        await server.protocol_send(RawData(data=b"HTTP/1.1 200 OK\r\n\r\n"))
        await server.protocol_send(RawData(data=b"body"))
        assert ran == []  # nothing else ran: no trip through the scheduler
    assert await _read_exactly(peer, 23) == b"HTTP/1.1 200 OK\r\n\r\nbody"
    assert protocol.events == []
    assert not server.send_lock.locked()


async def test_reads_enter_no_generator_based_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hypercorn entered `trio.fail_after(inf)` around every read; with no read timeout there is
    now no scope at all, and the protocol sees the same events."""

    def fail_after(seconds: float) -> None:
        raise AssertionError(f"fail_after({seconds}) around a read")

    monkeypatch.setattr(trio, "fail_after", fail_after)
    ours, peer = trio.socket.socketpair()
    server, protocol = _server(ours)
    await peer.send(b"GET / HTTP/1.1\r\n")
    peer.close()
    await server._read_data()  # the peer has closed: it ends at once
    assert protocol.events == [RawData(data=b"GET / HTTP/1.1\r\n"), RawData(data=b""), Closed()]


async def test_a_read_timeout_still_ends_a_silent_connection() -> None:
    ours, _peer = trio.socket.socketpair()
    server, protocol = _server(ours)
    server.config.read_timeout = 0.05
    with trio.fail_after(5):
        await server._read_data()
    assert protocol.events == [Closed()]


async def test_an_empty_write_writes_nothing_but_stays_a_cancellation_point() -> None:
    ours, peer = trio.socket.socketpair()
    server, _ = _server(ours)
    await server.protocol_send(RawData(data=b""))
    with trio.CancelScope() as scope:
        scope.cancel()
        await server.protocol_send(RawData(data=b"never"))
    assert scope.cancelled_caught
    await server.protocol_send(RawData(data=b"after"))
    assert await _read_exactly(peer, 5) == b"after"


async def test_what_the_socket_does_not_take_follows_in_order() -> None:
    """A write larger than the socket buffer: the rest goes through `send_all` under the lock
    (shielded), and a second write waits for it."""
    ours, peer = trio.socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    server, protocol = _server(ours)
    big = bytes(range(256)) * 4096  # 1 MiB
    received = b""

    async def reader() -> None:
        nonlocal received
        received = await _read_exactly(peer, len(big) + 5)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.protocol_send, RawData(data=big))
        await trio.testing.wait_all_tasks_blocked()  # the big write: the socket is full
        assert server.send_lock.locked()
        nursery.start_soon(reader)
        await server.protocol_send(RawData(data=b"after"))
    assert received == big + b"after"
    assert protocol.events == []
    assert not server.send_lock.locked()


async def test_a_write_to_a_reset_connection_reports_it_closed() -> None:
    ours, peer = trio.socket.socketpair()
    server, protocol = _server(ours)
    peer.close()
    await server.protocol_send(RawData(data=b"x" * 100))
    await server.protocol_send(RawData(data=b"x" * 100))  # EPIPE at the latest
    assert any(isinstance(event, Closed) for event in protocol.events)
    assert not server.send_lock.locked()


# --- the keep-alive timer ------------------------------------------------------------------------


async def test_the_keep_alive_timer_restarts_and_stops_without_the_scheduler() -> None:
    """Hypercorn's restart waited on a lock and for the new task to start, its stop on the lock:
    other tasks ran in the middle of both, on every request. The timer still runs, and is
    cancelled by the next restart or a stop whether or not it has started."""
    timer = TrioSingleTask()
    events: list[str] = []

    async def action(name: str) -> None:
        events.append(f"{name} started")
        try:
            await trio.sleep_forever()
        finally:
            events.append(f"{name} cancelled")

    async def other() -> None:
        events.append("other")

    async with trio.open_nursery() as nursery:
        group = SimpleNamespace(_nursery=nursery)
        nursery.start_soon(other)
        await timer.restart(group, partial(action, "first"))
        await timer.restart(group, partial(action, "second"))  # cancels "first" before it runs
        await timer.stop()
        assert events == []  # nothing else ran in the middle
        await trio.testing.wait_all_tasks_blocked()
        assert "first started" not in events and "second started" not in events
        await timer.restart(group, partial(action, "third"))
        await trio.testing.wait_all_tasks_blocked()
        assert events[-1] == "third started"
        await timer.stop()
    assert events[-1] == "third cancelled"


# --- the disconnect hook -------------------------------------------------------------------------


@asynccontextmanager
async def _served(app: object) -> AsyncIterator[int]:
    sock = bind_listener("HTTP", ListenAddress("127.0.0.1", 0))
    port = sock.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_asgi, app, sock, hypercorn_config(2.0), stop.wait)
        try:
            yield port
        finally:
            stop.set()


REQUEST = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi"


async def test_a_client_leaving_fires_the_hook_without_a_task_in_receive() -> None:
    hooks: list[DisconnectHook | None] = []
    registered = trio.Event()
    cancelled = trio.Event()

    async def app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        hook = disconnect_hook(scope)
        hooks.append(hook)
        assert (await receive())["type"] == "http.request"
        assert hook is not None
        with trio.CancelScope() as gone:
            hook.on_disconnect(gone.cancel)
            registered.set()
            await trio.sleep_forever()  # until the client leaves; nobody waits in receive()
        assert gone.cancelled_caught
        cancelled.set()
        assert (await receive())["type"] == "http.disconnect"  # still delivered

    async with _served(app) as port:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(REQUEST)
        with trio.fail_after(5):
            await registered.wait()
            await client.aclose()
            await cancelled.wait()
    assert isinstance(hooks[0], DisconnectHook)


async def test_the_end_of_a_complete_exchange_does_not_fire_the_hook() -> None:
    """Hypercorn reports `http.disconnect` from inside the final `send()` of every exchange;
    that is not the client leaving, and cancelling there would cancel Hypercorn's bookkeeping
    (complete_response_before_disconnect)."""
    calls: list[str] = []
    done = trio.Event()

    async def app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        hook = disconnect_hook(scope)
        assert hook is not None
        await receive()
        hook.on_disconnect(lambda: calls.append("fired"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        assert hook.disconnected  # the exchange is over, as Hypercorn reported in that send
        await trio.sleep(0.05)
        done.set()

    async with _served(app) as port:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(REQUEST)
        with trio.fail_after(5):
            await done.wait()
        await client.aclose()
    assert calls == []


def test_a_hook_registered_after_the_client_left_fires_at_once() -> None:
    hook = DisconnectHook()
    hook.fire()
    calls: list[str] = []
    hook.on_disconnect(lambda: calls.append("fired"))
    assert calls == ["fired"]
    hook.on_disconnect(None)
    hook.fire()
    assert calls == ["fired"]


# --- the head with the body ----------------------------------------------------------------------


async def _answer_in_two_steps(body_follows: bool) -> tuple[bytes, bytes]:
    """What the client has received after the app sent its head, then after its body."""
    head_sent = trio.Event()
    send_body = trio.Event()

    async def app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        await receive()
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"2")],
        }
        if body_follows:
            start[BODY_FOLLOWS] = True
        await send(start)
        head_sent.set()
        await send_body.wait()
        await send({"type": "http.response.body", "body": b"ok"})

    async with _served(app) as port:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(REQUEST)
        with trio.fail_after(5):
            await head_sent.wait()
            before = b""
            with trio.move_on_after(0.2):
                before = await client.receive_some(65536)
            send_body.set()
            after = before
            while not after.endswith(b"ok"):
                after += await client.receive_some(65536)
        await client.aclose()
    return before, after


async def test_a_head_marked_body_follows_is_written_with_the_body() -> None:
    before, after = await _answer_in_two_steps(body_follows=True)
    assert before == b""  # held: it goes out with the body, in one write
    assert after.startswith(b"HTTP/1.1 200 ") and after.endswith(b"\r\n\r\nok")


async def test_an_unmarked_head_is_written_at_once() -> None:
    before, after = await _answer_in_two_steps(body_follows=False)
    assert before.startswith(b"HTTP/1.1 200 ") and before.endswith(b"\r\n\r\n")
    assert after == before + b"ok"


async def test_a_held_head_is_written_when_the_app_ends_without_its_body() -> None:
    """The held head goes out as the exchange ends; the connection then closes (the body is
    missing), as for any response left unfinished."""

    async def app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        await receive()
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"2")],
        }
        start[BODY_FOLLOWS] = True
        await send(start)  # and no body

    async with _served(app) as port:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(REQUEST)
        received = b""
        with trio.fail_after(5):
            while chunk := await client.receive_some(65536):
                received += chunk
        await client.aclose()
    assert received.startswith(b"HTTP/1.1 200 ") and received.endswith(b"\r\n\r\n")


async def _streamed(
    monkeypatch: pytest.MonkeyPatch, request: bytes, headers: list[tuple[bytes, bytes]]
) -> tuple[bytes, int]:
    """What the client received for an answer of three body messages and an empty last one (the
    connection closed or the answer complete), and how many `h11.Data` events h11 framed."""
    framed = 0
    send = h11.Connection.send

    def counting(self: h11.Connection, event: object) -> bytes | None:
        nonlocal framed
        framed += isinstance(event, h11.Data)
        return send(self, event)  # type: ignore[arg-type]

    monkeypatch.setattr(h11.Connection, "send", counting)

    async def app(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for part in (b"data: 1\n\n", b"", b"data: 22\n\n", b"data: 333\n\n"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async with _served(app) as port:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(request)
        received = b""
        with trio.fail_after(5):
            while not received.endswith((b"0\r\n\r\n", b"333\n\n")):
                chunk = await client.receive_some(65536)
                if not chunk:
                    break
                received += chunk
        await client.aclose()
    return received, framed


async def test_chunks_of_a_streamed_body_are_framed_without_h11(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    received, framed = await _streamed(monkeypatch, REQUEST, [])
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    assert body == b"9\r\ndata: 1\n\n\r\na\r\ndata: 22\n\n\r\nb\r\ndata: 333\n\n\r\n0\r\n\r\n"
    assert framed == 0  # (the empty last message ends the body: h11 sends EndOfMessage)


async def test_bodies_h11_frames_otherwise_still_go_through_h11(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `content-length` body (h11 counts it) and an HTTP/1.0 client's (no chunks)."""
    sized, framed = await _streamed(monkeypatch, REQUEST, [(b"content-length", b"30")])
    assert sized.endswith(b"\r\n\r\ndata: 1\n\ndata: 22\n\ndata: 333\n\n")
    assert framed == 3  # the three with data
    http10 = b"POST / HTTP/1.0\r\ncontent-length: 2\r\n\r\nhi"
    plain, framed = await _streamed(monkeypatch, http10, [])
    assert plain.endswith(b"\r\n\r\ndata: 1\n\ndata: 22\n\ndata: 333\n\n")
    assert framed == 3


# --- HTTP/2 ---------------------------------------------------------------------------------------


async def _h2_get(port: int, client: h2.connection.H2Connection, request: int) -> list[object]:
    """Send what `client` has queued (ending with a GET on stream `request`) and collect the h2
    events until that stream ends."""
    events: list[object] = []
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(client.data_to_send())
    with trio.fail_after(5):
        while not any(
            isinstance(event, h2.events.StreamEnded) and event.stream_id == request
            for event in events
        ):
            data = await stream.receive_some(65536)
            assert data, "the server closed the connection"
            events += client.receive_data(data)
            await stream.send_all(client.data_to_send())
    await stream.aclose()
    return events


def _h2_client() -> h2.connection.H2Connection:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    return client


def _get(client: h2.connection.H2Connection, stream_id: int) -> None:
    headers = [(":method", "GET"), (":path", "/"), (":scheme", "http"), (":authority", "t")]
    client.send_headers(stream_id, headers, end_stream=True)


async def _answer_ok(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_the_last_data_frame_ends_the_stream() -> None:
    """END_STREAM goes with the last byte of the body, not in an empty DATA frame of its own."""
    client = _h2_client()
    _get(client, 1)
    async with _served(_answer_ok) as port:
        events = await _h2_get(port, client, 1)
    data = [event for event in events if isinstance(event, h2.events.DataReceived)]
    assert [event.data for event in data] == [b"ok"]
    assert data[0].stream_ended is not None


async def test_priority_frames_for_streams_that_are_not_open_park_nothing() -> None:
    """Hypercorn parked a placeholder in the send scheduler for each PRIORITY frame on a stream
    that is not open; past the scheduler's 999 the connection task failed and the connection
    closed. Now they are ignored, and the connection serves its requests."""
    client = _h2_client()
    for stream_id in range(3, 2203, 2):  # 1100 streams never opened
        client.prioritize(stream_id, weight=16)
    _get(client, 2203)
    async with _served(_answer_ok) as port:
        events = await _h2_get(port, client, 2203)
    statuses = [
        dict(event.headers)[b":status"]
        for event in events
        if isinstance(event, h2.events.ResponseReceived)
    ]
    body = b"".join(event.data for event in events if isinstance(event, h2.events.DataReceived))
    assert (statuses, body) == ([b"200"], b"ok")


# --- the keep-alive timer, stopped ---------------------------------------------------------------


async def test_stopping_the_keep_alive_timer_does_not_go_through_the_scheduler() -> None:
    """Hypercorn's stop took an async lock: another task could run in the middle of every stop
    (trio orders a batch of runnable tasks at random, so one stop alone shows it about half the
    time; twenty show it all but surely)."""
    timer = TrioSingleTask()
    ran: list[int] = []

    async def other(index: int) -> None:
        ran.append(index)

    async with trio.open_nursery() as nursery:
        group = SimpleNamespace(_nursery=nursery)
        for index in range(20):
            await timer.restart(group, trio.sleep_forever)
            nursery.start_soon(other, index)
            await timer.stop()
            assert ran == [], index
            await trio.testing.wait_all_tasks_blocked()
            ran.clear()
