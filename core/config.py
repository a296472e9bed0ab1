"""Configuration: defaults, then a TOML file, then ``SESSIONTAPE_*`` env, then flags.

Each section is a frozen dataclass below (:mod:`sessiontape.core.settings_framework`
says how one is declared and validated) and holds the one default of each of
its options; an engine's ``[engine.options]`` and each ``[transports.NAME]``
table are validated by the class the engine or transport declares
(``options_class``, found through :mod:`sessiontape.core.plugins`).
:meth:`Config.load` reads the layers once and refuses what it does not know:
an unknown section or key (naming the nearest known one), a value of the
wrong type, a value out of bounds. docs/configuration.md lists every option.

Example ``sessiontape.toml``::

    [database]
    url = "sqlite+aiosqlite:///./sessiontape.db"

    [engine]
    name = "reference"          # or "onnx"
    process = "inline"          # or "worker": the engine in a process of its own
    [engine.options]
    max_length = 2048

    [transports.grpc]
    listen = "127.0.0.1:50051"

    [auth]
    token = ""                  # bearer token; empty = no auth

Environment variables map onto keys with ``__`` between levels, e.g.
``SESSIONTAPE_DATABASE__URL``, ``SESSIONTAPE_ENGINE__NAME``,
``SESSIONTAPE_TRANSPORTS__GRPC__LISTEN``. Short aliases: ``SESSIONTAPE_DB``,
``SESSIONTAPE_ENGINE``, ``SESSIONTAPE_AUTH_TOKEN``. Values are parsed as TOML
scalars when they parse (``true``, ``12``, ``"x"``), else taken as strings; a
string option keeps the variable's text as it is (a token of digits stays a string).
"""

from __future__ import annotations

import copy
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sessiontape.core.errors import ConfigError, PluginNotFound
from sessiontape.core.settings_framework import load_section, nearest, option


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[v6]:PORT``) to a tuple; raises ConfigError."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def host_port(value: str) -> str | None:
    """A check for listen options (:func:`sessiontape.core.settings_framework.option`)."""
    _, sep, port = value.rpartition(":")
    return None if sep and port.isdigit() and int(port) < 65536 else "must be HOST:PORT"


def _url(value: str) -> str | None:
    return None if "://" in value else "must be a SQLAlchemy URL (DRIVER://...)"


def _level(value: str) -> str | None:
    names = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    return None if value.upper() in names else f"must be one of {', '.join(names)}"


@dataclass(frozen=True)
class DatabaseSettings:
    """``[database]``: where the log lives."""

    url: str = option(
        "sqlite+aiosqlite:///./sessiontape.db",
        "a SQLAlchemy async URL: `sqlite+aiosqlite:///FILE`, or "
        "`postgresql+asyncpg://USER@HOST:PORT/DB` (the `postgres` extra)",
        check=_url,
    )


@dataclass(frozen=True)
class EngineSettings:
    """``[engine]``: which engine serves generations, and where it runs."""

    name: str = option(
        "onnx",
        "`onnx`, `reference` (the deterministic test engine), or a `module:Class` path",
    )
    process: str = option(
        "inline",
        "`inline` runs the engine on the server's event loop; `worker` in a child process "
        "of its own, so its Python time does not take turns with the wires and the log",
        choices=("inline", "worker"),
    )
    options: dict[str, Any] = option(
        factory=dict,
        doc="the engine's own options (`[engine.options]`; their tables are below)",
    )


@dataclass(frozen=True)
class AuthSettings:
    """``[auth]``: who may call."""

    token: str = option(
        "",
        "bearer token every gRPC call and HTTP request must carry (health endpoints stay "
        "open); empty: no auth",
        repr=False,
    )


#: a session's idle time to live where ``[sessions] idle_ttl_s`` names none for its protocol
IDLE_TTL_S = 1800.0


@dataclass(frozen=True)
class SessionsSettings:
    """``[sessions]``: session lifetime and size limits."""

    idle_ttl_s: float | dict[str, float] = option(
        factory=lambda: {"default": IDLE_TTL_S, "salience": IDLE_TTL_S, "kakeya": IDLE_TTL_S},
        doc="seconds a session may sit idle before it expires, per protocol (`default` for the "
        "others); one number sets them all",
        gt=0,
    )
    sweep_interval_s: float = option(30.0, "seconds between sweeps for expired sessions", gt=0)
    max_nesting_depth: int = option(32, "Evergreen DAG depth limit", ge=1)
    max_nodes: int = option(
        100_000,
        "Evergreen nodes per session; more fragments are refused as resource exhausted",
        ge=1,
    )
    state_cache_size: int = option(
        1024, "session states kept in memory (the log is the truth)", ge=1
    )
    kakeya_sink: int = option(
        0, "Kakeya truncation: first positions kept (`[transports.grpc] sink` wins)", ge=0
    )
    kakeya_window: int | None = option(
        None,
        "Kakeya truncation: last positions kept; unset: no truncation "
        "(`[transports.grpc] window` wins)",
        ge=1,
    )


@dataclass(frozen=True)
class LogSettings:
    """``[log]``: the event log's group commit, snapshots and payloads."""

    batch_max: int = option(2000, "events per group commit", ge=1)
    snapshot_every: int = option(10_000, "events between state snapshots; 0: none", ge=0)
    inline_max_bytes: int = option(
        4096, "larger payloads are stored as content-addressed blobs", ge=1
    )
    poll_interval_s: float = option(0.5, "PostgreSQL tailer's poll, beside LISTEN/NOTIFY", gt=0)


@dataclass(frozen=True)
class GenerationSettings:
    """``[generation]``: the pipelined token path (docs/architecture.md, Generation). The
    run policy derives the rest from these (:mod:`sessiontape.core.generation.policy`)."""

    max_run: int = option(
        256,
        "most steps committed in one append (also: decoded steps that may wait uncommitted, "
        "and a quarter of it is what a fast engine's steps are gathered to per append) ...",
        ge=1,
    )
    linger_s: float = option(
        0.005,
        "... waiting at most this long for them (also: a turn of the priority gate ends "
        "past this while another generation waits)",
        gt=0,
    )
    max_active: int = option(
        16,
        "generations that run at once; the others wait their turn, in priority then "
        "arrival order (0: no limit)",
        ge=0,
    )


#: ``[generation]`` options that were settings and are now derived or constant: each
#: given one is refused with where its value comes from now
REMOVED_GENERATION = {
    "run_ahead": "it equals `max_run`",
    "min_run": "it is a quarter of `max_run`",
    "burst": "it is a quarter of `max_run`",
    "burst_s": "it equals `linger_s`",
    "pace_s": "it is a constant (core/generation/policy.py PACE_S)",
    "active_hold_s": "it is a constant (core/generation/scheduler.py ACTIVE_HOLD_S)",
}


@dataclass(frozen=True)
class LoggingSettings:
    """``[logging]``: what ``sessiontape`` commands log, and how."""

    level: str = option("INFO", "log level (`-v` forces DEBUG)", check=_level)
    format: str = option("text", "`text`, or `json`: one object per line", choices=("text", "json"))
    access_log: bool = option(True, "the HTTP access log, on the `sessiontape.access` logger")


@dataclass(frozen=True)
class LimitsSettings:
    """``[limits]``: what one request may cost, on every wire (docs/security.md)."""

    max_body_bytes: int = option(
        16 * 1024 * 1024,
        "an HTTP body (413 while it streams in; gRPC messages have "
        "`[transports.grpc] max_message_bytes`)",
        ge=1,
    )
    max_json_depth: int = option(64, "nesting of a JSON request body", ge=1)
    max_meta_bytes: int = option(64 * 1024, "session `meta` and one feedback body, as JSON", ge=1)
    body_timeout_s: float = option(
        30.0, "a body that sends nothing for this long is refused (408)", gt=0
    )
    header_timeout_s: float = option(
        10.0, "the request line and headers must arrive within this (slowloris)", gt=0
    )
    keep_alive_s: float = option(5.0, "idle keep-alive connections close after this", gt=0)
    max_header_bytes: int = option(16 * 1024, "request line plus headers", ge=1)
    max_connections: int = option(1000, "concurrent HTTP connections and tasks before 503", ge=1)
    max_requests_per_client: int = option(
        64,
        "concurrent HTTP requests (SSE streams included) from one address before 429 "
        "(`/healthz` exempt)",
        ge=1,
    )
    max_streams_per_connection: int = option(
        100,
        "concurrent gRPC streams on one client connection "
        "(`[transports.grpc] max_concurrent_streams` wins)",
        ge=1,
    )


@dataclass(frozen=True)
class ServerSettings:
    """``[server]``: the process ``sessiontape serve`` runs."""

    event_loop: str = option(
        "auto",
        "`uvloop`, `asyncio` (the standard library's), or `auto`: uvloop where it is "
        "installed (a sequential turn takes a little less CPU on it)",
        choices=("auto", "uvloop", "asyncio"),
    )
    tune_interpreter: bool = option(
        False,
        "once started, freeze the startup heap, collect the youngest generation less "
        "often and hand the GIL between threads sooner, for the whole process "
        "(core/gctune.py); off: CPython's defaults",
    )


#: every section but ``[transports]`` (a table per transport, each its transport's class)
SECTIONS: dict[str, type[Any]] = {
    "database": DatabaseSettings,
    "engine": EngineSettings,
    "auth": AuthSettings,
    "sessions": SessionsSettings,
    "log": LogSettings,
    "generation": GenerationSettings,
    "logging": LoggingSettings,
    "limits": LimitsSettings,
    "server": ServerSettings,
}

ALIASES = {
    "SESSIONTAPE_DB": ("database", "url"),
    "SESSIONTAPE_DB_URL": ("database", "url"),
    "SESSIONTAPE_ENGINE": ("engine", "name"),
    "SESSIONTAPE_AUTH_TOKEN": ("auth", "token"),
}


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(dict(value) if isinstance(value, Mapping) else value)
    return base


def _parse_scalar(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set_path(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config key {'.'.join(path)} crosses a scalar")
    node[path[-1]] = value


def _env_paths(environ: Mapping[str, str]) -> dict[tuple[str, ...], tuple[str, bool]]:
    """Each configuration variable's key path, text, and whether it parses as TOML."""
    out: dict[tuple[str, ...], tuple[str, bool]] = {}
    for name, raw in environ.items():
        if name in ALIASES:
            out[ALIASES[name]] = (raw, False)
        elif name.startswith("SESSIONTAPE_") and "__" in name:
            path = tuple(p.lower() for p in name[len("SESSIONTAPE_") :].split("__"))
            out[path] = (raw, True)
    return out


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The configuration tree the ``SESSIONTAPE_*`` variables set."""
    out: dict[str, Any] = {}
    for path, (raw, parse) in _env_paths(environ).items():
        _set_path(out, path, _parse_scalar(raw) if parse else raw)
    return out


def _paths(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    out: set[tuple[str, ...]] = set()
    for key, value in tree.items():
        path = (*prefix, str(key))
        out |= _paths(value, path) if isinstance(value, Mapping) else {path}
    return out


@dataclass(frozen=True)
class Config:
    """The configuration, one typed object per section (:meth:`load` builds it)."""

    database: DatabaseSettings = field(default_factory=DatabaseSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    sessions: SessionsSettings = field(default_factory=SessionsSettings)
    log: LogSettings = field(default_factory=LogSettings)
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    #: transport name -> its settings (the transport's ``options_class``), or its table
    #: as given for a transport that declares none
    transports: dict[str, Any] = field(default_factory=dict)
    #: ``[engine.options]`` as the engine's ``options_class`` reads them (None: the engine
    #: declares none, or is not installed here; its own constructor then judges them)
    engine_settings: Any = None

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> Config:
        """Defaults < ``path`` (TOML) < ``environ`` (``os.environ``) < ``overrides`` (flags)."""
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            try:
                _merge(data, tomllib.loads(p.read_text()))
            except FileNotFoundError as exc:
                raise ConfigError(f"config file {p} not found") from exc
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc
        env = _env_paths(os.environ if environ is None else environ)
        _merge(data, env_overrides(os.environ if environ is None else environ))
        flagged = _paths(overrides or {})
        texts = {".".join(p): raw for p, (raw, _) in env.items() if p not in flagged}
        if overrides:
            _merge(data, overrides)
        return cls.from_tree(data, texts=texts)

    @classmethod
    def from_tree(
        cls, data: Mapping[str, Any], *, texts: Mapping[str, str] | None = None
    ) -> Config:
        """The configuration a merged TOML tree describes, or ConfigError."""
        _refuse_removed(data.get("generation"))
        for name in data:
            if name not in SECTIONS and name != "transports":
                known = [*SECTIONS, "transports"]
                near = nearest(str(name), known)
                hint = f"did you mean [{near}]?" if near else f"known: {', '.join(sorted(known))}"
                raise ConfigError(f"unknown section [{name}]; {hint}")
        sections = {
            name: load_section(kind, data.get(name), name, texts=texts)
            for name, kind in SECTIONS.items()
        }
        engine: EngineSettings = sections["engine"]
        return cls(
            **sections,
            transports=_transports(data.get("transports"), texts or {}),
            engine_settings=_engine_settings(engine, texts or {}),
        )

    @property
    def db_url(self) -> str:
        return self.database.url

    @property
    def engine_name(self) -> str:
        return self.engine.name

    @property
    def engine_process(self) -> str:
        """Where the engine runs: ``inline`` (the server's event loop) or ``worker``."""
        return self.engine.process

    @property
    def engine_options(self) -> dict[str, Any]:
        """The ``[engine.options]`` given, as keywords for the engine's constructor (as its
        options class read them, where it declares one)."""
        if self.engine_settings is None:
            return dict(self.engine.options)
        return {key: getattr(self.engine_settings, key) for key in self.engine.options}

    def enabled_transports(self) -> list[str]:
        return [n for n, s in self.transports.items() if _enabled(s)]

    @property
    def auth_token(self) -> str:
        return self.auth.token

    def idle_ttl(self, protocol: str) -> float:
        ttls = self.sessions.idle_ttl_s
        if isinstance(ttls, float):
            return ttls
        return ttls.get(protocol, ttls.get("default", IDLE_TTL_S))


def _refuse_removed(generation: Any) -> None:
    """A ConfigError naming a removed ``[generation]`` option given in the file, the
    environment or a flag (a silent default would change what the user asked for)."""
    if not isinstance(generation, Mapping):
        return
    for key in generation:
        why = REMOVED_GENERATION.get(str(key))
        if why is not None:
            raise ConfigError(f"[generation] {key} is no longer an option: {why}")


def _enabled(settings: Any) -> bool:
    if isinstance(settings, Mapping):
        return settings.get("enabled", False) is True
    return bool(getattr(settings, "enabled", False))


def _options_class(group: str, name: str) -> type[Any] | None:
    from sessiontape.core import plugins

    try:
        return plugins.options_class(group, name)
    except PluginNotFound:
        return None


def _engine_settings(engine: EngineSettings, texts: Mapping[str, str]) -> Any:
    from sessiontape.core.plugins import ENGINES

    kind = _options_class(ENGINES, engine.name)
    if kind is None:
        return None
    return load_section(kind, engine.options, "engine.options", texts=texts)


def _transports(raw: Any, texts: Mapping[str, str]) -> dict[str, Any]:
    """Every installed transport's settings (defaults where not configured), and any
    ``module:Class`` transport the file names."""
    from sessiontape.core.plugins import TRANSPORTS, available

    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"[transports] must be a table of transports, got {raw!r}")
    known = available(TRANSPORTS)
    for name, table in raw.items():
        if name not in known and ":" not in name:
            near = nearest(str(name), known)
            hint = f"did you mean [transports.{near}]?" if near else f"known: {', '.join(known)}"
            raise ConfigError(f"unknown transport [transports.{name}]; {hint}")
        if not isinstance(table, Mapping):
            raise ConfigError(f"transports.{name} must be a table, got {table!r}")
    out: dict[str, Any] = {}
    for name in [*known, *(n for n in raw if n not in known)]:
        kind = _options_class(TRANSPORTS, name)
        table = raw.get(name, {})
        out[name] = (
            dict(table)
            if kind is None
            else load_section(kind, table, f"transports.{name}", texts=texts)
        )
    return out
