"""Raw gRPC calls for the gRPC tests: request bytes sent as they are, no serializer."""

from __future__ import annotations

from typing import Any

import grpc


async def raw_call(
    channel: grpc.aio.Channel,
    path: str,
    client_streaming: bool,
    server_streaming: bool,
    payload: bytes,
    metadata: Any = None,
) -> grpc.StatusCode:
    """Send ``payload`` as the request bytes (no serializer); the call's final status."""
    try:
        if client_streaming:
            call: Any = (channel.stream_stream if server_streaming else channel.stream_unary)(path)(
                iter([payload]), metadata=metadata
            )
        else:
            call = (channel.unary_stream if server_streaming else channel.unary_unary)(path)(
                payload, metadata=metadata
            )
        if server_streaming:
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK
