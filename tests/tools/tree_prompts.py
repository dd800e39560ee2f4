"""Rank held-out prompts by how much a tree test's negative control (no renormalisation) changes the first cycle.

The first cycle's trie is deterministic (a one-hot tree is drafted without randomness), so for each prompt this
builds it once and computes, from the target's probabilities at its nodes, how much acceptance probability the
missing renormalisation moves: at the root ("first") and below it ("deep"). A control has power where that
effect is large; check the chosen prompt with a real run (tests/test_stats.py, section C).

    python tests/tools/tree_prompts.py --draft same --temperature 0.7 --top-k 6 --top-p 0.9
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from model_helpers import load_fixture_model  # noqa: E402

from xtokspec import XTokSpec, tree  # noqa: E402


def effects(trie, probs) -> tuple[float, float]:
    """(first, deep): sum over nodes of P(reach the node) * P(try child j) * (p'(c_j) - p(c_j)), j >= 2."""

    def visit(node: int, reach: float, depth: int) -> tuple[float, float]:
        first = deep = 0.0
        remaining, tried = 1.0, 1.0
        for j, child in enumerate(trie.children[node]):
            p = float(probs[node, trie.tokens[child]])
            accept = p / remaining if remaining > 0 else 1.0
            if j > 0:
                if depth == 0:
                    first += reach * tried * (accept - p)
                else:
                    deep += reach * tried * (accept - p)
            f, d = visit(child, reach * tried * accept, depth + 1)
            first, deep = first + f, deep + d
            tried *= 1 - accept
            remaining -= p
        return first, deep

    return visit(0, 1.0, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", choices=("same", "bpe"), default="bpe")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--show", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = XTokSpec(load_fixture_model("ja-target"), load_fixture_model(f"ja-draft-{args.draft}"))
    captured = {}
    verify = tree.verify_tree_sampled

    def spy(probs, trie, uniforms, noise, root_q=None):
        captured.setdefault("first", (trie, probs.double()))
        return verify(probs, trie, uniforms, noise, root_q)

    tree.verify_tree_sampled = spy
    prompts = [line for line in (ROOT / "fixtures/data/prompts.txt").read_text(encoding="utf-8").splitlines() if line]
    rows = []
    for prompt in prompts:
        captured.clear()
        spec.generate(prompt, max_new_tokens=3, do_sample=True, seed=0, tree_width=args.width,
                      num_draft_tokens=args.depth, adaptive=False, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p)
        first, deep = effects(*captured["first"])
        rows.append((deep, first, prompt))
    for deep, first, prompt in sorted(rows, reverse=True)[: args.show]:
        print(f"deep {deep:.3f}  first {first:.3f}  {prompt!r}")


if __name__ == "__main__":
    main()
