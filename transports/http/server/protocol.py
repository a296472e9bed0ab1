"""The HTTP/1.1 protocol uvicorn serves sessiontape's HTTP transport with.

uvicorn's h11 protocol, chosen and bounded through uvicorn's public configuration
(transports/http/plugin.py): ``http="h11"``, ``h11_max_incomplete_event_size`` (a
request line and headers past ``[limits] max_header_bytes`` are answered 400),
``timeout_keep_alive`` and ``limit_concurrency``. h11 parses pipelined requests one
after another, so bytes that are no request behind a whole one are refused (400) only
after that one's answer.

One limit uvicorn has no setting for: a deadline on a request's head. A client that
sends its head a byte at a time (slowloris) would hold its connection for as long as
it likes. :class:`HeadDeadline` closes a connection whose first request line and
headers have not all arrived ``[limits] header_timeout_s`` after it opened. It wraps
(never subclasses) the protocol class uvicorn builds for ``http="h11"``, passing every
``asyncio.Protocol`` call through, and relies only on uvicorn constructing its
protocol with keyword arguments (``uvicorn.Config(http=<class>)`` is public; the
keywords are uvicorn's, tested with uvicorn 0.54, pinned in pyproject.toml). Later heads
on a kept-alive connection have no deadline of their own; every connection counts
against ``[limits] max_connections``.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: the end of a request's head
HEAD_END = b"\r\n\r\n"


class HeadDeadline(asyncio.Protocol):
    """uvicorn's h11 protocol, closed when the first head is late (see the module doc)."""

    #: set per server by :func:`with_head_deadline`
    header_timeout_s = 10.0

    def __init__(self, **kwargs: Any) -> None:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        self.inner: asyncio.Protocol = H11Protocol(**kwargs)
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.BaseTransport | None = None
        #: the last bytes seen, so a head end split across reads is found
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._timer = self._loop.call_later(self.header_timeout_s, self._late)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            seen = self._tail + data
            if HEAD_END in seen:
                self._disarm()
            else:
                self._tail = seen[-(len(HEAD_END) - 1) :]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._tail = b""

    def _late(self) -> None:
        self._timer = None
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()


def with_head_deadline(header_timeout_s: float) -> type[HeadDeadline]:
    """:class:`HeadDeadline` with ``header_timeout_s``, for ``uvicorn.Config(http=...)``."""
    return type("HeadDeadline", (HeadDeadline,), {"header_timeout_s": header_timeout_s})
