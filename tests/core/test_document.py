"""The session document: folded from a real session's log, incrementally, with exact patches."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import Sequence
from typing import Any

import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiontape.core.document import (
    REPLACEMENT,
    DocumentBuilder,
    SessionListBuilder,
    TextRun,
    build_document,
    fork_base,
)
from sessiontape.core.engine.interface import OutputOptions, SamplingParams
from sessiontape.core.errors import InvalidEvent, SessiontapeError
from sessiontape.core.events import Event
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.nodes import FragmentIn
from sessiontape.core.patch import apply_patch, diff, to_rfc6902
from sessiontape.core.runtime import Runtime
from sessiontape.core.tokens import ImageIn
from sessiontape.engines.reference import IMAGE_PAD, ReferenceEngine
from tests.helpers.config import make_config


def _bytes_text(ids: Sequence[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "replace")


def _shows(text: str | None, full: str) -> bool:
    """A growing text is the decoded tokens, less a trailing character that may still complete."""
    return text == full or (text is not None and full == text + REPLACEMENT)


async def _session(rt: Runtime) -> str:
    s = await rt.open_session("http", label="doc")
    await rt.append_text(s.session_id, "Hello")
    async for _ in rt.generate(
        s.session_id,
        GenerateRequest(SamplingParams(max_tokens=6, seed=7), OutputOptions(logprob_top_k=2)),
    ):
        pass
    await rt.record_feedback(s.session_id, {"score": 1})
    return s.session_id


async def _everything(rt: Runtime) -> tuple[str, str]:
    """A session with every kind of event the document folds, and a fork of it."""
    sid = await _session(rt)
    block = [200] + [IMAGE_PAD] * 8 + [201]
    at = (await rt.get(sid)).length + 5
    await rt.append_tokens(
        sid, [*"é€".encode(), *block], images=[ImageIn(b"\x89PNG x", "image/png", at, at + 10)]
    )
    await rt.append_tokens(
        sid, list(b"rewound"), offset=8, truncating=True
    )  # a rewind: tokens.truncated, then the append
    async for _ in rt.generate(sid, GenerateRequest(SamplingParams(max_tokens=5, seed=3))):
        pass
    await rt.nodes.append_fragments(
        sid,
        [
            FragmentIn("root", child_ids=("a",)),
            FragmentIn(
                "a", has_chunk=True, metadata={"mimetype": "text/plain", "role": "user"}, data=b"Hi"
            ),
        ],
    )
    act = await rt.nodes.submit_action(sid, "GENERATE", [("prompt", "a")], [("out", "o1")])
    await rt.nodes.finish_action(sid, str(act.body["action_id"]))
    await rt.record_error(sid, "oops", "a recorded error")
    child = await rt.fork(sid, at_position=4)
    await rt.close(sid)
    return sid, child.session_id


async def test_document_shows_the_session(runtime: Runtime) -> None:
    sid = await _session(runtime)
    await runtime.close(sid)
    evs = await runtime.log.read(sid)
    st_ = await runtime.get(sid)
    detok = runtime.engine.detokenize
    doc = build_document(sid, evs, detokenize=detok)
    assert doc["id"] == sid and doc["status"] == "closed" and doc["label"] == "doc"
    assert doc["version"] == st_.version == len(evs)
    assert doc["history"]["ids"] == list(st_.tokens)
    assert _shows(doc["history"]["text"], detok(list(st_.tokens)))
    assert [s["source"] for s in doc["history"]["segments"]] == ["input", "generation"]
    [gen] = doc["generations"]
    assert gen["status"] == "finished" and gen["finish_reason"] in ("length", "eos")
    assert [t["id"] for t in gen["tokens"]] == st_.generations[gen["id"]].tokens
    assert all(len(t["top"]) == 2 and t["logprob"] is not None for t in gen["tokens"])
    # a finished generation's text is all of its tokens' text
    assert (
        gen["text"]
        == detok([t["id"] for t in gen["tokens"]])
        == doc["history"]["segments"][1]["text"]
    )
    assert gen["timing"]["completion_tokens"] == len(gen["tokens"])
    assert doc["feedback"][0]["score"] == 1
    assert doc["audit"] == {"chain": "verified", "head_hash": evs[-1].hash, "error": None}
    assert doc["engine"]["model_id"] == runtime.engine.info.model_id


async def test_every_patch_turns_the_previous_document_into_the_next(runtime: Runtime) -> None:
    sid, child = await _everything(runtime)
    evs = [e for e in await runtime.log.read_all(0, limit=10_000) if e.session_id in (sid, child)]
    assert {e.type for e in evs} >= {
        "tokens.truncated",
        "node.fragment",
        "action.completed",
        "error.recorded",
        "image.attached",
        "session.closed",
    }
    detok = runtime.engine.detokenize
    b = DocumentBuilder(sid, detokenize=detok)
    for n, e in enumerate(evs, 1):
        before = copy.deepcopy(b.doc)
        ops = json.loads(json.dumps(b.apply(e)))  # what a watcher receives
        assert apply_patch(before, ops) == b.doc, e.type
        assert jsonpatch.apply_patch(before, to_rfc6902(ops, b.doc)) == b.doc, e.type
        # folding incrementally is the same as folding the prefix of the log from scratch
        assert b.doc == build_document(sid, evs[:n], detokenize=detok)
    assert _shows(b.doc["history"]["text"], detok(b.doc["history"]["ids"]))
    assert b.doc["children"][0]["session_id"] == child
    assert (
        b.doc["history"]["truncations"] == 1 and b.doc["history"]["images"] == []
    )  # rewound past the image


async def test_growing_text_is_streamed_as_appends(runtime: Runtime) -> None:
    sid = await _session(runtime)
    evs = await runtime.log.read(sid)
    b = DocumentBuilder(sid, detokenize=runtime.engine.detokenize)
    token_ops = []
    for e in evs:
        ops = b.apply(e)
        if e.type == "generation.token" and not e.body.get("is_prefill"):
            token_ops.append({op["path"]: op["op"] for op in ops})
    assert token_ops
    for ops in token_ops:
        assert ops["/history/ids"] == "append"
        assert ops["/generations/0/tokens"] == "append"
        assert all(op in ("append", "replace") for op in ops.values())
        assert not any(
            path.startswith("/history/text") and op == "replace" for path, op in ops.items()
        )


async def test_per_token_work_does_not_grow_with_the_history(sqlite_url: str) -> None:
    """A generated token re-decodes a short window, never the history: the same work at 100 and 12,000 tokens."""
    rt = await Runtime.create(
        make_config(sqlite_url), engine=ReferenceEngine(max_length=16_000, eos_bias=-100.0)
    )
    try:
        text = ("The quick brown fox jumps over the lazy dog; " * 300).encode()[:12_000]
        work: dict[int, list[int]] = {}
        generated: dict[int, list[int]] = {}
        for n in (100, 12_000):
            s = await rt.open_session("bench")
            await rt.append_tokens(
                s.session_id, list(text[-n:])
            )  # greedy on the same last tokens: the same generation
            async for _ in rt.generate(
                s.session_id, GenerateRequest(SamplingParams(max_tokens=80, temperature=0.0))
            ):
                pass
            decoded: list[int] = []

            def counting(ids: Sequence[int], decoded: list[int] = decoded) -> str:
                decoded.append(len(ids))
                return rt.engine.detokenize(ids)

            b = DocumentBuilder(s.session_id, detokenize=counting)
            per_token = []
            for e in await rt.log.read(s.session_id):
                decoded.clear()
                b.apply(e)
                if e.type == "generation.token":
                    per_token.append(sum(decoded))
            assert len(b.doc["history"]["ids"]) > n
            assert _shows(b.doc["history"]["text"], rt.engine.detokenize(b.doc["history"]["ids"]))
            work[n] = per_token
            generated[n] = b.doc["history"]["ids"][n:]
        assert generated[100] == generated[12_000] and len(work[100]) == 80
        assert work[12_000] == work[100]
        assert (
            max(work[12_000]) < 100
        )  # tokens decoded for one generated token, whatever the history
    finally:
        await rt.aclose()


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.sampled_from(["ab", "abc", "abcd"])
)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(old=_scalars | st.lists(_scalars, max_size=3), new=_scalars | st.lists(_scalars, max_size=3))
def test_a_set_records_the_ops_diff_gives(old: Any, new: Any) -> None:
    """The builder's short cut for numbers replacing numbers gives exactly diff()'s ops."""
    builder = DocumentBuilder("s")
    builder._ops = []
    obj = {"k": copy.deepcopy(old)}
    builder._set(obj, "k", new, "/k")
    assert obj["k"] == new
    assert builder._ops == diff(old, new, path="/k")


@settings(max_examples=300, deadline=None)
@given(
    data=st.lists(
        st.sampled_from(
            [0x41, 0x20, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xFF, 257]
        ),
        max_size=200,
    ),
    cuts=st.lists(st.integers(1, 60), min_size=1, max_size=20),
)
def test_text_run_is_the_decoded_bytes(data: list[int], cuts: list[int]) -> None:
    """For byte tokens (valid, truncated and invalid UTF-8), pushed in any batches; the
    complete run's text never ends in a character cut off (its U+FFFD is held back)."""
    run = TextRun(_bytes_text)
    text, i, k = run.start(data[: cuts[0]]), cuts[0], 1
    while i < len(data):
        step = cuts[k % len(cuts)]
        text += run.push(data[i : i + step])
        i, k = i + step, k + 1
        assert _shows(text, _bytes_text(data[:i]))
    assert text + run.flush() == _bytes_text(data).removesuffix(REPLACEMENT)


def test_text_run_keeps_the_context_of_word_pieces() -> None:
    """A SentencePiece-like decoder drops the leading space of the first piece: the window keeps context."""
    vocab = ["\u2581The", "\u2581quick", "\u2581bro", "wn", "\u2581fox", ",", "\u2581jumps"]

    def decode(ids: Sequence[int]) -> str:
        return "".join(vocab[i] for i in ids).replace("\u2581", " ").removeprefix(" ")

    ids = [i % len(vocab) for i in range(300)]
    run = TextRun(decode)
    text = run.start(ids[:3])
    for i in range(3, len(ids)):
        text += run.push([ids[i]])
    assert text == decode(ids)


async def test_forks_inherit_and_are_listed_as_children(runtime: Runtime) -> None:
    sid = await _session(runtime)
    child = await runtime.fork(sid, at_position=3)
    parent_evs = await runtime.log.read(sid)
    [opened] = await runtime.log.read(child.session_id)
    b = DocumentBuilder(sid, detokenize=runtime.engine.detokenize)
    doc = b.apply_all([*parent_evs, opened])
    assert doc["children"] == [
        {
            "session_id": child.session_id,
            "version": len(parent_evs),
            "token_position": 3,
            "created_at": opened.recorded_at,
            "position": opened.position,
        }
    ]
    assert await fork_base(runtime.log, parent_evs[0]) is None
    base = await fork_base(runtime.log, opened)
    assert base is not None and list(base.tokens) == doc["history"]["ids"][:3]
    cb = DocumentBuilder(child.session_id, detokenize=runtime.engine.detokenize, base=base)
    cb.apply(opened)
    cdoc = cb.doc
    assert cdoc["history"]["ids"] == doc["history"]["ids"][:3] and cdoc["history"]["text"] == "Hel"
    assert cdoc["history"]["segments"] == [{"source": "inherited", "start": 0, "text": "Hel"}]
    assert cdoc["parent"] == {"session_id": sid, "version": len(parent_evs), "token_position": 3}


async def test_nodes_are_rendered_as_a_tree(runtime: Runtime) -> None:
    s = await runtime.open_session("evergreen")
    await runtime.nodes.append_fragments(
        s.session_id,
        [
            FragmentIn("root", child_ids=("a", "img")),
            FragmentIn(
                "a",
                has_chunk=True,
                metadata={"mimetype": "text/plain", "role": "user"},
                data=b"Hi ",
                continued=True,
            ),
            FragmentIn("a", seq=1, has_chunk=True, data=b"there"),
            FragmentIn(
                "img",
                has_chunk=True,
                metadata={"mimetype": "image/png"},
                ref="https://x.test/i.png",
            ),
        ],
    )
    doc = build_document(s.session_id, await runtime.log.read(s.session_id))
    assert doc["roots"] == ["root"]
    assert doc["nodes"]["root"]["children"] == ["a", "img"]
    assert doc["nodes"]["a"]["text"] == "Hi there" and doc["nodes"]["a"]["complete"]
    assert (
        doc["nodes"]["img"]["ref"] == "https://x.test/i.png" and doc["nodes"]["img"]["text"] is None
    )


async def test_tampered_event_marks_the_chain_broken(runtime: Runtime) -> None:
    sid = await _session(runtime)
    evs = await runtime.log.read(sid)
    e = evs[2]
    evs[2] = Event(
        e.position,
        e.session_id,
        e.version,
        e.type,
        {**e.body, "tokens": [66]},
        e.data,
        e.recorded_at,
        e.hash,
        e.prev_hash,
    )
    doc = build_document(sid, evs)
    assert doc["audit"]["chain"] == "broken" and "v3" in doc["audit"]["error"]


async def test_an_event_that_cannot_follow_leaves_the_document(runtime: Runtime) -> None:
    sid = await _session(runtime)
    evs = await runtime.log.read(sid)
    b = DocumentBuilder(sid)
    b.apply_all(evs[:2])
    before: dict[str, Any] = copy.deepcopy(b.doc)
    with pytest.raises(InvalidEvent):
        b.apply(evs[5])
    assert b.doc == before


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


#: a node's fragment: (node, children named); a node with children is a parent
NODE_STEPS = st.lists(
    st.tuples(st.integers(0, 9), st.lists(st.integers(0, 9), max_size=3, unique=True)),
    min_size=1,
    max_size=24,
)


@settings(max_examples=40, derandomize=True, database=None, deadline=None)
@given(steps=NODE_STEPS)
def test_roots_are_the_nodes_nobody_names_as_a_child_in_arrival_order(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[int, list[int]]]
) -> None:
    """Kept as each fragment comes (a new parentless node joins at the end, a root
    named as a child leaves): equal to the definition after every event, and the
    patches carry a watcher's copy there."""

    async def main() -> None:
        db = tmp_path_factory.mktemp("roots") / "log.db"
        rt = await Runtime.create(
            make_config(f"sqlite+aiosqlite:///{db}"), engine=ReferenceEngine()
        )
        try:
            sid = (await rt.open_session("evergreen")).session_id
            for node, kids in steps:
                children = tuple(f"n{k}" for k in kids)
                fragment = (
                    FragmentIn(id=f"n{node}", seq=0, continued=False, child_ids=children)
                    if children
                    else FragmentIn(
                        id=f"n{node}", seq=0, continued=False, has_chunk=True, data=b"x"
                    )
                )
                # a fragment the model refuses changes nothing
                with contextlib.suppress(SessiontapeError):
                    await rt.nodes.append_fragments(sid, [fragment])
            b = DocumentBuilder(sid)
            watched = copy.deepcopy(b.doc)
            for e in await rt.log.read(sid):
                ops = b.apply(e)
                watched = apply_patch(watched, json.loads(json.dumps(ops)))
                assert b.doc["roots"] == b._roots()
                assert watched == b.doc
        finally:
            await rt.aclose()

    asyncio.run(main())
