"""The speculative rejection step for one K-token block, written from the papers, in float64.

Notation (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"):
p = target distribution, q = proposal (draft) distribution. Chen et al. 2023 ("Accelerating Large
Language Model Decoding with Speculative Sampling") swap the letters: their q is our p.

Shapes: K = num_draft_tokens, V = target vocabulary size, Vd = draft vocabulary size.
``target_probs`` (K+1, V): p_i for i = 0..K, where p_i is the target's next-token distribution
after the prefix and the first i draft tokens (row K scores the bonus position).
``proposal_probs`` (K, V): q_i, the distribution draft token x_i was sampled from.

One block (Leviathan et al., Algorithm 1), outcomes named as in vLLM v1's rejection sampler:
- *accepted*: position i keeps x_i with probability min(1, p_i(x_i) / q_i(x_i));
- *recovered*: at the first rejection i, a token from the residual norm(max(0, p_i - q_i));
- *bonus*: if all K draft tokens are accepted, one more token from p_K.
Each output token is then distributed exactly as the target's own next-token sample.

Randomness is explicit so a torch implementation can replay it bit for bit:
- ``uniforms`` (K,) in [0, 1): position i accepts iff ``uniforms[i] * q_i(x_i) < p_i(x_i)``,
  i.e. u < p/q without a division.
- ``noise`` (K+1, V) iid Exp(1): a token is drawn by the exponential race
  ``argmax(probs / noise)`` (equivalently argmax(log probs - log noise)), which samples
  ``probs / probs.sum()``; probs need not be normalized and zero-probability tokens never win.
"""

from dataclasses import dataclass

import numpy as np

UNMAPPED = -1  # token_map entry for a draft token with no target-vocabulary counterpart
PROB_SUM_TOL = 1e-6  # rows of p and q must sum to 1 within this (catches logits passed as probs)


@dataclass(frozen=True)
class BlockResult:
    """Outcome of one block: ``tokens == accepted draft tokens + [recovered or bonus]``."""

    tokens: list[int]  # num_accepted + 1 tokens
    num_accepted: int  # 0..K
    recovered: int | None  # token sampled from the residual at the first rejection, else None
    bonus: int | None  # token sampled from p_K when all K were accepted, else None


def sample_race(probs: np.ndarray, noise: np.ndarray) -> int:
    """Token argmax(probs / noise) for probs (V,) >= 0 and noise (V,) iid Exp(1).

    Invariant: the token is distributed as probs / probs.sum(); tokens with probs <= 0 never win.
    """
    probs = np.asarray(probs, dtype=np.float64)
    noise = np.asarray(noise, dtype=np.float64)
    if probs.shape != noise.shape or probs.ndim != 1:
        raise ValueError(f"probs {probs.shape} and noise {noise.shape} must be equal 1-D shapes")
    positive = probs > 0
    if not positive.any():
        raise ValueError("sample_race needs at least one token with positive probability")
    # NOTE: divide only where probs > 0: 0/0 would be NaN (and a warning), and argmax picks NaN first.
    race = np.full(probs.shape, -np.inf)
    with np.errstate(divide="ignore"):  # noise 0 (probability 0 under Exp(1)) gives +inf: that token wins
        race[positive] = probs[positive] / noise[positive]
    return int(np.argmax(race))


def _check_block_inputs(target_probs, draft_tokens, uniforms, noise):
    target_probs = np.asarray(target_probs, dtype=np.float64)  # (K+1, V)
    draft_tokens = np.asarray(draft_tokens, dtype=np.int64)  # (K,)
    uniforms = np.asarray(uniforms, dtype=np.float64)  # (K,)
    noise = np.asarray(noise, dtype=np.float64)  # (K+1, V)
    num_draft_tokens = draft_tokens.shape[0]
    vocab_size = target_probs.shape[-1]
    if target_probs.shape != (num_draft_tokens + 1, vocab_size) or draft_tokens.ndim != 1:
        raise ValueError(f"target_probs {target_probs.shape} must be (K+1, V) for K={num_draft_tokens}")
    if uniforms.shape != (num_draft_tokens,) or noise.shape != target_probs.shape:
        raise ValueError(f"uniforms {uniforms.shape} must be (K,) and noise {noise.shape} (K+1, V)")
    if ((uniforms < 0) | (uniforms >= 1)).any():
        raise ValueError("uniforms must lie in [0, 1)")
    if ((draft_tokens < 0) | (draft_tokens >= vocab_size)).any():
        raise ValueError(f"draft_tokens must be target-vocabulary ids in [0, {vocab_size})")
    _check_distributions(target_probs, "target_probs")
    return target_probs, draft_tokens, uniforms, noise


def _check_distributions(probs: np.ndarray, name: str) -> None:
    if not np.isfinite(probs).all() or (probs < 0).any():
        raise ValueError(f"{name} must be finite and non-negative")
    if np.abs(probs.sum(axis=-1) - 1.0).max() > PROB_SUM_TOL:
        raise ValueError(f"each row of {name} must sum to 1 (within {PROB_SUM_TOL})")


def speculative_block(
    target_probs: np.ndarray,
    proposal_probs: np.ndarray,
    draft_tokens: np.ndarray,
    uniforms: np.ndarray,
    noise: np.ndarray,
) -> BlockResult:
    """Verify K draft tokens sampled from ``proposal_probs`` (K, V) against ``target_probs`` (K+1, V).

    Invariant: if draft_tokens[i] ~ q_i, every output token is distributed as the target's
    sample at its position (Leviathan et al., Theorem 1).
    """
    target_probs, draft_tokens, uniforms, noise = _check_block_inputs(
        target_probs, draft_tokens, uniforms, noise
    )
    proposal_probs = np.asarray(proposal_probs, dtype=np.float64)  # (K, V)
    if proposal_probs.shape != (draft_tokens.shape[0], target_probs.shape[1]):
        raise ValueError(f"proposal_probs {proposal_probs.shape} must be (K, V)")
    _check_distributions(proposal_probs, "proposal_probs")
    accepted: list[int] = []
    for i, token in enumerate(draft_tokens.tolist()):
        p, q = target_probs[i], proposal_probs[i]  # (V,), (V,)
        if q[token] <= 0:
            raise ValueError(f"draft token {token} at position {i} has proposal probability 0")
        if uniforms[i] * q[token] < p[token]:  # u < p/q
            accepted.append(token)
            continue
        # NOTE: the clamp is what makes this the residual. In the race, negative entries can never
        # beat a positive one, but in log space (log probs - log noise) log(negative) = NaN wins argmax.
        residual = np.maximum(p - q, 0.0)  # (V,), unnormalized: the race normalizes
        recovered = sample_race(residual, noise[i])
        return BlockResult(accepted + [recovered], i, recovered, None)
    bonus = sample_race(target_probs[-1], noise[-1])
    return BlockResult(accepted + [bonus], len(accepted), None, bonus)


def onehot_block(
    target_probs: np.ndarray, draft_tokens: np.ndarray, uniforms: np.ndarray, noise: np.ndarray
) -> BlockResult:
    """Verify K draft tokens treated as certain guesses (q_i = one-hot at x_i).

    Accept x_i iff uniforms[i] < p_i(x_i); on rejection sample p_i with x_i removed (the race
    renormalizes). Invariant: equal, token for token, to ``speculative_block`` with one-hot q.
    """
    target_probs, draft_tokens, uniforms, noise = _check_block_inputs(
        target_probs, draft_tokens, uniforms, noise
    )
    accepted: list[int] = []
    for i, token in enumerate(draft_tokens.tolist()):
        p = target_probs[i]  # (V,)
        if uniforms[i] < p[token]:
            accepted.append(token)
            continue
        without_guess = p.copy()
        without_guess[token] = 0.0  # the residual max(0, p - onehot(x_i))
        recovered = sample_race(without_guess, noise[i])
        return BlockResult(accepted + [recovered], i, recovered, None)
    bonus = sample_race(target_probs[-1], noise[-1])
    return BlockResult(accepted + [bonus], len(accepted), None, bonus)


def map_proposal(
    draft_probs: np.ndarray, token_map: np.ndarray, target_vocab_size: int
) -> tuple[np.ndarray, float]:
    """Move a draft distribution (Vd,) onto the target vocabulary through ``token_map`` (Vd,).

    ``token_map[d]`` is the target id of draft id d, or UNMAPPED (-1). The draft is restricted to
    mapped ids and renormalized, then scatter-added (several draft ids may share one target id).
    Returns (proposal_probs (Vt,), mapped_mass): the proposal the draft's mapped token is
    distributed as, provided the draft samples from the same restriction.
    """
    draft_probs = np.asarray(draft_probs, dtype=np.float64)  # (Vd,)
    token_map = np.asarray(token_map)  # (Vd,)
    if draft_probs.ndim != 1 or token_map.shape != draft_probs.shape:
        raise ValueError(f"draft_probs {draft_probs.shape} and token_map {token_map.shape} must be (Vd,)")
    if not np.issubdtype(token_map.dtype, np.integer):
        raise ValueError(f"token_map must hold integers, got dtype {token_map.dtype}")
    if ((token_map < UNMAPPED) | (token_map >= target_vocab_size)).any():
        raise ValueError(f"token_map entries must be -1 (unmapped) or in [0, {target_vocab_size})")
    _check_distributions(draft_probs, "draft_probs")
    mapped = token_map != UNMAPPED  # (Vd,)
    mapped_mass = float(draft_probs[mapped].sum())
    if mapped_mass <= 0:
        raise ValueError("the draft puts no probability on mapped tokens; the proposal is undefined")
    proposal_probs = np.zeros(target_vocab_size)  # (Vt,)
    np.add.at(proposal_probs, token_map[mapped], draft_probs[mapped] / mapped_mass)
    return proposal_probs, mapped_mass
