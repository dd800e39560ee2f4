"""KV-cache backends and the model/device helpers they share.

Two backends, chosen per model (`SpecConfig.cache`; "auto" = static on CUDA, dynamic elsewhere):
- dynamic: transformers' DynamicCache; it grows with the ids, and a rollback crops every layer (a slice).
- static: transformers' StaticCache, one preallocated (1, heads, capacity, head_dim) buffer per layer and a
  length. A rollback only moves the length (`cumulative_length`, in place: no copy, no host sync); entries past
  it are overwritten by the next forward, which writes at positions length.., and until then the causal mask
  hides them (a query at position t attends to positions <= t). This relies on StaticLayer writing at
  `cumulative_length + arange(T)` (transformers 5.x; tests/test_cache.py pins it against the installed version).
  That whole-buffer layer serves compiled steps (fixed shapes); eager forwards use `PrefixStaticLayer`, the
  same buffer with a Python-int length, which attends over the written prefix only. A compiled model's buffer
  has one of a few sizes (`buffer_capacity`) and passes from one generation to the next (`reuse`), so its
  graphs are compiled once per size and keep their buffers' addresses. Eager static buffers are sized and
  passed on the same way (nothing is allocated or initialised per generation).
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from ..types import CACHE_CHOICES, XTokSpecError

CACHE_BACKENDS = tuple(choice for choice in CACHE_CHOICES if choice != "auto")
MIN_BUFFER_CAPACITY = 256


def cache_keyword(model) -> str:
    """The keyword `model.forward` takes its KV cache by: "cache" from transformers 5.24 on, which deprecates
    "past_key_values" (a FutureWarning per call site; removed in 5.40), and "past_key_values" before that and in
    models that have not moved (remote code, older classes).

    A forward wrapped on the instance (a hook, a profiler, a test's slowed forward) usually takes only
    `*args, **kwargs` and names neither: then the class's own forward (or a compiled module's original) decides.
    """
    for forward in (getattr(model, "forward", None), getattr(type(model), "forward", None),
                    getattr(getattr(model, "_orig_mod", None), "forward", None)):
        try:
            parameters = inspect.signature(forward).parameters
        except (TypeError, ValueError):  # absent, or without an inspectable signature
            continue
        for name in ("cache", "past_key_values"):
            if name in parameters:
                return name
    return "past_key_values"  # the long-standing name


def buffer_capacity(needed: int, limit: int) -> int:
    """A static buffer's size: `needed` positions rounded up to the next of 256, 384, 512,
    768, 1024, 1536, ... (a power of two or 1.5 times one), at most the model's `limit`.

    torch.compile specialises every graph on the buffer's shape, so a buffer sized to each prompt would recompile
    every bucket of both models whenever a prompt's length is new, mid-generation (what that cost at the 13B
    shapes: BENCHMARKS.md, "The loop's own overhead at the 13B shapes"). Rounded, a process
    compiles once per size class; a reused buffer (`ModelState(reuse=...)`) only grows. Compiled steps attend
    over the whole buffer, so the classes are kept within 1.5x of each other (at most a third of a buffer is
    past the longest generation that needed it), at about twice as many classes as powers of two alone."""
    size = MIN_BUFFER_CAPACITY
    while size < needed:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return max(min(size, limit), needed)


def input_device(model) -> torch.device:
    """Where a (possibly accelerate-sharded) model wants its input ids: the embedding's device."""
    return model.get_input_embeddings().weight.device


def to_device(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host data (a list or a CPU tensor) as a tensor on `device`, without making the host wait for the device.

    On CUDA, a copy from pageable host memory first waits for the stream to drain: the input ids of every draft
    and verify forward would each make the host wait for the device (benchmarks/gpu_syncs.py counts them). Pinned memory with a non-blocking copy queues instead; torch's pinned
    allocator keeps the buffer until the copy has run."""
    if device.type == "cpu" and not isinstance(data, torch.Tensor):
        return torch.tensor(data, dtype=dtype)  # already where it goes
    tensor = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def sliding_layers(model) -> list[str]:
    """Layer types of `model` whose cache is a ring buffer (moving its length back is not a rollback)."""
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None) or []
    if not types and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        types = ["sliding_attention"]
    return sorted({t for t in types if t != "full_attention"})


# Attention implementations that apply a 4D additive mask as given (a tree's ancestor mask). flash-attention
# takes padding masks only; flex attention crashed the process on this project's CPU given one.
TREE_MASK_ATTENTION = ("sdpa", "eager")


def dynamic_cache(model) -> DynamicCache:
    """An empty DynamicCache for `model`: built from its config where it has layers other than full attention (the
    config gives each layer its kind), else plain (its layers made as the forward first writes them; building
    them from the config is work every generation would repeat for nothing)."""
    return DynamicCache(config=model.config) if sliding_layers(model) else DynamicCache()


def takes_tree_masks(model) -> bool:
    """Whether `model`'s attention applies an arbitrary 4D mask (token trees' tree-masked forwards)."""
    return getattr(model.config, "_attn_implementation", None) in TREE_MASK_ATTENTION


def choose_backend(model, requested: str, compiled: bool = False) -> str:
    """'auto' -> static on CUDA or when compiled (if every layer is full attention), dynamic elsewhere; checks
    an explicit choice (and compile) against the model's layers. `requested` is a checked `SpecConfig.cache`."""
    assert requested in CACHE_CHOICES and not (compiled and requested == "dynamic"), requested  # SpecConfig checks
    sliding = sliding_layers(model)
    if compiled and sliding:
        raise XTokSpecError(
            f"compile=True needs the static cache, which {type(model).__name__} cannot use here "
            f"(cache={requested!r}, sliding layers {sliding}): use compile=False"
        )
    if requested == "auto":
        return "static" if (compiled or input_device(model).type == "cuda") and not sliding else "dynamic"
    if requested == "static" and sliding:
        raise XTokSpecError(
            f"cache='static' needs full-attention layers; {type(model).__name__} has {sliding} layers (a ring "
            "buffer, which a length cannot roll back): use cache='dynamic'"
        )
    return requested


class RollbackTooDeep(RuntimeError):
    """A sliding-window layer no longer holds the positions a rollback needs (the caller re-prefills)."""


# Positions a sliding-window layer keeps beyond its window: a rollback may reach this far past what the forwards
# since the last one fed (a draft re-encodes a few committed ids with new text; DynamicKV's docstring)
SLIDING_SPARE = 64


class DynamicKV:
    """transformers' DynamicCache: grows with the ids; rollback crops every layer.

    A sliding-window layer (Gemma 2/3, Mistral, gpt-oss, ...) needs only its last window - 1 positions, and
    transformers keeps no more, so it cannot crop such a layer once the window has filled. Here each one records
    its past (`activate_past_recording`: a forward appends without dropping) and is cut back to window - 1 +
    `spare` positions after each forward and rollback; a rollback slices its last positions off itself. So a
    rollback of up to `spare` positions more than the last forwards fed is exact, and the memory per sliding
    layer stays window - 1 + spare + one forward's ids, whatever the context. A deeper rollback raises
    RollbackTooDeep."""

    def __init__(self, model, capacity: int, spare: int = SLIDING_SPARE):
        self.cache = dynamic_cache(model)
        self.capacity = capacity
        self.spare = spare
        self.sliding = [layer for layer in self.cache.layers if getattr(layer, "is_sliding", False)]
        for layer in self.sliding:
            layer.activate_past_recording()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def advance(self, n: int) -> None:
        if self.sliding:  # the cache's own length grew in the forward
            self._trim()

    def mask_length(self, n_new: int) -> int:
        return self.length + n_new  # keys after the update: the cache and the new ones

    def layer_tensors(self):
        return [(layer.keys, layer.values) for layer in self.cache.layers if layer.is_initialized]

    def read(self, layer_idx: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's first n positions, (heads, n, head_dim) each (a batched draft's copy of this request)."""
        layer = self.cache.layers[layer_idx]
        if layer.keys.shape[-2] != n:
            raise ValueError(f"a sliding layer keeps {layer.keys.shape[-2]} of {n} positions: not batchable")
        return layer.keys[0], layer.values[0]

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """A layer's positions from `start` (its length: they are appended) set to (1, heads, n, head_dim) keys
        and values; `advance` follows once every layer is written."""
        self.cache.update(keys, values, layer_idx)

    def rollback(self, n: int) -> None:
        extra = self.length - n
        if extra <= 0:
            return
        if not self.sliding:
            self.cache.crop(-extra)
            return
        for layer in self.sliding:  # NOTE: checked first, so that a refused rollback changes nothing
            if layer.is_initialized and layer.keys.shape[-2] - extra < min(n, layer.sliding_window - 1):
                raise RollbackTooDeep(f"a rollback of {extra} positions past a sliding window that keeps "
                                      f"{layer.keys.shape[-2]} of {layer.cumulative_length}")
        for layer in self.cache.layers:
            if not layer.is_initialized:
                continue
            if getattr(layer, "is_sliding", False):
                layer.keys, layer.values = layer.keys[:, :, :-extra], layer.values[:, :, :-extra]
                layer.cumulative_length -= extra
            else:
                layer.crop(-extra)
        self._trim()

    def _trim(self) -> None:
        """Cut each sliding-window layer back to window - 1 + spare positions."""
        for layer in self.sliding:
            keep = layer.sliding_window - 1 + self.spare
            if layer.is_initialized and layer.keys.shape[-2] > keep:
                layer.keys, layer.values = layer.keys[:, :, -keep:], layer.values[:, :, -keep:]


class PrefixStaticLayer(StaticLayer):
    """A StaticLayer whose update returns only the written prefix of its buffer, for eager forwards.

    transformers' StaticLayer returns (and its mask covers) the whole preallocated buffer at every step, the
    fixed shape a captured graph needs; eagerly that is wasted attention over empty positions (5-8% of a step on
    the CPU fixtures). Here the length is a Python int (no tensor arithmetic per layer), the new keys and values
    are copied into the buffer's slice, and the prefix `[:, :, :length + T]` is returned as a view, with a mask
    as long: the same buffer, the same rollback (move the length), no copy of the past."""

    # NOTE: not for torch.compile (the prefix's shape changes every step). It also lets transformers' masking
    # skip the mask of a one-token step (sdpa's is_causal), as it does for a DynamicCache: a StaticLayer's
    # one-token steps get a materialized (1, 1, 1, capacity) mask.
    is_compileable = False

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.max_cache_len:
            raise RuntimeError(f"{end} positions exceed the static cache's {self.max_cache_len}")
        self.keys[:, :, start:end].copy_(key_states)  # (1, heads, T, head_dim) into the buffer, in place
        self.values[:, :, start:end].copy_(value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length


class StaticKV:
    """transformers' StaticCache of `capacity` positions; the length lives here as a Python int (no host sync).

    `prefix` (eager use): attend over the written positions only (`PrefixStaticLayer`); without it (compiled
    steps) over the whole buffer, whose shape never changes."""

    def __init__(self, model, capacity: int, prefix: bool = False):
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        if prefix:
            for i, layer in enumerate(self.cache.layers):
                if type(layer) is not StaticLayer:
                    raise XTokSpecError(f"the static cache has a {type(layer).__name__} layer, not a full-attention one")
                self.cache.layers[i] = PrefixStaticLayer(max_cache_len=capacity)
        self.prefix = prefix
        self.capacity = capacity
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def advance(self, n: int) -> None:
        self._length += n

    def mask_length(self, n_new: int) -> int:
        if self.prefix:
            return self._length + n_new
        return self.capacity  # attention runs over the whole buffer; the mask hides what is not written

    def layer_tensors(self):
        return [(layer.keys, layer.values) for layer in self.cache.layers if layer.is_initialized]

    def read(self, layer_idx: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's first n positions, (heads, n, head_dim) each (views of its buffers)."""
        layer = self.cache.layers[layer_idx]
        return layer.keys[0, :, :n], layer.values[0, :, :n]

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """A layer's positions from `start` set to (1, heads, n, head_dim) keys and values, in place (a captured
        graph keeps the buffers' addresses), and its own length moved past them; `advance` follows once every
        layer is written."""
        layer = self.cache.layers[layer_idx]
        end = start + keys.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"{end} positions exceed the static cache's {self.capacity}")
        layer.keys[:, :, start:end].copy_(keys)
        layer.values[:, :, start:end].copy_(values)
        if isinstance(layer, PrefixStaticLayer):
            layer.length = end
        else:
            layer.cumulative_length.fill_(end)

    def reset(self) -> None:
        """Empty, whatever state a forward left it in (one that raised may have moved some layers' lengths)."""
        self._length = max(self._length, 1)
        self.rollback(0)

    def rollback(self, n: int) -> None:
        if n >= self._length:
            return
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(n)  # (); in place: a captured graph keeps its address
            if isinstance(layer, PrefixStaticLayer):
                layer.length = min(layer.length, n)  # its own length; cumulative_length is unused
        self._length = n


def select_rows(cache: DynamicCache, rows: list[int]) -> None:
    """Reorder (and repeat) a branch cache's batch rows in place: row i becomes old row rows[i]."""
    for layer in cache.layers:
        if layer.is_initialized:
            index = torch.tensor(rows, device=layer.keys.device)
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)


def context_limit(model) -> int | None:
    """The model's context in positions (`max_position_embeddings`), or None where its config gives none."""
    return getattr(model.config, "max_position_embeddings", None)


def position_bytes(model) -> int:
    """Bytes a KV cache spends per position of `model` (keys and values of every layer, in its dtype); an upper
    bound for models whose sliding-window layers keep only their window."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize
