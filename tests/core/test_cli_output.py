"""What the command line prints, and what it leaves alone when it fails.

Replay decodes characters split across tokens and escapes control characters; a bad database
URL, a missing database and an import of a session that exists are each one line of words (no
traceback); read-only commands never create a database; purge says what it removed; an audit
that fails on another engine says why, without Python reprs; the progress bar is drawn only on
a terminal; every flag has help text.

Real subprocesses against real SQLite files, as in test_cli.py.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

from sessiontape.core.cli import build_parser
from sessiontape.core.events import Event, T
from sessiontape.core.replay import escape_controls, render_tokens, replay
from tests.helpers.cli import cli


def _ev(version: int, type_: str, body: dict[str, object]) -> Event:
    return Event(
        position=version,
        session_id="s_x",
        version=version,
        type=type_,
        body=body,
        data=None,
        recorded_at=1000.0 + version,
        hash="",
        prev_hash="",
    )


async def test_replay_decodes_characters_split_across_tokens() -> None:
    # "é" is C3 A9 and "日" E6 97 A5: each byte comes as its own generated token
    text = "é日!"
    evs = [_ev(1, T.GENERATION_STARTED, {"generation_id": "g"})]
    evs += [
        _ev(2 + i, T.GENERATION_TOKEN, {"generation_id": "g", "token": b, "position": i})
        for i, b in enumerate(text.encode())
    ]
    evs.append(
        _ev(
            20,
            T.GENERATION_FINISHED,
            {"generation_id": "g", "finish_reason": "length", "completion_tokens": 6},
        )
    )
    out = io.StringIO()
    await replay(evs, out, instant=True)
    assert "[model] é日!" in out.getvalue()
    assert "\ufffd" not in out.getvalue()


async def test_replay_marks_a_character_cut_off_at_the_end() -> None:
    evs = [
        _ev(1, T.GENERATION_STARTED, {"generation_id": "g"}),
        _ev(2, T.GENERATION_TOKEN, {"generation_id": "g", "token": 0xE6, "position": 0}),
        _ev(3, T.GENERATION_FINISHED, {"generation_id": "g", "finish_reason": "length"}),
    ]
    out = io.StringIO()
    await replay(evs, out, instant=True)
    assert "[model] \ufffd  ⟨length" in out.getvalue()


def test_control_characters_are_escaped() -> None:
    assert (
        escape_controls("a\x1b[31mred\x07\tb\nc\x7f\u202e")
        == "a\\x1b[31mred\\x07\tb\nc\\x7f\\u202e"
    )
    assert render_tokens([0x68, 0xC3, 0xA9, 300]) == "hé<300>"


def test_replay_cli_escapes_what_would_steer_the_terminal(tmp_path: Path) -> None:
    import asyncio

    from sessiontape.core.runtime import Runtime
    from sessiontape.engines.reference import ReferenceEngine
    from tests.helpers.config import make_config

    url = f"sqlite+aiosqlite:///{tmp_path / 'esc.db'}"

    async def build() -> str:
        rt = await Runtime.create(make_config(url), engine=ReferenceEngine())
        try:
            sid = (await rt.open_session("http")).session_id
            await rt.append_text(sid, "Hé \x1b[2J\x1b]0;pwned\x07 日本語")
            await rt.close(sid)
            return sid
        finally:
            await rt.aclose()

    sid = asyncio.run(build())
    out = cli("replay", sid, "--instant", db=url).stdout
    assert "\x1b" not in out and "\x07" not in out
    assert "[user] Hé \\x1b[2J\\x1b]0;pwned\\x07 日本語" in out
    assert '── closed {"reason": "client"}' in out  # JSON, not a Python dict repr
    shown = cli("sessions", "show", sid, db=url).stdout
    assert "\x1b" not in shown and "Hé \\x1b[2J" in shown


def test_a_wrong_database_url_is_one_line(tmp_path: Path) -> None:
    for url, code, words in [
        ("foo://bar", 2, "unknown database driver 'foo'"),
        ("postgresql+psycopg2://u@127.0.0.1/x", 2, "not an asyncio driver"),
        ("sqlite+aiosqlite:////nonexistent-dir/x.db", 1, "no database at /nonexistent-dir/x.db"),
    ]:
        proc = cli("sessions", "ls", db=url, check=False)
        assert proc.returncode == code, (url, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
        assert proc.stderr.startswith("sessiontape: error: ") and words in proc.stderr


def test_read_only_commands_do_not_create_a_database(tmp_path: Path) -> None:
    path = tmp_path / "typo.db"
    url = f"sqlite+aiosqlite:///{path}"
    for args in (
        ("sessions", "ls"),
        ("sessions", "show", "s_x"),
        ("replay", "s_x", "--instant"),
        ("audit", "s_x"),
        ("export", "s_x"),
        ("purge", "s_x"),
    ):
        proc = cli(*args, db=url, check=False)
        assert proc.returncode == 1, args
        assert (
            proc.stderr.strip() == f"sessiontape: error: no database at {path} "
            f"(`sessiontape db upgrade --db {url}` creates one)"
        )
        assert not path.exists(), args
    proc = cli(
        "db", "upgrade", db=f"sqlite+aiosqlite:///{tmp_path / 'no-such-dir' / 'x.db'}", check=False
    )
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        == f"sessiontape: error: no directory {tmp_path / 'no-such-dir'} for the database "
        f"{tmp_path / 'no-such-dir' / 'x.db'}"
    )
    cli("db", "upgrade", db=url)
    assert path.exists()
    assert cli("sessions", "ls", "--json", db=url).stdout.strip() == "[]"


def test_importing_a_session_that_exists_is_refused_clearly(
    populated: tuple[str, list[str]],
    tmp_path: Path,
) -> None:
    url, (a, b, _) = populated
    dump = tmp_path / "a.ndjson"
    dump.write_text(cli("export", a, db=url).stdout)
    proc = cli("import", str(dump), db=url, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"sessiontape: error: session {a} already exists in this database; "
        "purge it first or import into another database"
    )
    # a file with one new and one existing session imports neither
    other = f"sqlite+aiosqlite:///{tmp_path / 'other.db'}"
    cli("import", str(dump), db=other)
    both = tmp_path / "both.ndjson"
    both.write_text(cli("export", b, db=url).stdout + dump.read_text())
    proc = cli("import", str(both), db=other, check=False)
    assert proc.returncode == 1 and f"session {a} already exists" in proc.stderr
    assert [r["id"] for r in json.loads(cli("sessions", "ls", "--json", db=other).stdout)] == [a]


def test_purge_by_age_says_what_it_did(populated: tuple[str, list[str]]) -> None:
    url, (a, _, _) = populated
    assert (
        cli("purge", "--older-than-days", "1000", db=url)
        .stdout.splitlines()[-1]
        .startswith("purged 0 sessions")
    )
    out = cli("purge", "--older-than-days", "0", db=url).stdout.splitlines()
    assert out[0].startswith(f"purged {a}: ") and out[-1].startswith("purged 1 session ")


def test_audit_on_another_engine_says_why_it_failed(
    populated: tuple[str, list[str]],
    tmp_path: Path,
) -> None:
    url, (a, _, _) = populated
    # a reference engine whose EOS is boosted behaves differently from the recorded one
    cfg = tmp_path / "alt.toml"
    cfg.write_text('[engine]\nname = "reference"\n[engine.options]\neos_bias = 50.0\n')
    proc = cli(
        "audit",
        a,
        "--reexecute",
        "--engine",
        "reference",
        "--config",
        str(cfg),
        db=url,
        check=False,
    )
    assert proc.returncode == 1
    first, *rest = proc.stdout.strip().splitlines()
    assert first.startswith(
        f"{a}: FAILED: re-execution on engine reference differs "
        "from the recording in 1 of 1 generation"
    )
    assert "{" not in proc.stdout and "'" not in proc.stdout  # no Python reprs
    assert any(
        "first divergence at step 0" in line
        and "recorded token" in line
        and "re-executed token" in line
        for line in rest
    ), rest
    [r] = json.loads(
        cli(
            "audit",
            a,
            "--reexecute",
            "--engine",
            "reference",
            "--config",
            str(cfg),
            "--json",
            db=url,
            check=False,
        ).stdout
    )
    assert r["engine"] == "reference" and r["recorded_engine"] == "reference"
    assert r["reason"].startswith("re-execution on engine reference differs")
    # another engine altogether: whatever goes wrong is said in words
    proc = cli("audit", a, "--reexecute", "--engine", "onnx", db=url, check=False)
    assert proc.returncode == 1
    line = proc.stdout.splitlines()[0]
    assert line.startswith(f"{a}: FAILED: ") and not line.startswith(f"{a}: FAILED (")
    assert "{'" not in proc.stdout
    [r] = json.loads(
        cli("audit", a, "--reexecute", "--engine", "onnx", "--json", db=url, check=False).stdout
    )
    assert r["engine"] == "onnx" and r["recorded_engine"] == "reference" and r["reason"]


def test_progress_is_only_drawn_on_a_terminal(populated: tuple[str, list[str]]) -> None:
    url, ids = populated
    proc = cli("audit", *ids, db=url)
    assert "\r" not in proc.stderr and "[###" not in proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 3


def test_progress_is_drawn_on_a_terminal(populated: tuple[str, list[str]]) -> None:
    import os
    import pty
    import subprocess
    import sys

    url, ids = populated
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "sessiontape.core.cli", "audit", *ids],
            stderr=follower,
            stdout=subprocess.PIPE,
            env={**os.environ, "SESSIONTAPE_DB": url},
            timeout=60,
        )
        os.close(follower)
        follower = -1
        drawn = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert proc.returncode == 0
    assert b"\r[" in drawn and f"] {len(ids)}/{len(ids)}".encode() in drawn


def test_version_and_help_on_every_flag() -> None:
    from importlib.metadata import version

    assert (
        cli("--version", db="sqlite+aiosqlite:///unused.db").stdout.strip()
        == f"sessiontape {version('sessiontape')}"
    )

    def walk(p: argparse.ArgumentParser, path: str) -> list[str]:
        missing = []
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    missing += walk(child, f"{path} {name}")
            elif not action.help and action.dest != "help":
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
        return missing

    assert walk(build_parser(), "sessiontape") == []
