"""The h11 upstream pool against real loopback servers (trio + h11) on the real clock.

Every server here counts the TCP connections it accepted and closed, which is how reuse, retries
and "closed, not pooled" are observed from the outside.
"""

from __future__ import annotations

import json
import math
import ssl
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import h11
import pytest
import trio

from stargate.upstream import (
    ConnectError,
    ConnectionPool,
    ConnectionPoolTimeout,
    ResponseHeadTimeout,
    UpstreamConfig,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    make_ssl_context,
)
from stargate.upstream.connection import build_request

# --- test server ------------------------------------------------------------------------------


class ServerConn:
    """The server side of one accepted connection."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER)
        self.close_after = False  # close once the handler returns, whatever the framing said

    async def read_request(self) -> tuple[h11.Request, bytes] | None:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(65536))  # type: ignore[arg-type]
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                return request, bytes(body)
            else:
                return None

    async def send(self, *events: h11._events.Event) -> None:
        data = b"".join(self.h11.send(event) or b"" for event in events)
        await self.stream.send_all(data)

    async def respond(
        self, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None, body: bytes = b""
    ) -> None:
        all_headers = [*(headers or []), (b"content-length", b"%d" % len(body))]
        await self.send(
            h11.Response(status_code=status, headers=all_headers),
            h11.Data(data=body),
            h11.EndOfMessage(),
        )

    async def send_raw(self, wire: bytes, close: bool = False) -> None:
        """Answer with `wire` as it is. The server's machine is told of an answer (its bytes
        dropped), so it keeps the connection for the next request unless `close`."""
        await self.stream.send_all(wire)
        self.h11.send(h11.Response(status_code=200, headers=[(b"content-length", b"0")]))
        self.h11.send(h11.EndOfMessage())
        self.close_after = close

    async def wait_for_client_close(self) -> None:
        """Block until the client closes (EOF or reset), ignoring anything it sends."""
        try:
            while await self.stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass


Handler = Callable[[ServerConn, h11.Request, bytes], Awaitable[None]]


class Server:
    """A keep-alive HTTP/1.1 server whose responses are written by a per-test handler."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.port = 0
        self.connections = 0
        self.disconnects = 0
        self.requests: list[tuple[h11.Request, bytes]] = []
        self.scheme = "http"
        self.host = "127.0.0.1"
        self._disconnected = trio.Event()

    async def wait_disconnects(self, count: int) -> None:
        """Until the server has seen `count` connections end (fails after 2 s)."""
        with trio.fail_after(2):
            while self.disconnects < count:
                await self._disconnected.wait()

    def url(self, path: str = "/") -> str:
        return f"{self.scheme}://{self.host}:{self.port}{path}"

    async def serve_connection(self, stream: trio.abc.Stream) -> None:
        self.connections += 1
        conn = ServerConn(stream)
        try:
            while True:
                received = await conn.read_request()
                if received is None:
                    break
                self.requests.append(received)
                await self.handler(conn, *received)
                machine = conn.h11
                if conn.close_after or not (
                    machine.our_state is h11.DONE and machine.their_state is h11.DONE
                ):
                    break
                machine.start_next_cycle()
        except (trio.BrokenResourceError, h11.RemoteProtocolError):
            pass
        finally:
            self.disconnects += 1
            self._disconnected.set()
            self._disconnected = trio.Event()
            await trio.aclose_forcefully(stream)


async def start_server(
    nursery: trio.Nursery, handler: Handler, ssl_context: ssl.SSLContext | None = None
) -> Server:
    server = Server(handler)
    if ssl_context is None:
        serve = partial(trio.serve_tcp, server.serve_connection, 0, host="127.0.0.1")
        listeners = await nursery.start(serve)
        server.port = listeners[0].socket.getsockname()[1]
    else:
        serve_tls = partial(
            trio.serve_ssl_over_tcp,
            server.serve_connection,
            0,
            ssl_context,
            host="127.0.0.1",
            https_compatible=True,
        )
        listeners = await nursery.start(serve_tls)
        server.port = listeners[0].transport_listener.socket.getsockname()[1]
        server.scheme = "https"
    return server


async def echo(conn: ServerConn, request: h11.Request, body: bytes) -> None:
    """Answer with what was received, as JSON."""
    payload = {
        "method": request.method.decode(),
        "target": request.target.decode(),
        "headers": [[k.decode(), v.decode()] for k, v in request.headers],
        "body": body.decode(),
    }
    await conn.respond(200, [(b"content-type", b"application/json")], json.dumps(payload).encode())


def header_values(headers: list[list[str]], name: str) -> list[str]:
    return [v for k, v in headers if k == name]


async def get_json(pool: ConnectionPool, url: str, **kwargs: Any) -> Any:
    method = kwargs.pop("method", "GET")
    async with await pool.request(method, url, kwargs.pop("headers", []), **kwargs) as response:
        assert response.status == 200
        return json.loads(await response.read())


# --- basics -------------------------------------------------------------------------------------


async def test_get_and_post_with_body(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, echo)
    async with ConnectionPool() as pool:
        got = await get_json(pool, server.url("/v1/models?x=1&y=2"))
        assert got["method"] == "GET"
        assert got["target"] == "/v1/models?x=1&y=2"
        assert got["body"] == ""
        assert header_values(got["headers"], "content-length") == []

        body = json.dumps({"model": "m", "messages": []}).encode()
        got = await get_json(
            pool,
            server.url("/v1/chat/completions"),
            method="POST",
            headers=[(b"content-type", b"application/json")],
            body=body,
        )
        assert got["method"] == "POST"
        assert got["body"].encode() == body
        assert header_values(got["headers"], "content-length") == [str(len(body))]

        got = await get_json(pool, server.url("/empty"), method="POST")
        assert header_values(got["headers"], "content-length") == ["0"]


async def test_host_and_content_length_are_set_once_and_other_headers_kept(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, echo)
    headers = [
        (b"Host", b"evil.example"),
        (b"CONTENT-LENGTH", b"999"),
        (b"content-length", b"1"),
        (b"Transfer-Encoding", b"chunked"),
        (b"x-custom", b"1"),
        (b"authorization", b"Bearer t"),
        (b"X-Custom", b"2"),
    ]
    async with ConnectionPool() as pool:
        got = await get_json(pool, server.url("/p"), method="POST", headers=headers, body=b"hello")
    sent = got["headers"]
    assert header_values(sent, "host") == [f"127.0.0.1:{server.port}"]
    assert sent[0] == ["host", f"127.0.0.1:{server.port}"]
    assert header_values(sent, "content-length") == ["5"]
    assert header_values(sent, "transfer-encoding") == []
    assert header_values(sent, "x-custom") == ["1", "2"]
    assert header_values(sent, "authorization") == ["Bearer t"]
    assert got["body"] == "hello"


async def test_response_headers_are_lower_case_as_received_and_no_cookie_jar(
    nursery: trio.Nursery,
) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        if request.target == b"/login":
            headers = [
                (b"Set-Cookie", b"session=user-A-secret"),
                (b"X-Thing", b"a"),
                (b"set-cookie", b"other=1"),
            ]
            await conn.respond(200, headers, b"ok")
        else:
            await echo(conn, request, body)

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        async with await pool.request("GET", server.url("/login"), []) as response:
            assert await response.read() == b"ok"
            assert response.headers[:3] == [
                (b"set-cookie", b"session=user-A-secret"),
                (b"x-thing", b"a"),
                (b"set-cookie", b"other=1"),
            ]
            assert response.reason == b""
            assert response.http_version == b"1.1"
        got = await get_json(pool, server.url("/next"))
    assert header_values(got["headers"], "cookie") == []


async def test_bad_urls_and_headers_are_value_errors_and_leave_nothing_behind() -> None:
    async with ConnectionPool() as pool:
        for url in (
            "ftp://127.0.0.1/",
            "/relative",
            "http:///nohost",
            "http://user:pw@127.0.0.1/",
            "http://127.0.0.1:99999/",
        ):
            with pytest.raises(ValueError):
                await pool.request("GET", url, [])
        with pytest.raises(ValueError):
            await pool.request("GET", "http://127.0.0.1:1/", [(b"x-bad", b"a\r\nb")])
        assert pool._origins == {}
        stats = pool.stats()
        assert (stats.open_connections, stats.in_use_connections) == (0, 0)


# --- keep-alive ---------------------------------------------------------------------------------


async def test_sequential_requests_reuse_one_connection(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, echo)
    async with ConnectionPool() as pool:
        for i in range(5):
            got = await get_json(pool, server.url(f"/r{i}"), method="POST", body=b"x" * i)
            assert got["body"] == "x" * i
        stats = pool.stats()
        assert server.connections == 1
        assert stats.connections_created == 1
        assert stats.open_connections == 1
        assert stats.in_use_connections == 0
        assert stats.idle_connections == {f"http://127.0.0.1:{server.port}": 1}
        assert stats.stale_retries == 0
    # aclose() closed the idle connection: the server sees it go.
    await server.wait_disconnects(1)
    assert pool.stats().open_connections == 0
    with pytest.raises(RuntimeError):
        await pool.request("GET", server.url(), [])


async def test_a_large_body_is_sent_intact(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, echo)
    body = bytes(range(97, 123)) * 40_000  # ~1 MB, sent separately from the head
    async with ConnectionPool() as pool:
        got = await get_json(pool, server.url("/big"), method="POST", body=body)
    assert got["body"].encode() == body


async def test_connection_close_responses_are_not_reused(nursery: trio.Nursery) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.respond(200, [(b"connection", b"close")], b"bye")

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        for _ in range(2):
            async with await pool.request("GET", server.url(), []) as response:
                assert await response.read() == b"bye"
        assert server.connections == 2
        stats = pool.stats()
        assert stats.open_connections == 0
        assert stats.idle_connections == {}


async def test_chunked_and_content_length_bodies_both_keep_the_connection(
    nursery: trio.Nursery,
) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        if request.target == b"/chunked":
            await conn.send(h11.Response(status_code=200, headers=[]))
            for part in (b"one ", b"two ", b"three"):
                await conn.send(h11.Data(data=part))
            await conn.send(h11.EndOfMessage())
        else:
            await conn.respond(200, [], b"fixed length")

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        async with await pool.request("GET", server.url("/chunked"), []) as response:
            assert (b"transfer-encoding", b"chunked") in response.headers
            assert await response.read() == b"one two three"
        async with await pool.request("GET", server.url("/fixed"), []) as response:
            assert (b"content-length", b"12") in response.headers
            assert await response.read() == b"fixed length"
    assert server.connections == 1


async def test_complete_says_when_the_chunk_just_read_was_the_last(nursery: trio.Nursery) -> None:
    """What lets the proxy send the last chunk as the end of its response (one message)."""
    go_on = trio.Event()

    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        if request.target == b"/stream":
            await conn.send(h11.Response(status_code=200, headers=[]), h11.Data(data=b"first"))
            await go_on.wait()
            await conn.send(h11.Data(data=b"last"), h11.EndOfMessage())
        else:
            await conn.respond(200, [], b"whole")

    def complete(response: UpstreamResponse) -> bool:
        return response.complete

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        async with await pool.request("GET", server.url("/stream"), []) as response:
            chunks = response.aiter_bytes()
            assert await chunks.__anext__() == b"first"
            assert not complete(response)
            go_on.set()
            assert await chunks.__anext__() == b"last"
            assert complete(response)
        async with await pool.request("GET", server.url("/whole"), []) as response:
            assert not complete(response)  # nothing read yet
            assert [chunk async for chunk in response.aiter_bytes()] == [b"whole"]
            assert complete(response)
    assert server.connections == 1  # both complete: the connection was reused


async def test_close_delimited_bodies_are_read_to_eof_and_not_reused(
    nursery: trio.Nursery,
) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        if request.target == b"/http10":
            raw = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nhello from 1.0"
        else:
            raw = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nno framing at all"
        await conn.stream.send_all(raw)
        conn.close_after = True

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        async with await pool.request("GET", server.url("/http10"), []) as response:
            assert response.http_version == b"1.0"
            assert await response.read() == b"hello from 1.0"
        async with await pool.request("GET", server.url("/http11"), []) as response:
            assert await response.read() == b"no framing at all"
        assert server.connections == 2
        assert pool.stats().open_connections == 0


async def test_bodyless_statuses_and_head_keep_the_connection_even_unread(
    nursery: trio.Nursery,
) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        if request.target == b"/204":
            await conn.send(h11.Response(status_code=204, headers=[]), h11.EndOfMessage())
        elif request.target == b"/304":
            await conn.send(
                h11.Response(status_code=304, headers=[(b"etag", b'"x"')]), h11.EndOfMessage()
            )
        else:  # HEAD: framing headers of the GET, no body
            await conn.send(
                h11.Response(status_code=200, headers=[(b"content-length", b"5")]),
                h11.EndOfMessage(),
            )

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        async with await pool.request("GET", server.url("/204"), []) as response:
            assert response.status == 204
            assert await response.read() == b""
        async with await pool.request("GET", server.url("/304"), []) as response:
            assert response.status == 304  # closed without reading the (empty) body
        async with await pool.request("HEAD", server.url("/head"), []) as response:
            assert response.status == 200
            assert (b"content-length", b"5") in response.headers
        assert server.connections == 1
        assert pool.stats().open_connections == 1


async def test_idle_connections_past_expiry_are_not_reused(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, echo)
    async with ConnectionPool(UpstreamConfig(idle_expiry=0.05)) as pool:
        await get_json(pool, server.url())
        await trio.sleep(0.1)
        await get_json(pool, server.url())
        assert server.connections == 2
        assert pool.stats().stale_retries == 0
        assert pool.stats().open_connections == 1
        await server.wait_disconnects(1)

        await trio.sleep(0.1)
        assert pool.close_expired() == 1
        assert pool.stats().open_connections == 0
        assert pool._origins == {}
        await server.wait_disconnects(2)


async def test_idle_connections_are_capped_per_origin(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, echo)
    async with ConnectionPool(UpstreamConfig(max_idle_per_origin=2)) as pool:
        responses: list[UpstreamResponse] = []

        async def start_one() -> None:
            responses.append(await pool.request("GET", server.url(), []))

        async with trio.open_nursery() as inner:
            for _ in range(4):
                inner.start_soon(start_one)
        assert pool.stats().in_use_connections == 4
        for response in responses:
            async with response:
                await response.read()
        stats = pool.stats()
        assert stats.connections_created == 4
        assert stats.open_connections == 2
        assert stats.idle_connections == {f"http://127.0.0.1:{server.port}": 2}
        await server.wait_disconnects(2)


# --- limits and timeouts --------------------------------------------------------------------------


async def test_pool_acquire_timeout_and_slot_hand_off(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, echo)
    config = UpstreamConfig(max_connections_per_origin=1, pool_acquire_timeout=0.1)
    async with ConnectionPool(config) as pool:
        held = await pool.request("GET", server.url("/held"), [])
        with pytest.raises(ConnectionPoolTimeout) as caught:
            await pool.request("GET", server.url("/waits"), [])
        assert caught.value.request_sent is False

        # A waiter gets the slot (and the pooled connection) as soon as the holder finishes.
        got: list[Any] = []

        async def waiter() -> None:
            got.append(await get_json(pool, server.url("/after")))

        async with trio.open_nursery() as inner:
            inner.start_soon(waiter)
            await trio.sleep(0.02)
            assert got == []
            async with held:
                await held.read()
        assert got[0]["target"] == "/after"
        assert server.connections == 1


async def test_response_head_timeout(nursery: trio.Nursery) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await trio.sleep_forever()

    server = await start_server(nursery, handler)
    async with ConnectionPool(UpstreamConfig(response_head_timeout=0.2)) as pool:
        started = time.monotonic()
        with pytest.raises(ResponseHeadTimeout) as caught:
            await pool.request("POST", server.url(), [], b"{}")
        assert 0.15 < time.monotonic() - started < 1.0
        assert caught.value.request_sent is True
        stats = pool.stats()
        assert (stats.open_connections, stats.in_use_connections) == (0, 0)


async def test_the_streamed_body_has_no_timeout(nursery: trio.Nursery) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.send(h11.Response(status_code=200, headers=[]), h11.Data(data=b"first,"))
        await trio.sleep(0.5)
        await conn.send(h11.Data(data=b"second"), h11.EndOfMessage())

    server = await start_server(nursery, handler)
    async with ConnectionPool(UpstreamConfig(response_head_timeout=0.2)) as pool:
        async with await pool.request("GET", server.url(), []) as response:
            assert await response.read() == b"first,second"
        assert pool.stats().open_connections == 1


async def test_connect_refused_is_a_connect_error() -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # bound once, never listening: connections are refused
    async with ConnectionPool() as pool:
        with pytest.raises(ConnectError) as caught:
            await pool.request("GET", f"http://127.0.0.1:{port}/", [])
        assert caught.value.request_sent is False
        assert isinstance(caught.value, UpstreamError)
        stats = pool.stats()
        assert (stats.open_connections, stats.in_use_connections) == (0, 0)


async def test_connect_timeout_is_a_connect_error(monkeypatch: pytest.MonkeyPatch) -> None:
    async def never_connects(host: str, port: int, **kwargs: Any) -> trio.SocketStream:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    monkeypatch.setattr(trio, "open_tcp_stream", never_connects)
    async with ConnectionPool(UpstreamConfig(connect_timeout=0.1)) as pool:
        started = time.monotonic()
        with pytest.raises(ConnectError, match="timed out"):
            await pool.request("GET", "http://127.0.0.1:9/", [])
        assert time.monotonic() - started < 1.0
        assert pool.stats().in_use_connections == 0


async def test_cancelled_while_waiting_for_the_head_closes_the_connection(
    nursery: trio.Nursery,
) -> None:
    """Cancelled once the server holds the request (not after a fixed 0.1 s: on a loaded
    machine the request had not even connected by then, and the server saw no connection)."""
    received = trio.Event()

    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        received.set()
        await conn.wait_for_client_close()
        conn.close_after = True

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        async with trio.open_nursery() as client:
            client.start_soon(pool.request, "GET", server.url(), [])
            with trio.fail_after(5):
                await received.wait()
            client.cancel_scope.cancel()
        stats = pool.stats()
        assert (stats.open_connections, stats.in_use_connections) == (0, 0)
        await server.wait_disconnects(1)


# --- streaming ----------------------------------------------------------------------------------


async def test_chunks_arrive_one_by_one(nursery: trio.Nursery) -> None:
    release = trio.Event()

    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        headers = [(b"content-type", b"text/event-stream")]
        await conn.send(h11.Response(status_code=200, headers=headers))
        await conn.send(h11.Data(data=b"data: 1\n\n"))
        await release.wait()
        await conn.send(h11.Data(data=b"data: 2\n\n"), h11.EndOfMessage())

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        received: list[bytes] = []
        async with await pool.request("POST", server.url(), [], b'{"stream": true}') as response:
            assert (b"content-type", b"text/event-stream") in response.headers
            async for chunk in response.aiter_bytes():
                received.append(chunk)
                if len(received) == 1:
                    # The first event came through while the server was still holding the second.
                    assert not release.is_set()
                    release.set()
        assert received == [b"data: 1\n\n", b"data: 2\n\n"]
        assert pool.stats().open_connections == 1


async def test_data_already_buffered_is_joined_into_one_chunk(nursery: trio.Nursery) -> None:
    release = trio.Event()

    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        # Head and three chunks in one write: they reach the client together.
        await conn.send(
            h11.Response(status_code=200, headers=[]),
            h11.Data(data=b"a"),
            h11.Data(data=b"b"),
            h11.Data(data=b"c"),
        )
        await release.wait()
        await conn.send(h11.Data(data=b"d"), h11.EndOfMessage())

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool, await pool.request("GET", server.url(), []) as response:
        chunks = response.aiter_bytes()
        assert await chunks.__anext__() == b"abc"
        release.set()
        assert [chunk async for chunk in chunks] == [b"d"]


async def test_server_closing_mid_body_is_an_error_and_the_connection_is_dropped(
    nursery: trio.Nursery,
) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        if request.target == b"/truncated":
            await conn.send(
                h11.Response(status_code=200, headers=[(b"content-length", b"100")]),
                h11.Data(data=b"only ten.."),
            )
            conn.close_after = True
        else:
            await conn.respond(200, [], b"fine")

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        async with await pool.request("GET", server.url("/truncated"), []) as response:
            chunks: list[bytes] = []
            with pytest.raises(UpstreamProtocolError) as caught:
                async for chunk in response.aiter_bytes():
                    chunks.append(chunk)
            assert b"".join(chunks) == b"only ten.."
            assert caught.value.request_sent is True
            with pytest.raises(UpstreamProtocolError):
                await response.read()
        assert pool.stats().open_connections == 0
        async with await pool.request("GET", server.url("/next"), []) as response:
            assert await response.read() == b"fine"
        assert server.connections == 2
        assert pool.stats().stale_retries == 0


async def test_consumer_cancelled_mid_body_closes_the_connection(nursery: trio.Nursery) -> None:
    client_gone = trio.Event()

    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.send(h11.Response(status_code=200, headers=[]), h11.Data(data=b"token 1"))
        await conn.wait_for_client_close()
        client_gone.set()
        conn.close_after = True

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        received: list[bytes] = []
        with trio.CancelScope() as scope:  # stands in for the downstream client going away
            async with await pool.request("GET", server.url(), []) as response:
                async for chunk in response.aiter_bytes():
                    received.append(chunk)
                    scope.cancel()
        assert scope.cancelled_caught
        assert received == [b"token 1"]
        stats = pool.stats()
        assert (stats.open_connections, stats.in_use_connections) == (0, 0)
        assert stats.idle_connections == {}
        with trio.fail_after(2):
            await client_gone.wait()


async def test_a_response_abandoned_mid_body_is_closed_not_pooled(nursery: trio.Nursery) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.send(h11.Response(status_code=200, headers=[]), h11.Data(data=b"part"))
        await conn.wait_for_client_close()
        conn.close_after = True

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        response = await pool.request("GET", server.url(), [])
        async for _ in response.aiter_bytes():
            break
        await response.aclose()
        await response.aclose()  # idempotent
        with pytest.raises(RuntimeError):
            await response.read()
        assert pool.stats().open_connections == 0
        await server.wait_disconnects(1)


# --- stale pooled connections -------------------------------------------------------------------


async def test_a_stale_pooled_connection_is_retried_once_on_a_fresh_one(
    nursery: trio.Nursery,
) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await echo(conn, request, body)
        conn.close_after = True  # advertises keep-alive, then closes anyway (idle timeout)

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        await get_json(pool, server.url("/first"))
        await server.wait_disconnects(1)  # the pooled connection is now dead
        assert pool.stats().idle_connections == {f"http://127.0.0.1:{server.port}": 1}

        got = await get_json(pool, server.url("/second"), method="POST", body=b"once")
        assert got["body"] == "once"
        assert server.connections == 2
        # The POST reached the server exactly once: the dead connection carried nothing.
        assert [request.target for request, _ in server.requests] == [b"/first", b"/second"]
        stats = pool.stats()
        assert stats.stale_retries == 1
        assert stats.connections_created == 2


async def test_a_fresh_connection_closed_without_response_is_not_retried(
    nursery: trio.Nursery,
) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        conn.close_after = True  # read the request, answer nothing

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        with pytest.raises(UpstreamProtocolError) as caught:
            await pool.request("POST", server.url(), [], b"{}")
        assert caught.value.request_sent is True
        assert server.connections == 1
        stats = pool.stats()
        assert stats.stale_retries == 0
        assert (stats.open_connections, stats.in_use_connections) == (0, 0)


async def test_stale_retry_that_also_fails_raises_request_sent(nursery: trio.Nursery) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        if request.target == b"/first":
            await conn.respond(200, [], b"ok")
        conn.close_after = True

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        async with await pool.request("GET", server.url("/first"), []) as response:
            assert await response.read() == b"ok"
        await server.wait_disconnects(1)
        with pytest.raises(UpstreamProtocolError) as caught:
            await pool.request("GET", server.url("/second"), [])
        assert caught.value.request_sent is True
        assert server.connections == 2
        assert pool.stats().stale_retries == 1
        assert pool.stats().open_connections == 0


async def test_malformed_response_head_is_a_protocol_error(nursery: trio.Nursery) -> None:
    async def handler(conn: ServerConn, request: h11.Request, body: bytes) -> None:
        await conn.stream.send_all(b"NOT HTTP AT ALL\r\n\r\n")
        conn.close_after = True

    server = await start_server(nursery, handler)
    async with ConnectionPool() as pool:
        with pytest.raises(UpstreamProtocolError, match="bad response head"):
            await pool.request("GET", server.url(), [])
        assert pool.stats().open_connections == 0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (b"x-ok", b"plain value"),
        (b"x-ok", b""),
        (b"x-ok", b"caf\xc3\xa9 \t tab"),
        (b"x-sp", b" leading"),
        (b"x-sp", b"trailing "),
        (b"x-ctl", b"a\x01b"),
        (b"x-nul", b"a\x00b"),
        (b"x-crlf", b"a\r\nb"),
        (b"x-ff", b"a\x0cb"),
        (b"bad name", b"v"),
        (b"x(y", b"v"),
        (b";", b"v"),
        (b"", b"v"),
    ],
)
def test_build_request_refuses_exactly_what_h11_refuses(name: bytes, value: bytes) -> None:
    """The pool validates headers itself and tells h11 they are validated (`_parsed`): the same
    grammar as h11's own check, so nothing h11 would have refused is sent."""
    try:
        h11.Request(method=b"POST", target=b"/v1/x", headers=[(b"host", b"h"), (name, value)])
    except h11.LocalProtocolError:
        h11_refuses = True
    else:
        h11_refuses = False
    try:
        build_request("POST", b"h", b"/v1/x", [(name, value)], b"{}")
    except ValueError:
        ours_refuses = True
    else:
        ours_refuses = False
    assert ours_refuses == h11_refuses


# --- configuration ------------------------------------------------------------------------------


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        UpstreamConfig(connect_timeout=0)
    with pytest.raises(ValueError):
        UpstreamConfig(response_head_timeout=math.nan)
    with pytest.raises(ValueError):
        UpstreamConfig(max_connections_per_origin=0)
    with pytest.raises(ValueError):
        UpstreamConfig(max_idle_per_origin=-1)
    with pytest.raises(ValueError):
        UpstreamConfig(ssl_context=ssl.create_default_context(), ca_file="/x.pem")
    assert UpstreamConfig(response_head_timeout=math.inf).response_head_timeout == math.inf


# --- TLS ----------------------------------------------------------------------------------------


@pytest.fixture
def ca() -> Any:
    trustme = pytest.importorskip(
        "trustme", reason="TLS tests need trustme (pip install trustme) for throwaway certificates"
    )
    return trustme.CA()


async def start_tls_server(nursery: trio.Nursery, ca: Any, sni_seen: list[str | None]) -> Server:
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)

    def record_sni(sock: ssl.SSLObject, name: str | None, ctx: ssl.SSLContext) -> None:
        sni_seen.append(name)

    server_context.sni_callback = record_sni
    server = await start_server(nursery, echo, ssl_context=server_context)
    server.host = "localhost"
    return server


async def test_https_with_sni_and_keep_alive(nursery: trio.Nursery, ca: Any) -> None:
    sni_seen: list[str | None] = []
    server = await start_tls_server(nursery, ca, sni_seen)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    async with ConnectionPool(UpstreamConfig(ssl_context=client_context)) as pool:
        for _ in range(2):
            got = await get_json(pool, server.url("/secure"), method="POST", body=b"tls")
            assert got["body"] == "tls"
            assert header_values(got["headers"], "host") == [f"localhost:{server.port}"]
        assert server.connections == 1
    assert sni_seen == ["localhost"]


async def test_https_with_ca_file(nursery: trio.Nursery, ca: Any, tmp_path: Path) -> None:
    server = await start_tls_server(nursery, ca, [])
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    async with ConnectionPool(UpstreamConfig(ca_file=str(ca_file))) as pool:
        got = await get_json(pool, server.url("/ca-file"))
        assert got["target"] == "/ca-file"
    context = make_ssl_context(str(ca_file))
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert context.check_hostname


async def test_https_with_an_untrusted_certificate_is_a_connect_error(
    nursery: trio.Nursery, ca: Any
) -> None:
    server = await start_tls_server(nursery, ca, [])
    async with ConnectionPool() as pool:  # system trust store only
        with pytest.raises(ConnectError, match="TLS handshake"):
            await pool.request("GET", server.url(), [])
        assert pool.stats().open_connections == 0
