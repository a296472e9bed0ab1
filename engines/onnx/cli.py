"""``sessiontape model build-demo [--size tiny|small] [--out DIR]``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from sessiontape.engines.onnx.demo import SIZES, build_demo, cache_root


def register(subparsers: Any) -> None:
    model = subparsers.add_parser("model", help="manage the ONNX demo model")
    sub = model.add_subparsers(dest="model_command", required=True)
    build = sub.add_parser("build-demo", help="build the deterministic demo model")
    build.add_argument(
        "--size", choices=sorted(SIZES), default="tiny", help="model size (default: tiny)"
    )
    build.add_argument(
        "--out", type=Path, default=None, help="target folder (default: the engine's model cache)"
    )
    build.set_defaults(func=build_demo_cmd)


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
