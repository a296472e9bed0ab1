"""One client connection of the endpoint: frames in, frames out, a stream per request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Protocol, cast

import hpack

from sessiontape.transports.grpc.http2.frames import (
    ACK,
    COMPRESSION_ERROR,
    CONNECTION_WINDOW,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME,
    DEFAULT_WINDOW,
    ENCODER_TABLE,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEAD,
    HEADERS,
    INTERNAL_ERROR,
    MAX_FRAME,
    MAX_HEADER_BLOCK,
    MAX_HEADER_LIST,
    MAX_RESETS_PER_S,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    S_ENABLE_PUSH,
    S_HEADER_TABLE_SIZE,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_CONCURRENT_STREAMS,
    S_MAX_FRAME_SIZE,
    S_MAX_HEADER_LIST_SIZE,
    SETTING,
    SETTINGS,
    STREAM_CLOSED,
    STREAM_WINDOW,
    U32,
    WINDOW_UPDATE,
    ConnectionFault,
    Headers,
    StreamFault,
    frame,
    unpad,
)
from sessiontape.transports.grpc.http2.stream import Stream

log = logging.getLogger(__name__)

#: the bytes of HPACK's one-byte indexed fields (RFC 7541 section 6.1: indices 1-126).
#: A block of only these reads the table without changing it, so while no other block
#: changed the table it decodes as it did before: a client's repeated requests (grpcio
#: sends the same block for every call of a method without a deadline) are looked up.
_ONE_BYTE_INDEXED = bytes(range(0x81, 0xFF))
#: how many such blocks a connection keeps decoded
DECODED_BLOCKS = 64
#: how long a closed connection may take to hand its last bytes to the client
CLOSE_TIMEOUT_S = 5.0
#: silence after which a connection is pinged, and how long its answer may take
KEEPALIVE_S = 7200.0
KEEPALIVE_TIMEOUT_S = 20.0
_KEEPALIVE = b"st-alive"


class Handler(Protocol):
    """What a connection tells about its streams."""

    def accept(self, stream: Stream, headers: Headers) -> None:
        """A request's headers came: start its call (it calls ``stream.release()`` when
        it is done)."""

    def cancel(self, stream: Stream) -> None:
        """The stream's client reset it, or the connection ended: cancel its call."""


class Connection(asyncio.Protocol):
    """One client connection: frames in, frames out, a :class:`Stream` per request."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_streams: int,
        keepalive_s: float = KEEPALIVE_S,
        keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
    ) -> None:
        self.handler = handler
        self.max_streams = max_streams
        self.keepalive_s, self.keepalive_timeout_s = keepalive_s, keepalive_timeout_s
        #: the loop's time of the last read, and the keepalive's timers
        self._last_read = 0.0
        self._keepalive: asyncio.TimerHandle | None = None
        self._unanswered: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Stream] = {}
        self.out: list[bytes] = []
        self.writable = True
        #: whether a write of ``out`` is due at the end of this loop pass
        self._flush_soon = False
        self._loop = asyncio.get_running_loop()  # protocols are made in the loop
        self._waiters: list[asyncio.Future[None]] = []
        self._buf = bytearray()
        self._preface = False
        self._settings_seen = False
        self._encoder = hpack.Encoder()
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = MAX_HEADER_LIST
        #: header blocks of only indexed fields, decoded, while the table is unchanged
        self._decoded: dict[bytes, Headers] = {}
        #: a header block whose CONTINUATION frames are still to come: stream, flags, bytes
        self._block: tuple[int, int, bytearray] | None = None
        self.last_stream = 0
        self.send_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_frame = DEFAULT_FRAME
        #: what the client may still send on the connection, as this side counts it
        self.recv_window = CONNECTION_WINDOW
        #: bytes received and not yet given back to the client's connection window
        self.unacked = 0
        self.closed = False
        self._goaway_received = False
        #: running streams the client reset in the second since ``_resets_since``
        self._resets = 0
        self._resets_since = 0.0
        self._dispatch = {
            DATA: self._on_data,
            HEADERS: self._on_headers,
            PRIORITY: self._on_priority,
            RST_STREAM: self._on_rst_stream,
            SETTINGS: self._on_settings,
            PUSH_PROMISE: self._on_push_promise,
            PING: self._on_ping,
            GOAWAY: self._on_goaway,
            WINDOW_UPDATE: self._on_window_update,
            CONTINUATION: self._on_continuation,
        }

    # -- asyncio's protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: no isinstance here
        self.transport = cast(asyncio.Transport, transport)
        self._last_read = self._loop.time()
        self._keepalive = self._loop.call_later(self.keepalive_s, self._check_alive)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        settings = b"".join(
            SETTING.pack(k, v)
            for k, v in (
                (S_ENABLE_PUSH, 0),
                (S_MAX_CONCURRENT_STREAMS, self.max_streams),
                (S_INITIAL_WINDOW_SIZE, STREAM_WINDOW),
                (S_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST),
            )
        )
        self.out.append(frame(SETTINGS, 0, 0, settings))
        self.out.append(frame(WINDOW_UPDATE, 0, 0, U32.pack(CONNECTION_WINDOW - DEFAULT_WINDOW)))
        self.flush()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._last_read = self._loop.time()
        buf = self._buf
        if buf:  # the rest of a frame that came before: one copy, then frames are slices
            buf += data
            data = bytes(buf)
            buf.clear()
        try:
            pos = 0
            if not self._preface:
                pos = self._read_preface(data)
                if not pos:  # not all of it yet
                    buf += data
                    return
            n = len(data)
            head, dispatch = HEAD, self._dispatch
            while n - pos >= 9:
                hi, lo, ftype, flags, stream_id = head.unpack_from(data, pos)
                length = hi << 16 | lo
                if length > DEFAULT_FRAME:
                    raise ConnectionFault(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                end = pos + 9 + length
                if end > n:
                    break
                payload = data[pos + 9 : end]
                pos = end
                if self._block is not None and ftype != CONTINUATION:
                    raise ConnectionFault(PROTOCOL_ERROR, "a header block left unfinished")
                if not self._settings_seen and ftype != SETTINGS:
                    raise ConnectionFault(PROTOCOL_ERROR, "the first frame is not SETTINGS")
                handle = dispatch.get(ftype)
                if handle is not None:  # unknown frame types are ignored (section 5.5)
                    try:
                        handle(flags, stream_id & 0x7FFFFFFF, payload)
                    except StreamFault as exc:
                        self._reset(exc.stream_id, exc.code)
            if pos < n:
                buf += data[pos:]
        except ConnectionFault as exc:
            log.debug("HTTP/2 connection error %d: %s", exc.code, exc)
            self.close(str(exc), exc.code)
            return
        except Exception:  # a fault of this module's own: the connection cannot go on
            log.exception("HTTP/2 connection failed")
            self.close("internal error", INTERNAL_ERROR)
            return
        self.flush()

    def pause_writing(self) -> None:
        # a client that does not read what it is sent is not read either: its PINGs and
        # SETTINGS would otherwise queue their answers without bound
        self.writable = False
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.writable = True
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
        self._wake_writers()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._end("the connection was lost")

    # -- writing

    def write(self, data: bytes) -> None:
        """``data`` after whatever frames wait, written once the loop's ready callbacks
        have run: the writes of one loop pass (a call's last messages and its trailers,
        the runs of several calls) go in one ``send``."""
        if self.transport is None:
            return
        self.out.append(data)
        if not self._flush_soon:
            self._flush_soon = True
            self._loop.call_soon(self._flush_now)

    def _flush_now(self) -> None:
        self._flush_soon = False
        self.flush()

    def flush(self) -> None:
        """Whatever frames wait, written now."""
        if self.out:
            t = self.transport
            if t is not None and not t.is_closing():
                t.write(b"".join(self.out))
            self.out.clear()

    def give_back(self) -> None:
        """Open the client's connection window by what came since last time."""
        if self.unacked:
            self.out.append(frame(WINDOW_UPDATE, 0, 0, U32.pack(self.unacked)))
            self.recv_window += self.unacked
            self.unacked = 0

    def header_frames(self, stream_id: int, headers: Headers, end_stream: bool) -> bytes:
        """A header block as HEADERS and, past the peer's frame size, CONTINUATION frames."""
        block = self._encoder.encode(headers)
        flags = END_STREAM if end_stream else 0
        size = self.peer_frame
        if len(block) <= size:
            return frame(HEADERS, flags | END_HEADERS, stream_id, block)
        parts = [frame(HEADERS, flags, stream_id, block[:size])]
        for i in range(size, len(block), size):
            last = i + size >= len(block)
            parts.append(
                frame(CONTINUATION, END_HEADERS if last else 0, stream_id, block[i : i + size])
            )
        return b"".join(parts)

    async def until_writable(self) -> None:
        """Wait until the transport takes writes again or a window opens (whichever a
        writer waits for, it looks again), or the connection ends."""
        if self.closed:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut

    def _wake_writers(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # -- the end

    def going_away(self) -> None:
        """The first GOAWAY of a graceful shutdown (RFC 9113 section 6.8): the client
        opens no new streams here (its library goes to a new connection), and the streams
        it has open, or opened before it read this, go on. :meth:`close` sends the last."""
        if self.transport is not None and not self.closed:
            self.out.append(frame(GOAWAY, 0, 0, U32.pack(MAX_WINDOW) + U32.pack(NO_ERROR)))
            self.flush()

    def close(self, reason: str, code: int = NO_ERROR) -> None:
        """GOAWAY with ``code``, then the connection closed and its calls cancelled."""
        t = self.transport
        if t is not None and not self.closed:
            self.out.append(frame(GOAWAY, 0, 0, U32.pack(self.last_stream) + U32.pack(code)))
            self.flush()
            t.close()  # once what is buffered went out; a client that reads none of it:
            self._loop.call_later(CLOSE_TIMEOUT_S, _abort, t)
        self._end(reason)

    def _end(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.transport = None
        for timer in (self._keepalive, self._unanswered):
            if timer is not None:
                timer.cancel()
        for stream in list(self.streams.values()):
            stream._lose(reason)
            self.handler.cancel(stream)
        self._wake_writers()

    def _reset(self, stream_id: int, code: int) -> None:
        stream = self.streams.get(stream_id)
        self.out.append(frame(RST_STREAM, 0, stream_id, U32.pack(code)))
        if stream is not None:
            # a client can make this side reset its streams as fast as it could reset
            # them itself ("MadeYouReset", CVE-2025-8671): they count alike
            self._count_reset()
            stream.local_closed = True
            stream._lose(f"reset by the server (error {code})")
            self.handler.cancel(stream)

    # -- reading

    def _read_preface(self, data: bytes) -> int:
        """The preface's length once it came whole, 0 while it is still coming."""
        if not data.startswith(PREFACE):
            if PREFACE.startswith(data):
                return 0
            raise ConnectionFault(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
        self._preface = True
        return len(PREFACE)

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ConnectionFault(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ConnectionFault(FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a body")
            return
        if len(payload) % 6:
            raise ConnectionFault(FRAME_SIZE_ERROR, "SETTINGS of a length not a multiple of 6")
        self._settings_seen = True
        for i in range(0, len(payload), 6):
            key, value = SETTING.unpack_from(payload, i)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionFault(FLOW_CONTROL_ERROR, "an initial window over 2^31-1")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise ConnectionFault(FLOW_CONTROL_ERROR, "a window over 2^31-1")
                self._wake_writers()
            elif key == S_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= MAX_FRAME:
                    raise ConnectionFault(PROTOCOL_ERROR, f"a frame size of {value}")
                self.peer_frame = value
            elif key == S_HEADER_TABLE_SIZE:
                # the encoder may keep less than the client allows (RFC 7541 section 4.2):
                # a larger table is memory here and a linear search per header sent
                self._encoder.header_table_size = min(value, ENCODER_TABLE)
            elif key == S_ENABLE_PUSH and value > 1:
                raise ConnectionFault(PROTOCOL_ERROR, f"ENABLE_PUSH {value}")
        self.out.append(frame(SETTINGS, ACK, 0))

    def _on_ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ConnectionFault(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ConnectionFault(FRAME_SIZE_ERROR, "a PING not of 8 bytes")
        if not flags & ACK:
            self.out.append(frame(PING, ACK, 0, payload))
        elif payload == _KEEPALIVE and self._unanswered is not None:
            self._unanswered.cancel()
            self._unanswered = None

    def _check_alive(self) -> None:
        """Keepalive (gRPC's server default: every 2 hours of silence): a PING to a
        client that sent nothing for ``keepalive_s``, and the connection closed if its
        answer does not come within ``keepalive_timeout_s`` (a client gone without a
        FIN would otherwise keep its calls, an Evergreen session's among them)."""
        if self.closed:
            return
        idle = self._loop.time() - self._last_read
        if idle < self.keepalive_s:  # it spoke since: look again when it will have been silent
            self._keepalive = self._loop.call_later(self.keepalive_s - idle, self._check_alive)
            return
        if self._unanswered is None:
            self.out.append(frame(PING, 0, 0, _KEEPALIVE))
            self.flush()
            self._unanswered = self._loop.call_later(
                self.keepalive_timeout_s, self.close, "the client did not answer a keepalive PING"
            )
        self._keepalive = self._loop.call_later(self.keepalive_s, self._check_alive)

    def _on_goaway(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ConnectionFault(PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise ConnectionFault(FRAME_SIZE_ERROR, "a GOAWAY shorter than 8 bytes")
        self._goaway_received = True  # the client opens no more streams; those open go on

    def _on_window_update(self, flags: int, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionFault(FRAME_SIZE_ERROR, "a WINDOW_UPDATE not of 4 bytes")
        inc = U32.unpack(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            if inc == 0:
                raise ConnectionFault(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self.send_window += inc
            if self.send_window > MAX_WINDOW:
                raise ConnectionFault(FLOW_CONTROL_ERROR, "a window over 2^31-1")
        else:
            self._idle_check(stream_id)
            stream = self.streams.get(stream_id)
            if stream is None:
                return  # a stream already closed: allowed for a while (section 6.9)
            if inc == 0:
                raise StreamFault(stream_id, PROTOCOL_ERROR)
            stream.send_window += inc
            if stream.send_window > MAX_WINDOW:
                raise StreamFault(stream_id, FLOW_CONTROL_ERROR)
        if self._waiters:
            self._wake_writers()

    def _on_rst_stream(self, flags: int, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionFault(FRAME_SIZE_ERROR, "an RST_STREAM not of 4 bytes")
        if stream_id == 0:
            raise ConnectionFault(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        self._idle_check(stream_id)
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._count_reset()
            stream.local_closed = True
            stream._lose(f"reset by the client (error {U32.unpack(payload)[0]})")
            self.handler.cancel(stream)

    def _count_reset(self) -> None:
        """A client that opens and resets streams faster than :data:`MAX_RESETS_PER_S`
        (the "rapid reset" attack: each stream a call started and cancelled, none
        counted against ``max_streams``) loses its connection."""
        now = self._loop.time()
        if now - self._resets_since >= 1.0:
            self._resets_since, self._resets = now, 0
        self._resets += 1
        if self._resets > MAX_RESETS_PER_S:
            raise ConnectionFault(ENHANCE_YOUR_CALM, "too many streams reset by the client")

    def _on_priority(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionFault(PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) != 5:
            raise StreamFault(stream_id, FRAME_SIZE_ERROR)  # read, and otherwise ignored

    def _on_push_promise(self, flags: int, stream_id: int, payload: bytes) -> None:
        raise ConnectionFault(PROTOCOL_ERROR, "PUSH_PROMISE from a client")

    def _idle_check(self, stream_id: int) -> None:
        if stream_id > self.last_stream:
            raise ConnectionFault(PROTOCOL_ERROR, f"a frame on idle stream {stream_id}")

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionFault(PROTOCOL_ERROR, "DATA on stream 0")
        self._idle_check(stream_id)
        size = len(payload)  # all of it counts against the windows, padding too
        self.recv_window -= size
        if self.recv_window < 0:
            raise ConnectionFault(FLOW_CONTROL_ERROR, "the client overran the connection's window")
        # the connection's window takes the bytes back as they come: a stream's unread
        # bytes are bounded by its own window, and must not hold up the other streams
        self.unacked += size
        if self.unacked >= CONNECTION_WINDOW // 4:
            self.give_back()
        data = unpad(flags, payload) if flags & PADDED else payload
        stream = self.streams.get(stream_id)
        if stream is None or stream.gone is not None:
            return  # a stream this side has done with
        if stream.remote_closed:
            raise StreamFault(stream_id, STREAM_CLOSED)
        if size > stream.recv_window:
            raise StreamFault(stream_id, FLOW_CONTROL_ERROR)
        stream.recv_window -= size
        if size > len(data):  # the padding is never read: it goes back now
            stream._give_back(size - len(data))
        if data:
            stream._data(data)
        if flags & END_STREAM:
            stream._end()

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or not stream_id & 1:
            raise ConnectionFault(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        block = unpad(flags, payload) if flags & PADDED else payload
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise ConnectionFault(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            block = block[5:]
        if flags & END_HEADERS:
            self._headers(stream_id, flags, block)
        else:
            self._block = (stream_id, flags, bytearray(block))

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is None or self._block[0] != stream_id:
            raise ConnectionFault(PROTOCOL_ERROR, "CONTINUATION out of place")
        sid, first_flags, block = self._block
        block += payload
        if len(block) > MAX_HEADER_BLOCK:
            raise ConnectionFault(ENHANCE_YOUR_CALM, "a header block too large")
        if flags & END_HEADERS:
            self._block = None
            self._headers(sid, first_flags, bytes(block))

    def _headers(self, stream_id: int, flags: int, block: bytes) -> None:
        # decoded whatever becomes of the stream: HPACK's table is the connection's
        headers = self._decoded.get(block)
        if headers is None:
            try:
                # (str, str) tuples (hpack decodes UTF-8)
                headers = tuple(cast(Headers, self._decoder.decode(block)))
            except (hpack.HPACKError, UnicodeDecodeError, ValueError) as exc:
                # an oversized list too: hpack stops inside the block, so the table may
                # not be the client's any more
                raise ConnectionFault(COMPRESSION_ERROR, f"a header block: {exc}") from None
            if block.translate(None, _ONE_BYTE_INDEXED):
                self._decoded.clear()  # the block may have changed the table
            else:
                if len(self._decoded) >= DECODED_BLOCKS:
                    self._decoded.clear()
                self._decoded[block] = headers
        stream = self.streams.get(stream_id)
        if stream_id <= self.last_stream:
            if stream is None:
                if flags & END_STREAM:
                    return  # the trailers of a stream this side has done with
                raise ConnectionFault(PROTOCOL_ERROR, f"HEADERS reusing stream {stream_id}")
            if stream.remote_closed:
                raise StreamFault(stream_id, STREAM_CLOSED)
            if not flags & END_STREAM:
                raise StreamFault(stream_id, PROTOCOL_ERROR)
            stream._end()  # the request's trailers: gRPC has none to read
            return
        self.last_stream = stream_id
        if len(self.streams) >= self.max_streams or self._goaway_received or self.closed:
            raise StreamFault(stream_id, REFUSED_STREAM)
        stream = Stream(self, stream_id, self.peer_initial_window)
        self.streams[stream_id] = stream
        if flags & END_STREAM:
            stream.remote_closed = True
        self.handler.accept(stream, headers)


def _abort(transport: asyncio.Transport) -> None:
    """Drop a closed connection whose client never read what was left to send."""
    with contextlib.suppress(RuntimeError):  # uvloop's, already gone
        transport.abort()
