"""Chat: `generate(messages=...)` renders the target's chat template; the draft sees the text with the target's
special tokens it has by the same text, and without those it does not have; greedy output is the target's own on
the rendered prompt."""

from __future__ import annotations

import copy

import pytest
import torch

from xtokspec import XTokSpec, XTokSpecError
from xtokspec.chat import render

# "<s>" is a special token of the fixture target's tokenizer (ja-sp) and not of the draft's (ja-bpe);
# "<|endoftext|>" is the draft's and not the target's
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")
MESSAGES = [{"role": "user", "content": "ファイルシステムをマウントするには"}]


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
