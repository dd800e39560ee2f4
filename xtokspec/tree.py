"""Token trees: several drafted continuations, merged into a trie of target tokens, verified in one forward.

A trie node n >= 1 is a target token `tokens[n]` whose parent is `parents[n]`; node 0 is the root, the
position after the committed text. Nodes are numbered in creation order, so a parent's number is always
smaller than its children's, and a path from the root visits increasing numbers.

Verification reads the target's distribution at every node (row n of the logits: the next token after the
path to n) and walks down from the root:

- greedy: follow the child equal to the target's argmax; emit the argmax where no child matches;
- sampling (recursive rejection with one-hot proposals): the children c_1..c_m of a node, in the order the
  draft ranked them, are tried in turn. c_j is accepted with probability p'(c_j), where p' is the target's p
  with c_1..c_{j-1} removed and renormalised: p'(c_j) = p(c_j) / (1 - p(c_1) - ... - p(c_{j-1})); the test is
  u_j * (1 - p(c_1) - ... - p(c_{j-1})) < p(c_j), without a division. If every child is rejected, the emitted
  token is drawn from p with all children removed. Each token x is then emitted with probability exactly p(x)
  (reference/tree.py proves it and checks it by exact enumeration), and the walk descends with probability
  sum_j p(c_j), the children's total target mass.

The walk needs the probabilities of the children only, so it gathers them on the device and moves them to the
host once, then draws the emitted token on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import sampling
from .cache import to_device


@dataclass
class Trie:
    """Target-token trie; node 0 is the root (no token)."""

    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    children: list[list[int]] = field(default_factory=lambda: [[]])
    # A node's estimated chance of being accepted (the likeliest draft path through it; the root: 1). Along a
    # path values never increase, which `pruned` relies on.
    values: list[float] = field(default_factory=lambda: [1.0])

    @property
    def size(self) -> int:
        """Number of token nodes (the root excluded)."""
        return len(self.tokens) - 1

    @property
    def depth(self) -> int:
        return max(self.depths)

    def insert(self, ids: list[int], max_depth: int | None = None, max_nodes: int | None = None,
               values: list[float] | None = None) -> None:
        """Add the path `ids` (cut at max_depth tokens; stops where a new node would exceed max_nodes). `values`
        (one per id, non-increasing): each node keeps the largest value any inserted path gives it."""
        node = 0
        for i, token in enumerate(ids[:max_depth]):
            child = next((c for c in self.children[node] if self.tokens[c] == token), None)
            if child is None:
                if max_nodes is not None and self.size >= max_nodes:
                    return
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1)
                self.children.append([])
                self.values.append(0.0)
                self.children[node].append(child)
            if values is not None:
                self.values[child] = max(self.values[child], min(values[i], self.values[node]))
            node = child

    def ranked(self) -> list[int]:
        """Token nodes by value, largest first (ties: smaller node number first), so that every prefix of the
        list holds each node's parent before the node."""
        return sorted(range(1, len(self.tokens)), key=lambda n: (-self.values[n], n))

    def pruned(self, keep: int) -> Trie:
        """The trie of the `keep` most valuable nodes (a prefix of `ranked`: closed under parents), children
        in their order here, nodes renumbered in their order here (parents still before children)."""
        kept = sorted(self.ranked()[:keep])
        if len(kept) == self.size:
            return self
        out, number = Trie(), {0: 0}
        for n in kept:
            parent = number[self.parents[n]]  # KeyError would mean a node kept without its parent
            number[n] = len(out.tokens)
            out.tokens.append(self.tokens[n])
            out.parents.append(parent)
            out.depths.append(self.depths[n])
            out.children.append([])
            out.values.append(self.values[n])
            out.children[parent].append(number[n])
        return out

    def path_tokens(self, path: list[int]) -> list[int]:
        return [self.tokens[n] for n in path]

    def ancestors(self, node: int) -> list[int]:
        """node's path from the root's first child down to node itself (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def max_children(self) -> int:
        return max(len(c) for c in self.children)


def verify_tree_greedy(logits: torch.Tensor, trie: Trie) -> tuple[list[int], int]:
    """(N+1, V) logits (row n: after the path to node n) -> (accepted path of node numbers, next token)."""
    argmax = torch.argmax(logits, dim=-1).tolist()  # (N+1,): the one transfer to the host
    node, path = 0, []
    while True:
        child = next((c for c in trie.children[node] if trie.tokens[c] == argmax[node]), None)
        if child is None:
            return path, argmax[node]
        path.append(child)
        node = child


def child_probs(probs: torch.Tensor, trie: Trie) -> list[list[float]]:
    """p(c) of every child c at its parent's row, as host floats: one gather, one transfer."""
    rows = [p for p in range(len(trie.tokens)) for _ in trie.children[p]]
    cols = [trie.tokens[c] for p in range(len(trie.tokens)) for c in trie.children[p]]
    if not rows:
        return [[] for _ in trie.children]
    flat = probs[to_device(rows, probs.device), to_device(cols, probs.device)].tolist()
    out, i = [], 0
    for kids in trie.children:
        out.append(flat[i : i + len(kids)])
        i += len(kids)
    return out


def walk_sampled(trie: Trie, p_children: list[list[float]], uniforms: list[list[float]],
                 renormalize: bool = True) -> tuple[list[int], int]:
    """Recursive rejection down the trie -> (accepted path, node where the walk stopped).

    p_children[n][j]: the target's probability of node n's j-th child at n; uniforms[n][j]: its U[0, 1) draw.
    `renormalize=False` is the negative control of the tests (accepts c_j with p(c_j), not p'(c_j)): wrong.
    """
    node, path = 0, []
    while True:
        remaining = 1.0  # target mass not yet rejected at this node (1 - sum of the rejected children's p)
        accepted = None
        for j, child in enumerate(trie.children[node]):
            p = p_children[node][j]
            if uniforms[node][j] * (remaining if renormalize else 1.0) < p:
                accepted = child
                break
            remaining -= p
        if accepted is None:
            return path, node
        path.append(accepted)
        node = accepted


def residual(probs_row: torch.Tensor, excluded: list[int]) -> torch.Tensor:
    """(V,) target distribution at the stopping node with every rejected child removed (unnormalised)."""
    if not excluded:
        return probs_row
    out = probs_row.clone()
    out[to_device(excluded, out.device)] = 0.0
    # NOTE: p itself only through rounding (the children held all the mass and were all rejected); chosen on
    # the device, so the host does not wait for it
    return torch.where((out > 0).any(), out, probs_row)


def verify_tree_sampled(probs: torch.Tensor, trie: Trie, uniforms: torch.Tensor, noise: torch.Tensor,
                        renormalize: bool = True) -> tuple[list[int], int]:
    """(N+1, V) warped target probabilities; uniforms (N+1, max children) U[0, 1); noise (V,) Exp(1) for the
    emitted token -> (accepted path of node numbers, next token)."""
    p_children = child_probs(probs, trie)
    u = uniforms.tolist()
    path, node = walk_sampled(trie, p_children, u, renormalize)
    dist = residual(probs[node], [trie.tokens[c] for c in trie.children[node]])
    return path, int(sampling.race(dist, noise.to(dist.device)))
