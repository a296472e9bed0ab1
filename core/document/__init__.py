"""The session document: one JSON view of a session, folded from its events.

Every transport that shows a session as JSON (the HTTP API, the SSE patch
streams, the replay viewer) uses this one view. :class:`DocumentBuilder`
folds events one at a time with the core fold (:func:`sessiontape.core.session.state.apply`,
so the document can never disagree with the runtime's state) and returns,
for each event, the JSON Patch+ that turns the previous document into the
new one. The patch is written by the fold itself, so a generated token costs
the same whether the history holds a hundred tokens or a hundred thousand:
the document is updated in place (no copy of the history), texts grow by
appending what the new token adds (:class:`TextRun` re-decodes only a short
window of recent tokens), and no diff has to search for what changed. The
schema is described in docs/protocols/session-document.md.

Usage::

    b = DocumentBuilder(sid, detokenize=engine.detokenize)
    send_snapshot(json.dumps(b.doc))
    for e in events:
        send(json.dumps(b.apply(e)))   # serialise (or copy) before the next apply

``doc`` is mutated by ``apply``: a caller that needs an earlier document
keeps a copy (or its serialisation), and the ops of one ``apply`` may share
objects with the document, so they are serialised before the next one.
"""

from sessiontape.core.document.fold import DocumentBuilder, build_document, fork_base
from sessiontape.core.document.schema import (
    MAX_EXACT_JSON_INT,
    SCHEMA,
    TERMINAL,
    Doc,
    empty_document,
    image_view,
    is_text,
    node_view,
    params_view,
)
from sessiontape.core.document.sessionlist import SessionListBuilder, session_summary
from sessiontape.core.document.text import REPLACEMENT, Detokenize, TextRun

__all__ = [
    "MAX_EXACT_JSON_INT",
    "REPLACEMENT",
    "SCHEMA",
    "TERMINAL",
    "Detokenize",
    "Doc",
    "DocumentBuilder",
    "SessionListBuilder",
    "TextRun",
    "build_document",
    "empty_document",
    "fork_base",
    "image_view",
    "is_text",
    "node_view",
    "params_view",
    "session_summary",
]
