"""Conformance: one scripted session, every transport's view of it is the same log.

One runtime (the reference engine, on each log backend) serves HTTP (JSON API
+ SSE, uvicorn on loopback) and gRPC (Kakeya, Salience, Evergreen) at once.
The script: create, append text, generate with a seed, fork mid-response (at a
token position), feedback, close. It is driven over HTTP, over Kakeya and
Salience (token sessions; Salience forks), and over Evergreen (its node DAG),
and each time the views must describe the log, event for event:

- the SSE stream (snapshot, then JSON Patch+ patches, ids = log positions)
  folds to the document rebuilt from the log, with one patch per event;
- the token streams (HTTP generation, Kakeya ``token_id``, Salience ``Token``
  with logprobs) equal the log's ``generation.token`` events;
- the NDJSON export verifies, re-imports into a fresh log unchanged, and folds
  to the same document;
- a cursor taken on one wire resumes on another: an SSE ``Last-Event-ID``
  resumes over the HTTP events route with exactly the events after it, and a
  log position inside a gRPC session's generation resumes its SSE stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from sessiontape.core.document import build_document, fork_base
from sessiontape.core.events import Event
from sessiontape.core.log import EventLog
from sessiontape.core.log.store import verify_chain
from sessiontape.core.patch import apply_patch
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.grpc.client import (
    EvergreenClient,
    action,
    assemble,
    sampling_config,
    text_fragments,
)
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as kakeya_grpc
from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2 as spb
from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2_grpc as salience_grpc
from sessiontape.transports.grpc.plugin import GrpcTransport
from sessiontape.transports.http.plugin import HttpTransport
from tests.helpers.config import free_port, make_config
from tests.helpers.sse_client import SseEvent, events

TOKEN = "conformance-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@dataclass
class Stack:
    runtime: Runtime
    http: httpx.AsyncClient
    channel: grpc.aio.Channel
    grpc_target: str

    @property
    def log(self) -> EventLog:
        return self.runtime.log


@pytest.fixture
async def stack(db_url: str) -> AsyncIterator[Stack]:
    """HTTP and gRPC servers on loopback over one runtime (on each log backend)."""
    grpc_opts = {"enabled": True, "listen": f"127.0.0.1:{free_port()}", "grace_s": 1.0}
    cfg = make_config(db_url, auth={"token": TOKEN}, transports={"grpc": grpc_opts})
    rt = await Runtime.create(cfg, engine=ReferenceEngine(eos_bias=-100.0))
    http_port = free_port()
    web = HttpTransport(rt, {"listen": f"127.0.0.1:{http_port}", "heartbeat_s": 1.0}, cfg)
    rpc = GrpcTransport(rt, cfg.transports["grpc"], cfg)
    await web.start()
    await rpc.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{rpc.port}")
    client = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{http_port}",
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=20,
    )
    try:
        yield Stack(rt, client, channel, f"127.0.0.1:{rpc.port}")
    finally:
        await client.aclose()
        await channel.close()
        await rpc.stop(1.0)
        await web.stop(grace=1.0)
        await rt.aclose()


# -- what the log says ----------------------------------------------------------


async def document_from_log(
    st: Stack, sid: str, upto_position: int | None = None
) -> dict[str, Any]:
    """The session's document folded straight from the log: its events and its forks'
    ``session.opened`` (which place each fork in the parent), in log order."""
    own = await st.log.read(sid)
    children = [
        (await st.log.read(row.id, 1, 1))[0] for row in await st.log.list_sessions(parent_id=sid)
    ]
    evs = sorted([*own, *children], key=lambda e: e.position)
    if upto_position is not None:
        evs = [e for e in evs if e.position <= upto_position]
    doc = build_document(
        sid, evs, detokenize=st.runtime.engine.detokenize, base=await fork_base(st.log, own[0])
    )
    return json.loads(json.dumps(doc))


async def doc_positions(st: Stack, sid: str) -> list[int]:
    """Log positions of every event that changes ``sid``'s document."""
    own = [e.position for e in await st.log.read(sid)]
    children = [
        (await st.log.read(row.id, 1, 1))[0].position
        for row in await st.log.list_sessions(parent_id=sid)
    ]
    return sorted(own + children)


#: the penalties a generation.started records where one acts
PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty", "penalty_last_n")


def generated(evs: Sequence[Event], generation_id: str | None = None) -> list[Event]:
    return [
        e
        for e in evs
        if e.type == "generation.token"
        and not e.body["is_prefill"]
        and (generation_id is None or e.body["generation_id"] == generation_id)
    ]


# -- what the wires say -----------------------------------------------------------


@dataclass
class Stream:
    snapshot: SseEvent | None
    patches: list[SseEvent]
    end: SseEvent | None


async def read_sse(
    st: Stack, sid: str, last_event_id: int | None = None, started: asyncio.Event | None = None
) -> Stream:
    """An SSE stream of ``sid``'s document, to its ``end`` event."""
    headers = {} if last_event_id is None else {"last-event-id": str(last_event_id)}
    snap, patches, end = None, [], None
    async with st.http.stream("GET", f"/v1/sessions/{sid}/events", headers=headers) as resp:
        assert resp.status_code == 200, await resp.aread()
        if started is not None:
            started.set()
        async for ev in events(resp):
            if ev.event == "snapshot":
                assert snap is None and not patches
                snap = ev
            elif ev.event == "patch":
                patches.append(ev)
            elif ev.event == "end":
                end = ev
                break
            else:
                raise AssertionError(f"unexpected SSE event {ev.event}: {ev.data}")
    return Stream(snap, patches, end)


def fold(doc: Any, patches: Sequence[SseEvent]) -> Any:
    for p in patches:
        doc = apply_patch(doc, p.json())
    return doc


async def check_views(st: Stack, sid: str, watched: Stream) -> None:
    """The SSE stream, the document route and the export all describe the log."""
    assert watched.snapshot is not None and watched.end is not None
    ids = [p.id for p in watched.patches]
    assert all(i is not None for i in ids)
    # one patch per event that changes the document, in log order, ids = positions
    after_snapshot = [p for p in await doc_positions(st, sid) if p > (watched.snapshot.id or 0)]
    assert ids == after_snapshot
    from_log = await document_from_log(st, sid)
    assert fold(watched.snapshot.json(), watched.patches) == from_log
    assert (await st.http.get(f"/v1/sessions/{sid}")).json() == from_log
    # the export verifies, equals the log line for line, and re-imports unchanged
    exported = await st.http.get(f"/v1/sessions/{sid}/export")
    assert exported.status_code == 200
    lines = [json.loads(line) for line in exported.text.splitlines()]
    logged = await st.log.read(sid)
    assert lines == [e.to_json() for e in logged]
    evs = [Event.from_json(obj) for obj in lines]
    verify_chain(evs)


async def reimport(st: Stack, sid: str, tmp_path: Path) -> None:
    """An export re-imported into a fresh log reads back identically and folds to the same document."""
    text = (await st.http.get(f"/v1/sessions/{sid}/export")).text
    evs = [Event.from_json(json.loads(line)) for line in text.splitlines()]
    other = await EventLog.open(f"sqlite+aiosqlite:///{tmp_path / 'imported.db'}")
    try:
        back = await other.import_events(evs)
        again = await other.read(sid)
        assert again == back

        def unplaced(xs: Sequence[Event]) -> list[dict[str, Any]]:
            return [{k: v for k, v in e.to_json().items() if k != "position"} for e in xs]

        assert unplaced(again) == unplaced(evs)
        detok = st.runtime.engine.detokenize
        mine = build_document(sid, await st.log.read(sid), detokenize=detok)
        theirs = build_document(sid, again, detokenize=detok)
        for doc in (mine, theirs):
            doc.pop("children")
        assert json.loads(json.dumps(theirs)) == json.loads(json.dumps(mine))
    finally:
        await other.close()


async def check_resume(st: Stack, sid: str, watched: Stream, cursor: int) -> None:
    """Resuming ``sid``'s SSE stream at log position ``cursor`` yields exactly the events after it,
    and folds from the document at ``cursor`` to the final document."""
    resumed = await read_sse(st, sid, last_event_id=cursor)
    assert resumed.snapshot is None  # a resume gets no fresh snapshot, only what it missed
    assert [p.id for p in resumed.patches] == [
        p for p in await doc_positions(st, sid) if p > cursor
    ]
    # the same cursor over the HTTP export: its events past the cursor are the session's own patches
    exported = [
        json.loads(line)
        for line in (await st.http.get(f"/v1/sessions/{sid}/export")).text.splitlines()
    ]
    own_after = [obj["position"] for obj in exported if obj["position"] > cursor]
    assert own_after and set(own_after) <= {p.id for p in resumed.patches}
    at_cursor = await document_from_log(st, sid, upto_position=cursor)
    final = fold(at_cursor, resumed.patches)
    assert final == await document_from_log(st, sid)
    # and, past where the live stream began, equals it patch for patch
    if watched.snapshot is not None:
        since = max(cursor, watched.snapshot.id or 0)
        assert [(p.id, p.json()) for p in resumed.patches if (p.id or 0) > since] == [
            (p.id, p.json()) for p in watched.patches if (p.id or 0) > since
        ]


# -- the script over HTTP ----------------------------------------------------------


async def test_http_script_reads_the_same_over_sse_export_and_resume(
    stack: Stack, tmp_path: Path
) -> None:
    st = stack
    created = await st.http.post("/v1/sessions", json={"label": "conformance"})
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    listening = asyncio.Event()
    watch = asyncio.create_task(read_sse(st, sid, started=listening))
    await asyncio.wait_for(listening.wait(), 10)

    r = await st.http.post(f"/v1/sessions/{sid}/append", json={"text": "Hello, tape. "})
    assert r.status_code == 200, r.text
    prompt_len = r.json()["length"]
    r = await st.http.post(
        f"/v1/sessions/{sid}/generate",
        json={"max_tokens": 12, "seed": 7, "temperature": 0.8, "logprob_top_k": 2, "stream": False},
    )
    assert r.status_code == 200, r.text
    gen = r.json()["generation"]
    at = prompt_len + 5  # inside the response
    r = await st.http.post(f"/v1/sessions/{sid}/fork", json={"at_position": at, "label": "child"})
    assert r.status_code == 201, r.text
    child = r.json()["id"]
    r = await st.http.post(f"/v1/sessions/{sid}/feedback", json={"score": 8, "comment": "good"})
    assert r.status_code == 201, r.text
    r = await st.http.post(f"/v1/sessions/{sid}/close", json={"reason": "done"})
    assert r.status_code == 200, r.text
    watched = await asyncio.wait_for(watch, 20)

    logged = await st.log.read(sid)
    assert [e.type for e in logged] == [
        "session.opened",
        "tokens.appended",
        "generation.started",
        *["generation.token"] * 12,
        "generation.finished",
        "feedback.recorded",
        "session.closed",
    ]
    # the HTTP generation's tokens are the log's, logprobs and top-k included
    toks = generated(logged)
    assert [(t["id"], t["position"], t["logprob"]) for t in gen["tokens"]] == [
        (e.body["token"], e.body["position"], e.body["logprob"]) for e in toks
    ]
    assert [[[x["id"], x["logprob"]] for x in t["top"]] for t in gen["tokens"]] == [
        e.body["top"] for e in toks
    ]
    # the fork holds the parent's first `at` tokens
    child_doc = await document_from_log(st, child)
    assert child_doc["history"]["ids"] == (await document_from_log(st, sid))["history"]["ids"][:at]

    await check_views(st, sid, watched)
    await reimport(st, sid, tmp_path)
    # a cursor from the live SSE stream (mid-generation) resumes over the events route
    cursor = watched.patches[6].id
    assert cursor is not None
    await check_resume(st, sid, watched, cursor)


# -- the script over gRPC token sessions -------------------------------------------


async def test_kakeya_and_salience_streams_are_the_logged_tokens(
    stack: Stack, tmp_path: Path
) -> None:
    st = stack
    kakeya = kakeya_grpc.RuntimeServiceStub(st.channel)
    salience = salience_grpc.SalienceStub(st.channel)
    prompt = list(b"Hello, tape. ")

    # Kakeya: create, append, seeded generate, close (feedback over HTTP: Kakeya has none)
    ksid = (
        await kakeya.CreateSession(kpb.CreateSessionRequest(client_label="k"), metadata=AUTH)
    ).session_id
    await kakeya.AppendTokens(
        kpb.AppendTokensRequest(session_id=ksid, token_ids=prompt), metadata=AUTH
    )
    streamed: list[int] = []
    async for msg in kakeya.Generate(
        kpb.GenerateRequest(session_id=ksid, max_tokens=10, seed=7, temperature=0.8), metadata=AUTH
    ):
        if msg.WhichOneof("payload") == "token_id":
            streamed.append(msg.token_id)
        else:
            assert msg.WhichOneof("payload") == "done" and msg.done.generated_token_count == 10
    assert streamed == [e.body["token"] for e in generated(await st.log.read(ksid))]
    # the same seed over HTTP on a copy of the history gives the same tokens (one engine, one fold)
    r = await st.http.post("/v1/sessions", json={})
    hsid = r.json()["id"]
    await st.http.post(f"/v1/sessions/{hsid}/append", json={"tokens": prompt})
    r = await st.http.post(
        f"/v1/sessions/{hsid}/generate",
        json={"max_tokens": 10, "seed": 7, "temperature": 0.8, "stream": False},
    )
    assert [t["id"] for t in r.json()["generation"]["tokens"]] == streamed

    # Salience: open, generate with logprobs, fork mid-response, generate on the fork
    ssid = (await salience.OpenSession(spb.OpenSessionRequest(), metadata=AUTH)).session_id
    stoks: list[Any] = []
    async for ev in salience.Generate(
        spb.GenerateRequest(
            session_id=ssid,
            append_tokens=prompt,
            offset=0,
            max_tokens=10,
            logprob_top_k=2,
            logprobs_ranges=[spb.PositionRange(start=len(prompt), end=len(prompt) + 10)],
        ),
        metadata=AUTH,
    ):
        if ev.WhichOneof("event") == "token":
            stoks.append(ev.token)
    logged = generated(await st.log.read(ssid))
    assert [(t.id, t.position) for t in stoks if not t.is_prefill] == [
        (e.body["token"], e.body["position"]) for e in logged
    ]
    # float32 on the wire: the log's float64 values rounded to float32, top-k included
    assert [t.sampled_logprob for t in stoks if not t.is_prefill] == [
        float(np.float32(e.body["logprob"])) for e in logged
    ]
    assert [[(x.id, x.logprob) for x in t.logprobs] for t in stoks if not t.is_prefill] == [
        [(i, float(np.float32(lp))) for i, lp in e.body["top"]] for e in logged
    ]
    at = len(prompt) + 4
    fsid = (
        await salience.ForkSession(
            spb.ForkSessionRequest(session_id=ssid, at_position=at), metadata=AUTH
        )
    ).session_id
    dumped = (
        await salience.DumpSession(spb.DumpSessionRequest(session_id=fsid), metadata=AUTH)
    ).tokens
    assert list(dumped) == prompt + [e.body["token"] for e in logged][:4]
    async for _ in salience.Generate(
        spb.GenerateRequest(session_id=fsid, offset=at, max_tokens=3), metadata=AUTH
    ):
        pass
    # the token history every wire reports is the document's, folded from the log
    for sid in (ssid, fsid):
        dumped = (
            await salience.DumpSession(spb.DumpSessionRequest(session_id=sid), metadata=AUTH)
        ).tokens
        assert (await document_from_log(st, sid))["history"]["ids"] == list(dumped)
        assert (await st.http.get(f"/v1/sessions/{sid}")).json()["history"]["ids"] == list(dumped)
    info = await kakeya.GetSessionInfo(kpb.GetSessionInfoRequest(session_id=ksid), metadata=AUTH)
    assert (
        info.history_length
        == len((await document_from_log(st, ksid))["history"]["ids"])
        == len(prompt) + 10
    )
    r = await st.http.post(f"/v1/sessions/{ssid}/feedback", json={"score": 3})
    assert r.status_code == 201
    await salience.CloseSession(spb.CloseSessionRequest(session_id=ssid), metadata=AUTH)
    await kakeya.CloseSession(kpb.CloseSessionRequest(session_id=ksid), metadata=AUTH)

    for sid in (ksid, ssid):
        finished = await read_sse(st, sid)
        assert finished.patches == []  # a closed session: snapshot, then end
        assert finished.snapshot is not None
        # its id: the log position the document is complete up to (at or past the session's last event)
        assert (finished.snapshot.id or 0) >= (await st.log.read(sid))[-1].position
        await check_views(st, sid, finished)
    await reimport(st, ksid, tmp_path)

    # a log position inside the gRPC-made generation resumes the session's SSE stream
    for sid in (ksid, ssid):
        toks = generated(await st.log.read(sid))
        cursor = toks[3].position
        await check_resume(st, sid, Stream(None, [], None), cursor)


# -- the script over Evergreen (node DAG) ------------------------------------------


async def test_evergreen_fragments_and_dag_read_the_same_over_sse_and_http(
    stack: Stack, tmp_path: Path
) -> None:
    st = stack
    prompt = "Hello, tape. "
    async with EvergreenClient(st.grpc_target, token=TOKEN) as client, client.session() as ev:
        # create (the stream), append (the prompt node), generate (an action) with a seed
        await ev.send(
            actions=[
                action(
                    "GENERATE",
                    inputs={"text": "prompt"},
                    outputs={"text": "reply"},
                    configs=[sampling_config(max_tokens=12, seed=7, temperature=0.8)],
                )
            ],
            fragments=text_fragments("prompt", prompt, parts=2),
        )
        sid = await ev.session_id()
        listening = asyncio.Event()
        watch = asyncio.create_task(read_sse(st, sid, started=listening))
        await asyncio.wait_for(listening.wait(), 10)
        async with asyncio.timeout(10):
            async for e in st.runtime.reads.subscribe(0, session_id=sid):
                if e.type == "action.completed":
                    break
        # fork mid-response and feedback over HTTP while the Evergreen stream is open; close by half-closing
        at = len(st.runtime.engine.tokenize(prompt)) + 4
        r = await st.http.post(f"/v1/sessions/{sid}/fork", json={"at_position": at})
        assert r.status_code == 201, r.text
        child = r.json()["id"]
        r = await st.http.post(f"/v1/sessions/{sid}/feedback", json={"score": 5})
        assert r.status_code == 201, r.text
        await ev.done_writing()
        nodes = await ev.collect()
        received = [f for m in ev.received for f in m.node_fragments]
    watched = await asyncio.wait_for(watch, 20)

    logged = await st.log.read(sid)
    assert logged[-1].type == "session.closed"
    # the streamed fragments are the log's outbound node.fragment events, bytes included
    outbound = [e for e in logged if e.type == "node.fragment" and e.body["direction"] == "out"]
    assert [
        (e.body["id"], e.body["seq"], e.body["continued"], e.data or b"") for e in outbound
    ] == [(f.id, f.seq, f.continued, f.chunk_fragment.data) for f in received]
    reply_tokens = [e.body["token"] for e in generated(logged)]
    assert nodes["reply"] == assemble(ev.received)["reply"]
    assert nodes["reply"].decode() == st.runtime.engine.detokenize(reply_tokens)
    # the node DAG every view shows: the document's nodes, the node-content route, the fork's history
    doc = await document_from_log(st, sid)
    assert set(doc["nodes"]) == {"prompt", "reply"}
    content = await st.http.get(f"/v1/sessions/{sid}/nodes/reply/content")
    assert content.status_code == 200 and content.content == nodes["reply"]
    assert (
        await st.http.get(f"/v1/sessions/{sid}/nodes/prompt/content")
    ).content == prompt.encode()
    assert (await document_from_log(st, child))["history"]["ids"] == doc["history"]["ids"][:at]
    # the same prompt, seed and parameters over HTTP generate the same tokens
    r = await st.http.post("/v1/sessions", json={})
    hsid = r.json()["id"]
    await st.http.post(f"/v1/sessions/{hsid}/append", json={"text": prompt})
    r = await st.http.post(
        f"/v1/sessions/{hsid}/generate",
        json={"max_tokens": 12, "seed": 7, "temperature": 0.8, "stream": False},
    )
    assert [t["id"] for t in r.json()["generation"]["tokens"]] == reply_tokens

    await check_views(st, sid, watched)
    await reimport(st, sid, tmp_path)
    cursor = generated(logged)[5].position
    await check_resume(st, sid, watched, cursor)


# -- the script over D4 (Nostr kind-1 events through a loopback relay) ------------


async def test_d4_results_and_feedback_read_the_same_over_sse_and_http(
    stack: Stack, tmp_path: Path
) -> None:
    import nostr_sdk as ns

    from sessiontape.transports.nostr.plugin import NostrTransport
    from tests.helpers.nostr import Caller, LocalRelay, call_body, eventually

    st = stack
    ns.uniffi_set_event_loop(asyncio.get_running_loop())
    relay = await LocalRelay().start()
    key_file = tmp_path / "worker.key"
    key_file.write_text(ns.Keys.generate().secret_key().to_bech32())
    d4 = NostrTransport(
        st.runtime,
        {
            "relays": [relay.url],
            "key_file": str(key_file),
            "price_msat": 1000,
            "stream_every_tokens": 4,
            "stream_every_ms": 10_000,
            "stream_gap_ms": 0,
            "reconnect_min_s": 0.5,
            "retry_base_s": 0.05,
        },
        st.runtime.config,
    )
    caller: Caller | None = None
    try:
        await d4.start()
        assert d4.worker is not None
        [fid] = d4.worker.functions
        caller = await Caller(d4.worker.pubkey).connect(relay.url)
        # create + append + generate with a seed: one call (the reference engine here never samples EOS,
        # so the call stops for length: more_results, the session stays open for a funded continuation)
        call_id = await caller.call(
            fid, call_body("Hello, tape. ", args={"temperature": 0.8, "seed": 7})
        )
        final = await caller.wait_final(call_id)
        sid = "d4_" + call_id[:48]
        # feedback over Nostr on the final result
        fb = await caller.publish(
            caller.sign(
                json.dumps({"score": 7, "version": "0.1.0"}), [["e", final["id"]], ["e", fid]]
            )
        )
        await eventually(lambda: d4.worker is not None and d4.worker.stats["feedback"] == 1)
        assert final["body"]["more_results"] is True
        # fork mid-response and close over HTTP
        logged = await st.log.read(sid)
        [started] = [e for e in logged if e.type == "generation.started"]
        at = started.body["prompt_length"] + 3
        r = await st.http.post(f"/v1/sessions/{sid}/fork", json={"at_position": at})
        assert r.status_code == 201, r.text
        child = r.json()["id"]
        assert (await st.http.post(f"/v1/sessions/{sid}/close", json={})).status_code == 200
        logged = await st.log.read(sid)
        assert [e.type for e in logged if e.type.startswith("session.")] == [
            "session.opened",
            "session.closed",
        ]
        [feedback] = [e for e in logged if e.type == "feedback.recorded"]
        assert (feedback.body["score"], feedback.body["event_id"]) == (7, fb)

        # every result the caller got for the call is a wire.message (out) the log recorded first, verbatim
        replies = {
            r["id"]: {k: v for k, v in r.items() if k != "body"} for r in caller.replies(call_id)
        }
        outs = {
            e.body["payload"]["id"]: e.body["payload"]
            for e in logged
            if e.type == "wire.message" and e.body["direction"] == "out"
        }
        assert replies and all(outs.get(i) == r for i, r in replies.items())
        # the final result's completion is the log's generated tokens
        toks = [e.body["token"] for e in generated(logged)]
        completion = json.loads(final["body"]["result"])
        assert completion["usage"]["completion_tokens"] == len(toks)
        # the text of the tokens, less a character they end in the middle of
        text = st.runtime.engine.detokenize(toks).removesuffix("\ufffd")
        assert completion["choices"][0]["message"]["content"] == text
        # the recorded prompt and parameters, driven over HTTP, generate the same tokens
        [appended] = [e for e in logged if e.type == "tokens.appended"]
        hsid = (await st.http.post("/v1/sessions", json={})).json()["id"]
        await st.http.post(f"/v1/sessions/{hsid}/append", json={"tokens": appended.body["tokens"]})
        p = started.body["params"]
        r = await st.http.post(
            f"/v1/sessions/{hsid}/generate",
            json={
                "max_tokens": p["max_tokens"],
                "temperature": p["temperature"],
                "top_p": p["top_p"],
                "top_k": p["top_k"],
                "seed": int(p["seed"]),
                "stop_token_ids": p["stop_token_ids"],
                # the call's min_p (and penalties, where it names them) are recorded too
                **{k: p[k] for k in (*PENALTIES, "min_p") if k in p},
                "stream": False,
            },
        )
        assert [t["id"] for t in r.json()["generation"]["tokens"]] == toks
        doc = await document_from_log(st, sid)
        assert (await document_from_log(st, child))["history"]["ids"] == doc["history"]["ids"][:at]
        assert [f["score"] for f in doc["feedback"]] == [7]

        finished = await read_sse(st, sid)
        await check_views(st, sid, finished)
        await reimport(st, sid, tmp_path)
        await check_resume(st, sid, finished, generated(logged)[2].position)
    finally:
        if caller is not None:
            await caller.close()
        await d4.stop(1.0)
        relay.stop()
