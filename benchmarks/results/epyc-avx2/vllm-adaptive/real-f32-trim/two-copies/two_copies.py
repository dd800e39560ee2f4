"""Two copies of the same float32 weights in one process, stepped in turn: how far apart do their steps run?

The weights have the shapes of Qwen2.5-Coder-1.5B's linear layers (28 layers: q/k/v as one 2048 x 1536 matrix,
o 1536 x 1536, gate/up as one 17920 x 1536, down 1536 x 8960; the 151,936 x 1536 head), filled at random: a
batch-1 decode step of the real pair's target streams them all, as vLLM's does. Each build allocates both copies
afresh; the copies are then stepped in turn, the order alternating (ABBA), one vector each, and each pair of steps
gives a ratio (A's seconds over B's). Nothing differs between the copies but where their memory lies, so a ratio
away from 1 is what one engine's weights can cost against another's in the same process, xtokspec or not.

    OMP_NUM_THREADS=1 taskset -c 1 python two_copies.py --builds 4 --steps 20
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

HIDDEN, INTER, QKV, VOCAB, LAYERS = 1536, 8960, 2048, 151936, 28


def build() -> list[torch.Tensor]:
    mats = []
    for _ in range(LAYERS):
        mats += [torch.randn(QKV, HIDDEN), torch.randn(HIDDEN, HIDDEN), torch.randn(2 * INTER, HIDDEN),
                 torch.randn(HIDDEN, INTER)]
    return mats + [torch.randn(VOCAB, HIDDEN)]


def step(mats: list[torch.Tensor], x: torch.Tensor, z: torch.Tensor) -> float:
    start = time.perf_counter()
    for w in mats:
        torch.nn.functional.linear(x if w.shape[1] == HIDDEN else z, w)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builds", type=int, default=4, help="builds of both copies in this process")
    parser.add_argument("--steps", type=int, default=20, help="steps of each copy per build")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, z = torch.randn(1, HIDDEN), torch.randn(1, INTER)
    for n in range(args.builds):
        a, b = build(), build()
        step(a, x, z), step(b, x, z)  # first touches
        ta, tb = [], []
        for i in range(args.steps):
            for mats, times in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
                times.append(step(mats, x, z))
        ratios = [p / q for p, q in zip(ta, tb, strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"build {n + 1}: A/B paired median {statistics.median(ratios):.3f} (IQR {q1:.3f}-{q3:.3f}), "
              f"sums {sum(ta) / sum(tb):.3f}; median step A {statistics.median(ta) * 1e3:.0f} ms, "
              f"B {statistics.median(tb) * 1e3:.0f} ms", flush=True)
        del a, b
        gc.collect()


if __name__ == "__main__":
    main()
