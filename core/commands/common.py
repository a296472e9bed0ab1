"""What every subcommand shares: ``--config``/``--db``, the configuration, and
a log opened without an engine for commands that read or edit a database."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from sessiontape.core.config import Config
from sessiontape.core.engine.interface import TextCodec
from sessiontape.core.errors import ConfigError, PluginNotFound
from sessiontape.core.events import Event


def add_common(p: argparse.ArgumentParser) -> None:
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


async def log_only(
    args: argparse.Namespace, *, follow: bool = False, must_exist: bool = True
) -> Any:
    """A log (no engine) for commands that read or edit an existing database.

    A SQLite file that is not there is an error rather than a new, empty
    database (only ``serve``, ``import`` and ``db upgrade`` create one).
    """
    from sessiontape.core.log import EventLog

    cfg = load_config(args)
    check_database_url(cfg.db_url, must_exist=must_exist)
    return await EventLog.open(cfg.db_url, follow=follow)


def check_database_url(url: str, *, must_exist: bool) -> None:
    """Raise ConfigError for a URL SQLAlchemy cannot use, NotFound for a missing SQLite file."""
    from pathlib import Path

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    from sessiontape.core.errors import NotFound

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


def redact(url: str) -> str:
    """``url`` with its password hidden."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def opened_binding(events: Sequence[Event]) -> Mapping[str, Any] | None:
    """The engine binding the session's ``session.opened`` (its first event) recorded."""
    from sessiontape.core.bodies import SessionOpened, body
    from sessiontape.core.events import T

    if not events or events[0].type != T.SESSION_OPENED:
        return None
    return body(events[0], SessionOpened).get("engine")


def codec_or_note(binding: Mapping[str, Any] | None) -> TextCodec | None:
    """:func:`recorded_codec`, saying on stderr when there is none (the ids are shown)."""
    codec = recorded_codec(binding)
    if codec is None:
        model = (binding or {}).get("model_id", "?")
        print(
            f"note: the tokenizer of {model} is not at hand here: token ids shown",
            file=sys.stderr,
        )
    return codec


def recorded_codec(binding: Mapping[str, Any] | None) -> TextCodec | None:
    """The text codec of the session whose ``session.opened`` recorded ``binding``: its
    engine plugin's (:meth:`Engine.recorded_codec`), found by the plugin's registered
    name only (a ``module:attr`` path in a log is never imported); None when the engine
    is not installed or does not have the session's tokenizer at hand."""
    from sessiontape.core.engine.interface import Engine
    from sessiontape.core.plugins import ENGINES, load

    if not isinstance(binding, Mapping):
        return None
    name = binding.get("engine")
    if not isinstance(name, str) or not name or ":" in name:
        return None
    try:
        cls = load(ENGINES, name)
    except PluginNotFound:
        return None
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        return None
    return cls.recorded_codec(binding)
