"""Ending open HTTP requests quietly when the server stops.

uvicorn waits for open connections on shutdown and, at its deadline, cancels
what is left, logging every cancelled response as "Exception in ASGI
application" with a traceback (and skipping the app's shutdown). An event
stream never finishes by itself, so every stopped server with a viewer open
printed them. :class:`Drain` tracks the requests in flight and ends them
itself (:class:`Inflight`), in the order a client wants:

- ``end(watchers_only=True)`` when shutdown starts: pure watch streams (a GET
  answered with ``text/event-stream``: a session's or the list's patches) have
  nothing to finish, so they end at once, and so does any that starts later;
- ``end()`` at the grace deadline: whatever still runs (a generation's stream,
  a slow request) is cancelled, as a client that went away would cancel it.

An ended stream gets the last, empty chunk of its body: the client sees an
ordinary end of stream (an EventSource reconnects, to the restarted server,
and resumes by ``Last-Event-ID``). A request whose answer had not started gets
503 ``unavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sessiontape.transports.http.server.errors import error_response


class Inflight:
    """The requests in flight, and ending them (``app.state.inflight``)."""

    def __init__(self) -> None:
        self.tasks: dict[asyncio.Task[object], bool] = {}  # request task -> is a watch stream
        self.ending: set[asyncio.Task[object]] = set()
        self.watchers_closed = False

    def end(self, watchers_only: bool = False) -> int:
        """Cancel the requests in flight (only the watch streams with ``watchers_only``); how many."""
        if watchers_only:
            self.watchers_closed = True
        n = 0
        for task, watch in list(self.tasks.items()):
            if (watch or not watchers_only) and task not in self.ending and not task.done():
                self.ending.add(task)
                task.cancel()
                n += 1
        return n


class Drain:
    """The middleware that registers each request in an :class:`Inflight` and ends it quietly."""

    def __init__(self, app: ASGIApp, inflight: Inflight) -> None:
        self.app = app
        self.inflight = inflight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        if scope["type"] != "http" or task is None:
            await self.app(scope, receive, send)
            return
        inflight = self.inflight
        started = finished = False

        async def watched(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
                ctype = dict(message.get("headers", [])).get(b"content-type", b"")
                if scope.get("method") == "GET" and ctype.startswith(b"text/event-stream"):
                    inflight.tasks[task] = True
                    if (
                        inflight.watchers_closed
                    ):  # started during shutdown: ends right after its head went out
                        asyncio.get_running_loop().call_soon(inflight.end, True)
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        inflight.tasks[task] = False
        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            if task not in inflight.ending:
                raise
            task.uncancel()
            with contextlib.suppress(Exception):  # the client may be gone already
                if not started:
                    await error_response("unavailable", "the server is shutting down", 503)(
                        scope, receive, send
                    )
                elif not finished:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            inflight.tasks.pop(task, None)
            inflight.ending.discard(task)
