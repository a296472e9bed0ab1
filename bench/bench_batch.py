"""Continuous batching: N concurrent sessions on one model, against N = 1 of the same run.

    .venv/bin/python bench/bench_batch.py                     # small demo model, N = 1 2 4 8 16
    .venv/bin/python bench/bench_batch.py --sessions 1,8 --rounds 5 --tokens 96

Every session decodes ``--tokens`` tokens after a ``--prompt``-token history of
its own (seeded sampling, temperature 0.8, so lookahead guesses rarely hit and
the rows measure real passes). For each N the table gives the aggregate rate
(all tokens over the wall time), the median per-session rate, and the p50 and
p99 time between two tokens of one session, each against the N = 1 figure of
the same run. Rows run in interleaved rounds (every N once per round, the
order rotating) and report medians. Two baselines from the same run:

- ``unbatched``: the same engine with ``batch_slots=0`` (each session its own
  passes, what the engine did before the scheduler) at the largest N;
- onnxruntime-genai's batched generation (greedy, ``batch_size=N``) on the same
  model file, when the package is installed (the ``bench`` extra; on a GPU
  ``onnxruntime-genai-cuda``), or from another environment with
  ``--genai-python PATH`` (the CPU ``onnxruntime-genai`` depends on the CPU-only
  ``onnxruntime``, which must not sit beside onnxruntime-gpu in the project's
  environment: ``python3 -m venv /tmp/genai && /tmp/genai/bin/pip install
  onnxruntime-genai``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def genai_batched(folder: Path, n: int, tokens: int, plen: int, provider: str) -> float:
    """onnxruntime-genai generating ``n`` sequences in one batch: aggregate tok/s."""
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.clear_providers()
    if provider == "cuda":
        config.append_provider("cuda")
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(
        max_length=-(-(plen + tokens) // 64) * 64, do_sample=False, batch_size=n
    )
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray([prompt(i, plen) for i in range(n)], dtype=np.int32))
    gen.generate_next_token()
    t0 = time.perf_counter()
    count = 1
    while not gen.is_done() and count < tokens:
        gen.generate_next_token()
        count += 1
    return n * (count - 1) / (time.perf_counter() - t0)


def prompt(i: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(1000 + i).integers(3, 250, n)]


if __name__ == "__main__" and sys.argv[1:2] == ["--genai-child"]:
    # run by --genai-python in another environment: only numpy and onnxruntime_genai here
    _, _, folder_, n_, tokens_, plen_, provider_ = sys.argv
    print(genai_batched(Path(folder_), int(n_), int(tokens_), int(plen_), provider_))
    sys.exit(0)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sessiontape.core.engine.interface import SamplingParams  # noqa: E402
from sessiontape.engines.onnx.demo import ensure_demo  # noqa: E402
from sessiontape.engines.onnx.engine import OnnxEngine  # noqa: E402


async def one_round(
    engine: OnnxEngine, n: int, tokens: int, plen: int, tag: str
) -> tuple[float, list[float], list[float]]:
    """Wall seconds for ``n`` sessions, each session's rate, and every gap between two tokens."""
    gaps: list[float] = []
    rates: list[float] = []

    async def session(i: int) -> None:
        key = f"{tag}-{n}-{i}"
        params = SamplingParams(max_tokens=tokens, temperature=0.8, seed=i)
        last = None
        first = None
        count = 0
        async for _ in engine.generate(key, prompt(i, plen), params):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            else:
                first = now
            last = now
            count += 1
        assert count == tokens, "the demo model must not stop early (no stop ids given)"
        assert first is not None and last is not None
        rates.append((count - 1) / (last - first))
        engine.forget(key)

    t0 = time.perf_counter()
    await asyncio.gather(*(session(i) for i in range(n)))
    return time.perf_counter() - t0, rates, gaps


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small", help="demo model size")
    ap.add_argument("--sessions", default="1,2,4,8,16", help="comma-separated session counts")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each session decodes")
    ap.add_argument("--prompt", type=int, default=32, help="history tokens per session")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    ap.add_argument("--providers", default="auto", help="onnx engine providers")
    ap.add_argument("--slots", type=int, default=16, help="batch_slots of the batching engine")
    ap.add_argument(
        "--genai-python", help="an interpreter whose environment has onnxruntime-genai (baseline)"
    )
    args = ap.parse_args()
    ns = [int(x) for x in args.sessions.split(",")]
    folder = ensure_demo(args.size)
    engines: dict[str, Any] = {
        "batched": OnnxEngine(model_dir=folder, providers=args.providers, batch_slots=args.slots),
        "unbatched": OnnxEngine(model_dir=folder, providers=args.providers, batch_slots=0),
    }
    info = engines["batched"].info
    print(
        f"model {info.model_id} on {info.provider}, onnxruntime {info.runtime_version}, "
        f"{os.cpu_count()} logical CPUs, load {os.getloadavg()[0]:.1f}; "
        f"{args.tokens} tokens after a {args.prompt}-token prompt per session, "
        f"{args.rounds} rounds"
    )
    if engines["batched"]._batch is None:
        print("this provider runs the fixed pass shape: no batch scheduler (see docs/engines.md)")
    # warm both engines (thread pools, allocations, the pool's first capacity)
    for eng in engines.values():
        await one_round(eng, 2, 8, args.prompt, "warm")
    cells: list[tuple[str, int]] = [("batched", n) for n in ns] + [
        ("unbatched", n) for n in sorted({min(ns), max(ns)})
    ]
    got: dict[tuple[str, int], list[tuple[float, list[float], list[float]]]] = {
        c: [] for c in cells
    }
    for r in range(args.rounds):
        order = cells[r % len(cells) :] + cells[: r % len(cells)]
        for name, n in order:
            got[(name, n)].append(await one_round(engines[name], n, args.tokens, args.prompt, name))

    def agg(cell: tuple[str, int]) -> float:
        return float(
            statistics.median(cell[1] * (args.tokens - 1) / w for w, _, _ in got[cell] if w)
        )

    def per_session(cell: tuple[str, int]) -> float:
        return statistics.median(statistics.median(rs) for _, rs, _ in got[cell])

    def gaps(cell: tuple[str, int]) -> list[float]:
        return [g for _, _, gs in got[cell] for g in gs]

    base = ("batched", min(ns))
    b_agg, b_p50 = agg(base), pct(gaps(base), 50)
    print()
    print(
        "| engine | N | aggregate tok/s | x N=1 | per-session tok/s | p50 ms/token | p99 ms/token "
        "| p99 / N=1 p50 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for cell in cells:
        name, n = cell
        g = gaps(cell)
        print(
            f"| {name} | {n} | {agg(cell):,.0f} | {agg(cell) / b_agg:.2f} | {per_session(cell):,.0f} "
            f"| {1000 * pct(g, 50):.2f} | {1000 * pct(g, 99):.2f} | {pct(g, 99) / b_p50:.2f} |"
        )
    stats = engines["batched"].scheduler_stats()
    print(
        f"\nscheduler: {stats.get('passes', 0):.0f} passes, "
        f"{stats.get('shared_passes', 0):.0f} carrying more than one session"
    )
    provider = "cuda" if "CUDA" in info.provider else "cpu"
    try:
        rates: dict[int, float] = {}
        for n in ns:
            if args.genai_python:
                cmd = [args.genai_python, __file__, "--genai-child", str(folder), str(n)]
                cmd += [str(args.tokens), str(args.prompt), provider]
                out = await asyncio.to_thread(
                    subprocess.run, cmd, capture_output=True, text=True, check=True, timeout=600
                )
                rates[n] = float(out.stdout.split()[-1])
            else:
                rates[n] = genai_batched(folder, n, args.tokens, args.prompt, provider)
    except Exception as exc:  # not installed, or this genai build cannot batch this file
        print(f"no onnxruntime-genai batched baseline: {exc}")
    else:
        print("\n| onnxruntime-genai batched, N | aggregate tok/s | ours / genai |")
        print("|---:|---:|---:|")
        for n in ns:
            ours = agg(("batched", n))
            print(f"| {n} | {rates[n]:,.0f} | {ours / rates[n]:.2f} |")
    for eng in engines.values():
        await eng.aclose()


if __name__ == "__main__":
    asyncio.run(main())
