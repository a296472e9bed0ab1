"""The D4 worker against real relays on loopback, with the reference engine on a real SQLite file."""

from __future__ import annotations

import json
from typing import Any

from core.events import T
from core.runtime import Runtime
from tests.transports.nostr.conftest import Caller, LocalRelay, WorkerFactory, call_body, eventually


def chat(reply: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(reply["body"]["result"])
    return result


async def wire(runtime: Runtime, sid: str) -> list[tuple[str, dict[str, Any]]]:
    return [(e.body["direction"], e.body["payload"]) for e in await runtime.log.read(sid) if e.type == T.WIRE]


async def test_sample_call_answered(runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay) -> None:
    worker = await make_worker(runtime, [local_relay.url])
    [fid] = worker.functions
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    try:
        call_id = await caller.call(fid, call_body())
        final = await caller.wait_final(call_id)
        body = final["body"]
        assert body["version"] == "0.1.0" and body["iteration_cost"] == 1000
        completion = chat(final)
        assert completion["object"] == "chat.completion"
        n = completion["usage"]["completion_tokens"]
        assert 0 < n <= 12 and body["total_cost"] == n * 1000
        assert [t for t in final["tags"] if t[0] == "e"] == [["e", call_id], ["e", fid]]
        # the session recorded the call and every result with their signed JSON
        sid = "d4_" + call_id[:48]
        st = await runtime.get(sid)
        assert st.meta == {"call_id": call_id, "caller": caller.pubkey, "function_id": fid}
        ws = await wire(runtime, sid)
        assert ws[0] == ("in", caller.sent[call_id])
        outs = [p for d, p in ws if d == "out"]
        assert outs[-1] == {k: v for k, v in final.items() if k != "body"}
        text = runtime.engine.detokenize(list(st.tokens[st.generations[next(iter(st.generations))].prompt_length:]))
        assert completion["choices"][0]["message"]["content"] == text
    finally:
        await caller.close()

