"""The target's verdict on a proposal: one forward over the uncached ids and the proposals (a chain's K ids, or a
trie's nodes, tree-masked), then the accepted proposals and the next token (recovered or bonus).

Greedy: a proposal is accepted while it is the target's argmax (`sampling.verify_greedy`, `tree.verify_tree_greedy`).
Sampling: the recursive rejection of Leviathan et al. 2023 / Chen et al. 2023 (`sampling.count_accepted`,
`sampling.next_token_distribution`; a trie: `tree.verify_tree_sampled`), on the target's own generator: the
uniforms first, then the exponential noise of the next token's race. Keyed (`Sampler.key`, SamplingParams.keyed):
each position's keyed sample (decode/keyed.py) is computed, a proposal is accepted iff it equals it, and the first
one not proposed is emitted; a trie is walked along the keyed samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..runtime.cache import ModelState
from ..runtime.kv import to_device
from . import keyed, sampling, tree
from .propose import Proposal


@dataclass(frozen=True)
class SamplerOps:
    """The steps of sampled verification that decide what is emitted. The defaults are the proven ones
    (reference/); a statistical test hands in a deliberately wrong one as its negative control, which must fail."""

    count_accepted: Callable = sampling.count_accepted  # a chain's accepted proposals
    next_token_distribution: Callable = sampling.next_token_distribution  # a chain's residual or bonus row
    walk: Callable = tree.walk_sampled  # a trie's walk down its accepted path
    keyed_chain: Callable = keyed.chain  # a chain's verdict under the keyed rule
    keyed_walk: Callable = tree.walk_keyed  # a trie's walk along the keyed samples


@dataclass
class Sampler:
    """The target's logits processing (transformers' warpers), random stream and sampling steps."""

    warpers: object
    generator: torch.Generator
    ops: SamplerOps = field(default_factory=SamplerOps)
    key: int | None = None  # the keyed sampler's seed (None: the generator's draws)
    start: int = 0  # the target's ids before the first output position (the prompt's)


@dataclass
class Verdict:
    accepted: int  # proposals accepted in a row (a tree: the nodes on the accepted path)
    next_token: int  # the recovered (after a rejection) or bonus (after all accepted) token
    rejected: bool  # the walk stopped at a rejection
    path: list[int] | None = None  # a tree's accepted nodes
    target_probs: torch.Tensor | None = None  # (K+1, Vt) a sampled chain's warped target distributions


def verify(target: ModelState, proposal: Proposal, sampler: Sampler | None) -> Verdict:
    """Feed the proposal to `target` (its nodes stay in the cache until the commit) -> the verdict."""
    if proposal.trie is not None:
        return verify_tree(target, proposal.trie, sampler, proposal.root_q)
    return verify_chain(target, proposal.target_ids, proposal.proposal_probs, sampler)


def verify_chain(target: ModelState, proposals: list[int], proposal_probs: torch.Tensor | None,
                 sampler: Sampler | None) -> Verdict:
    """A chain of K proposals (none: the target's own next token) -> the verdict."""
    target.extend(proposals)
    logits = target.forward(keep=len(proposals) + 1)  # (K+1, Vt)
    if sampler is None:
        accepted, next_token = sampling.verify_greedy(logits, proposals)
        return Verdict(accepted, next_token, accepted < len(proposals))
    target_probs = sampling.logits_to_probs(logits, sampler.warpers)  # (K+1, Vt)
    if sampler.key is not None:
        first = len(target.ids) - len(proposals) - sampler.start
        accepted, next_token = sampler.ops.keyed_chain(target_probs, proposals, sampler.key, first)
        return Verdict(accepted, next_token, accepted < len(proposals), target_probs=target_probs)
    proposal_ids = to_device(proposals, logits.device)  # (K,)
    gen = sampler.generator
    uniforms = torch.rand(len(proposals), generator=gen, device=gen.device).to(logits.device)
    accepted = sampler.ops.count_accepted(target_probs, proposal_ids, uniforms, proposal_probs)
    dist = sampler.ops.next_token_distribution(target_probs, proposal_ids, accepted, proposal_probs)
    noise = sampling.exponential_noise(dist.shape, gen, gen.device).to(dist.device)
    next_token = int(sampling.race(dist, noise))
    return Verdict(accepted, next_token, accepted < len(proposals), target_probs=target_probs)


def verify_tree(target: ModelState, trie: tree.Trie, sampler: Sampler | None, root_q: torch.Tensor | None) -> Verdict:
    """A trie of proposals in one tree-masked forward -> the verdict (its path: the accepted nodes)."""
    logits = target.forward_tree(trie.tokens, trie.parents)  # (N+1, Vt)
    if sampler is None:
        path, next_token = tree.verify_tree_greedy(logits, trie)
    elif sampler.key is not None:
        probs = sampling.logits_to_probs(logits, sampler.warpers)  # (N+1, Vt)
        first = len(target.ids) - sampler.start
        path, next_token = sampler.ops.keyed_walk(
            trie, lambda node: keyed.sample(probs[node], sampler.key, first + trie.depths[node]))
    else:
        probs = sampling.logits_to_probs(logits, sampler.warpers)  # (N+1, Vt)
        gen = sampler.generator
        uniforms = torch.rand((trie.size + 1, max(1, trie.max_children())), generator=gen, device=gen.device)
        noise = sampling.exponential_noise(probs.shape[-1:], gen, gen.device)
        path, next_token = tree.verify_tree_sampled(probs, trie, uniforms, noise, root_q=root_q, walk=sampler.ops.walk)
    return Verdict(len(path), next_token, bool(trie.children[path[-1] if path else 0]), path=path)
