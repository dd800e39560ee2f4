"""The facade: `XTokSpec(large, small).generate(prompt)`, lossless speculative decoding across tokenizers.

It loads the two models, checks what users pass, and delegates: `decode.assemble` builds each generation's
`decode.loop.Run` (its mapper, proposer, verifier's sampler and policies) from the tokenizers' `Pair` and from
what outlives one generation (`Kept`: captured steps, idle caches, learned policies); `decode.loop` runs it.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from . import options
from .decode import assemble, loop
from .decode.policy import TargetAlone
from .runtime.kv import context_limit, input_device, sliding_layers, takes_tree_masks
from .runtime.models import check_source, cpu_bf16_note, eos_ids, frozen_head_note, load, no_length_warning
from .runtime.vocab import DraftVocab, choose_draft_vocab, trimmed_draft
from .text import chat
from .text.codec import TokenCodec
from .types import (
    GenerationResult,
    GenerationStats,
    SamplingParams,
    SpecConfig,
    XTokSpecError,
    check_prompt,
    is_int,
)

log = logging.getLogger("xtokspec")


class XTokSpec:
    """Lossless speculative decoding of `large` (the target) with `small` (the draft), any two tokenizers.

    `large` and `small` are each a local folder or hub id (loaded with `large_kwargs` / `small_kwargs`, e.g.
    dtype, device_map) or an already loaded `(model, tokenizer)` pair. The models may sit on different devices.
    Both arguments are checked before either model loads. `progress=True` shows transformers' "Loading weights"
    bars (hidden by default, as in the CLI; the hub's download bars show either way).
    """

    # Seams, set on the class or on one XTokSpec:
    # - fallback_policy: None for the measured policy (decode.policy.Fallback, SpecConfig.fallback), or a callable
    #   config -> an object with run_alone() and observe(cycle), e.g. to script which cycles draft;
    # - clock: what every second the loop and its policies see is read from (a test hands a simulated one);
    # - sampler_ops: the verifier's sampling steps (decode.verify.SamplerOps; None: the proven ones), which a
    #   statistical test's negative control replaces with a wrong one.
    fallback_policy = None
    clock = staticmethod(time.perf_counter)
    sampler_ops = None

    def __init__(self, large, small, *, config: SpecConfig | None = None, large_kwargs=None, small_kwargs=None,
                 progress: bool = False):
        self.config = config or SpecConfig()
        # NOTE: both checked first: a mistyped draft is named before the target's seconds of loading
        large, small = check_source(large, "target (large)"), check_source(small, "draft (small)")
        self.target_model, self.target_tokenizer = load(large, "target (large)", progress, **(large_kwargs or {}))
        self.draft_model, self.draft_tokenizer = load(small, "draft (small)", progress, **(small_kwargs or {}))
        notes = [frozen_head_note(self.target_model, "target (large)"), frozen_head_note(self.draft_model, "draft (small)"),
                 cpu_bf16_note(self.target_model, "the target (large)")]
        for note in filter(None, notes):
            warnings.warn(note, UserWarning, stacklevel=2)
        self.pair = assemble.Pair.of(
            TokenCodec(self.target_tokenizer, self.target_model.config.vocab_size, "target tokenizer"),
            TokenCodec(self.draft_tokenizer, self.draft_model.config.vocab_size, "draft tokenizer"),
            eos_ids(self.target_model, self.target_tokenizer), eos_ids(self.draft_model, self.draft_tokenizer))
        self.kept = assemble.Kept()
        self._full_draft_model = self.draft_model  # trim_draft_vocab replaces draft_model by a view of this
        self.draft_vocab: DraftVocab | None = None
        self._custom_generate = None
        self.last_stats: GenerationStats | None = None  # of the last custom_generate call (transformers' generate)

    # the pair's views, by their names in the public API
    target = property(lambda self: self.pair.target, doc="The target's tokenizer as bytes (text.codec.TokenCodec).")
    draft = property(lambda self: self.pair.draft, doc="The draft's tokenizer as bytes.")
    target_eos = property(lambda self: self.pair.target_eos, doc="The target's EOS ids.")
    draft_eos = property(lambda self: self.pair.draft_eos, doc="The draft's EOS ids.")
    same_vocab = property(lambda self: self.pair.same_vocab, doc="Whether both models share one tokenizer.")
    vocab_maps = property(lambda self: self.pair.maps, doc="The maps between the vocabularies (mapping.VocabMaps).")

    # ---------------------------------------------------------------- public API
    def describe(self) -> str:
        """One line naming both models with their class, dtype and device (the CLI prints it)."""
        trimmed = f" [head: {self.draft_vocab.keep.numel()} of {self.draft_vocab.vocab_size} ids]" if self.draft_vocab else ""
        return f"{describe_model('target', self.target_model)}; {describe_model('draft', self.draft_model)}{trimmed}"

    def trim_draft_vocab(self, texts, size: int = 32768) -> DraftVocab | None:
        """Let the draft's output head compute only `size` ids: those most frequent in `texts` (calibration text
        like what you will generate, e.g. thousands of paragraphs, or the target's own outputs on your prompts),
        plus EOS and single-byte ids. `texts=None` restores the full head. -> what was kept.

        For drafts whose head is a large share of a step (a 262k vocabulary), each draft step gets cheaper (FR-Spec,
        Zhao et al. 2025). Lossless whatever is kept: the draft only proposes, and the verifier is given the trimmed
        draft's own distributions. Out-of-domain text costs acceptance where the target wants an id the head no
        longer scores (BENCHMARKS.md, "A trimmed draft head")."""
        # NOTE: both may raise; nothing has changed yet, so bad input keeps the head as it was
        vocab = None if texts is None else choose_draft_vocab(self.draft, texts, size, self.draft_eos)
        model = self._full_draft_model if vocab is None else trimmed_draft(self._full_draft_model, vocab.keep)
        if self.draft_model is not self._full_draft_model:
            self.kept.forget(self.draft_model)  # NOTE: the old view is dropped; a new one could reuse its id
        self.draft_model, self.draft_vocab = model, vocab
        return vocab

    def generate(self, prompt: str | None = None, max_new_tokens: int = 128, **kwargs) -> GenerationResult:
        """Continue `prompt`, or answer chat `messages=[{"role": "user", "content": ...}, ...]` (rendered with the
        target's chat template; xtokspec/text/chat.py); greedy by default, or do_sample=True with temperature / top_k
        / top_p / seed.

        Other keywords: proposal ("auto" | "onehot" | "intersection"), num_draft_tokens, adaptive, tree_width;
        SpecConfig's other fields are the XTokSpec's, and passing one here is an error naming so.

        `seed`: whatever the seed, a sample is distributed as the target's own. The same seed gives the same
        sample when the drafted cycles are the same, which holds with `SpecConfig(adaptive=False)` (or
        adaptive=False here): a fixed K and no fallback. With adaptive K and the fallback to the target alone
        (the default), K and which cycles run the target alone follow measured timings and this XTokSpec's
        earlier generations, so the same seed can give another sample (from the same distribution).
        `keyed=True` (with do_sample=True): each output position's token is a fixed function of the seed, the
        position and the target's distribution there (decode/keyed.py), so the same seed gives the same text
        whatever the draft, K, trees, fallback or healing: the text of `generate(..., alone=True)`, the target
        alone, with that seed.
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
        yield from text_pieces(self._cycles(prompt, max_new_tokens, stats or GenerationStats(), **kwargs), self._decode)

    def warmup(self, prompt: str, max_new_tokens: int = 128, *, tree_width: int | None = None,
               progress: bool = True) -> int:
        """With captured steps (CUDA graphs, the default on a GPU; or `compile="inductor"`): record or compile now
        every shape that generations of this prompt's size can meet (`compile.warmup_plan`; trees with
        `tree_width` > 1), so that none of them stops a generation. Returns the number of shapes; 0 where both
        models run eagerly (the CPU's default). How long it took is logged and added to `capture_seconds`.

        Steps are specialised on the cache's size class (256, 384, 512, 768, ... positions), which the prompt's
        length plus `max_new_tokens` decides: warm up with a prompt and a `max_new_tokens` like those you will
        serve (a generation in another class records its own shapes, once)."""
        config = options.call_config(self.config, tree_width=tree_width)
        target_ids, draft_ids = prompt_ids(self, prompt, max_new_tokens)  # NOTE: refused before any step is made
        check_trees(self.target_model, config)
        return assemble.warm_up(self.kept, self.target_model, self.draft_model, target_ids, draft_ids,
                                max_new_tokens, config, progress)

    @property
    def capture_seconds(self) -> float:
        """Seconds this XTokSpec has spent recording CUDA graphs or compiling its steps (warmup and first calls of
        new shapes in generations); each generation's share is its `stats.capture_seconds`."""
        return self.kept.capture_seconds

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

            self._custom_generate = hf.custom_generate_for(self)
        return self._custom_generate

    def draft_prompt_ids(self, target_ids: list[int]) -> list[int]:
        """The draft's prompt for a prompt given as target ids: their text in the draft's own encoding."""
        check_length(self.target_model, target_ids)
        if self.same_vocab:
            return list(target_ids)
        text = self._decode(target_ids)
        if not text:
            raise XTokSpecError("the prompt ids stand for no text (only special tokens): give some text to continue")
        with no_length_warning(self.draft_tokenizer):
            return self.draft.encode_prompt(text)

    def sampling_params(self, do_sample=None, temperature=None, top_k=None, top_p=None, seed=None,
                        keyed=False) -> SamplingParams:
        """Sampling parameters as the target's `generate` would resolve them from its generation_config."""
        options.check_neutral(self.target_model.generation_config)
        # NOTE: the warning about ignored values names the user's call: user code -> generate -> _cycles -> here
        return options.sampling_params(self.target_model.generation_config, do_sample, temperature, top_k, top_p,
                                       seed, keyed=keyed, stacklevel=4)

    def cycles(self, target_ids: list[int], draft_ids: list[int], max_new_tokens: int, stats: GenerationStats,
               params: SamplingParams, *, proposal=None, num_draft_tokens=None, adaptive=None,
               tree_width=None, alone: bool = False) -> Iterator[list[int]]:
        """The loop over prepared prompt ids (the target's and the draft's): each cycle's committed target ids.
        `generate`, `stream` and the transformers entry point (xtokspec/hf.py) run on it. `alone=True`: every cycle
        runs the target alone (no draft), the reference a keyed sample is compared with."""
        config = options.call_config(self.config, num_draft_tokens, adaptive, tree_width)
        check_trees(self.target_model, config)
        kind = options.proposal_kind(self.same_vocab, params, proposal or config.proposal, config.tree_width)
        stats.proposal = kind.value + (" tree" if config.tree_width > 1 else "")
        kept = self.kept
        # Inference mode around each cycle, never across a yield: the caller's code between two cycles (another
        # stream's, a training step) runs in its own grad mode, and interleaved streams cannot leave it switched off
        with torch.inference_mode():
            target, draft = assemble.states(kept, self.target_model, self.draft_model, target_ids, draft_ids,
                                            max_new_tokens, config)
            before = kept.capture_seconds
            run = assemble.generation(self.pair, kept, target, draft, stats, params, config, kind,
                                      fallback_policy=(lambda config: TargetAlone()) if alone else self.fallback_policy,
                                      sampler_ops=self.sampler_ops,
                                      clock=self.clock)
            steps = loop.cycles(run, max_new_tokens)
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
                stats.capture_seconds = kept.capture_seconds - before
                kept.release(target)
                kept.release(draft)

    # ---------------------------------------------------------------- one generation's input
    def _decode(self, token_ids: list[int]) -> str:
        # NOTE: no clean-up: it deletes spaces before punctuation, and the text must be the tokens' own
        return self.target_tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _cycles(self, prompt, max_new_tokens, stats, *, messages=None, do_sample=None, temperature=None, top_k=None,
                top_p=None, seed=None, keyed=False, **kwargs) -> Iterator[list[int]]:
        unknown = sorted(set(kwargs) - set(options.keyword_only(self.cycles)))
        if unknown:  # NOTE: the keywords named are the ones these signatures take, so they cannot drift apart
            known = (options.keyword_params(self.generate, skip=("prompt",)) + options.keyword_only(self._cycles)
                     + options.keyword_only(self.cycles))
            raise XTokSpecError(options.unknown_options_message(unknown, known))
        if messages is not None:  # chat: the template's text carries its own special tokens
            if prompt is not None:
                raise XTokSpecError("pass either a prompt or messages, not both")
            prompt, draft_prompt = chat.render(messages, self.target_tokenizer, self.draft_tokenizer)
            target_ids, draft_ids = prompt_ids(self, prompt, max_new_tokens, draft_prompt, special=False)
        else:
            target_ids, draft_ids = prompt_ids(self, prompt, max_new_tokens)  # NOTE: the prompt's errors first
        params = self.sampling_params(do_sample, temperature, top_k, top_p, seed, keyed)
        yield from self.cycles(target_ids, draft_ids, max_new_tokens, stats, params, **kwargs)


# ---------------------------------------------------------------- checks and descriptions
def prompt_ids(spec: XTokSpec, prompt, max_new_tokens, draft_prompt=None, special=True) -> tuple[list[int], list[int]]:
    """Both models' prompt ids, checked (the draft's from `draft_prompt` if given; `special=False`: no BOS added,
    the text has its own special tokens, as a chat template's does)."""
    check_prompt(prompt)
    if not is_int(max_new_tokens) or max_new_tokens <= 0:
        raise XTokSpecError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    with no_length_warning(spec.target_tokenizer, spec.draft_tokenizer):  # NOTE: check_length names it
        target_ids = spec.target.encode_prompt(prompt, special)
        check_length(spec.target_model, target_ids)
        draft_ids = target_ids if spec.same_vocab else spec.draft.encode_prompt(draft_prompt or prompt, special)
    return target_ids, draft_ids


def check_length(target_model, target_ids: list[int]) -> None:
    """A prompt must leave the target's context room for at least one new token."""
    limit = context_limit(target_model)
    if limit and len(target_ids) >= limit:
        raise XTokSpecError(f"prompt is {len(target_ids)} target tokens, but the target's context is {limit} positions")


def check_trees(target_model, config: SpecConfig) -> None:
    """Token trees need a target that can verify a trie in one forward."""
    if config.tree_width > 1 and sliding_layers(target_model):
        raise XTokSpecError(
            f"token trees (tree_width={config.tree_width}) need full-attention layers in the target; "
            f"{type(target_model).__name__} has {sliding_layers(target_model)} layers: use tree_width=1"
        )
    if config.tree_width > 1 and not takes_tree_masks(target_model):
        raise XTokSpecError(
            f"token trees (tree_width={config.tree_width}) verify with a tree attention mask, which the target's "
            f"attention implementation {target_model.config._attn_implementation!r} does not apply: load it "
            f"with attn_implementation='sdpa' (or 'eager'), or use tree_width=1"
        )


def text_pieces(cycles: Iterator[list[int]], decode) -> Iterator[str]:
    """Each cycle's new text, whole characters only, from its committed ids (`decode`: ids -> text)."""
    token_ids: list[int] = []
    shown = ""
    for new_ids in cycles:
        token_ids += new_ids
        text = decode(token_ids)
        stable = text.rstrip("\ufffd")  # an incomplete trailing character decodes to U+FFFD: wait for it
        if len(stable) > len(shown) and stable.startswith(shown):
            yield stable[len(shown) :]
            shown = stable
    text = decode(token_ids)
    if text != shown:
        yield text[len(shown) :] if text.startswith(shown) else text


def describe_model(role: str, model) -> str:
    """A model's role, folder name, class, dtype and device."""
    name = Path(str(getattr(model, "name_or_path", "") or "?")).name
    dtype = str(model.dtype).removeprefix("torch.")
    return f"{role} {name} ({type(model).__name__}, {dtype}, {input_device(model)})"
