"""``sessiontape nostr call``: publish a signed D4 call and print results as they arrive.

    sessiontape nostr call --relay ws://127.0.0.1:7777 --function <id> --prompt "Hello" \\
        --max-total-cost 50000 --max-iteration-cost 1000 --key-file caller.key

Each reply (intermediate result, final result, price suggestion or error)
is printed as one JSON line; the command exits 0 after the final reply,
1 on an ``err`` reply or when no relay can be reached within
``--connect-timeout`` (or none accepts the call), and 2 when ``--timeout``
passes first. Event ids (``--function``, ``--continue``) must be 64 hex
digits. Without ``--key-file`` a throwaway key signs the call.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

_EVENT_ID = re.compile(r"[0-9a-fA-F]{64}")


def event_id(text: str) -> str:
    """An argparse type: a nostr event id, 64 hex digits (returned in lower case)."""
    if not _EVENT_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not a nostr event id (64 hex digits): {text!r}")
    return text.lower()


def register(subparsers: Any) -> None:
    nostr = subparsers.add_parser("nostr", help="D4 (DDIP-001) over nostr")
    sub = nostr.add_subparsers(dest="nostr_command", required=True)
    call = sub.add_parser("call", help="publish a signed call and print results as they arrive")
    call.add_argument("--relay", action="append", required=True, help="relay URL (repeatable)")
    call.add_argument(
        "--function", required=True, type=event_id, help="function event id (64 hex digits)"
    )
    call.add_argument("--prompt", required=True, help="the text the function is called with")
    call.add_argument("--max-total-cost", type=int, default=100_000, help="msat for the whole call")
    call.add_argument(
        "--max-iteration-cost", type=int, default=1000, help="msat per iteration (token)"
    )
    call.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="stop after N tokens (default: the worker's limit)",
    )
    call.add_argument(
        "--seed", type=int, default=None, help="sampling seed (default: the worker draws one)"
    )
    call.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)"
    )
    call.add_argument(
        "--continue",
        dest="continue_from",
        default=None,
        type=event_id,
        help="a result event id with more_results: true to continue",
    )
    call.add_argument(
        "--key-file", default=None, help="secret key (nsec or hex); default: a throwaway key"
    )
    call.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the final result"
    )
    call.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for a relay connection before giving up (default 5)",
    )
    # the main CLI reads --config/--db of every subcommand (for [logging]); this one has neither
    call.set_defaults(func=run_call, config=None, db=None)


def call_content(args: argparse.Namespace) -> str:
    call_args: dict[str, Any] = {
        "prompt": args.prompt,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
    }
    return json.dumps(
        {
            "max_iteration_cost": args.max_iteration_cost,
            "max_total_cost": args.max_total_cost,
            "results": 1,
            "version": "0.1.0",
            "args": call_args,
        }
    )


async def run_call(args: argparse.Namespace) -> int:
    import nostr_sdk as ns

    if args.key_file:
        # a one-line key file read once before any I/O starts
        keys = ns.Keys.parse(Path(args.key_file).read_text().strip())  # noqa: ASYNC240
    else:
        keys = ns.Keys.generate()
    client = ns.ClientBuilder().build()
    for url in args.relay:
        await client.add_relay(ns.RelayUrl.parse(url))
    # try_connect, not connect: a relay that is down is an error now, not a silent wait for --timeout
    up = await client.try_connect(datetime.timedelta(seconds=args.connect_timeout))
    if not up.success:
        why = "; ".join(f"{u}: {m}" for u, m in up.failed.items()) or "no answer"
        print(f"sessiontape: error: cannot reach any relay ({why})", file=sys.stderr)
        await client.shutdown()
        return 1
    tags = [["e", args.function]] + ([["e", args.continue_from]] if args.continue_from else [])
    event = (
        ns.EventBuilder(ns.Kind(1), call_content(args))
        .tags([ns.Tag.parse(t) for t in tags])
        .finalize(keys)
    )
    call_id = event.id().to_hex()
    notes = client.notifications()
    await client.subscribe(
        ns.ReqTarget.auto(
            [
                ns.Filter()
                .kind(ns.Kind(1))
                .event(event.id())
                .since(ns.Timestamp.from_secs(int(time.time()) - 60))
            ]
        )
    )
    out = await client.send_event(event)
    print(
        json.dumps(
            {
                "call": call_id,
                "accepted_by": [str(u) for u in out.success],
                "rejected_by": {str(u): str(m) for u, m in out.failed.items()},
            }
        ),
        flush=True,
    )
    if not out.success:
        print("sessiontape: error: no relay accepted the call", file=sys.stderr)
        await client.shutdown()
        return 1
    code = 2
    try:
        async with asyncio.timeout(args.timeout):
            while True:
                note = await notes.next()
                if note.is_shutdown():
                    break
                if not note.is_new_event():
                    continue
                reply = json.loads(note.event.as_json())
                try:
                    result = json.loads(reply["content"])
                except ValueError:
                    continue
                if not isinstance(result, dict):
                    continue
                print(
                    json.dumps({"id": reply["id"], "pubkey": reply["pubkey"], **result}), flush=True
                )
                if not result.get("partial"):
                    code = 1 if result.get("err") else 0
                    break
    except TimeoutError:
        print(f"no final result within {args.timeout}s", file=sys.stderr)
    finally:
        await client.shutdown()
    return code
