"""Reading the server's session-document streams: SSE lines to events, events to updates.

A stream carries the session document as a snapshot and then JSON Patch+
patches (docs/protocols/json-patch-plus.md). :class:`SSEDecoder` turns lines
into :class:`SSE` events; :class:`Follow` applies them to the document it
builds, yields an :class:`Update` per step and remembers the last event id to
resume from. No I/O here: both clients feed it the lines they read. Import
the public names from :mod:`sessiontape.client`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sessiontape.core.patch import apply_op
from sessiontape.errors import APIError, from_body


@dataclass
class Update:
    """One step of a session-document stream.

    ``kind`` is ``snapshot`` (the whole document), ``patch`` (``patch`` was
    applied to it) or ``end`` (the session ended; ``data`` says how).
    ``position`` is the log position the document is complete up to (the SSE
    event id), ``None`` for ``end``.
    """

    kind: str
    position: int | None
    document: dict[str, Any]
    patch: list[dict[str, Any]] | None = None
    data: Any = None


@dataclass
class SSE:
    event: str = "message"
    data: str = ""
    id: str | None = None


class SSEDecoder:
    """Server-Sent Events from lines (the WHATWG rules this server's streams need)."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None

    def line(self, line: str) -> SSE | None:
        line = line.rstrip("\r\n")
        if not line:
            if not self._data and not self._event:
                return None
            out = SSE(self._event or "message", "\n".join(self._data), self._id)
            self._event, self._data = "", []
            return out
        if line.startswith(":"):
            return None  # a comment: the server's heartbeat
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            self._id = value
        return None


@dataclass
class Follow:
    """The document a stream builds, and where to resume it."""

    document: dict[str, Any] | None = None
    last_event_id: int | None = None
    until_generation: str | None = None
    done: bool = False
    decoder: SSEDecoder = field(default_factory=SSEDecoder)

    @classmethod
    def resume(
        cls,
        until_generation: str | None,
        last_event_id: int | None,
        document: dict[str, Any] | None,
    ) -> Follow:
        """A follow from the start, or from a document read before up to ``last_event_id``."""
        if (last_event_id is None) != (document is None):
            raise TypeError("resuming needs both last_event_id and the document it belongs to")
        return cls(
            document=document, last_event_id=last_event_id, until_generation=until_generation
        )

    def headers(self) -> dict[str, str]:
        return {} if self.last_event_id is None else {"Last-Event-ID": str(self.last_event_id)}

    def lines(self, lines: Iterable[str]) -> Iterator[Update]:
        for line in lines:
            sse = self.decoder.line(line)
            if sse is not None:
                update = self.event(sse)
                if update is not None:
                    yield update

    def event(self, sse: SSE) -> Update | None:
        if sse.event == "error":
            self.done = True
            raise from_body(0, _json(sse.data))
        if sse.event == "end":
            self.done = True
            return Update("end", None, self.document or {}, data=_json(sse.data))
        if sse.event not in ("snapshot", "patch"):
            return None
        position = int(sse.id) if sse.id else None
        if sse.event == "snapshot":
            self.document = _json(sse.data)
            update = Update("snapshot", position, self.document)
        else:
            if self.document is None:
                raise APIError(0, "protocol", "a patch arrived before the snapshot")
            ops = _json(sse.data)
            doc: Any = self.document
            for n, op in enumerate(ops):
                doc = apply_op(doc, op, n)
            self.document = doc
            update = Update("patch", position, doc, patch=ops)
        if position is not None:
            self.last_event_id = position
        if self.until_generation is not None and _generation_done(
            update.document, self.until_generation
        ):
            self.done = True
        return update


def _json(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise APIError(
            0, "protocol", f"the server sent an event that is not JSON: {data[:200]!r}"
        ) from exc


def _generation_done(doc: Mapping[str, Any], gid: str) -> bool:
    return any(
        g.get("id") == gid and g.get("status") == "finished" for g in doc.get("generations", ())
    )
