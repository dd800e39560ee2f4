"""Token-tree verification with one-hot candidates (recursive rejection), written out in float64.

A trie of proposed tokens: node 0 is the root (the position after the committed text), node n >= 1 holds
token ``tokens[n]`` under ``parents[n]`` (parents[n] < n). ``children(n)`` lists a node's children in the
order they are tried (the draft's ranking). ``node_probs[n]`` (V,) is the target's next-token distribution
after the path to node n.

The rule at a node with target distribution p and children c_1..c_m (distinct tokens):
  try c_1, c_2, ... in turn; with r_j = 1 - p(c_1) - ... - p(c_{j-1}) the mass not yet rejected, accept c_j
  iff u_j * r_j < p(c_j), i.e. with probability p'(c_j) = p(c_j) / r_j, the target distribution with the
  rejected children removed and renormalised. Accepting c_j moves the walk to c_j. If all m are rejected,
  emit a token from p with c_1..c_m removed (renormalised) and stop.

Theorem (one node). The emitted-or-accepted token x has law p.
  Proof: P(c_j is reached and accepted) = prod_{i<j} (1 - p(c_i)/r_i) * p(c_j)/r_j. Since
  1 - p(c_i)/r_i = r_{i+1}/r_i, the product telescopes to (r_j / r_1) * p(c_j)/r_j = p(c_j) (r_1 = 1). All m
  are rejected with probability r_{m+1} = 1 - sum_j p(c_j); the residual then draws x outside the children
  with probability p(x) / r_{m+1}, so P(x) = p(x). (A child with r_j = 0 is never reached.)

Theorem (tree). The walk's tokens are a prefix of a sample from the target: the law of the emitted sequence,
extended by sampling the target after it to any fixed length L, equals the target's law of L tokens.
  Proof: by induction on depth. At the root the next token has law p_root (one node). Given that token, if it
  is a child, the walk continues at that child, whose distribution is the target's after it (node_probs is
  the target's conditional), and the subtree is again a trie: the same argument applies; if it is not a
  child, the walk stops, and the extension samples the target from there. The per-node randomness (u, noise)
  is fresh at each node, so the steps compose.

The candidates may be chosen in any way that does not look at the target's randomness (u, noise): the
proof never uses how they were chosen. That includes which drafted nodes are verified at all: xtokspec cuts
each drafted trie to the nodes worth their verification cost (their draft probabilities, and costs and
acceptance measured in earlier cycles), before this cycle's u and noise are drawn; any such cut is a trie, and
the theorem holds for every trie. Without the renormalisation (accepting c_j with probability p(c_j)),
later children are under-accepted and the law is wrong: ``renormalize=False`` is the negative control.

Randomness is explicit so the torch implementation can be replayed: ``uniforms`` (N+1, W) with row n, column
j the draw for node n's j-th child, and ``noise`` (V,) Exp(1) for the one emitted token (exponential race).
"""

from collections.abc import Callable, Sequence

import numpy as np

from reference.rejection import sample_race


def children_of(parents: Sequence[int]) -> list[list[int]]:
    """Children of every node, in node-number order (the order they are tried)."""
    out: list[list[int]] = [[] for _ in parents]
    for node in range(1, len(parents)):
        if not 0 <= parents[node] < node:
            raise ValueError(f"node {node}'s parent {parents[node]} must be an earlier node")
        out[parents[node]].append(node)
    return out


def node_step(p: np.ndarray, child_tokens: Sequence[int], uniforms: Sequence[float],
              renormalize: bool = True) -> int | None:
    """Index j of the accepted child, or None when all are rejected (p (V,), one uniform per child)."""
    p = np.asarray(p, dtype=np.float64)
    if len(set(child_tokens)) != len(child_tokens):
        raise ValueError(f"children must hold distinct tokens, got {list(child_tokens)}")
    remaining = 1.0
    for j, token in enumerate(child_tokens):
        if uniforms[j] * (remaining if renormalize else 1.0) < p[token]:
            return j
        remaining -= p[token]
    return None


def residual(p: np.ndarray, child_tokens: Sequence[int]) -> np.ndarray:
    """p with the (all rejected) children removed, unnormalised; p itself if nothing is left (rounding)."""
    out = np.asarray(p, dtype=np.float64).copy()
    out[list(child_tokens)] = 0.0
    return out if (out > 0).any() else np.asarray(p, dtype=np.float64)


def tree_walk(tokens: Sequence[int], parents: Sequence[int], node_probs: np.ndarray, uniforms: np.ndarray,
              noise: np.ndarray, renormalize: bool = True) -> tuple[list[int], int]:
    """One verification -> (accepted path as node numbers, the emitted token after it)."""
    kids = children_of(parents)
    node, path = 0, []
    while True:
        child_tokens = [tokens[c] for c in kids[node]]
        j = node_step(node_probs[node], child_tokens, uniforms[node], renormalize)
        if j is None:
            return path, sample_race(residual(node_probs[node], child_tokens), noise)
        node = kids[node][j]
        path.append(node)


def node_law(p: np.ndarray, child_tokens: Sequence[int], renormalize: bool = True) -> np.ndarray:
    """Exact law (V,) of the token a node accepts or emits, from the mechanics (not from the theorem)."""
    p = np.asarray(p, dtype=np.float64)
    law = np.zeros_like(p)
    reach, remaining = 1.0, 1.0  # P(child j is tried); the mass not yet rejected
    for token in child_tokens:
        accept = min(1.0, p[token] / (remaining if renormalize else 1.0)) if remaining > 0 else 1.0
        law[token] += reach * accept
        reach *= 1.0 - accept
        remaining -= p[token]
    rest = residual(p, child_tokens)
    return law + reach * rest / rest.sum()


def tree_law(tokens: Sequence[int], parents: Sequence[int], prob_fn: Callable[[tuple[int, ...]], np.ndarray],
             renormalize: bool = True) -> dict[tuple[int, ...], float]:
    """Exact law of the emitted sequence (accepted path tokens + the emitted token) of one verification, where
    prob_fn(prefix) is the target's next-token distribution after `prefix` (relative to the root)."""
    kids = children_of(parents)
    law: dict[tuple[int, ...], float] = {}

    def visit(node: int, prefix: tuple[int, ...], prob: float) -> None:
        p = np.asarray(prob_fn(prefix), dtype=np.float64)
        child_tokens = [tokens[c] for c in kids[node]]
        step = node_law(p, child_tokens, renormalize)
        for token in np.flatnonzero(step):
            if token in child_tokens:
                visit(kids[node][child_tokens.index(token)], prefix + (int(token),), prob * step[token])
            else:
                law[prefix + (int(token),)] = law.get(prefix + (int(token),), 0.0) + prob * step[token]

    visit(0, (), 1.0)
    return law


def extend_law(law: dict[tuple[int, ...], float], prob_fn: Callable[[tuple[int, ...]], np.ndarray],
               length: int) -> dict[tuple[int, ...], float]:
    """Each sequence continued by sampling the target until it has `length` tokens: the exact law."""
    out: dict[tuple[int, ...], float] = {}

    def grow(seq: tuple[int, ...], prob: float) -> None:
        if len(seq) >= length:
            out[seq[:length]] = out.get(seq[:length], 0.0) + prob
            return
        p = np.asarray(prob_fn(seq), dtype=np.float64)
        for token in np.flatnonzero(p):
            grow(seq + (int(token),), prob * p[token])

    for seq, prob in law.items():
        grow(seq, prob)
    return out


def target_law(prob_fn: Callable[[tuple[int, ...]], np.ndarray], length: int) -> dict[tuple[int, ...], float]:
    """The target's own law of `length` tokens after the root."""
    return extend_law({(): 1.0}, prob_fn, length)


def random_trie(rng: np.random.Generator, vocab_size: int, nodes: int,
                max_children: int | None = None) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a random trie of `nodes` nodes whose siblings hold distinct tokens (for tests)."""
    tokens, parents = [-1], [-1]
    while len(tokens) <= nodes:
        parent = int(rng.integers(len(tokens)))
        used = {tokens[c] for c in range(1, len(tokens)) if parents[c] == parent}
        free = [t for t in range(vocab_size) if t not in used]
        if not free or (max_children is not None and len(used) >= max_children):
            continue
        tokens.append(int(rng.choice(free)))
        parents.append(parent)
    return tokens, parents
