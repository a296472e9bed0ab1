"""The OpenAI-compatible routes, driven by the official ``openai`` package against a live server.

The sync client blocks, so it runs in a worker thread while the server's
event loop serves it. Every reply is checked against the log: a response's
id names its session and the version of its ``generation.started``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from sessiontape.core.events import T
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.http.openai.chat_template import ROLE_MARKERS
from sessiontape.transports.http.openai.turns import load_turn
from sessiontape.transports.http.plugin import HttpTransport
from tests.helpers.config import make_config
from tests.helpers.http import Served

TOKEN = "sekret"
MODEL = "reference-bigram-v1"


async def _serve(url: str, port: int, engine: ReferenceEngine) -> AsyncIterator[Served]:
    cfg = make_config(url, auth={"token": TOKEN})
    rt = await Runtime.create(cfg, engine=engine)
    tr = HttpTransport(rt, {"listen": f"127.0.0.1:{port}", "heartbeat_s": 1.0}, cfg)
    await tr.start()
    try:
        yield Served(rt, tr, f"http://127.0.0.1:{port}")
    finally:
        await tr.stop(grace=1.0)
        await rt.aclose()


@pytest.fixture
async def live(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    """A server with a bearer token; the reference engine sleeps 20 ms a step (streams can be cut)."""
    async for s in _serve(sqlite_url, port, ReferenceEngine(step_delay_s=0.02)):
        yield s


@pytest.fixture
async def eager(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    """The reference engine biased towards EOS: replies end by themselves within a few tokens."""
    async for s in _serve(sqlite_url, port, ReferenceEngine(eos_bias=6.0)):
        yield s


def sync_client(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key=TOKEN, max_retries=0)


def async_client(s: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=TOKEN, max_retries=0)


def session_of(rid: str) -> tuple[str, int]:
    body = rid.split("_", 1)[1]
    sid, _, version = body.rpartition("_")
    return sid, int(version)


async def test_models(live: Served) -> None:
    def run() -> tuple[list[str], str]:
        with sync_client(live) as c:
            return [m.id for m in c.models.list()], c.models.retrieve(MODEL).owned_by

    ids, owner = await asyncio.to_thread(run)
    assert ids == [MODEL] and owner == "sessiontape"
    async with async_client(live) as c:
        with pytest.raises(openai.NotFoundError) as exc:
            await c.models.retrieve("gpt-4o")
        # the engine's name is an alias of its model
        alias = await c.models.retrieve("reference")
        by_alias = await c.responses.create(model="reference", input="x", max_output_tokens=1)
    assert exc.value.code == "model_not_found"
    assert alias.id == MODEL and (alias.model_extra or {})["engine"] == "reference"
    assert by_alias.model == MODEL


async def test_response_sync_is_a_generation_in_the_log(live: Served) -> None:
    def run() -> Any:
        with sync_client(live) as c:
            return c.responses.create(
                model=MODEL,
                input="Hello",
                instructions="Be brief.",
                max_output_tokens=6,
                temperature=0,
                metadata={"k": "v"},
                extra_body={"seed": 7},
            )

    r = await asyncio.to_thread(run)
    assert r.status in ("completed", "incomplete") and r.object == "response" and r.model == MODEL
    assert r.metadata == {"k": "v"} and r.instructions == "Be brief."
    assert r.usage is not None and 1 <= r.usage.output_tokens <= 6
    sid, version = session_of(r.id)
    assert r.model_extra is not None and r.model_extra["session_id"] == sid
    evs = await live.runtime.log.read(sid)
    started = next(e for e in evs if e.version == version)
    assert started.type == T.GENERATION_STARTED
    st = await live.runtime.get(sid)
    # the chat template was applied once and recorded with the session and the request
    prompt = ROLE_MARKERS.render(
        [("system", "Be brief."), ("user", "Hello")], at_start=True, after_generation=False
    )
    assert live.runtime.engine.detokenize(st.tokens[: r.usage.input_tokens]) == prompt
    assert st.meta["chat_template"] == ROLE_MARKERS.to_json()
    wire = next(e for e in evs if e.type == T.WIRE)
    assert wire.body["payload"]["request"]["template"] == ROLE_MARKERS.to_json()
    gen = st.generations[started.body["generation_id"]]
    assert r.output_text == live.runtime.engine.detokenize(gen.tokens)
    assert r.usage.output_tokens == len(gen.tokens)
    # GET rebuilds the same response from the log
    async with async_client(live) as c:
        again = await c.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()
    # and the session audits like any other
    async with httpx.AsyncClient(
        base_url=live.url, headers={"Authorization": f"Bearer {TOKEN}"}
    ) as h:
        audit = (await h.get(f"/v1/sessions/{sid}/audit")).json()
    assert audit["ok"] is True


async def test_same_seed_same_text(live: Served) -> None:
    async with async_client(live) as c:
        a = await c.responses.create(
            model=MODEL, input="Hi", max_output_tokens=8, extra_body={"seed": 42}
        )
        b = await c.responses.create(
            model=MODEL, input="Hi", max_output_tokens=8, extra_body={"seed": 42}
        )
        d = await c.responses.create(
            model=MODEL, input="Hi", max_output_tokens=8, extra_body={"seed": 43}
        )
    assert a.output_text == b.output_text and a.id != b.id
    assert (a.output_text, a.usage and a.usage.output_tokens) != (
        d.output_text,
        d.usage and d.usage.output_tokens,
    ) or a.output_text == d.output_text  # different seeds may agree; the ids never do
    assert session_of(a.id)[0] != session_of(b.id)[0]


async def test_previous_response_chain_continues_the_session(live: Served) -> None:
    async with async_client(live) as c:
        r1 = await c.responses.create(model=MODEL, input="one", max_output_tokens=4, temperature=0)
        r2 = await c.responses.create(
            model=MODEL, input="two", max_output_tokens=4, temperature=0, previous_response_id=r1.id
        )
        r3 = await c.responses.create(
            model=MODEL,
            input="three",
            max_output_tokens=4,
            temperature=0,
            previous_response_id=r2.id,
        )
    sids = {session_of(r.id)[0] for r in (r1, r2, r3)}
    assert len(sids) == 1 and r3.previous_response_id == r2.id
    sid = sids.pop()
    st = await live.runtime.get(sid)
    assert len(st.generations) == 3
    text = live.runtime.engine.detokenize(st.tokens)
    assert text.index("<|user|>\none") < text.index("<|user|>\ntwo") < text.index("<|user|>\nthree")
    # the earlier turns were cached: only this turn's tokens are new input
    assert r3.usage is not None and r3.usage.input_tokens_details.cached_tokens > 0
    assert r3.usage.input_tokens > r1.usage.input_tokens  # type: ignore[union-attr]


async def test_previous_response_that_is_not_the_latest_forks(live: Served) -> None:
    async with async_client(live) as c:
        r1 = await c.responses.create(model=MODEL, input="root", max_output_tokens=4, temperature=0)
        r2 = await c.responses.create(
            model=MODEL, input="left", max_output_tokens=4, previous_response_id=r1.id
        )
        sid = session_of(r1.id)[0]
        before = [e.hash for e in await live.runtime.log.read(sid)]
        r3 = await c.responses.create(
            model=MODEL, input="right", max_output_tokens=4, previous_response_id=r1.id
        )
        listed = await c.responses.input_items.list(r3.id)
    child = session_of(r3.id)[0]
    assert session_of(r2.id)[0] == sid and child != sid
    assert [e.hash for e in await live.runtime.log.read(sid)] == before  # the original is intact
    parent_st = await live.runtime.get(sid)
    child_st = await live.runtime.get(child)
    turn1 = await load_turn(live.runtime, sid, session_of(r1.id)[1], "responses")
    assert child_st.parent is not None and child_st.parent["session_id"] == sid
    assert child_st.parent["token_position"] == turn1.end
    assert list(child_st.tokens[: turn1.end]) == list(parent_st.tokens[: turn1.end])
    detok = live.runtime.engine.detokenize
    r1_text = detok(parent_st.tokens[: turn1.end])
    # the fork closes r1's turn and renders the new message after it, as continuing would
    assert detok(child_st.tokens).startswith(r1_text + "\n<|user|>\nright\n<|assistant|>\n")
    assert "left" not in detok(child_st.tokens)
    assert [it.content[0].text for it in listed.data] == ["right"]  # type: ignore[union-attr]


async def test_continuing_a_response_checks_the_session_not_a_remembered_turn(
    live: Served,
) -> None:
    """The server remembers each session's latest turn it drove, so continuing it needs no
    read of the log; but a session closed, or appended to, since that turn is forked from
    it as the log says, and the answer a POST gives is the one GET rebuilds from the log."""
    async with async_client(live) as c:
        r1 = await c.responses.create(model=MODEL, input="one", max_output_tokens=4, temperature=0)
        sid = session_of(r1.id)[0]
        r2 = await c.responses.create(
            model=MODEL, input="two", max_output_tokens=4, previous_response_id=r1.id
        )
        assert session_of(r2.id)[0] == sid  # continued
        assert (await c.responses.retrieve(r2.id)).model_dump() == r2.model_dump()
        await live.runtime.append_text(sid, "an append after r2")
        r3 = await c.responses.create(
            model=MODEL, input="three", max_output_tokens=4, previous_response_id=r2.id
        )
        forked = session_of(r3.id)[0]
        assert forked != sid and r3.model_extra is not None
        await live.runtime.close(forked)
        r4 = await c.responses.create(
            model=MODEL, input="four", max_output_tokens=4, previous_response_id=r3.id
        )
        assert session_of(r4.id)[0] not in (sid, forked)
        assert (await c.responses.retrieve(r4.id)).model_dump() == r4.model_dump()
    st = await live.runtime.get(sid)
    assert live.runtime.engine.detokenize(st.tokens).endswith("an append after r2")


async def test_stream_events_and_resume(live: Served) -> None:
    async with async_client(live) as c:
        stream = await c.responses.create(
            model=MODEL, input="stream me", max_output_tokens=12, stream=True, temperature=0
        )
        events = [e async for e in stream]
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    rid = events[0].response.id  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == deltas and deltas
    # resume: the same events after N, rebuilt from the log
    async with async_client(live) as c:
        resumed = [e async for e in await c.responses.retrieve(rid, stream=True, starting_after=3)]
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in events[4:]]


async def test_stream_helper_accumulates(eager: Served) -> None:
    async with async_client(eager) as c:
        async with c.responses.stream(model=MODEL, input="x", max_output_tokens=200) as s:
            async for _ in s:
                pass
            final = await s.get_final_response()
        assert final.status == "completed"
        assert final.output_text == (await c.responses.retrieve(final.id)).output_text
        chat = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=200
        )
        assert chat.choices[0].finish_reason == "stop"


async def test_background_resume_while_running_and_cancel(live: Served) -> None:
    async with async_client(live) as c:
        bg = await c.responses.create(
            model=MODEL, input="long", max_output_tokens=40, background=True, temperature=0
        )
        assert bg.status == "in_progress" and bg.background is True
        # follow it live from the start, drop the connection after a few events, resume from there
        cut = []
        async with await c.responses.retrieve(bg.id, stream=True) as s:
            async for e in s:
                cut.append(e)
                if len(cut) == 6:
                    break
        assert [e.sequence_number for e in cut] == list(range(6))
        rest = [e async for e in await c.responses.retrieve(bg.id, stream=True, starting_after=5)]
        assert rest[0].sequence_number == 6 and rest[-1].type in (
            "response.completed",
            "response.incomplete",
        )
        done = await c.responses.retrieve(bg.id)
        text = "".join(e.delta for e in cut + rest if e.type == "response.output_text.delta")  # type: ignore[union-attr]
        assert done.output_text == text
        # cancel: a finished one comes back as it is; a running one stops and says so
        assert (await c.responses.cancel(bg.id)).status == done.status
        slow = await c.responses.create(
            model=MODEL, input="slow", max_output_tokens=400, background=True
        )
        cancelled = await c.responses.cancel(slow.id)
        assert cancelled.status == "cancelled"
        assert (await c.responses.retrieve(slow.id)).status == "cancelled"
        fg = await c.responses.create(model=MODEL, input="fg", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError):
            await c.responses.cancel(fg.id)
    sid, _ = session_of(slow.id)
    st = await live.runtime.get(sid)
    assert [g.finish_reason for g in st.generations.values()] == ["cancelled"]


async def test_store_false_is_not_retrievable_and_closes(live: Served) -> None:
    async with async_client(live) as c:
        r = await c.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            await c.responses.create(model=MODEL, input="y", previous_response_id=r.id)
        with pytest.raises(openai.BadRequestError):
            await c.responses.create(model=MODEL, input="y", store=False, background=True)
    sid, _ = session_of(r.id)
    for _ in range(100):
        if (await live.runtime.get(sid)).status == "closed":
            break
        await asyncio.sleep(0.02)
    assert (await live.runtime.get(sid)).status == "closed"


async def test_chat_completions(live: Served) -> None:
    def run() -> Any:
        with sync_client(live) as c:
            return c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=6,
                seed=3,
                logprobs=True,
                top_logprobs=2,
            )

    r = await asyncio.to_thread(run)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs is not None and len(choice.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    sid = r.model_extra["session_id"]
    assert r.id.startswith(f"chatcmpl-{sid}_")
    st = await live.runtime.get(sid)
    [gen] = st.generations.values()
    # the text of the generated tokens, less a character they end in the middle of
    text = live.runtime.engine.detokenize(gen.tokens)
    assert choice.message.content == text.removesuffix("\ufffd")
    assert [t.logprob for t in choice.logprobs.content] == [
        e.body["logprob"]
        for e in await live.runtime.log.read(sid)
        if e.type == T.GENERATION_TOKEN and not e.body["is_prefill"]
    ]
    # continue the same session by id, without resending history
    length = len(st.tokens)
    async with async_client(live) as c:
        r2 = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "More"}],
            max_completion_tokens=4,
            extra_body={"session_id": sid},
        )
    assert r2.model_extra is not None and r2.model_extra["session_id"] == sid
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    assert r2.usage.prompt_tokens_details.cached_tokens == length
    assert len((await live.runtime.get(sid)).generations) == 2


async def test_chat_stream_with_usage(live: Served) -> None:
    async with async_client(live) as c:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Go"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
        )
        chunks = [ch async for ch in stream]
        plain = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Go"}], max_tokens=8, temperature=0
        )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    finishes = [
        ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason
    ]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens  # type: ignore[union-attr]


@pytest.fixture
async def fast(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    """The reference engine at full speed: tokens commit in runs of several."""
    async for s in _serve(sqlite_url, port, ReferenceEngine()):
        yield s


async def test_chat_stream_chunks_are_committed_runs(fast: Served) -> None:
    """A chunk carries every token that was ready when the stream got to it (its
    text and each token's logprob, in order): the stream adds up to the reply."""
    async with async_client(fast) as c:
        req: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "runs"}],
            "max_tokens": 300,
            "seed": 3,
            "logprobs": True,
            "top_logprobs": 2,
        }
        stream = await c.chat.completions.create(
            **req, stream=True, stream_options={"include_usage": True}
        )
        chunks = [ch async for ch in stream]
        plain = await c.chat.completions.create(**req)
    assert plain.usage is not None and chunks[-1].usage is not None
    n = plain.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens == n
    body = [ch for ch in chunks if ch.choices and ch.choices[0].logprobs]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    streamed = [
        (lp.token, lp.logprob, [t.token for t in lp.top_logprobs])
        for ch in body
        for lp in ch.choices[0].logprobs.content or []  # type: ignore[union-attr]
    ]
    assert plain.choices[0].logprobs is not None
    final = [
        (lp.token, lp.logprob, [t.token for t in lp.top_logprobs])
        for lp in plain.choices[0].logprobs.content or []
    ]
    assert streamed == final and len(final) == n
    assert 0 < len(body) <= n


async def test_chat_stop_string_cuts_the_text(live: Served) -> None:
    async with async_client(live) as c:
        full = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "s"}], max_tokens=30, seed=5
        )
        text = full.choices[0].message.content or ""
        stop = next((ch for ch in text[3:] if ch.isprintable() and ch != "\ufffd"), None)
        if stop is None:
            pytest.skip("no printable character to stop at")  # pragma: no cover
        cut = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "s"}],
            max_tokens=30,
            seed=5,
            stop=[stop],
        )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


async def test_chat_stream_with_a_stop_string_matches_the_plain_reply(live: Served) -> None:
    """Streamed, the text is cut at the same place and the usage counts every token the
    generation made, as the reply read back from the log does."""
    req: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "s"}],
        "max_tokens": 30,
        "seed": 5,
    }
    async with async_client(live) as c:
        text = (await c.chat.completions.create(**req)).choices[0].message.content or ""
        stop = next((ch for ch in text[3:] if ch.isprintable() and ch != "\ufffd"), None)
        if stop is None:
            pytest.skip("no printable character to stop at")  # pragma: no cover
        plain = await c.chat.completions.create(**req, stop=[stop])
        stream = await c.chat.completions.create(
            **req, stop=[stop], stream=True, stream_options={"include_usage": True}
        )
        chunks = [ch async for ch in stream]
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == plain.choices[0].message.content == text[: text.index(stop)]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and plain.usage is not None
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    # how many tokens were made past the stop depends on the runs' boundaries: the log says
    sid, _, version = chunks[-1].id.removeprefix("chatcmpl-").rpartition("_")
    logged = await load_turn(live.runtime, sid, int(version), "chat.completions")
    assert usage.completion_tokens == len(logged.tokens) >= len(streamed)


async def test_errors_have_openai_shape(live: Served) -> None:
    async with async_client(live) as c:
        with pytest.raises(openai.BadRequestError) as bad:
            await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], n=2
            )
        assert bad.value.param == "n" and bad.value.code == "invalid_parameters"
        with pytest.raises(openai.NotFoundError) as nf:
            await c.responses.retrieve("resp_s_nope_3")
        assert nf.value.code == "response_not_found"
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "x"}]
            )
    bad_key = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0)
    async with bad_key:
        with pytest.raises(openai.AuthenticationError) as auth:
            await bad_key.models.list()
    assert auth.value.body == {
        "message": "missing or wrong bearer token",
        "type": "authentication_error",
        "param": None,
        "code": "unauthenticated",
    }
    async with httpx.AsyncClient(
        base_url=live.url, headers={"Authorization": f"Bearer {TOKEN}"}
    ) as h:
        r = await h.post("/v1/responses", content=b"{nope")
        assert r.status_code == 400 and set(r.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
        r = await h.post("/v1/responses", json={"model": MODEL, "input": "x", "temperature": 3})
        assert r.json()["error"]["param"] == "temperature"
        r = await h.post(
            "/v1/responses",
            json={"model": MODEL, "input": "x", "text": {"format": {"type": "xml"}}},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.type"
        r = await h.post(
            "/v1/responses",
            json={"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema"}}},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format"
        bad_schema = {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}
        r = await h.post(
            "/v1/responses", json={"model": MODEL, "input": "x", "text": {"format": bad_schema}}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_constraint"
        r = await h.post(
            "/v1/responses", json={"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        bad_name = {"type": "function", "name": "no spaces", "parameters": {"type": "object"}}
        r = await h.post("/v1/responses", json={"model": MODEL, "input": "x", "tools": [bad_name]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_tool", r.text
        n_sessions = len((await h.get("/v1/sessions")).json()["sessions"])
        assert n_sessions == 0  # refused requests left nothing behind


async def test_stream_dropped_mid_way_cancels_foreground(live: Served) -> None:
    body = {"model": MODEL, "input": "x", "stream": True, "max_output_tokens": 400}
    rid = None
    async with (
        httpx.AsyncClient(base_url=live.url, headers={"Authorization": f"Bearer {TOKEN}"}) as h,
        h.stream("POST", "/v1/responses", json=body) as r,
    ):
        async for line in r.aiter_lines():
            if line.startswith("data: ") and rid is None:
                rid = json.loads(line[6:])["response"]["id"]
            if line.startswith("event: response.output_text.delta"):
                break
    assert rid is not None
    sid, _ = session_of(rid)
    for _ in range(200):
        st = await live.runtime.get(sid)
        if st.active_generation is None:
            break
        await asyncio.sleep(0.02)
    [gen] = (await live.runtime.get(sid)).generations.values()
    assert gen.finish_reason == "cancelled" and len(gen.tokens) < 400


async def test_sync_streams(live: Served) -> None:
    def run() -> tuple[list[Any], list[Any], Any]:
        with sync_client(live) as c:
            events = list(
                c.responses.create(model=MODEL, input="sync", max_output_tokens=5, stream=True)
            )
            chunks = list(
                c.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "sync"}],
                    max_tokens=5,
                    stream=True,
                    temperature=0,
                )
            )
            plain = c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "sync"}],
                max_tokens=5,
                temperature=0,
            )
            return events, chunks, plain

    events, chunks, plain = await asyncio.to_thread(run)
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in chunks)
        == plain.choices[0].message.content
    )


async def test_chat_session_id_must_exist_and_be_open(live: Served) -> None:
    async with async_client(live) as c:
        with pytest.raises(openai.NotFoundError) as nf:
            await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                extra_body={"session_id": "s_missing"},
            )
        assert nf.value.code == "session_not_found"
        r = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        sid = r.model_extra["session_id"]  # type: ignore[index]
        await live.runtime.close(sid)
        with pytest.raises(openai.ConflictError) as closed:
            await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                extra_body={"session_id": sid},
            )
        assert closed.value.code == "session_closed"


async def test_input_items_pages_and_running_response(live: Served) -> None:
    items = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": [{"type": "input_text", "text": "c"}]},
    ]
    async with async_client(live) as c:
        r = await c.responses.create(
            model=MODEL, input=items, max_output_tokens=200, background=True
        )  # type: ignore[arg-type]
        running = await c.responses.retrieve(r.id)
        assert running.status == "in_progress" and running.usage is None
        desc = await c.responses.input_items.list(r.id)
        asc = await c.responses.input_items.list(r.id, order="asc", limit=2)
        after = await c.responses.input_items.list(r.id, order="asc", after=asc.data[-1].id)
        await c.responses.cancel(r.id)
    texts = [it.content[0].text for it in desc.data]  # type: ignore[union-attr]
    assert texts == ["c", "b", "a", "sys"]
    assert [it.content[0].text for it in asc.data] == ["sys", "a"] and asc.has_more  # type: ignore[union-attr]
    assert [it.content[0].text for it in after.data] == ["b", "c"] and not after.has_more  # type: ignore[union-attr]
    assert [it.role for it in desc.data] == ["user", "assistant", "user", "system"]  # type: ignore[union-attr]


async def test_response_logprobs(live: Served) -> None:
    async with async_client(live) as c:
        r = await c.responses.create(
            model=MODEL,
            input="lp",
            max_output_tokens=6,
            top_logprobs=3,
            include=["message.output_text.logprobs"],
        )
        events = [e async for e in await c.responses.retrieve(r.id, stream=True)]
        plain = await c.responses.create(model=MODEL, input="lp", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError):
            await c.responses.create(
                model=MODEL, input="lp", include=["reasoning.encrypted_content"]
            )
    content = r.output[0].content[0]  # type: ignore[union-attr]
    sid, _ = session_of(r.id)
    logged = [e.body for e in await live.runtime.log.read(sid) if e.type == T.GENERATION_TOKEN]
    assert [lp.logprob for lp in content.logprobs] == [b["logprob"] for b in logged]  # type: ignore[union-attr]
    assert all(len(lp.top_logprobs) == 3 for lp in content.logprobs)  # type: ignore[union-attr]
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]  # type: ignore[union-attr]
    assert [x.logprob for x in streamed] == [b["logprob"] for b in logged]
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]


async def test_a_response_left_running_by_a_stopped_process_can_be_continued(live: Served) -> None:
    """The log a process leaves when it dies mid-generation: started, two tokens, no finish."""
    from sessiontape.core.engine.interface import SamplingParams
    from sessiontape.core.events import NewEvent

    rt = live.runtime
    sid = "s_orphan"
    prompt = rt.engine.tokenize(
        ROLE_MARKERS.render([("user", "hi")], at_start=True, after_generation=False)
    )
    request = {
        "model": MODEL,
        "input": [{"role": "user", "content": "hi"}],
        "store": True,
        "background": True,
        "stop": list(ROLE_MARKERS.stop),
        "template": ROLE_MARKERS.to_json(),
    }
    gen = {
        "generation_id": "g_1",
        "params": SamplingParams(max_tokens=50, seed=1).to_json(),
        "prompt_length": len(prompt),
        "priority": 0,
        "action_id": None,
        "options": {},
    }
    opened = {
        "protocol": "openai",
        "mode": "offset",
        "label": "",
        "eos_token_ids": [257],
        "ttl_s": 1800.0,
        "engine": rt.engine.info.provenance(),
        "meta": {},
        "parent": None,
    }
    await rt.log.append(
        sid,
        0,
        [
            NewEvent(T.SESSION_OPENED, opened),
            NewEvent(T.TOKENS_APPENDED, {"start": 0, "tokens": prompt, "images": []}),
            NewEvent(T.GENERATION_STARTED, gen),
            NewEvent(
                T.WIRE,
                {
                    "transport": "openai",
                    "direction": "in",
                    "payload": {
                        "api": "responses",
                        "generation_id": "g_1",
                        "version": 3,
                        "appended": len(prompt),
                        "request": request,
                    },
                },
            ),
            *[
                NewEvent(
                    T.GENERATION_TOKEN,
                    {
                        "generation_id": "g_1",
                        "token": 65 + i,
                        "position": len(prompt) + i,
                        "is_prefill": False,
                        "t": 0.0,
                        "logprob": -1.0,
                    },
                )
                for i in range(2)
            ],
        ],
    )
    rid = f"resp_{sid}_3"
    async with async_client(live) as c:
        before = await c.responses.retrieve(rid)
        assert before.status == "in_progress" and before.output_text == "AB"
        nxt = await c.responses.create(
            model=MODEL, input="again", max_output_tokens=3, previous_response_id=rid
        )
        after = await c.responses.retrieve(rid)
    assert session_of(nxt.id)[0] == sid  # continued, not forked
    assert after.status == "failed" and after.output_text == "AB"
    assert (await rt.get(sid)).generations["g_1"].finish_reason == "interrupted"


async def test_seed_is_an_integer_in_every_reply(live: Served) -> None:
    """A response's and a chat completion's ``seed`` (an extension: the one given, or the one
    drawn and recorded) is a JSON integer, exact above 2**53; the wire record keeps the stored
    format, a string of digits."""
    big = 2**63 - 1
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=live.url, headers=auth, timeout=20) as h:
        r = await h.post(
            "/v1/responses",
            json={"model": MODEL, "input": "s", "max_output_tokens": 2, "seed": big},
        )
        assert r.status_code == 200, r.text
        assert f'"seed": {big}' in r.text or f'"seed":{big}' in r.text
        assert type(r.json()["seed"]) is int and r.json()["seed"] == big
        again = (await h.get(f"/v1/responses/{r.json()['id']}")).json()
        assert again["seed"] == big
        async with h.stream(
            "POST",
            "/v1/responses",
            json={
                "model": MODEL,
                "input": "s",
                "max_output_tokens": 2,
                "seed": big,
                "stream": True,
            },
        ) as s:
            events = [
                json.loads(line[6:]) async for line in s.aiter_lines() if line.startswith("data: ")
            ]
        assert {e["response"]["seed"] for e in events if "response" in e} == {big}
        c = await h.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "s"}],
                "max_tokens": 2,
                "seed": big,
            },
        )
        assert c.status_code == 200, c.text
        assert type(c.json()["seed"]) is int and c.json()["seed"] == big
        async with h.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "s"}],
                "max_tokens": 2,
                "seed": big,
                "stream": True,
            },
        ) as s:
            chunks = [
                json.loads(line[6:]) async for line in s.aiter_lines() if line.startswith("data: {")
            ]
        assert chunks and {ch["seed"] for ch in chunks} == {big}
    # without a seed, the drawn one is shown (an integer) and re-running with it repeats the text
    async with async_client(live) as oai:
        drawn = await oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "d"}], max_tokens=6
        )
        seed = (drawn.model_extra or {})["seed"]
        assert type(seed) is int
        twice = await oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "d"}], max_tokens=6, seed=seed
        )
        resp = await oai.responses.create(model=MODEL, input="d", max_output_tokens=3)
    assert twice.choices[0].message.content == drawn.choices[0].message.content
    assert type((resp.model_extra or {})["seed"]) is int
    sid, version = session_of(r.json()["id"])
    turn = await load_turn(live.runtime, sid, version, "responses")
    assert turn.request["seed"] == str(big)


async def test_unknown_fields_are_refused_not_ignored(live: Served) -> None:
    """Unknown request fields are refused, not ignored: on these routes a field that neither
    OpenAI's API nor this server knows is 400 ``unknown_field`` naming it (as OpenAI answers), and
    nothing is written; OpenAI fields that change nothing here (``user``, ``service_tier`` ...) are
    taken."""
    async with async_client(live) as c:
        with pytest.raises(openai.BadRequestError) as typo:
            await c.responses.create(
                model=MODEL, input="x", max_output_tokens=2, extra_body={"temprature": 0.5}
            )
        assert typo.value.code == "unknown_field" and typo.value.param == "temprature"
        assert "temprature" in typo.value.message
        with pytest.raises(openai.BadRequestError) as chat_typo:
            await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                extra_body={"max_token": 2, "sesion_id": "s_1"},
            )
        assert chat_typo.value.code == "unknown_field"
        assert chat_typo.value.param == "max_token" and "sesion_id" in chat_typo.value.message
        with pytest.raises(openai.BadRequestError) as trunc:
            await c.responses.create(model=MODEL, input="x", truncation="auto")
        assert trunc.value.param == "truncation"
        with pytest.raises(openai.BadRequestError) as modal:
            await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], modalities=["audio"]
            )
        assert modal.value.param == "modalities"
        sessions = await live.runtime.reads.list_sessions()
        assert sessions == []  # refused requests wrote nothing
        ok = await c.responses.create(
            model=MODEL,
            input="x",
            max_output_tokens=2,
            user="u-1",
            service_tier="auto",
            truncation="disabled",
            parallel_tool_calls=False,
            tool_choice="none",
            extra_body={"verbosity": None},  # null asks for nothing
        )
        chat = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            user="u-1",
            store=True,
            modalities=["text"],
            service_tier="auto",
        )
    assert ok.status in ("completed", "incomplete") and chat.choices[0].message.role == "assistant"


async def test_a_response_replays_audits_and_exports_like_any_session(live: Served) -> None:
    """A response's id names a log position: its session exports, audits and replays with the native
    client and the replay renderer, and the log holds the sampling fields the request gave."""
    import io

    from sessiontape import AsyncClient
    from sessiontape.core.replay import replay

    async with async_client(live) as c:
        r = await c.responses.create(
            model=MODEL,
            input="Once",
            max_output_tokens=5,
            temperature=0.7,
            top_p=0.9,
            extra_body={"seed": 11},
        )
        chat = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Once"}],
            max_completion_tokens=4,
            temperature=0.3,
            top_p=0.8,
            seed=12,
        )
    assert r.temperature == 0.7 and r.top_p == 0.9
    sid, version = session_of(r.id)
    async with AsyncClient(live.url, token=TOKEN) as st:
        events = await st.export(sid)
        audit = await st.audit(sid)
        chat_events = await st.export(chat.model_extra["session_id"])  # type: ignore[index]
    assert audit["ok"] is True
    [started] = [e for e in events if e["version"] == version]
    assert started["type"] == "generation.started"
    assert {k: started["body"]["params"][k] for k in ("max_tokens", "temperature", "top_p")} == {
        "max_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
    }
    assert started["body"]["params"]["seed"] == "11"  # the stored format: digits
    [chat_started] = [e for e in chat_events if e["type"] == "generation.started"]
    assert chat_started["body"]["params"]["top_p"] == 0.8
    assert chat_started["body"]["params"]["temperature"] == 0.3
    assert chat_started["body"]["params"]["max_tokens"] == 4
    out = io.StringIO()
    assert await replay(await live.runtime.log.read(sid), out, instant=True) > 0
    assert r.output_text.strip() and r.output_text.strip()[:3] in out.getvalue()


async def test_chat_stream_dropped_mid_way_cancels(live: Served) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "max_tokens": 400,
    }
    sid = None
    async with (
        httpx.AsyncClient(base_url=live.url, headers={"Authorization": f"Bearer {TOKEN}"}) as h,
        h.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                sid = chunk["session_id"]
                if chunk["choices"][0]["delta"].get("content"):
                    break
    assert sid is not None
    for _ in range(200):
        if (await live.runtime.get(sid)).active_generation is None:
            break
        await asyncio.sleep(0.02)
    [gen] = (await live.runtime.get(sid)).generations.values()
    assert gen.finish_reason == "cancelled" and len(gen.tokens) < 400


async def test_streamed_logprobs_include_a_closing_eos(eager: Served) -> None:
    """A reply that ends with EOS (a token with no text): its logprob is streamed too, so the
    stream's logprobs are the response's."""
    async with async_client(eager) as c:
        for seed in range(1, 6):
            r = await c.responses.create(
                model=MODEL,
                input="lp",
                max_output_tokens=200,
                top_logprobs=1,
                include=["message.output_text.logprobs"],
                extra_body={"seed": seed},
            )
            assert r.status == "completed"  # EOS ended it
            events = [e async for e in await c.responses.retrieve(r.id, stream=True)]
            streamed = [
                lp.logprob
                for e in events
                if e.type == "response.output_text.delta"
                for lp in e.logprobs  # type: ignore[union-attr]
            ]
            final = [lp.logprob for lp in r.output[0].content[0].logprobs]  # type: ignore[union-attr]
            assert streamed == final and len(final) == r.usage.output_tokens  # type: ignore[union-attr]
