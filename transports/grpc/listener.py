"""The gRPC endpoint: a listening socket, its HTTP/2 connections, a task per call.

HTTP/2 itself (frames, HPACK, flow control) is :mod:`sessiontape.transports.grpc.http2`:
this module gives each connection a handler, which starts a task per stream. What a
task does with its stream (the gRPC call) is :mod:`sessiontape.transports.grpc.calls`.
Here: which requests become calls (method, shutdown, bearer token), the deadline, and
the endpoint's life (start, graceful stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from grpclib.metadata import Deadline

from sessiontape.core.errors import ConfigError, Unauthenticated
from sessiontape.transports.grpc import calls
from sessiontape.transports.grpc.http2 import Connection, Stream
from sessiontape.transports.grpc.http2.connection import KEEPALIVE_S, KEEPALIVE_TIMEOUT_S
from sessiontape.transports.grpc.status import message_for

_GONE = calls.CLIENT_GONE
#: a grpc-timeout as gRPC's HTTP/2 protocol spells it: at most 8 digits and a unit
_TIMEOUT = re.compile(r"[0-9]{1,8}[HMSmun]")


def authorized(headers: Sequence[tuple[str, str]], expected: bytes) -> bool:
    """``authorization: Bearer <expected>`` among ``headers`` (the scheme in any case)."""
    for key, value in headers:
        if key == "authorization":
            # the scheme is case-insensitive (RFC 9110 section 11.1); the token is not
            scheme, _, token = value.encode(errors="replace").strip().partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected)
    return False


class _Refused(Exception):
    """A request that does not become a call: answered trailers-only.

    A refused call whose client streams its requests (Evergreen, reflection) is answered
    once its first request arrived, or a little later (:func:`calls.await_first_request`).
    """

    def __init__(
        self, code: grpc.StatusCode, details: str, http: int = 200, *, streaming: bool = False
    ) -> None:
        super().__init__(details)
        self.code, self.details, self.http, self.streaming = code, details, http, streaming


class _Calls:
    """The calls of one HTTP/2 connection, a task each (the connection calls these)."""

    __slots__ = ("calls", "server")

    def __init__(self, server: Listener) -> None:
        self.server = server
        self.calls: dict[Stream, asyncio.Task[None]] = {}

    def accept(self, stream: Stream, headers: Sequence[tuple[str, str]]) -> None:
        task = asyncio.get_running_loop().create_task(self.server.serve(stream, headers))
        self.calls[stream] = task
        self.server.running.add(task)
        task.add_done_callback(lambda t: self._done(stream, t))

    def _done(self, stream: Stream, task: asyncio.Task[None]) -> None:
        # here, not in the task: a task cancelled before its first step (a reset that came
        # in the same read as the request) runs none of its code, and an unreleased stream
        # keeps its unread data out of the connection's window for good
        self.calls.pop(stream, None)
        self.server.running.discard(task)
        stream.release()

    def cancel(self, stream: Stream) -> None:  # the client reset the stream, or it went
        task = self.calls.pop(stream, None)
        if task is not None:
            task.cancel()


class _Connection(Connection):
    """An HTTP/2 connection of this endpoint, tracked for shutdown."""

    def __init__(self, server: Listener) -> None:
        super().__init__(
            _Calls(server),
            max_streams=server.max_streams,
            keepalive_s=server.keepalive_s,
            keepalive_timeout_s=server.keepalive_timeout_s,
        )
        self.server = server

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.server.connections.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.server.connections.discard(self)
        super().connection_lost(exc)


class Listener:
    """Serves ``methods`` (by path) on one socket: start, then stop with a grace period.

    ``token``: the bearer token every call needs but those whose path starts with one
    of ``open_prefixes`` (empty: no token). ``max_message_bytes`` caps each message
    both ways; ``max_streams`` the streams one connection may have open at once;
    ``keepalive_s`` the silence after which a connection is pinged, closed if the
    answer takes over ``keepalive_timeout_s``.
    """

    def __init__(
        self,
        methods: Mapping[str, calls.Method],
        *,
        max_message_bytes: int,
        max_streams: int,
        token: str = "",
        open_prefixes: tuple[str, ...] = (),
        keepalive_s: float = KEEPALIVE_S,
        keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
    ) -> None:
        self.methods = dict(methods)
        self.keepalive_s, self.keepalive_timeout_s = keepalive_s, keepalive_timeout_s
        self.max_message_bytes = max_message_bytes
        self.max_streams = max_streams
        self.open_prefixes = open_prefixes
        self.port: int | None = None
        self.running: set[asyncio.Task[None]] = set()
        self.connections: set[_Connection] = set()
        self._token = token.encode()
        self._socket: asyncio.Server | None = None
        self._stopping = False

    async def start(self, host: str, port: int, context: ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port."""
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self._socket = await asyncio.get_running_loop().create_server(
                lambda: _Connection(self), host, port, ssl=context, reuse_address=True
            )
        except OSError as exc:
            raise ConfigError(f"transports.grpc: cannot listen on {address}: {exc}") from exc
        self.port = int(self._socket.sockets[0].getsockname()[1])
        return self.port

    def _method(self, headers: Sequence[tuple[str, str]]) -> calls.Method:
        """The method a request's headers call, or why it is refused."""
        h = dict(headers)
        if h.get(":method") != "POST":
            raise _Refused(grpc.StatusCode.UNIMPLEMENTED, "gRPC calls are POST requests", 405)
        if not h.get("content-type", "").startswith(calls.CONTENT_TYPE):
            raise _Refused(grpc.StatusCode.UNKNOWN, "content-type is not application/grpc", 415)
        path = h.get(":path", "")
        method = self.methods.get(path)
        # which methods exist is for authorized clients to learn: the token comes first
        streaming = method is not None and method.request_streaming
        if self._stopping:
            raise _Refused(
                grpc.StatusCode.UNAVAILABLE, "the server is shutting down", streaming=streaming
            )
        if (
            self._token
            and not path.startswith(self.open_prefixes)
            and not authorized(headers, self._token)
        ):
            refused = Unauthenticated(
                "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"
            )
            raise _Refused(
                grpc.StatusCode.UNAUTHENTICATED, message_for(refused), streaming=streaming
            )
        if method is None:
            raise _Refused(grpc.StatusCode.UNIMPLEMENTED, f"method not found: {path}")
        return method

    async def serve(self, stream: Stream, headers: Sequence[tuple[str, str]]) -> None:
        """One call, from its request's headers to its status (its stream is released when
        the task is done: ``_Connection``)."""
        expired = False
        task = asyncio.current_task()
        assert task is not None
        this: asyncio.Task[Any] = task

        def expire() -> None:
            nonlocal expired
            expired = True
            this.cancel()

        timer = None
        call: calls.Call | None = None
        try:
            method = self._method(headers)
            try:
                for key, value in headers:
                    if key == "grpc-timeout" and not _TIMEOUT.fullmatch(value):
                        raise ValueError(value)
                deadline = Deadline.from_headers(headers)
                call = calls.Call(stream, method, headers, deadline, self.max_message_bytes)
            except Exception as exc:  # a malformed grpc-timeout or binary metadata value
                raise _Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"malformed request headers ({type(exc).__name__})",
                    streaming=method.request_streaming,
                ) from None
            if deadline is not None:
                timer = asyncio.get_running_loop().call_later(deadline.time_remaining(), expire)
            await calls.run(call)
        except _Refused as exc:
            with contextlib.suppress(*_GONE):
                if exc.streaming:
                    await calls.await_first_request(stream)
                await calls.refuse(stream, exc.code, exc.details, exc.http)
        except asyncio.CancelledError:
            # the deadline passed or the server stopped: the client hears why; a client
            # that reset its stream or closed its connection hears nothing more
            code = (
                grpc.StatusCode.DEADLINE_EXCEEDED
                if expired
                else grpc.StatusCode.UNAVAILABLE
                if self._stopping
                else None
            )
            if code is None or call is None:
                raise
            this.uncancel()  # cancelled by this endpoint, to answer with a status
            with contextlib.suppress(*_GONE):
                await call.finish(code, "deadline exceeded" if expired else "the server stopped")
        except _GONE:
            pass
        finally:
            if timer is not None:
                timer.cancel()

    async def stop(self, grace: float) -> None:
        """Refuse new connections and calls (GOAWAY on every connection: clients take new
        calls elsewhere), let calls in flight run up to ``grace`` s, cancel the rest (their
        clients hear ``UNAVAILABLE``) and close the connections."""
        if self._socket is None:
            return
        self._stopping = True
        self._socket.close()
        for conn in list(self.connections):
            conn.going_away()
        pending = set(self.running)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=grace)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=max(grace, 5.0))
        for conn in list(self.connections):
            conn.close("the server stopped")
        self._socket = None
