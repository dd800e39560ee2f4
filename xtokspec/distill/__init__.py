"""Distilling a draft toward a target across tokenizers: `distill(target, draft, prompts, out)` writes the target's
continuations (`data`), trains the draft on them (`train`) and measures its agreement with the target
(`evaluate`); `pipeline` runs the three."""

from .pipeline import DistillSettings, distill

__all__ = ["DistillSettings", "distill"]
