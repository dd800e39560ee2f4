"""Loading target and draft models: the only code that touches transformers' Auto classes."""

from __future__ import annotations

import os
from pathlib import Path

from .types import XTokSpecError

# Bundled fixture models, relative to the repository root (used by the CLI and benchmarks by default).
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"
FIXTURE_TARGET = FIXTURES / "ja-target"
FIXTURE_DRAFT_BPE = FIXTURES / "ja-draft-bpe"
FIXTURE_DRAFT_SAME = FIXTURES / "ja-draft-same"


def load(spec, role: str, **load_kwargs):
    """(model, tokenizer) from a folder / hub id, or from an already loaded (model, tokenizer) pair.

    `load_kwargs` (dtype, device_map, quantization_config, ...) pass through to `from_pretrained`.
    """
    if isinstance(spec, (tuple, list)):
        if len(spec) != 2:
            raise XTokSpecError(f"{role}: expected a path, a hub id or a (model, tokenizer) pair, got {len(spec)} items")
        model, tokenizer = spec
        if not hasattr(model, "forward") or not callable(tokenizer):
            raise XTokSpecError(f"{role}: the pair must be (model, tokenizer), got ({type(model).__name__}, {type(tokenizer).__name__})")
        return model.eval(), tokenizer
    if not isinstance(spec, (str, os.PathLike)):
        raise XTokSpecError(f"{role}: expected a path, a hub id or a (model, tokenizer) pair, got {type(spec).__name__}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, **load_kwargs)
    except OSError as err:
        raise XTokSpecError(f"{role}: could not load {str(spec)!r} ({err.__class__.__name__}: {err})") from err
    return model.eval(), tokenizer
