"""Snapshot (de)serialisation of SessionState: JSON for the structure, raw
bytes for the token array (a 1M-token history loads in milliseconds)."""

from __future__ import annotations

import base64
import json
from array import array
from typing import Any

from sessiontape.core.session.state import Action, Fragment, Generation, Image, Node, SessionState


def state_to_json(st: SessionState) -> tuple[int, str, bytes | None]:
    nodes = {
        nid: {
            "direction": n.direction,
            "final_seq": n.final_seq,
            "kind": n.kind,
            "fragments": [
                [
                    f.seq,
                    f.continued,
                    f.child_ids,
                    f.metadata,
                    f.ref,
                    None if f.data is None else base64.b64encode(f.data).decode(),
                    f.has_chunk,
                ]
                for f in n.fragments.values()
            ],
        }
        for nid, n in st.nodes.items()
    }
    doc: dict[str, Any] = {
        "session_id": st.session_id,
        "version": st.version,
        "head_hash": st.head_hash,
        "protocol": st.protocol,
        "mode": st.mode,
        "status": st.status,
        "label": st.label,
        "engine": st.engine,
        "eos_token_ids": st.eos_token_ids,
        "ttl_s": st.ttl_s,
        "parent": st.parent,
        "meta": st.meta,
        "created_at": st.created_at,
        "updated_at": st.updated_at,
        "images": [vars(im) for im in st.images],
        "nodes": nodes,
        "actions": [vars(a) for a in st.actions.values()],
        "generations": [vars(g) for g in st.generations.values()],
        "feedback": st.feedback,
        "errors": st.errors,
        "truncations": st.truncations,
        "dropped_tokens": st.dropped_tokens,
        "event_count": st.event_count,
        "abort": st.abort,
        "purged_through": st.purged_through,
    }
    return st.version, json.dumps(doc), st.tokens.tobytes()


def state_from_json(text: str, data: bytes | None) -> SessionState:
    d = json.loads(text)
    st = SessionState(d["session_id"])
    for key in (
        "version",
        "head_hash",
        "protocol",
        "mode",
        "status",
        "label",
        "engine",
        "eos_token_ids",
        "ttl_s",
        "parent",
        "meta",
        "created_at",
        "updated_at",
        "feedback",
        "errors",
        "truncations",
        "dropped_tokens",
        "event_count",
        "abort",
        "purged_through",
    ):
        setattr(st, key, d[key])
    toks: array[int] = array("q")
    if data:
        toks.frombytes(data)
    st.tokens = toks
    st.images = [Image(**im) for im in d["images"]]
    for nid, n in d["nodes"].items():
        node = Node(id=nid, final_seq=n["final_seq"], kind=n["kind"], direction=n["direction"])
        for seq, cont, kids, meta, ref, data_b64, has_chunk in n["fragments"]:
            node.fragments[seq] = Fragment(
                seq,
                cont,
                kids,
                meta,
                ref,
                None if data_b64 is None else base64.b64decode(data_b64),
                has_chunk,
            )
            for c in kids:
                st.parents_of.setdefault(c, set()).add(nid)
        st.nodes[nid] = node
    for a in d["actions"]:
        a["inputs"] = [tuple(x) for x in a["inputs"]]
        a["outputs"] = [tuple(x) for x in a["outputs"]]
        st.actions[a["id"]] = Action(**a)
        st.action_outputs.update(o for _, o in a["outputs"])
    for g in d["generations"]:
        st.generations[g["id"]] = Generation(**g)
    return st
