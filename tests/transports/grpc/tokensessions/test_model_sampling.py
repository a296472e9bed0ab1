"""Kakeya and Salience leave the sampling a request does not name to the served model's
recommendation (engines/models/sampling_defaults.py), and record the values used."""

from __future__ import annotations

from typing import Any

from sessiontape.core.events import T
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
from tests.transports.grpc.tokensessions.conftest import Serve
from tests.transports.grpc.tokensessions.helpers import dump, events, generate, open_with

#: what the served "model" recommends: none of it is a wire's own default
RECOMMENDED = {"temperature": 0.25, "top_p": 0.5, "top_k": 7}


def engine() -> ReferenceEngine:
    return ReferenceEngine(
        eos_bias=-100.0,
        default_temperature=RECOMMENDED["temperature"],
        default_top_p=RECOMMENDED["top_p"],
        default_top_k=RECOMMENDED["top_k"],
    )


def sampling(params: Any) -> dict[str, Any]:
    return {k: params[k] for k in ("temperature", "top_p", "top_k")}


async def started(s: Any, sid: str) -> list[dict[str, Any]]:
    return [sampling(e.body["params"]) for e in await events(s.runtime, sid, T.GENERATION_STARTED)]


async def test_kakeya_takes_the_models_sampling_for_fields_it_leaves_unset(serve: Serve) -> None:
    s = await serve(engine=engine())
    sid = (await s.kakeya.CreateSession(kpb.CreateSessionRequest())).session_id
    await s.kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[5, 6, 7]))
    named = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}  # the wire's defaults, said aloud
    for fields in ({}, named, {"temperature": 0.0}):
        async for _ in s.kakeya.Generate(
            kpb.GenerateRequest(session_id=sid, max_tokens=2, **fields)
        ):
            pass
    assert await started(s, sid) == [RECOMMENDED, named, {**RECOMMENDED, "temperature": 0.0}]


async def test_salience_takes_the_models_sampling_where_a_field_is_zero(serve: Serve) -> None:
    s = await serve(engine=engine())
    sid = await open_with(s.salience, [])
    for fields in ({}, {"temperature": 0.75, "top_p": 0.625, "top_k": 3}, {"top_k": 2}):
        offset = len(await dump(s.salience, sid))
        await generate(
            s.salience, session_id=sid, append_tokens=[5], offset=offset, max_tokens=2, **fields
        )
    assert await started(s, sid) == [
        RECOMMENDED,
        {"temperature": 0.75, "top_p": 0.625, "top_k": 3},
        {**RECOMMENDED, "top_k": 2},
    ]


async def test_an_engine_that_recommends_nothing_keeps_the_wire_defaults(serve: Serve) -> None:
    s = await serve()
    sid = (await s.kakeya.CreateSession(kpb.CreateSessionRequest())).session_id
    await s.kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[5]))
    async for _ in s.kakeya.Generate(kpb.GenerateRequest(session_id=sid, max_tokens=1)):
        pass
    assert await started(s, sid) == [{"temperature": 1.0, "top_p": 1.0, "top_k": 0}]
