"""Configuration: precedence (defaults < file < environment < flags), typed sections, and
refusals: an unknown section or key with the nearest known name, a value of the wrong type
or out of bounds, each a ConfigError naming ``section.key``."""

from __future__ import annotations

import math
import os
import string
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from sessiontape.core.cli import build_parser, load_config, serve_overrides
from sessiontape.core.config import (
    SECTIONS,
    Config,
    GenerationSettings,
    LogSettings,
    env_overrides,
)
from sessiontape.core.errors import ConfigError
from sessiontape.engines.onnx.options import OnnxOptions
from sessiontape.engines.reference import ReferenceEngine, ReferenceOptions
from sessiontape.transports.grpc.settings import GrpcSettings
from sessiontape.transports.http.plugin import HttpTransport
from sessiontape.transports.http.server.settings import HttpSettings

ROOT = Path(__file__).resolve().parents[2]

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


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sessiontape.toml"
    path.write_text(text)
    return path


# -- layers ---------------------------------------------------------------------


def test_defaults_alone() -> None:
    cfg = Config.load(environ={})
    assert cfg.db_url == "sqlite+aiosqlite:///./sessiontape.db"
    assert cfg.engine_name == "onnx"
    assert cfg.transports["grpc"] == GrpcSettings()
    assert cfg.transports["grpc"].listen == "127.0.0.1:50051"
    assert cfg.log == LogSettings() and cfg.log.batch_max == 2000
    assert cfg.generation == GenerationSettings()
    assert cfg.enabled_transports() == ["grpc", "http"]
    assert cfg.engine_settings == OnnxOptions()  # the named engine's options, all defaults


def test_the_file_overrides_defaults_and_keeps_the_rest(config_file: Path) -> None:
    cfg = Config.load(config_file, environ={})
    assert cfg.db_url == "sqlite+aiosqlite:///from-file.db"
    assert cfg.engine_name == "from-file"
    assert cfg.engine_settings is None  # no engine of that name here: its own constructor judges
    assert cfg.log.batch_max == 111
    # a table in the file sets its keys; the others keep the class's defaults
    assert cfg.log.inline_max_bytes == LogSettings().inline_max_bytes
    assert cfg.transports["grpc"] == GrpcSettings(listen="127.0.0.1:1111")


def test_the_environment_overrides_the_file(config_file: Path) -> None:
    env = {
        "SESSIONTAPE_ENGINE": "from-env",
        "SESSIONTAPE_TRANSPORTS__GRPC__LISTEN": "127.0.0.1:3333",
        "SESSIONTAPE_LOG__BATCH_MAX": "222",
        "UNRELATED": "x",
    }
    cfg = Config.load(config_file, environ=env)
    assert cfg.engine_name == "from-env"  # the short alias
    assert cfg.transports["grpc"].listen == "127.0.0.1:3333"
    assert cfg.log.batch_max == 222  # parsed as a TOML scalar: a number, not "222"
    assert cfg.db_url == "sqlite+aiosqlite:///from-file.db"  # not in the environment: the file's
    assert cfg.transports["http"].listen == "127.0.0.1:2222"
    assert cfg.log.snapshot_every == 5


def test_explicit_overrides_win_over_everything(config_file: Path) -> None:
    env = {"SESSIONTAPE_ENGINE": "from-env", "SESSIONTAPE_DB": "sqlite+aiosqlite:///from-env.db"}
    cfg = Config.load(config_file, environ=env, overrides={"engine": {"name": "from-flag"}})
    assert cfg.engine_name == "from-flag"
    assert cfg.db_url == "sqlite+aiosqlite:///from-env.db"
    assert cfg.log.batch_max == 111


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
    assert cfg.transports["grpc"].listen == "127.0.0.1:5555"  # flag > env > file
    assert cfg.transports["http"].listen == "127.0.0.1:4444"  # env > file (no flag)
    assert cfg.engine_name == "reference"
    assert cfg.engine_settings == ReferenceOptions()
    assert cfg.db_url == "sqlite+aiosqlite:///from-flag.db"
    assert cfg.log.batch_max == 111  # file > defaults (nothing above)
    assert cfg.log.poll_interval_s == LogSettings().poll_interval_s


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


def test_env_overrides_reach_every_kind_of_section() -> None:
    cfg = Config.load(
        environ={
            "SESSIONTAPE_ENGINE__NAME": "reference",
            "SESSIONTAPE_ENGINE__OPTIONS__EOS_BIAS": "-5",  # an integer where a number goes
            "SESSIONTAPE_ENGINE__PROCESS": "worker",
            "SESSIONTAPE_TRANSPORTS__NOSTR__ENABLED": "true",
            "SESSIONTAPE_TRANSPORTS__NOSTR__RELAYS": "ws://127.0.0.1:7777",  # one: as a string
            "SESSIONTAPE_SESSIONS__IDLE_TTL_S__SALIENCE": "60",
            "SESSIONTAPE_GENERATION__LINGER_S": "0.01",
            "SESSIONTAPE_LIMITS__MAX_JSON_DEPTH": "8",
        }
    )
    assert cfg.engine_settings == ReferenceOptions(eos_bias=-5.0)
    assert cfg.engine_process == "worker"
    assert cfg.enabled_transports() == ["grpc", "http", "nostr"]
    assert cfg.transports["nostr"].relays == "ws://127.0.0.1:7777"
    assert (cfg.idle_ttl("salience"), cfg.idle_ttl("kakeya"), cfg.idle_ttl("other")) == (
        60.0,
        1800.0,
        1800.0,
    )
    assert cfg.generation.linger_s == 0.01 and cfg.limits.max_json_depth == 8


def test_a_string_option_keeps_the_variables_text() -> None:
    """``123`` parses as a TOML integer, but a token is a string: the text is kept as it was."""
    cfg = Config.load(environ={"SESSIONTAPE_AUTH__TOKEN": "0123", "SESSIONTAPE_ENGINE": "42"})
    assert cfg.auth_token == "0123" and cfg.engine_name == "42"
    # a flag over the same key wins, and is taken as it is
    cfg = Config.load(
        environ={"SESSIONTAPE_AUTH__TOKEN": "0123"}, overrides={"auth": {"token": "flag"}}
    )
    assert cfg.auth_token == "flag"
    assert "0123" not in repr(Config.load(environ={"SESSIONTAPE_AUTH__TOKEN": "0123"}))
    # the engine is given the option as its class read it
    cfg = Config.load(environ={"SESSIONTAPE_ENGINE__OPTIONS__MODEL": "123"})
    assert cfg.engine_options == {"model": "123"}


def test_the_example_file_loads_clean() -> None:
    cfg = Config.load(ROOT / "sessiontape.example.toml", environ={})
    assert cfg.engine_name == "onnx" and isinstance(cfg.engine_settings, OnnxOptions)
    # its uncommented values are the defaults (the examples are commented out)
    assert cfg.transports["grpc"] == GrpcSettings()
    assert cfg.transports["http"] == HttpSettings()
    assert cfg.engine_settings == OnnxOptions()
    for name in SECTIONS:
        if name != "engine":
            assert getattr(cfg, name) == SECTIONS[name](), name


# -- refusals ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # a section far from every known one: the known ones are listed
        (
            "[frontend]\nlisten = 1\n",
            r"unknown section \[frontend\]; known: auth, database, engine",
        ),
        ("[sever]\nevent_loop = 1\n", r"unknown section \[sever\]; did you mean \[server\]\?"),
        (
            "[sesions]\nmax_nodes = 10\n",
            r"unknown section \[sesions\]; did you mean \[sessions\]\?",
        ),
        (
            '[transports.http]\nlistn = "127.0.0.1:9"\n',
            r"unknown key `listn` in \[transports.http\]; did you mean `listen`\?",
        ),
        ("[database]\npool_size = 5\n", r"unknown key `pool_size` in \[database\]; known: url"),
        (
            '[transports.htp]\nlisten = "127.0.0.1:9"\n',
            r"unknown transport \[transports.htp\]; did you mean \[transports.http\]\?",
        ),
        (
            "[generation]\nmax_rnu = 8\n",
            r"unknown key `max_rnu` in \[generation\]; did you mean `max_run`\?",
        ),
        (
            '[engine]\nname = "reference"\n[engine.options]\neos_bais = 1.0\n',
            r"unknown key `eos_bais` in \[engine.options\]; did you mean `eos_bias`\?",
        ),
        (
            '[engine]\nname = "onnx"\n[engine.options]\nbatch_slot = 4\n',
            r"unknown key `batch_slot` in \[engine.options\]; did you mean `batch_slots`\?",
        ),
        (
            '[transports.grpc]\ntls_crt = "a.pem"\n',
            r"unknown key `tls_crt` in \[transports.grpc\]; did you mean `tls_cert`\?",
        ),
        (
            "[transports.nostr]\nprice = 5\n",
            r"unknown key `price` in \[transports.nostr\]; did you mean `price_msat`\?",
        ),
    ],
)
def test_unknown_sections_and_keys_are_refused_with_the_nearest_name(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.load(write(tmp_path, text), environ={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[log]\nbatch_max = "12"\n', r"log\.batch_max must be an integer, got '12' \(str\)"),
        ("[log]\nbatch_max = 12.5\n", r"log\.batch_max must be an integer, got 12\.5 \(float\)"),
        ("[log]\nbatch_max = true\n", r"log\.batch_max must be an integer, got True \(bool\)"),
        ("[transports.http]\nlisten = 8080\n", r"transports\.http\.listen must be a string"),
        ('[transports.http]\nlisten = "nowhere"\n', r"transports\.http\.listen must be HOST:PORT"),
        ('[transports.grpc]\nenabled = "yes"\n', r"transports\.grpc\.enabled must be a boolean"),
        ("[transports.http]\nring = 0\n", r"transports\.http\.ring must be >= 1, got 0"),
        ('[engine]\nprocess = "thread"\n', r"engine\.process must be one of inline, worker"),
        ('[logging]\nformat = "xml"\n', r"logging\.format must be one of text, json"),
        ('[logging]\nlevel = "LOUD"\n', r"logging\.level must be one of DEBUG"),
        ('[database]\nurl = "sessiontape.db"\n', r"database\.url must be a SQLAlchemy URL"),
        (
            "[sessions]\nidle_ttl_s = { default = -1 }\n",
            r"sessions\.idle_ttl_s\.default must be > 0",
        ),
        (
            '[transports.nostr]\nrelays = ["ws://a", 7]\n',
            r"transports\.nostr\.relays\[1\] must be a string",
        ),
        (
            "[transports.http]\nlinger_s = nan\n",
            r"transports\.http\.linger_s must be a finite number",
        ),
        ("[transports.http]\nlinger_s = -0.001\n", r"transports\.http\.linger_s must be >= 0"),
        (
            "[transports.nostr]\nstream_gap_ms = 60001\n",
            r"transports\.nostr\.stream_gap_ms must be <= 60000",
        ),
        (
            '[transports.http]\nlinger_s = "0.001"\n',
            r"transports\.http\.linger_s must be a number, got '0\.001' \(str\)",
        ),
        ("[transports.http]\nring_bytes = 0\n", r"transports\.http\.ring_bytes must be >= 1"),
        (
            "[transports.http]\nring_bytes = 1.5\n",
            r"transports\.http\.ring_bytes must be an integer",
        ),
        (
            "[transports.http]\nring_bytes = true\n",
            r"transports\.http\.ring_bytes must be an integer",
        ),
        ("[transports.grpc]\nspin_s = 0.0005\n", r"unknown key `spin_s` in \[transports\.grpc\]"),
        ("[auth]\ntoken = 123\n", r"auth\.token must be a string, got 123 \(int\)"),
        ("engine = 1\n", r"\[engine\] must be a table, got 1 \(int\)"),
        ("[transports]\nhttp = 1\n", r"transports\.http must be a table"),
        (
            '[engine]\nname = "onnx"\n[engine.options]\nbatch_slots = "8"\n',
            r"engine\.options\.batch_slots must be an integer, got '8' \(str\)",
        ),
        (
            '[engine]\nname = "onnx"\n[engine.options]\ndtype = "float64"\n',
            r"unknown dtype 'float64': engine\.options\.dtype must be one of auto, float32, .*q4",
        ),
        (
            '[engine]\nname = "onnx"\n[engine.options]\nproviders = ["CPU", 1]\n',
            r"engine\.options\.providers\[1\] must be a string",
        ),
    ],
)
def test_wrong_types_and_values_are_refused_naming_section_key(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.load(write(tmp_path, text), environ={})


def test_serve_refuses_a_misspelled_key_in_one_line_before_opening_anything(
    tmp_path: Path,
) -> None:
    """Where the server used to start on its defaults, ignoring the table it did not know."""
    db = tmp_path / "st.db"
    path = write(
        tmp_path, '[engine]\nname = "reference"\n[transports.http]\nlistn = "127.0.0.1:1"\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "sessiontape.core.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "SESSIONTAPE_DB": f"sqlite+aiosqlite:///{db}"},
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "sessiontape: error: unknown key `listn` in [transports.http]; did you mean `listen`?"
    )
    assert not db.exists()


def test_a_bad_value_from_any_layer_is_a_config_error(config_file: Path) -> None:
    with pytest.raises(ConfigError, match=r"log\.batch_max must be an integer, got 'lots'"):
        Config.load(config_file, environ={"SESSIONTAPE_LOG__BATCH_MAX": "lots"})
    with pytest.raises(ConfigError, match=r"unknown key `pool_size` in \[database\]"):
        Config.load(config_file, environ={"SESSIONTAPE_DATABASE__POOL_SIZE": "5"})
    with pytest.raises(ConfigError, match=r"limits\.max_connections must be >= 1"):
        Config.load(config_file, environ={}, overrides={"limits": {"max_connections": 0}})
    with pytest.raises(ConfigError, match="not found"):
        Config.load(config_file.with_name("missing.toml"), environ={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        Config.load(write(config_file.parent, "[log\n"), environ={})


@pytest.mark.parametrize("key", [f.name for f in GenerationSettings.__dataclass_fields__.values()])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, 0, "x", True, None])
def test_generation_limits_refuse_what_is_not_a_positive_finite_number(
    key: str, value: object
) -> None:
    if (key, value) == ("max_active", 0):  # the one that takes 0: no limit
        assert (
            Config.load(environ={}, overrides={"generation": {key: 0}}).generation.max_active == 0
        )
        return
    with pytest.raises(ConfigError, match=f"generation.{key}"):
        Config.load(environ={}, overrides={"generation": {key: value}})


def test_transports_and_engines_validate_their_keywords_with_the_same_classes() -> None:
    """A transport built from a table, and an engine from keywords, refuse what the
    configuration refuses, with the same words."""
    with pytest.raises(ConfigError, match=r"unknown key `listn` in \[transports.http\]"):
        HttpTransport(None, {"listn": "127.0.0.1:0"}, Config())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"unknown key `eos_bais` in \[engine.options\]"):
        ReferenceEngine(eos_bais=1.0)
    with pytest.raises(ConfigError, match=r"engine\.options\.max_length must be an integer"):
        ReferenceEngine(max_length="64")
    assert ReferenceEngine(ReferenceOptions(max_length=64)).info.max_length == 64
    with pytest.raises(ConfigError, match="options or keywords, not both"):
        ReferenceEngine(ReferenceOptions(), eos_bias=1.0)


# -- never anything but a ConfigError ---------------------------------------------------

_names = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=12)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**1100), max_value=2**1100),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(_names, inner, max_size=3)
    ),
    max_leaves=6,
)
_SECTION_NAMES = [*SECTIONS, "transports"]


def _known_keys(section: str) -> list[str]:
    if section == "transports":
        return ["grpc", "http", "nostr"]
    return list(SECTIONS[section].__dataclass_fields__)


@seed(20261125)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_keys_and_values_are_refused_as_config_errors_or_load(data: st.DataObject) -> None:
    """Whatever a file, the environment or a flag puts in a known section, under a known or
    an unknown key, loading either succeeds with typed values or raises ConfigError."""
    section = data.draw(st.sampled_from(_SECTION_NAMES))
    key = data.draw(st.one_of(st.sampled_from(_known_keys(section)), _names))
    value = data.draw(_values)
    tree: dict[str, Any] = {section: {key: value}}
    if section == "engine" and key == "options":
        tree["engine"]["name"] = data.draw(st.sampled_from(["onnx", "reference"]))
    try:
        cfg = Config.from_tree(tree)
    except ConfigError as exc:
        assert exc.message and "\n" not in exc.message
        return
    assert key in _known_keys(section)  # an unknown key never loads
    if section in SECTIONS and key in SECTIONS[section].__dataclass_fields__:
        got = getattr(getattr(cfg, section), key)
        if isinstance(got, float):
            assert math.isfinite(got)


@seed(20261126)
@settings(max_examples=100, deadline=None)
@given(name=_names, value=_values)
def test_unknown_sections_never_load(name: str, value: object) -> None:
    if name in _SECTION_NAMES:
        return
    with pytest.raises(ConfigError, match=rf"unknown section \[{name}\]"):
        Config.from_tree({name: value})


@pytest.mark.parametrize("value", ['"uv"', '""', "1", "true", '["uvloop"]', "nan"])
def test_server_event_loop_takes_only_its_choices(tmp_path: Path, value: str) -> None:
    """`[server] event_loop`: a value outside auto/uvloop/asyncio, or of another type, is a
    ConfigError naming the option; the default is auto."""
    assert Config.load(None).server.event_loop == "auto"
    path = tmp_path / "c.toml"
    path.write_text(f"[server]\nevent_loop = {value}\n")
    with pytest.raises(ConfigError, match=r"server\.event_loop"):
        Config.load(path)


@pytest.mark.parametrize(
    "key", ["run_ahead", "min_run", "burst", "burst_s", "pace_s", "active_hold_s"]
)
def test_a_removed_generation_option_is_refused_naming_it_and_its_source(
    key: str, tmp_path: Path
) -> None:
    """The six ``[generation]`` options the run policy now derives or fixes: given in a
    file or the environment, a ConfigError names the option and where its value comes
    from now, instead of a silent default or a misleading "did you mean"."""
    path = tmp_path / "old.toml"
    path.write_text(f"[generation]\n{key} = 8\n")
    with pytest.raises(ConfigError, match=rf"\[generation\] {key} is no longer an option: it "):
        Config.load(path, environ={})
    env = {f"SESSIONTAPE_GENERATION__{key.upper()}": "8"}
    with pytest.raises(ConfigError, match=rf"\[generation\] {key} is no longer an option"):
        Config.load(environ=env)
    assert len(GenerationSettings.__dataclass_fields__) <= 3
