"""The text bridge between two tokenizers. Tokenizers and bytes only: no models, no tensors.

Both token streams are seen as raw UTF-8 bytes, each through its tokenizer's `TokenCodec` (codec.py). The
committed text is, by definition, the bytes of the committed *target* ids: the target's output is the truth.

Invariants the decoding loop keeps with these helpers:
- the draft's context is a prefix of the committed bytes that ends on a character boundary, and equals it
  up to the last complete character (incomplete trailing bytes wait until their character completes);
- text handed to a tokenizer never ends, or starts, inside a UTF-8 character, so no U+FFFD is introduced;
- continuations are encoded as fragments: no BOS and no dummy-prefix "▁" (the published llm-jp/open-calm
  bridge dropped a token with `[1:]` instead), with the boundary fixed at the committed text, because
  committed tokens can not be re-segmented.

Token healing (`TextSync.healable` / `heal`, the prompt-boundary fix of guidance's token healing applied at
every cycle start): the committed text ends on a *target* token boundary, which often falls inside one of the
draft's own tokens ("日本" committed where the draft writes "日本語" as one token). Encoded as it is, the draft's
context ends in a piece it rarely saw in training, and its next token is then seldom right. Healing lets the
draft choose its last token again among those that start with its bytes (`PrefixIndex`); where it chooses a
longer one, that token is taken back off the view (its bytes become pending) and the longer one is the first
drafted id. Proposals are the drafted bytes after the committed text, as for any pending bytes; what the target
commits never depends on it (greedy: its argmax; sampled: one-hot proposals, which are lossless whatever chose
them).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from .codec import TokenCodec, byte_ends, is_char_boundary, utf8_char_len, utf8_valid_prefix_len


@dataclass(frozen=True)
class TokenMap:
    """Draft id -> target id with the same bytes (-1 where none), for proposals in the target vocabulary."""

    draft_to_target: list[int]
    mapped_draft_share: float  # share of (non-special) draft ids that map
    mapped_target_share: float  # share of (non-special) target ids that some draft id maps to


def build_token_map(draft: TokenCodec, target: TokenCodec, eos_pairs: Sequence[tuple[int, int]] = ()) -> TokenMap:
    """Match draft and target tokens by the raw bytes they stand for (byte-normalized, not raw strings).

    Byte-level 'Ġ', SentencePiece '▁' and `<0xNN>` pieces are all compared as bytes. Where the target has
    several ids for the same bytes, the one its own encoder would produce is chosen. `eos_pairs` maps the
    draft's end-of-sequence ids onto the target's.
    """
    by_bytes: dict[bytes, list[int]] = {}
    for i, tb in enumerate(target.token_bytes):
        if tb:
            by_bytes.setdefault(tb, []).append(i)
    mapping = [-1] * draft.vocab_size
    for d, tb in enumerate(draft.token_bytes):
        candidates = by_bytes.get(tb) if tb else None
        if not candidates:
            continue
        if len(candidates) > 1 and utf8_valid_prefix_len(tb) == len(tb):
            canonical = target.encode_fragment(tb.decode("utf-8"))
            mapping[d] = canonical[0] if len(canonical) == 1 and canonical[0] in candidates else candidates[0]
        else:
            mapping[d] = candidates[0]
    for d, t in eos_pairs:
        mapping[d] = t
    draft_regular = [d for d, tb in enumerate(draft.token_bytes) if tb]
    target_regular = sum(1 for tb in target.token_bytes if tb)
    hit_targets = {mapping[d] for d in draft_regular if mapping[d] >= 0}
    return TokenMap(
        draft_to_target=mapping,
        mapped_draft_share=sum(mapping[d] >= 0 for d in draft_regular) / max(1, len(draft_regular)),
        mapped_target_share=len(hit_targets) / max(1, target_regular),
    )


class PrefixIndex:
    """A vocabulary's ids by the bytes they stand for, for the ids a drafted token may be when its bytes must
    restate `pending` ones: those that start with them, else those that are a prefix of them."""

    def __init__(self, token_bytes: Sequence[bytes]):
        pairs = sorted((tb, i) for i, tb in enumerate(token_bytes) if tb)
        self.sorted_bytes = [tb for tb, _ in pairs]
        self.sorted_ids = [i for _, i in pairs]
        self.by_bytes: dict[bytes, list[int]] = {}
        for tb, i in pairs:
            self.by_bytes.setdefault(tb, []).append(i)
        self._found: dict[bytes, list[int]] = {}  # starting_with's answers, by prefix

    def starting_with(self, prefix: bytes) -> list[int]:
        """Ids whose bytes start with `prefix` (all of them for b""), a range of the sorted bytes (do not change
        the list: it is kept for the next call with the same prefix)."""
        found = self._found.get(prefix)
        if found is None:
            lo = bisect_left(self.sorted_bytes, prefix)
            stem = prefix.rstrip(b"\xff")  # the first bytes past every extension of `prefix`: stem's last + 1
            hi = bisect_left(self.sorted_bytes, stem[:-1] + bytes([stem[-1] + 1])) if stem else len(self.sorted_bytes)
            found = self.sorted_ids[lo:hi]
            if len(self._found) < 65536:
                self._found[prefix] = found
        return found

    def prefixes_of(self, data: bytes) -> list[int]:
        """Ids whose bytes are a proper, non-empty prefix of `data`."""
        return [i for n in range(1, len(data)) for i in self.by_bytes.get(data[:n], ())]

    def extends(self, piece: bytes) -> bool:
        """Whether some token is longer than `piece` and starts with it (healing it may then find a better one)."""
        lo = bisect_right(self.sorted_bytes, piece)
        return lo < len(self.sorted_bytes) and self.sorted_bytes[lo].startswith(piece)

    def allowed(self, pending: bytes) -> tuple[list[int], bool]:
        """The ids a drafted token may be while `pending` bytes remain to restate -> (ids, whether each of them
        covers all of `pending`): those starting with it, or where none does, its proper prefixes."""
        covering = self.starting_with(pending)
        return (covering, True) if covering else (self.prefixes_of(pending), False)


def propose_target_ids(target: TokenCodec, pending: bytes, drafted: bytes) -> list[int]:
    """Target ids for drafted bytes that continue committed text ending in `pending`: the bytes the draft has not
    been shown (an incomplete character, after the complete ones a healed token stood for).

    The draft's context stops before `pending`, so its drafted bytes must restate them; the bytes that complete
    an incomplete character at its end become the target's single-byte pieces, the rest is encoded as a fragment
    up to its last complete character (an incomplete tail waits for the next round).
    """
    if not drafted.startswith(pending):
        return []
    rest = drafted[len(pending) :]
    ids: list[int] = []
    tail = pending[utf8_valid_prefix_len(pending) :]  # the start of a character the committed text ends inside
    if tail:
        need = utf8_char_len(tail[0]) - len(tail)
        if len(rest) < need or any(b not in target.byte_ids for b in rest[:need]):
            return []
        ids = [target.byte_ids[b] for b in rest[:need]]
        rest = rest[need:]
    complete = utf8_valid_prefix_len(rest)
    if complete:
        ids += target.encode_exact(rest[:complete].decode("utf-8"))
    return ids


def common_prefix_len(a: bytes, b: bytes, start: int = 0) -> int:
    """Length of the common prefix of a and b, given that they agree on [0, start)."""
    n = min(len(a), len(b))
    if a[start:n] == b[start:n]:
        return n
    lo, hi = start, n  # invariant: agree on [0, lo), differ somewhere in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class TextSync:
    """The committed text (bytes of the committed target ids) and the draft's view of it.

    `draft_ends[n]` is the end offset, in `committed`, of the bytes of the draft's n-th continuation id (after
    the first `base` bytes, which a draft with a window of the text no longer holds: `drop`). The draft's view
    always ends on a character boundary and covers `committed` up to its last complete character; `pending` is
    the rest (an incomplete character the draft has not been shown).
    """

    def __init__(self, target: TokenCodec, draft: TokenCodec, lookbehind: int = 0):
        self.target, self.draft = target, draft
        self.lookbehind = lookbehind  # kept draft ids re-encoded together with new text (canonical boundaries)
        self.committed = b""
        self.draft_ends: list[int] = []
        self.base = 0  # where the draft's continuation ids start in `committed`

    @property
    def synced(self) -> int:
        return self.draft_ends[-1] if self.draft_ends else self.base

    def drop(self, n: int) -> int:
        """Let the draft forget its first continuation ids, at most n of them, ending on a character boundary
        (its window of the text moves on; the text after them is re-encoded from there when it must) -> how
        many."""
        n = min(n, len(self.draft_ends))
        while n and not is_char_boundary(self.committed, self.draft_ends[n - 1]):
            n -= 1
        if n:
            self.base = self.draft_ends[n - 1]
            del self.draft_ends[:n]
        return n

    @property
    def pending(self) -> bytes:
        return self.committed[self.synced :]

    def healable(self, piece: bytes, index: PrefixIndex) -> bool:
        """Whether healing may take the draft's last continuation id, whose bytes are `piece`, back off its view
        of the text: nothing is pending, the id stands for the last bytes of the view (`piece`), the view before
        it ends on a character boundary, and some longer draft token starts with `piece`."""
        if not self.draft_ends or self.pending:
            return False
        start = self.draft_ends[-2] if len(self.draft_ends) > 1 else self.base
        return (self.committed[start : self.draft_ends[-1]] == piece and is_char_boundary(self.committed, start)
                and index.extends(piece))

    def heal(self) -> None:
        """Take the draft's last continuation id back off its view of the text (after `healable`): its bytes
        join `pending`, for the next drafted id to restate."""
        self.draft_ends.pop()

    def propose(self, drafted: list[int], eos_candidate: int | None = None) -> list[int]:
        """Target ids for the drafted draft ids; `eos_candidate` is appended when the draft ended its text."""
        drafted_bytes = self.draft.bytes_of(drafted)
        proposals = propose_target_ids(self.target, self.pending, drafted_bytes)
        if eos_candidate is not None and self.target.bytes_of(proposals) == drafted_bytes[len(self.pending) :]:
            proposals.append(eos_candidate)
        return proposals

    def propose_from(self, first: int, drafted: list[int], eos_candidate: int | None = None) -> list[int]:
        """`propose` for a branch whose first target token is fixed: `first`, the first piece of the drafted
        bytes (they start with its bytes; nothing is pending). The bytes after it follow as `propose` would give
        them, a character it ends inside completed by single-byte pieces."""
        piece = self.target.token_bytes[first]
        drafted_bytes = self.draft.bytes_of(drafted)
        if self.pending or not drafted_bytes.startswith(piece):
            raise ValueError(f"drafted bytes {drafted_bytes[:16]!r} do not start with the first piece {piece!r}")
        tail = piece[utf8_valid_prefix_len(piece):]  # the start of a character `first` ends inside
        rest = propose_target_ids(self.target, tail, tail + drafted_bytes[len(piece):])
        proposals = [first] + rest
        if eos_candidate is not None and self.target.bytes_of(proposals) == drafted_bytes:
            proposals.append(eos_candidate)
        return proposals

    def commit(self, new_target_ids: list[int], drafted: list[int]) -> tuple[int, list[int]]:
        """Append committed target ids; -> (draft continuation ids to keep, draft ids to append after them).

        The draft's continuation was its synced ids followed by `drafted`; the kept ones are those whose bytes
        agree with the committed text and end on a character boundary, the appended ones encode the rest of
        the committed text up to its last complete character.
        """
        table = self.draft.token_bytes
        cut = next((n for n, i in enumerate(drafted) if not table[i]), len(drafted))
        drafted = drafted[:cut]  # NOTE: a drafted special (EOS) stands for no text and is never kept
        synced = self.synced
        self.committed += self.target.bytes_of(new_target_ids)
        ends = self.draft_ends + [synced + e for e in byte_ends(self.draft.token_bytes, drafted)]
        draft_bytes = self.committed[:synced] + self.draft.bytes_of(drafted)
        complete = utf8_valid_prefix_len(self.committed)
        agree = min(common_prefix_len(draft_bytes, self.committed, synced), complete)
        keep = bisect_right(ends, agree)
        while keep > len(self.draft_ends) and not is_char_boundary(self.committed, ends[keep - 1]):
            keep -= 1
        keep = max(keep, len(self.draft_ends))
        if complete > (ends[keep - 1] if keep else self.base):  # new text: re-encode the last few kept ids with it
            keep = max(0, keep - self.lookbehind)
            while keep and not is_char_boundary(self.committed, ends[keep - 1]):
                keep -= 1  # NOTE: byte-level ids can end inside a character; never restart encoding there
        self.draft_ends = ends[:keep]
        start = self.synced
        if complete <= start:
            return keep, []
        ids, rel_ends = self.draft.encode_stream(self.committed[start:complete].decode("utf-8"))
        self.draft_ends += [start + e for e in rel_ends]
        return keep, ids
