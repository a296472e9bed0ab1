"""``sessiontape audit``: verify chains and invariants, optionally re-execute generations,
and say in one sentence why a session failed."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sessiontape.core.commands.common import (
    add_common,
    load_config,
    log_only,
    opened_binding,
    recorded_codec,
)
from sessiontape.core.engine.interface import TextCodec
from sessiontape.core.errors import SessiontapeError

Decode = Callable[[Sequence[int]], str]


async def cmd_audit(args: argparse.Namespace) -> int:
    from sessiontape.core.audit import AuditReport, audit_session
    from sessiontape.core.engine.interface import Engine
    from sessiontape.core.plugins import ENGINES, load

    cfg = load_config(args)
    log_ = await log_only(args)
    engines: dict[str, Engine] = {}
    used: dict[str, str] = {}

    def engine_for(provenance: Any) -> Engine:
        """The engine a session recorded (or --engine), built once per name."""
        recorded = str(provenance.get("engine") or cfg.engine_name)
        name = args.engine or recorded
        used.update(engine=name, recorded=recorded)
        if name not in engines:
            options = cfg.engine_options if name == cfg.engine_name else {}
            engines[name] = load(ENGINES, name)(**options)
        return engines[name]

    reports = []
    engine_of: dict[str, dict[str, str]] = {}
    codecs: dict[str, TextCodec | None] = {}
    try:
        ids = list(args.ids)
        for i, sid in enumerate(ids, 1):
            used.clear()
            try:
                report = await audit_session(
                    log_, sid, reexecute=args.reexecute, engine_for=engine_for
                )
            except SessiontapeError as exc:
                report = AuditReport.failed(sid, str(exc))
            except Exception as exc:  # one bad session never stops the others
                report = AuditReport.failed(sid, f"audit failed: {type(exc).__name__}: {exc}")
            reports.append(report)
            engine_of[sid] = dict(used)
            if report.divergences and not args.tokens:
                opened = await log_.read(sid, 1, 1)
                codecs[sid] = recorded_codec(opened_binding(opened))
            if len(ids) > 1 and not args.json:
                _progress(i, len(ids))
    finally:
        for eng in engines.values():
            await eng.aclose()
        await log_.close()
    if args.json:
        out = []
        for r in reports:
            row = r.to_json()
            if r.reexecuted and engine_of.get(r.session_id):
                row.update(
                    engine=engine_of[r.session_id].get("engine"),
                    recorded_engine=engine_of[r.session_id].get("recorded"),
                )
            if not r.ok:
                row["reason"] = audit_reason(r, engine_of.get(r.session_id, {}))
            out.append(row)
        print(json.dumps(out))
    else:
        for r in reports:
            mark = "ok" if r.ok else "FAILED: " + audit_reason(r, engine_of.get(r.session_id, {}))
            extra = (
                f", {r.generations} generations re-run, {len(r.divergences)} diverged"
                if r.reexecuted
                else ""
            )
            print(
                f"{r.session_id}: {mark} (chain {'ok' if r.chain_ok else 'BROKEN'}, invariants "
                f"{'ok' if r.invariants_ok else 'BROKEN'}{extra})"
            )
            for p in r.problems:
                print(f"  {p}")
            codec = codecs.get(r.session_id)
            for d in r.divergences:
                print(f"  {divergence_text(d, None if codec is None else codec.decode)}")
    return 0 if all(r.ok for r in reports) else 1


def audit_reason(r: Any, engines: dict[str, str]) -> str:
    """Why an audit failed, in one sentence."""
    why = []
    if not r.chain_ok:
        why.append("the hash chain is broken")
    if not r.invariants_ok:
        why.append("an event breaks the session's invariants")
    if r.divergences:
        on, rec = engines.get("engine"), engines.get("recorded")
        where = ""
        if on:
            where = f" on engine {on}" + (f" (recorded on {rec})" if rec and rec != on else "")
        why.append(
            f"re-execution{where} differs from the recording in {len(r.divergences)} of "
            f"{r.generations} generation{'' if r.generations == 1 else 's'}"
        )
    if not why:
        why = [str(p) for p in r.problems[:1]] or ["see the problems listed"]
    return "; ".join(why)


def _tok(d: dict[str, Any], decode: Decode | None) -> str:
    lp = d.get("logprob")
    tok = d.get("token")
    text = ""
    if decode is not None and isinstance(tok, int):
        from sessiontape.core.replay import escape_controls

        text = " " + escape_controls(json.dumps(decode([tok]), ensure_ascii=False))
    return f"token {tok}{text}" + ("" if lp is None else f" (logprob {float(lp):.6g})")


def divergence_text(d: dict[str, Any], decode: Decode | None = None) -> str:
    """One divergence as a sentence (the CLI's plain output; --json keeps the raw fields);
    with ``decode`` (the session's tokenizer) each token's text follows its id."""
    gid, rec, got = d.get("generation_id"), d.get("recorded"), d.get("reexecuted")
    if isinstance(rec, dict) and isinstance(got, dict) and "count" in rec:
        return (
            f"generation {gid}: the recording has {rec['count']} steps, "
            f"re-execution produced {got.get('count')}"
        )
    if isinstance(rec, dict) and isinstance(got, dict) and "token" in rec:
        at = f"step {d.get('index')}" + (
            f" (token position {d['position']})" if d.get("position") is not None else ""
        )
        if rec.get("token") == got.get("token"):
            return (
                f"generation {gid}: first divergence at {at}: same token {rec['token']}, logprob "
                f"{rec.get('logprob')!r} recorded, {got.get('logprob')!r} re-executed"
            )
        return (
            f"generation {gid}: first divergence at {at}: recorded {_tok(rec, decode)}, "
            f"re-executed {_tok(got, decode)}"
        )
    reason = d.get("reason") or d.get("message") or d.get("error")
    if reason:
        return f"generation {gid}: {reason}"
    return f"generation {gid}: " + json.dumps(
        {k: v for k, v in d.items() if k != "generation_id"}, default=str
    )


def _progress(i: int, n: int) -> None:
    """A progress bar on stderr, drawn only on a terminal (no carriage-return frames in files or pipes)."""
    if not sys.stderr.isatty():
        return
    width = 30
    done = int(width * i / n)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def register(sub: Any) -> None:
    """Add this group's subcommands to the ``sessiontape`` parser."""
    a = sub.add_parser(
        "audit", help="verify chains and invariants; optionally re-execute generations"
    )
    add_common(a)
    a.add_argument("ids", nargs="+", metavar="ID", help="session ids")
    a.add_argument(
        "--reexecute",
        action="store_true",
        help="run every recorded generation again and compare the tokens bitwise",
    )
    a.add_argument(
        "--engine", help="re-execute on this engine instead of the one each session recorded"
    )
    a.add_argument("--json", action="store_true", help="one JSON array of reports instead of text")
    a.add_argument(
        "--tokens", action="store_true", help="name diverging tokens by id only, without their text"
    )
    a.set_defaults(func=cmd_audit)
