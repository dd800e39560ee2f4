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
  That whole-buffer layer serves compiled steps (fixed shapes); eager forwards use `_PrefixStaticLayer`, the
  same buffer with a Python-int length, which attends over the written prefix only. A compiled model's buffer
  has one of a few sizes (`buffer_capacity`) and passes from one generation to the next (`reuse`), so its
  graphs are compiled once per size and keep their buffers' addresses. Eager static buffers are sized and
  passed on the same way (nothing is allocated or initialised per generation).

Token trees (xtokspec/tree.py): `forward_tree` feeds the uncached ids and then a trie's nodes in one forward,
with explicit positions (a node sits one past its parent) and a 4D additive attention mask (a node sees the
cache, the uncached ids and its own ancestors); `keep_path` then moves the accepted nodes' keys and values to
the positions right after the uncached ids, in place, and rolls the rest back. The draft grows its beam
level by level on its own cache the same way (`grow_tree`; `truncate` drops the nodes). Both run through the
compiled step when there is one (padded buckets with a mask over the whole buffer: one more graph per bucket).
`branches` copies the cache into a batch of rows instead, for a draft with sliding-window layers (a ring buffer
cannot hold a tree's nodes and then drop them) or an attention that takes no 4D mask (always a DynamicCache: it
lives for one cycle).
"""

from __future__ import annotations

import inspect
import logging
import time

import numpy as np
import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from .types import XTokSpecError

log = logging.getLogger("xtokspec")

CACHE_BACKENDS = ("dynamic", "static")
# Lengths a compiled forward is padded to, so that a captured graph is recorded once per bucket, not per K.
# Longer inputs (prompt prefills) run eagerly.
COMPILE_BUCKETS = (1, 2, 4, 8, 16, 32)
PAD_ID = 0  # fills a bucket; its positions are written to the static cache and rolled back at once
MIN_BUFFER_CAPACITY = 256


def padded_length(length: int) -> int | None:
    """The bucket a compiled forward over `length` ids is padded to, or None past the largest (run eagerly)."""
    return next((b for b in COMPILE_BUCKETS if b >= length), None)


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

    torch.compile specialises every graph on the buffer's shape, so a buffer sized to each prompt recompiled
    every bucket of both models whenever a prompt's length was new: on an H100 at the 13B shapes that stalled
    the second of three prompts for ~100 s, mid-generation (BENCHMARKS.md, section GPU). Rounded, a process
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

    On CUDA, a copy from pageable host memory first waits for the stream to drain (measured on an H100: the
    input ids of every draft and verify forward were one such sync each, two per cycle besides the two
    transfers the loop needs). Pinned memory with a non-blocking copy queues instead; torch's pinned
    allocator keeps the buffer until the copy has run."""
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


def takes_tree_masks(model) -> bool:
    """Whether `model`'s attention applies an arbitrary 4D mask (token trees' tree-masked forwards)."""
    return getattr(model.config, "_attn_implementation", None) in TREE_MASK_ATTENTION


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

    def mask_length(self, n_new: int) -> int:
        return self.length + n_new  # keys after the update: the cache and the new ones

    def layer_tensors(self):
        return [(layer.keys, layer.values) for layer in self.cache.layers if layer.is_initialized]

    def rollback(self, n: int) -> None:
        extra = self.length - n
        if extra > 0:
            self.cache.crop(-extra)


class _PrefixStaticLayer(StaticLayer):
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


class _StaticKV:
    """transformers' StaticCache of `capacity` positions; the length lives here as a Python int (no host sync).

    `prefix` (eager use): attend over the written positions only (`_PrefixStaticLayer`); without it (compiled
    steps) over the whole buffer, whose shape never changes."""

    def __init__(self, model, capacity: int, prefix: bool = False):
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        if prefix:
            for i, layer in enumerate(self.cache.layers):
                if type(layer) is not StaticLayer:
                    raise XTokSpecError(f"the static cache has a {type(layer).__name__} layer, not a full-attention one")
                self.cache.layers[i] = _PrefixStaticLayer(max_cache_len=capacity)
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
            if isinstance(layer, _PrefixStaticLayer):
                layer.length = min(layer.length, n)  # its own length; cumulative_length is unused
        self._length = n


class CompiledStep:
    """`model` compiled for fixed-length calls (CUDA graphs on a GPU: torch.compile's reduce-overhead mode).

    torch.compile compiles inside the first call of each new shape (bucket length x buffer size): seconds on a
    CPU, minutes for a 13B model on a GPU (BENCHMARKS.md, section GPU). Those calls are logged (logger
    "xtokspec", INFO; the CLI prints it), with their duration, so a long first generation says why it is long."""

    def __init__(self, model, role: str = "model"):
        import torch._dynamo.config as dynamo_config

        # NOTE: one graph per bucket and model: a target and a draft of the same class share forward's code
        # object, and past dynamo's recompile limit (8 by default) it would silently run eagerly.
        needed = 8 * len(COMPILE_BUCKETS)  # chain and tree steps, two models
        if getattr(dynamo_config, "recompile_limit", needed) < needed:
            dynamo_config.recompile_limit = needed
        self.cuda = input_device(model).type == "cuda"
        self.mode = "reduce-overhead" if self.cuda else None  # CUDA graphs
        self.compiled = torch.compile(model, mode=self.mode, dynamic=False)
        self.cache_keyword = cache_keyword(model)
        self.compiled_move = None  # keep_path's move, compiled at its first use (a target's, with trees)
        self.role = role
        self.shapes: set[tuple] = set()  # (ids, buffer size, tree mask) per forward; (positions, size, "move")

    def __call__(self, *, input_ids: torch.Tensor, **kwargs):
        """The compiled forward; `kwargs` name the cache by the model's `cache_keyword`."""
        layers = getattr(kwargs.get(self.cache_keyword), "layers", None) or [None]
        tree = kwargs.get("attention_mask") is not None  # a tree-masked forward: its own graph
        shape = (input_ids.shape[1], getattr(layers[0], "max_cache_len", None), tree)
        what = f"the {self.role}'s {shape[0]}-id {'tree ' if tree else ''}step over a {shape[1]}-position cache"
        return self._run(shape, what, self.compiled, input_ids=input_ids, **kwargs)

    def move_positions(self, tensors: list[torch.Tensor], index_from: torch.Tensor, index_to: torch.Tensor) -> None:
        """`move_positions`, compiled once per index length (the buckets) and buffer size: eagerly two small
        kernels per layer tensor (~160 launches for a 40-layer target), captured one replay."""
        if self.compiled_move is None:
            self.compiled_move = torch.compile(move_positions, mode=self.mode, dynamic=False)
        shape = (index_from.shape[0], tensors[0].shape[2], "move")
        what = f"the {self.role}'s {shape[0]}-position move over a {shape[1]}-position cache"
        self._run(shape, what, self.compiled_move, tensors, index_from, index_to)

    def _run(self, shape: tuple, what: str, compiled, *args, **kwargs):
        """`compiled(*args, **kwargs)`, logging its first call of each shape (the one that compiles)."""
        if shape in self.shapes:
            return compiled(*args, **kwargs)
        log.info("compiling %s (once per shape%s)", what, "; minutes for a large model" if self.cuda else "")
        start = time.perf_counter()
        out = compiled(*args, **kwargs)
        self.shapes.add(shape)
        log.info("compiled %s in %.1f s", what, time.perf_counter() - start)
        return out


def move_positions(tensors: list[torch.Tensor], index_from: torch.Tensor, index_to: torch.Tensor) -> None:
    """In every (batch, heads, positions, head_dim) cache tensor, copy positions `index_from` to `index_to`
    (all read before any is written)."""
    for t in tensors:
        t.index_copy_(2, index_to, t.index_select(2, index_from))


def compile_step(model, role: str = "model") -> CompiledStep:
    """`model` compiled for fixed-length calls (see CompiledStep)."""
    return CompiledStep(model, role)


class ModelState:
    """A causal LM with its committed/proposed ids and a KV cache covering a prefix of them.

    With `step` (a compiled model; static backend only), forwards of up to COMPILE_BUCKETS[-1] new ids are
    padded to the next bucket length and run through it; the padding's cache positions are rolled back.
    """

    def __init__(self, model, ids: list[int], backend: str = "dynamic", capacity: int | None = None, step=None,
                 tree_nodes: int = 0, reuse: _StaticKV | None = None):
        """`reuse`: the static cache (`kv`) of an earlier ModelState of this model, run the same way (compiled or
        eager), taken over if it is large enough: its buffers keep their addresses, so captured graphs stay valid
        and nothing is allocated, initialised or recompiled. Its old contents are harmless: the new prefill
        starts writing at position 0, and until a position is written again the causal mask hides it, as after
        any rollback."""
        if step is not None and backend != "static":
            raise ValueError("a compiled step needs the static backend")
        self.model = model
        self.step = step
        self.device = input_device(model)
        self.cache_keyword = cache_keyword(model)  # "cache" or "past_key_values", by transformers version
        self.ids = list(ids)
        self.backend = backend
        limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        capacity = min(capacity or limit, limit)
        if backend == "static":
            capacity = buffer_capacity(capacity, limit)
        self.tree_nodes = tree_nodes  # room past `capacity` for the nodes of a tree being verified
        self._tree_parents: list[int] | None = None  # the open tree's parents per node (node 0: -1); None: none
        self._columns = np.arange(0)  # cache positions, for tree masks
        # A sliding-window layer's cache is a ring buffer: it cannot hold a tree's nodes and then drop them; and
        # the nodes need an attention that applies their mask.
        self.grows_trees = not sliding_layers(model) and takes_tree_masks(model)
        self._mask_dtype: torch.dtype | None = None  # a tree mask's dtype, looked up at the first tree forward
        if (backend == "static" and reuse is not None and reuse.prefix == (step is None)
                and reuse.capacity >= capacity + tree_nodes):
            reuse.reset()
            self.kv = reuse
        elif backend == "static":
            self.kv = _StaticKV(model, capacity + tree_nodes, prefix=step is None)
        else:
            self.kv = _DynamicKV(model, capacity + tree_nodes)

    @property
    def cached(self) -> int:
        return self.kv.length

    @property
    def capacity(self) -> int:
        """Most ids the cache can hold (the static buffer's size; the model's context when dynamic), not counting
        the room kept for tree nodes."""
        return self.kv.capacity - self.tree_nodes

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
            padded = to_device([new + [PAD_ID] * (bucket - len(new))], self.device)
            return self._run_step(padded, len(new))[len(new) - keep :]  # (keep, V)
        input_ids = to_device([new], self.device)  # (1, T)
        out = self._forward(self.model, input_ids, logits_to_keep=keep)
        self.kv.advance(len(new))
        return out.logits[0]  # (keep, V)

    def _bucket(self, length: int, start: int | None = None, end: int | None = None) -> int | None:
        """The padded length a compiled call uses for `length` new ids written from cache position `start`
        (default: the cached length) within the first `end` positions (default: `capacity`; tree forwards may
        use the room kept for nodes), or None to run eagerly."""
        start = self.cached if start is None else start
        if self.step is None or start == 0:
            # NOTE: the cache's first forward runs eagerly: StaticLayer marks its buffers as static addresses
            # only when initialised outside a compiled region; initialised inside one, every compiled call
            # "mutates inputs" and torch.compile silently gives up CUDA graphs for it. (An empty cache is also
            # one rolled back to nothing; running that forward eagerly too costs nothing in correctness.)
            return None
        bucket = padded_length(length)
        return bucket if bucket is not None and start + bucket <= (self.capacity if end is None else end) else None

    def _run_step(self, padded: torch.Tensor, length: int) -> torch.Tensor:
        """Compiled forward over (1, bucket) ids of which the first `length` are real -> (length, V) logits."""
        start = self.cached
        out = self._forward(self.step, padded, logits_to_keep=padded.shape[1])
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
        out = self._forward(self.model, tokens)
        self.kv.advance(tokens.shape[1])
        return out.logits[0]  # (T, V)

    def _forward(self, call, input_ids: torch.Tensor, cache=None, **kwargs):
        """`call` (the model or its compiled step) over `input_ids` with `cache` (default: this state's), named
        by the installed transformers' keyword."""
        kwargs[self.cache_keyword] = self.kv.cache if cache is None else cache
        return call(input_ids=input_ids, use_cache=True, **kwargs)

    def forward_rows(self, tokens: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """One id per row of a `branches` cache (B, 1) -> the next-token logits (B, V); this state's own cache and
        ids are untouched."""
        return self._forward(self.model, tokens, cache=cache).logits[:, -1]

    def truncate(self, n: int) -> None:
        """Keep ids[:n]; roll the cache back to at most n positions."""
        del self.ids[n:]
        self.kv.rollback(n)
        self._tree_parents = None  # an open tree's nodes are past every id: gone

    # ------------------------------------------------------------ token trees
    # A tree's node n >= 1 is written at cache position base + n - 1, and its position id is its parent's plus
    # one (node 0, the root, is the last id before base); it attends to the ids up to the root, its ancestors and
    # itself.
    # The target feeds a whole trie at once (`forward_tree`, then `keep_path`); the draft grows one level of its
    # beam per call (`grow_tree`) and drops the nodes with `truncate`.
    @property
    def tree_size(self) -> int:
        """Nodes of the open tree (0 when none is open)."""
        return len(self._tree_parents) - 1 if self._tree_parents else 0

    def forward_tree(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Feed ids[cached:] and then trie nodes (node n >= 1: token tokens[n] under parent parents[n]; node 0 is
        the last uncached id) in one forward -> logits (N+1, V): row 0 after the ids, row n after node n.

        With a compiled step, the forward is padded to a bucket and captured like a chain's (the padding's
        positions are rolled back). Until `keep_path`, the cache holds the nodes too."""
        if self.cached >= len(self.ids):
            self.kv.rollback(len(self.ids) - 1)
        new = self.ids[self.cached :]
        self._open_tree(self.cached + len(new))
        return self._tree_forward(new, tokens[1:], parents[1:])

    def grow_tree(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Feed the next nodes of a tree rooted at the last id (cached): node tree_size + 1 + i is tokens[i] under
        node parents[i] (0: the root; else a node fed before) -> logits (len(tokens), V), row i after node i.

        The first call opens the tree; `truncate` (or `forward_tree`) drops it. Drafting a beam this way is one
        (1, width) forward per level on the model's own cache: fixed shapes that a compiled step captures, and
        no copy of the cache into batch rows."""
        if not self._tree_parents:
            if self.cached != len(self.ids):
                raise RuntimeError(f"a tree grows from cached ids only ({self.cached} of {len(self.ids)} cached)")
            self._open_tree(self.cached)
        if self.cached != self._tree_base + self.tree_size:
            raise RuntimeError("the tree's nodes are no longer in the cache")
        return self._tree_forward([], tokens, parents)

    def _open_tree(self, base: int) -> None:
        """A new tree whose node 1 goes at cache position `base` (its root is the id before it)."""
        self._tree_base, self._tree_parents, self._tree_depths = base, [-1], [0]

    def _tree_forward(self, new: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
        """One forward over uncached ids `new` (causal) and then nodes `tokens` under `parents` (tree-masked)
        -> logits (1 + len(tokens), V) from the last new id on, or (len(tokens), V) without new ids."""
        start, u, n = self.cached, len(new), len(tokens)
        rows = u + n
        first = len(self._tree_parents)  # the first new node's number
        # NOTE: checked before anything changes
        bad = [p for j, p in enumerate(parents) if not 0 <= p < first + j]
        if bad or len(parents) != n or not rows:
            raise ValueError(f"tree nodes need one parent each, fed before them (got {n} nodes, parents {parents})")
        if start + rows > self.kv.capacity:
            raise RuntimeError(f"{start + rows} ids and tree nodes exceed the cache's {self.kv.capacity} positions")
        for parent in parents:
            self._tree_parents.append(parent)
            self._tree_depths.append(self._tree_depths[parent] + 1)
        base = self._tree_base
        bucket = self._bucket(rows, end=self.kv.capacity)  # NOTE: nodes may use the room kept for them
        width = bucket or rows
        # NOTE: the padding's positions are the first row's: any valid one will do (its rows are dropped), and
        # one past the real rows could pass a learned position table's end (GPT-2's) near the context's end
        positions = ([start + i for i in range(u)] + [base - 1 + self._tree_depths[first + j] for j in range(n)]
                     + [start] * (width - rows))
        # visible[r, c]: row r attends to cache position c. Rows are: u ids (causal), n nodes (the ids before
        # base, their ancestors and themselves), then padding (the ids before start and themselves). NumPy: a
        # few microseconds where the same in torch ops took ~50 per call, every draft level and verification.
        prefix = np.array([start + i + 1 for i in range(u)] + [base] * n + [start] * (width - rows))
        columns = self.kv.mask_length(width)
        if len(self._columns) < columns:
            self._columns = np.arange(columns)
        visible = self._columns[None, :columns] < prefix[:, None]  # (width, L)
        for j in range(n):
            a = first + j
            while a > 0:
                visible[u + j, base + a - 1] = True
                a = self._tree_parents[a]
        pad = np.arange(rows, width)
        visible[pad, start + pad] = True
        if self._mask_dtype is None:  # once: through the module tree it costs ~20 us, every level and trie
            self._mask_dtype = self.model.get_input_embeddings().weight.dtype
        hidden = torch.finfo(self._mask_dtype).min
        mask = torch.zeros(visible.shape, dtype=self._mask_dtype).masked_fill_(torch.from_numpy(~visible), hidden)
        ids = to_device([new + tokens + [PAD_ID] * (width - rows)], self.device)  # (1, width)
        kwargs = dict(attention_mask=to_device(mask[None, None], self.device),
                      position_ids=to_device([positions], self.device))
        keep = n + (u > 0)
        if bucket:
            out = self._forward(self.step, ids, logits_to_keep=width, **kwargs)
            self.kv.advance(width)
            self.kv.rollback(start + rows)  # the padding's positions
            # NOTE: clone: a CUDA graph's output buffer is overwritten by its next replay.
            return out.logits[0, rows - keep : rows].clone()
        out = self._forward(self.model, ids, logits_to_keep=keep, **kwargs)
        self.kv.advance(rows)
        return out.logits[0]  # (keep, V)

    def max_tree_nodes(self, requested: int) -> int:
        """Most nodes one `forward_tree` should carry: `requested`, and through a compiled step no more than the
        largest bucket holds besides the id before them (larger tries would run eagerly)."""
        return requested if self.step is None else min(requested, COMPILE_BUCKETS[-1] - 1)

    def tree_room(self, nodes: int) -> int:
        """How many nodes the next `forward_tree` can carry for the price of `nodes`: through a compiled step, the
        rest of its bucket (padding rows cost what nodes do); eagerly, `nodes`."""
        start = min(self.cached, len(self.ids) - 1)  # forward_tree feeds at least the last id
        uncached = len(self.ids) - start
        bucket = self._bucket(uncached + nodes, start, self.kv.capacity)
        return bucket - uncached if bucket else nodes

    def keep_path(self, path: list[int], tokens: list[int]) -> None:
        """After `forward_tree`: keep the nodes on `path` (increasing node numbers) as ids and cache entries,
        in place, and drop every other node."""
        base = self._tree_base
        src = [base + n - 1 for n in path]
        dst = list(range(base, base + len(path)))
        if src != dst:  # already in place when the path is nodes 1, 2, ...
            tensors = [t for pair in self.kv.layer_tensors() for t in pair]  # (1, heads, L, head_dim) each
            bucket = self._move_bucket(len(path), base, tensors)
            if bucket:
                # padded to a bucket by positions past the path copied onto themselves: no destination, and
                # rolled back below
                pad = list(range(base + len(path), base + bucket))
                self.step.move_positions(tensors, to_device(src + pad, self.device), to_device(dst + pad, self.device))
            else:
                index_from, index_to = to_device(src, self.device), to_device(dst, self.device)
                for t in tensors:
                    move_positions([t], index_from.to(t.device), index_to.to(t.device))
        self.kv.rollback(base + len(path))
        self._tree_parents = None
        self.ids.extend(tokens[n] for n in path)

    def _move_bucket(self, length: int, base: int, tensors: list[torch.Tensor]) -> int | None:
        """The padded length of a captured move of `length` positions from `base`, or None to move eagerly (no
        compiled step, a length past the largest bucket, the buffer's end, or layers off the input device)."""
        if getattr(self.step, "move_positions", None) is None:
            return None
        bucket = padded_length(length)
        fits = bucket is not None and base + bucket <= self.kv.capacity
        return bucket if fits and all(t.device == self.device for t in tensors) else None

    def branches(self, rows: int) -> DynamicCache:
        """A DynamicCache with the cached positions repeated over `rows` batch rows (for tree drafting)."""
        cache = DynamicCache(config=self.model.config)
        n = self.cached
        for layer_idx, (keys, values) in enumerate(self.kv.layer_tensors()):
            cache.update(keys[:, :, :n].repeat(rows, 1, 1, 1), values[:, :, :n].repeat(rows, 1, 1, 1), layer_idx)
        return cache


def select_rows(cache: DynamicCache, rows: list[int]) -> None:
    """Reorder (and repeat) a branch cache's batch rows in place: row i becomes old row rows[i]."""
    for layer in cache.layers:
        if layer.is_initialized:
            index = torch.tensor(rows, device=layer.keys.device)
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
