"""The Japanese fixture family (fixtures/): models and tokenizers load offline and are what they claim.

ja-sp is the llm-jp kind (SentencePiece unigram, byte fallback, adds <s>); ja-bpe is the open-calm kind
(byte-level BPE, <|endoftext|> only, adds no BOS). See fixtures/README.md for how they are built.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SP_DIR = FIXTURES / "tokenizers" / "ja-sp"
BPE_DIR = FIXTURES / "tokenizers" / "ja-bpe"
MODEL_NAMES = ("ja-target", "ja-draft-same", "ja-draft-bpe")
MODEL_KIND = {"ja-target": "LlamaForCausalLM", "ja-draft-same": "LlamaForCausalLM",
              "ja-draft-bpe": "GPTNeoXForCausalLM"}
RARE = "𠮷"  # U+20BB7, outside the ja-sp vocabulary: 4 UTF-8 bytes


@cache
def tokenizer(path: Path):
    """A fixture tokenizer loaded offline with AutoTokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@cache
def heldout() -> tuple[str, ...]:
    """The committed held-out paragraphs."""
    return tuple((FIXTURES / "data" / "heldout.txt").read_text(encoding="utf-8").splitlines())


def tokenizer_json(path: Path) -> dict:
    """The raw tokenizer.json of a fixture tokenizer."""
    return json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_loads_offline_with_its_tokenizer(name):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "models" / name, dtype=torch.float32)
    tok = tokenizer(FIXTURES / "models" / name)
    assert type(model).__name__ == MODEL_KIND[name]
    assert model.generation_config.eos_token_id == tok.eos_token_id
    ids = tok("自然言語処理", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert model.config.vocab_size == len(tok)


def test_ja_sp_is_byte_fallback_unigram_adding_bos():
    spec = tokenizer_json(SP_DIR)
    assert spec["model"]["type"] == "Unigram" and spec["model"]["byte_fallback"] is True
    assert spec["pre_tokenizer"]["type"] == "Metaspace"
    tok = tokenizer(SP_DIR)
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok("テスト").input_ids[0] == tok.bos_token_id


def test_ja_bpe_is_byte_level_bpe_adding_no_bos():
    spec = tokenizer_json(BPE_DIR)
    assert spec["model"]["type"] == "BPE"
    assert spec["pre_tokenizer"]["type"] == "ByteLevel" and spec["pre_tokenizer"]["add_prefix_space"] is False
    assert spec["decoder"]["type"] == "ByteLevel"
    tok = tokenizer(BPE_DIR)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.eos_token_id not in tok("テスト").input_ids


def test_vocab_sizes_differ():
    # transformers' cross-tokenizer assisted generation refuses two vocabularies of one size
    assert len(tokenizer(SP_DIR)) != len(tokenizer(BPE_DIR))


@pytest.mark.parametrize("path", [SP_DIR, BPE_DIR], ids=["ja-sp", "ja-bpe"])
def test_decode_encode_round_trip_on_heldout(path):
    tok = tokenizer(path)
    lines = list(heldout())
    decoded = [tok.decode(ids, skip_special_tokens=True) for ids in tok(lines).input_ids]
    assert [x for x, y in zip(lines, decoded, strict=True) if x != y] == []


def test_fast_ids_equal_sentencepiece_ids_on_heldout():
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(SP_DIR / "ja-sp.model"))
    lines = list(heldout())
    fast = tokenizer(SP_DIR)(lines, add_special_tokens=False).input_ids
    assert [x for x, a, b in zip(lines, sp.encode(lines), fast, strict=True) if a != b] == []


def test_known_sentencepiece_differences_are_as_documented():
    # fixtures/README.md: the Metaspace pre-tokenizer adds no dummy prefix to text that already starts with
    # a space (sentencepiece always does), and literal "<s>" in text becomes the special token.
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(SP_DIR / "ja-sp.model"))
    tok = tokenizer(SP_DIR)
    assert sp.encode(" テスト", out_type=str) == ["▁", "▁", "テスト"]
    assert tok.tokenize(" テスト") == ["▁", "テスト"]
    assert tok.decode(tok(" テスト").input_ids, skip_special_tokens=True) == "テスト"
    assert tok.bos_token_id in tok("a <s> b", add_special_tokens=False).input_ids


def test_rare_character_becomes_byte_pieces_in_ja_sp():
    tok = tokenizer(SP_DIR)
    pieces = tok.tokenize(RARE)
    assert pieces[-4:] == [f"<0x{b:02X}>" for b in RARE.encode("utf-8")]
    assert tok.decode(tok(RARE).input_ids, skip_special_tokens=True) == RARE


def test_prompts_are_heldout_paragraph_openings():
    prompts = (FIXTURES / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()
    assert len(prompts) == len(set(prompts)) == 64
    assert all(8 <= len(p) <= 24 for p in prompts)
    assert all(any(line.startswith(p) for line in heldout()) for p in prompts)
