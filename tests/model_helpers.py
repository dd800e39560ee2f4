"""Model and tokenizer helpers for the tests (torch and transformers are imported inside the functions)."""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
MODELS = FIXTURES / "models"
TEST_DEVICE = os.environ.get("XTOKSPEC_TEST_DEVICE", "cpu")

def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_fixture_model(name: str):
    """(model, tokenizer) of a bundled fixture model in float32, on the CPU or on XTOKSPEC_TEST_DEVICE (e.g. cuda:
    the chi-square tests run there on a GPU machine with `XTOKSPEC_TEST_DEVICE=cuda tox -e stats`)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = MODELS / name
    if not (path / "config.json").exists():
        pytest.fail(f"fixture model {path} is missing: build it with fixtures/build (see fixtures/README.md)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model.to(TEST_DEVICE), load_tokenizer(path)


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


WINDOW = 6  # the sliding window of the tiny sliding-window models


def tiny_gemma3(tokenizer, seed: int, layers=("sliding_attention", "sliding_attention", "full_attention")):
    """A random Gemma-3 text model over `tokenizer` whose sliding layers see WINDOW positions."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=len(layers),
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=WINDOW, layer_types=list(layers),
        max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
    )
    model = Gemma3ForCausalLM(config).eval()
    return model


def tiny_mistral(tokenizer, seed: int):
    """A random Mistral (every layer sliding, the window in `sliding_window`)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=WINDOW, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return MistralForCausalLM(config).eval()


def load_script(relative: str):
    """A script of the checkout (e.g. benchmarks/real_models.py) imported as a module by its path, its folder on
    sys.path as when it runs."""
    import importlib.util
    import sys

    path = ROOT / relative
    if str(path.parent) not in sys.path:  # as when it runs: its folder's modules (benchmarks/common.py) import
        sys.path.insert(0, str(path.parent))
    name = "script_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # NOTE: dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
