"""Tool calls on the Evergreen wire: a call the model makes is an action the server sends
the client; its result is that action's output node, which the client writes.

A GENERATE whose config names ``tools`` (transports/grpc/evergreen_config.py) generates
under the tools' grammar (:mod:`sessiontape.core.tools`); its output node carries the text
as generated, calls included. For each call the reply makes, in the commit that carries
the generation's finish, the server records

* ``tool.called`` (function, arguments, call id, generation, token span),
* an *arguments* node: a leaf, ``application/json``, the arguments as generated
  (``node.fragment``, direction ``out``),
* an action named after the function (``action.submitted`` with ``direction: "out"``):
  input ``arguments`` (that node), output ``result`` (a new id the client is to write),
  config a Struct ``{"call_id": ...}``,

and sends the nodes and actions in the message that carries the output's final fragment
(so a client that sees that fragment knows every call of the reply). The client runs the
function and sends the ``result`` node (``text/*`` or ``application/json`` chunks, a leaf or a parent);
in the commit of the fragment that completes it, the server records ``tool.result``
(``supplied_by: "client"``, the node's text as ``content``) and ``action.completed`` for
the call. A later GENERATE reads calls and results like any node: the client lists them
among its inputs. docs/protocols/evergreen.md describes the exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from google.protobuf import any_pb2, struct_pb2

from sessiontape.core.events import NewEvent, T
from sessiontape.core.node_writes import NodeWrites
from sessiontape.core.nodes import FragmentIn, missing, text_of
from sessiontape.core.session.state import SessionState
from sessiontape.core.tools import CallRecorder, ToolCall, ToolUse, result_event
from sessiontape.transports.grpc.evergreen_config import STRUCT_TYPE_URL
from sessiontape.transports.grpc.gen.evergreen.v2 import evergreen_pb2

ARGUMENTS_MIMETYPE = "application/json"
#: the call action's parameter names
ARGUMENTS, RESULT = "arguments", "result"


@dataclass(frozen=True)
class SentCall:
    """A call sent to the client as an action, waiting for its result node."""

    action_id: str
    call_id: str
    name: str
    arguments_id: str
    result_id: str
    arguments: str


def _fresh(st: SessionState, base: str, taken: set[str]) -> str:
    """``base``, or ``base`` with a suffix when a node or an output already has that id."""
    nid, k = base, 1
    while nid in st.nodes or nid in st.action_outputs or nid in taken:
        k += 1
        nid = f"{base}-{k}"
    taken.add(nid)
    return nid


def call_actions(st: SessionState, calls: Sequence[ToolCall]) -> list[SentCall]:
    """The actions ``calls`` become on ``st`` (ids: the session's next action ids; nodes:
    the call id and ``<call id>.result``, made unique)."""
    taken: set[str] = set()
    first = len(st.actions) + 1
    return [
        SentCall(
            f"a{first + i}",
            c.id,
            c.name,
            _fresh(st, c.id, taken),
            _fresh(st, f"{c.id}.result", taken),
            c.arguments,
        )
        for i, c in enumerate(calls)
    ]


def arguments_fragment(call: SentCall) -> FragmentIn:
    return FragmentIn(
        id=call.arguments_id,
        has_chunk=True,
        metadata={"mimetype": ARGUMENTS_MIMETYPE},
        data=call.arguments.encode(),
    )


def submitted_event(call: SentCall) -> NewEvent:
    """The ``action.submitted`` (direction ``out``) that records a call sent to the client."""
    return NewEvent(
        T.ACTION_SUBMITTED,
        {
            "action_id": call.action_id,
            "name": call.name,
            "inputs": [{"name": ARGUMENTS, "id": call.arguments_id}],
            "outputs": [{"name": RESULT, "id": call.result_id}],
            "target": "",
            "configs": [{"type_url": STRUCT_TYPE_URL, "json": {"call_id": call.call_id}}],
            "direction": "out",
        },
    )


def answered(st: SessionState, waiting: Sequence[SentCall]) -> list[SentCall]:
    """The calls among ``waiting`` whose result node is complete on ``st``."""
    return [c for c in waiting if c.result_id in st.nodes and not missing(st, c.result_id)]


def result_events(st: SessionState, calls: Sequence[SentCall]) -> list[NewEvent]:
    """``tool.result`` and ``action.completed`` for each answered call (its result node's
    text; a node that is not text is InvalidAction)."""
    out: list[NewEvent] = []
    for c in calls:
        content = text_of(st, c.result_id, f"the result of {c.name} ({c.call_id})")
        out.append(result_event(c.call_id, c.name, content, "client"))
        out.append(NewEvent(T.ACTION_COMPLETED, {"action_id": c.action_id}))
    return out


def arguments_message(call: SentCall) -> evergreen_pb2.NodeFragment:
    """The arguments node as sent: one leaf fragment."""
    frag = evergreen_pb2.NodeFragment(id=call.arguments_id)
    frag.chunk_fragment.metadata.mimetype = ARGUMENTS_MIMETYPE
    frag.chunk_fragment.data = call.arguments.encode()
    return frag


def action_message(call: SentCall) -> evergreen_pb2.Action:
    """The Action that asks the client to run ``call``."""
    config = struct_pb2.Struct()
    config.update({"call_id": call.call_id})
    packed = any_pb2.Any()
    packed.Pack(config)
    return evergreen_pb2.Action(
        name=call.name,
        inputs=[evergreen_pb2.NamedParameter(name=ARGUMENTS, id=call.arguments_id)],
        outputs=[evergreen_pb2.NamedParameter(name=RESULT, id=call.result_id)],
        configs=[packed],
    )


class ReplyCalls:
    """The calls one GENERATE's reply makes: read from its tokens with the last run and
    recorded in the commit of the generation's finish (:meth:`run`, a part of the run
    hook). :attr:`sent` holds them once recorded."""

    def __init__(
        self,
        nodes: NodeWrites,
        detokenize: Callable[[Sequence[int]], str],
        use: ToolUse | None,
        action_id: str,
    ) -> None:
        self.nodes = nodes
        self.recorder = CallRecorder(detokenize, use)
        self.action_id = action_id
        self.sent: list[SentCall] = []
        #: the calls went out (:meth:`announce`)
        self.announced = False

    @property
    def wanted(self) -> bool:
        return self.recorder.wanted

    def run(self, st: SessionState, tokens: list[int], last: bool) -> list[NewEvent]:
        """Take a run's tokens; with the last, the events that record the reply's calls."""
        if not self.wanted:
            return []
        self._follow(st)
        return self._events(st, self.recorder(st, tokens, last))

    def _follow(self, st: SessionState) -> None:
        """Point the recorder at the action's generation (its start commits first)."""
        if not self.recorder.generation_id:
            g = next(g for g in reversed(st.generations.values()) if g.action_id == self.action_id)
            self.recorder.started(g.id, g.prompt_length)

    def _events(self, st: SessionState, called: Sequence[NewEvent]) -> list[NewEvent]:
        """``tool.called`` (``called``), then the arguments nodes and the actions."""
        if not called:
            return []
        # (a commit tried again on a reloaded state makes them again)
        self.sent = call_actions(st, self.recorder.calls)
        frags, _ = self.nodes.fragment_events(st, [arguments_fragment(c) for c in self.sent], "out")
        return [*called, *frags, *(submitted_event(c) for c in self.sent)]

    def announce(self, message: evergreen_pb2.SessionMessage) -> None:
        """Add the recorded calls to ``message`` (the one with the output's final
        fragment): their arguments nodes and actions."""
        message.node_fragments.extend(arguments_message(c) for c in self.sent)
        message.actions.extend(action_message(c) for c in self.sent)
        self.announced = True


class Waiting:
    """The calls a stream sent whose result node is not complete yet, by result id."""

    def __init__(self) -> None:
        self.calls: dict[str, SentCall] = {}
        self._answering: list[SentCall] = []

    def __bool__(self) -> bool:
        return bool(self.calls)

    def add(self, sent: Sequence[SentCall]) -> None:
        self.calls.update((c.result_id, c) for c in sent)

    def answers(self, st: SessionState) -> list[NewEvent]:
        """The results of calls whose result node is complete on ``st`` (the ``then`` of
        :meth:`~sessiontape.core.node_writes.NodeWrites.append_fragments`: they commit
        with the fragments that complete them)."""
        self._answering = answered(st, list(self.calls.values()))
        return result_events(st, self._answering)

    def settle(self) -> list[SentCall]:
        """The calls :meth:`answers` found, once committed: no longer waiting."""
        done, self._answering = self._answering, []
        for c in done:
            del self.calls[c.result_id]
        return done
