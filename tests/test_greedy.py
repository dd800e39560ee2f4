"""Greedy losslessness: XTokSpec's ids equal the target's own `generate`, token for token (CPU; float32, and
bfloat16 as the default load gives).

A divergence fails unless it is a floating-point near-tie: the target's top-two logits at the first
differing position are closer than NEAR_TIE (the verifier scores K+1 positions in one call, `generate`
one at a time, so the last bits of the logits may differ). Near-ties are reported with their margin.
"""

from __future__ import annotations

import pytest
import torch

NEW_TOKENS = 48
NEAR_TIE = 1e-4  # logit units; float32 noise between batched and one-at-a-time forwards is ~1e-6
BF16_PROMPTS = 24  # held-out prompts checked with the default (bfloat16) load

HOSTILE_PROMPTS = [
    "𠮷野家の牛丼",  # rare CJK: byte fallback in ja-sp
    "𩸽を焼く",
    "今日は😀です👨‍👩‍👧‍👦",  # emoji and a ZWJ sequence
    "ｶﾀｶﾅとﾊﾟﾝ",  # half-width kana (with a half-width voiced mark)
    "ＡＢＣとＸＹＺ１２３",  # full-width Latin and digits
    "か\u3099き\u3099く\u3099",  # combining voiced sound marks
    "def f(x):\n\treturn x  # 関数の定義",  # mixed Japanese / English / code
    "タブ\tと  空白   の\n\n改行",  # tabs, runs of spaces, newlines
    "あ",  # one character
    "a",
    "東京 Tokyo 2024年の設定ファイル",
]


def target_generate(model, tokenizer, prompt: str, n: int) -> list[int]:
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=n)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def logit_margin(model, tokenizer, prompt: str, prefix: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| of the target after prompt + prefix (one plain forward)."""
    ids = tokenizer(prompt)["input_ids"] + prefix
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    return abs(float(logits[a] - logits[b]))


def near_tie_bound(model, tokenizer, prompt: str, prefix: list[int], token: int) -> float:
    """The largest logit gap that floating-point noise explains: NEAR_TIE in float32; in a 16-bit dtype,
    2 units in the last place of the logit's magnitude (bfloat16: 2 * 2^-7 * |logit|)."""
    if model.dtype == torch.float32:
        return NEAR_TIE
    ids = tokenizer(prompt)["input_ids"] + prefix
    with torch.inference_mode():
        logit = float(model(input_ids=torch.tensor([ids])).logits[0, -1, token])
    return 2 * torch.finfo(model.dtype).eps * max(abs(logit), 1.0)


def check_prompts(spec, target, prompts: list[str], n: int, reference_cache: dict) -> list[str]:
    """Compare every prompt; -> near-tie reports. Fails on any divergence that is not a near-tie."""
    model, tokenizer = target
    near_ties, failures = [], []
    for prompt in prompts:
        key = (model, prompt, n)  # by identity; the key keeps the model alive, so no other can take its place
        if key not in reference_cache:
            reference_cache[key] = target_generate(model, tokenizer, prompt, n)
        want = reference_cache[key]
        got = spec.generate(prompt, max_new_tokens=n).token_ids
        if got == want:
            continue
        j = next((i for i, (x, y) in enumerate(zip(got, want, strict=False)) if x != y), min(len(got), len(want)))
        if j < min(len(got), len(want)):
            margin = logit_margin(model, tokenizer, prompt, want[:j], want[j], got[j])
            bound = near_tie_bound(model, tokenizer, prompt, want[:j], want[j])
            line = (f"{prompt!r}: first difference at token {j} ({want[j]} vs {got[j]}), logit margin {margin:.2e} "
                    f"({model.dtype}; near-tie bound {bound:.2e})")
            (near_ties if margin <= bound else failures).append(line)
        else:
            failures.append(f"{prompt!r}: lengths differ ({len(got)} vs {len(want)}) with equal prefix")
    assert not failures, "greedy output differs from the target's generate:\n" + "\n".join(failures)
    return near_ties


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["bridged", "same"])
def test_greedy_equals_target_on_heldout_prompts(draft, bridged_spec, same_spec, ja_target, heldout_prompts,
                                                 reference_cache, record_property):
    spec = bridged_spec if draft == "bridged" else same_spec
    near_ties = check_prompts(spec, ja_target, heldout_prompts, NEW_TOKENS, reference_cache)
    record_property("near_ties", near_ties)
    for line in near_ties:
        print("near-tie:", line)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["bridged", "same"])
def test_greedy_equals_target_on_hostile_text(draft, bridged_spec, same_spec, ja_target, reference_cache):
    spec = bridged_spec if draft == "bridged" else same_spec
    for line in check_prompts(spec, ja_target, HOSTILE_PROMPTS, NEW_TOKENS, reference_cache):
        print("near-tie:", line)


@pytest.mark.slow
def test_bridge_never_introduces_replacement_characters(bridged_spec, ja_target):
    """No U+FFFD that the target's own continuation does not have. (The v2 target itself emits byte-fallback
    runs that never complete a character after "𠮷野家の牛丼", e.g. <0xE7><0x97> repeated; xtokspec must
    reproduce them, not repair them.)"""
    model, tokenizer = ja_target
    for prompt in HOSTILE_PROMPTS:
        ours = bridged_spec.target_tokenizer.decode(bridged_spec.generate(prompt, max_new_tokens=24).token_ids)
        own = tokenizer.decode(target_generate(model, tokenizer, prompt, 24))
        assert ours.count("\ufffd") <= own.count("\ufffd"), (prompt, ours, own)


@pytest.mark.slow
def test_the_draft_is_actually_used(bridged_spec, same_spec, heldout_prompts):
    """Losslessness alone would pass with a draft that is always rejected: the fixture pair must accept."""
    for spec in (bridged_spec, same_spec):
        stats = [spec.generate(p, max_new_tokens=NEW_TOKENS).stats for p in heldout_prompts[:8]]
        tokens = sum(s.new_tokens for s in stats)
        calls = sum(s.target_forwards for s in stats)
        # NOTE: v2.1 fixtures measure 1.37 (bridged) and 1.55 (same-tokenizer) here; an unused draft gives 1.0
        assert tokens / calls > 1.25, f"{spec.draft_tokenizer.name_or_path}: {tokens / calls:.2f} tokens per target call"


@pytest.mark.slow
@pytest.mark.parametrize("healing", [True, False])
def test_greedy_equals_target_with_and_without_healing(healing, ja_target, ja_draft_bpe, heldout_prompts,
                                                        reference_cache):
    """Token healing (the draft chooses its last token again, among those starting with its text) changes what
    is drafted, never what is committed; it takes a longer token on 28% of the fixture pair's drafted cycles
    here, and never when it is off."""
    from xtokspec import SpecConfig, XTokSpec

    spec = XTokSpec(ja_target, ja_draft_bpe, config=SpecConfig(cache="dynamic", fallback=False, draft_healing=healing))
    for line in check_prompts(spec, ja_target, heldout_prompts[:8] + HOSTILE_PROMPTS, NEW_TOKENS, reference_cache):
        print("near-tie:", line)
    stats = [spec.generate(p, max_new_tokens=NEW_TOKENS).stats for p in heldout_prompts[:8]]
    healed = sum(s.healed_cycles for s in stats)
    drafted = sum(s.target_forwards - s.alone_cycles for s in stats)
    assert (healed > drafted / 10) if healing else healed == 0, (healed, drafted)


@pytest.mark.slow
def test_stream_yields_the_generated_text(bridged_spec):
    prompt = "自然言語処理とは何か"
    pieces = list(bridged_spec.stream(prompt, max_new_tokens=32))
    assert len(pieces) > 1
    assert "".join(pieces) == bridged_spec.generate(prompt, max_new_tokens=32).text


@pytest.mark.slow
def test_default_dtype_greedy_equals_target_loaded_the_same_way(heldout_prompts, record_property):
    """XTokSpec("ja-target", "ja-draft-bpe") loads bfloat16 (transformers' default for these checkpoints), as
    the CLI does: the reference is the target's own generate in bfloat16. At 16 bits the verifier's K+1-row
    forward and generate's one-row steps round differently, so near-ties (<= 2 ulps) are allowed and reported;
    the rest must be equal."""
    from xtokspec import XTokSpec

    spec = XTokSpec("ja-target", "ja-draft-bpe")
    assert spec.target_model.dtype == torch.bfloat16
    target = (spec.target_model, spec.target_tokenizer)
    near_ties = check_prompts(spec, target, heldout_prompts[:BF16_PROMPTS], NEW_TOKENS, {})
    record_property("near_ties", near_ties)
    for line in near_ties:
        print("near-tie:", line)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["bridged", "same"])
def test_static_cache_greedy_equals_target(draft, ja_target, ja_draft_bpe, ja_draft_same, heldout_prompts,
                                           reference_cache):
    """The static (preallocated) KV cache backend, whose rollback only moves a length, is lossless too."""
    from xtokspec import SpecConfig, XTokSpec

    spec = XTokSpec(ja_target, ja_draft_bpe if draft == "bridged" else ja_draft_same,
                    config=SpecConfig(cache="static", compile=False))  # eager on CUDA too (graphs: test_gpu.py)
    result = spec.generate(heldout_prompts[0], max_new_tokens=4)
    assert result.stats.cache == "static/static"
    for line in check_prompts(spec, ja_target, heldout_prompts[:24] + HOSTILE_PROMPTS, NEW_TOKENS, reference_cache):
        print("near-tie:", line)
