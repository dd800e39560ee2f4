"""Chat messages as a prompt: the target's chat template, and the draft's view of the text it renders.

The target reads the template's text with its special tokens (`<|im_start|>`, `<start_of_turn>`, ...). The draft
reads the same text, except that a special token of the target's that the draft does not have by the same text
is left out of its view: spelled out, it would be ordinary characters to the draft, and the draft would continue
them as such. Where both tokenizers have a token (both speak ChatML), it reaches the draft as its own.
"""

from __future__ import annotations

from .types import XTokSpecError


def special_texts(tokenizer) -> set[str]:
    """The texts of `tokenizer`'s special tokens (declared ones and added tokens marked special)."""
    texts = set(tokenizer.all_special_tokens)
    texts |= {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    return texts


def render(messages, target_tokenizer, draft_tokenizer) -> tuple[str, str]:
    """(the target's prompt text, the draft's view of it) for chat `messages` ([{"role": ..., "content": ...}])."""
    if not isinstance(messages, (list, tuple)) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str) for m in messages):
        raise XTokSpecError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    if not getattr(target_tokenizer, "chat_template", None):
        raise XTokSpecError("the target's tokenizer has no chat template: pass a prompt string instead of messages")
    text = target_tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    draft_text = text
    for token in sorted(special_texts(target_tokenizer) - special_texts(draft_tokenizer), key=len, reverse=True):
        draft_text = draft_text.replace(token, "")
    return text, draft_text
