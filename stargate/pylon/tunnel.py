"""The Pylon's end of the QUIC tunnels: requests in, through the same hop as its HTTP listener.

docs/tunnels.md, "The Pylon". The replica opens one stream per request on a connection the Pylon
either accepted (direct: the Pylon listens on UDP and registers `quic://IP:port`) or dialed
(reverse: after a replica's ack names its reverse listener, the Pylon dials it, sends its
`Handshake` on its first stream and serves the streams the replica opens). Every request goes to
`PylonHop.forward`, the transport-independent core of `hop.py`, so the stats are the same over
either transport.

A stream's failures stay on that stream: a head without `x-method`/`x-path`, a malformed message,
an answer cut after its head (`StreamAborted`) reset the stream (code 0, as Rust), never the
connection. The replica resetting or stopping a stream cancels its hop (and the engine request).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from stargate.addresses import parse_host_port
from stargate.asgi import BodyTooLarge
from stargate.config import TunnelProtocol
from stargate.pylon.backoff import Backoff
from stargate.pylon.hop import PylonHop, PylonRequest, StreamAborted
from stargate.tunnel.codec import TunnelProtocolError
from stargate.tunnel.handshake import send_handshake
from stargate.tunnel.raw_quic import BadTunnelRequest, TunnelRequestReader, TunnelSink
from stargate.tunnel.stream import StreamClosed, StreamReset, TunnelStream

if TYPE_CHECKING:  # aioquic loads only when a tunnel is served (the sidecar imports this module)
    from stargate.tunnel.quic import QuicConnection

__all__ = [
    "REVERSE_CONNECT_TIMEOUT_SECONDS",
    "EndpointWatch",
    "HandshakeRejected",
    "ReverseEndpoint",
    "dial_reverse",
    "serve_connection",
]

log = logging.getLogger("stargate.pylon")

REVERSE_CONNECT_TIMEOUT_SECONDS = 5.0
"""One bound over resolving, the QUIC handshake, the `Handshake` and its ack (the Rust
`REVERSE_TUNNEL_CONNECT_TIMEOUT`)."""
REVERSE_BACKOFF_INITIAL_SECONDS = 1.0
REVERSE_BACKOFF_CAP_SECONDS = 30.0
REVERSE_STABLE_SECONDS = 60.0
"""A reverse tunnel that lived this long restarts its backoff from the initial delay."""


async def serve_stream(stream: TunnelStream, hop: PylonHop) -> None:
    """One raw-quic request on `stream`, answered through `hop`."""
    reader = TunnelRequestReader(stream)
    sink = TunnelSink(stream)
    try:
        head = await reader.head()
        if head is None:
            return
        request = PylonRequest(head.method, head.path, head.query, head.headers)
        await hop.forward(request, reader.body, sink)
    except (BadTunnelRequest, TunnelProtocolError) as error:
        log.warning("tunnel stream %d refused: %s", stream.stream_id, error)
    except StreamAborted:
        pass  # logged by the hop; the reset below tells the replica the body is broken
    except BodyTooLarge:
        log.warning("tunnel stream %d: request body over the limit", stream.stream_id)
    except (StreamReset, StreamClosed):
        return  # the replica gave up on this request: nothing to answer
    else:
        if sink.finished:
            return
    stream.reset(0)
    stream.stop(0)


async def serve_connection(
    connection: QuicConnection, hop: PylonHop, protocol: TunnelProtocol
) -> None:
    """Serve every request stream the replica opens on `connection` until it closes."""
    if protocol is TunnelProtocol.HTTP3:
        from stargate.tunnel.http3 import serve_http3

        await serve_http3(connection, hop)
        return
    from stargate.tunnel.quic import ConnectionClosed

    async with trio.open_nursery() as nursery:
        while True:
            try:
                stream = await connection.accept_stream()
            except ConnectionClosed:
                return
            nursery.start_soon(serve_stream, stream, hop)


class HandshakeRejected(Exception):
    """The replica refused the reverse handshake (its NACK reason is the message)."""


@dataclass(frozen=True, slots=True)
class ReverseEndpoint:
    """Where a replica's ack tells the Pylon to dial: the target (whose host is the SNI when
    the dial address differs) and the dial address."""

    target: str
    dial_addr: str

    @property
    def sni(self) -> str:
        """The Rust rule: the target's host (which is the dial address's when the two are the
        same); an IP literal or `localhost` becomes `stargate`."""
        from stargate.tunnel.quic.tls import derive_sni

        return derive_sni(self.target)


class EndpointWatch:
    """The reverse endpoint named by a replica's latest ack: `wait` returns it once there is
    one, `wait_changed` returns when a later ack names another (the tunnel is then redialed)."""

    def __init__(self) -> None:
        self.current: ReverseEndpoint | None = None
        self.started = False
        self._changed = trio.Event()

    def update(self, target: str, dial_addr: str) -> bool:
        """Take an ack's `reverse_tunnel_target` and `reverse_tunnel_pylon_dial_addr` (the target
        when empty); True when the ack names an endpoint."""
        target = target.strip()
        if not target:
            return False
        endpoint = ReverseEndpoint(target, dial_addr.strip() or target)
        if endpoint != self.current:
            self.current = endpoint
            self._changed.set()
            self._changed = trio.Event()
        return True

    async def wait(self) -> ReverseEndpoint:
        while self.current is None:
            await self._changed.wait()
        return self.current

    async def wait_changed(self, since: ReverseEndpoint) -> None:
        while self.current == since:
            await self._changed.wait()


async def dial_reverse(
    nursery: trio.Nursery,
    endpoint: ReverseEndpoint,
    server_id: str,
    token: str | None,
    *,
    protocol: TunnelProtocol,
    insecure: bool,
    trust_pem: bytes | None,
) -> QuicConnection:
    """Dial a replica's reverse listener and handshake (bounded by
    `REVERSE_CONNECT_TIMEOUT_SECONDS` overall). ConnectFailed, HandshakeRejected or
    TunnelProtocolError on failure; the connection is closed then."""
    from stargate.tunnel.quic import connect
    from stargate.tunnel.quic.tls import client_configuration

    # A malformed address in an ack is an AddressError: logged, and the loop backs off.
    dial = parse_host_port(endpoint.dial_addr, names=True, min_port=1)
    host, port = dial.host, dial.port
    configuration = client_configuration(
        insecure=insecure, trust_pem=trust_pem, server_name=endpoint.sni, alpn=protocol.alpn
    )
    with trio.fail_after(REVERSE_CONNECT_TIMEOUT_SECONDS):
        connection = await connect(
            nursery, host, port, configuration, timeout=REVERSE_CONNECT_TIMEOUT_SECONDS
        )
        try:
            stream = await connection.open_stream()  # client bidi stream 0
            accepted, reason = await send_handshake(stream, server_id, token)
        except BaseException:
            connection.close(0, "handshake failed")
            raise
    if not accepted:
        connection.close(0, "handshake rejected")
        raise HandshakeRejected(reason)
    return connection


class ReverseTunnels:
    """One reverse tunnel per replica, kept up by `run_for` (the Rust reconnect loop): dial,
    serve until the connection closes, back off 1 s doubling to 30 s (from 1 s again after a
    connection that lived 60 s, or when the endpoint changes)."""

    def __init__(
        self,
        hop: Callable[[], PylonHop | None],
        server_id: str,
        token: Callable[[], str | None],
        *,
        protocol: TunnelProtocol,
        insecure: bool,
        trust_pem: bytes | None,
        on_change: Callable[[], None],
        connections: set[QuicConnection] | None = None,
    ) -> None:
        self._hop = hop
        self._connections: set[QuicConnection] = set() if connections is None else connections
        self._server_id = server_id
        self._token = token
        self._protocol = protocol
        self._insecure = insecure
        self._trust_pem = trust_pem
        self._on_change = on_change
        self.connected: set[str] = set()
        """Replicas (by name) whose reverse tunnel is up: only they see the models ACTIVE."""

    async def run_for(self, replica: str, endpoint: EndpointWatch) -> None:
        """Keep `replica`'s tunnel up at the endpoint its latest ack names; a changed endpoint
        tears the tunnel down and redials at once."""
        from stargate.tunnel.quic import ConnectFailed

        backoff = Backoff(REVERSE_BACKOFF_INITIAL_SECONDS, REVERSE_BACKOFF_CAP_SECONDS)
        last: ReverseEndpoint | None = None
        while True:
            current = await endpoint.wait()
            if current != last:
                backoff.reset()
                last = current
            started = trio.current_time()
            try:
                async with trio.open_nursery() as watch:

                    async def redial_on_change(endpoint_now: ReverseEndpoint = current) -> None:
                        await endpoint.wait_changed(endpoint_now)
                        log.info("reverse tunnel endpoint of %s changed: redialing", replica)
                        watch.cancel_scope.cancel()

                    watch.start_soon(redial_on_change)
                    await self._connect_and_serve(replica, current, ConnectFailed)
                    watch.cancel_scope.cancel()
            except Exception:  # a defect: this tunnel redials, the Pylon lives on
                log.exception("reverse tunnel to %s failed", replica)
            finally:
                if replica in self.connected:
                    self.connected.discard(replica)
                    self._on_change()
            if trio.current_time() - started >= REVERSE_STABLE_SECONDS:
                backoff.reset()
            with trio.move_on_after(backoff.next()):  # a new endpoint is dialed at once
                await endpoint.wait_changed(current)

    async def _connect_and_serve(
        self, replica: str, endpoint: ReverseEndpoint, connect_failed: type[Exception]
    ) -> None:
        """One tunnel: dial, handshake, serve until it closes. A failed dial or a refused
        handshake is logged here (the caller backs off either way)."""
        async with trio.open_nursery() as nursery:
            try:
                connection = await dial_reverse(
                    nursery,
                    endpoint,
                    self._server_id,
                    self._token(),
                    protocol=self._protocol,
                    insecure=self._insecure,
                    trust_pem=self._trust_pem,
                )
            except (
                connect_failed,
                HandshakeRejected,
                TunnelProtocolError,
                trio.TooSlowError,
            ) as error:
                log.warning(
                    "reverse tunnel to %s failed (%s): %s", replica, endpoint.dial_addr, error
                )
                nursery.cancel_scope.cancel()
                return
            log.info("reverse tunnel to %s connected (%s)", replica, endpoint.dial_addr)
            self.connected.add(replica)
            self._on_change()
            hop = self._hop()
            assert hop is not None
            self._connections.add(connection)
            try:
                await serve_connection(connection, hop, self._protocol)
            finally:
                self._connections.discard(connection)
            log.warning("reverse tunnel to %s closed", replica)
            nursery.cancel_scope.cancel()
