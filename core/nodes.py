"""The Evergreen node DAG: fragment rules, completeness, flattening.

A node is a parent (``child_ids``) or a leaf (a chunk), fixed by its seq 0
fragment. Fragments share the node id; ``seq`` orders them (default 0) and
``continued=False`` marks the final one. The first of duplicate (id, seq)
wins and later ones are ignored without error; metadata only on seq 0; a
fragment past the final seq aborts; cycles and nesting deeper than the
configured limit abort; refs are URIs.

``check_fragment`` decides (no mutation): it returns False for a duplicate
to ignore, True for a fragment to record, and raises otherwise. The fold
applies the recorded body with :func:`sessiontape.core.session.state.apply_fragment`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from sessiontape.core.errors import (
    InvalidAction,
    InvalidFragment,
    NodeNotFound,
    ProtocolViolation,
    shown,
)
from sessiontape.core.session.state import Node, SessionState


@dataclass(frozen=True)
class FragmentIn:
    """A fragment as a transport hands it to the runtime."""

    id: str
    seq: int = 0
    continued: bool = False
    child_ids: tuple[str, ...] = ()
    has_chunk: bool = False
    metadata: Mapping[str, Any] | None = None
    ref: str | None = None
    data: bytes | None = None

    def body(self, direction: str) -> dict[str, Any]:
        """The ``node.fragment`` event body (bytes travel as the event's data)."""
        return {
            "direction": direction,
            "id": self.id,
            "seq": self.seq,
            "continued": self.continued,
            "child_ids": list(self.child_ids),
            "chunk": (
                {
                    "metadata": None if self.metadata is None else dict(self.metadata),
                    "ref": self.ref,
                }
                if self.has_chunk
                else None
            ),
        }


@dataclass(frozen=True)
class Chunk:
    """One leaf's content, as flattening yields it."""

    node_id: str
    mimetype: str
    role: str
    data: bytes | None
    ref: str | None
    metadata: Mapping[str, Any]


def check_fragment(state: SessionState, f: FragmentIn, max_depth: int) -> bool:
    """Validate ``f`` against ``state``; False means "duplicate, ignore"."""
    if not f.id:
        raise InvalidFragment("fragment without a node id")
    if f.seq < 0:
        raise InvalidFragment(f"node {f.id}: negative seq {f.seq}")
    node = state.nodes.get(f.id)
    if node is not None and f.seq in node.fragments:
        return False
    if f.has_chunk and f.child_ids:
        raise ProtocolViolation(f"node {f.id}: a fragment cannot be both parent and leaf")
    if f.metadata is not None and f.seq != 0:
        raise ProtocolViolation(f"node {f.id}: metadata on seq {f.seq} (only seq 0 may carry it)")
    if f.ref is not None:
        if f.data is not None:
            raise InvalidFragment(f"node {f.id}: chunk has both ref and data")
        parsed = urlparse(f.ref)
        if not parsed.scheme or not (parsed.netloc or parsed.path):
            raise InvalidFragment(f"node {f.id}: ref {f.ref!r} is not a URI")
    kind = "leaf" if f.has_chunk else ("parent" if f.child_ids else None)
    if node is not None:
        if node.final_seq is not None and f.seq > node.final_seq:
            raise ProtocolViolation(
                f"node {f.id}: fragment seq {f.seq} after the final seq {node.final_seq}"
            )
        if not f.continued and any(s > f.seq for s in node.fragments):
            raise ProtocolViolation(f"node {f.id}: final seq {f.seq} but later fragments exist")
        if node.kind is not None and kind is not None and kind != node.kind:
            raise ProtocolViolation(f"node {f.id} is a {node.kind}; got a {kind} fragment")
        if f.seq == 0 and kind is None and node.fragments:
            others = {("leaf" if x.has_chunk else "parent") for x in node.fragments.values()}
            if len(others) > 1:
                raise ProtocolViolation(f"node {f.id}: mixed leaf and parent fragments")
    if f.seq == 0 and kind is None:
        # An empty parent (no children yet) is allowed; children may come later.
        kind = "parent"
    if f.child_ids:
        _check_children(state, f.id, f.child_ids, max_depth)
    return True


def _check_children(
    state: SessionState, node_id: str, children: tuple[str, ...], max_depth: int
) -> None:
    for c in children:
        if c == node_id or _reaches(state, c, node_id):
            raise ProtocolViolation(f"node {node_id}: child {c} would create a cycle")
    depth_above = _depth_above(state, node_id)
    below = 1 + max((_height(state, c) for c in children), default=0)
    if depth_above + below > max_depth:
        raise ProtocolViolation(
            f"node {node_id}: nesting depth {depth_above + below} exceeds the limit {max_depth}"
        )


def _reaches(state: SessionState, start: str, target: str) -> bool:
    stack, seen = [start], set()
    while stack:
        n = stack.pop()
        if n == target:
            return True
        if n in seen:
            continue
        seen.add(n)
        node = state.nodes.get(n)
        if node is not None:
            stack.extend(node.child_ids)
    return False


def _height(state: SessionState, node_id: str, _memo: dict[str, int] | None = None) -> int:
    memo = {} if _memo is None else _memo
    if node_id in memo:
        return memo[node_id]
    node = state.nodes.get(node_id)
    h = 1 + max((_height(state, c, memo) for c in node.child_ids), default=0) if node else 1
    memo[node_id] = h
    return h


def _depth_above(state: SessionState, node_id: str) -> int:
    """Nodes on the longest path from a root down to ``node_id``, exclusive."""
    best, frontier, seen = 0, [(node_id, 0)], set()
    while frontier:
        n, d = frontier.pop()
        best = max(best, d)
        for p in state.parents_of.get(n, ()):
            if (p, d + 1) not in seen:
                seen.add((p, d + 1))
                frontier.append((p, d + 1))
    return best


def is_complete(state: SessionState, node_id: str) -> bool:
    """All fragments of the node and, for a parent, of every descendant arrived."""
    stack, seen = [node_id], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        node = state.nodes.get(n)
        if node is None or not node.fragments_complete:
            return False
        stack.extend(node.child_ids)
    return True


def missing(state: SessionState, node_id: str) -> list[str]:
    """Ids (reachable from ``node_id``) not yet complete: what an action waits for."""
    out, stack, seen = [], [node_id], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        node = state.nodes.get(n)
        if node is None or not node.fragments_complete:
            out.append(n)
        if node is not None:
            stack.extend(node.child_ids)
    return sorted(out)


def flatten(state: SessionState, node_id: str) -> list[Chunk]:
    """The node's leaves in depth-first child order: what an action consumes."""
    node = state.nodes.get(node_id)
    if node is None:
        raise NodeNotFound(f"node {node_id!r} not found")
    out: list[Chunk] = []

    def walk(n: Node) -> None:
        if n.kind == "leaf":
            meta = dict(n.metadata or {})
            out.append(
                Chunk(
                    node_id=n.id,
                    mimetype=str(meta.get("mimetype", "")),
                    role=str(meta.get("role", "")),
                    data=None if n.ref is not None else n.data(),
                    ref=n.ref,
                    metadata=meta,
                )
            )
            return
        for c in n.child_ids:
            child = state.nodes.get(c)
            if child is None:
                raise NodeNotFound(f"node {c!r} (child of {n.id}) not found")
            walk(child)

    walk(node)
    return out


#: mimetypes read as text besides ``text/*`` (a tool call's arguments, a JSON result)
TEXT_MIMETYPES = frozenset({"application/json"})


def text_of(state: SessionState, node_id: str, reader: str) -> str:
    """The text of the node's leaves, flattened: ``text/*`` and ``application/json`` chunks
    with inline UTF-8 data, end-of-turn markers (a mimetype with ``type=EndOfTurn``)
    skipped. A ref, another mimetype or invalid UTF-8 is InvalidAction (``reader`` names
    who reads it in the message)."""
    parts: list[str] = []
    for chunk in flatten(state, node_id):
        mime = chunk.mimetype.split(";", 1)[0].strip().lower()
        if "type=endofturn" in chunk.mimetype.replace(" ", "").lower():
            continue  # a turn marker; the engine's history carries no separate token for it
        if chunk.ref is not None:
            raise InvalidAction(
                f"{reader}: node {chunk.node_id} is a ref ({shown(chunk.ref, 'a ref')});"
                " refs are not fetched"
            )
        if not mime.startswith("text/") and mime not in TEXT_MIMETYPES:
            raise InvalidAction(
                f"{reader}: node {chunk.node_id} has mimetype {shown(chunk.mimetype, 'a mimetype')};"
                " only text/* and application/json are read"
            )
        try:
            parts.append((chunk.data or b"").decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InvalidAction(f"{reader}: node {chunk.node_id} is not UTF-8 text: {exc}") from exc
    return "".join(parts)
