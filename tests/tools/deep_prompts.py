"""Choose prompts for the deep end-to-end chi-square tests (tests/test_stats.py, section B).

For each held-out prompt and each sampling path, runs N seeded 3-token generations with K fixed at 3 and
prints the share of runs that accepted 2 proposals in one cycle (the test asserts >= MIN_DEEP_SHARE) and the
number of distinct continuations (fewer outcomes: more power per sample). Re-run it whenever the fixture
models change, then confirm the chosen prompts with `pytest -m stats -s tests/test_stats.py`.

Run: python tests/tools/deep_prompts.py --setting t1.0-k3 --runs 100 --prompts 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_helpers import FIXTURES, load_fixture_model  # noqa: E402
from test_stats import LENGTH, NUM_DRAFT_TOKENS, SETTINGS  # noqa: E402

from xtokspec import XTokSpec  # noqa: E402

PATHS = ("same-tokenizer", "onehot", "intersection")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="t1.0-k3")
    parser.add_argument("--runs", type=int, default=100, help="seeded generations per prompt and path")
    parser.add_argument("--prompts", type=int, default=64, help="first N lines of fixtures/data/prompts.txt")
    args = parser.parse_args()
    torch.set_num_threads(1)
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
