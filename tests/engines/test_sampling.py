"""The sampler every engine shares (engines/sampling.py)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiontape.core.engine.interface import SamplingParams
from sessiontape.engines.sampling import PREFIX_MIN_VOCAB, _draw, _draw_sorted, log_softmax, sample

#: scores with many ties and both infinities among them
_SCORE = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 3.5, math.inf, -math.inf]),
    st.floats(width=32, allow_nan=False),
)
#: temperatures across float64's range: those that overflow or underflow scaled scores
_TEMPERATURE = st.one_of(
    st.floats(min_value=1e-30, max_value=100.0),
    st.floats(min_value=5e-324, max_value=1e300),
    st.sampled_from([5e-324, 1e-251, 1e-250, 1e-249, 1e249, 1e250, 1e251]),
)


def _same(a: tuple[int, float], b: tuple[int, float]) -> bool:
    return a[0] == b[0] and (a[1] == b[1] or (math.isnan(a[1]) and math.isnan(b[1])))


@settings(max_examples=1000, derandomize=True, deadline=None)
@given(
    logits=st.lists(_SCORE, min_size=1, max_size=40),
    nan_at=st.integers(0, 400),  # a NaN among the scores in about one example in twenty
    temperature=_TEMPERATURE,
    top_p=st.floats(min_value=0.01, max_value=1.0),
    seed=st.none() | st.integers(0, 2**32),
    position=st.integers(0, 100_000),
)
def test_top_k_one_takes_what_the_seeded_draw_takes(
    logits: list[float],
    nan_at: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    position: int,
) -> None:
    """top_k=1 (how Salience asks for greedy decoding) skips the sort and the draw, and
    picks exactly the token and logprob the draw picks: the highest score, the lowest id
    among equal ones, overflowing temperatures and infinite scores included; with a NaN
    among the scores both go the draw's way."""
    if nan_at < len(logits):
        logits[nan_at] = math.nan
    x = np.array(logits, dtype=np.float32)
    params = SamplingParams(max_tokens=1, temperature=temperature, top_k=1, top_p=top_p, seed=seed)
    with np.errstate(all="ignore"):
        fast = sample(x, params, position)
        drawn = _draw(x.astype(np.float64) / temperature, log_softmax(x), params, position)
    assert _same(fast, drawn)


def test_top_k_one_equals_greedy_on_ordinary_scores() -> None:
    rng = np.random.default_rng(7)
    for position in range(200):
        x = rng.standard_normal(259).astype(np.float32)
        greedy = sample(x, SamplingParams(max_tokens=1, temperature=0.0), position)
        top1 = sample(x, SamplingParams(max_tokens=1, temperature=0.7, top_k=1, seed=3), position)
        assert top1 == greedy


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    vocab=st.sampled_from([PREFIX_MIN_VOCAB, 5_000, 49_152]),
    spread=st.sampled_from([0.3, 3.0, 12.0]),
    ties=st.booleans(),
    temperature=st.sampled_from([0.05, 0.2, 0.7, 1.0, 1.6]),
    top_p=st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.01]),
    top_k=st.sampled_from([0, 0, 1, 7, 64, 65, 3_000]),
    seed=st.integers(0, 2**32),
)
def test_a_large_vocabulary_draws_what_the_full_sort_draws(
    vocab: int, spread: float, ties: bool, temperature: float, top_p: float, top_k: int, seed: int
) -> None:
    """The prefix draw (large vocabularies) picks the token the full sort picks, ties at
    every prefix boundary included (rounded scores), for ten positions each."""
    x = (np.random.default_rng(seed).standard_normal(vocab) * spread).astype(np.float32)
    if ties:
        x = np.round(x)
    logp = log_softmax(x)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    scaled = x.astype(np.float64) / temperature
    for position in range(10):
        assert _draw(scaled, logp, params, position) == _draw_sorted(scaled, logp, params, position)
