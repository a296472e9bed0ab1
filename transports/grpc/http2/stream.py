"""One request's stream on the endpoint's HTTP/2 connection: the call's side of it."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from sessiontape.transports.grpc.http2.frames import (
    DATA,
    END_STREAM,
    INTERNAL_ERROR,
    RST_STREAM,
    STREAM_WINDOW,
    U32,
    WINDOW_UPDATE,
    Headers,
    StreamEndedShort,
    StreamGone,
    frame,
)


class Link(Protocol):
    """What a stream uses of its connection (:class:`~.connection.Connection`)."""

    transport: asyncio.Transport | None
    streams: dict[int, Stream]
    #: control frames waiting for the next write
    out: list[bytes]
    writable: bool
    send_window: int
    peer_frame: int

    def write(self, data: bytes) -> None: ...
    def flush(self) -> None: ...
    def header_frames(self, stream_id: int, headers: Headers, end_stream: bool) -> bytes: ...
    async def until_writable(self) -> None: ...


class Stream:
    """One request's stream: its body read in order, its answer written."""

    __slots__ = (
        "_chunks",
        "_held",
        "_reader",
        "_unacked",
        "conn",
        "gone",
        "id",
        "local_closed",
        "recv_window",
        "remote_closed",
        "send_window",
    )

    def __init__(self, conn: Link, stream_id: int, send_window: int) -> None:
        self.conn = conn
        self.id = stream_id
        self.send_window = send_window
        self.recv_window = STREAM_WINDOW
        self._chunks = bytearray()
        #: the newest of the bytes in ``_chunks`` not yet counted to be given back
        self._held = 0
        #: bytes counted to be given back to the client's stream window, not yet sent
        self._unacked = 0
        self._reader: asyncio.Future[None] | None = None
        self.remote_closed = False
        self.local_closed = False
        #: why the stream cannot go on (None while it can)
        self.gone: str | None = None

    # -- the connection's side

    def _wake(self) -> None:
        r = self._reader
        if r is not None:
            self._reader = None
            if not r.done():
                r.set_result(None)

    def _data(self, data: bytes) -> None:
        self._chunks += data
        self._held += len(data)
        self._wake()

    def _end(self) -> None:
        self.remote_closed = True
        self._wake()

    def _lose(self, reason: str) -> None:
        if self.gone is None:
            self.gone = reason

    # -- the call's side

    def peer(self) -> tuple[Any, ...] | None:
        """The client's address, as the socket gives it."""
        t = self.conn.transport
        return None if t is None else t.get_extra_info("peername")

    async def recv_data(self, size: int) -> bytes:
        """``size`` bytes of the request body; ``b""`` once it ended with nothing left.
        Raises :class:`StreamEndedShort` if it ended with fewer than ``size`` left."""
        while len(self._chunks) < size and not self.remote_closed:
            if self.gone is not None:
                # reset or cut off: the call is being cancelled (``Handler.cancel``), and a
                # read in any task of it waits for that rather than end the request early
                await asyncio.get_running_loop().create_future()
            if self._held:
                # a message larger than what came: what came goes back to the windows
                # now, or a message wider than them would never arrive
                self._give_back(self._held)
                self._held = 0
            fut = self._reader = asyncio.get_running_loop().create_future()
            await fut
        have = len(self._chunks)
        if have < size:
            if have == 0:
                return b""
            raise StreamEndedShort(f"the request ended {size - have} bytes short")
        out = bytes(self._chunks[:size])
        del self._chunks[:size]
        held = min(self._held, len(self._chunks))
        if self._held > held:
            self._give_back(self._held - held)
            self._held = held
        return out

    def _give_back(self, n: int) -> None:
        """Count ``n`` bytes read (or padding) to be given back to the client's stream
        window; send the WINDOW_UPDATE once a quarter of the window is due (not one per
        message). The connection's window took them back as they came."""
        if self.remote_closed or self.gone is not None:
            return  # the client sends nothing more on this stream
        self._unacked += n
        if self._unacked >= STREAM_WINDOW // 4:
            conn = self.conn
            conn.out.append(frame(WINDOW_UPDATE, 0, self.id, U32.pack(self._unacked)))
            self.recv_window += self._unacked
            self._unacked = 0
            conn.flush()

    def _check(self) -> None:
        if self.gone is not None:
            raise StreamGone(self.gone)
        if self.local_closed:
            raise StreamGone("the stream's answer already ended")

    def try_send(
        self, headers: Headers | None, data: bytes, trailers: Headers | None = None
    ) -> bool:
        """``headers``, ``data`` and ``trailers`` (each optional; trailers end the
        stream) in one write, if the connection takes them now: not paused by
        back-pressure and ``data`` one frame inside both windows. False: nothing went."""
        conn = self.conn
        n = len(data)
        if (
            self.gone is not None
            or self.local_closed
            or not conn.writable
            or (n and (n > self.send_window or n > conn.send_window or n > conn.peer_frame))
        ):
            return False
        parts = []
        if headers:
            parts.append(conn.header_frames(self.id, headers, False))
        if n:
            self.send_window -= n
            conn.send_window -= n
            parts.append(frame(DATA, 0, self.id, data))
        if trailers:
            parts.append(conn.header_frames(self.id, trailers, True))
            self.local_closed = True
        conn.write(b"".join(parts))
        return True

    async def send_headers(self, headers: Headers, end_stream: bool = False) -> None:
        """A header block (the answer's headers, or with ``end_stream`` its trailers)."""
        conn = self.conn
        while True:
            self._check()
            if conn.writable:
                break
            await conn.until_writable()
        block = conn.header_frames(self.id, headers, end_stream)
        if end_stream:
            self.local_closed = True
        conn.write(block)

    async def send_data(self, data: bytes, end_stream: bool = False) -> None:
        """``data`` in as many frames as the windows and the peer's frame size allow,
        waiting for the client to open its windows."""
        conn = self.conn
        view = memoryview(data)
        while True:
            self._check()
            room = min(self.send_window, conn.send_window, conn.peer_frame, len(view))
            if not conn.writable or (room <= 0 and len(view)):
                await conn.until_writable()
                continue
            room = max(room, 0)  # nothing to send (b""): a window below 0 stays as it is
            chunk = bytes(view[:room])
            view = view[room:]
            self.send_window -= room
            conn.send_window -= room
            last = not len(view)
            if last and end_stream:
                self.local_closed = True
            conn.write(frame(DATA, END_STREAM if last and end_stream else 0, self.id, chunk))
            if last:
                return

    def release(self) -> None:
        """The call is done with the stream (its task ended): forget it and its unread
        bytes (the connection's window took them back as they came), and reset it if
        its answer never ended."""
        conn = self.conn
        if conn.streams.pop(self.id, None) is None:
            return
        self._chunks = bytearray()
        self._held = 0
        if not self.local_closed and self.gone is None and conn.transport is not None:
            self.local_closed = True
            conn.out.append(frame(RST_STREAM, 0, self.id, U32.pack(INTERNAL_ERROR)))
        conn.flush()
