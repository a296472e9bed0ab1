"""salience.v1.Salience: token sessions with offsets, forks, logprobs and readouts.

Every call is a thin translation onto :class:`sessiontape.core.runtime.Runtime`; the
rules about the session (offset drift, truncating rewinds, vocabulary,
image pad runs, fork boundaries, context length) are the core's. What this
module decides is wire-level only, and docs/protocols/salience.md lists it:

- ``OpenSession(model)``: empty or the served ``model_id``; anything else is
  FAILED_PRECONDITION (:class:`ModelMismatch`), since the request is well
  formed but this server serves another model.
- ``CloseSession`` of a closed or expired session succeeds; of an id that
  never existed it is NOT_FOUND.
- A closed or expired session answers NOT_FOUND to every other call.
- A Generate with no tokens, no images, ``max_tokens`` 0 and no ranges at
  the current offset only refreshes the TTL and records nothing.
- Stop ids end a generation with FINISH_REASON_EOS (the schema's "emitted
  EOS / stop token"); STOP_STRING is never sent (the request has no stop
  strings).
- Salience pins no seed: each Generate passes none, so the runtime draws
  one and records it in ``generation.started``; replay reproduces the tokens.
- Readout ranges on an engine without a readout manifest are the runtime's
  to refuse (INVALID_ARGUMENT, ``invalid_range``), like every range rule.
"""

from __future__ import annotations

from typing import Any

from sessiontape.core.bodies import GenerationFinished, GenerationToken, body
from sessiontape.core.engine.interface import OutputOptions, SamplingParams, left_to_model
from sessiontape.core.errors import ModelMismatch
from sessiontape.core.events import Event, T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.runtime import Runtime
from sessiontape.core.tokens import ImageIn
from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2 as pb
from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2_grpc as pb_grpc
from sessiontape.transports.grpc.service import GrpcService
from sessiontape.transports.grpc.settings import GrpcSettings
from sessiontape.transports.grpc.tokensessions import (
    Generations,
    closing,
    constraint_of,
    covered,
    grpc_errors,
    live_session,
    token_ids,
)

__all__ = ["SalienceService"]

SERVICE = "salience.v1.Salience"
PROTOCOL = "salience"

_FINISH = {
    "eos": pb.GenerateDone.FINISH_REASON_EOS,
    "stop": pb.GenerateDone.FINISH_REASON_EOS,
    "length": pb.GenerateDone.FINISH_REASON_LENGTH,
    "cancelled": pb.GenerateDone.FINISH_REASON_CANCELLED,
}


class SalienceService(pb_grpc.SalienceServicer, GrpcService):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.generations = Generations()

    @classmethod
    def create(cls, runtime: Runtime, settings: GrpcSettings) -> SalienceService:
        return cls(runtime)

    def add_to(self, server: Any) -> list[str]:
        pb_grpc.add_SalienceServicer_to_server(self, server)
        return [SERVICE]

    async def drain(self, limit_s: float) -> None:
        await self.generations.drain(limit_s)

    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: Any
    ) -> pb.OpenSessionResponse:
        async with grpc_errors(context):
            info = self.runtime.engine.info
            if request.model and request.model != info.model_id:
                raise ModelMismatch(f"this server serves {info.model_id!r}, not {request.model!r}")
            st = await self.runtime.open_session(PROTOCOL, mode="offset")
        return pb.OpenSessionResponse(session_id=st.session_id, max_model_len=info.max_length)

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: Any
    ) -> pb.CloseSessionResponse:
        async with grpc_errors(context, request.session_id):
            # idempotent: Runtime.close leaves a closed/expired session as it is
            await self.runtime.close(request.session_id)
        return pb.CloseSessionResponse()

    async def ForkSession(
        self, request: pb.ForkSessionRequest, context: Any
    ) -> pb.ForkSessionResponse:
        async with grpc_errors(context, request.session_id):
            await live_session(self.runtime, request.session_id)
            child = await self.runtime.fork(request.session_id, at_position=request.at_position)
        return pb.ForkSessionResponse(session_id=child.session_id)

    async def GetReadoutManifest(
        self, request: pb.GetReadoutManifestRequest, context: Any
    ) -> pb.ReadoutManifest:
        m = self.runtime.engine.info.readout_manifest
        if m is None:
            return pb.ReadoutManifest()
        return pb.ReadoutManifest(
            concepts=list(m.concepts),
            layers=list(m.layers),
            hidden_size=m.hidden_size,
            dtype=m.dtype,
        )

    async def DumpSession(
        self, request: pb.DumpSessionRequest, context: Any
    ) -> pb.DumpSessionResponse:
        async with grpc_errors(context, request.session_id):
            st = await live_session(self.runtime, request.session_id)
        return pb.DumpSessionResponse(tokens=list(st.tokens))

    # grpc.aio also takes a handler that writes with context.write (the stubs type an iterator)
    async def Generate(self, request: pb.GenerateRequest, context: Any) -> None:  # type: ignore[override]
        """Written with ``context.write`` run by run (as Kakeya's: one message per token)."""
        sid = request.session_id
        async with grpc_errors(context, sid):
            # Anything but a no-op is Runtime.generate's to refuse (closed,
            # expired or unknown session included); a no-op needs the length.
            if _is_noop(request):
                st = await live_session(self.runtime, sid)
                if request.offset == st.length:
                    await self.runtime.sessions.touch(sid)
                    await context.write(_done(st.length, 0, "length"))
                    return
            params = SamplingParams(
                max_tokens=request.max_tokens,
                temperature=request.temperature or 1.0,
                top_p=request.top_p or 1.0,
                top_k=request.top_k,
                seed=None,  # the runtime draws one and records it
                stop_token_ids=tuple(request.stop_token_ids),
                # proto3 scalars: 0 is unset, left to the served model's recommendation
                from_model=left_to_model(
                    temperature=request.temperature or None,
                    top_p=request.top_p or None,
                    top_k=request.top_k or None,
                ),
                constraint=constraint_of(context),
            )
            options = OutputOptions(
                logprob_top_k=request.logprob_top_k,
                logprob_ranges=tuple((r.start, r.end) for r in request.logprobs_ranges),
                readout_ranges=tuple((r.start, r.end) for r in request.readout_ranges),
                generated_logprobs=False,
            )
            images = [
                ImageIn(im.bytes, im.mime, im.pad_range_start, im.pad_range_end)
                for im in request.images
            ]
            self.generations.track()
            runs = self.runtime.generate_runs(
                sid,
                GenerateRequest(
                    params,
                    options,
                    append=token_ids(self.runtime, request.append_tokens),
                    offset=request.offset,
                    truncating=request.truncating,
                    images=images,
                    priority=request.priority,
                ),
            )
            wire = _WireEvents(request)
            write = context.write
            async with closing(runs):
                async for run in runs:
                    for ev in run:
                        if (out := wire.event(ev)) is not None:
                            await write(out)


def _is_noop(r: pb.GenerateRequest) -> bool:
    return not (
        r.append_tokens
        or r.images
        or r.max_tokens
        or r.logprobs_ranges
        or r.readout_ranges
        or r.truncating
    )


def _done(prompt: int, completion: int, reason: str) -> pb.GenerateEvent:
    return pb.GenerateEvent(
        done=pb.GenerateDone(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            finish_reason=_FINISH.get(reason, pb.GenerateDone.FINISH_REASON_UNSPECIFIED),
        )
    )


class _WireEvents:
    """The wire form of one Generate call's events (its ranges read once, not per token)."""

    def __init__(self, request: pb.GenerateRequest) -> None:
        self.logprobs = tuple((r.start, r.end) for r in request.logprobs_ranges)
        self.readouts = tuple((r.start, r.end) for r in request.readout_ranges)
        self.top_k = request.logprob_top_k

    def event(self, ev: Event) -> pb.GenerateEvent | None:
        if ev.type == T.GENERATION_TOKEN:
            b = body(ev, GenerationToken)
            pos = int(b["position"])
            out = pb.GenerateEvent()
            tok = out.token
            tok.id = int(b["token"])
            tok.position = pos
            tok.is_prefill = bool(b["is_prefill"])
            # engines may report more than was asked (e.g. top-k on every decode
            # step); the wire carries only what the ranges cover
            logprob = b.get("logprob")
            if logprob is not None and covered(self.logprobs, pos):
                tok.sampled_logprob = float(logprob)
                tok.has_sampled_logprob = True
                if self.top_k:
                    tok.logprobs.extend(
                        pb.TokenLogprob(id=int(i), logprob=float(lp)) for i, lp in b.get("top", ())
                    )
            readout = b.get("readout")
            if readout is not None and covered(self.readouts, pos):
                tok.readout.extend(float(x) for x in readout)
            return out
        if ev.type == T.GENERATION_FINISHED:
            f = body(ev, GenerationFinished)
            return _done(
                int(f["prompt_tokens"]), int(f["completion_tokens"]), str(f["finish_reason"])
            )
        return None  # tokens.truncated (a rewind) and generation.started have no wire form
