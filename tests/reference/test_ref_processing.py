"""reference.processing: hand-worked examples of transformers' temperature -> top-k -> top-p, and errors."""

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reference.processing import greedy, process_logits


def probs_to_logits(probs):
    return np.log(np.asarray(probs, dtype=np.float64))


def test_temperature_divides_logits():
    logits = np.log([1.0, 2.0, 4.0])
    np.testing.assert_allclose(process_logits(logits), [1 / 7, 2 / 7, 4 / 7])
    # T = 2 takes square roots of the weights: 1, sqrt 2, 2.
    np.testing.assert_allclose(
        process_logits(logits, temperature=2.0), np.array([1, math.sqrt(2), 2]) / (3 + math.sqrt(2))
    )


def test_top_k_keeps_every_token_tied_with_the_kth_value():
    logits = np.array([3.0, 1.0, 1.0, 0.0])
    probs = process_logits(logits, top_k=2)  # 2nd largest is 1.0, held by two tokens: 3 survive
    weights = np.exp([3.0, 1.0, 1.0])
    np.testing.assert_allclose(probs, np.append(weights / weights.sum(), 0.0))


@pytest.mark.parametrize("top_k", [0, None, 4, 10])
def test_top_k_disabled_or_at_least_vocab_keeps_everything(top_k):
    logits = np.array([0.5, -1.0, 2.0, 0.0])
    np.testing.assert_allclose(process_logits(logits, top_k=top_k), process_logits(logits))


def test_top_p_removes_tokens_whose_ascending_cumulative_mass_is_small():
    logits = probs_to_logits([0.5, 0.3, 0.15, 0.05])
    # ascending cumulative: 0.05, 0.20, 0.50, 1.0; top_p = 0.75 removes those <= 0.25.
    np.testing.assert_allclose(process_logits(logits, top_p=0.75), [0.625, 0.375, 0.0, 0.0])
    # top_p = 0.94 removes only the 0.05 token (0.05 <= 0.06); top_p = 0.96 removes nothing (0.05 > 0.04).
    np.testing.assert_allclose(process_logits(logits, top_p=0.94), np.array([0.5, 0.3, 0.15, 0.0]) / 0.95)
    np.testing.assert_allclose(process_logits(logits, top_p=0.96), [0.5, 0.3, 0.15, 0.05])


def test_top_p_tie_at_the_boundary_removes_the_lower_index_first():
    # Ascending stable sort puts token 0 first; its cumulative 0.5 <= 1 - 0.5 removes it.
    np.testing.assert_array_equal(process_logits(np.zeros(2), top_p=0.5), [0.0, 1.0])


def test_top_p_tiny_keeps_the_most_likely_token():
    logits = probs_to_logits([0.2, 0.5, 0.3])
    np.testing.assert_array_equal(process_logits(logits, top_p=1e-9), [0.0, 1.0, 0.0])


def test_top_p_one_disables():
    logits = probs_to_logits([0.97, 0.02, 0.01])
    np.testing.assert_allclose(process_logits(logits, top_p=1.0), [0.97, 0.02, 0.01])


def test_top_k_applies_before_top_p():
    logits = probs_to_logits([0.4, 0.35, 0.25])
    # top-k=2 renormalizes to (0.533, 0.467); top-p=0.5 then removes 0.467 <= 0.5: one token left.
    # (top-p first would keep {0, 1} and top-k=2 would keep both.)
    np.testing.assert_allclose(process_logits(logits, top_k=2, top_p=0.5), [1.0, 0.0, 0.0])


def test_temperature_applies_before_top_p():
    logits = probs_to_logits([0.6, 0.3, 0.1])
    np.testing.assert_allclose(process_logits(logits, top_p=0.65), [2 / 3, 1 / 3, 0.0])
    # T = 0.5 squares the weights: (0.36, 0.09, 0.01) / 0.46, cumulative 0.022, 0.217 <= 0.35.
    np.testing.assert_allclose(process_logits(logits, temperature=0.5, top_p=0.65), [1.0, 0.0, 0.0])


def test_minus_inf_logits_get_zero_probability():
    probs = process_logits(np.array([-np.inf, 0.0, -np.inf, 0.0]), top_p=0.9)
    np.testing.assert_array_equal(probs, [0.0, 0.5, 0.0, 0.5])


def test_greedy_takes_first_index_on_ties():
    assert greedy(np.array([1.0, 3.0, 3.0, -np.inf])) == 1
    assert greedy(np.array([-np.inf, -np.inf, 0.0])) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_invalid_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        process_logits(np.zeros(3), **kwargs)


@pytest.mark.parametrize(
    "logits, message",
    [
        ([0.0, float("nan")], "NaN"),
        ([0.0, np.inf], r"\+inf"),
        ([-np.inf, -np.inf], "all -inf"),
        ([], "non-empty"),
        ([[0.0, 1.0]], "1-D"),
    ],
)
def test_invalid_logits_raise(logits, message):
    with pytest.raises(ValueError, match=message):
        process_logits(np.array(logits, dtype=np.float64))
    with pytest.raises(ValueError, match=message):
        greedy(np.array(logits, dtype=np.float64))


logit_arrays = st.lists(st.one_of(st.floats(-30, 30), st.just(-np.inf)), min_size=1, max_size=8).filter(
    lambda xs: any(np.isfinite(xs))
)
temperatures = st.floats(0.05, 5.0)
top_ps = st.floats(1e-6, 1.0)


def support(probs):
    return set(np.flatnonzero(probs > 0).tolist())


@settings(max_examples=150, deadline=None)
@given(logit_arrays, temperatures, st.integers(0, 9), top_ps)
@example([30.0, 29.999999999999996], 0.875, 0, 0.5)  # a tie only under the temperature, found by hypothesis
def test_output_is_a_distribution_keeping_a_most_likely_token(logits, temperature, top_k, top_p):
    logits = np.array(logits)
    probs = process_logits(logits, temperature, top_k, top_p)
    assert (probs >= 0).all() and math.isclose(probs.sum(), 1.0, rel_tol=1e-12)
    # Not necessarily greedy()'s index: on a tie top-p drops the lower index first. Most likely under the
    # temperature: logits a few ulps apart (30.0 and 29.999999999999996) tie exactly once divided by 0.875.
    scaled = logits / temperature
    assert scaled[probs > 0].max() == scaled.max()


@settings(max_examples=150, deadline=None)
@given(logit_arrays, temperatures, st.integers(1, 9), st.integers(1, 9), top_ps)
def test_support_shrinks_with_smaller_top_k(logits, temperature, k1, k2, top_p):
    small, large = min(k1, k2), max(k1, k2)
    logits = np.array(logits)
    assert support(process_logits(logits, temperature, small, top_p)) <= support(
        process_logits(logits, temperature, large, top_p)
    )
    assert support(process_logits(logits, temperature, large, top_p)) <= support(
        process_logits(logits, temperature, 0, top_p)
    )


@settings(max_examples=150, deadline=None)
@given(logit_arrays, temperatures, st.integers(0, 9), top_ps, top_ps)
def test_support_shrinks_with_smaller_top_p(logits, temperature, top_k, p1, p2):
    logits = np.array(logits)
    assert support(process_logits(logits, temperature, top_k, min(p1, p2))) <= support(
        process_logits(logits, temperature, top_k, max(p1, p2))
    )


@settings(max_examples=150, deadline=None)
@given(logit_arrays, temperatures, st.integers(0, 9), top_ps)
def test_survivors_keep_their_relative_weights(logits, temperature, top_k, top_p):
    logits = np.array(logits)
    probs = process_logits(logits, temperature, top_k, top_p)
    kept = probs > 0
    expected = np.exp((logits[kept] - logits[kept].max()) / temperature)
    np.testing.assert_allclose(probs[kept], expected / expected.sum(), rtol=1e-9)
