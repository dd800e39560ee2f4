"""Size the negative controls of tests/test_stats.py from their measured power.

For every control in test_stats.CONTROLS: the degrees of freedom its chi-square has at each recorded run count
(the exact law's bins after pooling, which grow with N), the flaw's effect per draw estimated from the recorded
p-values (reference.noncentrality_per_run), and the probability that the control misses (does not reject at
ALPHA) at its first look and at its full size, at the estimate and at its lower bound (estimate - 2 standard
errors), with the draws CI pays for the second look on average, and the smallest total (a multiple of 100 from
the first look) within test_stats.CONTROL_MISS. Prints a table, and the dofs to record.

Run: python tests/tools/control_power.py            (loads the fixture models; about a minute)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from xtokspec import XTokSpec

# the source tree first: `reference` is not installed, and a regular package there wins over the namespace
# directory tests/reference
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import test_stats  # noqa: E402
from model_helpers import load_fixture_model  # noqa: E402

import reference  # noqa: E402


def pooled_dof(exact: dict, runs: int) -> int:
    """The dof chisquare_test gives the exact law's bins at `runs` draws (pooling depends on expected counts only)."""
    probs = np.array(list(exact.values()))
    counts = np.floor(probs * runs).astype(np.int64)
    counts[np.argmax(probs)] += runs - counts.sum()
    return reference.chisquare_test(counts, probs / probs.sum(), test_stats.ALPHA).dof


def main() -> None:
    target = load_fixture_model("ja-target")
    specs = {"bpe": XTokSpec(target, load_fixture_model("ja-draft-bpe")),
             "same": XTokSpec(target, load_fixture_model("ja-draft-same"))}
    print(f"ALPHA {test_stats.ALPHA:.2g}, miss budget per control {test_stats.CONTROL_MISS:g}\n")
    print("| control | first / total | dof | effect per 1,000 draws (lower bound) | miss at first | miss at total "
          "(lower bound) | extra draws per CI run | smallest total within budget |")
    print("|---|---|---|---|---|---|---|---|")
    dofs = {}
    for name, control in test_stats.CONTROLS.items():
        prompt, setting, length, draft = control.law
        spec = specs[draft]
        params = spec.sampling_params(do_sample=True, **test_stats.SETTINGS[setting])
        exact = test_stats.exact_continuations(*target, prompt, params, length, spec.target_eos)
        evidence = [(runs, p, pooled_dof(exact, runs)) for runs, p, _ in control.evidence]
        dofs[name] = {runs: dof for runs, _, dof in evidence} | {control.total: pooled_dof(exact, control.total)}
        delta, error = reference.noncentrality_per_run(evidence)
        low = max(delta - 2 * error, 0.0)
        dof_first, dof_total = pooled_dof(exact, control.first), dofs[name][control.total]
        first = reference.control_miss_probability(delta, control.first, dof_first, test_stats.ALPHA)
        total = reference.control_miss_probability(delta, control.total, dof_total, test_stats.ALPHA)
        total_low = reference.control_miss_probability(low, control.total, dof_total, test_stats.ALPHA)
        suggested = next(n for n in range(control.first, 100_000, 100)
                         if reference.control_miss_probability(low, n, pooled_dof(exact, n), test_stats.ALPHA)
                         <= test_stats.CONTROL_MISS)
        dofs[name][suggested] = pooled_dof(exact, suggested)
        print(f"| {name} | {control.first} / {control.total} | {dof_first} / {dof_total} | {1000 * delta:.0f} "
              f"({1000 * low:.0f}) | {first:.1e} | {total:.1e} ({total_low:.1e}) | "
              f"{first * (control.total - control.first):.1f} | {suggested} |", flush=True)
    print("\ndof at each recorded count:", dofs)


if __name__ == "__main__":
    main()
