"""Verification cost of a token tree as a function of its node count, on this machine.

A tree pays when the tokens its extra nodes add are worth more than the time they cost. This measures the
target's tree-masked forward (`ModelState.forward_tree`: one uncached id plus N trie nodes, then the rollback)
for N = 0..64 at a fixed context, median of several runs, and fits cost(N) = base + slope * N over N >= 1.
`slope / base` is the expected number of extra accepted tokens a node must bring for the tree to break even
on verification alone (the draft's extra work comes on top).

    python benchmarks/tree_cost.py --out bench-out/tree-cost                      # the fixture target, fp32
    python benchmarks/tree_cost.py --model qwen2.5-coder-1.5b --dtype bfloat16 --out ...   # a fetched real model
    python benchmarks/tree_cost.py --model ~/.cache/xtokspec/real/qwen2.5-coder-1.5b --cpu-linears onednn ...
    python benchmarks/tree_cost.py --device cuda --out "$OUT/tree-cost"           # on a GPU (synchronised timing)

Writes tree_cost.json, tree_cost.md and tree_cost.png under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from common import write_manifest
from transformers import AutoModelForCausalLM

from xtokspec.cli.presets import real_model_dir, real_models_root
from xtokspec.decode.tree import Trie
from xtokspec.runtime.cache import ModelState
from xtokspec.runtime.models import CPU_LINEARS, onednn_linears, resolve

NODES = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def tries(n: int) -> dict[str, Trie]:
    """Two shapes of n nodes: all children of the root ("flat") and a beam-like tree (4 branches of n/4)."""
    flat, beam = Trie(), Trie()
    for i in range(n):
        flat.insert([10 + i])
    per = max(1, n // 4)
    for b in range(4):
        beam.insert([10 + b] + [100 + 10 * b + j for j in range(per - 1)], max_nodes=n)
    while beam.size < n:
        beam.insert([10, 500 + beam.size], max_nodes=n)
    return {"flat": flat, "beam": beam}


def _sync(model) -> None:
    """Wait for the device's queued work, so that a wall-clock interval covers the kernels (CUDA is async)."""
    device = model.get_input_embeddings().weight.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model, context: int, repeats: int) -> dict:
    prompt = torch.randint(10, min(7000, model.config.vocab_size), (context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    state = ModelState(model, prompt, "dynamic", context + 8, tree_nodes=max(NODES) + 1)
    out = {}
    with torch.inference_mode():
        state.forward(keep=1)
        state.ids.append(5)  # the uncached last committed id, as in a cycle
        for n in NODES:  # NOTE: one warm-up sweep first: the first calls of a process run slower (allocator)
            for trie in tries(n).values():
                state.forward_tree(trie.tokens, trie.parents)
                state.kv.rollback(len(state.ids) - 1)
        for n in NODES:
            for shape, trie in tries(n).items():
                times = []
                for _ in range(repeats + 2):
                    _sync(model)
                    start = time.perf_counter()
                    state.forward_tree(trie.tokens, trie.parents)
                    _sync(model)
                    times.append(time.perf_counter() - start)
                    state.kv.rollback(len(state.ids) - 1)
                out.setdefault(shape, {})[n] = statistics.median(times[2:]) * 1e3  # ms; two warm-up calls
    return out


def fit(costs: dict[int, float]) -> tuple[float, float]:
    xs = np.array([n for n in costs if n >= 1], dtype=float)
    ys = np.array([costs[n] for n in costs if n >= 1])
    slope, base = np.polyfit(xs, ys, 1)
    return float(base), float(slope)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ja-target", help="a folder, a bundled name (default: ja-target) or a real model fetched by real_models.py")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="where the model runs, e.g. cuda")
    parser.add_argument("--cpu-linears", choices=CPU_LINEARS, default="torch",
                        help="onednn: the model's linears packed for oneDNN (float32 CPU; models.onednn_linears)")
    parser.add_argument("--out", default="bench-out/tree-cost")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # NOTE: a fetched real model's name, not a hub id (a hub lookup on a machine without access retries for ~25 s)
    real = not Path(args.model).expanduser().exists() and (real_models_root() / args.model).is_dir()
    path = real_model_dir(args.model) if real else resolve(args.model, "--model")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval().to(args.device)
    if args.cpu_linears == "onednn":
        onednn_linears(model)
    kernels = ", oneDNN linears" if args.cpu_linears == "onednn" else ""
    costs = measure(model, args.context, args.repeats)
    one_step = costs["flat"][0]
    cuda = args.device.startswith("cuda")
    where = torch.cuda.get_device_name(args.device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    lines = [f"Tree verification cost, {Path(str(path)).name} ({args.dtype}{kernels}, {where}, "
             f"{args.context}-token context; median of {args.repeats})", "",
             "| nodes | flat tree (ms) | beam-like tree (ms) | x one-token step |", "|---|---|---|---|"]
    for n in NODES:
        lines.append(f"| {n} | {costs['flat'][n]:.2f} | {costs['beam'][n]:.2f} | {costs['beam'][n] / one_step:.2f} |")
    fits = {shape: fit(c) for shape, c in costs.items()}
    base, slope = fits["beam"]
    lines += ["", f"Fit over 1-64 nodes (beam-like): {base:.2f} ms + {slope:.3f} ms per node; one-token step "
              f"{one_step:.2f} ms. A node pays for its verification when it adds more than "
              f"{slope / one_step:.3f} expected accepted tokens (slope / one-token step)."]
    report = "\n".join(lines)
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out, args.device)
    (out / "tree_cost.md").write_text(report + "\n", encoding="utf-8")
    (out / "tree_cost.json").write_text(json.dumps(
        {"model": str(path), "dtype": args.dtype, "cpu_linears": args.cpu_linears, "device": where,
         "threads": torch.get_num_threads(),
         "context": args.context, "costs_ms": costs, "fit": fits, "one_step_ms": one_step, "torch": torch.__version__}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for shape, c in costs.items():
        ax.plot(list(c), list(c.values()), marker="o", label=f"{shape} tree")
    ax.axhline(one_step, color="gray", linestyle=":", label="one-token step")
    ax.set_xlabel("tree nodes verified in one forward")
    ax.set_ylabel("ms")
    ax.set_title(f"{Path(str(path)).name}, {args.dtype}{kernels}, {torch.get_num_threads()} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tree_cost.png", dpi=120)
    print(f"written: {out}/tree_cost.md, tree_cost.json, tree_cost.png")


if __name__ == "__main__":
    main()
