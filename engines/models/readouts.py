"""Concept directions for Salience readouts, derived from labelled example texts.

    sessiontape model readouts MODEL_DIR [--examples examples.json] [--layers 15,30]

For each concept, the direction at a layer is the difference of means: the
mean hidden state (over the tokens of each example, then over the examples)
of the concept's examples minus the mean over every example of every
concept, scaled to unit length. A token's readout is then the cosine of its
hidden state with each direction (:class:`sessiontape.engines.onnx.model.Concepts`):
positive where the token's representation leans toward the concept's
examples and away from the others. The directions are only as good as the
examples: a few sentences per concept give a coarse, but real, signal.

``examples.json`` maps concept names to lists of texts; without it,
:data:`DEFAULT_EXAMPLES` (which the importer uses) is taken. The result is
written to the model folder's ``readout_concepts.json``, with the method and
the examples' sha256 recorded beside the directions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sessiontape.core.errors import ConfigError
from sessiontape.engines.model_spec import SLOT_BLOCK

DEFAULT_EXAMPLES: dict[str, list[str]] = {
    "question": [
        "What is the capital of France?",
        "How do I reverse a list in Python?",
        "Why is the sky blue?",
        "Can you tell me when the museum opens?",
        "Where did you put the keys?",
    ],
    "code": [
        "def add(a, b):\n    return a + b",
        "for (int i = 0; i < n; i++) { sum += x[i]; }",
        "SELECT name FROM users WHERE id = 42;",
        "import numpy as np\nx = np.zeros((3, 4))",
        "const total = items.reduce((s, x) => s + x, 0);",
    ],
    "positive": [
        "I love this, it is wonderful and makes me so happy.",
        "What a fantastic day, everything went perfectly!",
        "Thank you so much, this is great news.",
        "The food was delicious and the staff were lovely.",
        "I am delighted with the results, well done!",
    ],
    "negative": [
        "I hate this, it is awful and makes me so angry.",
        "What a terrible day, everything went wrong.",
        "This is the worst service I have ever had.",
        "The food was cold and the staff were rude.",
        "I am disappointed and upset with the results.",
    ],
    "number": [
        "12 + 30 = 42",
        "The total is 3,250 dollars and 17 cents.",
        "In 1969, 3 astronauts flew 384,400 km.",
        "7 8 9 10 11 12",
        "Pi is about 3.14159 and e is about 2.71828.",
    ],
}


def _hidden_means(
    model_dir: Path, texts: Sequence[str], layers: Sequence[int]
) -> np.ndarray[Any, Any]:
    """[texts, layers, hidden]: each text's hidden states at ``layers``, averaged over its tokens."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(
        str(model_dir / "model.onnx"), opts, providers=["CPUExecutionProvider"]
    )
    pasts = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    out = np.zeros((len(texts), len(layers), 0), np.float64)
    rows = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        if not ids:
            raise ConfigError(f"readout example {text!r} has no tokens")
        n = len(ids)
        cap = -(-(n + 1) // SLOT_BLOCK) * SLOT_BLOCK
        feed: dict[str, Any] = {
            "input_ids": np.array([ids], np.int64),
            "attention_mask": np.ones((1, cap), np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None],
        }
        for p in pasts:  # the element type the graph declares (float16 for --dtype float16)
            kv_type = np.float16 if p.type == "tensor(float16)" else np.float32
            feed[p.name] = np.zeros((1, int(p.shape[1]), cap, int(p.shape[3])), kv_type)
        got = sess.run([f"hidden_states.{layer}" for layer in layers], feed)
        rows.append([np.asarray(h[0], np.float64).mean(axis=0) for h in got])
    out = np.asarray(rows, np.float64)
    return out


def derive_concepts(
    model_dir: Path, examples: Mapping[str, Sequence[str]], layers: Sequence[int] | None = None
) -> dict[str, Any]:
    """The ``readout_concepts.json`` document for ``examples`` (difference of means, unit length)."""
    if len(examples) < 2 or any(not texts for texts in examples.values()):
        raise ConfigError("readout examples need at least two concepts, each with some texts")
    cfg = json.loads((model_dir / "config.json").read_text())
    n_layers = int(cfg.get("layers") or 0)
    chosen = list(layers) if layers else sorted({n_layers // 2, n_layers})
    if any(not 0 <= x <= n_layers for x in chosen):
        raise ConfigError(f"readout layers must be in [0, {n_layers}], got {chosen}")
    names = list(examples)
    texts = [t for name in names for t in examples[name]]
    means = _hidden_means(model_dir, texts, chosen)  # [texts, layers, hidden]
    overall = means.mean(axis=0)
    directions = []
    start = 0
    for name in names:
        k = len(examples[name])
        d = means[start : start + k].mean(axis=0) - overall  # [layers, hidden]
        start += k
        norm = np.linalg.norm(d, axis=-1, keepdims=True)
        directions.append(d / np.where(norm > 0, norm, 1.0))
    dirs = np.stack(directions, axis=1)  # [layers, concepts, hidden]
    blob = json.dumps(dict(examples), sort_keys=True).encode()
    return {
        "concepts": names,
        "layers": chosen,
        "hidden_size": int(dirs.shape[-1]),
        "directions": [[[float(x) for x in row] for row in layer] for layer in dirs],
        "method": "difference of mean hidden states (concept minus all examples), unit length",
        "examples_sha256": hashlib.sha256(blob).hexdigest(),
        "examples_per_concept": {name: len(examples[name]) for name in names},
    }


def write_concepts(
    model_dir: Path, examples: Mapping[str, Sequence[str]], layers: Sequence[int] | None = None
) -> Path:
    doc = derive_concepts(model_dir, examples, layers)
    path = model_dir / "readout_concepts.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc) + "\n")
    tmp.replace(path)
    return path


def load_examples(path: Path) -> dict[str, list[str]]:
    """``{"concept": ["text", ...], ...}`` from a JSON file, checked."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read readout examples {path}: {exc}") from exc
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, list) and all(isinstance(t, str) for t in v)
        for k, v in data.items()
    ):
        raise ConfigError(f"{path}: readout examples must map concept names to lists of texts")
    return {k: list(v) for k, v in data.items()}
