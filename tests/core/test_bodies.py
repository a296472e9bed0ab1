"""The body types (core/bodies.py) against the documentation and against what the
runtime really writes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.bodies import BODIES, GenerationToken, SessionClosed, body
from core.engine import OutputOptions, SamplingParams
from core.events import T
from core.runtime import Runtime
from core.tokens import ImageIn
from engines.reference import IMAGE_PAD

DOC = Path(__file__).resolve().parents[2] / "docs" / "events.md"


def keys(kind: type) -> tuple[frozenset[str], frozenset[str]]:
    return kind.__required_keys__, kind.__optional_keys__  # type: ignore[attr-defined]


def documented() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| `([a-z]+\.[a-z]+)` \| (.*?) \|", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_every_type_is_documented_with_its_fields_and_nothing_else_is() -> None:
    rows = documented()
    assert set(rows) == set(BODIES), "docs/events.md and core/bodies.py list different event types"
    for name, kind in BODIES.items():
        required, optional = keys(kind)
        named = set(re.findall(r"`([a-z_0-9]+)`", rows[name]))
        missing = (required | optional) - named
        assert not missing, f"docs/events.md does not describe {sorted(missing)} of {name}"


def test_every_registered_name_is_an_event_type() -> None:
    names = {v for k, v in vars(T).items() if not k.startswith("_")}
    assert set(BODIES) == names


def test_body_refuses_the_wrong_type(runtime: Runtime) -> None:
    from core.events import Event

    e = Event(1, "s", 1, T.SESSION_CLOSED, {"reason": "client"}, None, 0.0, "h", "p")
    assert body(e, SessionClosed)["reason"] == "client"
    with pytest.raises(TypeError):
        body(e, GenerationToken)


async def test_what_the_runtime_writes_has_the_declared_shape(runtime: Runtime) -> None:
    """A session exercising every path: each body has its type's required keys and no
    undeclared ones (free-form bodies excepted)."""
    rt = runtime
    sid = (await rt.open_session("http", label="shape", meta={"k": 1})).session_id
    block = [1, *([IMAGE_PAD] * 8), 2]
    await rt.append_tokens(
        sid, [72, 105, *block], images=[ImageIn(b"\x89PNG" + bytes(64), "image/png", 2, 12)]
    )
    evs = [
        e
        async for e in rt.generate(
            sid,
            SamplingParams(max_tokens=4, seed=1),
            OutputOptions(logprob_top_k=2, logprob_ranges=((1, 3),), readout_ranges=((0, 10),)),
            append=[33],
            offset=12,
            truncating=True,
        )
    ]
    assert evs[-1].type == T.GENERATION_FINISHED
    await rt.append_tokens(sid, [], offset=13, truncating=True)
    child = (await rt.fork(sid, at_position=12)).session_id
    await rt.record_feedback(sid, {"score": 7, "source": "test"})
    await rt.record_error(sid, "oops", "a recorded error")
    await rt.record_wire(sid, "http", "in", {"x": 1})
    await rt.abort(child, "protocol_violation", "test")
    await rt.close(sid)
    seen: set[str] = set()
    for s in (sid, child):
        for e in await rt.log.read(s):
            seen.add(e.type)
            required, optional = keys(BODIES[e.type])
            if e.type in (T.FEEDBACK, T.NOTE):
                continue
            assert required <= set(e.body), (e.type, sorted(required - set(e.body)))
            assert set(e.body) <= required | optional, (
                e.type,
                sorted(set(e.body) - required - optional),
            )
    assert {
        T.SESSION_OPENED,
        T.TOKENS_APPENDED,
        T.IMAGE_ATTACHED,
        T.TOKENS_TRUNCATED,
        T.GENERATION_STARTED,
        T.GENERATION_TOKEN,
        T.GENERATION_FINISHED,
        T.FEEDBACK,
        T.ERROR,
        T.WIRE,
        T.SESSION_ABORTED,
        T.SESSION_CLOSED,
    } <= seen
