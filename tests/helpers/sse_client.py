"""A small SSE client over httpx streaming, for the tests and the benchmark."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class SseEvent:
    event: str
    data: str
    id: int | None

    def json(self) -> Any:
        return json.loads(self.data)


async def events(
    resp: httpx.Response, *, comments: list[str] | None = None
) -> AsyncIterator[SseEvent]:
    event, id_ = "message", None
    data: list[str] = []
    async for line in resp.aiter_lines():
        if line == "":
            if data:
                yield SseEvent(event, "\n".join(data), id_)
            event, data, id_ = "message", [], None
        elif line.startswith(":"):
            if comments is not None:
                comments.append(line)
                yield SseEvent("comment", line, None)
        else:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
            elif field == "id":
                id_ = int(value)
