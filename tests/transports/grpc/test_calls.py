"""What sessiontape's gRPC endpoint does with a call that grpc.aio used to do for it:
compressed requests, deadlines, unknown methods, and HTTP/2 requests that are not gRPC
calls or end inside a message (sent with the ``h2`` library, byte by byte, as a broken
or hostile client would). Every refused call leaves the log unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass, field
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from sessiontape.core.events import T
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as kgrpc
from sessiontape.transports.grpc.guard import guarded
from tests.transports.grpc.conftest import Serve, Served

APPEND = "/kakeya.v1.RuntimeService/AppendTokens"
GENERATE = "/kakeya.v1.RuntimeService/Generate"


def grpc_frame(payload: bytes, compressed: bool = False) -> bytes:
    return struct.pack(">BI", int(compressed), len(payload)) + payload


@dataclass
class Answer:
    """What a raw HTTP/2 request got back."""

    headers: dict[str, str] = field(default_factory=dict)
    trailers: dict[str, str] = field(default_factory=dict)
    data_frames: list[bytes] = field(default_factory=list)

    @property
    def status(self) -> int | None:
        """The gRPC status, from the trailers (or a trailers-only response's headers)."""
        raw = self.trailers.get("grpc-status", self.headers.get("grpc-status"))
        return None if raw is None else int(raw)

    def messages(self) -> list[bytes]:
        body, out = b"".join(self.data_frames), []
        while body:
            _, n = struct.unpack(">BI", body[:5])
            out.append(body[5 : 5 + n])
            body = body[5 + n :]
        return out


def request_headers(
    port: int,
    path: str,
    method: str = "POST",
    content_type: str = "application/grpc",
    extra: tuple[tuple[str, str], ...] = (),
) -> list[tuple[str, str]]:
    return [
        (":method", method),
        (":scheme", "http"),
        (":authority", f"127.0.0.1:{port}"),
        (":path", path),
        ("content-type", content_type),
        ("te", "trailers"),
        *extra,
    ]


async def raw_call(
    port: int,
    path: str,
    body: bytes,
    *,
    method: str = "POST",
    content_type: str = "application/grpc",
    extra: tuple[tuple[str, str], ...] = (),
    end: bool = True,
    window: int | None = None,
) -> Answer:
    """One HTTP/2 request on a fresh connection, read until the server ends its stream
    (``window``: the stream flow-control window the client grants, in bytes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    if window is not None:
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    headers = request_headers(port, path, method, content_type, extra)
    conn.send_headers(1, headers, end_stream=not body and end)
    if body:
        conn.send_data(1, body, end_stream=end)
    writer.write(conn.data_to_send())
    answer = Answer()
    try:
        async with asyncio.timeout(10):
            while True:
                data = await reader.read(65536)
                if not data:
                    return answer
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.events.ResponseReceived):
                        answer.headers = {k.decode(): v.decode() for k, v in ev.headers}
                    elif isinstance(ev, h2.events.TrailersReceived):
                        answer.trailers = {k.decode(): v.decode() for k, v in ev.headers}
                    elif isinstance(ev, h2.events.DataReceived):
                        answer.data_frames.append(ev.data)
                        conn.acknowledge_received_data(ev.flow_controlled_length, 1)
                    elif isinstance(ev, h2.events.StreamEnded | h2.events.StreamReset):
                        return answer
                writer.write(conn.data_to_send())
    finally:
        writer.close()


async def kakeya_session(served: Served) -> str:
    async with grpc.aio.insecure_channel(served.target) as ch:
        resp = await kgrpc.RuntimeServiceStub(ch).CreateSession(kpb.CreateSessionRequest())
    return str(resp.session_id)


async def full_length_session(server: Served) -> tuple[int, str]:
    """The server's port and a new Kakeya session whose generations run to max_tokens."""
    engine = server.runtime.engine
    assert isinstance(engine, ReferenceEngine)
    engine.eos_bias = -1000.0
    assert server.transport.port is not None
    return server.transport.port, await kakeya_session(server)


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate])
async def test_compressed_requests_are_inflated(
    server: Served, compression: grpc.Compression
) -> None:
    sid = await kakeya_session(server)
    async with grpc.aio.insecure_channel(server.target, compression=compression) as ch:
        stub = kgrpc.RuntimeServiceStub(ch)
        resp = await stub.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[7] * 500))
    assert resp.history_length == 500
    st = await server.runtime.sessions.load(sid)
    assert list(st.tokens) == [7] * 500


async def test_a_deadline_ends_a_running_generation_and_it_is_recorded(server: Served) -> None:
    engine = server.runtime.engine
    assert isinstance(engine, ReferenceEngine)
    engine.eos_bias, engine.step_delay_s = -1000.0, 0.002
    sid = await kakeya_session(server)
    async with grpc.aio.insecure_channel(server.target) as ch:
        stub = kgrpc.RuntimeServiceStub(ch)
        await stub.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[1, 2]))
        call = stub.Generate(kpb.GenerateRequest(session_id=sid, max_tokens=5000), timeout=0.3)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(300):  # the server records the end once its task has unwound
        evs = await server.runtime.log.read(sid, 1, None)
        fins = [e for e in evs if e.type == T.GENERATION_FINISHED]
        if fins:
            break
        await asyncio.sleep(0.01)
    assert [f.body["finish_reason"] for f in fins] == ["cancelled"]
    assert 0 < fins[0].body["completion_tokens"] < 5000


async def test_an_unknown_method_is_unimplemented(server: Served) -> None:
    before = await server.runtime.log.last_position()
    async with grpc.aio.insecure_channel(server.target) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ch.unary_unary("/kakeya.v1.RuntimeService/Nope")(b"")
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "/kakeya.v1.RuntimeService/Nope" in (err.value.details() or "")
    assert await server.runtime.log.last_position() == before


async def test_requests_that_are_not_grpc_calls_are_refused(server: Served) -> None:
    port = server.transport.port
    assert port is not None
    get = await raw_call(port, APPEND, b"", method="GET")
    assert get.headers[":status"] == "405"
    text = await raw_call(port, APPEND, b"hello", content_type="text/plain")
    assert text.headers[":status"] == "415"


async def test_a_request_that_ends_inside_a_message_is_invalid_argument(server: Served) -> None:
    port = server.transport.port
    assert port is not None
    sid = await kakeya_session(server)
    before = await server.runtime.log.last_position()
    whole = kpb.AppendTokensRequest(session_id=sid, token_ids=[5, 6, 7]).SerializeToString()
    for body in (grpc_frame(whole)[:3], grpc_frame(whole)[:-2]):  # in the prefix; in the bytes
        answer = await raw_call(port, APPEND, body)
        assert answer.status == grpc.StatusCode.INVALID_ARGUMENT.value[0], answer
        assert "ended inside a message" in answer.headers.get("grpc-message", "")
    assert await server.runtime.log.last_position() == before


async def test_a_message_over_the_limit_is_refused_before_its_bytes_come(serve: Serve) -> None:
    served = await serve(max_message_bytes=2048)
    port = served.transport.port
    assert port is not None
    # the prefix announces 1 MiB; not one byte of it is sent, and the stream stays open:
    # the answer can only come from the prefix
    answer = await raw_call(port, APPEND, struct.pack(">BI", 0, 1 << 20), end=False)
    assert answer.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "exceeds the limit of 2048" in answer.headers.get("grpc-message", "")


async def test_an_unknown_compression_is_invalid_argument(server: Served) -> None:
    port = server.transport.port
    assert port is not None
    sid = await kakeya_session(server)
    before = await server.runtime.log.last_position()
    whole = kpb.AppendTokensRequest(session_id=sid, token_ids=[5]).SerializeToString()
    for encoding, body in (("snappy", whole), ("gzip", b"not gzip at all")):
        answer = await raw_call(
            port, APPEND, grpc_frame(body, compressed=True), extra=(("grpc-encoding", encoding),)
        )
        assert answer.status == grpc.StatusCode.INVALID_ARGUMENT.value[0], answer
    assert await server.runtime.log.last_position() == before


async def test_a_committed_run_goes_out_in_one_write(server: Served) -> None:
    """A generation's messages go out run by run, a committed run's in one write: its
    last tokens and its done message (committed together with them) in one DATA frame,
    and fewer frames than messages."""
    port, sid = await full_length_session(server)
    req = kpb.GenerateRequest(session_id=sid, max_tokens=16, seed=1, temperature=0.0)
    answer = await raw_call(port, GENERATE, grpc_frame(req.SerializeToString()))
    assert answer.status == 0, answer
    messages = [kpb.GenerateResponse.FromString(m) for m in answer.messages()]
    assert [m.WhichOneof("payload") for m in messages] == ["token_id"] * 16 + ["done"]
    evs = await server.runtime.log.read(sid, 1, None)
    assert [m.token_id for m in messages[:16]] == [
        e.body["token"] for e in evs if e.type == T.GENERATION_TOKEN
    ]
    per_frame = [len(Answer(data_frames=[f]).messages()) for f in answer.data_frames]
    assert len(per_frame) < 17 and per_frame[-1] >= 2, per_frame


@pytest.mark.parametrize("window", [1, 7])
async def test_answers_wider_than_the_clients_window_arrive_whole(
    server: Served, window: int
) -> None:
    """A client that takes a few bytes at a time (its HTTP/2 window) gets every answer
    whole and in order: the endpoint waits for the window rather than overrun it."""
    port, sid = await full_length_session(server)
    append = kpb.AppendTokensRequest(session_id=sid, token_ids=[5, 6, 7]).SerializeToString()
    answer = await raw_call(port, APPEND, grpc_frame(append), window=window)
    assert answer.status == 0, answer
    assert all(len(f) <= window for f in answer.data_frames)
    assert kpb.AppendTokensResponse.FromString(answer.messages()[0]).history_length == 3
    gen = kpb.GenerateRequest(session_id=sid, max_tokens=16, seed=1, temperature=0.0)
    answer = await raw_call(port, GENERATE, grpc_frame(gen.SerializeToString()), window=window)
    assert answer.status == 0, answer
    messages = [kpb.GenerateResponse.FromString(m) for m in answer.messages()]
    evs = await server.runtime.log.read(sid, 1, None)
    assert [m.token_id for m in messages[:16]] == [
        e.body["token"] for e in evs if e.type == T.GENERATION_TOKEN
    ]
    assert messages[16].done.generated_token_count == 16


@pytest.mark.parametrize(
    "header",
    [("x-bin", "a"), ("grpc-timeout", "9" * 40 + "m"), ("grpc-timeout", "abc")],
    ids=["bad-binary-metadata", "huge-timeout", "bad-timeout"],
)
async def test_malformed_request_headers_are_invalid_argument(
    server: Served, header: tuple[str, str]
) -> None:
    port = server.transport.port
    assert port is not None
    sid = await kakeya_session(server)
    before = await server.runtime.log.last_position()
    req = kpb.AppendTokensRequest(session_id=sid, token_ids=[5]).SerializeToString()
    answer = await raw_call(port, APPEND, grpc_frame(req), extra=(header,))
    assert answer.status == grpc.StatusCode.INVALID_ARGUMENT.value[0], answer
    assert await server.runtime.log.last_position() == before


async def test_calls_reset_as_they_start_leave_the_connection_usable(server: Served) -> None:
    """Requests whose client resets them in the same write as their body (so their task is
    cancelled before it runs) still give their stream back and acknowledge its bytes: past
    the connection's 4 MiB window, the next call on the connection is answered."""
    port = server.transport.port
    assert port is not None
    sid = await kakeya_session(server)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    headers = request_headers(port, APPEND)
    body = grpc_frame(b"x" * 16000)
    stream_id = 1
    try:
        async with asyncio.timeout(20):
            for _ in range(300):  # 4.8 MB, more than the connection's window
                while conn.outbound_flow_control_window < len(body):
                    for ev in conn.receive_data(await reader.read(65536)):
                        assert not isinstance(ev, h2.events.ConnectionTerminated), ev
                conn.send_headers(stream_id, headers)
                conn.send_data(stream_id, body)
                conn.reset_stream(stream_id)
                writer.write(conn.data_to_send())
                stream_id += 2
            req = kpb.AppendTokensRequest(session_id=sid, token_ids=[9]).SerializeToString()
            conn.send_headers(stream_id, headers)
            conn.send_data(stream_id, grpc_frame(req), end_stream=True)
            writer.write(conn.data_to_send())
            trailers: dict[bytes, bytes] = {}
            while not trailers:
                for ev in conn.receive_data(await reader.read(65536)):
                    if isinstance(ev, h2.events.TrailersReceived) and ev.stream_id == stream_id:
                        trailers = dict(ev.headers)
                writer.write(conn.data_to_send())
    finally:
        writer.close()
    assert trailers[b"grpc-status"] == b"0"
    assert list((await server.runtime.sessions.load(sid)).tokens) == [9]


async def test_a_streaming_call_ended_before_it_read_keeps_its_status(server: Served) -> None:
    """A servicer that ends a client-streaming call before reading a request: grpcio's
    client, which writes its first request as the call starts, gets the status sent, not
    the INTERNAL it reports when its write finds the call over."""

    async def refuse(requests: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not now")
        yield  # pragma: no cover - makes this an async generator

    grpc_server = server.transport.server
    assert grpc_server is not None
    path = "/test.Early/Refuse"
    grpc_server.methods[path] = guarded(path, grpc.stream_stream_rpc_method_handler(refuse))
    codes = []
    async with grpc.aio.insecure_channel(server.target) as ch:
        for _ in range(20):
            call = ch.stream_stream(path)()
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await call.write(b"\x08\x01")
            codes.append(await call.code())
    assert set(codes) == {grpc.StatusCode.FAILED_PRECONDITION}, codes


async def test_the_token_is_asked_before_a_method_is_looked_up(serve: Serve) -> None:
    served = await serve(token="s3cret")
    async with grpc.aio.insecure_channel(served.target) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ch.unary_unary("/kakeya.v1.RuntimeService/Nope")(b"")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
