"""The session document: one JSON view of a session, folded from its events.

Every transport that shows a session as JSON (the HTTP API, the SSE patch
streams, the replay viewer) uses this one view. :class:`DocumentBuilder`
folds events one at a time with the core fold (:func:`core.state.apply`,
so the document can never disagree with the runtime's state) and keeps the
document immutable between events: ``apply`` returns a new root that shares
every unchanged subtree with the previous one, so ``diff(before, after)``
costs what changed, not the document's size. The schema is described in
docs/protocols/session-document.md.

Usage::

    b = DocumentBuilder(sid, detokenize=engine.detokenize)
    for e in events:
        before, after = b.doc, b.apply(e)
        send(diff(before, after))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from core.events import GENESIS_HASH, Event, T, event_hash
from core.state import Node, SessionState, apply

Detokenize = Callable[[Sequence[int]], str]
Doc = dict[str, Any]

SCHEMA = "sessiontape.session/1"
TERMINAL = frozenset({"closed", "aborted", "expired", "purged"})
_TEXTUAL = ("text/", "application/json", "application/x-ndjson", "application/xml")


def _is_text(mimetype: str) -> bool:
    return mimetype.startswith(_TEXTUAL) or mimetype.endswith(("+json", "+xml"))


def empty_document(session_id: str) -> Doc:
    return {
        "schema": SCHEMA,
        "id": session_id,
        "version": 0,
        "status": "open",
        "protocol": "",
        "mode": "offset",
        "label": "",
        "engine": {},
        "meta": {},
        "ttl_s": None,
        "eos_token_ids": [],
        "created_at": None,
        "updated_at": None,
        "end": None,
        "parent": None,
        "children": [],
        "history": {"ids": [], "text": None, "segments": [], "images": [], "truncations": 0, "dropped": 0},
        "nodes": {},
        "roots": [],
        "actions": [],
        "generations": [],
        "active_generation": None,
        "feedback": [],
        "errors": [],
        "audit": {"chain": "verified", "head_hash": GENESIS_HASH, "error": None},
    }


class DocumentBuilder:
    """Folds events into the session document; ``doc`` is the current one.

    ``base`` is the state a fork starts from (``core.state.fork_state`` of
    the parent at the fork point): its history and nodes are inherited.
    Events of other sessions are ignored except a ``session.opened`` that
    names this session as parent, which adds a child (fork) entry.
    """

    def __init__(self, session_id: str, *, detokenize: Detokenize | None = None,
                 base: SessionState | None = None) -> None:
        self.session_id = session_id
        self.detokenize = detokenize
        self.state = base if base is not None else SessionState(session_id)
        #: log position of the last event that went into ``doc`` (0: none)
        self.position = 0
        self._gen_index: dict[str, int] = {}
        self._action_index: dict[str, int] = {}
        self._head = GENESIS_HASH
        doc = empty_document(session_id)
        if base is not None and (base.tokens or base.nodes):
            ids = list(base.tokens)
            doc["history"] = {
                **doc["history"], "ids": ids, "text": self._text(ids),
                "segments": [{"source": "inherited", "start": 0, "text": self._text(ids)}] if ids else [],
                "images": [self._image(im) for im in base.images],
            }
            doc["nodes"] = {nid: self._node(n) for nid, n in base.nodes.items()}
            doc["roots"] = self._roots()
        self.doc: Doc = doc

    # -- helpers -----------------------------------------------------------

    def _text(self, ids: Sequence[int]) -> str | None:
        return None if self.detokenize is None else self.detokenize(ids)

    @staticmethod
    def _image(im: Any) -> dict[str, Any]:
        return {"start": im.start, "end": im.end, "mime": im.mime, "sha256": im.sha256, "size": im.size}

    def _node(self, n: Node) -> dict[str, Any]:
        meta = dict(n.metadata or {})
        mimetype = str(meta.get("mimetype", ""))
        data = n.data() if n.kind == "leaf" else b""
        text = data.decode("utf-8", "replace") if n.kind == "leaf" and n.ref is None and _is_text(mimetype) else None
        return {
            "id": n.id, "kind": n.kind, "direction": n.direction, "mimetype": mimetype,
            "role": str(meta.get("role", "")), "metadata": meta, "children": n.child_ids,
            "ref": n.ref, "text": text, "size": len(data), "complete": n.fragments_complete,
            "fragments": len(n.fragments),
        }

    def _roots(self) -> list[str]:
        return [nid for nid in self.state.nodes if not self.state.parents_of.get(nid)]

    def _token(self, b: Mapping[str, Any], at: float) -> dict[str, Any]:
        tok = int(b["token"])
        top = [{"id": int(i), "text": self._text([int(i)]), "logprob": lp} for i, lp in b.get("top", ())]
        return {"id": tok, "position": int(b["position"]), "text": self._text([tok]),
                "logprob": b.get("logprob"), "top": top, "readout": b.get("readout"),
                "t": b.get("t"), "at": at}

    def _history(self, doc: Doc, **changes: Any) -> None:
        h = dict(doc["history"])
        h.update(changes)
        if "ids" in changes:
            h["text"] = self._text(h["ids"])
        doc["history"] = h

    def _set_in_list(self, doc: Doc, key: str, index: int, **changes: Any) -> dict[str, Any]:
        items = list(doc[key])
        item = dict(items[index])
        item.update(changes)
        items[index] = item
        doc[key] = items
        return item

    def _audit(self, doc: Doc, e: Event) -> None:
        expected = e.prev_hash if (self.state.version == 0 and e.type == T.SESSION_PURGED) else self._head
        audit = doc["audit"]
        if audit["chain"] == "verified":
            if e.prev_hash != expected:
                audit = {"chain": "broken", "head_hash": e.hash,
                         "error": f"v{e.version}: prev_hash does not match the previous event"}
            elif event_hash(e) != e.hash:
                audit = {"chain": "broken", "head_hash": e.hash,
                         "error": f"v{e.version}: hash does not match the event's content"}
            else:
                audit = {**audit, "head_hash": e.hash}
        else:
            audit = {**audit, "head_hash": e.hash}
        self._head = e.hash
        doc["audit"] = audit

    # -- the fold ----------------------------------------------------------

    def apply(self, e: Event) -> Doc:
        """Fold ``e``; returns the new document (the old one is left as it was).

        Raises :class:`core.errors.InvalidEvent` if ``e`` cannot follow
        (the document is then unchanged).
        """
        if e.session_id != self.session_id:
            parent = e.body.get("parent") if e.type == T.SESSION_OPENED else None
            if not parent or parent.get("session_id") != self.session_id:
                return self.doc
            doc = dict(self.doc)
            doc["children"] = [*doc["children"], {
                "session_id": e.session_id, "version": parent.get("version"),
                "token_position": parent.get("token_position"), "created_at": e.recorded_at,
                "position": e.position}]
            self.doc = doc
            self.position = max(self.position, e.position)
            return doc
        st = self.state
        if st.version == 0 and e.type == T.SESSION_PURGED:
            st.version = e.version - 1  # a tombstone stands in for the purged events
        prev_len = len(st.tokens)
        apply(st, e)
        doc = dict(self.doc)
        doc["version"] = e.version
        doc["updated_at"] = e.recorded_at
        self._audit(doc, e)
        handler = _HANDLERS.get(e.type)
        if handler is not None:
            handler(self, doc, e, prev_len)
        self.doc = doc
        self.position = max(self.position, e.position)
        return doc

    def apply_all(self, events: Iterable[Event]) -> Doc:
        for e in events:
            self.apply(e)
        return self.doc

    # -- per event type ----------------------------------------------------

    def _opened(self, doc: Doc, e: Event, _: int) -> None:
        st = self.state
        doc.update(status=st.status, protocol=st.protocol, mode=st.mode, label=st.label,
                   engine=dict(st.engine), meta=dict(st.meta), ttl_s=st.ttl_s,
                   eos_token_ids=list(st.eos_token_ids), created_at=e.recorded_at,
                   parent=None if e.body.get("parent") is None else dict(e.body["parent"]))

    def _ended(self, doc: Doc, e: Event, _: int) -> None:
        doc["status"] = self.state.status
        doc["end"] = {"type": e.type, "at": e.recorded_at, **dict(e.body)}
        if e.type == T.SESSION_PURGED:
            doc["nodes"], doc["roots"] = {}, []
            self._history(doc, ids=[], segments=[], images=[])

    def _fragment(self, doc: Doc, e: Event, _: int) -> None:
        nid = str(e.body["id"])
        node = self.state.nodes.get(nid)
        if node is None:
            return
        nodes = dict(doc["nodes"])
        is_new = nid not in nodes
        nodes[nid] = self._node(node)
        doc["nodes"] = nodes
        if is_new or e.body.get("child_ids"):
            roots = self._roots()
            if roots != doc["roots"]:
                doc["roots"] = roots
            # a parent's children list changed: re-render parents whose children arrived
            for c in e.body.get("child_ids", ()):
                if c in nodes and c in self.state.nodes:
                    nodes[c] = self._node(self.state.nodes[c])

    def _action(self, doc: Doc, e: Event, _: int) -> None:
        aid = str(e.body["action_id"])
        act = self.state.actions[aid]
        entry = {"id": act.id, "name": act.name, "target": act.target, "configs": act.configs,
                 "inputs": [{"name": n, "id": i} for n, i in act.inputs],
                 "outputs": [{"name": n, "id": i} for n, i in act.outputs],
                 "status": act.status, "error": act.error, "submitted_at": e.recorded_at,
                 "finished_at": None}
        if aid in self._action_index:
            self._set_in_list(doc, "actions", self._action_index[aid], status=act.status, error=act.error,
                              finished_at=e.recorded_at)
        else:
            self._action_index[aid] = len(doc["actions"])
            doc["actions"] = [*doc["actions"], entry]

    def _appended(self, doc: Doc, e: Event, prev_len: int) -> None:
        b = e.body
        toks = [int(t) for t in b["tokens"]]
        h = doc["history"]
        changes: dict[str, Any] = {"ids": h["ids"] + toks}
        if toks:
            changes["segments"] = [*h["segments"], {"source": "input", "start": prev_len, "text": self._text(toks)}]
        if b.get("images"):
            changes["images"] = h["images"] + [
                {k: im[k] for k in ("start", "end", "mime", "sha256", "size")} for im in b["images"]]
        self._history(doc, **changes)

    def _truncated(self, doc: Doc, e: Event, _: int) -> None:
        st = self.state
        keep = [(int(a), int(b)) for a, b in e.body["keep"]]
        h = doc["history"]
        ids = list(st.tokens)
        if len(keep) == 1 and keep[0][0] == 0:
            cut = keep[0][1]
            kept = [s for s in h["segments"] if s["start"] < cut]
            ends = [s["start"] for s in kept[1:]] + [cut]
            segs = [{**s, "text": self._text(ids[s["start"]:end])} for s, end in zip(kept, ends, strict=True)]
        else:
            segs = [{"source": "truncated", "start": 0, "text": self._text(ids)}] if ids else []
        self._history(doc, ids=ids, segments=segs,
                      images=[self._image(im) for im in st.images],
                      truncations=st.truncations, dropped=st.dropped_tokens)

    def _gen_started(self, doc: Doc, e: Event, _: int) -> None:
        b = e.body
        gid = str(b["generation_id"])
        self._gen_index[gid] = len(doc["generations"])
        doc["generations"] = [*doc["generations"], {
            "id": gid, "status": "running", "params": dict(b.get("params", {})),
            "options": dict(b.get("options", {})), "prompt_length": b.get("prompt_length"),
            "priority": b.get("priority", 0), "action_id": b.get("action_id"),
            "started_at": e.recorded_at, "finished_at": None, "finish_reason": None,
            "text": "" if self.detokenize else None, "tokens": [], "prefill": [], "timing": None}]
        doc["active_generation"] = gid

    def _gen_token(self, doc: Doc, e: Event, _: int) -> None:
        b = e.body
        gid = str(b["generation_id"])
        i = self._gen_index[gid]
        g = doc["generations"][i]
        entry = self._token(b, e.recorded_at)
        if b.get("is_prefill"):
            self._set_in_list(doc, "generations", i, prefill=[*g["prefill"], entry])
            return
        tokens = [*g["tokens"], entry]
        text = self._text([t["id"] for t in tokens])
        self._set_in_list(doc, "generations", i, tokens=tokens, text=text)
        h = doc["history"]
        ids = [*h["ids"], entry["id"]]
        segs = list(h["segments"])
        last = segs[-1] if segs else None
        if last is None or last.get("generation_id") != gid:
            segs.append({"source": "generation", "start": entry["position"], "generation_id": gid,
                         "text": entry["text"]})
        else:
            segs[-1] = {**last, "text": self._text(ids[last["start"]:])}
        self._history(doc, ids=ids, segments=segs)

    def _gen_finished(self, doc: Doc, e: Event, _: int) -> None:
        b = e.body
        gid = str(b["generation_id"])
        timing = {k: b.get(k) for k in ("prompt_tokens", "completion_tokens", "prefill_s", "ttft_s", "total_s")}
        self._set_in_list(doc, "generations", self._gen_index[gid], status="finished",
                          finish_reason=b.get("finish_reason"), finished_at=e.recorded_at, timing=timing)
        doc["active_generation"] = None

    def _feedback(self, doc: Doc, e: Event, _: int) -> None:
        doc["feedback"] = [*doc["feedback"], {**dict(e.body), "at": e.recorded_at, "version": e.version}]

    def _error(self, doc: Doc, e: Event, _: int) -> None:
        doc["errors"] = [*doc["errors"], {**dict(e.body), "at": e.recorded_at, "version": e.version}]


_Handler = Callable[[DocumentBuilder, Doc, Event, int], None]
_HANDLERS: dict[str, _Handler] = {
    T.SESSION_OPENED: DocumentBuilder._opened,
    T.SESSION_CLOSED: DocumentBuilder._ended,
    T.SESSION_ABORTED: DocumentBuilder._ended,
    T.SESSION_EXPIRED: DocumentBuilder._ended,
    T.SESSION_PURGED: DocumentBuilder._ended,
    T.NODE_FRAGMENT: DocumentBuilder._fragment,
    T.ACTION_SUBMITTED: DocumentBuilder._action,
    T.ACTION_COMPLETED: DocumentBuilder._action,
    T.ACTION_FAILED: DocumentBuilder._action,
    T.TOKENS_APPENDED: DocumentBuilder._appended,
    T.TOKENS_TRUNCATED: DocumentBuilder._truncated,
    T.GENERATION_STARTED: DocumentBuilder._gen_started,
    T.GENERATION_TOKEN: DocumentBuilder._gen_token,
    T.GENERATION_FINISHED: DocumentBuilder._gen_finished,
    T.FEEDBACK: DocumentBuilder._feedback,
    T.ERROR: DocumentBuilder._error,
}


def build_document(session_id: str, events: Iterable[Event], *, detokenize: Detokenize | None = None,
                   base: SessionState | None = None) -> Doc:
    """The document after ``events`` (a pure function of its inputs)."""
    return DocumentBuilder(session_id, detokenize=detokenize, base=base).apply_all(events)


# -- the sessions list ----------------------------------------------------------


def session_summary(row: Mapping[str, Any]) -> dict[str, Any]:
    """A sessions-list entry from a sessions-index row (``SessionRow.to_json()``)."""
    return {"id": row["id"], "protocol": row["protocol"], "status": row["status"], "label": row["label"],
            "parent_id": row.get("parent_id"), "model_id": row.get("model_id", ""),
            "created_at": row["created_at"], "generating": bool(row.get("generating", False))}


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
                b = e.body
                parent = b.get("parent") or {}
                entry = session_summary({
                    "id": e.session_id, "protocol": b.get("protocol", ""), "status": "open",
                    "label": b.get("label", ""), "parent_id": parent.get("session_id"),
                    "model_id": (b.get("engine") or {}).get("model_id", ""), "created_at": e.recorded_at})
                self.doc = {**self.doc, "sessions": {**self.doc["sessions"], e.session_id: entry}}
        elif t in (T.SESSION_CLOSED, T.SESSION_ABORTED, T.SESSION_EXPIRED, T.SESSION_PURGED):
            self._set(e.session_id, status=t.split(".", 1)[1], generating=False)
        elif t == T.GENERATION_STARTED:
            self._set(e.session_id, generating=True)
        elif t == T.GENERATION_FINISHED:
            self._set(e.session_id, generating=False)
        return self.doc
