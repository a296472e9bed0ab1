"""Hostile data written into a store behind the runtime's back."""

from __future__ import annotations

import json

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from sessiontape.core.events import T


async def poison(url: str, sid: str) -> None:
    """What an older server stored for ``temperature: NaN``: null in the generation.started body.

    The body is rewritten and the hash chain re-sealed, so only the bad parameter is wrong.
    """
    from sessiontape.core.events import Event, event_hash

    eng = create_async_engine(url)
    async with eng.begin() as conn:
        rows = (
            await conn.execute(
                sa.text(
                    "SELECT position, version, type, body, data, recorded_at, hash, prev_hash FROM events "
                    "WHERE session_id = :s ORDER BY version"
                ),
                {"s": sid},
            )
        ).all()
        prev = rows[0].prev_hash
        for r in rows:
            body = json.loads(r.body)
            if r.type == T.GENERATION_STARTED:
                body["params"]["temperature"] = None
            e = Event(r.position, sid, r.version, r.type, body, r.data, r.recorded_at, "", prev)
            h = event_hash(e)
            await conn.execute(
                sa.text(
                    "UPDATE events SET body = :b, hash = :h, prev_hash = :p WHERE position = :pos"
                ),
                {
                    "b": json.dumps(body, sort_keys=True, separators=(",", ":")),
                    "h": h,
                    "p": prev,
                    "pos": r.position,
                },
            )
            prev = h
        await conn.execute(sa.text("DELETE FROM snapshots WHERE session_id = :s"), {"s": sid})
    await eng.dispose()
