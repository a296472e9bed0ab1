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
import inspect
import logging
import sys
from collections.abc import Sequence
from typing import Any

from sessiontape.core.commands import audit, maintenance, replay, serve, sessions, transfer
from sessiontape.core.commands.audit import audit_reason, cmd_audit, divergence_text
from sessiontape.core.commands.common import check_database_url, load_config
from sessiontape.core.commands.maintenance import cmd_db_upgrade, cmd_purge
from sessiontape.core.commands.replay import cmd_replay
from sessiontape.core.commands.serve import cmd_serve, serve_overrides
from sessiontape.core.commands.sessions import cmd_sessions_ls, cmd_sessions_show
from sessiontape.core.commands.transfer import cmd_export, cmd_import
from sessiontape.core.config import LoggingSettings
from sessiontape.core.errors import ConfigError, SessiontapeError

#: the command functions, importable from here too (they live in core/commands/)
__all__ = [
    "audit_reason",
    "build_parser",
    "check_database_url",
    "cmd_audit",
    "cmd_db_upgrade",
    "cmd_export",
    "cmd_import",
    "cmd_purge",
    "cmd_replay",
    "cmd_serve",
    "cmd_sessions_ls",
    "cmd_sessions_show",
    "divergence_text",
    "load_config",
    "main",
    "serve_overrides",
]

log = logging.getLogger("sessiontape")


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

    for group in (serve, sessions, replay, audit, transfer, maintenance):
        group.register(sub)
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
            _unavailable_command(sub, ep.name, exc)
            continue
        register(sub)


def _unavailable_command(sub: Any, name: str, exc: Exception) -> None:
    """A plugin command whose import failed: a WARNING naming the missing module, and a
    command of that name that says why it cannot run instead of argparse's "invalid choice"."""
    missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    reason = f"module {missing!r} is missing ({exc})" if missing else f"{type(exc).__name__}: {exc}"
    log.warning("plugin command %r unavailable: %s", name, reason)

    def unavailable(args: argparse.Namespace) -> int:
        print(f"sessiontape: error: the {name!r} command is unavailable: {reason}", file=sys.stderr)
        return 1

    # no option prefix: whatever follows the name is taken as is, and the error above is shown
    p = sub.add_parser(name, help=f"(unavailable: {reason})", add_help=False, prefix_chars="\0")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=unavailable)


def _config_logging(args: argparse.Namespace) -> LoggingSettings:
    """``[logging]`` from the config, read before logging starts (defaults when unreadable:
    the command itself then reports what is wrong with the config)."""
    try:
        return load_config(args).logging
    except SessiontapeError:
        return LoggingSettings()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from sessiontape.core.logformat import configure

    settings = _config_logging(args)
    level = "DEBUG" if args.verbose else settings.level
    fmt = getattr(args, "log_format", None) or settings.format
    try:
        configure(level, fmt)
    except ConfigError as exc:
        print(f"sessiontape: error: {exc.message}", file=sys.stderr)
        return 2
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if not settings.access_log:
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
