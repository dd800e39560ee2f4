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

A *sampled root* (`verify_tree_sampled(..., root_q=q)`, the default when sampling): the root's children were
drawn in turn without replacement from the draft's distribution q on the target vocabulary (its first token,
moved there by the first target token of its text), and are tested against it: c_j is accepted iff
u_j * q_j(c_j) < p_j(c_j), with p_{j+1} = norm(max(0, p_j - q_j)) and q_{j+1} = q_j without c_j,
renormalised; if all are rejected the token is drawn from p_{m+1} (recursive rejection sampling without
replacement, Jeon et al. 2024). The emitted token again follows p, here on average over the draws, so the
children must be exactly the draws, in draw order (reference/tree.py proves it). It accepts sum min(p, q) with
one child and more with each further one: with a flat target far more than the one-hot rule's children mass.
Nodes below the root keep the one-hot rule (their children come from the bridged text, not from a q).

The walk needs the probabilities of the children only, so it gathers them on the device and moves them to the
host once, then draws the emitted token on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..runtime.kv import to_device
from . import sampling


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
    # The root's first `pinned` children are drawn samples (a sampled root): verified whatever their value, since
    # dropping a draw for its own value would bias the rule (reference/tree.py). They rank before every other node.
    pinned: int = 0

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
        """Token nodes by value, largest first (ties: smaller node number first), the pinned root children before
        all, so that every prefix of the list holds each node's parent before the node."""
        pinned = set(self.children[0][: self.pinned])
        return sorted(range(1, len(self.tokens)), key=lambda n: (n not in pinned, -self.values[n], n))

    def pruned(self, keep: int) -> Trie:
        """The trie of the `keep` most valuable nodes (a prefix of `ranked`: closed under parents), children
        in their order here, nodes renumbered in their order here (parents still before children)."""
        kept = sorted(self.ranked()[: max(keep, self.pinned)])
        if len(kept) == self.size:
            return self
        out, number = Trie(pinned=self.pinned), {0: 0}
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


def child_probs(probs: torch.Tensor, trie: Trie, extra: torch.Tensor | None = None) -> tuple[list[list[float]], list[float]]:
    """p(c) of every child c at its parent's row, as host floats, and `extra` (any 1-D tensor on the same
    device) with them: one gather, one transfer."""
    rows = [p for p in range(len(trie.tokens)) for _ in trie.children[p]]
    cols = [trie.tokens[c] for p in range(len(trie.tokens)) for c in trie.children[p]]
    flat = probs[to_device(rows, probs.device), to_device(cols, probs.device)] if rows else probs.new_zeros(0)
    if extra is not None:
        flat = torch.cat([flat, extra.to(flat.dtype)])
    flat = flat.tolist()
    out, i = [], 0
    for kids in trie.children:
        out.append(flat[i : i + len(kids)])
        i += len(kids)
    return out, flat[i:]


def sampled_tests(p: torch.Tensor, q: torch.Tensor, child_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled node's rule on the device: (Vt,) target p and draft q, the children in draw order -> ((m, 2)
    each child's test (p_j(c_j), q_j(c_j)): accept iff u * q_j(c_j) < p_j(c_j); (Vt,) the residual p_{m+1}
    to draw from when all are rejected). No host sync."""
    p = p / p.sum()
    q = q / q.sum()
    tests = []
    for token in child_tokens:
        tests.append(torch.stack([p[token], q[token]]))
        rest = torch.clamp(p - q, min=0.0)
        total = rest.sum()
        # NOTE: rest is all zero only where p_j = q_j: c_j is then kept surely and p_{j+1} is never used
        p = torch.where(total > 0, rest / torch.where(total > 0, total, 1.0), p)
        q = q.clone()
        q[token] = 0.0
        left = q.sum()
        q = q / torch.where(left > 0, left, 1.0)
    return torch.stack(tests) if tests else p.new_zeros((0, 2)), p


def walk_sampled(trie: Trie, p_children: list[list[float]], uniforms: list[list[float]],
                 root_tests: list[tuple[float, float]] | None = None) -> tuple[list[int], int]:
    """Recursive rejection down the trie -> (accepted path, node where the walk stopped).

    p_children[n][j]: the target's probability of node n's j-th child at n; uniforms[n][j]: its U[0, 1) draw.
    root_tests (a sampled root): the root's children's tests (p_j(c_j), q_j(c_j)) from `sampled_tests`.
    """
    node, path = 0, []
    while True:
        remaining = 1.0  # target mass not yet rejected at this node (1 - sum of the rejected children's p)
        accepted = None
        for j, child in enumerate(trie.children[node]):
            if node == 0 and root_tests is not None:
                p_j, q_j = root_tests[j]
                if uniforms[0][j] * q_j < p_j:
                    accepted = child
                    break
                continue
            p = p_children[node][j]
            if uniforms[node][j] * remaining < p:
                accepted = child
                break
            remaining -= p
        if accepted is None:
            return path, node
        path.append(accepted)
        node = accepted


def walk_keyed(trie: Trie, sample) -> tuple[list[int], int]:
    """The keyed sampler's walk (decode/keyed.py): from the root, to the child whose token is the node's keyed
    sample (`sample(n)`, node n's, computed only for the nodes reached), until no child is -> (accepted path, the
    token emitted: the last node's sample)."""
    node, path = 0, []
    while True:
        token = sample(node)
        child = next((c for c in trie.children[node] if trie.tokens[c] == token), None)
        if child is None:
            return path, token
        path.append(child)
        node = child


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
                        root_q: torch.Tensor | None = None, walk=None) -> tuple[list[int], int]:
    """(N+1, V) warped target probabilities; uniforms (N+1, max children) U[0, 1); noise (V,) Exp(1) for the
    emitted token; root_q (V,): the draft distribution the root's children were drawn from without replacement
    (a sampled root), or None (one-hot root); `walk`: the walk down the trie (default `walk_sampled`; a test's
    negative control hands a wrong one) -> (accepted path of node numbers, next token)."""
    sampled = root_q is not None and bool(trie.children[0])
    if sampled:
        tests, root_rest = sampled_tests(probs[0], root_q.to(probs.device), [trie.tokens[c] for c in trie.children[0]])
        p_children, flat_tests = child_probs(probs, trie, tests.flatten())
        root_tests = list(zip(flat_tests[0::2], flat_tests[1::2], strict=True))
    else:
        p_children, _ = child_probs(probs, trie)
        root_tests = None
    u = uniforms.tolist()
    path, node = (walk or walk_sampled)(trie, p_children, u, root_tests)
    if sampled and node == 0:
        dist = root_rest
    else:
        dist = residual(probs[node], [trie.tokens[c] for c in trie.children[node]])
    return path, int(sampling.race(dist, noise.to(dist.device)))
