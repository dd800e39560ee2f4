"""A prediction, from `root_acceptance.py`'s per-position figures: how many tokens a target call would commit if
the sampled rule (candidates drawn from the draft and tested against it, as a sampled tree root is) held at every
level of a tree, not just at its root.

`root_acceptance.py` reads, along the target's own sampled continuation of each prompt, the chance a(t) that
each way of proposing accepts the token at position t, with the draft re-reading the committed text there. A
tree of shape (m_1, ..., m_D) drafts m_1 candidates at the root and m_{i+1} below each candidate of depth i, and
commits one token more than the levels it accepts, so its tokens per call are predicted as

    E = 1 + a_1(t) + a_1(t) a_2(t+1) + ... + a_1(t) ... a_D(t+D-1),   a_i = the figure for m_i candidates,

averaged over the positions t whose next 2 positions also have figures (whole characters; the same positions
for every shape). This is a
**prediction**, not a measurement: it takes the target's own next token as the one the walk descends with (given
that a level accepts, the token accepted leans towards the draft's candidates), and it gives every node below the
root a draft that re-reads the committed text, which the tree as built does not (its deeper candidates are the draft's
beam, bridged, under the one-hot rule). The chains' rows (`onehot`, `intersection`; every level one proposal) and
a stand-in for the tree as built (sampled root, the one-hot top-m rule below) are computed the same way, so that they
can be checked against the loop's measured tokens per call (BENCHMARKS.md, "Token trees across machines").

    python benchmarks/sampled_depth.py benchmarks/results/machine-independent/root-acceptance/root_acceptance-fixtures-T0.7.json

Prints a Markdown table; with matplotlib installed, writes a plot of predicted tokens per call against nodes
verified next to the input file.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

# (label, the figure used at each level, candidates per node at each level)
SHAPES = [
    ("one-hot chain, K=1", ["onehot"], [1]),
    ("one-hot chain, K=2", ["onehot"] * 2, [1, 1]),
    ("intersection chain, K=1", ["intersection"], [1]),
    ("intersection chain, K=2", ["intersection"] * 2, [1, 1]),
    ("intersection chain, K=3", ["intersection"] * 3, [1, 1, 1]),
    ("today's tree (stand-in): sampled 4, then top-1", ["sampled-4", "top-1"], [4, 1]),
    ("today's tree (stand-in): sampled 4, then top-2", ["sampled-4", "top-2"], [4, 2]),
    ("today's tree (stand-in): sampled 4, then top-1, top-1", ["sampled-4", "top-1", "top-1"], [4, 1, 1]),
    ("today's tree (stand-in): sampled 4, then top-2, top-1", ["sampled-4", "top-2", "top-1"], [4, 2, 1]),
    ("sampled at every level (4, 1)", ["sampled-4", "sampled-1"], [4, 1]),
    ("sampled at every level (4, 2)", ["sampled-4", "sampled-2"], [4, 2]),
    ("sampled at every level (4, 1, 1)", ["sampled-4", "sampled-1", "sampled-1"], [4, 1, 1]),
    ("sampled at every level (4, 2, 1)", ["sampled-4", "sampled-2", "sampled-1"], [4, 2, 1]),
    ("sampled at every level (4, 4)", ["sampled-4", "sampled-4"], [4, 4]),
    ("sampled at every level (4, 4, 2)", ["sampled-4", "sampled-4", "sampled-2"], [4, 4, 2]),
    ("sampled at every level (8, 2, 1)", ["sampled-8", "sampled-2", "sampled-1"], [8, 2, 1]),
]


def nodes(widths: list[int]) -> int:
    """Nodes the target verifies for a full tree of this shape."""
    total, level = 0, 1
    for m in widths:
        level *= m
        total += level
    return total


def mean_se(values: list[float]) -> tuple[float, float]:
    """(mean, standard error of the mean)."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1)
    return mean, math.sqrt(var / len(values))


def per_position(at: dict, keys: list[str], depth: int) -> list[float]:
    """Predicted tokens per call at each usable position of `at` ((prompt, position) -> figures). Only positions
    whose next `depth` - 1 positions have figures are used, the same for every shape, so that shapes compare
    paired, position by position."""
    values = []
    for (prompt, position) in at:
        if any((prompt, position + i) not in at for i in range(depth)):
            continue
        tokens, reach = 1.0, 1.0
        for i, key in enumerate(keys):
            reach *= at[(prompt, position + i)][key]
            tokens += reach
        values.append(tokens)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", help="root_acceptance-*.json files")
    args = parser.parse_args()
    for name in args.inputs:
        path = Path(name)
        data = json.loads(path.read_text())
        rows, run = data["rows"], data["args"]
        print(f"\n{run['preset']}, T={run['temperature']} ({path}); PREDICTED tokens per target call:\n")
        print("| shape | nodes verified | predicted tokens per call (s.e.) | positions |")
        print("|---|---|---|---|")
        depth = max(len(keys) for _, keys, _ in SHAPES)
        at = {(r["prompt"], r["position"]): r for r in rows}
        values = {label: per_position(at, keys, depth) for label, keys, _ in SHAPES}
        points = []
        for label, _, widths in SHAPES:
            mean, se = mean_se(values[label])
            points.append((label, nodes(widths), mean))
            print(f"| {label} | {nodes(widths)} | {mean:.2f} ({se:.2f}) | {len(values[label])} |")
        print("\nThe sampled rule below the root, paired against today's rule (one-hot top-m) in a tree of the same "
              "shape:\n")
        print("| shape | predicted tokens per call, sampled below the root minus one-hot below (s.e.) | ratio |")
        print("|---|---|---|")
        trees = {(tuple(widths), "today" in label): label for label, _, widths in SHAPES if "chain" not in label}
        for (widths, today), label in trees.items():
            base = trees.get((widths, True))
            if today or base is None:
                continue
            diff, se = mean_se([a - b for a, b in zip(values[label], values[base], strict=True)])
            ratio = mean_se(values[label])[0] / mean_se(values[base])[0]
            print(f"| {widths} | {diff:+.3f} ({se:.3f}) | {ratio:.3f} |")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, n, mean in points:
            kind = "chain" if "chain" in label else ("today" if "today" in label else "sampled")
            style = {"chain": ("tab:gray", "s"), "today": ("tab:blue", "o"), "sampled": ("tab:orange", "^")}[kind]
            ax.scatter(n, mean, color=style[0], marker=style[1])
            ax.annotate(label.split(": ")[-1].replace("sampled at every level ", ""), (n, mean),
                        textcoords="offset points", xytext=(5, -10) if kind == "today" else (4, 3), fontsize=7,
                        color=style[0])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes verified per target call (full tree)")
        ax.set_ylabel("predicted tokens per target call")
        ax.set_title(f"{run['preset']}, T={run['temperature']}: PREDICTION from per-position acceptance\n"
                     "grey: chains, blue: today's tree (stand-in), orange: sampled rule at every level", fontsize=9)
        ax.grid(alpha=0.3)
        out = path.with_name(path.stem + "-depth.png")
        fig.tight_layout()
        fig.savefig(out, dpi=120)
        print(f"\nplot: {out}")


if __name__ == "__main__":
    main()
