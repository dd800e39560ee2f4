"""The vLLM proposer's own seconds per step by how its requests draft, without vLLM (which does not run on the GPU
machine here): a simulated engine verifies every running request's proposal greedily with the fixture target
and hands the proposer its rows as vLLM does; only the proposer's `propose` calls are timed.

Ways (K drafted by every request at every step, so that the ways alone differ; the fixture draft, float32):
- `batched`: batched eager forwards over dynamic caches (the default without CUDA graphs);
- `captured`: each request's steps replayed as CUDA graphs over its own static cache;
- `chosen`: captured caches, each step the cheaper of batched forwards over them and each request's graphs, as
  measured (`StepCosts.way`; the default on a GPU where the caches fit).

Per batch size: one wave of requests to warm up (graphs recorded, costs measured), then `--waves` timed waves of
other prompts; proposals are compared with `batched`'s (float32: equal, or a near-tie where kernels differ).

    python benchmarks/proposer_ways.py --device cuda --batches 1 4 8 16 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from pathlib import Path

import torch
from common import write_manifest

from xtokspec.runtime.models import load
from xtokspec.vllm.proposer import TextBridgeProposer

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "fixtures" / "models"
WAYS = {"batched": {"xtokspec_draft_graphs": False},
        "captured": {"xtokspec_draft_graphs": True, "xtokspec_batched_drafts": False},
        "chosen": {"xtokspec_draft_graphs": True}}


def vllm_config(device: str, max_seqs: int, k: int, extra: dict):
    """What the proposer reads of vLLM's VllmConfig, for the fixture target."""
    target = MODELS / "ja-target"
    model_config = types.SimpleNamespace(
        tokenizer=str(target), tokenizer_revision=None, trust_remote_code=False, dtype=torch.float32,
        max_model_len=512, get_vocab_size=lambda: 8000, try_get_generation_config=lambda: {"eos_token_id": 2})
    return types.SimpleNamespace(
        model_config=model_config, speculative_config=types.SimpleNamespace(num_speculative_tokens=k),
        additional_config={"xtokspec_draft": str(MODELS / "ja-draft-bpe"), "xtokspec_adaptive": False, **extra},
        device_config=types.SimpleNamespace(device=device), scheduler_config=types.SimpleNamespace(max_num_seqs=max_seqs))


@torch.inference_mode()
def serve(target, proposer, prompts: list[list[int]], new_tokens: int) -> tuple[list[float], list]:
    """Every request to `new_tokens` ids, all running together -> (seconds of each propose call, the proposals)."""
    seqs = [list(p) for p in prompts]
    ends = [len(p) + new_tokens for p in prompts]
    proposals = [[] for _ in prompts]
    waiting = [[] for _ in prompts]
    times, new = [], [[] for _ in prompts]
    while True:
        live = [n for n in range(len(seqs)) if len(seqs[n]) < ends[n]]
        if not live:
            return times, proposals
        for n in live:  # verify the last proposal greedily: accepted ids, then the target's own
            proposal = waiting[n]
            best = target(torch.tensor([seqs[n] + proposal], device=target.device)).logits[0, len(seqs[n]) - 1 :]
            best = best.argmax(-1).tolist()
            a = 0
            while a < len(proposal) and proposal[a] == best[a]:
                a += 1
            new[n] = (proposal[:a] + [best[a]])[: ends[n] - len(seqs[n])]
            seqs[n] += new[n]
        live = [n for n in live if len(seqs[n]) < ends[n]]
        if not live:
            return times, proposals
        width = max(len(seqs[n]) for n in live)
        tokens = torch.zeros((len(live), width), dtype=torch.long).numpy()
        for r, n in enumerate(live):
            tokens[r, : len(seqs[n])] = seqs[n]
        t0 = time.perf_counter()
        out = proposer.propose([new[n] for n in live], [len(seqs[n]) for n in live], tokens)
        times.append(time.perf_counter() - t0)
        for r, n in enumerate(live):
            waiting[n] = out[r]
            proposals[n].append(out[r])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8, 16])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_manifest(args.out, args.device)
    target, tokenizer = load("ja-target", "target")
    target = target.to(args.device).eval()
    lines = [line for line in (ROOT / "fixtures" / "data" / "heldout.txt").read_text(encoding="utf-8").splitlines()
             if line.strip()]
    prompts = [tokenizer(line)["input_ids"] for line in lines]
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    results = {"device": name, "torch": torch.__version__, "k": args.k, "new_tokens": args.new_tokens, "rows": []}
    for batch in args.batches:
        row = {"batch": batch}
        runs = {}
        for way, extra in WAYS.items():
            proposer = TextBridgeProposer(vllm_config(args.device, max(batch, 2), args.k, extra))
            serve(target, proposer, prompts[:batch], args.new_tokens)  # warm-up: graphs, measured costs
            stats0 = proposer.stats.batched_forwards, proposer.stats.calls
            times, proposals = [], []
            for wave in range(args.waves):
                first = batch * (wave + 1)
                t, p = serve(target, proposer, prompts[first : first + batch], args.new_tokens)
                times += t
                proposals += p
            runs[way] = proposals
            batched_calls = (proposer.stats.batched_forwards - stats0[0]) / args.k
            row[way] = {"ms_per_step": 1e3 * statistics.mean(times), "median_ms": 1e3 * statistics.median(times),
                        "steps": len(times), "batched_share": batched_calls / max(1, proposer.stats.calls - stats0[1])}
        for way in ("captured", "chosen"):
            row[way]["proposals_equal"] = sum(a == b for a, b in zip(runs[way], runs["batched"], strict=True))
        row["requests"] = len(runs["batched"])
        results["rows"].append(row)
        print(f"B={batch}: " + "; ".join(f"{w} {row[w]['ms_per_step']:.2f} ms/step (batched {row[w]['batched_share']:.0%})"
                                         for w in WAYS)
              + f"; proposals equal to batched's: captured {row['captured']['proposals_equal']}/{row['requests']},"
              f" chosen {row['chosen']['proposals_equal']}/{row['requests']}", flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
