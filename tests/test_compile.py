"""SpecConfig(compile=...): short forwards padded to fixed lengths and captured, on the static cache: recorded as
CUDA graphs ("graphs"; "auto", the default, on a GPU) or run through torch.compile ("inductor", or True). Lossless
like every backend: the padding's cache positions are rolled back, and the captured model computes what the eager
one does (greedy ids equal the target's own generate). Capturing itself needs CUDA (tests/test_gpu.py); here the
choice of path, its fallbacks and what GraphedStep feeds a graph are tested."""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch
from model_helpers import tiny_llama, tiny_neox
from policies import scripted, simulated_clock

from xtokspec import SpecConfig, XTokSpec, XTokSpecError
from xtokspec.runtime.compile import (
    COMPILE_BUCKETS,
    CompiledStep,
    GraphCaptureError,
    GraphedStep,
    choose_step,
)

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
    from xtokspec.runtime.kv import choose_backend

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
    from xtokspec.runtime.cache import ModelState

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


@pytest.mark.slow
@pytest.mark.fallback  # the real Fallback observes (with adaptive=False it never runs the target alone)
def test_cycles_that_compile_a_shape_are_left_out_of_the_policies(sp_tokenizer, bpe_tokenizer, monkeypatch):
    """A first call of a new shape compiles inside a cycle (seconds on a CPU, minutes for a 13B model on a GPU).
    Measured, that would pass for what drafting or a target step costs, and the policies, which carry over between
    generations, would choose K and the fallback on it long after. On a clock that only compiling advances (10 s a
    shape, simulated; the models' forwards cost nothing), the policies must have measured 0 s everywhere."""
    clock = simulated_clock(monkeypatch)
    first_call = CompiledStep._run

    def compiling(step, shape, *args, **kwargs):
        if shape not in step.shapes:
            clock.now += 10.0
        return first_call(step, shape, *args, **kwargs)

    monkeypatch.setattr(CompiledStep, "_run", compiling)
    target = (tiny_llama(sp_tokenizer, seed=11), sp_tokenizer)
    draft = (tiny_neox(bpe_tokenizer, seed=12), bpe_tokenizer)
    spec = XTokSpec(target, draft, config=SpecConfig(compile=True, adaptive=False, num_draft_tokens=3))
    result = spec.generate(PROMPTS[1], max_new_tokens=24)  # a fixed K: its few shapes are soon all compiled
    assert result.token_ids == target_ids(target, PROMPTS[1], 24)
    assert clock.now >= 30.0 and result.stats.target_forwards > 5  # shapes were compiled during the generation
    (drafting, draft_length), = spec.kept.learned.values()
    assert drafting.cycles > 0 and drafting.seconds == 0.0
    assert draft_length.draft_step == 0.0 and draft_length.verify_cost.sums[3] == 0.0  # verification seconds


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
        caches.append([spec.kept.idle_kv[id(model)][0] for model in (spec.target_model, spec.draft_model)])
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
    from xtokspec.runtime.compile import CompiledStep

    model = tiny_llama(sp_tokenizer, seed=5)
    step = CompiledStep(model, "target")
    check_move_off_the_first_branch(model, step)
    torch._dynamo.reset()


def check_move_off_the_first_branch(model, step) -> None:
    """A tree verified through `step`, its accepted path (nodes 2 -> 3 -> 4: positions 1-3 past the prompt) moved
    into place by keep_path, then one more forward: the cache holds exactly the committed ids (the logits equal a
    plain forward's), and the move ran as a 3-position step padded to 4."""
    from xtokspec.runtime.cache import ModelState

    prompt = list(range(30, 50))
    with torch.inference_mode():
        state = ModelState(model, prompt, "static", 64, step, tree_nodes=16)
        state.forward(keep=1)
        tokens, parents = [0, 5, 6, 7, 8, 9], [-1, 0, 0, 2, 3, 1]
        state.forward_tree(tokens, parents)
        state.keep_path([2, 3, 4], tokens)
        assert state.ids == prompt + [6, 7, 8] and state.cached == len(state.ids)
        state.ids.append(11)
        got = state.forward(keep=1)[0]
        want = model(input_ids=torch.tensor([state.ids])).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (4, state.kv.capacity, "move") in step.shapes


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
    from xtokspec.runtime.cache import ModelState
    from xtokspec.runtime.compile import CompiledStep

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
    assert 2 <= len(spec.kept.tree_size_times) and set(spec.kept.tree_size_times) <= {0, 1, 3, 7, 15, 31}, spec.kept.tree_size_times


def test_a_reused_buffer_starts_empty_even_after_a_forward_that_raised(sp_tokenizer):
    """A generation that raised inside a forward can leave some layers' write positions ahead of the length the
    cache believes in; the next generation that takes the buffer over must still write from position 0."""
    from xtokspec.runtime.cache import ModelState

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


# ---------------------------------------------------------------- CUDA graphs: the choice of path


@pytest.mark.parametrize("value", ["auto", "graphs", "inductor", True, False])
def test_compile_takes_its_choices(value):
    assert SpecConfig(compile=value).compile is value or SpecConfig(compile=value).compile == value
    assert SpecConfig().compile == "auto"  # the default


@pytest.mark.parametrize("value", ["yes", "cuda-graphs", 1, 0, None, "Graphs"])
def test_compile_refuses_other_values_naming_the_choices(value):
    with pytest.raises(XTokSpecError, match=r"compile must be 'auto' .*'graphs', 'inductor' .*False"):
        SpecConfig(compile=value)


def test_graphs_and_inductor_need_the_static_cache_auto_does_not():
    for value in ("graphs", "inductor", True):
        with pytest.raises(XTokSpecError, match=f"compile={value!r} needs the static cache"):
            SpecConfig(compile=value, cache="dynamic")
    assert SpecConfig(compile="auto", cache="dynamic").cache == "dynamic"  # eager with the cache asked for


@pytest.fixture
def on_cuda(monkeypatch):
    """The choice of path as for a model on a CUDA device: where compile.py looks for the model's device. Nothing
    runs on it (GraphedStep's constructor touches no device; no capture happens in these tests)."""
    import xtokspec.runtime.compile

    monkeypatch.setattr(xtokspec.runtime.compile, "input_device", lambda model: torch.device("cuda", 0))


def _no_warnings():
    context = warnings.catch_warnings()
    context.__enter__()
    warnings.simplefilter("error")
    return context


def test_the_path_each_option_takes_on_the_cpu(tiny_target, eager_compile):
    model = tiny_target[0]
    context = _no_warnings()
    try:
        assert choose_step(model, "auto") is None  # the CPU: eager, without a word
        assert choose_step(model, False) is None
        assert isinstance(choose_step(model, True), CompiledStep)
        assert isinstance(choose_step(model, "inductor"), CompiledStep)
    finally:
        context.__exit__(None, None, None)
    with pytest.warns(UserWarning, match="the draft's steps run eagerly, without CUDA graphs: its inputs are on cpu, "
                                         "not a CUDA device"):
        assert choose_step(model, "graphs", role="draft") is None


def test_the_path_each_option_takes_on_cuda(tiny_target, on_cuda, eager_compile):
    model = tiny_target[0]
    context = _no_warnings()
    try:
        assert isinstance(choose_step(model, "auto", role="target"), GraphedStep)
        assert isinstance(choose_step(model, "graphs", "static"), GraphedStep)
        assert isinstance(choose_step(model, True), CompiledStep)
        assert choose_step(model, False) is None
        assert choose_step(model, "auto", "dynamic") is None  # the dynamic cache asked for: eager, quietly
    finally:
        context.__exit__(None, None, None)


@pytest.mark.parametrize("compile", ["auto", "graphs"])
def test_models_that_cannot_be_captured_run_eagerly_with_a_warning_naming_why(compile, tiny_target, on_cuda):
    model = tiny_target[0]
    saved = dict(model.config.__dict__)
    try:
        model.config.sliding_window, model.config.use_sliding_window = 4, True
        with pytest.warns(UserWarning, match=r"the target's steps run eagerly, without CUDA graphs: it has "
                                             r"\['sliding_attention'\] layers"):
            assert choose_step(model, compile, role="target") is None
        model.config.__dict__.clear()
        model.config.__dict__.update(saved)
        model.config._attn_implementation = "flash_attention_2"
        with pytest.warns(UserWarning, match="its attention 'flash_attention_2' does not take the step's explicit mask"):
            assert choose_step(model, compile, role="target") is None
    finally:
        model.config.__dict__.clear()
        model.config.__dict__.update(saved)


def test_the_default_on_the_cpu_is_todays_eager_dynamic_path(tiny_target, bpe_tokenizer):
    """"auto" on the CPU changes nothing: the dynamic cache, eager forwards, nothing recorded or compiled."""
    context = _no_warnings()
    try:
        spec = XTokSpec(tiny_target, (tiny_neox(bpe_tokenizer), bpe_tokenizer))
        result = spec.generate(PROMPTS[0], max_new_tokens=12)
        assert spec.warmup(PROMPTS[0], max_new_tokens=12) == 0
    finally:
        context.__exit__(None, None, None)
    assert result.stats.cache == "dynamic/dynamic" and result.stats.capture_seconds == 0
    assert result.token_ids == target_ids(tiny_target, PROMPTS[0], 12)
    assert spec.kept.steps == {id(spec.target_model): None, id(spec.draft_model): None} and spec.capture_seconds == 0


def test_graphs_asked_for_on_the_cpu_warn_and_run_eagerly(tiny_target, bpe_tokenizer):
    spec = XTokSpec(tiny_target, (tiny_neox(bpe_tokenizer), bpe_tokenizer), config=SpecConfig(compile="graphs"))
    with pytest.warns(UserWarning, match="steps run eagerly, without CUDA graphs: its inputs are on cpu"):
        result = spec.generate(PROMPTS[1], max_new_tokens=12)
    assert result.stats.cache == "dynamic/dynamic"  # as compile=False (and "auto") have it on the CPU
    assert result.token_ids == target_ids(tiny_target, PROMPTS[1], 12)


def test_cli_compile_words():
    from xtokspec.cli.main import build_parser

    parser = build_parser()
    parsed = {word: parser.parse_args(["generate", "東京", "--compile", word]).compile
              for word in ("auto", "graphs", "inductor", "off")}
    assert parsed == {"auto": "auto", "graphs": "graphs", "inductor": "inductor", "off": False}
    assert parsed["off"] is False
    assert parser.parse_args(["generate", "東京"]).compile == "auto"
    assert parser.parse_args(["generate", "東京", "--compile"]).compile is True  # bare: torch.compile, as before
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "東京", "--compile", "cuda"])


# ---------------------------------------------------------------- CUDA graphs: what a graph is fed, on the CPU


@pytest.fixture
def uncaptured(monkeypatch, caplog):
    """GraphedStep on the CPU with its recorder replaced by one that captures nothing: each "replay" runs the
    forward eagerly over the graph's input buffers. Everything around the capture runs as on CUDA (which model
    gets a step, the input buffers and their copies, the in-graph causal mask and positions, graphs keyed by
    cache and shape, the move's indices, the log lines); the capture and replay themselves are tests/test_gpu.py's."""
    import xtokspec.runtime.compile

    recorded = []

    def record(step, run, restore):
        recorded.append(step.role)
        return run

    monkeypatch.setattr(xtokspec.runtime.compile, "graphs_blocker", lambda model, cache="auto": None)
    monkeypatch.setattr(GraphedStep, "_record", record)
    caplog.set_level(logging.INFO, logger="xtokspec")
    return recorded


@pytest.mark.parametrize("tree_width", [1, 3])
def test_graphed_steps_are_lossless_and_reused_across_prompts(tree_width, uncaptured, sp_tokenizer, bpe_tokenizer,
                                                               caplog):
    target = (tiny_llama(sp_tokenizer, seed=11), sp_tokenizer)
    draft = (tiny_neox(bpe_tokenizer, seed=12), bpe_tokenizer)
    spec = XTokSpec(target, draft, config=SpecConfig(compile="graphs", adaptive=False, num_draft_tokens=3,
                                                     tree_width=tree_width))
    shapes = spec.warmup(max(PROMPTS, key=len), max_new_tokens=24, progress=False)
    steps = [spec.kept.steps[id(model)] for model in (spec.target_model, spec.draft_model)]
    assert all(isinstance(step, GraphedStep) for step in steps)
    graphs = {id(step): dict(step.graphs) for step in steps}
    assert len(uncaptured) == sum(len(g) for g in graphs.values()) == shapes  # one recording per shape
    assert any("warmup: " in r.getMessage() and " ready in " in r.getMessage() for r in caplog.records)
    assert spec.capture_seconds > 0
    caplog.clear()
    for prompt in PROMPTS:
        result = spec.generate(prompt, max_new_tokens=24)
        assert result.token_ids == target_ids(target, prompt, 24), prompt
        assert result.stats.cache == "static/static+graphs" and result.stats.capture_seconds == 0
    # the same graphs, with the same input buffers, served every prompt: nothing recorded after the warm-up
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("capturing ")]
    assert len(uncaptured) == shapes
    for step in steps:
        assert step.graphs.keys() == graphs[id(step)].keys()
        assert all(step.graphs[key][0] is graphs[id(step)][key][0] for key in step.graphs)
    if tree_width > 1:
        assert any(shape[2] == "move" for shape in steps[0].shapes)  # keep_path's moves went through the step
        assert any(shape[2] is True for shape in steps[1].shapes)  # the draft's beam levels too


def test_a_larger_cache_gets_its_own_graphs_and_old_ones_are_let_go(uncaptured, sp_tokenizer):
    """A graph writes into the buffers it was recorded with: a cache too small for a generation is replaced by a
    larger one, which gets graphs of its own (keyed by the cache); past two caches the oldest one's graphs are
    dropped, and with them their hold on its buffers. A cache taken over by the next generation keeps its graphs."""
    from xtokspec.runtime.cache import ModelState

    model = tiny_llama(sp_tokenizer, seed=3, max_positions=2048)
    step = GraphedStep(model, "target")
    kv = None
    with torch.inference_mode():
        for capacity in (64, 64, 300, 600):  # buffers of 256 (twice: taken over), 384 and 768 positions
            state = ModelState(model, [5, 6, 7], "static", capacity, step, reuse=kv)
            state.forward(keep=1)
            state.ids.append(8)
            state.forward(keep=1)
            kv = state.kv
            assert step.caches[-1] == kv.cache.layers[0].keys.data_ptr()
    assert len(uncaptured) == 3 and len(step.caches) == GraphedStep.KEPT_CACHES == 2
    assert {key[0] for key in step.graphs} == set(step.caches) and len(step.graphs) == 2


def test_a_failed_capture_runs_eagerly_with_a_warning(monkeypatch, sp_tokenizer, bpe_tokenizer):
    import xtokspec.runtime.compile

    def refuse(step, run, restore):
        raise GraphCaptureError("operation not permitted when stream is capturing")

    monkeypatch.setattr(xtokspec.runtime.compile, "graphs_blocker", lambda model, cache="auto": None)
    monkeypatch.setattr(GraphedStep, "_record", refuse)
    target = (tiny_llama(sp_tokenizer, seed=11), sp_tokenizer)
    spec = XTokSpec(target, (tiny_neox(bpe_tokenizer, seed=12), bpe_tokenizer), config=SpecConfig(compile="graphs"))
    with pytest.warns(UserWarning, match="steps run eagerly from now on, without CUDA graphs: recording the .* failed: "
                                         "operation not permitted when stream is capturing"):
        result = spec.generate(PROMPTS[2], max_new_tokens=16)
    assert result.token_ids == target_ids(target, PROMPTS[2], 16)
    assert all(spec.kept.steps[id(m)].eager_reason for m in (spec.target_model, spec.draft_model))
    assert all(not spec.kept.steps[id(m)].graphs for m in (spec.target_model, spec.draft_model))


def test_a_chain_steps_mask_and_positions_come_from_the_caches_length(uncaptured, sp_tokenizer):
    """A graph cannot take the cache's length from the host: a chain step's causal mask and positions are made
    on the device from the cache's own length tensor, so one recorded step serves every position."""
    from xtokspec.runtime.cache import ModelState

    model = tiny_llama(sp_tokenizer, seed=3)
    step = GraphedStep(model, "target")
    with torch.inference_mode():
        state = ModelState(model, [5, 6, 7], "static", 64, step)
        state.forward(keep=1)  # the prefill: eager
        got = []
        for new in ([8, 9, 10], [11], [12, 13, 14]):  # buckets 4, 1, 4: the 4-id graph serves two positions
            state.ids.extend(new)
            got.append(state.forward(keep=len(new)))
        eager = model(input_ids=torch.tensor([state.ids])).logits[0]
    torch.testing.assert_close(torch.cat(got), eager[3:], rtol=1e-4, atol=1e-4)
    assert sorted(shape[0] for shape in step.shapes) == [1, 4] and len(uncaptured) == 2


@pytest.mark.parametrize("tree_width", [1, 3])
def test_warm_up_forwards_before_a_capture_leave_the_cache_as_they_found_it(tree_width, monkeypatch, sp_tokenizer,
                                                                             bpe_tokenizer):
    """On CUDA a shape's first call runs its forward WARMUP_CALLS times before the capture (which runs nothing),
    then replays: the warm-ups write the cache and move its length, which must be put back, and a move's
    warm-ups must move nothing (a move run twice is not one move). A recorder that runs the warm-ups as the CUDA
    one does, then replays eagerly: the output is still the target's own."""
    import xtokspec.runtime.compile

    def record(step, run, restore):
        for _ in range(step.WARMUP_CALLS):
            run()
            restore()
        return run

    monkeypatch.setattr(xtokspec.runtime.compile, "graphs_blocker", lambda model, cache="auto": None)
    monkeypatch.setattr(GraphedStep, "_record", record)
    target = (tiny_llama(sp_tokenizer, seed=11), sp_tokenizer)
    draft = (tiny_neox(bpe_tokenizer, seed=12), bpe_tokenizer)
    spec = XTokSpec(target, draft, config=SpecConfig(compile="graphs", adaptive=False, num_draft_tokens=3,
                                                     tree_width=tree_width))
    for prompt in PROMPTS:  # no warmup(): every shape is first met inside a generation
        assert spec.generate(prompt, max_new_tokens=24).token_ids == target_ids(target, prompt, 24), prompt
    # keep_path's move of an accepted path off the first branch, at its first call (warm-ups, then the replay)
    check_move_off_the_first_branch(target[0], GraphedStep(target[0], "target"))
