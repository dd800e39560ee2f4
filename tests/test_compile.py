"""SpecConfig(compile=True): short forwards padded to fixed lengths and run through torch.compile, on the
static cache. Lossless like every backend: the padding's cache positions are rolled back, and the compiled
model computes what the eager one does (greedy ids equal the target's own generate)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from model_helpers import tiny_llama, tiny_neox
from policies import scripted

from xtokspec import SpecConfig, XTokSpec, XTokSpecError
from xtokspec.compile import COMPILE_BUCKETS

PROMPTS = ["使用する C コンパイラが", "ファイルシステムをマウントするには", "𠮷野家の牛丼"]


def target_ids(target, prompt: str, n: int) -> list[int]:
    model, tokenizer = target
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=n)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_compile_needs_the_static_cache(tiny_target, bpe_tokenizer):
    """Refused when the configuration is made (not at the first generate, after the models have loaded), and for a
    model whose layers cannot use the static cache, when the backend is chosen."""
    with pytest.raises(XTokSpecError, match="compile=True needs the static cache"):
        SpecConfig(compile=True, cache="dynamic")
    with pytest.raises(XTokSpecError, match="compile must be True or False"):
        SpecConfig(compile="yes")
    from xtokspec.kv import choose_backend

    target = tiny_target[0]
    assert choose_backend(target, "auto", compiled=True) == "static"
    saved = dict(target.config.__dict__)
    target.config.sliding_window, target.config.use_sliding_window = 4, True
    try:
        with pytest.raises(XTokSpecError, match="compile=True needs the static cache.*sliding"):
            choose_backend(target, "auto", compiled=True)
    finally:
        target.config.__dict__.clear()
        target.config.__dict__.update(saved)
    assert choose_backend(target, "auto", compiled=True) == "static"


@pytest.fixture
def eager_compile(monkeypatch):
    """torch.compile replaced by the identity: the padded-bucket path runs eagerly (same xtokspec code)."""
    calls = []

    def identity(model, **kwargs):
        calls.append(kwargs)
        return model

    monkeypatch.setattr(torch, "compile", identity)
    return calls


def test_a_caches_first_forward_runs_eagerly_then_through_the_step(sp_tokenizer):
    """transformers' StaticLayer marks its buffers as static addresses only when initialised outside a compiled
    region; initialised inside one, torch.compile skipped CUDA graphs on an H100 ("mutated inputs"). So the
    prefill, even a short one, runs eagerly, and the step serves only the forwards after it."""
    from xtokspec.cache import ModelState

    model = tiny_llama(sp_tokenizer, seed=3)
    calls = []

    def step(**kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        return model(**kwargs)

    state = ModelState(model, [5, 6, 7], "static", 64, step)
    with torch.inference_mode():
        state.forward(keep=1)  # the prompt: 3 ids, short enough for a bucket, yet eager
        assert calls == [] and state.cached == 3
        state.ids.extend([8, 9, 10])
        logits = state.forward(keep=3)
    assert calls == [4] and state.cached == 6  # 3 new ids padded to the bucket of 4, the padding rolled back
    with torch.inference_mode():
        eager = model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]])).logits[0, -3:]
    torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["bridged", "same"])
def test_padded_buckets_are_lossless_on_the_fixtures(draft, eager_compile, ja_target, ja_draft_bpe, ja_draft_same,
                                                     heldout_prompts):
    spec = XTokSpec(ja_target, ja_draft_bpe if draft == "bridged" else ja_draft_same, config=SpecConfig(compile=True))
    for prompt in heldout_prompts[:12] + PROMPTS:
        result = spec.generate(prompt, max_new_tokens=40)
        assert result.token_ids == target_ids(ja_target, prompt, 40), prompt
    assert result.stats.cache == "static/static+compile"
    assert len(eager_compile) == 2  # both models, once per XTokSpec


@pytest.mark.slow
@pytest.mark.parametrize("tree_width", [1, 3])
def test_compiled_greedy_equals_target(tree_width, sp_tokenizer, bpe_tokenizer):
    """A real torch.compile (inductor on the CPU; a few seconds per bucket for these tiny models), for chains and
    for trees (tree-masked steps with explicit positions)."""
    target = (tiny_llama(sp_tokenizer, seed=11), sp_tokenizer)
    draft = (tiny_neox(bpe_tokenizer, seed=12), bpe_tokenizer)
    config = SpecConfig(compile=True, adaptive=False, num_draft_tokens=3, tree_width=tree_width)
    compiled = XTokSpec(target, draft, config=config)
    eager = XTokSpec(target, draft, config=SpecConfig(cache="static", adaptive=False, num_draft_tokens=3,
                                                      tree_width=tree_width))
    for prompt in PROMPTS:
        want = target_ids(target, prompt, 24)
        assert compiled.generate(prompt, max_new_tokens=24).token_ids == want, prompt
        assert eager.generate(prompt, max_new_tokens=24).token_ids == want, prompt
    assert max(COMPILE_BUCKETS) >= 4


@pytest.mark.parametrize("tree_width", [1, 2])
def test_new_prompt_lengths_reuse_the_compiled_graphs_and_buffers(tree_width, tiny_target, bpe_tokenizer, monkeypatch,
                                                                   caplog):
    """A new prompt length must not recompile: torch.compile specialises on the static buffer's shape, and a
    buffer sized to each prompt recompiled every bucket of both models (on an H100 at the 13B shapes, a ~100 s
    stall in the middle of a generation). Dynamo runs for real here, with its eager backend (guards without
    inductor), and records why it recompiled; none of the reasons may concern the cache. The buffers are
    reused from one generation to the next, so captured graphs keep their addresses."""
    from torch._dynamo.utils import guard_failures

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: real_compile(model, backend="eager", dynamic=False))
    torch._dynamo.reset()
    spec = XTokSpec(tiny_target, (tiny_neox(bpe_tokenizer), bpe_tokenizer),
                    config=SpecConfig(compile=True, tree_width=tree_width))
    caches = []
    caplog.set_level(logging.INFO, logger="xtokspec")
    for prompt in ["東京", *PROMPTS]:  # 2 to 13 target ids
        spec.generate(prompt, max_new_tokens=12)
        caches.append([spec._idle_kv[id(model)] for model in (spec.target_model, spec.draft_model)])
    reasons = [str(reason) for failures in guard_failures.values() for reason in failures]
    assert reasons, "no recompilation at all: the guard record is not being read"
    # the cache's guard names the forward's keyword: 'cache' from transformers 5.24 on, 'past_key_values' before
    assert not [r for r in reasons if re.search(r"\['(cache|past_key_values)'\]", r) and "size mismatch" in r], reasons
    assert all(pair[0] is caches[0][0] and pair[1] is caches[0][1] for pair in caches)
    # every new shape is announced once (a compile inside a generation says so), none twice
    compiling = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling ")]
    assert compiling and len(compiling) == len(set(compiling)), compiling
    sizes = {m.split("'s ")[0]: set() for m in compiling}  # per model: its buffer's sizes
    for m in compiling:
        sizes[m.split("'s ")[0]].add(m.split(" over a ")[1])
    assert all(len(s) == 1 for s in sizes.values()), compiling  # one buffer size each
    if tree_width > 1:  # and tree steps beside the chain's
        assert any(" tree step " in m for m in compiling), compiling
    torch._dynamo.reset()


def test_a_compiled_move_keeps_an_accepted_path_off_the_first_branch(sp_tokenizer):
    """keep_path moves an accepted path that is not nodes 1, 2, ... into place: through a compiled step with one
    captured call for every layer (inductor for real here), padded to a bucket by positions copied onto
    themselves. The cache then holds exactly the committed ids: the next forward equals a plain one."""
    from xtokspec.cache import ModelState
    from xtokspec.compile import CompiledStep

    model = tiny_llama(sp_tokenizer, seed=5)
    step = CompiledStep(model, "target")
    prompt = list(range(30, 50))
    with torch.inference_mode():
        state = ModelState(model, prompt, "static", 64, step, tree_nodes=16)
        state.forward(keep=1)
        tokens, parents = [0, 5, 6, 7, 8, 9], [-1, 0, 0, 2, 3, 1]  # nodes 2 -> 3 -> 4: positions 1-3 past base
        state.forward_tree(tokens, parents)
        state.keep_path([2, 3, 4], tokens)
        assert state.ids == prompt + [6, 7, 8] and state.cached == len(state.ids)
        state.ids.append(11)
        got = state.forward(keep=1)[0]
        want = model(input_ids=torch.tensor([state.ids])).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (4, state.kv.capacity, "move") in step.shapes  # 3 positions, padded to 4
    torch._dynamo.reset()


@pytest.mark.parametrize("tree_width", [1, 2])
def test_warmup_compiles_every_shape_before_the_first_generation(tree_width, tiny_target, bpe_tokenizer, monkeypatch,
                                                                 caplog):
    """`warmup` compiles what generations of the prompt's size class meet, so that none stops to compile (on an
    H100 at the 13B shapes a loop without it stalled 44 s in its third prompt). Dynamo runs for real
    (eager backend): after the warm-up, generations of several prompt lengths compile no graph, announce no
    new shape, and still equal the target's greedy output."""
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: real_compile(model, backend="eager", dynamic=False))
    torch._dynamo.reset()
    spec = XTokSpec(tiny_target, (tiny_neox(bpe_tokenizer), bpe_tokenizer),
                    config=SpecConfig(compile=True, tree_width=tree_width))
    caplog.set_level(logging.INFO, logger="xtokspec")
    shapes = spec.warmup("ファイルシステムをマウントするには", max_new_tokens=16, progress=False)
    # the draft's 6 buckets and the target's 6 (chain, or tree-masked); with trees also the draft's 2 level widths,
    # keep_path's 6 move lengths and the one-id chain step of the target-alone cycles (SpecConfig.fallback)
    assert shapes == 12 + (2 + 6 + 1 if tree_width == 2 else 0)
    announced = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling ")]
    assert len(announced) == shapes, announced
    graphs = counters["stats"]["unique_graphs"]
    caplog.clear()
    # target-alone cycles between drafted ones (the fallback's choice, scripted: conftest otherwise drafts always)
    monkeypatch.setattr(spec, "fallback_policy", scripted(lambda policy: policy.cycles >= 1 and policy.since_draft < 1))
    for prompt in ["東京", *PROMPTS]:
        assert spec.generate(prompt, max_new_tokens=16).token_ids == target_ids(tiny_target, prompt, 16), prompt
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling ")]
    assert counters["stats"]["unique_graphs"] == graphs
    assert XTokSpec(tiny_target, (tiny_neox(bpe_tokenizer), bpe_tokenizer)).warmup("東京") == 0  # nothing compiled
    with pytest.raises(XTokSpecError, match="max_new_tokens"):
        spec.warmup("東京", max_new_tokens=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("draft", ["bridged", "same"])
def test_trees_run_through_the_compiled_steps_and_stay_lossless(draft, eager_compile, ja_target, ja_draft_bpe,
                                                                ja_draft_same, heldout_prompts):
    """Token trees are captured too: the target verifies each trie, and the draft grows each level of its beam,
    in padded tree-masked calls through the compiled steps (an eager draft level costs 10x a captured step on an
    H100). The output is still the target's own."""
    from xtokspec.cache import ModelState
    from xtokspec.compile import CompiledStep

    calls = {"forward_tree": 0, "grow_tree": 0, "target tree step": 0, "draft tree step": 0}

    def counting(name, original):
        def run(self, *args, **kwargs):
            if name.endswith("step"):
                if kwargs.get("attention_mask") is None:
                    return original(self, *args, **kwargs)
                name_ = f"{self.role} tree step"
            else:
                name_ = name
            calls[name_] += 1
            return original(self, *args, **kwargs)
        return run

    patch = pytest.MonkeyPatch()
    for name in ("forward_tree", "grow_tree"):
        patch.setattr(ModelState, name, counting(name, getattr(ModelState, name)))
    patch.setattr(CompiledStep, "__call__", counting("step", CompiledStep.__call__))
    prompts = heldout_prompts[:4] + PROMPTS
    try:
        spec = XTokSpec(ja_target, ja_draft_bpe if draft == "bridged" else ja_draft_same,
                        config=SpecConfig(compile=True, tree_width=4))
        for prompt in prompts:
            result = spec.generate(prompt, max_new_tokens=24)
            assert result.token_ids == target_ids(ja_target, prompt, 24), prompt
    finally:
        patch.undo()
    assert result.stats.proposal.endswith(" tree") and result.stats.cache == "static/static+compile"
    assert max(result.stats.proposal_lengths) > 1  # tries of several nodes
    # every verification but each generation's first (the prompt's prefill, eager) and every draft level captured
    assert calls["target tree step"] == calls["forward_tree"] - len(prompts), calls
    assert calls["draft tree step"] == calls["grow_tree"] > 0, calls
    # the budget costs each bucket's size apart (1 uncached id + nodes = 1, 2, 4, 8, 16, 32), several by now
    assert 2 <= len(spec._tree_size_times) and set(spec._tree_size_times) <= {0, 1, 3, 7, 15, 31}, spec._tree_size_times


def test_a_reused_buffer_starts_empty_even_after_a_forward_that_raised(sp_tokenizer):
    """A generation that raised inside a forward can leave some layers' write positions ahead of the length the
    cache believes in; the next generation that takes the buffer over must still write from position 0."""
    from xtokspec.cache import ModelState

    model = tiny_llama(sp_tokenizer, seed=4)
    step = lambda **kwargs: model(**kwargs)  # noqa: E731
    first = ModelState(model, [5, 6, 7, 8], "static", 64, step)
    with torch.inference_mode():
        first.forward(keep=1)
    first.kv._length = 0  # as if the prefill had raised after its layers wrote: their positions stay at 4
    again = ModelState(model, [9, 10, 11], "static", 64, step, reuse=first.kv)
    assert again.kv is first.kv
    with torch.inference_mode():
        logits = again.forward(keep=3)
        fresh = model(input_ids=torch.tensor([[9, 10, 11]])).logits[0]
    torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)
