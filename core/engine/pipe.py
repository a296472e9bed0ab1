"""The pipe between the server and its engine worker: multiprocessing's framing (a 4-byte
big-endian length, or -1 and an 8-byte one, then a pickle), read and written without
blocking the event loop of the side that holds it.

The server reads with :class:`Frames` and writes with ``Connection.send_bytes`` (a
few small messages a generation; the child always reads). The child writes with
:class:`Outbox`: its steps are most of the traffic, and a write must never wait for
the server, which may itself be blocked writing to the child.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import socket
from typing import Any

#: the largest length the 4-byte header carries (multiprocessing's own limit)
_SHORT_MAX = 0x7FFFFFFF


def framed(data: bytes) -> bytes:
    """``data`` with the header ``Connection.recv_bytes`` reads."""
    n = len(data)
    if n > _SHORT_MAX:
        return b"\xff\xff\xff\xff" + n.to_bytes(8, "big") + data
    return n.to_bytes(4, "big") + data


class Frames:
    """The messages on a pipe as they arrive, read without blocking: all that is there in
    one ``recv``, where ``Connection`` takes a ``poll`` and two reads a message."""

    def __init__(self, fd: int) -> None:
        self._sock = socket.socket(fileno=os.dup(fd))
        self._buf = bytearray()

    def read(self) -> list[Any]:
        """The messages complete so far (none if nothing arrived); EOFError once the
        other end is closed."""
        try:
            data = self._sock.recv(1 << 18, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return []
        if not data:
            raise EOFError("the other end of the engine worker's pipe is closed")
        buf = self._buf
        buf += data
        out: list[Any] = []
        pos, end = 0, len(buf)
        while end - pos >= 4:
            n = int.from_bytes(buf[pos : pos + 4], "big", signed=True)
            start = pos + 4
            if n == -1:
                if end - pos < 12:
                    break
                n, start = int.from_bytes(buf[pos + 4 : pos + 12], "big"), pos + 12
            if end - start < n:
                break
            out.append(pickle.loads(buf[start : start + n]))
            pos = start + n
        del buf[:pos]
        return out

    def close(self) -> None:
        self._sock.close()


class Outbox:
    """Messages written from the event loop without ever blocking it.

    A message is framed into one buffer when it is put; the buffer is written once
    the loop's ready callbacks have run, so the messages of one loop pass (every
    generation's batch that flushed in it) go in one write and wake the reader once.
    What the pipe does not take waits for it to drain (``add_writer``), while the
    loop goes on reading. No writer thread: its hand-overs of the interpreter lock
    would cost the child about as much as the engine's own steps.
    """

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self._sock = socket.socket(fileno=os.dup(fd))
        self._sock.setblocking(False)
        self._loop = loop
        self._buf = bytearray()
        self._scheduled = False  # a write waits in the loop's ready queue
        self._watching = False  # a write waits for the pipe to take more
        #: the other end went away: what is put is dropped (its reader sees the end)
        self.broken = False

    def put(self, msg: tuple[Any, ...]) -> None:
        if self.broken:
            return
        self._buf += framed(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
        if not self._scheduled and not self._watching:
            self._scheduled = True
            self._loop.call_soon(self._write)

    def _write(self) -> None:
        self._scheduled = False
        if not self._buf or self.broken:
            return
        try:
            sent = self._sock.send(self._buf)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._break()
            return
        del self._buf[:sent]
        if self._buf and not self._watching:
            self._watching = True
            self._loop.add_writer(self._sock.fileno(), self._write)
        elif not self._buf and self._watching:
            self._watching = False
            self._loop.remove_writer(self._sock.fileno())

    def _break(self) -> None:
        self.broken = True
        self._buf.clear()
        if self._watching:
            self._watching = False
            self._loop.remove_writer(self._sock.fileno())

    def close(self, timeout_s: float) -> None:
        """Write what is left, waiting at most ``timeout_s`` for the pipe, then close."""
        if self._watching:
            self._watching = False
            self._loop.remove_writer(self._sock.fileno())
        with contextlib.suppress(OSError):
            if self._buf and not self.broken:
                self._sock.settimeout(timeout_s)
                self._sock.sendall(self._buf)
        self._buf.clear()
        self._sock.close()
