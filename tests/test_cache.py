"""KV-cache rollback, for every backend: after truncating and feeding other ids, logits equal a fresh forward."""

from __future__ import annotations

import pytest
import torch
from model_helpers import tiny_llama, tiny_neox

from xtokspec import SpecConfig, XTokSpecError
from xtokspec.runtime.cache import ModelState
from xtokspec.runtime.kv import CACHE_BACKENDS, cache_keyword, choose_backend

BACKENDS = pytest.mark.parametrize("backend", CACHE_BACKENDS)


def fresh_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


@BACKENDS
@pytest.mark.parametrize("arch", ["llama", "neox"])
def test_rollback_equals_fresh_forward(sp_tokenizer, backend, arch):
    model = tiny_llama(sp_tokenizer, seed=3) if arch == "llama" else tiny_neox(sp_tokenizer, seed=3)
    state = ModelState(model, [1, 10, 11, 12], backend, capacity=32)
    with torch.inference_mode():
        state.forward(keep=1)
        state.ids += [20, 21, 22, 23]  # a speculative block ...
        state.forward(keep=4)
        state.truncate(5)  # ... of which one token is accepted
        assert state.cached == 5 and state.ids == [1, 10, 11, 12, 20]
        state.ids += [30, 31]
        got = state.forward(keep=1)[-1]
        state.truncate(6)  # a second rollback inside the newly written positions, then a longer block
        state.ids += [40, 41, 42]
        got2 = state.forward(keep=1)[-1]
    torch.testing.assert_close(got, fresh_logits(model, [1, 10, 11, 12, 20, 30, 31]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got2, fresh_logits(model, [1, 10, 11, 12, 20, 30, 40, 41, 42]), rtol=1e-5, atol=1e-5)


@BACKENDS
def test_forward_after_full_rollback_recomputes_the_last_position(sp_tokenizer, backend):
    model = tiny_llama(sp_tokenizer, seed=4)
    state = ModelState(model, [1, 5, 6, 7], backend, capacity=16)
    with torch.inference_mode():
        state.ids += [8, 9]
        state.forward(keep=1)
        state.truncate(4)  # everything left is cached: nothing new to feed
        got = state.forward(keep=1)[-1]
    torch.testing.assert_close(got, fresh_logits(model, [1, 5, 6, 7]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prefix", [True, False], ids=["eager-prefix", "whole-buffer"])
def test_static_rollback_moves_a_length_and_copies_nothing(sp_tokenizer, prefix):
    """Pins what the static backend relies on: both layer kinds write at their length (transformers' StaticLayer,
    which compiled steps use: cumulative_length + arange(T); xtokspec's eager prefix layer: a Python int) into
    buffers that a rollback leaves in place, and the prefix layer attends over the written positions only."""
    from xtokspec.runtime.kv import StaticKV

    model = tiny_llama(sp_tokenizer, seed=5)
    state = ModelState(model, [1, 5, 6, 7, 8, 9], "static", capacity=16)
    state.kv = StaticKV(model, 16, prefix=prefix)

    def length(layer):
        return layer.length if prefix else int(layer.cumulative_length)

    with torch.inference_mode():
        state.forward(keep=1)
        layer = state.kv.cache.layers[0]
        keys = layer.keys
        address = keys.data_ptr()
        assert keys.shape[-2] == 16 and length(layer) == 6
        assert layer.get_mask_sizes(2) == ((8, 0) if prefix else (16, 0))
        state.truncate(3)
        assert length(layer) == 3 and layer.keys.data_ptr() == address
        stale = keys[0, 0, 3:6].clone()
        state.ids += [42]
        state.forward(keep=1)
        assert length(layer) == 4
        assert not torch.equal(keys[0, 0, 3], stale[0]) and torch.equal(keys[0, 0, 4:6], stale[1:])


def test_eager_static_logits_equal_dynamic(sp_tokenizer):
    """The prefix layer (no mask for one-token steps, a shorter one otherwise) computes what the dynamic cache does,
    through a prefill, one-token steps, a rollback and a multi-token forward."""
    from xtokspec.runtime.kv import PrefixStaticLayer

    model = tiny_llama(sp_tokenizer, seed=8)
    states = [ModelState(model, [1, 5, 6, 7, 8, 9], backend, capacity=32) for backend in ("dynamic", "static")]
    with torch.inference_mode():
        for script in ([], [11], [12], "rollback", [13, 14, 15], [16]):
            out = []
            for state in states:
                if script == "rollback":
                    state.truncate(len(state.ids) - 2)
                    continue
                state.ids += script
                out.append(state.forward(keep=len(script) or 1))
            if out:
                torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)
    assert all(isinstance(layer, PrefixStaticLayer) for layer in states[1].kv.cache.layers)


def test_static_cache_refuses_to_overflow(sp_tokenizer):
    """A static buffer is rounded up to a size class (256 here, the tiny model's whole context), no further."""
    model = tiny_llama(sp_tokenizer, seed=6, max_positions=1024)
    state = ModelState(model, list(range(1, 300)), "static", capacity=8)
    assert state.capacity == 256
    with pytest.raises(RuntimeError, match="299 ids exceed the cache's 256 positions"), torch.inference_mode():
        state.forward(keep=1)


def test_the_cache_goes_by_the_keyword_the_models_forward_takes(sp_tokenizer):
    """transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name warns, and goes in 5.40;
    pyproject turns that warning into an error in every test): each model is called by its own forward's name."""
    import inspect

    for model in (tiny_llama(sp_tokenizer), tiny_neox(sp_tokenizer)):
        names = inspect.signature(model.forward).parameters
        assert cache_keyword(model) == ("cache" if "cache" in names else "past_key_values")
        assert cache_keyword(model) in names

    class OldStyle(torch.nn.Module):  # a remote-code model that never moved
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return None

    assert cache_keyword(OldStyle()) == "past_key_values"

    # a forward wrapped on the instance, taking only *args and **kwargs, goes by the class's forward
    model = tiny_neox(sp_tokenizer)
    class_name = cache_keyword(model)
    forward = model.forward
    model.forward = lambda *args, **kwargs: forward(*args, **kwargs)
    assert cache_keyword(model) == class_name
    old = OldStyle()
    old.forward = lambda *args, **kwargs: None
    assert cache_keyword(old) == "past_key_values"


FAMILIES = {  # the mission pair's (llm-jp: GPT-2, open-calm: GPT-NeoX), the fixtures' and the real preset's
    "gpt2": dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0),
    "gpt_neox": dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=64),
    "llama": dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=64),
    "qwen2": dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64, vocab_size=64),
    "gemma3_text": dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=64, vocab_size=64, head_dim=16),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_fills_the_cache_passed_under_its_keyword(family):
    """A cache passed under a name the forward does not take would vanish into **kwargs: the model would run
    without it and nothing would fail until the outputs diverged. Each family fills the cache it is given."""
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    config = AutoConfig.for_model(family, **FAMILIES[family])
    model = AutoModelForCausalLM.from_config(config)
    cache = DynamicCache(config=config)
    model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{cache_keyword(model): cache})
    assert cache.get_seq_length() == 3


def test_backend_choice(sp_tokenizer):
    model = tiny_llama(sp_tokenizer, seed=7)
    assert choose_backend(model, "auto") == "dynamic"  # CPU
    assert choose_backend(model, "static") == "static"
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert choose_backend(model, "auto") == "dynamic"
    with pytest.raises(XTokSpecError, match=r"cache='static' needs full-attention layers.*sliding_attention"):
        choose_backend(model, "static")
    with pytest.raises(XTokSpecError, match="cache must be one of"):
        SpecConfig(cache="paged")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_auto_is_static_on_cuda(sp_tokenizer):
    assert choose_backend(tiny_llama(sp_tokenizer, seed=8).cuda(), "auto") == "static"


def test_static_buffers_pass_from_one_generation_to_the_next(tiny_target, bpe_tokenizer):
    """Eager static caches (CUDA's default) are reused as compiled ones are: the next generation takes the
    buffer over (nothing allocated, no layer initialised again, which on CUDA cost 26 host syncs per
    generation) and its output is still the target's own."""
    from test_greedy import target_generate

    from xtokspec import XTokSpec

    spec = XTokSpec(tiny_target, (tiny_neox(bpe_tokenizer), bpe_tokenizer), config=SpecConfig(cache="static"))
    kept = []
    for prompt in ["東京", "使用する C コンパイラが", "𠮷野家の牛丼"]:
        result = spec.generate(prompt, max_new_tokens=12)
        assert result.token_ids == target_generate(*tiny_target, prompt, 12), prompt
        kept.append([spec.kept.idle_kv[id(m)][0] for m in (spec.target_model, spec.draft_model)])
    assert all(k[0] is kept[0][0] and k[1] is kept[0][1] for k in kept)
    assert kept[0][0].prefix and kept[0][0].capacity == 256  # eager (prefix attention), the smallest size class


def test_a_buffer_is_reused_only_by_a_state_that_runs_it_the_same_way(sp_tokenizer):
    """A compiled step's buffer attends over the whole buffer, an eager one over its written prefix: neither is
    handed to the other, nor one too small."""
    model = tiny_llama(sp_tokenizer, seed=5, max_positions=1024)
    eager = ModelState(model, [5, 6, 7], "static", 64)
    assert ModelState(model, [5, 6], "static", 64, reuse=eager.kv).kv is eager.kv
    assert ModelState(model, [5, 6], "static", 64, step=lambda **kw: model(**kw), reuse=eager.kv).kv is not eager.kv
    assert ModelState(model, [5, 6], "static", 300, reuse=eager.kv).kv is not eager.kv
    assert ModelState(model, [5, 6], "dynamic", 64, reuse=eager.kv).backend == "dynamic"


@pytest.mark.parametrize("tree_width", [1, 2])
def test_streams_open_at_once_never_share_a_static_buffer(tree_width, tiny_target, bpe_tokenizer):
    """A static buffer passes to the next generation only once its own has finished: two streams advanced in
    turn each keep their own (a shared one would interleave their caches and change both outputs)."""
    from xtokspec import XTokSpec

    spec = XTokSpec(tiny_target, (tiny_neox(bpe_tokenizer), bpe_tokenizer),
                    config=SpecConfig(cache="static", tree_width=tree_width))
    prompts = ["使用する C コンパイラが", "𠮷野家の牛丼"]
    alone = [spec.generate(p, max_new_tokens=16).text for p in prompts]
    streams = [spec.stream(p, max_new_tokens=16) for p in prompts]
    texts = ["", ""]
    done = [False, False]
    while not all(done):
        for i, stream in enumerate(streams):
            if not done[i]:
                piece = next(stream, None)
                # the caller's grad mode between pieces: inference mode stays inside each cycle
                assert torch.is_grad_enabled()
                done[i] = piece is None
                texts[i] += piece or ""
    assert texts == alone
    assert [len(idle) for idle in spec.kept.idle_kv.values()] == [1, 1]  # one buffer per model, kept for the next generation


# The static cache's sampled one-hot path, sample for sample against the dynamic cache, whose law
# tests/test_stats.py tests: equality on the same seeds is a stronger check of the backend than a chi-square case
# of its own, at a fraction of the cost (a sampled token flips only if the two caches' logits differed).
SAME_SAMPLE_SEEDS = 150


@pytest.mark.slow
def test_static_cache_draws_the_dynamic_caches_samples_seed_for_seed(bridged_spec):
    from xtokspec import XTokSpec

    static = XTokSpec((bridged_spec.target_model, bridged_spec.target_tokenizer),
                      (bridged_spec.draft_model, bridged_spec.draft_tokenizer),
                      config=SpecConfig(cache="static", compile=False))  # eager on CUDA too
    options = dict(max_new_tokens=3, do_sample=True, proposal="onehot", num_draft_tokens=3, adaptive=False,
                   temperature=1.0, top_k=3, top_p=1.0)
    prompt = "Linux 2.0 で、 struct arp"  # tests/test_stats.py's one-hot prompt: 15% of runs accept 2 proposals
    deep = 0
    for seed in range(SAME_SAMPLE_SEEDS):
        ours = static.generate(prompt, seed=seed, **options)
        assert ours.stats.cache == "static/static"
        assert ours.token_ids == bridged_spec.generate(prompt, seed=seed, **options).token_ids, f"seed {seed}"
        deep += ours.stats.max_accepted_in_a_cycle >= 2
    assert deep >= 0.05 * SAME_SAMPLE_SEEDS  # the rollback below the first proposal is on the checked path
