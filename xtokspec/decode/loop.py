"""The speculative loop across tokenizers: one cycle after another until EOS, the length asked, or a full context.

One drafted cycle (Leviathan et al. 2023, Algorithm 1, with a text bridge in the middle):
  1. propose: draft K tokens (a chain, or a tree) and move them onto the target's vocabulary (xtokspec/decode/propose.py
     with a mapper from xtokspec/decode/mapping.py);
  2. verify: one target forward over the uncommitted ids plus the proposals; accept a prefix (a tree: a path) and
     emit one recovered or bonus token (xtokspec/decode/verify.py);
  3. commit: the target's cache keeps the accepted ids; the draft's context returns to the committed text (it
     keeps the drafted ids whose bytes agree with it and re-encodes only the rest);
  4. record: one `CycleRecord` feeds the statistics and every policy (xtokspec/decode/policy.py).
Where drafting does not pay, the fallback policy runs cycles of the target alone, one token each; the draft
catches up with their text when it drafts again.

Invariant after every cycle: the target's ids are exactly what it would have produced alone (greedy: equal ids;
sampling: equal distribution), and the draft's context is the committed text up to its last complete character
(once it has caught up with the target-alone cycles).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..runtime.cache import ModelState
from ..types import CycleRecord, GenerationStats, Laps
from .propose import Proposal
from .protocols import DraftLengthPolicy, FallbackPolicy, Mapper, MapperChoice, Observer, Proposer
from .verify import Sampler, Verdict, verify, verify_chain


@dataclass(kw_only=True)
class Run:
    """One generation: both models' ids and caches, how its cycles propose and verify, what they learn from
    (built by `assemble.generation`)."""

    target: ModelState
    draft: ModelState
    mapper: MapperChoice  # the cycle's mapper is `mapper.current`
    proposer: Proposer
    sampler: Sampler | None  # None: greedy
    draft_length: DraftLengthPolicy
    fallback: FallbackPolicy
    observers: tuple[Observer, ...]  # the stats and every policy: each observes every cycle's record
    stats: GenerationStats
    target_eos: set[int]
    target_limit: int  # the target's ids stop here (its context, or its cache)
    draft_limit: int  # the draft's context: past it, its window of the text moves on (`make_room`)
    draft_room: int  # ids a cycle may draft
    clock: Callable[[], float] = time.perf_counter  # every second the policies see is read from it
    unsynced: list[int] = field(default_factory=list)  # target-alone cycles' ids the draft has not seen yet


def cycles(run: Run, max_new_tokens: int) -> Iterator[list[int]]:
    """Run cycles until a stop reason; yield each cycle's committed target ids (the stats complete first)."""
    produced = 0
    start = run.clock()
    while produced < max_new_tokens:
        remaining = max_new_tokens - produced
        new_ids, record = alone_cycle(run, remaining) if run.fallback.run_alone() else drafted_cycle(run, remaining)
        for observer in run.observers:
            observer.observe(record)
        produced += len(new_ids)
        run.stats.wall_seconds = run.clock() - start
        run.stats.stop_reason = stop_reason(run, new_ids, produced >= max_new_tokens)
        yield new_ids
        if run.stats.stop_reason:
            return


def make_room(mapper: Mapper, draft: ModelState, room: int, limit: int) -> None:
    """Where `room` more ids would pass the draft's context `limit`, keep its most recent half (the loop and the
    vLLM proposer both slide the draft's window of the text this way)."""
    if len(draft.ids) + room > limit:
        mapper.slide(draft, len(draft.ids) - limit // 2)


def drafted_cycle(run: Run, remaining: int) -> tuple[list[int], CycleRecord]:
    """Propose, verify, commit -> the committed target ids and the cycle's record."""
    target, draft = run.target, run.draft
    catch_up_s = catch_up(run)
    make_room(run.mapper.current, draft, run.draft_room, run.draft_limit)
    # NOTE: proposals are capped at remaining - 1, so the target never holds more than prompt + max_new_tokens ids
    k = min(run.draft_length.next_k(), remaining - 1, run.draft_limit - len(draft.ids) - 1)
    room = max(0, min(remaining - 1, run.target_limit - len(target.ids) - 1))
    mapper = run.mapper.current
    # a cycle in which either model feeds its whole context (the prompt; the draft after a target-alone first
    # cycle or a moved window), or records or compiles a new shape, says nothing of what drafting and verifying
    # cost: the policies leave it out
    prefill = target.prefilling or draft.cached == 0
    setup = setup_seconds(run)
    laps = Laps(run.clock)
    proposal = run.proposer.propose(draft, k, mapper, room, laps)  # laps "draft" and "bridge"
    verdict = verify(target, proposal, run.sampler)
    laps("verify")
    new_ids = commit(run, mapper, proposal, verdict, remaining)
    chances = None
    if proposal.first_probs is not None and verdict.target_probs is not None:
        chances = run.mapper.first_chances(verdict.target_probs[0], proposal.first_probs)
    laps("bridge")
    prefill = prefill or setup_seconds(run) != setup
    trie = proposal.trie
    record = CycleRecord.drafted(
        kind=proposal.kind, draft_steps=proposal.draft_steps,
        depth=trie.depth if trie else len(proposal.target_ids), nodes=trie.size if trie else len(proposal.target_ids),
        accepted=verdict.accepted, rejected=verdict.rejected, committed=len(new_ids),
        draft_s=laps.seconds["draft"], bridge_s=laps.seconds["bridge"] + catch_up_s, verify_s=laps.seconds["verify"],
        prefill=prefill, size=proposal.size, predicted=sum(trie.values[1:]) if trie else None,
        pruned=proposal.pruned, sampled_root=proposal.root_q is not None, healed=proposal.healed,
        first_chances=chances,
    )
    return new_ids, record


def commit(run: Run, mapper: Mapper, proposal: Proposal, verdict: Verdict, remaining: int) -> list[int]:
    """Keep the accepted proposals and the next token in the target's cache, bring the draft back to the committed
    text -> the committed target ids (cut after EOS and at `remaining`)."""
    if proposal.trie is not None:
        run.target.commit_path(verdict.path, proposal.trie.tokens, verdict.next_token)
        new_ids = committed(proposal.trie.path_tokens(verdict.path) + [verdict.next_token], remaining, run.target_eos)
        mapper.commit(run.draft, [], new_ids)  # NOTE: drops the draft's tree; the new text is re-encoded
        return new_ids
    accepted = proposal.target_ids[: verdict.accepted]
    run.target.commit(len(proposal.target_ids), verdict.accepted, verdict.next_token)
    new_ids = committed(accepted + [verdict.next_token], remaining, run.target_eos)
    mapper.commit(run.draft, proposal.draft_ids, new_ids)
    return new_ids


def alone_cycle(run: Run, remaining: int) -> tuple[list[int], CycleRecord]:
    """One target step with no draft -> the committed id. The draft is not fed: the ids wait in `unsynced` until
    a drafted cycle needs the draft again (`catch_up`)."""
    t0 = run.clock()
    prefill, setup = run.target.prefilling, setup_seconds(run)
    verdict = verify_chain(run.target, [], None, run.sampler)  # no proposals: the target's own next token
    run.target.extend([verdict.next_token])
    new_ids = committed([verdict.next_token], remaining, run.target_eos)
    run.unsynced += new_ids
    prefill = prefill or setup_seconds(run) != setup  # NOTE: a step that compiled a shape is not a step's cost
    return new_ids, CycleRecord.target_alone(committed=len(new_ids), seconds=run.clock() - t0, prefill=prefill)


def setup_seconds(run: Run) -> float:
    """Seconds both models' captured steps have spent recording CUDA graphs or compiling new shapes."""
    return sum(state.step.setup_seconds for state in (run.target, run.draft) if state.step is not None)


def catch_up(run: Run) -> float:
    """Commit the target-alone cycles' ids to the draft's context (its forward feeds them when it next drafts)
    -> the seconds it took, which count as the drafted cycle's bridge time."""
    if not run.unsynced:
        return 0.0
    t0 = run.clock()
    run.mapper.current.commit(run.draft, [], run.unsynced)
    run.unsynced = []
    return run.clock() - t0


def committed(new_ids: list[int], remaining: int, eos: set[int]) -> list[int]:
    """A cycle's accepted tokens plus its next token, cut after the first EOS and at `remaining`."""
    for n, token in enumerate(new_ids):
        if token in eos:
            return new_ids[: min(n + 1, remaining)]
    return new_ids[:remaining]


def stop_reason(run: Run, new_ids: list[int], length_reached: bool) -> str:
    """Why generation stops after this cycle (types.STOP_REASONS), or "" to go on."""
    if new_ids[-1] in run.target_eos:
        return "eos"
    if length_reached:
        return "length"
    if len(run.target.ids) >= run.target_limit:
        return "context"  # NOTE: the target alone could not go on either
    return ""
