"""Tiny hand-built tokenizers for bridge tests: a SentencePiece-style unigram and a byte-level BPE."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

SP_PIECES = ["▁", "東", "京", "東京", "都", "▁a", "a", "b", "ab", "▁ab", "野", "家"]
BPE_WORDS = ["東京", "京都", "東", "京", "都", " a", "ab", "野"]


def sp_tokenizer() -> PreTrainedTokenizerFast:
    """Unigram + byte fallback + Metaspace dummy prefix + BOS, like llm-jp (ids: <unk> 0, <s> 1, </s> 2)."""
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    vocab += [(p, -2.0 if len(p) > 1 else -4.0) for p in SP_PIECES]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE over the 256 byte symbols plus merges for BPE_WORDS; <|endoftext|> is id 0, no BOS."""
    alphabet = bytes_to_unicode()
    vocab = {"<|endoftext|>": 0}
    for b in range(256):
        vocab[alphabet[b]] = len(vocab)
    merges = []
    for word in BPE_WORDS:
        symbols = [alphabet[b] for b in word.encode("utf-8")]
        current = symbols[0]
        for s in symbols[1:]:
            if current + s not in vocab:
                merges.append((current, s))
                vocab[current + s] = len(vocab)
            current += s
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
