"""reference.rejection: exact equalities on hand-worked blocks, the one-hot variant, the token map."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.rejection import BlockResult, map_proposal, onehot_block, sample_race, speculative_block


def random_tables(rng, num_draft_tokens, vocab_size, concentration=0.5):
    """p (K+1, V) and q (K, V) with rows ~ Dirichlet; small concentration gives peaked rows."""
    alpha = np.full(vocab_size, concentration)
    return rng.dirichlet(alpha, num_draft_tokens + 1), rng.dirichlet(alpha, num_draft_tokens)


def test_acceptance_is_strict_u_times_q_below_p():
    target = np.array([[0.3, 0.7], [0.5, 0.5]])
    proposal = np.array([[0.6, 0.4]])
    noise = np.ones((2, 2))
    # p/q = 0.5 at token 0: u = 0.49 accepts, u = 0.5 rejects (0.5 * 0.6 < 0.3 is false).
    assert speculative_block(target, proposal, [0], [0.49], noise).num_accepted == 1
    assert speculative_block(target, proposal, [0], [0.5], noise).num_accepted == 0


def test_rejection_recovers_from_the_residual_only():
    target = np.array([[0.2, 0.8, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    proposal = np.array([[0.6, 0.2, 0.2]])
    # residual max(0, p - q) = (0, 0.6, 0): token 1 whatever the noise, even noise favouring others.
    noise = np.array([[1e-9, 5.0, 1e-9], [1.0, 1.0, 1.0]])
    result = speculative_block(target, proposal, [0], [0.99], noise)
    assert result == BlockResult(tokens=[1], num_accepted=0, recovered=1, bonus=None)


def test_all_accepted_adds_a_bonus_from_the_last_row_and_its_noise():
    target = np.array([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    proposal = target[:2]
    noise = np.array([[1.0, 1.0], [1.0, 1.0], [3.0, 1.0]])  # race on row K: 0.5/3 < 0.5/1 -> token 1
    result = speculative_block(target, proposal, [0, 0], [0.9, 0.9], noise)
    assert result == BlockResult(tokens=[0, 0, 1], num_accepted=2, recovered=None, bonus=1)


def test_stops_at_the_first_rejection():
    target = np.array([[0.1, 0.9], [0.9, 0.1], [0.5, 0.5]])
    proposal = np.array([[0.9, 0.1], [0.9, 0.1]])
    result = speculative_block(target, proposal, [1, 0], [0.5, 0.5], np.ones((3, 2)))
    assert result.tokens == [1, 0, 0] and result.bonus == 0
    result = speculative_block(target, proposal, [0, 0], [0.5, 0.0], np.ones((3, 2)))
    assert result == BlockResult(tokens=[1], num_accepted=0, recovered=1, bonus=None)


def test_onehot_block_equals_speculative_block_with_onehot_proposal():
    rng = np.random.default_rng(1)
    for _ in range(400):
        num_draft_tokens, vocab_size = rng.integers(1, 5), rng.integers(2, 7)
        target, _ = random_tables(rng, num_draft_tokens, vocab_size, concentration=0.3)
        draft_tokens = rng.integers(0, vocab_size, num_draft_tokens)
        proposal = np.eye(vocab_size)[draft_tokens]  # (K, V) one-hot
        uniforms = rng.random(num_draft_tokens)
        noise = rng.standard_exponential((num_draft_tokens + 1, vocab_size))
        assert onehot_block(target, draft_tokens, uniforms, noise) == speculative_block(
            target, proposal, draft_tokens, uniforms, noise
        )


def test_identical_distributions_accept_everything():
    rng = np.random.default_rng(2)
    target, _ = random_tables(rng, 3, 5)
    draft_tokens = [int(rng.choice(5, p=row)) for row in target[:3]]
    result = speculative_block(
        target, target[:3], draft_tokens, rng.random(3), rng.standard_exponential((4, 5))
    )
    assert result.num_accepted == 3 and result.tokens[:3] == draft_tokens


def test_sample_race_is_argmax_of_log_probs_minus_log_noise_and_scale_free():
    rng = np.random.default_rng(3)
    for _ in range(200):
        probs = rng.dirichlet(np.full(6, 0.5)) * (rng.random(6) > 0.3)
        if probs.sum() == 0:
            continue
        noise = rng.standard_exponential(6)
        token = sample_race(probs, noise)
        with np.errstate(divide="ignore"):
            assert token == int(np.argmax(np.log(probs) - np.log(noise)))
        assert token == sample_race(probs * 7.5, noise)
        assert probs[token] > 0


def test_sample_race_zero_probability_never_wins():
    assert sample_race(np.array([0.0, 1e-300, 0.0]), np.array([1e-300, 1e9, 0.0])) == 1
    with pytest.raises(ValueError, match="positive probability"):
        sample_race(np.zeros(3), np.ones(3))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(proposal=np.array([[0.0, 1.0]])), "proposal probability 0"),
        (lambda a: a.update(uniforms=np.array([1.0])), r"\[0, 1\)"),
        (lambda a: a.update(draft_tokens=np.array([2])), "target-vocabulary ids"),
        (lambda a: a.update(target=np.array([[0.5, 0.5]])), r"\(K\+1, V\)"),
        (lambda a: a.update(proposal=np.array([[0.5, 0.6]])), "sum to 1"),
        (lambda a: a.update(target=np.array([[2.0, -1.0], [0.5, 0.5]])), "non-negative"),
        (lambda a: a.update(noise=np.ones((1, 2))), "noise"),
    ],
)
def test_invalid_block_inputs_raise(change, message):
    args = {
        "target": np.array([[0.5, 0.5], [0.5, 0.5]]),
        "proposal": np.array([[0.5, 0.5]]),
        "draft_tokens": np.array([0]),
        "uniforms": np.array([0.5]),
        "noise": np.ones((2, 2)),
    }
    change(args)
    with pytest.raises(ValueError, match=message):
        speculative_block(
            args["target"], args["proposal"], args["draft_tokens"], args["uniforms"], args["noise"]
        )


def test_map_proposal_restricts_renormalizes_and_scatter_adds():
    draft_probs = np.array([0.1, 0.2, 0.3, 0.25, 0.15])
    token_map = np.array([2, -1, 0, 2, 1])  # draft ids 0 and 3 both map to target id 2
    proposal, mapped_mass = map_proposal(draft_probs, token_map, target_vocab_size=4)
    assert mapped_mass == pytest.approx(0.8)
    np.testing.assert_allclose(proposal, [0.3 / 0.8, 0.15 / 0.8, 0.35 / 0.8, 0.0])


@pytest.mark.parametrize(
    "draft_probs, token_map, message",
    [
        ([0.0, 1.0], [0, -1], "no probability on mapped tokens"),
        ([0.5, 0.5], [0, 3], r"\[0, 3\)"),
        ([0.5, 0.5], [0, -2], "unmapped"),
        ([0.5, 0.5], [0.0, 1.0], "integers"),
        ([0.5, 0.5], [0], r"\(Vd,\)"),
    ],
)
def test_map_proposal_invalid_inputs_raise(draft_probs, token_map, message):
    with pytest.raises(ValueError, match=message):
        map_proposal(np.array(draft_probs), np.array(token_map), target_vocab_size=3)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4), st.integers(2, 6))
def test_block_structure(seed, num_draft_tokens, vocab_size):
    """Accepted tokens are a prefix of the draft; a recovered token lies in the residual's support."""
    rng = np.random.default_rng(seed)
    target, proposal = random_tables(rng, num_draft_tokens, vocab_size, concentration=0.3)
    draft_tokens = [int(rng.choice(vocab_size, p=row)) for row in proposal]
    result = speculative_block(
        target,
        proposal,
        draft_tokens,
        rng.random(num_draft_tokens),
        rng.standard_exponential((num_draft_tokens + 1, vocab_size)),
    )
    n = result.num_accepted
    assert result.tokens[:n] == draft_tokens[:n] and len(result.tokens) == n + 1
    assert (result.recovered is None) != (result.bonus is None)
    if result.recovered is not None:
        assert target[n, result.recovered] > proposal[n, result.recovered]
    else:
        assert n == num_draft_tokens and target[-1, result.bonus] > 0
