"""kakeya.v1.RuntimeService: append-only raw-token sessions with seeded Generate.

A translation onto :class:`sessiontape.core.runtime.Runtime` (sessions opened with
``mode="append_only"``); the rules (vocabulary, append-only, sink+window
truncation, INV-1/INV-2 checks) are the core's. Wire-level decisions, listed
in docs/protocols/kakeya.md:

- A closed, expired or unknown session answers NOT_FOUND to every call,
  CloseSession included (the schema: "subsequent RPCs ... return NOT_FOUND").
- Sink+window truncation is off unless ``window`` is set, in
  ``[transports.grpc]`` (``sink``, ``window``) or ``[sessions]``
  (``kakeya_sink``, ``kakeya_window``).
- STOP_REASON_TRUNCATED ends a Generate that stopped short of
  ``max_tokens`` because the history filled the model's context.
- No seed pinned (the optional field unset): the runtime draws one and
  records it in ``generation.started``, so replay is exact.
- GetSessionInfo reports and does not refresh the idle clock.
- An INV-1/INV-2 violation aborts the session (``session.aborted``): later
  calls answer NOT_FOUND, except GetSessionInfo, which still reports the
  counters.
"""

from __future__ import annotations

from typing import Any

from sessiontape.core.bodies import GenerationFinished, TokensTruncated, body, generated_token
from sessiontape.core.config import Config
from sessiontape.core.engine.interface import SamplingParams, left_to_model
from sessiontape.core.errors import CacheInvariantViolation
from sessiontape.core.events import Event, T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.runtime import Runtime
from sessiontape.core.session.state import ABORTED
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as pb
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as pb_grpc
from sessiontape.transports.grpc.service import GrpcService
from sessiontape.transports.grpc.settings import GrpcSettings
from sessiontape.transports.grpc.tokensessions import (
    Generations,
    closing,
    constraint_of,
    grpc_errors,
    live_session,
    token_ids,
)

__all__ = ["KakeyaService"]

SERVICE = "kakeya.v1.RuntimeService"
PROTOCOL = "kakeya"

_Done = pb.GenerateDone
_STOP = {
    "eos": _Done.STOP_REASON_EOS,
    "stop": _Done.STOP_REASON_EOS,
    "length": _Done.STOP_REASON_MAX_TOKENS,
    "cancelled": _Done.STOP_REASON_CANCELLED,
}


def sink_window(settings: GrpcSettings, config: Config) -> tuple[int, int] | None:
    """The configured (sink, window), or None when truncation is off: ``[transports.grpc]``
    ``sink``/``window`` where set, else ``[sessions]`` ``kakeya_sink``/``kakeya_window``."""
    window = settings.window if settings.window is not None else config.sessions.kakeya_window
    if window is None:
        return None
    sink = settings.sink if settings.sink is not None else config.sessions.kakeya_sink
    return sink, window


class KakeyaService(pb_grpc.RuntimeServiceServicer, GrpcService):
    def __init__(self, runtime: Runtime, sink_window: tuple[int, int] | None) -> None:
        self.runtime = runtime
        self.sink_window = sink_window
        self.generations = Generations()

    @classmethod
    def create(cls, runtime: Runtime, settings: GrpcSettings) -> KakeyaService:
        return cls(runtime, sink_window(settings, runtime.config))

    def add_to(self, server: Any) -> list[str]:
        pb_grpc.add_RuntimeServiceServicer_to_server(self, server)
        return [SERVICE]

    async def drain(self, limit_s: float) -> None:
        await self.generations.drain(limit_s)

    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: Any
    ) -> pb.CreateSessionResponse:
        async with grpc_errors(context):
            st = await self.runtime.open_session(
                PROTOCOL,
                mode="append_only",
                label=request.client_label,
                eos_token_ids=list(request.eos_token_ids),
            )
        return pb.CreateSessionResponse(session_id=st.session_id)

    async def AppendTokens(
        self, request: pb.AppendTokensRequest, context: Any
    ) -> pb.AppendTokensResponse:
        # Runtime.append_tokens refuses a closed/expired/unknown session itself;
        # grpc_errors turns its SessionClosed into this protocol's NOT_FOUND.
        async with grpc_errors(context, request.session_id):
            length = await self.runtime.append_tokens(
                request.session_id, token_ids(self.runtime, request.token_ids)
            )
        return pb.AppendTokensResponse(history_length=length)

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: Any
    ) -> pb.CloseSessionResponse:
        async with grpc_errors(context, request.session_id):
            st = await live_session(self.runtime, request.session_id)
            length = st.length
            await self.runtime.close(request.session_id)
        return pb.CloseSessionResponse(final_history_length=length)

    async def GetSessionInfo(
        self, request: pb.GetSessionInfoRequest, context: Any
    ) -> pb.GetSessionInfoResponse:
        sid = request.session_id
        async with grpc_errors(context, sid):
            st = await self.runtime.get(sid) if sid else await live_session(self.runtime, sid)
            # a session failed by an invariant violation still reports its counters
            if st.status != ABORTED:
                st = await live_session(self.runtime, sid)
        inv1, inv2 = self.runtime.generations.invariant_violations.get(sid, (0, 0))
        return pb.GetSessionInfoResponse(
            history_length=st.length,
            kv_live_bytes=self.runtime.engine.kv_live_bytes(sid),
            cache_invariant_inv1_violations=inv1,
            cache_invariant_inv2_violations=inv2,
            idle_seconds=self.runtime.sessions.idle_seconds(sid),
        )

    # grpc.aio also takes a handler that writes with context.write (the stubs type an iterator)
    async def Generate(self, request: pb.GenerateRequest, context: Any) -> None:  # type: ignore[override]
        """Written with ``context.write`` run by run (one message per token is the
        protocol's; taking the runtime's runs directly spares two generator hops a token)."""
        sid = request.session_id
        async with grpc_errors(context, sid):
            has_t, has_p, has_k = (request.HasField(f) for f in ("temperature", "top_p", "top_k"))
            params = SamplingParams(
                max_tokens=request.max_tokens,
                temperature=request.temperature if has_t else 1.0,
                top_p=request.top_p if has_p else 1.0,
                top_k=request.top_k if has_k else 0,
                seed=request.seed if request.HasField("seed") else None,
                # unset: the served model's recommendation
                from_model=left_to_model(
                    temperature=has_t or None, top_p=has_p or None, top_k=has_k or None
                ),
                constraint=constraint_of(context),
            )
            self.generations.track()
            runs = self.runtime.generate_runs(
                sid, GenerateRequest(params, sink_window=self.sink_window)
            )
            write = context.write
            try:
                async with closing(runs):
                    async for run in runs:
                        for ev in run:
                            if (m := _message(ev, params.max_tokens)) is not None:
                                await write(m)
            except CacheInvariantViolation as exc:
                # ADR 0008 section 2.8: the session is failed and its slab freed
                await self.runtime.abort(sid, exc.code, exc.message)
                raise


def _message(ev: Event, max_tokens: int) -> pb.GenerateResponse | None:
    """The wire message of one of a generation's events (None: it has none)."""
    if (tok := generated_token(ev)) is not None:
        return pb.GenerateResponse(token_id=int(tok))
    if ev.type == T.TOKENS_TRUNCATED:
        dropped = int(body(ev, TokensTruncated)["dropped"])
        return pb.GenerateResponse(truncated=pb.HistoryTruncated(dropped_token_count=dropped))
    if ev.type == T.GENERATION_FINISHED:
        return pb.GenerateResponse(done=_done(body(ev, GenerationFinished), max_tokens))
    return None


def _done(b: GenerationFinished, max_tokens: int) -> pb.GenerateDone:
    reason = str(b["finish_reason"])
    produced = int(b["completion_tokens"])
    stop = _STOP.get(reason, _Done.STOP_REASON_UNSPECIFIED)
    if reason == "length" and produced < max_tokens:
        stop = _Done.STOP_REASON_TRUNCATED  # the runtime capped it at the context length
    return _Done(
        stop_reason=stop,
        generated_token_count=produced,
        prefill_duration_seconds=float(b.get("prefill_s") or 0.0),
        total_duration_seconds=float(b.get("total_s") or 0.0),
    )
