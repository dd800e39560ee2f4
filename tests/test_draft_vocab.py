"""The trimmed draft output head (XTokSpec.trim_draft_vocab, xtokspec.runtime.vocab.trimmed_draft): the view computes
the kept ids' logits exactly as the full head does and -inf elsewhere, leaves the user's model as it was, keeps
what it promises to keep, refuses what it cannot trim, and stays lossless (greedy here; sampling in
tests/test_stats.py)."""

from __future__ import annotations

import pytest
import torch
from test_greedy import NEW_TOKENS, check_prompts

from xtokspec.types import XTokSpecError

TRIM_SIZE = 1024  # of the fixture draft's 8192 ids: small enough that the trimmed head changes the draft's guesses


@pytest.fixture(scope="module")
def trimmed_spec(ja_target, ja_draft_bpe, heldout_prompts):
    from xtokspec import XTokSpec

    spec = XTokSpec(ja_target, ja_draft_bpe)
    # NOTE: calibration text disjoint from the prompts checked below
    spec.trim_draft_vocab(heldout_prompts[32:], TRIM_SIZE)
    return spec


def test_trimmed_head_equals_the_full_head_on_kept_ids(ja_draft_bpe):
    from xtokspec.runtime.vocab import trimmed_draft

    model, tokenizer = ja_draft_bpe
    keep = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:500].sort().values
    view = trimmed_draft(model, keep)
    ids = torch.tensor([tokenizer("指定されたデバイス上に作成する。")["input_ids"]])  # (1, T)
    with torch.inference_mode():
        full = model(input_ids=ids).logits  # (1, T, V)
        trimmed = view(input_ids=ids).logits
        last = view(input_ids=ids, logits_to_keep=1).logits  # the strided (1, 1, H) slice of the hidden states
    assert trimmed.shape == full.shape and last.shape == (1, 1, full.shape[-1])
    torch.testing.assert_close(trimmed[..., keep], full[..., keep])
    torch.testing.assert_close(last[0, -1], trimmed[0, -1])
    dropped = torch.ones(full.shape[-1], dtype=torch.bool)
    dropped[keep] = False
    assert torch.isneginf(trimmed[..., dropped]).all()
    # the user's model is untouched: its own head, its own full logits
    assert not isinstance(model.get_output_embeddings(), type(view.get_output_embeddings()))
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, full, rtol=0, atol=0)


def test_int8_linears_quantize_a_trimmed_draft_and_keep_its_dropped_ids_out(ja_draft_bpe):
    """`int8_linears` converts every linear of a float32 draft, a trimmed head's too: its logits stay within a few
    percent of the float ones on kept ids (its greedy choice the same here), dropped ids stay -inf; a bfloat16
    draft is refused by name."""
    from transformers import AutoModelForCausalLM

    from xtokspec.runtime.models import fixture_model, int8_linears
    from xtokspec.runtime.vocab import trimmed_draft

    _, tokenizer = ja_draft_bpe
    model = AutoModelForCausalLM.from_pretrained(fixture_model("ja-draft-bpe"), dtype=torch.float32).eval()
    keep = torch.arange(0, model.config.vocab_size, 3)
    view = trimmed_draft(model, keep)
    ids = torch.tensor([tokenizer("指定されたデバイス上に作成する。")["input_ids"]])
    with torch.inference_mode():
        before = view(input_ids=ids).logits
    linears = sum(type(m) is torch.nn.Linear for m in view.modules())
    assert int8_linears(view) == linears + 1  # and the trimmed head
    assert not any(type(m) is torch.nn.Linear for m in view.modules())
    with torch.inference_mode():
        after = view(input_ids=ids).logits
    dropped = torch.ones(after.shape[-1], dtype=torch.bool)
    dropped[keep] = False
    assert torch.isneginf(after[..., dropped]).all() and torch.isfinite(after[..., keep]).all()
    error = (after[..., keep] - before[..., keep]).abs().max() / before[..., keep].abs().max()
    assert 0 < error < 0.1, error
    assert torch.equal(after.argmax(-1), before.argmax(-1))
    bf16 = AutoModelForCausalLM.from_pretrained(fixture_model("ja-draft-bpe"), dtype=torch.bfloat16)
    with pytest.raises(XTokSpecError, match="float32 draft on the CPU"):
        int8_linears(bf16)


def test_choose_draft_vocab_keeps_eos_bytes_and_the_most_frequent_ids(bridged_spec):
    from model_helpers import FIXTURES

    from xtokspec.runtime.vocab import choose_draft_vocab

    codec = bridged_spec.draft
    always = bridged_spec.draft_eos
    texts = (FIXTURES / "data" / "heldout.txt").read_text(encoding="utf-8").splitlines()[:300]
    vocab = choose_draft_vocab(codec, texts, 600, always)
    keep = vocab.keep.tolist()
    assert len(keep) == 600 and keep == sorted(set(keep)) and vocab.vocab_size == codec.vocab_size
    assert always <= set(keep)
    assert all(i in keep for i, b in enumerate(codec.token_bytes) if len(b) == 1)
    counts: dict[int, int] = {}
    for ids in codec.tokenizer(texts, add_special_tokens=False)["input_ids"]:
        for i in ids:
            counts[i] = counts.get(i, 0) + 1
    # every id more frequent than the most frequent one left out is kept
    left_out = max((c for i, c in counts.items() if i not in keep), default=0)
    assert all(i in keep for i, c in counts.items() if c > left_out)
    assert vocab.calibration_tokens == sum(counts.values()) and vocab.calibration_distinct == len(counts)
    assert 0 < vocab.calibration_covered < 1
    assert "600 of 8192 ids" in vocab.describe()


@pytest.mark.parametrize(
    ("texts", "size", "message"),
    [
        ([], 600, "calibration text"),
        (None, 600, "calibration text"),
        (["テキスト"], 0, "positive integer"),
        (["テキスト"], True, "positive integer"),
        (["テキスト"], 10, "below the"),
    ],
)
def test_choose_draft_vocab_refuses_bad_input(bridged_spec, texts, size, message):
    from xtokspec.runtime.vocab import choose_draft_vocab

    with pytest.raises(XTokSpecError, match=message):
        choose_draft_vocab(bridged_spec.draft, texts, size, bridged_spec.draft_eos)


def test_trimmed_draft_refuses_post_processed_logits(sp_tokenizer):
    """-inf under soft-capping would become a finite logit: such a draft is refused by name."""
    from model_helpers import tiny_llama

    from xtokspec.runtime.vocab import trimmed_draft

    model = tiny_llama(sp_tokenizer)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(XTokSpecError, match="final_logit_softcapping"):
        trimmed_draft(model, torch.arange(10))
    model.config.final_logit_softcapping = None
    head = model.lm_head
    model.lm_head = torch.nn.Sequential(head)  # not a plain Linear head
    with pytest.raises(XTokSpecError, match="no plain output head"):
        trimmed_draft(model, torch.arange(10))


def test_trim_and_restore(ja_target, ja_draft_bpe, heldout_prompts):
    from xtokspec import XTokSpec

    spec = XTokSpec(ja_target, ja_draft_bpe)
    full = spec.draft_model
    vocab = spec.trim_draft_vocab(heldout_prompts[:40], 2000)
    assert spec.draft_model is not full and spec.draft_vocab is vocab
    assert "[head: 2000 of 8192 ids]" in spec.describe()
    assert spec.trim_draft_vocab(heldout_prompts[:40], 3000).keep.numel() == 3000  # re-trims from the full head
    trimmed = spec.draft_model
    with pytest.raises(XTokSpecError, match="below the"):
        spec.trim_draft_vocab(heldout_prompts[:40], 10)
    assert spec.draft_model is trimmed and spec.draft_vocab.keep.numel() == 3000  # bad input changed nothing
    assert spec.trim_draft_vocab(None) is None
    assert spec.draft_model is full and spec.draft_vocab is None and "[head" not in spec.describe()


@pytest.mark.slow
@pytest.mark.parametrize("tree_width", [1, 4])
def test_trimmed_draft_greedy_equals_target(tree_width, trimmed_spec, ja_target, heldout_prompts, record_property):
    """Greedy losslessness with a draft that only guesses among 1,024 ids (float32: any divergence beyond
    float noise fails), for the chain and a token tree."""
    from xtokspec import SpecConfig, XTokSpec

    spec = trimmed_spec
    if tree_width > 1:
        spec = XTokSpec(ja_target, (trimmed_spec.draft_model, trimmed_spec.draft_tokenizer),
                        config=SpecConfig(tree_width=tree_width))
    near_ties = check_prompts(spec, ja_target, heldout_prompts[:16], NEW_TOKENS, {})
    record_property("near_ties", near_ties)
    stats = [spec.generate(p, max_new_tokens=NEW_TOKENS).stats for p in heldout_prompts[:4]]
    # the trimmed draft is still used (a draft that never matches would pass the equality above)
    assert sum(s.new_tokens for s in stats) / sum(s.target_forwards for s in stats) > 1.1


def test_a_frozen_bf16_head_on_the_cpu_is_warned_about(ja_draft_bpe, monkeypatch):
    """torch 2.13's CPU bf16 linear is ~20x slower for a head weight that does not require grad
    (benchmarks/torch_linear_strided.py): XTokSpec says so, naming the model; an unfrozen one is not warned about."""
    import copy
    import warnings

    from model_helpers import load_fixture_model

    import xtokspec.runtime.models
    from xtokspec import XTokSpec

    monkeypatch.setattr(xtokspec.runtime.models, "cpu_has_bf16_matmul", lambda: True)  # only the frozen head's warning

    model, tokenizer = load_fixture_model("ja-target")
    model = model.to(torch.bfloat16)
    draft = (copy.deepcopy(ja_draft_bpe[0]), ja_draft_bpe[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        XTokSpec((model, tokenizer), draft)  # as loaded: weights require grad
    model.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"target \(large\): the output head's weight does not require grad"):
        XTokSpec((model, tokenizer), draft)


def test_a_bf16_target_on_a_cpu_without_bf16_units_is_warned_about(ja_draft_bpe, monkeypatch):
    """Without AVX512-BF16 or AMX a bfloat16 forward over n tokens costs ~n one-token steps (BENCHMARKS.md,
    "Where verification cannot pay"), so verification cannot pay: XTokSpec says so. A float32 target, or a
    CPU with the units, gets no such warning."""
    import copy
    import warnings

    from model_helpers import load_fixture_model

    import xtokspec.runtime.models
    from xtokspec import XTokSpec

    model, tokenizer = load_fixture_model("ja-target")
    if model.device.type != "cpu":
        pytest.skip("a CPU case (XTOKSPEC_TEST_DEVICE is set)")
    draft = (copy.deepcopy(ja_draft_bpe[0]), ja_draft_bpe[1])
    monkeypatch.setattr(xtokspec.runtime.models, "cpu_has_bf16_matmul", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        XTokSpec((model, tokenizer), draft)  # float32
    model = model.to(torch.bfloat16)
    with pytest.warns(UserWarning, match=r"the target \(large\) 'ja-target' runs in bfloat16 on a CPU without "
                      r"AVX512-BF16 or AMX, so drafting cannot beat the target alone: use a GPU") as caught:
        XTokSpec((model, tokenizer), draft)
    (note,) = [str(w.message) for w in caught if "bfloat16" in str(w.message)]
    assert len(note) < 200 and "\n" not in note and "docs/how-it-works.md" in note, note
    monkeypatch.setattr(xtokspec.runtime.models, "cpu_has_bf16_matmul", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        XTokSpec((model, tokenizer), draft)
