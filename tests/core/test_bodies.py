"""The body types (core/bodies.py) against the documentation and against what the
runtime really writes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from sessiontape.core.bodies import BODIES, GenerationToken, SessionClosed, body
from sessiontape.core.engine.interface import OutputOptions, SamplingParams
from sessiontape.core.events import T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.runtime import Runtime
from sessiontape.core.tokens import ImageIn
from sessiontape.engines.reference import IMAGE_PAD

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
    from sessiontape.core.events import Event

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
            GenerateRequest(
                SamplingParams(max_tokens=4, seed=1),
                OutputOptions(logprob_top_k=2, logprob_ranges=((1, 3),), readout_ranges=((0, 10),)),
                append=[33],
                offset=12,
                truncating=True,
            ),
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


# -- no event body is read by string key outside core/bodies.py ---------------------------

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("core", "transports", "sessiontape")
#: the event types' own module (generated gRPC stubs are not ours)
EXEMPT = {Path("core/bodies.py")}
#: what a key read looks like once a body is in hand
_KEY_METHODS = {"get", "setdefault", "pop", "keys", "items", "values", "__getitem__"}


def _is_body(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "body"


def untyped_body_reads(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each untyped read of an attribute named ``body``.

    The rule: outside core/bodies.py, an event's body leaves its event only
    whole (passed on, copied with ``dict()``, spread with ``**``, hashed,
    stored, exported). These are refused, whatever the object: subscripting
    ``x.body[...]`` (read or write), calling a mapping method on it
    (``x.body.get(...)``, ``.items()``, ...), testing a key with
    ``k in x.body``, and binding it to a name (``b = x.body``, which is how an
    untyped read hides behind an alias). A typed read goes through
    ``sessiontape.core.bodies`` instead: ``body(e, Kind)[...]`` or one of its readers.
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and _is_body(node.value):
            found.append((node.lineno, "subscript of .body"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _KEY_METHODS
            and _is_body(node.func.value)
        ):
            found.append((node.lineno, f".body.{node.func.attr}()"))
        elif isinstance(node, ast.Compare) and any(
            isinstance(op, (ast.In, ast.NotIn)) and _is_body(right)
            for op, right in zip(node.ops, node.comparators, strict=True)
        ):
            found.append((node.lineno, "key test on .body"))
        elif (
            isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr))
            and node.value is not None
            and _is_body(node.value)
        ):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) for t in targets):
                found.append((node.lineno, "alias of .body"))
    return sorted(found)


def source_files() -> list[Path]:
    files = []
    for d in SOURCE_DIRS:
        for p in sorted((ROOT / d).rglob("*.py")):
            rel = p.relative_to(ROOT)
            if rel in EXEMPT or rel.parts[:3] == ("transports", "grpc", "gen"):
                continue
            files.append(p)
    return files


def test_no_event_body_is_read_by_string_key_outside_the_event_types() -> None:
    files = source_files()
    assert len(files) > 50, "the walk found too few source files"
    bad = [
        f"{p.relative_to(ROOT)}:{line}: {what}"
        for p in files
        for line, what in untyped_body_reads(p.read_text())
    ]
    assert not bad, (
        "untyped event body reads (use sessiontape.core.bodies.body(e, Kind)):\n" + "\n".join(bad)
    )


@pytest.mark.parametrize(
    "snippet",
    [
        "x = e.body['token']",
        "x = ev.body.get('token', 0)",
        "e.body['k'] = 1",
        "ok = 'token' in e.body",
        "ok = 'token' not in self.started.body",
        "b = e.body",
        "b: dict = e.body",
        "if (b := e.body): pass",
        "for k, v in e.body.items(): pass",
    ],
)
def test_the_rule_catches_each_form(snippet: str) -> None:
    assert untyped_body_reads(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "x = body(e, GenerationToken)['token']",
        "x = generated_token(e)",
        "h = canonical_json(e.body)",
        "d = {**dict(e.body), 'at': 1}",
        "n = length_after(n, e.type, e.body)",
        "self.body = body",
        "x = body.get('error')",  # a local name, not an event's body
    ],
)
def test_the_rule_allows_whole_bodies_and_typed_reads(snippet: str) -> None:
    assert not untyped_body_reads(snippet), snippet
