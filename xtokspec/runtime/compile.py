"""Fixed-shape steps: a model's short forwards padded to a few lengths and captured, over the whole-buffer static
cache (xtokspec/runtime/kv.py): recorded as CUDA graphs and replayed (`GraphedStep`, SpecConfig(compile="graphs"), the
default on a GPU), or through torch.compile (`CompiledStep`, compile="inductor" or True). `choose_step` decides
which a model gets."""

from __future__ import annotations

import logging
import time
import warnings

import torch

from .kv import cache_keyword, input_device, sliding_layers, takes_tree_masks

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
        self.setup_seconds = 0.0  # spent compiling, in the first call of each shape

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
        seconds = time.perf_counter() - start
        self.setup_seconds += seconds
        log.info("compiled %s in %.1f s", what, seconds)
        return out


class GraphCaptureError(RuntimeError):
    """Recording a CUDA graph failed (an operation in the forward that capture refuses, such as a host sync)."""


class GraphedStep:
    """`model`'s fixed-shape forwards recorded as CUDA graphs (torch.cuda.CUDAGraph) and replayed, without
    inductor: a new shape costs two warm-up forwards and a capture, not a compile. The
    calls are CompiledStep's, so ModelState runs either the same way (padded buckets, rollback, trees).

    A graph replays the kernels it recorded on the addresses it recorded, so:
    - ids, positions and tree masks are copied into input buffers of the graph's own before each replay;
    - the static cache's tensors keep their addresses: its buffers, and each layer's length tensor, by which
      transformers' StaticLayer indexes its writes on the device, are made once (a cache's first forward, eager)
      and passed from one generation to the next (ModelState's `reuse`); a graph is keyed by the cache it writes
      into and holds it, so that its buffers are not freed while the graph can replay;
    - nothing in a captured forward may make the host wait: a chain step's causal mask and positions are made in
      the graph from the cache's length tensor (transformers' own mask reads that length on the host for steps of
      several ids), and models whose attention does not take an explicit mask run eagerly (`graphs_blocker`).
    The output is the graph's own buffer, overwritten by the next replay of any of this step's graphs (they share
    one memory pool): callers copy what they keep at once (ModelState clones the logits it returns)."""

    WARMUP_CALLS = 2  # forwards on a side stream before a capture (torch's recipe: lazy kernel set-up runs there)
    KEPT_CACHES = 2  # caches whose graphs are kept: the one in use and one more (say, a second open stream)

    def __init__(self, model, role: str = "model"):
        self.model = model
        self.role = role
        self.cache_keyword = cache_keyword(model)
        self.device = input_device(model)
        self.dtype = model.get_input_embeddings().weight.dtype  # a chain step's mask's, as a tree mask's
        self.graphs: dict[tuple, tuple] = {}  # (cache, shape) -> (input buffers, replay)
        self.caches: list[int] = []  # the caches that graphs write into (their first buffer's address), oldest first
        self.shapes: set[tuple] = set()  # as CompiledStep's: (ids, buffer size, tree mask); (positions, size, "move")
        self.setup_seconds = 0.0  # spent recording graphs (warm-up forwards and captures)
        self.eager_reason: str | None = None  # why every call runs eagerly (a capture failed), or None
        self.pool = None  # one memory pool for all this step's graphs

    def __call__(self, *, input_ids: torch.Tensor, **kwargs):
        """The recorded forward; `kwargs` name the cache by the model's `cache_keyword`, and a tree-masked step
        passes its 4D `attention_mask` and `position_ids`."""
        cache = kwargs[self.cache_keyword]
        keep = kwargs.get("logits_to_keep", 0)
        tree = kwargs.get("attention_mask") is not None
        inputs = {"input_ids": input_ids}
        if tree:
            inputs.update(attention_mask=kwargs["attention_mask"], position_ids=kwargs["position_ids"])
        layers = cache.layers
        shape = (input_ids.shape[1], layers[0].max_cache_len, tree)
        what = f"the {self.role}'s {shape[0]}-id {'tree ' if tree else ''}step over a {shape[1]}-position cache"

        def run(buffers: dict):
            return self._forward(cache, buffers, keep)

        if not all(layer.is_initialized for layer in layers):  # (ModelState runs a cache's first forward eagerly)
            return run(inputs)
        lengths = [layer.cumulative_length for layer in layers]
        return self._run(layers[0].keys.data_ptr(), shape, what, run, inputs, lengths)

    def _forward(self, cache, inputs: dict, keep: int):
        """The model over `inputs`; a chain step (no mask given) attends causally from the cache's length on."""
        mask, positions = inputs.get("attention_mask"), inputs.get("position_ids")
        if mask is None:
            layer = cache.layers[0]
            width, size = inputs["input_ids"].shape[1], layer.max_cache_len
            rows = layer.cumulative_length + torch.arange(width, device=layer.keys.device)  # (width,) positions
            visible = torch.arange(size, device=layer.keys.device)[None, :] <= rows[:, None]  # (width, size)
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=visible.device)
            mask = mask.masked_fill_(~visible, torch.finfo(self.dtype).min)[None, None]
            positions = rows[None]
        return self.model(input_ids=inputs["input_ids"], attention_mask=mask, position_ids=positions,
                          use_cache=True, logits_to_keep=keep, **{self.cache_keyword: cache})

    def move_positions(self, tensors: list[torch.Tensor], index_from: torch.Tensor, index_to: torch.Tensor) -> None:
        """`move_positions`, one replay per index length (the buckets) and cache: eagerly two small kernels per
        layer tensor (~160 launches for a 40-layer target)."""
        shape = (index_from.shape[0], tensors[0].shape[2], "move")
        what = f"the {self.role}'s {shape[0]}-position move over a {shape[1]}-position cache"

        def run(buffers: dict):
            move_positions(tensors, buffers["index_from"], buffers["index_to"])

        # NOTE: warmed up and recorded on indices that copy positions onto themselves: a move run twice is not one
        # move (a position it reads may have been written by the first)
        self._run(tensors[0].data_ptr(), shape, what, run, {"index_from": index_from, "index_to": index_to}, [],
                  warm={"index_from": index_to, "index_to": index_to})

    def _run(self, cache: int, shape: tuple, what: str, run, inputs: dict, lengths: list, warm: dict | None = None):
        """`run` replayed from its graph for this cache and shape (recorded at its first call): `inputs` copied into
        the graph's buffers. `lengths`: the cache's length tensors, which warm-up forwards advance and which are
        put back before the capture (a capture runs nothing: the first replay makes this call's writes)."""
        if self.eager_reason is not None:
            return run(inputs)
        entry = self.graphs.get((cache, shape))
        if entry is None:
            entry = self._capture(cache, shape, what, run, warm or inputs, lengths)
            if entry is None:
                return run(inputs)
        buffers, replay = entry
        for name, tensor in inputs.items():
            buffers[name].copy_(tensor, non_blocking=True)
        return replay()

    def _capture(self, cache: int, shape: tuple, what: str, run, inputs: dict, lengths: list):
        """Record `run` over buffers holding `inputs` -> (buffers, replay), or None where capture failed (then this
        step runs eagerly from now on, with a warning naming why)."""
        log.info("capturing %s as a CUDA graph", what)
        start = time.perf_counter()
        buffers = {name: tensor.clone() for name, tensor in inputs.items()}
        saved = [length.clone() for length in lengths]

        def restore():
            for length, value in zip(lengths, saved, strict=True):
                length.copy_(value)

        try:
            replay = self._record(lambda: run(buffers), restore)
        except GraphCaptureError as err:
            self.eager_reason = f"recording {what} failed: {err}"
            warnings.warn(f"the {self.role}'s steps run eagerly from now on, without CUDA graphs: {self.eager_reason}",
                          UserWarning, stacklevel=2)
            return None
        if cache not in self.caches:
            if len(self.caches) >= self.KEPT_CACHES:  # an older cache's graphs go, and with them their hold on it
                dropped = self.caches.pop(0)
                self.graphs = {key: value for key, value in self.graphs.items() if key[0] != dropped}
            self.caches.append(cache)
        self.graphs[(cache, shape)] = buffers, replay
        self.shapes.add(shape)
        seconds = time.perf_counter() - start
        self.setup_seconds += seconds
        log.info("captured %s in %.2f s", what, seconds)
        return buffers, replay

    def _record(self, run, restore):
        """CUDA: `run` warmed up on a side stream (then `restore`d), and recorded -> replay(), which runs the
        recorded kernels and returns the recorded output."""
        with torch.cuda.device(self.device):
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            current = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(self.WARMUP_CALLS):
                    run()
                    restore()
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):  # records: nothing runs until a replay
                    out = run()
            except Exception as err:  # noqa: BLE001 (a refused operation, or capture_end after one)
                raise GraphCaptureError(str(err).strip().splitlines()[0] if str(err).strip() else repr(err)) from err

        def replay():
            graph.replay()
            return out

        return replay


def graphs_blocker(model, cache: str = "auto") -> str | None:
    """Why `model`'s steps cannot be recorded as CUDA graphs with SpecConfig(cache=cache), or None if they can."""
    device = input_device(model)
    if device.type != "cuda":
        return f"its inputs are on {device}, not a CUDA device"
    devices = sorted({str(p.device) for p in model.parameters()})
    if len(devices) > 1:
        return f"its weights span {', '.join(devices)}; a graph is recorded on one device"
    sliding = sliding_layers(model)
    if sliding:
        return f"it has {sliding} layers, which the static cache that a graph writes into cannot roll back"
    if cache == "dynamic":
        return "cache='dynamic' was asked for, and a graph writes into the static cache"
    if not takes_tree_masks(model):
        attention = getattr(model.config, "_attn_implementation", None)
        return (f"its attention {attention!r} does not take the step's explicit mask (sdpa and eager do), and its "
                "own masking reads the cache's length on the host, which a graph cannot hold")
    return None


def choose_step(model, compile, cache: str = "auto", role: str = "model"):
    """The step `model`'s short forwards run through with SpecConfig(compile=compile, cache=cache): a GraphedStep,
    a CompiledStep, or None (eager). "graphs" where graphs cannot be recorded, and "auto" on a CUDA device where
    they cannot, warn with the reason and run eagerly; "auto" elsewhere (the CPU) is eager without a word, as is
    "auto" with cache="dynamic"."""
    if compile is False:
        return None
    if compile is True or compile == "inductor":
        return CompiledStep(model, role)
    reason = graphs_blocker(model, cache)
    if reason is None:
        return GraphedStep(model, role)
    if compile == "graphs" or (input_device(model).type == "cuda" and cache != "dynamic"):
        hint = "" if compile == "graphs" else " (compile=False runs eagerly without this warning)"
        warnings.warn(f"the {role}'s steps run eagerly, without CUDA graphs: {reason}{hint}", UserWarning, stacklevel=3)
    return None


def step_kind(step) -> str | None:
    """"graphs", "inductor" or None (eager), for GenerationStats.cache."""
    return "graphs" if isinstance(step, GraphedStep) else "inductor" if isinstance(step, CompiledStep) else None


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
