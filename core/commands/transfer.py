"""``sessiontape export`` and ``import``: sessions as NDJSON, one event a line."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from sessiontape.core.commands.common import add_common, log_only


async def cmd_export(args: argparse.Namespace) -> int:
    log_ = await log_only(args)
    try:
        await log_.get_session(args.id)
        evs = await log_.read(args.id)
    finally:
        await log_.close()
    out = sys.stdout
    for e in evs:
        out.write(json.dumps(e.to_json(), separators=(",", ":")) + "\n")
    return 0


async def cmd_import(args: argparse.Namespace) -> int:
    from sessiontape.core.errors import FailedPrecondition, InvalidEvent
    from sessiontape.core.events import Event
    from sessiontape.core.tokens import length_after

    by_session: dict[str, list[Event]] = {}
    from pathlib import Path

    text = await asyncio.to_thread(Path(args.file).read_text, encoding="utf-8")
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            e = Event.from_json(json.loads(line))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidEvent(f"{args.file}:{n}: not an exported event ({exc})") from exc
        by_session.setdefault(e.session_id, []).append(e)
    log_ = await log_only(args, must_exist=False)
    try:
        # Refuse before writing anything: an import either adds every session or none.
        existing = [sid for sid in by_session if await _exists(log_, sid)]
        if existing:
            raise FailedPrecondition(
                f"session {existing[0]} already exists in this database"
                + (
                    f" (and {len(existing) - 1} more of the file's sessions)"
                    if len(existing) > 1
                    else ""
                )
                + "; purge it first or import into another database"
            )
        for sid, evs in by_session.items():
            evs.sort(key=lambda e: e.version)
            length = 0
            for e in evs:
                length = length_after(length, e.type, e.body)
            await log_.import_events(evs, index={"history_length": length})
            print(f"imported {sid}: {len(evs)} events")
    finally:
        await log_.close()
    return 0


async def _exists(log_: Any, sid: str) -> bool:
    from sessiontape.core.errors import SessionNotFound

    try:
        await log_.get_session(sid)
    except SessionNotFound:
        return False
    return True


def register(sub: Any) -> None:
    """Add this group's subcommands to the ``sessiontape`` parser."""
    e = sub.add_parser("export", help="write a session's events as NDJSON to stdout")
    add_common(e)
    e.add_argument("id", help="session id")
    e.set_defaults(func=cmd_export)

    i = sub.add_parser("import", help="import sessions from an NDJSON export")
    add_common(i)
    i.add_argument("file", help="an NDJSON file written by `sessiontape export`")
    i.set_defaults(func=cmd_import)
