"""The session document's fold: :class:`DocumentBuilder` turns each event into
the JSON Patch+ that updates the document (see :mod:`sessiontape.core.document`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sessiontape.core.bodies import (
    ErrorRecorded,
    FeedbackRecorded,
    GenerationFinished,
    GenerationStarted,
    GenerationToken,
    NodeFragment,
    TokensAppended,
    TokensTruncated,
    ToolCalled,
    action_id_of,
    body,
    fork_point,
)
from sessiontape.core.document.conversation import (
    Conversation,
    ForkBase,
    fork_conversation,
    openai_request,
)
from sessiontape.core.document.generation_view import (
    finished_fields,
    generation_entry,
    token_entry,
)
from sessiontape.core.document.schema import (
    Doc,
    empty_document,
    image_view,
    node_view,
)
from sessiontape.core.document.text import Detokenize, TextRun
from sessiontape.core.events import GENESIS_HASH, Event, T, event_hash
from sessiontape.core.log.store import EventLog
from sessiontape.core.patch import Op, diff, escape
from sessiontape.core.session.loader import base_state
from sessiontape.core.session.state import SessionState, apply


async def fork_base(log: EventLog, first: Event) -> SessionState | None:
    """The state a fork's document starts from, given the fork's first event.

    None for a session that is not a fork. The parent is loaded with
    :func:`sessiontape.core.session.loader.load_state` (snapshot, then events) at the fork's
    version and cut at its token position, as the runtime does; the state also carries
    the parent's conversation up to there (:func:`fork_conversation`).
    """
    if not fork_point(first):
        return None
    return ForkBase.of(await base_state(log, first), await fork_conversation(log, first))


class DocumentBuilder:
    """Folds events into the session document; ``doc`` is the current one.

    ``base`` is the state a fork starts from (:func:`fork_base`): its
    history and nodes are inherited. Events of other sessions are ignored
    except a ``session.opened`` that names this session as parent, which
    adds a child (fork) entry.
    """

    def __init__(
        self,
        session_id: str,
        *,
        detokenize: Detokenize | None = None,
        base: SessionState | None = None,
    ) -> None:
        self.session_id = session_id
        self.detokenize = detokenize
        self.state = base if base is not None else SessionState(session_id)
        #: log position of the last event that went into ``doc`` (0: none)
        self.position = 0
        self._gen_index: dict[str, int] = {}
        self._action_index: dict[str, int] = {}
        self._head = GENESIS_HASH
        self._ops: list[Op] = []
        #: the history's text, and each running generation's (which is also its segment's)
        self._history_run = TextRun(detokenize) if detokenize is not None else None
        self._gen_runs: dict[str, TextRun] = {}
        doc = empty_document(session_id)
        h = doc["history"]
        h["text"] = self._start_history([])
        if base is not None and (base.tokens or base.nodes):
            ids = list(base.tokens)
            h["ids"] = ids
            h["text"] = self._start_history(ids)
            h["segments"] = (
                [{"source": "inherited", "start": 0, "text": self._text(ids)}] if ids else []
            )
            h["images"] = [image_view(im) for im in base.images]
            doc["nodes"] = {nid: node_view(n) for nid, n in base.nodes.items()}
            doc["roots"] = self._roots()
        #: the ids in ``doc["roots"]``: kept as nodes come, not recomputed from every node
        self._root_ids: set[str] = set(doc["roots"])
        #: the chat turns (``doc["conversation"]`` is its list)
        self.chat = Conversation(detokenize)
        if isinstance(base, ForkBase) and base.conversation is not None:
            self.chat = base.conversation.inherit(base.tokens, detokenize)
        doc["conversation"] = self.chat.turns
        self.doc: Doc = doc

    # -- helpers -----------------------------------------------------------

    def _text(self, ids: Sequence[int]) -> str | None:
        return None if self.detokenize is None else self.detokenize(ids)

    def _start_history(self, ids: Sequence[int]) -> str | None:
        return None if self._history_run is None else self._history_run.start(ids)

    def _roots(self) -> list[str]:
        return [nid for nid in self.state.nodes if not self.state.parents_of.get(nid)]

    def _token(self, b: GenerationToken, at: float) -> dict[str, Any]:
        return token_entry(b, at, self.detokenize)

    # Every change to ``doc`` goes through these, which record its op.

    def _set(self, obj: dict[str, Any], key: str, value: Any, path: str) -> None:
        """``obj[key] = value``; the op is the diff of the old value (``add`` for a new key)."""
        if key in obj:
            old = obj[key]
            obj[key] = value
            kind = type(value)
            if kind is type(old) and (kind is int or kind is float):
                # a number replacing a number of its type (every event sets two):
                # the op diff() gives, without its walk
                if old != value:
                    self._ops.append({"op": "replace", "path": path, "value": value})
            else:
                self._ops.extend(diff(old, value, path=path))
        else:
            obj[key] = value
            self._ops.append({"op": "add", "path": path, "value": value})

    def _replace(self, obj: dict[str, Any], key: str, value: Any, path: str) -> None:
        """``obj[key] = value`` as one ``replace`` (a diff of a large list would remove item by item)."""
        obj[key] = value
        self._ops.append({"op": "replace", "path": path, "value": value})

    def _push(self, items: list[Any], value: Any, path: str) -> None:
        items.append(value)
        self._ops.append({"op": "append", "path": path, "value": value})

    def _grow(self, obj: dict[str, Any], key: str, piece: str, path: str) -> None:
        if piece and obj[key] is not None:
            obj[key] += piece
            self._ops.append({"op": "append", "path": path, "value": piece})

    def _audit(self, doc: Doc, e: Event) -> None:
        expected = (
            e.prev_hash if (self.state.version == 0 and e.type == T.SESSION_PURGED) else self._head
        )
        audit = doc["audit"]
        if audit["chain"] == "verified" and e.prev_hash != expected:
            self._set(
                doc,
                "audit",
                {
                    "chain": "broken",
                    "head_hash": e.hash,
                    "error": f"v{e.version}: prev_hash does not match the previous event",
                },
                "/audit",
            )
        elif audit["chain"] == "verified" and event_hash(e) != e.hash:
            self._set(
                doc,
                "audit",
                {
                    "chain": "broken",
                    "head_hash": e.hash,
                    "error": f"v{e.version}: hash does not match the event's content",
                },
                "/audit",
            )
        else:
            # two hashes of one length: a replace (or nothing), as diff() gives
            if audit["head_hash"] != e.hash:
                audit["head_hash"] = e.hash
                self._ops.append({"op": "replace", "path": "/audit/head_hash", "value": e.hash})
        self._head = e.hash

    # -- the fold ----------------------------------------------------------

    def apply(self, e: Event) -> list[Op]:
        """Fold ``e`` into ``doc``; returns the JSON Patch+ from the previous document to it.

        The ops may share objects with ``doc``: serialise them before the
        next ``apply``. Raises :class:`sessiontape.core.errors.InvalidEvent` if ``e``
        cannot follow (the document is then unchanged).
        """
        ops: list[Op] = []
        self._ops = ops
        doc = self.doc
        if e.session_id != self.session_id:
            parent = fork_point(e)
            if parent and parent.get("session_id") == self.session_id:
                self._push(
                    doc["children"],
                    {
                        "session_id": e.session_id,
                        "version": parent.get("version"),
                        "token_position": parent.get("token_position"),
                        "created_at": e.recorded_at,
                        "position": e.position,
                    },
                    "/children",
                )
                self.position = max(self.position, e.position)
            return ops
        st = self.state
        if st.version == 0 and e.type == T.SESSION_PURGED:
            st.version = e.version - 1  # a tombstone stands in for the purged events
        prev_len = len(st.tokens)
        apply(st, e)
        self._set(doc, "version", e.version, "/version")
        self._set(doc, "updated_at", e.recorded_at, "/updated_at")
        self._audit(doc, e)
        handler = _HANDLERS.get(e.type)
        if handler is not None:
            handler(self, doc, e, prev_len)
        self.position = max(self.position, e.position)
        return ops

    def apply_all(self, events: Iterable[Event]) -> Doc:
        for e in events:
            self.apply(e)
        return self.doc

    # -- per event type ----------------------------------------------------

    def _opened(self, doc: Doc, e: Event, _: int) -> None:
        st = self.state
        for key, value in (
            ("status", st.status),
            ("protocol", st.protocol),
            ("mode", st.mode),
            ("label", st.label),
            ("engine", dict(st.engine)),
            ("meta", dict(st.meta)),
            ("ttl_s", st.ttl_s),
            ("eos_token_ids", list(st.eos_token_ids)),
            ("created_at", e.recorded_at),
            ("parent", None if (parent := fork_point(e)) is None else dict(parent)),
        ):
            self._set(doc, key, value, "/" + key)

    def _ended(self, doc: Doc, e: Event, _: int) -> None:
        self._set(doc, "status", self.state.status, "/status")
        # the whole body (one of four types), no key read
        self._set(doc, "end", {"type": e.type, "at": e.recorded_at, **dict(e.body)}, "/end")
        if e.type == T.SESSION_PURGED:
            self._replace(doc, "nodes", {}, "/nodes")
            self._replace(doc, "roots", [], "/roots")
            self._root_ids.clear()
            h = doc["history"]
            for key, value in (
                ("ids", []),
                ("text", self._start_history([])),
                ("segments", []),
                ("images", []),
            ):
                self._replace(h, key, value, "/history/" + key)
            self._gen_runs.clear()
            self._ops.extend(self.chat.clear())
            doc["conversation"] = self.chat.turns

    def _fragment(self, doc: Doc, e: Event, _: int) -> None:
        b = body(e, NodeFragment)
        nid = str(b["id"])
        node = self.state.nodes.get(nid)
        if node is None:
            return
        nodes = doc["nodes"]
        is_new = nid not in nodes
        self._set(nodes, nid, node_view(node), "/nodes/" + escape(nid))
        children = b.get("child_ids", ())
        if is_new and not self.state.parents_of.get(nid):
            # roots are in arrival order, and a node arrives last: it joins at the end
            self._root_ids.add(nid)
            self._push(doc["roots"], nid, "/roots")
        for c in children:
            if c in self._root_ids:  # a root named as a child is one no more
                self._root_ids.discard(c)
                roots = doc["roots"]
                i = roots.index(c)
                del roots[i]
                self._ops.append({"op": "remove", "path": f"/roots/{i}"})
        # a parent's children list changed: re-render parents whose children arrived
        for c in children:
            if c in nodes and c in self.state.nodes:
                self._set(nodes, c, node_view(self.state.nodes[c]), "/nodes/" + escape(c))

    def _action(self, doc: Doc, e: Event, _: int) -> None:
        aid = str(action_id_of(e))
        act = self.state.actions[aid]
        if aid in self._action_index:
            i = self._action_index[aid]
            item = doc["actions"][i]
            for key, value in (
                ("status", act.status),
                ("error", act.error),
                ("finished_at", e.recorded_at),
            ):
                self._set(item, key, value, f"/actions/{i}/{key}")
            return
        self._action_index[aid] = len(doc["actions"])
        self._push(
            doc["actions"],
            {
                "id": act.id,
                "name": act.name,
                "direction": act.direction,
                "target": act.target,
                "configs": act.configs,
                "inputs": [{"name": n, "id": i} for n, i in act.inputs],
                "outputs": [{"name": n, "id": i} for n, i in act.outputs],
                "status": act.status,
                "error": act.error,
                "submitted_at": e.recorded_at,
                "finished_at": None,
            },
            "/actions",
        )

    def _appended(self, doc: Doc, e: Event, prev_len: int) -> None:
        b = body(e, TokensAppended)
        toks = [int(t) for t in b["tokens"]]
        h = doc["history"]
        for t in toks:
            self._push(h["ids"], t, "/history/ids")
        if toks:
            if self._history_run is not None:
                self._grow(h, "text", self._history_run.push(toks), "/history/text")
            self._push(
                h["segments"],
                {"source": "input", "start": prev_len, "text": self._text(toks)},
                "/history/segments",
            )
        for im in b.get("images") or ():
            self._push(
                h["images"],
                {k: im[k] for k in ("start", "end", "mime", "sha256", "size")},
                "/history/images",
            )

    def _truncated(self, doc: Doc, e: Event, _: int) -> None:
        st = self.state
        keep = [(int(a), int(b)) for a, b in body(e, TokensTruncated)["keep"]]
        h = doc["history"]
        ids = list(st.tokens)
        old = h["ids"]
        if len(keep) == 1 and keep[0][0] == 0:
            cut = keep[0][1]
            # a rewind: the history's head is kept, so only the tail is removed
            for i in range(len(old) - 1, cut - 1, -1):
                self._ops.append({"op": "remove", "path": f"/history/ids/{i}"})
            del old[cut:]
            kept = [s for s in h["segments"] if s["start"] < cut]
            ends = [s["start"] for s in kept[1:]] + [cut]
            segs = [
                {**s, "text": self._text(ids[s["start"] : end])}
                for s, end in zip(kept, ends, strict=True)
            ]
        else:
            self._replace(h, "ids", ids, "/history/ids")
            segs = [{"source": "truncated", "start": 0, "text": self._text(ids)}] if ids else []
        self._set(h, "text", self._start_history(ids), "/history/text")
        self._set(h, "segments", segs, "/history/segments")
        self._set(h, "images", [image_view(im) for im in st.images], "/history/images")
        self._set(h, "truncations", st.truncations, "/history/truncations")
        self._set(h, "dropped", st.dropped_tokens, "/history/dropped")
        self._ops.extend(self.chat.truncated(keep, st.tokens))
        doc["conversation"] = self.chat.turns

    def _gen_started(self, doc: Doc, e: Event, _: int) -> None:
        b = body(e, GenerationStarted)
        gid = str(b["generation_id"])
        self._gen_index[gid] = len(doc["generations"])
        if self.detokenize is not None:
            self._gen_runs[gid] = TextRun(self.detokenize)
        self._push(
            doc["generations"],
            generation_entry(b, e.recorded_at, with_text=self.detokenize is not None),
            "/generations",
        )
        self._set(doc, "active_generation", gid, "/active_generation")
        self.chat.started(gid, int(b.get("prompt_length") or 0))

    def _gen_token(self, doc: Doc, e: Event, _: int) -> None:
        b = body(e, GenerationToken)
        gid = str(b["generation_id"])
        i = self._gen_index[gid]
        g = doc["generations"][i]
        gpath = f"/generations/{i}"
        entry = self._token(b, e.recorded_at)
        if b.get("is_prefill"):
            self._push(g["prefill"], entry, gpath + "/prefill")
            return
        tok, tok_pos = entry["id"], entry["position"]
        self._push(g["tokens"], entry, gpath + "/tokens")
        run = self._gen_runs.get(gid)
        piece = run.push([tok]) if run is not None else ""
        self._grow(g, "text", piece, gpath + "/text")
        h = doc["history"]
        self._push(h["ids"], tok, "/history/ids")
        if self._history_run is not None:
            self._grow(h, "text", self._history_run.push([tok]), "/history/text")
        segs = h["segments"]
        last = segs[-1] if segs else None
        if last is None or last.get("generation_id") != gid:
            self._push(
                segs,
                {
                    "source": "generation",
                    "start": entry["position"],
                    "generation_id": gid,
                    "text": piece if run is not None else None,
                },
                "/history/segments",
            )
        else:
            self._grow(last, "text", piece, f"/history/segments/{len(segs) - 1}/text")
        self._ops.extend(self.chat.token(gid, piece if run is not None else None, tok_pos))

    def _gen_finished(self, doc: Doc, e: Event, _: int) -> None:
        b = body(e, GenerationFinished)
        gid = str(b["generation_id"])
        i = self._gen_index.get(gid)
        if i is None:
            # a fork made while its parent generated inherits that generation running, and ends
            # it (interrupted) before its own first one: the document lists only its own
            return
        g = doc["generations"][i]
        gpath = f"/generations/{i}"
        run = self._gen_runs.pop(gid, None)
        piece = None
        if run is not None:
            # the generation is complete: its text is all of its tokens' text
            piece = run.flush()
            self._grow(g, "text", piece, gpath + "/text")
            segs = doc["history"]["segments"]
            if segs and segs[-1].get("generation_id") == gid:
                self._grow(segs[-1], "text", piece, f"/history/segments/{len(segs) - 1}/text")
        self._ops.extend(self.chat.finished(gid, piece))
        for key, value in finished_fields(b, e.recorded_at).items():
            self._set(g, key, value, f"{gpath}/{key}")
        self._set(doc, "active_generation", None, "/active_generation")

    def _wire(self, doc: Doc, e: Event, _: int) -> None:
        payload = openai_request(e)
        if payload is None:
            return
        # the reply so far: a generation's tokens may be committed before its request
        i = self._gen_index.get(str(payload["generation_id"]))
        reply = None if i is None else doc["generations"][i]["text"]
        self._ops.extend(self.chat.request(payload, reply))

    def _tool_called(self, doc: Doc, e: Event, _: int) -> None:
        self._ops.extend(self.chat.tool_called(body(e, ToolCalled)))

    def _feedback(self, doc: Doc, e: Event, _: int) -> None:
        self._push(
            doc["feedback"],
            {**dict(body(e, FeedbackRecorded)), "at": e.recorded_at, "version": e.version},
            "/feedback",
        )

    def _error(self, doc: Doc, e: Event, _: int) -> None:
        self._push(
            doc["errors"],
            {**dict(body(e, ErrorRecorded)), "at": e.recorded_at, "version": e.version},
            "/errors",
        )


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
    T.WIRE: DocumentBuilder._wire,
    T.TOOL_CALLED: DocumentBuilder._tool_called,
}


def build_document(
    session_id: str,
    events: Iterable[Event],
    *,
    detokenize: Detokenize | None = None,
    base: SessionState | None = None,
) -> Doc:
    """The document after ``events`` (a pure function of its inputs)."""
    return DocumentBuilder(session_id, detokenize=detokenize, base=base).apply_all(events)
