"""Server reflection under both names clients ask for: ``grpc.reflection.v1`` and ``v1alpha``.

grpcio-reflection (1.85) ships only ``grpc.reflection.v1alpha.ServerReflection``;
current grpcurl, Postman and the other gRPC tooling try
``grpc.reflection.v1.ServerReflection`` first. The two protocols are the same
messages with the same field numbers under another package name, so v1 is
served here by the same servicer, on its own method path, with v1alpha's
(wire-identical) message classes. v1's own descriptor
(``grpc/reflection/v1/reflection.proto``, v1alpha's file renamed) is added to
the descriptor pool, so a client can describe the v1 service too.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as alpha

V1ALPHA_SERVICE: str = reflection.SERVICE_NAME
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
SERVICE_NAMES = (V1_SERVICE, V1ALPHA_SERVICE)


def _rename(name: str) -> str:
    return name.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")


def _rename_messages(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    for m in messages:
        for f in m.field:
            if f.type_name:
                f.type_name = _rename(f.type_name)
        _rename_messages(m.nested_type)


def register_v1_descriptor(pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Add v1's file to ``pool`` (the default pool) once."""
    pool = pool or descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    alpha.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = V1_FILE, "grpc.reflection.v1"
    fdp.options.Clear()
    fdp.options.java_package = "io.grpc.reflection.v1"
    fdp.options.java_outer_classname = "ServerReflectionProto"
    fdp.options.java_multiple_files = True
    fdp.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    _rename_messages(fdp.message_type)
    for svc in fdp.service:
        for method in svc.method:
            method.input_type, method.output_type = (
                _rename(method.input_type),
                _rename(method.output_type),
            )
    pool.AddSerializedFile(fdp.SerializeToString())


def enable(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection over ``service_names`` (plus both reflection services) as v1 and v1alpha."""
    register_v1_descriptor()
    names = [*service_names, *SERVICE_NAMES]
    reflection.enable_server_reflection(names, server)
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.method_handlers_generic_handler(
        V1_SERVICE,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=alpha.ServerReflectionRequest.FromString,
                response_serializer=alpha.ServerReflectionResponse.SerializeToString,
            ),
        },
    )
    server.add_generic_rpc_handlers((handler,))
