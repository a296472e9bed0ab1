"""The schema of every event body: one read-only TypedDict per event type.

An event's body is stored as canonical JSON and read back as a dict; these
types say, for the type checker, which keys each kind has and what they
hold, so a misspelt key or a wrong value type is found by ``mypy`` (strict,
in ``scripts/check``), not at run time. ``ReadOnly`` keys make a body
immutable to the checker, as a committed event is.

(Annotations here are evaluated, not postponed, so the runtime knows which
keys are required: tests/core/test_bodies.py checks real bodies against them.)

Why typed dicts and not a dataclass per event: a body is a JSON object in
the log, the export and on several wires, and the fold reads about two
million of them a second (``bench/bench_log.py``). A typed dict is the dict
itself, so typing costs nothing at run time and old logs load unchanged;
constructing an object per event would not be free on the token path.

Usage::

    from sessiontape.core.bodies import body
    b = body(e, GenerationToken)     # e.type must be "generation.token"
    b["token"], b["position"]        # checked keys and types

``BODIES`` maps each type name to its body type (docs/events.md is checked
against it by tests/core/test_bodies.py); ``SCHEMA_VERSION`` is the version
of these body shapes, raised (with a migration) when one changes.
"""

from collections.abc import Mapping
from typing import Any, Literal, NotRequired, Protocol, TypeVar, cast

from typing_extensions import ReadOnly, TypedDict

from sessiontape.core.events import T

SCHEMA_VERSION = 1


# -- session lifecycle -----------------------------------------------------


class EngineBinding(TypedDict):
    engine: ReadOnly[str]
    model_id: ReadOnly[str]
    model_hash: ReadOnly[str]
    provider: ReadOnly[str]
    runtime_version: ReadOnly[str]
    vocab_size: ReadOnly[int]
    max_length: ReadOnly[int]
    # an imported model's origin (engines/models): the source file's or folder's sha256, the
    # tokenizer's and the chat template's, and the weights' dtype
    source_sha256: NotRequired[ReadOnly[str]]
    tokenizer_sha256: NotRequired[ReadOnly[str]]
    chat_template_sha256: NotRequired[ReadOnly[str]]
    dtype: NotRequired[ReadOnly[str]]


class ForkPoint(TypedDict):
    session_id: ReadOnly[str]
    version: ReadOnly[int]
    token_position: ReadOnly[int | None]


SessionMode = Literal["offset", "append_only"]


class SessionOpened(TypedDict):
    protocol: ReadOnly[str]
    mode: ReadOnly[SessionMode]
    label: ReadOnly[str]
    eos_token_ids: ReadOnly[list[int]]
    ttl_s: ReadOnly[float | None]
    engine: ReadOnly[EngineBinding]
    meta: ReadOnly[dict[str, Any]]
    parent: ReadOnly[ForkPoint | None]


class SessionClosed(TypedDict):
    reason: ReadOnly[str]


class SessionAborted(TypedDict):
    code: ReadOnly[str]
    message: ReadOnly[str]


class SessionExpired(TypedDict):
    idle_s: ReadOnly[float]


class SessionPurged(TypedDict):
    reason: ReadOnly[str]
    through_version: ReadOnly[int]
    last_hash: ReadOnly[str]


# -- Evergreen content -----------------------------------------------------


class ChunkInfo(TypedDict):
    metadata: ReadOnly[dict[str, Any] | None]
    ref: ReadOnly[str | None]


class NodeFragment(TypedDict):
    direction: ReadOnly[Literal["in", "out"]]
    id: ReadOnly[str]
    seq: ReadOnly[int]
    continued: ReadOnly[bool]
    child_ids: ReadOnly[list[str]]
    chunk: ReadOnly[ChunkInfo | None]


class NamedNode(TypedDict):
    name: ReadOnly[str]
    id: ReadOnly[str]


class ActionSubmitted(TypedDict):
    action_id: ReadOnly[str]
    name: ReadOnly[str]
    inputs: ReadOnly[list[NamedNode]]
    outputs: ReadOnly[list[NamedNode]]
    target: ReadOnly[str]
    configs: ReadOnly[list[Any]]
    #: who submitted it: absent or ``in`` for the client, ``out`` for the server (an
    #: Evergreen tool call the model made, sent to the client to run)
    direction: NotRequired[ReadOnly[Literal["in", "out"]]]


class ActionCompleted(TypedDict):
    action_id: ReadOnly[str]


class ActionFailed(TypedDict):
    action_id: ReadOnly[str]
    code: ReadOnly[str]
    message: ReadOnly[str]


# -- token history ---------------------------------------------------------


class ImageSpan(TypedDict):
    start: ReadOnly[int]
    end: ReadOnly[int]
    mime: ReadOnly[str]
    sha256: ReadOnly[str]
    size: ReadOnly[int]


class TokensAppended(TypedDict):
    start: ReadOnly[int]
    tokens: ReadOnly[list[int]]
    images: ReadOnly[list[ImageSpan]]


class ImageAttached(TypedDict):
    sha256: ReadOnly[str]
    mime: ReadOnly[str]
    size: ReadOnly[int]


class TokensTruncated(TypedDict):
    reason: ReadOnly[Literal["rewind", "sink_window"]]
    keep: ReadOnly[list[list[int]]]
    dropped: ReadOnly[int]
    sink: NotRequired[ReadOnly[int]]
    window: NotRequired[ReadOnly[int]]


# -- generation ------------------------------------------------------------


class RecordedConstraint(TypedDict):
    kind: ReadOnly[Literal["json_schema", "json_object", "regex", "grammar"]]
    #: the canonical text: a schema's canonical JSON, the regex, the Lark grammar
    text: ReadOnly[str]
    sha256: ReadOnly[str]
    #: the absolute position the constrained text begins at (null: the generation's start)
    start: ReadOnly[int | None]


class RecordedParams(TypedDict):
    max_tokens: ReadOnly[int]
    temperature: ReadOnly[float]
    top_p: ReadOnly[float]
    top_k: ReadOnly[int]
    #: a decimal string: seeds may exceed 2**53
    seed: ReadOnly[str | None]
    stop_token_ids: ReadOnly[list[int]]
    #: the constraint the output was generated under (core/constraint.py), when any
    constraint: NotRequired[ReadOnly[RecordedConstraint]]
    #: the penalties, recorded (all four) where they act
    repetition_penalty: NotRequired[ReadOnly[float]]
    frequency_penalty: NotRequired[ReadOnly[float]]
    presence_penalty: NotRequired[ReadOnly[float]]
    penalty_last_n: NotRequired[ReadOnly[int]]
    #: recorded where it is above 0
    min_p: NotRequired[ReadOnly[float]]


class RecordedOptions(TypedDict):
    logprob_top_k: ReadOnly[int]
    logprob_ranges: ReadOnly[list[list[int]]]
    readout_ranges: ReadOnly[list[list[int]]]
    generated_logprobs: ReadOnly[bool]


class GenerationStarted(TypedDict):
    generation_id: ReadOnly[str]
    params: ReadOnly[RecordedParams]
    options: ReadOnly[RecordedOptions]
    prompt_length: ReadOnly[int]
    priority: ReadOnly[int]
    action_id: ReadOnly[str | None]


class GenerationToken(TypedDict):
    generation_id: ReadOnly[str]
    token: ReadOnly[int]
    position: ReadOnly[int]
    is_prefill: ReadOnly[bool]
    #: seconds since the generation started
    t: ReadOnly[float]
    logprob: NotRequired[ReadOnly[float | None]]
    #: ``[[token id, logprob], ...]``
    top: NotRequired[ReadOnly[list[list[float]]]]
    readout: NotRequired[ReadOnly[list[float]]]


FinishReason = Literal["eos", "stop", "length", "cancelled", "aborted", "error", "interrupted"]


class GenerationFinished(TypedDict):
    generation_id: ReadOnly[str]
    finish_reason: ReadOnly[FinishReason]
    prompt_tokens: ReadOnly[int]
    completion_tokens: ReadOnly[int]
    prefill_s: ReadOnly[float | None]
    total_s: ReadOnly[float | None]
    ttft_s: ReadOnly[float | None]
    #: true when the generation ended (``length``) before its constraint was complete
    constraint_incomplete: NotRequired[ReadOnly[bool]]


# -- tools -------------------------------------------------------------------


class ToolCalled(TypedDict):
    """A function call: one the model made (``supplied_by: "model"``, with the
    generation and the token span ``[start, end)`` its JSON came from), or one a
    client's request brought in its history (``"client"``, no generation)."""

    call_id: ReadOnly[str]
    name: ReadOnly[str]
    #: the arguments as JSON text, as generated (or as the client sent them)
    arguments: ReadOnly[str]
    generation_id: ReadOnly[str | None]
    span: ReadOnly[list[int] | None]
    supplied_by: ReadOnly[Literal["model", "client"]]


class ToolResult(TypedDict):
    """What a call returned, as whoever ran it supplied it (``supplied_by``)."""

    call_id: ReadOnly[str]
    name: ReadOnly[str | None]
    content: ReadOnly[str]
    supplied_by: ReadOnly[str]


# -- other -----------------------------------------------------------------


class FeedbackRecorded(TypedDict, total=False):
    """Free-form; these keys are the ones the transports write."""

    score: ReadOnly[float]
    source: ReadOnly[str]
    target: ReadOnly[str]
    version: ReadOnly[int]


class ErrorRecorded(TypedDict):
    code: ReadOnly[str]
    message: ReadOnly[str]
    generation_id: NotRequired[ReadOnly[str]]


class WireMessage(TypedDict):
    transport: ReadOnly[str]
    direction: ReadOnly[Literal["in", "out"]]
    payload: ReadOnly[Any]


class NoteRecorded(TypedDict, total=False):
    """Free-form; these keys are the ones the Nostr worker writes (its delivery
    notes: an event it ``published`` to ``relays``, or one it could not and
    for which ``session_id``)."""

    transport: ReadOnly[str]
    published: ReadOnly[str]
    relays: ReadOnly[list[str]]
    unpublished: ReadOnly[str]
    session_id: ReadOnly[str]


BODIES: Mapping[str, type] = {
    T.SESSION_OPENED: SessionOpened,
    T.SESSION_CLOSED: SessionClosed,
    T.SESSION_ABORTED: SessionAborted,
    T.SESSION_EXPIRED: SessionExpired,
    T.SESSION_PURGED: SessionPurged,
    T.NODE_FRAGMENT: NodeFragment,
    T.ACTION_SUBMITTED: ActionSubmitted,
    T.ACTION_COMPLETED: ActionCompleted,
    T.ACTION_FAILED: ActionFailed,
    T.TOKENS_APPENDED: TokensAppended,
    T.TOKENS_TRUNCATED: TokensTruncated,
    T.IMAGE_ATTACHED: ImageAttached,
    T.GENERATION_STARTED: GenerationStarted,
    T.GENERATION_TOKEN: GenerationToken,
    T.GENERATION_FINISHED: GenerationFinished,
    T.TOOL_CALLED: ToolCalled,
    T.TOOL_RESULT: ToolResult,
    T.FEEDBACK: FeedbackRecorded,
    T.ERROR: ErrorRecorded,
    T.WIRE: WireMessage,
    T.NOTE: NoteRecorded,
}

B = TypeVar("B")


class HasBody(Protocol):
    """What the accessors read: an :class:`~sessiontape.core.events.Event` or a
    :class:`~sessiontape.core.events.NewEvent`."""

    @property
    def type(self) -> str: ...

    @property
    def body(self) -> Mapping[str, Any]: ...


def body(e: HasBody, kind: type[B]) -> B:
    """``e``'s body as ``kind`` (the body type registered for ``e.type``).

    Raises TypeError when ``kind`` is not ``e.type``'s body type: the check is
    one dict lookup, the body itself is not copied or validated (the log
    validated it when it was written).
    """
    if BODIES.get(e.type) is not kind:
        raise TypeError(f"a {e.type} event's body is not a {getattr(kind, '__name__', kind)}")
    return e.body  # type: ignore[return-value]  # the cast, without cast()'s call


def body_as(type_name: str, b: Mapping[str, Any], kind: type[B]) -> B:
    """:func:`body` for a body held apart from its event (``type_name`` is the event's type)."""
    if BODIES.get(type_name) is not kind:
        raise TypeError(f"a {type_name} event's body is not a {getattr(kind, '__name__', kind)}")
    return b  # type: ignore[return-value]


def session_purged(reason: str, through_version: int, last_hash: str) -> SessionPurged:
    """The one place a ``session.purged`` tombstone's body is built (by the log's
    writer, which knows the purged head inside the purge's transaction)."""
    return {"reason": reason, "through_version": through_version, "last_hash": last_hash}


def session_opened(
    *,
    protocol: str,
    mode: SessionMode,
    label: str,
    eos_token_ids: list[int],
    ttl_s: float | None,
    engine: EngineBinding,
    meta: dict[str, Any],
    parent: ForkPoint | None,
) -> SessionOpened:
    """The one place a ``session.opened`` body is built (a new session and a fork)."""
    return {
        "protocol": protocol,
        "mode": mode,
        "label": label,
        "eos_token_ids": eos_token_ids,
        "ttl_s": ttl_s,
        "engine": engine,
        "meta": meta,
        "parent": parent,
    }


def tokens_truncated(
    reason: Literal["rewind", "sink_window"],
    keep: list[list[int]],
    dropped: int,
    sink_window: tuple[int, int] | None = None,
) -> TokensTruncated:
    """The one place a ``tokens.truncated`` body is built: a rewind (Salience's offset
    moving back) or Kakeya's sink+window truncation (which records ``sink``/``window``)."""
    out: TokensTruncated = {"reason": reason, "keep": keep, "dropped": dropped}
    if sink_window is not None:
        out = {**out, "sink": sink_window[0], "window": sink_window[1]}
    return out


# -- readers of a key several event types share ---------------------------------
#
# Each is a type test and one dict read: no object is built per event.


class _WithGenerationId(TypedDict):
    generation_id: NotRequired[ReadOnly[str]]


class _WithActionId(TypedDict):
    action_id: ReadOnly[str]


#: the types whose body may name a generation (``error.recorded`` optionally)
GENERATION_ID_TYPES = frozenset(
    {T.GENERATION_STARTED, T.GENERATION_TOKEN, T.GENERATION_FINISHED, T.ERROR}
)
#: the types whose body names an action
ACTION_ID_TYPES = frozenset({T.ACTION_SUBMITTED, T.ACTION_COMPLETED, T.ACTION_FAILED})


def generation_id_of(e: HasBody) -> str | None:
    """The generation ``e`` belongs to: ``generation.*`` events, and an
    ``error.recorded`` that names one; None for any other event."""
    if e.type not in GENERATION_ID_TYPES:
        return None
    return cast(_WithGenerationId, e.body).get("generation_id")


def action_id_of(e: HasBody) -> str:
    """The action an ``action.*`` event is about (TypeError for another type)."""
    if e.type not in ACTION_ID_TYPES:
        raise TypeError(f"a {e.type} event names no action")
    return cast(_WithActionId, e.body)["action_id"]


def generated_token(e: HasBody) -> int | None:
    """The token id of a generated ``generation.token`` (not a scored prompt
    position); None for any other event."""
    if e.type != T.GENERATION_TOKEN:
        return None
    b = cast(GenerationToken, e.body)
    return None if b.get("is_prefill") else b["token"]


def fork_point(e: HasBody) -> ForkPoint | None:
    """The parent a ``session.opened`` names (a fork); None for a session that
    is not a fork, or any other event."""
    if e.type != T.SESSION_OPENED:
        return None
    return cast(SessionOpened, e.body).get("parent")
