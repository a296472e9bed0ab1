"""The gRPC endpoint's HTTP/2 (``transports/grpc/http2.py``) against clients that are
not it: frames written by hand here (struct and ``hpack``), the ``h2`` library, and
grpcio. Each protocol error ends its connection with the GOAWAY code RFC 9113 names
and leaves the log and the server's other connections as they were."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import hpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.grpc import calls
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
from sessiontape.transports.grpc.listener import Listener
from tests.fuzz.conftest import QUICK, fuzz_settings
from tests.fuzz.test_grpc_fuzz import Fuzzed, _stored, fuzzed  # noqa: F401
from tests.transports.grpc.conftest import Serve, Served
from tests.transports.grpc.test_calls import (
    APPEND,
    grpc_frame,
    kakeya_session,
    raw_call,
    request_headers,
)

IDLE = "/test.Idle/Wait"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = 0, 1, 3, 4, 5, 6, 7
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, END_HEADERS, PADDED = 0x1, 0x4, 0x8
PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR = 0x1, 0x3, 0x6
REFUSED_STREAM, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x7, 0x9, 0xB


def fr(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, ftype, flags, stream) + payload


@dataclass
class Frame:
    type: int
    flags: int
    stream: int
    payload: bytes


class Raw:
    """A client that writes frames as given and reads the server's back, one by one."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()

    def send(self, *frames: bytes) -> None:
        self.writer.write(b"".join(frames))

    def headers(
        self, stream: int, port: int, path: str = APPEND, flags: int = END_HEADERS
    ) -> bytes:
        return fr(HEADERS, flags, stream, self.encoder.encode(request_headers(port, path)))

    async def frames(self) -> AsyncIterator[Frame]:
        """The server's frames until it closes the connection (10 s at most)."""
        async with asyncio.timeout(10):
            while True:
                try:
                    head = await self.reader.readexactly(9)
                except asyncio.IncompleteReadError:
                    return
                hi, lo, ftype, flags, stream = struct.unpack(">BHBBI", head)
                payload = await self.reader.readexactly(hi << 16 | lo)
                yield Frame(ftype, flags, stream & 0x7FFFFFFF, payload)

    async def goaway(self) -> int:
        """The error code of the server's GOAWAY (after which it must close)."""
        code = None
        try:
            async for f in self.frames():
                if f.type == GOAWAY:
                    code = struct.unpack(">II", f.payload[:8])[1]
        finally:
            self.writer.close()
        assert code is not None, "the connection closed without GOAWAY"
        return code


async def connect(port: int, *, preface: bool = True) -> Raw:
    raw = Raw(*await asyncio.open_connection("127.0.0.1", port))
    if preface:
        raw.send(PREFACE, fr(SETTINGS, 0, 0))
    return raw


async def still_serves(served: Served) -> None:
    """A grpcio call on a new connection is answered."""
    sid = await kakeya_session(served)
    assert sid


async def test_a_ping_is_answered_with_its_payload(server: Served) -> None:
    assert server.transport.port is not None
    raw = await connect(server.transport.port)
    raw.send(fr(PING, 0, 0, b"sessiont"))
    async for f in raw.frames():
        if f.type == PING:
            assert f.flags == 1 and f.payload == b"sessiont"
            break
    else:
        pytest.fail("no PING acknowledgement")
    raw.writer.close()


def _violations(port: int, enc: hpack.Encoder) -> dict[str, tuple[bytes, int]]:
    head = enc.encode(request_headers(port, APPEND))
    return {
        "not-a-preface": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", PROTOCOL_ERROR),
        "first-frame-not-settings": (PREFACE + fr(PING, 0, 0, b"12345678"), PROTOCOL_ERROR),
        "frame-over-16k": (
            PREFACE + fr(SETTINGS, 0, 0) + fr(DATA, 0, 1, b"x" * 16_385),
            FRAME_SIZE_ERROR,
        ),
        "data-on-stream-0": (PREFACE + fr(SETTINGS, 0, 0) + fr(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
        "data-on-an-idle-stream": (
            PREFACE + fr(SETTINGS, 0, 0) + fr(DATA, 0, 9, b"x"),
            PROTOCOL_ERROR,
        ),
        "headers-on-an-even-stream": (
            PREFACE + fr(SETTINGS, 0, 0) + fr(HEADERS, END_HEADERS, 2, head),
            PROTOCOL_ERROR,
        ),
        "window-past-2^31": (
            PREFACE + fr(SETTINGS, 0, 0) + fr(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)),
            FLOW_CONTROL_ERROR,
        ),
        "push-promise": (
            PREFACE + fr(SETTINGS, 0, 0) + fr(PUSH_PROMISE, 0, 1, b"\0" * 4),
            PROTOCOL_ERROR,
        ),
        "bad-hpack": (
            PREFACE + fr(SETTINGS, 0, 0) + fr(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\xff"),
            COMPRESSION_ERROR,
        ),
        "continuation-out-of-place": (
            PREFACE + fr(SETTINGS, 0, 0) + fr(CONTINUATION, END_HEADERS, 1, head),
            PROTOCOL_ERROR,
        ),
        "headers-left-unfinished": (
            PREFACE + fr(SETTINGS, 0, 0) + fr(HEADERS, 0, 1, head) + fr(PING, 0, 0, b"12345678"),
            PROTOCOL_ERROR,
        ),
        "settings-of-odd-length": (PREFACE + fr(SETTINGS, 0, 0, b"\0" * 5), FRAME_SIZE_ERROR),
        "frame-size-setting-too-small": (
            PREFACE + fr(SETTINGS, 0, 0, struct.pack(">HI", 5, 100)),
            PROTOCOL_ERROR,
        ),
        "priority-on-stream-0": (
            PREFACE + fr(SETTINGS, 0, 0) + fr(2, 0, 0, b"\0" * 5),
            PROTOCOL_ERROR,
        ),
        "goaway-of-4-bytes": (
            PREFACE + fr(SETTINGS, 0, 0) + fr(GOAWAY, 0, 0, b"\0" * 4),
            FRAME_SIZE_ERROR,
        ),
        "headers-reusing-a-closed-stream": (
            PREFACE
            + fr(SETTINGS, 0, 0)
            + fr(HEADERS, END_HEADERS | END_STREAM, 3, head)
            + fr(HEADERS, END_HEADERS, 1, head),
            PROTOCOL_ERROR,
        ),
        "ping-of-7-bytes": (
            PREFACE + fr(SETTINGS, 0, 0) + fr(PING, 0, 0, b"1234567"),
            FRAME_SIZE_ERROR,
        ),
    }


@pytest.mark.parametrize(
    "case",
    list(_violations(0, hpack.Encoder())),
)
async def test_a_protocol_error_ends_the_connection_with_its_goaway_code(
    server: Served, case: str
) -> None:
    port = server.transport.port
    assert port is not None
    await kakeya_session(server)
    before = await server.runtime.log.last_position()
    raw = await connect(port, preface=False)
    data, code = _violations(port, raw.encoder)[case]
    raw.send(data)
    assert await raw.goaway() == code
    assert await server.runtime.log.last_position() == before
    await still_serves(server)


async def _wait(requests: object, ctx: object) -> None:
    await asyncio.sleep(30)


async def _echo(request: bytes, ctx: object) -> bytes:
    return request


#: a method that never reads its requests (its stream's bytes stay unread)
IDLE_METHOD = calls.Method(IDLE, True, False, _wait, bytes, bytes)
ECHO = calls.Method("/t.T/Echo", False, False, _echo, bytes, bytes)


@contextlib.asynccontextmanager
async def serving(*methods: calls.Method, **options: Any) -> AsyncIterator[Listener]:
    """An endpoint serving ``methods`` on a free port (``listener.port``), stopped after."""
    options = {"max_message_bytes": 1 << 20, "max_streams": 10, **options}
    listener = Listener({m.path: m for m in methods}, **options)
    await listener.start("127.0.0.1", 0)
    try:
        yield listener
    finally:
        await listener.stop(0.1)


@contextlib.asynccontextmanager
async def idle_endpoint(max_streams: int = 10) -> AsyncIterator[int]:
    """An endpoint whose one method never reads its requests, on a free port."""
    async with serving(IDLE_METHOD, max_streams=max_streams) as listener:
        assert listener.port is not None
        yield listener.port


@pytest.fixture
async def idle() -> AsyncIterator[int]:
    async with idle_endpoint() as port:
        yield port


async def test_data_past_the_stream_window_resets_that_stream_alone(idle: int) -> None:
    """A stream's 1 MiB window taken by a call that does not read, then a byte more:
    RST_STREAM FLOW_CONTROL_ERROR on that stream; the connection goes on."""
    raw = await connect(idle)
    raw.send(raw.headers(1, idle, IDLE))
    chunk = b"\0" * 16_384
    raw.send(*(fr(DATA, 0, 1, chunk) for _ in range(64)))  # the stream's 1 MiB: taken
    raw.send(fr(DATA, 0, 1, b"\0"), fr(PING, 0, 0, b"12345678"))  # one byte past it
    reset = None
    async for f in raw.frames():
        assert f.type != GOAWAY, f
        if f.type == RST_STREAM:
            reset = (f.stream, struct.unpack(">I", f.payload)[0])
        if f.type == PING:
            break
    raw.writer.close()
    assert reset == (1, FLOW_CONTROL_ERROR)


async def test_the_connection_window_comes_back_as_bytes_arrive(idle: int) -> None:
    """Bytes on streams whose calls never read go back to the connection's window as
    they come: 8 MiB over eight such streams, twice the connection's window, all taken
    without an error, and answered by WINDOW_UPDATEs on stream 0 worth about as much."""
    raw = await connect(idle)
    chunk = b"\0" * 16_384
    for sid in range(1, 17, 2):
        raw.send(raw.headers(sid, idle, IDLE), *(fr(DATA, 0, sid, chunk) for _ in range(64)))
    raw.send(fr(PING, 0, 0, b"12345678"))
    returned = 0
    async for f in raw.frames():
        assert f.type not in (GOAWAY, RST_STREAM), f
        if f.type == WINDOW_UPDATE and f.stream == 0:
            returned += struct.unpack(">I", f.payload)[0]
        if f.type == PING:
            break
    raw.writer.close()
    assert returned >= 8 * 1024 * 1024 - 1024 * 1024  # all but the last quarter-window


async def test_a_stream_that_is_not_read_holds_up_no_other_call() -> None:
    """grpcio puts a channel's calls on one connection. A client-streaming call whose
    servicer does not read yet, its client uploading 4 MiB, leaves the channel's other
    calls answered."""

    later = calls.Method("/t.T/Later", True, False, _wait, bytes, bytes)
    async with (
        serving(later, ECHO, max_message_bytes=8 << 20) as listener,
        grpc.aio.insecure_channel(f"127.0.0.1:{listener.port}") as ch,
    ):
        upload = ch.stream_unary(
            "/t.T/Later", request_serializer=bytes, response_deserializer=bytes
        )

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(64):
                yield b"u" * 65_536

        held = upload(chunks())
        await asyncio.sleep(0.5)  # the upload fills what windows it may
        echo_stub = ch.unary_unary(
            "/t.T/Echo", request_serializer=bytes, response_deserializer=bytes
        )
        assert await echo_stub(b"still here", timeout=5) == b"still here"
        held.cancel()


async def test_padding_goes_back_to_the_windows() -> None:
    """4 MiB of padding (four times a stream's window) before a small message on one
    stream: the padding is given back as it comes, and the call is answered."""
    async with serving(ECHO) as listener:
        port = listener.port
        assert port is not None
        raw = await connect(port)
        try:
            raw.send(raw.headers(1, port, "/t.T/Echo"))
            padded = fr(DATA, PADDED, 1, bytes([255]) + b"\0" * 255)
            raw.send(padded * (4 * 1024 * 1024 // 256))
            raw.send(fr(DATA, END_STREAM, 1, grpc_frame(b"padded")))
            answer = b""
            async for f in raw.frames():
                assert f.type not in (GOAWAY, RST_STREAM), f
                if f.type == DATA:
                    answer = f.payload[5:]
                    break
        finally:
            raw.writer.close()
    assert answer == b"padded"


async def test_a_client_that_makes_the_server_reset_its_streams_is_bounded() -> None:
    """Streams the server resets because of what the client sent (here a WINDOW_UPDATE
    of 0 on each, CVE-2025-8671's "MadeYouReset") count as the client's own resets."""
    async with idle_endpoint(max_streams=5_000) as port:
        raw = await connect(port)
        frames = []
        for i in range(1_100):
            sid = 1 + 2 * i
            frames += [raw.headers(sid, port, IDLE), fr(WINDOW_UPDATE, 0, sid, b"\0\0\0\0")]
        raw.send(*frames)
        assert await raw.goaway() == ENHANCE_YOUR_CALM


async def test_the_encoder_keeps_4_kib_of_table_whatever_the_client_allows() -> None:
    """A client may allow a header table of 4 GiB; the server's encoder keeps 4 KiB (a
    larger one would be memory, and a linear search for every header it sends)."""
    async with serving(ECHO) as listener:
        assert listener.port is not None
        raw = await connect(listener.port, preface=False)
        try:
            big = struct.pack(">HI", 1, 2**32 - 1)
            raw.send(PREFACE, fr(SETTINGS, 0, 0, big), fr(PING, 0, 0, b"12345678"))
            async for f in raw.frames():
                if f.type == PING:
                    break
            sizes = [c._encoder.header_table_size for c in listener.connections]
        finally:
            raw.writer.close()
    assert sizes == [4096]


async def test_streams_past_the_limit_are_refused_and_the_rest_answered(serve: Serve) -> None:
    served = await serve(max_concurrent_streams=2)
    port = served.transport.port
    assert port is not None
    sid = await kakeya_session(served)
    raw = await connect(port)
    raw.send(raw.headers(1, port), raw.headers(3, port), raw.headers(5, port))
    refused = None
    async for f in raw.frames():
        if f.type == RST_STREAM:
            refused = (f.stream, struct.unpack(">I", f.payload)[0])
            break
    assert refused == (5, REFUSED_STREAM)
    body = grpc_frame(kpb.AppendTokensRequest(session_id=sid, token_ids=[4]).SerializeToString())
    raw.send(fr(DATA, END_STREAM, 1, body), fr(DATA, END_STREAM, 3, body))
    ended = set()
    async for f in raw.frames():
        if f.type == HEADERS and f.flags & END_STREAM:
            ended.add(f.stream)
            if ended == {1, 3}:
                break
    raw.writer.close()
    assert list((await served.runtime.sessions.load(sid)).tokens) == [4, 4]


async def test_padded_frames_and_header_blocks_in_continuations_are_read(server: Served) -> None:
    """A request whose headers come padded, split across HEADERS and two CONTINUATION
    frames, and whose body comes in padded DATA frames, is the same request."""
    port = server.transport.port
    assert port is not None
    sid = await kakeya_session(server)
    raw = await connect(port)
    block = raw.encoder.encode(request_headers(port, APPEND, extra=(("x-pad", "p" * 30_000),)))
    third = len(block) // 3
    body = grpc_frame(kpb.AppendTokensRequest(session_id=sid, token_ids=[7, 8]).SerializeToString())
    raw.send(
        fr(HEADERS, PADDED, 1, bytes([3]) + block[:third] + b"\0\0\0"),
        fr(CONTINUATION, 0, 1, block[third : 2 * third]),
        fr(CONTINUATION, END_HEADERS, 1, block[2 * third :]),
        fr(DATA, PADDED, 1, bytes([10]) + body[:4] + b"\0" * 10),
        fr(DATA, PADDED | END_STREAM, 1, bytes([0]) + body[4:]),
    )
    decoder = hpack.Decoder()
    status = None
    async for f in raw.frames():
        if f.type == HEADERS and f.flags & END_STREAM:
            status = dict(decoder.decode(f.payload)).get("grpc-status")
            break
        if f.type == HEADERS:
            decoder.decode(f.payload)
    raw.writer.close()
    assert status == "0"
    assert list((await server.runtime.sessions.load(sid)).tokens) == [7, 8]


async def test_a_client_writing_a_byte_at_a_time_is_understood(server: Served) -> None:
    """The preface, the frame headers and the payloads cut at every byte: one request."""
    port = server.transport.port
    assert port is not None
    sid = await kakeya_session(server)
    raw = await connect(port, preface=False)
    body = grpc_frame(kpb.AppendTokensRequest(session_id=sid, token_ids=[6]).SerializeToString())
    data = PREFACE + fr(SETTINGS, 0, 0) + raw.headers(1, port) + fr(DATA, END_STREAM, 1, body)
    for i in range(len(data)):
        raw.send(data[i : i + 1])
        await raw.writer.drain()
        await asyncio.sleep(0)
    decoder = hpack.Decoder()
    status = None
    async for f in raw.frames():
        if f.type == HEADERS:
            status = dict(decoder.decode(f.payload)).get("grpc-status", status)
            if f.flags & END_STREAM:
                break
    raw.writer.close()
    assert status == "0"
    assert list((await server.runtime.sessions.load(sid)).tokens) == [6]


async def test_a_request_wider_than_the_windows_arrives_whole(serve: Serve) -> None:
    """A 6 MiB request (the stream's and the connection's receive windows are 4 MiB): the
    endpoint opens the windows as the bytes come, before the message is whole."""
    served = await serve(max_message_bytes=8 * 1024 * 1024)
    sid = await kakeya_session(served)
    # an unknown field (number 1000, bytes) rides along: parsed and not stored
    filler = b"\xc2\x3e" + _varint(6 * 1024 * 1024) + b"f" * (6 * 1024 * 1024)
    request = kpb.AppendTokensRequest(session_id=sid, token_ids=[1, 2]).SerializeToString() + filler
    async with grpc.aio.insecure_channel(
        served.target, options=[("grpc.max_send_message_length", 8 * 1024 * 1024)]
    ) as ch:
        call = ch.unary_unary(APPEND, request_serializer=bytes, response_deserializer=bytes)
        answer = kpb.AppendTokensResponse.FromString(await call(request, timeout=20))
    assert answer.history_length == 2
    # and the connection's window came back: the next call on a fresh one goes through
    port = served.transport.port
    assert port is not None
    follow = kpb.AppendTokensRequest(session_id=sid, token_ids=[3]).SerializeToString()
    assert (await raw_call(port, APPEND, grpc_frame(follow))).status == 0


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


#: a request the server can read, to a session that does not exist (answered NOT_FOUND)
_HEADERS = hpack.Encoder().encode(request_headers(0, APPEND))
_BODY = grpc_frame(kpb.AppendTokensRequest(session_id="nope", token_ids=[1]).SerializeToString())


@st.composite
def frame_soup(draw: st.DrawFn) -> bytes:
    """Up to eight frames: well-formed requests and their bodies (on streams 1 to 7,
    in any order, whole or cut), and frames of any type (the ten of RFC 9113 and an
    unknown one) with any flags and up to 40 random bytes."""
    out = b""
    for _ in range(draw(st.integers(1, 8))):
        stream = draw(st.integers(0, 7))
        kind = draw(st.sampled_from(("headers", "data", "random", "random")))
        if kind == "headers":
            out += fr(
                HEADERS, END_HEADERS | draw(st.sampled_from((0, END_STREAM))), stream, _HEADERS
            )
        elif kind == "data":
            cut = draw(st.integers(0, len(_BODY)))
            out += fr(DATA, draw(st.sampled_from((0, END_STREAM))), stream, _BODY[:cut])
        else:
            ftype = draw(st.sampled_from((0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0x42)))
            flags = draw(st.sampled_from((0, 1, 4, 5, 8, 0x20, 0x2D, 0xFF)))
            out += fr(ftype, flags, stream, draw(st.binary(max_size=40)))
    return out


async def soup_check(fuzzed: Fuzzed, soup: bytes) -> None:  # noqa: F811
    before = await _stored(fuzzed)
    fuzzed.errors.clear()
    raw = await connect(fuzzed.port)
    raw.send(soup)
    await raw.writer.drain()
    raw.writer.write_eof()
    async for _ in raw.frames():
        pass
    raw.writer.close()
    assert not fuzzed.errors, (soup, fuzzed.errors)
    assert await _stored(fuzzed) == before
    stub = fuzzed.channel.unary_unary(APPEND, request_serializer=bytes, response_deserializer=bytes)
    ok = kpb.AppendTokensRequest(session_id=fuzzed.sids[1], token_ids=[]).SerializeToString()
    try:
        await stub(ok, timeout=5)
    except grpc.aio.AioRpcError as exc:  # an empty append is refused, with a status
        assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, exc


@fuzz_settings(QUICK * 4)
@given(soup=frame_soup())
async def test_random_frames_end_in_a_goaway_or_an_answer_never_a_fault(
    fuzzed: Fuzzed,  # noqa: F811
    soup: bytes,
) -> None:
    """After a valid preface, random frames among well-formed ones: the server answers
    them, ignores them, or ends the connection with GOAWAY; it logs no fault of its
    own, stores nothing, and its other connections go on."""
    await soup_check(fuzzed, soup)


def test_the_endpoint_runs_on_uvloops_transports() -> None:
    """``sessiontape serve`` runs uvloop by default, whose transports are not asyncio's
    classes: a connection there answers a PING and refuses a stream past its limit."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> tuple[bytes, int]:
        async with idle_endpoint(max_streams=1) as port:
            raw = await connect(port)
            raw.send(raw.headers(1, port, IDLE), raw.headers(3, port, IDLE))
            raw.send(fr(PING, 0, 0, b"uvloop!!"))
            pong, refused = b"", -1
            async for f in raw.frames():
                if f.type == RST_STREAM:
                    refused = f.stream
                if f.type == PING:
                    pong = f.payload
                    break
            raw.writer.close()
        return pong, refused

    assert uvloop.run(main()) == (b"uvloop!!", 3)


async def test_a_rapid_reset_flood_ends_the_connection() -> None:
    """Streams opened and reset at once (CVE-2023-44487's "rapid reset": each a call
    started and cancelled), past a thousand in a second: GOAWAY ENHANCE_YOUR_CALM. Three
    hundred in a row are a client's right (test_calls: the connection goes on)."""
    async with idle_endpoint(max_streams=5_000) as port:
        raw = await connect(port)
        frames = []
        for i in range(1_100):
            sid = 1 + 2 * i
            frames += [raw.headers(sid, port, IDLE), fr(RST_STREAM, 0, sid, struct.pack(">I", 8))]
        raw.send(*frames)
        assert await raw.goaway() == ENHANCE_YOUR_CALM


async def test_a_header_list_over_64_kib_is_a_compression_error(server: Served) -> None:
    port = server.transport.port
    assert port is not None
    raw = await connect(port)
    headers = request_headers(port, APPEND, extra=tuple((f"x-{i}", "v" * 1000) for i in range(70)))
    block = raw.encoder.encode(headers)
    chunks = [block[i : i + 16_384] for i in range(0, len(block), 16_384)]
    raw.send(fr(HEADERS, 0, 1, chunks[0]), *(fr(CONTINUATION, 0, 1, c) for c in chunks[1:-1]))
    raw.send(fr(CONTINUATION, END_HEADERS, 1, chunks[-1]))
    assert await raw.goaway() == COMPRESSION_ERROR
    await still_serves(server)


async def test_a_client_that_does_not_read_is_not_read(idle: int) -> None:
    """PINGs sent by a client that reads none of their answers: once the answers fill
    the socket, the server stops reading the client (its writes stall) rather than
    queue answers without bound; once the client reads, the server answers again."""
    raw = await connect(idle)
    ping = fr(PING, 0, 0, b"12345678") * 4096  # 68 KiB a write
    stalled = False
    for _ in range(2_000):  # at most 136 MiB
        raw.writer.write(ping)
        try:
            await asyncio.wait_for(raw.writer.drain(), 0.5)
        except TimeoutError:
            stalled = True
            break
    assert stalled, "the server read everything and queued every answer"
    raw.send(fr(PING, 0, 0, b"the last"))
    async for f in raw.frames():  # reading now: every answer comes, the last one too
        if f.type == PING and f.payload == b"the last":
            break
    else:
        pytest.fail("the server did not go back to reading")
    raw.writer.close()


async def test_grpclibs_client_on_the_endpoint(server: Served) -> None:
    """A second gRPC client library, with an HTTP/2 of its own (h2): unary calls one
    after another on one connection, then a server-streaming call of 3,000 tokens whose
    every token is the one the log holds."""
    from grpclib.client import Channel
    from grpclib.const import Cardinality

    port = server.transport.port
    assert port is not None
    engine = server.runtime.engine
    assert isinstance(engine, ReferenceEngine)
    engine.eos_bias = -1000.0
    channel = Channel("127.0.0.1", port)
    try:
        async with channel.request(
            "/kakeya.v1.RuntimeService/CreateSession",
            Cardinality.UNARY_UNARY,
            kpb.CreateSessionRequest,
            kpb.CreateSessionResponse,
        ) as call:
            await call.send_message(kpb.CreateSessionRequest(), end=True)
            sid = (await call.recv_message()).session_id

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

        lengths = [await append([i]) for i in range(1, 6)]
        assert lengths == [1, 2, 3, 4, 5]
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


def _named(name: bytes) -> calls.Method:
    """A unary method that answers its request after its own name."""

    async def answer(request: bytes, ctx: object) -> bytes:
        return name + request

    return calls.Method(f"/t.T/{name.decode()}", False, False, answer, bytes, bytes)


async def test_a_repeated_header_block_is_read_against_the_table_as_it_is_now() -> None:
    """A block of only indexed fields means what the table holds now: the same bytes
    that named method A name B once B's request changed the table (a decoded block
    kept from before would route it to A)."""
    async with serving(_named(b"A"), _named(b"B")) as listener:
        port = listener.port
        assert port is not None
        enc = hpack.Encoder()

        def block(path: str) -> bytes:
            return enc.encode(
                [
                    (":method", "POST"),
                    (":scheme", "http"),
                    (":authority", "x"),
                    ("content-type", "application/grpc"),
                    ("te", "trailers"),
                    (":path", path),
                ]
            )

        first_a, again_a, first_b = block("/t.T/A"), block("/t.T/A"), block("/t.T/B")
        assert max(again_a) < 0xFF and min(again_a) > 0x80  # only one-byte indexed fields
        # the client's own view of what again_a now means: its last :path is B's
        shadow = hpack.Decoder()
        for b in (first_a, again_a, first_b):
            shadow.decode(b)
        assert dict(shadow.decode(again_a))[":path"] == "/t.T/B"
        raw = await connect(port)
        answers: dict[int, bytes] = {}
        try:
            for sid, b in ((1, first_a), (3, again_a), (5, first_b), (7, again_a)):
                raw.send(
                    fr(HEADERS, END_HEADERS, sid, b),
                    fr(DATA, END_STREAM, sid, grpc_frame(b"%d" % sid)),
                )
            async for f in raw.frames():
                if f.type == DATA:
                    answers[f.stream] = f.payload[5:]
                if len(answers) == 4:
                    break
        finally:
            raw.writer.close()
    assert answers == {1: b"A1", 3: b"A3", 5: b"B5", 7: b"B7"}


@pytest.mark.parametrize("answers", [True, False], ids=["answering", "silent"])
async def test_a_silent_client_is_pinged_and_one_that_never_answers_is_closed(
    answers: bool,
) -> None:
    """After ``keepalive_s`` of silence the server PINGs; a client that answers keeps its
    connection, one that does not (gone without a FIN) loses it, its calls cancelled."""
    started: list[asyncio.Task[object]] = []

    async def wait(requests: object, ctx: object) -> None:
        task = asyncio.current_task()
        assert task is not None
        started.append(task)
        await asyncio.sleep(30)

    method = calls.Method(IDLE, True, False, wait, bytes, bytes)
    pings, goaway = 0, False
    async with serving(method, keepalive_s=0.2, keepalive_timeout_s=0.3) as listener:
        assert listener.port is not None
        raw = await connect(listener.port)
        raw.send(raw.headers(1, listener.port, IDLE))
        try:
            async with asyncio.timeout(1.5):
                async for f in raw.frames():
                    if f.type == PING and not f.flags & 1:
                        pings += 1
                        if answers:
                            raw.send(fr(PING, 1, 0, f.payload))
                    goaway = goaway or f.type == GOAWAY
        except TimeoutError:
            pass
        finally:
            raw.writer.close()
    if answers:
        assert pings >= 3 and not goaway
    else:
        assert pings == 1 and goaway
        assert started and started[0].cancelled()
