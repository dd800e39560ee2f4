"""reference.tree: the multi-candidate rules, checked by exact enumeration on tiny vocabularies.

Each law is computed from the mechanics (the acceptance probabilities and the residual), never from the
theorem, so these tests check the theorems: a node emits exactly p, and a whole tree's output, extended by
the target, has the target's law. The negative controls (no renormalisation for the one-hot rule; three
wrong residual or proposal updates for the sampled root) must give a different law.
"""

import numpy as np
import pytest

from reference.tree import (
    children_of,
    extend_law,
    node_law,
    node_step,
    sampled_acceptance,
    sampled_node_law,
    sampled_node_law_given,
    sampled_node_step,
    sampled_root_tree_law,
    sampled_root_tree_walk,
    sampled_steps,
    target_law,
    tree_law,
    tree_walk,
    without_replacement_law,
)
from reference.tree import random_trie as reference_random_trie


def peaked(rng, vocab_size, concentration=0.5):
    return rng.dirichlet(np.full(vocab_size, concentration))


def random_lm(seed, vocab_size):
    """prob_fn(prefix): a fixed random next-token distribution per prefix (memoised, so it is a function)."""
    rng = np.random.default_rng(seed)
    table: dict[tuple[int, ...], np.ndarray] = {}

    def prob_fn(prefix):
        if prefix not in table:
            table[prefix] = peaked(rng, vocab_size)
        return table[prefix]

    return prob_fn


def random_trie(seed, vocab_size, nodes, max_children=3):
    return reference_random_trie(np.random.default_rng(seed), vocab_size, nodes, max_children)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_children", [1, 2, 3, 5])
def test_node_law_is_the_target_distribution(seed, num_children):
    rng = np.random.default_rng(seed)
    p = peaked(rng, 5)
    children = [int(t) for t in rng.permutation(5)[:num_children]]
    np.testing.assert_allclose(node_law(p, children), p, atol=1e-12)


def test_node_law_with_children_holding_all_mass_or_none():
    p = np.array([0.5, 0.5, 0.0, 0.0])
    np.testing.assert_allclose(node_law(p, [0, 1]), p, atol=1e-12)  # the residual is empty: never reached
    np.testing.assert_allclose(node_law(p, [2, 3]), p, atol=1e-12)  # zero-mass children: never accepted
    np.testing.assert_allclose(node_law(p, [2, 0, 3, 1]), p, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_node_law_without_renormalisation_is_wrong(seed):
    """The negative control: accepting c_j with p(c_j) instead of p'(c_j) under-accepts later children."""
    rng = np.random.default_rng(seed)
    p = peaked(rng, 5)
    children = [int(t) for t in np.argsort(-p)[:3]]
    assert np.abs(node_law(p, children, renormalize=False) - p).max() > 1e-2


@pytest.mark.parametrize("seed, vocab_size, nodes", [(0, 3, 4), (1, 4, 6), (2, 4, 9), (3, 5, 8)])
def test_tree_output_extended_by_the_target_has_the_target_law(seed, vocab_size, nodes):
    tokens, parents = random_trie(seed, vocab_size, nodes)
    prob_fn = random_lm(seed + 100, vocab_size)
    depth = max(len(_path(parents, n)) for n in range(len(parents)))
    length = depth + 1
    got = extend_law(tree_law(tokens, parents, prob_fn), prob_fn, length)
    want = target_law(prob_fn, length)
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[s] for s in want], [want[s] for s in want], atol=1e-12)
    assert abs(sum(got.values()) - 1.0) < 1e-12


@pytest.mark.parametrize("seed", range(3))
def test_tree_law_without_renormalisation_differs(seed):
    tokens, parents = random_trie(seed, 4, 7)
    prob_fn = random_lm(seed + 200, 4)
    length = 1 + max(len(_path(parents, n)) for n in range(len(parents)))
    wrong = extend_law(tree_law(tokens, parents, prob_fn, renormalize=False), prob_fn, length)
    want = target_law(prob_fn, length)
    assert max(abs(wrong.get(s, 0.0) - want[s]) for s in want) > 1e-3


def test_node_step_follows_the_rule_exactly():
    p = np.array([0.2, 0.3, 0.5])
    assert node_step(p, [2, 1], [0.99, 0.0]) == 1  # u * (1 - 0.5) = 0 < 0.3
    assert node_step(p, [2, 1], [0.99, 0.59]) == 1  # 0.59 * 0.5 = 0.295 < 0.3
    assert node_step(p, [2, 1], [0.99, 0.61]) is None  # 0.61 * 0.5 = 0.305 >= 0.3
    assert node_step(p, [2, 1], [0.4, 0.9]) == 0  # 0.4 < 0.5
    assert node_step(p, [2, 1], [0.99, 0.59], renormalize=False) is None  # control: 0.59 >= 0.3


def test_tree_walk_descends_then_draws_from_the_residual():
    tokens, parents = [-1, 1, 2, 0], [-1, 0, 1, 0]  # root -> {1: token 1 -> {2: token 2}, 3: token 0}
    probs = np.array([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [1 / 3, 1 / 3, 1 / 3]])
    node_probs = np.stack([probs[0], probs[1], probs[2], probs[2]])
    uniforms = np.array([[0.5, 0.5], [0.9, 0.0], [0.0, 0.0], [0.0, 0.0]])
    noise = np.array([1.0, 0.5, 1e-9])  # token 2 would win any race it is in; then token 1 (0.2/0.5 > 0.2/1)
    path, token = tree_walk(tokens, parents, node_probs, uniforms, noise)
    assert path == [1]  # root: 0.5 < 0.6 accepts token 1; node 1: 0.9 >= 0.6 rejects token 2
    assert token == 1  # node 1's residual is [0.2, 0.2, 0]: token 2 (its rejected child) is out of the race
    with pytest.raises(ValueError, match="earlier node"):
        children_of([-1, 2, 0])


def _path(parents, node):
    out = []
    while node > 0:
        out.append(node)
        node = parents[node]
    return out


# ---------------------------------------------------------------- a sampled root (recursive rejection with q)
SAMPLED_FLAWS = ("keep_p", "onehot_residual", "no_renormalize")


def with_zeros(rng, vocab_size, zeros):
    """A peaked distribution with `zeros` tokens of probability 0 (tokens the target or the draft never emits)."""
    d = peaked(rng, vocab_size)
    d[rng.permutation(vocab_size)[:zeros]] = 0.0
    return d / d.sum()


def test_without_replacement_law_draws_distinct_tokens_in_order():
    q = np.array([0.5, 0.3, 0.2, 0.0])
    law = without_replacement_law(q, 2)
    assert abs(law[(0, 1)] - 0.5 * 0.3 / 0.5) < 1e-12 and abs(law[(1, 0)] - 0.3 * 0.5 / 0.7) < 1e-12
    assert all(len(set(seq)) == len(seq) == 2 and 3 not in seq for seq in law)
    assert abs(sum(law.values()) - 1.0) < 1e-12
    assert without_replacement_law(np.array([0.0, 1.0]), 3) == {(1,): 1.0}  # q runs out: fewer children


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_sampled_node_law_is_the_target_distribution(seed, count):
    """Averaged over children drawn from q without replacement, a sampled node emits exactly p, also where p
    or q puts no mass on some tokens."""
    rng = np.random.default_rng(seed)
    p, q = with_zeros(rng, 5, seed % 2), with_zeros(rng, 5, seed % 3)
    np.testing.assert_allclose(sampled_node_law(p, q, count), p, atol=1e-12)


def test_sampled_node_law_holds_only_on_average_over_the_draws():
    """For one fixed list of children the law is not p: the children must really be drawn from q (nothing may
    pick or drop them by their own value), which is why xtokspec never prunes a sampled child."""
    p, q = np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.4, 0.3, 0.2, 0.1])
    assert np.abs(sampled_node_law_given(p, q, [0, 1]) - p).max() > 0.05
    np.testing.assert_allclose(sampled_node_law(p, q, 2), p, atol=1e-12)


@pytest.mark.parametrize("flaw", SAMPLED_FLAWS)
@pytest.mark.parametrize("seed", range(3))
def test_sampled_node_law_with_a_flawed_update_is_wrong(flaw, seed):
    """The negative controls: each wrong update of p or q changes the law of a node with 3 children."""
    rng = np.random.default_rng(seed)
    p, q = peaked(rng, 5), peaked(rng, 5)
    assert np.abs(sampled_node_law(p, q, 3, flaw) - p).max() > 1e-3


def test_sampled_acceptance_is_the_intersection_for_one_child_and_grows_with_more():
    rng = np.random.default_rng(0)
    for _ in range(20):
        p, q = peaked(rng, 6), peaked(rng, 6)
        rates = [sampled_acceptance(p, q, m) for m in range(1, 5)]
        assert abs(rates[0] - np.minimum(p, q).sum()) < 1e-12
        assert all(b >= a - 1e-12 for a, b in zip(rates, rates[1:], strict=False))
    p = peaked(rng, 6)
    assert abs(sampled_acceptance(p, p, 1) - 1.0) < 1e-12  # a draft equal to the target: always accepted


def test_a_flat_target_accepts_more_sampled_children_than_its_top_ones():
    """Why the rule exists: with a flat target and a draft that follows it, m children drawn from q are
    accepted far more often than the m likeliest ones under the one-hot rule (their mass p(c_1..c_m))."""
    p = np.full(12, 1 / 12)
    q = p * np.linspace(0.8, 1.2, 12)
    q /= q.sum()
    top = np.argsort(-q)[:4]
    assert sampled_acceptance(p, q, 4) > 0.95 > 0.5 > p[top].sum()


def test_sampled_node_step_follows_the_rule_exactly():
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.6, 0.2])
    tests, rest = sampled_steps(p, q, [1, 2])
    # child 1: p_1 = 0.3, q_1 = 0.6. p_2 = norm(max(0, p - q)) = [1, 0, 0]; q_2 = [0.5, 0, 0.5]
    assert tests == [(0.3, 0.6), (0.0, 0.5)]
    np.testing.assert_allclose(rest, [1.0, 0.0, 0.0])  # max(0, p_2 - q_2) = [0.5, 0, 0], normalised
    assert sampled_node_step(p, q, [1, 2], [0.49, 0.0])[0] == 0  # 0.49 * 0.6 = 0.294 < 0.3
    assert sampled_node_step(p, q, [1, 2], [0.51, 0.0])[0] is None  # 0.306 >= 0.3; then 0 * 0.5 < 0 fails
    with pytest.raises(ValueError, match="q = 0"):
        sampled_steps(p, np.array([1.0, 0.0, 0.0]), [1])


def random_subtrees(seed, vocab_size, nodes):
    """subtree_fn(child token) -> a random trie under that child (node 0: the child), fixed per token."""
    tries = {t: random_trie(seed * 10 + t, vocab_size, nodes) for t in range(vocab_size)}
    return lambda token: tries[token]


@pytest.mark.parametrize("seed, vocab_size, count, nodes", [(0, 4, 2, 2), (1, 4, 3, 2), (2, 4, 2, 2), (3, 4, 3, 2)])
def test_tree_with_a_sampled_root_extended_by_the_target_has_the_target_law(seed, vocab_size, count, nodes):
    """The root's children drawn from q without replacement, a one-hot subtree under each (a function of the
    child): the emitted sequence, extended by the target, has the target's law; each flawed update does not."""
    prob_fn = random_lm(seed + 300, vocab_size)
    root_q = peaked(np.random.default_rng(seed + 400), vocab_size)
    subtree_fn = random_subtrees(seed, vocab_size, nodes)
    length = 2 + max(len(_path(subtree_fn(t)[1], n)) for t in range(vocab_size) for n in range(nodes + 1))
    want = target_law(prob_fn, length)
    got = extend_law(sampled_root_tree_law(root_q, count, subtree_fn, prob_fn), prob_fn, length)
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[s] for s in want], [want[s] for s in want], atol=1e-12)
    for flaw in SAMPLED_FLAWS:
        wrong = extend_law(sampled_root_tree_law(root_q, count, subtree_fn, prob_fn, flaw), prob_fn, length)
        assert max(abs(wrong.get(s, 0.0) - want[s]) for s in want) > 1e-4, flaw


def test_sampled_root_walk_tests_the_root_against_q_and_the_rest_one_hot():
    tokens, parents = [-1, 1, 2, 0], [-1, 0, 1, 0]  # root -> {1: token 1 -> {2: token 2}, 3: token 0}
    probs = np.array([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [1 / 3, 1 / 3, 1 / 3]])
    node_probs = np.stack([probs[0], probs[1], probs[2], probs[2]])
    root_q = np.array([0.2, 0.7, 0.1])
    noise = np.array([1.0, 0.5, 1e-9])
    # root: child token 1 has p 0.6, q 0.7: u = 0.8 -> 0.56 < 0.6 accepts; node 1: 0.9 >= 0.6 rejects token 2
    path, token = sampled_root_tree_walk(tokens, parents, node_probs, root_q, np.array([[0.8, 0.5]] + [[0.9, 0.0]] * 3), noise)
    assert (path, token) == ([1], 1)
    # u = 0.9 -> 0.63 >= 0.6 rejects; p_2 = norm(max(0, p - q)) = [0, 0, 1]; q_2 = [2/3, 0, 1/3]: token 0 has
    # p_2 = 0 and is rejected; the residual max(0, p_2 - q_2) = [0, 0, 2/3] draws token 2
    path, token = sampled_root_tree_walk(tokens, parents, node_probs, root_q, np.array([[0.9, 0.0]] * 4), noise)
    assert (path, token) == ([], 2)
