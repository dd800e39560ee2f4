"""Statistical tests of the reference samplers against exact distributions, each with a negative control.

Every test runs a correct sampler and a deliberately wrong one on the same sample size and checks
that the correct one passes the chi-square test at ALPHA while the wrong one fails it (p < ALPHA),
so no test here can pass by having no power.

Budget (see reference/chisquare.py): the project allows a false-failure probability of 1e-3 for a
full tox run. This file claims REFERENCE_BUDGET = 1e-4 of it for NUM_STATISTICAL_TESTS = 14 tests
(counting parametrizations), so each correct-sampler check runs at
ALPHA = 1e-4 / 14 = 7.1e-6. The negative controls do not spend budget: they are expected to fail,
and a control that passed would be a test failure caused by too little power, not by chance on
a correct sampler. ``test_statistical_test_count_matches_the_budget`` keeps the count honest.

Fixed seeds: each test draws from ``np.random.default_rng(seed)``, so results are reproducible.
Models are peaked (Dirichlet concentration < 1), because near-uniform distributions hide errors.
"""

import inspect
import math
import sys

import numpy as np
import pytest
from scipy import stats

from reference.chisquare import (
    assert_same_distribution,
    chisquare_test,
    count_samples,
    format_result,
    per_test_alpha,
)
from reference.exact import (
    TableLM,
    accepted_count_distribution,
    block_output_distribution,
    sequence_distribution,
    speculative_generate,
    truncate_at_eos,
)
from reference.keyed import coupled_match_law, keyed_sample
from reference.rejection import map_proposal, onehot_block, sample_race, speculative_block
from reference.tree import sampled_root_tree_law, sampled_root_tree_walk

REFERENCE_BUDGET = 1e-4  # this file's share of chisquare.FALSE_FAILURE_BUDGET (1e-3)
NUM_STATISTICAL_TESTS = 14
ALPHA = per_test_alpha(NUM_STATISTICAL_TESTS, budget=REFERENCE_BUDGET)

NUM_DRAFT_TOKENS, VOCAB_SIZE = 3, 6


def check_with_control(exact_probs, correct_counts, wrong_counts, label, bin_labels=None):
    """The correct sampler passes at ALPHA; the wrong one (negative control) must fail the same check."""
    assert_same_distribution(correct_counts, exact_probs, ALPHA, f"{label}, correct sampler", bin_labels)
    control = chisquare_test(wrong_counts, exact_probs, ALPHA)
    assert control.rejected, format_result(control, f"{label}, negative control lacks power", bin_labels)


def check_samples_with_control(exact_law, correct_samples, wrong_samples, label):
    """``check_with_control`` for hashable samples (token tuples) against {outcome: prob}."""
    correct_counts, probs, bin_labels = count_samples(correct_samples, exact_law)
    wrong_counts, _, _ = count_samples(wrong_samples, exact_law)
    check_with_control(probs / probs.sum(), correct_counts, wrong_counts, label, bin_labels)


# --- wrong re-implementations (negative controls) -------------------------------------------------


def block_recovering_from_target(target_probs, proposal_probs, draft_tokens, uniforms, noise):
    """WRONG: at the first rejection, samples p_i instead of the residual max(0, p_i - q_i)."""
    for i, token in enumerate(draft_tokens):
        if uniforms[i] * proposal_probs[i, token] >= target_probs[i, token]:
            return list(draft_tokens[:i]) + [sample_race(target_probs[i], noise[i])]
    return list(draft_tokens) + [sample_race(target_probs[-1], noise[-1])]


def block_with_letters_swapped(target_probs, proposal_probs, draft_tokens, uniforms, noise):
    """WRONG: reads Chen et al.'s letters as Leviathan's, accepting iff u < q/p."""
    swapped = np.concatenate([proposal_probs, target_probs[-1:]])
    return speculative_block(swapped, target_probs[:-1], draft_tokens, uniforms, noise).tokens


def onehot_block_keeping_the_guess(target_probs, draft_tokens, uniforms, noise):
    """WRONG: after rejecting x_i, samples p_i without removing x_i."""
    for i, token in enumerate(draft_tokens):
        if uniforms[i] >= target_probs[i, token]:
            return list(draft_tokens[:i]) + [sample_race(target_probs[i], noise[i])]
    return list(draft_tokens) + [sample_race(target_probs[-1], noise[-1])]


def tempered(probs, temperature):
    weights = probs ** (1.0 / temperature)
    return weights / weights.sum(axis=-1, keepdims=True)


# --- fixed-table blocks ---------------------------------------------------------------------------


def block_tables(seed):
    """Peaked p (K+1, V) and a q (K, V) that is a noisy copy of p, so acceptance is partial."""
    rng = np.random.default_rng(seed)
    target = rng.dirichlet(np.full(VOCAB_SIZE, 0.4), NUM_DRAFT_TOKENS + 1)
    proposal = 0.5 * target[:-1] + 0.5 * rng.dirichlet(np.full(VOCAB_SIZE, 0.4), NUM_DRAFT_TOKENS)
    return target, proposal


def block_randomness(rng, proposal, num_blocks):
    """Draft tokens x_i ~ q_i by race (N, K), uniforms (N, K), noise (N, K+1, V)."""
    draft_noise = rng.standard_exponential((num_blocks,) + proposal.shape)
    draft_tokens = np.argmax(proposal / draft_noise, axis=-1)
    uniforms = rng.random((num_blocks, proposal.shape[0]))
    noise = rng.standard_exponential((num_blocks, proposal.shape[0] + 1, proposal.shape[1]))
    return draft_tokens, uniforms, noise


def run_blocks(block, target, proposal, randomness):
    return [block(target, proposal, *args) for args in zip(*randomness, strict=True)]


def token_at(outputs, position):
    """(N,) token at ``position`` of each block output, or V where the block was shorter."""
    return np.array([tokens[position] if position < len(tokens) else VOCAB_SIZE for tokens in outputs])


def correct_block(*args):
    return speculative_block(*args).tokens


@pytest.mark.stats
@pytest.mark.parametrize("position", [0, 1])
def test_block_output_token_matches_exact(position):
    target, proposal = block_tables(seed=10)
    randomness = block_randomness(np.random.default_rng(11 + position), proposal, num_blocks=4000)
    exact = block_output_distribution(target, proposal)[position]  # (V+1,), last bin: block ended
    correct, wrong = (
        np.bincount(
            token_at(run_blocks(block, target, proposal, randomness), position), minlength=VOCAB_SIZE + 1
        )
        for block in (correct_block, block_recovering_from_target)
    )
    check_with_control(exact, correct, wrong, f"block output token {position} (control: recovered from p)")


@pytest.mark.stats
def test_block_accepted_count_matches_exact():
    target, proposal = block_tables(seed=20)
    randomness = block_randomness(np.random.default_rng(21), proposal, num_blocks=4000)
    exact = accepted_count_distribution(target, proposal)  # (K+1,)
    correct, wrong = (
        np.bincount(
            [len(tokens) - 1 for tokens in run_blocks(block, target, proposal, randomness)],
            minlength=NUM_DRAFT_TOKENS + 1,
        )
        for block in (correct_block, block_with_letters_swapped)
    )
    check_with_control(exact, correct, wrong, "accepted count (control: p and q swapped)")


@pytest.mark.stats
def test_onehot_block_first_token_matches_target():
    target, proposal = block_tables(seed=30)
    draft_tokens, uniforms, noise = block_randomness(np.random.default_rng(31), proposal, num_blocks=6000)
    correct, wrong = (
        np.bincount(
            [block(target, *args)[0] for args in zip(draft_tokens, uniforms, noise, strict=True)],
            minlength=VOCAB_SIZE,
        )
        for block in (lambda *a: onehot_block(*a).tokens, onehot_block_keeping_the_guess)
    )
    check_with_control(target[0], correct, wrong, "one-hot block first token (control: guess kept)")


@pytest.mark.stats
def test_mapped_proposal_block_first_token_matches_target():
    rng = np.random.default_rng(40)
    draft_vocab_size = 8
    token_map = np.array([0, 1, 2, 3, 4, 5, 2, -1])  # draft ids 2 and 6 share target id 2; id 7 unmapped
    shifted_map = np.roll(token_map, 1)  # off by one draft id (e.g. a forgotten BOS offset)
    target = rng.dirichlet(np.full(VOCAB_SIZE, 0.4), NUM_DRAFT_TOKENS + 1)
    draft_probs = rng.dirichlet(np.full(draft_vocab_size, 0.4), NUM_DRAFT_TOKENS)  # (K, Vd)
    proposal = np.stack([map_proposal(row, token_map, VOCAB_SIZE)[0] for row in draft_probs])
    wrong_proposal = np.stack([map_proposal(row, shifted_map, VOCAB_SIZE)[0] for row in draft_probs])
    # The draft samples its own ids from the restriction to mapped ids; the correct map moves them.
    restricted = draft_probs * (token_map >= 0)
    num_blocks = 4000
    draft_ids = np.argmax(restricted / rng.standard_exponential((num_blocks,) + restricted.shape), axis=-1)
    uniforms = rng.random((num_blocks, NUM_DRAFT_TOKENS))
    noise = rng.standard_exponential((num_blocks, NUM_DRAFT_TOKENS + 1, VOCAB_SIZE))
    randomness = (token_map[draft_ids], uniforms, noise)
    correct, wrong = (
        np.bincount(token_at(run_blocks(correct_block, target, q, randomness), 0), minlength=VOCAB_SIZE + 1)
        for q in (proposal, wrong_proposal)
    )
    check_with_control(
        np.append(target[0], 0.0), correct, wrong, "mapped-proposal first token (control: map shifted)"
    )


# --- full speculative decoding over table language models -----------------------------------------

EOS, LM_VOCAB_SIZE, PREFIX, LENGTH = 0, 4, (1,), 3


def table_lms(seed):
    """Peaked order-1 target over 4 tokens with a small EOS probability, and a draft near it."""
    rng = np.random.default_rng(seed)
    rows = rng.dirichlet(np.full(LM_VOCAB_SIZE, 0.5), LM_VOCAB_SIZE)
    rows[:, EOS] = 0.1 * rows[:, EOS]  # keep most sequences full-length
    target = rows / rows.sum(axis=-1, keepdims=True)
    noisy = rng.dirichlet(np.full(LM_VOCAB_SIZE, 0.5), LM_VOCAB_SIZE)
    draft = 0.6 * target + 0.4 * noisy
    return TableLM(target, EOS), TableLM(draft, EOS)


def assert_drafts_partly_accepted(target_lm, draft_lm):
    """Both branches must be exercised: a sampler ignoring the draft would pass trivially."""
    acceptance = np.minimum(target_lm.table, draft_lm.table).sum(axis=-1)  # alpha per context
    assert 0.5 < acceptance.mean() < 0.95, acceptance


def generate_with_tempered_draft(target_lm, draft_lm, prefix, length, num_draft_tokens, rng, temperature=2.0):
    """WRONG: draft tokens are sampled from the draft at T=1 but scored with q at ``temperature``."""
    generated: list[int] = []
    while len(generated) < length and EOS not in generated:
        context = list(prefix) + generated
        draft_tokens, proposal_probs = [], []
        for _ in range(num_draft_tokens):
            q = draft_lm.next_probs(context + draft_tokens)
            draft_tokens.append(sample_race(q, rng.standard_exponential(LM_VOCAB_SIZE)))
            proposal_probs.append(tempered(q, temperature))
        target_probs = np.stack(
            [target_lm.next_probs(context + draft_tokens[:i]) for i in range(num_draft_tokens + 1)]
        )
        uniforms = rng.random(num_draft_tokens)
        noise = rng.standard_exponential((num_draft_tokens + 1, LM_VOCAB_SIZE))
        generated += speculative_block(
            target_probs, np.stack(proposal_probs), draft_tokens, uniforms, noise
        ).tokens
    return truncate_at_eos(generated, length, EOS)


def generate_onehot_keeping_the_guess(target_lm, draft_lm, prefix, length, num_draft_tokens, rng):
    """WRONG: one-hot proposal that samples p_i without removing the rejected guess."""
    generated: list[int] = []
    while len(generated) < length and EOS not in generated:
        context = list(prefix) + generated
        draft_tokens: list[int] = []
        for _ in range(num_draft_tokens):
            q = draft_lm.next_probs(context + draft_tokens)
            draft_tokens.append(sample_race(q, rng.standard_exponential(LM_VOCAB_SIZE)))
        target_probs = np.stack(
            [target_lm.next_probs(context + draft_tokens[:i]) for i in range(num_draft_tokens + 1)]
        )
        uniforms = rng.random(num_draft_tokens)
        noise = rng.standard_exponential((num_draft_tokens + 1, LM_VOCAB_SIZE))
        generated += onehot_block_keeping_the_guess(target_probs, draft_tokens, uniforms, noise)
    return truncate_at_eos(generated, length, EOS)


NUM_SEQUENCES = 6000


@pytest.mark.stats
@pytest.mark.parametrize("num_draft_tokens", [1, 3])
def test_speculative_generate_full_proposal_matches_target(num_draft_tokens):
    target_lm, draft_lm = table_lms(seed=50)
    assert_drafts_partly_accepted(target_lm, draft_lm)
    exact = sequence_distribution(target_lm, PREFIX, LENGTH)
    rng = np.random.default_rng(51 + num_draft_tokens)
    correct = [
        speculative_generate(target_lm, draft_lm, PREFIX, LENGTH, num_draft_tokens, rng)
        for _ in range(NUM_SEQUENCES)
    ]
    wrong = [
        generate_with_tempered_draft(target_lm, draft_lm, PREFIX, LENGTH, num_draft_tokens, rng)
        for _ in range(NUM_SEQUENCES)
    ]
    check_samples_with_control(
        exact, correct, wrong, f"full proposal, K={num_draft_tokens} (control: q at T=2)"
    )


@pytest.mark.stats
@pytest.mark.parametrize("num_draft_tokens", [1, 3])
def test_speculative_generate_onehot_proposal_matches_target(num_draft_tokens):
    target_lm, draft_lm = table_lms(seed=60)
    assert_drafts_partly_accepted(target_lm, draft_lm)
    exact = sequence_distribution(target_lm, PREFIX, LENGTH)
    rng = np.random.default_rng(61 + num_draft_tokens)
    correct = [
        speculative_generate(target_lm, draft_lm, PREFIX, LENGTH, num_draft_tokens, rng, proposal="onehot")
        for _ in range(NUM_SEQUENCES)
    ]
    wrong = [
        generate_onehot_keeping_the_guess(target_lm, draft_lm, PREFIX, LENGTH, num_draft_tokens, rng)
        for _ in range(NUM_SEQUENCES)
    ]
    check_samples_with_control(
        exact, correct, wrong, f"one-hot proposal, K={num_draft_tokens} (control: guess kept)"
    )


def choose_from_history(generated, drafted):
    """A chooser that sees only the past (as xtokspec's proposal="auto"): the kind flips with the last token."""
    return "onehot" if generated and generated[-1] % 2 else "full"


def choose_peeking(generated, drafted):
    """WRONG: picks the kind from the block's own first draft token."""
    return "full" if drafted[0] == 0 else "onehot"


@pytest.mark.stats
def test_speculative_generate_with_a_chooser_matches_target():
    """Kinds chosen block by block from the history: still the target's law (proof: speculative_generate)."""
    target_lm, draft_lm = table_lms(seed=80)
    assert_drafts_partly_accepted(target_lm, draft_lm)
    exact = sequence_distribution(target_lm, PREFIX, LENGTH)
    rng = np.random.default_rng(81)
    correct = [
        speculative_generate(target_lm, draft_lm, PREFIX, LENGTH, 2, rng, proposal=choose_from_history)
        for _ in range(NUM_SEQUENCES)
    ]
    wrong = [
        speculative_generate(target_lm, draft_lm, PREFIX, LENGTH, 2, rng, proposal=choose_peeking)
        for _ in range(NUM_SEQUENCES)
    ]
    kinds = {choose_from_history(s[:i], ()) for s in correct for i in range(len(s))}
    assert kinds == {"full", "onehot"}, kinds  # both kinds were chosen
    check_samples_with_control(exact, correct, wrong, "kinds chosen from the history (control: chooser peeks)")


# --- a token tree whose root's children are drawn from q (reference/tree.py) -------------------------


def sampled_root_trie(root_q, count, subtree_fn, rng):
    """Draw the root's children from root_q without replacement (an exponential race) and hang subtree_fn(t)
    under each -> (tokens, parents) in the order the walk tries them."""
    keys = np.where(root_q > 0, root_q / rng.exponential(size=len(root_q)), -1.0)
    children = [int(t) for t in np.argsort(-keys)[: min(count, int((root_q > 0).sum()))]]
    tokens, parents = [-1] + children, [-1] + [0] * len(children)
    for child_node, token in enumerate(children, start=1):
        sub_tokens, sub_parents = subtree_fn(token)
        base = len(tokens) - 1  # subtree node n >= 1 becomes node base + n
        for n in range(1, len(sub_tokens)):
            tokens.append(sub_tokens[n])
            parents.append(child_node if sub_parents[n] == 0 else base + sub_parents[n])
    return tokens, parents


@pytest.mark.stats
def test_tree_walk_with_a_sampled_root_matches_its_exact_law():
    """Children drawn from q, the walk run on them: its output has the exact law (the target's, by
    test_ref_tree). Control: the one-hot rule's residual update (p_j with c_j removed) under the q test."""
    vocab, count = 4, 2
    rng = np.random.default_rng(90)
    tables = {prefix: rng.dirichlet(np.full(vocab, 0.5)) for prefix in [()] + [(t,) for t in range(vocab)]}
    root_q = rng.dirichlet(np.full(vocab, 0.5))
    subtree = {t: ([-1, (t + 1) % vocab], [-1, 0]) for t in range(vocab)}  # one child under each root child
    uniform_row = lambda prefix: tables.get(prefix, np.full(vocab, 1.0 / vocab))  # noqa: E731
    exact = sampled_root_tree_law(root_q, count, subtree.__getitem__, uniform_row)

    def run(flaw):
        out = []
        for _ in range(NUM_SEQUENCES):
            tokens, parents = sampled_root_trie(root_q, count, subtree.__getitem__, rng)
            node_probs = np.stack([uniform_row(tuple(t for t in _path_tokens(tokens, parents, n))) for n in range(len(tokens))])
            uniforms = rng.random((len(tokens), count))
            path, token = sampled_root_tree_walk(tokens, parents, node_probs, root_q, uniforms,
                                                 rng.exponential(size=vocab), flaw)
            out.append(tuple(tokens[n] for n in path) + (token,))
        return out

    check_samples_with_control(exact, run(None), run("onehot_residual"),
                               "tree walk with a sampled root (control: one-hot residual update)")


def _path_tokens(tokens, parents, node):
    out = []
    while node > 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


# --- the chi-square helper itself -----------------------------------------------------------------

HELPER_PROBS = np.array([0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.03, 0.02, 0.01])  # small tail gets pooled


@pytest.mark.stats
def test_chisquare_helper_passes_a_correct_sampler_and_fails_a_tempered_one():
    rng = np.random.default_rng(70)
    correct = rng.multinomial(3000, HELPER_PROBS)
    wrong = rng.multinomial(3000, tempered(HELPER_PROBS, 1.25))
    check_with_control(HELPER_PROBS, correct, wrong, "chi-square helper (control: T=1.25)")


@pytest.mark.stats
def test_coupled_keyed_draws_match_with_their_exact_law():
    """A draft draw from q and the target's keyed sample from p on one position's noise (reference/keyed.py, item
    5): over 6,000 seeds, which token both picked (or that they differ) follows `coupled_match_law`. Control: the
    draft's race on another seed's noise (a draw apart from the target's), which matches with sum q p only."""
    rng = np.random.default_rng(91)
    p, q = rng.dirichlet(np.full(VOCAB_SIZE, 0.6)), rng.dirichlet(np.full(VOCAB_SIZE, 0.6))
    law = coupled_match_law(p, q)
    outcomes = {v: float(law[v]) for v in range(VOCAB_SIZE) if law[v] > 0} | {"differ": float(law[-1])}

    def outcome(x, y):
        return x if x == y else "differ"

    position, seeds = 7, range(6000)
    coupled = [outcome(keyed_sample(q, s, position), keyed_sample(p, s, position)) for s in seeds]
    apart = [outcome(keyed_sample(q, s + 10**6, position), keyed_sample(p, s, position)) for s in seeds]
    check_samples_with_control(outcomes, coupled, apart, "coupled keyed draws (control: the draft's own noise)")


@pytest.mark.stats
def test_chisquare_helper_rejection_rate_is_its_alpha():
    """Test the test: over many correct samples, rejections at alpha = 0.05 occur ~5% of the time.

    The control computes the p-value with dof one too many (forgetting the -1), which makes the
    test conservative; the same rate check must catch that.
    """
    rng = np.random.default_rng(80)
    num_runs, level = 4000, 0.05
    results = [
        chisquare_test(counts, HELPER_PROBS, level) for counts in rng.multinomial(200, HELPER_PROBS, num_runs)
    ]
    rejections = sum(result.rejected for result in results)
    wrong_rejections = sum(stats.chi2.sf(r.statistic, r.dof + 1) < level for r in results)
    assert stats.binomtest(rejections, num_runs, level).pvalue >= ALPHA, (
        f"{rejections}/{num_runs} rejected at {level}"
    )
    assert stats.binomtest(wrong_rejections, num_runs, level).pvalue < ALPHA, (
        f"control lacks power: {wrong_rejections}/{num_runs} rejected at {level} with dof + 1"
    )


def test_statistical_test_count_matches_the_budget():
    """NUM_STATISTICAL_TESTS must count every stats-marked test, parametrizations included."""
    count = 0
    for _, function in inspect.getmembers(sys.modules[__name__], inspect.isfunction):
        marks = getattr(function, "pytestmark", [])
        if any(mark.name == "stats" for mark in marks):
            count += math.prod(len(mark.args[1]) for mark in marks if mark.name == "parametrize")
    assert count == NUM_STATISTICAL_TESTS
