"""Token-path benchmark: tokens per second through the log against the engine alone.

    .venv/bin/python bench/bench_generate.py [--engine reference|onnx] [--size small]
        [--tokens 400] [--sessions 1,8] [--rounds 5] [--pg URL | --no-pg] [--wires]

Every row is measured in interleaved rounds in one run: a round generates the
same greedy tokens once with the engine alone (``Engine.generate`` driven
directly, nothing stored) and once through ``Runtime.generate`` (every token
committed to the log before it is yielded). The table shows medians and their
ratio. ``--wires`` adds one row per transport: the same generation received
by a client over the wire (SSE, Kakeya, Salience, Evergreen), with the
median time from a token's commit to its arrival at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.config import Config
from core.engine import Engine, SamplingParams
from core.events import T
from core.registry import ENGINES, load
from core.runtime import Runtime

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


def row(name: str, alone: str, through: str, ratio: str, extra: str = "") -> None:
    print(f"| {name:44} | {alone:>14} | {through:>14} | {ratio:>7} | {extra:>16} |", flush=True)


def make_engine(name: str, size: str) -> Engine:
    opts: dict[str, Any] = {"size": size} if name == "onnx" else {"max_length": 8192}
    return load(ENGINES, name)(**opts)  # type: ignore[no-any-return]


def params(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, seed=1)


async def engine_alone(engine: Engine, sessions: int, tokens: int) -> float:
    """Total tok/s of ``sessions`` concurrent generations, engine only."""
    prompt = engine.tokenize(PROMPT)

    async def one(i: int) -> int:
        key = f"alone-{i}-{time.monotonic_ns()}"
        n = 0
        async for step in engine.generate(key, prompt, params(tokens)):
            n += not step.is_prefill
        engine.forget(key)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(sessions)))
    return sum(counts) / (time.perf_counter() - t0)


async def through_log(rt: Runtime, sessions: int, tokens: int) -> float:
    """Total tok/s of ``sessions`` concurrent generations through Runtime.generate."""
    prompt = rt.engine.tokenize(PROMPT)
    sids = []
    for _ in range(sessions):
        st = await rt.open_session("bench", eos_token_ids=[])
        await rt.append_tokens(st.session_id, prompt)
        sids.append(st.session_id)

    async def one(sid: str) -> int:
        n = 0
        async for e in rt.generate(sid, params(tokens)):
            n += e.type == T.GENERATION_TOKEN and not e.body["is_prefill"]
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(s) for s in sids))
    dt = time.perf_counter() - t0
    for sid in sids:
        await rt.close(sid)
    return sum(counts) / dt


async def open_runtime(url: str, engine: Engine) -> Runtime:
    cfg = Config.load(environ={}, overrides={"database": {"url": url}})
    return await Runtime.create(cfg, engine=engine)


async def compare(name: str, rounds: int, alone: Callable[[], Awaitable[float]],
                  through: Callable[[], Awaitable[float]], extra: Callable[[], str] = lambda: "") -> float:
    a, b = [], []
    await alone()  # warm up both paths once
    await through()
    for _ in range(rounds):
        a.append(await alone())
        b.append(await through())
    ma, mb = statistics.median(a), statistics.median(b)
    row(name, f"{ma:,.0f} tok/s", f"{mb:,.0f} tok/s", f"{mb / ma:.3f}", extra())
    return mb / ma


# -- wires -----------------------------------------------------------------

class _Clock:
    """Commit times of generated tokens (the log's before-commit hook) and arrival times at a client."""

    def __init__(self) -> None:
        self.committed: dict[int, float] = {}
        self.lat: list[float] = []

    def arrived(self, position: int) -> None:
        t = self.committed.get(position)
        if t is not None:
            self.lat.append(time.perf_counter() - t)


async def wire_rows(engine: Engine, url: str, tokens: int, rounds: int) -> None:
    import grpc
    import httpx

    from core.config import parse_listen
    from transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
    from transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as kgrpc
    from transports.grpc.gen.salience.v1 import salience_pb2 as spb
    from transports.grpc.gen.salience.v1 import salience_pb2_grpc as sgrpc
    from transports.grpc.plugin import GrpcTransport
    from transports.sse.plugin import HttpTransport

    def free() -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    gport, hport = free(), free()
    cfg = Config.load(environ={}, overrides={
        "database": {"url": url},
        "transports": {"grpc": {"enabled": True, "listen": f"127.0.0.1:{gport}"},
                       "http": {"enabled": True, "listen": f"127.0.0.1:{hport}"}}})
    rt = await Runtime.create(cfg, engine=engine)
    clock = _Clock()

    async def hook(evs: list[Any]) -> None:
        now = time.perf_counter()
        for e in evs:
            if e.type == T.GENERATION_TOKEN:
                clock.committed[int(e.body["position"])] = now

    rt.log.before_commit = hook
    grpc_t = GrpcTransport(rt, cfg.transports["grpc"])
    http_t = HttpTransport(rt, cfg.transports["http"])
    await grpc_t.start()
    await http_t.start()
    host, _ = parse_listen(f"127.0.0.1:{gport}")
    chan = grpc.aio.insecure_channel(f"{host}:{gport}")
    kakeya = kgrpc.RuntimeServiceStub(chan)
    salience = sgrpc.SalienceStub(chan)
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{hport}", timeout=60)
    prompt = engine.tokenize(PROMPT)
    try:
        async def via_sse() -> float:
            r = await http.post("/v1/sessions", json={"eos_token_ids": []})
            sid = r.json()["id"]
            await http.post(f"/v1/sessions/{sid}/append", json={"tokens": prompt})
            n = 0
            t0 = time.perf_counter()
            async with http.stream("POST", f"/v1/sessions/{sid}/generate",
                                   json={"max_tokens": tokens, "temperature": 0, "seed": 1}) as resp:
                async for line in resp.aiter_lines():
                    if (line.startswith("data:") and '"/tokens/' in line) or '"tokens"' in line:
                        pass
                    if line.startswith("data:") and "generated" in line:
                        n += line.count('"op":"append"') or 0
                    if line.startswith("event: end") or line.startswith("event:end"):
                        break
            dt = time.perf_counter() - t0
            doc = (await http.get(f"/v1/sessions/{sid}")).json()
            n = len(doc["generations"][-1]["tokens"]) if doc.get("generations") else n
            return n / dt

        async def via_kakeya() -> float:
            sid = (await kakeya.CreateSession(kpb.CreateSessionRequest(eos_token_ids=[]))).session_id
            await kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, tokens=prompt))
            n = 0
            t0 = time.perf_counter()
            pos = len(prompt)
            async for m in kakeya.Generate(kpb.GenerateRequest(session_id=sid, max_tokens=tokens, temperature=0.0,
                                                               seed=1)):
                if m.HasField("token_id") if hasattr(m, "HasField") else False:
                    pass
                if m.WhichOneof("event") == "token_id":
                    clock.arrived(pos)
                    pos += 1
                    n += 1
            return n / (time.perf_counter() - t0)

        async def via_salience() -> float:
            r = await salience.OpenSession(spb.OpenSessionRequest())
            sid = r.session_id
            n = 0
            t0 = time.perf_counter()
            async for m in salience.Generate(spb.GenerateRequest(
                    session_id=sid, offset=0, append_tokens=prompt, max_tokens=tokens, temperature=1e-9)):
                if m.WhichOneof("event") == "token" and not m.token.is_prefill:
                    clock.arrived(m.token.position)
                    n += 1
            return n / (time.perf_counter() - t0)

        async def alone() -> float:
            return await engine_alone(engine, 1, tokens)

        for name, fn in (("Kakeya Generate", via_kakeya), ("Salience Generate", via_salience),
                         ("SSE generate stream", via_sse)):
            clock.lat.clear()
            await compare(f"{name}, 1 session", rounds, alone, fn,
                          lambda: f"{statistics.median(clock.lat) * 1e3:.2f} ms" if clock.lat else "")
    finally:
        await http.aclose()
        await chan.close()
        await http_t.stop()
        await grpc_t.stop()
        await rt.aclose()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="reference", choices=["reference", "onnx"])
    ap.add_argument("--size", default="small", help="demo model size for --engine onnx")
    ap.add_argument("--tokens", type=int, default=400, help="tokens per generation")
    ap.add_argument("--sessions", default="1,8", help="comma-separated concurrent session counts")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per row (median)")
    ap.add_argument("--pg", default=os.environ.get("BENCH_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"),
                    help="PostgreSQL URL for the PostgreSQL rows")
    ap.add_argument("--no-pg", action="store_true", help="skip the PostgreSQL rows")
    ap.add_argument("--wires", action="store_true", help="add one row per transport (client over loopback)")
    args = ap.parse_args()

    engine = make_engine(args.engine, args.size)
    print(f"engine {engine.info.name} ({engine.info.model_id}, {engine.info.provider}), "
          f"{args.tokens} greedy tokens per generation, {args.rounds} interleaved rounds, medians; "
          f"{os.cpu_count()} CPUs\n")
    row("path", "engine alone", "through log", "ratio", "commit->client")
    row("-" * 44, "-" * 14, "-" * 14, "-" * 7, "-" * 16)
    counts = [int(x) for x in args.sessions.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        urls = [("SQLite", f"sqlite+aiosqlite:///{tmp}/bench.db")]
        if not args.no_pg:
            urls.append(("PostgreSQL", args.pg))
        for label, url in urls:
            try:
                rt = await open_runtime(url, engine)
            except Exception as exc:  # PostgreSQL not answering
                row(f"{label}: skipped ({type(exc).__name__})", "", "", "")
                continue
            try:
                for n in counts:
                    await compare(f"{label}, {n} session{'s' if n > 1 else ''}", args.rounds,
                                  lambda n=n: engine_alone(engine, n, args.tokens),  # type: ignore[misc]
                                  lambda n=n, rt=rt: through_log(rt, n, args.tokens))  # type: ignore[misc]
            finally:
                with contextlib.suppress(Exception):
                    await rt.aclose()
            if args.wires and label == "SQLite":
                await wire_rows(make_engine(args.engine, args.size), f"sqlite+aiosqlite:///{tmp}/wires.db",
                                args.tokens, args.rounds)


if __name__ == "__main__":
    asyncio.run(main())
