"""reference.tree: the one-hot multi-candidate rule, checked by exact enumeration on tiny vocabularies.

Each law is computed from the mechanics (the acceptance probabilities and the residual), never from the
theorem, so these tests check the theorem: a node emits exactly p, and a whole tree's output, extended by
the target, has the target's law. The negative control (no renormalisation) must give a different law.
"""

import numpy as np
import pytest

from reference.tree import (
    children_of,
    extend_law,
    node_law,
    node_step,
    target_law,
    tree_law,
    tree_walk,
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
