"""xtokspec's torch sampler against the NumPy reference: exact parity on the same random numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reference
from xtokspec.decode import sampling
from xtokspec.types import SamplingParams, XTokSpecError

SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.5, 0, 0.8), (1.0, 7, 0.6), (2.0, 1, 1.0)]


def torch_block(p, q, draft, uniforms, noise, onehot: bool):
    """xtokspec's block step (the functions the decoding loop calls) on float64 tensors."""
    p_t, ids = torch.from_numpy(p), torch.from_numpy(draft)
    q_t = None if onehot else torch.from_numpy(q)
    n = sampling.count_accepted(p_t, ids, torch.from_numpy(uniforms), q_t)
    dist = sampling.next_token_distribution(p_t, ids, n, q_t)
    return n, int(sampling.race(dist, torch.from_numpy(noise[n])))


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_logit_processing_matches_reference(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    warpers = sampling.build_warpers(params)
    for _ in range(50):
        logits = rng.normal(size=40) * 3
        got = sampling.logits_to_probs(torch.from_numpy(logits)[None], warpers)[0].double().numpy()
        want = reference.process_logits(logits, temperature, top_k, top_p)
        np.testing.assert_allclose(got, want, atol=2e-6)
        np.testing.assert_array_equal(got > 0, want > 0)  # same support, exactly


@pytest.mark.parametrize("onehot", [False, True])
def test_block_parity_with_reference(onehot):
    """Same p, q, draft tokens, uniforms and noise -> the same accepted / recovered / bonus tokens."""
    rng = np.random.default_rng(1)
    outcomes = set()
    for trial in range(400):
        k, v = int(rng.integers(1, 6)), int(rng.integers(2, 12))
        p = rng.dirichlet(np.full(v, 0.5), size=k + 1)
        q = rng.dirichlet(np.full(v, 0.5), size=k)
        draft = np.array([rng.choice(v, p=row) for row in q])
        uniforms, noise = rng.random(k), rng.exponential(size=(k + 1, v))
        ref = reference.onehot_block(p, draft, uniforms, noise) if onehot else reference.speculative_block(
            p, q, draft, uniforms, noise
        )
        n, token = torch_block(p, q, draft, uniforms, noise, onehot)
        assert (n, token) == (ref.num_accepted, ref.tokens[-1]), f"trial {trial}"
        outcomes.add("bonus" if ref.bonus is not None else "recovered")
    assert outcomes == {"bonus", "recovered"}  # both branches were exercised


def test_token_map_parity_with_reference():
    rng = np.random.default_rng(2)
    for _ in range(100):
        vd, vt = 12, 9
        token_map = rng.integers(-1, vt, size=vd)
        token_map[0] = 3  # at least one mapped id
        draft_probs = rng.dirichlet(np.ones(vd), size=3)
        got = sampling.map_to_target(torch.from_numpy(draft_probs), torch.from_numpy(token_map), vt).numpy()
        for row, want_row in zip(got, draft_probs, strict=True):
            want, _mass = reference.map_proposal(want_row, token_map, vt)
            np.testing.assert_allclose(row, want, atol=1e-12)


def test_map_with_no_mapped_mass_is_an_error():
    probs = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    with pytest.raises(XTokSpecError, match="no probability on tokens that exist"):
        sampling.map_to_target(probs, torch.tensor([0, -1]), 3)


def test_verify_greedy_accepts_the_argmax_prefix():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])  # argmax 1, 0, 2
    assert sampling.verify_greedy(logits, torch.tensor([1, 0])) == (2, 2)  # both accepted + bonus
    assert sampling.verify_greedy(logits, torch.tensor([1, 2])) == (1, 0)  # recovered at position 1
    assert sampling.verify_greedy(logits, torch.tensor([0, 0])) == (0, 1)
    assert sampling.verify_greedy(logits[:1], torch.tensor([], dtype=torch.long)) == (0, 1)


def test_bad_logits_are_named():
    warpers = sampling.build_warpers(SamplingParams(do_sample=True))
    with pytest.raises(XTokSpecError, match="no finite value"):
        sampling.logits_to_probs(torch.full((1, 4), float("-inf")), warpers)
    with pytest.raises(XTokSpecError, match="NaN"):
        sampling.logits_to_probs(torch.tensor([[0.0, float("nan")]]), warpers)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(temperature=float("nan")), "finite"),
        (dict(top_p=0.0), "top_p must be in"),
        (dict(top_p=1.5), "top_p must be in"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
    ],
)
def test_invalid_sampling_parameters(kwargs, match):
    with pytest.raises(XTokSpecError, match=match):
        SamplingParams(do_sample=True, **kwargs)


def test_first_position_acceptance_matches_enumeration():
    """proposal="auto" compares the kinds by these two chances; check both against the defining sums and
    against the reference's mapped proposal, on random distributions with unmapped ids and shared targets."""
    rng = np.random.default_rng(5)
    vd, vt = 9, 7
    for _ in range(20):
        p = rng.dirichlet(np.full(vt, 0.4))
        q = rng.dirichlet(np.full(vd, 0.4))
        token_map = rng.integers(-1, vt, vd)  # -1: unmapped; repeats: several draft ids share a target id
        token_map[0] = 2  # at least one mapped id
        first = rng.integers(-1, vt, vd)
        proposal, _ = reference.map_proposal(q, token_map, vt)
        want_intersection = np.minimum(p, proposal).sum()
        want_onehot = sum(q[d] * p[first[d]] for d in range(vd) if first[d] >= 0)
        pt, qt = torch.tensor(p), torch.tensor(q)
        got_i = sampling.intersection_acceptance(pt, qt, torch.tensor(token_map))
        got_o = sampling.onehot_acceptance(pt, qt, torch.tensor(first))
        assert got_i.dim() == 0 and got_o.dim() == 0
        assert float(got_i) == pytest.approx(want_intersection, abs=1e-12)
        assert float(got_o) == pytest.approx(want_onehot, abs=1e-12)
    # the draft's mass all on unmapped ids: the intersection proposal does not exist, and is never accepted
    none_mapped = torch.tensor([-1, -1, 0])
    assert float(sampling.intersection_acceptance(torch.tensor([0.5, 0.5]), torch.tensor([0.6, 0.4, 0.0]),
                                                  none_mapped)) == 0.0


def test_a_proposal_the_draft_could_not_have_drawn_is_an_error_and_p_equal_q_falls_back_to_p():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 1.0, 0.0]])  # the proposal, id 0, has q = 0: the token map is inconsistent
    with pytest.raises(XTokSpecError, match="zero proposal probability"):
        sampling.count_accepted(p, torch.tensor([0]), torch.tensor([0.5]), q)
    q = torch.tensor([[0.5, 0.5, 0.0]])  # q == p: accepted surely, unless rounding rejects; then p itself
    assert sampling.count_accepted(p, torch.tensor([0]), torch.tensor([0.99]), q) == 1
    torch.testing.assert_close(sampling.next_token_distribution(p, torch.tensor([0]), 0, q), p[0])
    torch.testing.assert_close(sampling.next_token_distribution(p, torch.tensor([0]), 0, None),
                               torch.tensor([0.0, 0.5, 0.0]))
