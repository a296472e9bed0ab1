"""``sessiontape sessions ls`` and ``sessions show``: the sessions index and one session's state."""

from __future__ import annotations

import argparse
import json
from typing import Any

from sessiontape.core.commands.common import add_common, codec_or_note, log_only


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
    from sessiontape.core.document import build_document, fork_base
    from sessiontape.core.replay import escape_controls, render_tokens
    from sessiontape.core.session.loader import load_state

    log_ = await log_only(args)
    try:
        row = await log_.get_session(args.id)
        st = await load_state(log_, args.id)
        codec = None if args.tokens else codec_or_note(st.engine)
        turns: list[dict[str, Any]] = []
        if codec is not None:
            evs = await log_.read(args.id)
            base = await fork_base(log_, evs[0]) if evs else None
            turns = readable_turns(build_document(args.id, evs, detokenize=codec.decode, base=base))
    finally:
        await log_.close()
    info = row.to_json()
    info.update(
        {
            "mode": st.mode,
            "tokens": len(st.tokens),
            "text": (
                "".join(f"<{t}>" for t in st.tokens[-2000:])
                if args.tokens
                else render_tokens(st.tokens[-2000:])
                if codec is None
                else codec.decode(st.tokens[-2000:])
            ),
            "turns": turns,
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
    if codec is None:
        print(f"{'text':14} {escape_controls(info['text'])}")
        return 0
    for t in turns:
        print(escape_controls(f"[{t['role']}] {t['text']}"))
    return 0


def readable_turns(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The session's text as the viewer shows it: a chat session's conversation (its
    messages by role, the replies as ``assistant``), else its history's segments (input
    as ``user``, generations as ``model``, a fork's inherited history as ``inherited``)."""
    if doc.get("conversation"):
        return [{"role": t["role"], "text": t["text"] or ""} for t in doc["conversation"]]
    roles = {"generation": "model", "inherited": "inherited"}
    return [
        {"role": roles.get(str(s.get("source")), "user"), "text": s.get("text") or ""}
        for s in doc["history"]["segments"]
    ]


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
    sh.add_argument(
        "--tokens",
        action="store_true",
        help="show token ids instead of the session's decoded text",
    )
    sh.set_defaults(func=cmd_sessions_show)
