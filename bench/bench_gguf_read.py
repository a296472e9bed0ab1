"""Reading a GGUF file: the header, the tokenizer, the weights and a whole first import.

Run (about a minute for a 250 MB file on a 2-core machine)::

    .venv/bin/python bench/bench_gguf_read.py --model FILE [--no-baseline] [--no-import]

Steps, each timed once in this process (the file in the page cache after a first read,
which this script does before timing, as a server's second start finds it):

- ``header``: :class:`GgufFile` (metadata and tensor infos; no tensor data), against
  ``gguf.GGUFReader`` on the same file as the baseline (``--no-baseline`` skips it: it
  parses every field in Python and takes tens of seconds on a 262k-token vocabulary);
- ``check``: what refuses an unsupported file: header, architecture and tensor types
  (``open_source``), so this is the time to a refusal too;
- ``tokenizer``: the ``tokenizer.json`` rebuilt from the metadata;
- ``weights``: every tensor converted as ``--dtype auto`` imports it (blocks repacked for
  MatMulNBits, floats as float32), the graph not written;
- ``import``: ``import_model`` into a temporary folder, the whole first import (skipped with
  ``--no-import``, and reported as refused when the architecture is not served).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path


def timed(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a GGUF file")
    ap.add_argument("--no-baseline", action="store_true", help="skip gguf.GGUFReader")
    ap.add_argument("--no-import", action="store_true", help="skip the whole import")
    args = ap.parse_args()

    from sessiontape.core.errors import UnsupportedModel
    from sessiontape.engines.models import quant
    from sessiontape.engines.models.gguf_file import GgufFile
    from sessiontape.engines.models.sources import WeightPolicy, open_source
    from sessiontape.engines.models.tokenizer import tokenizer_from_gguf
    from sessiontape.engines.onnx.importer import import_model

    path: Path = args.model
    with path.open("rb") as f:  # into the page cache, for every contender alike
        while f.read(16 << 20):
            pass
    size = path.stat().st_size
    print(f"{path.name}: {size / 1e6:.1f} MB, {os.cpu_count()} CPUs")
    rows: list[tuple[str, float, str]] = []

    header, t_header = timed(GgufFile, path)
    kinds = Counter(t.type_name for t in header)
    vocab = len(header.meta.get("tokenizer.ggml.tokens") or [])
    print(f"tensors: {dict(kinds)}; vocabulary {vocab} tokens")
    rows.append(("header (sessiontape)", t_header, ""))
    if not args.no_baseline:
        import gguf

        _, t_base = timed(gguf.GGUFReader, str(path))
        rows.append(("header (gguf.GGUFReader)", t_base, f"{t_base / t_header:.0f}x sessiontape"))

    t0, refusal = time.perf_counter(), ""
    try:
        open_source(path, "auto")
    except UnsupportedModel as exc:
        refusal = f"refused: {exc}"
    t_check = time.perf_counter() - t0
    rows.append(("check (header, architecture, types)", t_check, refusal[:70]))

    _, t_tok = timed(tokenizer_from_gguf, header.meta)
    rows.append(("tokenizer", t_tok, ""))

    policy = WeightPolicy("auto")

    def convert() -> None:
        for t in header:
            raw = t.data
            if t.type_id in quant.FORMATS and raw.ndim == 2:
                floats = partial(quant.dequantize, raw, t.type_id)
                policy.matrix(raw, t.type_id, floats)
            else:
                quant.dequantize(raw, t.type_id)

    _, t_weights = timed(convert)
    rows.append(("weights (auto, graph not written)", t_weights, ""))

    if not args.no_import:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                _, t_import = timed(import_model, path, Path(tmp) / "out", "auto")
                rows.append(("import (auto, whole)", t_import, ""))
            except UnsupportedModel as exc:
                rows.append(("import (auto, whole)", float("nan"), f"refused: {exc}"[:70]))

    width = max(len(r[0]) for r in rows)
    for name, seconds, note in rows:
        print(f"{name:<{width}}  {seconds:8.2f} s  {note}")


if __name__ == "__main__":
    main()
