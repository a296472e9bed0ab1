"""The sessions list ``{"sessions": {id: summary}}``, folded from events (the
viewer's list feed).

Each summary carries a ``preview`` of what the session is about, so that a list of
chats can be told apart: the first user message of its first OpenAI request, else
the text of its first input (decoded with ``detokenize``, when the list has one),
whitespace folded and cut at :data:`PREVIEW_CHARS`. The session's label, when it
has one, is shown beside it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sessiontape.core.bodies import SessionOpened, TokensAppended, body
from sessiontape.core.document.conversation import openai_request, request_messages
from sessiontape.core.document.schema import Doc
from sessiontape.core.document.text import Detokenize
from sessiontape.core.events import Event, T

#: the longest preview, in characters (an ellipsis marks a cut one)
PREVIEW_CHARS = 120
#: the events a preview is found in: a chat session's request is recorded by its
#: fourth (opened, appended, started, wire.message)
PREVIEW_EVENTS = 8


def preview_text(text: str) -> str:
    """``text`` as a one-line preview: whitespace folded, cut at :data:`PREVIEW_CHARS`."""
    line = re.sub(r"\s+", " ", text).strip()
    return line if len(line) <= PREVIEW_CHARS else line[: PREVIEW_CHARS - 1].rstrip() + "…"


def chat_preview(e: Event) -> str | None:
    """The first user message of the OpenAI request ``e`` recorded (None for another
    event, or a request without one)."""
    payload = openai_request(e) if e.type == T.WIRE else None
    request = None if payload is None else payload.get("request")
    if not isinstance(request, Mapping):
        return None
    users = [text for role, text in request_messages(request) if role == "user" and text.strip()]
    return preview_text(users[0]) if users else None


def input_preview(e: Event, detokenize: Detokenize | None) -> str | None:
    """The text of the input ``e`` appended (None without ``detokenize`` or text)."""
    if e.type != T.TOKENS_APPENDED or detokenize is None:
        return None
    head = body(e, TokensAppended)["tokens"][: 2 * PREVIEW_CHARS]  # more than a preview shows
    text = preview_text(detokenize([int(t) for t in head]).rstrip("\ufffd"))
    return text or None


def preview_of(events: Sequence[Event], detokenize: Detokenize | None = None) -> str:
    """A session's preview from its first events (:data:`PREVIEW_EVENTS` of them do)."""
    found = ""
    for e in events:
        chat = chat_preview(e)
        if chat:
            return chat
        found = found or input_preview(e, detokenize) or ""
    return found


def session_summary(row: Mapping[str, Any]) -> dict[str, Any]:
    """A sessions-list entry from a sessions-index row (``SessionRow.to_json()``)."""
    return {
        "id": row["id"],
        "protocol": row["protocol"],
        "status": row["status"],
        "label": row["label"],
        "parent_id": row.get("parent_id"),
        "model_id": row.get("model_id", ""),
        "created_at": row["created_at"],
        "generating": bool(row.get("generating", False)),
        "preview": str(row.get("preview") or ""),
    }


class SessionListBuilder:
    """The sessions list ``{"sessions": {id: summary}}``, kept live by folding events.

    Only what changes rarely is tracked (open, end, generating), so a list
    watcher gets a patch per session change, not per token.
    """

    def __init__(
        self, rows: Iterable[Mapping[str, Any]] = (), detokenize: Detokenize | None = None
    ) -> None:
        self.doc: Doc = {"sessions": {r["id"]: session_summary(r) for r in rows}}
        self.position = 0
        self.detokenize = detokenize
        #: sessions whose preview is a chat message (an input's text gives way to one)
        self._chats: set[str] = {
            sid for sid, summary in self.doc["sessions"].items() if summary["preview"]
        }

    def _set(self, sid: str, **changes: Any) -> None:
        cur = self.doc["sessions"].get(sid)
        if cur is None or all(cur.get(k) == v for k, v in changes.items()):
            return
        sessions = dict(self.doc["sessions"])
        sessions[sid] = {**cur, **changes}
        self.doc = {**self.doc, "sessions": sessions}

    def apply(self, e: Event) -> Doc:
        self.position = max(self.position, e.position)
        t = e.type
        if t == T.SESSION_OPENED:
            if e.session_id not in self.doc["sessions"]:
                b = body(e, SessionOpened)
                parent = b.get("parent")
                engine = b.get("engine")
                entry = session_summary(
                    {
                        "id": e.session_id,
                        "protocol": b.get("protocol", ""),
                        "status": "open",
                        "label": b.get("label", ""),
                        "parent_id": None if not parent else parent.get("session_id"),
                        "model_id": "" if not engine else engine.get("model_id", ""),
                        "created_at": e.recorded_at,
                    }
                )
                self.doc = {**self.doc, "sessions": {**self.doc["sessions"], e.session_id: entry}}
        elif t in (T.SESSION_CLOSED, T.SESSION_ABORTED, T.SESSION_EXPIRED, T.SESSION_PURGED):
            self._set(e.session_id, status=t.split(".", 1)[1], generating=False)
        elif t == T.GENERATION_STARTED:
            self._set(e.session_id, generating=True)
        elif t == T.GENERATION_FINISHED:
            self._set(e.session_id, generating=False)
        elif t in (T.WIRE, T.TOKENS_APPENDED) and e.session_id not in self._chats:
            self._preview(e)
        return self.doc

    def _preview(self, e: Event) -> None:
        cur = self.doc["sessions"].get(e.session_id)
        if cur is None:
            return
        chat = chat_preview(e)
        if chat:
            self._chats.add(e.session_id)
            self._set(e.session_id, preview=chat)
        elif not cur["preview"] and (text := input_preview(e, self.detokenize)):
            self._set(e.session_id, preview=text)
