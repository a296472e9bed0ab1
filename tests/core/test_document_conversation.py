"""The session document's conversation: chat requests and their replies as turns, folded from the
log (live, by patches, across forks and rewinds); sessions no chat request went into have none."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

from sessiontape.core.document import DocumentBuilder, build_document, fork_base
from sessiontape.core.document.conversation import Conversation, remap, request_messages
from sessiontape.core.engine.interface import OutputOptions, SamplingParams
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.patch import apply_patch
from sessiontape.core.runtime import Runtime
from sessiontape.transports.http.openai.chat_template import ROLE_MARKERS, ChatTemplate
from sessiontape.transports.http.openai.turns import Turn, Turns, load_turn

QUESTION = "What is the capital of France?"


async def _ask(
    turns: Turns,
    sid: str,
    messages: list[tuple[str, str]],
    *,
    api: str = "chat.completions",
    request: dict[str, Any] | None = None,
    seed: int = 1,
) -> Turn:
    """One request as the OpenAI routes make it; returns once its generation ended."""
    req = request or {"messages": [{"role": r, "content": c} for r, c in messages]}
    turn = await turns.start(
        sid, api, messages, req, SamplingParams(max_tokens=12, seed=seed), OutputOptions()
    )
    await turns.wait(turn)
    return await load_turn(turns.runtime, sid, turn.version, api)  # with its tokens


def _turns(rt: Runtime, template: ChatTemplate = ROLE_MARKERS) -> Turns:
    return Turns(rt, template, set[asyncio.Task[Any]]())


async def test_a_chat_session_is_a_conversation(runtime: Runtime) -> None:
    turns = _turns(runtime)
    sid = (await runtime.open_session("openai")).session_id
    one = await _ask(turns, sid, [("system", "Be brief."), ("user", QUESTION)])
    two = await _ask(turns, sid, [("user", "And of Italy?")], seed=2)
    detok = runtime.engine.detokenize
    doc = build_document(sid, await runtime.log.read(sid), detokenize=detok)
    conv = doc["conversation"]
    assert [(t["role"], t["generation_id"]) for t in conv] == [
        ("system", None),
        ("user", None),
        ("assistant", one.generation_id),
        ("user", None),
        ("assistant", two.generation_id),
    ]
    assert [t["text"] for t in conv] == [
        "Be brief.",
        QUESTION,
        one.text(detok)[0],  # what the OpenAI reply shows
        "And of Italy?",
        two.text(detok)[0],
    ]
    # a request's messages span the tokens it appended; a reply its generated tokens
    a1 = one.prompt_tokens
    spans = [(t["start"], t["end"]) for t in conv]
    assert spans == [
        (0, a1),
        (0, a1),
        (a1, one.end),
        (one.end, two.prompt_tokens),
        (two.prompt_tokens, two.end),
    ]
    assert two.prompt_tokens - one.end == two.appended and two.end == len(doc["history"]["ids"])
    ids = doc["history"]["ids"]
    assert detok(ids[0:a1]) == f"<|system|>\nBe brief.\n<|user|>\n{QUESTION}\n<|assistant|>\n"
    assert not any(t["inherited"] for t in conv)
    # the messages are the request's: no template marker in any turn
    assert all("<|" not in t["text"] for t in conv[:2] + conv[3:4])


async def test_the_reply_grows_by_appends_as_tokens_arrive(runtime: Runtime) -> None:
    turns = _turns(runtime)
    sid = (await runtime.open_session("openai")).session_id
    turn = await _ask(turns, sid, [("user", QUESTION)])
    evs = await runtime.log.read(sid)
    detok = runtime.engine.detokenize
    b = DocumentBuilder(sid, detokenize=detok)
    seen: list[str] = []
    for n, e in enumerate(evs, 1):
        before = copy.deepcopy(b.doc)
        ops = json.loads(json.dumps(b.apply(e)))  # what a watcher receives
        assert apply_patch(before, ops) == b.doc, e.type
        assert b.doc == build_document(sid, evs[:n], detokenize=detok)
        mine = [op for op in ops if op["path"].startswith("/conversation")]
        if e.type == "generation.token":
            # a token appends to the reply's text and moves its end: no whole-text replace
            assert {(op["op"], op["path"]) for op in mine} <= {
                ("append", "/conversation/1/text"),
                ("replace", "/conversation/1/end"),
            }
            assert ("replace", "/conversation/1/end") in {(op["op"], op["path"]) for op in mine}
        conv = b.doc["conversation"]
        if len(conv) == 2:
            text = conv[1]["text"]
            assert text.startswith(seen[-1] if seen else "")
            seen.append(text)
    assert seen[0] == "" and seen[-1] == turn.text(detok)[0]
    assert b.doc["conversation"][1]["end"] == turn.end


async def test_a_fork_keeps_the_conversation_up_to_the_fork_point(runtime: Runtime) -> None:
    turns = _turns(runtime)
    sid = (await runtime.open_session("openai")).session_id
    one = await _ask(turns, sid, [("user", QUESTION)])
    two = await _ask(turns, sid, [("user", "And of Italy?")], seed=2)
    assert len(two.tokens) >= 4
    cut = two.prompt_tokens + 3  # three tokens into the second reply
    child = (await runtime.fork(sid, at_position=cut)).session_id
    detok = runtime.engine.detokenize

    async def child_doc() -> dict[str, Any]:
        evs = await runtime.log.read(child)
        base = await fork_base(runtime.log, evs[0])
        return build_document(child, evs, detokenize=detok, base=base)

    doc = await child_doc()
    conv = doc["conversation"]
    assert [t["role"] for t in conv] == ["user", "assistant", "user", "assistant"]
    assert all(t["inherited"] for t in conv)
    assert conv[1]["text"] == one.text(detok)[0]
    assert (conv[3]["start"], conv[3]["end"]) == (two.prompt_tokens, cut)
    assert conv[3]["text"] == detok(two.tokens[:3]).removesuffix("\ufffd")
    # the fork goes on talking: its own turns follow the inherited ones
    three = await _ask(turns, child, [("user", "And of Spain?")], seed=3)
    conv = (await child_doc())["conversation"]
    assert [(t["role"], t["inherited"]) for t in conv[4:]] == [
        ("user", False),
        ("assistant", False),
    ]
    assert conv[4]["text"] == "And of Spain?" and conv[5]["text"] == three.text(detok)[0]
    assert conv[4]["start"] == cut
    # a fork before the first reply keeps only the question
    early = (await runtime.fork(sid, at_position=one.prompt_tokens)).session_id
    evs = await runtime.log.read(early)
    doc = build_document(early, evs, detokenize=detok, base=await fork_base(runtime.log, evs[0]))
    assert [(t["role"], t["text"]) for t in doc["conversation"]] == [("user", QUESTION)]


async def test_sessions_without_chat_requests_have_no_conversation(runtime: Runtime) -> None:
    s = await runtime.open_session("http", label="raw")
    await runtime.append_text(s.session_id, "<|user|>\nHello\n<|assistant|>\n")
    async for _ in runtime.generate(
        s.session_id, GenerateRequest(SamplingParams(max_tokens=6, seed=7))
    ):
        pass
    await runtime.record_wire(s.session_id, "nostr", "in", {"kind": 1})
    doc = build_document(s.session_id, await runtime.log.read(s.session_id))
    assert doc["conversation"] == []
    child = await runtime.fork(s.session_id, at_position=4)
    evs = await runtime.log.read(child.session_id)
    base = await fork_base(runtime.log, evs[0])
    assert build_document(child.session_id, evs, base=base)["conversation"] == []


async def test_a_template_prefix_is_no_message(runtime: Runtime) -> None:
    """A default system prompt the template adds lies in the first request's span, but is no turn;
    a responses-style request shows its instructions as a system turn."""
    smol = ChatTemplate(prefix="<|system|>\nYou are a helpful AI assistant named SmolLM\n")
    turns = _turns(runtime, smol)
    sid = (await runtime.open_session("openai")).session_id
    await _ask(turns, sid, [("user", QUESTION)])
    await _ask(
        turns,
        sid,
        [("system", "Answer in French."), ("user", "Hi")],
        api="responses",
        request={"instructions": "Answer in French.", "input": [{"role": "user", "content": "Hi"}]},
    )
    detok = runtime.engine.detokenize
    doc = build_document(sid, await runtime.log.read(sid), detokenize=detok)
    conv = doc["conversation"]
    assert [(t["role"], t["text"]) for t in conv if t["generation_id"] is None] == [
        ("user", QUESTION),
        ("system", "Answer in French."),
        ("user", "Hi"),
    ]
    assert conv[0]["start"] == 0
    assert "SmolLM" in detok(doc["history"]["ids"][conv[0]["start"] : conv[0]["end"]])


async def test_a_rewind_into_a_reply_cuts_it(runtime: Runtime) -> None:
    turns = _turns(runtime)
    sid = (await runtime.open_session("openai")).session_id
    one = await _ask(turns, sid, [("user", QUESTION)])
    await runtime.append_tokens(sid, [], offset=one.prompt_tokens + 2, truncating=True)
    detok = runtime.engine.detokenize
    conv = build_document(sid, await runtime.log.read(sid), detokenize=detok)["conversation"]
    assert [t["role"] for t in conv] == ["user", "assistant"]
    assert conv[1]["end"] == one.prompt_tokens + 2 and conv[1]["text"] == detok(one.tokens[:2])
    await runtime.append_tokens(sid, [], offset=1, truncating=True)
    conv = build_document(sid, await runtime.log.read(sid), detokenize=detok)["conversation"]
    assert [(t["role"], t["start"], t["end"]) for t in conv] == [("user", 0, 1)]


def test_stop_strings_and_late_requests() -> None:
    """The reply is cut before a stop string (as the OpenAI reply is); a request recorded after
    some of its tokens starts from the text so far."""
    c = Conversation(detokenize=lambda ids: "")
    c.started("g1", 10)
    payload = {
        "generation_id": "g1",
        "appended": 10,
        "request": {"messages": [{"role": "user", "content": "hi"}], "stop": ["<|user|>"]},
    }
    c.token("g1", "Par", 10)
    ops = c.request(payload, reply="Par")
    assert [op["op"] for op in ops] == ["append", "append"]
    assert c.turns[1] == {
        "role": "assistant",
        "text": "Par",
        "generation_id": "g1",
        "start": 10,
        "end": 11,
        "inherited": False,
    }
    assert c.token("g1", "is <|u", 11) == [
        {"op": "append", "path": "/conversation/1/text", "value": "is "},
        {"op": "replace", "path": "/conversation/1/end", "value": 12},
    ]
    c.token("g1", "ser|> more", 12)
    c.finished("g1", "")
    assert c.turns[1]["text"] == "Paris " and c.turns[1]["end"] == 13
    assert c.request(payload) == []  # one reply per generation


def test_request_messages_and_remap() -> None:
    assert request_messages({"messages": [{"role": "developer", "content": "x"}]}) == [
        ("developer", "x")
    ]
    assert request_messages({"instructions": "be kind", "input": "hello"}) == [
        ("system", "be kind"),
        ("user", "hello"),
    ]
    assert request_messages({"input": [{"role": "user", "content": [{"text": "a"}]}]}) == [
        ("user", "a")
    ]
    keep = [(0, 4), (10, 20)]
    assert remap(2, 12, keep) == (2, 6)
    assert remap(5, 9, keep) is None
    assert remap(12, 12, keep) == (6, 6)
    assert remap(14, 30, keep) == (8, 14)
