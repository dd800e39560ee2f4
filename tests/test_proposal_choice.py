"""proposal="auto": the chooser's rule, and that it picks kinds by their measured merit on the fixture pair.

Losslessness of switching kinds between cycles: reference/exact.py (proof sketch; a statistical test with a
peeking chooser as its negative control) and tests/test_stats.py (end to end, kinds forced to alternate).
"""

from __future__ import annotations

import pytest

from xtokspec.decode.policy import ProposalChooser


def test_chooser_starts_with_the_static_rule_and_switches_on_a_clear_lead():
    chooser = ProposalChooser("intersection")
    assert chooser.kind == "intersection" and chooser.scores() == {}
    # one-hot's first proposal is accepted far more often: switch after the first measured cycle
    assert chooser.update(onehot=0.6, intersection=0.2, accepted=1) == "onehot"
    # a lead under the margin does not switch back
    for _ in range(3):
        assert chooser.update(onehot=0.40, intersection=0.41, accepted=1) == "onehot"


def test_chooser_weighs_first_position_chances_by_measured_depth():
    """Equal first-position chances: the kind whose accepted cycles carried more tokens wins; a kind that has
    not run keeps the prior depth (PRIOR_DEPTH tokens per accepted cycle)."""
    chooser = ProposalChooser("onehot")
    for _ in range(10):
        kind = chooser.update(onehot=0.4, intersection=0.4, accepted=3)  # one-hot cycles carry 3 tokens
    assert kind == "onehot"
    scores = chooser.scores()
    assert scores["onehot"] > 2 * 0.4 > scores["intersection"] == pytest.approx(0.4 * ProposalChooser.PRIOR_DEPTH)
    # cycles that accept nothing leave the depth alone
    before = chooser.scores()["onehot"]
    chooser.update(onehot=0.4, intersection=0.4, accepted=0)
    assert chooser.scores()["onehot"] == pytest.approx(before)


@pytest.mark.slow
def test_auto_follows_the_kinds_merit_on_the_fixture_pair(bridged_spec, heldout_prompts):
    """On the fixtures intersection accepts more at T=1.0 and one-hot more at T=0.3 (BENCHMARKS.md): at T=1.0
    "auto" stays with intersection (the static rule's start) nearly always; at T=0.3 it moves to one-hot in
    some cycles. adaptive=False: no timings, so the runs are deterministic."""

    def cycles(temperature):
        counts = {}
        for seed, prompt in enumerate(heldout_prompts[40:46]):
            result = bridged_spec.generate(prompt, max_new_tokens=32, do_sample=True, temperature=temperature,
                                           seed=seed, adaptive=False)
            assert result.stats.proposal == "auto"
            assert set(result.stats.proposal_estimates) == {"onehot", "intersection"}
            for kind, n in result.stats.proposal_cycles.items():
                counts[kind] = counts.get(kind, 0) + n
        return counts

    hot, cold = cycles(1.0), cycles(0.3)
    assert hot.get("intersection", 0) >= 0.9 * sum(hot.values()), hot
    assert cold.get("onehot", 0) >= 0.2 * sum(cold.values()), cold


def test_fixed_kinds_report_their_cycles(bridged_spec):
    result = bridged_spec.generate("東京の", max_new_tokens=8, do_sample=True, seed=0, proposal="onehot")
    assert result.stats.proposal == "onehot" and set(result.stats.proposal_cycles) == {"onehot"}
    assert sum(result.stats.proposal_cycles.values()) == result.stats.target_forwards
    assert result.stats.proposal_estimates == {}


@pytest.mark.slow
@pytest.mark.parametrize("healing", [True, False])
def test_auto_heals_in_its_onehot_cycles_only(healing, ja_target, ja_draft_bpe, heldout_prompts):
    """Token healing under proposal="auto": a one-hot cycle may restate the draft's last token with a longer one;
    an intersection cycle never does (its proposals are single draft ids), and nothing heals with healing off.
    At T=0.3 "auto" runs one-hot in some cycles on the fixture pair (the test above): v2.1 fixtures measure 46
    one-hot cycles here, 10 of them healed."""
    from xtokspec import SpecConfig, XTokSpec
    from xtokspec.types import GenerationStats

    spec = XTokSpec(ja_target, ja_draft_bpe, config=SpecConfig(cache="dynamic", fallback=False, draft_healing=healing))
    healed_kinds: dict[str, int] = {}
    observe = GenerationStats.observe

    def record(self, cycle):
        observe(self, cycle)
        if cycle.healed:
            healed_kinds[cycle.kind] = healed_kinds.get(cycle.kind, 0) + 1

    onehot = 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GenerationStats, "observe", record)
        for seed, prompt in enumerate(heldout_prompts[40:46]):
            stats = spec.generate(prompt, max_new_tokens=32, do_sample=True, temperature=0.3, seed=seed,
                                  adaptive=False).stats
            assert stats.healed_cycles <= stats.proposal_cycles.get("onehot", 0)
            onehot += stats.proposal_cycles.get("onehot", 0)
    assert onehot >= 10, f"only {onehot} one-hot cycles: the test hardly reaches healing"
    if healing:
        assert set(healed_kinds) == {"onehot"} and healed_kinds["onehot"] >= 2, healed_kinds
    else:
        assert healed_kinds == {}
