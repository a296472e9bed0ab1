"""The sessions list as an SSE stream: a snapshot of the index, then a patch per change."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from sessiontape.core.document import SessionListBuilder
from sessiontape.core.document.sessionlist import PREVIEW_EVENTS, preview_of
from sessiontape.core.events import Event, T
from sessiontape.core.log.store import SessionRow
from sessiontape.core.patch import diff, to_rfc6902
from sessiontape.core.runtime import Runtime
from sessiontape.transports.http.native.feeds import frame
from sessiontape.transports.http.server.json_encoding import dump_bytes, dumps

log = logging.getLogger("sessiontape.http.feeds")


#: the events that can change the sessions list (what SessionListBuilder folds)
LIST_EVENTS = frozenset(
    {T.SESSION_OPENED, T.SESSION_CLOSED, T.SESSION_ABORTED, T.SESSION_EXPIRED, T.SESSION_PURGED}
    | {T.GENERATION_STARTED, T.GENERATION_FINISHED}
    # a session's preview: its first input, its first chat request
    | {T.TOKENS_APPENDED, T.WIRE}
)


async def _preview(runtime: Runtime, row: SessionRow) -> str:
    """The session's preview from its first events; its input is decoded only where the
    served model is the one it recorded."""
    evs = await runtime.reads.read_events(row.id, 1, PREVIEW_EVENTS)
    same = row.model_id == runtime.engine.info.model_id
    return preview_of(evs, runtime.engine.detokenize if same else None)


async def list_stream(
    runtime: Runtime,
    *,
    limit: int = 200,
    heartbeat_s: float = 15.0,
    rfc: bool = False,
    queue_max: int = 10_000,
) -> AsyncIterator[bytes]:
    """The SSE stream of the sessions list: a snapshot, then patches as sessions change.

    A reconnect always gets a fresh snapshot (the list is an index view, not
    a fold from genesis), so a client more than ``queue_max`` list changes
    behind is not buffered for: its stream ends and it reconnects.
    """
    position = await runtime.reads.last_position()
    rows = []
    for r in await runtime.reads.list_sessions(limit=limit):
        row = r.to_json()
        row["generating"] = runtime.generations.is_running(r.id)
        row["preview"] = await _preview(runtime, r)
        rows.append(row)
    builder = SessionListBuilder(rows, runtime.engine.detokenize)
    yield frame("snapshot", dump_bytes(builder.doc), position)
    queue: asyncio.Queue[Event | None] = asyncio.Queue(maxsize=queue_max)

    async def pump() -> None:
        try:
            async for e in runtime.reads.subscribe(position, None):
                if e.type not in LIST_EVENTS:
                    continue
                try:
                    queue.put_nowait(e)
                except asyncio.QueueFull:
                    log.info(
                        "sessions list watcher more than %d changes behind: ending its stream",
                        queue_max,
                    )
                    break
        except Exception:  # end the stream; the client reconnects for a fresh snapshot
            log.exception("sessions list feed failed")
        finally:
            # None ends the stream, ahead of anything still queued (a lagging client starts over anyway)
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(None)

    task = asyncio.create_task(pump(), name="sse-list-pump")
    try:
        while True:
            try:
                async with asyncio.timeout(heartbeat_s):  # not wait_for: 3.11's can lose a cancel
                    e = await queue.get()
            except TimeoutError:
                yield b": ping\n\n"
                continue
            if e is None:
                return
            before = builder.doc
            after = builder.apply(e)
            if after is not before:
                ops = diff(before, after)
                if ops:
                    yield frame("patch", dumps(to_rfc6902(ops, after) if rfc else ops), e.position)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
