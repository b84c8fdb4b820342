"""The two gRPC services of a replica, each on its own port (spec §0, §7 trap 15).

* `stargate.StargateControlPlane` (`--listen-addr`): `RegisterInferenceServer` and
  `WatchStargates`, facing Pylons.
* `stargate.StargateModelDiscovery` (`--model-discovery-listen-addr`): `ListModels`, facing API
  gateways.

Each port's `GrpcApp` knows only its own methods, so calling the other service's method answers
UNIMPLEMENTED.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from stargate.control_plane.discovery import WatchPublisher, WatchSnapshot
from stargate.control_plane.grpc import (
    GrpcApp,
    GrpcError,
    GrpcStatus,
    RpcContext,
    stream_stream,
    unary_stream,
    unary_unary,
)
from stargate.control_plane.registration import RegistrationService
from stargate.protocol import stargate_pb2 as pb
from stargate.routing import RoutingState

__all__ = ["control_plane_app", "model_discovery_app", "snapshot_to_wire"]

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


def control_plane_app(
    registrations: RegistrationService, publisher: WatchPublisher, *, max_message_bytes: int
) -> GrpcApp:
    """The Pylon-facing service."""

    async def watch_stargates(
        request: pb.WatchStargatesRequest,
        context: RpcContext,
        send: Callable[[pb.WatchStargatesResponse], Awaitable[None]],
    ) -> None:
        """Send the current snapshot (if any), then every publication, until shutdown (OK)."""
        async for snapshot in publisher.subscribe():
            await send(snapshot_to_wire(snapshot))

    return GrpcApp(
        [
            stream_stream(
                f"{CONTROL_PLANE}/RegisterInferenceServer",
                pb.InferenceServerRegistration,
                registrations.register,
            ),
            unary_stream(
                f"{CONTROL_PLANE}/WatchStargates", pb.WatchStargatesRequest, watch_stargates
            ),
        ],
        max_message_bytes=max_message_bytes,
    )


def model_discovery_app(routing: RoutingState, *, max_message_bytes: int) -> GrpcApp:
    """The gateway-facing service."""

    async def list_models(
        request: pb.ListModelsRequest, context: RpcContext
    ) -> pb.ListModelsResponse:
        """Models with an active backend under the requested routing key (spec §2.11)."""
        routing_key = request.routing_key.strip() if request.HasField("routing_key") else ""
        model_ids = [model_id.strip() for model_id in request.model_ids]
        if any(not model_id for model_id in model_ids):
            raise GrpcError(GrpcStatus.INVALID_ARGUMENT, "model_ids must not contain empty values")
        found = routing.list_models(routing_key or None, model_ids or None)
        return pb.ListModelsResponse(model_ids=found)

    return GrpcApp(
        [unary_unary(f"{MODEL_DISCOVERY}/ListModels", pb.ListModelsRequest, list_models)],
        max_message_bytes=max_message_bytes,
    )
