"""The keyed sampler (xtokspec/decode/keyed.py, reference/keyed.py): the same bits as the NumPy reference, the
rule's verification, a chi-square test of its law with a control that must fail, and the promise itself: sampled
text identical to the target alone's keyed sample with that seed, whatever the draft, K, trees or fallback, with
mutants that must break it.

False-failure budget: the one chi-square test here claims 5e-5 of a tox run's 1e-3 (docs/testing.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_helpers import TEST_DEVICE
from policies import scripted

import reference
from xtokspec import SpecConfig, XTokSpec
from xtokspec.decode import keyed, tree
from xtokspec.decode.verify import SamplerOps
from xtokspec.types import XTokSpecError

KEYED_ALPHA = 5e-5


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3, 2**64 - 5, -1])
def test_the_hash_gives_the_references_bits_and_noise_strictly_inside(seed):
    # on XTOKSPEC_TEST_DEVICE: the 64-bit products that the hash masks must give the same bits on a GPU
    positions = torch.tensor([0, 1, 5, 123_456, 2**33])
    ours = keyed.uniforms(seed, positions.to(TEST_DEVICE), 5000).cpu().numpy()
    theirs = reference.keyed_uniforms(seed, positions.numpy(), 5000)
    assert np.array_equal(ours, theirs)
    assert 0 < ours.min() and ours.max() < 1
    noise = keyed.noise(seed, torch.arange(20, device=TEST_DEVICE), 5000)
    assert bool(torch.isfinite(noise).all()) and float(noise.min()) > 0
    assert abs(float(noise.double().mean()) - 1.0) < 0.02  # Exp(1): mean 1 (100,000 draws, sd 0.0032)


def test_the_noise_runs_a_fixed_handful_of_tensor_operations():
    """A cycle's noise is (K + 1) x vocabulary values, but on a GPU its cost is its kernel launches: the positions'
    keys are hashed on the host, so one call runs the hash's dozen operations over the whole table once, however
    many positions it keys (21 operators, the copy of the row keys included; 45 when the rows were hashed on the
    device too)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    keyed.noise(1, range(5), 3000)  # the vocabulary's token keys, computed once
    for positions in (range(1), range(40, 45), list(range(100, 164))):
        Count.calls = 0
        with Count():
            keyed.noise(9, positions, 3000)
        assert Count.calls <= 22, (len(positions), Count.calls)


def test_chain_verification_matches_the_reference_rule():
    rng = np.random.default_rng(3)
    for trial in range(200):
        k, vocab, first, seed = int(rng.integers(0, 5)), 7, int(rng.integers(0, 50)), int(rng.integers(0, 2**40))
        p = rng.dirichlet(np.ones(vocab) * 0.5, size=k + 1)
        samples = keyed.samples(torch.tensor(p), seed, torch.arange(first, first + k + 1)).tolist()
        # proposals that follow the keyed samples for a while, then guess
        agree = int(rng.integers(0, k + 1))
        proposals = samples[:agree] + [int(x) for x in rng.integers(0, vocab, size=k - agree)]
        expected = reference.keyed_verify(p, proposals, seed, first)
        assert keyed.verify_chain(samples, proposals) == expected, trial
        assert keyed.chain(torch.tensor(p), proposals, seed, first) == expected, trial


def test_a_trie_is_walked_along_the_keyed_samples():
    trie = tree.Trie()
    trie.insert([4, 1])
    trie.insert([2])
    a, c, b = 1, 2, 3  # nodes: 4, its child 1, then 2
    assert tree.walk_keyed(trie, [4, 1, 9, 9, 9].__getitem__) == ([a, c], 9)  # 4, then 1, then 9 emitted
    assert tree.walk_keyed(trie, [2, 0, 9, 9, 9].__getitem__) == ([b], 9)
    assert tree.walk_keyed(trie, [3, 0, 0, 0, 0].__getitem__) == ([], 3)


def test_the_keyed_sampler_follows_the_law_of_a_two_token_table_and_a_position_blind_key_does_not():
    """y1 ~ p1 and y2 ~ p2[y1], keyed by (seed, position) over 4,000 seeds, against the exact joint law (36
    cells); the control keys both positions alike (noise by seed alone), which ties y2 to y1 and must be
    rejected by the same test."""
    rng = np.random.default_rng(5)
    p1 = rng.dirichlet(np.ones(6))
    p2 = 0.7 * p1 + 0.3 * rng.dirichlet(np.ones(6), size=6)  # rows: p(y2 | y1)
    exact = {(i, j): p1[i] * p2[i, j] for i in range(6) for j in range(6)}

    def draw(position_of) -> list[tuple[int, int]]:
        out = []
        for seed in range(4000):
            y1 = int(keyed.samples(torch.tensor(p1)[None], seed, torch.tensor([position_of(0)]))[0])
            y2 = int(keyed.samples(torch.tensor(p2[y1])[None], seed, torch.tensor([position_of(1)]))[0])
            out.append((y1, y2))
        return out

    result = reference.assert_samples_match(draw(lambda t: t), exact, KEYED_ALPHA, "keyed sampler, 2 tokens")
    print(f"keyed sampler: p = {result.pvalue:.3g}")
    control = reference.chisquare_test(*reference.count_samples(draw(lambda t: 0), exact)[:2], KEYED_ALPHA)
    print(f"control (noise keyed by seed alone): p = {control.pvalue:.3g}")
    assert control.rejected, reference.format_result(control, "control: position-blind noise")


# ---------------------------------------------------------------------------------------------- end to end
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=20)]
CONFIGS = {
    "bridged K=4": ("bridged", dict(num_draft_tokens=4, adaptive=False)),
    "bridged K=1": ("bridged", dict(num_draft_tokens=1, adaptive=False)),
    "bridged one-hot": ("bridged", dict(num_draft_tokens=3, adaptive=False, proposal="onehot")),
    "bridged intersection": ("bridged", dict(num_draft_tokens=3, adaptive=False, proposal="intersection")),
    "bridged tree": ("bridged", dict(num_draft_tokens=3, adaptive=False, tree_width=2)),
    "same tokenizer K=3": ("same", dict(num_draft_tokens=3, adaptive=False)),
    "same tokenizer tree": ("same", dict(num_draft_tokens=2, adaptive=False, tree_width=3)),
}


def keyed_texts(spec, prompts, seeds, setting, **options) -> list[list[int]]:
    return [spec.generate(prompt, max_new_tokens=24, do_sample=True, keyed=True, seed=seed, **setting,
                          **options).token_ids for prompt in prompts for seed in seeds]


@pytest.fixture(scope="module")
def alone_texts(bridged_spec, heldout_prompts):
    prompts = heldout_prompts[:3]
    return {n: keyed_texts(bridged_spec, prompts, range(2), setting, alone=True) for n, setting in enumerate(SETTINGS)}


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_keyed_sampled_text_is_the_target_alones_whatever_the_draft(config, bridged_spec, same_spec,
                                                                    heldout_prompts, alone_texts):
    """3 prompts x 2 seeds x 3 sampling settings: the text sampled with a draft equals the target alone's keyed
    sample, token for token (float32, one device)."""
    which, options = CONFIGS[config]
    spec = bridged_spec if which == "bridged" else same_spec
    for n, setting in enumerate(SETTINGS):
        texts = keyed_texts(spec, heldout_prompts[:3], range(2), setting, **options)
        assert texts == alone_texts[n], (config, setting)


@pytest.mark.slow
@pytest.mark.fallback
def test_keyed_text_is_the_same_with_the_fallback_and_adaptive_k(bridged_spec, heldout_prompts, alone_texts):
    """The measured policies (adaptive K, the fallback to the target alone: wall-clock decisions) and a scripted
    alternation of drafted and target-alone cycles, each with token healing on (the default): the same text."""
    setting = SETTINGS[1]
    assert keyed_texts(bridged_spec, heldout_prompts[:3], range(2), setting) == alone_texts[1]
    spec = XTokSpec((bridged_spec.target_model, bridged_spec.target_tokenizer),
                    (bridged_spec.draft_model, bridged_spec.draft_tokenizer), config=SpecConfig(cache="static"))
    spec.fallback_policy = scripted(lambda policy: policy.cycles % 3 == 2 and policy.since_draft < 2)
    assert keyed_texts(spec, heldout_prompts[:3], range(2), setting) == alone_texts[1]


@pytest.mark.slow
def test_mutants_of_the_keyed_rule_change_the_text(bridged_spec, heldout_prompts, alone_texts, monkeypatch):
    """Noise keyed by the cycle's own count instead of the output position, and a verification that accepts the
    first proposal whatever the samples say: each must give text other than the target alone's."""

    def by_cycle(probs, proposals, seed, first):
        return keyed.chain(probs, proposals, seed, 0)

    def first_accepted(probs, proposals, seed, first):
        accepted, token = keyed.chain(probs, proposals, seed, first)
        if proposals and not accepted:
            return 1, keyed.sample(probs[1], seed, first + 1)
        return accepted, token

    def texts():
        return keyed_texts(bridged_spec, heldout_prompts[:3], range(2), SETTINGS[0], num_draft_tokens=4,
                           adaptive=False)

    monkeypatch.setattr(bridged_spec, "sampler_ops", SamplerOps(keyed_chain=by_cycle))
    assert texts() != alone_texts[0]
    monkeypatch.setattr(bridged_spec, "sampler_ops", SamplerOps(keyed_chain=first_accepted))
    assert texts() != alone_texts[0]


def test_the_coupled_draft_draws_the_keyed_sample_of_its_own_distribution_on_the_targets_ids():
    """keyed.Coupling (reference/keyed.py, item 5): a draft distribution over its own ids, with mass only on ids
    that are target ids too, raced on the coupling's noise, picks the id whose target id is the keyed sample of
    that distribution moved onto the target's ids (the reference's bits), at the target's next output position.
    Mutant: noise keyed by the draft's own ids, which the target's race never sees."""

    class Target:  # the target's state as the coupling reads it: its ids
        ids = list(range(11))  # a 4-id prompt (start) and 7 output ids: the next output position is 7

    rng = np.random.default_rng(5)
    draft_vocab, target_vocab, seed = 40, 64, 2024
    draft_to_target = torch.tensor(rng.permutation(target_vocab)[:draft_vocab])
    draft_to_target[rng.random(draft_vocab) < 0.3] = -1  # draft ids no target id spells
    coupling = keyed.Coupling(seed, Target(), 4, draft_to_target)
    mutant = keyed.Coupling(seed, Target(), 4, torch.arange(draft_vocab))
    differ = 0
    for trial in range(200):
        q = torch.tensor(rng.dirichlet(np.full(draft_vocab, 0.3))) * (draft_to_target >= 0)
        q = (q / q.sum()).float()
        on_target = np.zeros(target_vocab)
        on_target[draft_to_target[draft_to_target >= 0].numpy()] = q[draft_to_target >= 0].numpy()
        for offset in (0, 2):
            drafted = int(draft_to_target[int(torch.argmax(q / coupling.noise(3)[offset]))])
            assert drafted == reference.keyed_sample(on_target, seed, 7 + offset), (trial, offset)
            differ += int(draft_to_target[int(torch.argmax(q / mutant.noise(3)[offset]))]) != drafted
    assert differ > 100, differ  # the mutant's draws are not the keyed samples


def test_the_choosers_coupled_acceptance_is_the_references_match_law():
    """sampling.coupled_acceptance (what proposal="auto" scores intersection proposals by under the keyed sampler)
    equals the sum of reference.coupled_match_law over random target and draft distributions, with draft ids that
    no target id spells, ids without mass on either side, and ties of p / Q."""
    from xtokspec.decode import sampling

    rng = np.random.default_rng(3)
    for trial in range(300):
        vt, vd = int(rng.integers(3, 12)), int(rng.integers(3, 12))
        p = rng.dirichlet(np.full(vt, 0.5))
        p[rng.random(vt) < 0.2] = 0.0
        p = p / p.sum() if p.sum() > 0 else np.full(vt, 1.0 / vt)
        q = rng.dirichlet(np.full(vd, 0.5))
        draft_to_target = np.where(rng.random(vd) < 0.25, -1, rng.permutation(max(vt, vd))[:vd] % vt)
        if trial % 10 == 0:  # ties: Q proportional to p on the mapped ids
            draft_to_target = np.arange(vd) % vt
            q = p[draft_to_target] / p[draft_to_target].sum() if p[draft_to_target].sum() > 0 else q
        mapped = np.zeros(vt)
        np.add.at(mapped, draft_to_target[draft_to_target >= 0], q[draft_to_target >= 0])
        expected = reference.coupled_match_law(p, mapped / mapped.sum())[:-1].sum() if mapped.sum() > 0 else 0.0
        got = float(sampling.coupled_acceptance(torch.tensor(p), torch.tensor(q), torch.tensor(draft_to_target)))
        assert got == pytest.approx(expected, abs=1e-9), trial


@pytest.mark.slow
def test_coupled_draws_are_accepted_more_and_give_the_same_text(bridged_spec, heldout_prompts, monkeypatch):
    """Keyed, with intersection proposals (K=3, T=0.7, 4 prompts x 3 seeds x 24 tokens): drafts coupled to the
    target's noise are accepted more often than the same proposals drawn on the draft's own generator, and the
    text is the same either way (the target alone's). Measured: 50 accepted coupled, 34 apart (8 prompts x 4
    seeds x 32 tokens: 162 and 107)."""
    from xtokspec.decode import assemble

    def run():
        outs = [bridged_spec.generate(p, max_new_tokens=24, do_sample=True, temperature=0.7, seed=seed, keyed=True,
                                      num_draft_tokens=3, adaptive=False, proposal="intersection")
                for p in heldout_prompts[:4] for seed in range(3)]
        return [o.token_ids for o in outs], sum(o.stats.accepted for o in outs)

    coupled_text, coupled = run()
    monkeypatch.setattr(assemble, "COUPLED_KINDS", frozenset())
    apart_text, apart = run()
    print(f"keyed intersection proposals: {coupled} accepted coupled, {apart} drawn apart")
    assert coupled_text == apart_text
    assert coupled >= 1.3 * apart, (coupled, apart)


def test_a_keyed_tree_roots_groups_race_on_the_targets_noise():
    """sampling.draw_groups_without_replacement with group keys on keyed.Coupling.row's noise (reference/keyed.py,
    item 6): the root's groups
    are the reference's coupled roots of the draft's distribution moved onto the target's ids, and each group's
    draft id is one of that group's ids with mass."""
    from xtokspec.decode import sampling

    class Target:
        ids = list(range(9))  # a 3-id prompt and 6 output ids: the next output position is 6

    rng = np.random.default_rng(11)
    draft_vocab, target_vocab, seed = 50, 30, 77
    coupling = keyed.Coupling(seed, Target(), 3)
    for trial in range(200):
        groups = torch.tensor(rng.integers(-1, target_vocab, size=draft_vocab))
        probs = torch.tensor(rng.dirichlet(np.full(draft_vocab, 0.3)), dtype=torch.float32)
        width = int(rng.integers(1, 6))
        id_noise = torch.empty(draft_vocab).exponential_(generator=torch.Generator().manual_seed(trial))
        q = sampling.grouped_distribution(probs, groups, target_vocab)
        chosen, draft_ids = sampling.draw_groups_without_replacement(
            probs, groups, target_vocab, width, id_noise, q / coupling.row(target_vocab, torch.device("cpu")))
        assert chosen == reference.coupled_roots(q.double().numpy(), seed, 6, width), trial
        assert all(int(groups[d]) == g and float(probs[d]) > 0 for g, d in zip(chosen, draft_ids, strict=True))


@pytest.mark.slow
def test_keyed_tree_roots_coupled_are_accepted_more_and_give_the_same_text(bridged_spec, heldout_prompts,
                                                                           monkeypatch):
    """Keyed width-3 trees with sampled roots (K=3, T=0.7, 4 prompts x 3 seeds x 24 tokens): roots raced on the
    target's keyed noise are accepted more often than roots drawn on the draft's own generator, and the text is the
    same either way (the target alone's). Measured: 74 accepted coupled on the CPU and on an H100 (the keyed noise is
    the same on both), 59 apart on the CPU and 67 on the H100, whose generator draws other roots. The apart count
    moves with the device's generator by about its square root, so the bar is only "more"; the rates themselves are
    compared exactly in tests/reference/test_ref_exact.py."""
    from xtokspec.decode import sampling

    def run():
        outs = [bridged_spec.generate(p, max_new_tokens=24, do_sample=True, temperature=0.7, seed=seed, keyed=True,
                                      num_draft_tokens=3, adaptive=False, tree_width=3)
                for p in heldout_prompts[:4] for seed in range(3)]
        assert all(o.stats.sampled_roots > 0 for o in outs)
        return [o.token_ids for o in outs], sum(o.stats.accepted for o in outs)

    coupled_text, coupled = run()
    apart = sampling.draw_groups_without_replacement
    monkeypatch.setattr(sampling, "draw_groups_without_replacement",
                        lambda probs, groups, vocab, count, noise, _group_keys: apart(probs, groups, vocab, count, noise))
    apart_text, drawn_apart = run()
    print(f"keyed tree roots: {coupled} accepted coupled, {drawn_apart} drawn apart")
    assert coupled_text == apart_text
    assert coupled > drawn_apart, (coupled, drawn_apart)


def test_keyed_needs_sampling():
    from xtokspec.types import SamplingParams

    with pytest.raises(XTokSpecError, match="keyed=True is a way of sampling"):
        SamplingParams(keyed=True)
    with pytest.raises(XTokSpecError, match="keyed must be True or False"):
        SamplingParams(do_sample=True, keyed=1)


@pytest.mark.slow
def test_the_command_line_keyed_sample_is_the_same_with_chains_trees_and_the_fallback(capsys, ja_target):
    """`xtokspec generate --keyed --seed 3`: the same text with a fixed K of 1, a tree of width 3 and the default
    adaptive K with the fallback (float32); --keyed implies --sample."""
    from xtokspec.cli.main import main

    args = ["generate", "dirp が相対パスで dirfd が特別な値", "--max-new-tokens", "24", "--dtype", "float32",
            "--keyed", "--seed", "3", "--temperature", "0.9"]
    texts = []
    for extra in (["--fixed-k", "--num-draft-tokens", "1"], ["--tree-width", "3"], []):
        assert main([*args, *extra]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0].strip() and texts[0] == texts[1] == texts[2]
    assert main(["generate", "x", "--keyed", "--temperature", "0"]) == 2
    assert "--keyed is a way of sampling" in capsys.readouterr().err


@pytest.mark.slow
def test_stream_and_custom_generate_give_the_keyed_text(bridged_spec, heldout_prompts):
    """The target alone's keyed sample through `generate`, through `stream` with a draft (its pieces joined) and
    through the target's own `generate` with `custom_generate=spec.custom_generate` (its ids)."""
    prompt, setting = heldout_prompts[0], dict(temperature=0.7, top_p=0.9, top_k=50)
    alone = bridged_spec.generate(prompt, max_new_tokens=24, do_sample=True, keyed=True, seed=0, alone=True,
                                  **setting)
    streamed = "".join(bridged_spec.stream(prompt, max_new_tokens=24, do_sample=True, keyed=True, seed=0,
                                           num_draft_tokens=2, adaptive=False, **setting))
    assert alone.token_ids and streamed == alone.text
    model, tokenizer = bridged_spec.target_model, bridged_spec.target_tokenizer
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=24, do_sample=True, keyed=True, seed=0, **setting,
                             custom_generate=bridged_spec.custom_generate)
    assert out[0, inputs["input_ids"].shape[1]:].tolist() == alone.token_ids
