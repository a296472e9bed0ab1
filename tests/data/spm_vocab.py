"""A small SentencePiece-style (``llama`` tokenizer model) vocabulary, written as a GGUF.

Shared by tests/engines/models/test_tokenizer.py and record_tokenizer_reference.py (which
records transformers' ids for this very file), so it needs only the standard library and
``gguf``. The vocabulary is Llama 2's layout in miniature: ``<unk>``, ``<s>``, ``</s>``, the
256 ``<0xXX>`` byte tokens, merged pieces scored best first, then single characters; plus
one CONTROL token (``<|end|>``) and one USER_DEFINED token (``<tool>``).
"""

from __future__ import annotations

from pathlib import Path

import gguf

# Merged pieces, best first (scores -1, -2, ...). Every piece can be cut into two others.
PIECES = [
    "▁t", "he", "▁the", "▁h", "▁he", "ll", "lo", "llo", "▁hello",
    "▁w", "or", "▁wor", "ld", "▁world", "an", "▁a", "▁an", "nd", "▁and",
    "is", "▁is", "▁c", "at", "▁cat", "in", "▁in", "▁s", "▁sat", "er", "▁▁",
]  # fmt: skip
CHARS = list("▁abcdehilnorstw,.")
CONTROL_TOKEN = "<|end|>"
USER_TOKEN = "<tool>"

UNKNOWN, CONTROL, USER_DEFINED, BYTE, NORMAL = 2, 3, 4, 6, 1


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and llama.cpp token types (ids are list positions)."""
    tokens = ["<unk>", "<s>", "</s>"]
    scores = [0.0, 0.0, 0.0]
    types = [UNKNOWN, CONTROL, CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(BYTE)
    for rank, piece in enumerate(PIECES):
        tokens.append(piece)
        scores.append(-1.0 - rank)
        types.append(NORMAL)
    for rank, char in enumerate(CHARS):
        tokens.append(char)
        scores.append(-1000.0 - rank)
        types.append(NORMAL)
    for token, kind in ((CONTROL_TOKEN, CONTROL), (USER_TOKEN, USER_DEFINED)):
        tokens.append(token)
        scores.append(0.0)
        types.append(kind)
    return tokens, scores, types


def write_gguf(path: Path, *, add_space_prefix: bool = True) -> Path:
    """A GGUF holding only this vocabulary (and the few llama keys loaders insist on)."""
    tokens, scores, types = vocabulary()
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("synthetic-spm")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
