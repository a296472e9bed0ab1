"""ONNX engine benchmarks: decode speed vs onnxruntime-genai, cached turns vs stateless re-prefill.

Run: ``.venv/bin/python bench/bench_onnx.py [--threads N] [--history 4096]``

Prints one table. Every baseline is measured in the same run on the same
model file: onnxruntime-genai's greedy decode of the ``small`` demo model,
a stateless re-prefill of the whole history, and numpy's copy bandwidth
(the memory-bandwidth ceiling for a decode step that must read every
weight once).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import numpy as np

from core.engine import SamplingParams
from engines.onnx import OnnxEngine
from engines.onnx.demo import SIZES, ensure_demo


def copy_bandwidth(mb: int = 256, reps: int = 5) -> float:
    """Bytes per second moved by a large numpy copy (read + write)."""
    src = np.ones(mb * (1 << 20) // 4, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * src.nbytes / min(times)


async def decode_rate(engine: OnnxEngine, prompt: list[int], n: int, key: str) -> float:
    engine.forget(key)
    t0 = 0.0
    count = 0
    async for _step in engine.generate(key, prompt, SamplingParams(max_tokens=n, temperature=0)):
        if count == 0:
            t0 = time.perf_counter()
        count += 1
    assert count == n, "the demo model must not stop early (no stop ids given)"
    return (count - 1) / (time.perf_counter() - t0)


def genai_rate(folder: Path, prompt: list[int], n: int) -> float:
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    gen.generate_next_token()
    t0 = time.perf_counter()
    count = 1
    while not gen.is_done() and count < n:
        gen.generate_next_token()
        count += 1
    return (count - 1) / (time.perf_counter() - t0)


async def turn(engine: OnnxEngine, history: list[int], key: str, stateless: bool) -> tuple[float, list[int]]:
    """One conversational turn: the whole history in, 8 tokens out."""
    if stateless:
        engine.forget(key)
    t0 = time.perf_counter()
    out = [s.token_id async for s in engine.generate(key, history, SamplingParams(max_tokens=8, temperature=0))]
    return time.perf_counter() - t0, out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all CPUs)")
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=64)
    args = ap.parse_args()

    folder = ensure_demo("small")
    spec = SIZES["small"]
    weight_bytes = (folder / "model.onnx").stat().st_size
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(32, 127, 32)]
    rows: list[tuple[str, str, str, str]] = []

    bw = copy_bandwidth()
    ceiling = bw / weight_bytes

    engine = OnnxEngine(model_dir=folder, intra_op_threads=args.threads)
    unpadded = OnnxEngine(model_dir=folder, intra_op_threads=args.threads, min_rows=1)
    ours = statistics.median([await decode_rate(engine, prompt, args.decode, "d") for _ in range(3)])
    ours1 = statistics.median([await decode_rate(unpadded, prompt, args.decode, "d") for _ in range(3)])
    theirs = statistics.median([genai_rate(folder, prompt, args.decode) for _ in range(3)])
    rows.append(("decode tok/s, small (2-row padded passes)", f"{ours:.1f}", f"genai {theirs:.1f}",
                 f"{ours / theirs:.2f}x"))
    rows.append(("decode tok/s, small (1-row passes, not bit-exact)", f"{ours1:.1f}", f"genai {theirs:.1f}",
                 f"{ours1 / theirs:.2f}x"))
    rows.append(("decode vs bandwidth ceiling", f"{ours:.1f}",
                 f"ceiling {ceiling:.1f} ({bw / 1e9:.1f} GB/s, {weight_bytes / 1e6:.0f} MB)",
                 f"{ours / ceiling:.0%}"))

    hist = [int(t) for t in rng.integers(32, 127, args.history)]
    _, out = await turn(engine, hist, "c", stateless=True)  # the session so far
    cached = []
    for _ in range(3):
        hist = hist + out + [int(t) for t in rng.integers(32, 127, 16)]
        took, out = await turn(engine, hist, "c", stateless=False)
        cached.append(took)
    stateless, again = await turn(engine, hist, "s", stateless=True)
    assert again == out, "a stateless re-prefill must give the same tokens as the cached turn"
    c = statistics.median(cached)
    rows.append((f"turn latency, {args.history}-token history + 16 new, 8 out", f"{c * 1e3:.0f} ms",
                 f"stateless {stateless * 1e3:.0f} ms", f"{stateless / c:.1f}x"))

    print(f"small demo model: {spec.params():,} params, {spec.layers} layers, hidden {spec.hidden}; "
          f"provider {engine.info.provider}; onnxruntime {engine.info.runtime_version}")
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    head = ("measure", "sessiontape onnx", "baseline (same run)", "ratio")
    w = [max(a, len(b)) for a, b in zip(w, head, strict=True)]
    for r in (head, tuple("-" * x for x in w), *rows):
        print(" | ".join(c.ljust(x) for c, x in zip(r, w, strict=True)))


if __name__ == "__main__":
    asyncio.run(main())
