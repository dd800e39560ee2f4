"""The lengths the policy chose, drafted (`StepDrafts`, one per proposer): the requests that draft in one batch
(one batched forward per drafted position over their caches side by side, `batch.draft_together`), the others one
at a time (`drafts.RequestDraft.propose`), each request's draft first brought to its committed text and a long
reading split into chunks across steps, so that no running request waits on a new one's prompt.

What to draft and for whom is the proposer's (proposer.py: rows matched to requests, the step timed, the lengths
chosen); this module does it, counts what it cost (`settings.ProposerStats`), and turns a fault in one request's
drafting into no proposal for it (a proposal cannot change the output)."""

from __future__ import annotations

import time

from ..types import Laps
from .batch import draft_together, prefill_tail
from .drafts import RequestDraft
from .requests import Entry

LONG_TAIL = 16  # a row with more uncached ids than this (a new request's prompt) prefills them on its own first


class StepDrafts:
    """Drafts a step's chosen lengths for the proposer that owns it (its draft, policy, table and counts)."""

    def __init__(self, owner):
        self.owner = owner  # the proposer (proposer.TextBridgeProposer), as a RequestDraft's

    def draft(self, candidates, lengths, out, t0) -> tuple[int, int, bool, int, int]:
        """The chosen lengths drafted into `out` (by row): the requests that draft in one batch, then the others
        one at a time -> (requests drafted in the batch, those drafted alone, whether a prefill ran, the alone
        ones' forwards, the batch's k). `t0`: when the call's own work began (stats.other_s runs from it)."""
        owner = self.owner
        stats = owner.stats
        k = max(lengths, default=0)
        batch_now = owner.policy.costs.way(lengths, owner.ways) == "batched" if len(owner.ways) > 1 \
            else owner.batched
        together: list[tuple[int, Entry, int, tuple | None]] = []  # (row, entry, room, healing's candidate)
        alone: list[tuple[int, Entry, int]] = []  # drafted one request at a time
        prefills, prefilled = 0.0, False  # seconds of prefills run alone; whether any ran (a chunk included)
        for (r, entry, room), length in zip(candidates, lengths, strict=True):
            if not length:
                continue
            try:
                batch, heal, prefill_s = self._prepare(entry, k, min(room, length), batch_now)
            except Exception as err:
                owner.fault(err, "preparing a request's draft")
                owner.table.discard(entry)
                continue
            prefills += prefill_s
            prefilled = prefilled or prefill_s > 0
            if batch is None:  # its draft read a chunk of its text instead
                continue
            if batch:
                together.append((r, entry, min(room, length), heal))
            else:
                alone.append((r, entry, min(room, length)))
        if len(together) == 1:  # nothing to batch with
            alone += [item[:3] for item in together]
            together = []
        t0 += prefills  # a prefill outside the batch counts as drafting, not other_s
        forwards, t0 = self._alone(alone, out, t0)
        if together:
            t0 = self._together(together, k, out, t0)
        stats.other_s += time.perf_counter() - t0
        return len(together), len(alone), prefilled, forwards, k

    def _alone(self, alone, out, t0: float) -> tuple[int, float]:
        """Each request's own draft forwards -> (the forwards run, when the last one ended)."""
        owner = self.owner
        stats, forwards = owner.stats, 0
        for r, entry, room in alone:
            request = entry.payload
            laps = Laps()
            stats.other_s += laps.start - t0
            try:
                out[r] = request.propose(room, room, laps)
            except Exception as err:
                owner.fault(err, "drafting for a request")
                owner.table.discard(entry)
                out[r] = []
            stats.draft_s += laps.seconds["draft"]
            stats.bridge_s += laps.seconds["bridge"]
            stats.draft_forwards += request.draft_steps
            forwards += request.draft_steps
            stats.proposed += len(out[r])
            t0 = time.perf_counter()
        return forwards, t0

    def _together(self, together, k: int, out, t0: float) -> float:
        """One batched forward per drafted position over the requests' caches (`draft_together`), each request's
        ids then mapped onto the target's -> when that ended."""
        owner = self.owner
        stats = owner.stats
        t1 = time.perf_counter()
        stats.other_s += t1 - t0
        try:
            requests = [entry.payload for _, entry, _, _ in together]
            drafted, copy_s, healed = draft_together(
                owner.draft_model, [request.state for request in requests], k, owner.chain.draft_eos,
                owner.window, [request.first_ids for request in requests], [h for *_, h in together])
        except Exception as err:  # NOTE: the batch's caches may be half-written: every request in it starts over
            owner.fault(err, "drafting a batch of requests", len(together))
            for _, entry, _, _ in together:
                owner.table.discard(entry)
            drafted = None
        t0 = time.perf_counter()
        if drafted is not None:
            stats.draft_s += t0 - t1 - copy_s
            stats.copy_s += copy_s
            stats.batched_forwards += k
            stats.healed += sum(healed)
            for (r, entry, room, _), ids, was_healed in zip(together, drafted, healed, strict=True):
                try:
                    out[r] = entry.payload.finish(ids, room, was_healed)
                except Exception as err:
                    owner.fault(err, "mapping a request's draft")
                    owner.table.discard(entry)
                    out[r] = []
                stats.draft_forwards += len(ids)
                stats.proposed += len(out[r])
        t1 = time.perf_counter()
        stats.bridge_s += t1 - t0
        return t1

    def _prepare(self, entry: Entry, k: int, room: int, batch: bool) -> tuple[bool | None, tuple | None, float]:
        """Ready a request to draft -> (whether it drafts in the batch of k forwards, or None: not this step, its
        draft is still reading a long text, one chunk per step; token healing's candidate in the batch; seconds of
        a prefill it ran)."""
        owner = self.owner
        request = entry.payload
        unread, t0 = request.unread, time.perf_counter()
        prepared = self._ready(request, k, room, batch)
        owner.policy.costs.observe_read(unread, time.perf_counter() - t0)  # what the reading cost (decode.stepcosts)
        return prepared

    def _ready(self, request: RequestDraft, k: int, room: int,
               batch: bool) -> tuple[bool | None, tuple | None, float]:
        """`_prepare`'s work: the request's draft caught up (built the first time) and prefilled."""
        owner = self.owner
        ready = request.prepare(k, room)
        state = request.state
        prefill_s = 0.0
        if len(state.ids) - state.cached > owner.prefill_chunk + 1:
            # a new request's prompt, or much text committed while it did not draft: one chunk per step, so that
            # no running request waits on a long prefill
            t1 = time.perf_counter()
            prefill_tail(state, owner.prefill_chunk)
            prefill_s = time.perf_counter() - t1
            owner.stats.draft_s += prefill_s
            owner.stats.prefill_chunks += 1
            return None, None, prefill_s
        if batch and ready == k:
            if state.cached < 1 or not 1 <= len(state.ids) - state.cached <= LONG_TAIL:
                t1 = time.perf_counter()
                prefill_tail(state)  # the rest of a prompt, or all ids cached: on its own, before the batch
                prefill_s = time.perf_counter() - t1
                owner.stats.draft_s += prefill_s
            fits = owner.window is None or len(state.ids) + LONG_TAIL + k < owner.window - 1
            if state.cached >= 1 and fits:
                return True, request.heal_candidate(), prefill_s
        return False, None, prefill_s
