"""A torch CPU slowdown, reproduced for an upstream report: bf16 `F.linear` runs ~20x (32k rows) to ~50x (262k)
slower when its weight does not require grad and its 3-D input is a slice of the last k < T positions of a
(1, T, H) tensor (strides (T*H, H, 1)) than with a weight that requires grad, or with the input reshaped to 2-D.

HF causal LMs pass exactly that slice to their head after a multi-token forward (`hidden_states[:, -k:, :]`,
logits_to_keep=k), so a model whose weights were frozen (`model.requires_grad_(False)`, common in inference
code) pays it at every verification; a model as loaded (weights require grad) does not. A head built from
copied rows (xtokspec.runtime.vocab.TrimmedHead, whose weight is a buffer) would, which is why it reshapes to 2-D.

    python benchmarks/torch_linear_strided.py [--rows 32768 262144] [--hidden 640] [--threads 2]

Prints the median time of each variant (torch.utils.benchmark). Measured figures: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32768, 262144], help="output rows (vocabulary)")
    parser.add_argument("--hidden", type=int, default=640, help="input features (Gemma-3-270M: 640)")
    parser.add_argument("--tokens", type=int, default=16, help="length of the sequence the slice is taken from")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hidden = torch.randn(1, args.tokens, args.hidden, dtype=torch.bfloat16)  # (1, T, H)
    inputs = {
        "last 1 of T, 3-D": hidden[:, -1:, :],  # strides (T*H, H, 1)
        "last 4 of T, 3-D": hidden[:, -4:, :],
        "all T, 3-D": hidden,
        "last 1 of T, 2-D": hidden[:, -1:, :].reshape(-1, args.hidden),
    }
    print(f"torch {torch.__version__}, bf16, {args.threads} threads, hidden {args.hidden}, T={args.tokens}")
    print(f"| rows | weight | {' | '.join(inputs)} |")
    print("|---|---|" + "---|" * len(inputs))
    for rows in args.rows:
        frozen = torch.randn(rows, args.hidden, dtype=torch.bfloat16)
        for label, weight in (("requires_grad=False", frozen), ("requires_grad=True", torch.nn.Parameter(frozen))):
            cells = []
            for x in inputs.values():
                with torch.inference_mode():
                    timer = Timer("F.linear(x, w)", globals={"F": F, "x": x, "w": weight})
                    cells.append(f"{timer.blocked_autorange(min_run_time=0.5).median * 1e3:.2f} ms")
            print(f"| {rows} | {label} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
