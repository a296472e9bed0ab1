"""Seeded sampling shared by every engine.

The random draw for the token at absolute position ``p`` depends only on
``(seed, p)``, never on how many draws came before, so the same history,
seed and parameters give the same tokens however the history was built up
(Kakeya INV-3), and a fork continues exactly as the parent would have.

The steps, in order (docs/models.md, Penalties against loops): the penalties, over
the last ``penalty_last_n`` tokens this generation produced (the prompt is not
penalized: a question's own words are what a short answer repeats); then
temperature, top-k, top-p and min-p, as transformers and llama.cpp order them. The log-probability reported for a
token is always the model's own, before any of them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from sessiontape.core.engine.interface import SamplingParams

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


def penalized(logits: F32, params: SamplingParams, history: Sequence[int], start: int = 0) -> F32:
    """``logits`` with the penalties applied (``logits`` itself when none acts).

    Every token among the last ``penalty_last_n`` of ``history[start:]`` (the tokens
    the generation produced; all of them for -1), except the generation's stop tokens:
    a positive score divided by ``repetition_penalty``, any other multiplied by it
    (llama.cpp, transformers); then ``count * frequency_penalty + presence_penalty``
    subtracted (OpenAI's definition). In float32, as numpy does it on every machine."""
    if not params.penalized or len(history) <= start:
        return logits
    last = params.penalty_last_n
    window = history[start:] if last < 0 else history[max(start, len(history) - last) :]
    ids, counts = np.unique(np.asarray(window, np.int64), return_counts=True)
    keep = (ids < logits.shape[0]) & ~np.isin(ids, np.asarray(params.stop_token_ids, np.int64))
    ids, counts = ids[keep], counts[keep]
    out = logits.astype(np.float32)  # a copy
    x = out[ids]
    if params.repetition_penalty != 1.0:
        rp = np.float32(params.repetition_penalty)
        x = np.where(x > 0, x / rp, x * rp)
    if params.frequency_penalty or params.presence_penalty:
        x = x - (
            counts.astype(np.float32) * np.float32(params.frequency_penalty)
            + np.float32(params.presence_penalty)
        )
    out[ids] = x
    return out


def sample(
    logits: F32,
    params: SamplingParams,
    position: int,
    history: Sequence[int] = (),
    start: int | None = None,
) -> tuple[int, float]:
    """Pick the token at ``position`` after ``history`` (the whole history before it),
    whose tokens from ``start`` on are the ones this generation produced (the penalties
    read those; ``None``: none); returns (token, its log-probability under the model)."""
    logp = log_softmax(logits)
    scores = logits if start is None else penalized(logits, params, history, start)
    if params.temperature == 0:
        tok = int(np.argmax(logp if scores is logits else log_softmax(scores)))
        return tok, float(logp[tok])
    logits = scores
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


#: vocabularies from this size on draw from a sorted prefix (:func:`_draw_prefix`)
PREFIX_MIN_VOCAB = 2048
#: the first prefix :func:`_draw_prefix` sorts; it grows fourfold until the draw lies in it
FIRST_PREFIX = 64


def _draw(scaled: F64, logp: F64, params: SamplingParams, position: int) -> tuple[int, float]:
    """The seeded draw among the top-k / top-p candidates of ``scaled`` (logits / temperature).

    The candidates in order of score (the lowest id first among equal ones); the draw
    takes the first whose cumulative probability passes ``u`` (the seeded uniform) of the
    whole. A large vocabulary with finite scores sorts only the prefix the draw needs
    (:func:`_draw_prefix`), the same draw."""
    if scaled.shape[0] >= PREFIX_MIN_VOCAB and np.isfinite(scaled).all():
        return _draw_prefix(scaled, logp, params, position)
    return _draw_sorted(scaled, logp, params, position)


def _draw_sorted(
    scaled: F64, logp: F64, params: SamplingParams, position: int
) -> tuple[int, float]:
    """:func:`_draw` as its definition says: every candidate sorted."""
    order = np.lexsort((np.arange(scaled.shape[0]), -scaled))
    if params.top_k > 0:
        order = order[: params.top_k]
    if params.top_p >= 1.0:
        order = order[: _min_p_count(scaled, params)]
    z = scaled[order]
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        cum = np.cumsum(p)
        keep = min(int(np.searchsorted(cum, params.top_p) + 1), _min_p_count(scaled, params))
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    u = uniform(params.seed, position)
    cum = np.cumsum(p)
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    tok = int(order[min(i, len(order) - 1)])
    return tok, float(logp[tok])


def _min_p_count(scaled: F64, params: SamplingParams) -> int:
    """How many candidates ``min_p`` keeps: those at least ``min_p`` times as probable
    as the most probable one (the same count whatever the other filters kept, as they
    all keep the most probable one); the count of all without ``min_p``."""
    n = int(scaled.shape[0])
    if params.min_p <= 0 or np.isnan(scaled).any():
        return n
    top = float(scaled.max())
    if not math.isfinite(top):
        return n
    return max(1, int(np.count_nonzero(scaled - top >= math.log(params.min_p))))


def _first(scaled: F64, m: int) -> npt.NDArray[np.intp]:
    """The ``m`` first ids of ``scaled`` in the draw's order (highest score first, the
    lowest id first among equal ones), in that order: what a full sort's first ``m``
    are, from a partition (the ties at the boundary settled by id)."""
    n = scaled.shape[0]
    neg = -scaled
    if m >= n:
        return np.lexsort((np.arange(n), neg))
    part = np.argpartition(neg, m - 1)[:m]
    kth = neg[part].max()
    strict = np.flatnonzero(neg < kth)
    ties = np.flatnonzero(neg == kth)[: m - strict.shape[0]]
    idx = np.concatenate([strict, ties])
    return idx[np.lexsort((idx, neg[idx]))]


def _draw_prefix(
    scaled: F64, logp: F64, params: SamplingParams, position: int
) -> tuple[int, float]:
    """:func:`_draw` for a large vocabulary of finite scores: each candidate's probability
    is its weight over the candidates' total (the same arithmetic as the full sort's,
    the total summed in id order where every id is a candidate), and only a prefix of
    the candidates is sorted, grown fourfold until it holds the ``top_p`` cut and the
    draw. Sorting a 49,152-token vocabulary in full costs about as long as the SmolLM2
    models' decode step; the prefix costs a fraction of a millisecond."""
    n = scaled.shape[0]
    limit = n if params.top_k <= 0 else min(params.top_k, n)
    kept = _min_p_count(scaled, params)
    if params.top_p >= 1.0:
        limit = min(limit, kept)
    top = float(scaled.max())
    if limit < n:
        candidates = _first(scaled, limit)
        total = float(np.exp(scaled[candidates] - top).sum())
    else:
        candidates = None
        total = float(np.exp(scaled - top).sum())
    u = uniform(params.seed, position)
    m = min(limit, FIRST_PREFIX)
    while True:
        order = _first(scaled, m) if candidates is None else candidates[:m]
        p = np.exp(scaled[order] - top) / total
        whole = m == limit
        if params.top_p < 1.0:
            cum = np.cumsum(p)
            keep = int(np.searchsorted(cum, params.top_p) + 1)
            if keep <= m or whole:
                keep = min(keep, kept)
                order, p = order[:keep], p[:keep] / p[:keep].sum()
                cum = np.cumsum(p)
                i = int(np.searchsorted(cum, u * cum[-1], side="right"))
                tok = int(order[min(i, len(order) - 1)])
                return tok, float(logp[tok])
        else:
            cum = np.cumsum(p)
            i = int(np.searchsorted(cum, u, side="right"))
            if i < m or whole:
                tok = int(order[min(i, len(order) - 1)])
                return tok, float(logp[tok])
        m = min(limit, 4 * m)
