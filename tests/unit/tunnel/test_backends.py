"""The replica's tunnel manager with fake links and a mock clock (docs/tunnels.md, "Connection
states", "Reverse handshake", "Requests"), driven through the registration service as a Pylon's
stream would: what each update is acked with, when routes appear, the handshake checks in their
order, hot-path reconnects and evictions. The real transport is in tests/e2e/test_tunnels.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import Self

import pytest
import trio
from trio.testing import MockClock

from stargate.config import Connectivity, ListenAddress, TunnelConfig
from stargate.control_plane.auth import AuthenticationFailed, OpenAuthenticator
from stargate.control_plane.registration import RegistrationConfig, RegistrationService
from stargate.health_probe import ProbeFailed
from stargate.routing import RegistrationIdentity, RoutingState, RoutingTargetKey
from stargate.tunnel.backends import TunnelBackends, TunnelMetrics
from stargate.tunnel.gating import DIRECT_GRACE_SECONDS, ReverseState
from stargate.tunnel.quic import ConnectFailed
from stargate.upstream import ConnectError, UpstreamProtocolError
from tests.fakes.pylon import registration
from tests.unit.control_plane.test_probe_routability import _exchange, _open, _until

M = RoutingTargetKey(None, "m")
DIRECT_URL = "quic://127.0.0.1:4433"
LOOPBACK_ANY_PORT = ListenAddress("127.0.0.1", 0)
ENGINE_URL = "http://127.0.0.1:8080"


class FakeResponse:
    def __init__(self, status: int = 200, body: bytes = b"ok") -> None:
        self.status = status
        self.headers: list[tuple[bytes, bytes]] = []
        self._body = body
        self._complete = False

    @property
    def complete(self) -> bool:
        return self._complete

    def take_buffered(self) -> bytes | None:
        return None

    async def _chunks(self) -> AsyncIterator[bytes]:
        self._complete = True
        yield self._body

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def read(self) -> bytes:
        self._complete = True
        return self._body

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class FakeLink:
    """A tunnel connection: healthy until `die()`; answers every request (or fails)."""

    def __init__(self, fail: bool = False) -> None:
        self.healthy = True
        self.fail = fail
        self.requests: list[tuple[str, bytes]] = []
        self.closed = False

    def die(self) -> None:
        self.healthy = False

    open_requests = 0

    async def request(
        self,
        method: str,
        path_and_query: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | bytearray,
        deadline: float,
    ) -> FakeResponse:
        await trio.sleep(0.001)
        self.requests.append((method, path_and_query))
        if self.fail:
            self.healthy = False
            raise UpstreamProtocolError("tunnel stream failed", request_sent=True)
        return FakeResponse()

    def close(self) -> None:
        self.closed = True
        self.healthy = False


class Dialer(TunnelBackends):
    """TunnelBackends whose dials are scripted: each returns the next FakeLink, or fails."""

    def __init__(self, config: TunnelConfig, **kwargs: object) -> None:
        super().__init__(config, OpenAuthenticator().authenticate, **kwargs)  # type: ignore[arg-type]
        self.dial_ok = True
        self.dials = 0
        self.links: list[FakeLink] = []

    async def _connect(self, host: str, port: int) -> FakeLink:  # type: ignore[override]
        self.dials += 1
        await trio.sleep(0.01)
        if not self.dial_ok:
            raise ConnectFailed(f"QUIC connection to {host}:{port} failed: timed out")
        link = FakeLink()
        self.links.append(link)
        return link


def service_for(state: RoutingState, tunnels: TunnelBackends) -> RegistrationService:
    async def no_http_probe(url: str) -> int:
        raise ProbeFailed(f"{url} is a tunnel backend: never probed over HTTP")

    return RegistrationService(
        state, OpenAuthenticator(), no_http_probe, RegistrationConfig(idle_timeout_ms=0), tunnels
    )


async def test_a_direct_backend_that_cannot_be_dialed_is_applied_unroutable_and_not_acked(
    autojump_clock: MockClock,
) -> None:
    state = RoutingState()
    tunnels = Dialer(TunnelConfig(insecure=True))
    tunnels.dial_ok = False
    service = service_for(state, tunnels)
    message = registration("a", DIRECT_URL, ["m"])
    async with trio.open_nursery() as nursery:
        await nursery.start(tunnels.run)
        stream = await _open(nursery, service)
        await stream.send.send(message)
        await _until(lambda: state.is_advertised(M))
        await trio.sleep(1)
        assert stream.acks == []  # the Rust rule: no ack, the next update dials again
        assert state.snapshot(M) is None
        tunnels.dial_ok = True
        await _exchange(stream, message)
        assert state.snapshot(M) is not None  # routable: the probe went through the tunnel
        assert tunnels.links[0].requests[0] == ("GET", b"/health")
        nursery.cancel_scope.cancel()


async def test_a_connected_direct_backend_keeps_routing_through_the_grace_only(
    autojump_clock: MockClock,
) -> None:
    state = RoutingState()
    tunnels = Dialer(TunnelConfig(insecure=True, direct_connections=2))
    service = service_for(state, tunnels)
    message = registration("a", DIRECT_URL, ["m"])
    async with trio.open_nursery() as nursery:
        await nursery.start(tunnels.run)
        stream = await _open(nursery, service)
        await _exchange(stream, message)
        assert tunnels.dials == 2  # the whole set
        for link in tunnels.links:
            link.die()
        tunnels.dial_ok = False
        started = trio.current_time()
        await _exchange(stream, message)  # recovering: still acked
        acks = len(stream.acks)
        while trio.current_time() - started < DIRECT_GRACE_SECONDS + 0.5:
            await stream.send.send(message)
            await trio.sleep(0.5)
        assert len(stream.acks) < acks + 5  # past the grace the updates go unacked
        assert state.snapshot(M) is None
        nursery.cancel_scope.cancel()


async def test_a_reverse_backend_is_advertised_first_and_routed_once_its_tunnel_is_up(
    autojump_clock: MockClock,
) -> None:
    state = RoutingState()
    config = TunnelConfig(
        insecure=True,
        connectivity=Connectivity.REVERSE,
        reverse_listen_addr=LOOPBACK_ANY_PORT,
        reverse_pylon_dial_addr=" udp-lb:7000 ",
        reverse_connect_timeout_ms=3_000,
    )
    tunnels = Dialer(config, advertised_host=lambda: "10.0.0.9")
    service = service_for(state, tunnels)
    message = registration("r", ENGINE_URL, ["m"])
    message.reverse_tunnel = True
    async with trio.open_nursery() as nursery:
        await nursery.start(tunnels.run)
        stream = await _open(nursery, service)
        await _exchange(stream, message)  # the first update only advertises, without waiting
        ack = stream.acks[0]
        assert ack.reverse_tunnel_target == f"10.0.0.9:{tunnels.reverse_port}"
        assert ack.reverse_tunnel_pylon_dial_addr == "udp-lb:7000"
        assert state.is_advertised(M) and state.snapshot(M) is None
        # A later update waits for the tunnel: no tunnel in time, acked all the same, unroutable.
        started = trio.current_time()
        await _exchange(stream, message)
        assert trio.current_time() - started == pytest.approx(3.0, abs=0.1)
        assert state.snapshot(M) is None
        # The Pylon's handshake arrives while an update waits: routed at once.
        await stream.send.send(message)
        await trio.sleep(1)
        tunnel, reason = await tunnels._check_handshake("r", None)
        assert reason is None and tunnel is not None
        link = FakeLink()
        assert tunnels._install(tunnel, link)
        await _until(lambda: state.snapshot(M) is not None)
        assert trio.current_time() - started < 4.5  # not the whole 3 s wait
        # The tunnel drops: the next update finds none, the models go unroutable.
        link.die()
        tunnels._lost(tunnel, link)
        await _exchange(stream, message)
        assert state.snapshot(M) is None
        nursery.cancel_scope.cancel()


async def test_the_handshake_checks_run_in_the_rust_order(autojump_clock: MockClock) -> None:
    keys = {"token-a": "key-a", "token-b": "key-b"}

    async def authenticate(token: str | None) -> str | None:
        await trio.lowlevel.checkpoint()
        if token not in keys:
            raise AuthenticationFailed("no such token")
        return keys[token]

    config = TunnelConfig(
        insecure=True, connectivity=Connectivity.REVERSE, reverse_listen_addr=LOOPBACK_ANY_PORT
    )
    tunnels = TunnelBackends(config, authenticate)
    state = RoutingState()
    reverse = state.begin(RegistrationIdentity("r", "r", ENGINE_URL, "key-a", reverse_tunnel=True))
    direct = state.begin(RegistrationIdentity("d", "d", DIRECT_URL, "key-a"))
    tunnels.begin(reverse)
    tunnels.begin(direct)
    cases = [
        ("", "bad", "empty inference_server_id"),
        ("r", "bad", "authentication failed"),
        ("nobody", "token-a", "unauthorized inference_server_id"),
        ("d", "token-a", "unauthorized inference_server_id"),
        ("r", "token-b", "routing key mismatch"),
    ]
    for server_id, token, reason in cases:
        assert (await tunnels._check_handshake(server_id, token))[1] == reason
    tunnel, reason = await tunnels._check_handshake("r", "token-a")
    assert reason is None and tunnel is not None
    assert tunnel.reverse.state is ReverseState.INSTALLING
    # An install in progress, then a healthy connection, refuse a second handshake.
    assert (await tunnels._check_handshake("r", "token-a"))[1] == "duplicate connection"
    link = FakeLink()
    tunnels._install(tunnel, link)
    assert (await tunnels._check_handshake("r", "token-a"))[1] == "duplicate connection"
    link.die()  # no longer healthy: a new handshake may replace it
    assert (await tunnels._check_handshake("r", "token-a"))[1] is None
    # The registration ends: its slot is retired, a late install is closed, not revived.
    tunnels.end(reverse)
    late = FakeLink()
    assert not tunnels._install(tunnel, late) and late.closed
    assert (await tunnels._check_handshake("r", "token-a"))[1] == (
        "unauthorized inference_server_id"
    )


async def test_hot_path_reconnects_and_evictions_are_counted(autojump_clock: MockClock) -> None:
    counted: list[tuple[str, str, str]] = []
    metrics = TunnelMetrics(
        evicted=lambda server_id, reason: counted.append(("evicted", server_id, reason)),
        reconnected=lambda server_id, result: counted.append(("reconnect", server_id, result)),
    )
    tunnels = Dialer(TunnelConfig(insecure=True), metrics=metrics)
    state = RoutingState()
    direct = state.begin(RegistrationIdentity("d", "d", DIRECT_URL, None))
    tunnels.begin(direct)
    async with trio.open_nursery() as nursery:
        await nursery.start(tunnels.run)
        # No healthy connection before the attempt: re-dialed on the hot path.
        response = await tunnels.request(direct, "POST", b"/v1/chat/completions", [], b"{}")
        assert response.status == 200
        assert counted == [("evicted", "d", "stale_connection"), ("reconnect", "d", "success")]
        # The attempt fails on its connection: evicted as a proxy error (the next attempt
        # re-dials).
        tunnels.links[0].fail = True
        with pytest.raises(UpstreamProtocolError):
            await tunnels.request(direct, "POST", b"/v1/chat/completions", [], b"{}")
        assert counted[-1] == ("evicted", "d", "proxy_error")
        tunnels.dial_ok = False
        with pytest.raises(ConnectError):
            await tunnels.request(direct, "POST", b"/v1/chat/completions", [], b"{}")
        assert counted[-1] == ("reconnect", "d", "error")
        nursery.cancel_scope.cancel()


async def test_a_reverse_backend_without_a_tunnel_is_a_connect_failure_never_a_dial() -> None:
    config = TunnelConfig(
        insecure=True, connectivity=Connectivity.REVERSE, reverse_listen_addr=LOOPBACK_ANY_PORT
    )
    tunnels = Dialer(config)
    state = RoutingState()
    reverse = state.begin(RegistrationIdentity("r", "r", ENGINE_URL, None, reverse_tunnel=True))
    tunnels.begin(reverse)
    with pytest.raises(ConnectError, match="no reverse tunnel connection"):
        await tunnels.request(reverse, "POST", b"/v1/chat/completions", [], b"{}")
    assert tunnels.dials == 0


def test_quic_registrations_need_a_way_to_check_the_pylon() -> None:
    identity = RegistrationIdentity("d", "d", DIRECT_URL, None)
    verified = TunnelBackends(TunnelConfig(), OpenAuthenticator().authenticate)
    assert verified.admit(identity) is not None and "--quic-insecure" in str(
        verified.admit(identity)
    )
    assert (
        TunnelBackends(TunnelConfig(insecure=True), OpenAuthenticator().authenticate).admit(
            identity
        )
        is None
    )
    reverse = RegistrationIdentity("r", "r", ENGINE_URL, None, reverse_tunnel=True)
    assert verified.admit(reverse) == "reverse tunnel flag set but no reverse tunnel config"


async def test_a_retired_connection_closes_once_its_requests_are_done(
    autojump_clock: MockClock,
) -> None:
    """A registration that ends (a Pylon stopping, closing its registrations first) does not cut
    the streams in flight on its connections; they close once those are done."""
    tunnels = Dialer(TunnelConfig(insecure=True))
    state = RoutingState()
    direct = state.begin(RegistrationIdentity("d", "d", DIRECT_URL, None))
    tunnels.begin(direct)
    async with trio.open_nursery() as nursery:
        await nursery.start(tunnels.run)
        await tunnels.request(direct, "POST", b"/v1/chat/completions", [], b"{}")
        link = tunnels.links[0]
        link.open_requests = 1  # a stream still running
        tunnels.end(direct)
        await trio.sleep(30)
        assert not link.closed
        link.open_requests = 0
        await trio.sleep(1)
        assert link.closed
        nursery.cancel_scope.cancel()
