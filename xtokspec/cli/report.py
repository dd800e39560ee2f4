"""The figures of an `xtokspec bench` run, from its timed runs: summaries, paired comparisons, tables, plots.

Each speedup is the ratio of the target-alone time per token to the system's on the same prompt, and figures are
medians over prompts with their interquartile range; two systems are compared head to head by their per-prompt
ratio, with a 95% bootstrap interval of its mean.

Theory: with per-token acceptance a, K proposals per cycle, a cycle commits (1 - a^(K+1)) / (1 - a) tokens
(Leviathan et al. 2023) and costs K draft steps plus one verification; "of theory" is the measured speedup
over that bound computed from the measured per-call costs.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..types import XTokSpecError, expected_tokens


@dataclass
class Run:
    system: str
    mode: str
    prompt: int
    seconds: float
    new_tokens: int
    target_calls: int
    draft_calls: int
    stats: dict = field(default_factory=dict)  # xtokspec's own GenerationStats, when it is xtokspec
    stopped_eos: bool = False  # the continuation ended with the target's EOS

    @property
    def seconds_per_token(self) -> float:
        # NOTE: per token: sampled runs of the same prompt can stop (EOS) at different lengths
        return self.seconds / max(self.new_tokens, 1)


def _median_iqr(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), q[0], q[2]


def theoretical_speedup(stats: dict, target_step: float) -> float | None:
    """Speedup the measured acceptance and per-call costs allow: tokens per cycle over cost per cycle.

    With per-token acceptance a, a cycle with K proposals commits (1 - a^(K+1)) / (1 - a) tokens on average;
    this is averaged over the cycles' actual K, and divided by the measured draft + verify seconds per cycle
    in units of a target-alone step. None where most cycles ran the target alone (`SpecConfig.fallback`): the bound
    would then weigh the loop's own target step against the baseline's (under CUDA graphs, several times faster),
    not what drafting allows.
    """
    if not stats or not stats["target_forwards"] or not stats["drafted"]:
        return None
    if 2 * stats.get("alone_cycles", 0) > stats["target_forwards"]:
        return None
    if stats.get("proposal", "").endswith(" tree"):
        # NOTE: eq. 1 describes a chain; a tree's proposals are nodes, not a row, so the figure would be
        # meaningless (tokens per target call is the tree's measure)
        return None
    cycles = stats["target_forwards"]
    a = min(stats["token_acceptance"], 0.999)
    lengths = stats.get("proposal_lengths") or [stats["drafted"] / cycles]
    tokens = sum(expected_tokens(a, k) for k in lengths) / len(lengths)
    cost = (stats["draft_seconds"] + stats["verify_seconds"]) / cycles
    return tokens / (cost / target_step)


def summarize(runs: list[Run]) -> list[dict]:
    """One row per (mode, system) with medians over prompts and spreads."""
    rows = []
    target_step = {(r.mode, r.prompt): r.seconds_per_token for r in runs if r.system == "target"}
    for mode in dict.fromkeys(r.mode for r in runs):
        target = [r for r in runs if r.mode == mode and r.system == "target"]
        for system in dict.fromkeys(r.system for r in runs if r.mode == mode):
            sel = [r for r in runs if r.mode == mode and r.system == system]
            speedups = [target_step[(mode, r.prompt)] / r.seconds_per_token for r in sel]
            med, lo, hi = _median_iqr(speedups)
            row = {
                "mode": mode, "system": system, "prompts": len(sel),
                "tokens_per_s": statistics.median(r.new_tokens / r.seconds for r in sel),
                "speedup": med, "speedup_q1": lo, "speedup_q3": hi, "speedups": speedups,
                "tokens_per_target_call": statistics.median(r.new_tokens / max(r.target_calls, 1) for r in sel),
                "target_calls_per_token": statistics.median(r.target_calls / max(r.new_tokens, 1) for r in sel),
            }
            ours = [r for r in sel if r.stats]
            if ours:
                row["acceptance_rate"] = statistics.median(r.stats["acceptance_rate"] for r in ours)
                row["token_acceptance"] = statistics.median(r.stats["token_acceptance"] for r in ours)
                row["bridge_share"] = statistics.median(r.stats["bridge_seconds"] / r.seconds for r in ours)
                theory = [theoretical_speedup(r.stats, target_step[(mode, r.prompt)]) for r in ours]
                shares = [s / t for s, t in zip(speedups, theory, strict=True) if t]
                # NOTE: only where most prompts have a bound: not the few that drafted in a mostly-alone row
                shown = 2 * len(shares) >= len(ours)
                row["theory_speedup"] = statistics.median(t for t in theory if t) if shown else None
                row["of_theory"] = statistics.median(shares) if shown else None
            if mode != "greedy":
                row.update(eos_check(sel, target))
            rows.append(row)
    return rows


EOS_ALARM = 1e-3  # Fisher p-value below which the EOS-stop share is taken as a sign of a wrong distribution


def eos_check(sel: list[Run], target: list[Run]) -> dict:
    """Share of continuations that stopped at EOS, and Fisher's exact test against the target alone's share.

    A lossless sampler stops at EOS as often as the target does; p < EOS_ALARM flags a sampler whose output
    is not distributed like the target's. One sample per prompt, so the test only sees large differences;
    pooling prompts of different stop chances makes it conservative (the false-alarm rate is <= EOS_ALARM).
    """
    from scipy.stats import fisher_exact

    k, kt = sum(r.stopped_eos for r in sel), sum(r.stopped_eos for r in target)
    p = fisher_exact([[k, len(sel) - k], [kt, len(target) - kt]]).pvalue
    return {"eos_share": k / len(sel), "eos_p": float(p)}


def paired(runs: list[Run], mode: str, a: str, b: str, resamples: int = 10_000) -> dict | None:
    """Speed of system a over system b on the same prompts: median per-prompt ratio, 95% bootstrap CI, wins.

    The ratio is b's seconds per token over a's, so > 1 means a is faster. The interval is scipy's percentile
    bootstrap of the mean ratio, prompts resampled (each prompt's pair stays together), from a fixed seed.
    """
    import numpy as np
    from scipy.stats import bootstrap

    time_a = {r.prompt: r.seconds_per_token for r in runs if r.mode == mode and r.system == a}
    time_b = {r.prompt: r.seconds_per_token for r in runs if r.mode == mode and r.system == b}
    common = sorted(time_a.keys() & time_b.keys())
    if not common:
        return None
    ratios = np.array([time_b[i] / time_a[i] for i in common])
    low = high = float(ratios[0])  # NOTE: one prompt: every resample is that prompt (scipy wants two or more)
    if len(ratios) > 1:
        ci = bootstrap((ratios,), np.mean, n_resamples=resamples, confidence_level=0.95, method="percentile",
                       random_state=np.random.default_rng(0)).confidence_interval
        low, high = float(ci.low), float(ci.high)
    return {"mode": mode, "a": a, "b": b, "prompts": len(common), "median_ratio": float(np.median(ratios)),
            "mean_ratio": float(ratios.mean()), "ci_low": low, "ci_high": high, "wins": int((ratios > 1).sum())}


# (a, b): the head-to-head comparisons against the peers, when both systems ran
PAIRS = [("xtokspec-same", "hf-assisted"), ("xtokspec-bridged", "hf-universal"),
         ("xtokspec-bridged", "xtokspec-same"), ("xtokspec-bridged", "xtokspec-bridged-fixed-k"),
         ("xtokspec-bridged-intersection", "xtokspec-bridged-onehot"),
         ("xtokspec-bridged-intersection", "hf-universal"), ("xtokspec-bridged-onehot", "hf-universal"),
         ("xtokspec-bridged-gemma", "hf-universal"), ("xtokspec-bridged-gemma", "xtokspec-same"),
         ("xtokspec-bridged-gemma", "xtokspec-bridged-gemma-fixed-k"),
         ("xtokspec-bridged-gemma-intersection", "hf-universal"), ("xtokspec-bridged-gemma-onehot", "hf-universal"),
         ("xtokspec-bridged-gemma-intersection", "xtokspec-bridged-gemma-onehot"),
         ("xtokspec-bridged-auto", "xtokspec-bridged-onehot"), ("xtokspec-bridged-auto", "xtokspec-bridged-intersection"),
         ("xtokspec-bridged-gemma-auto", "xtokspec-bridged-gemma-onehot"),
         ("xtokspec-bridged-gemma-auto", "xtokspec-bridged-gemma-intersection"),
         ("xtokspec-bridged-smollm", "hf-universal-smollm"),
         ("xtokspec-same-static", "xtokspec-same"), ("xtokspec-bridged-static", "xtokspec-bridged"),
         ("xtokspec-bridged-gemma-static", "xtokspec-bridged-gemma")]


def tree_pairs(names) -> list[tuple[str, str]]:
    """Each token-tree system against the chains it competes with: the same draft's chains (greedy; one-hot,
    intersection and auto sampling) and the same-tokenizer chain; each `-always` twin against its default, and
    always-drafting trees against always-drafting chains."""
    out = []
    for name in names:
        if name.endswith("-always"):  # always drafting: against the default (fallback) twin, and trees vs chains
            twin = name.removesuffix("-always")
            out.append((twin, name))
            if "-tree" in twin and not twin.endswith(("-all", "-top", "-trim")):
                base = twin.rsplit("-tree", 1)[0]
                out += [(name, f"{base}{kind}-always") for kind in ("", "-intersection", "-onehot", "-auto")]
                out.append((name, "xtokspec-same-always"))
            continue
        if "-tree" not in name:
            continue
        base, shape = name.rsplit("-tree", 1)
        if shape.endswith("-all"):  # the unpruned tree: against its pruned twin only
            out.append((name.removesuffix("-all"), name))
            continue
        if shape.endswith("-top"):  # the one-hot root: against its sampled-root twin only
            out.append((name.removesuffix("-top"), name))
            continue
        if shape.endswith("-trim"):  # the trimmed draft head: against the full head, and the trimmed auto chain
            out += [(name, name.removesuffix("-trim")), (name, base + "-auto-trim")]
            continue
        out += [(name, base), (name, base + "-intersection"), (name, base + "-onehot"), (name, base + "-auto"),
                (name, "xtokspec-same")]
    return out


def trim_pairs(names) -> list[tuple[str, str]]:
    """Each chain with a trimmed draft head (`-trim`) against the same chain with the full head."""
    return [(name, name.removesuffix("-trim")) for name in names if name.endswith("-trim") and "-tree" not in name]


def heal_pairs(names) -> list[tuple[str, str]]:
    """Each system that heals the draft's last token against its `-unhealed` twin (bench --unhealed)."""
    return [(name.replace("-unhealed", ""), name) for name in names if "-unhealed" in name]


def static_target_pairs(names) -> list[tuple[str, str]]:
    """Each system against `target-static` (transformers' compiled target alone), where that ran: on a GPU the
    "speedup" column's eager target is not the fastest way to run the target alone."""
    if "target-static" not in names:
        return []
    return [(name, "target-static") for name in names if name.startswith("xtokspec-")] + [("target-static", "target")]


def comparisons(runs: list[Run]) -> list[dict]:
    out = []
    names = sorted({r.system for r in runs})
    for mode in dict.fromkeys(r.mode for r in runs):
        for a, b in PAIRS + tree_pairs(names) + trim_pairs(names) + heal_pairs(names) + static_target_pairs(names):
            result = paired(runs, mode, a, b)
            if result:
                out.append(result)
    return out


def comparison_table(rows: list[dict]) -> str:
    lines = ["| mode | system | vs | speed ratio, median per prompt | mean [95% bootstrap CI] | faster on |",
             "|" + "---|" * 6]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['a']} | {r['b']} | {r['median_ratio']:.2f} | {r['mean_ratio']:.2f} "
                     f"[{r['ci_low']:.2f}-{r['ci_high']:.2f}] | {r['wins']}/{r['prompts']} prompts |")
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    def fmt(v, spec=".2f"):
        return "–" if v is None else format(v, spec)

    lines = ["| mode | system | tokens/s | speedup (IQR) | alpha | accepted share | tokens/target call | target calls/token "
             "| bridge share | theory | of theory | EOS stops (Fisher p vs target) |", "|" + "---|" * 12]
    for r in rows:
        eos = "–" if "eos_share" not in r else f"{r['eos_share']:.0%} (p={r['eos_p']:.2g})"
        lines.append(
            f"| {r['mode']} | {r['system']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x "
            f"({r['speedup_q1']:.2f}-{r['speedup_q3']:.2f}) | {fmt(r.get('token_acceptance'))} | {fmt(r.get('acceptance_rate'))} "
            f"| {r['tokens_per_target_call']:.2f} | {r['target_calls_per_token']:.2f} "
            f"| {fmt(r.get('bridge_share'), '.1%')} | {fmt(r.get('theory_speedup'))} | {fmt(r.get('of_theory'), '.0%')} "
            f"| {eos} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, title: str) -> list[Path]:
    try:
        import matplotlib
    except ImportError as err:
        raise XTokSpecError("xtokspec bench draws its plots with matplotlib: pip install 'xtokspec[bench]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 4.2), sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        sel = [r for r in rows if r["mode"] == mode]
        ax.boxplot([r["speedups"] for r in sel])
        names = [r["system"] + (" *" if r.get("eos_p", 1.0) < EOS_ALARM else "") for r in sel]
        ax.set_xticks(range(1, len(sel) + 1), names, rotation=60, ha="right", fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(mode)
    axes[0][0].set_ylabel("speedup over the target alone (per prompt)")
    fig.suptitle(title)
    fig.tight_layout()
    if any(r.get("eos_p", 1.0) < EOS_ALARM for r in rows):
        fig.text(0.01, 0.01, f"* stops at EOS unlike the target (Fisher p < {EOS_ALARM:g}): not target-distributed",
                 fontsize=7)
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    temps = [m for m in modes if m.startswith("T=")]
    if temps:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        xs = [float(m[2:]) for m in temps]
        for system in dict.fromkeys(r["system"] for r in rows if r["mode"] in temps and r["system"] != "target"):
            sel = [next((r for r in rows if r["mode"] == m and r["system"] == system), {}) for m in temps]
            ys = [r.get("speedup") for r in sel]
            # NOTE: a sampler whose EOS stops differ from the target's (p < 0.001) is drawn dashed and named:
            # its speed is not that of sampling the target's distribution.
            flagged = [t for t, r in zip(temps, sel, strict=True) if r.get("eos_p", 1.0) < EOS_ALARM]
            label = system + (f" (not target-distributed at {', '.join(flagged)}: EOS check)" if flagged else "")
            ax.plot(xs, ys, marker="o", label=label, ls="--" if flagged else "-")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("sampling temperature (draft samples at the target's temperature)")
        ax.set_ylabel("median speedup over the target alone")
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "speedup_vs_temperature.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def write_report(out: Path, meta: dict, runs: list[Run]) -> str:
    """results.json (every run and figure), table.md and the plots; returns the tables as Markdown."""
    rows = summarize(runs)
    pairs = comparisons(runs)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(rows) + "\n\n" + comparison_table(pairs)
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": rows, "comparisons": pairs,
                                                  "runs": [r.__dict__ for r in runs]}, indent=1, ensure_ascii=False))
    (out / "table.md").write_text(table + "\n")
    plot(rows, out, f"xtokspec bench ({meta['preset']}, {meta['max_new_tokens']} new tokens, {meta['device']})")
    return table
