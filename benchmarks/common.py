"""Helpers the benchmark scripts share (run them as `python benchmarks/NAME.py`, which puts this folder on the
import path)."""

from __future__ import annotations

import platform
import sys
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (or what the platform says elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_real(name: str, dtype):
    """A real model converted by benchmarks/real_models.py -> (model, tokenizer), ready for greedy comparisons."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xtokspec.cli.presets import real_model_dir

    path = real_model_dir(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.repetition_penalty = 1.0  # xtokspec implements no repetition penalty
    return model, AutoTokenizer.from_pretrained(path)


def bf16_near_tie_bound(logit: float) -> float:
    """The largest gap between two bfloat16 logits that rounding explains, at a logit of this size: 2 units in the
    last place of its magnitude (tests/test_greedy.py's near-tie bound, 2 * 2^-7 * |logit|)."""
    import torch

    return 2 * torch.finfo(torch.bfloat16).eps * max(abs(logit), 1.0)


def acceptance_counts(runs, system: str, mode: str | None = None) -> dict[int, tuple[int, int]]:
    """prompt -> (accepted proposals, accepted + rejections) of one system's runs (in one mode, where given): the
    per-token acceptance's hits and positions, for `pooled_gain`."""
    return {r.prompt: (r.stats["accepted"], r.stats["accepted"] + r.stats["rejections"]) for r in runs
            if r.system == system and (mode is None or r.mode == mode)}


def pooled_gain(before: dict, after: dict) -> dict:
    """Per-token acceptance pooled over prompts, before and after, from {prompt: (accepted, positions)} of the
    same prompts -> both shares, the gain, and its 95% bootstrap interval over prompts (paired)."""
    from xtokspec.distill.evaluate import paired_interval

    keys = sorted(before.keys() & after.keys())
    pairs_before, pairs_after = [before[k] for k in keys], [after[k] for k in keys]

    def share(pairs):
        return sum(h for h, _ in pairs) / max(1, sum(n for _, n in pairs))

    return {"prompts": len(keys), "before": share(pairs_before), "after": share(pairs_after),
            "gain": share(pairs_after) - share(pairs_before), "gain_ci95": paired_interval(pairs_before, pairs_after),
            "positions": [sum(n for _, n in pairs_before), sum(n for _, n in pairs_after)]}


def save_report(out: Path, stem: str, lines: list[str], table: str, payload: dict) -> None:
    """OUT/STEM.md (the lines, then bench's tables) and OUT/STEM.json; the Markdown is printed too."""
    import json

    text = "\n".join(lines) + "\n\n" + table + "\n"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1, ensure_ascii=False))
    print(text)


def write_manifest(out: Path, device: str | None = None, argv: list[str] | None = None, **extra) -> Path:
    """OUT/manifest.json for this script's run: commit, machine (CPU flags or GPU), torch and transformers
    versions, the command as typed from the repository root (`python benchmarks/NAME.py ARGS`), the date
    (xtokspec.cli.common.manifest). Every script that writes a result folder calls it when it starts writing."""
    import shlex

    from xtokspec.cli.common import write_manifest as write

    script = Path(sys.argv[0]).name
    words = sys.argv[1:] if argv is None else argv
    return write(Path(out), "python " + shlex.join([f"benchmarks/{script}", *words]), device, **extra)


def lower_bound(ratios: list[float], seed: int = 0) -> float:
    """One-sided 95% bootstrap lower bound of the median of `ratios` (percentile method, fixed rng)."""
    import numpy as np
    from scipy import stats

    if len(ratios) < 2:
        return float("nan")
    if len(set(ratios)) == 1:
        return ratios[0]  # every resample has this median
    data = (np.asarray(ratios, dtype=float),)
    try:
        result = stats.bootstrap(data, np.median, confidence_level=0.95, alternative="greater",
                                 method="percentile", n_resamples=9999, rng=np.random.default_rng(seed))
    except TypeError:  # scipy before 1.15 (no rng) or 1.12 (no alternative): the two-sided 90% interval's low end
        result = stats.bootstrap(data, np.median, confidence_level=0.90, method="percentile",
                                 n_resamples=9999, random_state=np.random.default_rng(seed))
    return float(result.confidence_interval.low)


class NullProposer:
    """A vLLM `custom_class` proposer that never proposes (`vllm_bench.py`'s `null` system): what vLLM's speculative
    path costs by itself, every step verifying zero drafted tokens, against the target alone."""

    def __init__(self, vllm_config, *args, **kwargs):
        self.k = vllm_config.speculative_config.num_speculative_tokens

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load."""

    def dummy_run(self, *args, **kwargs) -> None:
        """Nothing to warm up."""

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]
