"""Loading target and draft models: the only code that touches transformers' Auto classes."""

from __future__ import annotations

import os
from pathlib import Path

from .types import XTokSpecError

FIXTURE_NAMES = ("ja-target", "ja-draft-same", "ja-draft-bpe")


def fixtures_dir() -> Path:
    """The repository's fixtures/ folder: $XTOKSPEC_FIXTURES, the source tree, or the working directory up."""
    candidates = [Path(os.environ["XTOKSPEC_FIXTURES"])] if os.environ.get("XTOKSPEC_FIXTURES") else []
    candidates.append(Path(__file__).resolve().parent.parent / "fixtures")
    candidates += [d / "fixtures" for d in (Path.cwd(), *Path.cwd().parents)]
    for path in candidates:
        if (path / "models" / "ja-target" / "config.json").exists():
            return path
    raise XTokSpecError(
        "bundled fixture models not found: run from the xtokspec checkout (fixtures/models/...) or set "
        "XTOKSPEC_FIXTURES to its fixtures/ folder"
    )


def fixture_model(name: str) -> Path:
    """Folder of a bundled fixture model: ja-target, ja-draft-same or ja-draft-bpe."""
    if name not in FIXTURE_NAMES:
        raise XTokSpecError(f"unknown fixture model {name!r}; choose from {FIXTURE_NAMES}")
    return fixtures_dir() / "models" / name


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
