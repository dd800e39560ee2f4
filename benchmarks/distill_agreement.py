"""How much distilled drafts gained, on enough held-out prompts to tell: the teacher-forced agreement of each
draft with the target's greedy text per target token (`xtokspec.distill.pipeline.agreement`), against the draft it was distilled from,
with a 95% bootstrap interval over prompts on each gain (paired: every draft scores the same continuations).

`xtokspec distill` evaluates through the decoder, a timed generation per prompt and draft, so it runs on a dozen
prompts; at that size the gains of a short distillation sit inside the interval. This scores hundreds of
prompts in minutes: the target continues them once (vLLM when installed, else transformers' `generate`; the
continuations are kept in OUT/references.jsonl and reused), then each draft needs one forward per prompt.

Prompts: the first `--from-prompts` lines of fixtures/data/prompts.txt and `--from-heldout` paragraphs of
fixtures/data/heldout.txt cut to a seeded 20-60 characters: the evaluation text, which no distillation here
trains on.

    python benchmarks/distill_agreement.py --target ~/.cache/xtokspec/real/qwen2.5-coder-1.5b \\
        --base ~/.cache/xtokspec/real/gemma-3-270m --distilled RUN1 RUN2 ... --out DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from pathlib import Path

import torch
from common import write_manifest

from xtokspec.distill.pipeline import agreement, continue_prompts
from xtokspec.runtime.models import load

DATA = Path(__file__).resolve().parent.parent / "fixtures" / "data"


def held_out_prompts(from_prompts: int, from_heldout: int, seed: int = 1) -> list[str]:
    prompts = [p for p in (DATA / "prompts.txt").read_text(encoding="utf-8").splitlines() if p.strip()]
    paragraphs = [p for p in (DATA / "heldout.txt").read_text(encoding="utf-8").splitlines() if len(p) > 60]
    rng = random.Random(seed)
    rng.shuffle(paragraphs)
    return prompts[:from_prompts] + [p[: rng.randint(20, 60)] for p in paragraphs[:from_heldout]]


def references(target: str, prompts: list[str], new_tokens: int, dtype: str, engine: str, path: Path) -> list[dict]:
    """The target's greedy continuations of `prompts`, from `path` when it holds exactly those."""
    if path.exists():
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        if [r["prompt"] for r in records] == prompts:
            return records
    model, tokenizer = load(target, "target", dtype=getattr(torch, dtype))
    generator = None
    if engine == "vllm":
        from xtokspec.distill.data import VllmGenerator

        generator = VllmGenerator(target, dtype=dtype)
    records = []
    for i in range(0, len(prompts), 64):
        records += continue_prompts(model, tokenizer, prompts[i : i + 64], "greedy", new_tokens, 0, generator=generator)
        print(f"target continued {len(records)}/{len(prompts)} prompts", flush=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--base", required=True, help="the draft the others were distilled from")
    parser.add_argument("--distilled", nargs="+", required=True, help="distilled draft folders")
    parser.add_argument("--from-prompts", type=int, default=64)
    parser.add_argument("--from-heldout", type=int, default=192)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--engine", default="vllm" if importlib.util.find_spec("vllm") else "transformers",
                        choices=["vllm", "transformers"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_manifest(args.out)
    prompts = held_out_prompts(args.from_prompts, args.from_heldout)
    records = references(args.target, prompts, args.new_tokens, args.dtype, args.engine, args.out / "references.jsonl")
    from transformers import AutoTokenizer

    target_tokenizer = AutoTokenizer.from_pretrained(args.target)  # the unit: the target's tokens
    base = load(args.base, "base draft", dtype=getattr(torch, args.dtype))
    rows = []
    for folder in args.distilled:
        after = load(folder, "distilled draft", dtype=getattr(torch, args.dtype))
        result = agreement((None, target_tokenizer), {"before": base, "after": after}, prompts, args.new_tokens,
                           progress=False, records=records)
        report = Path(folder) / "distill_report.json"
        decoder = json.loads(report.read_text(encoding="utf-8")).get("evaluation") if report.exists() else None
        result.update(run=Path(folder).name, decoder=decoder and {k: decoder[k] for k in ("prompts", "gain")})
        rows.append(result)
        print(f"{result['run']}: {result['before']:.3f} -> {result['after']:.3f} "
              f"({result['gain']:+.3f}, 95% {result['gain_ci95'][0]:+.3f} to {result['gain_ci95'][1]:+.3f})", flush=True)
        del after
    summary = {"target": args.target, "base": args.base, "prompts": len(prompts), "new_tokens": args.new_tokens,
               "dtype": args.dtype, "rows": rows}
    (args.out / "agreement.json").write_text(json.dumps(summary, ensure_ascii=False, indent=1), encoding="utf-8")
    print("\n| run | agreement before -> after | gain [95% interval] | decoder's acceptance gain (prompts) |")
    print("|---|---|---|---|")
    for r in rows:
        dec = r["decoder"]
        dec_text = f"{dec['gain']['token_acceptance']:+.3f} ({dec['prompts']})" if dec and dec.get("gain") else "-"
        print(f"| {r['run']} | {r['before']:.3f} -> {r['after']:.3f} | {r['gain']:+.3f} "
              f"[{r['gain_ci95'][0]:+.3f}, {r['gain_ci95'][1]:+.3f}] | {dec_text} |")


if __name__ == "__main__":
    main()
