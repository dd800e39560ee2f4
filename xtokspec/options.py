"""Options in one place: sampling parameters as transformers' `generate` resolves them from a generation config,
the per-call overrides of a SpecConfig, the proposal kind they add up to, and the errors that name a bad one.
Shared by the facade (xtokspec/spec.py), the transformers entry point (xtokspec/hf.py) and the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import inspect
import warnings

from .types import PROPOSAL_KINDS, ProposalKind, SamplingParams, SpecConfig, XTokSpecError

# generation_config fields whose non-neutral values add logits processors xtokspec does not implement.
NEUTRAL = {
    "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "sequence_bias": (None,),
    "min_p": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,),
    "num_beams": (None, 1),
}
# transformers' defaults for sampling fields a model's generation_config leaves unset.
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
# ... and what an unset field means in the generation config `generate` has prepared for a call (no warper).
PREPARED_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


def check_neutral(generation_config) -> None:
    """Refuse a generation config that asks for logits processors other than temperature / top-k / top-p."""
    bad = {k: getattr(generation_config, k, None) for k, ok in NEUTRAL.items()
           if getattr(generation_config, k, None) not in ok}
    if bad:
        raise XTokSpecError(
            f"the target's generation_config sets {bad}, which add logits processors xtokspec does not "
            "implement; set them to neutral values (e.g. model.generation_config.repetition_penalty = 1.0)"
        )


def sampling_params(generation_config, do_sample=None, temperature=None, top_k=None, top_p=None, seed=None, *,
                    keyed: bool = False, unset: dict = SAMPLING_DEFAULTS, stacklevel: int = 2) -> SamplingParams:
    """Sampling parameters as `generate` would resolve them: each given value, else the generation config's,
    else `unset`'s. Values given for sampling while decoding greedily are ignored with a warning, as `generate`
    does (`stacklevel`: the user's frame, for the warning)."""

    def pick(name, value):
        if value is not None:
            return value
        value = getattr(generation_config, name, None)
        return unset[name] if value is None else value

    do_sample = bool(generation_config.do_sample) if do_sample is None else do_sample
    params = SamplingParams(
        do_sample=do_sample, temperature=pick("temperature", temperature), top_k=pick("top_k", top_k),
        top_p=pick("top_p", top_p), seed=seed, keyed=keyed,
    )
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    ignored = {k: v for k, v in given.items() if v is not None and not (k == "temperature" and v == 0)}
    if not do_sample and ignored:
        warnings.warn(
            f"{ignored} only apply when sampling, and do_sample is False (greedy decoding): they are ignored; "
            "pass do_sample=True to sample", UserWarning, stacklevel=stacklevel + 1,
        )
    return params


def call_config(config: SpecConfig, num_draft_tokens=None, adaptive=None, tree_width=None) -> SpecConfig:
    """`config` with one call's overrides (None: the config's own); invalid values are SpecConfig's errors."""
    if num_draft_tokens is not None or adaptive is not None:
        k = config.num_draft_tokens if num_draft_tokens is None else num_draft_tokens  # NOTE: 0 is refused, not the default
        config = dataclasses.replace(
            config,
            num_draft_tokens=k,
            max_draft_tokens=max(config.max_draft_tokens, k) if isinstance(k, int) else config.max_draft_tokens,
            adaptive=config.adaptive if adaptive is None else adaptive,
        )
    if tree_width is not None:
        config = dataclasses.replace(config, tree_width=tree_width)
    return config


def proposal_kind(same_vocab: bool, params: SamplingParams, proposal: str, tree_width: int = 1) -> ProposalKind:
    """The proposal kind a generation runs (types.ProposalKind): same-tokenizer, the greedy bridge, or for sampling
    across tokenizers the one asked for ("onehot", "intersection", or "auto": chosen each cycle between them)."""
    if proposal not in PROPOSAL_KINDS:
        raise XTokSpecError(f"proposal must be 'auto', 'onehot' or 'intersection', got {proposal!r}")
    asked = ProposalKind(proposal)
    if same_vocab:
        return ProposalKind.SAME_TOKENIZER
    if not params.do_sample:
        return ProposalKind.GREEDY_BRIDGE
    if tree_width > 1:  # a tree's root draws from the draft (tree_root), its other nodes are one-hot
        if asked is ProposalKind.INTERSECTION:
            raise XTokSpecError(
                f"token trees (tree_width={tree_width}) choose their own proposals (SpecConfig.tree_root); "
                "proposal='intersection' needs tree_width=1 (or use proposal='auto' / 'onehot')"
            )
        return ProposalKind.ONEHOT
    # NOTE: under the keyed sampler too: its intersection draws are coupled to the target's keyed samples
    # (decode/keyed.py, Coupling), which keeps most of what the rejection rule accepts (sum min(p, q))
    return asked


def keyword_only(function) -> tuple[str, ...]:
    """The keyword-only parameter names of `function` (a bound method counts as its function), in order."""
    return _keyword_only(getattr(function, "__func__", function))


@functools.lru_cache(maxsize=32)
def _keyword_only(function) -> tuple[str, ...]:  # NOTE: cached: every generate checks its keywords against it
    return tuple(name for name, parameter in inspect.signature(function).parameters.items()
                 if parameter.kind is inspect.Parameter.KEYWORD_ONLY)


def keyword_params(function, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The names `function` takes by keyword (positional-or-keyword, then keyword-only), in order, less `skip`."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(name for name, parameter in inspect.signature(function).parameters.items()
                 if parameter.kind in kinds and name not in skip)


def unknown_options_message(names: list[str], known: tuple[str, ...]) -> str:
    """An error naming keywords that generate() / stream() do not take (`known`: those they do), with where
    each belongs if anywhere. A suggestion is one of `known` if any is close (max_tokens: max_new_tokens), else
    a SpecConfig field."""
    config_fields = tuple(field.name for field in dataclasses.fields(SpecConfig))
    parts = []
    for name in names:
        if name in config_fields:
            parts.append(f"{name!r} is set once per XTokSpec: XTokSpec(..., config=SpecConfig({name}=...))")
        else:
            close = difflib.get_close_matches(name, known, n=1) or difflib.get_close_matches(name, config_fields, n=1)
            parts.append(f"{name!r} is not an option" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unknown keyword for generate/stream: {'; '.join(parts)}. They take: {', '.join(known)}"


COMPILE_WORDS = {"auto": "auto", "graphs": "graphs", "inductor": "inductor", "off": False}


def compile_choice(word: str):
    """The command line's --compile word -> SpecConfig.compile ("off" is False)."""
    if word not in COMPILE_WORDS:
        raise argparse.ArgumentTypeError(f"invalid choice: {word!r} (choose from {', '.join(COMPILE_WORDS)}; a bare "
                                         "--compile goes after the prompt)")
    return COMPILE_WORDS[word]
