"""The keyed sampler in NumPy: noise that is a fixed function of (seed, output position, token id), the target's
keyed sample, and verification by matching it (xtokspec/decode/keyed.py and verify.py are tested against this).

The hash: MurmurHash3's 32-bit finaliser (fmix) over (seed folded to 32 bits, position) for a row key, and over
the token id for a token key; fmix(row key xor token key), its top 24 bits plus one half, over 2^24, give U
strictly inside (0, 1); E = -log U ~ Exp(1). NumPy's uint64 arithmetic here and the
torch int64 arithmetic there compute the same bits.

Proof sketch.
1. The keyed sample is a sample. For one position, the E(v) are (up to the hash's quality) independent Exp(1);
   the exponential race argmax_v p(v) / E(v) picks v with probability p(v) (E(v) / p(v) ~ Exp(p(v)) and the
   minimum of independent exponentials is the v with probability p(v) / sum p = p(v)). Different positions use
   different noise, so a whole sequence sampled position by position, each position's distribution conditioned
   on the tokens before it, follows the target's sequence law.
2. Verification emits the keyed samples. A cycle at output position t verifies proposals x_1..x_K against the
   target's distributions p_1..p_{K+1}, where p_i is conditioned on the committed prefix and x_1..x_{i-1}. With
   y_i the keyed sample of p_i at position t + i - 1, x_i is accepted iff x_i = y_i, and the first y_i whose x_i
   differs (or y_{K+1} after K acceptances) is emitted. By induction on i, each accepted x_i is y_i, so p_{i+1} is
   the distribution the target alone would have at position t + i after the same tokens, and its keyed sample is
   the target alone's. Every emitted token is therefore the token the target alone samples with that seed: the
   text does not depend on the proposals (Daliri, Musco and Suresh 2024, "Coupling without communication and
   drafter-invariant speculative decoding").
3. Acceptance. For a proposal x chosen without looking at the noise of its position (a draft's argmax, or a
   draw from the draft's own generator), P(x = y) = p(x): the one-hot rule's acceptance. A trie is walked along
   the keyed samples: from a node, to the child whose token is that node's sample, so a level's children are
   accepted with the sum of their p, as in the one-hot trie walk.
4. What is not kept: a proposal drawn from a distribution q apart from the noise is accepted with sum_v q(v)
   p(v), not the rejection rule's sum_v min(p(v), q(v)).
5. The coupled draw (Daliri et al.). A draft whose distribution q is on the target's ids (the intersection map)
   draws x = argmax_v q(v) / E(v) with the same position's noise. Both races pick v iff, for every u != v,
   E(u) >= E(v) m_u with m_u = max(p(u) / p(v), q(u) / q(v)); given E(v) = e this has probability
   prod_u exp(-e m_u), and integrating against e^-e gives P(x = y = v) = 1 / sum_u m_u (m_v = 1): the
   law `coupled_match_law` computes. Its sum, the chance of acceptance, is at least (1 - TV) / (1 + TV) with TV
   the total variation between p and q (Daliri et al., "Coupling without communication"), where item 4's draw
   gets sum_v q(v) p(v). x stays a draw from q (the race of item 1 on q), and item 2 does not depend on how the
   proposal was chosen: the text is still the target alone's.
6. Coupled tree roots. A tree's sampled root offers W candidates for its first position, the target ids (groups
   of draft ids) with the W largest q(v) / E(v) on that position's keyed noise: a draw without replacement from q
   (the Gumbel-top-k trick; its first is item 5's coupled draw). The trie walk of item 3 accepts the child equal
   to y, so the root level is accepted with P(y among the W), at least item 5's chance and growing with W
   (`coupled_roots_hit` counts it over seeds); drawn apart from the noise, it is sum over the W of p(v) only.
   Item 2 holds whatever the candidates: the text is the target alone's.
7. Target calls are a function of the text. Let a draft propose its K greedy ids, a fixed function of the
   committed text, every cycle. Under either rule a cycle accepts exactly the longest common prefix of its
   proposals and the tokens it emits: the keyed rule accepts x_i iff x_i = y_i and emits y_i (item 2); the
   one-hot rejection rule, on rejecting x_i, emits a draw from p_i with x_i removed, never x_i. So the cycles'
   starts, and the number of target calls c(T) that emit a text T, are fixed by T alone (`greedy_calls`).
   Both rules emit texts of the target's law (item 2; Leviathan et al. for the one-hot rule), so c(T) has one
   law under both, and so has the tokens per call, len(T) / c(T). Timed per prompt, the keyed rule's speed over
   the one-hot rule's is (tokens per call, keyed / one-hot) x (calls per second, keyed / one-hot); the first
   factor's two terms are independent draws of one law, so its logarithm has mean zero: the second factor alone
   estimates the expected ratio of speeds, without the two texts' luck (a control variate whose mean is
   known). This needs the proposals to be the draft's greedy ids at a fixed K: drafts drawn at random, or
   lengths chosen from timings, make the calls depend on more than the text.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from reference.exact import truncate_at_eos
from reference.rejection import onehot_block

MASK = np.uint64(0xFFFFFFFF)
SEED_SALT, POSITION_MUL, TOKEN_MUL = 0x9E3779B9, 0x27D4EB2F, 0x165667B1


def _mul(x: np.ndarray, c: int) -> np.ndarray:
    return (x * np.uint64(c)) & MASK  # NOTE: uint64 products wrap mod 2^64, which keeps the low 32 bits right


def _fmix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(16))
    h = _mul(h, 0x85EBCA6B)
    h = h ^ (h >> np.uint64(13))
    h = _mul(h, 0xC2B2AE35)
    return h ^ (h >> np.uint64(16))


def keyed_uniforms(seed: int, positions, vocab: int) -> np.ndarray:
    """(N,) output positions -> (N, vocab) float64 U(0, 1) keyed by (seed, position, token id)."""
    seed &= (1 << 64) - 1
    folded = np.uint64((seed ^ (seed >> 32)) & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        base = _fmix(np.asarray(folded ^ np.uint64(SEED_SALT), dtype=np.uint64))
        rows = _fmix(base ^ _mul(np.asarray(positions, dtype=np.uint64) & MASK, POSITION_MUL))
        ids = _fmix(_mul(np.arange(vocab, dtype=np.uint64), TOKEN_MUL))
        h = _fmix(rows[:, None] ^ ids[None, :])
    return ((h >> np.uint64(8)).astype(np.float64) + 0.5) / float(1 << 24)


def keyed_noise(seed: int, positions, vocab: int) -> np.ndarray:
    """(N, vocab) Exp(1) noise, -log U: strictly positive and finite."""
    return -np.log(keyed_uniforms(seed, positions, vocab))


def keyed_sample(p: np.ndarray, seed: int, position: int) -> int:
    """The keyed sample of one distribution (V,) at one output position."""
    return int(np.argmax(p / keyed_noise(seed, [position], p.shape[-1])[0]))


def keyed_verify(p_rows: np.ndarray, proposals: list[int], seed: int, first: int) -> tuple[int, int]:
    """A chain's (K+1, V) target distributions at output positions first.. and its K proposals -> (accepted, the
    token emitted after them): accept while a proposal equals its position's keyed sample."""
    for i, x in enumerate(proposals):
        y = keyed_sample(p_rows[i], seed, first + i)
        if x != y:
            return i, y
    return len(proposals), keyed_sample(p_rows[len(proposals)], seed, first + len(proposals))


def coupled_match_law(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Two races on one position's noise, over p and over q (V,) -> (V + 1,): P(both pick v) for each v (item 5),
    then P(they differ)."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    law = np.zeros(len(p) + 1)
    for v in np.flatnonzero((p > 0) & (q > 0)):
        law[v] = 1.0 / np.maximum(p / p[v], q / q[v]).sum()
    law[-1] = 1.0 - law[:-1].sum()
    return law


def coupled_roots(q: np.ndarray, seed: int, position: int, width: int) -> list[int]:
    """The `width` ids with the largest q(v) / E(v) on the position's keyed noise, largest first, among ids with
    mass (item 6)."""
    keys = np.asarray(q, dtype=np.float64) / keyed_noise(seed, [position], len(q))[0]
    order = np.argsort(-keys, kind="stable")[:width]
    return [int(v) for v in order if keys[v] > 0]


def coupled_roots_hit(p: np.ndarray, q: np.ndarray, width: int, seeds: range, position: int = 0) -> float:
    """The share of seeds whose keyed sample of p is among `coupled_roots(q, ...)` (item 6's root acceptance)."""
    return float(np.mean([keyed_sample(p, s, position) in coupled_roots(q, s, position, width) for s in seeds]))


def coupling_bound(p: np.ndarray, q: np.ndarray) -> float:
    """(1 - TV) / (1 + TV): Daliri et al.'s lower bound on the coupled draws' chance of matching."""
    tv = 0.5 * float(np.abs(np.asarray(p, dtype=np.float64) - np.asarray(q, dtype=np.float64)).sum())
    return (1.0 - tv) / (1.0 + tv)


def greedy_proposals(draft_lm, context: Sequence[int], k: int) -> list[int]:
    """The draft's K greedy ids after `context` (item 7's draft: a fixed function of the committed text)."""
    drafted: list[int] = []
    for _ in range(k):
        drafted.append(int(np.argmax(draft_lm.next_probs(list(context) + drafted))))
    return drafted


def greedy_chain_generate(target_lm, draft_lm, prefix: Sequence[int], length: int, k: int, rule: str,
                          seed: int) -> tuple[tuple[int, ...], int]:
    """Speculative decoding over table LMs (reference/exact.py's `TableLM`) with the draft's K greedy ids every
    cycle, verified by `rule` ("keyed": `keyed_verify` with `seed`; "onehot": the one-hot rejection rule,
    `rejection.onehot_block`, on a generator seeded with `seed`) -> (the first `length` tokens, cut after EOS; the
    target calls it took)."""
    if rule not in ("keyed", "onehot"):
        raise ValueError(f"rule must be 'keyed' or 'onehot', got {rule!r}")
    rng = np.random.default_rng(seed)
    generated: list[int] = []
    calls = 0
    while len(generated) < length and target_lm.eos_id not in generated:
        context = list(prefix) + generated
        proposals = greedy_proposals(draft_lm, context, k)
        p_rows = np.stack([target_lm.next_probs(context + proposals[:i]) for i in range(k + 1)])  # (K+1, V)
        calls += 1
        if rule == "keyed":
            accepted, token = keyed_verify(p_rows, proposals, seed, len(generated))
            generated += proposals[:accepted] + [token]
        else:
            result = onehot_block(p_rows, np.asarray(proposals), rng.random(k),
                                  rng.standard_exponential(p_rows.shape))
            generated += result.tokens
    return truncate_at_eos(generated, length, target_lm.eos_id), calls


def greedy_calls(text: Sequence[int], draft_lm, prefix: Sequence[int], k: int) -> int:
    """Item 7's c(T): the target calls that a chain of the draft's K greedy ids a cycle takes to emit `text`
    (a generation's tokens, cut at its length or after EOS), under either rule: each cycle accepts the longest
    common prefix of its proposals and the text, then emits one token more."""
    text = list(text)
    start = calls = 0
    while start < len(text):
        proposals = greedy_proposals(draft_lm, list(prefix) + text[:start], k)
        ahead = text[start:start + k]  # shorter than k where the text ends
        accepted = next((i for i, (x, y) in enumerate(zip(proposals, ahead, strict=False)) if x != y), len(ahead))
        start += accepted + 1
        calls += 1
    return calls
