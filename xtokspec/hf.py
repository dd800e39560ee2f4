"""The transformers entry point: `large_model.generate(**inputs, custom_generate=spec.custom_generate, ...)`.

transformers 5 runs a callable `custom_generate` as the decoding loop once `generate` has prepared the inputs:
the generation config (max_length from max_new_tokens, do_sample, temperature, top_k, top_p), the logits
processors and stopping criteria built from it (EOS, max length, stop_strings, a user's own criteria), and the
streamer, which has already been given the prompt. `hf_generate` runs xtokspec's loop on the prompt ids and
applies those stopping criteria token by token, so it stops exactly where `generate` would, and feeds the
streamer each verified token.

What it cannot do losslessly it refuses with an error that names it: a batch of several sequences, beam search,
scores or logits in the output, and any logits processor other than temperature / top-k / top-p.

NOTE (transformers 5.23, 5.24): `generate` drops `streamer` and `tokenizer` (and so `stop_strings`) before calling a
*callable* custom_generate (`_extract_generation_mode_kwargs` keeps only the callable's own extra arguments).
`install(model, fn)` therefore wraps that one method on the target model instance: for calls whose
custom_generate is `fn` it returns the standard arguments (streamer, tokenizer, ...) plus xtokspec's own
keywords; every other call goes to the original method unchanged.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from . import options
from .types import GenerationStats, XTokSpecError

# generate() keywords that go to xtokspec rather than to the model (XTokSpec.generate's own options)
OPTIONS = ("seed", "keyed", "proposal", "num_draft_tokens", "adaptive", "tree_width")
_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def custom_generate_for(spec):
    """`spec`'s decoding loop as a `custom_generate` for its target's `generate` (XTokSpec.custom_generate)."""

    def custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        return hf_generate(spec, model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs)

    install(spec.target_model, custom_generate)
    return custom_generate


def install(model, fn) -> None:
    """Make `model.generate(custom_generate=fn, ...)` pass streamer, tokenizer and xtokspec's options to fn."""
    current = model._extract_generation_mode_kwargs
    if getattr(current, "_xtokspec_for", None) is not None:
        if any(f is fn or f == fn for f in current._xtokspec_for):
            return
        current._xtokspec_for.append(fn)
        return
    original = current

    def extract(custom_generate, kwargs, synced_gpus, assistant_model, streamer):
        if not any(custom_generate is f or custom_generate == f for f in extract._xtokspec_for):
            return original(custom_generate, kwargs, synced_gpus, assistant_model, streamer)
        out = original(None, kwargs, synced_gpus, assistant_model, streamer)  # the standard mode arguments
        out.update({k: kwargs.pop(k) for k in OPTIONS if k in kwargs})
        return out

    extract._xtokspec_for = [fn]
    model._extract_generation_mode_kwargs = extract


def hf_generate(spec, model, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
                synced_gpus: bool = False, streamer=None, tokenizer=None, assistant_model=None,
                assistant_tokenizer=None, seed: int | None = None, keyed: bool = False, proposal=None,
                num_draft_tokens=None,
                adaptive=None, tree_width=None, **model_kwargs):
    """The decoding loop `generate` calls (see the module docstring) -> sequences, as `generate` returns them."""
    if model is not spec.target_model:
        raise XTokSpecError("custom_generate=spec.custom_generate must be passed to the generate of spec's target "
                            f"model, not of {type(model).__name__} {getattr(model, 'name_or_path', '')!r}")
    if generation_config.num_beams and generation_config.num_beams > 1:
        raise XTokSpecError(f"xtokspec does not do beam search (num_beams={generation_config.num_beams})")
    if input_ids.shape[0] != 1:
        raise XTokSpecError(f"xtokspec decodes one sequence at a time; got a batch of {input_ids.shape[0]} "
                            "(num_return_sequences > 1 also makes a batch)")
    if assistant_model is not None or assistant_tokenizer is not None:
        raise XTokSpecError("assistant_model does not go with custom_generate=spec.custom_generate: spec's draft "
                            "model is the assistant")
    if synced_gpus:
        raise XTokSpecError("xtokspec does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation)")
    asked = [name for name in _UNSUPPORTED_OUTPUTS if getattr(generation_config, name, False)]
    if asked:
        raise XTokSpecError(f"xtokspec returns sequences only; {asked} cannot be returned")
    unsupported = [type(p).__name__ for p in logits_processor if not isinstance(p, _WARPERS)]
    if unsupported:
        raise XTokSpecError(
            f"logits processors {unsupported} are not implemented by xtokspec (only temperature, top_k and "
            "top_p): unset the generation options that add them (e.g. repetition_penalty, min_new_tokens)"
        )
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise XTokSpecError("the attention_mask has padding; xtokspec decodes one unpadded sequence")

    prompt_ids = input_ids[0].tolist()
    max_new_tokens = generation_config.max_length - len(prompt_ids)
    if max_new_tokens <= 0:
        raise XTokSpecError(f"max_length {generation_config.max_length} leaves no room after the "
                            f"{len(prompt_ids)}-token prompt")
    params = options.sampling_params(generation_config, seed=seed, keyed=keyed, unset=options.PREPARED_DEFAULTS)
    draft_ids = spec.draft_prompt_ids(prompt_ids)
    stats = GenerationStats()
    sequence = input_ids
    cycles = spec.cycles(prompt_ids, draft_ids, max_new_tokens, stats, params, proposal=proposal,
                         num_draft_tokens=num_draft_tokens, adaptive=adaptive, tree_width=tree_width)
    with torch.inference_mode():
        try:
            for new_ids in cycles:
                stop = False
                for token in new_ids:  # the criteria see one more token at a time, as in generate's own loop
                    sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=1)
                    if streamer is not None:
                        streamer.put(sequence[:, -1:].cpu())
                    if bool(stopping_criteria(sequence, None).any()):
                        stop = True
                        break
                if stop:
                    break
        finally:
            cycles.close()
            if streamer is not None:
                streamer.end()
    spec.last_stats = stats
    if generation_config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequence)
    return sequence
