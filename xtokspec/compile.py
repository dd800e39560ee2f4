"""Fixed-shape steps: a model's short forwards padded to a few lengths and captured by torch.compile (CUDA graphs
on a GPU), over the whole-buffer static cache (xtokspec/kv.py)."""

from __future__ import annotations

import logging
import time

import torch

from .kv import cache_keyword, input_device

log = logging.getLogger("xtokspec")

# Lengths a compiled forward is padded to, so that a captured graph is recorded once per bucket, not per K.
# Longer inputs (prompt prefills) run eagerly.
COMPILE_BUCKETS = (1, 2, 4, 8, 16, 32)
PAD_ID = 0  # fills a bucket; its positions are written to the static cache and rolled back at once


def padded_length(length: int) -> int | None:
    """The bucket a compiled forward over `length` ids is padded to, or None past the largest (run eagerly)."""
    return next((b for b in COMPILE_BUCKETS if b >= length), None)



class CompiledStep:
    """`model` compiled for fixed-length calls (CUDA graphs on a GPU: torch.compile's reduce-overhead mode).

    torch.compile compiles inside the first call of each new shape (bucket length x buffer size): seconds on a
    CPU, minutes for a 13B model on a GPU (BENCHMARKS.md, "GPU (H100)"). Those calls are logged (logger
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


def warmup_plan(target, draft, config) -> list[tuple]:
    """Every fixed shape a generation with `config` can run through the compiled steps of `target` and `draft`
    (cache.ModelState after their prompts), as (state, call, n): `call(state, n)` runs that shape once past the
    prompt (XTokSpec.warmup runs each twice, CUDA graphs being recorded on a shape's second call, and rolls back).

    The draft's forwards in every bucket (a drafting step, a resync); the target's, as a chain's verifications or,
    with trees, as tree-masked ones, with the draft's tree levels and the target's moves of an accepted path into
    place."""
    trees = config.tree_width > 1

    def chain(state, n):  # n more ids fed after the prompt: a drafting step, a resync or a verification
        state.extend([state.ids[-1]] * n)
        state.forward(keep=1)

    def trie(state, n):  # the last id and n - 1 trie nodes
        tokens = [0] + [state.ids[-1]] * (n - 1)
        state.forward_tree(tokens, [-1] + [(i - 1) // config.tree_width for i in range(1, n)])
        state.keep_path([], tokens)

    def level(state, n):  # a beam level of n nodes on the draft's cache
        state.grow_tree([state.ids[-1]] * n, [0] * n)

    def move(state, n):  # a kept path of n nodes that is not in place (node 1 is off it): keep_path's move
        tokens = [0] + [state.ids[-1]] * (n + 1)
        state.forward_tree(tokens, [-1, 0, 0] + list(range(2, n + 1)))
        state.keep_path(list(range(2, n + 2)), tokens)

    plan = [(draft, chain, n) for n in COMPILE_BUCKETS]
    plan += [(target, trie if trees else chain, n) for n in COMPILE_BUCKETS]
    if trees and draft.grows_trees:
        widths = {padded_length(w): w for w in range(1, config.tree_width + 1)}  # the widest per bucket
        plan += [(draft, level, w) for w in sorted(widths.values())]
    if trees and config.adaptive and config.fallback:  # a target-alone cycle feeds one id, as a chain does
        plan.append((target, chain, 1))
    if trees:  # an accepted path off the first branch: at most every node but one
        lengths = {padded_length(n): n for n in range(1, target.max_tree_nodes(config.max_tree_nodes))}
        plan += [(target, move, n) for n in sorted(lengths.values())]
    return plan
