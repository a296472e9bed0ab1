"""``sessiontape remote``: the native HTTP API from the command line, through :mod:`sessiontape.client`.

    sessiontape remote ls [--status open] [--json]
    sessiontape remote show ID
    sessiontape remote generate ID --text "Hello" --max-tokens 32 [--seed 1] [--temperature 0]
    sessiontape remote tail ID [--until-generation G] [--json]
    sessiontape remote fork ID --at-position N
    sessiontape remote close ID
    sessiontape remote export ID > session.ndjson

The server is ``--url`` (else ``SESSIONTAPE_URL``, else http://127.0.0.1:8080)
and the bearer token ``--token`` (else ``SESSIONTAPE_AUTH_TOKEN``). A refused
request prints ``sessiontape: error: <code>: <message>`` and exits 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from sessiontape.client import DEFAULT_URL, Client, Update
from sessiontape.errors import APIError, ClientError


def register(subparsers: Any) -> None:
    remote = subparsers.add_parser("remote", help="talk to a running server over its HTTP API")
    remote.add_argument(
        "--url", default=None, help=f"server URL (default: $SESSIONTAPE_URL or {DEFAULT_URL})"
    )
    remote.add_argument(
        "--token", default=None, help="bearer token (default: $SESSIONTAPE_AUTH_TOKEN)"
    )
    sub = remote.add_subparsers(dest="remote_command", required=True)

    ls = sub.add_parser("ls", help="list sessions, newest first")
    ls.add_argument(
        "--status", default=None, help="only sessions in this status (open, closed, ...)"
    )
    ls.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.set_defaults(remote=_ls)

    show = sub.add_parser("show", help="print a session's document as JSON")
    show.add_argument("session_id", help="the session id")
    show.set_defaults(remote=_show)

    gen = sub.add_parser(
        "generate", help="append text (optional) and generate, printing the text as it comes"
    )
    gen.add_argument("session_id", help="the session id")
    gen.add_argument("--text", default=None, help="text to append first")
    gen.add_argument(
        "--max-tokens", type=int, default=32, help="tokens to generate at most (default 32)"
    )
    gen.add_argument(
        "--seed", type=int, default=None, help="sampling seed (default: the server draws one)"
    )
    gen.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature (0: greedy)"
    )
    gen.set_defaults(remote=_generate)

    tail = sub.add_parser("tail", help="follow a session live (resuming dropped connections)")
    tail.add_argument("session_id", help="the session id")
    tail.add_argument("--until-generation", default=None, help="stop when this generation finishes")
    tail.add_argument(
        "--json", action="store_true", help="print each update (kind, position, patch) as JSON"
    )
    tail.set_defaults(remote=_tail)

    fork = sub.add_parser("fork", help="fork a session at a token position or event version")
    fork.add_argument("session_id", help="the session id")
    fork.add_argument("--at-position", type=int, default=None, help="keep the first N tokens")
    fork.add_argument(
        "--at-version", type=int, default=None, help="fork the session as of event version N"
    )
    fork.set_defaults(remote=_fork)

    close = sub.add_parser("close", help="close a session")
    close.add_argument("session_id", help="the session id")
    close.set_defaults(remote=_close)

    export = sub.add_parser("export", help="print a session's events as NDJSON")
    export.add_argument("session_id", help="the session id")
    export.set_defaults(remote=_export)

    # the main CLI reads --config/--db of every subcommand (for [logging]); these have neither
    remote.set_defaults(func=run, config=None, db=None)


def run(args: argparse.Namespace) -> int:
    url = args.url or os.environ.get("SESSIONTAPE_URL") or DEFAULT_URL
    token = args.token or os.environ.get("SESSIONTAPE_AUTH_TOKEN") or None
    command: Callable[[Client, argparse.Namespace], None] = args.remote
    if not getattr(args, "verbose", False):
        logging.getLogger("httpx").setLevel(
            logging.WARNING
        )  # one line per request is -v's business
    try:
        with Client(url, token=token) as client:
            command(client, args)
    except APIError as exc:
        print(f"sessiontape: error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except ClientError as exc:
        print(f"sessiontape: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _ls(client: Client, args: argparse.Namespace) -> None:
    rows = client.list_sessions(status=args.status, limit=args.limit)
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print(
                f"{row['id']}  {row.get('status', ''):8} {row.get('protocol', ''):10} "
                f"{row.get('history_length', 0):>7} tokens  {row.get('label') or ''}"
            )


def _show(client: Client, args: argparse.Namespace) -> None:
    print(json.dumps(client.get_session(args.session_id), indent=2))


def _texts(updates: Iterator[Update], pick: Callable[[dict[str, Any]], str]) -> None:
    """Print what ``pick(document)`` gains with each update (texts grow by appending)."""
    shown = 0
    for u in updates:
        text = pick(u.document)
        if u.kind == "snapshot":
            shown = len(text)
        elif len(text) > shown:
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
        if u.kind == "end":
            sys.stdout.write(
                f"\n[session {u.data.get('status') if isinstance(u.data, dict) else 'ended'}]\n"
            )
    sys.stdout.write("\n")


def _generate(client: Client, args: argparse.Namespace) -> None:
    params: dict[str, Any] = {"max_tokens": args.max_tokens}
    for name in ("text", "seed", "temperature"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)

    known: list[int] = []  # how many generations the snapshot had: the new one comes after them

    def new_generation_text(doc: dict[str, Any]) -> str:
        gens = doc.get("generations") or []
        if not known:
            known.append(len(gens))
        return str(gens[known[0]].get("text") or "") if len(gens) > known[0] else ""

    _texts(client.generate_stream(args.session_id, **params), new_generation_text)


def _tail(client: Client, args: argparse.Namespace) -> None:
    updates = client.tail(args.session_id, until_generation=args.until_generation)
    if args.json:
        for u in updates:
            print(
                json.dumps(
                    {"kind": u.kind, "position": u.position, "patch": u.patch, "data": u.data}
                )
            )
        return
    _texts(updates, lambda doc: str((doc.get("history") or {}).get("text") or ""))


def _fork(client: Client, args: argparse.Namespace) -> None:
    doc = client.fork(args.session_id, at_position=args.at_position, at_version=args.at_version)
    print(doc["id"])


def _close(client: Client, args: argparse.Namespace) -> None:
    print(client.close_session(args.session_id).get("status", ""))


def _export(client: Client, args: argparse.Namespace) -> None:
    for event in client.export(args.session_id):
        print(json.dumps(event, separators=(",", ":")))
