"""The static pass is batch-invariant: the ground continuous batching stands on.

The static demo graph takes a batch dimension: ``input_ids``/``position_ids``
``[B, rows]`` and one buffer ``[B, kv_heads, capacity, head_dim]`` per layer and
kind, each batch element a session with its own positions. With one fixed shape
(B, rows, capacity), a session's logits and KV must not depend on which batch
element it sits in or on what its neighbours hold. Runs on the provider the
engine picks (CUDA where it loads), through plain ONNX Runtime.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sessiontape.engines.onnx.model import GraphSpec, infer_graph
from sessiontape.engines.onnx.runner import choose_providers, open_session

B, ROWS, CAP = 4, 8, 128


def _names(spec: GraphSpec) -> list[str]:
    return [f"past_key_values.{i}.{k}" for i in range(spec.layers) for k in ("key", "value")]


def _pass(
    sess: Any, spec: GraphSpec, ids: np.ndarray, pos: np.ndarray, bufs: list[np.ndarray]
) -> tuple[Any, list[Any]]:
    names = _names(spec)
    feeds: dict[str, Any] = {
        "input_ids": ids,
        "position_ids": pos,
        "attention_mask": np.ones((ids.shape[0], CAP), np.int64),
    }
    feeds.update(zip(names, bufs, strict=True))
    out = sess.run(["logits", *(n.replace("past_key_values", "present") for n in names)], feeds)
    return out[0], list(out[1:])


def _session(
    sess: Any, spec: GraphSpec, tokens: list[int], slot: int, neighbours: np.random.Generator | None
) -> Any:
    """Run ``tokens`` in passes of ROWS at batch element ``slot``; the other elements hold random
    sessions (``neighbours``) or padding. Returns this session's logits per position."""
    bufs = [np.zeros((B, spec.kv_heads, CAP, spec.head_dim), np.float32) for _ in _names(spec)]
    logits = []
    for start in range(0, len(tokens), ROWS):
        chunk = tokens[start : start + ROWS]
        ids = np.zeros((B, ROWS), np.int64)
        pos = np.full((B, ROWS), CAP - 1, np.int64)
        if neighbours is not None:
            ids[:] = neighbours.integers(0, 256, (B, ROWS))
            pos[:] = start + np.arange(ROWS)[None, :]
        ids[slot, : len(chunk)] = chunk
        ids[slot, len(chunk) :] = 0
        pos[slot] = np.minimum(start + np.arange(ROWS), CAP - 1)
        out, bufs = _pass(sess, spec, ids, pos, bufs)
        logits.append(out[slot, : len(chunk)])
    return np.concatenate(logits)


def test_a_sessions_bits_do_not_depend_on_its_batch_neighbours(tiny_dir: Path) -> None:
    sess = open_session(str(tiny_dir / "model.onnx"), choose_providers("auto"), 1, 0)
    spec = infer_graph(sess.get_inputs(), sess.get_outputs())
    assert spec.static
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, 256, 29)]
    alone = _session(sess, spec, tokens, 0, None)
    assert np.array_equal(_session(sess, spec, tokens, 0, np.random.default_rng(1)), alone)
    assert np.array_equal(_session(sess, spec, tokens, 2, np.random.default_rng(2)), alone)
    assert np.array_equal(_session(sess, spec, tokens, 3, None), alone)
