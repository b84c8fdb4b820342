"""The `RegisterInferenceServer` stream: one task per Pylon stream, from auth to cleanup.

Lifecycle (docs/control-plane.md, "Registration lifecycle"; HTTP backends: docs/decisions.md,
D3):

1. authenticate the bearer token before reading anything (UNAUTHENTICATED on failure);
2. negotiate the idle timeout from `x-stargate-registration-heartbeat-ms` (Idle timeout);
3. wait for the first message: end, idle timeout or shutdown first ends the stream with OK;
4. admit it (Admission) and reserve the id in the routing state (ALREADY_EXISTS for a live
   duplicate);
5. for this and every later message, strictly in order: check the identity, get the backend's
   RTT from its health monitor, apply the update to the routing state (its KV-block delta
   first, when it carries one: docs/prefix-routing.md, "Precise mode"), send one ack;
6. however the stream ends (client end, idle timeout, error status, disconnect, shutdown), remove
   every route of this exact registration.

Between messages, a change of the health monitor's verdict re-applies the latest message under
the new verdict (no ack: the Pylon sent nothing). A backend is routable only while its Pylon says
ACTIVE *and* the replica's own probe passes, so a failed probe unroutes it at once (its models stay
advertised: 503, not 404) and a passing one restores the latest update's routes with a fresh RTT.
Without this a frozen or partitioned Pylon, which sends no next update, would keep a dead engine
routable until the idle timeout (docs/stale-routes.md). Both paths are synchronous from reading the
verdict to applying, so whichever runs last decides from the latest message and verdict.

Removing routes tells the proxy to move requests still waiting for that backend's response head,
except when the removal says nothing about the backend: the replica's own shutdown (requests in
flight drain where they are) and a held registration replaced by the same backend's new stream.

Once the replica begins to shut down (docs/rolling-restarts.md) it still serves requests: while it
leaves, everything; while it drains, the requests in flight and those on connections the
listeners accepted just before they closed. So the routes of a stream that ends from then on,
whether its Pylon closed it (the leaving replica no longer announces itself) or the drain ended
it, are *held* until the drain is over (`release_routes`): the requests still arriving must not
turn into 404s. A new registration of the same id replaces a held one at once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from stargate.control_plane.admission import (
    HEARTBEAT_HEADER,
    admit,
    bearer_token,
    check_identity,
    negotiate_idle_timeout,
    routes_for_update,
)
from stargate.control_plane.auth import AuthenticationFailed, Authenticator
from stargate.control_plane.health import HealthMonitor, HealthProbe
from stargate.control_plane.probe_clock import ProbeClock
from stargate.grpc_asgi import GrpcError, GrpcStatus, RequestStream, RpcContext
from stargate.protocol import stargate_pb2 as pb
from stargate.routing import AlreadyRegistered, Registration, RoutingState
from stargate.tunnel.kinds import is_tunnel

if TYPE_CHECKING:
    from stargate.tunnel.backends import TunnelBackends

__all__ = ["RegistrationConfig", "RegistrationService"]

log = logging.getLogger(__name__)

Registrations = RequestStream[pb.InferenceServerRegistration]
SendAck = Callable[[pb.InferenceServerAck], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class RegistrationConfig:
    """The idle-timeout flags (0 in either disables idle enforcement) and the probe interval."""

    idle_timeout_ms: int = 60_000
    max_idle_timeout_ms: int = 300_000
    health_interval_seconds: float = 1.0


class RegistrationService:
    """Serves every registration stream of one replica against its routing state."""

    def __init__(
        self,
        routing: RoutingState,
        authenticator: Authenticator,
        probe: HealthProbe,
        config: RegistrationConfig = RegistrationConfig(),
        tunnels: TunnelBackends | None = None,
    ) -> None:
        self._routing = routing
        self._authenticator = authenticator
        self._probe = probe
        self._config = config
        self._tunnels = tunnels
        self._streams: set[trio.CancelScope] = set()
        self._shutting_down = False
        self._leaving = False
        self._released = False
        self._held: dict[str, Registration] = {}
        self._probe_clock = ProbeClock(config.health_interval_seconds)

    @property
    def authenticator(self) -> Authenticator:
        return self._authenticator

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def held_registrations(self) -> int:
        """Registrations whose stream ended once the replica began to shut down, their routes kept
        until `release_routes()`."""
        return len(self._held)

    def leave(self) -> None:
        """Keep serving every stream, but hold the routes of streams that end from now on."""
        self._leaving = True

    def shutdown(self) -> None:
        """End every stream at its next wait point (OK status) and refuse new ones. Their routes,
        like those held since `leave()`, stay until `release_routes()`: the listeners have
        closed, but a request on a connection accepted just before is still to be routed (it
        got a 404 `no_eligible_candidates` when the routes went with the streams)."""
        self._shutting_down = True
        for scope in self._streams:
            scope.cancel()

    def release_routes(self) -> None:
        """Once nothing is in flight (the drain is over): remove every held route."""
        self._released = True
        for registration in self._held.values():
            self._routing.end(registration, notify=False)  # nothing routes on them any more
        self._held.clear()

    async def register(self, requests: Registrations, context: RpcContext, send: SendAck) -> None:
        """The stream-stream handler of `/stargate.StargateControlPlane/RegisterInferenceServer`."""
        token = bearer_token(context.metadata.get("authorization"))
        try:
            routing_key = await self._authenticator.authenticate(token)
        except AuthenticationFailed:
            raise GrpcError(GrpcStatus.UNAUTHENTICATED, "authentication failed") from None
        idle_timeout = negotiate_idle_timeout(
            context.metadata.get(HEARTBEAT_HEADER),
            self._config.idle_timeout_ms,
            self._config.max_idle_timeout_ms,
        )
        with trio.CancelScope() as scope:
            self._streams.add(scope)
            if self._shutting_down:
                scope.cancel()
            try:
                first = await self._next_message(requests, idle_timeout)
                if first is None:
                    return
                tunnels = self._tunnels
                identity = admit(first, routing_key, tunnels is not None and tunnels.config.reverse)
                if tunnels is None and is_tunnel(identity):  # a service built without tunnels
                    raise GrpcError(
                        GrpcStatus.INVALID_ARGUMENT,
                        "invalid inference_server_url: inference_server_url scheme must be "
                        "http or https (this service reaches no tunnel backends)",
                    )
                if tunnels is not None and (refusal := tunnels.admit(identity)) is not None:
                    raise GrpcError(GrpcStatus.INVALID_ARGUMENT, refusal)
                held = self._held.pop(identity.inference_server_id, None)
                if held is not None:
                    # The same backend is back: its new stream wins, and requests in flight on
                    # the held routes go on (nothing is wrong with the backend).
                    self._routing.end(held, notify=False)
                try:
                    registration = self._routing.begin(identity)
                except AlreadyRegistered as error:
                    raise GrpcError(GrpcStatus.ALREADY_EXISTS, str(error)) from None
                log.info(
                    "registration admitted: inference_server_id=%s cluster_id=%s url=%s "
                    "routing_key=%s idle_timeout=%s",
                    identity.inference_server_id,
                    identity.cluster_id,
                    identity.url,
                    "" if routing_key is None else routing_key,
                    "none" if idle_timeout is None else f"{idle_timeout:g}s",
                )
                try:
                    await self._serve_admitted(registration, first, requests, idle_timeout, send)
                finally:
                    self._end(registration)
            finally:
                self._streams.discard(scope)

    def _end(self, registration: Registration) -> None:
        server_id = registration.identity.inference_server_id
        holding = (self._leaving or self._shutting_down) and not self._released
        if holding and self._routing.is_live(registration):
            self._held[server_id] = registration
            log.info(
                "registration ended while the replica shuts down; routes kept until nothing is "
                "in flight: inference_server_id=%s",
                server_id,
            )
            return
        # The replica's own shutdown says nothing about the backend: let its requests drain.
        self._routing.end(registration, notify=not self._shutting_down)
        log.info("registration ended: inference_server_id=%s", server_id)

    async def _serve_admitted(
        self,
        registration: Registration,
        first: pb.InferenceServerRegistration,
        requests: Registrations,
        idle_timeout: float | None,
        send: SendAck,
    ) -> None:
        server_id = registration.identity.inference_server_id
        # The latest applied message and when it arrived: what a verdict change re-applies.
        latest: tuple[pb.InferenceServerRegistration, float] | None = None
        tunnels = self._tunnels
        tunneled = tunnels is not None and is_tunnel(registration.identity)

        def on_verdict(routable: bool) -> None:
            if latest is None:
                return  # nothing applied yet: the first update reads the verdict itself
            message, received_at = latest
            self._routing.apply(
                registration,
                routes_for_update(message, monitor.rtt_ns, received_at)
                if routable
                else dict.fromkeys(message.models, None),  # unroutable, still advertised
            )

        probe = self._probe
        if tunneled:
            assert tunnels is not None
            tunnels.begin(registration)

            async def probe_tunnel(url: str) -> int:
                del url  # the tunnel knows its backend
                return await tunnels.probe(registration)

            probe = probe_tunnel
        monitor = HealthMonitor(
            registration.identity.url,
            probe,
            self._config.health_interval_seconds,
            # Every passing probe lifts a connect-failure demotion (docs/data-plane.md, Retries).
            on_healthy=lambda: self._routing.restore(server_id),
            on_verdict=on_verdict,
            clock=self._probe_clock,
        )
        ack = pb.InferenceServerAck()
        if tunnels is not None:
            target, dial = tunnels.ack_fields()
            ack = pb.InferenceServerAck(
                reverse_tunnel_target=target, reverse_tunnel_pylon_dial_addr=dial
            )
        failure: GrpcError | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(monitor.run)
                try:
                    message: pb.InferenceServerRegistration | None = first
                    while message is not None:
                        check_identity(message, registration.identity)
                        connected = True
                        if tunneled:
                            assert tunnels is not None
                            connected = await tunnels.gate(registration)
                        rtt_ns = await monitor.rtt_for_update() if connected else None
                        received_at = trio.current_time()
                        routes = routes_for_update(message, rtt_ns, received_at)
                        if (
                            message.kv_blocks_reset
                            or message.kv_blocks_added
                            or message.kv_blocks_removed
                        ):
                            # A delta applies once, in order; a verdict change never re-applies
                            # it (on_verdict re-applies only the routes).
                            self._routing.apply_kv_blocks(
                                registration,
                                reset=message.kv_blocks_reset,
                                added=message.kv_blocks_added,
                                removed=message.kv_blocks_removed,
                            )
                        self._routing.apply(registration, routes)
                        latest = (message, received_at)
                        # A direct tunnel that cannot be dialed is not acked (the Rust rule):
                        # the next update dials again.
                        if connected or registration.identity.reverse_tunnel:
                            await send(ack)
                        message = await self._next_message(requests, idle_timeout)
                except GrpcError as error:
                    failure = error  # raised below, outside the nursery, unwrapped
                nursery.cancel_scope.cancel()
        finally:
            if tunneled:
                assert tunnels is not None
                tunnels.end(registration)
        if failure is not None:
            raise failure

    async def _next_message(
        self, requests: Registrations, idle_timeout: float | None
    ) -> pb.InferenceServerRegistration | None:
        """The next message; None when the client ended the stream or the idle timeout fired."""
        with trio.move_on_after(math.inf if idle_timeout is None else idle_timeout):
            return await requests.receive()
        log.warning("registration stream idle timeout; closing registration")
        return None
