"""The replica's tunnels to its backends: dialing, the reverse listener, requests, health.

docs/tunnels.md. One `TunnelBackends` per replica; the registration streams and the proxy reach a
tunnel backend through it alone:

* `admit(identity)` says whether a `quic://` or reverse registration can be served at all;
* `gate(registration)`, once per registration update, answers "connected?" by the Rust rules of
  `gating.py` (direct: a healthy set, or dial `--direct-quic-connections` connections, each
  bounded by `--quic-connect-timeout-ms`; reverse: the first update only advertises the listener,
  later ones wait up to `--reverse-tunnel-connect-timeout-ms` for the Pylon's connection);
* `probe(registration)` is the 1 s health probe, `GET /health` through the tunnel;
* `request(...)` is one proxied attempt on a fresh stream, bounded by `--quic-request-timeout-ms`
  from opening the stream to the response head; a direct backend with no healthy connection is
  re-dialed first (hot-path reconnect), and a transport failure evicts the connection it used;
* `end(registration)` closes a direct set and retires a reverse slot.

Every connection task runs in the nursery of `run`, which the runtime keeps for the replica's
life. A registration's tunnel state lives in its `_Tunnel`, keyed by the `Registration` object (a
generation: a new stream of the same id never borrows the old one's connections).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import trio
from prometheus_client import CollectorRegistry

from stargate.config import ServeConfig, TunnelConfig, TunnelProtocol
from stargate.http_headers import Headers
from stargate.metrics import TlsMetrics, TunnelCounters
from stargate.routing import Registration, RegistrationIdentity
from stargate.serving import StartupError
from stargate.tunnel.codec import decode_handshake, encode_handshake_ack
from stargate.tunnel.gating import DirectGate, ReverseSlot, ReverseState
from stargate.tunnel.handshake import read_one_message
from stargate.tunnel.kinds import is_direct
from stargate.upstream import BackendResponse, ConnectError, UpstreamError

if TYPE_CHECKING:  # aioquic loads on first use: a replica without tunnels never imports it
    from stargate.tunnel.identity import QuicIdentity
    from stargate.tunnel.links import TunnelLink
    from stargate.tunnel.quic import QuicConnection

__all__ = [
    "Authenticate",
    "TunnelBackends",
    "TunnelMetrics",
    "replica_tunnels",
]

log = logging.getLogger("stargate.tunnel")

HEALTH_MODEL = "stargate-health"
QUIC_MATERIAL = "quic_server_identity"
"""The `material_type` of the QUIC pair's `tls_reloads_total` and `tls_certificate_expiry_seconds`
(the HTTP and gRPC listeners' pair is `server_identity`)."""


Authenticate = Callable[[str | None], Awaitable[str | None]]
"""The replica's worker authenticator: a token to its routing key; raises on failure."""


class TunnelMetrics:
    """The Rust tunnel counters, as callbacks (the runtime binds them to Prometheus)."""

    def __init__(
        self,
        evicted: Callable[[str, str], None] = lambda server_id, reason: None,
        reconnected: Callable[[str, str], None] = lambda server_id, result: None,
        identity_reloaded: Callable[[str], None] = lambda result: None,
        identity_served: Callable[[float], None] = lambda not_after: None,
    ) -> None:
        self.evicted = evicted
        self.reconnected = reconnected
        self.identity_reloaded = identity_reloaded
        self.identity_served = identity_served


@dataclass(eq=False)
class _Tunnel:
    """One registration's tunnel state."""

    registration: Registration
    links: list[TunnelLink] = field(default_factory=list)
    cursor: int = 0
    direct: DirectGate = field(default_factory=DirectGate)
    reverse: ReverseSlot = field(default_factory=ReverseSlot)
    advertised: bool = False
    dialing: trio.Lock = field(default_factory=trio.Lock)
    changed: trio.Event = field(default_factory=trio.Event)

    def healthy_link(self) -> TunnelLink | None:
        """Round robin over the healthy links (the Rust shared cursor)."""
        links = self.links
        for offset in range(len(links)):
            link = links[(self.cursor + offset) % len(links)]
            if link.healthy:
                self.cursor = (self.cursor + offset + 1) % len(links)
                return link
        return None

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class TunnelBackends:
    """See the module docstring. Create, then run `run` in a nursery that outlives every
    registration stream (`nursery.start(backends.run)`)."""

    def __init__(
        self,
        config: TunnelConfig,
        authenticate: Authenticate,
        *,
        advertised_host: Callable[[], str] = lambda: "127.0.0.1",
        metrics: TunnelMetrics | None = None,
    ) -> None:
        self.config = config
        self._authenticate = authenticate
        self._advertised_host = advertised_host
        self._metrics = metrics or TunnelMetrics()
        self._tunnels: dict[Registration, _Tunnel] = {}
        self._by_id: dict[str, _Tunnel] = {}
        self._nursery: trio.Nursery | None = None
        self._quic_identity: QuicIdentity | None = None
        self.reverse_port: int | None = None

    def load_identity(self) -> QuicIdentity:
        """Read and check the mounted QUIC pair now (start-up): OSError or ValueError when it
        cannot be served."""
        return self._identity

    @property
    def _identity(self) -> QuicIdentity:
        if self._quic_identity is None:
            from stargate.tunnel.identity import QuicIdentity

            self._quic_identity = QuicIdentity(
                self.config.cert_path,
                self.config.key_path,
                self._metrics.identity_reloaded,
                self._metrics.identity_served,
            )
        return self._quic_identity

    # ------------------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own every connection task and, in reverse mode, the UDP listener; started once the
        listener is bound (so `reverse_port` is known). Cancelled with the replica."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.config.reverse:
                from stargate.tunnel.quic import QuicServer

                listen = self.config.reverse_listen_addr
                assert listen is not None
                server = await nursery.start(
                    QuicServer.serve,
                    listen.host,
                    listen.port,
                    lambda: self._identity.server_configuration(self.config.protocol.alpn),
                    self._accept_reverse,
                )
                self.reverse_port = server.port
                log.info("reverse tunnel listener on UDP port %d", server.port)
                if self.config.key_path is not None:
                    nursery.start_soon(self._identity.reload_every, self.config.reload_interval_ms)
            task_status.started()
            await trio.sleep_forever()

    # ------------------------------------------------------------------------------ admission

    def admit(self, identity: RegistrationIdentity) -> str | None:
        """Why this tunnel registration cannot be served (an INVALID_ARGUMENT message), or None."""
        if identity.reverse_tunnel and not self.config.reverse:
            return "reverse tunnel flag set but no reverse tunnel config"
        if is_direct(identity) and not self.config.can_dial:
            return (
                "quic backends need --quic-insecure or --quic-tls-cert-path (the certificates "
                "their Pylons present) on this replica"
            )
        return None

    def ack_fields(self) -> tuple[str, str]:
        """(`reverse_tunnel_target`, `reverse_tunnel_pylon_dial_addr`) of every ack: empty
        without a reverse listener."""
        if not self.config.reverse or self.reverse_port is None:
            return "", ""
        host = self._advertised_host()
        target = f"[{host}]:{self.reverse_port}" if ":" in host else f"{host}:{self.reverse_port}"
        dial = (self.config.reverse_pylon_dial_addr or "").strip() or target
        return target, dial

    def begin(self, registration: Registration) -> None:
        tunnel = _Tunnel(registration)
        self._tunnels[registration] = tunnel
        self._by_id[registration.identity.inference_server_id] = tunnel

    def end(self, registration: Registration) -> None:
        """The registration ended: retire its reverse slot, and close its connections once the
        requests in flight on them are done (a Pylon that closes its registrations on SIGTERM
        still finishes its streams; the Rust rule that a retired registration does not cut a
        streaming body)."""
        tunnel = self._tunnels.pop(registration, None)
        if tunnel is None:
            return
        if self._by_id.get(registration.identity.inference_server_id) is tunnel:
            del self._by_id[registration.identity.inference_server_id]
        tunnel.reverse.retire()
        for link in tunnel.links:
            self._retire(link)
        tunnel.links = []
        tunnel.wake()

    def _retire(self, link: TunnelLink) -> None:
        """No new request goes to `link`; it closes once its requests in flight are done."""
        if self._nursery is None:
            link.close()
            return
        try:
            self._nursery.start_soon(_close_when_idle, link)
        except RuntimeError:  # the replica is closing its tunnels: everything closes now
            link.close()

    # ---------------------------------------------------------------------------------- gating

    async def gate(self, registration: Registration) -> bool:
        """Whether this update finds the tunnel connected (docs/tunnels.md, "Gating")."""
        tunnel = self._tunnels[registration]
        if registration.identity.reverse_tunnel:
            return await self._gate_reverse(tunnel)
        if tunnel.healthy_link() is not None:
            tunnel.direct.dialed()
            if not all(link.healthy for link in tunnel.links):
                await self._dial(tunnel, quiet=True)  # replenish; failure only logs
            return True
        if await self._dial(tunnel, quiet=False):
            return True
        return tunnel.direct.dial_failed(trio.current_time())

    async def _gate_reverse(self, tunnel: _Tunnel) -> bool:
        if not tunnel.advertised:
            tunnel.advertised = True  # the first ack tells the Pylon where to dial
            return tunnel.healthy_link() is not None
        with trio.move_on_after(self.config.reverse_connect_timeout):
            while tunnel.healthy_link() is None:
                await tunnel.changed.wait()
            return True
        log.error(
            "reverse tunnel connection not received within timeout: inference_server_id=%s",
            tunnel.registration.identity.inference_server_id,
        )
        return False

    async def _dial(self, tunnel: _Tunnel, *, quiet: bool) -> bool:
        """Dial a whole direct set (sequentially, each bounded); replace the old set on success."""
        async with tunnel.dialing:
            identity = tunnel.registration.identity
            if tunnel.links and all(link.healthy for link in tunnel.links):
                return True  # another task dialed while this one waited
            parts = urlsplit(identity.url)
            host, port = parts.hostname or "", parts.port or 0
            from stargate.tunnel.quic import ConnectFailed

            links: list[TunnelLink] = []
            try:
                for _ in range(self.config.direct_connections):
                    links.append(await self._connect(host, port))
            except ConnectFailed as error:
                for link in links:
                    link.close()
                if not quiet:
                    log.warning(
                        "direct tunnel dial failed: inference_server_id=%s: %s",
                        identity.inference_server_id,
                        error,
                    )
                else:
                    log.info("direct tunnel replenish failed: %s", error)
                return False
            if tunnel.registration not in self._tunnels:  # ended meanwhile
                for link in links:
                    link.close()
                return False
            old, tunnel.links = tunnel.links, links
            for link in old:  # requests in flight keep their own connection until done
                self._retire(link)
            tunnel.direct.dialed()
            tunnel.wake()
            return True

    async def _connect(self, host: str, port: int) -> TunnelLink:
        from stargate.tunnel.quic import connect
        from stargate.tunnel.quic.tls import client_configuration

        assert self._nursery is not None, "run() first"
        configuration = client_configuration(
            insecure=self.config.insecure,
            trust_pem=self._identity.trust_pem(),
            server_name="stargate",
            alpn=self.config.protocol.alpn,
        )
        connection = await connect(
            self._nursery, host, port, configuration, timeout=self.config.connect_timeout
        )
        return await self._link(connection, client_role=True)

    async def _link(self, connection: QuicConnection, *, client_role: bool) -> TunnelLink:
        if self.config.protocol is TunnelProtocol.HTTP3:
            from stargate.tunnel.http3 import Http3Link

            return Http3Link.replica_side(connection)
        from stargate.tunnel.links import RawQuicLink

        del client_role
        return RawQuicLink(connection)

    # -------------------------------------------------------------------------------- requests

    async def request(
        self,
        registration: Registration,
        method: str,
        path_and_query: bytes,
        headers: Headers,
        body: bytes | bytearray,
    ) -> BackendResponse:
        """One attempt through `registration`'s tunnel (docs/tunnels.md, "Requests")."""
        tunnel = self._tunnels.get(registration)
        server_id = registration.identity.inference_server_id
        if tunnel is None:
            raise ConnectError(f"no tunnel to {server_id}: the registration ended")
        deadline = trio.current_time() + self.config.request_timeout
        link = tunnel.healthy_link()
        if link is None:
            if registration.identity.reverse_tunnel:
                raise ConnectError(f"no reverse tunnel connection from {server_id}")
            self._metrics.evicted(server_id, "stale_connection")
            dialed = await self._dial(tunnel, quiet=False)
            self._metrics.reconnected(server_id, "success" if dialed else "error")
            link = tunnel.healthy_link() if dialed else None
            if link is None:
                raise ConnectError(f"cannot reach {server_id} through its tunnel")
        try:
            return await link.request(method, path_and_query, headers, body, deadline)
        except UpstreamError:
            if not registration.identity.reverse_tunnel and not link.healthy:
                self._metrics.evicted(server_id, "proxy_error")
            raise

    async def probe(self, registration: Registration) -> int:
        """The health probe through the tunnel: its round-trip time in ns. Raises ProbeFailed
        without a healthy connection, on a non-2xx answer or a transport failure."""
        from stargate.health_probe import ProbeFailed

        tunnel = self._tunnels.get(registration)
        if tunnel is None or tunnel.healthy_link() is None:
            raise ProbeFailed("no healthy tunnel connection")
        server_id = registration.identity.inference_server_id
        headers: Headers = [
            (b"x-request-id", f"stargate-health-{server_id}".encode()),
            (b"x-model", HEALTH_MODEL.encode()),
            (b"x-input-tokens", b"0"),
        ]
        start = time.perf_counter_ns()
        try:
            response = await self.request(registration, "GET", b"/health", headers, b"")
            async with response:
                await response.read()
        except UpstreamError as error:
            raise ProbeFailed(f"health probe through the tunnel failed: {error}") from None
        if not 200 <= response.status < 300:
            raise ProbeFailed(f"health probe through the tunnel answered {response.status}")
        return time.perf_counter_ns() - start

    # ------------------------------------------------------------------- the reverse listener

    async def _accept_reverse(self, connection: QuicConnection) -> None:
        """A Pylon dialed the reverse listener: handshake on its first stream, then install the
        connection on its registration until it closes (docs/tunnels.md, "Reverse handshake")."""
        accepted = await self._handshake(connection)
        if accepted is None:
            return
        tunnel, link = accepted
        if not self._install(tunnel, link):
            return
        await connection.wait_closed()
        self._lost(tunnel, link)

    async def _handshake(self, connection: QuicConnection) -> tuple[_Tunnel, TunnelLink] | None:
        """Read the Pylon's `Handshake` and answer it: the slot now installing and the link on
        success; None after a refusal (acked with its reason) or a failure (the connection is
        closed either way)."""
        timeout = self.config.connect_timeout
        tunnel: _Tunnel | None = None
        try:
            with trio.fail_after(max(timeout, 1.0)):  # Rust waits forever: a Pylon may not
                stream = await connection.accept_stream()
                server_id, token = decode_handshake(await read_one_message(stream))
            tunnel, reason = await self._check_handshake(server_id, token)
            if reason is not None:
                log.warning(
                    "reverse tunnel handshake rejected: inference_server_id=%s reason=%s",
                    server_id,
                    reason,
                )
                await stream.send(encode_handshake_ack(False, reason), end=True)
                with trio.move_on_after(timeout):  # the Pylon reads it, then goes
                    await connection.wait_closed()
                connection.close(0, "handshake rejected")
                return None
            assert tunnel is not None
            # http3: the replica's H3 layer exists (its control streams sent) before the ack.
            link = await self._link(connection, client_role=False)
            await stream.send(encode_handshake_ack(True, ""), end=True)
        except Exception as error:  # timeouts, resets, a malformed handshake: this one only
            if tunnel is not None:
                tunnel.reverse.install_failed()
            log.warning("reverse tunnel handshake failed: %s", error)
            connection.close(0, "handshake failed")
            return None
        return tunnel, link

    def _install(self, tunnel: _Tunnel, link: TunnelLink) -> bool:
        """Put an accepted reverse link on its registration; False if that registration ended
        during the handshake (the link is closed)."""
        if tunnel.reverse.state is ReverseState.RETIRED:
            link.close()
            return False
        tunnel.reverse.installed()
        tunnel.links = [link]
        tunnel.wake()
        log.info(
            "reverse tunnel connected: inference_server_id=%s",
            tunnel.registration.identity.inference_server_id,
        )
        return True

    def _lost(self, tunnel: _Tunnel, link: TunnelLink) -> None:
        """An installed reverse link closed: its registration waits for a new handshake."""
        if tunnel.links and tunnel.links[0] is link:
            tunnel.links = []
            tunnel.reverse.lost()
            tunnel.wake()
            log.warning(
                "reverse tunnel connection closed, removed from pool: inference_server_id=%s",
                tunnel.registration.identity.inference_server_id,
            )

    async def _check_handshake(
        self, server_id: str, token: str | None
    ) -> tuple[_Tunnel | None, str | None]:
        """The Rust checks, in order; (the slot now installing, None) or (None, NACK reason)."""
        if not server_id:
            return None, "empty inference_server_id"
        try:
            routing_key = await self._authenticate(token)
        except Exception:
            return None, "authentication failed"
        tunnel = self._by_id.get(server_id)
        if tunnel is None or not tunnel.registration.identity.reverse_tunnel:
            return None, "unauthorized inference_server_id"
        if tunnel.registration.identity.routing_key != routing_key:
            return None, "routing key mismatch"
        current = tunnel.links[0] if tunnel.links else None
        if not tunnel.reverse.begin_install(current is not None and current.healthy):
            return None, "duplicate connection"
        return tunnel, None


def replica_tunnels(
    config: ServeConfig,
    authenticate: Authenticate,
    advertised_host: Callable[[], str],
    registry: CollectorRegistry,
    tls: TlsMetrics | None,
) -> TunnelBackends:
    """A replica's tunnels, their counters on `registry` (the Rust names, docs/tunnels.md,
    "Metrics"); a mounted QUIC pair is read now, so one that cannot be served fails start-up
    (StartupError naming the flags)."""
    counters = TunnelCounters.create(registry, config.metrics_prefix)

    def reloaded(result: str) -> None:
        if tls is not None:  # created whenever a QUIC pair is mounted
            tls.reloads.labels(material_type=QUIC_MATERIAL, result=result).inc()

    def served(not_after: float) -> None:
        if tls is not None:
            tls.certificate_expiry.labels(material_type=QUIC_MATERIAL).set(not_after)

    tunnels = TunnelBackends(
        config.tunnels,
        authenticate,
        advertised_host=advertised_host,
        metrics=TunnelMetrics(
            evicted=lambda server_id, reason: counters.evictions.labels(server_id, reason).inc(),
            reconnected=lambda server_id, result: counters.hot_path_reconnects.labels(
                server_id, result
            ).inc(),
            identity_reloaded=reloaded,
            identity_served=served,
        ),
    )
    if config.tunnels.key_path is not None:
        try:
            tunnels.load_identity()
        except (OSError, ValueError) as error:
            raise StartupError(
                f"--quic-tls-cert-path/--quic-tls-key-path cannot be served: {error}"
            ) from None
    return tunnels


RETIRED_LINK_GRACE_SECONDS = 600.0
"""How long a retired connection may stay open for the requests still on it (a stream of many
minutes is cut after this)."""


async def _close_when_idle(link: TunnelLink) -> None:
    with trio.move_on_after(RETIRED_LINK_GRACE_SECONDS):
        while link.healthy and link.open_requests > 0:  # noqa: ASYNC110 - no event for it
            await trio.sleep(0.5)
    link.close()
