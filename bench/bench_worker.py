"""The engine worker's own cost: generations through ``WorkerEngine`` (the engine in a
child process, ``[engine] process = "worker"``) against the same engine in this
process, nothing stored.

    .venv/bin/python bench/bench_worker.py [--concurrent 16] [--generations 40]
        [--tokens 16] [--rounds 5] [--event-loop auto]

``--concurrent`` sessions each run ``--generations`` generations of ``--tokens``
tokens, one after another, all sessions at once (as the runtime's admission lets 16
run). Each round times both sides back to back (the order alternating): the CPU a
generation costs the child and this process (from ``/proc`` and ``os.times``), and
the wall time per generation. Medians of the rounds, and the median of the rounds'
own ratios to the engine alone. The reference engine with EOS biased away.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sessiontape.core.commands.serve import loop_factory
from sessiontape.core.engine.interface import Engine, SamplingParams
from sessiontape.core.engine.worker import WorkerEngine
from sessiontape.engines.reference import ReferenceEngine

#: a session's history starts again from its prompt past this many tokens
HISTORY_MAX = 1500


def child_cpu(engine: WorkerEngine) -> float:
    """CPU seconds the worker's child has used."""
    stat = Path(f"/proc/{engine._proc.pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(engine: Engine, concurrent: int, generations: int, tokens: int) -> None:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, seed=1)
    prompt = list(b"the worker's own cost ")

    async def one(i: int) -> None:
        history = list(prompt)
        for _ in range(generations):
            if len(history) > HISTORY_MAX:
                history = list(prompt)
            history.extend(b"abc")
            async for step in engine.generate(f"s{i}", history, params):
                history.append(step.token_id)

    await asyncio.gather(*(one(i) for i in range(concurrent)))


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    worker = WorkerEngine("reference", {"eos_bias": -1000.0}, event_loop=args.event_loop)
    alone = ReferenceEngine(eos_bias=-1000.0)
    n = args.concurrent * args.generations
    got: dict[str, list[float]] = {k: [] for k in ("alone", "child", "server", "wall", "ratio")}
    try:
        for engine in (alone, worker):  # warm-up: imports, the child's first generations
            await run(engine, args.concurrent, 3, args.tokens)
        for r in range(args.rounds):
            sides: list[Any] = ["alone", "worker"] if r % 2 == 0 else ["worker", "alone"]
            for side in sides:
                c0, p0, t0 = child_cpu(worker), time.process_time(), time.perf_counter()
                engine = alone if side == "alone" else worker
                await run(engine, args.concurrent, args.generations, args.tokens)
                wall = (time.perf_counter() - t0) / n
                mine = (time.process_time() - p0) / n
                if side == "alone":
                    got["alone"].append(mine)
                else:
                    got["child"].append((child_cpu(worker) - c0) / n)
                    got["server"].append(mine)
                    got["wall"].append(wall)
            got["ratio"].append((got["child"][-1] + got["server"][-1]) / got["alone"][-1])
    finally:
        await worker.aclose()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--generations", type=int, default=40, help="a session's, a round")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--event-loop", default="auto", choices=("auto", "uvloop", "asyncio"))
    args = ap.parse_args()
    with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
        got = runner.run(measure(args))
    med = {k: statistics.median(v) for k, v in got.items()}
    print(
        f"\n{args.concurrent} sessions at once, {args.tokens} tokens a generation, "
        f"median of {args.rounds} rounds; {os.cpu_count()} CPUs, load "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        + "\n"
    )
    print("| per generation | CPU ms | wall ms (all at once) | CPU x engine alone |")
    print("|---|---:|---:|---:|")
    print(f"| engine alone, in process | {med['alone'] * 1e3:.3f} | | 1.00 |")
    total = med["child"] + med["server"]
    print(
        f"| through the worker: child {med['child'] * 1e3:.3f} + server "
        f"{med['server'] * 1e3:.3f} | {total * 1e3:.3f} | {med['wall'] * 1e3:.3f} "
        f"| {med['ratio']:.2f} |"
    )


if __name__ == "__main__":
    main()
