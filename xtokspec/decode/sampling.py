"""Pure tensor functions for speculative verification (greedy and sampled).

Notation (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"): p is the
target distribution, q the proposal (draft) distribution; Chen et al. 2023 swap the letters. In code the
names say it: `target_probs` (p), `proposal_probs` (q, already on the target vocabulary).

Shapes: K = number of proposed tokens, Vt = target vocabulary, Vd = draft vocabulary.

The rule, per position i < K with proposed token x_i: accept iff u_i * q_i(x_i) < p_i(x_i) (u ~ U[0,1), i.e.
u < p/q without a division). At the first rejection the *recovered* token is drawn from the residual
max(0, p_i - q_i) (normalised); if all K are accepted the *bonus* token is drawn from p_K. The emitted token
is then distributed exactly as p at every position. A one-hot proposal (q_i = e_{x_i}) gives: accept with
probability p_i(x_i), else draw from p_i with x_i removed.

Sampling is an exponential race: argmax(probs / E) with E ~ Exp(1) iid draws a token with probability
proportional to probs, so normalisation is never needed and the noise is an explicit tensor that
`reference/` can replay.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..types import SamplingParams, XTokSpecError


def build_warpers(params: SamplingParams) -> LogitsProcessorList:
    """transformers' own warpers, in transformers' order: temperature, top-k, top-p."""
    warpers = LogitsProcessorList()
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        warpers.append(TopKLogitsWarper(top_k=params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=params.top_p))
    return warpers


def logits_to_probs(logits: torch.Tensor, warpers: LogitsProcessorList) -> torch.Tensor:
    """(N, V) raw logits -> (N, V) float32 probabilities after the warpers, as transformers samples them."""
    scores = logits.float()
    # NOTE: one host sync for both checks; the message is worked out only when something is wrong.
    if bool(torch.isnan(scores).any() | ~torch.isfinite(scores).any(dim=-1).all()):
        if not torch.isfinite(scores).any(dim=-1).all():
            raise XTokSpecError("model produced a row of logits with no finite value (all -inf or NaN)")
        raise XTokSpecError("model produced NaN logits")
    scores = warpers(None, scores)  # transformers' warpers ignore input_ids
    return torch.softmax(scores, dim=-1)  # (N, V)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: (..., V) probs and Exp(1) noise -> (...) sampled ids. Zero-probability ids never win."""
    return torch.argmax(probs / noise, dim=-1)


def exponential_noise(shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """iid Exp(1) noise drawn from `generator` (which must live on `device`)."""
    return torch.empty(shape, device=device).exponential_(generator=generator)


def _mapped(draft_probs: torch.Tensor, draft_to_target: torch.Tensor, target_vocab_size: int):
    """(..., Vd) draft distributions -> ((..., Vt) their mass on mapped ids moved onto the target vocabulary and
    renormalised, zeros where none is mapped; (..., 1) the mapped mass). No host sync."""
    restricted = draft_probs * (draft_to_target >= 0)  # (..., Vd)
    mass = restricted.sum(dim=-1, keepdim=True)  # (..., 1)
    out = torch.zeros(*draft_probs.shape[:-1], target_vocab_size, dtype=draft_probs.dtype, device=draft_probs.device)
    out.index_add_(-1, draft_to_target.clamp(min=0), restricted / torch.where(mass > 0, mass, 1.0))  # (..., Vt)
    return out, mass


def map_to_target(draft_probs: torch.Tensor, draft_to_target: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """(K, Vd) draft distributions restricted to mapped ids -> (K, Vt) proposal distributions.

    draft_to_target (Vd,) holds the target id with the same bytes, or -1. Several draft ids may map to one
    target id; their mass adds up. Rows are renormalised over the mapped ids.
    """
    out, mass = _mapped(draft_probs, draft_to_target, target_vocab_size)
    if bool((mass <= 0).any()):
        raise XTokSpecError("the draft put no probability on tokens that exist in the target vocabulary")
    return out


def intersection_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                            draft_to_target: torch.Tensor) -> torch.Tensor:
    """Chance that the intersection proposal is accepted at one position: sum_v min(p(v), Q(v)), with Q the draft's
    (Vd,) distribution restricted to mapped ids and moved onto the target's (Vt,) vocabulary; 0 when no mapped id
    has mass (Q is then all zeros). A 0-dim tensor (no host transfer)."""
    q, _ = _mapped(draft_probs, draft_to_target, target_probs.shape[-1])
    return torch.minimum(target_probs, q).sum()


def coupled_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                       draft_to_target: torch.Tensor) -> torch.Tensor:
    """Chance that an intersection proposal drawn on the keyed sampler's noise (keyed.Coupling) is the target's
    keyed sample at one position: sum_v 1 / sum_u max(p(u) / p(v), Q(u) / Q(v)) (reference/keyed.py, item 5),
    with Q as in `intersection_acceptance`. In O(V log V): sorted by r = p / Q, the max is the p term for the u
    with r(u) >= r(v) and the Q term for the rest (ties give both the same). A 0-dim tensor (no host transfer)."""
    p = target_probs.double()
    q = _mapped(draft_probs, draft_to_target, target_probs.shape[-1])[0].double()
    ratio = torch.where(q > 0, p / q.clamp(min=1e-300), torch.where(p > 0, torch.inf, 0.0))
    order = torch.argsort(ratio, descending=True)
    ps, qs = p[order], q[order]
    p_at_or_above = torch.cumsum(ps, 0)
    q_below = qs.sum() - torch.cumsum(qs, 0)
    both = (ps > 0) & (qs > 0)
    denominator = p_at_or_above / ps.clamp(min=1e-300) + q_below / qs.clamp(min=1e-300)
    return torch.where(both, 1.0 / denominator, 0.0).sum().to(target_probs.dtype)


def onehot_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor, first_piece: torch.Tensor) -> torch.Tensor:
    """Chance that the one-hot proposal is accepted at one position: sum_d q(d) p(first_piece[d]), the draft id d
    drawn from its (Vd,) distribution q and proposed as the first target token of its text (first_piece[d]; -1,
    no target token: counts as rejected). A 0-dim tensor."""
    p_first = target_probs[first_piece.clamp(min=0)] * (first_piece >= 0)  # (Vd,)
    return (draft_probs * p_first).sum()


def grouped_distribution(draft_probs: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(Vd,) draft distribution and (Vd,) group of each draft id (a target id; -1: none) -> (Vt,) the
    distribution of the group of a draft id drawn from draft_probs restricted to grouped ids (renormalised).
    All zeros when no grouped id has mass. No host sync."""
    grouped = draft_probs * (groups >= 0)  # (Vd,)
    total = grouped.sum()
    out = torch.zeros(num_groups, dtype=draft_probs.dtype, device=draft_probs.device)
    out.index_add_(0, groups.clamp(min=0), grouped / torch.where(total > 0, total, 1.0))  # (Vt,)
    return out


def draw_groups_without_replacement(draft_probs: torch.Tensor, groups: torch.Tensor, num_groups: int, count: int,
                                    noise: torch.Tensor, group_keys: torch.Tensor | None = None
                                    ) -> tuple[list[int], list[int]]:
    """Up to `count` distinct groups drawn in turn without replacement from `grouped_distribution`, each with
    the draft id that represents it -> (group ids in draw order, their draft ids). One host transfer.

    An exponential race over draft ids (key probs / noise, noise (Vd,) Exp(1)): a group's key is the largest of
    its ids' keys, which is 1 / Exp(rate Q(group)), so the groups sorted by key are a draw without
    replacement from Q (the Gumbel-top-k trick), and a group's best id is drawn from the draft restricted to
    the group. Groups with no mass are never drawn. `group_keys` (Vt,): the groups' keys given instead, under the
    keyed sampler Q(group) / E(group) on the target's keyed noise at the root's position (keyed.Coupling.row;
    reference/keyed.py, item 6), the ids within each group still raced on `noise`."""
    keys = torch.where(groups >= 0, draft_probs / noise, torch.zeros_like(draft_probs))  # (Vd,)
    if group_keys is None:
        group_keys = torch.zeros(num_groups, dtype=keys.dtype, device=keys.device)
        group_keys.scatter_reduce_(0, groups.clamp(min=0), keys, reduce="amax")  # (Vt,); ungrouped ids add key 0
    top_keys, top_groups = group_keys.topk(min(count, num_groups))  # (m,)
    ids = torch.where(groups == top_groups[:, None], keys, -1.0).argmax(dim=-1)  # (m,): each group's largest key
    chosen, draft_ids, drawn = torch.stack([top_groups, ids, (top_keys > 0).long()]).tolist()
    n = sum(drawn)  # NOTE: keys > 0 come first, so the drawn groups are a prefix
    return chosen[:n], draft_ids[:n]


def verify_greedy(target_logits: torch.Tensor, proposal_ids: torch.Tensor | list[int]) -> tuple[int, int]:
    """(K+1, Vt) logits and (K,) proposals (a tensor or host ids) -> (num_accepted, next_token).

    Accepts the longest prefix of proposals equal to the target's argmax; next_token is the argmax at the first
    mismatch (the *recovered* token) or after the last proposal (the *bonus* token).
    """
    target_argmax = torch.argmax(target_logits, dim=-1).tolist()  # (K+1,): the cycle's one transfer to the host
    proposals = proposal_ids.tolist() if isinstance(proposal_ids, torch.Tensor) else list(proposal_ids)
    num_accepted = next((i for i, (a, b) in enumerate(zip(target_argmax[: len(proposals)], proposals, strict=True)) if a != b),
                        len(proposals))
    return num_accepted, target_argmax[num_accepted]


def count_accepted(
    target_probs: torch.Tensor,
    proposal_ids: torch.Tensor,
    uniforms: torch.Tensor,
    proposal_probs: torch.Tensor | None = None,
) -> int:
    """Number of leading proposals accepted by u_i * q_i(x_i) < p_i(x_i); q one-hot when proposal_probs is None.

    target_probs (K+1, Vt) or (K, Vt); proposal_ids (K,); uniforms (K,); proposal_probs (K, Vt) or None.
    """
    k = proposal_ids.shape[0]
    if k == 0:
        return 0
    rows = torch.arange(k, device=target_probs.device)
    p_x = target_probs[rows, proposal_ids]  # (K,)
    q_x = torch.ones_like(p_x) if proposal_probs is None else proposal_probs[rows, proposal_ids]
    rejected = uniforms * q_x >= p_x  # (K,)
    if proposal_probs is None:
        flags = rejected.tolist()  # the one transfer to the host
    else:
        # NOTE: a proposed token must have q > 0 (the draft drew it); q = 0 here means the map is wrong. Checked
        # in the same transfer as the decisions.
        flags, impossible = torch.stack([rejected, q_x <= 0]).tolist()
        if any(impossible):
            raise XTokSpecError("a proposed token has zero proposal probability: the token map is inconsistent")
    return next((i for i, r in enumerate(flags) if r), k)


def next_token_distribution(
    target_probs: torch.Tensor,
    proposal_ids: torch.Tensor,
    num_accepted: int,
    proposal_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """(Vt,) unnormalised distribution of the token emitted after `num_accepted` acceptances.

    All accepted: the bonus distribution p_K. Otherwise the residual max(0, p_i - q_i) at the rejected
    position i (one-hot q: p_i with the rejected token zeroed).
    """
    i = num_accepted
    if i == proposal_ids.shape[0]:
        return target_probs[i]
    if proposal_probs is None:
        residual = target_probs[i].clone()
        residual[proposal_ids[i]] = 0.0
    else:
        residual = torch.clamp(target_probs[i] - proposal_probs[i], min=0.0)
    # NOTE: p itself only through rounding when p == q (the rejection itself had probability ~0); chosen on the
    # device, so the host does not wait for it
    return torch.where((residual > 0).any(), residual, target_probs[i])

