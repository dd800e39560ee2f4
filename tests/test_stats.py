"""Chi-square tests of xtokspec's sampling against exact distributions, each with a negative control.

False-failure budget (see reference/chisquare.py): a full tox run may fail a correct implementation with
probability <= 1e-3. tests/reference claims 2e-4 for its 11 tests; this file claims the other 8e-4 for its
NUM_TESTS statistical tests, so each runs at ALPHA = 8e-4 / NUM_TESTS. Seeds are fixed: a pass is
reproducible, and the budget is the chance that the seeds chosen were unlucky. Every test also runs a
deliberately wrong sampler on the same sample size and asserts that the same check rejects it (p < ALPHA).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import reference
from xtokspec import sampling
from xtokspec.decode import _Run
from xtokspec.types import SamplingParams

NUM_TESTS = 10  # statistical tests in this file (test_budget_count checks it)
ALPHA = reference.per_test_alpha(NUM_TESTS, budget=8e-4)  # 8e-5

pytestmark = pytest.mark.stats

# ---------------------------------------------------------------- A. the block sampler, fixed tables
K, V, N_BLOCK = 3, 6, 4000


@pytest.fixture(scope="module")
def tables():
    rng = np.random.default_rng(11)
    p = rng.dirichlet(np.full(V, 0.7), size=K + 1)  # (K+1, V) target
    q = rng.dirichlet(np.full(V, 0.7), size=K)  # (K, V) proposal
    return p, q


def run_blocks(p, q, seed, n=N_BLOCK, *, onehot=False, verify_flaw=None):
    """n blocks through xtokspec's step -> list of (first emitted token, number accepted)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    p_t, q_t = torch.from_numpy(p), torch.from_numpy(q)
    out = []
    for _ in range(n):
        draft = torch.tensor([rng.choice(V, p=row) for row in q])
        uniforms = torch.rand(K, generator=gen, dtype=torch.float64)
        noise = torch.empty(V, dtype=torch.float64).exponential_(generator=gen)
        if verify_flaw:
            n_acc, token = verify_flaw(p_t, q_t, draft, uniforms, noise)
        else:
            q_arg = None if onehot else q_t
            n_acc = sampling.count_accepted(p_t, draft, uniforms, q_arg)
            token = int(sampling.race(sampling.next_token_distribution(p_t, draft, n_acc, q_arg), noise))
        out.append((int(draft[0]) if n_acc > 0 else token, n_acc))
    return out


def first_token_check(samples, p0, label):
    counts = np.bincount([s[0] for s in samples], minlength=V)
    return reference.chisquare_test(counts, p0, ALPHA), label


def recovered_from_target(p, q, draft, uniforms, noise):
    """WRONG: at a rejection, samples p instead of the residual max(0, p - q)."""
    n = sampling.count_accepted(p, draft, uniforms, q)
    return n, int(sampling.race(p[n], noise))


def test_block_first_token_is_target_distributed(tables):
    p, q = tables
    result = reference.assert_same_distribution(
        np.bincount([s[0] for s in run_blocks(p, q, 1)], minlength=V), p[0], ALPHA, "block first token"
    )
    wrong = np.bincount([s[0] for s in run_blocks(p, q, 1, verify_flaw=recovered_from_target)], minlength=V)
    control = reference.chisquare_test(wrong, p[0], ALPHA)
    assert control.rejected, f"negative control passed (p={control.pvalue:.3g}); the test has no power"
    assert result.pvalue >= ALPHA


def test_accepted_count_distribution(tables):
    p, q = tables
    exact = reference.accepted_count_distribution(p, q)
    counts = np.bincount([s[1] for s in run_blocks(p, q, 2)], minlength=K + 1)
    reference.assert_same_distribution(counts, exact, ALPHA, "number accepted")

    def swapped(p_, q_, draft, uniforms, noise):  # WRONG: Chen et al.'s letters read as Leviathan's
        n = sampling.count_accepted(q_, draft, uniforms, p_[:K])
        return n, 0

    wrong = np.bincount([s[1] for s in run_blocks(p, q, 2, verify_flaw=swapped)], minlength=K + 1)
    assert reference.chisquare_test(wrong, exact, ALPHA).rejected


def test_onehot_block_first_token(tables):
    p, q = tables
    counts = np.bincount([s[0] for s in run_blocks(p, q, 3, onehot=True)], minlength=V)
    reference.assert_same_distribution(counts, p[0], ALPHA, "one-hot block first token")

    def not_removed(p_, q_, draft, uniforms, noise):  # WRONG: the rejected guess stays in the residual
        n = sampling.count_accepted(p_, draft, uniforms, None)
        return n, int(sampling.race(p_[n], noise))

    wrong = np.bincount([s[0] for s in run_blocks(p, q, 3, verify_flaw=not_removed)], minlength=V)
    assert reference.chisquare_test(wrong, p[0], ALPHA).rejected


def test_mapped_proposal_first_token():
    """A draft over another vocabulary (8 ids, 2 unmapped, 2 sharing a target id) mapped onto V target ids."""
    rng = np.random.default_rng(4)
    p = rng.dirichlet(np.full(V, 0.7), size=K + 1)
    draft_probs = rng.dirichlet(np.full(8, 0.7), size=K)  # (K, Vd)
    token_map = torch.tensor([0, 1, 2, 3, 4, 5, 5, -1])
    q = sampling.map_to_target(torch.from_numpy(draft_probs), token_map, V).numpy()
    counts = np.bincount([s[0] for s in run_blocks(p, q, 5)], minlength=V)
    reference.assert_same_distribution(counts, p[0], ALPHA, "mapped proposal first token")
    shifted = sampling.map_to_target(torch.from_numpy(draft_probs), torch.roll(token_map, 1), V)

    def wrong_map(p_, q_, draft, uniforms, noise):  # WRONG: q scored through a map shifted by one id
        q_bad = shifted.clamp(min=1e-3)
        n = sampling.count_accepted(p_, draft, uniforms, q_bad)
        return n, int(sampling.race(sampling.next_token_distribution(p_, draft, n, q_bad), noise))

    wrong = np.bincount([s[0] for s in run_blocks(p, q, 5, verify_flaw=wrong_map)], minlength=V)
    assert reference.chisquare_test(wrong, p[0], ALPHA).rejected


# ---------------------------------------------------------------- B. end to end on the fixture models
N_E2E = 1000
LENGTH = 2
SETTINGS = {"t1.0-k4": dict(temperature=1.0, top_k=4, top_p=1.0), "t0.7-k8-p0.9": dict(temperature=0.7, top_k=8, top_p=0.9)}
# Held-out prompts where the path accepts >= 45% (measured), and where the draft is unsure of its first token:
# after "LibreOff" the restricted (intersection) draft is all but certain of "ice", so no drafting flaw shows.
PROMPTS = {"same-tokenizer": "これでこのデータソースが LibreOff", "onehot": "これでこのデータソースが LibreOff",
           "intersection": "使用する C コンパイラが"}


def exact_continuations(model, tokenizer, prompt, params: SamplingParams, length: int, eos: set[int]):
    """{continuation ids: probability} under the target's own processed sampling, by enumeration."""
    warpers = sampling.build_warpers(params)
    prompt_ids = tokenizer(prompt)["input_ids"]
    law: dict[tuple[int, ...], float] = {}

    def expand(prefix: tuple[int, ...], prob: float):
        if len(prefix) == length or (prefix and prefix[-1] in eos):
            law[prefix] = law.get(prefix, 0.0) + prob
            return
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt_ids + list(prefix)])).logits[0, -1:]
        probs = sampling.logits_to_probs(logits, warpers)[0].double()
        for token in torch.nonzero(probs).flatten().tolist():
            expand(prefix + (token,), prob * float(probs[token]))

    expand((), 1.0)
    return law


def sample_continuations(spec, setting, proposal, prompt, n=N_E2E):
    samples, drafted, accepted = [], 0, 0
    for seed in range(n):
        result = spec.generate(prompt, max_new_tokens=LENGTH, do_sample=True, seed=seed, proposal=proposal,
                               num_draft_tokens=2, adaptive=False, **setting)
        samples.append(tuple(result.token_ids))
        drafted += result.stats.drafted
        accepted += result.stats.accepted
    return samples, accepted / max(drafted, 1)


def flawed_draft(self, draft, k):
    """WRONG: the draft samples at a quarter of the temperature but reports q at the right one.

    (Colder, so that the sampled token stays inside q's top-k/top-p support and the flaw shows up in the
    distribution rather than as the loop's zero-probability consistency error.)"""
    ids, rows = [], []
    hot = sampling.build_warpers(dataclasses.replace(self.params, temperature=0.25 * self.params.temperature))
    for _ in range(k):
        logits = draft.forward(keep=1)
        q_row = sampling.logits_to_probs(logits, self.warpers)[0]
        sample_row = sampling.logits_to_probs(logits, hot)[0]
        if self.kind == "intersection" and not self.sync.pending:
            q_row, sample_row = q_row * self.mapped_mask, sample_row * self.mapped_mask
            if float(q_row.sum()) <= 0 or float(sample_row.sum()) <= 0:
                break  # as the real loop does: no mapped mass, no drafting
            q_row, sample_row = q_row / q_row.sum(), sample_row / sample_row.sum()
        noise = sampling.exponential_noise(sample_row.shape, self.draft_gen, sample_row.device)
        token = int(sampling.race(sample_row, noise))
        rows.append(q_row)
        draft.ids.append(token)
        ids.append(token)
    return ids, rows, False


_right_map = sampling.map_to_target


def half_wrong_map(draft_probs, draft_to_target, target_vocab_size):
    """WRONG: half of the proposal mass is scored through a token map shifted by one target id."""
    shifted = torch.where(draft_to_target >= 0, (draft_to_target + 1) % target_vocab_size, draft_to_target)
    return 0.5 * _right_map(draft_probs, draft_to_target, target_vocab_size) + 0.5 * _right_map(
        draft_probs, shifted, target_vocab_size
    )


def not_removed_distribution(target_probs, proposal_ids, num_accepted, proposal_probs=None):
    """WRONG: after a one-hot rejection, sample the target without removing the rejected guess."""
    return target_probs[num_accepted]


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("path", ["same-tokenizer", "onehot", "intersection"])
def test_end_to_end_sampling_matches_target(path, setting, bridged_spec, same_spec, ja_target, monkeypatch):
    spec = same_spec if path == "same-tokenizer" else bridged_spec
    proposal = "onehot" if path == "same-tokenizer" else path
    params = spec.sampling_params(do_sample=True, **SETTINGS[setting])
    prompt = PROMPTS[path]
    exact = exact_continuations(*ja_target, prompt, params, LENGTH, spec.target_eos)
    samples, acceptance = sample_continuations(spec, SETTINGS[setting], proposal, prompt)
    assert acceptance > 0.25, f"the draft is hardly used ({acceptance:.0%} accepted): the test would prove little"
    reference.assert_samples_match(samples, exact, ALPHA, f"{path} {setting}")

    if path == "onehot":
        monkeypatch.setattr(sampling, "next_token_distribution", not_removed_distribution)
    elif path == "intersection":
        monkeypatch.setattr(sampling, "map_to_target", half_wrong_map)
    else:
        monkeypatch.setattr(_Run, "_draft", flawed_draft)
    wrong, _ = sample_continuations(spec, SETTINGS[setting], proposal, prompt)
    counts, probs, _labels = reference.count_samples(wrong, exact)
    control = reference.chisquare_test(counts, probs / probs.sum(), ALPHA)
    assert control.rejected, f"negative control passed (p={control.pvalue:.3g}): the test has no power here"


def test_budget_count():
    """NUM_TESTS must count the statistical tests above, or ALPHA overspends the budget."""
    statistical = 4 + 3 * len(SETTINGS)
    assert statistical == NUM_TESTS
