"""One vLLM request's draft (`RequestDraft`): its ids and KV cache and the mapper that keeps it on the committed
text, built by `decode.assemble.request_draft` and driven by `proposer.TextBridgeProposer` (its `owner`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..decode import assemble
from ..decode.loop import make_room
from ..decode.rows import Acceptance
from ..text.codec import TokenCodec, is_char_boundary, utf8_valid_prefix_len
from ..types import Laps

LOOKBEHIND = 2  # kept draft ids re-encoded with new committed text (SpecConfig.draft_lookbehind's default)


class RequestDraft:
    """One request's draft: its ids and KV cache (`ModelState`) and the mapper that keeps it on the committed text."""

    def __init__(self, owner, target_ids: list[int]):
        self.owner = owner
        self.drafted: list[int] = []  # the last proposal's draft ids, in the draft's cache until the next commit
        self.draft_steps = 0  # the last proposal's draft forwards
        self.proposed: list[int] = []  # the last proposal's target ids, until vLLM's answer to it is seen
        # committed target ids not yet given to the draft (it did not draft since); before the request first
        # drafts, all of its ids: its draft is built then, from its whole text (`build`)
        self.pending: list[int] = list(target_ids)
        # what vLLM accepted of this request's proposals, and the ids it has committed (its age: decode.rows)
        self.acceptance = Acceptance()
        self.state = self.mapper = None  # the draft's ids and cache and its mapper, once built
        self.limit = 0  # ids the draft's cache holds, once built

    def build(self) -> None:
        """The draft's state and mapper, from every id the request has so far: a request costs nothing before it
        first drafts (at a large batch most never do: BENCHMARKS.md, "vLLM")."""
        owner, target_ids = self.owner, self.pending
        self.pending = []
        pair = owner.pair
        if owner.read_ids is not None and len(target_ids) > owner.read_ids:
            # its most recent text only: what a draft follows most on, for a fraction of a long reading
            target_ids = target_ids[recent_start(pair.target, target_ids, owner.read_ids, pair.same_vocab):]
        if pair.same_vocab:
            prompt, tail = list(target_ids), []
        else:
            split = complete_prefix(pair.target, target_ids)
            text, special = owner.view.prompt(target_ids[:split])  # a template's special tokens: the draft's or none
            prompt = pair.draft.encode_prompt(text, special) if text else []
            tail = list(target_ids[split:])  # the text ends inside a character: its first bytes wait
        static = owner.draft_backend == "static"  # a dropped request's buffers (and their graphs), else new ones
        self.state, self.mapper = assemble.request_draft(
            pair, owner.kept, owner.draft_model, prompt, tail, backend=owner.draft_backend,
            capacity=owner.static_len if static else owner.draft_limit, step=owner.step, lookbehind=LOOKBEHIND,
            healing=owner.healing, target_vocab=owner.target_vocab)
        self.limit = min(owner.draft_limit, self.state.capacity)  # ids the draft's cache holds
        owner.stats.new_states += 1

    def advance(self, new_ids: list[int], policy=None) -> int:
        """The row's new target ids: `policy` (decode.rows.RowDraftLengths) learns what vLLM did with the last
        proposal; the draft commits them now if it drafted last (keeping the drafted ids they repeat, re-encoding
        the rest), else when it drafts next (a request that is not drafting costs no bridging) -> how many of
        the last proposal's ids vLLM accepted."""
        accepted = 0
        self.acceptance.age += len(new_ids)
        if policy is not None and self.proposed:
            accepted = policy.observe_proposal(self.acceptance, self.proposed, new_ids)
        self.proposed = []
        if self.drafted:
            self.mapper.commit(self.state, self.drafted, new_ids)
            self.drafted = []
        else:
            self.pending += new_ids
        return accepted

    def catch_up(self) -> None:
        """Commit the ids that arrived while the request was not drafting (the first time: build its draft)."""
        if self.state is None:
            self.build()
        elif self.pending:
            self.mapper.commit(self.state, [], self.pending)
            self.pending = []

    @property
    def unread(self) -> int:
        """Target ids its draft has not read (all of them before it is built, or the most recent it will read)."""
        if self.state is None and self.owner.read_ids is not None:
            return min(len(self.pending), self.owner.read_ids)
        return len(self.pending)

    def prepare(self, k: int, room: int) -> int:
        """Make room in the draft's context for k more ids -> how many it may draft (0: none)."""
        self.catch_up()
        state = self.state
        self.draft_steps = 0
        if not state.ids or room <= 0:
            return 0
        make_room(self.mapper, state, k + 1, self.limit)
        return max(0, min(k, self.limit - len(state.ids) - 1))

    @property
    def first_ids(self) -> list[int] | None:
        """The ids the first drafted token may be (those restating pending text), or None for any."""
        restate = self.mapper.restate
        return self.mapper.allowed(restate)[0] if restate else None

    def heal_candidate(self) -> tuple[int, list[int]] | None:
        """Token healing's candidate for a batched draft (`TextBridge.heal_candidate`), with the two uncached
        ids `draft_together` then needs (the last one's cache position fed again where it is cached)."""
        state = self.state
        candidate = self.mapper.heal_candidate(state)
        if candidate is None or len(state.ids) < 3:
            return None
        state.uncache_last(2)
        return candidate

    def propose(self, k: int, room: int, laps: Laps) -> list[int]:
        """Draft k ids greedily, this request alone -> at most `room` target ids."""
        k = self.prepare(k, room)
        if k <= 0:
            return []
        proposal = self.owner.chain.propose(self.state, k, self.mapper, room, laps)
        self.drafted, self.draft_steps = proposal.draft_ids, proposal.draft_steps
        self.owner.stats.healed += proposal.healed
        return proposal.target_ids

    def finish(self, drafted: list[int], room: int, healed: bool = False) -> list[int]:
        """Map ids drafted by `draft_together` (in the draft's ids and cache already; `healed`: its first id took
        the place of the last one, which it took out of both) -> at most `room` target ids."""
        if healed:
            self.mapper.sync.heal()
        eos = bool(drafted) and drafted[-1] in self.owner.chain.draft_eos
        self.drafted, self.draft_steps = drafted, len(drafted)
        return self.mapper.to_target(drafted, [], eos)[0][: max(0, room)]


def recent_start(codec: TokenCodec, ids: Sequence[int], most: int, same_vocab: bool = False) -> int:
    """Where the most recent `most` ids (or a few fewer) begin, at the start of a character: the first of them
    whose bytes do not continue one (a byte-fallback piece, or a byte-level token holding a character's tail).
    Between models of one vocabulary, ids are read as they are."""
    start = max(0, len(ids) - most)
    if same_vocab:
        return start
    table = codec.token_bytes
    while start < len(ids) and (not table[ids[start]] or not is_char_boundary(table[ids[start]], 0)):
        start += 1
    return start


def complete_prefix(codec: TokenCodec, ids: Sequence[int]) -> int:
    """The most leading ids whose bytes are complete UTF-8 (a prompt may end inside a character: byte-fallback
    pieces, or a byte-level token holding part of one)."""
    table = codec.token_bytes
    data = b"".join(table[i] for i in ids)
    valid = utf8_valid_prefix_len(data)
    end = len(data)
    for n in range(len(ids), 0, -1):
        if end <= valid and is_char_boundary(data, end):
            return n
        end -= len(table[ids[n - 1]])
    return 0
