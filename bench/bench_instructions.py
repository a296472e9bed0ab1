"""Instructions a short turn costs, counted, against the engine alone: a CPU cost that
the VM's speed does not move.

    .venv/bin/python bench/bench_instructions.py [--turns 200] [--rounds 3] [--tokens 16]
        [--append 3] [--against-python PATH]

Timed figures on the 2-core VM swing by 2x from one hour to the next (another
guest's load, CPU steal), more than most changes to a turn's cost. Instructions do
not: each side runs in a process of its own under valgrind (``cachegrind`` with its
cache simulation off, so only instructions are counted), once with no turns and once
with ``--turns`` turns; the difference over the turns is what one turn costs, without
the interpreter's start, the imports and the warm-up turns. Sides, in interleaved
rounds (medians of ``--rounds``):

- ``engine alone``: ``Engine.generate`` of ``--tokens`` tokens driven directly,
  nothing stored (the reference engine with EOS biased away);
- ``runtime turn``: the same engine behind ``Runtime``: ``append_tokens`` of
  ``--append`` tokens, then ``generate_runs`` of ``--tokens`` (two commits to a
  SQLite file, as a Kakeya turn makes; no wire);
- with ``--against-python PATH``, the runtime turn again under another interpreter
  (a venv with another revision installed): the A/B of a change, each round running
  both.

Every count runs with ``PYTHONHASHSEED=0``. Not every instruction of a turn is the
same on every run even so: the token path's timers (how long a run waits for more
steps) see valgrind's pace, so a side's count moves by a per cent or two between
runs; compare medians of several rounds. Needs ``valgrind`` on the PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from sessiontape.core.generation.request import GenerateRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WARM_UP = 10
#: a session is replaced before its history would pass this (bench_load's --max-history)
SESSION_TOKENS = 2048


async def _engine_alone(turns: int, tokens: int, append: int) -> None:
    from bench_generate import make_engine

    from sessiontape.core.engine.interface import SamplingParams

    engine = make_engine("reference", "small", eos_bias=-1000.0)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, seed=1)
    history: list[int] = []
    for _ in range(WARM_UP + turns):
        if len(history) + append + tokens > SESSION_TOKENS:  # as the runtime side's sessions
            history = []
        history.extend(97 + (j % 26) for j in range(append))
        async for step in engine.generate("alone", history, params):
            history.append(step.token_id)


async def _runtime_turns(turns: int, tokens: int, append: int, db: str) -> None:
    from bench_generate import make_engine, open_runtime

    from sessiontape.core.engine.interface import SamplingParams

    engine = make_engine("reference", "small", eos_bias=-1000.0)
    rt = await open_runtime(f"sqlite+aiosqlite:///{db}", engine)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, seed=1)
    sid = (await rt.open_session("bench", eos_token_ids=[])).session_id
    length = 0
    try:
        for _ in range(WARM_UP + turns):
            if length + append + tokens > SESSION_TOKENS:  # a new session, as bench_load's
                await rt.close(sid)
                sid = (await rt.open_session("bench", eos_token_ids=[])).session_id
                length = 0
            length += append + tokens
            await rt.append_tokens(sid, [97 + (j % 26) for j in range(append)])
            async for _run in rt.generate_runs(sid, GenerateRequest(params)):
                pass
    finally:
        await rt.aclose()


def _worker(args: argparse.Namespace) -> None:
    """The counted process: run ``--side`` for ``--turns`` turns and exit."""
    from sessiontape.core import gctune
    from sessiontape.core.commands.serve import loop_factory

    gctune.tune_for_serving()  # as `sessiontape serve` runs with [server] tune_interpreter
    with tempfile.TemporaryDirectory() as tmp:
        if args.side == "alone":
            work = _engine_alone(args.turns, args.tokens, args.append)
        else:
            work = _runtime_turns(args.turns, args.tokens, args.append, f"{tmp}/turns.sqlite")
        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
            runner.run(work)


def count(python: str, side: str, turns: int, args: argparse.Namespace) -> int:
    """Instructions of one worker process under cachegrind."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [
                "valgrind",
                "--tool=cachegrind",
                "--cache-sim=no",
                f"--cachegrind-out-file={tmp}/cg.out",
                python,
                __file__,
                "--worker",
                "--side",
                side,
                "--turns",
                str(turns),
                "--tokens",
                str(args.tokens),
                "--append",
                str(args.append),
            ],
            capture_output=True,
            text=True,
            cwd=tmp,
            # the same string hashes in every count: set and dict orders, and so the
            # work that follows them, do not change from one process to the next
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
    if out.returncode != 0:
        raise RuntimeError(f"the {side} worker failed:\n{out.stderr[-3000:]}")
    m = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if m is None:
        raise RuntimeError(f"no instruction count from valgrind:\n{out.stderr[-2000:]}")
    return int(m.group(1).replace(",", ""))


def per_turn(python: str, side: str, args: argparse.Namespace) -> float:
    return (count(python, side, args.turns, args) - count(python, side, 0, args)) / args.turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated a turn")
    ap.add_argument("--append", type=int, default=3, help="tokens appended a turn")
    ap.add_argument(
        "--against-python",
        help="an interpreter with another revision installed: its runtime turn, interleaved",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=("alone", "runtime"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    if shutil.which("valgrind") is None:
        sys.exit("bench_instructions.py needs valgrind (apt-get install valgrind)")
    sides = [("engine alone", sys.executable, "alone"), ("runtime turn", sys.executable, "runtime")]
    if args.against_python:
        sides.append(("runtime turn, --against-python", args.against_python, "runtime"))
    got: dict[str, list[float]] = {name: [] for name, _, _ in sides}
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for name, python, side in order:
            got[name].append(per_turn(python, side, args))
            print(f"round {r + 1}: {name}: {got[name][-1] / 1e6:.3f} M", file=sys.stderr)
    alone = statistics.median(got["engine alone"])
    print(
        f"\ninstructions a turn (append {args.append}, generate {args.tokens}; "
        f"{args.turns} turns a count, median of {args.rounds} rounds; {os.cpu_count()} CPUs)\n"
    )
    print("| side | instructions a turn (rounds) | x engine alone |")
    print("|---|---:|---:|")
    for name, _, _ in sides:
        vals = got[name]
        spread = " / ".join(f"{v / 1e6:.2f}" for v in vals)
        med = statistics.median(vals)
        print(f"| {name} | {med / 1e6:.2f} M ({spread}) | {med / alone:.2f} |")


if __name__ == "__main__":
    main()
