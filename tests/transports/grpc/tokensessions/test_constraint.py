"""A constraint on Kakeya and Salience Generate, carried in the call's metadata
(``sessiontape-constraint``: their published messages have no field for it): the
output matches it, the generation records it, and a bad one is INVALID_ARGUMENT with
nothing stored."""

from __future__ import annotations

import json
import re

import grpc

from sessiontape.core.events import T
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2 as spb
from sessiontape.transports.grpc.tokensessions import CONSTRAINT_METADATA
from tests.transports.grpc.tokensessions.conftest import Serve
from tests.transports.grpc.tokensessions.helpers import events, expect_code, version

DIGITS = {"regex": "[0-9]{3}-[a-z]{2}"}


def _metadata(constraint: object) -> tuple[tuple[str, str], ...]:
    return ((CONSTRAINT_METADATA, json.dumps(constraint)),)


async def test_kakeya_generate_follows_the_constraint_in_its_metadata(serve: Serve) -> None:
    s = await serve()
    sid = (await s.kakeya.CreateSession(kpb.CreateSessionRequest())).session_id
    await s.kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[72, 105]))
    call = s.kakeya.Generate(
        kpb.GenerateRequest(session_id=sid, max_tokens=12, seed=5), metadata=_metadata(DIGITS)
    )
    ids = [m.token_id async for m in call if m.WhichOneof("payload") == "token_id"]
    text = s.runtime.engine.detokenize([t for t in ids if t < 256])
    assert re.fullmatch(DIGITS["regex"], text), (ids, text)
    [started] = await events(s.runtime, sid, T.GENERATION_STARTED)
    recorded = started.body["params"]["constraint"]
    assert recorded["kind"] == "regex" and recorded["text"] == DIGITS["regex"]


async def test_salience_generate_follows_the_constraint_in_its_metadata(serve: Serve) -> None:
    s = await serve()
    sid = (await s.salience.OpenSession(spb.OpenSessionRequest())).session_id
    call = s.salience.Generate(
        spb.GenerateRequest(session_id=sid, append_tokens=[72, 105], offset=0, max_tokens=12),
        metadata=_metadata(DIGITS),
    )
    ids = [
        ev.token.id
        async for ev in call
        if ev.WhichOneof("event") == "token" and not ev.token.is_prefill
    ]
    text = s.runtime.engine.detokenize([t for t in ids if t < 256])
    assert re.fullmatch(DIGITS["regex"], text), (ids, text)


async def test_a_bad_constraint_is_invalid_argument_and_stores_nothing(serve: Serve) -> None:
    s = await serve()
    sid = (await s.kakeya.CreateSession(kpb.CreateSessionRequest())).session_id
    await s.kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[72]))
    before = await version(s.runtime, sid)
    bad = [
        ((CONSTRAINT_METADATA, "{not json"),),
        _metadata(["regex"]),
        _metadata({"regex": "[0-9", "grammar": "x"}),
        _metadata({"regex": "("}),
    ]
    for metadata in bad:
        details = await expect_code(
            grpc.StatusCode.INVALID_ARGUMENT,
            s.kakeya.Generate(
                kpb.GenerateRequest(session_id=sid, max_tokens=4, seed=1), metadata=metadata
            ),
        )
        assert "invalid_constraint" in details, details
    assert await version(s.runtime, sid) == before
