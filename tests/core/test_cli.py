"""The command line, run as a real subprocess against a real SQLite file."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import EXE, cli


def test_sessions_ls_and_show(populated: tuple[str, list[str]]) -> None:
    url, (a, b, c) = populated
    rows = json.loads(cli("sessions", "ls", "--json", db=url).stdout)
    by_id = {r["id"]: r for r in rows}
    assert set(by_id) == {a, b, c}
    for r in rows:
        assert {
            "id",
            "status",
            "created_at",
            "engine",
            "parent_id",
            "history_length",
            "event_count",
        } <= set(r)
    assert by_id[a]["status"] == "closed" and by_id[a]["history_length"] == 14
    assert by_id[b]["parent_id"] == a and by_id[b]["history_length"] == 7
    shown = json.loads(cli("sessions", "show", a, "--json", db=url).stdout)
    assert shown["feedback"] == [{"score": 8, "source": "test"}]
    assert shown["generations"][0]["tokens"] == 6
    text = cli("sessions", "show", a, db=url).stdout
    assert "feedback" in text and "score 8" in text
    assert (
        "Hi there" in cli("sessions", "ls", db=url).stdout
        or a in cli("sessions", "ls", db=url).stdout
    )


def test_replay_renders_from_the_log(populated: tuple[str, list[str]]) -> None:
    url, (a, _, c) = populated
    out = cli("replay", a, "--instant", db=url).stdout
    assert (
        "[user] Hi there" in out
        and "[model]" in out
        and "length, 6 tokens" in out
        and "closed" in out
    )
    assert "node n#0" in cli("replay", c, "--instant", db=url).stdout


def test_audit_and_reexecute(populated: tuple[str, list[str]]) -> None:
    url, ids = populated
    reports = json.loads(cli("audit", *ids, "--reexecute", "--json", db=url).stdout)
    assert [r["session_id"] for r in reports] == ids
    for r in reports:
        assert r["chain_ok"] and r["invariants_ok"] and r["divergences"] == []
    assert [r["generations"] for r in reports] == [1, 1, 0]
    plain = cli("audit", ids[0], db=url).stdout
    assert "ok" in plain


def test_audit_detects_tampering(populated: tuple[str, list[str]]) -> None:
    import sqlite3

    url, (a, _, _) = populated
    path = url.split("///", 1)[1]
    with sqlite3.connect(path) as db:
        db.execute(
            "UPDATE events SET body = replace(body, '\"score\":8', '\"score\":9') WHERE session_id = ?",
            (a,),
        )
    proc = cli("audit", a, "--json", db=url, check=False)
    assert proc.returncode == 1
    [r] = json.loads(proc.stdout)
    assert r["chain_ok"] is False and "hash does not match" in r["problems"][0]


def test_reexecute_on_another_engine_reports_divergence(
    populated: tuple[str, list[str]], tmp_path: Path
) -> None:
    url, (a, _, _) = populated
    # an engine whose EOS is boosted behaves differently from the recorded one
    cfg = tmp_path / "alt.toml"
    cfg.write_text('[engine]\nname = "reference"\n[engine.options]\neos_bias = 50.0\n')
    proc = cli("audit", a, "--reexecute", "--json", "--config", str(cfg), db=url, check=False)
    [r] = json.loads(proc.stdout)
    assert proc.returncode == 1 and r["divergences"] and r["divergences"][0]["index"] == 0
    # the plain report names each diverging token by id and by its text (the session's
    # tokenizer: bytes, for the reference engine); --tokens by id only
    rec, got = r["divergences"][0]["recorded"]["token"], r["divergences"][0]["reexecuted"]["token"]
    plain = cli("audit", a, "--reexecute", "--config", str(cfg), db=url, check=False).stdout

    def shown(tok: int) -> str:
        return json.dumps(
            bytes([tok]).decode("utf-8", "replace") if tok < 256 else "", ensure_ascii=False
        )

    assert f"recorded token {rec} {shown(rec)} (logprob" in plain, plain
    assert f"re-executed token {got} {shown(got)}" in plain, plain
    ids = cli("audit", a, "--reexecute", "--tokens", "--config", str(cfg), db=url, check=False)
    assert f"recorded token {rec} (logprob" in ids.stdout


def test_reexecute_compares_engines(populated: tuple[str, list[str]]) -> None:
    url, (a, _, _) = populated
    proc = cli("audit", a, "--reexecute", "--engine", "onnx", "--json", db=url, check=False)
    [r] = json.loads(proc.stdout)
    assert proc.returncode == 1 and r["chain_ok"] and r["generations"] == 1
    assert r["divergences"][0]["generation_id"]


def test_export_import_roundtrip_exact(populated: tuple[str, list[str]], tmp_path: Path) -> None:
    url, (a, _, c) = populated
    dump = cli("export", a, db=url).stdout
    lines = [json.loads(x) for x in dump.splitlines()]
    assert all(
        {"position", "session_id", "version", "type", "recorded_at", "hash", "prev_hash"} <= set(x)
        for x in lines
    )
    big = cli("export", c, db=url).stdout
    f = tmp_path / "a.ndjson"
    f.write_text(dump + big)
    other = f"sqlite+aiosqlite:///{tmp_path / 'other.db'}"
    cli("import", str(f), db=other)
    again = cli("export", a, db=other).stdout

    def strip(text: str) -> list[dict[str, object]]:
        return [
            {k: v for k, v in json.loads(x).items() if k != "position"} for x in text.splitlines()
        ]

    assert strip(again) == strip(dump)
    assert strip(cli("export", c, db=other).stdout) == strip(big)
    assert json.loads(cli("audit", a, "--json", db=other).stdout)[0]["chain_ok"]
    row = json.loads(cli("sessions", "show", a, "--json", db=other).stdout)
    assert row["history_length"] == 14 and row["status"] == "closed"
    # importing twice is refused and changes nothing
    proc = cli("import", str(f), db=other, check=False)
    assert proc.returncode == 1 and "error" in proc.stderr


def test_errors_are_one_line(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'e.db'}"
    cli("db", "upgrade", db=url)
    proc = cli("sessions", "show", "s_missing", db=url, check=False)
    assert proc.returncode == 1
    assert (
        proc.stderr.strip().splitlines()[-1] == "sessiontape: error: session 's_missing' not found"
    )
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml")
    proc = cli("sessions", "ls", "--config", str(bad), db=url, check=False)
    assert proc.returncode == 2 and "not valid TOML" in proc.stderr
    junk = tmp_path / "junk.ndjson"
    junk.write_text("{not json}\n")
    proc = cli("import", str(junk), db=url, check=False)
    assert proc.returncode == 1 and "junk.ndjson:1" in proc.stderr


def test_purge_leaves_a_verifiable_tombstone(populated: tuple[str, list[str]]) -> None:
    url, (a, b, c) = populated
    proc = cli("purge", c, db=url, check=False)
    assert proc.returncode == 1 and "is open" in proc.stderr
    assert "purged " + a in cli("purge", a, db=url).stdout
    [r] = json.loads(cli("audit", a, "--json", db=url).stdout)
    assert r["chain_ok"] and r["invariants_ok"]
    lines = cli("export", a, db=url).stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["type"] == "session.purged"
    rows = {r["id"]: r for r in json.loads(cli("sessions", "ls", "--json", db=url).stdout)}
    assert rows[a]["status"] == "purged" and rows[b]["status"] == "open"
    assert "purged " + c in cli("purge", c, "--force", db=url).stdout
    assert cli("purge", "--older-than-days", "1", db=url).stdout.startswith("purged 0 sessions")


def test_db_upgrade(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'u.db'}"
    assert "revision 0004_sqlite_position_rowid" in cli("db", "upgrade", db=url).stdout


def test_remote_help_runs_from_the_installed_console_script() -> None:
    """The client's dependency (httpx) comes with the install: `sessiontape remote` exists."""
    script = Path(sys.executable).parent / "sessiontape"
    exe = [str(script)] if script.exists() else EXE
    proc = subprocess.run(
        [*exe, "remote", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "generate" in proc.stdout
    assert "unavailable" not in proc.stderr


def test_a_plugin_command_that_fails_to_import_warns_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import importlib.metadata

    from sessiontape.core import cli as cli_module

    real = importlib.metadata.entry_points
    broken = importlib.metadata.EntryPoint(
        name="broken",
        value="sessiontape_no_such_plugin_module:register",
        group="sessiontape.commands",
    )

    def entry_points(**params: str) -> list[importlib.metadata.EntryPoint]:
        found = list(real(**params))
        return [*found, broken] if params.get("group") == "sessiontape.commands" else found

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    with caplog.at_level(logging.WARNING, logger="sessiontape"):
        parser = cli_module.build_parser()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("sessiontape_no_such_plugin_module" in r.getMessage() for r in warnings), warnings
    assert any("'broken'" in r.getMessage() for r in warnings)

    args = parser.parse_args(["broken", "--anything", "x"])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert "'broken' command is unavailable" in err
    assert "sessiontape_no_such_plugin_module" in err
    # the working plugins still load beside the broken one
    assert parser.parse_args(["remote", "ls"]).remote_command == "ls"
