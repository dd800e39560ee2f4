"""Drafting: a chain of K draft tokens, or a token tree, proposed on the target's vocabulary.

`ChainProposer.propose` drafts K ids (greedy, or sampled with the target's own logits processing) and maps
them through the cycle's mapper (xtokspec/decode/mapping.py). `TreeProposer.propose` grows a beam of `tree_width`
paths, bridges every branch into a trie of target ids (xtokspec/decode/tree.py) and prunes it to the nodes worth
verifying (policy.TreeBudget). Both return a `Proposal`; the draft's cache keeps what was drafted until the
mapper's `commit` (a tree's nodes are dropped there). Shape legend: Vd the draft's vocabulary, Vt the target's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..runtime.cache import ModelState
from ..runtime.kv import select_rows, to_device
from ..types import Laps
from . import sampling, tree


@dataclass
class Proposal:
    """What one cycle proposes to the verifier."""

    kind: str  # the mapper's kind (GenerationStats.proposal_cycles)
    draft_steps: int  # draft forwards
    draft_ids: list[int]  # a chain's drafted ids, in the draft's cache until the commit (a tree: none)
    target_ids: list[int]  # a chain's proposals on the target's vocabulary
    proposal_probs: torch.Tensor | None = None  # (K, Vt) the distributions they were drawn from; None: one-hot
    first_probs: torch.Tensor | None = None  # (Vd,) a sampled chain's draft distribution at its first position
    trie: tree.Trie | None = None  # a tree's proposals
    root_q: torch.Tensor | None = None  # (Vt,) a sampled root's distribution (its candidates' proposal)
    pruned: int = 0  # a tree's drafted nodes left out of verification
    size: int | None = None  # a captured tree verification: the nodes its bucket carries
    healed: bool = False  # the first drafted id took the place of the draft's last one (token healing)


class ChainProposer:
    """K draft tokens in a row, greedy or sampled, moved onto the target's vocabulary by a mapper."""

    def __init__(self, draft_eos: set[int], warpers=None, generator: torch.Generator | None = None,
                 min_confidence: float = 0.0, token_bytes: list[bytes] | None = None):
        self.draft_eos, self.warpers, self.generator = draft_eos, warpers, generator
        self.min_confidence = min_confidence
        self.table = token_bytes  # the draft's ids' bytes (None: one tokenizer, nothing is ever restated)
        self.coupling = None  # keyed.Coupling: draws on the intersection map race on the target's keyed noise

    def propose(self, draft: ModelState, k: int, mapper, room: int, laps: Laps) -> Proposal:
        """Draft up to k ids and map them; at most `room` proposals reach the verifier."""
        prefix, logits = self._heal(draft, mapper) if k > 0 else ([], None)
        restate = mapper.restate if not prefix else b""  # NOTE: a healed first id restates the pending text
        ids, covering = mapper.allowed(restate) if restate else (None, True)
        if self.warpers is None and self.min_confidence <= 0 and k - len(prefix) > 1 and covering:
            # NOTE: committed text to restate is covered by the first drafted token (its ids all start with it)
            drafted, rows, eos, first = *self._draft_greedy_on_device(draft, k - len(prefix), ids, logits), None
        else:
            drafted, rows, eos, first = self._draft(draft, max(k - len(prefix), 0), mapper, logits, restate)
        drafted = prefix + drafted
        laps("draft")
        proposals, proposal_probs = mapper.to_target(drafted, rows, eos)
        proposals = proposals[: max(0, room)]
        if proposal_probs is not None:
            proposal_probs = proposal_probs[: len(proposals)]
        laps("bridge")
        return Proposal(mapper.kind, len(drafted), drafted, proposals, proposal_probs, first, healed=bool(prefix))

    def _heal(self, draft: ModelState, mapper) -> tuple[list[int], torch.Tensor | None]:
        """Token healing at a cycle start (mapping.TextBridge.heal_candidate): the draft chooses its last id again,
        among the ids that start with its bytes, from the logits before it; both rows come from the forward that
        drafting makes anyway (two ids fed instead of one). -> ([the new first drafted id], None) where it chose
        another (the last id is then taken back, `mapper.heal`), ([], the logits after the last id (1, Vd)) where it
        chose the same, ([], None) where nothing may be healed."""
        candidate = mapper.heal_candidate(draft)
        if candidate is None:
            return [], None
        last, allowed = candidate
        logits = draft.forward_last(2)  # (2, Vd): after the id before the last, after the last
        before = only(logits[:1], allowed)  # (1, Vd)
        if self.warpers is None:
            choice = int(torch.argmax(before[0]))
        else:
            probs = sampling.logits_to_probs(before, self.warpers)[0]  # (Vd,)
            choice = int(sampling.race(probs, sampling.exponential_noise(probs.shape, self.generator, probs.device)))
        if choice == last:
            return [], logits[1:]
        mapper.heal(draft)
        draft.extend([choice])
        return [choice], None

    def _draft(self, draft: ModelState, k: int, mapper, first_logits: torch.Tensor | None = None,
               restate: bytes | None = None):
        """k draft tokens one forward at a time -> (ids, their distributions when the mapper keeps them, stopped
        at EOS, the first position's distribution when sampling). `first_logits` (1, Vd): the first step's,
        already computed (`_heal`); `restate`: the committed bytes the drafted text must start with (default: the
        mapper's; none after a healed first id, which restated them)."""
        ids: list[int] = []
        rows: list[torch.Tensor] = []
        restrict = mapper.restrict  # (Vd,) bool or None
        keep_rows = mapper.keeps_rows and self.warpers is not None
        # the coupled draws' noise (keyed.Coupling), all k rows in one pass: each id drafted is one target id
        coupled = self.coupling.noise(k) if self.coupling is not None and restrict is not None and k > 0 else None
        first = None
        remaining = mapper.restate if restate is None else restate
        for _ in range(k):
            logits = first_logits if first_logits is not None and not ids else draft.forward(keep=1)  # (1, Vd)
            if remaining:
                logits = only(logits, mapper.allowed(remaining)[0])
            if self.warpers is None:
                token = int(torch.argmax(logits[0]))
                confident = self.min_confidence <= 0 or float(torch.softmax(logits[0].float(), -1)[token]) >= self.min_confidence
            else:
                probs = sampling.logits_to_probs(logits, self.warpers)[0]  # (Vd,)
                if not ids and not mapper.pending:
                    first = probs  # both kinds' first proposal comes from this q (before restriction)
                if restrict is not None:
                    probs = probs * restrict
                    if float(probs.sum()) <= 0:
                        break  # NOTE: no mapped token has mass: stop drafting rather than divide by 0
                    probs = probs / probs.sum()
                if coupled is not None:
                    noise = coupled[len(ids)].to(probs.device)
                else:
                    noise = sampling.exponential_noise(probs.shape, self.generator, probs.device)
                token = int(sampling.race(probs, noise))
                confident = float(probs[token]) >= self.min_confidence
                if keep_rows:
                    rows.append(probs)
            draft.extend([token])
            ids.append(token)
            if remaining:  # NOTE: a token that is a proper prefix of the text to restate leaves the rest to restate
                piece = self.table[token]
                remaining = remaining[len(piece):] if remaining.startswith(piece) and piece else b""
            if token in self.draft_eos:
                return ids, rows, True, first
            if not confident:  # NOTE: a low-confidence guess is still proposed, but nothing is drafted after it
                break
        return ids, rows, False, first

    def _draft_greedy_on_device(self, draft: ModelState, k: int, first_ids: list[int] | None = None,
                                first_logits: torch.Tensor | None = None):
        """Greedy drafting with one host transfer: each argmax feeds the next step on the device, and the k ids
        come to the host once, for the bridge. Steps past a drafted EOS are rolled back afterwards. `first_ids`:
        the ids the first drafted token may be (None: any); `first_logits` (1, Vd): the first step's, already
        computed (`_heal`)."""
        base = len(draft.ids)
        logits = first_logits if first_logits is not None else draft.forward(keep=1)[-1:]  # (1, Vd)
        token = torch.argmax(logits if first_ids is None else only(logits, first_ids), dim=-1)  # (1,)
        tokens = [token]
        for _ in range(k - 1):
            token = torch.argmax(draft.feed(token.view(1, 1)), dim=-1)  # (1,)
            tokens.append(token)
        ids = torch.cat(tokens).tolist()  # the one transfer
        draft.extend(ids)
        for n, token_id in enumerate(ids):
            if token_id in self.draft_eos:
                draft.truncate(base + n + 1)
                return ids[: n + 1], [], True
        return ids, [], False


def only(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """(B, Vd) logits with every id but `ids` at -inf (a drafted token that must restate committed text); all of
    them where `ids` is empty (no draft token fits: the drafted text then proposes nothing)."""
    if not ids:
        return logits
    keep = torch.full((logits.shape[-1],), float("-inf"), dtype=logits.dtype, device=logits.device)
    keep[to_device(ids, logits.device)] = 0
    return logits + keep


def _last(scores: list[float]) -> float:
    """A draft path's log-probability: its last running score (0 for the empty path)."""
    return scores[-1] if scores else 0.0


class TreeProposer:
    """A beam of `width` draft paths, bridged into a trie of target ids and pruned to what is worth verifying."""

    def __init__(self, width: int, draft_eos: set[int], token_bytes: list[bytes], budget, target: ModelState,
                 max_nodes: int, warpers=None, generator: torch.Generator | None = None,
                 root_groups: torch.Tensor | None = None, target_vocab: int = 0):
        self.width, self.draft_eos, self.table, self.budget = width, draft_eos, token_bytes, budget
        self.target, self.max_nodes = target, max_nodes  # the verifier's state: its room for nodes and buckets
        self.warpers, self.generator = warpers, generator
        # a sampled root (SpecConfig.tree_root): (Vd,) each draft id's group, the target id its root candidate
        # stands for (the first target token of its text; the target's EOS for the draft's; -1: none)
        self.root_groups, self.target_vocab = root_groups, target_vocab
        self.coupling = None  # keyed.Coupling: under the keyed sampler the root's groups race on its keyed noise

    def propose(self, draft: ModelState, k: int, mapper, max_depth: int, laps: Laps) -> Proposal:
        """Draft a tree of up to k levels, bridge its branches into a trie of depth <= max_depth and at most
        `max_nodes` nodes, and keep the nodes the budget says are worth verifying."""
        target, max_nodes = self.target, self.max_nodes
        branches, steps, root = self._draft_tree(draft, max(k, 0), mapper, sample_root=max_depth > 0)
        laps("draft")
        trie = tree.Trie()
        if root is not None:  # the draws go first, in draw order, and are all verified
            for token in root[0][:max_nodes]:
                trie.insert([token])
            trie.pinned = trie.size
        for path, eos, scores, first in branches:
            ids = mapper.branch_to_target(path, eos, first)
            trie.insert(ids, max_depth, max_nodes, mapper.node_values(path, scores, ids))
        if root is not None and [trie.tokens[c] for c in trie.children[0]] != root[0][: trie.pinned]:
            raise RuntimeError("a sampled tree root gained a child that was not drawn (a bridge bug)")
        full = trie.size
        captured = target.step is not None
        keep = self.budget.nodes([trie.values[n] for n in trie.ranked()], laps.elapsed(),
                                 target.tree_room if captured else None)
        size = target.tree_room(max(keep, trie.pinned))  # compiled: the bucket's padding rows, as nodes, cost nothing
        trie = trie.pruned(size)
        laps("bridge")
        return Proposal(mapper.kind, steps, [], [], trie=trie, root_q=root[1] if root is not None else None,
                        pruned=full - trie.size, size=size if captured else None)

    def _draft_tree(self, draft: ModelState, k: int, mapper, sample_root: bool = True):
        """A beam of `width` draft paths grown for k steps -> (branches as (draft ids, ends at EOS, the path's
        log-probability under the draft after each id, the target id it must start with or None), forwards, the
        sampled root as (target ids in draw order, (Vt,) the distribution they were drawn from) or None).

        At each depth the candidates are the top `width` tokens of every path's next-token distribution (the
        target's warpers applied when sampling), ranked by the path's probability under the draft; the draft's
        greedy chain goes on first, then the best candidates whose text differs from the others', up to `width`
        paths. A path that no candidate continues is a branch. With a sampled root (SpecConfig.tree_root, when
        sampling and no incomplete character is pending) the first depth's `width` candidates are instead drawn
        without replacement from the draft, grouped by the target id each stands for
        (`sampling.draw_groups_without_replacement`), and each branch starts with its group's target id. One
        forward per depth: the depth's nodes, tree-masked, on the draft's own cache (`grow_tree`; dropped by the
        commit), or, for a draft with sliding-window layers or an attention that takes no 4D mask, batch rows
        over a copy of its cache."""
        logits = draft.forward(keep=1)  # (1, Vd)
        if mapper.restate:  # NOTE: only the first depth is held to it; a branch that then strays proposes nothing
            logits = only(logits, mapper.allowed(mapper.restate)[0])
        probs = self._probs(logits)  # (1, Vd)
        steps = 1
        paths, texts, cums = [[]], [b""], [[]]  # per path: draft ids, their text, log-probability after each id
        firsts: list[int | None] = [None]  # per path: the target id its bridged text must start with
        branches: list[tuple[list[int], bool, list[float], int | None]] = []
        cache = None
        nodes = [0]  # per path: its node in the draft's tree (grow_tree; 0 is the root, the last drafted-from id)
        root = None
        for depth in range(k):
            if depth == 0 and sample_root and self.root_groups is not None and not mapper.pending:
                chosen, root = self._sample_root(probs[0])
            else:
                chosen = self._top_candidates(probs, cums, texts)
            continued = {r for _, r, _, _ in chosen}
            branches += [(paths[r], False, cums[r], firsts[r]) for r in range(len(paths))
                         if r not in continued and paths[r]]
            frontier = []
            for score, r, t, first in chosen:
                first = firsts[r] if first is None else first
                if t in self.draft_eos:
                    branches.append((paths[r] + [t], True, cums[r] + [score], first))
                elif depth == k - 1:
                    branches.append((paths[r] + [t], False, cums[r] + [score], first))
                else:
                    frontier.append((score, r, t, first))
            if not frontier:
                break
            if draft.grows_trees:
                start = draft.tree_size + 1
                logits = draft.grow_tree([t for _, _, t, _ in frontier], [nodes[r] for _, r, _, _ in frontier])  # (B, Vd)
                nodes = list(range(start, start + len(frontier)))
            else:
                rows = [r for _, r, _, _ in frontier]
                if cache is None:
                    cache = draft.branches(len(rows))
                else:
                    select_rows(cache, rows)
                tokens = to_device([[t] for _, _, t, _ in frontier], draft.device)  # (B, 1)
                logits = draft.forward_rows(tokens, cache)  # (B, Vd)
            steps += 1
            probs = self._probs(logits)  # (B, Vd)
            paths = [paths[r] + [t] for _, r, t, _ in frontier]
            texts = [texts[r] + self.table[t] for _, r, t, _ in frontier]
            cums = [cums[r] + [score] for score, r, _, _ in frontier]
            firsts = [first for _, _, _, first in frontier]
        return branches, steps, root

    def _top_candidates(self, probs: torch.Tensor, cums, texts) -> list[tuple[float, int, int, None]]:
        """A depth's candidates: (path log-probability, row, draft id, None), the greedy chain's first."""
        table, width = self.table, self.width
        top_p, top_i = probs.topk(min(width, probs.shape[-1]), dim=-1)  # (B, w)
        candidates = sorted(
            ((_last(cums[r]) + math.log(p), r, t, None) for r, (ps, ts) in enumerate(zip(top_p.tolist(), top_i.tolist(), strict=True))
             for p, t in zip(ps, ts, strict=True) if p > 0),
            reverse=True,
        )
        chosen, seen = [], set()
        # NOTE: row 0 is always the draft's greedy chain, and its next token goes first: a tree then holds
        # the chain that tree_width=1 would draft, and never accepts less than it with the same K.
        first = next((c for c in candidates if c[1] == 0), None)
        for candidate in ([first] if first else []) + candidates:
            _, r, t, _ = candidate
            key = (texts[r] + table[t]) if table[t] else (texts[r], t)  # same text, same target tokens
            if key not in seen:
                seen.add(key)
                chosen.append(candidate)
            if len(chosen) == width:
                break
        return chosen

    def _sample_root(self, probs: torch.Tensor):
        """The root's candidates drawn from the draft's (Vd,) distribution: ([(log-probability, row 0, draft id,
        target id)] in draw order, (target ids, (Vt,) the distribution they were drawn from))."""
        noise = sampling.exponential_noise(probs.shape, self.generator, probs.device)  # (Vd,)
        root_q = sampling.grouped_distribution(probs, self.root_groups, self.target_vocab)  # (Vt,)
        # under the keyed sampler the groups race on the target's keyed noise at the root's position
        group_keys = None if self.coupling is None else root_q / self.coupling.row(self.target_vocab, probs.device)
        groups, draft_ids = sampling.draw_groups_without_replacement(probs, self.root_groups, self.target_vocab,
                                                                     self.width, noise, group_keys)
        scores = probs[to_device(draft_ids, probs.device)].log().tolist() if draft_ids else []
        chosen = [(score, 0, d, g) for score, d, g in zip(scores, draft_ids, groups, strict=True)]
        return chosen, (groups, root_q)

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's next-token probabilities that rank tree candidates: warped as the target's when sampling."""
        if self.warpers is not None:
            return sampling.logits_to_probs(logits, self.warpers)
        return torch.softmax(logits.float(), dim=-1)
