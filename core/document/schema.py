"""The session document's shape (docs/protocols/session-document.md): the empty
document, and how a node, an image and a generation's recorded parameters are
shown in it."""

from __future__ import annotations

from typing import Any

from sessiontape.core.events import GENESIS_HASH
from sessiontape.core.session.state import Image, Node

Doc = dict[str, Any]

SCHEMA = "sessiontape.session/1"
TERMINAL = frozenset({"closed", "aborted", "expired", "purged"})
_TEXTUAL = ("text/", "application/json", "application/x-ndjson", "application/xml")


def is_text(mimetype: str) -> bool:
    """Whether a node of this mimetype is shown as text."""
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
        "history": {
            "ids": [],
            "text": None,
            "segments": [],
            "images": [],
            "truncations": 0,
            "dropped": 0,
        },
        "nodes": {},
        "roots": [],
        "actions": [],
        "generations": [],
        "active_generation": None,
        "conversation": [],
        "feedback": [],
        "errors": [],
        "audit": {"chain": "verified", "head_hash": GENESIS_HASH, "error": None},
    }


#: the largest integer every JSON reader holds exactly (an IEEE double, JavaScript's Number)
MAX_EXACT_JSON_INT = 2**53


def params_view(recorded: Any) -> dict[str, Any]:
    """A generation's recorded parameters for the document: the seed (recorded as a string, since
    it may need 64 bits) as a JSON integer, exact at any size (a reader that parses numbers as
    doubles, such as JavaScript's JSON.parse, must keep the digits of one above 2**53)."""
    out = dict(recorded)
    seed = out.get("seed")
    if isinstance(seed, str) and seed.isascii() and seed.isdigit():
        out["seed"] = int(seed)
    return out


def image_view(im: Image) -> dict[str, Any]:
    """An image of the history as the document shows it."""
    return {
        "start": im.start,
        "end": im.end,
        "mime": im.mime,
        "sha256": im.sha256,
        "size": im.size,
    }


def node_view(n: Node) -> dict[str, Any]:
    """An Evergreen node as the document shows it."""
    meta = dict(n.metadata or {})
    mimetype = str(meta.get("mimetype", ""))
    data = n.data() if n.kind == "leaf" else b""
    text = (
        data.decode("utf-8", "replace")
        if n.kind == "leaf" and n.ref is None and is_text(mimetype)
        else None
    )
    return {
        "id": n.id,
        "kind": n.kind,
        "direction": n.direction,
        "mimetype": mimetype,
        "role": str(meta.get("role", "")),
        "metadata": meta,
        "children": n.child_ids,
        "ref": n.ref,
        "text": text,
        "size": len(data),
        "complete": n.fragments_complete,
        "fragments": len(n.fragments),
    }
