"""gRPC health checking and server reflection on the replica's two gRPC ports.

Three layers:

* the status decision and the `Watch` loop, with a fake serving signal or a real `Readiness`,
  and the reflection index, in-process and without I/O;
* both port apps on a real Hypercorn server, called with the real grpcio health client, where a
  fake signal can stop accepting work while the listener stays open (a Check answering
  NOT_SERVING is only reachable that way: a draining replica's listeners refuse new calls);
* real `stargate serve` processes, called with the clients from grpcio-health-checking and
  grpcio-reflection: a warming replica (SERVING, `/readyz` 503) and one that drains on SIGTERM.
"""

from __future__ import annotations

import queue
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import httpx
import pytest
import trio
import trio.testing
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from hypercorn.config import Config as HypercornConfig

from stargate.config import ListenAddress, WarmupConfig
from stargate.control_plane.auth import OpenAuthenticator
from stargate.control_plane.discovery import PublisherConfig, WatchPublisher
from stargate.control_plane.grpc_health import (
    HEALTH_SERVICE,
    NOT_SERVING,
    SERVICE_UNKNOWN,
    SERVING,
    HealthService,
    serving_status,
)
from stargate.control_plane.reflection import (
    REFLECTION_V1,
    REFLECTION_V1ALPHA,
    ReflectionIndex,
    file_proto,
    v1_reflection_file,
)
from stargate.control_plane.registration import RegistrationService
from stargate.control_plane.services import control_plane_app, model_discovery_app
from stargate.grpc_asgi import GrpcError, GrpcStatus, RpcContext
from stargate.protocol import stargate_pb2 as pb
from stargate.readiness import Readiness
from stargate.routing import RoutingState
from stargate.serving import bind_listener, serve_asgi
from tests.e2e.processes import Ports, StargateProcess, launch, stop, wait_until

CONTROL_PLANE = "stargate.StargateControlPlane"
MODEL_DISCOVERY = "stargate.StargateModelDiscovery"
COMMON = {HEALTH_SERVICE, REFLECTION_V1ALPHA, REFLECTION_V1}
CONTEXT = RpcContext("/grpc.health.v1.Health/Check", {}, None, "")

R = TypeVar("R")


# ---- fakes and helpers --------------------------------------------------------------------------


@dataclass
class FakeSignal:
    """A `ServingSignal` the test drives: `accepting_work` and `draining` set independently, so a
    phase that stops taking work before draining (a "leaving" replica) can be played."""

    accepting: bool = True
    drains: bool = False
    _changed: trio.Event = field(default_factory=trio.Event)

    @property
    def accepting_work(self) -> bool:
        return self.accepting

    @property
    def draining(self) -> bool:
        return self.drains

    def next_change(self) -> trio.Event:
        return self._changed

    def change(self, *, accepting: bool | None = None, drains: bool | None = None) -> None:
        if accepting is not None:
            self.accepting = accepting
        if drains is not None:
            self.drains = drains
        changed, self._changed = self._changed, trio.Event()
        changed.set()


def _statuses(service: HealthService, names: list[str]) -> dict[str, int]:
    return {name: service.status(name) for name in names}


@asynccontextmanager
async def _watching(
    health: HealthService, service: str = ""
) -> AsyncIterator[tuple[trio.MemoryReceiveChannel[int], Callable[[], bool]]]:
    """Run `health.watch` in the background; yield its sent statuses and a "has it returned"."""
    sent, received = trio.open_memory_channel[int](16)
    returned = False

    async def send(response: health_pb2.HealthCheckResponse) -> None:
        await sent.send(response.status)

    async def run() -> None:
        nonlocal returned
        await health.watch(health_pb2.HealthCheckRequest(service=service), CONTEXT, send)
        returned = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        yield received, lambda: returned
        nursery.cancel_scope.cancel()


def _pending(channel: trio.MemoryReceiveChannel[int]) -> list[int]:
    items = []
    while True:
        try:
            items.append(channel.receive_nowait())
        except trio.WouldBlock:
            return items


# ---- the status decision ------------------------------------------------------------------------


def test_status_is_serving_while_accepting_work_for_every_served_name() -> None:
    served = frozenset({CONTROL_PLANE, *COMMON})
    for name in ["", CONTROL_PLANE, HEALTH_SERVICE, REFLECTION_V1ALPHA]:
        assert serving_status(name, served, accepting_work=True) == SERVING
        assert serving_status(name, served, accepting_work=False) == NOT_SERVING
    for name in [MODEL_DISCOVERY, "nope", "stargate"]:
        assert serving_status(name, served, accepting_work=True) == SERVICE_UNKNOWN
        assert serving_status(name, served, accepting_work=False) == SERVICE_UNKNOWN


async def test_warming_replica_is_serving_and_draining_is_not_serving() -> None:
    readiness = Readiness(WarmupConfig(warmup_ms=60_000))  # warmup never run: stays warming
    health = HealthService(readiness, [CONTROL_PLANE])
    assert readiness.state().phase == "warming" and not readiness.ready
    assert readiness.accepting_work
    assert _statuses(health, ["", CONTROL_PLANE, HEALTH_SERVICE]) == {
        "": SERVING,
        CONTROL_PLANE: SERVING,
        HEALTH_SERVICE: SERVING,
    }
    readiness.lifecycle.begin_draining()
    assert not readiness.accepting_work
    assert _statuses(health, ["", CONTROL_PLANE]) == {"": NOT_SERVING, CONTROL_PLANE: NOT_SERVING}
    assert health.status(MODEL_DISCOVERY) == SERVICE_UNKNOWN


async def test_ready_replica_is_serving() -> None:
    readiness = Readiness(WarmupConfig(warmup_ms=0))
    assert readiness.ready
    assert HealthService(readiness, [MODEL_DISCOVERY]).status(MODEL_DISCOVERY) == SERVING


async def test_readiness_next_change_fires_on_promotion_and_on_draining(
    autojump_clock: trio.testing.MockClock,
) -> None:
    readiness = Readiness(WarmupConfig(warmup_ms=5_000, sample_interval_ms=1_000))
    first = readiness.next_change()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(readiness.run_warmup, lambda: 0)
        await first.wait()  # the deadline promotes with zero backends (autojump clock)
    assert readiness.warm and readiness.accepting_work
    second = readiness.next_change()
    assert second is not first and not second.is_set()
    readiness.lifecycle.begin_draining()
    assert second.is_set()
    readiness.lifecycle.begin_draining()  # idempotent: no further change
    assert not readiness.next_change().is_set()


async def test_check_unknown_service_is_not_found() -> None:
    health = HealthService(FakeSignal(), [MODEL_DISCOVERY])
    response = await health.check(health_pb2.HealthCheckRequest(service=MODEL_DISCOVERY), CONTEXT)
    assert response.status == SERVING
    with pytest.raises(GrpcError) as raised:
        await health.check(health_pb2.HealthCheckRequest(service=CONTROL_PLANE), CONTEXT)
    assert raised.value.status is GrpcStatus.NOT_FOUND
    assert CONTROL_PLANE in raised.value.message


# ---- Watch --------------------------------------------------------------------------------------


async def test_watch_sends_the_status_at_once_then_each_change_and_ends_on_drain() -> None:
    signal_ = FakeSignal()
    health = HealthService(signal_, [CONTROL_PLANE])
    async with _watching(health, CONTROL_PLANE) as (statuses, returned):
        assert await statuses.receive() == SERVING
        signal_.change()  # a change that leaves the status alone sends nothing
        await trio.testing.wait_all_tasks_blocked()
        assert _pending(statuses) == []
        signal_.change(accepting=False)  # stops taking work before draining ("leaving")
        assert await statuses.receive() == NOT_SERVING
        await trio.testing.wait_all_tasks_blocked()
        assert not returned()  # still open: only draining ends it
        signal_.change(accepting=True)
        assert await statuses.receive() == SERVING
        signal_.change(accepting=False, drains=True)
        assert await statuses.receive() == NOT_SERVING
        await trio.testing.wait_all_tasks_blocked()
        assert returned()
        assert _pending(statuses) == []


async def test_watch_on_a_real_readiness_sends_not_serving_when_draining(
    autojump_clock: trio.testing.MockClock,
) -> None:
    readiness = Readiness(WarmupConfig(warmup_ms=60_000, sample_interval_ms=1_000))
    health = HealthService(readiness, [CONTROL_PLANE])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(readiness.run_warmup, lambda: 0)
        async with _watching(health) as (statuses, returned):
            assert await statuses.receive() == SERVING  # warming
            await trio.sleep(10)  # ten samples, still warming: nothing new
            assert _pending(statuses) == [] and not returned()
            readiness.lifecycle.begin_draining()
            assert await statuses.receive() == NOT_SERVING
            await trio.testing.wait_all_tasks_blocked()
            assert returned()


async def test_watch_of_a_promotion_sends_nothing_new(
    autojump_clock: trio.testing.MockClock,
) -> None:
    readiness = Readiness(WarmupConfig(warmup_ms=3_000, sample_interval_ms=1_000))
    health = HealthService(readiness, [MODEL_DISCOVERY])
    async with _watching(health, MODEL_DISCOVERY) as (statuses, returned):
        assert await statuses.receive() == SERVING
        await readiness.run_warmup(lambda: 0)  # deadline promotion
        assert readiness.ready
        await trio.testing.wait_all_tasks_blocked()
        assert _pending(statuses) == [] and not returned()


async def test_watch_of_an_unknown_service_says_so_and_stays_open_until_drain() -> None:
    signal_ = FakeSignal()
    health = HealthService(signal_, [CONTROL_PLANE])
    async with _watching(health, "no.such.Service") as (statuses, returned):
        assert await statuses.receive() == SERVICE_UNKNOWN
        signal_.change(accepting=False)
        await trio.testing.wait_all_tasks_blocked()
        assert _pending(statuses) == [] and not returned()
        signal_.change(drains=True)
        await trio.testing.wait_all_tasks_blocked()
        assert returned()


async def test_watch_reports_a_drain_that_begins_while_it_is_sending() -> None:
    """`send` yields; a drain starting then must still be reported before the stream ends."""
    signal_ = FakeSignal()
    health = HealthService(signal_, [CONTROL_PLANE])
    sent: list[int] = []

    async def send(response: health_pb2.HealthCheckResponse) -> None:
        sent.append(response.status)
        if len(sent) == 1:
            signal_.change(accepting=False, drains=True)
        await trio.lowlevel.checkpoint()

    with trio.fail_after(5):
        await health.watch(health_pb2.HealthCheckRequest(), CONTEXT, send)
    assert sent == [SERVING, NOT_SERVING]


async def test_watch_started_while_draining_sends_not_serving_and_ends() -> None:
    health = HealthService(FakeSignal(accepting=False, drains=True), [CONTROL_PLANE])
    sent: list[int] = []

    async def send(response: health_pb2.HealthCheckResponse) -> None:
        sent.append(response.status)

    await health.watch(health_pb2.HealthCheckRequest(), CONTEXT, send)
    assert sent == [NOT_SERVING]


# ---- the reflection index -----------------------------------------------------------------------


def _index(*services: str) -> ReflectionIndex:
    return ReflectionIndex([*services, HEALTH_SERVICE], [pb.DESCRIPTOR, health_pb2.DESCRIPTOR])


def _file_names(response: reflection_pb2.ServerReflectionResponse) -> list[str]:
    names = []
    for data in response.file_descriptor_response.file_descriptor_proto:
        proto = descriptor_pb2.FileDescriptorProto()
        proto.ParseFromString(data)
        names.append(proto.name)
    return names


def test_reflection_lists_the_ports_services_and_itself() -> None:
    request = reflection_pb2.ServerReflectionRequest(host="h", list_services="*")
    response = _index(MODEL_DISCOVERY).answer(request)
    assert [s.name for s in response.list_services_response.service] == sorted(
        [MODEL_DISCOVERY, *COMMON]
    )
    assert response.original_request == request
    assert response.valid_host == "h"


@pytest.mark.parametrize(
    ("symbol", "filename"),
    [
        (CONTROL_PLANE, "stargate/protocol/stargate.proto"),
        (f"{MODEL_DISCOVERY}.ListModels", "stargate/protocol/stargate.proto"),
        ("stargate.ListModelsRequest", "stargate/protocol/stargate.proto"),
        ("grpc.health.v1.HealthCheckResponse.ServingStatus", "grpc_health/v1/health.proto"),
        (REFLECTION_V1ALPHA, "grpc_reflection/v1alpha/reflection.proto"),
        (REFLECTION_V1, "grpc/reflection/v1/reflection.proto"),
    ],
)
def test_reflection_file_containing_symbol(symbol: str, filename: str) -> None:
    index = _index(CONTROL_PLANE)
    response = index.answer(reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol))
    assert _file_names(response) == [filename]
    by_name = index.answer(reflection_pb2.ServerReflectionRequest(file_by_filename=filename))
    assert by_name.file_descriptor_response == response.file_descriptor_response


def test_reflection_serves_transitive_dependencies_requested_file_first() -> None:
    pool = descriptor_pool.DescriptorPool()
    for module in ("timestamp_pb2", "duration_pb2"):
        well_known = __import__(f"google.protobuf.{module}", fromlist=["DESCRIPTOR"])
        pool.AddSerializedFile(file_proto(well_known.DESCRIPTOR).SerializeToString())
    middle = descriptor_pb2.FileDescriptorProto(
        name="test/middle.proto",
        package="test",
        syntax="proto3",
        dependency=["google/protobuf/timestamp.proto"],
    )
    middle.message_type.add(name="Middle").field.add(
        name="at", number=1, type=11, label=1, type_name=".google.protobuf.Timestamp"
    )
    top = descriptor_pb2.FileDescriptorProto(
        name="test/top.proto",
        package="test",
        syntax="proto3",
        dependency=["test/middle.proto", "google/protobuf/duration.proto"],
    )
    top.message_type.add(name="Req").field.add(
        name="m", number=1, type=11, label=1, type_name=".test.Middle"
    )
    top.service.add(name="Top").method.add(
        name="Call", input_type=".test.Req", output_type=".test.Req"
    )
    pool.AddSerializedFile(middle.SerializeToString())
    index = ReflectionIndex(["test.Top"], [pool.AddSerializedFile(top.SerializeToString())])
    response = index.answer(
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="test.Top")
    )
    names = _file_names(response)
    assert names[0] == "test/top.proto"
    assert sorted(names[1:]) == [
        "google/protobuf/duration.proto",
        "google/protobuf/timestamp.proto",
        "test/middle.proto",
    ]
    # What a client does with it: every file builds in a fresh pool, dependencies first.
    fresh = descriptor_pool.DescriptorPool()
    for data in reversed(response.file_descriptor_response.file_descriptor_proto):
        fresh.AddSerializedFile(data)
    assert [m.name for m in fresh.FindServiceByName("test.Top").methods] == ["Call"]


def test_reflection_errors_are_responses_not_call_failures() -> None:
    index = _index(CONTROL_PLANE)
    for request in [
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.Such"),
        reflection_pb2.ServerReflectionRequest(file_by_filename="no/such.proto"),
        reflection_pb2.ServerReflectionRequest(all_extension_numbers_of_type="no.Such"),
        reflection_pb2.ServerReflectionRequest(
            file_containing_extension=reflection_pb2.ExtensionRequest(
                containing_type="stargate.ListModelsRequest", extension_number=100
            )
        ),
    ]:
        response = index.answer(request)
        assert response.WhichOneof("message_response") == "error_response"
        assert response.error_response.error_code == GrpcStatus.NOT_FOUND
        assert response.original_request == request
    empty = index.answer(reflection_pb2.ServerReflectionRequest(host="x"))
    assert empty.error_response.error_code == GrpcStatus.INVALID_ARGUMENT


def test_reflection_extension_numbers_of_a_message_without_extensions() -> None:
    response = _index(CONTROL_PLANE).answer(
        reflection_pb2.ServerReflectionRequest(
            all_extension_numbers_of_type="stargate.StargateInfo"
        )
    )
    assert response.all_extension_numbers_response.base_type_name == "stargate.StargateInfo"
    assert list(response.all_extension_numbers_response.extension_number) == []


def test_v1_reflection_file_is_v1alpha_under_the_v1_package() -> None:
    v1 = v1_reflection_file()
    v1alpha = file_proto(reflection_pb2.DESCRIPTOR)
    assert (v1.name, v1.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    assert v1.options.java_package == "io.grpc.reflection.v1" and not v1.options.deprecated
    renamed = str(v1alpha.message_type).replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
    assert str(v1.message_type) == renamed
    assert "v1alpha" not in str(v1.message_type) + str(v1.service)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(v1.SerializeToString())
    method = pool.FindMethodByName(f"{REFLECTION_V1}.ServerReflectionInfo")
    assert method.input_type.full_name == "grpc.reflection.v1.ServerReflectionRequest"


def test_reflection_refuses_to_list_a_service_it_cannot_describe() -> None:
    with pytest.raises(ValueError, match=r"no\.Such"):
        ReflectionIndex(["no.Such"], [pb.DESCRIPTOR])


# ---- both port apps on a real Hypercorn server --------------------------------------------------


@asynccontextmanager
async def _served(app: Callable[..., Any]) -> AsyncIterator[grpc.Channel]:
    """Serve `app` on loopback with Hypercorn's trio worker; yield a grpcio channel to it."""
    sock = bind_listener("gRPC", ListenAddress("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = HypercornConfig()
    config.graceful_timeout = 2.0
    config.accesslog = None
    stop = trio.Event()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_asgi, app, sock, config, stop.wait)
            try:
                yield channel
            finally:
                stop.set()
    finally:
        channel.close()


async def _in_thread(function: Callable[[], R]) -> R:
    return await trio.to_thread.run_sync(function)


def _check(channel: grpc.Channel, service: str, timeout: float = 10) -> int | grpc.StatusCode:
    """The status a health probe sees: the reported status, or the call's error code."""
    try:
        return (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            .status
        )
    except grpc.RpcError as error:
        return error.code()


def _control_plane(serving: FakeSignal) -> Callable[..., Any]:
    routing = RoutingState()

    async def never_probed(url: str) -> int:
        raise AssertionError("no backend is registered in this test")

    registrations = RegistrationService(routing, OpenAuthenticator(), never_probed)
    publisher = WatchPublisher(PublisherConfig("health-test", "127.0.0.1:1"))
    return control_plane_app(
        registrations, publisher, serving=serving, max_message_bytes=4 * 1024 * 1024
    )


@pytest.mark.parametrize("port", ["control_plane", "model_discovery"])
async def test_port_app_check_and_watch_over_grpcio(port: str) -> None:
    serving = FakeSignal()
    if port == "control_plane":
        app, own, other = _control_plane(serving), CONTROL_PLANE, MODEL_DISCOVERY
    else:
        app = model_discovery_app(RoutingState(), serving=serving, max_message_bytes=1 << 22)
        own, other = MODEL_DISCOVERY, CONTROL_PLANE
    async with _served(app) as channel:
        for name in ["", own, HEALTH_SERVICE, REFLECTION_V1ALPHA, REFLECTION_V1]:
            assert await _in_thread(lambda name=name: _check(channel, name)) == SERVING
        for name in [other, "unknown.Service"]:
            assert await _in_thread(lambda name=name: _check(channel, name)) == (
                grpc.StatusCode.NOT_FOUND
            )
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=own), timeout=30
        )
        try:
            assert (await _in_thread(lambda: next(watch))).status == SERVING
            # Not taking work while the listener is still open: Check answers NOT_SERVING.
            serving.change(accepting=False)
            assert (await _in_thread(lambda: next(watch))).status == NOT_SERVING
            for name in ["", own]:
                assert await _in_thread(lambda name=name: _check(channel, name)) == NOT_SERVING
            serving.change(drains=True)
            assert await _in_thread(lambda: list(watch)) == []  # ended, with OK
            assert watch.code() == grpc.StatusCode.OK
        finally:
            watch.cancel()


# ---- real replicas ------------------------------------------------------------------------------


@dataclass
class WarmingReplica:
    """A warming `stargate serve` process and grpcio channels to both of its gRPC ports."""

    process: StargateProcess
    ports: Ports
    control: grpc.Channel
    discovery: grpc.Channel

    def close(self) -> None:
        self.control.close()
        self.discovery.close()


def _start_warming_replica(start: Callable[..., StargateProcess], *extra: str) -> WarmingReplica:
    """A replica that stays warming for the whole test (no Pylon ever registers)."""
    ports = Ports.pick()
    process = start(
        "serve",
        "--stargate-id=health-replica",
        *ports.args(),
        "--disable-dns-discovery",
        "--readiness-warmup-ms=600000",
        "--warmup-sample-interval-ms=1000",
        *extra,
    )
    replica = WarmingReplica(
        process,
        ports,
        grpc.insecure_channel(f"127.0.0.1:{ports.grpc}"),
        grpc.insecure_channel(f"127.0.0.1:{ports.discovery}"),
    )
    try:
        wait_until(lambda: _check(replica.control, "") == SERVING, 20, "the control-plane port")
        wait_until(lambda: _check(replica.discovery, "") == SERVING, 20, "the discovery port")
    except BaseException:
        replica.close()
        raise
    return replica


@pytest.fixture(scope="module")
def warming(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmingReplica]:
    """One warming replica for the tests that only read from it."""
    log_dir = tmp_path_factory.mktemp("warming")
    started: list[StargateProcess] = []

    def start(*args: str) -> StargateProcess:
        started.append(launch(log_dir / "stargate.log", *args))
        return started[-1]

    try:
        replica = _start_warming_replica(start)
        yield replica
        replica.close()
    finally:
        for handle in started:
            stop(handle)


def test_warming_replica_is_serving_on_both_ports_while_readyz_is_503(
    warming: WarmingReplica,
) -> None:
    readyz = httpx.get(f"http://127.0.0.1:{warming.ports.http}/readyz", timeout=5)
    assert readyz.status_code == 503 and readyz.json()["phase"] == "warming"
    for channel, own, other in [
        (warming.control, CONTROL_PLANE, MODEL_DISCOVERY),
        (warming.discovery, MODEL_DISCOVERY, CONTROL_PLANE),
    ]:
        for name in ["", own, HEALTH_SERVICE]:
            assert _check(channel, name) == SERVING, name
        assert _check(channel, other) == grpc.StatusCode.NOT_FOUND
        assert _check(channel, "no.such.Service") == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_each_ports_services(warming: WarmingReplica) -> None:
    for channel, own, methods in [
        (warming.control, CONTROL_PLANE, {"RegisterInferenceServer", "WatchStargates"}),
        (warming.discovery, MODEL_DISCOVERY, {"ListModels"}),
    ]:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert sorted(database.get_services()) == sorted([own, *COMMON])
        pool = descriptor_pool.DescriptorPool(database)  # resolves through reflection calls
        assert {m.name for m in pool.FindServiceByName(own).methods} == methods
        health = pool.FindServiceByName(HEALTH_SERVICE)
        assert {"Check", "Watch"} <= {m.name for m in health.methods}
        request = pool.FindMessageTypeByName("stargate.ListModelsRequest")
        assert "routing_key" in request.fields_by_name
        assert database.FindFileByName("stargate/protocol/stargate.proto").package == "stargate"
        # `grpcurl describe stargate.X.Method` asks for the file containing a method name.
        method = f"{own}.{sorted(methods)[0]}"
        assert database.FindFileContainingSymbol(method).name == "stargate/protocol/stargate.proto"


def test_v1_reflection_answers_on_both_ports(warming: WarmingReplica) -> None:
    """grpcurl tries `grpc.reflection.v1` first; its messages are the v1alpha ones on the wire."""
    for channel, own in [(warming.control, CONTROL_PLANE), (warming.discovery, MODEL_DISCOVERY)]:
        call = channel.stream_stream(
            f"/{REFLECTION_V1}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        responses = list(
            call(
                iter(
                    [
                        reflection_pb2.ServerReflectionRequest(list_services=""),
                        reflection_pb2.ServerReflectionRequest(file_containing_symbol=own),
                    ]
                ),
                timeout=10,
            )
        )
        assert [s.name for s in responses[0].list_services_response.service] == sorted(
            [own, *COMMON]
        )
        assert _file_names(responses[1]) == ["stargate/protocol/stargate.proto"]


def test_sigterm_turns_watch_to_not_serving_and_health_streams_do_not_hold_the_drain(
    start_stargate: Callable[..., StargateProcess],
) -> None:
    replica = _start_warming_replica(
        start_stargate, "--shutdown-drain-timeout-ms=30000", "--shutdown-delay-ms=2000"
    )
    release: queue.Queue[None] = queue.Queue()

    def held_requests() -> Iterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        release.get()  # the client does not half-close until the test says so

    try:
        watches = [
            health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=service), timeout=60
            )
            for channel, service in [
                (replica.control, ""),
                (replica.control, CONTROL_PLANE),
                (replica.discovery, ""),
                (replica.discovery, MODEL_DISCOVERY),
            ]
        ]
        # An in-flight call that keeps the replica draining (and alive) until it is released.
        held = reflection_pb2_grpc.ServerReflectionStub(replica.control).ServerReflectionInfo(
            held_requests(), timeout=60
        )
        assert next(held).list_services_response.service
        for watch in watches:
            assert next(watch).status == SERVING  # warming

        replica.process.process.send_signal(signal.SIGTERM)
        for watch in watches:
            assert next(watch).status == NOT_SERVING  # leaving: still open, still answering
        # The leave phase (docs/rolling-restarts.md): the listeners still accept, and a new
        # Check hears NOT_SERVING itself.
        for channel, service in [(replica.control, CONTROL_PLANE), (replica.discovery, "")]:
            assert _check(channel, service, timeout=3) == NOT_SERVING
        for watch in watches:
            assert list(watch) == []  # ended with OK: Watch does not hold the drain open
            assert watch.code() == grpc.StatusCode.OK

        # Still draining (the held call), yet no new call sees SERVING: Hypercorn refuses new
        # streams and connections once the drain has begun, which a probe counts as unhealthy.
        assert replica.process.process.poll() is None
        for channel in (replica.control, replica.discovery):
            assert _check(channel, "", timeout=3) != SERVING

        release.put(None)
        assert list(held) == []
        assert replica.process.process.wait(timeout=20) == 0  # drained, not cut at the deadline
    finally:
        release.put(None)
        replica.close()
