"""What batching the vLLM proposer's draft forwards across requests buys on a device: for B requests waiting
between two steps (caches of different lengths, 1 to 4 uncached ids each), the seconds to draft k ids for all
of them one request at a time (`ChainProposer`, as the proposer does with `xtokspec_batched_drafts` off) against
one batched forward per drafted position (`draft_together`, its default). Paired per repetition (the two orders
alternate), fresh states each time; the ids drafted both ways are compared (float32: equal; bfloat16 rows may
round apart).

Drafts: the bundled ja-draft-bpe, or random weights at SmolLM2-135M's and Gemma-3-270M's shapes (their configs
below, as their model folders give them; Gemma batches while a batch fits its 512-position window).

    python benchmarks/batch_draft_cost.py --device cuda --drafts fixture smollm2 gemma --out DIR
    python benchmarks/batch_draft_cost.py --device cpu --drafts fixture --batches 1 4 --reps 3 --out DIR
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from xtokspec.batch_draft import draft_together
from xtokspec.cache import ModelState
from xtokspec.kv import sliding_layers
from xtokspec.models import load
from xtokspec.propose import ChainProposer

CONFIGS = {  # the shapes of the real drafts (config.json of each model folder, weights random)
    "smollm2": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                    max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5,
                    rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}),
    "gemma": dict(model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                  query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768,
                  layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3, tie_word_embeddings=True,
                  rope_parameters={"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                                   "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}),
}


def build(name: str, device: str, dtype: torch.dtype):
    if name == "fixture":
        return load("ja-draft-bpe", device)[0].to(dtype).eval()
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(CONFIGS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def waiting(model, prompts: list[list[int]], tails: list[int]) -> list[ModelState]:
    """One draft state per request as it waits between two vLLM steps: its last `tail` ids not yet cached."""
    out = []
    for prompt, tail in zip(prompts, tails, strict=True):
        state = ModelState(model, prompt[:-tail])
        state.forward(keep=1)
        state.extend(prompt[-tail:])
        out.append(state)
    return out


def measure(model, device: str, batch: int, k: int, context: tuple[int, int], reps: int, window: int | None,
            seed: int) -> dict:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    one, together, same = [], [], 0
    for rep in range(reps + 1):  # the first repetition warms up (allocator, kernels) and is not kept
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*context))] for _ in range(batch)]
        tails = [rng.randint(1, 4) for _ in range(batch)]
        times = {}
        drafted = {}
        for way in (("alone", "together") if rep % 2 == 0 else ("together", "alone")):
            states = waiting(model, prompts, tails)
            sync(device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                if way == "alone":
                    drafted[way] = [ChainProposer(set())._draft_greedy_on_device(s, k)[0] for s in states]
                else:
                    drafted[way] = draft_together(model, states, k, set(), window=window)[0]
            sync(device)
            times[way] = time.perf_counter() - t0
        if rep:
            one.append(times["alone"])
            together.append(times["together"])
            same += sum(a == b for a, b in zip(drafted["alone"], drafted["together"], strict=True))
    ratios = [a / b for a, b in zip(one, together, strict=True)]
    return {"batch": batch, "k": k, "reps": reps, "alone_ms": 1e3 * statistics.median(one),
            "together_ms": 1e3 * statistics.median(together), "speedup_median": statistics.median(ratios),
            "speedup_min": min(ratios), "speedup_max": max(ratios), "rows_equal": same, "rows": batch * reps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--drafts", nargs="+", default=["fixture", "smollm2", "gemma"],
                        choices=["fixture", *CONFIGS])
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda for the real shapes, else float32")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--context", default="200-400", help="prompt lengths MIN-MAX (ids)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    context = tuple(int(x) for x in args.context.split("-"))
    args.out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    results = {"device": device_name, "torch": torch.__version__, "k": args.k, "context": args.context, "drafts": {}}
    for name in args.drafts:
        dtype = getattr(torch, args.dtype) if args.dtype else (
            torch.bfloat16 if args.device.startswith("cuda") and name != "fixture" else torch.float32)
        model = build(name, args.device, dtype)
        window = getattr(model.config, "sliding_window", None) if sliding_layers(model) else None
        rows = []
        for batch in args.batches:
            row = measure(model, args.device, batch, args.k, context, args.reps, window, seed=batch)
            rows.append(row)
            print(f"{name} ({dtype}) B={batch}: alone {row['alone_ms']:.2f} ms, together {row['together_ms']:.2f} ms,"
                  f" {row['speedup_median']:.2f}x [{row['speedup_min']:.2f}-{row['speedup_max']:.2f}],"
                  f" rows equal {row['rows_equal']}/{row['rows']}", flush=True)
        results["drafts"][name] = {"dtype": str(dtype), "rows": rows}
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
