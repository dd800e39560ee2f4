"""Several bridged drafts for one target, each with and without token healing, paired per prompt in one run.

For a distilled draft (`xtokspec distill`) against the draft it came from, through the decoder, with healing
(SpecConfig.draft_healing) on and off: per prompt, the target alone (transformers' `generate`) and every
(draft, healing) system run in a shuffled order, greedy, the fallback off (every cycle drafts: the acceptance of
each draft, and what drafting every cycle costs). Writes bench's results.json / table.md (speed ratios paired per
prompt, `-unhealed` twins against their healed systems) and compare.md: each system's pooled per-token
acceptance and its gain over the first draft unhealed, with a 95% bootstrap interval over prompts.

    python benchmarks/draft_compare.py --target ~/.cache/xtokspec/real/qwen2.5-coder-1.5b \\
        --draft base=~/.cache/xtokspec/real/gemma-3-270m --draft distilled=RUN --out DIR

On two cores, one process per core over half the prompts each (`--shard 0/2`, `--shard 1/2`, each its own --out),
then one report over both: `python benchmarks/draft_compare.py --merge DIR0 DIR1 --out DIR`. Speed ratios stay
paired per prompt (each prompt's systems run in one process). `--margins --target T --out DIR` then gives the
target's logit margin wherever a greedy output departs from the target's own (DIR/margins.json).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from common import acceptance_counts, bf16_near_tie_bound, cpu_name, pooled_gain, save_report
from distill_agreement import held_out_prompts

from xtokspec import SpecConfig, XTokSpec
from xtokspec.cli.bench import REAL_PROMPTS
from xtokspec.cli.report import Run, write_report
from xtokspec.runtime.models import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target")
    parser.add_argument("--draft", action="append", metavar="NAME=PATH",
                        help="a draft (repeat; the first is the baseline the gains are measured from)")
    parser.add_argument("--heldout", type=int, default=10, help="seeded held-out prompts after the real preset's six")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shard", default="0/1", metavar="I/N", help="only the prompts whose index is I modulo N")
    parser.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                        help="no run: one report over these shards' results (each written with --shard)")
    parser.add_argument("--margins", action="store_true",
                        help="no run: where each system's greedy output in OUT/outputs.json first differs from the "
                             "target's `generate`, the target's logit margin between the two tokens there "
                             "(OUT/margins.json; needs --target)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.merge:
        return merge([Path(d) for d in args.merge], Path(args.out))
    if args.margins:
        if not args.target:
            parser.error("--margins needs --target")
        return margins(Path(args.target).expanduser(), Path(args.out), REAL_PROMPTS + held_out_prompts(0, args.heldout))
    if not args.target or not args.draft:
        parser.error("--target and at least one --draft are needed (or --merge)")
    shard, shards = (int(x) for x in args.shard.split("/"))
    torch.set_num_threads(args.threads)
    target = load(str(Path(args.target).expanduser()), "target", dtype=torch.bfloat16)
    target[0].generation_config.repetition_penalty = 1.0  # xtokspec implements no repetition penalty
    drafts = {}
    for item in args.draft:
        name, _, path = item.partition("=")
        drafts[name] = load(str(Path(path).expanduser()), f"draft {name}", dtype=torch.bfloat16)
    prompts = REAL_PROMPTS + held_out_prompts(0, args.heldout)
    model, tokenizer = target

    def alone(prompt: str):
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        return out[0, inputs["input_ids"].shape[1]:].tolist(), None

    def ours(spec):
        def run(prompt: str):
            result = spec.generate(prompt, max_new_tokens=args.max_new_tokens)
            return result.token_ids, result.stats
        return run

    systems = {"target": alone}
    for name, pair in drafts.items():
        for healing in (True, False):
            spec = XTokSpec(target, pair, config=SpecConfig(fallback=False, draft_healing=healing))
            systems[f"xtokspec-{name}" + ("" if healing else "-unhealed")] = ours(spec)
    for fn in systems.values():  # warm-up: first calls pay for allocation and lazy init
        fn(prompts[0])
    runs, outputs = [], {}
    for p_index, prompt in enumerate(prompts):
        if p_index % shards != shard:
            continue
        order = list(systems.items())
        random.Random(p_index).shuffle(order)
        for name, fn in order:
            start = time.perf_counter()
            ids, stats = fn(prompt)
            seconds = time.perf_counter() - start
            runs.append(Run(name, "greedy", p_index, seconds, len(ids), stats.target_forwards if stats else len(ids),
                            stats.draft_forwards if stats else 0, stats.as_dict() if stats else {}))
            outputs[name, p_index] = ids
        print(f"prompt {p_index + 1}/{len(prompts)} done", flush=True)
    out = Path(args.out)
    meta = {"preset": "real", "modes": ["greedy"], "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "dtype": "bfloat16", "threads": torch.get_num_threads(), "torch": torch.__version__, "device": "cpu",
            "cpu": cpu_name(), "target": args.target, "drafts": args.draft, "fallback": False, "shard": args.shard}
    report(out, meta, runs, outputs, list(systems))


def merge(dirs: list[Path], out: Path) -> None:
    """One report over shards' results.json and outputs.json (their prompts disjoint)."""
    meta, runs, outputs = None, [], {}
    for d in dirs:
        saved = json.loads((d / "results.json").read_text())
        meta = meta or {**saved["meta"], "shard": "merged: " + " ".join(str(x) for x in dirs)}
        runs += [Run(**r) for r in saved["runs"]]
        for name, by_prompt in json.loads((d / "outputs.json").read_text()).items():
            outputs.update({(name, int(k)): ids for k, ids in by_prompt.items()})
    drafts = [item.partition("=")[0] for item in meta["drafts"]]
    report(out, meta, runs, outputs, ["target"] + [f"xtokspec-{name}{suffix}" for name in drafts
                                                   for suffix in ("", "-unhealed")])


def margins(target_path: Path, out: Path, prompts: list[str]) -> None:
    """Each xtokspec system's first departure from the target's greedy output (`first_difference`: one plain forward
    over the prompt and the common prefix), with the near-tie bound of tests/test_greedy.py (two bf16 steps of the
    target's logit there). A margin past the bound would be a bug, not a floating-point near-tie."""
    from xtokspec.distill.evaluate import first_difference

    outputs = json.loads((out / "outputs.json").read_text())
    model, tokenizer = load(str(target_path), "target", dtype=torch.bfloat16)
    rows = []
    for name, by_prompt in outputs.items():
        if name == "target":
            continue
        for key, got in by_prompt.items():
            prompt_ids = tokenizer(prompts[int(key)])["input_ids"]
            want = outputs["target"][key]
            with torch.inference_mode():
                diff = first_difference(model, prompt_ids, want, got)
            row = {"system": name, "prompt": int(key), "equal": diff is None and len(got) == len(want)}
            if diff:
                row.update(diff, bound=bf16_near_tie_bound(diff["logit"]))
            rows.append(row)
    past = [r for r in rows if "margin" in r and abs(r["margin"]) > r["bound"]]
    (out / "margins.json").write_text(json.dumps({"cpu": cpu_name(), "rows": rows, "past_the_bound": past}, indent=1))
    differ = [r for r in rows if "margin" in r]
    print(f"{len(differ)} of {len(rows)} outputs differ from the target's; margins "
          f"{sorted({round(r['margin'], 4) for r in differ})}; past the near-tie bound: {len(past)}")


def report(out: Path, meta: dict, runs: list[Run], outputs: dict, names: list[str]) -> None:
    """bench's tables, outputs.json, and compare.md: per-token acceptance per system and its gain over the first
    draft unhealed, with how many outputs equal the target's."""
    table = write_report(out, meta, runs)
    prompts = sorted({r.prompt for r in runs})
    by_name = {name: {k: outputs[name, k] for k in prompts} for name in names}
    (out / "outputs.json").write_text(json.dumps(by_name))
    first = next(name for name in names if name != "target")
    base = first if first.endswith("-unhealed") else f"{first}-unhealed"
    lines = [f"# Drafts with and without token healing ({meta['cpu']}, {meta['threads']} thread(s), bf16, "
             f"{len(prompts)} prompts x {meta['max_new_tokens']} tokens, fallback off)", "",
             f"| system | per-token acceptance | gain over {base} [95% CI] | outputs equal to the target's |",
             "|---|---|---|---|"]
    rows = []
    for name in names:
        if name == "target":
            continue
        gain = pooled_gain(acceptance_counts(runs, base), acceptance_counts(runs, name))
        lo, hi = gain["gain_ci95"]
        equal = sum(outputs[name, k] == outputs["target", k] for k in prompts)
        rows.append({"system": name, **gain, "equal": equal})
        lines.append(f"| {name} | {gain['after']:.3f} | {gain['gain']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {equal}/{len(prompts)} |")
    save_report(out, "compare", lines, table, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
