"""What a linear layer costs for n input rows on this CPU: the reason a verified token (or tree node) is cheap or not.

Verifying n drafted tokens runs every linear of the target over n rows instead of 1. Where one row is bound by
reading the weights from memory, more rows come almost free; where the kernel is bound by arithmetic, each row
costs about what one row costs, and speculative decoding cannot pay. This times a stack of linear layers
(weights streamed from memory, not cached: the stack's weights hold at least --megabytes) over 1..64 rows for
torch's float32 and bfloat16 linears and oneDNN's with its weight packed once (`torch.utils.mkldnn`, what
`--cpu-linears onednn` uses), and prints ms per layer and each column over its one-row cost.

    python benchmarks/linear_rows.py [--in-features 1536] [--out-features 8960] [--threads 2]

The default shape is Qwen2.5-1.5B's MLP up-projection. Measured figures: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.utils.benchmark import Timer
from torch.utils.mkldnn import MkldnnLinear

ROWS = (1, 2, 3, 4, 8, 16, 32, 64)


def stacks(in_features: int, out_features: int, megabytes: int) -> dict[str, list[torch.nn.Module]]:
    """Each kind: enough linears of one shape that their weights (in that kind's dtype) fill `megabytes`."""
    out = {}
    for label, dtype, onednn in (("torch float32", torch.float32, False), ("oneDNN float32", torch.float32, True),
                                 ("torch bfloat16", torch.bfloat16, False), ("oneDNN bfloat16", torch.bfloat16, True)):
        size = in_features * out_features * (4 if dtype == torch.float32 else 2)
        layers = []
        for _ in range(max(1, math.ceil(megabytes * 2**20 / size))):
            layer = torch.nn.Linear(in_features, out_features, bias=False)
            layers.append(MkldnnLinear(layer, dtype) if onednn else layer.to(dtype))
        out[label] = layers
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-features", type=int, default=1536)
    parser.add_argument("--out-features", type=int, default=8960)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--megabytes", type=int, default=512, help="weights per stack (beyond the CPU's caches)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}; "
          f"a {args.in_features}x{args.out_features} linear, weights streamed from a stack of >= {args.megabytes} MB")
    table = {}
    with torch.inference_mode():
        for label, layers in stacks(args.in_features, args.out_features, args.megabytes).items():
            dtype = torch.float32 if "float32" in label else torch.bfloat16
            row = []
            for n in ROWS:
                x = torch.randn(1, n, args.in_features, dtype=dtype)
                timer = Timer("for layer in layers: layer(x)", globals={"layers": layers, "x": x},
                              num_threads=args.threads)
                row.append(timer.blocked_autorange(min_run_time=1.0).median / len(layers) * 1e3)
            table[label] = row
    print("\n| ms per layer, rows | " + " | ".join(map(str, ROWS)) + " |")
    print("|---|" + "---|" * len(ROWS))
    for label, row in table.items():
        print(f"| {label} | " + " | ".join(f"{ms:.2f}" for ms in row) + " |")
    print("\n| x its one-row cost | " + " | ".join(map(str, ROWS)) + " |")
    print("|---|" + "---|" * len(ROWS))
    for label, row in table.items():
        print(f"| {label} | " + " | ".join(f"{ms / row[0]:.2f}" for ms in row) + " |")


if __name__ == "__main__":
    main()
