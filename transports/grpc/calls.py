"""One gRPC call on an HTTP/2 stream: its request messages in, its servicer run, its
messages and status out.

The gRPC server (:mod:`sessiontape.transports.grpc.server`) takes HTTP/2 itself from
:mod:`sessiontape.transports.grpc.http2` (connections, streams, flow control, all in
the event loop); what a gRPC call is on one stream is here:

- the request's headers checked (``POST``, ``application/grpc``), its method found,
  its bearer token checked, its ``grpc-timeout`` kept as a deadline;
- request messages read with their size checked from their 5-byte prefix, before
  their bytes are taken (``max_message_bytes``), and ``gzip``/``deflate`` ones
  inflated up to that size;
- the servicer given a :class:`ServicerContext`, grpc.aio's servicer context as far
  as sessiontape's servicers and grpcio's health and reflection servicers use it, plus
  ``write_many``: the messages of one committed run handed to the connection in one
  write (gRPC messages are a byte stream; a Kakeya run of 16 tokens is one ``send``,
  not 16);
- the status sent as trailers, or as a trailers-only response when nothing else was.

Why not grpc.aio: its core hands every message to a thread of its own and back (an
``eventfd`` kick, a poller thread's wake, a socket write to wake the loop), one message
in flight a call; a short Kakeya turn paid 22 such round trips, a quarter of its CPU
(docs/architecture.md, "The gRPC server").
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from grpclib.metadata import Deadline, decode_metadata, encode_grpc_message, encode_metadata

from sessiontape.core.errors import InvalidArgument, ResourceExhausted
from sessiontape.transports.grpc.http2 import Stream, StreamEndedShort, StreamGone
from sessiontape.transports.grpc.status import code_for, message_for

CONTENT_TYPE = "application/grpc"
#: what a call's stream raises once its client is gone (a reset, a lost connection)
CLIENT_GONE = (StreamGone, ConnectionError)
#: how long a call whose client streams its requests waits for the first one before
#: answering a status other than OK, when it read none (see :func:`await_first_request`)
FIRST_REQUEST_WAIT_S = 0.25
ACCEPT_ENCODING = "identity,deflate,gzip"
#: zlib's window bits for each request encoding this server inflates
_INFLATE = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class Aborted(Exception):
    """``context.abort``: the call ends with this status, sent as its trailers."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


@dataclass(frozen=True, slots=True)
class Method:
    """One method a server answers: its path, shape, behavior and message codecs."""

    path: str
    request_streaming: bool
    response_streaming: bool
    #: ``(request or request iterator, context)``: awaitable of the response (unary), or
    #: awaitable of None, the servicer having written its messages with the context
    behavior: Callable[[Any, ServicerContext], Any]
    deserialize: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]


class MethodTable:
    """The methods of a server, by path. It stands in for a grpc.aio server to what
    registers on one: generated ``add_*Servicer_to_server`` functions, grpcio-health-checking,
    grpcio-reflection. Each registers ``grpc.RpcMethodHandler`` objects."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        for name, handler in handlers.items():
            self.handlers[f"/{service}/{name}"] = handler

    def add_generic_rpc_handlers(self, generic: Iterable[Any]) -> None:
        for g in generic:
            table = getattr(g, "_method_handlers", None)  # grpc.method_handlers_generic_handler's
            if not isinstance(table, dict):
                raise TypeError(f"a generic handler without a method table: {g!r}")
            self.handlers.update(table)


class ServicerContext:
    """A servicer's view of its call (grpc.aio's ``ServicerContext``, the part in use)."""

    __slots__ = ("_call", "code", "details")

    def __init__(self, call: Call) -> None:
        self._call = call
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def write(self, message: Any) -> None:
        await self._call.send((message,))

    async def write_many(self, messages: Sequence[Any]) -> None:
        """``messages`` in order, handed to the connection in one write."""
        if messages:
            await self._call.send(messages)

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: Any) -> NoReturn:
        raise Aborted(code, details)

    async def send_initial_metadata(self, metadata: Iterable[tuple[str, str]]) -> None:
        await self._call.send_headers(list(metadata))

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return tuple(self._call.metadata.items())

    def peer(self) -> str:
        return self._call.peer()

    def time_remaining(self) -> float | None:
        d = self._call.deadline
        return None if d is None else d.time_remaining()

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def _frame(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


class Call:
    """One call's stream: reading its request messages, writing its answer."""

    __slots__ = (
        "deadline",
        "encoding",
        "headers_sent",
        "limit",
        "metadata",
        "method",
        "received",
        "stream",
    )

    def __init__(
        self,
        stream: Stream,
        method: Method,
        headers: Sequence[tuple[str, str]],
        deadline: Deadline | None,
        limit: int,
    ) -> None:
        self.stream = stream
        self.method = method
        self.metadata = decode_metadata(headers)
        self.encoding = next((v for k, v in headers if k == "grpc-encoding"), "identity")
        self.deadline = deadline
        self.limit = limit
        #: whether the response headers went out (set once they are written)
        self.headers_sent = False
        #: request bytes taken from the stream so far
        self.received = 0

    def peer(self) -> str:
        addr = self.stream.peer()
        if not addr:
            return "unknown"
        host, port = addr[0], addr[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"

    async def recv(self) -> Any | None:
        """The next request message decoded (None once the client finished sending)."""
        try:
            prefix = await self.stream.recv_data(5)
            if not prefix:
                return None
            compressed, size = prefix[0], int.from_bytes(prefix[1:5], "big")
            if size > self.limit:
                raise ResourceExhausted(
                    f"request message of {size} bytes exceeds the limit of {self.limit}"
                    " (max_message_bytes)"
                )
            data = await self.stream.recv_data(size)
            self.received += 5 + size
        except StreamEndedShort:
            raise InvalidArgument("the request stream ended inside a message") from None
        if compressed:
            data = self._inflate(data)
        return self.method.deserialize(data)

    def _inflate(self, data: bytes) -> bytes:
        bits = _INFLATE.get(self.encoding)
        if bits is None:
            raise InvalidArgument(f"request message compressed with {self.encoding!r}")
        inflater = zlib.decompressobj(bits)
        try:
            out = inflater.decompress(data, self.limit + 1)
        except zlib.error as exc:
            raise InvalidArgument(f"request message does not inflate ({exc})") from None
        if len(out) > self.limit or inflater.unconsumed_tail:
            raise ResourceExhausted(
                f"request message inflates past the limit of {self.limit} bytes (max_message_bytes)"
            )
        if not inflater.eof:
            raise InvalidArgument("request message does not inflate (it ends short)")
        return out

    async def requests(self) -> AsyncIterator[Any]:
        while (message := await self.recv()) is not None:
            yield message

    async def request(self) -> Any:
        message = await self.recv()
        if message is None:
            raise InvalidArgument("the call carried no request message")
        return message

    def _initial(self, metadata: Sequence[tuple[str, str]] = ()) -> list[tuple[str, str]]:
        if self.headers_sent:
            raise InvalidArgument("initial metadata was already sent")
        return [
            (":status", "200"),
            ("content-type", CONTENT_TYPE),
            ("grpc-accept-encoding", ACCEPT_ENCODING),
            *encode_metadata(metadata),
        ]

    def _frames(self, messages: Iterable[Any]) -> bytes:
        serialize, limit = self.method.serialize, self.limit
        parts = []
        for m in messages:
            payload = serialize(m)
            if len(payload) > limit:
                raise ResourceExhausted(
                    f"response message of {len(payload)} bytes exceeds the limit of {limit}"
                    " (max_message_bytes)"
                )
            parts.append(_frame(payload))
        return b"".join(parts)

    async def send_headers(self, metadata: Sequence[tuple[str, str]] = ()) -> None:
        await self.stream.send_headers(self._initial(metadata))
        self.headers_sent = True

    async def send(self, messages: Iterable[Any], *, last: bool = False) -> None:
        """``messages`` (with the response headers, the first time; ``last``: with the OK
        status too) in one write where the connection takes it now, else frame by frame,
        waiting for the client's windows."""
        data = self._frames(messages)
        headers = None if self.headers_sent else self._initial()
        trailers = _status(grpc.StatusCode.OK, "") if last else None
        if self.stream.try_send(headers, data, trailers):
            if headers is not None:
                self.headers_sent = True
            return
        if headers is not None:
            await self.stream.send_headers(headers)
            self.headers_sent = True
        await self.stream.send_data(data)
        if trailers is not None:
            await self.stream.send_headers(trailers, end_stream=True)

    async def finish(self, code: grpc.StatusCode, details: str = "") -> None:
        """The status, as trailers (or a trailers-only response), ending the stream."""
        status = _status(code, details)
        if not self.headers_sent:  # a trailers-only response
            status = [(":status", "200"), ("content-type", CONTENT_TYPE), *status]
        # cancelled while it waits to write, nothing went: a second finish is trailers-only
        await self.stream.send_headers(status, end_stream=True)
        self.headers_sent = True

    async def failing(self) -> None:
        """Before a status other than OK: a call whose client streams its requests and of
        which nothing was read waits for the first (:func:`await_first_request`)."""
        if self.method.request_streaming and self.received == 0:
            await await_first_request(self.stream)


def _status(code: grpc.StatusCode, details: str) -> list[tuple[str, str]]:
    status = [("grpc-status", str(code.value[0]))]
    if details:
        status.append(("grpc-message", encode_grpc_message(details)))
    return status


async def await_first_request(stream: Stream) -> None:
    """Wait (at most ``FIRST_REQUEST_WAIT_S``) for a client's first request on ``stream``.
    grpcio's clients write it as a streaming-request call starts, and one whose write finds
    the call already ended reports INTERNAL ("Internal error from Core") in place of the
    status the server sent."""
    with contextlib.suppress(TimeoutError, StreamEndedShort, *CLIENT_GONE):
        await asyncio.wait_for(stream.recv_data(1), FIRST_REQUEST_WAIT_S)


async def run(call: Call) -> None:
    """The servicer's behavior for ``call``, its answer and its status."""
    method, ctx = call.method, ServicerContext(call)
    try:
        request = call.requests() if method.request_streaming else await call.request()
        out = await method.behavior(request, ctx)
        if not method.response_streaming:
            if out is None:  # a generated servicer's unimplemented method sets a code
                raise Aborted(
                    ctx.code or grpc.StatusCode.UNKNOWN, ctx.details or "no response message"
                )
            await call.send((out,), last=True)
            return
    except Aborted as exc:
        await call.failing()
        await call.finish(exc.code, exc.details)
        return
    except CLIENT_GONE:
        raise
    except Exception as exc:  # outside the servicer: its request did not read
        await call.failing()
        await call.finish(code_for(exc), message_for(exc))
        return
    await call.finish(grpc.StatusCode.OK)


async def refuse(stream: Stream, code: grpc.StatusCode, details: str, http: int = 200) -> None:
    """A trailers-only answer to a request that never became a call."""
    headers = [(":status", str(http)), ("content-type", CONTENT_TYPE), *_status(code, details)]
    await stream.send_headers(headers, end_stream=True)


__all__ = [
    "Aborted",
    "Call",
    "Method",
    "MethodTable",
    "ServicerContext",
    "await_first_request",
    "refuse",
    "run",
]
