"""Property tests: random valid command sequences replay to the live state;
random invalid commands leave the log unchanged."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessiontape.core.engine.interface import SamplingParams
from sessiontape.core.errors import SessiontapeError
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.log.store import verify_chain
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from tests.helpers.config import make_config

token = st.integers(min_value=0, max_value=258)
bad_token = st.one_of(st.integers(max_value=-1), st.integers(min_value=259, max_value=10**6))

ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(token, min_size=1, max_size=6)),
        st.tuples(
            st.just("rewind"), st.integers(min_value=0, max_value=20), st.lists(token, max_size=3)
        ),
        st.tuples(
            st.just("generate"), st.integers(min_value=0, max_value=4), st.integers(0, 2**64 - 1)
        ),
        st.tuples(st.just("feedback"), st.integers(min_value=0, max_value=9)),
        st.tuples(st.just("fragment"), st.sampled_from("abc"), st.integers(0, 2), st.booleans()),
    ),
    max_size=12,
)

SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def snapshot(s: Any) -> tuple[Any, ...]:
    return (
        s.version,
        s.head_hash,
        list(s.tokens),
        s.status,
        len(s.generations),
        [(g.tokens, g.finish_reason) for g in s.generations.values()],
        s.feedback,
        {k: (n.kind, sorted(n.fragments), n.final_seq) for k, n in s.nodes.items()},
        s.truncations,
    )


async def run_ops(rt: Runtime, sid: str, program: list[tuple[Any, ...]]) -> None:
    from sessiontape.core.nodes import FragmentIn

    for op in program:
        try:
            if op[0] == "append":
                await rt.append_tokens(sid, op[1])
            elif op[0] == "rewind":
                st_ = await rt.get(sid)
                await rt.append_tokens(sid, op[2], offset=min(op[1], st_.length), truncating=True)
            elif op[0] == "generate":
                async for _ in rt.generate(
                    sid, GenerateRequest(SamplingParams(max_tokens=op[1], seed=op[2]))
                ):
                    pass
            elif op[0] == "feedback":
                await rt.record_feedback(sid, {"score": op[1]})
            else:
                await rt.nodes.append_fragments(
                    sid,
                    [
                        FragmentIn(
                            id=op[1],
                            seq=op[2],
                            continued=op[3],
                            has_chunk=True,
                            data=b"x",
                            metadata={"mimetype": "text/plain"} if op[2] == 0 else None,
                        )
                    ],
                )
        except SessiontapeError:
            pass  # rule violations are part of the program; they must change nothing


@given(program=ops)
@SETTINGS
def test_replay_equals_live_state(tmp_path: Path, program: list[tuple[Any, ...]]) -> None:
    async def main() -> None:
        db = tmp_path / f"p{abs(hash(str(program)))}.db"
        rt = await Runtime.create(
            make_config(f"sqlite+aiosqlite:///{db}"), engine=ReferenceEngine()
        )
        try:
            sid = (await rt.open_session("prop")).session_id
            await run_ops(rt, sid, program)
            live = await rt.get(sid)
            replayed = await rt.sessions.load(sid)
            assert snapshot(replayed) == snapshot(live)
            verify_chain(await rt.log.read(sid))
        finally:
            await rt.aclose()

    asyncio.run(main())


bad_ops = st.one_of(
    st.tuples(st.just("vocab"), st.lists(token, max_size=3), bad_token),
    st.tuples(st.just("offset"), st.integers(min_value=1, max_value=50)),
    st.tuples(st.just("meta"), st.integers(min_value=1, max_value=5)),
    st.tuples(st.just("range"), st.integers(0, 40), st.integers(0, 40)),
    st.tuples(st.just("params"), st.floats(max_value=-0.001, allow_nan=False)),
)


@given(
    prefix=st.lists(token, min_size=0, max_size=8), bad=st.lists(bad_ops, min_size=1, max_size=5)
)
@SETTINGS
def test_invalid_inputs_leave_the_log_unchanged(
    tmp_path: Path, prefix: list[int], bad: list[tuple[Any, ...]]
) -> None:
    from sessiontape.core.engine.interface import OutputOptions
    from sessiontape.core.nodes import FragmentIn

    async def main() -> None:
        db = tmp_path / f"b{abs(hash(str((prefix, bad))))}.db"
        rt = await Runtime.create(
            make_config(f"sqlite+aiosqlite:///{db}"), engine=ReferenceEngine()
        )
        try:
            sid = (await rt.open_session("prop")).session_id
            if prefix:
                await rt.append_tokens(sid, prefix)
            before = [e.to_json() for e in await rt.log.read(sid)]
            n = len(prefix)
            for op in bad:
                try:
                    if op[0] == "vocab":
                        await rt.append_tokens(sid, [*op[1], op[2]])
                    elif op[0] == "offset":
                        await rt.append_tokens(sid, [1], offset=n + op[1], truncating=True)
                    elif op[0] == "meta":
                        await rt.nodes.append_fragments(
                            sid,
                            [
                                FragmentIn(
                                    id="n",
                                    seq=op[1],
                                    has_chunk=True,
                                    data=b"x",
                                    metadata={"mimetype": "text/plain"},
                                )
                            ],
                        )
                    elif op[0] == "range":
                        a, b = op[1], op[2]
                        if a < b <= n:
                            a, b = b, a  # make it invalid: empty or reversed
                        async for _ in rt.generate(
                            sid,
                            GenerateRequest(
                                SamplingParams(max_tokens=0),
                                OutputOptions(logprob_ranges=((a, b + n + 1 if a < b else b),)),
                            ),
                        ):
                            pass
                    else:
                        async for _ in rt.generate(
                            sid, GenerateRequest(SamplingParams(max_tokens=1, temperature=op[1]))
                        ):
                            pass
                except SessiontapeError:
                    continue
                raise AssertionError(f"{op} was accepted")
            assert [e.to_json() for e in await rt.log.read(sid)] == before
            assert list((await rt.get(sid)).tokens) == prefix
        finally:
            await rt.aclose()

    asyncio.run(main())
