"""Evergreen node-DAG rules in the core session model (shared by every transport)."""

from __future__ import annotations

from collections.abc import Awaitable

import pytest

from sessiontape.core.errors import InvalidAction, InvalidFragment, NodeNotFound, ProtocolViolation
from sessiontape.core.nodes import FragmentIn, flatten, is_complete, missing
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from tests.helpers.config import make_config


def leaf(
    id: str, seq: int = 0, data: bytes = b"x", continued: bool = False, meta: bool | None = None
) -> FragmentIn:
    return FragmentIn(
        id=id,
        seq=seq,
        continued=continued,
        has_chunk=True,
        data=data,
        metadata={"mimetype": "text/plain", "role": "user"}
        if (meta if meta is not None else seq == 0)
        else None,
    )


def parent(id: str, children: tuple[str, ...], seq: int = 0, continued: bool = False) -> FragmentIn:
    return FragmentIn(id=id, seq=seq, continued=continued, child_ids=children)


async def new(rt: Runtime) -> str:
    return (await rt.open_session("evergreen")).session_id


async def assert_unchanged(rt: Runtime, sid: str, version: int) -> None:
    assert (await rt.get(sid)).version == version
    assert (await rt.sessions.load(sid)).version == version
    assert (await rt.log.get_session(sid)).version == version


async def test_leaf_bytes_concatenate_in_seq_order_and_duplicates_first_win(
    runtime: Runtime,
) -> None:
    sid = await new(runtime)
    kept = await runtime.nodes.append_fragments(
        sid, [leaf("a", 1, b" world", continued=True), leaf("a", 0, b"Hello", continued=True)]
    )
    assert kept == [True, True]
    assert not is_complete(await runtime.get(sid), "a")
    assert await runtime.nodes.append_fragments(
        sid, [leaf("a", 0, b"IGNORED", continued=True)]
    ) == [False]
    await runtime.nodes.append_fragments(sid, [leaf("a", 2, b"!")])
    st = await runtime.get(sid)
    assert is_complete(st, "a")
    [chunk] = flatten(st, "a")
    assert chunk.data == b"Hello world!" and chunk.mimetype == "text/plain"
    assert flatten(await runtime.sessions.load(sid), "a") == [chunk]


@pytest.mark.parametrize(
    ("frags", "error"),
    [
        (
            [leaf("a", 0, continued=True), leaf("a", 1, meta=True)],
            ProtocolViolation,
        ),  # metadata past seq 0
        ([leaf("a", 0)], None),
        ([leaf("a", 0), leaf("a", 1)], ProtocolViolation),  # after the final fragment
        (
            [leaf("a", 0, continued=True), parent("a", ("b",), seq=1)],
            ProtocolViolation,
        ),  # leaf then parent
        ([FragmentIn(id="a", has_chunk=True, child_ids=("b",))], ProtocolViolation),  # both at once
        ([FragmentIn(id="", has_chunk=True, data=b"x")], InvalidFragment),
        ([FragmentIn(id="a", has_chunk=True, ref="not a uri")], InvalidFragment),
        (
            [FragmentIn(id="a", has_chunk=True, ref="https://example.org/x", data=b"x")],
            InvalidFragment,
        ),
    ],
)
async def test_fragment_rules(
    runtime: Runtime, frags: list[FragmentIn], error: type[Exception] | None
) -> None:
    sid = await new(runtime)
    before = (await runtime.get(sid)).version
    if error is None:
        await runtime.nodes.append_fragments(sid, frags)
        return
    with pytest.raises(error):
        for f in frags:
            await runtime.nodes.append_fragments(sid, [f])
    # the failing fragment changed nothing (earlier valid ones may have been recorded)
    st = await runtime.get(sid)
    assert st.version <= before + len(frags) - 1
    await assert_unchanged(runtime, sid, st.version)


async def test_batch_is_all_or_nothing(runtime: Runtime) -> None:
    sid = await new(runtime)
    with pytest.raises(ProtocolViolation):
        await runtime.nodes.append_fragments(sid, [leaf("a", 0), leaf("a", 1)])
    await assert_unchanged(runtime, sid, 1)
    assert (await runtime.get(sid)).nodes == {}


async def test_children_may_arrive_later_and_flatten_in_order(runtime: Runtime) -> None:
    sid = await new(runtime)
    await runtime.nodes.append_fragments(sid, [parent("root", ("p1", "c3"))])
    st = await runtime.get(sid)
    assert missing(st, "root") == ["c3", "p1"]
    await runtime.nodes.append_fragments(
        sid, [parent("p1", ("c1", "c2")), leaf("c2", data=b"2"), leaf("c1", data=b"1")]
    )
    assert not is_complete(await runtime.get(sid), "root")
    await runtime.nodes.append_fragments(
        sid,
        [
            FragmentIn(
                id="c3",
                has_chunk=True,
                ref="gs://bucket/img.png",
                metadata={"mimetype": "image/png"},
            )
        ],
    )
    st = await runtime.get(sid)
    assert is_complete(st, "root")
    chunks = flatten(st, "root")
    assert [(c.node_id, c.data, c.ref) for c in chunks] == [
        ("c1", b"1", None),
        ("c2", b"2", None),
        ("c3", None, "gs://bucket/img.png"),
    ]
    with pytest.raises(NodeNotFound):
        flatten(st, "nope")


async def test_cycles_and_depth_abort(runtime: Runtime) -> None:
    sid = await new(runtime)
    await runtime.nodes.append_fragments(sid, [parent("a", ("b",)), parent("b", ("c",))])
    with pytest.raises(ProtocolViolation, match="cycle"):
        await runtime.nodes.append_fragments(sid, [parent("c", ("a",))])
    with pytest.raises(ProtocolViolation, match="cycle"):
        await runtime.nodes.append_fragments(sid, [parent("x", ("x",))])
    await assert_unchanged(runtime, sid, 3)
    runtime.nodes.max_depth = 4
    await runtime.nodes.append_fragments(sid, [parent("c", ("d",))])  # a > b > c > d: depth 4
    with pytest.raises(ProtocolViolation, match="depth"):
        await runtime.nodes.append_fragments(sid, [parent("d", ("e",))])


async def test_action_outputs_stay_taken_in_a_state_loaded_from_a_snapshot(
    sqlite_url: str,
) -> None:
    def runtime_on_file() -> Awaitable[Runtime]:
        config = make_config(sqlite_url, log={"snapshot_every": 3})
        return Runtime.create(config, engine=ReferenceEngine())

    rt = await runtime_on_file()
    try:
        sid = await new(rt)
        await rt.nodes.append_fragments(sid, [leaf("in")])
        for k in range(5):
            await rt.nodes.submit_action(sid, "GENERATE", [("prompt", "in")], [("out", f"o{k}")])
        for task in list(rt.sessions._background):  # the snapshots, saved in the background
            await task
        snapshot = await rt.log.load_snapshot(sid)
        assert snapshot is not None and snapshot[0] >= 3
        live = await rt.get(sid)
    finally:
        await rt.aclose()
    rt = await runtime_on_file()  # a new process: the state comes from the snapshot
    try:
        loaded = await rt.sessions.load(sid)
        assert loaded.action_outputs == live.action_outputs == {f"o{k}" for k in range(5)}
        with pytest.raises(InvalidAction):
            await rt.nodes.submit_action(sid, "GENERATE", [("prompt", "in")], [("out", "o1")])
        await assert_unchanged(rt, sid, live.version)
    finally:
        await rt.aclose()


async def test_action_outputs_must_be_new(runtime: Runtime) -> None:
    sid = await new(runtime)
    await runtime.nodes.append_fragments(sid, [leaf("in")])
    await runtime.nodes.submit_action(sid, "GENERATE", [("prompt", "in")], [("out", "o1")])
    for outputs in ([("out", "in")], [("out", "o1")], [("a", "n"), ("b", "n")]):
        with pytest.raises(InvalidAction):
            await runtime.nodes.submit_action(sid, "GENERATE", [("prompt", "in")], outputs)
    await assert_unchanged(runtime, sid, 3)
