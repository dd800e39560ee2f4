"""Shared fixtures. Imports nothing heavy at module level: the `reference` tox env (no torch) loads this file."""

from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
MODELS = FIXTURES / "models"


def pytest_configure(config):
    """One torch thread: the fixture models are tiny, and on a shared 2-core machine a 2-thread op stalls
    whenever its peer thread is descheduled (measured: 8 ms per tiny matmul under load instead of ~0.05)."""
    try:
        import torch
    except ImportError:  # the reference env has no torch
        return
    torch.set_num_threads(1)


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def sp_tokenizer():
    """ja-sp: SentencePiece unigram with byte fallback and BOS (the llm-jp kind)."""
    return load_tokenizer(FIXTURES / "tokenizers" / "ja-sp")


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """ja-bpe: byte-level BPE without BOS (the open-calm kind)."""
    return load_tokenizer(FIXTURES / "tokenizers" / "ja-bpe")


def load_fixture_model(name: str):
    """(model, tokenizer) of a bundled fixture model in float32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    path = MODELS / name
    if not (path / "config.json").exists():
        pytest.fail(f"fixture model {path} is missing: build it with fixtures/build (see fixtures/README.md)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, load_tokenizer(path)


@pytest.fixture(scope="session")
def ja_target():
    return load_fixture_model("ja-target")


@pytest.fixture(scope="session")
def ja_draft_bpe():
    return load_fixture_model("ja-draft-bpe")


@pytest.fixture(scope="session")
def ja_draft_same():
    return load_fixture_model("ja-draft-same")


@pytest.fixture(scope="session")
def heldout_prompts() -> list[str]:
    lines = (FIXTURES / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line]


@pytest.fixture(scope="session")
def bridged_spec(ja_target, ja_draft_bpe):
    from xtokspec import XTokSpec

    return XTokSpec(ja_target, ja_draft_bpe)


@pytest.fixture(scope="session")
def same_spec(ja_target, ja_draft_same):
    from xtokspec import XTokSpec

    return XTokSpec(ja_target, ja_draft_same)


def tiny_llama(tokenizer, layers: int = 2, seed: int = 0, max_positions: int = 256):
    """A randomly initialised tiny Llama over `tokenizer` (for tests that need any model, not a good one)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config).eval()


def tiny_neox(tokenizer, seed: int = 1):
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=256,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return GPTNeoXForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_target(sp_tokenizer):
    return tiny_llama(sp_tokenizer), sp_tokenizer


@pytest.fixture(scope="session")
def tiny_spec(tiny_target, bpe_tokenizer):
    from xtokspec import XTokSpec

    return XTokSpec(tiny_target, (tiny_neox(bpe_tokenizer), bpe_tokenizer))
