"""Server reflection as current tools speak it: ``grpc.reflection.v1`` first, ``v1alpha`` still answered.

The v1 client below is what grpcurl does: list the services over
``/grpc.reflection.v1.ServerReflection/ServerReflectionInfo``, then ask for the
file that holds a symbol and decode the FileDescriptorProto. The request and
response messages of v1 and v1alpha are the same on the wire, so v1alpha's
classes encode v1's messages.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as wire

from tests.transports.grpc.conftest import Served

V1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
V1ALPHA = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


async def _ask(
    target: str, path: str, *reqs: wire.ServerReflectionRequest
) -> list[wire.ServerReflectionResponse]:
    async with grpc.aio.insecure_channel(target) as ch:
        call = ch.stream_stream(
            path,
            request_serializer=wire.ServerReflectionRequest.SerializeToString,
            response_deserializer=wire.ServerReflectionResponse.FromString,
        )
        return [r async for r in call(iter(reqs))]


def _files(resp: wire.ServerReflectionResponse) -> list[descriptor_pb2.FileDescriptorProto]:
    return [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in resp.file_descriptor_response.file_descriptor_proto
    ]


async def test_v1_lists_and_describes_every_service(server: Served) -> None:
    [listed] = await _ask(server.target, V1, wire.ServerReflectionRequest(list_services=""))
    names = {s.name for s in listed.list_services_response.service}
    assert {
        "evergreen.v2.EvergreenService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    assert set(server.transport.server.services) <= names  # type: ignore[union-attr]
    for name in names:
        [resp] = await _ask(
            server.target, V1, wire.ServerReflectionRequest(file_containing_symbol=name)
        )
        assert not resp.HasField("error_response"), (name, resp.error_response.error_message)
        files = _files(resp)
        package, _, service = name.rpartition(".")
        [own] = [f for f in files if f.package == package]
        assert service in [s.name for s in own.service], name
    # v1's own descriptor is v1, not v1alpha renamed halfway
    [resp] = await _ask(
        server.target,
        V1,
        wire.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
    )
    [own] = _files(resp)
    assert own.name == "grpc/reflection/v1/reflection.proto"
    method = own.service[0].method[0]
    assert (method.name, method.input_type, method.output_type) == (
        "ServerReflectionInfo",
        ".grpc.reflection.v1.ServerReflectionRequest",
        ".grpc.reflection.v1.ServerReflectionResponse",
    )
    assert all("v1alpha" not in f.type_name for m in own.message_type for f in m.field)


async def test_v1alpha_still_answers_and_unknown_symbols_are_errors(server: Served) -> None:
    [listed] = await _ask(server.target, V1ALPHA, wire.ServerReflectionRequest(list_services=""))
    assert "grpc.reflection.v1.ServerReflection" in {
        s.name for s in listed.list_services_response.service
    }
    [resp] = await _ask(
        server.target, V1, wire.ServerReflectionRequest(file_containing_symbol="nope.v1.Nope")
    )
    assert resp.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
