"""A model's token ids and its KV cache: the only code that knows the cache layout.

Invariant: the cache holds keys/values for exactly `ids[:cached]`; `forward` feeds `ids[cached:]`, and
`truncate(n)` drops ids and cached positions past n in place (a rejection costs a slice, never a recompute).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def input_device(model) -> torch.device:
    """Where a (possibly accelerate-sharded) model wants its input ids: the embedding's device."""
    return model.get_input_embeddings().weight.device


class ModelState:
    """A causal LM with its committed/proposed ids and a KV cache covering a prefix of them."""

    def __init__(self, model, ids: list[int]):
        self.model = model
        self.device = input_device(model)
        self.ids = list(ids)
        self.cache = DynamicCache(config=model.config)

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    def forward(self, keep: int) -> torch.Tensor:
        """Feed ids[cached:] and return the logits (keep, V) of the last `keep` of them."""
        if self.cached >= len(self.ids):  # all ids cached (e.g. after a rollback): recompute the last one
            self.cache.crop(-(self.cached - len(self.ids) + 1))
        new = self.ids[self.cached :]
        if not 1 <= keep <= len(new):
            raise RuntimeError(f"forward over {len(new)} new ids cannot keep {keep} logits")
        input_ids = torch.tensor([new], dtype=torch.long, device=self.device)  # (1, T)
        out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=keep)
        return out.logits[0]  # (keep, V)

    def truncate(self, n: int) -> None:
        """Keep ids[:n]; roll the cache back to at most n positions."""
        del self.ids[n:]
        extra = self.cached - n
        if extra > 0:
            self.cache.crop(-extra)
