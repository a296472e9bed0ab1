"""Session state and the fold that builds it from events.

``apply(state, event)`` is the only way state changes: it does no I/O and
the same function serves live sessions, replay, audit, snapshots and tests.
Commands are checked *before* their events are appended (see
:mod:`sessiontape.core.nodes`, :mod:`sessiontape.core.tokens` and :mod:`sessiontape.core.runtime`); ``apply``
re-checks what is cheap and raises :class:`InvalidEvent` on an event that
cannot follow the current state, which is how ``audit`` finds broken
invariants in a log that was written by something else.

For speed the fold mutates ``state`` in place; callers that need the old
state copy it first (:meth:`SessionState.copy`).
"""

from __future__ import annotations

import copy
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sessiontape.core.bodies import (
    BODIES,
    ActionCompleted,
    ActionFailed,
    ActionSubmitted,
    ErrorRecorded,
    FeedbackRecorded,
    GenerationFinished,
    GenerationStarted,
    GenerationToken,
    ImageAttached,
    NodeFragment,
    NoteRecorded,
    SessionAborted,
    SessionClosed,
    SessionExpired,
    SessionOpened,
    SessionPurged,
    TokensAppended,
    TokensTruncated,
    ToolCalled,
    ToolResult,
    WireMessage,
    body_as,
)
from sessiontape.core.errors import InvalidEvent
from sessiontape.core.events import GENESIS_HASH, Event, T

OPEN, CLOSED, ABORTED, EXPIRED, PURGED = "open", "closed", "aborted", "expired", "purged"


@dataclass
class Fragment:
    seq: int
    continued: bool
    child_ids: list[str]
    metadata: dict[str, Any] | None
    ref: str | None
    data: bytes | None
    has_chunk: bool


@dataclass
class Node:
    id: str
    fragments: dict[int, Fragment] = field(default_factory=dict)
    final_seq: int | None = None
    #: "leaf" or "parent", fixed by the seq 0 fragment
    kind: str | None = None
    direction: str = "in"

    @property
    def metadata(self) -> dict[str, Any] | None:
        f0 = self.fragments.get(0)
        return f0.metadata if f0 else None

    @property
    def child_ids(self) -> list[str]:
        out: list[str] = []
        for seq in sorted(self.fragments):
            out.extend(self.fragments[seq].child_ids)
        return out

    @property
    def fragments_complete(self) -> bool:
        return self.final_seq is not None and all(
            s in self.fragments for s in range(self.final_seq + 1)
        )

    def data(self) -> bytes:
        return b"".join(self.fragments[s].data or b"" for s in sorted(self.fragments))

    @property
    def ref(self) -> str | None:
        f0 = self.fragments.get(0)
        return f0.ref if f0 else None


@dataclass
class Image:
    start: int
    end: int
    mime: str
    sha256: str
    size: int


@dataclass
class Generation:
    id: str
    params: dict[str, Any]
    prompt_length: int
    started_at: float
    tokens: list[int] = field(default_factory=list)
    scored: int = 0
    finish_reason: str | None = None
    finished_at: float | None = None
    action_id: str | None = None


@dataclass
class Action:
    id: str
    name: str
    inputs: list[tuple[str, str]]
    outputs: list[tuple[str, str]]
    target: str
    configs: list[Any]
    status: str = "pending"
    error: str | None = None
    #: ``in``: the client submitted it; ``out``: the server did (a tool call to run)
    direction: str = "in"


@dataclass
class SessionState:
    session_id: str
    version: int = 0
    head_hash: str = GENESIS_HASH
    protocol: str = ""
    mode: str = "offset"  # or "append_only"
    status: str = OPEN
    label: str = ""
    engine: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: list[int] = field(default_factory=list)
    ttl_s: float | None = None
    parent: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0
    tokens: array[int] = field(default_factory=lambda: array("q"))
    images: list[Image] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict)
    parents_of: dict[str, set[str]] = field(default_factory=dict)
    actions: dict[str, Action] = field(default_factory=dict)
    #: every id some action names as an output (derived from ``actions``: a new
    #: action's outputs are checked against it, not against every action's)
    action_outputs: set[str] = field(default_factory=set)
    generations: dict[str, Generation] = field(default_factory=dict)
    feedback: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    truncations: int = 0
    dropped_tokens: int = 0
    event_count: int = 0
    abort: dict[str, Any] | None = None
    purged_through: int = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def active_generation(self) -> Generation | None:
        for g in reversed(self.generations.values()):
            return g if g.finish_reason is None else None
        return None

    def copy(self) -> SessionState:
        return copy.deepcopy(self)


#: ``(state, event, event's body)``: the body arrives typed as its event type's
#: TypedDict (checked once, when the applier is registered), at no cost per event
Applier = Callable[[SessionState, Event, Any], None]
_APPLIERS: dict[str, Applier] = {}
B = TypeVar("B")


def _on(
    type_: str, kind: type[B]
) -> Callable[[Callable[[SessionState, Event, B], None]], Callable[[SessionState, Event, B], None]]:
    if BODIES[type_] is not kind:
        raise TypeError(f"{type_}'s body is not a {kind.__name__}")

    def deco(
        fn: Callable[[SessionState, Event, B], None],
    ) -> Callable[[SessionState, Event, B], None]:
        _APPLIERS[type_] = fn
        return fn

    return deco


def apply(state: SessionState, event: Event) -> SessionState:
    """Fold one event into ``state`` (in place) and return it."""
    # A purge tombstone may open the log of a session: the chain starts there.
    starts_at_tombstone = event.type == T.SESSION_PURGED and state.version == 0
    if event.version != state.version + 1 and not starts_at_tombstone:
        raise InvalidEvent(
            f"event version {event.version} does not follow {state.version} in {state.session_id}"
        )
    fn = _APPLIERS.get(event.type)
    if fn is None:
        raise InvalidEvent(f"unknown event type {event.type!r}")
    if state.status == PURGED and event.type != T.SESSION_PURGED:
        raise InvalidEvent("event after purge tombstone")
    fn(state, event, event.body)
    state.version = event.version
    state.head_hash = event.hash
    state.updated_at = event.recorded_at
    state.event_count += 1
    return state


def _require_open(state: SessionState, event: Event) -> None:
    if state.status != OPEN:
        raise InvalidEvent(f"{event.type} on a {state.status} session")


@_on(T.SESSION_OPENED, SessionOpened)
def _opened(state: SessionState, e: Event, b: SessionOpened) -> None:
    if state.version != 0 and state.parent is None:
        raise InvalidEvent("session.opened must be the first event")
    state.protocol = str(b.get("protocol", ""))
    state.mode = str(b.get("mode", "offset"))
    state.label = str(b.get("label", ""))
    state.engine = dict(b.get("engine", {}))
    state.eos_token_ids = [int(t) for t in b.get("eos_token_ids", [])]
    ttl = b.get("ttl_s")
    state.ttl_s = None if ttl is None else float(ttl)
    state.meta = dict(b.get("meta", {}))
    state.created_at = e.recorded_at
    state.status = OPEN


@_on(T.SESSION_CLOSED, SessionClosed)
def _closed(state: SessionState, e: Event, b: SessionClosed) -> None:
    _require_open(state, e)
    state.status = CLOSED


@_on(T.SESSION_ABORTED, SessionAborted)
def _aborted(state: SessionState, e: Event, b: SessionAborted) -> None:
    _require_open(state, e)
    state.status = ABORTED
    state.abort = dict(b)


@_on(T.SESSION_EXPIRED, SessionExpired)
def _expired(state: SessionState, e: Event, b: SessionExpired) -> None:
    _require_open(state, e)
    state.status = EXPIRED


@_on(T.SESSION_PURGED, SessionPurged)
def _purged(state: SessionState, e: Event, b: SessionPurged) -> None:
    # A tombstone: the events before it are gone, the chain continues from it.
    state.status = PURGED
    state.purged_through = int(b.get("through_version", 0))
    state.tokens = array("q")
    state.nodes.clear()
    state.parents_of.clear()
    state.images.clear()


def apply_fragment(state: SessionState, fragment: Mapping[str, Any], data: bytes | None) -> None:
    """Record a fragment that :func:`sessiontape.core.nodes.check_fragment` accepted (first wins).

    ``fragment``: a ``node.fragment`` body."""
    b = body_as(T.NODE_FRAGMENT, fragment, NodeFragment)
    nid = str(b["id"])
    seq = int(b.get("seq", 0))
    node = state.nodes.get(nid)
    if node is None:
        node = state.nodes[nid] = Node(id=nid, direction=str(b.get("direction", "in")))
    if seq in node.fragments:
        return  # first wins
    chunk = b.get("chunk")
    children = [str(c) for c in b.get("child_ids", ())]
    if chunk is not None and children:
        raise InvalidEvent(f"node {nid}: fragment is both parent and leaf")
    metadata = None if chunk is None else chunk.get("metadata")
    frag = Fragment(
        seq=seq,
        continued=bool(b.get("continued", False)),
        child_ids=children,
        metadata=None if metadata is None else dict(metadata),
        ref=None if chunk is None else chunk.get("ref"),
        data=data,
        has_chunk=chunk is not None,
    )
    node.fragments[seq] = frag
    if not frag.continued:
        node.final_seq = seq if node.final_seq is None else min(node.final_seq, seq)
    if seq == 0 or node.kind is None:
        node.kind = "leaf" if frag.has_chunk else "parent" if (frag.child_ids or seq == 0) else None
    for c in children:
        state.parents_of.setdefault(c, set()).add(nid)


@_on(T.NODE_FRAGMENT, NodeFragment)
def _fragment(state: SessionState, e: Event, b: NodeFragment) -> None:
    _require_open(state, e)
    apply_fragment(state, b, e.data)


@_on(T.ACTION_SUBMITTED, ActionSubmitted)
def _action(state: SessionState, e: Event, b: ActionSubmitted) -> None:
    _require_open(state, e)
    aid = str(b["action_id"])
    if aid in state.actions:
        raise InvalidEvent(f"action {aid} submitted twice")
    outputs = [(str(p["name"]), str(p["id"])) for p in b.get("outputs", [])]
    state.actions[aid] = Action(
        id=aid,
        name=str(b.get("name", "")),
        inputs=[(str(p["name"]), str(p["id"])) for p in b.get("inputs", [])],
        outputs=outputs,
        target=str(b.get("target", "")),
        configs=list(b.get("configs", [])),
        direction=str(b.get("direction", "in")),
    )
    state.action_outputs.update(o for _, o in outputs)


def _action_of(state: SessionState, aid: str) -> Action:
    act = state.actions.get(str(aid))
    if act is None:
        raise InvalidEvent(f"unknown action {aid!r}")
    return act


@_on(T.ACTION_COMPLETED, ActionCompleted)
def _action_done(state: SessionState, e: Event, b: ActionCompleted) -> None:
    _action_of(state, b["action_id"]).status = "completed"


@_on(T.ACTION_FAILED, ActionFailed)
def _action_failed(state: SessionState, e: Event, b: ActionFailed) -> None:
    act = _action_of(state, b["action_id"])
    act.status = "failed"
    act.error = str(b.get("message", ""))


@_on(T.TOKENS_APPENDED, TokensAppended)
def _tokens(state: SessionState, e: Event, b: TokensAppended) -> None:
    _require_open(state, e)
    start = int(b["start"])
    if start != len(state.tokens):
        raise InvalidEvent(f"tokens.appended at {start} but history length is {len(state.tokens)}")
    vocab = state.engine.get("vocab_size")
    toks = b["tokens"]
    if vocab is not None and any(not 0 <= t < vocab for t in toks):
        raise InvalidEvent("tokens.appended carries an id outside the vocabulary")
    state.tokens.extend(toks)
    for im in b.get("images", ()):
        state.images.append(
            Image(
                int(im["start"]),
                int(im["end"]),
                str(im["mime"]),
                str(im["sha256"]),
                int(im["size"]),
            )
        )


@_on(T.TOKENS_TRUNCATED, TokensTruncated)
def _truncated(state: SessionState, e: Event, b: TokensTruncated) -> None:
    _require_open(state, e)
    keep = [(int(start), int(end)) for start, end in b["keep"]]
    old = state.tokens
    new: array[int] = array("q")
    for start, end in keep:
        if not 0 <= start <= end <= len(old):
            raise InvalidEvent(f"tokens.truncated keeps [{start},{end}) of {len(old)} tokens")
        new.extend(old[start:end])
    state.dropped_tokens += len(old) - len(new)
    state.tokens = new
    state.truncations += 1
    if len(keep) == 1 and keep[0][0] == 0:
        cut = keep[0][1]
        state.images = [im for im in state.images if im.end <= cut]
    else:
        state.images = []


@_on(T.GENERATION_STARTED, GenerationStarted)
def _gen_started(state: SessionState, e: Event, b: GenerationStarted) -> None:
    _require_open(state, e)
    gid = str(b["generation_id"])
    if state.active_generation is not None:
        raise InvalidEvent("generation started while another is running")
    state.generations[gid] = Generation(
        id=gid,
        params=dict(b.get("params", {})),
        prompt_length=int(b.get("prompt_length", len(state.tokens))),
        started_at=e.recorded_at,
        action_id=b.get("action_id"),
    )


def _generation_of(state: SessionState, gid: str | None) -> Generation:
    g = state.generations.get(str(gid))
    if g is None:
        raise InvalidEvent(f"unknown generation {gid!r}")
    if g.finish_reason is not None:
        raise InvalidEvent(f"generation {g.id} already finished")
    return g


@_on(T.GENERATION_TOKEN, GenerationToken)
def _gen_token(state: SessionState, e: Event, b: GenerationToken) -> None:
    _require_open(state, e)
    g = _generation_of(state, b.get("generation_id"))
    if b.get("is_prefill"):
        g.scored += 1
        return
    pos = int(b["position"])
    if pos != len(state.tokens):
        raise InvalidEvent(f"generated token at {pos} but history length is {len(state.tokens)}")
    tok = int(b["token"])
    state.tokens.append(tok)
    g.tokens.append(tok)


@_on(T.GENERATION_FINISHED, GenerationFinished)
def _gen_finished(state: SessionState, e: Event, b: GenerationFinished) -> None:
    _require_open(state, e)
    g = _generation_of(state, b.get("generation_id"))
    g.finish_reason = str(b.get("finish_reason", "unspecified"))
    g.finished_at = e.recorded_at


@_on(T.FEEDBACK, FeedbackRecorded)
def _feedback(state: SessionState, e: Event, b: FeedbackRecorded) -> None:
    state.feedback.append(dict(b))


@_on(T.ERROR, ErrorRecorded)
def _error(state: SessionState, e: Event, b: ErrorRecorded) -> None:
    state.errors.append(dict(b))


@_on(T.WIRE, WireMessage)
def _wire(state: SessionState, e: Event, b: WireMessage) -> None:
    return None


@_on(T.IMAGE_ATTACHED, ImageAttached)
def _image(state: SessionState, e: Event, b: ImageAttached) -> None:
    _require_open(state, e)  # the bytes; tokens.appended places the block


@_on(T.TOOL_CALLED, ToolCalled)
def _tool_called(state: SessionState, e: Event, b: ToolCalled) -> None:
    _require_open(state, e)


@_on(T.TOOL_RESULT, ToolResult)
def _tool_result(state: SessionState, e: Event, b: ToolResult) -> None:
    _require_open(state, e)


@_on(T.NOTE, NoteRecorded)
def _note(state: SessionState, e: Event, b: NoteRecorded) -> None:
    return None


def overlay(st: SessionState) -> SessionState:
    """A scratch view of ``st`` for checking several fragments in a row: the
    node maps are shallow copies; :func:`overlay_apply` copies a node before
    touching it, so ``st`` itself never changes."""
    scratch = copy.copy(st)
    scratch.nodes = dict(st.nodes)
    scratch.parents_of = dict(st.parents_of)
    return scratch


def overlay_apply(
    scratch: SessionState, base: SessionState, fragment: Mapping[str, Any], data: bytes | None
) -> None:
    b = body_as(T.NODE_FRAGMENT, fragment, NodeFragment)
    nid = str(b["id"])
    node = scratch.nodes.get(nid)
    if node is not None and node is base.nodes.get(nid):
        scratch.nodes[nid] = Node(
            id=node.id,
            fragments=dict(node.fragments),
            final_seq=node.final_seq,
            kind=node.kind,
            direction=node.direction,
        )
    for c in b.get("child_ids", ()):
        parents = scratch.parents_of.get(c)
        if parents is not None and parents is base.parents_of.get(c):
            scratch.parents_of[c] = set(parents)
    apply_fragment(scratch, fragment, data)


def fork_state(parent: SessionState, child_id: str, token_position: int | None) -> SessionState:
    """The state a fork starts from: the parent's, cut at ``token_position``."""
    st = parent.copy()
    st.session_id = child_id
    st.version = 0
    st.event_count = 0
    st.head_hash = GENESIS_HASH
    st.status = OPEN
    st.abort = None
    # a generation still running in the parent at the fork point is the parent's: the
    # child keeps its tokens as history but has no generation of its own running (else
    # its first generate would record the parent's as interrupted in the child's log)
    running = st.active_generation
    if running is not None:
        del st.generations[running.id]
    if token_position is not None:
        st.tokens = st.tokens[:token_position]
        st.images = [im for im in st.images if im.end <= token_position]
    return st
