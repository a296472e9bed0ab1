"""Hostile clients against a real ``sessiontape serve`` process: oversized fields, frame
floods, HPACK-heavy header blocks, compression bombs, malformed requests, a non-UTF-8
``:path`` and silent connections, each bounded in count and time.

A canary in a process of its own (tests/helpers/canary.py) asks the server's gRPC
health service and HTTP ``/healthz`` the whole time; after each case its slowest answer
must be under a second, the server alive, its memory bounded and its event log
unchanged. Where grpcio answers differently from RFC 9113, the test says what grpcio
answers: its C-core HTTP/2 is the protocol stack here, not this project's code.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import os
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sessiontape.transports.grpc.client import action
from sessiontape.transports.grpc.gen.evergreen.v2 import evergreen_pb2
from sessiontape.transports.grpc.gen.evergreen.v2 import evergreen_pb2_grpc as evergreen_grpc
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as kgrpc
from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2 as spb
from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2_grpc as sgrpc
from tests.conftest import free_port
from tests.helpers.h2client import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    HEADERS,
    PING,
    PREFACE,
    PRIORITY,
    SETTINGS,
    Answer,
    client_connection,
    frame,
    grpc_frame,
    raw_call,
    request_headers,
)

pytestmark = pytest.mark.timeout(300)

APPEND = "/kakeya.v1.RuntimeService/AppendTokens"
#: the canary's slowest answer a case may cause
CANARY_LIMIT_S = 1.0
#: how much the server's resident memory may grow over the whole suite
RSS_LIMIT_BYTES = 200 << 20
MEGABYTE_ID = "s" * 1_000_000


@dataclass
class Server:
    proc: subprocess.Popen[str]
    grpc_port: int
    http_port: int
    db: Path
    lines: list[str] = field(default_factory=list)
    canary: subprocess.Popen[str] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stored(self) -> str:
        """A digest of every stored event: equal before and after a refused case."""
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True) as conn:
            rows = conn.execute("SELECT * FROM events ORDER BY position").fetchall()
        return hashlib.sha256(repr(rows).encode()).hexdigest()

    def canary_window(self) -> dict[str, float]:
        """The canary's slowest answers since the last window."""
        assert self.canary is not None and self.canary.stdin and self.canary.stdout
        self.canary.stdin.write("report\n")
        self.canary.stdin.flush()
        out: dict[str, float] = json.loads(self.canary.stdout.readline())
        return out

    def errors(self) -> list[str]:
        return [line for line in self.lines if " ERROR " in line or "Traceback" in line]


def _drain(stream: object, into: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        into.append(line.rstrip())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("hostile")
    g, h = free_port(), free_port()
    db = tmp / "hostile.db"
    env = {**os.environ, "SESSIONTAPE_CACHE": str(tmp / "cache")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sessiontape.core.cli",
            "serve",
            "--engine",
            "reference",
            "--db",
            f"sqlite+aiosqlite:///{db}",
            "--grpc",
            f"127.0.0.1:{g}",
            "--http",
            f"127.0.0.1:{h}",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=tmp,
    )
    srv = Server(proc, g, h, db)
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        srv.lines.append(line.rstrip())
        if "sessiontape ready" in line:
            break
    else:
        proc.kill()
        raise AssertionError("server did not start")
    threading.Thread(target=_drain, args=(proc.stderr, srv.lines), daemon=True).start()
    # something stored, so that "the log unchanged" means something
    with grpc.insecure_channel(srv.target) as ch:
        stub = kgrpc.RuntimeServiceStub(ch)
        sid = stub.CreateSession(kpb.CreateSessionRequest()).session_id
        stub.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[1, 2, 3]))
    canary = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.canary", str(g), str(h)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert canary.stdout is not None
    assert canary.stdout.readline().strip() == "ready"
    srv.canary = canary
    try:
        yield srv
    finally:
        assert canary.stdin is not None
        canary.stdin.close()
        canary.wait(10)
        canary.stdout.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()


@pytest.fixture
def case(server: Server) -> Iterator[Server]:
    """One hostile case: afterwards the canary stayed fast, the server is alive, its memory
    bounded and its log unchanged."""
    stored = server.stored()
    baseline = getattr(server, "_rss0", None) or server.rss()
    server._rss0 = baseline  # type: ignore[attr-defined]
    server.canary_window()  # a fresh window for this case
    yield server
    time.sleep(0.3)  # the canary's asks that began during the case have answered
    window = server.canary_window()
    assert server.proc.poll() is None, "the server died"
    assert window["asks"] > 0, window
    assert window["grpc"] < CANARY_LIMIT_S and window["http"] < CANARY_LIMIT_S, window
    assert window["grpc_failures"] == 0 and window["http_failures"] == 0, window
    assert server.rss() - baseline < RSS_LIMIT_BYTES, (server.rss(), baseline)
    assert server.stored() == stored


def healthy(target: str) -> bool:
    # a subchannel of its own: the process-wide pool would carry a dead server's backoff
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return True


# -- oversized fields ------------------------------------------------------------


def _details_bounded(exc: grpc.RpcError) -> str:
    details = exc.details() or ""  # type: ignore[attr-defined]
    assert len(details.encode()) <= 1024, len(details)
    return details


def test_a_megabyte_session_id_on_each_service_is_described_not_echoed(case: Server) -> None:
    t0 = time.monotonic()
    with grpc.insecure_channel(case.target) as ch:
        with pytest.raises(grpc.RpcError) as salience:
            sgrpc.SalienceStub(ch).ForkSession(
                spb.ForkSessionRequest(session_id=MEGABYTE_ID), timeout=10
            )
        assert salience.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        assert "session_id of 1,000,000 characters" in _details_bounded(salience.value)
        with pytest.raises(grpc.RpcError) as kakeya:
            kgrpc.RuntimeServiceStub(ch).AppendTokens(
                kpb.AppendTokensRequest(session_id=MEGABYTE_ID, token_ids=[1]), timeout=10
            )
        assert kakeya.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        assert "session_id of 1,000,000 characters" in _details_bounded(kakeya.value)
    assert time.monotonic() - t0 < 10


def test_a_megabyte_node_id_in_an_evergreen_action_is_described_not_echoed(
    server: Server,
) -> None:
    """Evergreen opens a session per stream, so the log grows by that session (aborted with
    the error); the answer stays small and the canary fast."""
    server.canary_window()
    with grpc.insecure_channel(server.target) as ch:
        first = evergreen_pb2.SessionMessage(
            actions=[action("GENERATE", inputs={"prompt": MEGABYTE_ID}, outputs={"text": "o"})]
        )
        calls = evergreen_grpc.EvergreenServiceStub(ch).StartSession(iter([first]), timeout=10)
        with pytest.raises(grpc.RpcError) as evergreen:
            for _ in calls:
                pass
        details = _details_bounded(evergreen.value)
        assert "1,000,000 characters" in details, details
    window = server.canary_window()
    assert window["grpc"] < CANARY_LIMIT_S and window["http"] < CANARY_LIMIT_S, window


def test_a_million_ids_in_a_repeated_field_are_refused_before_any_work(case: Server) -> None:
    """Lengths are checked before the ids are: the model's context for tokens, at most
    1,024 stop or end-of-sequence ids."""
    million = [1] * 1_000_000
    with grpc.insecure_channel(case.target) as ch:
        kakeya = kgrpc.RuntimeServiceStub(ch)
        salience = sgrpc.SalienceStub(ch)
        calls = {
            "eos_token_ids": lambda: kakeya.CreateSession(
                kpb.CreateSessionRequest(eos_token_ids=million), timeout=10
            ),
            "token_ids": lambda: kakeya.AppendTokens(
                kpb.AppendTokensRequest(session_id="none", token_ids=million), timeout=10
            ),
            "stop_token_ids": lambda: list(
                salience.Generate(
                    spb.GenerateRequest(session_id="none", stop_token_ids=million), timeout=10
                )
            ),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as refused:
                call()
            code = refused.value.code()  # type: ignore[attr-defined]
            assert code in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.NOT_FOUND,
            ), (name, code)
            _details_bounded(refused.value)


# -- floods ----------------------------------------------------------------------


async def _flood(port: int, payload: bytes, seconds: float = 5.0) -> bytes:
    """Send ``payload`` after the preface and a SETTINGS; read what comes back until the
    server closes or ``seconds`` pass."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = b""
    try:
        writer.write(PREFACE + frame(SETTINGS, 0, 0))
        writer.write(payload)
        async with asyncio.timeout(seconds):
            while chunk := await reader.read(1 << 16):
                got += chunk
    except (TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return got


def _open_stream_headers(port: int, stream: int = 1, end_headers: bool = True) -> bytes:
    conn = client_connection()
    conn.initiate_connection()
    conn.send_headers(stream, request_headers(port, APPEND))
    raw = conn.data_to_send()
    block = raw[raw.rindex(b"\x01\x04\x00\x00\x00\x01") + 6 :]  # the HEADERS frame's block
    return frame(HEADERS, END_HEADERS if end_headers else 0, stream, block)


#: frames per flooding connection: grpcio acknowledges each PING and SETTINGS frame (about
#: 8 us of C-core time each here) and reads the others cheaply
FLOOD_FRAMES = 20_000

FLOODS = {
    "empty DATA frames": lambda port: _open_stream_headers(port) + frame(DATA, 0, 1) * FLOOD_FRAMES,
    "empty CONTINUATION frames": lambda port: (
        _open_stream_headers(port, end_headers=False) + frame(CONTINUATION, 0, 1) * FLOOD_FRAMES
    ),
    "SETTINGS frames": lambda port: frame(SETTINGS, 0, 0) * FLOOD_FRAMES,
    "PING frames": lambda port: frame(PING, 0, 0, b"\0" * 8) * FLOOD_FRAMES,
    "PRIORITY frames": lambda port: frame(PRIORITY, 0, 3, b"\0\0\0\1\x10") * FLOOD_FRAMES,
    "unknown frames": lambda port: frame(0xEE, 0, 0, b"junk") * FLOOD_FRAMES,
}


@pytest.mark.parametrize("kind", list(FLOODS))
async def test_a_frame_flood_stalls_nobody(case: Server, kind: str) -> None:
    """grpcio ends the connection on frames that break the protocol (CONTINUATION without
    its HEADERS' end, GOAWAY PROTOCOL_ERROR), acknowledges PING and SETTINGS frames one by
    one, and reads DATA, PRIORITY and unknown frames cheaply; other clients go on."""
    floods = [_flood(case.grpc_port, FLOODS[kind](case.grpc_port)) for _ in range(2)]
    await asyncio.gather(*floods)
    assert healthy(case.target)


async def test_hpack_heavy_header_blocks_stall_nobody(case: Server) -> None:
    """Header blocks of ~1,860 one-byte indexed fields (static entry 16,
    ``accept-encoding: gzip, deflate``), 200 streams on each of 3 connections."""
    heavy = b"\x90" * 1860

    def blocks(port: int) -> bytes:
        conn = client_connection()
        conn.initiate_connection()
        conn.send_headers(1, request_headers(port, APPEND), end_stream=True)
        raw = conn.data_to_send()
        block = raw[raw.rindex(b"\x01\x05\x00\x00\x00\x01") + 6 :]
        return b"".join(
            frame(HEADERS, END_HEADERS | 0x1, 2 * i + 1, block + heavy) for i in range(200)
        )

    await asyncio.gather(*(_flood(case.grpc_port, blocks(case.grpc_port)) for _ in range(3)))
    assert healthy(case.target)


# -- compression -------------------------------------------------------------------


async def test_a_gzip_bomb_is_refused_as_it_inflates(case: Server) -> None:
    """16 MiB of zeros in ~16 KB of gzip, five times: RESOURCE_EXHAUSTED (grpcio counts the
    inflated size against the 4 MiB limit while it inflates)."""
    bomb = gzip.compress(b"\0" * (16 << 20), compresslevel=9)
    assert len(bomb) < 32 << 10
    t0 = time.monotonic()
    answers = await asyncio.gather(
        *(
            raw_call(
                case.grpc_port,
                APPEND,
                grpc_frame(bomb, compressed=True),
                extra=(("grpc-encoding", "gzip"),),
            )
            for _ in range(5)
        )
    )
    assert all(a.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] for a in answers), answers
    assert time.monotonic() - t0 < 5


async def test_an_oversized_message_is_refused_from_its_prefix(case: Server) -> None:
    declared = struct.pack(">BI", 0, (4 << 20) + 1)
    answer = await raw_call(case.grpc_port, APPEND, declared + b"\0" * 16_000)
    assert answer.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], answer


# -- malformed requests -------------------------------------------------------------


def _malformed(port: int) -> dict[str, list[tuple[str | bytes, str | bytes]]]:
    good = request_headers(port, APPEND)
    return {
        "uppercase header name": [*good, ("X-Upper", "1")],
        "connection header": [*good, ("connection", "keep-alive")],
        "te other than trailers": [h for h in good if h[0] != "te"] + [("te", "gzip")],
        "no :scheme": [h for h in good if h[0] != ":scheme"],
        "pseudo-header after a regular one": [good[0], good[4], *good[1:4], *good[5:]],
        "no :path": [h for h in good if h[0] != ":path"],
    }


#: the malformed requests grpcio refuses (RST_STREAM or a gRPC error before the method)
REFUSED = ("uppercase header name", "te other than trailers", "no :scheme", "no :path")
#: the ones grpcio 1.85 serves as the gRPC call they name, against RFC 9113 section 8.2.2
#: (a ``connection`` header) and 8.3 (a pseudo-header after a regular one): the method runs
#: as for any call, and the input checks behind it hold
SERVED_BY_GRPCIO = ("connection header", "pseudo-header after a regular one")


@pytest.mark.parametrize("kind", REFUSED)
async def test_a_malformed_request_is_refused(case: Server, kind: str) -> None:
    """RFC 9113 section 8.1.1: a malformed request is a stream error; grpcio resets the
    stream or answers an error status, and never runs the method."""
    body = grpc_frame(kpb.AppendTokensRequest(session_id="none", token_ids=[1]).SerializeToString())
    answer: Answer = await raw_call(
        case.grpc_port, APPEND, body, headers=_malformed(case.grpc_port)[kind], timeout_s=10
    )
    ran = answer.status in (0, grpc.StatusCode.NOT_FOUND.value[0])
    assert not ran, answer
    assert answer.reset is not None or answer.goaway is not None or answer.status, answer


@pytest.mark.parametrize("kind", SERVED_BY_GRPCIO)
async def test_grpcio_serves_these_malformed_requests_as_calls(case: Server, kind: str) -> None:
    body = grpc_frame(kpb.AppendTokensRequest(session_id="none", token_ids=[1]).SerializeToString())
    answer: Answer = await raw_call(
        case.grpc_port, APPEND, body, headers=_malformed(case.grpc_port)[kind], timeout_s=10
    )
    assert answer.status == grpc.StatusCode.NOT_FOUND.value[0], answer


# -- a non-UTF-8 :path --------------------------------------------------------------


async def test_a_non_utf8_path_does_not_stop_the_server(server: Server) -> None:
    """grpcio 1.85's aio server loop dies on a ``:path`` that is not UTF-8 and stops
    listening; sessiontape's supervisor logs an ERROR and serves again on the same port."""
    stored = server.stored()
    before = len(server.errors())
    for _ in range(3):
        await raw_call(server.grpc_port, b"/\x80", b"", timeout_s=5)
        # within milliseconds on an idle machine; the bound leaves room for a loaded one
        deadline = time.monotonic() + 20
        while not healthy(server.target):
            assert time.monotonic() < deadline, "gRPC did not serve again"
            await asyncio.sleep(0.05)
    assert server.proc.poll() is None
    with grpc.insecure_channel(server.target) as ch:
        stub = kgrpc.RuntimeServiceStub(ch)
        sid = stub.CreateSession(kpb.CreateSessionRequest(), timeout=5).session_id
        stub.CloseSession(kpb.CloseSessionRequest(session_id=sid), timeout=5)
    assert stored != server.stored()  # that session was stored: the server works
    deadline = time.monotonic() + 20
    while not any("serving again" in e for e in server.errors()[before:]):
        assert time.monotonic() < deadline, server.lines[-20:]
        await asyncio.sleep(0.05)


# -- silent connections -------------------------------------------------------------


@pytest.mark.slow
async def test_silent_connections_are_dropped_and_stall_nobody(case: Server) -> None:
    """100 connections that never send the HTTP/2 preface: grpcio's handshake timeout
    (transports/grpc/server.py sets 10 s) closes each."""
    conns = [await asyncio.open_connection("127.0.0.1", case.grpc_port) for _ in range(100)]
    t0 = time.monotonic()

    async def closed(reader: asyncio.StreamReader) -> float:
        async with asyncio.timeout(30):
            while await reader.read(1024):
                pass
        return time.monotonic() - t0

    took = await asyncio.gather(*(closed(r) for r, _ in conns))
    for _, w in conns:
        w.close()
        with contextlib.suppress(ConnectionError):
            await w.wait_closed()
    assert max(took) < 20, max(took)
