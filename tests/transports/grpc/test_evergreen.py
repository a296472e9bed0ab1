"""Evergreen v2 over real gRPC on loopback: fragment rules, actions, barriers, the log."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from sessiontape.core.events import T
from sessiontape.core.session.state import SessionState
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.grpc.client import (
    EvergreenClient,
    action,
    fragment,
    sampling_config,
    text_fragments,
)
from sessiontape.transports.grpc.evergreen_config import sampling_params
from sessiontape.transports.grpc.gen.evergreen.v2 import evergreen_pb2
from tests.helpers.evergreen import Outcome, exchange, msg
from tests.transports.grpc.conftest import Served

SessionMessage = evergreen_pb2.SessionMessage


def gen(inputs: dict[str, str], outputs: dict[str, str], **params: Any) -> Any:
    target = params.pop("target", "")
    params.setdefault("max_tokens", 6)
    params.setdefault("seed", 7)
    return action(
        "GENERATE",
        inputs=inputs,
        outputs=outputs,
        configs=[sampling_config(**params)],
        target=target,
    )


def dag(st: SessionState) -> dict[str, Any]:
    return {
        nid: {
            "kind": n.kind,
            "final": n.final_seq,
            "direction": n.direction,
            "fragments": {
                s: (f.continued, f.child_ids, f.metadata, f.ref, f.data, f.has_chunk)
                for s, f in n.fragments.items()
            },
        }
        for nid, n in st.nodes.items()
    }


def assert_aborted(out: Outcome, code: grpc.StatusCode, fragment_of_message: str) -> None:
    assert out.code == code, (out.code, out.details)
    assert fragment_of_message in out.details
    assert out.events[-1].type == T.SESSION_ABORTED
    assert fragment_of_message in out.events[-1].body["message"]


# -- the happy path and the log ----------------------------------------------


async def test_generate_streams_the_output_and_the_log_holds_every_message(
    client: EvergreenClient, server: Served
) -> None:
    rt = server.runtime
    # The seed's "streamed chains" example: action first, parent before children,
    # the parent itself streamed in two fragments, a leaf in three.
    out = await exchange(
        client,
        rt,
        msg(actions=[gen({"text": "prompt_1"}, {"text": "response_1"}, max_tokens=12)]),
        msg(fragments=[fragment("prompt_1", child_ids=["prompt_1_text"], continued=True)]),
        msg(
            fragments=text_fragments(
                "prompt_1_text", "Write a heroic novel about a doughnut.", parts=3
            )
        ),
        msg(
            fragments=[
                fragment("prompt_1", seq=1, child_ids=["prompt_1_eot"]),
                fragment("prompt_1_eot", mimetype="application/x-protobuf; type=EndOfTurn"),
            ]
        ),
    )
    assert out.code == grpc.StatusCode.OK, out.details

    # Replies: one leaf, seq 0..n, continued until the last, metadata on seq 0 only.
    frags = [f for m in out.received for f in m.node_fragments]
    assert {f.id for f in frags} == {"response_1"}
    assert [f.seq for f in frags] == list(range(len(frags)))
    assert [f.continued for f in frags] == [True] * (len(frags) - 1) + [False]
    assert frags[0].chunk_fragment.metadata.mimetype.startswith("text/plain")
    assert not any(f.chunk_fragment.HasField("metadata") for f in frags[1:])

    # The text is the detokenized generation the log recorded.
    tokens = [e.body["token"] for e in out.of(T.GENERATION_TOKEN) if not e.body["is_prefill"]]
    assert 0 < len(tokens) <= 12
    assert out.nodes["response_1"].decode() == rt.engine.detokenize(tokens)
    # The prompt was the flattened input (the EndOfTurn marker adds nothing).
    [appended] = out.of(T.TOKENS_APPENDED)
    assert appended.body["tokens"] == rt.engine.tokenize("Write a heroic novel about a doughnut.")

    # Every inbound fragment and the action, in arrival order; every outbound one as sent.
    inbound = [
        (e.body["id"], e.body["seq"])
        for e in out.of(T.NODE_FRAGMENT)
        if e.body["direction"] == "in"
    ]
    assert inbound == [
        ("prompt_1", 0),
        ("prompt_1_text", 0),
        ("prompt_1_text", 1),
        ("prompt_1_text", 2),
        ("prompt_1", 1),
        ("prompt_1_eot", 0),
    ]
    assert out.events[1].type == T.ACTION_SUBMITTED
    assert out.events[1].body["configs"][0]["json"] == {"max_tokens": 12.0, "seed": 7.0}
    outbound = [e for e in out.of(T.NODE_FRAGMENT) if e.body["direction"] == "out"]
    assert [(e.body["id"], e.body["seq"], e.body["continued"]) for e in outbound] == [
        (f.id, f.seq, f.continued) for f in frags
    ]
    assert [e.data or b"" for e in outbound] == [f.chunk_fragment.data for f in frags]
    # the final fragment, the action's completion and the generation's finish: one append
    assert [e.type for e in out.events][-4:] == [
        T.NODE_FRAGMENT,
        T.ACTION_COMPLETED,
        T.GENERATION_FINISHED,
        T.SESSION_CLOSED,
    ]
    assert len({e.recorded_at for e in out.events[-4:-1]}) == 1
    assert out.events[-1].body["reason"] == "client"
    [started] = out.of(T.GENERATION_STARTED)
    assert started.body["action_id"] == "a1"

    # Replay from the log gives the same node DAG as the live session.
    live = await rt.get(out.session_id)
    replayed = await rt.sessions.load(out.session_id)
    assert dag(replayed) == dag(live)
    assert replayed.nodes["response_1"].data() == out.nodes["response_1"]
    assert replayed.status == "closed"


async def test_each_output_fragment_commits_with_the_tokens_it_carries(
    client: EvergreenClient, server: Served
) -> None:
    """A streamed output fragment is recorded in the same append as the run of
    tokens whose text it carries (nothing commits between them); the last one,
    which ends the node, commits with the generation's last run and its finish."""
    rt = server.runtime
    out = await exchange(
        client,
        rt,
        msg(actions=[gen({"text": "p"}, {"text": "r"}, max_tokens=80)]),
        msg(fragments=text_fragments("p", "Tell me a long story.", parts=1)),
    )
    assert out.code == grpc.StatusCode.OK, out.details
    evs = out.events
    outbound = [
        i for i, e in enumerate(evs) if e.type == T.NODE_FRAGMENT and e.body["direction"] == "out"
    ]
    *streamed, last = outbound
    assert streamed and not evs[last].body["continued"]
    start = next(i for i, e in enumerate(evs) if e.type == T.GENERATION_STARTED)
    carried: list[int] = []
    for i in streamed:
        assert evs[i].body["continued"]
        run = [e for e in evs[start + 1 : i] if e.type == T.GENERATION_TOKEN]
        assert run and evs[i - 1].type == T.GENERATION_TOKEN
        # the same commit: one recorded time, consecutive positions
        assert run[-1].recorded_at == evs[i].recorded_at
        assert evs[i].position == evs[i - 1].position + 1
        carried += [e.body["token"] for e in run if not e.body["is_prefill"]]
        start = i
    tokens = [e.body["token"] for e in out.of(T.GENERATION_TOKEN) if not e.body["is_prefill"]]
    assert carried == tokens[: len(carried)]
    text = b"".join(evs[i].data or b"" for i in streamed)
    assert rt.engine.detokenize(carried).encode().startswith(text)
    assert out.nodes["r"].decode() == rt.engine.detokenize(tokens)
    # the generation ended on its own: the last tokens, the final fragment, the action's
    # completion and the finish are one append, in that order
    [fin] = out.of(T.GENERATION_FINISHED)
    [done] = out.of(T.ACTION_COMPLETED)
    assert fin.body["finish_reason"] in ("length", "eos")
    assert evs[last - 1].type == T.GENERATION_TOKEN
    assert evs[last + 1 : last + 3] == [done, fin]
    assert evs[last].recorded_at == done.recorded_at == fin.recorded_at


async def test_outputs_of_earlier_actions_feed_later_ones(
    client: EvergreenClient, server: Served
) -> None:
    rt = server.runtime
    # The seed's second example: prompt_2 = prompt_1 + response_1 + question_2.
    out = await exchange(
        client,
        rt,
        msg(
            actions=[gen({"prompt": "prompt_1"}, {"response": "response_1"})],
            fragments=text_fragments("prompt_1", "Summarise: "),
        ),
        msg(
            actions=[gen({"prompt": "prompt_2"}, {"response": "response_2"})],
            fragments=[
                fragment("prompt_2", child_ids=["prompt_1", "response_1", "question_2"]),
                *text_fragments("question_2", "Who is winning?"),
            ],
        ),
        # An earlier output used directly as an input.
        msg(actions=[gen({"prompt": "response_2"}, {"text": "response_3"})]),
    )
    assert out.code == grpc.StatusCode.OK, out.details
    nodes = out.nodes
    assert set(nodes) == {"response_1", "response_2", "response_3"}
    prompts = [e for e in out.of(T.GENERATION_STARTED)]
    assert [p.body["action_id"] for p in prompts] == ["a1", "a2", "a3"]
    # The second prompt is exactly the text of its three children, in order.
    st = await rt.sessions.load(out.session_id, prompts[1].version - 1)
    assert (
        rt.engine.detokenize(list(st.tokens))
        == "Summarise: " + nodes["response_1"].decode() + "Who is winning?"
    )
    st3 = await rt.sessions.load(out.session_id, prompts[2].version - 1)
    assert rt.engine.detokenize(list(st3.tokens)) == nodes["response_2"].decode()
    assert [e.body["action_id"] for e in out.of(T.ACTION_COMPLETED)] == ["a1", "a2", "a3"]


async def test_an_output_the_client_did_not_ask_for_is_not_produced(
    client: EvergreenClient, server: Served
) -> None:
    out = await exchange(
        client,
        server.runtime,
        msg(actions=[gen({"prompt": "p"}, {})], fragments=text_fragments("p", "hi")),
    )
    assert out.code == grpc.StatusCode.OK, out.details
    assert out.received == []
    assert [e.type for e in out.of(T.GENERATION_FINISHED, T.ACTION_COMPLETED)] == [
        T.GENERATION_FINISHED,
        T.ACTION_COMPLETED,
    ]
    assert not [e for e in out.of(T.NODE_FRAGMENT) if e.body["direction"] == "out"]


async def test_two_outputs_get_the_same_text(client: EvergreenClient, server: Served) -> None:
    out = await exchange(
        client,
        server.runtime,
        msg(
            actions=[gen({"prompt": "p"}, {"text": "t", "response": "r"})],
            fragments=text_fragments("p", "hi"),
        ),
    )
    assert out.code == grpc.StatusCode.OK, out.details
    assert out.nodes["t"] == out.nodes["r"]


async def test_target_ids(client: EvergreenClient, server: Served) -> None:
    info = server.runtime.engine.info
    for target in ("", info.model_id, info.name):
        out = await exchange(
            client,
            server.runtime,
            msg(
                actions=[gen({"p": "p"}, {"text": "r"}, target=target)],
                fragments=text_fragments("p", "x"),
            ),
        )
        assert out.code == grpc.StatusCode.OK, (target, out.details)
    out = await exchange(
        client, server.runtime, msg(actions=[gen({"p": "p"}, {"text": "r"}, target="gpt-9")])
    )
    assert_aborted(out, grpc.StatusCode.NOT_FOUND, "gpt-9")
    assert not out.of(T.ACTION_SUBMITTED)


async def test_sampling_config_is_deterministic_for_a_seed(
    client: EvergreenClient, server: Served
) -> None:
    texts = []
    for _ in range(2):
        out = await exchange(
            client,
            server.runtime,
            msg(
                actions=[gen({"p": "p"}, {"text": "r"}, max_tokens=10, seed=42, temperature=0.8)],
                fragments=text_fragments("p", "same prompt"),
            ),
        )
        assert out.code == grpc.StatusCode.OK
        [started] = out.of(T.GENERATION_STARTED)
        assert started.body["params"]["seed"] == "42"
        assert started.body["params"]["temperature"] == 0.8
        texts.append(out.nodes["r"])
    assert texts[0] == texts[1]


# -- fragment rules -----------------------------------------------------------


async def test_defaults_and_first_wins_duplicates(client: EvergreenClient, server: Served) -> None:
    out = await exchange(
        client,
        server.runtime,
        msg(actions=[gen({"p": "p"}, {"text": "r"})]),
        # No seq, no continued: seq 0 and final.
        msg(fragments=[fragment("p", data=b"first", mimetype="text/plain")]),
        # Retries of (p, 0): ignored without error, even with other content.
        msg(fragments=[fragment("p", data=b"second", mimetype="text/plain")]),
        msg(fragments=[fragment("p", data=b"third", mimetype="text/plain", continued=True)]),
    )
    assert out.code == grpc.StatusCode.OK, out.details
    inbound = [e for e in out.of(T.NODE_FRAGMENT) if e.body["direction"] == "in"]
    assert len(inbound) == 1
    assert inbound[0].body["seq"] == 0 and inbound[0].body["continued"] is False
    assert inbound[0].data == b"first"
    [appended] = out.of(T.TOKENS_APPENDED)
    assert appended.body["tokens"] == server.runtime.engine.tokenize("first")


@pytest.mark.parametrize(
    ("fragments", "code", "text"),
    [
        pytest.param(
            [fragment("n", data=b"a", mimetype="text/plain"), fragment("n", seq=1, data=b"b")],
            grpc.StatusCode.FAILED_PRECONDITION,
            "after the final seq",
            id="seq-past-final",
        ),
        pytest.param(
            [
                fragment("n", continued=True, data=b"a", mimetype="text/plain"),
                fragment("n", seq=1, data=b"b", mimetype="text/plain"),
            ],
            grpc.StatusCode.FAILED_PRECONDITION,
            "metadata on seq 1",
            id="metadata-after-seq-0",
        ),
        pytest.param(
            [fragment("n", data=b"a", leaf=True)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "must carry metadata",
            id="leaf-without-metadata",
        ),
        pytest.param(
            [fragment("n", continued=True, child_ids=["c"]), fragment("n", seq=1, data=b"x")],
            grpc.StatusCode.FAILED_PRECONDITION,
            "is a parent",
            id="parent-then-leaf",
        ),
        pytest.param(
            [fragment("a", child_ids=["b"]), fragment("b", child_ids=["a"])],
            grpc.StatusCode.FAILED_PRECONDITION,
            "cycle",
            id="cycle",
        ),
        pytest.param(
            [fragment("a", child_ids=["a"])],
            grpc.StatusCode.FAILED_PRECONDITION,
            "cycle",
            id="self-child",
        ),
        pytest.param(
            [fragment(f"d{i}", child_ids=[f"d{i + 1}"]) for i in range(40)],
            grpc.StatusCode.FAILED_PRECONDITION,
            "nesting depth",
            id="too-deep",
        ),
        pytest.param(
            [fragment("n", ref="not a uri", mimetype="video/mp4")],
            grpc.StatusCode.INVALID_ARGUMENT,
            "not a URI",
            id="ref-not-uri",
        ),
        pytest.param(
            [fragment("", data=b"x", mimetype="text/plain")],
            grpc.StatusCode.INVALID_ARGUMENT,
            "without a node id",
            id="no-id",
        ),
        pytest.param(
            [fragment("n", seq=-1, data=b"x", mimetype="text/plain")],
            grpc.StatusCode.INVALID_ARGUMENT,
            "negative seq",
            id="negative-seq",
        ),
    ],
)
async def test_bad_fragments_abort_and_leave_the_nodes_unchanged(
    client: EvergreenClient, server: Served, fragments: list[Any], code: grpc.StatusCode, text: str
) -> None:
    ok = text_fragments("keep", "kept")
    out = await exchange(
        client, server.runtime, msg(fragments=ok), *(msg(fragments=[f]) for f in fragments)
    )
    assert_aborted(out, code, text)
    st = await server.runtime.sessions.load(out.session_id)
    assert st.status == "aborted"
    # Nothing of the message that broke a rule was recorded.
    bad = fragments[-1]
    recorded = [(e.body["id"], e.body["seq"]) for e in out.of(T.NODE_FRAGMENT)]
    assert recorded.count((bad.id, bad.seq)) == (
        1 if (bad.id, bad.seq) in [(f.id, f.seq) for f in fragments[:-1]] else 0
    )
    assert st.nodes["keep"].data() == b"kept"


async def test_a_rejected_message_records_none_of_its_fragments(
    client: EvergreenClient, server: Served
) -> None:
    out = await exchange(
        client,
        server.runtime,
        msg(fragments=[*text_fragments("ok", "fine"), fragment("x", child_ids=["x"])]),
    )
    assert out.code == grpc.StatusCode.FAILED_PRECONDITION
    assert not out.of(T.NODE_FRAGMENT)


async def test_uri_refs_are_recorded(client: EvergreenClient, server: Served) -> None:
    out = await exchange(
        client,
        server.runtime,
        msg(
            fragments=[
                fragment("v", continued=True, ref="file://path/part1", mimetype="video/mp4"),
                fragment("v", seq=1, ref="file://path/part2", leaf=True),
            ]
        ),
    )
    assert out.code == grpc.StatusCode.OK, out.details
    st = await server.runtime.sessions.load(out.session_id)
    assert st.nodes["v"].ref == "file://path/part1"
    assert st.nodes["v"].fragments[1].ref == "file://path/part2"
    assert st.nodes["v"].fragments_complete


# -- actions ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "code", "text"),
    [
        pytest.param(
            [msg(actions=[action("SUMMON", inputs={"p": "p"})])],
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown action",
            id="unknown-action",
        ),
        pytest.param(
            [msg(actions=[gen({}, {"text": "r"})])],
            grpc.StatusCode.INVALID_ARGUMENT,
            "at least one input",
            id="no-input",
        ),
        pytest.param(
            [msg(actions=[gen({"p": "p"}, {"video": "r"})])],
            grpc.StatusCode.INVALID_ARGUMENT,
            "has no output",
            id="unknown-output",
        ),
        pytest.param(
            [msg(actions=[gen({"p": "p"}, {"text": "p"})])],
            grpc.StatusCode.INVALID_ARGUMENT,
            "same node",
            id="reads-own-output",
        ),
        pytest.param(
            [
                msg(fragments=text_fragments("p", "x")),
                msg(actions=[gen({"q": "x"}, {"text": "p"})]),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "not new",
            id="output-is-existing-node",
        ),
        pytest.param(
            [msg(actions=[gen({"p": "p"}, {"text": "r"}), gen({"p": "p"}, {"text": "r"})])],
            grpc.StatusCode.INVALID_ARGUMENT,
            "not new",
            id="output-reused",
        ),
        pytest.param(
            [
                msg(
                    actions=[
                        action("GENERATE", inputs={"p": "p"}, configs=[sampling_config(temp=1)])
                    ]
                )
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown GENERATE config key",
            id="bad-config-key",
        ),
        pytest.param(
            [
                msg(
                    actions=[
                        action(
                            "GENERATE", inputs={"p": "p"}, configs=[sampling_config(max_tokens="x")]
                        )
                    ]
                )
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "wrong type",
            id="bad-config-type",
        ),
        pytest.param(
            [
                msg(
                    actions=[
                        action(
                            "GENERATE", inputs={"p": "p"}, configs=[sampling_config(max_tokens=-1)]
                        )
                    ]
                ),
                msg(fragments=text_fragments("p", "x")),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_tokens",
            id="negative-max-tokens",
        ),
        pytest.param(
            [
                msg(actions=[gen({"p": "p"}, {"text": "r"})]),
                msg(fragments=text_fragments("r", "mine")),
            ],
            grpc.StatusCode.FAILED_PRECONDITION,
            "only the server writes it",
            id="client-writes-output",
        ),
        pytest.param(
            [
                msg(
                    actions=[gen({"p": "v"}, {"text": "r"})],
                    fragments=[fragment("v", ref="file://x", mimetype="text/plain")],
                )
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "refs are not fetched",
            id="ref-input",
        ),
        pytest.param(
            [
                msg(
                    actions=[gen({"p": "v"}, {"text": "r"})],
                    fragments=[fragment("v", data=b"\x89PNG", mimetype="image/png")],
                )
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "only text/* and application/json are read",
            id="image-input",
        ),
        pytest.param(
            [
                msg(
                    actions=[gen({"p": "v"}, {"text": "r"})],
                    fragments=[fragment("v", data=b"", mimetype="text/plain")],
                )
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "empty prompt",
            id="empty-prompt",
        ),
        pytest.param(
            [
                msg(
                    actions=[gen({"p": "v"}, {"text": "r"})],
                    fragments=[fragment("v", data=b"\xff\xfe", mimetype="text/plain")],
                )
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "not UTF-8",
            id="bad-utf8",
        ),
        pytest.param(
            [
                msg(
                    actions=[gen({"p": "v"}, {"text": "r"})],
                    fragments=[fragment("v", data=b"x" * 5000, mimetype="text/plain")],
                )
            ],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "",
            id="context-overflow",
        ),
        pytest.param(
            [
                msg(
                    actions=[
                        gen({"p": "p"}, {"text": "r"}),
                        gen({"p": "r2"}, {"text": "r3"}),
                        gen({"p": "p"}, {"text": "r2"}),
                    ],
                    fragments=text_fragments("p", "x"),
                )
            ],
            grpc.StatusCode.FAILED_PRECONDITION,
            "output of a later action",
            id="reads-later-output",
        ),
        pytest.param(
            [
                msg(
                    actions=[gen({"p": "p"}, {"text": "r"})],
                    fragments=[fragment("p", continued=True, data=b"half", mimetype="text/plain")],
                )
            ],
            grpc.StatusCode.FAILED_PRECONDITION,
            "ended its stream",
            id="input-never-completed",
        ),
    ],
)
async def test_failed_actions_abort_the_session(
    client: EvergreenClient,
    server: Served,
    messages: list[SessionMessage],
    code: grpc.StatusCode,
    text: str,
) -> None:
    out = await exchange(client, server.runtime, *messages)
    assert_aborted(out, code, text)
    assert out.events[-1].body["code"] != "internal"
    st = await server.runtime.sessions.load(out.session_id)
    assert st.status == "aborted"
    # Every accepted action ends: completed, failed with the session's error, or
    # cancelled because the session aborted while it waited.
    submitted = [e.body["action_id"] for e in out.of(T.ACTION_SUBMITTED)]
    ended = {
        e.body["action_id"]: e.body.get("code") for e in out.of(T.ACTION_COMPLETED, T.ACTION_FAILED)
    }
    assert sorted(ended) == sorted(submitted)
    assert set(ended.values()) <= {None, "cancelled", out.events[-1].body["code"]}


async def test_rejected_action_is_not_recorded(client: EvergreenClient, server: Served) -> None:
    out = await exchange(
        client,
        server.runtime,
        msg(fragments=text_fragments("p", "x")),
        msg(actions=[action("GENERATE", inputs={"p": "p"}, configs=[sampling_config(bogus=1)])]),
    )
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [e.type for e in out.events] == [T.SESSION_OPENED, T.NODE_FRAGMENT, T.SESSION_ABORTED]


async def test_barrier_waits_for_inputs_while_fragments_keep_coming(
    client: EvergreenClient, server: Served
) -> None:
    rt = server.runtime
    async with client.session() as s:
        sid = await s.session_id()
        await s.send(
            actions=[gen({"p": "root"}, {"text": "r"})],
            fragments=[fragment("root", child_ids=["a", "b"])],
        )
        await s.send(fragments=text_fragments("a", "alpha "))
        await s.send(fragments=[fragment("b", continued=True, data=b"be", mimetype="text/plain")])
        # Wait until the server has recorded the three fragments sent so far.
        for _ in range(500):
            evs = await rt.log.read(sid, 1, None)
            if sum(e.type == T.NODE_FRAGMENT for e in evs) == 3:
                break
            await _yield()
        assert sum(e.type == T.NODE_FRAGMENT for e in evs) == 3
        assert not [e for e in evs if e.type == T.GENERATION_STARTED], (
            "ran before its inputs were complete"
        )
        await s.send(fragments=[fragment("b", seq=1, data=b"ta")])
        await s.done_writing()
        nodes = await s.collect()
    evs = await rt.log.read(sid, 1, None)
    types = [e.type for e in evs]
    last_input = max(
        i for i, e in enumerate(evs) if e.type == T.NODE_FRAGMENT and e.body["direction"] == "in"
    )
    assert types.index(T.GENERATION_STARTED) > last_input
    [appended] = [e for e in evs if e.type == T.TOKENS_APPENDED]
    assert appended.body["tokens"] == rt.engine.tokenize("alpha beta")
    assert "r" in nodes


async def _yield() -> None:
    import asyncio

    await asyncio.sleep(0.01)


async def test_client_cancel_records_the_generation_as_cancelled(
    client: EvergreenClient, server: Served
) -> None:
    import asyncio

    rt = server.runtime
    engine = rt.engine
    assert isinstance(engine, ReferenceEngine)
    # slow and never EOS, so the cancel always lands before the generation could end by
    # itself (it raced an EOS that seed 7 samples at token 173)
    engine.step_delay_s = 0.01
    engine.eos_bias = -100.0
    async with client.session() as s:
        sid = await s.session_id()
        await s.send(
            actions=[gen({"p": "p"}, {"text": "r"}, max_tokens=3000)],
            fragments=text_fragments("p", "go"),
        )
        async for _ in s:
            break  # the generation is running
        s.cancel()
    for _ in range(300):
        st = await rt.sessions.load(sid)
        if st.status != "open":
            break
        await asyncio.sleep(0.01)
    assert st.status == "closed"
    evs = await rt.log.read(sid, 1, None)
    [fin] = [e for e in evs if e.type == T.GENERATION_FINISHED]
    assert fin.body["finish_reason"] == "cancelled"
    assert [e.body["code"] for e in evs if e.type == T.ACTION_FAILED] == ["cancelled"]
    assert evs[-1].type == T.SESSION_CLOSED and evs[-1].body["reason"] == "cancelled"


def test_generate_config_keys_left_out_are_the_models() -> None:
    # the penalties and min_p, which no config key names, are always the model's
    penalties = {"repetition_penalty", "min_p", "penalty_last_n"}
    assert sampling_params([]).from_model == {"temperature", "top_p", "top_k"} | penalties
    params = sampling_params([sampling_config(temperature=0.5), sampling_config(top_k=3)])
    assert (params.temperature, params.top_k, params.from_model) == (0.5, 3, {"top_p"} | penalties)
