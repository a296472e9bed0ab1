"""Kill the server process with SIGKILL mid-append: everything a subscriber
saw is in the log afterwards, and every chain verifies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sessiontape.core.log import EventLog
from sessiontape.core.log.store import verify_chain

WRITER = textwrap.dedent(
    """
    import asyncio, json, sys
    from sessiontape.core.engine.interface import SamplingParams
    from sessiontape.core.generation.request import GenerateRequest
    from sessiontape.core.runtime import Runtime
    from sessiontape.engines.reference import ReferenceEngine
    from tests.helpers.config import make_config

    async def main():
        rt = await Runtime.create(make_config(sys.argv[1]), engine=ReferenceEngine())

        async def watch():
            async for e in rt.reads.subscribe(0):
                print(json.dumps([e.session_id, e.version, e.hash]), flush=True)

        async def work(i):
            sid = (await rt.open_session("crash")).session_id
            while True:
                await rt.append_tokens(sid, [i % 250, 1, 2])
                async for _ in rt.generate(sid, GenerateRequest(SamplingParams(max_tokens=3, seed=i))):
                    pass

        asyncio.create_task(watch())
        await asyncio.gather(*(work(i) for i in range(4)))

    asyncio.run(main())
    """
)


#: the pipelined token path: what the generating caller itself received (runs committed
#: while the engine decodes ahead), long generations killed in the middle
GENERATOR = textwrap.dedent(
    """
    import asyncio, json, sys
    from sessiontape.core.engine.interface import SamplingParams
    from sessiontape.core.generation.request import GenerateRequest
    from sessiontape.core.runtime import Runtime
    from sessiontape.engines.reference import ReferenceEngine
    from tests.helpers.config import make_config

    async def main():
        if sys.argv[2] == "worker":
            from sessiontape.core.engine.worker import WorkerEngine

            engine = WorkerEngine("reference", {"eos_bias": -1000.0})
            print(json.dumps(["worker", engine._proc.pid, ""]), flush=True)
        else:
            engine = ReferenceEngine(eos_bias=-1000.0)
        rt = await Runtime.create(make_config(sys.argv[1]), engine=engine)

        async def work(i):
            sid = (await rt.open_session("crash")).session_id
            await rt.append_tokens(sid, [i % 250, 1, 2])
            while True:
                async for e in rt.generate(sid, GenerateRequest(SamplingParams(max_tokens=2000, seed=i))):
                    print(json.dumps([e.session_id, e.version, e.hash]), flush=True)

        await asyncio.gather(*(work(i) for i in range(4)))

    asyncio.run(main())
    """
)


#: short turns, as a chat client or an agent sends them: append three tokens, on their
#: own (the caller sees the session's head after it) or in the generate request (they
#: commit with generation.started and the first run), and generate sixteen (the caller
#: sees every event, the finish included, which commits with the last tokens)
SHORT_TURNS = textwrap.dedent(
    """
    import asyncio, json, sys
    from sessiontape.core.engine.interface import SamplingParams
    from sessiontape.core.generation.request import GenerateRequest
    from sessiontape.core.runtime import Runtime
    from sessiontape.engines.reference import ReferenceEngine
    from tests.helpers.config import make_config

    async def main():
        options = {"eos_bias": -1000.0, "max_length": 1 << 20}
        if sys.argv[2] == "worker":
            from sessiontape.core.engine.worker import WorkerEngine

            engine = WorkerEngine("reference", options)
            print(json.dumps(["worker", engine._proc.pid, ""]), flush=True)
        else:
            engine = ReferenceEngine(**options)
        rt = await Runtime.create(make_config(sys.argv[1]), engine=engine)

        async def work(i):
            sid = (await rt.open_session("crash")).session_id
            n = 0
            while True:
                n += 1
                params = SamplingParams(max_tokens=16, seed=n)
                append = [i % 250, n % 250, 2]
                if n % 2:
                    # the append in the request: it commits with the first run
                    gen = rt.generate(sid, GenerateRequest(params, append=append))
                else:
                    await rt.append_tokens(sid, append)
                    st = await rt.get(sid)
                    print(json.dumps([sid, st.version, st.head_hash]), flush=True)
                    gen = rt.generate(sid, GenerateRequest(params))
                async for e in gen:
                    print(json.dumps([e.session_id, e.version, e.hash]), flush=True)

        await asyncio.gather(*(work(i) for i in range(8)))

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("process", ["inline", "worker"])
async def test_sigkill_mid_short_turns_loses_nothing_a_caller_saw(
    tmp_path: Path, db_url: str, process: str
) -> None:
    """Eight sessions doing short turns (the append acknowledged on its own, or
    carried by the request and committed with the first run), killed at a random
    point: every append and every token and finish a caller was given is in the log,
    chains intact (SQLite and PostgreSQL; the engine inline, and in a worker, whose
    generations' ends carry the cache state the runtime checks)."""
    url = db_url
    await asyncio.to_thread(_kill_and_check, tmp_path, SHORT_TURNS, 4000, process, url)


@pytest.mark.parametrize("process", ["inline", "worker"])
def test_sigkill_mid_generation_loses_no_token_a_caller_saw(tmp_path: Path, process: str) -> None:
    """With the engine in a worker process too: and the worker goes when the server does."""
    _kill_and_check(tmp_path, GENERATOR, 3000, process)


def test_sigkill_loses_nothing_a_subscriber_saw(tmp_path: Path) -> None:
    _kill_and_check(tmp_path, WRITER, 300)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _kill_and_check(
    tmp_path: Path, source: str, count: int, process: str = "inline", url: str | None = None
) -> None:
    url = url or f"sqlite+aiosqlite:///{tmp_path / 'crash.db'}"
    script = tmp_path / "writer.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, str(script), url, process], stdout=subprocess.PIPE, text=True, env=env
    )
    seen: list[tuple[str, int, str]] = []
    worker_pid = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            item = tuple(json.loads(line))
            if item[0] == "worker":
                worker_pid = int(item[1])
                continue
            seen.append(item)  # type: ignore[arg-type]
            if len(seen) >= count:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert len(seen) >= count
    if process == "worker":
        # the worker sees its pipe close and exits: no orphan engine outlives a killed server
        assert worker_pid is not None
        deadline = time.monotonic() + 10
        while not _gone(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker_pid)

    async def check() -> None:
        log = await EventLog.open(url)
        try:
            sessions = {sid for sid, _, _ in seen}
            for sid in sessions:
                evs = await log.read(sid)
                verify_chain(evs)
                by_version = {e.version: e.hash for e in evs}
                for s, v, h in seen:
                    if s == sid:
                        assert by_version.get(v) == h, f"{sid} v{v} seen by a subscriber but lost"
        finally:
            await log.close()

    asyncio.run(check())


async def test_generation_left_open_by_a_crash_is_closed_as_interrupted(sqlite_url: str) -> None:
    from sessiontape.core.engine.interface import SamplingParams
    from sessiontape.core.events import NewEvent, T
    from sessiontape.core.generation.request import GenerateRequest
    from sessiontape.core.runtime import Runtime
    from sessiontape.engines.reference import ReferenceEngine
    from tests.helpers.config import make_config

    rt = await Runtime.create(make_config(sqlite_url), engine=ReferenceEngine())
    try:
        sid = (await rt.open_session("t")).session_id
        st = await rt.get(sid)
        # what a process killed mid-generation leaves behind
        await rt.log.append(
            sid,
            st.version,
            [NewEvent(T.GENERATION_STARTED, {"generation_id": "g_dead", "params": {}})],
        )
    finally:
        await rt.aclose()
    rt = await Runtime.create(make_config(sqlite_url), engine=ReferenceEngine())
    try:
        evs = [
            e async for e in rt.generate(sid, GenerateRequest(SamplingParams(max_tokens=2, seed=1)))
        ]
        assert evs[-1].body["finish_reason"] == "length"
        gens = (await rt.sessions.load(sid)).generations
        assert gens["g_dead"].finish_reason == "interrupted"
    finally:
        await rt.aclose()
