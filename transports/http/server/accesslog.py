"""The HTTP access log: one record per request on the ``sessiontape.access`` logger.

Written when the response ends (for an SSE stream, when the stream closes), so
``duration_s`` is the whole exchange. The record's message is one text line;
its ``extra`` fields (request id, session id, route template, status,
duration, bytes) become the object's keys when logs are JSON
(:mod:`sessiontape.core.logformat`). The route is the template (``/v1/sessions/{sid}``),
never a client's raw path, so it is safe to aggregate on.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sessiontape.transports.http.server.errors import REQUEST_ID

log = logging.getLogger("sessiontape.access")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _safe(value: str) -> str:
    """A value from the client (a decoded path parameter) fit for one text line."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", value)


def _raw_path(scope: Scope) -> str:
    """The path as it came on the wire: still percent-encoded, so a log line cannot be split by it."""
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else str(scope.get("path", ""))
    return path if len(path) <= 512 else path[:512] + "..."


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0
        sent = 0

        async def watched(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self._record(scope, status, sent, time.perf_counter() - start)

    @staticmethod
    def _record(scope: Scope, status: int, sent: int, duration: float) -> None:
        route: Any = scope.get("route")
        template = str(getattr(route, "path", "") or "-")
        params = scope.get("path_params") or {}
        client = scope.get("client")
        fields = {
            "request_id": scope.get(REQUEST_ID),
            "session_id": params.get("sid"),
            "method": scope.get("method"),
            "route": template,
            "path": _raw_path(scope),
            "status": status or None,
            "duration_s": round(duration, 6),
            "bytes": sent,
            "client": f"{client[0]}:{client[1]}" if client else None,
        }
        log.info(
            "%s %s %s %s %.3fs %dB %s%s",
            fields["client"] or "-",
            fields["method"],
            fields["path"],
            status or "-",
            duration,
            sent,
            fields["request_id"] or "-",
            f" session={_safe(str(fields['session_id']))}" if fields["session_id"] else "",
            extra=fields,
        )
