"""Token healing (SpecConfig.draft_healing) against the same bridged draft without it, on the real pair.

The committed text ends where the target's last token ends, which for Qwen2.5-Coder's Japanese falls inside one
of Gemma-3's own tokens a quarter of the time (benchmarks/boundary_cuts.py); healing has the draft restate its
last token with a constrained first draw. This runs `xtokspec bench`'s machinery (systems interleaved per
prompt, paired ratios) on the real preset's prompts and seeded held-out ones, with four bridged systems per
mode: healed and `-unhealed`, each with the fallback (what a user gets) and drafting every cycle (`-always`: the
acceptance of every cycle's draft). Beside bench's tables it writes healing.md: per mode, the paired gain in
per-token acceptance (pooled over the prompts' cycles, 95% bootstrap interval over prompts).

    python benchmarks/healing.py --out benchmarks/results/<hardware>/healing [--heldout 10] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import acceptance_counts, bf16_near_tie_bound, cpu_name, pooled_gain, save_report, write_manifest
from distill_agreement import held_out_prompts

from xtokspec.cli.bench import REAL_PROMPTS, run_benchmark
from xtokspec.cli.presets import load_preset
from xtokspec.cli.report import Run, heal_pairs, write_report

GREEDY = "xtokspec-bridged-gemma"  # sampled modes: GREEDY + "-" + the proposal kind (--sampled-proposal)


def acceptance_gains(runs) -> list[dict]:
    """Per mode and healed/unhealed pair: pooled per-token acceptance of each, the gain, its paired interval."""
    out = []
    for mode in dict.fromkeys(r.mode for r in runs):
        names = sorted({r.system for r in runs if r.mode == mode})
        for healed, unhealed in heal_pairs(names):
            gain = pooled_gain(acceptance_counts(runs, unhealed, mode), acceptance_counts(runs, healed, mode))
            out.append({"mode": mode, "healed": healed, "unhealed": unhealed, **gain})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heldout", type=int, default=10, help="seeded held-out prompts after the preset's six")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=["greedy", "T=0.7"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sampled-proposal", choices=("onehot", "auto"), default="onehot",
                        help="the sampled modes' proposal kind: one-hot cycles heal, and auto's one-hot cycles do")
    parser.add_argument("--out", required=True)
    parser.add_argument("--report-only", action="store_true", help="the tables again from OUT/results.json's runs")
    parser.add_argument("--margins", action="store_true",
                        help="only: greedy outputs of the healed draft (every cycle drafting) against the target's "
                             "`generate`, the target's logit margin at each first difference (OUT/margins.json)")
    args = parser.parse_args()
    out = Path(args.out)
    if args.margins:
        torch.set_num_threads(args.threads)
        return margins(out, REAL_PROMPTS + held_out_prompts(0, args.heldout), args.max_new_tokens)
    if args.report_only:
        saved = json.loads((out / "results.json").read_text())
        report(out, saved["meta"], [Run(**r) for r in saved["runs"]])
        return
    torch.set_num_threads(args.threads)
    models = load_preset("real", torch.bfloat16)
    prompts = REAL_PROMPTS + held_out_prompts(0, args.heldout)
    systems = [GREEDY if m == "greedy" else f"{GREEDY}-{args.sampled_proposal}" for m in args.modes]
    only = tuple(name + suffix for name in systems
                 for suffix in ("", "-unhealed", "-always", "-unhealed-always"))
    runs = run_benchmark(models, args.modes, prompts, args.max_new_tokens, tree_widths=(), only=only,
                         always_draft=True, unhealed=True)
    meta = {"preset": "real", "modes": args.modes, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "dtype": "bfloat16", "threads": torch.get_num_threads(), "torch": torch.__version__, "device": "cpu",
            "cpu": cpu_name(), "command": "python benchmarks/healing.py " + " ".join(
                f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items())}
    report(out, meta, runs)


def margins(out: Path, prompts: list[str], new_tokens: int) -> None:
    """Where the healed draft's greedy output differs from the target's own `generate`: the first differing
    position and the target's logit margin there between the two tokens (one plain forward over the prompt and
    the common prefix), against 2 bf16 steps of the logit (tests/test_greedy.py's near-tie bound)."""
    from xtokspec import SpecConfig, XTokSpec
    from xtokspec.cli.presets import real_model_dir
    from xtokspec.distill.evaluate import first_difference
    from xtokspec.runtime.models import load

    target = load(str(real_model_dir("qwen2.5-coder-1.5b")), "target", dtype=torch.bfloat16)
    draft = load(str(real_model_dir("gemma-3-270m")), "draft", dtype=torch.bfloat16)
    model, tokenizer = target
    model.generation_config.repetition_penalty = 1.0
    spec = XTokSpec(target, draft, config=SpecConfig(fallback=False))
    rows = []
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            want = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0, len(ids):].tolist()
        got = spec.generate(prompt, max_new_tokens=new_tokens).token_ids
        with torch.inference_mode():
            diff = first_difference(model, ids, want, got)
        row = {"prompt": prompt, "equal": got == want, "first_difference": diff and diff["token"]}
        if diff:
            row["margin"] = diff["margin"]
            row["bound"] = bf16_near_tie_bound(diff["logit"])
        rows.append(row)
        print(row, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out)
    (out / "margins.json").write_text(json.dumps({"cpu": cpu_name(), "new_tokens": new_tokens, "rows": rows},
                                                 indent=1, ensure_ascii=False))


def report(out: Path, meta: dict, runs: list[Run]) -> None:
    """bench's results.json, table.md and plots, then healing.md / healing.json."""
    table = write_report(out, meta, runs)
    gains = acceptance_gains(runs)
    lines = [f"# Token healing on the real pair ({meta['cpu']}, {meta['threads']} thread(s), bf16)", "",
             "| mode | healed | unhealed | prompts | alpha unhealed | alpha healed | gain [95% CI] |", "|" + "---|" * 7]
    for g in gains:
        lo, hi = g["gain_ci95"]
        lines.append(f"| {g['mode']} | {g['healed']} | {g['unhealed']} | {g['prompts']} | {g['before']:.3f} "
                     f"| {g['after']:.3f} | {g['gain']:+.3f} [{lo:+.3f}, {hi:+.3f}] |")
    save_report(out, "healing", lines, table, {"meta": meta, "gains": gains})


if __name__ == "__main__":
    main()
