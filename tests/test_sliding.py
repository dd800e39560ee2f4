"""Sliding-window models (Gemma 2/3, Mistral, ...) in either role, far past their window: greedy output is the
target's own `generate`, for chains and for trees drafted by a sliding-window draft (batch rows over a copy of its
cache), and each sliding layer's cache stays bounded by its window plus the spare a rollback may need.

The models are tiny and random, with a window of a few tokens, so that a short generation passes it many times.
A draft that is the target itself (same weights) has every proposal accepted: the path where nothing is rolled
back and the layers are only trimmed; a draft of other weights or another tokenizer is mostly rejected: the path
where every cycle rolls back past the window's start. The sampled law past the window is in test_stats.py.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import WINDOW, tiny_gemma3, tiny_mistral
from test_greedy import check_prompts

from xtokspec import SpecConfig, XTokSpec
from xtokspec.runtime.kv import SLIDING_SPARE, DynamicKV, cache_keyword

PROMPTS = ["東京と京都の", "ファイルシステムをマウントするには", "あ"]
NEW_TOKENS = 100  # prompt + output pass the window ~20 times, and the spare kept beyond it (SLIDING_SPARE)


@pytest.fixture(scope="module")
def gemma_sp(sp_tokenizer):
    return tiny_gemma3(sp_tokenizer, seed=0), sp_tokenizer


@pytest.fixture(scope="module")
def gemma_bpe(bpe_tokenizer):
    return tiny_gemma3(bpe_tokenizer, seed=1), bpe_tokenizer


def generate_checked(spec, target, **options):
    reports = check_prompts(spec, target, PROMPTS, NEW_TOKENS, {}) if not options else []
    for line in reports:
        print("near-tie:", line)
    return reports


@pytest.mark.parametrize("draft", ["itself", "other-weights", "other-tokenizer"])
def test_sliding_target_equals_its_generate_past_the_window(draft, gemma_sp, gemma_bpe, sp_tokenizer):
    small = {"itself": gemma_sp, "other-weights": (tiny_gemma3(sp_tokenizer, seed=5), sp_tokenizer),
             "other-tokenizer": gemma_bpe}[draft]
    spec = XTokSpec(gemma_sp, small, config=SpecConfig(adaptive=False, num_draft_tokens=4))
    generate_checked(spec, gemma_sp)
    stats = spec.generate(PROMPTS[1], max_new_tokens=NEW_TOKENS).stats
    assert stats.cache == "dynamic/dynamic" and stats.new_tokens == NEW_TOKENS
    if draft == "itself":
        assert stats.accepted == stats.drafted > 0  # nothing rolled back: the trimmed path
    else:
        assert stats.rejections > 0  # rolled back past the window's start


@pytest.mark.parametrize("tree_width", [1, 3])
def test_sliding_draft_for_a_full_attention_target(tree_width, ja_target, gemma_bpe):
    """The fixture target (full attention) with a sliding-window draft of another tokenizer; with trees the draft's
    beam grows over batch rows copied from its cache (`ModelState.branches`), whose positions must be the cache's
    length, not the window's."""
    spec = XTokSpec(ja_target, gemma_bpe, config=SpecConfig(tree_width=tree_width, adaptive=False, num_draft_tokens=4))
    generate_checked(spec, ja_target)


def test_all_sliding_layers_mistral_in_both_roles(sp_tokenizer):
    target = (tiny_mistral(sp_tokenizer, seed=2), sp_tokenizer)
    draft = (tiny_mistral(sp_tokenizer, seed=3), sp_tokenizer)
    generate_checked(XTokSpec(target, draft, config=SpecConfig(adaptive=False, num_draft_tokens=3)), target)


def test_a_sliding_layer_keeps_its_window_plus_the_spare_and_refuses_a_rollback_it_cannot_make(gemma_sp):
    """Memory per sliding layer is window - 1 + spare (+ one forward's ids) whatever the context; a rollback
    deeper than what is kept raises before changing anything, and ModelState then rebuilds the cache (exact,
    at a re-prefill's cost)."""
    from xtokspec.runtime.cache import ModelState
    from xtokspec.runtime.kv import RollbackTooDeep

    model = gemma_sp[0]
    kv = DynamicKV(model, 1024, spare=4)
    ids = list(range(5, 105))
    with torch.inference_mode():
        for start in range(0, 100, 10):  # 100 positions, 10 at a time
            model(input_ids=torch.tensor([ids[start:start + 10]]), use_cache=True, **{cache_keyword(model): kv.cache})
            kv.advance(10)
    sliding = [layer for layer in kv.cache.layers if layer.is_sliding]
    assert sliding and all(layer.keys.shape[-2] == WINDOW - 1 + 4 for layer in sliding)
    full = [layer for layer in kv.cache.layers if not layer.is_sliding]
    assert all(layer.keys.shape[-2] == 100 for layer in full)
    kv.rollback(96)  # 4 back: within the spare
    assert kv.length == 96 and all(layer.keys.shape[-2] == WINDOW - 1 for layer in sliding)
    with pytest.raises(RollbackTooDeep):
        kv.rollback(90)
    assert kv.length == 96  # unchanged
    # through ModelState: the rollback falls back to a new cache, and the next forward is the model's own
    state = ModelState(model, ids[:96], "dynamic", 1024)
    state.kv = kv
    state.truncate(90)
    assert state.cached == 0
    with torch.inference_mode():
        logits = state.forward(keep=1)
        want = model(input_ids=torch.tensor([ids[:90]])).logits[0, -1]
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)
    assert SLIDING_SPARE >= 2 * SpecConfig().max_draft_tokens  # a cycle's drafted ids and the re-encoded ones


def test_branch_rows_of_a_sliding_cache_continue_where_the_cache_is(gemma_bpe):
    """A tree's batch rows copied from a sliding-window cache past its window give each row the logits of the
    model's own forward over the ids plus that row's token (their positions are the cache's length)."""
    from xtokspec.runtime.cache import ModelState

    model = gemma_bpe[0]
    ids = list(range(5, 105))  # 100 ids: past the window and the spare it keeps
    state = ModelState(model, ids, "dynamic", 1024)
    with torch.inference_mode():
        state.forward(keep=1)
        rows = state.forward_rows(torch.tensor([[7], [9]]), state.branches(2))  # (2, V)
        for row, token in zip(rows, (7, 9), strict=True):
            want = model(input_ids=torch.tensor([ids + [token]])).logits[0, -1]
            torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-4)
