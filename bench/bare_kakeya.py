"""A Kakeya server with nothing behind it: the gRPC floor of a short turn.

    .venv/bin/python bench/bare_kakeya.py PORT [--event-loop auto|uvloop|asyncio]

``CreateSession`` and ``AppendTokens`` answer at once; ``Generate`` sends
``max_tokens`` token messages (ids 0, 1, ...) and the done message. No runtime, no
log, no engine: what a turn costs on the wire alone, on a ``grpc.aio`` server as the
real one, each message an awaited ``context.write``. bench/bench_load.py's turns mode runs the same client against it, in the same run as
the real server, so the table can say how much of a turn is the wire's. Prints
``ready`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sessiontape.core.commands.serve import loop_factory
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as pb
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as pbg


class BareKakeya(pbg.RuntimeServiceServicer):
    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: Any
    ) -> pb.CreateSessionResponse:
        return pb.CreateSessionResponse(session_id="bare")

    async def AppendTokens(
        self, request: pb.AppendTokensRequest, context: Any
    ) -> pb.AppendTokensResponse:
        return pb.AppendTokensResponse(history_length=len(request.token_ids))

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: Any
    ) -> pb.CloseSessionResponse:
        return pb.CloseSessionResponse(final_history_length=0)

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> None:  # type: ignore[override]
        done = pb.GenerateDone(
            stop_reason=pb.GenerateDone.STOP_REASON_MAX_TOKENS,
            generated_token_count=request.max_tokens,
        )
        messages = [pb.GenerateResponse(token_id=i) for i in range(request.max_tokens)]
        messages.append(pb.GenerateResponse(done=done))
        for m in messages:
            await context.write(m)


async def serve(port: int) -> None:
    server = grpc.aio.server()
    pbg.add_RuntimeServiceServicer_to_server(BareKakeya(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("port", type=int)
    ap.add_argument("--event-loop", default="auto", choices=("auto", "uvloop", "asyncio"))
    args = ap.parse_args()
    with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
        runner.run(serve(args.port))


if __name__ == "__main__":
    main()
