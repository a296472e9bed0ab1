"""A setting's two values compared on one server, switched every second while one Kakeya
client sends turns one after another.

    .venv/bin/python bench/bench_alternate.py [--setting max_active] [--values 16,8]
        [--seconds 30] [--every 1.0]

On a VM whose speed swings within minutes, two runs of a fresh server a side cannot
separate a 10% change from the noise. Here one ``sessiontape serve`` runs the whole
time; a thread in it sets the setting to one value, then the other, every ``--every``
seconds, and notes the time and the process's CPU (``os.times()``) at each switch. The
client notes each turn's end and length. Each window's turns and CPU count to the value
it ran with (its first 50 ms left out, a turn begun before the switch); the table gives,
per value, the median over its windows of the CPU a turn and of the median turn.

Settings (set on the live objects, as the config would have made them):

- ``max_active``: ``[generation] max_active`` (``core/generation/scheduler.Admission.limit``; with
  one client, a check that the harness itself sees no difference).

A setting is added here as a class, the attribute its instances carry it in, and the
environment variable that sets it at the server's start.

A turn appends 3 tokens and generates 16 with the reference engine, EOS biased away.
The client (this process, after the server started) is pinned to the last CPU, as
bench_load.py's are (``--client-cpu none`` leaves it floating).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import client_cpu  # noqa: E402
from bench_load import Server  # noqa: E402  (the server as bench_load.py starts it)

#: where each setting lives: the class whose instances carry it, and the attribute
SETTINGS = {
    "max_active": ("sessiontape.core.generation.scheduler", "Admission", "limit"),
}

#: the environment variable that sets each setting at the server's start
ENV_NAMES = {
    "max_active": "SESSIONTAPE_GENERATION__MAX_ACTIVE",
}

#: the server's hook, run at its start as ``sitecustomize`` (only in the server process)
HOOK = """
import importlib, json, os, sys, threading, time
_cfg = json.loads(os.environ["SESSIONTAPE_BENCH_ALTERNATE"])
if "serve" in sys.argv:
    _mod = importlib.import_module(_cfg["module"])
    _cls = getattr(_mod, _cfg["cls"])
    _made = []
    _init = _cls.__init__
    def _remember(self, *a, **k):
        _init(self, *a, **k)
        _made.append(self)
    _cls.__init__ = _remember
    def _switch():
        out = open(_cfg["log"], "w", buffering=1)
        side = 0
        while True:
            time.sleep(_cfg["every"])
            side = 1 - side
            for obj in _made:
                setattr(obj, _cfg["attr"], _cfg["values"][side])
            t = os.times()
            out.write(f"{time.time():.4f} {side} {t.user + t.system:.4f}\\n")
    threading.Thread(target=_switch, daemon=True, name="bench-alternate").start()
"""


async def client(port: int, seconds: float, log: Path) -> int:
    import grpc

    from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as pb
    from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as pbg

    turns = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pbg.RuntimeServiceStub(ch)
        sid = ""
        with log.open("w") as out:
            end = time.time() + seconds
            while time.time() < end:
                if turns % 100 == 0:  # a fresh session now and then, as bench_load's
                    if sid:
                        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
                    req = pb.CreateSessionRequest(eos_token_ids=[])
                    sid = (await stub.CreateSession(req)).session_id
                t0 = time.perf_counter()
                await stub.AppendTokens(
                    pb.AppendTokensRequest(session_id=sid, token_ids=[97, 98, 99])
                )
                gen = pb.GenerateRequest(session_id=sid, max_tokens=16, seed=1, temperature=0.0)
                async for _ in stub.Generate(gen):
                    pass
                out.write(f"{time.time():.4f} {time.perf_counter() - t0:.6f}\n")
                turns += 1
    return turns


def windows(switches: Path, turns: Path) -> dict[int, dict[str, list[float]]]:
    """Per side: each window's CPU a turn and median turn, in ms."""
    marks = [(float(a), int(b), float(c)) for a, b, c in (ln.split() for ln in switches.open())]
    ends = [(float(a), float(b)) for a, b in (ln.split() for ln in turns.open())]
    out: dict[int, dict[str, list[float]]] = {
        0: {"cpu": [], "turn": []},
        1: {"cpu": [], "turn": []},
    }
    for (t0, side, c0), (t1, _, c1) in itertools.pairwise(marks):
        lat = [d for t, d in ends if t0 + 0.05 < t <= t1]
        if len(lat) < 10:
            continue
        out[side]["cpu"].append((c1 - c0) / len(lat) * 1e3)
        out[side]["turn"].append(statistics.median(lat) * 1e3)
    return out


async def run(args: argparse.Namespace) -> None:
    values = [float(v) if "." in v else int(v) for v in args.values.split(",")]
    if len(values) != 2:
        raise SystemExit("--values takes two values")
    module, cls, attr = SETTINGS[args.setting]
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        (tmp / "hook").mkdir()
        (tmp / "hook" / "sitecustomize.py").write_text(HOOK)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(tmp / "hook"), os.environ.get("PYTHONPATH", "")]),
            "SESSIONTAPE_BENCH_ALTERNATE": json.dumps(
                {
                    "module": module,
                    "cls": cls,
                    "attr": attr,
                    "values": values,
                    "every": args.every,
                    "log": str(tmp / "switches.log"),
                }
            ),
            # the first value is the server's own from the start: the first window is its
            ENV_NAMES[args.setting]: str(values[0]),
        }
        server = await Server.start(tmp, f"sqlite+aiosqlite:///{tmp}/db.sqlite", 1, env=env)
        try:
            cpu = client_cpu(args.client_cpu)  # as bench_load's clients: the server has the rest
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})
            port = server.ports[0]
            await client(port, 2.0, tmp / "warm.log")  # warm-up, not counted
            n = await client(port, args.seconds, tmp / "turns.log")
        finally:
            await server.stop()
        sides = windows(tmp / "switches.log", tmp / "turns.log")
    print(
        f"{args.setting} alternating {values[0]} / {values[1]} every {args.every} s on one "
        f"server, one Kakeya client turn after turn for {args.seconds:.0f} s ({n:,} turns; "
        f"{os.cpu_count()} CPUs)\n"
    )
    print(f"| {args.setting} | windows | server CPU a turn ms | median turn ms |")
    print("|---|---:|---:|---:|")
    med = {
        s: (statistics.median(w["cpu"]), statistics.median(w["turn"]))
        for s, w in sides.items()
        if w["cpu"]
    }
    for side, value in enumerate(values):
        if side in med:
            print(
                f"| {value} | {len(sides[side]['cpu'])} | {med[side][0]:.2f} | {med[side][1]:.2f} |"
            )
    if len(med) == 2:
        print(
            f"\n{values[1]} against {values[0]}: CPU a turn x{med[1][0] / med[0][0]:.3f}, "
            f"median turn x{med[1][1] / med[0][1]:.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="max_active")
    ap.add_argument("--values", default="16,8", help="the two values, comma-separated")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--every", type=float, default=1.0, help="seconds between switches")
    ap.add_argument(
        "--client-cpu",
        default="last",
        help="the CPU the client is pinned to: last, none, or a number",
    )
    args = ap.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
