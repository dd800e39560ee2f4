"""Long contexts: a draft whose context is shorter than the text keeps drafting from a window of the most recent
text (SpecConfig.draft_context, or the draft model's own position limit), and the fixtures run up to the target's
512 positions. Greedy output is the target's own throughout (the draft only proposes)."""

from __future__ import annotations

import copy

import pytest
from model_helpers import FIXTURES
from test_greedy import check_prompts

from xtokspec import SpecConfig, XTokSpec, XTokSpecError

WINDOW = 64  # draft tokens


@pytest.fixture(scope="module")
def heldout_text() -> str:
    return (FIXTURES / "data" / "heldout.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def long_prompts(heldout_text) -> list[str]:
    """Held-out text of ~100 target tokens, ~90 draft tokens (longer than the draft's window before any output),
    which the fixture target continues past 96 tokens without an EOS."""
    return [heldout_text[1000:1250], heldout_text[2000:2250]]


@pytest.mark.parametrize("draft", ["bpe", "same"])
def test_a_draft_window_keeps_drafting_past_it(draft, ja_target, ja_draft_bpe, ja_draft_same, long_prompts):
    small = ja_draft_bpe if draft == "bpe" else ja_draft_same
    spec = XTokSpec(ja_target, small, config=SpecConfig(draft_context=WINDOW, adaptive=False, num_draft_tokens=4))
    for line in check_prompts(spec, ja_target, long_prompts, 96, {}):
        print("near-tie:", line)
    result = spec.generate(long_prompts[0], max_new_tokens=96)
    stats = result.stats
    assert result.stop_reason == "length" and len(stats.proposal_lengths) > 10
    later = stats.accepted_lengths[len(stats.accepted_lengths) // 2 :]
    assert all(n > 0 for n in stats.proposal_lengths[:-1]), stats.proposal_lengths  # drafting never stopped
    assert sum(later) > 0, stats.accepted_lengths  # and its windowed proposals are accepted


def test_a_draft_with_fewer_positions_than_the_prompt(ja_target, ja_draft_bpe, long_prompts):
    """The draft model's own limit (here 64 positions) is a window too: the prompt is longer than the draft can
    hold, and the draft drafts from its most recent text."""
    model = copy.deepcopy(ja_draft_bpe[0])
    model.config.max_position_embeddings = WINDOW
    spec = XTokSpec(ja_target, (model, ja_draft_bpe[1]), config=SpecConfig(adaptive=False, num_draft_tokens=4))
    for line in check_prompts(spec, ja_target, long_prompts[:1], 64, {}):
        print("near-tie:", line)
    result = spec.generate(long_prompts[0], max_new_tokens=64)
    stats = result.stats
    assert result.stop_reason == "length" and len(stats.proposal_lengths) > 10
    assert stats.accepted > 0 and all(n > 0 for n in stats.proposal_lengths[:-1])


def test_the_fixtures_run_up_to_the_targets_context(ja_target, bridged_spec, heldout_text):
    """A prompt and output that fill the target's 512 positions: greedy equal to its own generate to the last
    position, stopping with reason "context"; a prompt at the limit is refused by name."""
    ids = bridged_spec.target.encode_prompt(heldout_text[:3000])
    assert len(ids) > 520
    prompt = bridged_spec.target_tokenizer.decode(ids[1:470])  # ~470 target tokens: 40 or so to go
    n = 512 - len(bridged_spec.target.encode_prompt(prompt))
    for line in check_prompts(bridged_spec, ja_target, [prompt], n, {}):
        print("near-tie:", line)
    result = bridged_spec.generate(prompt, max_new_tokens=n + 20)
    assert result.stop_reason in ("context", "eos"), result.stop_reason
    with pytest.raises(XTokSpecError, match="target's context is 512 positions"):
        bridged_spec.generate(bridged_spec.target_tokenizer.decode(ids[1:600]), max_new_tokens=4)


def test_draft_context_is_checked():
    with pytest.raises(XTokSpecError, match="draft_context must be None or an integer >= 4 \\* max_draft_tokens"):
        SpecConfig(draft_context=8)
    with pytest.raises(XTokSpecError, match="draft_context"):
        SpecConfig(draft_context=True)


@pytest.mark.fallback
def test_the_first_text_comes_before_the_draft_prefills(ja_target, ja_draft_bpe, long_prompts, monkeypatch):
    """With the default settings the first cycle runs the target alone: `stream` yields the target's first token
    before the draft has run a single forward (its prefill comes with the next cycle). With the fallback off the
    first cycle drafts, as before."""
    events = []
    forward = ja_draft_bpe[0].forward

    def recording(*args, **kwargs):
        events.append("draft forward")
        return forward(*args, **kwargs)

    monkeypatch.setattr(ja_draft_bpe[0], "forward", recording)
    spec = XTokSpec(ja_target, ja_draft_bpe)
    stream = spec.stream(long_prompts[0], max_new_tokens=16)
    events.append(next(stream))
    assert events[0] != "draft forward", events  # the first text came first
    rest = list(stream)
    assert "draft forward" in events[1:] or not rest
    events.clear()
    off = XTokSpec(ja_target, ja_draft_bpe, config=SpecConfig(fallback=False))
    events.append(next(off.stream(long_prompts[0], max_new_tokens=16)))
    assert events[0] == "draft forward"
