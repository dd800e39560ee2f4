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

A sampled root (recursive rejection with q; Jeon et al. 2024, "Recursive Speculative Decoding", sampling
without replacement). The one-hot rule accepts at most the children's target mass p(c_1) + ... + p(c_m):
with a flat target (T=0.7 on a small model) even the draft's best m candidates hold little of it. When the
draft's distribution q on the target vocabulary is known at a node (at the root: the draft's first token,
moved onto the target vocabulary by the first target token of its text), the children can instead be drawn
from q *without replacement* and verified against it:
  q_1 = q, p_1 = p. The children c_1, c_2, ... are drawn in turn, c_j from q_j. Child c_j is accepted iff
  u_j * q_j(c_j) < p_j(c_j), i.e. with probability min(1, p_j(c_j) / q_j(c_j)). On a rejection
  p_{j+1} = norm(max(0, p_j - q_j)) and q_{j+1} = q_j with c_j removed, renormalised. If all m are rejected,
  the token is drawn from p_{m+1}.

Theorem (sampled node). Averaged over the children's draws, the emitted-or-accepted token has law p.
  Proof: by induction from the last child back. Given any history c_1..c_{j-1}, the procedure from child j on
  emits a token with law p_j. For j = m + 1 it draws from p_{m+1}. For j <= m, c_j ~ q_j, and it is kept with
  probability min(1, p_j/q_j)(c_j); otherwise (probability 1 - sum min(p_j, q_j)) the rest emits p_{j+1} =
  max(0, p_j - q_j) / (1 - sum min(p_j, q_j)) by induction (p_{j+1} does not depend on c_j). So
  P(x) = min(p_j, q_j)(x) + max(0, p_j - q_j)(x) = p_j(x): the one-position lemma of Leviathan et al.
  Then P(x) = p_1(x) = p(x). Where max(0, p_j - q_j) is all zero, p_j = q_j and c_j is kept surely.
  Unlike the one-hot rule, this holds only on average over the draws: for one fixed list of children the
  law is not p (``sampled_node_law_given`` shows it), so the children must really be drawn from q_j in
  order, and neither the draft nor a pruning step may drop one of them for its own value or identity. The
  *number* of children may depend on anything known before the next one is drawn (a stopping time), which
  includes the node's own value and the children drawn so far; xtokspec draws tree_width children and
  verifies all of them.
  Acceptance: sum min(p, q) for one child (the intersection proposal's), rising with m; for a target that
  is flat and a draft that follows it, far above the one-hot rule's top-m mass.

Theorem (tree with a sampled root). The tree theorem above holds when the root's children are drawn this way
and each subtree is any function of its child (and of the draft's other randomness): the root emits law p
on average over the draws, and the walk below each child is the one-hot rule, exact for every trie.
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


# ---------------------------------------------------------------- a sampled root (recursive rejection with q)
def without_replacement_law(q: np.ndarray, count: int) -> dict[tuple[int, ...], float]:
    """Exact law of `count` tokens drawn from q without replacement, in order (fewer if q runs out)."""
    q = np.asarray(q, dtype=np.float64)
    law: dict[tuple[int, ...], float] = {}

    def draw(seq: tuple[int, ...], prob: float, left: np.ndarray) -> None:
        total = left.sum()
        if len(seq) == count or total <= 0:
            law[seq] = law.get(seq, 0.0) + prob
            return
        for token in np.flatnonzero(left):
            rest = left.copy()
            rest[token] = 0.0
            draw(seq + (int(token),), prob * left[token] / total, rest)

    draw((), 1.0, q)
    return law


def sampled_steps(p: np.ndarray, q: np.ndarray, child_tokens: Sequence[int], flaw: str | None = None
                  ) -> tuple[list[tuple[float, float]], np.ndarray]:
    """For children drawn in this order from q without replacement: each child's test (p_j(c_j), q_j(c_j))
    (accept iff u * q_j(c_j) < p_j(c_j)) and the residual p_{m+1} to draw from when all are rejected.

    `flaw` is for negative controls: "keep_p" never updates p (p_{j+1} = p_j), "onehot_residual" updates it
    as the one-hot rule would (p_j with c_j removed) instead of max(0, p_j - q_j), "no_renormalize" leaves q_j
    unnormalised after the removal. Each gives a wrong law."""
    p = np.asarray(p, dtype=np.float64) / np.sum(p)
    q = np.asarray(q, dtype=np.float64) / np.sum(q)
    if len(set(child_tokens)) != len(child_tokens):
        raise ValueError(f"children must hold distinct tokens, got {list(child_tokens)}")
    tests = []
    for token in child_tokens:
        if q[token] <= 0:
            raise ValueError(f"child {token} has q = 0: it cannot have been drawn from q")
        tests.append((float(p[token]), float(q[token])))
        if flaw == "onehot_residual":
            rest = p.copy()
            rest[token] = 0.0
        elif flaw == "keep_p":
            rest = p
        else:
            rest = np.maximum(p - q, 0.0)
        if rest.sum() > 0:  # NOTE: all zero only where p_j = q_j: then c_j is kept surely, p_{j+1} unused
            p = rest / rest.sum()
        q = q.copy()
        q[token] = 0.0
        if flaw != "no_renormalize" and q.sum() > 0:
            q = q / q.sum()
    return tests, p


def sampled_node_step(p: np.ndarray, q: np.ndarray, child_tokens: Sequence[int], uniforms: Sequence[float],
                      flaw: str | None = None) -> tuple[int | None, np.ndarray]:
    """(index j of the accepted child or None, the residual p_{m+1} to draw from when None)."""
    tests, rest = sampled_steps(p, q, child_tokens, flaw)
    for j, (p_j, q_j) in enumerate(tests):
        if uniforms[j] * q_j < p_j:
            return j, rest
    return None, rest


def sampled_node_law_given(p: np.ndarray, q: np.ndarray, child_tokens: Sequence[int],
                           flaw: str | None = None) -> np.ndarray:
    """Law (V,) of the token a sampled node emits *for this one list of children* (not p in general)."""
    tests, rest = sampled_steps(p, q, child_tokens, flaw)
    law = np.zeros(len(p), dtype=np.float64)
    reach = 1.0
    for token, (p_j, q_j) in zip(child_tokens, tests, strict=True):
        accept = min(1.0, p_j / q_j)
        law[token] += reach * accept
        reach *= 1.0 - accept
    return law + reach * rest / rest.sum()


def sampled_node_law(p: np.ndarray, q: np.ndarray, count: int, flaw: str | None = None) -> np.ndarray:
    """Exact law (V,) of a sampled node's token, averaged over its `count` children drawn from q."""
    law = np.zeros(len(p), dtype=np.float64)
    for children, prob in without_replacement_law(q, count).items():
        law += prob * sampled_node_law_given(p, q, children, flaw)
    return law


def sampled_acceptance(p: np.ndarray, q: np.ndarray, count: int) -> float:
    """Chance that a sampled node accepts one of its `count` children (averaged over the draws)."""
    total = 0.0
    for children, prob in without_replacement_law(q, count).items():
        reach = 1.0
        for p_j, q_j in sampled_steps(p, q, children)[0]:
            reach *= 1.0 - min(1.0, p_j / q_j)
        total += prob * (1.0 - reach)
    return total


def sampled_root_tree_walk(tokens: Sequence[int], parents: Sequence[int], node_probs: np.ndarray,
                           root_q: np.ndarray, uniforms: np.ndarray, noise: np.ndarray,
                           flaw: str | None = None) -> tuple[list[int], int]:
    """`tree_walk` with a sampled root: the root's children (in node order) were drawn from root_q without
    replacement and are tested against it; every other node follows the one-hot rule."""
    kids = children_of(parents)
    root_tokens = [tokens[c] for c in kids[0]]
    j, rest = sampled_node_step(node_probs[0], root_q, root_tokens, uniforms[0], flaw)
    if j is None:
        return [], sample_race(rest, noise)
    start = kids[0][j]
    sub_path, token = tree_walk(*_subtree(tokens, parents, start), node_probs[_subtree_nodes(parents, start)],
                                uniforms[_subtree_nodes(parents, start)], noise)
    nodes = _subtree_nodes(parents, start)
    return [start] + [nodes[n] for n in sub_path], token


def _subtree_nodes(parents: Sequence[int], start: int) -> list[int]:
    """start and its descendants, in node order (start first: it becomes the subtree's root)."""
    inside = {start}
    for node in range(start + 1, len(parents)):
        if parents[node] in inside:
            inside.add(node)
    return sorted(inside)


def _subtree(tokens: Sequence[int], parents: Sequence[int], start: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the subtree under `start`, renumbered with start as node 0."""
    nodes = _subtree_nodes(parents, start)
    number = {n: i for i, n in enumerate(nodes)}
    return [-1] + [tokens[n] for n in nodes[1:]], [-1] + [number[parents[n]] for n in nodes[1:]]


def sampled_root_tree_law(root_q: np.ndarray, count: int,
                          subtree_fn: Callable[[int], tuple[list[int], list[int]]],
                          prob_fn: Callable[[tuple[int, ...]], np.ndarray],
                          flaw: str | None = None) -> dict[tuple[int, ...], float]:
    """Exact law of one verification's emitted sequence when the root's `count` children are drawn from root_q
    without replacement and the subtree under child token t is subtree_fn(t) = (tokens, parents) (node 0: the
    child itself). Averaged over the draws; every node below the root follows the one-hot rule."""
    law: dict[tuple[int, ...], float] = {}
    p = np.asarray(prob_fn(()), dtype=np.float64)
    for children, prob in without_replacement_law(root_q, count).items():
        tests, rest = sampled_steps(p, root_q, children, flaw)
        reach = 1.0
        for token, (p_j, q_j) in zip(children, tests, strict=True):
            accept = min(1.0, p_j / q_j)
            sub_tokens, sub_parents = subtree_fn(token)
            sub = tree_law(sub_tokens, sub_parents, lambda prefix, t=token: prob_fn((t,) + prefix))
            for seq, sub_prob in sub.items():
                key = (token,) + seq
                law[key] = law.get(key, 0.0) + prob * reach * accept * sub_prob
            reach *= 1.0 - accept
        rest = rest / rest.sum()
        for token in np.flatnonzero(rest):
            law[(int(token),)] = law.get((int(token),), 0.0) + prob * reach * rest[token]
    return law
