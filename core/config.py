"""Configuration: defaults, then a TOML file, then ``SESSIONTAPE_*`` env, then flags.

Example ``sessiontape.toml``::

    [database]
    url = "sqlite+aiosqlite:///./sessiontape.db"

    [engine]
    name = "reference"          # or "onnx"
    process = "inline"          # or "worker": the engine in a process of its own
    [engine.options]
    size = "tiny"

    [transports.grpc]
    enabled = true
    listen = "127.0.0.1:50051"

    [transports.http]
    enabled = true
    listen = "127.0.0.1:8080"

    [auth]
    token = ""                  # bearer token; empty = no auth

Environment variables map onto keys with ``__`` between levels, e.g.
``SESSIONTAPE_DATABASE__URL``, ``SESSIONTAPE_ENGINE__NAME``,
``SESSIONTAPE_TRANSPORTS__GRPC__LISTEN``. Short aliases: ``SESSIONTAPE_DB``,
``SESSIONTAPE_ENGINE``, ``SESSIONTAPE_AUTH_TOKEN``. Values are parsed as TOML
scalars when they parse (``true``, ``12``, ``"x"``), else taken as strings.
"""

from __future__ import annotations

import copy
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sessiontape.core.errors import ConfigError

DEFAULT_DB_URL = "sqlite+aiosqlite:///./sessiontape.db"
ENGINE_PROCESSES = ("inline", "worker")

DEFAULTS: dict[str, Any] = {
    "database": {"url": DEFAULT_DB_URL, "echo": False},
    # process: "inline" runs the engine on the server's event loop; "worker" serves it
    # from a child process (core/engine_worker.py), so its Python time does not take turns
    # with the transports' and the log's
    "engine": {"name": "onnx", "process": "inline", "options": {}},
    "transports": {
        "grpc": {"enabled": True, "listen": "127.0.0.1:50051"},
        "http": {"enabled": True, "listen": "127.0.0.1:8080"},
        "nostr": {"enabled": False, "relays": []},
    },
    "auth": {"token": ""},
    "sessions": {
        # idle TTL per protocol; "default" applies to the rest
        "idle_ttl_s": {"default": 1800.0, "salience": 1800.0, "kakeya": 1800.0},
        "sweep_interval_s": 30.0,
        "max_nesting_depth": 32,
        "max_nodes": 100_000,
        "state_cache_size": 1024,
    },
    "log": {
        "batch_max": 2000,
        "snapshot_every": 10_000,
        "inline_max_bytes": 4096,
        "poll_interval_s": 0.5,
    },
    "generation": {
        # decoded steps that may wait uncommitted (a full queue pauses the engine)
        "run_ahead": 256,
        # most steps committed in one append
        "max_run": 256,
        # a fast engine's steps are gathered for up to linger_s, or until min_run wait
        "min_run": 64,
        "linger_s": 0.005,
        # engine steps a generation takes per turn of the priority gate, holding it
        # at most burst_s (a turn fills a run: burst >= min_run)
        "burst": 64,
        "burst_s": 0.005,
        # a caller slower than the engine (one message per token) gets runs it
        # handles in about pace_s each, committed when it asks for the next
        "pace_s": 0.004,
    },
    "logging": {"level": "INFO", "format": "text", "access_log": True},
    # what one request may cost (docs/security.md); every wire reads these
    "limits": {
        "max_body_bytes": 16
        * 1024
        * 1024,  # HTTP body and gRPC message, refused while streaming in
        "max_json_depth": 64,  # nesting of a JSON request body
        "max_meta_bytes": 64 * 1024,  # session meta and one feedback body, as JSON
        "body_timeout_s": 30.0,  # a body that sends nothing for this long is refused (408)
        "header_timeout_s": 10.0,  # request line and headers must arrive within this (slowloris)
        "keep_alive_s": 5.0,  # idle keep-alive connections are closed after this
        "max_header_bytes": 16 * 1024,  # request line + headers
        "max_connections": 1000,  # concurrent HTTP connections and tasks before 503s
        "max_requests_per_client": 64,  # concurrent HTTP requests (SSE streams included) per client address
        "max_streams_per_connection": 100,  # concurrent gRPC streams on one client connection
    },
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
            base[key] = copy.deepcopy(value)
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


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if name in ALIASES:
            _set_path(out, ALIASES[name], raw)
        elif name.startswith("SESSIONTAPE_") and "__" in name:
            path = tuple(p.lower() for p in name[len("SESSIONTAPE_") :].split("__"))
            _set_path(out, path, _parse_scalar(raw))
    return out


@dataclass
class Config:
    """The merged configuration tree, with typed accessors for what core reads."""

    data: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(DEFAULTS))

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> Config:
        data = copy.deepcopy(DEFAULTS)
        if path is not None:
            p = Path(path)
            try:
                _merge(data, tomllib.loads(p.read_text()))
            except FileNotFoundError as exc:
                raise ConfigError(f"config file {p} not found") from exc
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc
        _merge(data, env_overrides(os.environ if environ is None else environ))
        if overrides:
            _merge(data, overrides)
        cfg = cls(data)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not isinstance(self.db_url, str) or "://" not in self.db_url:
            raise ConfigError(f"database.url must be a SQLAlchemy URL, got {self.db_url!r}")
        numbers = {
            "sessions": ("sweep_interval_s", "max_nesting_depth", "max_nodes", "state_cache_size"),
            "log": ("batch_max", "snapshot_every", "inline_max_bytes", "poll_interval_s"),
            "generation": tuple(DEFAULTS["generation"]),
            "limits": tuple(DEFAULTS["limits"]),
        }
        for section, keys in numbers.items():
            for key in keys:
                value = self.section(section).get(key, DEFAULTS[section][key])
                if isinstance(value, bool) or (
                    not isinstance(value, int | float) and not _numeric(value)
                ):
                    raise ConfigError(f"{section}.{key} must be a number, got {value!r}")
                if not math.isfinite(float(value)):
                    raise ConfigError(f"{section}.{key} must be a finite number, got {value!r}")
                if float(value) <= 0 and key != "snapshot_every":
                    raise ConfigError(f"{section}.{key} must be positive, got {value!r}")
        ttls = self.section("sessions").get("idle_ttl_s", {})
        for proto, value in ttls.items() if isinstance(ttls, dict) else [("default", ttls)]:
            if isinstance(value, bool) or not _numeric(value) or float(value) <= 0:
                raise ConfigError(
                    f"sessions.idle_ttl_s.{proto} must be a positive number, got {value!r}"
                )
        if self.engine_process not in ENGINE_PROCESSES:
            raise ConfigError(
                f"engine.process must be one of {', '.join(ENGINE_PROCESSES)}, "
                f"got {self.data['engine'].get('process')!r}"
            )
        for name, opts in self.transports.items():
            if not isinstance(opts, dict):
                raise ConfigError(f"transports.{name} must be a table")

    def section(self, *path: str) -> dict[str, Any]:
        node: Any = self.data
        for key in path:
            node = node.get(key, {}) if isinstance(node, dict) else {}
        return node if isinstance(node, dict) else {}

    @property
    def db_url(self) -> str:
        return str(self.data["database"]["url"])

    @property
    def engine_name(self) -> str:
        return str(self.data["engine"]["name"])

    @property
    def engine_process(self) -> str:
        """Where the engine runs: ``inline`` (the server's event loop) or ``worker``."""
        return str(self.section("engine").get("process", "inline"))

    @property
    def engine_options(self) -> dict[str, Any]:
        return dict(self.section("engine", "options"))

    @property
    def transports(self) -> dict[str, dict[str, Any]]:
        return dict(self.section("transports"))

    def enabled_transports(self) -> list[str]:
        return [n for n, o in self.transports.items() if o.get("enabled", False)]

    @property
    def auth_token(self) -> str:
        return str(self.section("auth").get("token") or "")

    def idle_ttl(self, protocol: str) -> float:
        ttls = self.section("sessions").get("idle_ttl_s", {})
        if isinstance(ttls, int | float):
            return float(ttls)
        return float(ttls.get(protocol, ttls.get("default", 1800.0)))

    def sessions_opt(self, key: str) -> Any:
        return self.section("sessions").get(key, DEFAULTS["sessions"][key])

    def log_opt(self, key: str) -> Any:
        return self.section("log").get(key, DEFAULTS["log"][key])

    def limit(self, key: str) -> float:
        """One of the ``[limits]`` (validated positive numbers)."""
        return float(self.section("limits").get(key, DEFAULTS["limits"][key]))

    def generation_opt(self, key: str) -> Any:
        return self.section("generation").get(key, DEFAULTS["generation"][key])


def _numeric(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[v6]:PORT``) to a tuple; raises ConfigError."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)
