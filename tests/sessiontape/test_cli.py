"""``sessiontape remote``: the CLI's commands against a live server, through sessiontape.client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from sessiontape.core.cli import main
from tests.helpers.config import free_port
from tests.helpers.http import Served, serve


@pytest.fixture
async def live(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    s = await serve(sqlite_url, port)
    try:
        yield s
    finally:
        await s.transport.stop(grace=1.0)
        await s.runtime.aclose()


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_remote_commands(live: Served, capsys: pytest.CaptureFixture[str]) -> None:
    rt = live.runtime
    sid = (await rt.open_session("http", label="cli")).session_id
    url = ("--url", live.url)
    code, out, _ = await cli(
        capsys,
        "remote",
        *url,
        "generate",
        sid,
        "--text",
        "Hello",
        "--max-tokens",
        "5",
        "--seed",
        "3",
    )
    assert code == 0
    st = await rt.get(sid)
    [gen] = st.generations.values()
    # the answer's text: its tokens' text less a character its last token left unfinished
    text = rt.engine.detokenize(gen.tokens).rstrip("\n").removesuffix("\ufffd")
    assert out.rstrip("\n") == text
    code, out, _ = await cli(capsys, "remote", *url, "ls", "--json")
    assert code == 0 and [json.loads(line)["id"] for line in out.splitlines()] == [sid]
    code, out, _ = await cli(capsys, "remote", *url, "show", sid)
    assert json.loads(out)["history"]["ids"] == list(st.tokens)
    code, out, _ = await cli(capsys, "remote", *url, "fork", sid, "--at-position", "2")
    child = out.strip()
    assert (await rt.get(child)).parent == {
        "session_id": sid,
        "version": st.version,
        "token_position": 2,
    }
    code, out, _ = await cli(capsys, "remote", *url, "close", sid)
    assert out.strip() == "closed"
    code, out, _ = await cli(capsys, "remote", *url, "tail", sid, "--json")
    kinds = [json.loads(line)["kind"] for line in out.splitlines()]
    assert kinds == ["snapshot", "end"]
    code, out, _ = await cli(capsys, "remote", *url, "export", sid)
    assert [json.loads(line)["version"] for line in out.splitlines()] == list(
        range(1, st.version + 1)
    )


def cli_lines(err: str) -> list[str]:
    """The CLI's own stderr lines: the server runs in this process, and its access log
    shares stderr, written when the response is sent, so before or after the CLI's."""
    return [line for line in err.splitlines() if " sessiontape.access: " not in line]


async def test_remote_errors(live: Served, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = await cli(capsys, "remote", "--url", live.url, "show", "s_nope")
    assert code == 1 and cli_lines(err)[-1].startswith("sessiontape: error: session_not_found:")
    assert "HTTP Request" not in err  # httpx's per-request log stays quiet without -v
    code, _, err = await cli(capsys, "remote", "--url", f"http://127.0.0.1:{free_port()}", "ls")
    assert code == 1 and cli_lines(err)[-1].startswith("sessiontape: error:")
