"""Event records and the per-session hash chain.

An event is ``(session_id, version, type, body, data)``: ``body`` is a JSON
object, ``data`` optional raw bytes (inline payloads; large ones are stored
as content-addressed blobs and referenced from the body by sha256). Once
committed it also has a global ``position`` and a ``recorded_at`` time, and a
``hash`` chaining it to the previous event of its session::

    hash = sha256(prev_hash || canonical_json([session_id, version, type,
                                               body, sha256(data)|null,
                                               recorded_at]))

The global position is not hashed: an exported session imported into another
database gets new positions and the same chain. The catalogue of event types
is in docs/events.md; the type names are the constants of :class:`T`.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import orjson

from sessiontape.core.errors import InvalidValue

GENESIS_HASH = "0" * 64


class T:
    """Event type names (docs/events.md describes each body)."""

    SESSION_OPENED = "session.opened"
    SESSION_CLOSED = "session.closed"
    SESSION_ABORTED = "session.aborted"
    SESSION_EXPIRED = "session.expired"
    SESSION_PURGED = "session.purged"
    NODE_FRAGMENT = "node.fragment"
    ACTION_SUBMITTED = "action.submitted"
    ACTION_COMPLETED = "action.completed"
    ACTION_FAILED = "action.failed"
    TOKENS_APPENDED = "tokens.appended"
    TOKENS_TRUNCATED = "tokens.truncated"
    IMAGE_ATTACHED = "image.attached"
    GENERATION_STARTED = "generation.started"
    GENERATION_TOKEN = "generation.token"
    GENERATION_FINISHED = "generation.finished"
    TOOL_CALLED = "tool.called"
    TOOL_RESULT = "tool.result"
    FEEDBACK = "feedback.recorded"
    ERROR = "error.recorded"
    WIRE = "wire.message"
    NOTE = "note.recorded"


#: event types whose bodies the engine fills (logprobs may be -inf): not client input, not checked
UNCHECKED_TYPES = frozenset({T.GENERATION_TOKEN})


class _NewEventFields(NamedTuple):
    type: str
    body: Mapping[str, Any]
    data: bytes | None
    #: the body's canonical JSON, encoded once when the event is made: it is
    #: what the writer hashes and stores (a later change to ``body`` is not)
    body_json: str


class NewEvent(_NewEventFields):
    """An event to append: the caller's part, before the log numbers it.

    Its body is checked and encoded on construction (:func:`encode_body`), so
    a value the log cannot store exactly raises InvalidValue before anything
    is queued, and the writer never encodes it again. Immutable (a tuple).
    """

    __slots__ = ()

    def __new__(
        cls, type: str, body: Mapping[str, Any] | None = None, data: bytes | None = None
    ) -> NewEvent:
        if body is None:
            body = {}
        if data is not None and not isinstance(data, bytes):
            raise InvalidValue(f"event data must be bytes, got {builtins.type(data).__name__}")
        encoded = canonical_json(body) if type in UNCHECKED_TYPES else encode_body(body)
        return tuple.__new__(cls, (type, body, data, encoded))

    def __repr__(self) -> str:
        return f"NewEvent(type={self.type!r}, body={self.body!r}, data={self.data!r})"

    def __getnewargs__(self) -> tuple[str, Mapping[str, Any], bytes | None]:
        # copy and pickle make it again from its parts (checked and encoded again)
        return (self.type, self.body, self.data)

    def _replace(self, **changes: Any) -> NewEvent:
        """A changed copy, checked and encoded again (the tuple's own would keep
        the old ``body_json``)."""
        if "body_json" in changes:
            raise TypeError("body_json follows from body; replace body instead")
        parts = {"type": self.type, "body": self.body, "data": self.data, **changes}
        return NewEvent(parts["type"], parts["body"], parts["data"])


def check_body(body: Any) -> None:
    """Raise InvalidValue unless ``body`` stores as strict JSON, unchanged."""
    encode_body(body)


def encode_body(body: Any) -> str:
    """``body``'s canonical JSON; InvalidValue unless it stores as strict JSON, unchanged.

    Refused: NaN and infinities (the encoder would write ``null``), integers
    outside 64 bits, strings with lone surrogates, nesting beyond the
    encoder's limit. Reading old logs never calls this.
    """
    try:
        out: bytes | None = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError as exc:
        if "not JSON serializable" not in str(exc):
            raise InvalidValue(f"value cannot be stored as JSON: {exc}") from None
        out = None  # a type orjson does not know: canonical_json falls back to the standard library
    # (find, not ``in``: bytes.__contains__ first tries its argument as an int
    # and raises and clears a TypeError, 0.6 us against 0.25 on the write path)
    if out is None or out.find(b"null") != -1:
        # orjson writes NaN as null: only then is the slower strict check needed
        try:
            json.dumps(body, allow_nan=False, default=str)
        except ValueError as exc:
            raise InvalidValue(
                f"value cannot be stored as JSON: {exc} (NaN and infinities are refused)"
            ) from None
        except RecursionError:
            raise InvalidValue("value is nested too deeply to store") from None
    return canonical_json(body) if out is None else out.decode()


class Event(NamedTuple):
    """A committed event, as read back from the log (immutable: a tuple)."""

    position: int
    session_id: str
    version: int
    type: str
    body: Mapping[str, Any]
    data: bytes | None
    recorded_at: float
    hash: str
    prev_hash: str

    def to_json(self) -> dict[str, Any]:
        """The NDJSON export line (``data`` as hex when present)."""
        return {
            "position": self.position,
            "session_id": self.session_id,
            "version": self.version,
            "type": self.type,
            "body": self.body,
            "data": None if self.data is None else self.data.hex(),
            "recorded_at": self.recorded_at,
            "hash": self.hash,
            "prev_hash": self.prev_hash,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Event:
        data = obj.get("data")
        return cls(
            position=int(obj["position"]),
            session_id=str(obj["session_id"]),
            version=int(obj["version"]),
            type=str(obj["type"]),
            body=dict(obj["body"]),
            data=None if data is None else bytes.fromhex(data),
            recorded_at=float(obj["recorded_at"]),
            hash=str(obj["hash"]),
            prev_hash=str(obj["prev_hash"]),
        )


_FALLBACK = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode
_STRING = json.JSONEncoder(ensure_ascii=False).encode


def canonical_json(value: Any) -> str:
    """The canonical text of a JSON value: what is stored and what is hashed.

    orjson with sorted keys (compact, UTF-8, shortest float repr; NaN and
    infinities would become null, which is why :class:`NewEvent` refuses them
    up front). Integers beyond 64 bits, which orjson refuses (new events may
    not carry them; old logs may), fall back to the standard library with the
    same key order and separators: still a pure function of the value.
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except (orjson.JSONEncodeError, TypeError):
        return _FALLBACK(value)


def parse_json(text: str | bytes) -> Any:
    return orjson.loads(text)


def chain_hash(
    prev_hash: str,
    session_id: str,
    version: int,
    type_: str,
    body: Mapping[str, Any],
    data: bytes | None,
    recorded_at: float,
) -> str:
    return chain_hash_json(
        prev_hash, session_id, version, type_, canonical_json(body), data, recorded_at
    )


def chain_hash_json(
    prev_hash: str,
    session_id: str,
    version: int,
    type_: str,
    body_json: str,
    data: bytes | None,
    recorded_at: float,
) -> str:
    """:func:`chain_hash` with the body already in canonical JSON (the write path
    encodes each body once, for both the hash and the stored column)."""
    data_digest = "null" if data is None else '"' + hashlib.sha256(data).hexdigest() + '"'
    payload = (
        f"[{_dumps(session_id)},{int(version)},{_dumps(type_)},{body_json},{data_digest},"
        f"{_STRING(repr(recorded_at))}]"
    )
    return hashlib.sha256((prev_hash + payload).encode()).hexdigest()


#: ``hasher(prev_hash, version, type_, body_json, data) -> hash``
Hasher = Callable[[str, int, str, str, bytes | None], str]


def chain_hasher(session_id: str, recorded_at: float) -> Hasher:
    """:func:`chain_hash_json` for many events of one session recorded at one time
    (one append): the parts they share are encoded once.

    ``hasher(prev_hash, version, type_, body_json, data) -> hash``, ``version`` an
    ``int`` (not a subclass: it is formatted as it is)
    """
    return chain_hashers(recorded_at)(session_id)


def chain_hashers(recorded_at: float) -> Callable[[str], Hasher]:
    """:func:`chain_hasher` of each session of one commit (one time, encoded once)."""
    at = _STRING(repr(recorded_at)) + "]"
    tail_no_data = ",null," + at
    sha256 = hashlib.sha256

    def for_session(session_id: str) -> Hasher:
        head = "[" + _dumps(session_id) + ","

        def hasher(
            prev_hash: str, version: int, type_: str, body_json: str, data: bytes | None
        ) -> str:
            # one f-string, as few calls as can be: this runs once per event appended
            if data is None:
                payload = f"{prev_hash}{head}{version},{_dumps(type_)},{body_json}{tail_no_data}"
            else:
                digest = sha256(data).hexdigest()
                payload = f'{prev_hash}{head}{version},{_dumps(type_)},{body_json},"{digest}",{at}'
            return sha256(payload.encode()).hexdigest()

        return hasher

    return for_session


@functools.lru_cache(maxsize=65536)
def _dumps(s: str) -> str:
    return _STRING(s)


def event_hash(e: Event) -> str:
    return chain_hash(e.prev_hash, e.session_id, e.version, e.type, e.body, e.data, e.recorded_at)
