"""The transformers entry point: large_model.generate(custom_generate=spec.custom_generate, ...)."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from transformers import TextIteratorStreamer

from xtokspec import XTokSpecError

PROMPT = "Linux 2.0 で、 struct arp"


def run(model, encoder, prompt=PROMPT, **kwargs):
    inputs = encoder(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, **kwargs)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["bridged", "same"])
def test_greedy_equals_the_targets_own_generate_and_xtokspec(draft, bridged_spec, same_spec, heldout_prompts):
    from xtokspec import SpecConfig, XTokSpec

    shared = bridged_spec if draft == "bridged" else same_spec
    # NOTE: fallback=False: the fallback runs the target alone where drafting is measured not to pay, and on a
    # loaded machine that can be every cycle of a prompt; the check below needs drafted cycles
    spec = XTokSpec((shared.target_model, shared.target_tokenizer), (shared.draft_model, shared.draft_tokenizer),
                    config=SpecConfig(cache="dynamic", fallback=False))
    model, tokenizer = spec.target_model, spec.target_tokenizer
    for prompt in [PROMPT] + heldout_prompts[:5]:
        own = run(model, tokenizer, prompt, max_new_tokens=32, do_sample=False)
        ours = run(model, tokenizer, prompt, max_new_tokens=32, do_sample=False, custom_generate=spec.custom_generate)
        assert ours == own == spec.generate(prompt, max_new_tokens=32).token_ids, prompt
    assert spec.last_stats.new_tokens > 0 and spec.last_stats.target_forwards < spec.last_stats.new_tokens


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"tree_width": 4}, {"proposal": "onehot"}])
def test_sampling_gives_the_same_ids_as_xtokspec_generate_with_the_same_seed(options, bridged_spec):
    model, tokenizer = bridged_spec.target_model, bridged_spec.target_tokenizer
    for seed in range(3):
        kwargs = dict(max_new_tokens=24, do_sample=True, temperature=0.7, seed=seed, adaptive=False, **options)
        ours = run(model, tokenizer, custom_generate=bridged_spec.custom_generate, **kwargs)
        assert ours == bridged_spec.generate(PROMPT, **kwargs).token_ids


@pytest.mark.slow
def test_max_new_tokens_eos_and_stop_strings_stop_where_generate_stops(bridged_spec, heldout_prompts):
    model, tokenizer = bridged_spec.target_model, bridged_spec.target_tokenizer
    ours = run(model, tokenizer, max_new_tokens=5, custom_generate=bridged_spec.custom_generate)
    assert len(ours) == 5
    stopped = 0
    for prompt in heldout_prompts[:12]:
        kwargs = dict(max_new_tokens=48, do_sample=False, stop_strings=["、", "。"], tokenizer=tokenizer)
        own = run(model, tokenizer, prompt, **kwargs)
        assert run(model, tokenizer, prompt, custom_generate=bridged_spec.custom_generate, **kwargs) == own
        stopped += len(own) < 48
    assert stopped >= 3  # the stop strings really cut some continuations short
    eos = next(iter(bridged_spec.target_eos))
    # the first two prompts whose continuation reaches EOS (lazily: generating all 64 took half the test's time)
    ended = list(itertools.islice((p for p in heldout_prompts if eos in run(model, tokenizer, p, max_new_tokens=64)), 2))
    assert len(ended) == 2
    for prompt in ended:  # continuations that reach EOS end there, with EOS
        ours = run(model, tokenizer, prompt, max_new_tokens=64, custom_generate=bridged_spec.custom_generate)
        assert ours[-1] == eos and ours == run(model, tokenizer, prompt, max_new_tokens=64)


@pytest.mark.slow
def test_a_text_iterator_streamer_gets_the_text_and_ends(bridged_spec):
    model, tokenizer = bridged_spec.target_model, bridged_spec.target_tokenizer
    # NOTE: skip_special_tokens, as generate's own streaming would show "</s>" when the target ends there too
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=60)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    result = {}

    def work():
        result["ids"] = model.generate(**inputs, max_new_tokens=32, streamer=streamer,
                                       custom_generate=bridged_spec.custom_generate)

    thread = threading.Thread(target=work)
    thread.start()
    text = "".join(streamer)  # ends only if the loop calls streamer.end()
    thread.join(timeout=60)
    assert not thread.is_alive()
    new = result["ids"][0, inputs["input_ids"].shape[1] :]
    assert text == tokenizer.decode(new, skip_special_tokens=True) and text


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_beams=2), "beam search"),
    (dict(num_return_sequences=2, do_sample=True), "batch of 2"),
    (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor"),
    (dict(min_new_tokens=3), "MinNewTokensLengthLogitsProcessor"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
])
def test_what_cannot_be_lossless_is_refused_by_name(kwargs, message, tiny_spec):
    model, tokenizer = tiny_spec.target_model, tiny_spec.target_tokenizer
    with pytest.raises(XTokSpecError, match=message):
        run(model, tokenizer, max_new_tokens=4, custom_generate=tiny_spec.custom_generate, **kwargs)


def test_a_batch_and_another_model_are_refused(tiny_spec, ja_draft_bpe):
    model, tokenizer = tiny_spec.target_model, tiny_spec.target_tokenizer
    ids = tokenizer("こんにちは")["input_ids"]
    with pytest.raises(XTokSpecError, match="batch of 2"):
        model.generate(input_ids=torch.tensor([ids, ids]), max_new_tokens=4, custom_generate=tiny_spec.custom_generate)
    other, other_tok = ja_draft_bpe
    with pytest.raises(XTokSpecError, match="target model"):
        other.generate(**other_tok("こんにちは", return_tensors="pt"), max_new_tokens=4,
                       custom_generate=tiny_spec.custom_generate)


def test_the_model_keeps_its_own_generate_and_other_custom_loops(tiny_spec):
    model, tokenizer = tiny_spec.target_model, tiny_spec.target_tokenizer
    _ = tiny_spec.custom_generate  # installs the argument fix on this model
    plain = run(model, tokenizer, max_new_tokens=6, do_sample=False)
    assert len(plain) == 6
    seen = {}

    def my_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        seen.update(kwargs)
        return input_ids

    run(model, tokenizer, max_new_tokens=6, custom_generate=my_loop)
    assert "streamer" not in seen  # another callable gets transformers' own (unfixed) arguments
    assert run(model, tokenizer, max_new_tokens=6, custom_generate=tiny_spec.custom_generate) == plain
