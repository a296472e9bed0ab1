"""The ``sessiontape`` command line.

    sessiontape serve [--engine NAME] [--grpc H:P] [--http H:P] [--no-grpc] [--no-http]
                      [--nostr-relay URL ...] [--nostr-key-file F] [--auth-token T] [--log-format json]
    sessiontape sessions ls [--json] [--status S] [--limit N]
    sessiontape sessions show ID [--json]
    sessiontape replay ID [--speed X | --instant] [--follow]
    sessiontape audit ID... [--reexecute] [--engine NAME] [--json]
    sessiontape export ID > file.ndjson
    sessiontape import file.ndjson
    sessiontape purge ID... | --older-than-days N
    sessiontape db upgrade

Every subcommand accepts ``--config FILE`` and ``--db URL``. Errors print one
line to stderr and exit non-zero. Plugins add subcommands through the
``sessiontape.commands`` entry-point group (a ``register(subparsers)``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from core.config import Config
from core.errors import ConfigError, SessiontapeError

log = logging.getLogger("sessiontape")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", metavar="FILE", help="TOML config file (default: ./sessiontape.toml if present)"
    )
    p.add_argument("--db", metavar="URL", help="database URL (SQLAlchemy async)")


def load_config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Config:
    from pathlib import Path

    overrides: dict[str, Any] = dict(extra or {})
    if getattr(args, "db", None):
        overrides.setdefault("database", {})["url"] = args.db
    path = getattr(args, "config", None)
    if path is None and Path("sessiontape.toml").exists():
        path = "sessiontape.toml"
    return Config.load(path, overrides=overrides)


async def _log_only(
    args: argparse.Namespace, *, follow: bool = False, must_exist: bool = True
) -> Any:
    """A log (no engine) for commands that read or edit an existing database.

    A SQLite file that is not there is an error rather than a new, empty
    database (only ``serve``, ``import`` and ``db upgrade`` create one).
    """
    from core.log import EventLog

    cfg = load_config(args)
    check_database_url(cfg.db_url, must_exist=must_exist)
    return await EventLog.open(cfg.db_url, follow=follow)


def check_database_url(url: str, *, must_exist: bool) -> None:
    """Raise ConfigError for a URL SQLAlchemy cannot use, NotFound for a missing SQLite file."""
    from pathlib import Path

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    from core.errors import NotFound

    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ConfigError(
            f"not a database URL: {url!r} (expected e.g. sqlite+aiosqlite:///FILE)"
        ) from exc
    shown = parsed.render_as_string(hide_password=True)
    hint = "use sqlite+aiosqlite:///FILE or postgresql+asyncpg://HOST/DB"
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError as exc:
        raise ConfigError(
            f"unknown database driver {parsed.drivername!r} in {shown} ({hint})"
        ) from exc
    if not getattr(dialect, "is_async", False):
        raise ConfigError(f"{parsed.drivername!r} in {shown} is not an asyncio driver ({hint})")
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise ConfigError(f"the driver for {shown} is not installed: {exc}") from exc
    path = (parsed.database or "") if parsed.get_backend_name() == "sqlite" else ""
    if not path or path == ":memory:" or path.startswith("file:"):
        return
    if must_exist and not Path(path).exists():
        raise NotFound(f"no database at {path} (`sessiontape db upgrade --db {shown}` creates one)")
    if not Path(path).parent.is_dir():
        raise NotFound(f"no directory {Path(path).parent} for the database {path}")


# -- serve -------------------------------------------------------------------


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    t: dict[str, Any] = {}
    if args.grpc:
        t.setdefault("grpc", {})["listen"] = args.grpc
    if args.http:
        t.setdefault("http", {})["listen"] = args.http
    if args.no_grpc:
        t.setdefault("grpc", {})["enabled"] = False
    if args.no_http:
        t.setdefault("http", {})["enabled"] = False
    if args.nostr_relay:
        t.setdefault("nostr", {}).update({"relays": list(args.nostr_relay), "enabled": True})
    if args.nostr_key_file:
        t.setdefault("nostr", {})["key_file"] = args.nostr_key_file
    over: dict[str, Any] = {"transports": t}
    if args.auth_token:
        over["auth"] = {"token": args.auth_token}
    if args.engine:
        over["engine"] = {"name": args.engine}
    return over


async def cmd_serve(args: argparse.Namespace) -> int:
    from core.registry import TRANSPORTS, load
    from core.runtime import Runtime
    from core.transport import Transport

    cfg = load_config(args, serve_overrides(args))
    check_database_url(cfg.db_url, must_exist=False)
    runtime = await Runtime.create(cfg)
    log.info("log: %s", _redact(cfg.db_url))
    runtime.start_sweeper()
    started: list[Transport] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        for name in cfg.enabled_transports():
            cls = load(TRANSPORTS, name)
            transport: Transport = cls(runtime, cfg.transports[name], cfg)
            line = await transport.start()
            started.append(transport)
            log.info("%s: %s", name, line)
        if not started:
            log.warning("no transport enabled; serving nothing but the TTL sweeper")
        log.info("sessiontape ready (engine %s, pid %d)", runtime.engine.info.name, _pid())
        await stop.wait()
        log.info("shutting down")
    finally:
        for t in reversed(started):
            try:
                await t.stop(float(cfg.transports.get(t.name, {}).get("grace_s", 5.0)))
            except Exception:
                log.exception("stopping %s failed", t.name)
        await runtime.aclose()
    return 0


def _pid() -> int:
    import os

    return os.getpid()


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


# -- sessions ----------------------------------------------------------------


async def cmd_sessions_ls(args: argparse.Namespace) -> int:
    log_ = await _log_only(args)
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
    from core.loader import load_state
    from core.replay import escape_controls, render_tokens

    log_ = await _log_only(args)
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


# -- replay, audit, export, import ---------------------------------------------


async def cmd_replay(args: argparse.Namespace) -> int:
    from core.replay import replay

    log_ = await _log_only(args, follow=args.follow)
    try:
        await log_.get_session(args.id)
        evs = await log_.read(args.id)
        await replay(evs, sys.stdout, speed=args.speed, instant=args.instant)
        if args.follow:
            last = evs[-1].position if evs else 0
            terminal = {"session.closed", "session.aborted", "session.expired", "session.purged"}
            if not evs or evs[-1].type not in terminal:

                async def live() -> Any:
                    async for e in log_.subscribe(last, args.id):
                        yield e
                        if e.type in terminal:
                            return

                await replay(live(), sys.stdout, instant=True)
    finally:
        await log_.close()
    return 0


async def cmd_audit(args: argparse.Namespace) -> int:
    from core.audit import AuditReport, audit_session
    from core.engine import Engine
    from core.registry import ENGINES, load

    cfg = load_config(args)
    log_ = await _log_only(args)
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
            for d in r.divergences:
                print(f"  {divergence_text(d)}")
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


def _tok(d: dict[str, Any]) -> str:
    lp = d.get("logprob")
    return f"token {d.get('token')}" + ("" if lp is None else f" (logprob {float(lp):.6g})")


def divergence_text(d: dict[str, Any]) -> str:
    """One divergence as a sentence (the CLI's plain output; --json keeps the raw fields)."""
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
        return f"generation {gid}: first divergence at {at}: recorded {_tok(rec)}, re-executed {_tok(got)}"
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


async def cmd_export(args: argparse.Namespace) -> int:
    log_ = await _log_only(args)
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
    from core.errors import FailedPrecondition, InvalidEvent
    from core.events import Event
    from core.tokens import length_after

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
    log_ = await _log_only(args, must_exist=False)
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
    from core.errors import SessionNotFound

    try:
        await log_.get_session(sid)
    except SessionNotFound:
        return False
    return True


async def cmd_purge(args: argparse.Namespace) -> int:
    import time

    from core.bodies import SessionPurged, body
    from core.errors import InvalidParameters

    if not args.ids and args.older_than_days is None:
        raise InvalidParameters("name session ids or --older-than-days N")
    log_ = await _log_only(args)
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
    from core.log import EventLog
    from migrations.runner import current_revision

    cfg = load_config(args)
    check_database_url(cfg.db_url, must_exist=False)
    log_ = await EventLog.open(cfg.db_url, migrate=True)
    try:
        async with log_.engine.connect() as conn:
            rev = await conn.run_sync(current_revision)
    finally:
        await log_.close()
    print(f"database at revision {rev}: {_redact(cfg.db_url)}")
    return 0


# -- parser --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sessiontape", description="Event-sourced session store for generative-AI sessions."
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {_version()}",
        help="print the version and exit",
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the server with the enabled transports")
    _common(s)
    s.add_argument("--engine", help="engine name (reference, onnx, ...)")
    s.add_argument(
        "--grpc", metavar="HOST:PORT", help="gRPC listen address (default 127.0.0.1:50051)"
    )
    s.add_argument(
        "--http", metavar="HOST:PORT", help="HTTP listen address (default 127.0.0.1:8080)"
    )
    s.add_argument("--no-grpc", action="store_true", help="do not start the gRPC transport")
    s.add_argument("--no-http", action="store_true", help="do not start the HTTP transport")
    s.add_argument(
        "--nostr-relay",
        metavar="URL",
        action="append",
        default=[],
        help="serve D4 calls from this nostr relay (repeatable; enables the nostr transport)",
    )
    s.add_argument(
        "--nostr-key-file", metavar="FILE", help="the D4 worker's secret key (nsec or hex)"
    )
    s.add_argument(
        "--auth-token", metavar="TOKEN", help="require this bearer token on gRPC and HTTP"
    )
    s.add_argument(
        "--log-format",
        choices=("text", "json"),
        help="log lines as text or as one JSON object per line (default: [logging] format, text)",
    )
    s.set_defaults(func=cmd_serve)

    ss = sub.add_parser("sessions", help="list or show sessions").add_subparsers(
        dest="sub", required=True
    )
    ls = ss.add_parser("ls", help="list sessions")
    _common(ls)
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
    _common(sh)
    sh.add_argument("id", help="session id")
    sh.add_argument("--json", action="store_true", help="one JSON object instead of text")
    sh.set_defaults(func=cmd_sessions_show)

    r = sub.add_parser("replay", help="re-render a session from the log")
    _common(r)
    r.add_argument("id", help="session id")
    g = r.add_mutually_exclusive_group()
    g.add_argument(
        "--speed", type=float, default=1.0, help="play back X times as fast as recorded (default 1)"
    )
    g.add_argument(
        "--instant", action="store_true", help="print everything at once, without pauses"
    )
    r.add_argument("--follow", action="store_true", help="keep following a live session")
    r.set_defaults(func=cmd_replay)

    a = sub.add_parser(
        "audit", help="verify chains and invariants; optionally re-execute generations"
    )
    _common(a)
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
    a.set_defaults(func=cmd_audit)

    e = sub.add_parser("export", help="write a session's events as NDJSON to stdout")
    _common(e)
    e.add_argument("id", help="session id")
    e.set_defaults(func=cmd_export)

    i = sub.add_parser("import", help="import sessions from an NDJSON export")
    _common(i)
    i.add_argument("file", help="an NDJSON file written by `sessiontape export`")
    i.set_defaults(func=cmd_import)

    pg = sub.add_parser(
        "purge", help="delete sessions' events, leaving a tombstone the chain verifies from"
    )
    _common(pg)
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
    _common(up)
    up.set_defaults(func=cmd_db_upgrade)

    _plugin_commands(sub)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sessiontape")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _plugin_commands(sub: Any) -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group="sessiontape.commands"):
        try:
            register = ep.load()
        except Exception as exc:
            log.debug("plugin command %s unavailable: %s", ep.name, exc)
            continue
        register(sub)


def _config_logging(args: argparse.Namespace) -> dict[str, Any]:
    """``[logging]`` from the config, read before logging starts (defaults when unreadable)."""
    try:
        return load_config(args).section("logging")
    except SessiontapeError:
        return {}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from core.logformat import configure

    settings = _config_logging(args)
    level = "DEBUG" if args.verbose else str(settings.get("level", "INFO"))
    fmt = getattr(args, "log_format", None) or str(settings.get("format", "text"))
    try:
        configure(level, fmt)
    except ConfigError as exc:
        print(f"sessiontape: error: {exc.message}", file=sys.stderr)
        return 2
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if not settings.get("access_log", True):
        logging.getLogger("sessiontape.access").setLevel(logging.WARNING)
    try:
        result = args.func(args)
        if inspect.isawaitable(result):
            result = asyncio.run(result)  # type: ignore[arg-type]
        return int(result or 0)
    except SessiontapeError as exc:
        print(f"sessiontape: error: {exc.message}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        print(f"sessiontape: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        from sqlalchemy.exc import DBAPIError, SQLAlchemyError

        if not isinstance(exc, SQLAlchemyError) or args.verbose:
            raise
        # The driver's own message, without SQLAlchemy's SQL echo and link (-v shows the traceback).
        cause = exc.orig if isinstance(exc, DBAPIError) else exc
        msg = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        print(f"sessiontape: error: database: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
