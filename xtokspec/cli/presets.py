"""The bench's models: the presets (the bundled fixtures, or real models a checkout's benchmarks/real_models.py
converted), their folders, and the calibration text for a trimmed draft head."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..runtime.models import fixture_model, fixtures_dir, onednn_linears
from ..types import XTokSpecError

CACHE_ENV = "XTOKSPEC_CACHE"  # where benchmarks/real_models.py puts the converted real models
MARKER_FILE = "xtokspec-asset.json"  # written last by the conversion: the folder is complete


@dataclass
class Counter:
    """Counts forward calls of a model with a hook."""

    calls: int = 0

    def hook(self, module, args, kwargs, output):
        self.calls += 1


@dataclass
class Models:
    target: tuple
    draft_same: tuple | None
    draft_cross: tuple | None
    cross_label: str = "bridged"
    draft_cross_hf: tuple | None = None  # a private copy of draft_cross for transformers' universal mode
    extra_cross: dict = field(default_factory=dict)  # label -> (model, tokenizer): more drafts, greedy only
    draft_cross_hf_sampled: tuple | None = None  # another copy, for the universal mode's sampling

    def __post_init__(self):
        import copy

        # NOTE: transformers' universal sampler swaps the assistant's input embedding (and may prune its head)
        # in place, once per tokenizer pair (it caches the mapping), and its greedy path then fails on that
        # model ("Sizes of tensors must match" in GPT-NeoX's rotary), so greedy and sampling get a copy each.
        if self.draft_cross and self.draft_cross_hf is None:
            self.draft_cross_hf = (copy.deepcopy(self.draft_cross[0]), self.draft_cross[1])
        if self.draft_cross and self.draft_cross_hf_sampled is None:
            self.draft_cross_hf_sampled = (copy.deepcopy(self.draft_cross[0]), self.draft_cross[1])


def real_models_root() -> Path:
    """$XTOKSPEC_CACHE, else ~/.cache/xtokspec/real: the folder of the real preset's converted models."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "xtokspec" / "real"


def real_model_dir(name: str) -> Path:
    """A converted real model's folder. xtokspec downloads nothing: a checkout's benchmarks/real_models.py does."""
    folder = real_models_root() / name
    if not (folder / MARKER_FILE).is_file():
        raise XTokSpecError(
            f"real model {name!r} is not in {folder}; fetch and convert it from an xtokspec checkout with: "
            f"python benchmarks/real_models.py {name}  (or set ${CACHE_ENV} to where they are)"
        )
    return folder


def load_preset(preset: str, dtype: torch.dtype, device: str = "cpu", cpu_linears: str = "torch") -> Models:
    """The preset's models; `cpu_linears="onednn"` packs every linear of every model for oneDNN
    (`models.onednn_linears`), so the target alone and every system run the same kernels (the copies of the
    cross-tokenizer draft that transformers' universal mode uses keep a torch output head: it prunes it).
    Extra drafts (greedy only) are converted with their heads."""
    models = _load_preset(preset, dtype, device)
    if cpu_linears == "onednn":
        for pair in (models.target, models.draft_same, models.draft_cross, *models.extra_cross.values()):
            if pair is not None:
                onednn_linears(pair[0])
        for pair in (models.draft_cross_hf, models.draft_cross_hf_sampled):  # NOTE: transformers prunes their heads
            if pair is not None:
                onednn_linears(pair[0], keep_head=True)
    return models


def _load_preset(preset: str, dtype: torch.dtype, device: str) -> Models:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        return model, AutoTokenizer.from_pretrained(path)

    if preset == "fixtures":
        return Models(*(load(fixture_model(n)) for n in ("ja-target", "ja-draft-same", "ja-draft-bpe")))
    models = Models(load(real_model_dir("qwen2.5-coder-1.5b")), load(real_model_dir("qwen2.5-coder-0.5b")),
                    load(real_model_dir("gemma-3-270m")), cross_label="bridged-gemma",
                    extra_cross={"smollm": load(real_model_dir("smollm2-135m"))})
    for model, _ in (models.target, models.draft_same):
        model.generation_config.repetition_penalty = 1.0  # xtokspec implements no repetition penalty
    return models


def calibration_texts(limit: int = 3000) -> list[str]:
    """Text to choose a trimmed draft vocabulary from (`--draft-vocab`), none of it a benchmark prompt: the first
    `limit` paragraphs of the fixtures' held-out Japanese (man pages) and `limit` paragraphs of English and code
    from this Python's standard library sources (the real target is a coder model), in a fixed order."""
    import sysconfig

    japanese = (fixtures_dir() / "data" / "heldout.txt").read_text(encoding="utf-8").splitlines()
    japanese = [line for line in japanese if len(line) > 20][:limit]
    english: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        english += [block for block in path.read_text(encoding="utf-8", errors="ignore").split("\n\n")
                    if 80 < len(block) < 2000]
        if len(english) >= limit:
            break
    return japanese + english[:limit]
