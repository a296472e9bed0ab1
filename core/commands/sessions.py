"""``sessiontape sessions ls`` and ``sessions show``: the sessions index and one session's state."""

from __future__ import annotations

import argparse
import json
from typing import Any

from sessiontape.core.commands.common import add_common, log_only


async def cmd_sessions_ls(args: argparse.Namespace) -> int:
    log_ = await log_only(args)
    try:
        rows = await log_.list_sessions(
            status=args.status, protocol=args.protocol, limit=args.limit
        )
    finally:
        await log_.close()
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=None))
        return 0
    print(
        f"{'ID':28} {'STATUS':8} {'PROTOCOL':10} {'ENGINE':10} {'TOKENS':>7} {'EVENTS':>7}  PARENT"
    )
    for r in rows:
        print(
            f"{r.id:28} {r.status:8} {r.protocol:10} {r.engine:10} {r.history_length:>7} {r.event_count:>7}  {r.parent_id or ''}"
        )
    return 0


async def cmd_sessions_show(args: argparse.Namespace) -> int:
    from sessiontape.core.replay import escape_controls, render_tokens
    from sessiontape.core.session.loader import load_state

    log_ = await log_only(args)
    try:
        row = await log_.get_session(args.id)
        st = await load_state(log_, args.id)
    finally:
        await log_.close()
    info = row.to_json()
    info.update(
        {
            "mode": st.mode,
            "tokens": len(st.tokens),
            "text": render_tokens(st.tokens[-2000:]),
            "generations": [
                {"id": g.id, "tokens": len(g.tokens), "finish_reason": g.finish_reason}
                for g in st.generations.values()
            ],
            "nodes": len(st.nodes),
            "actions": len(st.actions),
            "feedback": st.feedback,
            "errors": st.errors,
            "provenance": st.engine,
            "abort": st.abort,
        }
    )
    if args.json:
        print(json.dumps(info))
        return 0
    for key in (
        "id",
        "status",
        "protocol",
        "mode",
        "engine",
        "model_id",
        "parent_id",
        "fork_position",
        "event_count",
        "tokens",
        "nodes",
        "actions",
    ):
        print(f"{key:14} {info[key]}")
    print(f"{'provenance':14} {json.dumps(st.engine)}")
    for g in info["generations"]:
        print(f"{'generation':14} {g['id']} {g['tokens']} tokens, {g['finish_reason']}")
    for f in st.feedback:
        print(f"{'feedback':14} score {f.get('score')} {json.dumps(f)}")
    for e in st.errors:
        print(escape_controls(f"{'error':14} {e.get('code')}: {e.get('message')}"))
    if st.abort:
        print(escape_controls(f"{'aborted':14} {st.abort.get('code')}: {st.abort.get('message')}"))
    print(f"{'text':14} {escape_controls(info['text'])}")
    return 0


def register(sub: Any) -> None:
    """Add this group's subcommands to the ``sessiontape`` parser."""
    ss = sub.add_parser("sessions", help="list or show sessions").add_subparsers(
        dest="sub", required=True
    )
    ls = ss.add_parser("ls", help="list sessions")
    add_common(ls)
    ls.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    ls.add_argument(
        "--status", help="only sessions with this status (open, closed, aborted, expired, purged)"
    )
    ls.add_argument(
        "--protocol", help="only sessions opened over this protocol (http, salience, kakeya, ...)"
    )
    ls.add_argument(
        "--limit", type=int, default=1000, help="at most N sessions, newest first (default 1000)"
    )
    ls.set_defaults(func=cmd_sessions_ls)
    sh = ss.add_parser("show", help="show one session")
    add_common(sh)
    sh.add_argument("id", help="session id")
    sh.add_argument("--json", action="store_true", help="one JSON object instead of text")
    sh.set_defaults(func=cmd_sessions_show)
