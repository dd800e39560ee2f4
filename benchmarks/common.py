"""Helpers the benchmark scripts share (run them as `python benchmarks/NAME.py`, which puts this folder on the
import path)."""

from __future__ import annotations

import platform
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

    from xtokspec.bench import real_model_dir

    path = real_model_dir(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.repetition_penalty = 1.0  # xtokspec implements no repetition penalty
    return model, AutoTokenizer.from_pretrained(path)
