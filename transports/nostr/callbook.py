"""The D4 worker's call state: which calls it recorded, answered and continued.

The worker's memory is bounded (:class:`Lru`); the log is the truth for what
it forgets. :meth:`CallBook.learn` rebuilds the memory from a session's
recorded events (on start, and when a call falls out of memory), and the
handlers update it as they record calls and answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from sessiontape.core.bodies import NoteRecorded, WireMessage, body
from sessiontape.core.errors import InvalidParameters
from sessiontape.core.events import Event, T
from sessiontape.transports.nostr import d4, nip90
from sessiontape.transports.nostr.settings import Settings

FUNCTION_TAG = "d4-function"

_V = TypeVar("_V")


class Lru(OrderedDict[str, _V]):
    """A dict that forgets its least recently written keys beyond ``size``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __setitem__(self, key: str, value: _V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


def call_session_id(call_id: str) -> str:
    return "d4_" + call_id[:48]


def answer_of(payload: Mapping[str, Any]) -> str | None:
    """The call a worker event is the final answer to (result, error, price suggestion), else None."""
    tags = payload.get("tags") or []
    refs = d4.e_refs(tags)
    if not refs:
        return None
    kind = payload.get("kind")
    if kind == nip90.KIND_FEEDBACK:
        return refs[0] if nip90.feedback_status(tags) in ("error", "payment-required") else None
    if kind == nip90.KIND_RESULT:
        return refs[0]
    if kind == 1:
        try:
            partial = d4.parse_object(str(payload.get("content", ""))).get("partial", False)
        except InvalidParameters:
            return None
        return None if partial else refs[0]
    return None


def is_function_event(tags: list[list[str]]) -> bool:
    return FUNCTION_TAG in (t[1] for t in tags if len(t) >= 2 and t[0] == "t")


@dataclass(frozen=True)
class ResultRef:
    """What the worker knows about a result it sent."""

    session_id: str
    call_id: str
    caller: str
    more_results: bool
    final: bool


@dataclass
class CallRef:
    """A call the worker recorded: where it lives, who sent it, whether it has its answer."""

    session_id: str
    caller: str
    answered: bool = False


class CallBook:
    """The worker's bounded memory of calls, results, seen events and unpublished answers."""

    def __init__(self, pubkey: str, settings: Settings) -> None:
        self.pubkey = pubkey
        self.settings = settings
        size = settings.index_size
        self.seen: Lru[None] = Lru(4 * size)
        self.calls: Lru[CallRef] = Lru(size)
        self.results: Lru[ResultRef] = Lru(size)
        #: function name -> the event id it was published as
        self.published: dict[str, str] = {}
        #: answers recorded but not (known to be) taken by a relay: event id -> (session, signed JSON)
        self.unacked: dict[str, tuple[str, dict[str, Any]]] = {}
        #: answers whose publishing gave up, flagged in the worker session so a restart finds
        #: them however old: event id -> session
        self.flagged: dict[str, str] = {}
        self.last_call_at = 0

    def since(self) -> int:
        """The ``since`` for (re-)subscribing: the last recorded call, less the slack."""
        base = self.last_call_at or int(time.time())
        return max(0, base - self.settings.since_slack_s)

    def note_call(self, created_at: int, recorded_at: float) -> None:
        # a client clock ahead of ours must not move ``since`` past calls not yet seen
        self.last_call_at = max(self.last_call_at, min(int(created_at), int(recorded_at)))

    def knows_answer(self, call_id: str) -> bool:
        """Whether memory says ``call_id`` is answered (False may only mean forgotten)."""
        ref = self.calls.get(call_id)
        return ref is not None and ref.answered

    def record_call(self, session_id: str, payload: Mapping[str, Any]) -> None:
        self.calls[str(payload["id"])] = CallRef(session_id, str(payload["pubkey"]))
        self.note_call(int(payload["created_at"]), time.time())

    def mark_answered(self, call_id: str, session_id: str) -> None:
        ref = self.calls.get(call_id)
        if ref is None:
            ref = CallRef(session_id, "")
        ref.answered = True
        self.calls[call_id] = ref

    def record_result(
        self,
        event_id: str,
        session_id: str,
        call_id: str,
        caller: str,
        more_results: bool,
        final: bool,
    ) -> None:
        ref = self.calls.get(call_id)
        self.results[event_id] = ResultRef(
            session_id, call_id, caller or (ref.caller if ref else ""), more_results, final
        )

    def delivered(self, event_id: str) -> None:
        self.unacked.pop(event_id, None)
        self.flagged.pop(event_id, None)

    def learn(self, session_id: str, e: Event) -> None:
        """Take one recorded event of ``session_id`` into memory."""
        if e.type == T.NOTE:
            note = body(e, NoteRecorded)
            if note.get("transport") != "nostr":
                return
            if "published" in note:
                self.delivered(str(note["published"]))
            elif "unpublished" in note:
                self.flagged[str(note["unpublished"])] = str(note.get("session_id", ""))
            return
        if e.type != T.WIRE:
            return
        wire = body(e, WireMessage)
        payload = wire.get("payload")
        if wire.get("transport") != "nostr" or not isinstance(payload, dict):
            return
        eid = str(payload.get("id", ""))
        tags = payload.get("tags") or []
        try:
            obj = d4.parse_object(str(payload.get("content", "")))
        except InvalidParameters:
            obj = {}
        if wire.get("direction") == "in":
            kind = payload.get("kind")
            if kind == nip90.KIND_JOB or (kind == 1 and d4.classify(obj) == d4.CALL):
                # not "seen": a call recorded but not answered (worker stopped mid-way) is resumed
                if eid not in self.calls:
                    self.calls[eid] = CallRef(session_id, str(payload.get("pubkey", "")))
                self.note_call(int(payload.get("created_at", 0)), e.recorded_at)
            else:
                self.seen[eid] = None
            return
        if payload.get("pubkey") != self.pubkey:
            return
        if any(len(t) >= 2 and t[0] == "t" and t[1] == FUNCTION_TAG for t in tags):
            self.published[str(obj.get("name", ""))] = eid
            self.unacked[eid] = (session_id, payload)
            return
        call_id = answer_of(payload)
        if call_id is not None:
            self.mark_answered(call_id, session_id)
            self.unacked[eid] = (session_id, payload)
        refs = d4.e_refs(tags)
        if payload.get("kind") != 1 or not refs or self.settings.negotiate_function_id in refs[1:]:
            return  # feedback, a NIP-90 result or a price suggestion: nothing to continue
        ref = self.calls.get(refs[0])
        self.results[eid] = ResultRef(
            session_id,
            refs[0],
            ref.caller if ref else "",
            bool(obj.get("more_results", False)),
            not obj.get("partial", False),
        )


class _SessionLock:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class SessionLocks:
    """One lock per session with a handler inside or waiting; dropped when the last one leaves."""

    def __init__(self) -> None:
        self.entries: dict[str, _SessionLock] = {}

    @contextlib.asynccontextmanager
    async def hold(self, sid: str) -> AsyncIterator[None]:
        entry = self.entries.get(sid)
        if entry is None:
            entry = self.entries[sid] = _SessionLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self.entries[sid]
