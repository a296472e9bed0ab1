"""Seeded sampling shared by every engine.

The random draw for the token at absolute position ``p`` depends only on
``(seed, p)``, never on how many draws came before, so the same history,
seed and parameters give the same tokens however the history was built up
(Kakeya INV-3), and a fork continues exactly as the parent would have.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

from sessiontape.core.engine import SamplingParams

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]


def log_softmax(logits: F32) -> F64:
    x = logits.astype(np.float64)
    m = np.max(x)
    out: F64 = x - m - np.log(np.sum(np.exp(x - m)))
    return out


def uniform(seed: int | None, position: int) -> float:
    """A uniform draw in [0, 1) from (seed, position)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def top_logprobs(logp: F64, k: int) -> tuple[tuple[int, float], ...]:
    if k <= 0:
        return ()
    k = min(k, logp.shape[0])
    idx = np.argpartition(-logp, k - 1)[:k]
    idx = idx[np.lexsort((idx, -logp[idx]))]
    return tuple((int(i), float(logp[i])) for i in idx)


#: temperatures by which dividing float32 scores, as float64, keeps their order and
#: ties: their largest magnitude (3.4e38) stays finite and their smallest nonzero one
#: (1.4e-45) stays normal, and float64's 53 bits hold float32's 24 with room to round
_ORDER_KEPT = (1e-250, 1e250)


def sample(logits: F32, params: SamplingParams, position: int) -> tuple[int, float]:
    """Pick the token at ``position``; returns (token, its log-probability under the model)."""
    logp = log_softmax(logits)
    if params.temperature == 0 or (params.seed is None and params.temperature == 0):
        tok = int(np.argmax(logp))
        return tok, float(logp[tok])
    if (
        params.top_k == 1
        and logits.dtype == np.float32
        and _ORDER_KEPT[0] <= params.temperature <= _ORDER_KEPT[1]
    ):
        # float32 scores divided (as float64) by such a temperature neither overflow
        # nor underflow and keep their order and their ties: the highest scaled score
        # is the highest logit, with no division to make
        tok = int(np.argmax(logits))
        if not np.isnan(logits[tok]):  # argmax stops at the first NaN
            return tok, float(logp[tok])
    scaled = logits.astype(np.float64) / params.temperature
    if params.top_k == 1 and not np.isnan(scaled).any():
        # One candidate: the highest score, the lowest id among equal ones, as
        # the ordering in _draw puts first; no draw can pick another (the way
        # Salience asks for greedy decoding, which has no temperature 0).
        tok = int(np.argmax(scaled))
        return tok, float(logp[tok])
    return _draw(scaled, logp, params, position)


def _draw(scaled: F64, logp: F64, params: SamplingParams, position: int) -> tuple[int, float]:
    """The seeded draw among the top-k / top-p candidates of ``scaled`` (logits / temperature)."""
    order = np.lexsort((np.arange(scaled.shape[0]), -scaled))
    if params.top_k > 0:
        order = order[: params.top_k]
    z = scaled[order]
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        cum = np.cumsum(p)
        keep = int(np.searchsorted(cum, params.top_p) + 1)
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    u = uniform(params.seed, position)
    cum = np.cumsum(p)
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    tok = int(order[min(i, len(order) - 1)])
    return tok, float(logp[tok])
