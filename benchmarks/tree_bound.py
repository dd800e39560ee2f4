"""How fast a token tree could be against a chain if its extra nodes were verified for free (computed, not measured).

A tree is faster than a chain by (its tokens per target call / the chain's) x (the chain's seconds per call / its
own). Its calls cost more for two reasons: more nodes to verify, and wider draft levels. This reads an `xtokspec
bench` run's results.json and, from the loop's own per-call totals over all prompts (`stats`: seconds, tokens,
target calls, verification seconds), prints for each tree system and each bridged chain of the same mode:
the tokens-per-call ratio, the measured speed ratio (of totals), and the bound: the speed ratio if the tree's
verification had cost what the chain's did per call, with its draft as measured. Where verification grows with
the nodes (a CPU) that bound is what no cheaper verification can beat; on a GPU, where a tree's verification can
cost what a chain's does, it is not a bound. Runs mixing drafted and target-alone cycles (the fallback) are
skipped: their per-call costs are not a drafted cycle's.

    python benchmarks/tree_bound.py benchmarks/results/xeon-avx512bf16/fixtures-trees/results.json [--mode T=0.7]

Figures: BENCHMARKS.md, "Token trees across machines".
"""

from __future__ import annotations

import argparse
import collections
import json

FIELDS = ("target_forwards", "new_tokens", "wall_seconds", "verify_seconds", "alone_cycles")


def totals(path: str, mode: str) -> dict[str, collections.Counter]:
    """Per system of `mode`: the sums of FIELDS over its prompts (systems with loop statistics only)."""
    with open(path) as f:
        runs = json.load(f)["runs"]
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for run in runs:
        stats = run.get("stats")
        if run["mode"] == mode and stats:
            out[run["system"]].update({field: stats.get(field) or 0 for field in FIELDS})
    return out


def rows(path: str, mode: str) -> list[tuple[str, str, float, float, float, float]]:
    """(tree, chain, tree's tokens per call, chain's, measured speed ratio, bound with free nodes) for each tree
    system and bridged chain of `mode` that drafted every cycle."""
    systems = {name: t for name, t in totals(path, mode).items() if t["target_forwards"] and not t["alone_cycles"]}
    per_call = {name: {f: t[f] / t["target_forwards"] for f in FIELDS} for name, t in systems.items()}
    out = []
    for tree, t in per_call.items():
        if "-tree" not in tree:
            continue
        for chain, c in per_call.items():
            if "-tree" in chain or "bridged" not in chain:
                continue
            chain_speed = c["new_tokens"] / c["wall_seconds"]
            free = t["wall_seconds"] - t["verify_seconds"] + c["verify_seconds"]  # the tree's call, verified at the chain's cost
            out.append((tree, chain, t["new_tokens"], c["new_tokens"], t["new_tokens"] / t["wall_seconds"] / chain_speed,
                        t["new_tokens"] / free / chain_speed))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="results.json of xtokspec bench runs")
    parser.add_argument("--mode", default="T=0.7")
    args = parser.parse_args()
    print("| run | tree | chain | tokens per call, tree / chain | measured speed, tree / chain (totals) | "
          "bound with free nodes |")
    print("|---|---|---|---|---|---|")
    for path in args.results:
        for tree, chain, t_tokens, c_tokens, measured, bound in rows(path, args.mode):
            print(f"| {path} | {tree} | {chain} | {t_tokens:.2f} / {c_tokens:.2f} = {t_tokens / c_tokens:.2f} | "
                  f"{measured:.2f} | {bound:.2f} |")


if __name__ == "__main__":
    main()
