"""Hostile D4 input: forged events handed straight to the worker's own check, and
calls whose content JSON cannot be stored (lone surrogates, NaN, >64-bit ints) answered with a typed error."""

from __future__ import annotations

import json
import math

import nostr_sdk as ns
import pytest

from sessiontape.core.runtime import Runtime
from tests.helpers.nostr import Caller, LocalRelay, WorkerFactory, call_body, eventually


async def _log(runtime: Runtime) -> list[dict[str, object]]:
    out = []
    for row in await runtime.log.list_sessions(limit=10_000):
        out.extend(e.to_json() for e in await runtime.log.read(row.id))
    return out


async def test_worker_drops_forged_events_itself(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    """No client or relay in between: the events go to ``ingest``, whose signature/id check alone decides."""
    worker = await make_worker(runtime, [local_relay.url])
    [fid] = worker.functions
    keys = ns.Keys.generate()
    good = json.loads(
        ns.EventBuilder(ns.Kind(1), json.dumps(call_body("hello")))
        .tags([ns.Tag.parse(["e", fid])])
        .finalize(keys)
        .as_json()
    )
    forged = {
        "bad signature": {**good, "sig": good["sig"][:-8] + "00000000"},
        "bad id": {**good, "content": json.dumps(call_body("tampered"))},
        "other author": {**good, "pubkey": ns.Keys.generate().public_key().to_hex()},
        "id of other content": {**good, "id": "0" * 64},
    }
    before = await _log(runtime)
    for name, ev in forged.items():
        event = ns.Event.from_json(json.dumps(ev))  # parsing does not verify: the worker must
        assert worker.ingest(event) is False, name
    assert worker.stats["forged"] == len(forged)
    assert await _log(runtime) == before  # nothing opened, recorded or answered
    # the control: the genuine event passes the same check
    assert worker.ingest(ns.Event.from_json(json.dumps(good))) is True
    await eventually(lambda: worker.stats["calls"] == 1, what="the genuine call")


@pytest.mark.parametrize(
    "content",
    [
        json.dumps(call_body("lone \ud800 surrogate")),
        json.dumps(call_body(args={"temperature": math.nan})),
        json.dumps(call_body(args={"top_p": math.inf})),
        json.dumps(call_body(args={"max_tokens": 2**70})),
        '{"args": {"prompt": "x"}, "max_total_cost": 1e400}',
    ],
    ids=["surrogate", "nan", "inf", "huge-int", "1e400"],
)
async def test_unstorable_call_content_is_a_typed_error_result(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay, content: str
) -> None:
    worker = await make_worker(runtime, [local_relay.url])
    [fid] = worker.functions
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    try:
        cid = await caller.call(fid, content)
        final = await caller.wait_final(cid)
        err = json.loads(final["body"]["err"])
        assert err["code"] == "invalid_parameters", err
        assert final["body"]["result"] is None
        st = await runtime.get("d4_" + cid[:48])
        assert st.length == 0 and st.errors == [err]
    finally:
        await caller.close()


async def test_the_workers_own_events_are_dropped_before_any_check(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    """Its results carry the function's tag, so the calls subscription brings each back:
    one signed by the worker, or one only claiming its key, is dropped unhandled and
    uncounted, and nothing is recorded."""
    worker = await make_worker(runtime, [local_relay.url])
    [fid] = worker.functions
    own = json.loads(
        ns.EventBuilder(ns.Kind(1), json.dumps(call_body("an echo")))
        .tags([ns.Tag.parse(["e", fid])])
        .finalize(worker.keys)
        .as_json()
    )
    claimed = {**own, "sig": own["sig"][:-8] + "00000000"}
    before, stats = await _log(runtime), dict(worker.stats)
    for ev in (own, claimed):
        assert worker.ingest(ns.Event.from_json(json.dumps(ev))) is False
    assert dict(worker.stats) == stats and await _log(runtime) == before
