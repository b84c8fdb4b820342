"""gRPC health checking (`grpc.health.v1.Health`) on the replica's two gRPC ports.

Kubernetes `grpc:` probes, `grpc_health_probe` and load balancers that health-check gRPC backends
call `Check`; gRPC clients with client-side health checking hold a `Watch` stream. Without this
service they get UNIMPLEMENTED and count the replica as unhealthy.

Status rules (the why is in docs/grpc-health.md):

* Every service the port serves (its own `stargate.*` service, `grpc.health.v1.Health` and the
  reflection services) and the whole server (the empty name) share one status: SERVING while the
  replica accepts work, NOT_SERVING once it stops (`ServingSignal.accepting_work`; today: from the
  start of draining on). Warming is SERVING on purpose: Pylon registrations are what end warmup,
  so a probe that pulled warming replicas out of rotation would keep them warming; and model
  discovery answers from the current routing state at any time. The HTTP `/readyz` stays the
  warmup gate for proxied traffic.
* A name the port does not serve: `Check` fails with NOT_FOUND; `Watch` sends SERVICE_UNKNOWN and
  stays open, as the health protocol asks (a service could appear later; here none ever does).
* `Watch` sends the current status at once and then each change, and ends (OK) once the replica
  drains, after sending NOT_SERVING: an open health stream must not hold the drain open.

The decision is `serving_status`, a pure function; `HealthService` adds the I/O.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Set
from typing import Protocol

import trio
from grpc_health.v1 import health_pb2

from stargate.grpc_asgi import (
    GrpcError,
    GrpcMethod,
    GrpcStatus,
    RpcContext,
    unary_stream,
    unary_unary,
)

__all__ = [
    "HEALTH_SERVICE",
    "NOT_SERVING",
    "SERVICE_UNKNOWN",
    "SERVING",
    "HealthService",
    "ServingSignal",
    "serving_status",
]

HEALTH_SERVICE: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
"""`grpc.health.v1.Health`."""

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class ServingSignal(Protocol):
    """What the health service reads from the replica (`stargate.readiness.Readiness` is one).

    Kept to one predicate, one flag and one notification so that new readiness phases change
    what `accepting_work` says, not this service.
    """

    @property
    def accepting_work(self) -> bool:
        """True while the replica takes new work: the ports' services are SERVING."""
        ...

    @property
    def draining(self) -> bool:
        """True once the replica drains: open `Watch` streams end."""
        ...

    def next_change(self) -> trio.Event:
        """An event set at the next change of either; take it before reading them."""
        ...


def serving_status(service: str, services: Set[str], *, accepting_work: bool) -> int:
    """The status of `service` on a port that serves `services` ("" names the whole server).

    One status for all of a port's services: each of them needs nothing but the process and the
    routing state, which are there exactly while the replica accepts work.
    """
    if service and service not in services:
        return SERVICE_UNKNOWN
    return SERVING if accepting_work else NOT_SERVING


class HealthService:
    """`grpc.health.v1.Health` for one port: `Check` and `Watch` over the port's service names.

    `services` are the fully qualified names the port serves; `grpc.health.v1.Health` is added.
    """

    def __init__(self, signal: ServingSignal, services: Iterable[str]) -> None:
        self._signal = signal
        self.services: frozenset[str] = frozenset(services) | {HEALTH_SERVICE}

    def status(self, service: str) -> int:
        """The status `Check` and `Watch` report for `service` right now."""
        return serving_status(service, self.services, accepting_work=self._signal.accepting_work)

    def methods(self) -> list[GrpcMethod]:
        """The two methods to add to the port's `GrpcApp`."""
        return [
            unary_unary(f"/{HEALTH_SERVICE}/Check", health_pb2.HealthCheckRequest, self.check),
            unary_stream(f"/{HEALTH_SERVICE}/Watch", health_pb2.HealthCheckRequest, self.watch),
        ]

    async def check(
        self, request: health_pb2.HealthCheckRequest, context: RpcContext
    ) -> health_pb2.HealthCheckResponse:
        """The current status; NOT_FOUND for a service the port does not serve."""
        status = self.status(request.service)
        if status == SERVICE_UNKNOWN:
            raise GrpcError(GrpcStatus.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def watch(
        self,
        request: health_pb2.HealthCheckRequest,
        context: RpcContext,
        send: Callable[[health_pb2.HealthCheckResponse], Awaitable[None]],
    ) -> None:
        """The current status at once, then each change; return (OK) once the replica drains.

        Only changes are sent, so a client that stops reading gets at most a message or two.
        """
        last: int | None = None
        while True:
            # One consistent reading, taken with the event that announces the next change: `send`
            # yields, and a drain that begins meanwhile must still get its NOT_SERVING sent (the
            # event is then set, so the loop reads again) rather than end the stream unreported.
            changed = self._signal.next_change()
            status = self.status(request.service)
            draining = self._signal.draining
            if status != last:
                await send(health_pb2.HealthCheckResponse(status=status))
                last = status
            if draining:
                return
            await changed.wait()
