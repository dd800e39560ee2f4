"""Chat messages as a prompt: the target's chat template, and the draft's view of the text it renders.

The target reads the template's text with its special tokens (`<|im_start|>`, `<start_of_turn>`, ...). The draft
reads the same text, except that a special token of the target's that the draft does not have by the same text
is left out of its view: spelled out, it would be ordinary characters to the draft, and the draft would continue
them as such. Where both tokenizers have a token (both speak ChatML), it reaches the draft as its own.

One rule, two entry points: `render` for messages (`XTokSpec.generate(messages=...)`), `DraftView` for a prompt
that arrives as the target's token ids with the template's special tokens among them (vLLM's proposer).
"""

from __future__ import annotations

from ..types import XTokSpecError


def special_tokens(tokenizer) -> dict[int, str]:
    """`tokenizer`'s special tokens, id -> text: declared ones and added tokens marked special."""
    special = {i: tokenizer.convert_ids_to_tokens(i) for i in tokenizer.all_special_ids}
    special |= {i: token.content for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return special


def special_texts(tokenizer) -> set[str]:
    """The texts of `tokenizer`'s special tokens (`special_tokens`)."""
    return set(tokenizer.all_special_tokens) | set(special_tokens(tokenizer).values())


def render(messages, target_tokenizer, draft_tokenizer) -> tuple[str, str]:
    """(the target's prompt text, the draft's view of it) for chat `messages` ([{"role": ..., "content": ...}])."""
    if not isinstance(messages, (list, tuple)) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str) for m in messages):
        raise XTokSpecError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    if not getattr(target_tokenizer, "chat_template", None):
        raise XTokSpecError("the target's tokenizer has no chat template: pass a prompt string instead of messages")
    text = target_tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    draft_text = text
    for token in hidden_specials(target_tokenizer, draft_tokenizer):
        draft_text = draft_text.replace(token, "")
    return text, draft_text


def hidden_specials(target_tokenizer, draft_tokenizer) -> list[str]:
    """The target's special-token texts that are no special token of the draft's, longest first: left out of the
    draft's view. The others reach the draft as its own."""
    return sorted(special_texts(target_tokenizer) - special_texts(draft_tokenizer), key=len, reverse=True)


class DraftView:
    """The draft's view of a prompt given as target token ids: each run of ordinary ids decoded to text on its own,
    each special id shown as its text where the draft has that special token and left out where it does not (the
    rule of `render`). Decoding run by run keeps what decoding the whole prompt without its special tokens gives
    (a SentencePiece target drops its dummy-prefix space after a BOS, which it would not after the BOS's text)."""

    def __init__(self, target_tokenizer, draft_tokenizer):
        self.tokenizer = target_tokenizer
        self.draft_bos = draft_tokenizer.bos_token
        hidden = set(hidden_specials(target_tokenizer, draft_tokenizer))
        self.shown = {i: ("" if text in hidden else text)  # special id -> its text in the draft's view
                      for i, text in special_tokens(target_tokenizer).items()}

    def text(self, ids) -> str:
        pieces, run = [], []
        for i in ids:
            shown = self.shown.get(int(i))
            if shown is None:
                run.append(int(i))
                continue
            if run:
                pieces.append(self._decode(run))
                run = []
            pieces.append(shown)
        if run:
            pieces.append(self._decode(run))
        return "".join(pieces)

    def prompt(self, ids) -> tuple[str, bool]:
        """(the draft's text of target ids, whether encoding it should add the draft's special tokens: not where
        the text already begins with the draft's BOS, as SmolLM2's `<|im_start|>` begins a ChatML prompt)."""
        text = self.text(ids)
        return text, not (self.draft_bos and text.startswith(self.draft_bos))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
