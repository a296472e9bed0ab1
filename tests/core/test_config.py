"""Configuration precedence: defaults < file < environment < explicit overrides (CLI flags)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sessiontape.core.cli import build_parser, load_config, serve_overrides
from sessiontape.core.config import DEFAULTS, Config, env_overrides
from sessiontape.core.errors import ConfigError

FILE = """
[database]
url = "sqlite+aiosqlite:///from-file.db"

[engine]
name = "from-file"

[transports.grpc]
listen = "127.0.0.1:1111"

[transports.http]
listen = "127.0.0.1:2222"

[log]
batch_max = 111
snapshot_every = 5
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "sessiontape.toml"
    path.write_text(FILE)
    return path


def test_defaults_alone() -> None:
    cfg = Config.load(environ={})
    assert cfg.db_url == DEFAULTS["database"]["url"]
    assert cfg.engine_name == "onnx"
    assert cfg.transports["grpc"]["listen"] == "127.0.0.1:50051"
    assert cfg.log_opt("batch_max") == 2000


def test_the_file_overrides_defaults_and_keeps_the_rest(config_file: Path) -> None:
    cfg = Config.load(config_file, environ={})
    assert cfg.db_url == "sqlite+aiosqlite:///from-file.db"
    assert cfg.engine_name == "from-file"
    assert cfg.log_opt("batch_max") == 111
    # a table in the file merges into the defaults' table, key by key
    assert cfg.log_opt("inline_max_bytes") == DEFAULTS["log"]["inline_max_bytes"]
    assert cfg.transports["grpc"] == {"enabled": True, "listen": "127.0.0.1:1111"}


def test_the_environment_overrides_the_file(config_file: Path) -> None:
    env = {
        "SESSIONTAPE_ENGINE": "from-env",
        "SESSIONTAPE_TRANSPORTS__GRPC__LISTEN": "127.0.0.1:3333",
        "SESSIONTAPE_LOG__BATCH_MAX": "222",
        "UNRELATED": "x",
    }
    cfg = Config.load(config_file, environ=env)
    assert cfg.engine_name == "from-env"  # the short alias
    assert cfg.transports["grpc"]["listen"] == "127.0.0.1:3333"
    assert cfg.log_opt("batch_max") == 222  # parsed as a TOML scalar: a number, not "222"
    assert cfg.db_url == "sqlite+aiosqlite:///from-file.db"  # not in the environment: the file's
    assert cfg.transports["http"]["listen"] == "127.0.0.1:2222"
    assert cfg.log_opt("snapshot_every") == 5


def test_explicit_overrides_win_over_everything(config_file: Path) -> None:
    env = {"SESSIONTAPE_ENGINE": "from-env", "SESSIONTAPE_DB": "sqlite+aiosqlite:///from-env.db"}
    cfg = Config.load(config_file, environ=env, overrides={"engine": {"name": "from-flag"}})
    assert cfg.engine_name == "from-flag"
    assert cfg.db_url == "sqlite+aiosqlite:///from-env.db"
    assert cfg.log_opt("batch_max") == 111


def test_cli_flags_over_env_over_file(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole chain as `sessiontape serve` builds it (load_config + serve_overrides)."""
    monkeypatch.setenv("SESSIONTAPE_TRANSPORTS__GRPC__LISTEN", "127.0.0.1:3333")
    monkeypatch.setenv("SESSIONTAPE_TRANSPORTS__HTTP__LISTEN", "127.0.0.1:4444")
    monkeypatch.setenv("SESSIONTAPE_ENGINE", "from-env")
    args = build_parser().parse_args(
        [
            "serve",
            "--config",
            str(config_file),
            "--db",
            "sqlite+aiosqlite:///from-flag.db",
            "--grpc",
            "127.0.0.1:5555",
            "--engine",
            "reference",
        ]
    )
    cfg = load_config(args, serve_overrides(args))
    assert cfg.transports["grpc"]["listen"] == "127.0.0.1:5555"  # flag > env > file
    assert cfg.transports["http"]["listen"] == "127.0.0.1:4444"  # env > file (no flag)
    assert cfg.engine_name == "reference"
    assert cfg.db_url == "sqlite+aiosqlite:///from-flag.db"
    assert cfg.log_opt("batch_max") == 111  # file > defaults (nothing above)
    assert cfg.log_opt("poll_interval_s") == DEFAULTS["log"]["poll_interval_s"]


def test_env_names_map_onto_nested_keys() -> None:
    assert env_overrides(
        {
            "SESSIONTAPE_TRANSPORTS__NOSTR__ENABLED": "true",
            "SESSIONTAPE_AUTH_TOKEN": "123",
            "SESSIONTAPE_ENGINE__OPTIONS__SIZE": "tiny",
        }
    ) == {
        "transports": {"nostr": {"enabled": True}},
        "auth": {"token": "123"},  # an alias keeps the raw string: a token is never a number
        "engine": {"options": {"size": "tiny"}},
    }


def test_a_bad_value_from_any_layer_is_a_config_error(config_file: Path) -> None:
    with pytest.raises(ConfigError, match=r"log\.batch_max"):
        Config.load(config_file, environ={"SESSIONTAPE_LOG__BATCH_MAX": "lots"})
    with pytest.raises(ConfigError, match="not found"):
        Config.load(config_file.with_name("missing.toml"), environ={})


@pytest.mark.parametrize("key", sorted(DEFAULTS["generation"]))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, 0, "x", True, None])
def test_generation_limits_refuse_what_is_not_a_positive_finite_number(
    key: str, value: object
) -> None:
    with pytest.raises(ConfigError, match=f"generation.{key}"):
        Config.load(environ={}, overrides={"generation": {key: value}})
