"""gRPC server reflection on the replica's gRPC ports, so `grpcurl` can list and describe them.

Served under both `grpc.reflection.v1alpha.ServerReflection` (what grpcio-reflection and older
clients speak) and `grpc.reflection.v1.ServerReflection` (what current grpcurl and grpc-go try
first). The two protocols are the same messages in two packages, so one handler decoding the
v1alpha messages answers both. grpcio-reflection ships only the v1alpha descriptor; the v1 one is
derived from it (same messages, package and options renamed) so that listing v1 does not name a
service that `describe` cannot resolve.

Answers follow grpcio-reflection's servicer: a file request returns the file's
`FileDescriptorProto` first, then those of its transitive dependencies, serialized; a name that
resolves to nothing returns an `error_response` with NOT_FOUND and the stream goes on; a request
naming no query returns INVALID_ARGUMENT the same way. The index reads a private descriptor pool
holding only the files it was given (and their dependencies), so reflection describes what the
port serves rather than whatever this process happens to have imported.

`ReflectionIndex.answer` is pure; `reflection_methods` adds the stream I/O.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Final, Protocol

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message import Message
from grpc_reflection.v1alpha import reflection_pb2

from stargate.grpc_asgi import (
    GrpcMethod,
    GrpcStatus,
    RequestStream,
    RpcContext,
    stream_stream,
)

__all__ = [
    "REFLECTION_SERVICES",
    "REFLECTION_V1",
    "REFLECTION_V1ALPHA",
    "FileDescriptorLike",
    "ReflectionIndex",
    "file_proto",
    "reflection_methods",
    "v1_reflection_file",
]

REFLECTION_V1ALPHA: Final = "grpc.reflection.v1alpha.ServerReflection"
REFLECTION_V1: Final = "grpc.reflection.v1.ServerReflection"
REFLECTION_SERVICES: Final = (REFLECTION_V1ALPHA, REFLECTION_V1)

_V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"
_V1_PACKAGE = "grpc.reflection.v1"
_V1_FILENAME = "grpc/reflection/v1/reflection.proto"


class FileDescriptorLike(Protocol):
    """A generated module's `DESCRIPTOR`.

    The type stubs call it `google.protobuf.descriptor.FileDescriptor` for some modules and upb's
    `FileDescriptor` for others; this is the part of both that reflection reads.
    """

    @property
    def name(self) -> str: ...

    @property
    def dependencies(self) -> Sequence[FileDescriptorLike]: ...

    def CopyToProto(self, proto: descriptor_pb2.FileDescriptorProto, /) -> None: ...


def file_proto(descriptor: FileDescriptorLike) -> descriptor_pb2.FileDescriptorProto:
    """`descriptor` as a `FileDescriptorProto` (without source info, as grpcio-reflection)."""
    proto = descriptor_pb2.FileDescriptorProto()
    descriptor.CopyToProto(proto)
    return proto


def v1_reflection_file() -> descriptor_pb2.FileDescriptorProto:
    """`grpc/reflection/v1/reflection.proto`, from the v1alpha file grpcio-reflection ships.

    Upstream made v1 by copying v1alpha under a new package; this does the same to the
    descriptor: rename the file and package, repoint every type reference, and use v1's options.
    """
    proto = file_proto(reflection_pb2.DESCRIPTOR)
    proto.name = _V1_FILENAME
    proto.package = _V1_PACKAGE
    old_prefix, new_prefix = f".{_V1ALPHA_PACKAGE}.", f".{_V1_PACKAGE}."

    def repoint(owner: Message, attribute: str) -> None:
        # Only fields that are set: descriptor.proto is proto2, so assigning "" would mark an
        # absent type name present (and the pool would reject a scalar field with a type name).
        type_name = getattr(owner, attribute)
        if type_name.startswith(old_prefix):
            setattr(owner, attribute, new_prefix + type_name[len(old_prefix) :])

    messages = list(proto.message_type)
    while messages:
        message = messages.pop()
        messages.extend(message.nested_type)
        for field in [*message.field, *message.extension]:
            repoint(field, "type_name")
            repoint(field, "extendee")
    for service in proto.service:
        for method in service.method:
            repoint(method, "input_type")
            repoint(method, "output_type")
    proto.options.Clear()
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    proto.options.java_multiple_files = True
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_outer_classname = "ServerReflectionProto"
    return proto


class ReflectionIndex:
    """The services one port lists and the files that describe them.

    `files` are the files defining the port's services (dependencies are followed); the reflection
    protocol's own files are always added. Construction fails if a listed service is not defined
    by those files, so every name `list_services` returns can be described.
    """

    def __init__(self, services: Iterable[str], files: Iterable[FileDescriptorLike]) -> None:
        protos: dict[str, descriptor_pb2.FileDescriptorProto] = {}
        for descriptor in files:
            _collect(descriptor, protos)
        _collect(reflection_pb2.DESCRIPTOR, protos)
        v1 = v1_reflection_file()
        protos[v1.name] = v1
        self._pool = descriptor_pool.DescriptorPool()
        self._serialized: dict[str, bytes] = {}
        self._dependencies: dict[str, tuple[str, ...]] = {}
        for proto in _dependencies_first(protos):
            data = proto.SerializeToString()
            self._pool.AddSerializedFile(data)
            self._serialized[proto.name] = data
            self._dependencies[proto.name] = tuple(proto.dependency)
        self.services: tuple[str, ...] = tuple(sorted({*services, *REFLECTION_SERVICES}))
        for service in self.services:
            try:
                self._pool.FindServiceByName(service)
            except KeyError:
                raise ValueError(f"no descriptor defines the service {service}") from None

    @property
    def filenames(self) -> tuple[str, ...]:
        """Every file this index can return, dependencies first."""
        return tuple(self._serialized)

    def answer(
        self, request: reflection_pb2.ServerReflectionRequest
    ) -> reflection_pb2.ServerReflectionResponse:
        """The response to one request of a `ServerReflectionInfo` stream."""
        query = request.WhichOneof("message_request")
        response = reflection_pb2.ServerReflectionResponse(
            valid_host=request.host, original_request=request
        )
        try:
            if query == "file_by_filename":
                self._add_files(response, self._pool.FindFileByName(request.file_by_filename).name)
            elif query == "file_containing_symbol":
                self._add_files(response, self._file_of_symbol(request.file_containing_symbol))
            elif query == "file_containing_extension":
                wanted = request.file_containing_extension
                message = self._pool.FindMessageTypeByName(wanted.containing_type)
                extension = self._pool.FindExtensionByNumber(message, wanted.extension_number)
                self._add_files(
                    response, self._pool.FindFileContainingSymbol(extension.full_name).name
                )
            elif query == "all_extension_numbers_of_type":
                message = self._pool.FindMessageTypeByName(request.all_extension_numbers_of_type)
                numbers = sorted(ext.number for ext in self._pool.FindAllExtensions(message))
                response.all_extension_numbers_response.base_type_name = message.full_name
                response.all_extension_numbers_response.extension_number.extend(numbers)
            elif query == "list_services":
                response.list_services_response.service.extend(
                    reflection_pb2.ServiceResponse(name=name) for name in self.services
                )
            else:
                response.error_response.error_code = int(GrpcStatus.INVALID_ARGUMENT)
                response.error_response.error_message = "the request names no query"
        except KeyError:
            # `message_response` is a oneof: setting the error replaces any partial answer.
            response.error_response.error_code = int(GrpcStatus.NOT_FOUND)
            response.error_response.error_message = f"{query} {_query_value(request)!r} not found"
        return response

    def _file_of_symbol(self, symbol: str) -> str:
        """The file defining `symbol`: a message, field, enum, value, service or method.

        The upb pool does not resolve method names by themselves (grpcio-reflection therefore
        cannot describe `pkg.Service.Method`); `grpcurl describe` asks for them, so look them up
        as methods when the generic lookup fails.
        """
        try:
            return self._pool.FindFileContainingSymbol(symbol).name
        except KeyError:
            return self._pool.FindMethodByName(symbol).containing_service.file.name

    def _add_files(self, response: reflection_pb2.ServerReflectionResponse, name: str) -> None:
        """The file `name` first, then its transitive dependencies, each once."""
        order: list[str] = []
        pending = [name]
        while pending:
            current = pending.pop(0)
            if current in order:
                continue
            order.append(current)
            pending.extend(self._dependencies[current])
        response.file_descriptor_response.file_descriptor_proto.extend(
            self._serialized[filename] for filename in order
        )


def reflection_methods(index: ReflectionIndex) -> list[GrpcMethod]:
    """`ServerReflectionInfo` under both protocol versions, answering from `index`."""

    async def server_reflection_info(
        requests: RequestStream[reflection_pb2.ServerReflectionRequest],
        context: RpcContext,
        send: Callable[[reflection_pb2.ServerReflectionResponse], Awaitable[None]],
    ) -> None:
        """One response per request, in order, until the client half-closes."""
        async for request in requests:
            await send(index.answer(request))

    return [
        stream_stream(
            f"/{service}/ServerReflectionInfo",
            reflection_pb2.ServerReflectionRequest,
            server_reflection_info,
        )
        for service in REFLECTION_SERVICES
    ]


def _collect(
    descriptor: FileDescriptorLike, into: dict[str, descriptor_pb2.FileDescriptorProto]
) -> None:
    """`descriptor` and its transitive dependencies, as protos by file name."""
    if descriptor.name in into:
        return
    into[descriptor.name] = file_proto(descriptor)
    for dependency in descriptor.dependencies:
        _collect(dependency, into)


def _dependencies_first(
    protos: dict[str, descriptor_pb2.FileDescriptorProto],
) -> list[descriptor_pb2.FileDescriptorProto]:
    """The files in an order a descriptor pool accepts: each after everything it imports."""
    ordered: list[descriptor_pb2.FileDescriptorProto] = []
    placed: set[str] = set()

    def place(name: str) -> None:
        if name in placed:
            return
        placed.add(name)  # imports cannot be circular, so marking before recursing is safe
        for dependency in protos[name].dependency:
            place(dependency)
        ordered.append(protos[name])

    for name in protos:
        place(name)
    return ordered


def _query_value(request: reflection_pb2.ServerReflectionRequest) -> str:
    """What the request asked about, for a NOT_FOUND message."""
    if request.HasField("file_containing_extension"):
        wanted = request.file_containing_extension
        return f"{wanted.containing_type}#{wanted.extension_number}"
    query = request.WhichOneof("message_request")
    return "" if query is None else str(getattr(request, query))
