"""Moving drafted tokens onto the target's vocabulary, and the draft's context back onto the committed text.

Three mappers, one per way a draft's proposals reach the target (the `kind` a cycle reports):
- `SameVocab` ("same-tokenizer"): the draft's ids are the target's; its distributions too.
- `TextBridge` ("onehot" when sampling, "greedy-bridge" when not): the drafted bytes re-encoded as target ids
  (`bridge.TextSync`), proposed one-hot.
- `IntersectionMap` ("intersection"): drafted ids with the same bytes in both vocabularies, with the draft's
  distribution restricted to them and moved onto the target's ids; where an incomplete character is pending it
  proposes through the text bridge instead.
`Switching` (proposal="auto") runs one of the last two each cycle, as a `policy.ProposalChooser` decides.

Every mapper's `commit` brings the draft's ids and cache back to the committed text, keeping the drafted ids
that agree with it; `slide` moves the window of the text a draft with a shorter context holds. Shape legend: Vd the draft's vocabulary, Vt the target's, K the proposals.
"""

from __future__ import annotations

import bisect
import math

import torch

from ..runtime.cache import ModelState
from ..text.bridge import PrefixIndex, TextSync, build_token_map
from ..text.codec import TokenCodec, byte_ends
from . import sampling


def resize_vocab(probs: torch.Tensor, size: int) -> torch.Tensor:
    """Pad (with zeros) or cut the last dimension to `size` (draft and target embeddings may be padded differently)."""
    if probs.shape[-1] >= size:
        return probs[..., :size]
    return torch.nn.functional.pad(probs, (0, size - probs.shape[-1]))


class Fixed:
    """A mapper that runs every cycle (all but `Switching`): it is its own `current`, and learns nothing."""

    @property
    def current(self):
        return self

    def first_chances(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> None:
        return None  # one kind of proposal: nothing to choose between


class SameVocab(Fixed):
    """One tokenizer: the draft's ids and distributions are the target's."""

    kind = "same-tokenizer"
    keeps_rows = True  # sampling: the verifier is given the draft's distributions
    restrict = None  # no mask on the draft's distribution

    def __init__(self, target_vocab: int, device: torch.device, head: int = 0):
        self.target_vocab, self.device = target_vocab, device
        self.head = head  # leading ids a window of the text keeps (BOS)

    def to_target(self, drafted: list[int], rows: list[torch.Tensor], eos: bool):
        """Drafted ids -> (target proposal ids, proposal distributions (K, Vt) or None for one-hot)."""
        probs = torch.stack(rows).to(self.device) if rows else None
        if probs is not None and probs.shape[-1] != self.target_vocab:
            probs = resize_vocab(probs, self.target_vocab)
        return list(drafted), probs

    def branch_to_target(self, path: list[int], eos: bool, first: int | None = None) -> list[int]:
        return list(path)

    def node_values(self, path: list[int], scores: list[float], target_ids: list[int]) -> list[float]:
        """Each target id's estimated chance of acceptance: the draft's probability of the branch up to it."""
        return [math.exp(x) for x in scores[: len(target_ids)]]

    def commit(self, draft: ModelState, drafted: list[int], new_ids: list[int]) -> None:
        """Keep the drafted ids that the committed ones repeat; feed the rest."""
        base = len(draft.ids) - len(drafted)
        agree = 0
        while agree < min(len(drafted), len(new_ids)) and drafted[agree] == new_ids[agree]:
            agree += 1
        draft.resync(base + agree, new_ids[agree:])

    def slide(self, draft: ModelState, n: int) -> None:
        """Forget the oldest n ids of the draft's context (after the head) and re-prefill the rest."""
        draft.drop(self.head, n)

    @property
    def pending(self) -> bool:
        return False

    restate = b""  # nothing committed waits for the draft to restate it

    def allowed(self, remaining: bytes) -> tuple[list[int], bool]:
        return [], True  # never asked: nothing is ever restated

    def heal_candidate(self, draft: ModelState) -> None:
        return None


class TextBridge(Fixed):
    """Two tokenizers: drafted text re-encoded as target ids, proposed one-hot."""

    keeps_rows = False
    restrict = None

    def __init__(self, sync: TextSync, target_eos: set[int], draft_prompt_len: int, kind: str, head: int = 0,
                 index: PrefixIndex | None = None, healing: bool = False):
        self.sync, self.kind = sync, kind
        # NOTE: the draft's EOS becomes a target EOS candidate (BOS never appears mid-stream).
        self.eos_candidate = min(target_eos) if target_eos else None
        self.target_eos = target_eos
        self.draft_prompt_len = draft_prompt_len  # the draft's ids before its continuation (its prompt's)
        self.head = head  # leading ids a window of the text keeps (BOS)
        self._index = index  # built on first use where none is given (it indexes the whole draft vocabulary)
        self.healing = healing  # SpecConfig.draft_healing: the draft chooses its last token again each cycle

    @property
    def pending(self) -> bool:
        """Committed bytes the draft has not been shown: an incomplete character, or a healed token's text."""
        return bool(self.sync.pending)

    @property
    def index(self) -> PrefixIndex:
        """The draft's ids by their bytes (bridge.PrefixIndex)."""
        if self._index is None:
            self._index = PrefixIndex(self.sync.draft.token_bytes)
        return self._index

    @property
    def restate(self) -> bytes:
        """The bytes the drafted text must start with (the committed text the draft has not been shown)."""
        return self.sync.pending

    def allowed(self, remaining: bytes) -> tuple[list[int], bool]:
        """The draft ids the next drafted token may be while `remaining` bytes are still to restate -> (ids,
        whether each covers them all) (bridge.PrefixIndex.allowed)."""
        return self.index.allowed(remaining)

    def heal_candidate(self, draft: ModelState) -> tuple[int, list[int]] | None:
        """At a cycle start, with healing on: (the draft's last id, the draft ids whose bytes start with its
        bytes) when healing may take it back (bridge.TextSync.healable), else None. The proposer chooses among
        those ids where the draft read its context without the last id; `heal` when it chose another."""
        if (not self.healing or len(draft.ids) < 2
                or len(draft.ids) != self.draft_prompt_len + len(self.sync.draft_ends)):
            return None
        last = draft.ids[-1]
        piece = self.sync.draft.token_bytes[last]
        if not self.sync.healable(piece, self.index):
            return None
        return last, self.index.starting_with(piece)

    def heal(self, draft: ModelState) -> None:
        """Take the draft's last id back off its context and the text's view (its bytes are then pending)."""
        self.sync.heal()
        draft.truncate(len(draft.ids) - 1)

    def to_target(self, drafted: list[int], rows: list[torch.Tensor], eos: bool):
        return self.sync.propose(drafted[:-1] if eos else drafted, self.eos_candidate if eos else None), None

    def branch_to_target(self, path: list[int], eos: bool, first: int | None = None) -> list[int]:
        """A tree branch's draft ids -> target ids, starting with `first` when a sampled root drew that target id."""
        eos_candidate = self.eos_candidate if eos else None
        if first is None:
            return self.sync.propose(path[:-1] if eos else path, eos_candidate)
        if first in self.target_eos:  # the draft's EOS drawn at the root
            return [first]
        return self.sync.propose_from(first, path[:-1] if eos else path, eos_candidate)

    def node_values(self, path: list[int], scores: list[float], target_ids: list[int]) -> list[float]:
        """Each target id's estimated chance of acceptance: the draft's probability of the branch up to the
        draft id that completes the target id's bytes."""
        draft_ends = byte_ends(self.sync.draft.token_bytes, path)
        end, out = len(self.sync.pending), []
        for t in target_ids:
            size = len(self.sync.target.token_bytes[t])
            end += size
            # NOTE: an EOS candidate (no bytes) stands for the draft's EOS, the branch's last id
            i = min(bisect.bisect_left(draft_ends, end), len(path) - 1) if size else len(path) - 1
            out.append(math.exp(scores[i]))
        return out

    def commit(self, draft: ModelState, drafted: list[int], new_ids: list[int]) -> None:
        """Re-encode the committed text's tail, keeping the drafted ids whose bytes agree with it."""
        keep, extra = self.sync.commit(new_ids, drafted)
        draft.resync(self.draft_prompt_len + keep, extra)

    def slide(self, draft: ModelState, n: int) -> None:
        """Forget the oldest n ids of the draft's context (after the head; the prompt's first, then continuation
        ids up to a character boundary) and re-prefill the rest."""
        from_prompt = min(n, self.draft_prompt_len - self.head)
        dropped = from_prompt + self.sync.drop(n - from_prompt)
        self.draft_prompt_len -= from_prompt
        draft.drop(self.head, dropped)


class IntersectionMap(Fixed):
    """Two tokenizers, sampled: the draft draws among ids whose bytes the target has as one id, and the verifier
    is given that restricted distribution on the target's ids. With an incomplete character pending, the text
    bridge proposes instead."""

    kind = "intersection"
    keeps_rows = True

    def __init__(self, bridge: TextBridge, draft_to_target: torch.Tensor, target_vocab: int, device: torch.device):
        self.bridge = bridge
        self.draft_to_target = draft_to_target  # (Vd,) target id with the same bytes, -1 where none
        self.mapped_mask = draft_to_target >= 0  # (Vd,)
        self.target_vocab, self.device = target_vocab, device

    @property
    def pending(self) -> bool:
        return self.bridge.pending

    @property
    def restrict(self) -> torch.Tensor | None:
        """(Vd,) the ids the draft may draw this cycle, or None for all."""
        return None if self.pending else self.mapped_mask

    @property
    def restate(self) -> bytes:
        return self.bridge.restate

    def allowed(self, remaining: bytes) -> tuple[list[int], bool]:
        return self.bridge.allowed(remaining)

    def heal_candidate(self, draft: ModelState) -> None:
        return None  # NOTE: a healed token's text would be pending, and pending text goes through the bridge

    def to_target(self, drafted: list[int], rows: list[torch.Tensor], eos: bool):
        if self.pending or not rows:
            return self.bridge.to_target(drafted, rows, eos)
        proposals = self.draft_to_target[drafted[: len(rows)]].tolist()
        probs = sampling.map_to_target(torch.stack(rows), self.draft_to_target, self.target_vocab)  # (K, Vt)
        return proposals, probs.to(self.device)

    # a tree's branches go through the text bridge (trees never run this kind: options.proposal_kind)
    def branch_to_target(self, path: list[int], eos: bool, first: int | None = None) -> list[int]:
        return self.bridge.branch_to_target(path, eos, first)

    def node_values(self, path: list[int], scores: list[float], target_ids: list[int]) -> list[float]:
        return self.bridge.node_values(path, scores, target_ids)

    def commit(self, draft: ModelState, drafted: list[int], new_ids: list[int]) -> None:
        self.bridge.commit(draft, drafted, new_ids)

    def slide(self, draft: ModelState, n: int) -> None:
        self.bridge.slide(draft, n)


class Switching:
    """proposal="auto": the one-hot bridge or the intersection map, chosen after each verified cycle from both
    kinds' estimated chance of acceptance at its first position (the chooser: policy.ProposalChooser, which
    observes each cycle's record like the other policies)."""

    def __init__(self, onehot: TextBridge, intersection: IntersectionMap, chooser, first_pieces: torch.Tensor,
                 draft_to_target: torch.Tensor):
        self.mappers = {"onehot": onehot, "intersection": intersection}
        self.chooser = chooser
        self.first_pieces = first_pieces  # (Vd,) on the target's logits device
        self.draft_to_target = draft_to_target  # (Vd,) on the target's logits device
        self.coupled = False  # the keyed sampler's coupled draws (keyed.Coupling): scored by their own chance

    @property
    def current(self):
        return self.mappers[self.chooser.kind]

    def first_chances(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> tuple[float, float]:
        """Both kinds' chance of acceptance at a cycle's first position, from the target's (Vt,) and the draft's
        (Vd,) distributions there (one transfer): (one-hot, intersection)."""
        q = draft_probs.to(target_probs.device)
        onehot, intersection = torch.stack([
            sampling.onehot_acceptance(target_probs, q, self.first_pieces[: q.shape[-1]]),
            (sampling.coupled_acceptance if self.coupled else sampling.intersection_acceptance)(
                target_probs, q, self.draft_to_target[: q.shape[-1]]),
        ]).tolist()
        return onehot, intersection


class VocabMaps:
    """The maps between the two vocabularies that the mappers and a sampled tree root need, each built on first
    use and kept for the XTokSpec's life (they depend on the tokenizers only)."""

    def __init__(self, target: TokenCodec, draft: TokenCodec, target_eos: set[int], draft_eos: set[int]):
        self.target, self.draft, self.target_eos, self.draft_eos = target, draft, target_eos, draft_eos
        self._token_map = None
        self._first_pieces = None
        self._draft_to_target: dict[torch.device, torch.Tensor] = {}  # the token map as a tensor, per device
        self._draft_index = None

    @property
    def token_map(self):
        """Byte-normalized draft -> target token map (bridge.TokenMap)."""
        if self._token_map is None:
            pairs = [(d, min(self.target_eos)) for d in self.draft_eos] if self.target_eos else []
            self._token_map = build_token_map(self.draft, self.target, pairs)
        return self._token_map

    @property
    def first_pieces(self) -> torch.Tensor:
        """(Vd,) draft id -> the target id of the first token of its text, -1 where none (one batched encode of
        every draft token's text, kept for the XTokSpec's life)."""
        if self._first_pieces is None:
            self._first_pieces = torch.tensor(self.target.first_pieces(self.draft.token_bytes), dtype=torch.long)
        return self._first_pieces

    def root_groups(self, same_vocab: bool, target_vocab: int, draft_vocab: int) -> torch.Tensor:
        """(Vd,) draft id -> the target id a tree root's candidate drawn as that draft id stands for: the same id
        for one tokenizer, else the first target token of its text (`first_pieces`), the target's EOS for the
        draft's; -1 where none (SpecConfig.tree_root="sampled")."""
        if same_vocab:
            groups = torch.arange(draft_vocab)
            return torch.where(groups < target_vocab, groups, -1)
        groups = self.first_pieces.clone()
        if self.target_eos:
            groups[[d for d in self.draft_eos if d < draft_vocab]] = min(self.target_eos)
        return groups

    @property
    def draft_index(self) -> PrefixIndex:
        """The draft's ids by their bytes, for the ids a drafted token may be while committed text waits to be
        restated (built once: it indexes the whole draft vocabulary)."""
        if self._draft_index is None:
            self._draft_index = PrefixIndex(self.draft.token_bytes)
        return self._draft_index

    def draft_to_target(self, device: torch.device) -> torch.Tensor:
        """(Vd,) the token map (draft id -> target id with the same bytes, -1 where none) on `device`, built once
        per device (a tensor of the whole draft vocabulary, which every sampled call needs)."""
        device = torch.device(device)
        if device not in self._draft_to_target:
            self._draft_to_target[device] = torch.tensor(self.token_map.draft_to_target, device=device)
        return self._draft_to_target[device]
