"""Hostile data written into a store behind the runtime's back."""

from __future__ import annotations

import json
from typing import Any

from sessiontape.core.events import Event, T, event_hash
from sessiontape.core.log import EventLog


async def poison(log: EventLog, sid: str) -> None:
    """What an older server stored for ``temperature: NaN``: null in the generation.started body.

    The body is rewritten and the hash chain re-sealed, so only the bad parameter is
    wrong; written in one transaction on the log's own connection, past the log's API.
    """
    sql = log.dialect.sql

    def work(cur: Any) -> None:
        cur.execute(
            sql(
                "SELECT position, version, type, body, data, recorded_at, hash, prev_hash"
                " FROM events WHERE session_id = ? ORDER BY version"
            ),
            (sid,),
        )
        rows = cur.fetchall()
        prev = rows[0][7]
        for position, version, type_, body_json, data, recorded_at, _hash, _prev in rows:
            body = json.loads(body_json)
            if type_ == T.GENERATION_STARTED:
                body["params"]["temperature"] = None
            h = event_hash(Event(position, sid, version, type_, body, data, recorded_at, "", prev))
            cur.execute(
                sql("UPDATE events SET body = ?, hash = ?, prev_hash = ? WHERE position = ?"),
                (json.dumps(body, sort_keys=True, separators=(",", ":")), h, prev, position),
            )
            prev = h
        cur.execute(sql("DELETE FROM snapshots WHERE session_id = ?"), (sid,))

    await log.dialect.transaction(work, None)
