"""The HTTP/1.1 protocol uvicorn serves sessiontape's HTTP transport with: httptools'
parser, plus the limits uvicorn does not set (transports/http/plugin.py starts it)."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeadTooLarge(Exception):
    """A request line and headers past ``[limits] max_header_bytes``: the parser stops, and
    uvicorn answers 400 and closes the connection."""


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol under ``header_timeout_s`` and ``max_header_bytes``
    (set by :func:`guarded_httptools`)."""

    header_timeout_s = 10.0
    max_header_bytes = 16 * 1024
    _header_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0
    _in_head = True
    #: the 400 owed for bytes that follow requests still being answered
    _refusal: str | None = None

    def send_400_response(self, msg: str) -> None:
        """uvicorn writes the 400 and closes at once, even when the bad bytes follow
        whole requests still being answered: their answers were lost while what they
        did stood (a pipelined close closed the session and its client saw only the
        400). Those are answered first, then the 400; a request whose own bytes are
        bad is refused at once, as before."""
        if self._refusal is not None:
            return
        cycle = self.cycle
        if cycle is not None and not cycle.more_body and not self._answered():
            self._refusal = msg
            self.flow.pause_reading()
            return
        super().send_400_response(msg)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._refusal is not None and self._answered() and not self.transport.is_closing():
            super().send_400_response(self._refusal)

    def _answered(self) -> bool:
        return not self.pipeline and (self.cycle is None or self.cycle.response_complete)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0
        if self._header_timer is None:
            self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # with ": " and CRLF, as sent
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.max_header_bytes:
            raise HeadTooLarge(f"request head over {self.max_header_bytes} bytes")

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._in_head and not self.transport.is_closing():
            self.transport.close()


def guarded_httptools(header_timeout_s: float, max_header_bytes: int) -> type[GuardedHttpTools]:
    """uvicorn's httptools protocol plus a header deadline and a header size limit.

    A connection whose request line and headers have not all arrived
    ``header_timeout_s`` after it opened (or after the first byte of a keep-alive
    request) is closed (slowloris); uvicorn has no such timeout. A request line and
    headers longer than ``max_header_bytes`` are answered 400; llhttp sets no limit
    of its own. httptools rather than h11: h11 runs its per-event state machine on
    every chunk written, which costs a streamed SSE turn several per cent of the
    server's CPU."""
    return type(
        "GuardedHttpTools",
        (GuardedHttpTools,),
        {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes},
    )
