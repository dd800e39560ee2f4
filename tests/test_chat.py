"""Chat: `generate(messages=...)` renders the target's chat template; the draft sees the text with the target's
special tokens it has by the same text, and without those it does not have; greedy output is the target's own on
the rendered prompt."""

from __future__ import annotations

import copy

import pytest
import torch

from xtokspec import XTokSpec, XTokSpecError
from xtokspec.text.chat import DraftView, render

# "<s>" is a special token of the fixture target's tokenizer (ja-sp) and not of the draft's (ja-bpe);
# "<|endoftext|>" is the draft's and not the target's
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")
MESSAGES = [{"role": "user", "content": "ファイルシステムをマウントするには"}]
# ChatML, with a special token of the target's that the draft lacks ("<|t_only|>")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|><|t_only|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_target(ja_target):
    model, tokenizer = ja_target
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = TEMPLATE
    return model, tokenizer


def test_the_draft_sees_the_template_without_the_targets_own_special_tokens(chat_target, ja_draft_bpe):
    text, draft_text = render(MESSAGES, chat_target[1], ja_draft_bpe[1])
    assert text.count("<s>") == 2 and "<s>" not in draft_text
    assert draft_text == text.replace("<s>", "")
    same, same_view = render(MESSAGES, chat_target[1], chat_target[1])  # one tokenizer: every token is its own
    assert same_view == same


def test_chat_generation_is_the_targets_own(chat_target, ja_draft_bpe):
    spec = XTokSpec(chat_target, ja_draft_bpe)
    result = spec.generate(messages=MESSAGES, max_new_tokens=24)
    model, tokenizer = chat_target
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, do_sample=False, max_new_tokens=24)
    assert result.token_ids == out[0, ids["input_ids"].shape[1]:].tolist()
    assert "".join(spec.stream(messages=MESSAGES, max_new_tokens=24)) == result.text


def test_chat_refusals_name_the_problem(chat_target, ja_target, ja_draft_bpe):
    spec = XTokSpec(chat_target, ja_draft_bpe)
    with pytest.raises(XTokSpecError, match="either a prompt or messages"):
        spec.generate("東京", messages=MESSAGES)
    with pytest.raises(XTokSpecError, match="messages must be a non-empty list"):
        spec.generate(messages=[{"role": "user"}])
    with pytest.raises(XTokSpecError, match="no chat template"):
        XTokSpec(ja_target, ja_draft_bpe).generate(messages=MESSAGES)


@pytest.mark.parametrize("template", ["plain", "chatml"])
def test_a_prompt_as_target_ids_gives_the_draft_what_render_gives(template, ja_target, ja_draft_bpe, heldout_prompts):
    """vLLM hands the proposer a chat request as the target's ids: `DraftView` gives the draft the text `render`
    gives it from the messages, a special token both tokenizers have reaching the draft as its own (one id), one
    only the target has left out; a plain prompt's view is the prompt's text without the target's BOS."""
    target, draft = copy.deepcopy(ja_target[1]), copy.deepcopy(ja_draft_bpe[1])
    target.chat_template = TEMPLATE
    if template == "chatml":
        target.chat_template = CHATML
        target.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|t_only|>"]})
        draft.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    messages = [{"role": "system", "content": "あなたは役に立つアシスタントです。"}, *MESSAGES]
    text, draft_text = render(messages, target, draft)
    view = DraftView(target, draft)
    ids = target(text, add_special_tokens=False)["input_ids"]
    assert view.text(ids) == draft_text
    if template == "chatml":
        assert "<|t_only|>" in text and "<|t_only|>" not in draft_text
        start = draft.convert_tokens_to_ids("<|im_start|>")
        assert draft(draft_text, add_special_tokens=False)["input_ids"].count(start) == 3
        assert view.prompt(ids) == (draft_text, True)  # the draft's BOS is another token: its encoding adds it
        draft.bos_token = "<|im_start|>"  # as SmolLM2's: the text begins with it, no second one is added
        assert DraftView(target, draft).prompt(ids) == (draft_text, False)
    for prompt in heldout_prompts[:20]:  # completion requests: what decoding without special tokens gives
        prompt_ids = target(prompt)["input_ids"]
        assert view.text(prompt_ids) == target.decode(prompt_ids, skip_special_tokens=True,
                                                      clean_up_tokenization_spaces=False)
