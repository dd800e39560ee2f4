"""Token healing (SpecConfig.draft_healing) against the same bridged draft without it, on the real pair.

The committed text ends where the target's last token ends, which for Qwen2.5-Coder's Japanese falls inside one
of Gemma-3's own tokens a quarter of the time (benchmarks/boundary_cuts.py); healing has the draft restate its
last token with a constrained first draw. This runs `xtokspec bench`'s machinery (systems interleaved per
prompt, paired ratios) on the real preset's prompts and seeded held-out ones, with four bridged systems per
mode: healed and `-unhealed`, each with the fallback (what a user gets) and drafting every cycle (`-always`: the
acceptance of every cycle's draft). Beside bench's tables it writes healing.md: per mode, the paired gain in
per-token acceptance (pooled over the prompts' cycles, 95% bootstrap interval over prompts).

    python benchmarks/healing.py --out benchmarks/healing-<cpu> [--heldout 10] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import cpu_name, pooled_gain, save_report
from distill_agreement import held_out_prompts

from xtokspec.bench import REAL_PROMPTS, load_preset, run_benchmark
from xtokspec.report import Run, heal_pairs, write_report

SYSTEMS = {"greedy": "xtokspec-bridged-gemma", "T=0.7": "xtokspec-bridged-gemma-onehot"}


def counts(runs, mode: str, system: str) -> dict[int, tuple[int, int]]:
    """prompt -> (accepted proposals, accepted + rejections): the per-token acceptance's hits and positions."""
    return {r.prompt: (r.stats["accepted"], r.stats["accepted"] + r.stats["rejections"]) for r in runs
            if r.mode == mode and r.system == system}


def acceptance_gains(runs) -> list[dict]:
    """Per mode and healed/unhealed pair: pooled per-token acceptance of each, the gain, its paired interval."""
    out = []
    for mode in dict.fromkeys(r.mode for r in runs):
        names = sorted({r.system for r in runs if r.mode == mode})
        for healed, unhealed in heal_pairs(names):
            gain = pooled_gain(counts(runs, mode, unhealed), counts(runs, mode, healed))
            out.append({"mode": mode, "healed": healed, "unhealed": unhealed, **gain})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heldout", type=int, default=10, help="seeded held-out prompts after the preset's six")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=["greedy", "T=0.7"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--report-only", action="store_true", help="the tables again from OUT/results.json's runs")
    args = parser.parse_args()
    out = Path(args.out)
    if args.report_only:
        saved = json.loads((out / "results.json").read_text())
        report(out, saved["meta"], [Run(**r) for r in saved["runs"]])
        return
    torch.set_num_threads(args.threads)
    models = load_preset("real", torch.bfloat16)
    prompts = REAL_PROMPTS + held_out_prompts(0, args.heldout)
    only = tuple(name + suffix for name in (SYSTEMS[m] for m in args.modes)
                 for suffix in ("", "-unhealed", "-always", "-unhealed-always"))
    runs = run_benchmark(models, args.modes, prompts, args.max_new_tokens, tree_widths=(), only=only,
                         always_draft=True, unhealed=True)
    meta = {"preset": "real", "modes": args.modes, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "dtype": "bfloat16", "threads": torch.get_num_threads(), "torch": torch.__version__, "device": "cpu",
            "cpu": cpu_name(), "command": "python benchmarks/healing.py " + " ".join(
                f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items())}
    report(out, meta, runs)


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
