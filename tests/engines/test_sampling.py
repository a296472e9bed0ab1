"""The sampler every engine shares (engines/sampling.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiontape.core.engine.interface import SamplingParams
from sessiontape.core.errors import InvalidParameters
from sessiontape.engines.sampling import (
    PREFIX_MIN_VOCAB,
    _draw,
    _draw_sorted,
    log_softmax,
    penalized,
    sample,
)

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
    min_p=st.sampled_from([0.0, 0.0, 0.001, 0.05, 0.3, 1.0]),
    seed=st.integers(0, 2**32),
)
def test_a_large_vocabulary_draws_what_the_full_sort_draws(
    vocab: int,
    spread: float,
    ties: bool,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    seed: int,
) -> None:
    """The prefix draw (large vocabularies) picks the token the full sort picks, ties at
    every prefix boundary included (rounded scores), with and without min_p, for ten
    positions each."""
    x = (np.random.default_rng(seed).standard_normal(vocab) * spread).astype(np.float32)
    if ties:
        x = np.round(x)
    logp = log_softmax(x)
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed
    )
    scaled = x.astype(np.float64) / temperature
    for position in range(10):
        assert _draw(scaled, logp, params, position) == _draw_sorted(scaled, logp, params, position)


# -- penalties and min_p ------------------------------------------------------------------


def _penalty(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, **kw)  # type: ignore[arg-type]


def test_the_repetition_penalty_divides_positive_scores_and_multiplies_the_others() -> None:
    x = np.array([2.0, -2.0, 0.0, 4.0, 1.0], dtype=np.float32)
    out = penalized(x, _penalty(repetition_penalty=2.0), [0, 1, 2, 0, 0], 0)
    # tokens 0, 1, 2 were seen (once or three times: the same); 3 and 4 were not
    assert out.tolist() == [1.0, -4.0, 0.0, 4.0, 1.0]
    assert x.tolist() == [2.0, -2.0, 0.0, 4.0, 1.0]  # the model's scores are left as they were


def test_frequency_and_presence_penalties_are_openais() -> None:
    x = np.zeros(4, dtype=np.float32)
    params = _penalty(frequency_penalty=0.5, presence_penalty=0.25)
    out = penalized(x, params, [1, 1, 1, 2], 0)
    assert out.tolist() == [0.0, -(3 * 0.5 + 0.25), -(1 * 0.5 + 0.25), 0.0]
    # negative penalties favour what was said
    assert penalized(x, _penalty(presence_penalty=-1.0), [3], 0).tolist() == [0, 0, 0, 1.0]


def test_the_penalties_read_the_last_penalty_last_n_generated_tokens_sparing_stops() -> None:
    x = np.ones(6, dtype=np.float32)
    history = [5, 1, 2, 3, 4]  # the prompt is [5]: the generation produced 1, 2, 3, 4
    last2 = penalized(x, _penalty(presence_penalty=1.0, penalty_last_n=2), history, 1)
    assert last2.tolist() == [1, 1, 1, 0, 0, 1]
    every = penalized(x, _penalty(presence_penalty=1.0, penalty_last_n=-1), history, 1)
    assert every.tolist() == [1, 0, 0, 0, 0, 1]
    # the prompt is never penalized, however far back the window reaches
    assert penalized(x, _penalty(presence_penalty=1.0, penalty_last_n=64), history, 1)[5] == 1
    assert penalized(x, _penalty(presence_penalty=1.0, penalty_last_n=0), history, 1) is x
    assert penalized(x, _penalty(presence_penalty=1.0), history, 5) is x  # nothing generated
    spared = _penalty(presence_penalty=1.0, penalty_last_n=-1, stop_token_ids=(3,))
    assert penalized(x, spared, history, 1).tolist() == [1, 0, 0, 1, 0, 1]


def test_a_penalty_changes_the_choice_and_not_the_reported_logprob() -> None:
    x = np.array([3.0, 2.9, -1.0], dtype=np.float32)
    plain = sample(x, _penalty(), 5, [2, 0, 0], 1)
    assert plain[0] == 0
    tok, lp = sample(x, _penalty(repetition_penalty=1.1), 5, [2, 0, 0], 1)
    assert tok == 1
    assert lp == float(log_softmax(x)[1])  # the model's own log-probability
    # a prompt of 0s, nothing generated yet: nothing is penalized
    assert sample(x, _penalty(repetition_penalty=1.1), 3, [0, 0, 0], 3)[0] == 0
    assert sample(x, _penalty(repetition_penalty=1.1), 3, [0, 0, 0])[0] == 0


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    min_p=st.floats(min_value=0.0, max_value=1.0),
    seed=st.integers(0, 2**32),
    vocab=st.sampled_from([50, PREFIX_MIN_VOCAB]),
)
def test_min_p_draws_only_tokens_as_probable_as_min_p_times_the_best(
    min_p: float, seed: int, vocab: int
) -> None:
    x = (np.random.default_rng(seed).standard_normal(vocab) * 3).astype(np.float32)
    params = SamplingParams(max_tokens=1, temperature=0.8, min_p=min_p, seed=seed)
    p = np.exp(log_softmax(x.astype(np.float64) / 0.8))
    for position in range(5):
        tok, _ = sample(x, params, position)
        assert p[tok] >= min_p * p.max() * (1 - 1e-12)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.nan),
        ("repetition_penalty", math.inf),
        ("frequency_penalty", 2.001),
        ("frequency_penalty", math.nan),
        ("presence_penalty", -3.0),
        ("min_p", 1.01),
        ("min_p", -0.01),
        ("min_p", math.nan),
        ("penalty_last_n", -2),
        ("penalty_last_n", 1.5),
    ],
)
def test_out_of_range_penalties_are_invalid_parameters(field: str, value: float) -> None:
    with pytest.raises(InvalidParameters, match=field):
        SamplingParams(**{field: value}).check()  # type: ignore[arg-type]


def test_the_recorded_form_holds_the_penalties_where_they_act() -> None:
    plain = SamplingParams(max_tokens=3, seed=1)
    assert set(plain.to_json()) == {
        "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids"
    }  # fmt: skip
    assert SamplingParams.from_json(plain.to_json()) == plain
    used = SamplingParams(
        max_tokens=3, seed=1, repetition_penalty=1.3, presence_penalty=-0.5, min_p=0.1,
        penalty_last_n=-1,
    )  # fmt: skip
    assert SamplingParams.from_json(used.to_json()) == used
