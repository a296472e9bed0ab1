"""The D4 worker against real relays on loopback, with the reference engine on a real SQLite file."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import nostr_sdk as ns
import pytest
import websockets

from sessiontape.core.events import T
from sessiontape.core.runtime import Runtime
from tests.helpers.nostr import (
    Caller,
    LocalRelay,
    WorkerFactory,
    call_body,
    chat,
    eventually,
    open_runtime,
)


async def wire(runtime: Runtime, sid: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        (e.body["direction"], e.body["payload"])
        for e in await runtime.log.read(sid)
        if e.type == T.WIRE
    ]


async def test_sample_call_answered(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
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
        text = runtime.engine.detokenize(
            list(st.tokens[st.generations[next(iter(st.generations))].prompt_length :])
        )
        # the text of the generated tokens, less a character they end in the middle of
        assert completion["choices"][0]["message"]["content"] == text.removesuffix("\ufffd")
    finally:
        await caller.close()


async def test_price_cap_stops_and_funded_call_continues(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    worker = await make_worker(runtime, [local_relay.url])
    [fid] = worker.functions
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    try:
        prompt = "Write a verse."
        # the oracle: one well-funded call of 11 tokens
        whole = await caller.wait_final(
            await caller.call(fid, call_body(prompt, args={"max_tokens": 11}))
        )
        # the same call capped at 5 iterations' worth
        capped_id = await caller.call(
            fid, call_body(prompt, max_total_cost=5500, args={"max_tokens": 11})
        )
        capped = await caller.wait_final(capped_id)
        assert capped["body"]["more_results"] is True and capped["body"]["total_cost"] == 5000
        assert chat(capped)["choices"][0]["finish_reason"] == "length"
        assert chat(capped)["usage"]["completion_tokens"] == 5
        # intermediate results every 4 tokens, never above the cap
        partials = [r for r in caller.replies(capped_id) if r["body"].get("partial")]
        assert [p["body"]["total_cost"] for p in partials] == [4000]
        # a funded call referencing that result continues the session (no new prompt)
        more_id = await caller.call(fid, call_body("ignored", args={"max_tokens": 6}), capped["id"])
        more = await caller.wait_final(more_id)
        assert more["body"]["total_cost"] == 6000
        sid = "d4_" + capped_id[:48]
        st = await runtime.get(sid)
        assert len(st.generations) == 2
        assert (
            chat(more)["choices"][0]["message"]["content"]
            == chat(whole)["choices"][0]["message"]["content"]
        )
        assert chat(more)["usage"]["completion_tokens"] == 11
        assert [d for d, _ in await wire(runtime, sid)].count("in") == 2
        # the continuation opened no session of its own
        sids = {r.id for r in await runtime.log.list_sessions(protocol="nostr")}
        assert sids == {worker.worker_session_id, "d4_" + whole["tags"][0][1][:48], sid}
    finally:
        await caller.close()


async def test_price_above_cap_negotiates(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    worker = await make_worker(runtime, [local_relay.url], price_msat=2000)
    [fid] = worker.functions
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    try:
        call_id = await caller.call(fid, call_body(max_iteration_cost=1000))
        reply = await caller.wait_final(call_id)
        assert reply["body"] == {
            "result": None,
            "iteration_cost": 2000,
            "total_cost": 24000,
            "more_results": False,
            "version": "0.1.0",
        }
        assert [t for t in reply["tags"] if t[0] == "e"] == [
            ["e", call_id],
            ["e", worker.settings.negotiate_function_id],
        ]
        st = await runtime.get("d4_" + call_id[:48])
        assert st.length == 0 and not st.generations and st.status == "closed"
        # the client accepts: a new call at the worker's price is answered
        ok = await caller.wait_final(
            await caller.call(fid, call_body(max_iteration_cost=2000), reply["id"])
        )
        assert ok["body"]["iteration_cost"] == 2000 and ok["body"]["result"] is not None
    finally:
        await caller.close()


async def test_feedback_recorded_against_the_session(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    worker = await make_worker(runtime, [local_relay.url])
    [fid] = worker.functions
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    try:
        call_id = await caller.call(fid, call_body())
        final = await caller.wait_final(call_id)
        sid = "d4_" + call_id[:48]
        bad = await caller.publish(
            caller.sign(
                json.dumps({"score": 11, "version": "0.1.0"}), [["e", final["id"]], ["e", fid]]
            )
        )
        good = await caller.publish(
            caller.sign(
                json.dumps({"score": 7, "version": "0.1.0"}), [["e", final["id"]], ["e", fid]]
            )
        )
        await eventually(
            lambda: worker.stats["feedback"] == 1 and worker.stats["feedback_invalid"] == 1
        )
        st = await runtime.get(sid)
        assert [(f["score"], f["event_id"], f["result_id"]) for f in st.feedback] == [
            (7, good, final["id"])
        ]
        ins = [p["id"] for d, p in await wire(runtime, sid) if d == "in"]
        assert good in ins and bad not in ins
    finally:
        await caller.close()


async def test_forged_and_malformed_events(
    runtime: Runtime, make_worker: WorkerFactory, relay_process: Any
) -> None:
    # a relay that stores events without checking signatures, so forgeries reach the worker's client
    relay = await relay_process(verify_signatures=False)
    worker = await make_worker(runtime, [relay.url])
    [fid] = worker.functions
    caller = await Caller(worker.pubkey).connect(relay.url)
    try:
        before = [r.id for r in await runtime.log.list_sessions(protocol="nostr")]
        good = json.loads(caller.sign(json.dumps(call_body()), [["e", fid]]).as_json())
        bad_sig = {**good, "sig": good["sig"][:-8] + "00000000"}
        bad_id = {**good, "content": json.dumps(call_body(max_total_cost=1))}
        async with websockets.connect(relay.url) as ws:
            for ev in (bad_sig, bad_id):
                await ws.send(json.dumps(["EVENT", ev]))
                await ws.recv()
        # the same forgeries handed to the worker directly are dropped and counted
        for ev in (bad_sig, bad_id):
            assert worker.ingest(ns.Event.from_json(json.dumps(ev))) is False
        assert worker.stats["forged"] == 2
        # malformed but signed calls each get an error result
        cases = {
            "not json": "{nope",
            "zero cost": json.dumps(call_body(max_iteration_cost=0)),
            "string cost": json.dumps(call_body(max_total_cost="100")),
            "args list": json.dumps({**call_body(), "args": [1]}),
            "bad version": json.dumps(call_body(version="1.0.0")),
            "seed too big": json.dumps(call_body(args={"seed": 2**64})),
        }
        ids = {name: await caller.call(fid, content) for name, content in cases.items()}
        for name, cid in ids.items():
            final = await caller.wait_final(cid)
            err = json.loads(final["body"]["err"])
            assert err["code"] == "invalid_parameters", name
            assert final["body"]["result"] is None and final["body"]["total_cost"] == 0
            st = await runtime.get("d4_" + cid[:48])
            assert st.length == 0 and st.errors == [
                {"code": err["code"], "message": err["message"]}
            ]
        # a genuine call still works, and no forgery opened a session or got an answer
        ok = await caller.wait_final(await caller.call(fid, call_body("a genuine one")))
        assert ok["body"]["result"] is not None
        after = {r.id for r in await runtime.log.list_sessions(protocol="nostr")}
        assert after - set(before) == {"d4_" + i[:48] for i in [*ids.values(), ok["tags"][0][1]]}
        assert not caller.replies(bad_sig["id"]) and not caller.replies(good["id"])
    finally:
        await caller.close()


async def test_duplicates_across_two_relays_answered_once(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay, relay_process: Any
) -> None:
    other = await relay_process()
    worker = await make_worker(runtime, [local_relay.url, other.url])
    [fid] = worker.functions
    caller = await Caller(worker.pubkey).connect(local_relay.url, other.url)
    try:
        ids = [await caller.call(fid, call_body(f"question {i}")) for i in range(3)]
        for cid in ids:
            await caller.wait_final(cid)  # asserts a single final reply
        for cid in ids:
            ins = [p for d, p in await wire(runtime, "d4_" + cid[:48]) if d == "in"]
            assert [p["id"] for p in ins] == [cid]
        # the same signed call delivered again (to the worker directly) is a duplicate
        assert worker.ingest(ns.Event.from_json(json.dumps(caller.sent[ids[0]]))) is False
        await eventually(lambda: worker.stats["answered"] == 3, what="3 answers")
        assert worker.stats["calls"] == 3
    finally:
        await caller.close()


async def test_restart_while_calls_arrive(
    sqlite_url: str, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    rt1 = await open_runtime(sqlite_url, step_delay_s=0.02)
    worker = await make_worker(rt1, [local_relay.url])
    [fid] = worker.functions
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    rt2: Runtime | None = None
    try:
        ids = [await caller.call(fid, call_body(f"before {i}")) for i in range(2)]
        for cid in ids:
            await caller.wait_final(cid)
        # one call in flight when the worker stops without grace, two while it is down
        ids.append(await caller.call(fid, call_body("in flight")))
        await eventually(lambda: ids[2] in worker.book.calls, what="the in-flight call to start")
        await worker.stop(grace=0)
        await rt1.aclose()
        ids += [await caller.call(fid, call_body(f"while down {i}")) for i in range(2)]
        rt2 = await open_runtime(sqlite_url)
        worker2 = await make_worker(rt2, [local_relay.url])
        assert list(worker2.functions) == [fid]  # reused from the log, not republished
        ids.append(await caller.call(fid, call_body("after")))
        for cid in ids:
            await caller.wait_final(cid)  # asserts exactly one final reply per call
        for cid in ids:
            ws = await wire(rt2, "d4_" + cid[:48])
            assert [p["id"] for d, p in ws if d == "in"] == [cid]
            finals = [
                p for d, p in ws if d == "out" and not json.loads(p["content"]).get("partial")
            ]
            assert len(finals) == 1
        # the interrupted call resumed where it stopped: its tokens match an uninterrupted run
        st = await rt2.get("d4_" + ids[2][:48])
        reasons = [g.finish_reason for g in st.generations.values()]
        assert reasons[-1] in ("length", "eos") and set(reasons[:-1]) <= {
            "cancelled",
            "interrupted",
        }
        assert (
            sum(len(g.tokens) for g in st.generations.values())
            == len(st.tokens) - st.generations[next(iter(st.generations))].prompt_length
        )
    finally:
        await caller.close()
        if rt2 is not None:
            await worker2.stop()
            await rt2.aclose()


class RejectFirst(ns.WritePolicy):
    """A relay write policy that rate-limits the first ``n`` events from one author."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.author: str | None = None
        self.rejected = 0

    async def admit_event(self, event: Any, socket_addr: str) -> Any:
        if event.author().to_hex() == self.author and self.rejected < self.n:
            self.rejected += 1
            return ns.WritePolicyResult.REJECT("rate-limited: slow down")
        return ns.WritePolicyResult.ACCEPT()


async def test_rate_limited_publish_is_retried(
    runtime: Runtime, make_worker: WorkerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    ns.uniffi_set_event_loop(asyncio.get_running_loop())
    policy = RejectFirst(3)
    relay = await LocalRelay(policy).start()
    try:
        worker = await make_worker(runtime, [relay.url], function_ids=["ab" * 32])
        policy.author = worker.pubkey
        caller = await Caller(worker.pubkey).connect(relay.url)
        try:
            with caplog.at_level(logging.WARNING, "sessiontape.nostr"):
                final = await caller.wait_final(await caller.call("ab" * 32, call_body()))
            assert final["body"]["result"] is not None
            assert policy.rejected == 3 and worker.stats["publish_failures"] == 3
            assert sum("rate-limited" in r.getMessage() for r in caplog.records) == 3
        finally:
            await caller.close()
    finally:
        relay.stop()


async def test_cli_call_prints_results(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    worker = await make_worker(runtime, [local_relay.url])
    [fid] = worker.functions
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "sessiontape"),
        "nostr",
        "call",
        "--relay",
        local_relay.url,
        "--function",
        fid,
        "--prompt",
        "Hello",
        "--max-total-cost",
        "3000",
        "--timeout",
        "30",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    lines = [json.loads(x) for x in out.decode().splitlines()]
    assert lines[0]["accepted_by"] == [local_relay.url]
    assert lines[-1]["more_results"] is True and lines[-1]["total_cost"] == 3000


async def test_nip90_text_generation_job(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    worker = await make_worker(runtime, [local_relay.url])
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    try:
        job = await caller.publish(
            caller.sign(
                "",
                [["i", "Tell me", "text"], ["param", "max_tokens", "5"], ["bid", "4000"]],
                kind=5050,
            )
        )
        result = await eventually(
            lambda: [d for d in caller.received.values() if d["kind"] == 6050]
        )
        statuses = [
            t[1]
            for d in caller.received.values()
            if d["kind"] == 7000
            for t in d["tags"]
            if t[0] == "status"
        ]
        assert statuses == ["processing"]
        tags = {t[0]: t[1:] for t in result[0]["tags"]}
        assert tags["e"] == [job] and tags["p"] == [caller.pubkey] and tags["amount"] == ["4000"]
        st = await runtime.get("d4_" + job[:48])
        assert result[0]["content"] == runtime.engine.detokenize(list(st.tokens[len("Tell me") :]))
        assert [p["id"] for d, p in await wire(runtime, st.session_id) if d == "in"] == [job]
    finally:
        await caller.close()


async def test_relay_outage_reconnects_and_catches_up(
    runtime: Runtime, make_worker: WorkerFactory, relay_process: Any
) -> None:
    relay = await relay_process()
    worker = await make_worker(runtime, [relay.url])
    [fid] = worker.functions
    caller = await Caller(worker.pubkey).connect(relay.url)
    try:
        first = await caller.call(fid, call_body("before the outage"))
        await caller.wait_final(first)
        relay.kill()
        await eventually(
            lambda: worker.stats["disconnects"] >= 1, what="the worker to see the outage"
        )
        relay.start()  # same port, same database
        await relay.wait_up()
        await eventually(
            lambda: worker.stats["resubscribed"] >= 1, 30, "the worker to re-subscribe"
        )
        await caller.wait_connected()
        later = await caller.call(fid, call_body("after the outage"))
        await caller.wait_final(later, 30)
        assert caller.final(first) is not None  # still answered exactly once
    finally:
        await caller.close()


async def test_plugin_from_the_registry(
    runtime: Runtime, local_relay: LocalRelay, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from sessiontape.core.errors import ConfigError
    from sessiontape.core.plugins import TRANSPORTS, load

    cls = load(TRANSPORTS, "nostr")
    with pytest.raises(ConfigError):
        await cls(runtime, {"relays": [local_relay.url]}, runtime.config).start()  # no key
    keys = ns.Keys.generate()
    secret = keys.secret_key().to_bech32()
    (tmp_path / "k").write_text(secret + "\n")
    transport = cls(
        runtime, {"relays": [local_relay.url], "key_file": str(tmp_path / "k")}, runtime.config
    )
    with caplog.at_level(logging.DEBUG):
        line = await transport.start()
    try:
        assert keys.public_key().to_hex() in line and local_relay.url in line
        assert secret not in caplog.text and keys.secret_key().to_hex() not in caplog.text
    finally:
        await transport.stop()
