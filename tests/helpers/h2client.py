"""A raw HTTP/2 client for the tests that speak to the gRPC server below gRPC: requests
built with the ``h2`` library (its outbound header checks off, so a test can send what a
hostile client would), and frames written by hand."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

#: HTTP/2 frame types (RFC 9113 section 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame."""
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def grpc_frame(payload: bytes, compressed: bool = False) -> bytes:
    """One gRPC length-prefixed message."""
    return struct.pack(">BI", int(compressed), len(payload)) + payload


@dataclass
class Answer:
    """What a raw HTTP/2 request got back."""

    headers: dict[str, str] = field(default_factory=dict)
    trailers: dict[str, str] = field(default_factory=dict)
    data_frames: list[bytes] = field(default_factory=list)
    reset: int | None = None
    goaway: int | None = None

    @property
    def status(self) -> int | None:
        """The gRPC status, from the trailers (or a trailers-only response's headers)."""
        raw = self.trailers.get("grpc-status", self.headers.get("grpc-status"))
        return None if raw is None else int(raw)


def request_headers(
    port: int,
    path: str | bytes,
    method: str = "POST",
    content_type: str = "application/grpc",
    extra: tuple[tuple[str | bytes, str | bytes], ...] = (),
) -> list[tuple[str | bytes, str | bytes]]:
    return [
        (":method", method),
        (":scheme", "http"),
        (":authority", f"127.0.0.1:{port}"),
        (":path", path),
        ("content-type", content_type),
        ("te", "trailers"),
        *extra,
    ]


def client_connection() -> h2.connection.H2Connection:
    config = h2.config.H2Configuration(
        client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False
    )
    return h2.connection.H2Connection(config)


async def raw_call(
    port: int,
    path: str | bytes,
    body: bytes,
    *,
    extra: tuple[tuple[str | bytes, str | bytes], ...] = (),
    headers: list[tuple[str | bytes, str | bytes]] | None = None,
    timeout_s: float = 10.0,
) -> Answer:
    """One HTTP/2 request on a fresh connection, read until the server ends its stream,
    resets it or closes the connection (``headers``: the whole header list instead of a
    gRPC request's)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = client_connection()
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
    sent = headers if headers is not None else request_headers(port, path, extra=extra)
    conn.send_headers(1, sent, end_stream=not body)
    if body:
        conn.send_data(1, body, end_stream=True)
    writer.write(conn.data_to_send())
    answer = Answer()
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                data = await reader.read(65536)
                if not data:
                    return answer
                try:
                    events = conn.receive_data(data)
                except h2.exceptions.ProtocolError:  # frames after the server's GOAWAY
                    return answer
                for ev in events:
                    if isinstance(ev, h2.events.ResponseReceived):
                        answer.headers = {k.decode(): v.decode() for k, v in ev.headers}
                    elif isinstance(ev, h2.events.TrailersReceived):
                        answer.trailers = {k.decode(): v.decode() for k, v in ev.headers}
                    elif isinstance(ev, h2.events.DataReceived):
                        answer.data_frames.append(ev.data)
                        conn.acknowledge_received_data(ev.flow_controlled_length, 1)
                    elif isinstance(ev, h2.events.StreamReset):
                        answer.reset = int(ev.error_code)
                        return answer
                    elif isinstance(ev, h2.events.ConnectionTerminated):
                        answer.goaway = int(ev.error_code)
                        return answer
                    elif isinstance(ev, h2.events.StreamEnded):
                        return answer
                writer.write(conn.data_to_send())
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
