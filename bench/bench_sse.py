"""SSE delivery: JSON Patch+ per committed token to 1 and 100 watchers, against a bare Starlette SSE.

For each watcher count the benchmark runs a real generation (reference
engine, no step delay) while the watchers, in a separate client process,
follow ``GET /v1/sessions/{id}/events``; then a bare Starlette endpoint on
uvicorn sends the very same frames (rebuilt from the log) from memory to the
same number of watchers. Reported: patches/s delivered (sum over watchers,
first patch to last), the ratio to the bare endpoint, and the server's RSS
growth per connected watcher. Medians of ``--repeats`` runs.

    .venv/bin/python bench/bench_sse.py [--tokens 300] [--repeats 3]
    .venv/bin/python bench/bench_sse.py --fold [100 8000 30000]   # per-token fold vs history length
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from sessiontape.core.generation.request import GenerateRequest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# -- the client process ---------------------------------------------------------


async def client(url: str, n: int) -> None:
    import httpx

    from tests.helpers.sse_client import events

    ready = 0
    all_ready = asyncio.Event()
    stats: list[tuple[int, float, float]] = []

    async def watch(c: httpx.AsyncClient) -> None:
        nonlocal ready
        count, first, last = 0, 0.0, 0.0
        async with c.stream("GET", url) as resp:
            ready += 1
            if ready == n:
                all_ready.set()
            async for ev in events(resp):
                if ev.event == "patch":
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    count += 1
                elif ev.event == "end":
                    break
        stats.append((count, first, last))

    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        tasks = [asyncio.create_task(watch(c)) for _ in range(n)]
        await all_ready.wait()
        print("ready", flush=True)
        await asyncio.gather(*tasks)
    total = sum(s[0] for s in stats)
    span = max(s[2] for s in stats) - min(s[1] for s in stats if s[1])
    print(json.dumps({"patches": total, "span_s": span}), flush=True)


# -- the server side --------------------------------------------------------------


async def spawn_client(url: str, n: int) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", url, str(n), stdout=subprocess.PIPE, cwd=str(ROOT)
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert line.strip() == b"ready", line
    return proc


async def finish_client(proc: asyncio.subprocess.Process) -> dict[str, float]:
    assert proc.stdout is not None
    out = await asyncio.wait_for(proc.stdout.read(), 120)
    await proc.wait()
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


async def run(tokens: int, repeats: int, counts: list[int]) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from sessiontape.core.config import Config
    from sessiontape.core.document import DocumentBuilder
    from sessiontape.core.engine.interface import SamplingParams
    from sessiontape.core.runtime import Runtime
    from sessiontape.engines.reference import ReferenceEngine
    from sessiontape.transports.http.native.feeds import frame
    from sessiontape.transports.http.plugin import HttpTransport
    from sessiontape.transports.http.server.json_encoding import dumps
    from tests.helpers.config import free_port

    tmp = tempfile.mkdtemp()
    cfg = Config.load(
        environ={}, overrides={"database": {"url": f"sqlite+aiosqlite:///{tmp}/bench.db"}}
    )
    rt = await Runtime.create(cfg, engine=ReferenceEngine(eos_bias=-100.0))
    http = HttpTransport(rt, {"listen": f"127.0.0.1:{free_port()}"}, cfg)
    await http.start()
    base = f"http://127.0.0.1:{http.port}"

    # the bare endpoint: the same frames, from memory
    bare_frames: list[bytes] = []
    go = asyncio.Event()

    async def bare(_: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield frame("snapshot", "{}", 0)
            await go.wait()
            for f in bare_frames:
                yield f
            yield frame("end", "{}")

        return StreamingResponse(body(), media_type="text/event-stream")

    bport = free_port()
    bserver = uvicorn.Server(
        uvicorn.Config(
            Starlette(routes=[Route("/bare", bare)]),
            host="127.0.0.1",
            port=bport,
            log_level="warning",
            access_log=False,
        )
    )
    btask = asyncio.create_task(bserver.serve())
    for _ in range(1000):
        if bserver.started:
            break
        await asyncio.sleep(0.01)

    results: dict[tuple[str, int], list[float]] = {}
    mem: dict[tuple[str, int], list[float]] = {}
    gen_only: list[float] = []
    for _ in range(repeats):
        # generation alone, nobody watching: what the log and engine cost
        s = await rt.open_session("bench")
        await rt.append_text(s.session_id, "bench")
        t0 = time.perf_counter()
        async for _e in rt.generate(
            s.session_id, GenerateRequest(SamplingParams(max_tokens=tokens, seed=1))
        ):
            pass
        gen_only.append(tokens / (time.perf_counter() - t0))
        await rt.close(s.session_id)
        for n in counts:
            s = await rt.open_session("bench")
            sid = s.session_id
            await rt.append_text(sid, "bench")
            before = rss_kib()
            proc = await spawn_client(f"{base}/v1/sessions/{sid}/events", n)
            mem.setdefault(("sessiontape", n), []).append((rss_kib() - before) / n)
            async for _e in rt.generate(
                sid, GenerateRequest(SamplingParams(max_tokens=tokens, seed=1))
            ):
                pass
            await rt.close(sid)
            r = await finish_client(proc)
            results.setdefault(("sessiontape", n), []).append(r["patches"] / r["span_s"])

            # the same payloads, rebuilt from the log, through the bare endpoint
            evs = await rt.log.read(sid)
            b = DocumentBuilder(sid, detokenize=rt.engine.detokenize)
            b.apply(evs[0])
            b.apply(evs[1])
            bare_frames.clear()
            for e in evs[2:]:
                bare_frames.append(frame("patch", dumps(b.apply(e)), e.position))
            go.clear()
            before = rss_kib()
            proc = await spawn_client(f"http://127.0.0.1:{bport}/bare", n)
            mem.setdefault(("bare", n), []).append((rss_kib() - before) / n)
            go.set()
            r = await finish_client(proc)
            results.setdefault(("bare", n), []).append(r["patches"] / r["span_s"])

            # the finished session replayed from the log: a resume from its second event
            proc = await spawn_client(
                f"{base}/v1/sessions/{sid}/events?last_event_id={evs[1].position}", n
            )
            r = await finish_client(proc)
            results.setdefault(("replay", n), []).append(r["patches"] / r["span_s"])

    print(
        f"\nSSE delivery, {tokens} generated tokens per run, median of {repeats} runs "
        f"(reference engine, SQLite; clients in a separate process)"
    )
    print(f"generation alone (no watchers): {statistics.median(gen_only):,.0f} tokens/s\n")
    print(
        f"{'watchers':>8} | {'live patches/s':>15} | {'resume-from-log patches/s':>26} | "
        f"{'bare starlette patches/s':>25} | {'ratio resume/bare':>17} | {'RSS/watcher':>12} | {'bare RSS/w':>11}"
    )
    print("-" * 135)
    for n in counts:
        live = statistics.median(results[("sessiontape", n)])
        replay = statistics.median(results[("replay", n)])
        bare_r = statistics.median(results[("bare", n)])
        print(
            f"{n:>8} | {live:>15,.0f} | {replay:>26,.0f} | {bare_r:>25,.0f} | {replay / bare_r:>17.2f} | "
            f"{statistics.median(mem[('sessiontape', n)]):>8,.1f} KiB | {statistics.median(mem[('bare', n)]):>7,.1f} KiB"
        )
    print(
        "\nlive: watchers of the generating session (bounded by the generation rate x watchers);"
        "\nresume-from-log: the same patches rebuilt from the log as fast as they go out;"
        "\nbare: a Starlette endpoint sending the same frames from memory."
    )
    bserver.should_exit = True
    await btask
    await http.stop(1.0)
    await rt.aclose()


async def fold(histories: list[int], tokens: int, repeats: int) -> None:
    """The document fold per generated token, against the history's length.

    For each history length a session gets that many (ASCII) tokens in one
    append, then generates ``tokens``; the generation's token events are
    then folded from the log: into the session document with its patch
    serialised (what a live feed does per event), and, as the baseline, into
    the runtime's own state (``sessiontape.core.session.state.apply``). Medians of ``repeats``.
    """
    from sessiontape.core.config import Config
    from sessiontape.core.document import DocumentBuilder
    from sessiontape.core.engine.interface import SamplingParams
    from sessiontape.core.runtime import Runtime
    from sessiontape.core.session.state import SessionState, apply
    from sessiontape.engines.reference import ReferenceEngine
    from sessiontape.transports.http.server.json_encoding import dumps

    tmp = tempfile.mkdtemp()
    cfg = Config.load(
        environ={}, overrides={"database": {"url": f"sqlite+aiosqlite:///{tmp}/fold.db"}}
    )
    rt = await Runtime.create(
        cfg, engine=ReferenceEngine(max_length=max(histories) + tokens + 8, eos_bias=-100.0)
    )
    text = ("The quick brown fox jumps over the lazy dog; " * (max(histories) // 45 + 1)).encode()
    rows = []
    for n in histories:
        s = await rt.open_session("bench")
        await rt.append_tokens(s.session_id, list(text[:n]))
        async for _e in rt.generate(
            s.session_id, GenerateRequest(SamplingParams(max_tokens=tokens, seed=1))
        ):
            pass
        evs = await rt.log.read(s.session_id)
        first = next(i for i, e in enumerate(evs) if e.type == "generation.token")
        prefix, toks = evs[:first], [e for e in evs[first:] if e.type == "generation.token"]
        doc_us, state_us = [], []
        for _ in range(repeats):
            b = DocumentBuilder(s.session_id, detokenize=rt.engine.detokenize)
            b.apply_all(prefix)
            t0 = time.perf_counter()
            for e in toks:
                dumps(b.apply(e))
            doc_us.append((time.perf_counter() - t0) / len(toks) * 1e6)
            st = SessionState(s.session_id)
            for e in prefix:
                apply(st, e)
            t0 = time.perf_counter()
            for e in toks:
                apply(st, e)
            state_us.append((time.perf_counter() - t0) / len(toks) * 1e6)
        rows.append((n, statistics.median(doc_us), statistics.median(state_us)))
    await rt.aclose()
    print(
        f"\nDocument fold per generated token ({tokens} tokens folded from the log, median of {repeats})"
    )
    print(
        f"{'history tokens':>14} | {'document fold + patch JSON':>27} | {'state fold (baseline)':>22} | {'ratio':>6}"
    )
    print("-" * 80)
    for n, d, b_ in rows:
        print(f"{n:>14,} | {d:>24.1f} us | {b_:>19.1f} us | {d / b_:>6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--watchers", type=int, nargs="*", default=[1, 100])
    ap.add_argument(
        "--fold",
        type=int,
        nargs="*",
        metavar="HISTORY",
        default=None,
        help="only the per-token document fold at these history lengths (default 100 8000 30000)",
    )
    ap.add_argument("--client", nargs=2, metavar=("URL", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        asyncio.run(client(args.client[0], int(args.client[1])))
        return
    if args.fold is not None:
        asyncio.run(fold(args.fold or [100, 8000, 30_000], args.tokens, max(args.repeats, 5)))
        return
    asyncio.run(run(args.tokens, args.repeats, args.watchers))


if __name__ == "__main__":
    main()
