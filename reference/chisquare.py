"""Pearson chi-square goodness-of-fit helper for sampler tests, with a written false-failure budget.

What one call means: under a correct sampler, ``chisquare_test`` rejects (pvalue < alpha) with
probability alpha, up to the error of the chi-square approximation, which pooling keeps small:
every tested bin has expected count >= ``min_expected`` (5, the usual rule). Bins whose expected
count is below that are pooled into one bin; if the pooled bin is itself still below, it is merged
with the smallest other bin. Outcomes with probability exactly 0 are not pooled away: observing
one is a support violation and fails outright (statistic inf, p-value 0). Too few samples to
test — fewer than ``MIN_SAMPLE_SIZE`` draws, or fewer than 2 bins left after pooling — raise
``InvalidTestError`` instead of passing silently.

Budget: a full tox run may fail a correct implementation, by bad luck, with probability at most
``FALSE_FAILURE_BUDGET = 1e-3``. By the union bound that holds when the alphas of all statistical
tests sum to <= 1e-3, so with N statistical tests each runs at ``per_test_alpha(N) = 1e-3 / N``.
A suite that owns only a share of the run passes its share as ``budget``:
``per_test_alpha(N, budget=share)``; tests/reference/test_ref_statistical.py claims 1e-4 of the
1e-3 for its statistical tests, tests/test_vllm.py 5e-5 for its tests through vLLM,
tests/test_keyed.py 5e-5 for the keyed sampler's, and tests/test_stats.py (the torch side) the other 8e-4 for
its own; each file counts its tests. Seeds are fixed, so a test that passes once passes every time; the budget is
the chance that the fixed seeds chosen were unlucky. Tests that run twice on the same seed (in
the ``reference`` and ``stats`` tox envs) are the same event and count once.
"""

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

FALSE_FAILURE_BUDGET = 1e-3  # P(a full tox run fails a correct implementation), summed over tests
MIN_SAMPLE_SIZE = 50  # below this many draws the chi-square approximation is not trusted
OUTSIDE_SUPPORT = "<outside support>"  # label of the bin for samples not among the exact outcomes


class InvalidTestError(Exception):
    """The sample is too small for a chi-square test to mean anything; draw more samples."""


@dataclass(frozen=True)
class ChiSquareResult:
    """Result of one goodness-of-fit test over the pooled bins."""

    statistic: float  # Pearson's sum (observed - expected)^2 / expected; inf on a support violation
    dof: int  # tested bins - 1
    pvalue: float  # chi2(dof).sf(statistic)
    pooled_bins: tuple[int, ...]  # original bins merged into one tested bin (empty if none)
    bins: tuple[tuple[int, ...], ...]  # original bins making up each tested bin
    observed: np.ndarray  # (B,) observed counts per tested bin
    expected: np.ndarray  # (B,) expected counts per tested bin
    support_violations: tuple[int, ...]  # original bins with probability 0 but observed > 0
    alpha: float

    @property
    def rejected(self) -> bool:
        return self.pvalue < self.alpha


def per_test_alpha(num_tests: int, budget: float = FALSE_FAILURE_BUDGET) -> float:
    """Alpha for each of ``num_tests`` statistical tests so that their alphas sum to ``budget``."""
    if num_tests < 1:
        raise ValueError(f"num_tests must be >= 1, got {num_tests}")
    return budget / num_tests


def _pool(expected: np.ndarray, candidates: np.ndarray, min_expected: float) -> list[list[int]]:
    """Group candidate bins: each big bin alone, all small bins in one, topped up if still small."""
    big = [int(b) for b in candidates if expected[b] >= min_expected]
    small = [int(b) for b in candidates if expected[b] < min_expected]
    groups = [[b] for b in big]
    if small:
        if expected[small].sum() < min_expected and groups:
            smallest = min(range(len(groups)), key=lambda g: expected[groups[g][0]])
            small += groups.pop(smallest)
        groups.append(sorted(small))
    return groups


def chisquare_test(
    observed_counts: Sequence[int], expected_probs: Sequence[float], alpha: float, min_expected: float = 5.0
) -> ChiSquareResult:
    """Pearson chi-square test of counts (B,) against probabilities (B,), after pooling small bins."""
    observed = np.asarray(observed_counts, dtype=np.float64)  # (B,)
    probs = np.asarray(expected_probs, dtype=np.float64)  # (B,)
    if observed.shape != probs.shape or observed.ndim != 1:
        raise ValueError(f"observed {observed.shape} and expected_probs {probs.shape} must be equal 1-D")
    if (observed < 0).any() or (probs < 0).any() or abs(probs.sum() - 1.0) > 1e-9:
        raise ValueError("counts must be >= 0 and expected_probs a distribution summing to 1")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    num_samples = observed.sum()
    if num_samples < MIN_SAMPLE_SIZE:
        raise InvalidTestError(f"{num_samples:.0f} samples; a chi-square test needs >= {MIN_SAMPLE_SIZE}")
    expected = num_samples * probs  # (B,)
    violations = tuple(int(b) for b in np.flatnonzero((probs == 0) & (observed > 0)))
    groups = _pool(expected, np.flatnonzero(probs > 0), min_expected)
    if sum(expected[g].sum() >= min_expected for g in groups) < 2:
        raise InvalidTestError(
            f"only {len(groups)} bin(s) with expected count >= {min_expected} after pooling "
            f"(n = {num_samples:.0f}); draw more samples"
        )
    groups += [[b] for b in violations]  # shown in the table; they already decide the test
    observed_pooled = np.array([observed[g].sum() for g in groups])
    expected_pooled = np.array([expected[g].sum() for g in groups])
    dof = len(groups) - len(violations) - 1
    if violations:
        statistic, pvalue = float("inf"), 0.0
    else:
        statistic = float(((observed_pooled - expected_pooled) ** 2 / expected_pooled).sum())
        pvalue = float(stats.chi2.sf(statistic, dof))
    pooled = next((tuple(g) for g in groups if len(g) > 1), ())
    return ChiSquareResult(
        statistic=statistic,
        dof=dof,
        pvalue=pvalue,
        pooled_bins=pooled,
        bins=tuple(tuple(g) for g in groups),
        observed=observed_pooled,
        expected=expected_pooled,
        support_violations=violations,
        alpha=alpha,
    )


def format_result(result: ChiSquareResult, label: str, bin_labels: Sequence[str] | None = None) -> str:
    """A table of expected vs observed counts per tested bin, then the statistic, dof and p-value."""

    def name(group: tuple[int, ...]) -> str:
        names = [bin_labels[b] if bin_labels is not None else str(b) for b in group]
        if len(names) == 1:
            return names[0]
        joined = f"pooled {len(names)}: " + ", ".join(names)
        return joined if len(joined) <= 40 else joined[:36] + " ..."

    lines = [
        f"{label}: sample does not match the expected distribution "
        f"(p = {result.pvalue:.3g} < alpha = {result.alpha:.3g})"
        if result.rejected
        else f"{label}: consistent with the expected distribution (p = {result.pvalue:.3g})",
        f"  chi-square = {result.statistic:.4g}, dof = {result.dof}, n = {result.observed.sum():.0f}",
        f"  {'bin':<40} {'expected':>10} {'observed':>9} {'(o-e)/sqrt(e)':>14}",
    ]
    for group, obs, exp in zip(result.bins, result.observed, result.expected, strict=True):
        z = (obs - exp) / np.sqrt(exp) if exp > 0 else float("inf")
        lines.append(f"  {name(group):<40} {exp:>10.1f} {obs:>9.0f} {z:>+14.2f}")
    if result.support_violations:
        lines.append(f"  support violation: samples in bins of probability 0: {result.support_violations}")
    return "\n".join(lines)


def assert_same_distribution(
    observed_counts: Sequence[int],
    expected_probs: Sequence[float],
    alpha: float,
    label: str,
    bin_labels: Sequence[str] | None = None,
    min_expected: float = 5.0,
) -> ChiSquareResult:
    """Raise AssertionError, with the expected-vs-observed table, if the test rejects at ``alpha``."""
    result = chisquare_test(observed_counts, expected_probs, alpha, min_expected)
    if result.rejected:
        raise AssertionError(format_result(result, label, bin_labels))
    return result


def count_samples(
    samples: Iterable[Hashable], exact_probs: Mapping[Hashable, float]
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(counts, probs, labels) over ``exact_probs``' outcomes plus a last probability-0 bin for the rest."""
    outcomes = list(exact_probs)
    index = {outcome: i for i, outcome in enumerate(outcomes)}
    counts = np.zeros(len(outcomes) + 1, dtype=np.int64)
    for sample in samples:
        counts[index.get(sample, len(outcomes))] += 1
    probs = np.array([exact_probs[o] for o in outcomes] + [0.0])
    return counts, probs, [str(o) for o in outcomes] + [OUTSIDE_SUPPORT]


def assert_samples_match(
    samples: Iterable[Hashable], exact_probs: Mapping[Hashable, float], alpha: float, label: str
) -> ChiSquareResult:
    """``assert_same_distribution`` for raw samples (e.g. token tuples) against {outcome: prob}."""
    counts, probs, labels = count_samples(samples, exact_probs)
    return assert_same_distribution(counts, probs / probs.sum(), alpha, label, labels)


# ---------------------------------------------------------------- the power of a negative control
# A negative control runs the test on a deliberately flawed sampler and must reject. How often it fails to
# (a *missed* control, which fails CI as surely as a false rejection does) is a number to budget, not to guess
# from one lucky run. Under a fixed flaw, Pearson's statistic over N draws is close to a noncentral chi-square
# with noncentrality N * delta, where delta = sum over bins of (flawed - exact)^2 / exact is the flaw's effect
# per draw: mean dof + N * delta, variance 2 * (dof + 2 * N * delta).


def noncentrality_per_run(observations: Iterable[tuple[int, float, int]]) -> tuple[float, float]:
    """(delta, its standard error) from control runs (N draws, p-value, dof): each gives the unbiased
    (chi2(dof).isf(p) - dof) / N, and they are averaged with weights 1 / variance, the variance
    2 (dof + 2 N delta) / N^2 taken at the common estimate (iterated; at each run's own estimate the low draws
    would weigh most and bias delta down). A p-value of 0 (the statistic beyond float64) counts as 1e-300,
    which understates the effect."""
    rows = [(runs, dof, max(float(stats.chi2.isf(max(pvalue, 1e-300), dof)) - dof, 0.0) / runs)
            for runs, pvalue, dof in observations]
    if not rows:
        raise ValueError("no observations")
    runs, dof, estimates = (np.array(column, dtype=float) for column in zip(*rows, strict=True))
    delta = float(estimates.mean())
    for _ in range(20):
        weights = runs**2 / (2.0 * (dof + 2.0 * runs * delta))
        delta = float((weights * estimates).sum() / weights.sum())
    return delta, float(np.sqrt(1.0 / weights.sum()))


def control_miss_probability(delta: float, runs: int, dof: int, alpha: float) -> float:
    """P(a control whose flaw has effect ``delta`` per draw does not reject at ``alpha`` over ``runs`` draws)."""
    return float(stats.ncx2.cdf(stats.chi2.isf(alpha, dof), dof, max(delta, 1e-12) * runs))
