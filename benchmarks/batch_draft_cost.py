"""What batching the vLLM proposer's draft forwards across requests buys on a device: for B requests waiting
between two steps (caches of different lengths, 1 to 4 uncached ids each), the seconds to draft k ids for all
of them one request at a time (`ChainProposer`, as the proposer does with `xtokspec_batched_drafts` off) against
one batched forward per drafted position (`draft_together`, its default), and with `--captured` (a GPU) one
request at a time with each request's steps replayed as CUDA graphs over its own static cache (the proposer's
`xtokspec_draft_graphs`; the caches and their graphs kept from one repetition to the next, as the proposer passes
them to new requests, and every step length recorded before the timed repetitions), and batched forwards over
those same static caches (`captured_together`: what the proposer drafts when batching is the cheaper way). Paired per repetition (the two orders
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
from common import write_manifest

from xtokspec.decode.propose import ChainProposer
from xtokspec.runtime.cache import ModelState
from xtokspec.runtime.compile import GraphedStep
from xtokspec.runtime.kv import sliding_layers
from xtokspec.runtime.models import load
from xtokspec.vllm.batch import draft_together

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
        return load("ja-draft-bpe", "draft")[0].to(device=device, dtype=dtype).eval()
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(CONFIGS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def waiting(model, prompts: list[list[int]], tails: list[int], step=None, pool=None) -> list[ModelState]:
    """One draft state per request as it waits between two vLLM steps: its last `tail` ids not yet cached. With
    `step` (captured): static caches, taken from `pool` (a list, one per row) where it holds them."""
    out = []
    for row, (prompt, tail) in enumerate(zip(prompts, tails, strict=True)):
        if step is None:
            state = ModelState(model, prompt[:-tail])
        else:
            reuse = pool[row] if pool is not None and row < len(pool) else None
            state = ModelState(model, prompt[:-tail], "static", 1024, step, reuse=reuse)
        state.forward(keep=1)
        state.extend(prompt[-tail:])
        out.append(state)
    return out


@torch.inference_mode()
def measure(model, device: str, batch: int, k: int, context: tuple[int, int], reps: int, window: int | None,
            seed: int, step=None) -> dict:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    ways = ["alone", "together"] + (["captured", "captured_together"] if step is not None else [])
    times: dict[str, list[float]] = {way: [] for way in ways}
    same = {way: 0 for way in ways[1:]}
    pool: list = []
    if step is not None:  # every step length each row's cache will replay, recorded before the timed repetitions
        prompt = [rng.randrange(3, vocab) for _ in range(context[1])]
        for tail in range(1, 5):
            states = waiting(model, [prompt] * batch, [tail] * batch, step, pool)
            for s in states:
                ChainProposer(set())._draft_greedy_on_device(s, k)
            pool = [s.kv for s in states]
    for rep in range(reps + 1):  # the first repetition warms up (allocator, kernels) and is not kept
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*context))] for _ in range(batch)]
        tails = [rng.randint(1, 4) for _ in range(batch)]
        drafted = {}
        for way in (ways if rep % 2 == 0 else ways[::-1]):
            states = waiting(model, prompts, tails, step if way.startswith("captured") else None, pool)
            sync(device)
            t0 = time.perf_counter()
            if way in ("together", "captured_together"):
                drafted[way] = draft_together(model, states, k, set(), window=window)[0]
            else:
                drafted[way] = [ChainProposer(set())._draft_greedy_on_device(s, k)[0] for s in states]
            sync(device)
            if rep:
                times[way].append(time.perf_counter() - t0)
            if way.startswith("captured"):
                pool = [s.kv for s in states]
        if rep:
            for way in ways[1:]:
                same[way] += sum(a == b for a, b in zip(drafted["alone"], drafted[way], strict=True))
    row = {"batch": batch, "k": k, "reps": reps, "rows": batch * reps}
    for way in ways:
        row[f"{way}_ms"] = 1e3 * statistics.median(times[way])
    for way in ways[1:]:
        ratios = [a / b for a, b in zip(times["alone"], times[way], strict=True)]
        name = "speedup" if way == "together" else f"{way}_speedup"
        row |= {f"{name}_median": statistics.median(ratios), f"{name}_min": min(ratios), f"{name}_max": max(ratios)}
        row["rows_equal" if way == "together" else f"{way}_rows_equal"] = same[way]
    return row


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
    parser.add_argument("--captured", action="store_true", help="also each request's steps as CUDA graphs (a GPU)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    context = tuple(int(x) for x in args.context.split("-"))
    args.out.mkdir(parents=True, exist_ok=True)
    write_manifest(args.out, args.device)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    results = {"device": device_name, "torch": torch.__version__, "k": args.k, "context": args.context, "drafts": {}}
    for name in args.drafts:
        dtype = getattr(torch, args.dtype) if args.dtype else (
            torch.bfloat16 if args.device.startswith("cuda") and name != "fixture" else torch.float32)
        model = build(name, args.device, dtype)
        window = getattr(model.config, "sliding_window", None) if sliding_layers(model) else None
        step = GraphedStep(model, "draft") if args.captured and not window else None
        if step is not None:
            step.KEPT_CACHES = max(args.batches)
        rows = []
        for batch in args.batches:
            row = measure(model, args.device, batch, args.k, context, args.reps, window, seed=batch, step=step)
            rows.append(row)
            captured = "" if step is None else (
                f"; captured {row['captured_ms']:.2f} ms, {row['captured_speedup_median']:.2f}x"
                f" [{row['captured_speedup_min']:.2f}-{row['captured_speedup_max']:.2f}],"
                f" rows equal {row['captured_rows_equal']}/{row['rows']}; batched over the captured caches"
                f" {row['captured_together_ms']:.2f} ms, {row['captured_together_speedup_median']:.2f}x,"
                f" rows equal {row['captured_together_rows_equal']}/{row['rows']}")
            print(f"{name} ({dtype}) B={batch}: alone {row['alone_ms']:.2f} ms, together {row['together_ms']:.2f} ms,"
                  f" {row['speedup_median']:.2f}x [{row['speedup_min']:.2f}-{row['speedup_max']:.2f}],"
                  f" rows equal {row['rows_equal']}/{row['rows']}{captured}", flush=True)
        results["drafts"][name] = {"dtype": str(dtype), "rows": rows}
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
