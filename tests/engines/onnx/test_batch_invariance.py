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

from sessiontape.engines.onnx.decoder import KV_SLOTS
from sessiontape.engines.onnx.model import GraphSpec, infer_graph
from sessiontape.engines.onnx.runner import choose_providers, open_session
from sessiontape.engines.onnx.static import attended_slots

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


def _grown_passes(
    sess: Any, spec: GraphSpec, tokens: list[int], cuts: list[int], slots: list[int | None]
) -> tuple[np.ndarray, list[np.ndarray]]:
    """``tokens`` in one session's passes ending at ``cuts``, in a 256-slot buffer, each pass
    attending over ``slots[j]`` slots (None: ``kv_slots`` not fed, the whole buffer)."""
    cap = 256
    names = _names(spec)
    bufs = [np.zeros((1, spec.kv_heads, cap, spec.head_dim), np.float32) for _ in names]
    logits, start = [], 0
    for end, n in zip(cuts, slots, strict=True):
        feeds: dict[str, Any] = {
            "input_ids": np.array([tokens[start:end]], np.int64),
            "position_ids": np.arange(start, end, dtype=np.int64)[None, :],
            "attention_mask": np.ones((1, cap), np.int64),
            **dict(zip(names, bufs, strict=True)),
        }
        if n is not None:
            feeds[KV_SLOTS] = np.array([n], np.int64)
        out = sess.run(["logits", *(k.replace("past_key_values", "present") for k in names)], feeds)
        logits.append(out[0][0])
        bufs = list(out[1:])
        start = end
    return np.concatenate(logits), bufs


def test_a_pass_over_its_filled_slots_computes_the_whole_buffers_bits(tiny_dir: Path) -> None:
    """``kv_slots``: a masked graph's pass attends over the buffer's first slots up to its
    last position (rounded up to SLOT_BLOCK, as the runners feed it), and a row's bits
    are those it gets attending over the whole buffer."""
    sess = open_session(str(tiny_dir / "model.onnx"), choose_providers("auto"), 1, 0)
    spec = infer_graph(sess.get_inputs(), sess.get_outputs())
    assert KV_SLOTS in {i.name for i in sess.get_overridable_initializers()}
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, 256, 150)]
    cuts = [100, 101, 150]
    whole, whole_kv = _grown_passes(sess, spec, tokens, cuts, [None, None, None])
    fed = [attended_slots(c, 256) for c in cuts]
    assert fed == [128, 128, 192]
    for slots in (fed, [256, 192, 256], [128, 256, 192]):
        logits, kv = _grown_passes(sess, spec, tokens, cuts, slots)
        assert np.array_equal(logits, whole), slots
        assert all(np.array_equal(a, b) for a, b in zip(kv, whole_kv, strict=True))
    # fewer slots than the positions need: the input is read (rows past slot 64 lose keys)
    short, _ = _grown_passes(sess, spec, tokens, cuts, [64, 128, 192])
    assert np.array_equal(short[:64], whole[:64]) and not np.array_equal(short[64:], whole[64:])
