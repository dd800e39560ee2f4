"""A model's token ids and its KV cache: the only code that knows the cache layout.

Invariant: the cache holds keys/values for exactly `ids[:cached]`; `forward` feeds `ids[cached:]`, and
`truncate(n)` drops ids and cached positions past n in place (a rejection costs no recompute).

Two backends, chosen per model (`SpecConfig.cache`; "auto" = static on CUDA, dynamic elsewhere):
- dynamic: transformers' DynamicCache; it grows with the ids, and a rollback crops every layer (a slice).
- static: transformers' StaticCache, one preallocated (1, heads, capacity, head_dim) buffer per layer and a
  length. A rollback only moves the length (`cumulative_length`, in place: no copy, no host sync); entries past
  it are overwritten by the next forward, which writes at positions length.., and until then the causal mask
  hides them (a query at position t attends to positions <= t). This relies on StaticLayer writing at
  `cumulative_length + arange(T)` (transformers 5.x; tests/test_cache.py pins it against the installed version).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache

from .types import XTokSpecError

CACHE_BACKENDS = ("dynamic", "static")
# Lengths a compiled forward is padded to, so that a captured graph is recorded once per bucket, not per K.
# Longer inputs (prompt prefills) run eagerly.
COMPILE_BUCKETS = (1, 2, 4, 8, 16, 32)
PAD_ID = 0  # fills a bucket; its positions are written to the static cache and rolled back at once


def input_device(model) -> torch.device:
    """Where a (possibly accelerate-sharded) model wants its input ids: the embedding's device."""
    return model.get_input_embeddings().weight.device


def sliding_layers(model) -> list[str]:
    """Layer types of `model` whose cache is a ring buffer (moving its length back is not a rollback)."""
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None) or []
    if not types and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        types = ["sliding_attention"]
    return sorted({t for t in types if t != "full_attention"})


def choose_backend(model, requested: str, compiled: bool = False) -> str:
    """'auto' -> static on CUDA or when compiled (if every layer is full attention), dynamic elsewhere; checks
    an explicit choice."""
    if requested not in ("auto", *CACHE_BACKENDS):
        raise XTokSpecError(f"cache must be 'auto', 'dynamic' or 'static', got {requested!r}")
    sliding = sliding_layers(model)
    if compiled and (requested == "dynamic" or sliding):
        raise XTokSpecError(
            f"compile=True needs the static cache, which {type(model).__name__} cannot use here "
            f"(cache={requested!r}, sliding layers {sliding or 'none'}): use compile=False"
        )
    if requested == "auto":
        return "static" if (compiled or input_device(model).type == "cuda") and not sliding else "dynamic"
    if requested == "static" and sliding:
        raise XTokSpecError(
            f"cache='static' needs full-attention layers; {type(model).__name__} has {sliding} layers (a ring "
            "buffer, which a length cannot roll back): use cache='dynamic'"
        )
    return requested


class _DynamicKV:
    """transformers' DynamicCache: grows with the ids; rollback crops every layer."""

    def __init__(self, model, capacity: int):
        self.cache = DynamicCache(config=model.config)
        self.capacity = capacity

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def advance(self, n: int) -> None:
        pass  # the cache's own length grew in the forward

    def rollback(self, n: int) -> None:
        extra = self.length - n
        if extra > 0:
            self.cache.crop(-extra)


class _StaticKV:
    """transformers' StaticCache of `capacity` positions; the length lives here as a Python int (no host sync)."""

    def __init__(self, model, capacity: int):
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.capacity = capacity
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def advance(self, n: int) -> None:
        self._length += n

    def rollback(self, n: int) -> None:
        if n >= self._length:
            return
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(n)  # (); in place: a captured graph keeps its address
        self._length = n


def compile_step(model):
    """`model` compiled for fixed-length calls (CUDA graphs on a GPU: torch.compile's reduce-overhead mode)."""
    import torch._dynamo.config as dynamo_config

    # NOTE: one graph per bucket and model: a target and a draft of the same class share forward's code
    # object, and past dynamo's recompile limit (8 by default) it would silently run eagerly.
    needed = 4 * len(COMPILE_BUCKETS)
    if getattr(dynamo_config, "recompile_limit", needed) < needed:
        dynamo_config.recompile_limit = needed
    mode = "reduce-overhead" if input_device(model).type == "cuda" else None
    return torch.compile(model, mode=mode, dynamic=False)


class ModelState:
    """A causal LM with its committed/proposed ids and a KV cache covering a prefix of them.

    With `step` (a compiled model; static backend only), forwards of up to COMPILE_BUCKETS[-1] new ids are
    padded to the next bucket length and run through it; the padding's cache positions are rolled back.
    """

    def __init__(self, model, ids: list[int], backend: str = "dynamic", capacity: int | None = None, step=None):
        if step is not None and backend != "static":
            raise ValueError("a compiled step needs the static backend")
        self.model = model
        self.step = step
        self.device = input_device(model)
        self.ids = list(ids)
        self.backend = backend
        limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        capacity = min(capacity or limit, limit)
        self.kv = (_StaticKV if backend == "static" else _DynamicKV)(model, capacity)

    @property
    def cached(self) -> int:
        return self.kv.length

    @property
    def capacity(self) -> int:
        """Most positions the cache can hold (the static buffer's size; the model's context when dynamic)."""
        return self.kv.capacity

    def forward(self, keep: int) -> torch.Tensor:
        """Feed ids[cached:] and return the logits (keep, V) of the last `keep` of them."""
        if self.cached >= len(self.ids):  # all ids cached (e.g. after a rollback): recompute the last one
            self.kv.rollback(len(self.ids) - 1)
        new = self.ids[self.cached :]
        if not 1 <= keep <= len(new):
            raise RuntimeError(f"forward over {len(new)} new ids cannot keep {keep} logits")
        if len(self.ids) > self.capacity:
            raise RuntimeError(f"{len(self.ids)} ids exceed the cache's {self.capacity} positions")
        bucket = self._bucket(len(new))
        if bucket:
            padded = torch.tensor([new + [PAD_ID] * (bucket - len(new))], dtype=torch.long, device=self.device)
            return self._run_step(padded, len(new))[len(new) - keep :]  # (keep, V)
        input_ids = torch.tensor([new], dtype=torch.long, device=self.device)  # (1, T)
        out = self.model(input_ids=input_ids, past_key_values=self.kv.cache, use_cache=True, logits_to_keep=keep)
        self.kv.advance(len(new))
        return out.logits[0]  # (keep, V)

    def _bucket(self, length: int) -> int | None:
        """The padded length a compiled call uses for `length` new ids, or None to run eagerly."""
        if self.step is None:
            return None
        bucket = next((b for b in COMPILE_BUCKETS if b >= length), None)
        return bucket if bucket is not None and self.cached + bucket <= self.capacity else None

    def _run_step(self, padded: torch.Tensor, length: int) -> torch.Tensor:
        """Compiled forward over (1, bucket) ids of which the first `length` are real -> (length, V) logits."""
        start = self.cached
        out = self.step(input_ids=padded, past_key_values=self.kv.cache, use_cache=True, logits_to_keep=padded.shape[1])
        self.kv.advance(padded.shape[1])
        self.kv.rollback(start + length)  # the padding's positions
        # NOTE: clone: a CUDA graph's output buffer is overwritten by its next replay.
        return out.logits[0, :length].clone()  # (length, V)

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed device ids (1, T) that follow `ids` and are all cached, without a host transfer -> logits (T, V).

        They are not in `ids` yet: the caller appends them with `ids.extend` once it has them on the host
        (until then `cached` runs ahead of `ids`, which `forward` and `truncate` must not see)."""
        if self.cached + tokens.shape[1] > self.capacity:
            raise RuntimeError(f"{self.cached + tokens.shape[1]} ids exceed the cache's {self.capacity} positions")
        if self._bucket(tokens.shape[1]) == tokens.shape[1]:
            return self._run_step(tokens, tokens.shape[1])
        out = self.model(input_ids=tokens, past_key_values=self.kv.cache, use_cache=True)
        self.kv.advance(tokens.shape[1])
        return out.logits[0]  # (T, V)

    def truncate(self, n: int) -> None:
        """Keep ids[:n]; roll the cache back to at most n positions."""
        del self.ids[n:]
        self.kv.rollback(n)
