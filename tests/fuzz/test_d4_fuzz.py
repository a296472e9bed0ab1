"""Fuzz the D4 worker with signed kind-1 events whose content is hostile, handed straight to ``ingest``.

Every call must end with a result (an answer or a typed ``err``), never an
internal error, and the worker must keep answering; sessions that existed
before are untouched.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import nostr_sdk as ns
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessiontape.core.runtime import Runtime
from sessiontape.transports.nostr.worker import D4Worker
from tests.helpers.fuzz import LONG, QUICK, fuzz_settings
from tests.helpers.nostr import LocalRelay, WorkerFactory, call_body, eventually
from tests.helpers.strategies import HOSTILE_JSON, HOSTILE_TEXT, encode, plausible

ARG_SCHEMA = {
    "prompt": {"type": "string"},
    "max_tokens": {"type": "integer"},
    "temperature": {"type": "number"},
    "top_p": {"type": "number"},
    "top_k": {"type": "integer"},
    "seed": {"type": "integer"},
    "stop": {"type": "array"},
}


@dataclass
class Fuzzed:
    runtime: Runtime
    worker: D4Worker
    fid: str
    before: str


@pytest.fixture
async def fuzzed(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> AsyncIterator[Fuzzed]:
    worker = await make_worker(runtime, [local_relay.url], default_max_tokens=4)
    [fid] = worker.functions
    sid = (await runtime.open_session("http")).session_id
    await runtime.append_text(sid, "untouched")
    before = await _stored(runtime, sid)
    yield Fuzzed(runtime, worker, fid, before)
    assert await _stored(runtime, sid) == before  # no D4 event touched a session it does not own


async def _stored(runtime: Runtime, sid: str) -> str:
    return json.dumps([e.to_json() for e in await runtime.log.read(sid)], sort_keys=True)


@st.composite
def contents(draw: Any) -> str:
    kind = draw(st.integers(0, 3))
    if kind == 0:  # a call with plausible or hostile args
        args = draw(
            st.fixed_dictionaries(
                {},
                optional={k: st.one_of(plausible(v), HOSTILE_JSON) for k, v in ARG_SCHEMA.items()},
            )
        )
        body = call_body(draw(HOSTILE_TEXT), args={**args, "max_tokens": args.get("max_tokens", 3)})
        for key in ("max_total_cost", "max_iteration_cost", "version", "results"):
            if draw(st.booleans()):
                body[key] = draw(HOSTILE_JSON)
        return encode(body).decode()
    if kind == 1:  # feedback-shaped
        return encode({"score": draw(HOSTILE_JSON), "version": draw(HOSTILE_JSON)}).decode()
    if kind == 2:
        return encode(draw(HOSTILE_JSON)).decode()
    return draw(st.text(max_size=40))


async def _check(f: Fuzzed, content: str, caplog: pytest.LogCaptureFixture) -> None:
    # a fresh key per example: the same content replayed by Hypothesis is a new event, not a duplicate
    event = (
        ns.EventBuilder(ns.Kind(1), content)
        .tags([ns.Tag.parse(["e", f.fid])])
        .finalize(ns.Keys.generate())
    )
    handled = (
        f.worker.stats["calls"]
        + f.worker.stats["feedback_unknown"]
        + f.worker.stats["feedback_invalid"]
    )
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        assert f.worker.ingest(event) is True
        await eventually(lambda: not f.worker._tasks, what="the event handled")
    assert not caplog.records, caplog.text  # no "handling event failed", no "call failed"
    eid = event.id().to_hex()
    sid = "d4_" + eid[:48]
    if (
        f.worker.stats["calls"]
        + f.worker.stats["feedback_unknown"]
        + f.worker.stats["feedback_invalid"]
        > handled
    ):
        try:
            st_ = await f.runtime.get(sid)
        except Exception:
            return  # feedback: no session of its own
        assert all(e["code"] != "internal" for e in st_.errors), st_.errors


@fuzz_settings(QUICK)
@given(content=contents())
async def test_d4_event_fuzz(
    fuzzed: Fuzzed, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    await _check(fuzzed, content, caplog)


@pytest.mark.fuzz
@fuzz_settings(LONG)
@given(content=contents())
async def test_d4_event_fuzz_long(
    fuzzed: Fuzzed, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    await _check(fuzzed, content, caplog)
