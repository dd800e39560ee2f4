"""reference.exact: closed forms checked against brute-force enumeration of every draft and outcome."""

import itertools

import numpy as np
import pytest

from reference.exact import (
    TableLM,
    accepted_count_distribution,
    all_continuations,
    block_output_distribution,
    onehot_guesses_output_distribution,
    sequence_distribution,
    speculative_generate,
)


def random_tables(rng, num_draft_tokens, vocab_size, concentration=0.5):
    alpha = np.full(vocab_size, concentration)
    return rng.dirichlet(alpha, num_draft_tokens + 1), rng.dirichlet(alpha, num_draft_tokens)


def brute_force_block(target, proposal):
    """{output tokens: probability} of one block, enumerating every draft and every branch."""
    num_draft_tokens, vocab_size = proposal.shape
    law: dict[tuple[int, ...], float] = {}

    def add(tokens, prob):
        law[tokens] = law.get(tokens, 0.0) + prob

    for drafts in itertools.product(range(vocab_size), repeat=num_draft_tokens):
        prob = np.prod([proposal[i, x] for i, x in enumerate(drafts)])
        for i, x in enumerate(drafts):
            accept = min(1.0, target[i, x] / proposal[i, x]) if proposal[i, x] > 0 else 0.0
            residual = np.maximum(target[i] - proposal[i], 0.0)
            if accept < 1.0:
                for v in range(vocab_size):
                    add(drafts[:i] + (v,), prob * (1 - accept) * residual[v] / residual.sum())
            prob *= accept
        for v in range(vocab_size):
            add(drafts + (v,), prob * target[-1, v])
    return law


@pytest.mark.parametrize("seed, num_draft_tokens, vocab_size", [(0, 1, 3), (1, 3, 4), (2, 2, 5)])
def test_accepted_count_distribution_matches_enumeration(seed, num_draft_tokens, vocab_size):
    target, proposal = random_tables(np.random.default_rng(seed), num_draft_tokens, vocab_size)
    law = brute_force_block(target, proposal)
    by_count = np.zeros(num_draft_tokens + 1)
    for tokens, prob in law.items():
        by_count[len(tokens) - 1] += prob
    np.testing.assert_allclose(accepted_count_distribution(target, proposal), by_count, atol=1e-12)


@pytest.mark.parametrize("seed, num_draft_tokens, vocab_size", [(3, 1, 3), (4, 3, 4), (5, 2, 5)])
def test_block_output_distribution_matches_enumeration_and_the_theorem(seed, num_draft_tokens, vocab_size):
    target, proposal = random_tables(np.random.default_rng(seed), num_draft_tokens, vocab_size)
    exact = block_output_distribution(target, proposal)  # (K+1, V+1)
    enumerated = np.zeros_like(exact)
    for tokens, prob in brute_force_block(target, proposal).items():
        for j in range(num_draft_tokens + 1):
            enumerated[j, tokens[j] if j < len(tokens) else vocab_size] += prob
    np.testing.assert_allclose(exact, enumerated, atol=1e-12)
    # Losslessness: token j is p_j-distributed given the block reaches position j.
    reach = 1.0 - exact[:, vocab_size]
    np.testing.assert_allclose(exact[:, :vocab_size], reach[:, None] * target, atol=1e-12)
    np.testing.assert_allclose(exact[0, :vocab_size], target[0], atol=1e-12)


def healed_guesses(draft, allowed):
    """A draft's guesses drawn as token healing draws them: the first one restricted to `allowed` and
    renormalized, the later ones from the draft's own rows (fixed tables: they do not depend on the first)."""
    first = np.where(np.isin(np.arange(draft.shape[1]), allowed), draft[0], 0.0)
    rows = [first / first.sum()] + list(draft[1:])
    return {guess: float(np.prod([rows[i][x] for i, x in enumerate(guess)]))
            for guess in itertools.product(range(draft.shape[1]), repeat=len(rows))}


@pytest.mark.parametrize("seed, num_draft_tokens, vocab_size", [(6, 1, 4), (7, 3, 4), (8, 2, 5)])
def test_onehot_guesses_from_any_law_keep_the_targets_law(seed, num_draft_tokens, vocab_size):
    """A one-hot block is lossless whatever law its guesses come from: a healed draft (first draw restricted and
    renormalized), or all mass on the target's least likely tokens. Control: a guess chosen after looking at the
    target's first uniform (the token the target would accept) changes the law, and the same check fails."""
    rng = np.random.default_rng(seed)
    target, draft = random_tables(rng, num_draft_tokens, vocab_size)
    for guesses in (healed_guesses(draft, [0, 2]), {tuple(int(x) for x in target[:-1].argmin(-1)): 1.0}):
        law = onehot_guesses_output_distribution(target, guesses)
        reach_times_p = (1.0 - law[:, vocab_size])[:, None] * target
        np.testing.assert_allclose(law[:, :vocab_size], reach_times_p, atol=1e-12)
        np.testing.assert_allclose(law[0, :vocab_size], target[0], atol=1e-12)
    # control: a guess that peeks at the target's first uniform u. Where u < p_0(best) it guesses the target's
    # likeliest token (accepted: u < p_0(best)); elsewhere its least likely one, never accepted there (u >=
    # p_0(best) >= p_0(worst)), so the residual, p_0 without it, is drawn. The first token's law, from the rule:
    p0 = target[0]
    best, worst = int(p0.argmax()), int(p0.argmin())
    residual = np.where(np.arange(vocab_size) == worst, 0.0, p0) / (1.0 - p0[worst])
    peeked = p0[best] * np.eye(vocab_size)[best] + (1.0 - p0[best]) * residual
    assert np.abs(peeked - p0).max() > 1e-3  # the check above, on this law, fails


def test_onehot_guesses_validate():
    target = np.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="sum to 1"):
        onehot_guesses_output_distribution(target, {(0,): 0.5})
    with pytest.raises(ValueError, match="K=1"):
        onehot_guesses_output_distribution(target, {(0, 1): 1.0})


def test_equal_tables_accept_everything():
    target, _ = random_tables(np.random.default_rng(6), 3, 4)
    np.testing.assert_allclose(accepted_count_distribution(target, target[:3]), [0, 0, 0, 1], atol=1e-12)


def chain_rule_probability(lm, prefix, continuation):
    prob, context = 1.0, list(prefix)
    for token in continuation:
        prob *= lm.next_probs(context)[token]
        context.append(token)
    return prob


@pytest.mark.parametrize("order", [1, 2])
def test_sequence_distribution_is_the_chain_rule_over_all_continuations(order):
    lm = TableLM.random(4, order, eos_id=0, rng=np.random.default_rng(7))
    law = sequence_distribution(lm, [1, 2], length=3)
    outcomes = all_continuations(4, 3, eos_id=0)
    assert set(law) <= set(outcomes)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    for seq in outcomes:
        assert law.get(seq, 0.0) == pytest.approx(chain_rule_probability(lm, [1, 2], seq), abs=1e-15)


def test_table_lm_validates_its_table():
    with pytest.raises(ValueError, match="sum to 1"):
        TableLM(np.full((3, 3), 0.5), eos_id=0)
    with pytest.raises(ValueError, match="eos_id"):
        TableLM(np.full((3, 3), 1 / 3), eos_id=3)
    with pytest.raises(ValueError, match="at least 1 tokens"):
        TableLM(np.full((3, 3), 1 / 3), eos_id=0).next_probs([])


def test_speculative_generate_is_reproducible_and_validates():
    rng = np.random.default_rng(8)
    target, draft = TableLM.random(4, 1, 0, rng), TableLM.random(4, 1, 0, rng)
    runs = [speculative_generate(target, draft, [1], 5, 2, np.random.default_rng(9)) for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(runs[0]) == 5 or runs[0][-1] == 0
    with pytest.raises(ValueError, match="proposal"):
        speculative_generate(target, draft, [1], 3, 2, rng, proposal="intersection")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(target, draft, [1], 3, 0, rng)


def test_the_coupled_match_law_is_a_coupling_and_meets_its_bound():
    """reference/keyed.py, item 5: each P(both pick v) is at most min(p(v), q(v)) (each race alone picks v with
    its own probability), equal distributions always match, disjoint ones never do, and the chance of matching
    is at least Daliri et al.'s (1 - TV) / (1 + TV) and at least a draw apart from the noise gets (sum q p)."""
    from reference.keyed import coupled_match_law, coupling_bound

    rng = np.random.default_rng(17)
    for _ in range(500):
        vocab = int(rng.integers(2, 9))
        p, q = rng.dirichlet(np.full(vocab, 0.5)), rng.dirichlet(np.full(vocab, 0.5))
        q[rng.random(vocab) < 0.2] = 0.0  # draft ids outside the intersection carry no mass
        if q.sum() == 0:
            continue
        q /= q.sum()
        law = coupled_match_law(p, q)
        assert np.all(law[:-1] <= np.minimum(p, q) + 1e-12)
        assert law[:-1].sum() >= coupling_bound(p, q) - 1e-12
        assert law[:-1].sum() >= float(p @ q) - 1e-12
        assert law[-1] >= -1e-12
    p = rng.dirichlet(np.ones(5))
    assert np.allclose(coupled_match_law(p, p)[:-1], p) and abs(coupled_match_law(p, p)[-1]) < 1e-12
    assert coupled_match_law([0.5, 0.5, 0, 0], [0, 0, 0.3, 0.7])[-1] == 1.0


def test_coupled_tree_roots_lead_with_the_coupled_draw_and_grow_by_width():
    """reference/keyed.py, item 6: the first root candidate is q's keyed sample (item 5's coupled draw), the
    candidates for width W are those for W + 1 less the last, all distinct ids with mass; equal distributions
    always match at width 1, and a width that covers q's support always holds the target's sample."""
    from reference.keyed import coupled_roots, coupled_roots_hit, keyed_sample

    rng = np.random.default_rng(23)
    for trial in range(300):
        vocab = int(rng.integers(2, 12))
        q = rng.dirichlet(np.full(vocab, 0.5))
        q[rng.random(vocab) < 0.3] = 0.0
        if q.sum() == 0:
            continue
        q /= q.sum()
        seed, position = int(rng.integers(0, 2**40)), int(rng.integers(0, 1000))
        roots = [coupled_roots(q, seed, position, w) for w in range(1, vocab + 1)]
        assert roots[0][0] == keyed_sample(q, seed, position), trial
        for w in range(1, vocab):
            assert roots[w - 1] == roots[w][:w] or roots[w - 1] == roots[w], trial
        assert len(set(roots[-1])) == len(roots[-1]) == int((q > 0).sum()) and all(q[v] > 0 for v in roots[-1])
    p = rng.dirichlet(np.ones(6))
    assert coupled_roots_hit(p, p, 1, range(300)) == 1.0
    q = p.copy()
    q[0] = 0.0
    q /= q.sum()
    assert coupled_roots_hit(q, q, 5, range(300)) == 1.0  # width 5 covers q's five ids


def test_coupled_tree_roots_hit_the_target_sample_more_often_than_roots_drawn_apart():
    """reference/keyed.py, item 6's purpose: over 20 random nearby pairs (q's logits are p's plus N(0, 1) noise), the
    share of seeds whose target keyed sample is among the W coupled roots, against W roots drawn from q without
    replacement on their own noise (4,000 Gumbel top-W draws). Measured: 0.71 / 0.42 at W = 1, 0.90 / 0.63 at 2,
    0.95 / 0.72 at 3; the bar is a 0.15 lead at each width, and every pair's coupled share is at least its apart share
    less 0.05 (the coupled share's own sampling error over 200 seeds is about 0.03)."""
    from reference.keyed import coupled_roots_hit

    rng = np.random.default_rng(5)
    for width in (1, 2, 3):
        coupled, apart = [], []
        for _ in range(20):
            vocab = int(rng.integers(4, 16))
            logits = rng.normal(0.0, 2.0, vocab)
            p = np.exp(logits) / np.exp(logits).sum()
            q = np.exp(logits + rng.normal(0.0, 1.0, vocab))
            q /= q.sum()
            coupled.append(coupled_roots_hit(p, q, width, range(200)))
            race = np.log(q) - np.log(rng.exponential(size=(4000, vocab)))
            top = np.argsort(-race, axis=1)[:, :width]
            apart.append(sum(p[y] * np.mean((top == y).any(axis=1)) for y in range(vocab)))
        assert np.mean(coupled) >= np.mean(apart) + 0.15, (width, np.mean(coupled), np.mean(apart))
        assert min(np.subtract(coupled, apart)) >= -0.05, width


def _pair_of_tables(rng, vocab=5, eos=4):
    """A target table and a draft that half agrees with it (their rows mixed half and half)."""
    target = TableLM.random(vocab, 1, eos, rng)
    other = TableLM.random(vocab, 1, eos, rng)
    return target, TableLM(0.5 * target.table + 0.5 * other.table, eos)


@pytest.mark.parametrize("rule", ["keyed", "onehot"])
def test_target_calls_are_a_function_of_the_text_under_both_rules(rule):
    """reference/keyed.py, item 7: with the draft's K greedy ids every cycle, every generation's target calls are
    the c(T) of its own text (`greedy_calls`), under the keyed rule and the one-hot rejection rule alike, over 8
    pairs of tables x 3 draft lengths x 40 seeds; on average they accept between 10% and 90% of the K
    drafted ids (neither never nor always, where the identity would hold trivially)."""
    from reference.keyed import greedy_calls, greedy_chain_generate

    rng = np.random.default_rng(29)
    accepted_share = []
    for _ in range(8):
        target, draft = _pair_of_tables(rng)
        for k in (1, 2, 4):
            for seed in range(40):
                text, calls = greedy_chain_generate(target, draft, [0], 12, k, rule, seed)
                assert calls == greedy_calls(text, draft, [0], k), (rule, k, seed, text)
                accepted_share.append((len(text) - calls) / (k * calls))
    assert 0.1 < np.mean(accepted_share) < 0.9


def test_a_rejection_that_may_emit_the_rejected_id_breaks_calls_as_a_function_of_the_text(monkeypatch):
    """The negative control of item 7: a one-hot rule that, on rejecting x, draws from p with x left in (its text's
    law is wrong too) may emit x after rejecting it, so its calls are no longer c(T) for some seeds."""
    import reference.keyed as keyed
    from reference.rejection import BlockResult, sample_race

    def rejection_keeping_the_guess(target_probs, draft_tokens, uniforms, noise):
        for i, token in enumerate(draft_tokens.tolist()):
            if uniforms[i] >= target_probs[i][token]:
                recovered = sample_race(target_probs[i], noise[i])  # x not removed
                return BlockResult(draft_tokens[:i].tolist() + [recovered], i, recovered, None)
        bonus = sample_race(target_probs[-1], noise[-1])
        return BlockResult(draft_tokens.tolist() + [bonus], len(draft_tokens), None, bonus)

    monkeypatch.setattr(keyed, "onehot_block", rejection_keeping_the_guess)
    target, draft = _pair_of_tables(np.random.default_rng(29))
    runs = [keyed.greedy_chain_generate(target, draft, [0], 12, 2, "onehot", seed) for seed in range(40)]
    assert any(calls != keyed.greedy_calls(text, draft, [0], 2) for text, calls in runs)
