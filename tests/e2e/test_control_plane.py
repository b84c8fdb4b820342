"""Pylon registration end to end: a real `stargate serve` process, the real grpcio client
(generated from our proto), and backends whose `/health` the test switches.

Most tests share one replica (fresh server ids per test); tests that need other flags start
their own. Everything runs on the real clock and loopback ports.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from stargate.protocol import stargate_pb2 as pb
from stargate.protocol import stargate_pb2_grpc as pb_grpc
from tests.e2e.processes import Ports, StargateProcess, launch, stop, wait_until
from tests.fakes.pylon import ACTIVE, INACTIVE, FakeBackend, PylonStream, registration


class Replica:
    """A running replica and clients for each of its listeners."""

    def __init__(self, process: StargateProcess, ports: Ports) -> None:
        self.process = process
        self.ports = ports
        self.channel = grpc.insecure_channel(f"127.0.0.1:{ports.grpc}")
        self.discovery_channel = grpc.insecure_channel(f"127.0.0.1:{ports.discovery}")
        self.discovery = pb_grpc.StargateModelDiscoveryStub(self.discovery_channel)
        self.control = pb_grpc.StargateControlPlaneStub(self.channel)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{ports.http}", timeout=5)

    def stream(self, **kwargs: object) -> PylonStream:
        return PylonStream(self.channel, **kwargs)  # type: ignore[arg-type]

    def list_models(self, routing_key: str | None = None, *model_ids: str) -> list[str]:
        request = pb.ListModelsRequest(model_ids=list(model_ids))
        if routing_key is not None:
            request.routing_key = routing_key
        return list(self.discovery.ListModels(request, timeout=5).model_ids)

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.ports.metrics}/metrics", timeout=5).text

    def wait_models(self, expected: list[str], routing_key: str | None = None, *ids: str) -> None:
        wait_until(
            lambda: self.list_models(routing_key, *ids) == expected, 10, f"models {expected}"
        )

    def close(self) -> None:
        self.channel.close()
        self.discovery_channel.close()
        self.http.close()
        stop(self.process)


def start_replica(
    log_dir: Path, *extra: str, ports: Ports | None = None, no_discovery: bool = True
) -> Replica:
    ports = ports or Ports.pick()
    process = launch(
        log_dir / f"replica-{ports.grpc}.log",
        "serve",
        "--stargate-id=cp-replica",
        *ports.args(),
        "--readiness-warmup-ms=0",
        *(["--disable-dns-discovery"] if no_discovery else []),
        *extra,
    )
    replica = Replica(process, ports)
    wait_until(lambda: replica.http.get("/healthz").status_code == 200, 15, "the replica")
    return replica


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    handle = start_replica(
        tmp_path_factory.mktemp("replica"),
        "--remote-stargate-url= other-region:50071 ,other-region:50071",
    )
    yield handle
    handle.close()


@pytest.fixture
def backend() -> Iterator[FakeBackend]:
    server = FakeBackend()
    yield server
    server.close()


@pytest.fixture
def streams() -> Iterator[Callable[[PylonStream], PylonStream]]:
    """Register streams here to have them cancelled at teardown."""
    opened: list[PylonStream] = []
    yield lambda stream: opened.append(stream) or stream  # type: ignore[func-returns-value]
    for stream in opened:
        stream.cancel()


def _error(stream: PylonStream) -> grpc.RpcError:
    event = stream.next_event()
    assert isinstance(event, grpc.RpcError), f"expected an error status, got {event!r}"
    return event


# ---- registration lifecycle ---------------------------------------------------------------------


def test_active_registration_is_routable_and_acked(
    replica: Replica, backend: FakeBackend, streams: Callable[[PylonStream], PylonStream]
) -> None:
    stream = streams(replica.stream())
    stream.exchange(registration("life-1", backend.url, ["life-model"], queue_size=2))
    replica.wait_models(["life-model"], None, "life-model")
    assert replica.http.get("/v1/models").json()["model_ids"].count("life-model") == 1
    assert 'stargate_active_inference_servers{model="life-model",routing_key=""} 1.0' in (
        replica.metrics()
    )


def test_status_lifecycle_active_inactive_active_then_stream_end(
    replica: Replica, backend: FakeBackend, streams: Callable[[PylonStream], PylonStream]
) -> None:
    stream = streams(replica.stream())
    stream.exchange(registration("life-2", backend.url, {"cycle": ACTIVE}))
    replica.wait_models(["cycle"], None, "cycle")
    stream.exchange(registration("life-2", backend.url, {"cycle": INACTIVE}))
    assert replica.list_models(None, "cycle") == []
    gauge = 'stargate_active_inference_servers{model="cycle",routing_key=""}'
    assert f"{gauge} 0.0" in replica.metrics()
    stream.exchange(registration("life-2", backend.url, {"cycle": ACTIVE}))
    assert replica.list_models(None, "cycle") == ["cycle"]
    stream.close()
    assert stream.finish() == grpc.StatusCode.OK
    replica.wait_models([], None, "cycle")


def test_client_cancel_removes_the_routes(
    replica: Replica, backend: FakeBackend, streams: Callable[[PylonStream], PylonStream]
) -> None:
    stream = streams(replica.stream())
    stream.exchange(registration("cancel-1", backend.url, ["cancelled-model"]))
    replica.wait_models(["cancelled-model"], None, "cancelled-model")
    stream.cancel()
    replica.wait_models([], None, "cancelled-model")


def test_missing_stats_and_unknown_status_are_not_routable(
    replica: Replica, backend: FakeBackend, streams: Callable[[PylonStream], PylonStream]
) -> None:
    stream = streams(replica.stream())
    message = registration("stats-1", backend.url, {"no-stats": ACTIVE}, with_stats=False)
    message.models["unknown-status"].CopyFrom(
        pb.InferenceServerModelRegistration(stats=pb.ModelStats(), status=0)
    )
    message.models["future-status"].CopyFrom(
        pb.InferenceServerModelRegistration(stats=pb.ModelStats(), status=7)
    )
    stream.exchange(message)
    assert replica.list_models(None, "no-stats", "unknown-status", "future-status") == []


def test_one_registration_serves_two_models_and_inactive_removes_only_one(
    replica: Replica, backend: FakeBackend, streams: Callable[[PylonStream], PylonStream]
) -> None:
    stream = streams(replica.stream())
    stream.exchange(registration("multi-1", backend.url, ["mm-a", "mm-b"]))
    replica.wait_models(["mm-a", "mm-b"], None, "mm-a", "mm-b")
    stream.exchange(registration("multi-1", backend.url, {"mm-a": INACTIVE, "mm-b": ACTIVE}))
    assert replica.list_models(None, "mm-a", "mm-b") == ["mm-b"]
    stream.exchange(registration("multi-1", backend.url, {"mm-b": ACTIVE}))  # omission
    assert replica.list_models(None, "mm-a", "mm-b") == ["mm-b"]


def test_two_backends_in_a_shared_cluster_keep_the_model_until_the_last_leaves(
    replica: Replica, backend: FakeBackend, streams: Callable[[PylonStream], PylonStream]
) -> None:
    first = streams(replica.stream())
    second = streams(replica.stream())
    first.exchange(registration("shared-1", backend.url, ["shared"], cluster_id="cl"))
    second.exchange(registration("shared-2", backend.url, ["shared"], cluster_id="cl"))
    gauge = 'stargate_active_inference_servers{model="shared",routing_key=""}'
    wait_until(lambda: f"{gauge} 2.0" in replica.metrics(), 10, "two backends")
    first.exchange(registration("shared-1", backend.url, {"shared": INACTIVE}, cluster_id="cl"))
    assert f"{gauge} 1.0" in replica.metrics()
    assert replica.list_models(None, "shared") == ["shared"]
    second.close()
    assert second.finish() == grpc.StatusCode.OK
    replica.wait_models([], None, "shared")


def test_failing_health_keeps_a_backend_unroutable_until_it_recovers(
    replica: Replica, backend: FakeBackend, streams: Callable[[PylonStream], PylonStream]
) -> None:
    backend.healthy = False
    stream = streams(replica.stream())
    message = registration("health-1", backend.url, ["guarded"])
    stream.exchange(message)  # acked, but not routable: no RTT
    assert replica.list_models(None, "guarded") == []
    backend.healthy = True
    wait_until(
        lambda: stream.exchange(message) is None and replica.list_models(None, "guarded") != [],
        10,
        "routable once /health answers",
    )
    backend.healthy = False
    wait_until(
        lambda: stream.exchange(message) is None and replica.list_models(None, "guarded") == [],
        10,
        "unroutable once /health fails",
    )


# ---- admission and identity ---------------------------------------------------------------------


def test_second_stream_with_a_live_id_gets_already_exists(
    replica: Replica, backend: FakeBackend, streams: Callable[[PylonStream], PylonStream]
) -> None:
    first = streams(replica.stream())
    first.exchange(registration("dup-1", backend.url, ["dup-model"]))
    second = streams(replica.stream())
    second.send(registration("dup-1", backend.url, ["dup-model"]))
    error = _error(second)
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert error.details() == "inference_server_id 'dup-1' is already registered"
    assert replica.list_models(None, "dup-model") == ["dup-model"]  # the first is untouched


@pytest.mark.parametrize(
    ("server_id", "url", "reverse", "details"),
    [
        ("", "http://127.0.0.1:1", False, "inference_server_id is empty"),
        ("bad-1", "", False, "inference_server_url is empty"),
        (
            "bad-2",
            "not a url",
            False,
            "invalid inference_server_url: inference_server_url must be a valid URL",
        ),
        (
            # A direct tunnel this replica could not verify (docs/tunnels.md, Admission).
            "bad-3",
            "quic://127.0.0.1:4433",
            False,
            "quic backends need --quic-insecure or --quic-tls-cert-path (the certificates "
            "their Pylons present) on this replica",
        ),
        (
            "bad-4",
            "ftp://127.0.0.1:21",
            False,
            "invalid inference_server_url: inference_server_url scheme must be quic, http or https",
        ),
        (
            "bad-3b",
            "quic://127.0.0.1:4433",
            True,
            "invalid inference_server_url: inference_server_url scheme must be http or https",
        ),
        (
            "bad-3c",
            "quic://pylon:4433",
            False,
            "invalid inference_server_url: inference_server_url host must be an IP address",
        ),
        (
            "bad-5",
            "http://:8000",
            False,
            "invalid inference_server_url: inference_server_url must include host",
        ),
        (
            "bad-6",
            "http://127.0.0.1:99999",
            False,
            "invalid inference_server_url: inference_server_url must be a valid URL",
        ),
        (
            "bad-7",
            "http://127.0.0.1:8000",
            True,
            "reverse tunnel flag set but no reverse tunnel config",
        ),
    ],
)
def test_admission_rejections(
    replica: Replica,
    streams: Callable[[PylonStream], PylonStream],
    server_id: str,
    url: str,
    reverse: bool,
    details: str,
) -> None:
    stream = streams(replica.stream())
    message = registration(server_id, url, ["never-admitted"])
    message.reverse_tunnel = reverse
    stream.send(message)
    error = _error(stream)
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)
    assert replica.list_models(None, "never-admitted") == []


@pytest.mark.parametrize(
    ("change", "details"),
    [
        ({"cluster_id": "other"}, "cluster_id changed"),
        ({"inference_server_url": "http://127.0.0.2:1"}, "inference_server_url changed"),
        ({"inference_server_id": "someone-else"}, "inference_server_id changed"),
        ({"reverse_tunnel": True}, "reverse tunnel flag changed"),
    ],
)
def test_identity_change_mid_stream_unroutes_and_fails_the_stream(
    replica: Replica,
    backend: FakeBackend,
    streams: Callable[[PylonStream], PylonStream],
    change: dict[str, object],
    details: str,
) -> None:
    server_id = f"ident-{details.split()[0]}"
    model = f"ident-model-{details.split()[0]}"
    stream = streams(replica.stream())
    stream.exchange(registration(server_id, backend.url, [model]))
    replica.wait_models([model], None, model)
    changed = registration(server_id, backend.url, [model])
    for field, value in change.items():
        setattr(changed, field, value)
    stream.send(changed)
    error = _error(stream)
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)
    assert replica.list_models(None, model) == []


def test_oversized_and_undecodable_messages_fail_the_stream_and_change_nothing(
    replica: Replica, backend: FakeBackend, streams: Callable[[PylonStream], PylonStream]
) -> None:
    before = replica.list_models()
    register = replica.channel.stream_stream(
        "/stargate.StargateControlPlane/RegisterInferenceServer",
        request_serializer=lambda raw: raw,
        response_deserializer=lambda raw: raw,
    )
    for payload, code in [
        (b"\x00" * (4 * 1024 * 1024 + 1), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (b"\xff\xff\xff\xff", grpc.StatusCode.INTERNAL),
        (b"\x0a\x05ab", grpc.StatusCode.INTERNAL),  # truncated field
        # Wrong wire types: protobuf keeps them as unknown fields, so the id or URL is empty.
        (b"\x08\x01", grpc.StatusCode.INVALID_ARGUMENT),
        (b"\x0a\x02ab\x10\x05", grpc.StatusCode.INVALID_ARGUMENT),
    ]:
        call = register(iter([payload]), timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
        assert caught.value.code() == code
    assert replica.list_models() == before


def test_control_plane_port_does_not_serve_list_models_and_vice_versa(replica: Replica) -> None:
    wrong = pb_grpc.StargateModelDiscoveryStub(replica.channel)
    with pytest.raises(grpc.RpcError) as caught:
        wrong.ListModels(pb.ListModelsRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    watch = pb_grpc.StargateControlPlaneStub(replica.discovery_channel).WatchStargates(
        pb.WatchStargatesRequest(), timeout=5
    )
    with pytest.raises(grpc.RpcError) as caught:
        next(watch)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


# ---- discovery and listing ----------------------------------------------------------------------


def test_watch_stargates_publishes_self_and_the_remote_urls(replica: Replica) -> None:
    call = replica.control.WatchStargates(pb.WatchStargatesRequest(), timeout=10)
    first = next(call)
    call.cancel()
    (self_info,) = first.stargates
    assert self_info.stargate_id == "cp-replica"
    assert self_info.advertise_addr == f"127.0.0.1:{replica.ports.grpc}"
    assert self_info.http_advertise_addr == f"127.0.0.1:{replica.ports.http}"
    assert list(first.watch_stargate_urls) == ["other-region:50071"]


def test_list_models_rejects_blank_filters_and_separates_routing_keys(replica: Replica) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        replica.discovery.ListModels(pb.ListModelsRequest(model_ids=["a", " "]), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "model_ids must not contain empty values"
    assert replica.list_models("some-tenant") == []
    assert replica.http.get("/v1/models", params={"model_ids": " "}).status_code == 400


def test_debug_state_follows_live_registrations(
    replica: Replica, backend: FakeBackend, streams: Callable[[PylonStream], PylonStream]
) -> None:
    stream = streams(replica.stream())
    stream.exchange(registration("debug-1", backend.url, ["debug-model"]))
    replica.wait_models(["debug-model"], None, "debug-model")
    state = replica.http.get("/debug/state").json()
    assert "debug-model" in state["active_model_ids"]
    assert state["config"]["grpc_listen_addr"] == f"127.0.0.1:{replica.ports.grpc}"
    assert state["config"]["stargate_id"] == "cp-replica"
    stream.cancel()
    wait_until(
        lambda: "debug-model" not in replica.http.get("/debug/state").json()["active_model_ids"],
        10,
        "the model to leave /debug/state",
    )


# ---- replicas with their own flags --------------------------------------------------------------


def test_stream_that_never_sends_ends_ok_at_the_idle_timeout(tmp_path: Path) -> None:
    replica = start_replica(
        tmp_path,
        "--registration-update-idle-timeout-ms=200",
        "--registration-update-max-idle-timeout-ms=300",
    )
    try:
        stream = replica.stream(heartbeat_ms=None)  # no header: the cap (300 ms) applies
        started = time.monotonic()
        assert stream.finish() == grpc.StatusCode.OK
        assert 0.25 < time.monotonic() - started < 3
        assert "registration stream idle timeout; closing registration" in replica.process.log
    finally:
        replica.close()


def test_static_token_authenticates_streams(tmp_path: Path, backend: FakeBackend) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    replica = start_replica(tmp_path, f"--registration-token-file={token_file}")
    try:
        for token in (None, "wrong"):
            stream = replica.stream(token=token)
            stream.send(registration("auth-1", backend.url, ["auth-model"]))
            error = _error(stream)
            assert (error.code(), error.details()) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "authentication failed",
            )
        stream = replica.stream(token="s3cret-token")
        stream.exchange(registration("auth-1", backend.url, ["auth-model"]))
        assert replica.list_models(None, "auth-model") == ["auth-model"]
        stream.cancel()
        assert "s3cret-token" not in replica.process.log
        assert "s3cret-token" not in replica.http.get("/debug/state").text
    finally:
        replica.close()


def test_shutdown_ends_registration_streams_ok_and_exits_0(
    tmp_path: Path, backend: FakeBackend
) -> None:
    replica = start_replica(tmp_path, "--shutdown-delay-ms=0")
    try:
        stream = replica.stream()
        stream.exchange(registration("bye-1", backend.url, ["bye-model"]))
        replica.process.process.send_signal(signal.SIGTERM)
        assert stream.finish() == grpc.StatusCode.OK
        assert replica.process.process.wait(timeout=10) == 0
    finally:
        replica.close()


@pytest.mark.parametrize("listener", ["grpc", "discovery"])
def test_occupied_grpc_port_fails_start_up_naming_the_listener(
    tmp_path: Path, listener: str
) -> None:
    import socket

    ports = Ports.pick()
    port = getattr(ports, listener)
    name = {"grpc": "gRPC", "discovery": "model-discovery gRPC"}[listener]
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port))
        blocker.listen()
        process = launch(tmp_path / "bind.log", "serve", *ports.args())
        assert process.process.wait(timeout=15) == 1
    assert f"failed to bind {name} listener on 127.0.0.1:{port}" in process.log


def test_three_stable_registrations_promote_a_warming_replica_early(
    tmp_path: Path, backend: FakeBackend
) -> None:
    ports = Ports.pick()
    process = launch(
        tmp_path / "warmup.log",
        "serve",
        *ports.args(),
        "--disable-dns-discovery",
        "--readiness-warmup-ms=60000",
        "--warmup-sample-interval-ms=200",
        "--warmup-stabilization-window=5",
    )
    replica = Replica(process, ports)
    try:
        wait_until(lambda: replica.http.get("/healthz").status_code == 200, 15, "the replica")
        assert replica.http.get("/readyz").status_code == 503
        streams = [replica.stream() for _ in range(3)]
        registered_at = time.monotonic()
        for index, stream in enumerate(streams):
            stream.exchange(registration(f"warm-{index}", backend.url, ["warm-model"]))
        ready_at = wait_until(
            lambda: replica.http.get("/readyz").status_code == 200, 10, "early promotion"
        )
        assert ready_at - registered_at < 3.0  # ~1 s (5 samples x 200 ms), far below 60 s
        assert replica.http.get("/readyz").json()["promotion_reason"] == "stabilized"
        for stream in streams:
            stream.cancel()
        replica.wait_models([], None, "warm-model")
        assert replica.http.get("/readyz").status_code == 200  # promotion is latched
    finally:
        replica.close()


class FakeGateway:
    """An `llm_gateway.LlmGateway` service (grpcio server) mapping worker tokens to routing keys."""

    def __init__(self, keys: dict[str, str]) -> None:
        from concurrent import futures

        from stargate.protocol import llm_gateway_pb2, llm_gateway_pb2_grpc

        class Servicer(llm_gateway_pb2_grpc.LlmGatewayServicer):  # type: ignore[misc]
            def AuthLlmWorker(self, request: object, context: grpc.ServicerContext) -> object:
                token = request.workerToken  # type: ignore[attr-defined]
                if token not in keys:
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, "unknown worker")
                return llm_gateway_pb2.AuthLlmWorkerResponse(routingKey=f"  {keys[token]} ")

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        llm_gateway_pb2_grpc.add_LlmGatewayServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def close(self) -> None:
        self.server.stop(None)


def test_worker_auth_maps_tokens_to_isolated_routing_keys(
    tmp_path: Path, backend: FakeBackend
) -> None:
    gateway = FakeGateway({"token-a": "tenant-a", "token-b": "tenant-b", "token-open": ""})
    replica = start_replica(tmp_path, f"--worker-auth-endpoint=127.0.0.1:{gateway.port}")
    try:
        denied = replica.stream(token="stolen")
        denied.send(registration("wa-0", backend.url, ["shared-model"]))
        error = _error(denied)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        a = replica.stream(token="token-a")
        a.exchange(registration("wa-a", backend.url, ["shared-model"]))
        b = replica.stream(token="token-b")
        b.exchange(registration("wa-b", backend.url, ["shared-model"]))
        unkeyed = replica.stream(token="token-open")  # a blank routing key means unkeyed
        unkeyed.exchange(registration("wa-u", backend.url, ["open-model"]))
        assert replica.list_models("tenant-a") == ["shared-model"]
        assert replica.list_models("tenant-b") == ["shared-model"]
        assert replica.list_models(None) == ["open-model"]
        assert replica.list_models("  ") == ["open-model"]  # blank = unkeyed
        assert replica.http.get("/v1/models").json() == {"model_ids": ["open-model"]}
        # Demoting tenant A's backend leaves tenant B's route alone.
        a.exchange(registration("wa-a", backend.url, {"shared-model": INACTIVE}))
        assert replica.list_models("tenant-a") == []
        assert replica.list_models("tenant-b") == ["shared-model"]
        metrics = replica.metrics()
        assert (
            'stargate_active_inference_servers{model="shared-model",routing_key="tenant-b"} 1.0'
            in (metrics)
        )
        for stream in (a, b, unkeyed):
            stream.cancel()
    finally:
        replica.close()
        gateway.close()


def test_watch_stargates_resends_an_unchanged_snapshot_at_the_heartbeat(tmp_path: Path) -> None:
    replica = start_replica(tmp_path, "--dns-poll-ms=100", "--watch-heartbeat-ms=200")
    try:
        call = replica.control.WatchStargates(pb.WatchStargatesRequest(), timeout=10)
        started = time.monotonic()
        first, second = next(call), next(call)
        call.cancel()
        assert first == second  # identical, re-sent
        assert 0.1 < time.monotonic() - started < 3
    finally:
        replica.close()


def test_static_peers_are_published_with_self(tmp_path: Path) -> None:
    ports = Ports.pick()
    replica = start_replica(
        tmp_path,
        "--peer=peer-b=127.0.0.9:50071,127.0.0.8:50071",
        ports=ports,
        no_discovery=False,
    )
    try:
        call = replica.control.WatchStargates(pb.WatchStargatesRequest(), timeout=10)
        snapshot = next(call)
        call.cancel()
        entries = {(s.stargate_id, s.advertise_addr) for s in snapshot.stargates}
        assert entries == {
            ("cp-replica", f"127.0.0.1:{ports.grpc}"),
            ("peer-b", "127.0.0.9:50071"),
            ("127.0.0.8:50071", "127.0.0.8:50071"),
        }
    finally:
        replica.close()
