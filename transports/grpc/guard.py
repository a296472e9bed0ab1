"""The gRPC input boundary and last resort, for every method of every service.

:class:`GuardInterceptor` wraps each handler so that

- a request that does not decode (bad protobuf bytes, invalid UTF-8 in a
  string field) ends the call with ``INVALID_ARGUMENT``, not the ``UNKNOWN``
  or ``INTERNAL`` grpc answers by itself;
- a core error that escapes a servicer ends it with its mapped status
  (:mod:`sessiontape.transports.grpc.status`);
- anything else ends it with ``INTERNAL`` and a request id, logged once with
  that id; the exception's text never reaches the client;
- a streaming response is sent with ``context.write`` from the call's own
  task, and the servicer's generator is closed in that task however the call
  ends. Handed to grpc as an async generator, a generator suspended at a
  ``yield`` while grpc awaited the send was left open when the call was
  cancelled (a client gone, a server shutdown): its cleanup (recording the
  generation as cancelled) ran later, in whatever task the interpreter's
  finalizer made, after a draining server had stopped waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from sessiontape.core.errors import InvalidArgument
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
    # context.abort raises grpc.aio.AbortError; it must pass through untouched
    return isinstance(exc, grpc.aio.AbortError | asyncio.CancelledError)


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


_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def guarded(handler: Any) -> Any:
    """``handler`` with the decode check and the last-resort mapping around its behavior."""
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
    if behavior is None:
        return handler
    call = (
        _stream_response(behavior, streaming_request)
        if streaming_response
        else _unary_response(behavior, streaming_request)  # no write of its own to wait for
    )
    return _MAKERS[(streaming_request, streaming_response)](
        call,
        request_deserializer=_deserializer(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )


class GuardInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Installed first, so it wraps every handler, the auth interceptor's refusals included."""

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        handler = await continuation(details)
        return None if handler is None else guarded(handler)


__all__ = ["GuardInterceptor", "guarded"]
