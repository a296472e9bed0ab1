"""HTTP/2's frames as the endpoint's connection reads and writes them: the protocol's
numbers (RFC 9113), a frame's bytes, and the two kinds of protocol error."""

from __future__ import annotations

import struct
from collections.abc import Sequence

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types (RFC 9113 section 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0, 1, 2, 3, 4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 5, 6, 7, 8, 9
# flags
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
# error codes (section 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB
# settings (section 6.5.2)
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

#: the protocol's defaults, before a peer's SETTINGS say otherwise
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME = 16_384
MAX_WINDOW = 2**31 - 1
MAX_FRAME = 2**24 - 1
#: the receive window this side gives each stream: what one call may have sent and not
#: yet read (so a connection's unread bytes are at most ``max_streams`` of these)
STREAM_WINDOW = 1024 * 1024
#: the connection's receive window: bytes in flight before this side takes them (they
#: go back to it as they arrive, so one stream's unread bytes never hold up another's)
CONNECTION_WINDOW = 4 * 1024 * 1024
#: the largest header table this side's encoder keeps, whatever the client allows
ENCODER_TABLE = 4096
#: the largest header list this side takes (advertised in its settings)
MAX_HEADER_LIST = 64 * 1024
#: running streams a client may reset in one second before its connection is ended
MAX_RESETS_PER_S = 1_000
#: a header block larger than this, across its CONTINUATION frames, ends the connection
MAX_HEADER_BLOCK = 2 * MAX_HEADER_LIST

HEAD = struct.Struct(">BHBBI")  # length (3 bytes, high byte first), type, flags, stream
SETTING = struct.Struct(">HI")
U32 = struct.Struct(">I")

Headers = Sequence[tuple[str, str]]


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame, header and payload."""
    n = len(payload)
    return HEAD.pack(n >> 16, n & 0xFFFF, ftype, flags, stream_id) + payload


class StreamGone(Exception):
    """A stream this side can no longer read or write: its client reset it, or the
    connection ended."""


class StreamEndedShort(Exception):
    """The client ended its side of a stream inside what the reader asked for."""


class ConnectionFault(Exception):
    """A connection error (RFC 9113 section 5.4.1): GOAWAY with ``code``, then the end."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class StreamFault(Exception):
    """A stream error (section 5.4.2): RST_STREAM with ``code`` on that stream."""

    def __init__(self, stream_id: int, code: int) -> None:
        super().__init__(f"stream {stream_id}: error {code}")
        self.stream_id, self.code = stream_id, code


def unpad(flags: int, payload: bytes) -> bytes:
    if not payload:
        raise ConnectionFault(FRAME_SIZE_ERROR, "a padded frame without its pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ConnectionFault(PROTOCOL_ERROR, "padding as long as the frame")
    return payload[1 : len(payload) - pad]
