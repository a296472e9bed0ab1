"""An answer cut off in the middle of a multi-byte character (its token limit reached
after the first bytes of an emoji) never ends in U+FFFD: the OpenAI routes, streamed and
not, and the session document hold the incomplete bytes back, and the log keeps them.

The reference engine's tokens are bytes, so answers drawn with a seed end mid-character
often; the test looks for seeds whose answers do, and checks every view of each."""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from sessiontape.engines.reference import ReferenceEngine
from tests.helpers.http import Served, serving

MODEL = "reference-bigram-v1"
#: seeds looked at; a few of their answers end mid-character
SEEDS = range(40)


@pytest.fixture
async def live(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    async with serving(sqlite_url, port, engine=ReferenceEngine(eos_bias=-100.0)) as s:
        yield s


def cut_tail(data: bytes) -> int:
    """How many bytes at the end of ``data`` begin a UTF-8 character they do not finish
    (what Python's incremental decoder holds back)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data)
    return len(decoder.getstate()[0])


def test_cut_tail_finds_a_started_character() -> None:
    star = "🌟".encode()
    assert [cut_tail(b"ab" + star[:i]) for i in range(5)] == [0, 1, 2, 3, 0]
    assert cut_tail("é".encode()[:1]) == 1 and cut_tail(b"\xff") == 0
    assert cut_tail(b"\xf0\x80") == 0  # no character starts so: two invalid bytes


async def test_an_answer_cut_mid_character_holds_the_bytes_back(live: Served) -> None:
    cut = 0
    async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0) as c:
        for seed in SEEDS:
            kw = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "🌟🌟🌟"}],
                "max_tokens": 7,
                "seed": seed,
                "temperature": 1.0,
            }
            r = await c.chat.completions.create(**kw)  # type: ignore[call-overload]
            sid = (r.model_extra or {})["session_id"]
            [gen] = (await live.runtime.get(sid)).generations.values()
            data = bytes(t for t in gen.tokens if t < 256)
            tail = cut_tail(data)
            if not tail:
                continue
            cut += 1
            # the text of every byte before the cut (random bytes: U+FFFD for invalid
            # ones among them), never a U+FFFD for the cut character
            whole = data[:-tail].decode("utf-8", "replace")
            text = r.choices[0].message.content or ""
            assert text == whole and r.choices[0].finish_reason == "length"
            stream = await c.chat.completions.create(**kw, stream=True)  # type: ignore[call-overload]
            assert (
                "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
                == whole
            )
            reply = await c.responses.create(
                model=MODEL, input="🌟🌟🌟", max_output_tokens=7, temperature=1.0,
                extra_body={"seed": seed},
            )  # fmt: skip
            rsid = (reply.model_extra or {}).get("session_id") or reply.id.split("_", 1)[1].rsplit(
                "_", 1
            )[0]
            [rgen] = (await live.runtime.get(rsid)).generations.values()
            assert rgen.tokens == gen.tokens  # the same prompt, seed and sampling
            assert reply.output_text == whole
            async with httpx.AsyncClient(base_url=live.url) as h:
                doc = (await h.get(f"/v1/sessions/{sid}")).json()
            [g] = doc["generations"]
            assert g["text"] == whole
            # the log keeps every byte
            assert [t["id"] for t in g["tokens"]] == gen.tokens
    assert cut >= 2, "no seed's answer ended mid-character: widen SEEDS"
