"""reference.chisquare: pooling, refusing small samples, support violations and the failure message."""

import numpy as np
import pytest

from reference.chisquare import (
    FALSE_FAILURE_BUDGET,
    InvalidTestError,
    assert_same_distribution,
    assert_samples_match,
    chisquare_test,
    control_miss_probability,
    noncentrality_per_run,
    per_test_alpha,
)


def test_small_bins_are_pooled_into_one():
    probs = np.array([0.45, 0.45, 0.04, 0.03, 0.03])
    result = chisquare_test([45, 45, 4, 3, 3], probs, alpha=0.01)  # n = 100: expected 4, 3, 3 < 5
    assert result.pooled_bins == (2, 3, 4)
    assert result.bins == ((0,), (1,), (2, 3, 4))
    assert result.dof == 2
    np.testing.assert_allclose(result.expected, [45, 45, 10])
    assert result.statistic == pytest.approx(0.0) and result.pvalue == pytest.approx(1.0)


def test_a_pooled_bin_still_too_small_is_merged_with_the_smallest_other_bin():
    probs = np.array([0.5, 0.3, 0.17, 0.03])
    result = chisquare_test([50, 30, 17, 3], probs, alpha=0.01)  # pooled bin expects 3 < 5
    assert result.bins == ((0,), (1,), (2, 3))
    assert result.dof == 2


def test_statistic_and_pvalue_match_scipy_without_pooling():
    from scipy import stats

    observed, probs = np.array([30, 50, 20]), np.array([0.25, 0.5, 0.25])
    result = chisquare_test(observed, probs, alpha=0.01)
    reference = stats.chisquare(observed, probs * 100)
    assert result.statistic == pytest.approx(reference.statistic)
    assert result.pvalue == pytest.approx(reference.pvalue)


@pytest.mark.parametrize(
    "observed, probs",
    [
        ([20, 10], [0.5, 0.5]),  # fewer than MIN_SAMPLE_SIZE draws
        ([97, 2, 1], [0.97, 0.02, 0.01]),  # only one bin with expected >= 5 after pooling
    ],
)
def test_too_few_samples_is_an_invalid_test_not_a_pass(observed, probs):
    with pytest.raises(InvalidTestError):
        chisquare_test(observed, probs, alpha=0.01)


def test_a_sample_in_a_zero_probability_bin_fails_outright():
    result = chisquare_test([50, 49, 1], [0.5, 0.5, 0.0], alpha=1e-6)
    assert result.pvalue == 0.0 and result.support_violations == (2,)
    assert_samples_match([(0,)] * 60 + [(1,)] * 60, {(0,): 0.5, (1,): 0.5}, 1e-6, "fine")
    with pytest.raises(AssertionError, match="outside support"):
        assert_samples_match([(0,)] * 60 + [(1,)] * 60 + [(2,)], {(0,): 0.5, (1,): 0.5}, 1e-6, "extra")


def test_failure_message_has_the_table_statistic_dof_and_pvalue():
    with pytest.raises(AssertionError) as failure:
        assert_same_distribution([80, 20], [0.5, 0.5], 1e-3, "coin", bin_labels=["heads", "tails"])
    message = str(failure.value)
    for needle in [
        "coin",
        "heads",
        "tails",
        "expected",
        "observed",
        "50.0",
        "80",
        "chi-square = 36",
        "dof = 1",
        "p = ",
    ]:
        assert needle in message, needle


def test_invalid_arguments_raise():
    with pytest.raises(ValueError):
        chisquare_test([50, 50], [0.6, 0.6], alpha=0.01)
    with pytest.raises(ValueError):
        chisquare_test([50, 50], [0.5, 0.5], alpha=0.0)
    with pytest.raises(ValueError):
        per_test_alpha(0)


def test_per_test_alphas_sum_to_the_budget():
    assert per_test_alpha(8) * 8 == pytest.approx(FALSE_FAILURE_BUDGET)
    assert per_test_alpha(4, budget=2e-4) == pytest.approx(5e-5)


def test_control_power_matches_simulated_flawed_samplers():
    """The miss probability of a negative control, and the effect recovered from its p-values, against 4,000
    simulated controls (a flawed 8-outcome sampler, 300 draws each, no pooling). Seeded, so deterministic; the
    tolerances are 4 binomial standard errors and 4 of the estimate's, wide enough that the seed is not lucky."""
    rng = np.random.default_rng(3)
    exact = np.array([0.2, 0.18, 0.15, 0.13, 0.11, 0.09, 0.08, 0.06])  # every bin >= 5 expected: no pooling
    flawed = exact * np.exp(rng.normal(0, 0.15, 8))
    flawed /= flawed.sum()
    delta = float(((flawed - exact) ** 2 / exact).sum())
    runs, alpha, reps = 300, 1e-3, 4000
    results = [chisquare_test(rng.multinomial(runs, flawed), exact, alpha) for _ in range(reps)]
    assert all(r.dof == 7 for r in results)
    predicted = control_miss_probability(delta, runs, 7, alpha)
    assert 0.05 < predicted < 0.95, predicted  # a case where the check has something to check
    missed = np.mean([not r.rejected for r in results])
    assert abs(missed - predicted) < 4 * np.sqrt(predicted * (1 - predicted) / reps), (missed, predicted)
    estimate, error = noncentrality_per_run((runs, r.pvalue, r.dof) for r in results[:50])
    assert abs(estimate - delta) < 4 * error, (estimate, delta, error)
    assert control_miss_probability(delta, 4 * runs, 7, alpha) < predicted / 10  # more draws, fewer misses


def test_noncentrality_needs_observations():
    with pytest.raises(ValueError):
        noncentrality_per_run([])
