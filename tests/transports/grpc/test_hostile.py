"""Hostile gRPC input: undecodable bytes, bad timestamps, corrupt Any, NaN in Struct and
in sampling parameters are INVALID_ARGUMENT; unexpected failures are INTERNAL with a request id only."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2, struct_pb2

from sessiontape.core.runtime import Runtime
from sessiontape.transports.grpc.client import action, fragment, text_fragments
from sessiontape.transports.grpc.gen.evergreen.v2 import evergreen_pb2
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kakeya_pb2
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as kakeya_grpc
from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2
from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2_grpc as salience_grpc
from sessiontape.transports.grpc.guard import GuardInterceptor
from tests.helpers.evergreen import exchange, msg
from tests.helpers.grpc_calls import raw_call
from tests.transports.grpc.conftest import Serve

#: field 1, length-delimited, length 2**35: truncated whatever the message type
UNDECODABLE = b"\x0a\xff\xff\xff\xff\x0f"
TYPED_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.OK,
}


def methods() -> Iterator[tuple[str, bool, bool]]:
    """(path, client streaming, server streaming) of every method of the three services."""
    for module in (evergreen_pb2, salience_pb2, kakeya_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                yield f"/{service.full_name}/{m.name}", m.client_streaming, m.server_streaming


METHODS = list(methods())


@pytest.mark.parametrize(
    ("path", "cs", "ss"),
    METHODS,
    ids=[m[0].rsplit("/", 2)[1].split(".")[0] + "." + m[0].rsplit("/", 1)[1] for m in METHODS],
)
async def test_undecodable_message_is_invalid_argument(
    serve: Serve, path: str, cs: bool, ss: bool
) -> None:
    server = await serve()
    async with grpc.aio.insecure_channel(server.target) as ch:
        assert await raw_call(ch, path, cs, ss, UNDECODABLE) == grpc.StatusCode.INVALID_ARGUMENT


async def test_undecodable_message_without_token_is_refused(serve: Serve) -> None:
    server = await serve(token="t0k")
    path, cs, ss = METHODS[-1]
    async with grpc.aio.insecure_channel(server.target) as ch:
        code = await raw_call(ch, path, cs, ss, UNDECODABLE)
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED)


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Bearer t0k", True),
        ("bearer t0k", True),
        ("BEARER  t0k", True),
        ("Bearer t0k2", False),
        ("Basic t0k", False),
        ("t0k", False),
    ],
)
async def test_authorization_scheme_is_case_insensitive(
    serve: Serve, header: str, ok: bool
) -> None:
    server = await serve(token="t0k")
    async with grpc.aio.insecure_channel(server.target) as ch:
        stub = kakeya_grpc.RuntimeServiceStub(ch)
        try:
            await stub.CreateSession(
                kakeya_pb2.CreateSessionRequest(), metadata=(("authorization", header),)
            )
            code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
    assert code == (grpc.StatusCode.OK if ok else grpc.StatusCode.UNAUTHENTICATED)


def _struct_any(**values: Any) -> any_pb2.Any:
    s = struct_pb2.Struct()
    s.update(values)
    a = any_pb2.Any()
    a.Pack(s)
    return a


@pytest.mark.parametrize("bad", ["timestamp", "corrupt-any", "nan-struct", "inf-struct"])
async def test_evergreen_bad_values_are_invalid_argument(
    serve: Serve, runtime: Runtime, bad: str
) -> None:
    server = await serve()
    if bad == "timestamp":
        f = fragment("p", data=b"hi", mimetype="text/plain")
        f.chunk_fragment.metadata.capture_time.seconds = 2**62
        messages = [msg(fragments=[f])]
    else:
        config = {
            "corrupt-any": any_pb2.Any(
                type_url="type.googleapis.com/google.protobuf.Struct", value=b"\xff\xff"
            ),
            "nan-struct": _struct_any(temperature=math.nan),
            "inf-struct": _struct_any(max_tokens=math.inf),
        }[bad]
        messages = [
            msg(
                fragments=text_fragments("p", "hi"),
                actions=[
                    action("GENERATE", inputs={"p": "p"}, outputs={"text": "r"}, configs=[config])
                ],
            )
        ]
    async with server.client() as c:
        out = await exchange(c, runtime, *messages)
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT, out.details
    assert "internal" not in out.details


async def test_nan_sampling_parameters_are_invalid_argument_and_store_nothing(
    serve: Serve, runtime: Runtime
) -> None:
    server = await serve()
    async with grpc.aio.insecure_channel(server.target) as ch:
        kakeya = kakeya_grpc.RuntimeServiceStub(ch)
        sid = (await kakeya.CreateSession(kakeya_pb2.CreateSessionRequest())).session_id
        await kakeya.AppendTokens(kakeya_pb2.AppendTokensRequest(session_id=sid, token_ids=[1, 2]))
        before = [e.to_json() for e in await runtime.log.read(sid)]
        for temperature in (math.nan, math.inf, -1.0):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in kakeya.Generate(
                    kakeya_pb2.GenerateRequest(
                        session_id=sid, max_tokens=2, temperature=temperature
                    )
                ):
                    pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [e.to_json() for e in await runtime.log.read(sid)] == before
        salience = salience_grpc.SalienceStub(ch)
        ssid = (await salience.OpenSession(salience_pb2.OpenSessionRequest())).session_id
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in salience.Generate(
                salience_pb2.GenerateRequest(
                    session_id=ssid, append_tokens=[1, 2], max_tokens=2, temperature=math.nan
                )
            ):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_message_size_limit_comes_from_config(serve: Serve) -> None:
    server = await serve(max_message_bytes=2048)
    async with grpc.aio.insecure_channel(server.target) as ch:
        kakeya = kakeya_grpc.RuntimeServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await kakeya.AppendTokens(
                kakeya_pb2.AppendTokensRequest(session_id="s", token_ids=list(range(3000)))
            )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_unexpected_error_is_internal_with_an_id_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def boom(request: bytes, context: Any) -> bytes:
        raise RuntimeError("SELECT secret FROM events")

    server = grpc.aio.server(interceptors=[GuardInterceptor()])
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Boom", {"Boom": grpc.unary_unary_rpc_method_handler(boom)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        with caplog.at_level(logging.ERROR, logger="sessiontape.grpc"):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await ch.unary_unary("/test.Boom/Boom")(b"")
    finally:
        await server.stop(0)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    details = info.value.details() or ""
    assert (
        "SELECT" not in details and "RuntimeError" not in details and "request id req_" in details
    )
    rid = details.rsplit("request id ", 1)[1].rstrip(")")
    records = [r for r in caplog.records if r.name == "sessiontape.grpc"]
    assert len(records) == 1 and rid in records[0].getMessage()
