"""``sessiontape purge`` and ``db upgrade``: retention and schema maintenance."""

from __future__ import annotations

import argparse
from typing import Any

from sessiontape.core.commands.common import (
    add_common,
    check_database_url,
    load_config,
    log_only,
    redact,
)


async def cmd_purge(args: argparse.Namespace) -> int:
    import time

    from sessiontape.core.bodies import SessionPurged, body
    from sessiontape.core.errors import InvalidParameters

    if not args.ids and args.older_than_days is None:
        raise InvalidParameters("name session ids or --older-than-days N")
    log_ = await log_only(args)
    try:
        ids = list(args.ids)
        if args.older_than_days is not None:
            cutoff = time.time() - args.older_than_days * 86400
            for status in ("closed", "aborted", "expired"):
                for row in await log_.list_sessions(status=status, limit=1_000_000):
                    if row.last_active_at < cutoff:
                        ids.append(row.id)
        for sid in ids:
            row = await log_.get_session(sid)
            if row.status == "open" and not args.force:
                raise InvalidParameters(f"session {sid} is open; close it first or pass --force")
            tomb = await log_.purge(sid, reason=args.reason)
            through = body(tomb, SessionPurged)["through_version"]
            print(f"purged {sid}: {through} events, tombstone v{tomb.version}")
    finally:
        await log_.close()
    if args.older_than_days is not None:
        print(
            f"purged {len(ids)} session{'' if len(ids) == 1 else 's'}"
            f" ({len(ids) - len(args.ids)} closed, aborted or expired ones idle for more than"
            f" {args.older_than_days:g} days)"
        )
    return 0


async def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from sessiontape.core.log import EventLog

    cfg = load_config(args)
    check_database_url(cfg.db_url, must_exist=False)
    log_ = await EventLog.open(cfg.db_url, migrate=True)
    try:
        rev = await log_.revision()
    finally:
        await log_.close()
    print(f"database at revision {rev}: {redact(cfg.db_url)}")
    return 0


def register(sub: Any) -> None:
    """Add this group's subcommands to the ``sessiontape`` parser."""
    pg = sub.add_parser(
        "purge", help="delete sessions' events, leaving a tombstone the chain verifies from"
    )
    add_common(pg)
    pg.add_argument("ids", nargs="*", metavar="ID", help="session ids to purge")
    pg.add_argument(
        "--older-than-days",
        type=float,
        metavar="N",
        help="also purge closed, aborted and expired sessions idle for N days",
    )
    pg.add_argument(
        "--reason", default="retention", help="recorded in the tombstone (default: retention)"
    )
    pg.add_argument("--force", action="store_true", help="purge open sessions too")
    pg.set_defaults(func=cmd_purge)

    d = sub.add_parser("db", help="database maintenance").add_subparsers(dest="sub", required=True)
    up = d.add_parser("upgrade", help="apply migrations")
    add_common(up)
    up.set_defaults(func=cmd_db_upgrade)
