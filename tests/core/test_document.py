"""The session document: folded from a real session's log, incrementally and at any version."""

from __future__ import annotations

import pytest

from core.document import DocumentBuilder, SessionListBuilder, build_document
from core.engine import OutputOptions, SamplingParams
from core.errors import InvalidEvent
from core.events import Event
from core.nodes import FragmentIn
from core.patch import apply_patch, diff
from core.runtime import Runtime
from core.state import fork_state


async def _session(rt: Runtime) -> str:
    s = await rt.open_session("http", label="doc")
    await rt.append_text(s.session_id, "Hello")
    async for _ in rt.generate(s.session_id, SamplingParams(max_tokens=6, seed=7), OutputOptions(logprob_top_k=2)):
        pass
    await rt.record_feedback(s.session_id, {"score": 1})
    return s.session_id


async def test_document_shows_the_session(runtime: Runtime) -> None:
    sid = await _session(runtime)
    await runtime.close(sid)
    evs = await runtime.log.read(sid)
    st = await runtime.get(sid)
    doc = build_document(sid, evs, detokenize=runtime.engine.detokenize)
    assert doc["id"] == sid and doc["status"] == "closed" and doc["label"] == "doc"
    assert doc["version"] == st.version == len(evs)
    assert doc["history"]["ids"] == list(st.tokens)
    assert doc["history"]["text"] == runtime.engine.detokenize(list(st.tokens))
    assert [s["source"] for s in doc["history"]["segments"]] == ["input", "generation"]
    [gen] = doc["generations"]
    assert gen["status"] == "finished" and gen["finish_reason"] in ("length", "eos")
    assert [t["id"] for t in gen["tokens"]] == st.generations[gen["id"]].tokens
    assert all(len(t["top"]) == 2 and t["logprob"] is not None for t in gen["tokens"])
    assert gen["text"] == runtime.engine.detokenize([t["id"] for t in gen["tokens"]])
    assert gen["timing"]["completion_tokens"] == len(gen["tokens"])
    assert doc["feedback"][0]["score"] == 1
    assert doc["audit"] == {"chain": "verified", "head_hash": evs[-1].hash, "error": None}
    assert doc["engine"]["model_id"] == runtime.engine.info.model_id


async def test_incremental_patches_rebuild_every_version(runtime: Runtime) -> None:
    sid = await _session(runtime)
    evs = await runtime.log.read(sid)
    b = DocumentBuilder(sid, detokenize=runtime.engine.detokenize)
    client = b.doc
    for n, e in enumerate(evs, 1):
        before = b.doc
        snapshot = repr(before)
        after = b.apply(e)
        client = apply_patch(client, diff(before, after))
        assert client == after
        assert repr(before) == snapshot  # the previous document is never mutated
        assert after == build_document(sid, evs[:n], detokenize=runtime.engine.detokenize)


async def test_growing_text_is_streamed_as_appends(runtime: Runtime) -> None:
    sid = await _session(runtime)
    evs = await runtime.log.read(sid)
    b = DocumentBuilder(sid, detokenize=runtime.engine.detokenize)
    token_ops = []
    for e in evs:
        before = b.doc
        ops = diff(before, b.apply(e))
        if e.type == "generation.token" and not e.body.get("is_prefill"):
            token_ops.append({op["path"]: op["op"] for op in ops})
    assert token_ops
    for ops in token_ops:
        assert ops["/history/ids"] == "append"
        assert ops["/generations/0/tokens"] == "append"


async def test_forks_inherit_and_are_listed_as_children(runtime: Runtime) -> None:
    sid = await _session(runtime)
    child = await runtime.fork(sid, at_position=3)
    parent_evs = await runtime.log.read(sid)
    [opened] = await runtime.log.read(child.session_id)
    b = DocumentBuilder(sid, detokenize=runtime.engine.detokenize)
    doc = b.apply_all([*parent_evs, opened])
    assert doc["children"] == [{"session_id": child.session_id, "version": len(parent_evs), "token_position": 3,
                                "created_at": opened.recorded_at, "position": opened.position}]
    pstate = await runtime.load(sid, len(parent_evs))
    cb = DocumentBuilder(child.session_id, detokenize=runtime.engine.detokenize,
                         base=fork_state(pstate, child.session_id, 3))
    cdoc = cb.apply(opened)
    assert cdoc["history"]["ids"] == doc["history"]["ids"][:3]
    assert cdoc["history"]["segments"] == [{"source": "inherited", "start": 0, "text": "Hel"}]
    assert cdoc["parent"] == {"session_id": sid, "version": len(parent_evs), "token_position": 3}


async def test_nodes_are_rendered_as_a_tree(runtime: Runtime) -> None:
    s = await runtime.open_session("evergreen")
    await runtime.append_fragments(s.session_id, [
        FragmentIn("root", child_ids=("a", "img")),
        FragmentIn("a", has_chunk=True, metadata={"mimetype": "text/plain", "role": "user"}, data=b"Hi ",
                   continued=True),
        FragmentIn("a", seq=1, has_chunk=True, data=b"there"),
        FragmentIn("img", has_chunk=True, metadata={"mimetype": "image/png"}, ref="https://x.test/i.png"),
    ])
    doc = build_document(s.session_id, await runtime.log.read(s.session_id))
    assert doc["roots"] == ["root"]
    assert doc["nodes"]["root"]["children"] == ["a", "img"]
    assert doc["nodes"]["a"]["text"] == "Hi there" and doc["nodes"]["a"]["complete"]
    assert doc["nodes"]["img"]["ref"] == "https://x.test/i.png" and doc["nodes"]["img"]["text"] is None


async def test_tampered_event_marks_the_chain_broken(runtime: Runtime) -> None:
    sid = await _session(runtime)
    evs = await runtime.log.read(sid)
    e = evs[2]
    evs[2] = Event(e.position, e.session_id, e.version, e.type, {**e.body, "tokens": [66]}, e.data,
                   e.recorded_at, e.hash, e.prev_hash)
    doc = build_document(sid, evs)
    assert doc["audit"]["chain"] == "broken" and "v3" in doc["audit"]["error"]


async def test_an_event_that_cannot_follow_leaves_the_document(runtime: Runtime) -> None:
    sid = await _session(runtime)
    evs = await runtime.log.read(sid)
    b = DocumentBuilder(sid)
    b.apply_all(evs[:2])
    before = b.doc
    with pytest.raises(InvalidEvent):
        b.apply(evs[5])
    assert b.doc is before


async def test_sessions_list_folds_status_and_generating(runtime: Runtime) -> None:
    sid = await _session(runtime)
    await runtime.close(sid)
    lb = SessionListBuilder()
    seen = []
    for e in await runtime.log.read(sid):
        lb.apply(e)
        seen.append((lb.doc["sessions"][sid]["status"], lb.doc["sessions"][sid]["generating"]))
    assert seen[0] == ("open", False)
    assert ("open", True) in seen
    assert seen[-1] == ("closed", False)
