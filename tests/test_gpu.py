"""Placement and host syncs on a GPU (skipped without one): models on different devices, a target with
device_map="auto", and the greedy path's transfers to the host per cycle (CUDA's sync debug mode counts them)."""

from __future__ import annotations

import warnings

import pytest
import torch
from model_helpers import MODELS, load_tokenizer

from xtokspec import SpecConfig, XTokSpec

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
PROMPTS = ["使用する C コンパイラが", "ファイルシステムをマウントするには", "𠮷野家の牛丼"]


def load(name: str, device: str, **kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODELS / name, dtype=torch.float32, **kwargs)
    if "device_map" not in kwargs:
        model = model.to(device)
    return model.eval(), load_tokenizer(MODELS / name)


def target_ids(target, prompt: str, n: int) -> list[int]:
    model, tokenizer = target
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=n)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("target_device,draft_device", [("cuda", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")])
def test_greedy_is_lossless_across_placements(target_device, draft_device, cache):
    target = load("ja-target", target_device)
    spec = XTokSpec(target, load("ja-draft-bpe", draft_device), config=SpecConfig(cache=cache))
    for prompt in PROMPTS:
        assert spec.generate(prompt, max_new_tokens=32).token_ids == target_ids(target, prompt, 32), prompt
    sampled = spec.generate(PROMPTS[0], max_new_tokens=16, do_sample=True, seed=1)
    assert sampled.token_ids == spec.generate(PROMPTS[0], max_new_tokens=16, do_sample=True, seed=1).token_ids


def test_target_with_device_map_auto():
    pytest.importorskip("accelerate")
    target = load("ja-target", "cuda", device_map="auto")
    spec = XTokSpec(target, load("ja-draft-bpe", "cpu"))
    assert spec.generate(PROMPTS[1], max_new_tokens=32).token_ids == target_ids(target, PROMPTS[1], 32)


def test_greedy_cycle_makes_two_host_transfers():
    """The drafted ids once (for the bridge) and the verdict once per cycle; CUDA's sync debug mode warns at each
    sync. Counted as the difference between a long and a short generation, so that the prompt's own transfers
    (encoding, prefill, the first draft) cancel out."""
    spec = XTokSpec(load("ja-target", "cuda"), load("ja-draft-same", "cuda"),
                    config=SpecConfig(cache="static", adaptive=False, num_draft_tokens=4))
    spec.generate(PROMPTS[1], max_new_tokens=8)  # warm-up

    def syncs_and_cycles(n: int) -> tuple[int, int]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = spec.generate(PROMPTS[1], max_new_tokens=n)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) for w in caught), result.stats.target_forwards

    (short, short_cycles), (long, long_cycles) = syncs_and_cycles(8), syncs_and_cycles(64)
    print(f"{short} syncs in {short_cycles} cycles, {long} in {long_cycles}")
    assert long_cycles >= short_cycles + 10, "the fixture target stopped early: the count needs more cycles"
    assert (long - short) <= 2 * (long_cycles - short_cycles), f"{long - short} syncs for {long_cycles - short_cycles} cycles"


@pytest.mark.parametrize("options", [dict(compile=True, cache="static"), dict(tree_width=4),
                                     dict(tree_width=4, compile=True, cache="static")],
                         ids=["compiled", "tree4", "compiled-tree4"])
def test_greedy_is_lossless_on_cuda_with(options, caplog):
    """CUDA graphs (padded buckets, replayed outputs), tree-masked verification and draft levels, and both (tree
    steps captured), against the target's generate. Compiled: warmed up first (graphs recorded by `warmup`),
    after which no generation compiles."""
    import logging

    target = load("ja-target", "cuda")
    spec = XTokSpec(target, load("ja-draft-bpe", "cuda"), config=SpecConfig(**options))
    if options.get("compile"):
        assert spec.warmup(max(PROMPTS, key=len), max_new_tokens=32, progress=False) > 0
    caplog.set_level(logging.INFO, logger="xtokspec")
    for prompt in PROMPTS:
        assert spec.generate(prompt, max_new_tokens=32).token_ids == target_ids(target, prompt, 32), prompt
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling ")]
