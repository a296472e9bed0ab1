"""The sessions list ``{"sessions": {id: summary}}``, folded from events (the
viewer's list feed)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sessiontape.core.bodies import SessionOpened, body
from sessiontape.core.document.schema import Doc
from sessiontape.core.events import Event, T


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
    }


class SessionListBuilder:
    """The sessions list ``{"sessions": {id: summary}}``, kept live by folding events.

    Only what changes rarely is tracked (open, end, generating), so a list
    watcher gets a patch per session change, not per token.
    """

    def __init__(self, rows: Iterable[Mapping[str, Any]] = ()) -> None:
        self.doc: Doc = {"sessions": {r["id"]: session_summary(r) for r in rows}}
        self.position = 0

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
        return self.doc
