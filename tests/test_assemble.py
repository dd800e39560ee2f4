"""decode.assemble: the mapper chosen by kind, what outlives a generation (`Kept`), the interfaces the loop holds,
and the cycle records' constructors."""

from __future__ import annotations

import time

import pytest
import torch

from xtokspec import SamplingParams, SpecConfig
from xtokspec.decode import assemble
from xtokspec.decode.mapping import IntersectionMap, SameVocab, Switching, TextBridge
from xtokspec.decode.policy import DraftLength, Fallback, ProposalChooser, TreeBudget, VerifyCost
from xtokspec.decode.propose import ChainProposer, TreeProposer
from xtokspec.decode.protocols import (
    DraftLengthPolicy,
    FallbackPolicy,
    Mapper,
    MapperChoice,
    Observer,
    Proposer,
)
from xtokspec.runtime.cache import ModelState
from xtokspec.types import ALONE, CycleRecord, GenerationStats, ProposalKind

CPU = torch.device("cpu")


def build(spec, kind: ProposalKind, healing: bool = True):
    draft_prompt = spec.draft.encode_prompt("設定ファイル")
    return assemble.mapper(spec.pair, kind, draft_prompt=draft_prompt, lookbehind=2, healing=healing,
                           logits_device=CPU, draft_device=CPU, target_vocab=spec.target_model.config.vocab_size)


def bridge_of(mapper) -> TextBridge:
    """The text bridge a mapper proposes through (auto: its one-hot kind's; the intersection map: the one it wraps)."""
    current = mapper.mappers["onehot"] if isinstance(mapper, Switching) else mapper
    return current.bridge if isinstance(current, IntersectionMap) else current


@pytest.mark.parametrize("kind, cls, heals", [
    (ProposalKind.GREEDY_BRIDGE, TextBridge, True),
    (ProposalKind.ONEHOT, TextBridge, True),
    (ProposalKind.INTERSECTION, IntersectionMap, False),
    (ProposalKind.AUTO, Switching, True),
])
def test_the_mapper_is_chosen_by_its_kind_across_tokenizers(bridged_spec, kind, cls, heals):
    mapper = build(bridged_spec, kind)
    assert type(mapper) is cls
    assert isinstance(mapper, MapperChoice) and isinstance(mapper.current, Mapper)
    assert bridge_of(mapper).healing is heals  # token healing only where proposals are one-hot through the bridge
    assert bridge_of(build(bridged_spec, kind, healing=False)).healing is False
    if cls is TextBridge:
        assert mapper.kind == kind.value  # what the cycles report


def test_one_tokenizer_gets_the_same_vocabulary_mapper(same_spec):
    mapper = build(same_spec, ProposalKind.SAME_TOKENIZER)
    assert type(mapper) is SameVocab and isinstance(mapper, Mapper) and mapper.kind == "same-tokenizer"
    assert mapper.first_chances(torch.ones(3), torch.ones(3)) is None  # nothing to choose between


def test_auto_starts_from_the_share_of_the_draft_vocabulary_that_maps(bridged_spec):
    share = bridged_spec.pair.maps.token_map.mapped_draft_share
    low = assemble.mapper(bridged_spec.pair, ProposalKind.AUTO, draft_prompt=[], lookbehind=2, healing=True,
                          logits_device=CPU, draft_device=CPU, target_vocab=bridged_spec.target_model.config.vocab_size,
                          min_mapped_mass=share + 0.01)
    high = assemble.mapper(bridged_spec.pair, ProposalKind.AUTO, draft_prompt=[], lookbehind=2, healing=True,
                           logits_device=CPU, draft_device=CPU, target_vocab=bridged_spec.target_model.config.vocab_size,
                           min_mapped_mass=share)
    assert low.chooser.kind == "onehot" and high.chooser.kind == "intersection"
    assert isinstance(low.current, TextBridge) and isinstance(high.current, IntersectionMap)


def test_a_generation_is_assembled_from_declared_interfaces(bridged_spec):
    stats = GenerationStats()
    kept = assemble.Kept()
    config = SpecConfig(tree_width=2)
    ids = bridged_spec.target.encode_prompt("設定ファイル")
    draft_ids = bridged_spec.draft.encode_prompt("設定ファイル")
    target, draft = assemble.states(kept, bridged_spec.target_model, bridged_spec.draft_model, ids, draft_ids, 8,
                                    config)
    params = SamplingParams(do_sample=True, temperature=0.7, seed=3)
    run = assemble.generation(bridged_spec.pair, kept, target, draft, stats, params, config, ProposalKind.ONEHOT)
    assert isinstance(run.proposer, TreeProposer) and isinstance(run.proposer, Proposer)
    assert isinstance(run.draft_length, DraftLengthPolicy) and isinstance(run.fallback, FallbackPolicy)
    assert all(isinstance(observer, Observer) for observer in run.observers)
    assert run.observers[0] is stats and any(isinstance(o, TreeBudget) for o in run.observers)
    assert run.sampler is not None and run.clock is time.perf_counter  # the real clock unless one is handed in
    # the same setting again: the learned policies carry over; another setting gets its own
    again = assemble.generation(bridged_spec.pair, kept, target, draft, GenerationStats(), params, config,
                                ProposalKind.ONEHOT)
    assert again.draft_length is run.draft_length
    greedy = assemble.generation(bridged_spec.pair, kept, target, draft, GenerationStats(), SamplingParams(),
                                 SpecConfig(), ProposalKind.GREEDY_BRIDGE)
    assert greedy.draft_length is not run.draft_length and greedy.sampler is None
    assert isinstance(greedy.proposer, ChainProposer)


def test_auto_puts_its_chooser_first_among_the_observers(bridged_spec):
    stats = GenerationStats()
    kept = assemble.Kept()
    ids = bridged_spec.target.encode_prompt("設定")
    target, draft = assemble.states(kept, bridged_spec.target_model, bridged_spec.draft_model, ids,
                                    bridged_spec.draft.encode_prompt("設定"), 4, SpecConfig())
    run = assemble.generation(bridged_spec.pair, kept, target, draft, stats, SamplingParams(do_sample=True),
                              SpecConfig(), ProposalKind.AUTO)
    chooser = run.observers[0]
    assert isinstance(chooser, ProposalChooser) and chooser is run.mapper.chooser
    chooser.observe(CycleRecord.drafted(kind="onehot", draft_steps=2, depth=2, nodes=2, accepted=1, rejected=True,
                                        committed=2, draft_s=0.0, bridge_s=0.0, verify_s=0.0, prefill=False,
                                        first_chances=(0.9, 0.1)))
    assert set(stats.proposal_estimates) == {"onehot", "intersection"}  # the chooser's scores, in the stats
    before = dict(stats.proposal_estimates)
    chooser.observe(CycleRecord.target_alone(committed=1, seconds=0.01, prefill=False))  # teaches nothing
    assert stats.proposal_estimates == before


def test_kept_keeps_the_largest_idle_static_caches(ja_target):
    model = ja_target[0]
    kept = assemble.Kept()
    small = kept.state(model, [1, 2], "static", 100)
    large = kept.state(model, [1, 2], "static", 600)
    kept.release(small)
    kept.release(large)
    assert [kv.capacity for kv in kept.idle_kv[id(model)]] == [large.kv.capacity]  # one kept: the larger
    again = kept.state(model, [3], "static", 50)
    assert again.kv is large.kv and kept.idle_kv[id(model)] == []  # taken, not shared
    other = kept.state(model, [3], "static", 100)  # nothing idle: a new cache
    assert other.kv is not large.kv
    kept.release(other, keep=4)
    kept.release(again, keep=4)
    assert kept.idle_kv[id(model)] == [large.kv, other.kv]  # up to `keep`, the largest first
    kept.release(ModelState(model, [1], "dynamic", 10))  # a dynamic cache is not kept
    assert len(kept.idle_kv[id(model)]) == 2
    kept.forget(model)
    assert id(model) not in kept.idle_kv


def test_cycle_records_name_their_kind():
    alone = CycleRecord.target_alone(committed=1, seconds=0.02, prefill=False)
    assert alone.alone and alone.kind == ALONE and alone.verify_s == 0.02 and alone.draft_steps == 0
    drafted = CycleRecord.drafted(kind="onehot", draft_steps=3, depth=3, nodes=3, accepted=2, rejected=True,
                                  committed=3, draft_s=0.01, bridge_s=0.0, verify_s=0.02, prefill=False, healed=True)
    assert not drafted.alone and drafted.healed and drafted.first_chances is None
    with pytest.raises(TypeError):
        CycleRecord.drafted(kind="onehot", draft_steps=3)  # every field a policy reads is named


def test_the_measured_policies_declare_their_interfaces():
    config = SpecConfig()
    length = DraftLength(config, VerifyCost())
    assert isinstance(length, DraftLengthPolicy)
    assert isinstance(Fallback(config), FallbackPolicy)
    assert isinstance(TreeBudget(config, VerifyCost()), Observer)
    assert isinstance(ProposalChooser("onehot"), Observer)
    assert isinstance(GenerationStats(), Observer)
