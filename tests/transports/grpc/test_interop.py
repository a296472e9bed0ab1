"""Independent gRPC implementations against the server: grpclib's client (an HTTP/2 of
its own, h2) and grpc-js (Node.js); grpcio's own client is every other test's. Each
makes unary calls one after another on one connection, then streams a generation
whose every token is the one the log holds."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
from tests.transports.grpc.conftest import Served

APPEND = "/kakeya.v1.RuntimeService/AppendTokens"
INTEROP = Path(__file__).resolve().parents[2] / "interop"
PROTOS = Path(__file__).resolve().parents[3] / "transports" / "grpc" / "protos"


def _never_eos(server: Served) -> None:
    engine = server.runtime.engine
    assert isinstance(engine, ReferenceEngine)
    engine.eos_bias = -1000.0


async def test_grpclibs_client(server: Served) -> None:
    from grpclib.client import Channel
    from grpclib.const import Cardinality

    port = server.transport.port
    assert port is not None
    _never_eos(server)
    channel = Channel("127.0.0.1", port)
    try:
        async with channel.request(
            "/kakeya.v1.RuntimeService/CreateSession",
            Cardinality.UNARY_UNARY,
            kpb.CreateSessionRequest,
            kpb.CreateSessionResponse,
        ) as call:
            await call.send_message(kpb.CreateSessionRequest(), end=True)
            created = await call.recv_message()
            assert created is not None
            sid = created.session_id

        async def append(tokens: list[int]) -> int:
            async with channel.request(
                APPEND, Cardinality.UNARY_UNARY, kpb.AppendTokensRequest, kpb.AppendTokensResponse
            ) as call:
                await call.send_message(
                    kpb.AppendTokensRequest(session_id=sid, token_ids=tokens), end=True
                )
                reply = await call.recv_message()
                assert reply is not None
                return int(reply.history_length)

        assert [await append([i]) for i in range(1, 6)] == [1, 2, 3, 4, 5]
        async with channel.request(
            "/kakeya.v1.RuntimeService/Generate",
            Cardinality.UNARY_STREAM,
            kpb.GenerateRequest,
            kpb.GenerateResponse,
        ) as call:
            await call.send_message(
                kpb.GenerateRequest(session_id=sid, max_tokens=3000, seed=1), end=True
            )
            replies = [m async for m in call]
    finally:
        channel.close()
    tokens = [m.token_id for m in replies if m.WhichOneof("payload") == "token_id"]
    assert len(tokens) == 3000 and replies[-1].done.generated_token_count == 3000
    assert list((await server.runtime.sessions.load(sid)).tokens)[5:] == tokens


async def test_grpc_js_client(server: Served) -> None:
    node = shutil.which("node")
    modules = INTEROP / "node_modules" / "@grpc" / "grpc-js"
    if node is None or not modules.is_dir():
        pytest.skip("needs Node.js and tests/interop's packages (scripts/setup installs them)")
    _never_eos(server)
    # the server runs in this event loop: the client runs beside it, not blocking it
    proc = await asyncio.create_subprocess_exec(
        node,
        str(INTEROP / "kakeya_client.js"),
        server.target,
        str(PROTOS),
        "500",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=INTEROP,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()
    out = json.loads(stdout)
    assert out["lengths"] == [1, 2, 3, 4, 5]
    assert len(out["tokens"]) == 500
    assert int(out["done"]["generated_token_count"]) == 500
    stored = await server.runtime.sessions.load(out["session_id"])
    assert list(stored.tokens)[5:] == out["tokens"]
