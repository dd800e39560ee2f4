"""The fallback to the target alone (SpecConfig.fallback): where drafting does not pay, cycles run the target
alone and drafting is probed now and then.

What must hold: the choice follows the measured seconds per token (policy units, with made-up timings); greedy
output stays the target's own whatever the pattern of drafted and target-alone cycles; after target-alone
cycles the draft's context is caught up to the committed text before it drafts again; and in the whole loop the
fallback engages where the draft is slow and stays off where drafting pays, on a simulated clock that only the
models' forwards advance (no test here depends on how fast the machine is). The sampled law with
target-alone cycles is checked in test_stats.py (D3).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from policies import alone as alone_cycle
from policies import drafted, scripted, simulated_clock

from xtokspec import SpecConfig, XTokSpec
from xtokspec.decode import loop
from xtokspec.decode.policy import Fallback
from xtokspec.text.codec import utf8_valid_prefix_len

pytestmark = pytest.mark.fallback

NEW_TOKENS = 40


def policy(first_alone: bool = False, **config) -> Fallback:
    return Fallback(SpecConfig(**config), first_alone=first_alone)


def drafted_cycles(p: Fallback, cycles: int, tokens: int, seconds: float) -> None:
    for _ in range(cycles):
        p.observe(drafted(3, 3, tokens - 1, seconds / 2, seconds / 2, committed=tokens))


def test_policy_runs_the_prompt_alone_then_drafts_then_measures_a_target_step():
    p = policy(first_alone=True)
    assert p.run_alone()  # the first cycle (the prompt's): the first token waits for no draft
    for _ in range(3):
        assert not p.run_alone()  # nothing measured: draft
        drafted_cycles(p, 1, 2, 0.030)
    assert p.run_alone()  # 3 drafted cycles measured, no target step yet: measure one


def alone_runs(p: Fallback, cycles: int, alone_s: float, tokens: int, drafted_s: float) -> list[int]:
    """Drive the policy with fixed costs -> the lengths of its runs of target-alone cycles."""
    pattern = ""
    for _ in range(cycles):
        alone = p.run_alone()
        pattern += "A" if alone else "D"
        if alone:
            p.observe(alone_cycle(alone_s))
        else:
            drafted_cycles(p, 1, tokens, drafted_s)
    return [len(run) for run in pattern.split("D")]


def test_policy_runs_the_target_alone_while_it_is_cheaper_per_token_and_probes_drafting_ever_more_rarely():
    p = policy()
    drafted_cycles(p, 3, 2, 0.030)  # 15 ms a token drafting, 10 ms alone: a probe costs 10 ms more than it commits
    # the first A measures a step; then runs of 2, 4, 8, 16, and at most 20 (a probe's extra 10 ms is 5% of 20
    # target-alone cycles)
    assert alone_runs(p, 80, 0.010, 2, 0.030) == [2, 4, 8, 16, 20, 20, 4]


def test_policy_probes_at_most_every_16_cycles_where_drafting_loses_a_little():
    p = policy()
    drafted_cycles(p, 3, 2, 0.021)  # 10.5 ms a token drafting: a probe costs 1 ms more than it commits
    assert alone_runs(p, 70, 0.010, 2, 0.021) == [2, 4, 8, 16, 16, 16, 2]


def test_policy_probes_rarely_where_a_drafted_cycle_costs_many_steps():
    p = policy()
    drafted_cycles(p, 3, 1, 0.100)  # a drafted cycle commits 1 token in 10 steps: 90 ms extra, 5% of 180 cycles
    assert alone_runs(p, 800, 0.010, 1, 0.100)[:9] == [2, 4, 8, 16, 32, 64, 128, 180, 180]


def test_policy_keeps_drafting_while_it_pays_and_measures_the_target_again_rarely():
    p = policy()
    drafted_cycles(p, 3, 3, 0.015)  # 5 ms a token drafting
    assert p.run_alone()
    p.observe(alone_cycle(0.010))  # 10 ms a token alone
    pattern = []
    for _ in range(2 * Fallback.PROBE_ALONE_EVERY + 2):
        alone = p.run_alone()
        pattern.append(alone)
        p.observe(alone_cycle(0.010)) if alone else drafted_cycles(p, 1, 3, 0.015)
    every = Fallback.PROBE_ALONE_EVERY
    assert [i for i, alone in enumerate(pattern) if alone] == [every, 2 * every + 1]


def test_policy_switches_back_when_a_probe_finds_drafting_cheaper_and_probes_early_again_later():
    p = policy()
    drafted_cycles(p, 3, 2, 0.030)
    pattern = ""
    for cycle in range(40):
        alone = p.run_alone()
        pattern += "A" if alone else "D"
        if alone:
            p.observe(alone_cycle(0.010))
        elif cycle < 8:  # the text got easy: drafted cycles commit 12 tokens in 30 ms, 2.5 ms a token
            drafted_cycles(p, 1, 12, 0.030)
        else:  # and hard again
            drafted_cycles(p, 1, 1, 0.030)
    assert pattern.startswith("AAD" + "DDDDD")  # one probe that wins is enough (the decayed sums follow it)
    assert "DAAD" in pattern[8:]  # once drafting loses again, the first run of target-alone cycles is 2 long


def test_a_later_generation_probes_only_once_the_alone_time_covers_the_drafts_prefill():
    """A generation that starts alone on the carried-over costs would feed the draft its whole context at its
    first probe: that probe waits for 1 / PROBE_BUDGET times the measured prefill of target-alone time."""
    first = policy(first_alone=True)
    assert first.run_alone()
    first.observe(drafted(3, 3, 0, 0.060, None))  # the draft's prefill: 60 ms of drafting (verify_s None: prefill)
    drafted_cycles(first, 3, 1, 0.030)  # 30 ms a token drafting, 10 ms alone
    assert first.drafting.prefill_seconds == pytest.approx(0.060)
    free = dataclasses.replace(first.drafting, prefill_seconds=0.0)  # the control: a prefill that costs nothing
    later = Fallback(SpecConfig(), first.alone_times.copy(), first.drafting)  # the next generation, same XTokSpec
    runs = alone_runs(later, 200, 0.010, 1, 0.030)
    # 5% of 120 target-alone cycles of 10 ms is the 60 ms prefill: no probe before
    assert runs[0] == 120 and len(runs) > 1
    control = Fallback(SpecConfig(), first.alone_times.copy(), free)
    assert alone_runs(control, 40, 0.010, 1, 0.030)[0] == Fallback.PROBE_DRAFT_FIRST  # the schedule as it was


@pytest.mark.parametrize("config", [dict(fallback=False), dict(adaptive=False)], ids=["fallback-off", "fixed-k"])
def test_policy_never_runs_alone_when_switched_off(config):
    p = policy(**config)
    drafted_cycles(p, 10, 1, 0.100)
    p.observe(alone_cycle(0.001))
    assert not p.run_alone()


def test_spec_config_checks_fallback():
    with pytest.raises(ValueError, match="fallback must be True or False"):
        SpecConfig(fallback="yes")


# ---------------------------------------------------------------- scripted patterns on the fixture models
def every_third_drafts(self) -> bool:
    """D A A D A A ...: after each drafted cycle, two target-alone ones (since_draft counts them)."""
    return self.cycles >= 1 and self.since_draft < 2


def alternate(self) -> bool:
    """D A D A ..."""
    return self.cycles >= 1 and self.since_draft < 1


PATTERNS = {"DAA": every_third_drafts, "DA": alternate}


def target_greedy(target, prompt: str, n: int) -> list[int]:
    model, tokenizer = target
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=n)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def check_caught_up(monkeypatch, spec: XTokSpec, prompt_len: list[int]) -> list[int]:
    """Wrap the drafted cycles' catch-up (loop.catch_up): after it the draft's context must be the committed text
    (same ids for one tokenizer; otherwise the same bytes, up to the last complete character). `prompt_len`:
    the current prompt's length in target ids, set by the caller. -> a list that counts the checks."""
    checked = []
    catch_up = loop.catch_up

    def checking(run):
        seconds = catch_up(run)
        target, draft = run.target, run.draft
        committed = spec.target.bytes_of(target.ids[prompt_len[0]:])
        if spec.same_vocab:
            assert draft.ids == target.ids
        else:
            context = spec.draft.bytes_of(draft.ids[run.mapper.current.draft_prompt_len:])
            assert context == committed[: utf8_valid_prefix_len(committed)]
        checked.append(len(target.ids))
        return seconds

    monkeypatch.setattr(loop, "catch_up", checking)
    return checked


@pytest.mark.slow
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("system", ["bridged", "same-tokenizer", "bridged-tree4"])
def test_interleaved_target_alone_cycles_decode_what_the_target_does(system, pattern, bridged_spec, same_spec,
                                                                      ja_target, heldout_prompts, monkeypatch):
    spec = same_spec if system == "same-tokenizer" else bridged_spec
    extra = {"tree_width": 4} if system.endswith("tree4") else {}
    monkeypatch.setattr(spec, "fallback_policy", scripted(PATTERNS[pattern]))
    prompt_len = [0]
    checked = check_caught_up(monkeypatch, spec, prompt_len)
    runs = {"DAA": 2, "DA": 1}[pattern]  # target-alone cycles after each drafted one
    accepted_after_alone = 0
    for prompt in heldout_prompts[:4]:
        prompt_len[0] = len(spec.target.encode_prompt(prompt))
        result = spec.generate(prompt, max_new_tokens=NEW_TOKENS, **extra)
        assert result.token_ids == target_greedy(ja_target, prompt, NEW_TOKENS), prompt
        stats = result.stats
        drafted = stats.target_forwards - stats.alone_cycles
        assert stats.alone_cycles >= runs * (drafted - 1) and stats.alone_cycles > 0  # the pattern ran
        assert sum(stats.proposal_cycles.values()) == stats.target_forwards == len(stats.proposal_lengths)
        accepted_after_alone += sum(a for n, a, before in zip(stats.proposal_lengths[1:], stats.accepted_lengths[1:],
                                                               stats.proposal_lengths[:-1], strict=True) if n and not before)
    assert checked  # drafted cycles were checked
    assert accepted_after_alone > 0  # drafts made after a catch-up were accepted: the draft followed the text


@pytest.mark.slow
def test_stream_matches_generate_with_target_alone_cycles(bridged_spec, heldout_prompts, monkeypatch):
    monkeypatch.setattr(bridged_spec, "fallback_policy", scripted(every_third_drafts))
    prompt = heldout_prompts[5]
    result = bridged_spec.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert "".join(bridged_spec.stream(prompt, max_new_tokens=NEW_TOKENS)) == result.text
    assert result.stats.alone_cycles > 0


# ---------------------------------------------------------------- a simulated clock
@pytest.fixture
def clock(monkeypatch):
    return simulated_clock(monkeypatch)


@pytest.mark.slow
def test_fallback_engages_where_the_draft_is_too_slow_to_pay(ja_target, ja_draft_bpe, heldout_prompts,
                                                             monkeypatch, clock):
    """A draft step that costs 40 ms against a target step's 7 ms (simulated): every drafted cycle costs more per
    token than a target step, so most cycles run the target alone, and the output is still the target's. A
    second generation with the same settings starts with the target alone."""
    spec = XTokSpec(ja_target, ja_draft_bpe)
    clock.costs(monkeypatch, ja_draft_bpe[0], 0.040)
    clock.costs(monkeypatch, ja_target[0], 0.007)
    prompt = heldout_prompts[1]
    stats = spec.generate(prompt, max_new_tokens=NEW_TOKENS).stats
    assert stats.alone_cycles >= stats.target_forwards / 2, stats.summary()
    again = spec.generate(prompt, max_new_tokens=NEW_TOKENS)  # the same settings: it starts where the first ended
    assert again.token_ids == target_greedy(ja_target, prompt, NEW_TOKENS)
    assert again.stats.proposal_lengths[0] == 0 and again.stats.alone_cycles > stats.alone_cycles, again.stats.summary()
    sampled = spec.generate(prompt, max_new_tokens=4, do_sample=True, seed=0)  # other settings: measured anew
    assert sampled.stats.proposal_lengths[0] == 0 and sampled.stats.proposal_lengths[1] > 0  # the prompt alone
    off = XTokSpec(ja_target, ja_draft_bpe, config=SpecConfig(fallback=False)).generate(prompt, max_new_tokens=8)
    assert off.stats.alone_cycles == 0


@pytest.mark.slow
def test_a_later_generation_drafts_as_many_tokens_as_earlier_ones_learned(ja_target, ja_draft_bpe, heldout_prompts,
                                                                          monkeypatch, clock):
    """A draft step that costs 8 ms against a target step's 10 ms (simulated): at this pair's acceptance one
    drafted token a cycle pays best, and the first generation moves there from the configured 4 once its first
    cycles are measured. A second generation with the same settings drafts one from its first cycle, where a
    fresh policy would spend its first cycles drafting 4 again; other settings start from the configured 4."""
    config = SpecConfig(fallback=False, num_draft_tokens=4)
    spec = XTokSpec(ja_target, ja_draft_bpe, config=config)
    clock.costs(monkeypatch, ja_draft_bpe[0], 0.008)
    clock.costs(monkeypatch, ja_target[0], 0.010)
    prompt = heldout_prompts[1]
    first = spec.generate(prompt, max_new_tokens=NEW_TOKENS).stats
    assert first.draft_lengths[0] == 4 and first.draft_lengths[-4:] == [1] * 4, first.draft_lengths
    again = spec.generate(heldout_prompts[2], max_new_tokens=NEW_TOKENS)
    assert again.token_ids == target_greedy(ja_target, heldout_prompts[2], NEW_TOKENS)
    assert again.stats.draft_lengths[:3] == [1, 1, 1], again.stats.draft_lengths
    other = spec.generate(prompt, max_new_tokens=8, num_draft_tokens=3).stats  # another setting: its own policy
    assert other.draft_lengths[0] == 3, other.draft_lengths


@pytest.mark.slow
def test_fallback_stays_off_where_drafting_pays(ja_target, ja_draft_same, heldout_prompts, monkeypatch, clock):
    """A target step that costs 60 ms whatever it verifies, a draft step 1 ms (simulated): a drafted cycle
    commits more than one token for little more than a step, so the target alone runs only for the prompt's
    cycle, as the measuring probe and at most one shortest run (the first drafted cycles of this prompt accept
    little)."""
    spec = XTokSpec(ja_target, ja_draft_same)
    clock.costs(monkeypatch, ja_target[0], 0.060)
    clock.costs(monkeypatch, ja_draft_same[0], 0.001)
    result = spec.generate(heldout_prompts[11], max_new_tokens=NEW_TOKENS)
    assert result.stats.tokens_per_cycle > 1.2  # drafting pays on this prompt (checked before the claim below)
    assert result.stats.alone_cycles <= 2 + Fallback.PROBE_DRAFT_FIRST, result.stats.summary()  # + the prompt's
