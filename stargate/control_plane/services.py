"""The two gRPC services of a replica, each on its own port (docs/control-plane.md, Ports).

* `stargate.StargateControlPlane` (`--listen-addr`): `RegisterInferenceServer` and
  `WatchStargates`, facing Pylons.
* `stargate.StargateModelDiscovery` (`--model-discovery-listen-addr`): `ListModels`, facing API
  gateways.

Each port's `GrpcApp` knows only its own methods, so calling the other service's method answers
UNIMPLEMENTED. Both ports also serve `grpc.health.v1.Health` (`grpc_health.py`) and server
reflection (`reflection.py`), each scoped to the port's own services (docs/grpc-health.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from grpc_health.v1 import health_pb2

from stargate.control_plane.discovery import WatchPublisher, WatchSnapshot
from stargate.control_plane.grpc_health import HEALTH_SERVICE, HealthService, ServingSignal
from stargate.control_plane.reflection import (
    REFLECTION_SERVICES,
    ReflectionIndex,
    reflection_methods,
)
from stargate.control_plane.registration import RegistrationService
from stargate.grpc_asgi import (
    GrpcApp,
    GrpcError,
    GrpcMethod,
    GrpcStatus,
    RpcContext,
    stream_stream,
    unary_stream,
    unary_unary,
)
from stargate.protocol import stargate_pb2 as pb
from stargate.routing import RoutingState

__all__ = ["control_plane_app", "model_discovery_app", "service_names", "snapshot_to_wire"]

CONTROL_PLANE = "/stargate.StargateControlPlane"
MODEL_DISCOVERY = "/stargate.StargateModelDiscovery"


def snapshot_to_wire(snapshot: WatchSnapshot) -> pb.WatchStargatesResponse:
    return pb.WatchStargatesResponse(
        stargates=[
            pb.StargateInfo(
                stargate_id=info.stargate_id,
                advertise_addr=info.advertise_addr,
                http_advertise_addr=info.http_advertise_addr,
                grpc_pylon_dial_addr=info.grpc_pylon_dial_addr,
            )
            for info in snapshot.stargates
        ],
        watch_stargate_urls=list(snapshot.watch_stargate_urls),
    )


def service_names(methods: Iterable[GrpcMethod]) -> frozenset[str]:
    """The fully qualified service names of `methods` (paths are `/package.Service/Method`)."""
    return frozenset(method.path.split("/")[1] for method in methods)


def _with_health_and_reflection(
    methods: list[GrpcMethod], serving: ServingSignal
) -> list[GrpcMethod]:
    """`methods` plus health checking and reflection for exactly the services the port serves.

    The names come from the method table, so a service added to a port is health-checked and
    listed by reflection without further wiring.
    """
    names = service_names(methods) | {HEALTH_SERVICE, *REFLECTION_SERVICES}
    health = HealthService(serving, names)
    index = ReflectionIndex(names, [pb.DESCRIPTOR, health_pb2.DESCRIPTOR])
    return [*methods, *health.methods(), *reflection_methods(index)]


def control_plane_app(
    registrations: RegistrationService,
    publisher: WatchPublisher,
    *,
    serving: ServingSignal,
    max_message_bytes: int,
) -> GrpcApp:
    """The Pylon-facing service, with health checking and reflection.

    `serving` (the replica's `Readiness`) decides the health status: SERVING while the replica
    accepts work, warming included, since warming replicas must take registrations.
    """

    async def watch_stargates(
        request: pb.WatchStargatesRequest,
        context: RpcContext,
        send: Callable[[pb.WatchStargatesResponse], Awaitable[None]],
    ) -> None:
        """Send the current snapshot (if any), then every publication, until shutdown (OK)."""
        async for snapshot in publisher.subscribe():
            await send(snapshot_to_wire(snapshot))

    methods = [
        stream_stream(
            f"{CONTROL_PLANE}/RegisterInferenceServer",
            pb.InferenceServerRegistration,
            registrations.register,
        ),
        unary_stream(f"{CONTROL_PLANE}/WatchStargates", pb.WatchStargatesRequest, watch_stargates),
    ]
    return GrpcApp(
        _with_health_and_reflection(methods, serving), max_message_bytes=max_message_bytes
    )


def model_discovery_app(
    routing: RoutingState, *, serving: ServingSignal, max_message_bytes: int
) -> GrpcApp:
    """The gateway-facing service, with health checking and reflection.

    `serving` decides the health status: SERVING while the replica accepts work, warming
    included, since `ListModels` answers from the current routing state at any time.
    """

    async def list_models(
        request: pb.ListModelsRequest, context: RpcContext
    ) -> pb.ListModelsResponse:
        """Models with an active backend under the requested routing key.

        docs/control-plane.md, ListModels.
        """
        routing_key = request.routing_key.strip() if request.HasField("routing_key") else ""
        model_ids = [model_id.strip() for model_id in request.model_ids]
        if any(not model_id for model_id in model_ids):
            raise GrpcError(GrpcStatus.INVALID_ARGUMENT, "model_ids must not contain empty values")
        found = routing.list_models(routing_key or None, model_ids or None)
        return pb.ListModelsResponse(model_ids=found)

    methods = [unary_unary(f"{MODEL_DISCOVERY}/ListModels", pb.ListModelsRequest, list_models)]
    return GrpcApp(
        _with_health_and_reflection(methods, serving), max_message_bytes=max_message_bytes
    )
