"""The facade: `XTokSpec(large, small).generate(prompt)`, lossless speculative decoding across tokenizers.

It owns the two models, their tokenizers' byte views, the resources that outlive one generation (compiled steps,
idle static caches, the token map, measured costs) and builds each generation's `loop.Run` from the options:
its mapper (xtokspec/mapping.py), proposer (xtokspec/propose.py), verifier's sampler and policies
(xtokspec/policy.py). The loop itself is xtokspec/loop.py.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from . import chat, loop, options, sampling
from .bridge import TextSync
from .cache import ModelState
from .codec import TokenCodec
from .compile import choose_step, step_kind, warmup_plan
from .kv import choose_backend, context_limit, input_device, sliding_layers, takes_tree_masks
from .mapping import IntersectionMap, SameVocab, Switching, TextBridge, VocabMaps
from .models import (
    DraftVocab,
    check_source,
    choose_draft_vocab,
    cpu_bf16_note,
    eos_ids,
    frozen_head_note,
    load,
    no_length_warning,
    trimmed_draft,
)
from .policy import DraftingCost, DraftLength, Fallback, ProposalChooser, TreeBudget, VerifyCost
from .propose import ChainProposer, TreeProposer
from .types import GenerationResult, GenerationStats, SamplingParams, SpecConfig, XTokSpecError, check_prompt
from .verify import Sampler

log = logging.getLogger("xtokspec")


class XTokSpec:
    """Lossless speculative decoding of `large` (the target) with `small` (the draft), any two tokenizers.

    `large` and `small` are each a local folder or hub id (loaded with `large_kwargs` / `small_kwargs`, e.g.
    dtype, device_map) or an already loaded `(model, tokenizer)` pair. The models may sit on different devices.
    Both arguments are checked before either model loads. `progress=True` shows transformers' "Loading weights"
    bars (hidden by default, as in the CLI; the hub's download bars show either way).
    """

    # The policy that decides before each cycle whether to run the target alone: None for the measured one
    # (policy.Fallback, SpecConfig.fallback), or a callable config -> an object with run_alone() and
    # observe(cycle), e.g. to script which cycles draft. Set on the class or on one XTokSpec.
    fallback_policy = None

    def __init__(self, large, small, *, config: SpecConfig | None = None, large_kwargs=None, small_kwargs=None,
                 progress: bool = False):
        self.config = config or SpecConfig()
        # NOTE: both checked first: a mistyped draft is named before the target's seconds of loading
        large, small = check_source(large, "target (large)"), check_source(small, "draft (small)")
        self.target_model, self.target_tokenizer = load(large, "target (large)", progress, **(large_kwargs or {}))
        self.draft_model, self.draft_tokenizer = load(small, "draft (small)", progress, **(small_kwargs or {}))
        self.target = TokenCodec(self.target_tokenizer, self.target_model.config.vocab_size, "target tokenizer")
        self.draft = TokenCodec(self.draft_tokenizer, self.draft_model.config.vocab_size, "draft tokenizer")
        notes = [frozen_head_note(self.target_model, "target (large)"), frozen_head_note(self.draft_model, "draft (small)"),
                 cpu_bf16_note(self.target_model, "the target (large)")]
        for note in filter(None, notes):
            warnings.warn(note, UserWarning, stacklevel=2)
        self.target_eos = eos_ids(self.target_model, self.target_tokenizer)
        self.draft_eos = eos_ids(self.draft_model, self.draft_tokenizer)
        self.same_vocab = self.target_tokenizer.get_vocab() == self.draft_tokenizer.get_vocab()
        self.vocab_maps = VocabMaps(self.target, self.draft, self.target_eos, self.draft_eos)
        self._full_draft_model = self.draft_model  # trim_draft_vocab replaces draft_model by a view of this
        self.draft_vocab: DraftVocab | None = None
        self._steps: dict[int, object] = {}  # id(model) -> its step (SpecConfig.compile), or None: eager
        self._idle_kv: dict[int, object] = {}  # id(model) -> its static cache, between generations
        self._tree_size_times: dict = {}  # captured tree verification costs per size (policy.TreeBudget)
        self._alone_times = collections.deque(maxlen=Fallback.ALONE_SAMPLES)  # target-alone cycle seconds
        # what drafting costs and how often it is accepted, per setting (config, sampling, kind): the fallback's
        # DraftingCost and the DraftLength policy carry over between generations (the costs are the models' and
        # the device's, the acceptance the pair's on similar text), so a later generation starts from them
        self._learned: dict[tuple, tuple[DraftingCost, DraftLength]] = {}
        self._custom_generate = None
        self.last_stats: GenerationStats | None = None  # of the last custom_generate call (transformers' generate)

    # ---------------------------------------------------------------- public API
    def describe(self) -> str:
        """One line naming both models with their class, dtype and device (the CLI prints it)."""

        def one(role, model):
            name = Path(str(getattr(model, "name_or_path", "") or "?")).name
            dtype = str(model.dtype).removeprefix("torch.")
            return f"{role} {name} ({type(model).__name__}, {dtype}, {input_device(model)})"

        trimmed = f" [head: {self.draft_vocab.keep.numel()} of {self.draft_vocab.vocab_size} ids]" if self.draft_vocab else ""
        return f"{one('target', self.target_model)}; {one('draft', self.draft_model)}{trimmed}"

    def trim_draft_vocab(self, texts, size: int = 32768) -> DraftVocab | None:
        """Let the draft's output head compute only `size` ids: those most frequent in `texts` (calibration text
        like what you will generate, e.g. thousands of paragraphs, or the target's own outputs on your prompts),
        plus EOS and single-byte ids. `texts=None` restores the full head. -> what was kept.

        For drafts whose head is a large share of a step (Gemma-3-270M: 262k ids, 42% of a CPU step), this makes
        each draft step cheaper (FR-Spec, Zhao et al. 2025). The output stays lossless whatever is kept: the draft
        only proposes, and the verifier is given the trimmed draft's own distributions. Out-of-domain text costs
        acceptance wherever the target wants an id the head no longer scores (BENCHMARKS.md, "A trimmed draft
        head": with man pages and Python source for general Japanese prompts, as much as the cheaper step gains).
        """
        # NOTE: both may raise; nothing has changed yet, so bad input keeps the head as it was
        vocab = None if texts is None else choose_draft_vocab(self.draft, texts, size, self.draft_eos)
        model = self._full_draft_model if vocab is None else trimmed_draft(self._full_draft_model, vocab.keep)
        if self.draft_model is not self._full_draft_model:
            # NOTE: compiled steps are keyed by id(model); the old view is dropped here, and a new one could reuse its id
            self._steps.pop(id(self.draft_model), None)
            self._idle_kv.pop(id(self.draft_model), None)
        self.draft_model, self.draft_vocab = model, vocab
        return vocab

    def generate(self, prompt: str | None = None, max_new_tokens: int = 128, **kwargs) -> GenerationResult:
        """Continue `prompt`, or answer chat `messages=[{"role": "user", "content": ...}, ...]` (rendered with the
        target's chat template; xtokspec/chat.py); greedy by default, or do_sample=True with temperature / top_k
        / top_p / seed.

        Other keywords: proposal ("auto" | "onehot" | "intersection"), num_draft_tokens, adaptive, tree_width;
        SpecConfig's other fields are the XTokSpec's, and passing one here is an error naming so.

        `seed`: whatever the seed, a sample is distributed as the target's own. The same seed gives the same
        sample when the drafted cycles are the same, which holds with `SpecConfig(adaptive=False)` (or
        adaptive=False here): a fixed K and no fallback. With adaptive K and the fallback to the target alone
        (the default), K and which cycles run the target alone follow measured timings and this XTokSpec's
        earlier generations, so the same seed can give another sample (from the same distribution).
        """
        stats = GenerationStats()
        token_ids: list[int] = []
        for new_ids in self._cycles(prompt, max_new_tokens, stats, **kwargs):
            token_ids += new_ids
        text = self._decode(token_ids)
        return GenerationResult(text=text, token_ids=token_ids, stats=stats, stop_reason=stats.stop_reason)

    def stream(self, prompt: str | None = None, max_new_tokens: int = 128, stats: GenerationStats | None = None,
               **kwargs) -> Iterator[str]:
        """Yield the continuation's text as soon as it is verified (whole characters only); `messages=` as in
        `generate`."""
        token_ids: list[int] = []
        shown = ""
        for new_ids in self._cycles(prompt, max_new_tokens, stats or GenerationStats(), **kwargs):
            token_ids += new_ids
            text = self._decode(token_ids)
            stable = text.rstrip("\ufffd")  # an incomplete trailing character decodes to U+FFFD: wait for it
            if len(stable) > len(shown) and stable.startswith(shown):
                yield stable[len(shown) :]
                shown = stable
        text = self._decode(token_ids)
        if text != shown:
            yield text[len(shown) :] if text.startswith(shown) else text

    def warmup(self, prompt: str, max_new_tokens: int = 128, *, tree_width: int | None = None,
               progress: bool = True) -> int:
        """With captured steps (CUDA graphs, the default on a GPU; or `compile="inductor"`): record or compile now
        every shape that generations of this prompt's size can meet, so that none of them stops for it (a first
        call of a new shape: two warm-up forwards and a capture to record a graph; to compile, seconds on a CPU and
        tens of seconds per shape for a 13B model on a GPU). Returns the number of shapes; 0 where both models run eagerly (the
        CPU's default). How long it took is logged (logger "xtokspec", INFO) and added to `capture_seconds`.

        Compiled calls are specialised on the cache's size class (buffers of 256, 384, 512, 768, ... positions),
        which the prompt's length plus `max_new_tokens` decides: warm up with a prompt and a `max_new_tokens`
        like those you will serve (a generation in another class compiles its own shapes, once). The shapes are
        `compile.warmup_plan`'s: the draft's forwards in every bucket, and the target's, as a chain's
        verifications or, with `tree_width` > 1 (default: the config's), as tree-masked ones, with the draft's
        tree levels and the target's moves of an accepted path into place."""
        config = options.call_config(self.config, tree_width=tree_width)
        target_ids, draft_ids = self._check_prompt(prompt, max_new_tokens)  # NOTE: refused before any step is made
        self._check_trees(config)
        steps = [self._step(model) for model in (self.target_model, self.draft_model)]
        if not any(steps):
            return 0
        from tqdm.auto import tqdm

        target, draft = self._states(target_ids, draft_ids, max_new_tokens, config)
        plan = warmup_plan(target, draft, config)
        before = self.capture_seconds
        kinds = sorted({step_kind(step) for step in steps} - {None})
        try:
            with torch.inference_mode():
                for state in (target, draft):
                    state.forward(keep=1)  # the prompt (eager: a cache's first forward always is)
                desc = "recording CUDA graphs" if kinds == ["graphs"] else "compiling"
                for state, call, n in tqdm(plan, desc=desc, disable=not progress):
                    prompt_len = len(state.ids)
                    for _ in range(2):  # torch.compile's CUDA graphs are recorded on a shape's second call
                        call(state, n)
                        state.truncate(prompt_len)
        finally:
            self._release(target)
            self._release(draft)
        log.info("warmup: %d shapes (%s) ready in %.1f s", len(plan), " and ".join(kinds),
                 self.capture_seconds - before)
        return len(plan)

    @property
    def capture_seconds(self) -> float:
        """Seconds this XTokSpec has spent recording CUDA graphs or compiling its steps (warmup and first calls of
        new shapes in generations); each generation's share is its `stats.capture_seconds`."""
        return sum(step.setup_seconds for step in self._steps.values() if step is not None)

    @property
    def custom_generate(self):
        """The decoding loop for transformers' generate on the target model (lossless, like `generate`):

            out = large_model.generate(**inputs, custom_generate=spec.custom_generate, max_new_tokens=64,
                                       streamer=streamer, do_sample=True, temperature=0.7, seed=0)

        It honours max_new_tokens / max_length, EOS, stop_strings (pass tokenizer=), stopping criteria and a
        streamer; xtokspec's own options (seed, proposal, num_draft_tokens, adaptive, tree_width) may be passed
        to generate too. The statistics of the last call are in `spec.last_stats`. See xtokspec/hf.py."""
        if self._custom_generate is None:
            from . import hf

            def custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
                return hf.hf_generate(self, model, input_ids, logits_processor, stopping_criteria, generation_config,
                                      **kwargs)

            hf.install(self.target_model, custom_generate)
            self._custom_generate = custom_generate
        return self._custom_generate

    def draft_prompt_ids(self, target_ids: list[int]) -> list[int]:
        """The draft's prompt for a prompt given as target ids: their text in the draft's own encoding."""
        self._check_length(target_ids)
        if self.same_vocab:
            return list(target_ids)
        text = self._decode(target_ids)
        if not text:
            raise XTokSpecError("the prompt ids stand for no text (only special tokens): give some text to continue")
        with no_length_warning(self.draft_tokenizer):
            return self.draft.encode_prompt(text)

    def sampling_params(self, do_sample=None, temperature=None, top_k=None, top_p=None, seed=None) -> SamplingParams:
        """Sampling parameters as the target's `generate` would resolve them from its generation_config."""
        options.check_neutral(self.target_model.generation_config)
        # NOTE: the warning about ignored values names the user's call: user code -> generate -> _cycles -> here
        return options.sampling_params(self.target_model.generation_config, do_sample, temperature, top_k, top_p,
                                       seed, stacklevel=4)

    def cycles(self, target_ids: list[int], draft_ids: list[int], max_new_tokens: int, stats: GenerationStats,
               params: SamplingParams, *, proposal=None, num_draft_tokens=None, adaptive=None,
               tree_width=None) -> Iterator[list[int]]:
        """The loop over prepared prompt ids (the target's and the draft's): each cycle's committed target ids.
        `generate`, `stream` and the transformers entry point (xtokspec/hf.py) run on it."""
        config = options.call_config(self.config, num_draft_tokens, adaptive, tree_width)
        self._check_trees(config)
        kind = options.proposal_kind(self.same_vocab, params, proposal or config.proposal, config.tree_width)
        stats.proposal = kind + (" tree" if config.tree_width > 1 else "")
        # Inference mode around each cycle, never across a yield: the caller's code between two cycles (another
        # stream's, a training step) runs in its own grad mode, and interleaved streams cannot leave it switched off
        with torch.inference_mode():
            target, draft = self._states(target_ids, draft_ids, max_new_tokens, config)
            before = self.capture_seconds
            steps = loop.cycles(self._run(target, draft, stats, params, config, kind), max_new_tokens)
        try:
            while True:
                with torch.inference_mode():
                    new_ids = next(steps, None)
                if new_ids is None:
                    return
                yield new_ids
        finally:  # also when a stream is closed early
            with torch.inference_mode():
                steps.close()
                stats.capture_seconds = self.capture_seconds - before
                self._release(target)
                self._release(draft)

    # ---------------------------------------------------------------- the vocabularies
    def _decode(self, token_ids: list[int]) -> str:
        # NOTE: no clean-up: it deletes spaces before punctuation, and the text must be the tokens' own
        return self.target_tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # ---------------------------------------------------------------- one generation
    def _cycles(self, prompt, max_new_tokens, stats, *, messages=None, do_sample=None, temperature=None, top_k=None,
                top_p=None, seed=None, **kwargs) -> Iterator[list[int]]:
        unknown = sorted(set(kwargs) - set(options.keyword_only(self.cycles)))
        if unknown:  # NOTE: the keywords named are the ones these signatures take, so they cannot drift apart
            known = (options.keyword_params(self.generate, skip=("prompt",)) + options.keyword_only(self._cycles)
                     + options.keyword_only(self.cycles))
            raise XTokSpecError(options.unknown_options_message(unknown, known))
        if messages is not None:  # chat: the template's text carries its own special tokens
            if prompt is not None:
                raise XTokSpecError("pass either a prompt or messages, not both")
            prompt, draft_prompt = chat.render(messages, self.target_tokenizer, self.draft_tokenizer)
            target_ids, draft_ids = self._check_prompt(prompt, max_new_tokens, draft_prompt, special=False)
        else:
            target_ids, draft_ids = self._check_prompt(prompt, max_new_tokens)  # NOTE: the prompt's errors first
        params = self.sampling_params(do_sample, temperature, top_k, top_p, seed)
        yield from self.cycles(target_ids, draft_ids, max_new_tokens, stats, params, **kwargs)

    def _check_prompt(self, prompt, max_new_tokens, draft_prompt=None, special=True) -> tuple[list[int], list[int]]:
        """Both models' prompt ids (the draft's from `draft_prompt` if given; `special=False`: no BOS added, the
        text has its own special tokens, as a chat template's does)."""
        check_prompt(prompt)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise XTokSpecError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        with no_length_warning(self.target_tokenizer, self.draft_tokenizer):  # NOTE: _check_length names it
            target_ids = self.target.encode_prompt(prompt, special)
            self._check_length(target_ids)
            draft_ids = target_ids if self.same_vocab else self.draft.encode_prompt(draft_prompt or prompt, special)
        return target_ids, draft_ids

    def _check_length(self, target_ids: list[int]) -> None:
        limit = context_limit(self.target_model)
        if limit and len(target_ids) >= limit:
            raise XTokSpecError(
                f"prompt is {len(target_ids)} target tokens, but the target's context is {limit} positions"
            )

    def _check_trees(self, config: SpecConfig) -> None:
        """Token trees need a target that can verify a trie in one forward."""
        if config.tree_width > 1 and sliding_layers(self.target_model):
            raise XTokSpecError(
                f"token trees (tree_width={config.tree_width}) need full-attention layers in the target; "
                f"{type(self.target_model).__name__} has {sliding_layers(self.target_model)} layers: use tree_width=1"
            )
        if config.tree_width > 1 and not takes_tree_masks(self.target_model):
            raise XTokSpecError(
                f"token trees (tree_width={config.tree_width}) verify with a tree attention mask, which the target's "
                f"attention implementation {self.target_model.config._attn_implementation!r} does not apply: load it "
                f"with attn_implementation='sdpa' (or 'eager'), or use tree_width=1"
            )

    def _run(self, target: ModelState, draft: ModelState, stats: GenerationStats, params: SamplingParams,
             config: SpecConfig, kind: str) -> loop.Run:
        """One generation's loop state: its mapper, proposer, sampler and policies."""
        kinds = {step_kind(target.step), step_kind(draft.step)}
        stats.cache = (f"{target.backend}/{draft.backend}" + ("+graphs" if "graphs" in kinds else "")
                       + ("+compile" if "inductor" in kinds else ""))
        warpers = sampling.build_warpers(params) if params.do_sample else None
        sampler = draft_gen = None
        if params.do_sample:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
            sampler = Sampler(warpers, torch.Generator(device=input_device(self.target_model)).manual_seed(seed))
            draft_gen = torch.Generator(device=input_device(self.draft_model)).manual_seed(seed + 1)
        setting = (config, dataclasses.replace(params, seed=None), kind)
        if setting not in self._learned:
            self._learned[setting] = DraftingCost(alone_run=Fallback.PROBE_DRAFT_FIRST), DraftLength(config, VerifyCost())
        drafting, draft_length = self._learned[setting]
        fallback = (self.fallback_policy(config) if self.fallback_policy is not None
                    else Fallback(config, self._alone_times, drafting))
        budget = TreeBudget(config, draft_length.verify_cost, self._tree_size_times)
        target_vocab = self.target_model.config.vocab_size
        draft_device = input_device(self.draft_model)
        if config.tree_width > 1:
            groups = params.do_sample and config.tree_root == "sampled"
            roots = (self.vocab_maps.root_groups(self.same_vocab, target_vocab, self.draft_model.config.vocab_size)
                     .to(draft_device) if groups else None)
            proposer = TreeProposer(config.tree_width, self.draft_eos, self.draft.token_bytes, budget, target,
                                    target.max_tree_nodes(config.max_tree_nodes), warpers, draft_gen, roots,
                                    target_vocab)
        else:
            proposer = ChainProposer(self.draft_eos, warpers, draft_gen, config.draft_confidence, self.draft.token_bytes)
        draft_limit = min(context_limit(self.draft_model) or 1 << 30, draft.capacity, config.draft_context or 1 << 30)
        target_limit = min(context_limit(self.target_model) or 1 << 30, target.capacity)
        return loop.Run(target, draft, self._mapper(kind, config, draft.ids), proposer, sampler, draft_length, fallback,
                        (stats, draft_length, budget, fallback) if config.tree_width > 1 else (stats, draft_length, fallback),
                        stats, self.target_eos, target_limit, draft_limit,
                        config.max_draft_tokens + 1)

    def _mapper(self, kind: str, config: SpecConfig, draft_prompt: list[int]):
        """The mapper for a proposal kind (options.proposal_kind)."""
        logits_device = self.target_model.get_output_embeddings().weight.device
        target_vocab = self.target_model.config.vocab_size
        bos = self.draft_tokenizer.bos_token_id
        head = int(bos is not None and draft_prompt[:1] == [bos])  # a window of the text keeps the BOS
        if kind == "same-tokenizer":
            return SameVocab(target_vocab, logits_device, head)
        sync = TextSync(self.target, self.draft, config.draft_lookbehind)
        # NOTE: healing leaves the restated token's text pending, which only the bridge's one-hot proposals carry:
        # "auto" heals in its one-hot cycles (a healed cycle has no first-position row for the chooser to score),
        # the intersection map never; trees do not (their draft cache holds one level per step)
        healing = config.draft_healing and kind in ("greedy-bridge", "onehot", "auto") and config.tree_width == 1
        bridge = TextBridge(sync, self.target_eos, len(draft_prompt), "greedy-bridge" if kind == "greedy-bridge" else "onehot",
                            head, self.vocab_maps.draft_index, healing)
        if kind in ("greedy-bridge", "onehot"):
            return bridge
        draft_device = input_device(self.draft_model)
        intersection = IntersectionMap(bridge, self.vocab_maps.draft_to_target(draft_device), target_vocab, logits_device)
        if kind == "intersection":
            return intersection
        # "auto": one-hot or intersection, chosen each cycle; the chooser scores on the target's logits device
        maps = self.vocab_maps
        start = "intersection" if maps.token_map.mapped_draft_share >= config.min_mapped_mass else "onehot"
        return Switching(bridge, intersection, ProposalChooser(start), maps.first_pieces.to(logits_device),
                         maps.draft_to_target(logits_device))

    # ---------------------------------------------------------------- caches
    def _step(self, model):
        """`model`'s step (compile.choose_step: CUDA graphs, torch.compile, or None for eager), chosen once per
        XTokSpec (a model that cannot be captured is named in a warning then)."""
        if id(model) not in self._steps:
            role = "target" if model is self.target_model else "draft"
            self._steps[id(model)] = choose_step(model, self.config.compile, self.config.cache, role)
        return self._steps[id(model)]

    def _model_state(self, model, ids: list[int], config: SpecConfig, capacity: int, tree_nodes: int = 0) -> ModelState:
        """ids + KV cache with the configured backend (and the model's captured step, if it has one)."""
        step = self._step(model)
        backend = choose_backend(model, config.cache, step is not None)
        reuse = None
        if backend == "static":
            # NOTE: taken, not shared: a generation still running (another open stream) keeps its own cache
            reuse = self._idle_kv.pop(id(model), None)
        return ModelState(model, ids, backend, capacity, step, tree_nodes, reuse)

    def _states(self, target_ids: list[int], draft_ids: list[int], max_new_tokens: int,
                config: SpecConfig) -> tuple[ModelState, ModelState]:
        """Both models' ids and caches for a generation of `max_new_tokens`, sized as the loop needs them: the
        draft's text in its own tokens is unknown in advance, so at most 3 per target token is budgeted."""
        trees = config.tree_width > 1
        target = self._model_state(self.target_model, target_ids, config, len(target_ids) + max_new_tokens,
                                   config.max_tree_nodes if trees else 0)
        # the draft's beam: at most tree_width nodes per level, one level per draft step (grow_tree)
        draft = self._model_state(self.draft_model, draft_ids, config,
                                  len(draft_ids) + 3 * max_new_tokens + 2 * config.max_draft_tokens + 16,
                                  config.tree_width * config.max_draft_tokens if trees else 0)
        return target, draft

    def _release(self, state: ModelState) -> None:
        """A finished generation's static cache, kept for the next one (the larger, if two finish)."""
        if state.backend == "static":
            idle = self._idle_kv.get(id(state.model))
            if idle is None or idle.capacity < state.kv.capacity:
                self._idle_kv[id(state.model)] = state.kv
