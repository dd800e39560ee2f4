"""Loading target and draft models: the only code that touches transformers' Auto classes."""

from __future__ import annotations

import difflib
import os
import re
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


# A hub id: "name" or "owner/name", letters, digits, "-", "_", "." (huggingface_hub's rule, simplified).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def resolve(spec: str | os.PathLike, role: str) -> str | Path:
    """A model argument -> an existing folder, a bundled fixture's folder, or a hub id; fails fast otherwise.

    Order: an existing path wins; then a bundled name (ja-target, ja-draft-same, ja-draft-bpe); then a hub id.
    Anything that looks like a local path (starts with / . ~, has a backslash or more than one /, or starts
    with a folder that exists here) and does not exist is an error at once, instead of a hub lookup that retries for a minute on a machine without access.
    """
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise XTokSpecError(f"{role}: {text!r} is a file; give the model's folder (with config.json)")
        if not (path / "config.json").exists():
            raise XTokSpecError(f"{role}: {text!r} has no config.json: not a transformers model folder")
        return path
    if text in FIXTURE_NAMES:
        return fixture_model(text)
    first = text.split("/", 1)[0]
    if not _HUB_ID.match(text) or ("/" in text and Path(first).is_dir()):  # NOTE: "fixtures/modl" is local
        raise XTokSpecError(f"{role}: no such model folder: {text!r}")
    close = difflib.get_close_matches(text, FIXTURE_NAMES, n=1, cutoff=0.8)
    if close:
        raise XTokSpecError(f"{role}: no model folder {text!r}; did you mean the bundled {close[0]!r}?")
    return text


def load(spec, role: str, **load_kwargs):
    """(model, tokenizer) from a folder, a bundled fixture name, a hub id, or a loaded (model, tokenizer) pair.

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

    spec = resolve(spec, role)
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, **load_kwargs)
    except (OSError, ValueError) as err:  # NOTE: transformers raises ValueError for unreadable tokenizer files
        raise XTokSpecError(f"{role}: could not load {str(spec)!r} ({err.__class__.__name__}: {err})") from err
    return model.eval(), tokenizer
