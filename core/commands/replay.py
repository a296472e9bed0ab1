"""``sessiontape replay``: re-render a session in the terminal from the log."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sessiontape.core.commands.common import (
    add_common,
    codec_or_note,
    log_only,
    opened_binding,
)


async def cmd_replay(args: argparse.Namespace) -> int:
    from sessiontape.core.replay import replay

    log_ = await log_only(args, follow=args.follow)
    try:
        await log_.get_session(args.id)
        evs = await log_.read(args.id)
        codec = None if args.tokens else codec_or_note(opened_binding(evs))
        detokenize = None if codec is None else codec.decode
        await replay(
            evs,
            sys.stdout,
            speed=args.speed,
            instant=args.instant,
            detokenize=detokenize,
            ids=args.tokens,
        )
        if args.follow:
            last = evs[-1].position if evs else 0
            terminal = {"session.closed", "session.aborted", "session.expired", "session.purged"}
            if not evs or evs[-1].type not in terminal:

                async def live() -> Any:
                    async for e in log_.subscribe(last, args.id):
                        yield e
                        if e.type in terminal:
                            return

                await replay(
                    live(), sys.stdout, instant=True, detokenize=detokenize, ids=args.tokens
                )
    finally:
        await log_.close()
    return 0


def register(sub: Any) -> None:
    """Add this group's subcommands to the ``sessiontape`` parser."""
    r = sub.add_parser("replay", help="re-render a session from the log")
    add_common(r)
    r.add_argument("id", help="session id")
    g = r.add_mutually_exclusive_group()
    g.add_argument(
        "--speed", type=float, default=1.0, help="play back X times as fast as recorded (default 1)"
    )
    g.add_argument(
        "--instant", action="store_true", help="print everything at once, without pauses"
    )
    r.add_argument("--follow", action="store_true", help="keep following a live session")
    r.add_argument(
        "--tokens",
        action="store_true",
        help="show token ids instead of the session's decoded text",
    )
    r.set_defaults(func=cmd_replay)
