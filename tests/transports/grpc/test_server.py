"""The gRPC server itself: auth, health, reflection, limits, TLS, options, graceful shutdown."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sessiontape.core.errors import ConfigError
from sessiontape.core.events import T
from sessiontape.core.plugins import TRANSPORTS, available, load
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.grpc.client import (
    EvergreenClient,
    action,
    sampling_config,
    text_fragments,
)
from sessiontape.transports.grpc.plugin import GrpcTransport
from tests.conftest import make_config
from tests.transports.grpc.conftest import Serve, Served

EVERGREEN = "evergreen.v2.EvergreenService"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


async def _list_services(target: str, metadata: tuple[tuple[str, str], ...] = ()) -> list[str]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        names = []
        async for r in stub.ServerReflectionInfo(iter([req]), metadata=metadata):
            names.extend(s.name for s in r.list_services_response.service)
        return names


async def _one_generate(client: EvergreenClient, **params: object) -> tuple[str, dict[str, bytes]]:
    async with client.session() as s:
        await s.send(
            actions=[
                action(
                    "GENERATE",
                    inputs={"p": "p"},
                    outputs={"text": "r"},
                    configs=[sampling_config(**(params or {"max_tokens": 4}))],
                )
            ],
            fragments=text_fragments("p", "hello"),
        )
        await s.done_writing()
        nodes = await s.collect()
        return await s.session_id(), nodes


def test_entry_point_is_the_grpc_transport() -> None:
    assert load(TRANSPORTS, "grpc") is GrpcTransport


async def test_health_and_reflection_list_every_service(server: Served) -> None:
    names = await _list_services(server.target)
    assert {EVERGREEN, HEALTH, REFLECTION} <= set(names)
    assert set(server.transport.server.services) <= set(names)  # type: ignore[union-attr]
    async with grpc.aio.insecure_channel(server.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for svc in ("", *names):
            if svc == HEALTH or svc.startswith("grpc.reflection."):
                continue
            resp = await health.Check(health_pb2.HealthCheckRequest(service=svc))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, svc
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health.Check(health_pb2.HealthCheckRequest(service="nope.v1.Nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_bearer_token(serve: Serve) -> None:
    served = await serve(token="s3cret")
    rt = served.runtime
    before = await rt.log.last_position()
    for token in (None, "wrong", "s3cret-but-longer"):
        async with served.client(token=token) as c, c.session() as s:
            # The server refuses the call as it starts, before reading: its status is
            # the call's, read without a write racing it (grpc.aio reports a write
            # that loses that race as INTERNAL, 1 run in 4-15 here).
            assert await s.call.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in (await s.call.details() or "")
    assert await rt.log.last_position() == before  # nothing recorded for rejected calls
    async with served.client(token="s3cret") as c:
        sid, nodes = await _one_generate(c)
    assert "r" in nodes and sid
    # Reflection needs the token; health stays open for probes.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _list_services(served.target)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert EVERGREEN in await _list_services(served.target, (("authorization", "Bearer s3cret"),))
    async with grpc.aio.insecure_channel(served.target) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_message_size_limit(serve: Serve) -> None:
    served = await serve(max_message_bytes=2048)
    rt = served.runtime
    async with served.client() as c, c.session() as s:
        sid = await s.session_id()
        await s.send(fragments=text_fragments("small", "fits"))
        for _ in range(300):  # committed before the oversized message ends the call
            if "small" in (await rt.sessions.load(sid)).nodes:
                break
            await asyncio.sleep(0.01)
        await s.send(fragments=text_fragments("big", "x" * 4096))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s.collect()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for _ in range(300):
        st = await rt.sessions.load(sid)
        if st.status != "open":
            break
        await asyncio.sleep(0.01)
    # The oversized message never reached the session; what came before is kept.
    assert set(st.nodes) == {"small"}
    # grpc rejects the message before the servicer sees it and ends the call. Which
    # way the servicer hears of that is grpc's race, not ours: usually its task is
    # cancelled ("cancelled"), but sometimes (about 1 run in 12 here) the request
    # stream first reads as ended, exactly as when a client half-closes ("client"),
    # and the servicer's context says neither cancelled() nor done() then.
    assert st.status == "closed"
    evs = await rt.log.read(sid, 1, None)
    assert evs[-1].type == T.SESSION_CLOSED and evs[-1].body["reason"] in ("cancelled", "client")


async def test_graceful_shutdown_lets_a_short_stream_finish(serve: Serve) -> None:
    served = await serve()
    async with served.client() as c, c.session() as s:
        await s.send(
            actions=[
                action(
                    "GENERATE",
                    inputs={"p": "p"},
                    outputs={"text": "r"},
                    configs=[sampling_config(max_tokens=20, seed=1)],
                )
            ],
            fragments=text_fragments("p", "hello"),
        )
        await s.done_writing()
        first = await anext(aiter(s))
        assert first.node_fragments
        stopping = asyncio.create_task(served.transport.stop(5.0))
        nodes = await s.collect()  # the rest arrives and the status is OK
        await stopping
        sid = await s.session_id()
    assert "r" in nodes
    evs = await served.runtime.log.read(sid, 1, None)
    assert [e.body["finish_reason"] for e in evs if e.type == T.GENERATION_FINISHED] != [
        "cancelled"
    ]
    assert evs[-1].type == T.SESSION_CLOSED and evs[-1].body["reason"] == "client"


async def test_shutdown_cancels_a_generation_still_running_at_the_deadline(serve: Serve) -> None:
    served = await serve()
    # a generation that cannot end by itself before the deadline: no EOS, a paced engine
    engine = served.runtime.engine
    assert isinstance(engine, ReferenceEngine)
    engine.eos_bias, engine.step_delay_s = -1000.0, 0.002
    async with served.client() as c, c.session() as s:
        sid = await s.session_id()
        await s.send(
            actions=[
                action(
                    "GENERATE",
                    inputs={"p": "p"},
                    outputs={"text": "r"},
                    configs=[sampling_config(max_tokens=4000)],
                )
            ],
            fragments=text_fragments("p", "hello"),
        )
        await anext(aiter(s))
        await served.transport.stop(0.2)
        with pytest.raises(grpc.aio.AioRpcError):
            await s.collect()
    # stop() returned only after the cancellation was recorded.
    st = await served.runtime.sessions.load(sid)
    evs = await served.runtime.log.read(sid, 1, None)
    [fin] = [e for e in evs if e.type == T.GENERATION_FINISHED]
    assert fin.body["finish_reason"] == "cancelled"
    assert 0 < fin.body["completion_tokens"] < 4000
    assert st.status == "closed" and evs[-1].body["reason"] == "cancelled"
    # Everything the client was sent is in the log, in order.
    sent = [e for e in evs if e.type == T.NODE_FRAGMENT and e.body["direction"] == "out"]
    assert [(f.id, f.seq) for m in s.received for f in m.node_fragments] == [
        (e.body["id"], e.body["seq"]) for e in sent
    ][: sum(len(m.node_fragments) for m in s.received)]


def test_services_come_from_the_entry_point_group() -> None:
    from sessiontape.transports.grpc.service import GROUP, GrpcService

    names = available(GROUP)
    assert {"evergreen", "salience", "kakeya"} <= set(names)
    assert all(issubclass(load(GROUP, n), GrpcService) for n in names)


async def test_two_servers_in_one_process_keep_their_streams_apart(serve: Serve) -> None:
    """What a server tracks (open streams, endings) is its own: stopping one leaves the other's alone."""
    a, b = await serve(), await serve()
    async with a.client() as c, c.session() as s:
        sid = await s.session_id()
        await b.transport.stop(0.2)  # drains b's streams: a's open stream is not among them
        await s.send(
            actions=[
                action(
                    "GENERATE",
                    inputs={"p": "p"},
                    outputs={"text": "r"},
                    configs=[sampling_config(max_tokens=4, seed=1)],
                )
            ],
            fragments=text_fragments("p", "hello"),
        )
        await s.done_writing()
        nodes = await s.collect()
    assert "r" in nodes
    evs = await a.runtime.log.read(sid, 1, None)
    assert evs[-1].type == T.SESSION_CLOSED and evs[-1].body["reason"] == "client"


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_tls(serve: Serve, tmp_path: Path) -> None:
    try:
        cert, key = _self_signed(tmp_path)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"openssl cannot make a test certificate: {exc}")
    served = await serve(tls_cert=str(cert), tls_key=str(key))
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    async with served.client(credentials=creds) as c:
        _, nodes = await _one_generate(c)
    assert "r" in nodes
    async with served.client() as plain:  # plaintext to a TLS port fails
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _one_generate(plain)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("options", "text"),
    [
        ({"tls_cert": "/nonexistent/cert.pem"}, "tls_cert and tls_key"),
        (
            {"tls_cert": "/nonexistent/c.pem", "tls_key": "/nonexistent/k.pem"},
            "cannot read TLS files",
        ),
        ({"listen": "nonsense"}, "HOST:PORT"),
        ({"max_message_bytes": -1}, "max_message_bytes"),
    ],
)
async def test_bad_options_are_config_errors(
    serve: Serve, options: dict[str, object], text: str
) -> None:
    with pytest.raises(ConfigError, match=text):
        await serve(**options)


async def test_port_in_use_is_a_config_error(
    serve: Serve, runtime: object, sqlite_url: str
) -> None:
    first = await serve()
    cfg = make_config(sqlite_url)
    second = GrpcTransport(first.runtime, {"listen": first.target}, cfg)
    with pytest.raises(ConfigError, match="cannot listen"):
        await second.start()
