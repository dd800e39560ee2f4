"""Exact distributions for speculative decoding, so statistical tests compare against numbers.

Notation as in ``reference.rejection``: p = target, q = proposal (draft), K = num_draft_tokens,
V = vocabulary size; alpha_i = sum_v min(p_i(v), q_i(v)) is the acceptance probability at
position i (Leviathan et al. 2023, Definition 3.1 and Lemma 3.3).

Two settings:
- Fixed per-position tables: p_i and q_i do not depend on the drawn tokens (K+1 and K rows).
  ``block_output_distribution`` and ``accepted_count_distribution`` give the exact law of one
  ``speculative_block`` call when draft_tokens[i] ~ q_i independently.
- Table language models (``TableLM``): next-token probabilities are a table indexed by the last
  ``order`` tokens, over a tiny vocabulary with an EOS id. ``sequence_distribution`` enumerates
  every continuation exactly; ``speculative_generate`` runs full speculative decoding with the
  reference block step, and its empirical law must equal ``sequence_distribution(target_lm, ...)``.
"""

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from reference.rejection import onehot_block, sample_race, speculative_block


def acceptance_probs(target_probs: np.ndarray, proposal_probs: np.ndarray) -> np.ndarray:
    """alpha (K,): alpha_i = sum_v min(p_i(v), q_i(v)), for p (K+1 or K, V) and q (K, V)."""
    num_draft_tokens = proposal_probs.shape[0]
    return np.minimum(target_probs[:num_draft_tokens], proposal_probs).sum(axis=-1)


def accepted_count_distribution(target_probs: np.ndarray, proposal_probs: np.ndarray) -> np.ndarray:
    """P(num_accepted = n) for n = 0..K, shape (K+1,), with fixed tables p (K+1, V), q (K, V).

    Closed form: P(n) = prod_{i<n} alpha_i * (1 - alpha_n) for n < K, and prod_{i<K} alpha_i for n = K.
    """
    alpha = acceptance_probs(np.asarray(target_probs, float), np.asarray(proposal_probs, float))  # (K,)
    reach = np.concatenate([[1.0], np.cumprod(alpha)])  # (K+1,): P(first n positions all accepted)
    return reach * np.concatenate([1.0 - alpha, [1.0]])


def block_output_distribution(target_probs: np.ndarray, proposal_probs: np.ndarray) -> np.ndarray:
    """Exact law of each output position of one block, shape (K+1, V+1), fixed tables p, q.

    Row j, column v < V: P(the block outputs at least j+1 tokens and token j is v); column V:
    P(the block ends before position j). Computed from the mechanics (accepted mass min(p, q),
    plus the rejection mass (1 - alpha) spread over the normalized residual, plus the bonus), so
    it checks the theorem rather than assuming it. Invariant: row j[:V] == prod_{i<j} alpha_i * p_j;
    in particular row 0[:V] == p_0.
    """
    target_probs = np.asarray(target_probs, dtype=np.float64)  # (K+1, V)
    proposal_probs = np.asarray(proposal_probs, dtype=np.float64)  # (K, V)
    num_draft_tokens, vocab_size = proposal_probs.shape
    alpha = acceptance_probs(target_probs, proposal_probs)  # (K,)
    reach = np.concatenate([[1.0], np.cumprod(alpha)])  # (K+1,)
    table = np.zeros((num_draft_tokens + 1, vocab_size + 1))
    for j in range(num_draft_tokens):
        p, q = target_probs[j], proposal_probs[j]
        residual = np.maximum(p - q, 0.0)
        recovered = residual / residual.sum() if residual.sum() > 0 else residual  # alpha_j = 1 if 0
        table[j, :vocab_size] = reach[j] * (np.minimum(p, q) + (1.0 - alpha[j]) * recovered)
    table[-1, :vocab_size] = reach[-1] * target_probs[-1]  # bonus
    table[:, vocab_size] = 1.0 - reach
    return table


def onehot_guesses_output_distribution(target_probs: np.ndarray, guesses: dict[tuple[int, ...], float]) -> np.ndarray:
    """Exact law of each output position of one one-hot block, shape (K+1, V+1) as
    ``block_output_distribution``, when its K guesses are drawn from any law ``guesses`` ({guess tuple:
    probability}) chosen before, and apart from, the target's draws.

    Why xtokspec's proposal="onehot" stays lossless however the draft picks its guesses, token healing
    included (SpecConfig.draft_healing: the draft reads the committed text one token short and its first
    draw is restricted to tokens that restate that token, then renormalized; the guesses are then not drawn
    from any distribution the target is told about). Proof sketch: for one fixed guess x, position i of the
    block, given that it is reached, outputs x_i with probability p_i(x_i) (accepted) and v != x_i with
    probability (1 - p_i(x_i)) * p_i(v) / (1 - p_i(x_i)) = p_i(v) (rejected, then the residual, p_i with x_i
    removed): p_i itself, whatever x_i is. Only the chance of reaching position i depends on x. A law over
    guesses that does not look at the target's uniforms or noise mixes these rows: row i[:V] = P(reach i) * p_i,
    the target's law given the history. A guess that looks at the target's draws breaks it (the tests' control).
    """
    target_probs = np.asarray(target_probs, dtype=np.float64)  # (K+1, V)
    num_draft_tokens, vocab_size = target_probs.shape[0] - 1, target_probs.shape[1]
    if not np.isclose(sum(guesses.values()), 1.0):
        raise ValueError(f"the guesses' probabilities must sum to 1, got {sum(guesses.values())}")
    table = np.zeros((num_draft_tokens + 1, vocab_size + 1))
    for guess, prob in guesses.items():
        if len(guess) != num_draft_tokens:
            raise ValueError(f"every guess must have K={num_draft_tokens} tokens, got {guess}")
        onehot = np.eye(vocab_size)[list(guess)]  # (K, V)
        table += prob * block_output_distribution(target_probs, onehot)
    return table


@dataclass(frozen=True, eq=False)
class TableLM:
    """A language model given by a table: next-token probs from the last ``order`` tokens.

    ``table`` has shape (V,) * order + (V,): ``table[c_1, ..., c_order]`` is the next-token
    distribution after context tokens c_1..c_order (oldest first). ``eos_id`` ends a sequence.
    """

    table: np.ndarray  # (V,)*order + (V,)
    eos_id: int

    def __post_init__(self):
        table = np.asarray(self.table, dtype=np.float64)
        if len(set(table.shape)) != 1 or (table < 0).any():
            raise ValueError(f"table must be (V,)*order + (V,) and non-negative, got {table.shape}")
        if np.abs(table.sum(axis=-1) - 1.0).max() > 1e-9:
            raise ValueError("every row of table must sum to 1")
        if not 0 <= self.eos_id < table.shape[-1]:
            raise ValueError(f"eos_id {self.eos_id} outside the vocabulary")
        object.__setattr__(self, "table", table)

    @property
    def vocab_size(self) -> int:
        return self.table.shape[-1]

    @property
    def order(self) -> int:
        return self.table.ndim - 1

    def next_probs(self, context: Sequence[int]) -> np.ndarray:
        """Next-token distribution (V,) after ``context`` (at least ``order`` tokens)."""
        if len(context) < self.order:
            raise ValueError(f"context needs at least {self.order} tokens, got {len(context)}")
        key = tuple(context[len(context) - self.order :])
        return self.table[key]

    @classmethod
    def random(
        cls, vocab_size: int, order: int, eos_id: int, rng: np.random.Generator, concentration: float = 0.5
    ) -> "TableLM":
        """A random table, rows ~ Dirichlet(concentration); small concentration gives peaked rows."""
        shape = (vocab_size,) * order
        table = rng.dirichlet(np.full(vocab_size, concentration), size=shape)
        return cls(table.reshape(shape + (vocab_size,)), eos_id)


def sequence_distribution(lm: TableLM, prefix: Sequence[int], length: int) -> dict[tuple[int, ...], float]:
    """Exact law of the next ``length`` tokens after ``prefix``, stopping early after EOS.

    Keys are continuations (an EOS-terminated one may be shorter than ``length``); values sum to 1.
    """
    result: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while frontier:
        continuation, prob = frontier.pop()
        if len(continuation) == length or (continuation and continuation[-1] == lm.eos_id):
            result[continuation] = result.get(continuation, 0.0) + prob
            continue
        next_probs = lm.next_probs(list(prefix) + list(continuation))
        for token in np.flatnonzero(next_probs).tolist():
            frontier.append((continuation + (token,), prob * float(next_probs[token])))
    return result


def all_continuations(vocab_size: int, length: int, eos_id: int) -> list[tuple[int, ...]]:
    """Every continuation of at most ``length`` tokens that is full-length or ends at its first EOS."""
    out = []
    for n in range(1, length + 1):
        for seq in itertools.product(range(vocab_size), repeat=n):
            if eos_id not in seq[:-1] and (n == length or seq[-1] == eos_id):
                out.append(seq)
    return out


def truncate_at_eos(tokens: Sequence[int], length: int, eos_id: int) -> tuple[int, ...]:
    """The first ``length`` tokens, cut just after the first EOS."""
    tokens = list(tokens[:length])
    if eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id) + 1]
    return tuple(tokens)


def speculative_generate(
    target_lm: TableLM,
    draft_lm: TableLM,
    prefix: Sequence[int],
    length: int,
    num_draft_tokens: int,
    rng: np.random.Generator,
    proposal: "str | Callable[[tuple[int, ...], tuple[int, ...]], str]" = "full",
) -> tuple[int, ...]:
    """Speculative decoding over table LMs; returns the first ``length`` tokens (cut after EOS).

    Each block: (1) the draft samples K tokens from its own table; (2) the target scores the K+1
    positions; (3) ``speculative_block`` (proposal="full": q = the draft's distributions) or
    ``onehot_block`` (proposal="onehot": the draft tokens as certain guesses) accepts, recovers or
    adds the bonus; (4) commit and repeat. Invariant: the result is distributed as
    ``sequence_distribution(target_lm, prefix, length)``.

    ``proposal`` may also be a chooser ``(generated so far, this block's draft tokens) -> "full" |
    "onehot"``, called once per block (xtokspec's proposal="auto" chooses each cycle this way). Proof
    sketch that the invariant holds for every chooser that ignores its second argument: given the
    tokens generated so far, the kind is fixed before the block's draws, and either block emits its
    tokens with the target's law given that history (Leviathan et al., Theorem 1; for one-hot, the same
    theorem with q one-hot). The law of the whole continuation is the product of these conditional laws,
    so it is the target's, whatever rule picked the kinds. A chooser that looks at the block's own draft
    tokens breaks it: "full" is then used on tokens that, given the choice, are no longer distributed as
    q (the tests' negative control).
    """
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    chooser = proposal if callable(proposal) else None
    if chooser is None and proposal not in ("full", "onehot"):
        raise ValueError(f"proposal must be 'full', 'onehot' or a chooser, got {proposal!r}")
    vocab_size = target_lm.vocab_size
    generated: list[int] = []
    while len(generated) < length and target_lm.eos_id not in generated:
        context = list(prefix) + generated
        draft_tokens, proposal_probs = [], []
        for _ in range(num_draft_tokens):  # (1) draft
            q = draft_lm.next_probs(context + draft_tokens)  # (V,)
            draft_tokens.append(sample_race(q, rng.standard_exponential(vocab_size)))
            proposal_probs.append(q)
        target_probs = np.stack(  # (2) target, (K+1, V)
            [target_lm.next_probs(context + draft_tokens[:i]) for i in range(num_draft_tokens + 1)]
        )
        uniforms = rng.random(num_draft_tokens)  # (K,)
        noise = rng.standard_exponential((num_draft_tokens + 1, vocab_size))  # (K+1, V)
        kind = chooser(tuple(generated), tuple(draft_tokens)) if chooser else proposal
        if kind not in ("full", "onehot"):
            raise ValueError(f"the chooser must return 'full' or 'onehot', got {kind!r}")
        if kind == "full":  # (3) verify
            result = speculative_block(target_probs, np.stack(proposal_probs), draft_tokens, uniforms, noise)
        else:
            result = onehot_block(target_probs, draft_tokens, uniforms, noise)
        generated.extend(result.tokens)  # (4) commit
    return truncate_at_eos(generated, length, target_lm.eos_id)
