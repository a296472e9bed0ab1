"""The tokenizer of a session the ONNX engine served, found without opening a model.

A session's ``session.opened`` records the sha256 of the imported model's
``tokenizer.json`` (``tokenizer_sha256``); the model cache holds the imported folders,
each with its ``config.json`` naming that sha256. The terminal commands (``sessions
show``, ``replay``, ``audit``) decode the session's tokens with the tokenizer whose
sha256 is the recorded one, and only with it: a tokenizer that merely has the same
model name could render other text. The built-in demo models are byte-level.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sessiontape.engines.byte_tokenizer import ByteTokenizer
from sessiontape.engines.onnx.demo import cache_root
from sessiontape.engines.onnx.model import HFTokenizer, Tokenizer

#: the model ids of the built-in demo models (byte-level tokenizers)
DEMO_PREFIX = "sessiontape-demo-"


def recorded_tokenizer(binding: Mapping[str, Any], root: Path | None = None) -> Tokenizer | None:
    """The tokenizer ``binding`` (a ``session.opened`` engine entry) was served with, from
    the model cache under ``root`` (``$SESSIONTAPE_CACHE/models``); None when no
    imported folder there holds it."""
    sha = binding.get("tokenizer_sha256")
    if not isinstance(sha, str) or not sha:
        if str(binding.get("model_id", "")).startswith(DEMO_PREFIX):
            return ByteTokenizer(int(binding.get("vocab_size") or 259))
        return None
    for config in sorted(((root or cache_root()) / "imported").glob("*/config.json")):
        path = config.parent / "tokenizer.json"
        try:
            if json.loads(config.read_text()).get("tokenizer_sha256") != sha:
                continue
            if hashlib.sha256(path.read_bytes()).hexdigest() != sha:
                continue
        except (OSError, ValueError):
            continue
        return HFTokenizer(path)
    return None
