"""A model's token ids and its KV cache: with its backends (xtokspec/runtime/kv.py), the only code that knows the cache
layout.

Invariant: the cache holds keys/values for exactly `ids[:cached]`; `forward` feeds `ids[cached:]`, and
`truncate(n)` drops ids and cached positions past n in place (a rejection costs no recompute). Short forwards
run through a compiled fixed-shape step (xtokspec/runtime/compile.py) when the model has one.

Token trees (xtokspec/decode/tree.py): `forward_tree` feeds the uncached ids and then a trie's nodes in one forward,
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

import logging

import numpy as np
import torch
from transformers import DynamicCache

from .compile import COMPILE_BUCKETS, PAD_ID, move_positions, padded_length
from .kv import (
    DynamicKV,
    RollbackTooDeep,
    StaticKV,
    buffer_capacity,
    cache_keyword,
    dynamic_cache,
    input_device,
    sliding_layers,
    takes_tree_masks,
    to_device,
)

log = logging.getLogger("xtokspec")


class ModelState:
    """A causal LM with its committed/proposed ids and a KV cache covering a prefix of them.

    With `step` (a compiled model; static backend only), forwards of up to COMPILE_BUCKETS[-1] new ids are
    padded to the next bucket length and run through it; the padding's cache positions are rolled back.
    """

    def __init__(self, model, ids: list[int], backend: str = "dynamic", capacity: int | None = None, step=None,
                 tree_nodes: int = 0, reuse: StaticKV | None = None):
        """`reuse`: the static cache (`kv`) of an earlier ModelState of this model, run the same way (compiled or
        eager), taken over if it is large enough: its buffers keep their addresses, so captured graphs stay valid
        and nothing is allocated, initialised or recompiled. Its old contents are harmless: the new prefill
        starts writing at position 0, and until a position is written again the causal mask hides it, as after
        any rollback."""
        assert step is None or backend == "static", "a compiled step needs the static backend"  # SpecConfig checks
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
            self.kv = StaticKV(model, capacity + tree_nodes, prefix=step is None)
        else:
            self.kv = DynamicKV(model, capacity + tree_nodes)

    @property
    def cached(self) -> int:
        return self.kv.length

    @property
    def capacity(self) -> int:
        """Most ids the cache can hold (the static buffer's size; the model's context when dynamic), not counting
        the room kept for tree nodes."""
        return self.kv.capacity - self.tree_nodes

    def uncache_last(self, n: int) -> None:
        """Roll the cache back, where it covers any of the last n ids, so that the next forward feeds them (and
        returns their logits)."""
        if len(self.ids) - self.cached < n:
            self._rollback(len(self.ids) - n)

    def forward(self, keep: int) -> torch.Tensor:
        """Feed ids[cached:] and return the logits (keep, V) of the last `keep` of them."""
        self.uncache_last(1)  # all ids cached (e.g. after a rollback): the last one is fed again
        cached = self.cached
        new = self.ids[cached:]
        if not 1 <= keep <= len(new):
            raise RuntimeError(f"forward over {len(new)} new ids cannot keep {keep} logits")
        if len(self.ids) > self.capacity:
            raise RuntimeError(f"{len(self.ids)} ids exceed the cache's {self.capacity} positions")
        bucket = self._bucket(len(new), cached) if self.step is not None else None
        if bucket:
            padded = to_device([new + [PAD_ID] * (bucket - len(new))], self.device)
            return self._run_step(padded, len(new))[len(new) - keep :]  # (keep, V)
        input_ids = to_device([new], self.device)  # (1, T)
        out = self._forward(self.model, input_ids, logits_to_keep=keep)
        self.kv.advance(len(new))
        return out.logits[0]  # (keep, V)

    def forward_last(self, n: int) -> torch.Tensor:
        """`forward` keeping the logits (n, V) of the last n ids, their cache positions fed again where they are
        cached already (a rollback of at most n - 1 positions)."""
        self.uncache_last(n)
        return self.forward(keep=n)

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
        cached = self.cached
        if cached + tokens.shape[1] > self.capacity:
            raise RuntimeError(f"{cached + tokens.shape[1]} ids exceed the cache's {self.capacity} positions")
        if self.step is not None and self._bucket(tokens.shape[1], cached) == tokens.shape[1]:
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
        self._rollback(n)
        self._tree_parents = None  # an open tree's nodes are past every id: gone

    def _rollback(self, n: int) -> None:
        """Roll the cache back to n positions; where a sliding-window layer no longer holds what that needs (a
        rollback deeper than DynamicKV keeps room for), start a new cache: the next forward feeds every id."""
        try:
            self.kv.rollback(n)
        except RollbackTooDeep as err:
            log.warning("%s; the cache is rebuilt from its %d ids", err, n)
            self.kv = DynamicKV(self.model, self.kv.capacity, self.kv.spare)

    @property
    def prefilling(self) -> bool:
        """Whether the next forward feeds more than one uncached id (the prompt, or ids after a resync)."""
        return len(self.ids) - self.cached > 1

    def extend(self, ids: list[int]) -> None:
        """Append ids that the next forward will feed."""
        self.ids.extend(ids)

    def commit(self, proposed: int, accepted: int, next_token: int) -> None:
        """After a chain verification that fed `proposed` proposal ids: keep `accepted` of them, then `next_token`."""
        self.truncate(len(self.ids) - proposed + accepted)
        self.ids.append(next_token)

    def commit_path(self, path: list[int], tokens: list[int], next_token: int) -> None:
        """After `forward_tree`: keep the nodes on `path` (`keep_path`), then append `next_token`."""
        self.keep_path(path, tokens)
        self.ids.append(next_token)

    def resync(self, keep: int, extra: list[int]) -> None:
        """Keep ids[:keep] and append `extra` (uncached: the next forward feeds them)."""
        self.truncate(keep)
        self.ids.extend(extra)

    def drop(self, start: int, n: int) -> None:
        """Forget ids[start:start + n] (a draft's window of the text moves on); the next forward feeds every id
        again, at its new position."""
        del self.ids[start : start + n]
        if self.backend == "static":
            self.kv.reset()
        else:
            self.kv = DynamicKV(self.model, self.kv.capacity, self.kv.spare)
        self._tree_parents = None

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
        self.uncache_last(1)
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
        cache = dynamic_cache(self.model)
        n = self.cached
        for layer_idx, (keys, values) in enumerate(self.kv.layer_tensors()):
            cache.update(keys[:, :, :n].repeat(rows, 1, 1, 1), values[:, :, :n].repeat(rows, 1, 1, 1), layer_idx)
            if getattr(cache.layers[layer_idx], "is_sliding", False):
                # NOTE: a sliding window's layer holds only its last positions: its length is the cache's, or the
                # rows' positions and masks would start at the wrong place
                cache.layers[layer_idx].cumulative_length = n
        return cache

