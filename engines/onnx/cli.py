"""``sessiontape model ...``: build the demo model, import real models, derive readout concepts.

sessiontape model build-demo [--size tiny|small] [--out DIR]
sessiontape model import SOURCE --out DIR [--dtype auto|float32|float16|q8|q4]
sessiontape model readouts MODEL_DIR [--examples FILE] [--layers 15,30]
sessiontape model list
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from sessiontape.engines.onnx.demo import SIZES, build_demo, cache_root


def register(subparsers: Any) -> None:
    model = subparsers.add_parser("model", help="build, import and inspect models")
    sub = model.add_subparsers(dest="model_command", required=True)
    build = sub.add_parser("build-demo", help="build the deterministic demo model")
    build.add_argument(
        "--size", choices=sorted(SIZES), default="tiny", help="model size (default: tiny)"
    )
    build.add_argument(
        "--out", type=Path, default=None, help="target folder (default: the engine's model cache)"
    )
    build.set_defaults(func=build_demo_cmd)
    imp = sub.add_parser(
        "import", help="import a GGUF file or a Hugging Face folder into a served model folder"
    )
    imp.add_argument("source", help="a .gguf file, a Hugging Face folder, or a registry name")
    imp.add_argument("--out", type=Path, required=True, help="the model folder to write")
    imp.add_argument(
        "--dtype",
        choices=("auto", "float32", "float16", "q8", "q4"),
        default="auto",
        help="weights: auto (GGUF blocks as they are; HF float32), float32, float16 (the graph "
        "computes in float16: for CUDA), q8 or q4",
    )
    imp.add_argument(
        "--attention",
        choices=("gqa", "masked"),
        default="gqa",
        help="gqa: one fused attention kernel per layer (fastest alone); masked: separate "
        "operators, for continuous batching (default gqa)",
    )
    imp.set_defaults(func=import_cmd)
    ro = sub.add_parser(
        "readouts", help="derive Salience readout concepts from labelled example texts"
    )
    ro.add_argument("model_dir", type=Path, help="an imported model folder")
    ro.add_argument(
        "--examples", type=Path, default=None, help='JSON {"concept": ["text", ...], ...}'
    )
    ro.add_argument("--layers", default=None, help="comma-separated layer numbers")
    ro.set_defaults(func=readouts_cmd)
    ls = sub.add_parser("list", help="models that installed packages carry")
    ls.set_defaults(func=list_cmd)


def build_demo_cmd(args: argparse.Namespace) -> int:
    from sessiontape.engines.onnx.demo import BUILDER_VERSION

    out = args.out or cache_root() / f"{args.size}-v{BUILDER_VERSION}"
    t0 = time.perf_counter()
    path = build_demo(args.size, out)
    spec = SIZES[args.size]
    print(
        f"built {args.size} demo model ({spec.params():,} parameters) at {path} "
        f"in {time.perf_counter() - t0:.2f}s"
    )
    return 0


def import_cmd(args: argparse.Namespace) -> int:
    from sessiontape.engines.models.registry import REGISTRY, resolve
    from sessiontape.engines.onnx.importer import import_model

    name = args.source if args.source in REGISTRY else None
    done = import_model(
        resolve(args.source), args.out, args.dtype, name=name, attention=args.attention
    )
    cfg = json.loads((done.folder / "config.json").read_text())
    size = sum(p.stat().st_size for p in done.folder.iterdir())
    print(
        f"imported {cfg['model_id']} ({cfg['layers']} layers, vocab {cfg['vocab_size']}, "
        f"{args.dtype}) into {done.folder} ({size / 2**20:.0f} MiB) in {done.seconds:.1f}s"
    )
    return 0


def readouts_cmd(args: argparse.Namespace) -> int:
    from sessiontape.core.errors import ConfigError
    from sessiontape.engines.models.readouts import (
        DEFAULT_EXAMPLES,
        load_examples,
        write_concepts,
    )

    examples = load_examples(args.examples) if args.examples else DEFAULT_EXAMPLES
    layers = None
    if args.layers:
        try:
            layers = [int(x) for x in args.layers.split(",")]
        except ValueError as exc:
            raise ConfigError(f"--layers must be comma-separated integers: {exc}") from exc
    path = write_concepts(args.model_dir, examples, layers)
    print(f"wrote {len(examples)} concepts to {path}")
    return 0


def list_cmd(args: argparse.Namespace) -> int:
    from sessiontape.engines.models.registry import REGISTRY, installed

    for name, entry in REGISTRY.items():
        state = "installed" if installed(name) else f"not installed ({entry.distribution})"
        print(f"{name:28} {state:12} {entry.description}")
    return 0
