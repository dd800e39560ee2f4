"""Rank held-out prompts by how much a sampled tree root's negative controls change the first token's law.

A sampled root's law depends only on the target's distribution p at the root and the draft's distribution q
there (moved onto the target vocabulary), so for each prompt this takes both from the first cycle and computes,
exactly (reference/tree.py), the total-variation distance between p and the law a flawed update gives. A
control has power where that distance is large; check the chosen prompt with a real run (tests/test_stats.py,
section C2). Also printed: the chance that the root accepts a child, and that it accepts a later one than the
first (the share of runs whose walk goes past the first draw); with --deep-runs N, for the prompts shown, the
share of N seeded runs that accepted 2 tree nodes in one cycle (the test asks for >= 10%).

    python tests/tools/sampled_root_prompts.py --draft bpe --temperature 1.0 --top-k 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from model_helpers import load_fixture_model  # noqa: E402

import reference.tree as ref  # noqa: E402
from xtokspec import XTokSpec, tree  # noqa: E402

FLAWS = ("keep_p", "onehot_residual", "no_renormalize")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", choices=("same", "bpe"), default="bpe")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--show", type=int, default=8)
    parser.add_argument("--deep-runs", type=int, default=0)
    parser.add_argument("--candidates", type=int, default=40, help="prompts (by root effect) to measure deep share on")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = XTokSpec(load_fixture_model("ja-target"), load_fixture_model(f"ja-draft-{args.draft}"))
    captured = {}
    verify = tree.verify_tree_sampled

    def spy(probs, trie, uniforms, noise, root_q=None):
        if root_q is not None:
            captured.setdefault("first", (probs[0].double().numpy(), root_q.double().numpy()))
        return verify(probs, trie, uniforms, noise, root_q)

    tree.verify_tree_sampled = spy
    prompts = [line for line in (ROOT / "fixtures/data/prompts.txt").read_text(encoding="utf-8").splitlines() if line]
    rows = []
    for prompt in prompts:
        captured.clear()
        spec.generate(prompt, max_new_tokens=3, do_sample=True, seed=0, tree_width=args.width, num_draft_tokens=2,
                      adaptive=False, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        if "first" not in captured:
            continue
        p, q = captured["first"]
        p, q = p / p.sum(), q / q.sum()
        effects = [0.5 * np.abs(ref.sampled_node_law(p, q, args.width, flaw) - p).sum() for flaw in FLAWS]
        accept = ref.sampled_acceptance(p, q, args.width)
        first = np.minimum(p, q).sum()
        rows.append((min(effects[:2]), effects, accept, accept - first, prompt))
    tree.verify_tree_sampled = verify
    options = dict(tree_width=args.width, num_draft_tokens=2, adaptive=False, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p)
    ranked = sorted(rows, reverse=True)[: args.candidates if args.deep_runs else args.show]
    shown = 0
    for _, effects, accept, later, prompt in ranked:
        deep = ""
        if args.deep_runs:
            share = sum(spec.generate(prompt, max_new_tokens=3, do_sample=True, seed=seed, **options).stats
                        .max_accepted_in_a_cycle >= 2 for seed in range(args.deep_runs)) / args.deep_runs
            if share < 0.10:
                continue
            deep = f"  deep share {share:.2f}"
        text = "  ".join(f"{flaw} {e:.3f}" for flaw, e in zip(FLAWS, effects, strict=True))
        print(f"{text}  accept {accept:.2f} (later draws {later:.2f}){deep}  {prompt!r}", flush=True)
        shown += 1
        if shown == args.show:
            break


if __name__ == "__main__":
    main()
