"""The keyed sampler: the target's token at each output position is a fixed function of the seed, the position and
the target's distribution there, so a seed gives the same text whatever the draft proposed.

Sampling is the exponential race (`sampling.race`): y = argmax_v p(v) / E(v) with E(v) ~ Exp(1) independent,
which draws v with probability p(v). Here E is not drawn from a generator but computed: E(v) = -log U(v), with U
a counter-based hash of (seed, position, v) mapped into (0, 1) — 24 random bits, strictly inside the interval, so
E is strictly positive and finite (a zero would give p / 0, which argmax could pick). The hash is integer
arithmetic on int64 tensors holding 32-bit values (a product's low 32 bits, whether or not the product wrapped
around), so the same bits come out on any device; a position's own key is computed on the host, in Python
integers, and only the (positions x vocabulary) part on the tensors' device.

Verifying a one-hot proposal x at a position under this rule: accept iff x equals that position's keyed sample y;
on a rejection y itself is emitted. Acceptance then happens with probability p(x), as in the usual one-hot rule,
and every emitted token is the target alone's keyed sample: the text is identical to the target alone's, whatever
was proposed (drafter-invariant speculative decoding, Daliri, Musco and Suresh 2024). Positions count target
tokens after the prompt, so the text bridge never touches what is emitted. reference/keyed.py holds the rule in
NumPy with its proof sketch.
"""

from __future__ import annotations

import torch

MASK = 0xFFFFFFFF
SEED_SALT, POSITION_MUL, TOKEN_MUL = 0x9E3779B9, 0x27D4EB2F, 0x165667B1


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) and c < 2^32 (a new tensor). The product may pass 2^63 and wrap
    around in int64, as integer multiplication does on CPUs and GPUs (two's complement, the low 64 bits kept): its
    low 32 bits are the same either way, and they are all that is kept."""
    return (x * c).bitwise_and_(MASK)


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (every input bit moves every output bit)."""
    h = h ^ (h >> 16)
    h.mul_(0x85EBCA6B).bitwise_and_(MASK)  # in place on the copy above (see mul32)
    h.bitwise_xor_(h >> 13)
    h.mul_(0xC2B2AE35).bitwise_and_(MASK)
    return h.bitwise_xor_(h >> 16)


def fold(seed: int) -> int:
    """A seed of any size as 32 bits (both halves of a 64-bit seed count)."""
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32)) & MASK


_TOKEN_KEYS: dict[tuple[int, str], torch.Tensor] = {}  # (vocabulary size, device) -> every id's own hash


def token_keys(ids: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Each token id's hash, fmix32(id * TOKEN_MUL): for a whole vocabulary (an int) computed once per device."""
    if not isinstance(ids, int):
        return fmix32(mul32(ids.to(device=device, dtype=torch.int64), TOKEN_MUL))
    key = (ids, str(device))
    if key not in _TOKEN_KEYS:
        _TOKEN_KEYS[key] = fmix32(mul32(torch.arange(ids, dtype=torch.int64, device=device), TOKEN_MUL))
    return _TOKEN_KEYS[key]


def row_keys(seed: int, positions) -> list[int]:
    """Each output position's row key, fmix32(fmix32(fold(seed) ^ SEED_SALT) ^ position * POSITION_MUL), in
    Python integers: a handful of positions a cycle, each a dozen integer operations that on a GPU would each be a
    kernel launch."""
    base = _fmix32_int(fold(seed) ^ SEED_SALT)
    return [_fmix32_int(base ^ (((int(p) & MASK) * POSITION_MUL) & MASK)) for p in positions]


def _fmix32_int(h: int) -> int:
    """`fmix32` on one Python integer in [0, 2^32)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK
    return h ^ (h >> 16)


def uniforms(seed: int, positions, vocab: int | torch.Tensor, keys: torch.Tensor | None = None,
             device: torch.device | str | None = None) -> torch.Tensor:
    """(N,) output positions (host integers, or a tensor) -> (N, vocab) float64 U(0, 1) values keyed by (seed,
    position, token id), on `device` (default: the positions', else `keys`' device); `vocab` a tensor of ids
    ((N, M) or (M,)) gives those ids' values only; `keys`: those ids' `token_keys`, computed once."""
    if device is None:
        device = positions.device if isinstance(positions, torch.Tensor) else keys.device if keys is not None \
            else torch.device("cpu")
    if isinstance(positions, torch.Tensor):
        positions = positions.tolist()
    rows = torch.tensor(row_keys(seed, positions), dtype=torch.int64).to(device)  # (N,): one copy to the device
    h = fmix32(rows[:, None] ^ (keys if keys is not None else token_keys(vocab, device)))  # (N, V)
    # NOTE: 24 bits plus a half: strictly inside (0, 1), exact in float32 and float64 alike
    return h.bitwise_right_shift_(8).to(torch.float64).add_(0.5).div_(float(1 << 24))


def noise(seed: int, positions, vocab: int | torch.Tensor, keys: torch.Tensor | None = None,
          device: torch.device | str | None = None) -> torch.Tensor:
    """(N, vocab) float32 Exp(1) noise keyed by (seed, position, token id): -log U, strictly positive (`vocab`:
    a size, or the ids to compute, as in `uniforms`)."""
    return uniforms(seed, positions, vocab, keys, device).log_().neg_().to(torch.float32)


def samples(probs: torch.Tensor, seed: int, positions) -> torch.Tensor:
    """(N, V) distributions at the (N,) output positions -> (N,) their keyed samples, argmax_v p(v) / E(v)."""
    return torch.argmax(probs / noise(seed, positions, probs.shape[-1], device=probs.device), dim=-1)


def sample(probs_row: torch.Tensor, seed: int, position: int) -> int:
    """One distribution (V,) at one output position -> its keyed sample."""
    return int(samples(probs_row[None], seed, [position])[0])


def chain(probs: torch.Tensor, proposals: list[int], seed: int, first: int) -> tuple[int, int]:
    """A chain's verdict under the keyed rule: (K+1, V) target distributions at output positions first, first + 1,
    ... and its K proposals -> (accepted, the token emitted after them). On a CPU the rows are keyed one at a time
    and only up to the first rejection (the noise is a pass over the vocabulary per row: K + 1 rows of Qwen's
    151,936 ids would cost a fifth of its step); on a GPU all at once, in one transfer."""
    if probs.device.type != "cpu":
        ids = samples(probs, seed, range(first, first + len(proposals) + 1)).tolist()
        return verify_chain(ids, proposals)
    for i, x in enumerate(proposals):
        y = sample(probs[i], seed, first + i)
        if y != x:
            return i, y
    return len(proposals), sample(probs[len(proposals)], seed, first + len(proposals))


def verify_chain(samples_at: list[int], proposals: list[int]) -> tuple[int, int]:
    """A chain's keyed samples at its K + 1 positions and its K proposals -> (accepted, the token emitted after
    them): accepted while a proposal equals its position's sample; then that position's sample."""
    accepted = next((i for i, (x, y) in enumerate(zip(proposals, samples_at, strict=False)) if x != y),
                    len(proposals))
    return accepted, samples_at[accepted]


def margin(probs: torch.Tensor, seed: int, position: int) -> float:
    """A keyed sample's margin at one position: the gap between the top two of log p - log E (0: a tie that
    floating-point differences between two runs could flip)."""
    keys = torch.log(probs.float()) - torch.log(noise(seed, [position], probs.shape[-1], device=probs.device)[0])
    top = torch.topk(keys, 2).values
    return float(top[0] - top[1])


class Coupling:
    """The draft's draws coupled to the target's keyed samples (Daliri, Musco and Suresh 2024): where the draft
    draws among ids that are target ids too (the intersection map), its race at a target output position uses
    that position's keyed noise of the target ids, x = argmax_d q(d) / E(position, t(d)). The target's keyed
    sample y = argmax_v p(v) / E(position, v) races on the same noise, so x = y with probability
    sum_v 1 / sum_u max(p(u) / p(v), q(u) / q(v)) >= (1 - TV) / (1 + TV), where a draw apart from the noise
    matches with sum_v q(v) p(v) only (reference/keyed.py, item 5). What is emitted is still the target's
    keyed sample: the draw changes acceptance, never the text."""

    def __init__(self, seed: int, target, start: int, draft_to_target: torch.Tensor | None = None):
        """`target`: the target's state (`cache.ModelState`: its ids are the committed ones while the draft
        draws); `start`: its ids before the first output position; `draft_to_target`: (Vd,) each draft id's
        target id, -1 where none (those ids get id 0's noise: the intersection map gives them no mass). Draft ids
        that spell one target id share its noise: the race then favours the likeliest of them (the emitted text
        is the target's keyed sample all the same); None: only `row` is asked for (a tree's sampled root)."""
        self.seed, self.target, self.start = seed, target, start
        self.keys = (None if draft_to_target is None  # (Vd,), computed once
                     else token_keys(draft_to_target.clamp(min=0), draft_to_target.device))

    def row(self, vocab: int, device: torch.device) -> torch.Tensor:
        """(vocab,) the noise of every target id at the next output position past the committed ones: a tree's
        sampled root races its candidate groups (target ids) on it (sampling.draw_groups_without_replacement)."""
        return noise(self.seed, [len(self.target.ids) - self.start], vocab, device=device)[0]

    def noise(self, offsets: int) -> torch.Tensor:
        """(offsets, Vd) the noise of the draft's ids at the next `offsets` target output positions past the
        committed ones, in one pass (a chain's K drafted ids race on K rows)."""
        first = len(self.target.ids) - self.start
        return noise(self.seed, range(first, first + offsets), self.keys.shape[-1], self.keys)
