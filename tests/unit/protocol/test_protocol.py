"""Wire-contract tests for the generated gRPC modules in ``stargate.protocol``.

Three layers:

1. Staleness: regenerating from the ``.proto`` files must reproduce the
   committed ``*_pb2.py`` / ``*_pb2.pyi`` / ``*_pb2_grpc.py`` byte for byte.
2. Contract: the compiled descriptors carry exactly the packages, services,
   methods, messages, fields, enums and reserved numbers/names of the upstream
   Rust proto (control-plane.md sections 2.1 and 2.2).
3. Wire: serialization round-trips, and hand-encoded bytes decode to the
   expected fields (proving the field numbers on the wire).
"""

from __future__ import annotations

import pathlib
import struct
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor

from stargate.protocol import (
    generate,
    llm_gateway_pb2,
    llm_gateway_pb2_grpc,
    stargate_pb2,
    stargate_pb2_grpc,
)

FDP = descriptor_pb2.FieldDescriptorProto

# --------------------------------------------------------------------------
# 1. Staleness
# --------------------------------------------------------------------------

REGENERATE_HINT = "generated protocol modules are stale: run `nox -s protos` and commit the result"


def test_generated_modules_are_up_to_date(tmp_path: pathlib.Path) -> None:
    written = generate.generate(tmp_path)
    expected = generate.generated_relative_paths()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == sorted(
        p.as_posix() for p in expected
    )
    for rel in expected:
        committed = generate.PROJECT_ROOT / rel
        assert committed.is_file(), f"{rel} is missing; {REGENERATE_HINT}"
        assert (tmp_path / rel).read_bytes() == committed.read_bytes(), (
            f"{rel} differs from a fresh generation; {REGENERATE_HINT}"
        )


def test_no_orphan_generated_modules() -> None:
    package_dir = generate.PROJECT_ROOT / generate.PROTO_PACKAGE_DIR
    present = {
        p.name
        for pattern in ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")
        for p in package_dir.glob(pattern)
    }
    expected = {p.name for p in generate.generated_relative_paths()}
    assert present == expected, (
        f"unexpected generated files {present - expected}; {REGENERATE_HINT}"
    )


# --------------------------------------------------------------------------
# 2. Contract (descriptors)
# --------------------------------------------------------------------------


def _file_proto(file_descriptor: FileDescriptor) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    file_descriptor.CopyToProto(proto)
    return proto


STARGATE_FILE = _file_proto(stargate_pb2.DESCRIPTOR)
LLM_GATEWAY_FILE = _file_proto(llm_gateway_pb2.DESCRIPTOR)


def _messages(
    file_proto: descriptor_pb2.FileDescriptorProto,
) -> dict[str, descriptor_pb2.DescriptorProto]:
    return {m.name: m for m in file_proto.message_type}


def _scalar_name(field: descriptor_pb2.FieldDescriptorProto) -> str:
    if field.type in (FDP.TYPE_MESSAGE, FDP.TYPE_ENUM):
        return str(field.type_name).lstrip(".")
    return str(FDP.Type.Name(field.type)).removeprefix("TYPE_").lower()


def _field_signature(
    message: descriptor_pb2.DescriptorProto, field: descriptor_pb2.FieldDescriptorProto
) -> tuple[str, int, str, str]:
    """Render a field as (name, number, type, label); maps as ``map<K,V>``."""
    label = FDP.Label.Name(field.label).removeprefix("LABEL_").lower()
    type_name = _scalar_name(field)
    if field.type == FDP.TYPE_MESSAGE:
        entry_name = field.type_name.rsplit(".", 1)[-1]
        for nested in message.nested_type:
            if nested.name == entry_name and nested.options.map_entry:
                key, value = sorted(nested.field, key=lambda f: f.number)
                assert (key.name, key.number, value.name, value.number) == ("key", 1, "value", 2)
                type_name = f"map<{_scalar_name(key)},{_scalar_name(value)}>"
    return field.name, field.number, type_name, label


def _fields(message: descriptor_pb2.DescriptorProto) -> set[tuple[str, int, str, str]]:
    return {_field_signature(message, f) for f in message.field}


EXPECTED_STARGATE_MESSAGES: dict[str, set[tuple[str, int, str, str]]] = {
    "WatchStargatesRequest": set(),
    "StargateInfo": {
        ("stargate_id", 1, "string", "optional"),
        ("advertise_addr", 2, "string", "optional"),
        ("http_advertise_addr", 3, "string", "optional"),
        ("grpc_pylon_dial_addr", 4, "string", "optional"),
    },
    "WatchStargatesResponse": {
        ("stargates", 1, "stargate.StargateInfo", "repeated"),
        ("watch_stargate_urls", 2, "string", "repeated"),
    },
    "ListModelsRequest": {
        ("model_ids", 1, "string", "repeated"),
        ("routing_key", 2, "string", "optional"),
    },
    "ListModelsResponse": {
        ("model_ids", 1, "string", "repeated"),
    },
    "ModelStats": {
        ("last_mean_input_tps", 1, "double", "optional"),
        ("output_tps", 2, "double", "optional"),
        ("queue_size", 3, "uint64", "optional"),
        ("queued_input_size", 4, "uint64", "optional"),
        ("max_output_tps", 5, "double", "optional"),
        ("kv_cache_capacity_tokens", 6, "uint64", "optional"),
        ("kv_cache_used_tokens", 7, "uint64", "optional"),
        ("kv_cache_free_tokens", 8, "uint64", "optional"),
        ("num_running_queries", 9, "uint64", "optional"),
        ("max_engine_concurrency", 10, "uint64", "optional"),
        ("total_query_input_size", 11, "uint64", "optional"),
        ("queue_time_estimate_ms_by_priority", 12, "map<uint32,uint64>", "repeated"),
        ("input_processing_queries", 13, "uint64", "optional"),
        ("output_generation_queries", 14, "uint64", "optional"),
        ("stats_observed_at_unix_ms", 15, "uint64", "optional"),
        ("stats_capabilities", 16, "string", "repeated"),
        ("stats_sources", 17, "string", "repeated"),
    },
    "InferenceServerRegistration": {
        ("inference_server_id", 1, "string", "optional"),
        ("inference_server_url", 2, "string", "optional"),
        ("models", 3, "map<string,stargate.InferenceServerModelRegistration>", "repeated"),
        ("reverse_tunnel", 4, "bool", "optional"),
        ("cluster_id", 5, "string", "optional"),
        # Ours, beyond the Rust proto (a Rust replica ignores them): the engine's cached prefix
        # blocks as deltas (docs/prefix-routing.md, "Precise mode"), at numbers Rust never uses.
        ("kv_blocks_reset", 1000, "bool", "optional"),
        ("kv_blocks_added", 1001, "fixed64", "repeated"),
        ("kv_blocks_removed", 1002, "fixed64", "repeated"),
    },
    "InferenceServerModelRegistration": {
        ("stats", 1, "stargate.ModelStats", "optional"),
        ("status", 2, "stargate.InferenceServerStatus", "optional"),
    },
    "InferenceServerAck": {
        ("reverse_tunnel_target", 1, "string", "optional"),
        ("reverse_tunnel_pylon_dial_addr", 3, "string", "optional"),
    },
}

EXPECTED_LLM_GATEWAY_MESSAGES: dict[str, set[tuple[str, int, str, str]]] = {
    "AuthLlmWorkerRequest": {("workerToken", 1, "string", "optional")},
    "AuthLlmWorkerResponse": {("routingKey", 1, "string", "optional")},
}

# message -> (reserved field numbers, reserved field names)
EXPECTED_RESERVED: dict[str, tuple[set[int], set[str]]] = {
    "InferenceServerRegistration": ({6}, {"coordinated_calibration"}),
    "InferenceServerModelRegistration": ({3}, {"calibration"}),
    "InferenceServerAck": ({2}, {"model_calibration_directives"}),
}


def test_files_package_and_syntax() -> None:
    assert (STARGATE_FILE.package, STARGATE_FILE.syntax) == ("stargate", "proto3")
    assert (LLM_GATEWAY_FILE.package, LLM_GATEWAY_FILE.syntax) == ("llm_gateway", "proto3")
    assert list(STARGATE_FILE.dependency) == []
    assert list(LLM_GATEWAY_FILE.dependency) == []


@pytest.mark.parametrize(
    ("file_proto", "expected"),
    [
        pytest.param(STARGATE_FILE, EXPECTED_STARGATE_MESSAGES, id="stargate"),
        pytest.param(LLM_GATEWAY_FILE, EXPECTED_LLM_GATEWAY_MESSAGES, id="llm_gateway"),
    ],
)
def test_message_fields(
    file_proto: descriptor_pb2.FileDescriptorProto,
    expected: dict[str, set[tuple[str, int, str, str]]],
) -> None:
    messages = _messages(file_proto)
    assert set(messages) == set(expected)
    for name, fields in expected.items():
        assert _fields(messages[name]) == fields, name


def test_reserved_numbers_and_names() -> None:
    messages = {**_messages(STARGATE_FILE), **_messages(LLM_GATEWAY_FILE)}
    for name, message in messages.items():
        numbers = {n for r in message.reserved_range for n in range(r.start, r.end)}
        names = set(message.reserved_name)
        assert (numbers, names) == EXPECTED_RESERVED.get(name, (set(), set())), name


def test_inference_server_status_enum() -> None:
    assert [e.name for e in STARGATE_FILE.enum_type] == ["InferenceServerStatus"]
    assert [e.name for e in LLM_GATEWAY_FILE.enum_type] == []
    values = {v.name: v.number for v in STARGATE_FILE.enum_type[0].value}
    assert values == {
        "INFERENCE_SERVER_STATUS_UNKNOWN": 0,
        "INFERENCE_SERVER_STATUS_ACTIVE": 1,
        "INFERENCE_SERVER_STATUS_INACTIVE": 2,
    }
    assert stargate_pb2.INFERENCE_SERVER_STATUS_ACTIVE == 1


# path -> (request type, response type, client streaming, server streaming)
EXPECTED_METHODS: dict[str, tuple[str, str, bool, bool]] = {
    "/stargate.StargateControlPlane/WatchStargates": (
        "stargate.WatchStargatesRequest",
        "stargate.WatchStargatesResponse",
        False,
        True,
    ),
    "/stargate.StargateControlPlane/RegisterInferenceServer": (
        "stargate.InferenceServerRegistration",
        "stargate.InferenceServerAck",
        True,
        True,
    ),
    "/stargate.StargateModelDiscovery/ListModels": (
        "stargate.ListModelsRequest",
        "stargate.ListModelsResponse",
        False,
        False,
    ),
    "/llm_gateway.LlmGateway/AuthLlmWorker": (
        "llm_gateway.AuthLlmWorkerRequest",
        "llm_gateway.AuthLlmWorkerResponse",
        False,
        False,
    ),
}


def test_services_and_methods() -> None:
    methods: dict[str, tuple[str, str, bool, bool]] = {}
    for file_proto in (STARGATE_FILE, LLM_GATEWAY_FILE):
        for service in file_proto.service:
            for method in service.method:
                path = f"/{file_proto.package}.{service.name}/{method.name}"
                methods[path] = (
                    method.input_type.lstrip("."),
                    method.output_type.lstrip("."),
                    method.client_streaming,
                    method.server_streaming,
                )
    assert methods == EXPECTED_METHODS


class _RecordingChannel:
    """Stands in for a grpc.Channel; records the method paths stubs bind."""

    def __init__(self) -> None:
        self.calls: dict[str, str] = {}

    def _recorder(self, kind: str) -> Any:
        def bind(path: str, *args: Any, **kwargs: Any) -> None:
            self.calls[path] = kind

        return bind

    def __getattr__(self, kind: str) -> Any:
        if kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            return self._recorder(kind)
        raise AttributeError(kind)


def test_generated_grpc_stubs_use_upstream_paths() -> None:
    channel = _RecordingChannel()
    # The generated grpc modules are untyped; bind the stub classes as Any.
    stubs: list[Any] = [
        stargate_pb2_grpc.StargateControlPlaneStub,
        stargate_pb2_grpc.StargateModelDiscoveryStub,
        llm_gateway_pb2_grpc.LlmGatewayStub,
    ]
    for stub in stubs:
        stub(channel)
    assert channel.calls == {
        "/stargate.StargateControlPlane/WatchStargates": "unary_stream",
        "/stargate.StargateControlPlane/RegisterInferenceServer": "stream_stream",
        "/stargate.StargateModelDiscovery/ListModels": "unary_unary",
        "/llm_gateway.LlmGateway/AuthLlmWorker": "unary_unary",
    }


def test_presence_tracking() -> None:
    messages = _messages(STARGATE_FILE)
    (routing_key,) = [f for f in messages["ListModelsRequest"].field if f.name == "routing_key"]
    assert routing_key.proto3_optional, "routing_key must be declared `optional string`"
    assert stargate_pb2.ListModelsRequest.DESCRIPTOR.fields_by_name["routing_key"].has_presence
    assert stargate_pb2.InferenceServerModelRegistration.DESCRIPTOR.fields_by_name[
        "stats"
    ].has_presence
    # No other field is presence-tracked via `optional`.
    optional_fields = {
        (m.name, f.name)
        for file_proto in (STARGATE_FILE, LLM_GATEWAY_FILE)
        for m in file_proto.message_type
        for f in m.field
        if f.proto3_optional
    }
    assert optional_fields == {("ListModelsRequest", "routing_key")}

    request = stargate_pb2.ListModelsRequest()
    assert not request.HasField("routing_key")
    request.routing_key = ""
    assert request.HasField("routing_key")

    model = stargate_pb2.InferenceServerModelRegistration()
    assert not model.HasField("stats")
    model.stats.SetInParent()
    assert model.HasField("stats")


# --------------------------------------------------------------------------
# 3. Wire
# --------------------------------------------------------------------------


def test_registration_round_trip() -> None:
    registration = stargate_pb2.InferenceServerRegistration(
        inference_server_id="pylon-0",
        inference_server_url="http://10.0.0.7:8000",
        reverse_tunnel=False,
        cluster_id="cluster-a",
    )
    with_stats = registration.models["llama"]
    with_stats.status = stargate_pb2.INFERENCE_SERVER_STATUS_ACTIVE
    with_stats.stats.last_mean_input_tps = 1234.5
    with_stats.stats.queue_size = 3
    with_stats.stats.max_engine_concurrency = 64
    with_stats.stats.stats_observed_at_unix_ms = 1_764_000_000_000
    with_stats.stats.queue_time_estimate_ms_by_priority[0] = 120
    with_stats.stats.queue_time_estimate_ms_by_priority[2**32 - 1] = 2**64 - 1
    with_stats.stats.stats_capabilities.extend(["kv_cache", "queue_time"])
    with_stats.stats.stats_sources.append("vllm")
    registration.models["mistral"].status = stargate_pb2.INFERENCE_SERVER_STATUS_INACTIVE

    decoded = stargate_pb2.InferenceServerRegistration.FromString(registration.SerializeToString())
    assert decoded == registration
    assert set(decoded.models) == {"llama", "mistral"}
    assert decoded.models["llama"].HasField("stats")
    assert not decoded.models["mistral"].HasField("stats")
    assert dict(decoded.models["llama"].stats.queue_time_estimate_ms_by_priority) == {
        0: 120,
        2**32 - 1: 2**64 - 1,
    }
    assert decoded.models["mistral"].status == stargate_pb2.INFERENCE_SERVER_STATUS_INACTIVE


def test_hand_encoded_bytes_decode() -> None:
    # InferenceServerRegistration: 1 id, 2 url, 3 models{"m": {2 status=ACTIVE}}, 4 bool, 5 cluster.
    registration = stargate_pb2.InferenceServerRegistration.FromString(
        b"\x0a\x02id"  # field 1, length-delimited
        b"\x12\x03u:1"  # field 2
        b"\x1a\x07\x0a\x01m\x12\x02\x10\x01"  # field 3 map entry: key=1 "m", value=2 {status=1}
        b"\x20\x01"  # field 4 varint
        b"\x2a\x01c"  # field 5
    )
    assert registration.inference_server_id == "id"
    assert registration.inference_server_url == "u:1"
    assert registration.reverse_tunnel is True
    assert registration.cluster_id == "c"
    assert registration.models["m"].status == stargate_pb2.INFERENCE_SERVER_STATUS_ACTIVE
    assert not registration.models["m"].HasField("stats")

    # ModelStats: 1 double (tag 0x09), 12 map<u32,u64> (tag 0x62), 15 u64 (tag 0x78),
    # 16 repeated string (tag 0x82 0x01).
    stats = stargate_pb2.ModelStats.FromString(
        b"\x09"
        + struct.pack("<d", 1.5)
        + b"\x62\x05\x08\x01\x10\xac\x02"
        + b"\x78\x05"
        + b"\x82\x01\x03gpu"
    )
    assert stats.last_mean_input_tps == 1.5
    assert dict(stats.queue_time_estimate_ms_by_priority) == {1: 300}
    assert stats.stats_observed_at_unix_ms == 5
    assert list(stats.stats_capabilities) == ["gpu"]

    # ListModelsRequest: an explicitly empty routing_key (field 2) is present on the wire.
    request = stargate_pb2.ListModelsRequest.FromString(b"\x0a\x01a\x12\x00")
    assert list(request.model_ids) == ["a"]
    assert request.HasField("routing_key") and request.routing_key == ""
    assert stargate_pb2.ListModelsRequest(routing_key="").SerializeToString() == b"\x12\x00"
    assert stargate_pb2.ListModelsRequest().SerializeToString() == b""

    # InferenceServerAck: field 3 follows reserved field 2.
    ack = stargate_pb2.InferenceServerAck(
        reverse_tunnel_target="t", reverse_tunnel_pylon_dial_addr="d"
    )
    assert ack.SerializeToString() == b"\x0a\x01t\x1a\x01d"

    # StargateInfo / WatchStargatesResponse nesting.
    response = stargate_pb2.WatchStargatesResponse.FromString(
        b"\x0a\x08"  # field 1: StargateInfo, 8 bytes
        b"\x0a\x01s"  # .stargate_id
        b"\x12\x03h:1"  # .advertise_addr
        b"\x12\x04seed"  # field 2: watch_stargate_urls
    )
    assert response.stargates[0].stargate_id == "s"
    assert response.stargates[0].advertise_addr == "h:1"
    assert list(response.watch_stargate_urls) == ["seed"]

    # llm_gateway camelCase fields, both number 1.
    assert (
        llm_gateway_pb2.AuthLlmWorkerRequest(workerToken="tok").SerializeToString()
        == b"\x0a\x03tok"
    )
    assert llm_gateway_pb2.AuthLlmWorkerResponse.FromString(b"\x0a\x02rk").routingKey == "rk"
