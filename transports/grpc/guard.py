"""The gRPC input boundary and last resort, for every method of every service.

:func:`guarded` wraps each method's handler so that

- a request that does not decode (bad protobuf bytes, invalid UTF-8 in a
  string field) ends the call with ``INVALID_ARGUMENT``, not the ``UNKNOWN``
  or ``INTERNAL`` grpc answers by itself;
- a core error that escapes a servicer ends it with its mapped status
  (:mod:`sessiontape.transports.grpc.status`);
- anything else ends it with ``INTERNAL`` and a request id, logged once with
  that id; the exception's text never reaches the client;
- a streaming response is sent with ``context.write`` from the call's own
  task, and the servicer's generator is closed in that task however the call
  ends. Handed to grpc.aio (this server's first) as an async generator, a
  generator suspended at a ``yield`` while the send was awaited was left open
  when the call was cancelled (a client gone, a server shutdown): its cleanup (recording the
  generation as cancelled) ran later, in whatever task the interpreter's
  finalizer made, after a draining server had stopped waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sessiontape.core.errors import InvalidArgument
from sessiontape.transports.grpc.calls import CLIENT_GONE, Aborted, Method, MethodTable
from sessiontape.transports.grpc.status import code_for, message_for


class _Undecodable:
    """What the wrapped deserializer returns for bytes that are not the request message."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _deserializer(inner: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if inner is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return inner(data)
        except (
            Exception
        ) as exc:  # DecodeError, UnicodeDecodeError, ...: the client's bytes, not a bug
            return _Undecodable(f"{type(exc).__name__}: {str(exc)[:200]}")

    return decode


def _refuse(request: _Undecodable) -> InvalidArgument:
    return InvalidArgument(f"request message does not decode ({request.reason})")


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise _refuse(request)
        yield request


async def _end(context: Any, exc: BaseException) -> None:
    await context.abort(code_for(exc), message_for(exc))


def _is_abort(exc: BaseException) -> bool:
    # context.abort raises Aborted, and a client gone ends the call with nobody to tell:
    # they pass through untouched (the latter is no internal error to log)
    return isinstance(exc, (Aborted, asyncio.CancelledError, *CLIENT_GONE))


def _unary_response(
    behavior: Callable[..., Awaitable[Any]], streaming_request: bool
) -> Callable[..., Any]:
    async def call(request: Any, context: Any) -> Any:
        try:
            if streaming_request:
                request = _checked(request)
            elif isinstance(request, _Undecodable):
                raise _refuse(request)
            return await behavior(request, context)
        except BaseException as exc:
            if _is_abort(exc) or not isinstance(exc, Exception):
                raise
            await _end(context, exc)

    return call


def _stream_response(behavior: Callable[..., Any], streaming_request: bool) -> Callable[..., Any]:
    async def call(request: Any, context: Any) -> None:
        try:
            if streaming_request:
                request = _checked(request)
            elif isinstance(request, _Undecodable):
                raise _refuse(request)
            responses = behavior(request, context)
            if not hasattr(responses, "__aiter__"):
                await responses  # a servicer that writes with context.write itself
                return
            try:
                async for response in responses:
                    await context.write(response)
            finally:
                aclose = getattr(responses, "aclose", None)
                if aclose is not None:
                    await aclose()  # in this task, whatever ended the call
        except BaseException as exc:
            if _is_abort(exc) or not isinstance(exc, Exception):
                raise
            await _end(context, exc)

    return call


def guarded(path: str, handler: Any) -> Method:
    """The method of a grpc ``RpcMethodHandler``, with the decode check and the last-resort
    mapping around its behavior."""
    streaming_request, streaming_response = (
        bool(handler.request_streaming),
        bool(handler.response_streaming),
    )
    behavior = {
        (False, False): handler.unary_unary,
        (True, False): handler.stream_unary,
        (False, True): handler.unary_stream,
        (True, True): handler.stream_stream,
    }[(streaming_request, streaming_response)]
    call = (
        _stream_response(behavior, streaming_request)
        if streaming_response
        else _unary_response(behavior, streaming_request)
    )
    deserialize = _deserializer(handler.request_deserializer) or (lambda data: data)
    serialize = handler.response_serializer or (lambda message: message)
    return Method(path, streaming_request, streaming_response, call, deserialize, serialize)


def guarded_methods(table: MethodTable) -> dict[str, Method]:
    """Every method registered on ``table``, guarded, by path."""
    return {path: guarded(path, h) for path, h in table.handlers.items()}


__all__ = ["guarded", "guarded_methods"]
