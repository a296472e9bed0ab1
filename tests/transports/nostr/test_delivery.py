"""Answers reach the client exactly once across failed publishes and crashes; the worker's memory is bounded."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import nostr_sdk as ns

from sessiontape.core.events import T
from sessiontape.core.runtime import Runtime
from sessiontape.transports.nostr.worker import D4Worker, answer_of
from tests.helpers.nostr import (
    Caller,
    LocalRelay,
    WorkerFactory,
    call_body,
    eventually,
)

FID = "cd" * 32


class RefuseWorker(ns.WritePolicy):
    """A relay that refuses every event of one author while ``refusing`` is set."""

    def __init__(self) -> None:
        self.author: str | None = None
        self.refusing = True
        self.refused = 0

    async def admit_event(self, event: Any, socket_addr: str) -> Any:
        if self.refusing and event.author().to_hex() == self.author:
            self.refused += 1
            return ns.WritePolicyResult.REJECT("blocked: not now")
        return ns.WritePolicyResult.ACCEPT()


class DiesBeforePublishingAnswers(D4Worker):
    """A worker process that dies between recording an answer and sending it."""

    async def publish(self, event: Any) -> list[str]:
        if answer_of(json.loads(event.as_json())) is not None:
            self.stats["died"] += 1
            await asyncio.Event().wait()  # until stop() cancels it, as a kill would
        return await super().publish(event)


async def wire(runtime: Runtime, sid: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        (e.body["direction"], e.body["payload"])
        for e in await runtime.log.read(sid)
        if e.type == T.WIRE
    ]


async def notes(runtime: Runtime, sid: str) -> list[dict[str, Any]]:
    return [dict(e.body) for e in await runtime.log.read(sid) if e.type == T.NOTE]


async def final_outs(runtime: Runtime, sid: str) -> list[dict[str, Any]]:
    return [
        p
        for d, p in await wire(runtime, sid)
        if d == "out" and not json.loads(p["content"]).get("partial")
    ]


async def test_answer_no_relay_took_is_published_after_restart(
    runtime: Runtime, make_worker: WorkerFactory
) -> None:
    policy = RefuseWorker()
    relay = await LocalRelay(policy).start()
    opts: dict[str, Any] = {"function_ids": [FID], "publish_retries": 0, "republish_every_s": 3600}
    try:
        worker = await make_worker(runtime, [relay.url], **opts)
        policy.author = worker.pubkey
        caller = await Caller(worker.pubkey).connect(relay.url)
        try:
            call_id = await caller.call(FID, call_body())
            sid = "d4_" + call_id[:48]
            await eventually(lambda: worker.stats["unacked"] == 1, what="publishing to give up")
            [answer] = await final_outs(runtime, sid)
            # recorded, but the client has nothing: it is flagged for the next start
            assert caller.final(call_id) is None
            assert {
                "transport": "nostr",
                "unpublished": answer["id"],
                "session_id": sid,
            } in await notes(runtime, worker.worker_session_id)
            assert not [n for n in await notes(runtime, sid) if "published" in n]
            await worker.stop()

            policy.refusing = False
            worker2 = await make_worker(runtime, [relay.url], **opts)
            final = await caller.wait_final(call_id)
            assert final["id"] == answer["id"] and caller.deliveries[answer["id"]] == 1
            await eventually(lambda: worker2.stats["republished"] == 1, what="the acknowledgement")
            assert [n for n in await notes(runtime, sid) if "published" in n] == [
                {"transport": "nostr", "published": answer["id"], "relays": [relay.url]}
            ]
            # the call itself comes back with the since-subscription: it is answered, not run again
            await eventually(lambda: worker2.stats["duplicate"] >= 1, what="the replayed call")
            assert worker2.stats["calls"] == 0 and len(await final_outs(runtime, sid)) == 1
            # a later start has nothing left to publish
            worker3 = D4Worker(runtime, worker2.settings)
            await worker3._scan_log()
            assert worker3.book.unacked == {}
        finally:
            await caller.close()
    finally:
        relay.stop()


async def test_answer_recorded_before_a_crash_is_published_on_start(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    worker = await make_worker(
        runtime, [local_relay.url], worker_cls=DiesBeforePublishingAnswers, function_ids=[FID]
    )
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    try:
        call_id = await caller.call(FID, call_body())
        sid = "d4_" + call_id[:48]
        await eventually(lambda: worker.stats["died"] == 1, what="the answer to be recorded")
        await worker.stop(grace=0)
        [answer] = await final_outs(runtime, sid)
        assert caller.final(call_id) is None and not await notes(runtime, sid)

        worker2 = await make_worker(runtime, [local_relay.url], function_ids=[FID])
        final = await caller.wait_final(call_id)
        assert final["id"] == answer["id"] and caller.deliveries[answer["id"]] == 1
        await eventually(lambda: worker2.stats["republished"] == 1, what="the acknowledgement")
        assert [n["published"] for n in await notes(runtime, sid)] == [answer["id"]]
        assert len(await final_outs(runtime, sid)) == 1
    finally:
        await caller.close()


async def test_answer_is_published_again_while_running(
    runtime: Runtime, make_worker: WorkerFactory
) -> None:
    policy = RefuseWorker()
    relay = await LocalRelay(policy).start()
    try:
        worker = await make_worker(
            runtime, [relay.url], function_ids=[FID], publish_retries=0, republish_every_s=0.2
        )
        policy.author = worker.pubkey
        caller = await Caller(worker.pubkey).connect(relay.url)
        try:
            call_id = await caller.call(FID, call_body())
            await eventually(lambda: worker.stats["unacked"] >= 1, what="publishing to give up")
            assert caller.final(call_id) is None
            policy.refusing = False
            final = await caller.wait_final(call_id)
            # the client may see it before the worker has recorded the relay's acknowledgement
            await eventually(lambda: worker.stats["republished"] == 1, what="the acknowledgement")
            assert caller.deliveries[final["id"]] == 1
            sid = "d4_" + call_id[:48]
            ack = {"transport": "nostr", "published": final["id"], "relays": [relay.url]}
            # acknowledged where the answer lives and where it was flagged
            assert ack in await notes(runtime, sid) and ack in await notes(
                runtime, worker.worker_session_id
            )
            assert worker.book.unacked == {} and worker.book.flagged == {}
        finally:
            await caller.close()
    finally:
        relay.stop()


async def test_memory_is_bounded_and_the_log_still_dedupes(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    worker = await make_worker(runtime, [local_relay.url], function_ids=[FID], index_size=1)
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    try:
        ids = []
        for i in range(6):
            ids.append(await caller.call(FID, call_body(f"question {i}", args={"max_tokens": 3})))
            await caller.wait_final(ids[-1])
        await eventually(lambda: not worker._tasks, what="the handlers to finish")
        book = worker.book
        assert len(book.calls) == 1 and len(book.results) <= 1 and len(book.seen) <= 4
        assert worker.locks.entries == {}
        assert ids[0] not in book.calls and ids[0] not in book.seen
        # the forgotten first call delivered again: the log says it was answered
        assert worker.ingest(ns.Event.from_json(json.dumps(caller.sent[ids[0]]))) is True
        await eventually(lambda: worker.stats["duplicate"] == 1, what="the replay to be recognised")
        assert worker.stats["calls"] == 6
        assert len(await final_outs(runtime, "d4_" + ids[0][:48])) == 1
        assert [p["id"] for d, p in await wire(runtime, "d4_" + ids[0][:48]) if d == "in"] == [
            ids[0]
        ]
    finally:
        await caller.close()


async def test_start_reads_only_open_and_recent_sessions(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    # no slack: sessions last active before the newest call's second are "old"
    opts: dict[str, Any] = {"function_ids": [FID], "since_slack_s": 0}
    worker = await make_worker(runtime, [local_relay.url], **opts)
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    try:
        # below the worker's price: answered with a price suggestion, session closed
        done = [
            await caller.call(FID, call_body(f"old {i}", max_iteration_cost=500)) for i in range(2)
        ]
        for cid in done:
            await caller.wait_final(cid)
        capped_id = await caller.call(
            FID, call_body("open", max_total_cost=3000, args={"max_tokens": 8})
        )
        capped = await caller.wait_final(capped_id)
        assert capped["body"]["more_results"] is True
        await eventually(lambda: not worker._tasks, what="the handlers to finish")
        old = max(r.updated_at for r in await runtime.log.list_sessions(protocol="nostr"))
        await asyncio.sleep(max(0.0, math.floor(old) + 1.05 - time.time()))  # into the next second
        recent = await caller.call(FID, call_body("recent", max_iteration_cost=500))
        await caller.wait_final(recent)
        await worker.stop()

        worker2 = await make_worker(runtime, [local_relay.url], **opts)
        # the open session (continuable) and the recent one; not the two closed old ones
        assert worker2.stats["scanned_sessions"] == 2
        assert not any(c in worker2.book.calls for c in done)
        # the open session's result can still be continued
        more = await caller.wait_final(
            await caller.call(FID, call_body("x", args={"max_tokens": 2}), capped["id"])
        )
        assert more["body"]["result"] is not None and more["body"]["total_cost"] == 2000
        # an old call delivered again is found answered in the log
        worker2.ingest(ns.Event.from_json(json.dumps(caller.sent[done[0]])))
        await eventually(
            lambda: worker2.stats["duplicate"] >= 1, what="the old call to be recognised"
        )
        assert len(await final_outs(runtime, "d4_" + done[0][:48])) == 1
    finally:
        await caller.close()
