"""Choose prompts for the deep end-to-end chi-square tests (tests/test_stats.py, section B).

For each held-out prompt and each sampling path, runs N seeded 3-token generations with K fixed at 3 and
prints the share of runs that accepted 2 proposals in one cycle (the test asserts >= MIN_DEEP_SHARE) and the
number of distinct continuations (fewer outcomes: more power per sample). Re-run it whenever the fixture
models change, then confirm the chosen prompts with `pytest -m stats -s tests/test_stats.py`.

Run: python tests/tools/deep_prompts.py --setting t1.0-k3 --runs 100 --prompts 64
     python tests/tools/deep_prompts.py --power --runs 400 --prompt "..." [--prompt ...]
       (each test case's check and both negative controls at --runs samples, with the controls' p-values
       *predicted* at N_E2E by scaling the chi-square excess over its degrees of freedom linearly in N)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from scipy import stats as scipy_stats

from xtokspec import XTokSpec

# the source tree first: `reference` is not installed, and a regular package there wins over the namespace
# directory tests/reference
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import test_stats  # noqa: E402
from model_helpers import FIXTURES, load_fixture_model  # noqa: E402
from test_stats import LENGTH, NUM_DRAFT_TOKENS, SETTINGS  # noqa: E402

import reference  # noqa: E402

PATHS = ("same-tokenizer", "onehot", "intersection")


def power(prompts: list[str], runs: int, cases: list[str]) -> None:
    """For every test case and prompt: the check's p-value and both controls' p-values at `runs` samples,
    and the controls' p-values predicted at test_stats.N_E2E."""
    import pytest

    target = load_fixture_model("ja-target")
    specs = {"bridged": XTokSpec(target, load_fixture_model("ja-draft-bpe")),
             "same": XTokSpec(target, load_fixture_model("ja-draft-same"))}
    for backend, path, setting in test_stats.CASES:
        scale = test_stats.N_E2E / runs
        if cases and "-".join((backend, path, setting)) not in cases:
            continue
        spec = specs["same" if path == "same-tokenizer" else "bridged"]
        proposal = "onehot" if path == "same-tokenizer" else path
        params = spec.sampling_params(do_sample=True, **SETTINGS[setting])
        for prompt in prompts:
            exact = test_stats.exact_continuations(*target, prompt, params, LENGTH, spec.target_eos)
            samples, deep = test_stats.sample_continuations(spec, SETTINGS[setting], proposal, prompt, runs)
            cells = [f"deep {deep:.2f}", f"p {reference.chisquare_test(*_counts(samples, exact), test_stats.ALPHA).pvalue:.2g}"]
            for flaw, where in test_stats.CASE_CONTROLS[backend, path, setting]:
                with pytest.MonkeyPatch.context() as patch:
                    for name, flawed in test_stats.FLAWS[flaw](where).items():
                        patch.setattr(test_stats.sampling, name, flawed)
                    wrong, _ = test_stats.sample_continuations(spec, SETTINGS[setting], proposal, prompt, runs)
                result = reference.chisquare_test(*_counts(wrong, exact), test_stats.ALPHA)
                predicted = scipy_stats.chi2.sf(result.dof + (result.statistic - result.dof) * scale, result.dof)
                cells.append(f"{flaw} {where} control p {result.pvalue:.2g} -> {predicted:.1g} predicted")
            print(f"{backend} {path} {setting} {prompt!r}: " + ", ".join(cells), flush=True)


def _counts(samples, exact):
    counts, probs, _ = reference.count_samples(samples, exact)
    return counts, probs / probs.sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="t1.0-k3")
    parser.add_argument("--runs", type=int, default=100, help="seeded generations per prompt and path")
    parser.add_argument("--prompts", type=int, default=64, help="first N lines of fixtures/data/prompts.txt")
    parser.add_argument("--power", action="store_true", help="power of each case's controls at --prompt prompts")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt for --power (repeatable)")
    parser.add_argument("--case", action="append", default=[], help="only this test case, e.g. dynamic-onehot-t1.0-k3")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.power:
        power(args.prompt, args.runs, args.case)
        return
    target = load_fixture_model("ja-target")
    bridged = XTokSpec(target, load_fixture_model("ja-draft-bpe"))
    same = XTokSpec(target, load_fixture_model("ja-draft-same"))
    prompts = [p for p in (FIXTURES / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines() if p]
    print(f"setting {args.setting}, {args.runs} runs: deep share / distinct continuations per path")
    for prompt in prompts[: args.prompts]:
        cells = []
        for path in PATHS:
            spec = same if path == "same-tokenizer" else bridged
            deep, outcomes = 0, set()
            for seed in range(args.runs):
                result = spec.generate(prompt, max_new_tokens=LENGTH, do_sample=True, seed=seed,
                                       proposal="onehot" if path == "same-tokenizer" else path,
                                       num_draft_tokens=NUM_DRAFT_TOKENS, adaptive=False, **SETTINGS[args.setting])
                deep += result.stats.max_accepted_in_a_cycle >= 2
                outcomes.add(tuple(result.token_ids))
            cells.append(f"{path} {deep / args.runs:.2f} / {len(outcomes):3d}")
        print(f"{prompt!r:40}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
