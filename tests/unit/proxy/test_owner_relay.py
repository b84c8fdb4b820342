"""Relaying pool requests to the pool's owner (docs/pool-ownership.md, "Relaying requests to the
owner"): a follower `ProxyApp` whose activator says another replica owns the pool hands the request
to the owner, served by Hypercorn on loopback (`serve_asgi`), and streams its answer back.

The owner here is a stand-in ASGI app that records what it received and streams what the test
tells it to: what is under test is the follower's side (headers, marker, streaming, disconnect,
retries). A relayed request reaching a replica that does not own the pool is answered by a real
`ProxyApp`, in process."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import trio
from prometheus_client import CollectorRegistry

from stargate.activator import Activator, PoolSpec
from stargate.activator.testing import FakeOwnership, Harness, running_activator
from stargate.asgi import ASGIReceive, ASGIScope, ASGISend, answer_lifespan
from stargate.config import ListenAddress, ProxyConfig
from stargate.load_balancing.config import LbConfig
from stargate.metrics import ProxyMetrics
from stargate.proxy.app import ProxyApp
from stargate.proxy.forwarder import Forwarder
from stargate.proxy.owner_relay import (
    RELAYED_HEADER,
    OwnerRelay,
    owner_relay,
    relay_request_headers,
    relay_response_headers,
)
from stargate.routing import RoutingState
from stargate.serving import bind_listener, hypercorn_config, serve_asgi
from stargate.upstream import ConnectionPool, UpstreamConfig

POOL = "gpu0"
SPEC = PoolSpec(POOL, ("a", "b"), swap_budget=60.0, hold_budget=3.0)

REQUEST_HEADERS = [
    (b"x-request-id", b"req-1"),
    (b"x-input-tokens", b"7"),
    (b"x-model", b"a"),
    (b"authorization", b"Bearer secret-token"),
    (b"x-routing-method", b"power-of-two"),
    (b"x-custom", b"kept"),
    (b"connection", b"keep-alive, x-hop"),
    (b"x-hop", b"dropped"),
    (b"x-forwarded-for", b"203.0.113.9"),
    (b"content-type", b"application/json"),
]
BODY = json.dumps({"model": "a", "messages": [], "stream": True}).encode()


# ---- the pure parts ----------------------------------------------------------------------------


def test_request_headers_as_received_minus_hop_by_hop_plus_marker() -> None:
    headers = relay_request_headers(
        [*REQUEST_HEADERS, (RELAYED_HEADER, b"forged"), (b"upgrade", b"h2c")],
        POOL,
        ("198.51.100.4", 5555),
        "http",
    )
    names = [name for name, _ in headers]
    for kept in [*REQUEST_HEADERS[:6], REQUEST_HEADERS[-1]]:
        assert kept in headers
    for dropped in (b"connection", b"x-hop", b"upgrade"):
        assert dropped not in names
    assert (b"x-forwarded-for", b"203.0.113.9, 198.51.100.4") in headers
    assert (b"x-forwarded-proto", b"http") in headers
    assert [v for n, v in headers if n == RELAYED_HEADER] == [POOL.encode()]


def test_response_headers_as_sent_minus_hop_by_hop() -> None:
    sent = [
        (b"content-type", b"text/event-stream"),
        (b"transfer-encoding", b"chunked"),
        (b"date", b"x"),
        (b"server", b"hypercorn"),
        (b"x-inference-server-id", b"engine-1"),
        (b"x-stargate-error-code", b"none"),
        (b"retry-after", b"5"),
    ]
    assert relay_response_headers(sent) == [sent[0], *sent[4:]]


def test_a_replica_relays_only_with_shared_pools_on_connections_that_never_time_heads_out() -> None:
    """The replica's builder: no relay for pools this replica decides alone (or without pools);
    otherwise connections as the proxy's flags set them, except the head timeout, which the relay
    applies itself (the owner may hold the request for a whole hold budget first)."""
    proxy = ProxyConfig(connect_timeout_ms=1_500, max_connections_per_backend=7)
    activator = cast(Activator, object())  # the builder only hands it to the relay
    assert owner_relay(proxy, activator, shared=False) is None
    assert owner_relay(proxy, None, shared=True) is None
    relay = owner_relay(proxy, activator, shared=True)
    assert relay is not None
    connections = relay.connections.config
    assert connections.response_head_timeout == math.inf
    assert (connections.connect_timeout, connections.max_connections_per_origin) == (1.5, 7)


# ---- the stand-in owner ------------------------------------------------------------------------


@dataclass
class Owner:
    """An ASGI app standing in for the owning replica. Each request is recorded; `chunks` says
    what the answer streams, each chunk sent once `release` lets it go (None: at once)."""

    status: int = 200
    headers: list[tuple[bytes, bytes]] = field(
        default_factory=lambda: [(b"content-type", b"text/event-stream")]
    )
    chunks: list[bytes] = field(default_factory=lambda: [b"data: 1\n\n", b"data: 2\n\n"])
    release: trio.MemoryReceiveChannel[None] | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    disconnected: trio.Event = field(default_factory=trio.Event)
    received: trio.Event = field(default_factory=trio.Event)
    hang_after_first: bool = False

    async def __call__(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.requests.append(
            {
                "method": scope["method"],
                "path": scope["path"],
                "query": scope["query_string"],
                "headers": list(scope["headers"]),
                "body": body,
            }
        )
        self.received.set()
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        for index, chunk in enumerate(self.chunks):
            if self.release is not None:
                await self.release.receive()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if index == 0 and self.hang_after_first:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.disconnected.set()
                return
        await send({"type": "http.response.body", "body": b""})


def dead_address() -> str:
    """A loopback URL nothing listens on (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@asynccontextmanager
async def served(app: Owner) -> AsyncIterator[str]:
    sock = bind_listener("HTTP", ListenAddress("127.0.0.1", 0))
    port = sock.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_asgi, app, sock, hypercorn_config(2.0), stop.wait)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            stop.set()


@asynccontextmanager
async def follower(
    ownership: FakeOwnership, *, relay: bool = True
) -> AsyncIterator[tuple[ProxyApp, Harness]]:
    """A follower replica's proxy app (no backends: it can only relay)."""
    async with running_activator([SPEC], ownership=ownership, ready=["a"]) as h:
        config = ProxyConfig()
        metrics = ProxyMetrics.create(CollectorRegistry(), "test_")
        forwarder = Forwarder(RoutingState(), cast(Any, object()), config, LbConfig(), metrics)
        pool = ConnectionPool(UpstreamConfig(connect_timeout=2.0, response_head_timeout=1e9))
        async with pool:
            owner_relay = OwnerRelay(pool, h.activator, response_header_timeout=2.0)
            app = ProxyApp(
                forwarder,
                config,
                metrics,
                _not_found,
                activator=h.activator,
                relay=owner_relay if relay else None,
            )
            yield app, h


async def _not_found(scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
    raise AssertionError("a proxy path reached the fallback app")


class Client:
    """One request through the follower app in process: what it sent, and when."""

    def __init__(self, headers: list[tuple[bytes, bytes]] = REQUEST_HEADERS) -> None:
        self.headers = headers
        self.sent: list[MutableMapping[str, Any]] = []
        self.chunk_sent = trio.Event()
        self.done = trio.Event()
        self.leave = trio.Event()

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"stream=1&x=%20y",
            "headers": list(self.headers),
            "scheme": "http",
            "client": ("198.51.100.4", 5555),
            "http_version": "1.1",
        }

    async def run(self, app: ProxyApp) -> None:
        first = [{"type": "http.request", "body": BODY, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if first:
                return first.pop()
            await self.leave.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            self.sent.append(message)
            if message["type"] == "http.response.body":
                self.chunk_sent.set()
                self.chunk_sent = trio.Event()

        try:
            await app(self.scope(), receive, send)
        finally:
            self.done.set()

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def response_headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


def relayed(h: Harness, outcome: str) -> float:
    return h.sample(
        "llmkube_modelpool_relayed_requests_total", outcome=outcome, pool=POOL, router="stargate"
    )


# ---- the relay ---------------------------------------------------------------------------------


async def test_a_streaming_request_is_relayed_chunk_by_chunk_with_its_headers() -> None:
    release_send, release_receive = trio.open_memory_channel[None](0)
    owner = Owner(
        headers=[(b"content-type", b"text/event-stream"), (b"x-inference-server-id", b"e1")],
        release=release_receive,
    )
    ownership = FakeOwnership()
    with trio.fail_after(10):
        async with served(owner) as address, follower(ownership) as (app, h):
            ownership.elsewhere(POOL, address, "owner-1")
            await trio.testing.wait_all_tasks_blocked()
            client = Client()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.run, app)
                first_chunk = client.chunk_sent
                await release_send.send(None)
                await first_chunk.wait()  # the first chunk arrived before the second left
                assert client.body == b"data: 1\n\n"
                await release_send.send(None)
                await client.done.wait()
            assert client.status == 200
            assert client.response_headers[b"content-type"] == b"text/event-stream"
            assert client.response_headers[b"x-inference-server-id"] == b"e1"
            assert b"transfer-encoding" not in client.response_headers
            assert client.body == b"data: 1\n\ndata: 2\n\n"
            (received,) = owner.requests
            assert received["method"] == "POST"
            assert received["path"] == "/v1/chat/completions"
            assert received["query"] == b"stream=1&x=%20y"
            assert received["body"] == BODY
            headers = received["headers"]
            for kept in REQUEST_HEADERS[:6]:
                assert kept in headers  # authorization and x-routing-method included
            assert (RELAYED_HEADER, POOL.encode()) in headers
            assert (b"x-hop", b"dropped") not in headers
            assert relayed(h, "relayed") == 1
            assert h.fake().calls == []


async def test_a_relayed_request_to_a_non_owner_is_refused_as_moved() -> None:
    ownership = FakeOwnership()
    ownership.elsewhere(POOL, "http://10.0.0.9:8000")
    async with follower(ownership) as (app, h):
        await trio.testing.wait_all_tasks_blocked()
        client = Client([*REQUEST_HEADERS, (RELAYED_HEADER, POOL.encode())])
        with trio.fail_after(5):
            await client.run(app)
        assert client.status == 503
        assert client.response_headers[b"retry-after"] == b"1"
        assert client.response_headers[b"x-stargate-error-code"] == b"pool_owner_moved"
        assert json.loads(client.body)["error"]["code"] == "pool_owner_moved"
        assert relayed(h, "rejected") == 1


async def test_without_a_relay_a_request_owned_elsewhere_is_a_503() -> None:
    ownership = FakeOwnership()
    ownership.elsewhere(POOL, "http://10.0.0.9:8000")
    async with follower(ownership, relay=False) as (app, _):
        await trio.testing.wait_all_tasks_blocked()
        client = Client()
        with trio.fail_after(5):
            await client.run(app)
        assert client.status == 503
        assert client.response_headers[b"x-stargate-error-code"] == b"pool_owned_elsewhere"
        assert client.response_headers[b"retry-after"] == b"1"


async def test_a_client_disconnect_cancels_the_owner_side_request() -> None:
    owner = Owner(hang_after_first=True)
    ownership = FakeOwnership()
    with trio.fail_after(10):
        async with served(owner) as address, follower(ownership) as (app, _):
            ownership.elsewhere(POOL, address)
            await trio.testing.wait_all_tasks_blocked()
            client = Client()
            async with trio.open_nursery() as nursery:
                first_chunk = client.chunk_sent
                nursery.start_soon(client.run, app)
                await first_chunk.wait()
                assert not owner.disconnected.is_set()
                client.leave.set()
                await owner.disconnected.wait()  # the owner heard its client (us) go
                await client.done.wait()


async def test_an_unreachable_owner_is_retried_at_the_next_owner() -> None:
    owner = Owner()
    ownership = FakeOwnership()
    with trio.fail_after(10):
        async with served(owner) as address, follower(ownership) as (app, h):
            ownership.elsewhere(POOL, dead_address(), "dead")
            await trio.testing.wait_all_tasks_blocked()
            client = Client()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.run, app)
                await trio.sleep(0.3)  # refused; waiting for the next owner
                assert not client.done.is_set()
                ownership.elsewhere(POOL, address, "alive")
                await client.done.wait()
            assert client.status == 200
            assert client.body == b"data: 1\n\ndata: 2\n\n"
            assert len(owner.requests) == 1
            assert relayed(h, "relayed") == 1


async def test_an_owner_that_moved_is_retried_at_the_next_owner() -> None:
    moved = Owner(
        status=503,
        headers=[(b"x-stargate-error-code", b"pool_owner_moved"), (b"retry-after", b"1")],
        chunks=[],
    )
    owner = Owner()
    ownership = FakeOwnership()
    with trio.fail_after(10):
        async with (
            served(moved) as old,
            served(owner) as new,
            follower(ownership) as (app, _),
        ):
            ownership.elsewhere(POOL, old)
            await trio.testing.wait_all_tasks_blocked()
            client = Client()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.run, app)
                await moved.received.wait()
                await trio.sleep(0.1)
                assert not client.done.is_set()
                ownership.elsewhere(POOL, new)
                await client.done.wait()
            assert client.status == 200
            assert len(owner.requests) == 1


async def test_an_owner_unreachable_for_the_whole_hold_budget_is_a_503() -> None:
    ownership = FakeOwnership()
    with trio.fail_after(10):
        async with follower(ownership) as (app, h):
            ownership.elsewhere(POOL, dead_address())
            await trio.testing.wait_all_tasks_blocked()
            client = Client()
            started = trio.current_time()
            await client.run(app)
            assert trio.current_time() - started == pytest.approx(3.0, abs=0.5)  # hold budget
            assert client.status == 503
            assert client.response_headers[b"x-stargate-error-code"] == b"pool_owner_unavailable"
            assert b"retry-after" in client.response_headers
            assert relayed(h, "owner_unavailable") == 1


async def test_ownership_arriving_here_serves_locally() -> None:
    """Unreachable owner, then this replica becomes the owner: the request goes through the
    local activator (here the grant is taken; the forwarder has no backend, so a 404/503 from
    routing follows, not a relay)."""
    ownership = FakeOwnership()
    with trio.fail_after(10):
        async with follower(ownership) as (app, h):
            ownership.elsewhere(POOL, dead_address())
            await trio.testing.wait_all_tasks_blocked()
            client = Client()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.run, app)
                await trio.sleep(0.3)
                ownership.own(POOL)
                await client.done.wait()
            assert relayed(h, "local") == 1
            assert h.activator.idle(POOL)  # the grant was taken and released
