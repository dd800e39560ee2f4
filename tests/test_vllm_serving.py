"""The vLLM proposer as a server uses it, through the simulated engine of tests/test_vllm.py (no vLLM needed):
each request's draft length chosen per step (decode/rows.py) leaves the output the target's, a request that
drafts nothing costs no draft forward and catches up when it drafts again, a long prompt is read in chunks, and
the draft caches stay within their memory bound over a thousand requests."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_vllm import MODELS, Engine, fake_vllm_config

from xtokspec.decode.rows import RowDraftLengths
from xtokspec.types import XTokSpecError
from xtokspec.vllm.drafts import RequestDraft, recent_start
from xtokspec.vllm.proposer import TextBridgeProposer
from xtokspec.vllm.requests import Queue


class Scripted(RowDraftLengths):
    """Lengths from `pattern(call number, request index)`; what it is told it measures as the policy does."""

    def __init__(self, cap, pattern):
        super().__init__(cap)
        self.pattern, self.calls, self.decisions = pattern, 0, []

    def lengths(self, requests, rows, ways=("batched",), full=True):
        self.calls += 1
        out = [self.pattern(self.calls, i) for i in range(len(requests))]
        self.decisions.append(out)
        return out


class Counted(Engine):
    """The simulated engine, counting each request's drafted and accepted proposals."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.per_request = {n: [0, 0] for n in self.seqs}
        self.at = {n: {} for n in self.seqs}  # per request: committed length -> the proposal verified there

    def next_ids(self, seq, proposal):
        before = self.accepted
        out = super().next_ids(seq, proposal)
        n = next(n for n, s in self.seqs.items() if s is seq)
        self.per_request[n][0] += len(proposal)
        self.per_request[n][1] += self.accepted - before
        if proposal:
            self.at[n][len(seq)] = list(proposal)
        return out


def greedy(model, prompt, new_tokens):
    return model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("batched", [True, False])
def test_requests_that_skip_steps_propose_nothing_and_catch_up_when_they_draft_again(ja_target, heldout_prompts,
                                                                                    batched):
    """Request 0 drafts every step; request 1 only every third step; request 2 never after its first step; 3
    drafts 3 ids every fourth step and 1 id two steps later; 4 and 5 every third and fourth step. The output is the target's greedy output; steps where nobody drafts run no draft forward; the
    requests that skip steps still have drafts accepted when they draft again (their drafts caught up)."""
    model, tokenizer = ja_target
    prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts[:6]]
    proposer = TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe",
                                                   extra={"xtokspec_batched_drafts": batched}))
    pattern = {0: lambda c: 3, 1: lambda c: 3 if c % 3 == 0 else 0, 2: lambda c: 3 if c == 1 else 0,
               3: lambda c: 3 if c % 4 == 0 else 1 if c % 4 == 2 else 0,
               4: lambda c: 3 if c % 3 == 1 else 0, 5: lambda c: 3 if c % 4 == 1 else 0}
    proposer.policy = Scripted(3, lambda call, i: pattern[i](call) if call % 5 else 0)
    engine = Counted(model, proposer, prompts, 64)
    forwards = []
    real_propose = proposer._propose

    def counted(*args):
        before = proposer.stats.draft_forwards
        out = real_propose(*args)
        forwards.append((proposer.policy.decisions[-1], proposer.stats.draft_forwards - before, out))
        return out

    proposer._propose = counted
    out = engine.run()
    for n, prompt in enumerate(prompts):
        assert out[n] == greedy(model, prompt, 64), n
    quiet = [f for decision, f, _ in forwards if not any(decision)]
    assert quiet and all(f == 0 for f in quiet)  # nothing drafted, no draft forward
    for decision, _, proposals in forwards:
        for length, proposal in zip(decision, proposals, strict=False):
            assert len(proposal) <= length
    assert proposer.stats.faults == 0
    # requests 1, 3, 4 and 5 draft after skipping steps: they propose what a request that drafted at every step
    # proposes from the same committed text (their drafts caught up on it; a draft that had not would propose
    # text from the wrong place)
    always = TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe", extra={"xtokspec_batched_drafts": batched}))
    reference = Counted(model, always, prompts, 64)
    reference.run()
    same = [engine.at[n][at] == reference.at[n][at] for n in (1, 3, 4, 5) for at in engine.at[n]
            if at in reference.at[n] and at > len(prompts[n]) + 1]
    print(f"after skipped steps, {sum(same)} of {len(same)} proposals equal an always-drafting request's")
    assert len(same) >= 5 and sum(same) >= 0.6 * len(same)  # 5 of 7 measured; 1 of 8 without the catch-up


def test_a_request_builds_its_draft_when_it_first_drafts(ja_target, heldout_prompts):
    """A request's draft (its text encoded for the draft, its cache) is built at its first proposal, from all its
    ids so far: one that never drafts costs no draft state, one that starts late drafts from the right place. The
    policy is told what each request's draft has to read (all its ids before it is built, a step's few once it
    drafts) and how many ids it has committed, and measures each first reading."""
    model, tokenizer = ja_target
    prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts[:3]]
    proposer = TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe"))

    class ByRequest(RowDraftLengths):
        """Request 0 drafts from the start, request 1 from its fourth step on, request 2 never (requests known by
        their acceptance records, in prompt order at the first call: rows shift as requests end)."""

        calls, order = 0, {}

        unread: dict = {}
        ages: dict = {}

        def lengths(self, requests, rows, ways=("batched",), full=True):
            self.calls += 1
            if self.calls == 1:
                self.order = {id(r): n for n, r in enumerate(requests)}
            which = [self.order[id(r)] for r in requests]
            for n, r in zip(which, requests, strict=True):
                self.unread.setdefault(n, []).append(r.unread)
                self.ages.setdefault(n, []).append(r.age)
            return [3 if n == 0 or (n == 1 and self.calls > 3) else 0 for n in which]

    proposer.policy = ByRequest(3)
    engine = Counted(model, proposer, prompts, 24)
    out = engine.run()
    for n, prompt in enumerate(prompts):
        assert out[n] == greedy(model, prompt, 24), n
    assert proposer.stats.new_states == 2  # requests 0 and 1
    assert engine.per_request[2][0] == 0 and engine.per_request[1][0] > 0
    assert engine.per_request[1][1] > 0  # built late from its whole text, its drafts are accepted
    unread = proposer.policy.unread
    assert unread[0][0] == len(prompts[0]) + 1 and max(unread[0][1:]) <= 4  # its prompt and first id, then a step's
    assert unread[1][3] == len(prompts[1]) + 4  # three quiet steps more
    assert unread[2] == list(range(len(prompts[2]) + 1, len(prompts[2]) + 1 + len(unread[2])))  # never read
    assert proposer.policy.ages[2] == list(range(1, 1 + len(unread[2])))  # one committed id a step
    read = proposer.policy.costs.read
    assert {(unread[0][0],), (unread[1][3],)} <= set(read.held) | set(read.times)


@pytest.mark.slow
def test_the_adaptive_proposer_leaves_the_output_the_targets(ja_target, heldout_prompts):
    """The default policy, learning from the simulated engine's steps (real seconds): whatever it chooses, every
    request's output is the target's greedy output, and it reports how many rows it let draft."""
    model, tokenizer = ja_target
    prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts[4:8]]
    proposer = TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe", extra={"xtokspec_adaptive": True}))
    assert proposer.policy.adaptive
    out = Engine(model, proposer, prompts, 32).run()
    for n, prompt in enumerate(prompts):
        assert out[n] == greedy(model, prompt, 32), n
    assert 0 < proposer.stats.drafting_rows <= proposer.stats.rows
    assert proposer.policy.steps > 0 and proposer.policy.costs.drafted > 0


def test_quiet_steps_the_policy_knows_of_leave_rows_unmatched_and_the_requests_are_found_again(
        ja_target, heldout_prompts, monkeypatch):
    """Where the model chooses no drafting (here it never predicts a gain), the steps until it costs the choice
    again skip matching rows (`RowDraftLengths.quiet_ahead`): the requests are found again after them (one entry
    each, never a new one), probes still draft on their schedule, and the output is the target's. A skipped call
    enters no torch inference mode (right after the target's forward a torch call runs cache-cold: BENCHMARKS.md,
    "vLLM"); the calls that draft do (the count's control)."""
    model, tokenizer = ja_target
    prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts[4:8]]
    proposer = TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe", extra={"xtokspec_adaptive": True}))
    monkeypatch.setattr(proposer.policy.costs, "may_pay", lambda *args, **kwargs: False)
    monkeypatch.setattr(proposer.policy, "PROBE_BUDGET", 1.0)  # probes on their schedule, whatever they cost
    entered, by_call = [], {"skipped": 0, "drafted": 0}
    inference_mode = torch.inference_mode
    monkeypatch.setattr(torch, "inference_mode",
                        lambda *args, **kwargs: entered.append(1) or inference_mode(*args, **kwargs))
    propose = proposer.propose

    def counted(*args, **kwargs):
        skipped, proposed, before = proposer.stats.skipped, proposer.stats.proposed, len(entered)
        out = propose(*args, **kwargs)
        if proposer.stats.skipped > skipped:
            by_call["skipped"] += len(entered) - before
        elif proposer.stats.proposed > proposed:
            by_call["drafted"] += len(entered) - before
        return out

    monkeypatch.setattr(proposer, "propose", counted)
    out = Engine(model, proposer, prompts, 48).run()
    for n, prompt in enumerate(prompts):
        assert out[n] == greedy(model, prompt, 48), n
    stats = proposer.stats
    assert stats.skipped >= 0.4 * stats.calls, (stats.skipped, stats.calls)
    assert by_call["skipped"] == 0 and by_call["drafted"] > 0, by_call
    assert proposer.table.created == len(prompts)  # every request kept its entry across the skipped steps
    assert proposer.policy.probes >= 2 and stats.proposed > 0


def test_a_step_where_a_request_was_replaced_is_not_skipped(monkeypatch):
    """A skipped step leaves rows unmatched only where each row is its request one id longer: a step in which
    a request left and another came (the same number of rows) is matched, and the new request gets its entry."""
    proposer = TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe", extra={"xtokspec_adaptive": True}))
    monkeypatch.setattr(proposer.policy, "quiet_ahead", lambda: True)
    monkeypatch.setattr(proposer.policy, "lengths", lambda requests, rows, ways=(), full=True: [0] * len(requests))
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, 7000, size=(4, 256)).astype(np.int64)
    lengths = np.array([40, 50, 60, 70])

    def call():
        return proposer.propose([[int(tokens[r, lengths[r] - 1])] for r in range(4)], lengths.copy(), tokens)

    call()
    lengths += 1
    call()
    assert proposer.stats.skipped == 1 and proposer.table.created == 4
    tokens[2] = rng.integers(10, 7000, size=256)  # request 2 left, a new one of 30 ids took its row
    lengths += 1
    lengths[2] = 30
    call()
    assert proposer.stats.skipped == 1 and proposer.table.created == 5
    lengths += 1
    call()
    assert proposer.stats.skipped == 2


def test_the_measured_arms_are_told_each_steps_committed_ids(ja_target, heldout_prompts, monkeypatch):
    """Each measured step reaches the policy with the ids it committed (its arms compare seconds per committed
    id): a step without proposals commits exactly one id per request, one with p proposals between one and 1 + p
    more per request. A step after which a request left the rows (here: a finished one) reaches it with none."""
    model, tokenizer = ja_target
    prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts[4:8]]
    proposer = TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe", extra={"xtokspec_adaptive": True}))
    seen = []
    observe = RowDraftLengths._observe_step  # where every step is costed, at once or later (a skipped one)

    def record(self, rows, proposals, seconds, tokens, call):
        seen.append((rows, proposals, tokens))
        return observe(self, rows, proposals, seconds, tokens, call)

    monkeypatch.setattr(RowDraftLengths, "_observe_step", record)
    Engine(model, proposer, prompts, 24).run()
    known = [(rows, p, tokens) for rows, p, tokens in seen if tokens is not None]
    assert len(known) > 0.8 * len(seen)
    assert any(p == 0 for _, p, _ in known) and any(p > 0 for _, p, _ in known), known
    for rows, proposals, tokens in known:
        assert tokens == rows if proposals == 0 else rows <= tokens <= rows + proposals, (rows, proposals, tokens)
    assert proposer.policy.measured  # the arms were fed


@pytest.mark.slow
def test_a_long_prompt_is_read_in_chunks_while_the_others_draft(ja_target, heldout_prompts):
    """A request with a prompt of ~300 ids beside three short ones: its draft reads its prompt 32 ids per step
    (`xtokspec_prefill_chunk`), proposing nothing meanwhile; no draft forward in any step feeds more than a chunk
    and a drafted tail; every output is the target's."""
    model, tokenizer = ja_target
    long_prompt = tokenizer("".join(heldout_prompts * 4))["input_ids"][:300]
    prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts[:3]] + [long_prompt]
    assert len(long_prompt) == 300
    proposer = TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe", extra={"xtokspec_prefill_chunk": 32}))
    widths = []
    hook = proposer.draft_model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        out = Counted(model, proposer, prompts, 16).run()
    finally:
        hook.remove()
    for n, prompt in enumerate(prompts):
        assert out[n] == greedy(model, prompt, 16), n
    assert proposer.stats.prefill_chunks >= 300 * 1.0 / 32 - 1  # the draft's prompt is at least as long in ids
    assert max(widths) <= 32 + 16, max(widths)  # a chunk, or the rest of a prompt, or a short tail


def test_a_draft_that_reads_only_recent_text_begins_at_a_character_and_leaves_the_output_the_targets(
        ja_target, heldout_prompts):
    """`xtokspec_draft_read`: a new request's draft reads only the most recent ids of its text. Where they would
    begin inside a character (byte-fallback pieces of one), they begin after it. The policy is told of the few
    ids the draft will read, the draft reads a long prompt in one step (no chunks), and every output is the
    target's. A value under 8 is refused by name."""
    model, tokenizer = ja_target
    proposer = TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe", extra={"xtokspec_draft_read": 24}))
    codec = proposer.pair.target
    pieces = tokenizer.convert_tokens_to_ids(["<0xE3>", "<0x81>", "<0x82>"])  # one character, byte by byte
    assert tokenizer.unk_token_id not in pieces and tokenizer.decode(pieces) == "あ"
    text = tokenizer("".join(heldout_prompts[:3]))["input_ids"][1:]
    ids = text + pieces + text[:9]
    assert recent_start(codec, ids, 11) == len(text) + 3  # two of the character's pieces: after it
    assert recent_start(codec, ids, 12) == len(text)  # its first piece: from it
    assert recent_start(codec, ids, 12, same_vocab=True) == len(ids) - 12
    long_prompt = tokenizer("".join(heldout_prompts * 4))["input_ids"][:300]
    prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts[:3]] + [long_prompt]
    out = Counted(model, proposer, prompts, 16).run()
    for n, prompt in enumerate(prompts):
        assert out[n] == greedy(model, prompt, 16), n
    assert proposer.stats.prefill_chunks == 0 and proposer.stats.proposed > 0
    waiting = RequestDraft(proposer, long_prompt)
    assert waiting.unread == 24
    with pytest.raises(XTokSpecError, match="xtokspec_draft_read"):
        TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe", extra={"xtokspec_draft_read": 4}))


@pytest.mark.slow
def test_the_draft_caches_stay_within_their_bound_over_a_thousand_requests(heldout_prompts):
    """1,000 requests of 4 to 200 prompt ids, 8 running at a time, each living 1 to 12 steps and a fifth of them
    aborted (gone without finishing), straight through `propose` (rows as vLLM lays them out, each step committing
    part of the last proposal and one more id from the text). With a 2 MiB bound (1,024 positions of the fixture
    draft: less than 8 requests of up to 200 ids and their drafts need), the memory the bound counts stays within
    it after every call, it is never less than what the cache tensors hold, and the states kept stay bounded."""
    from xtokspec.runtime.kv import position_bytes

    proposer = TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe",
                                                   extra={"xtokspec_draft_cache_mib": 2}))
    text = proposer.target_tokenizer("".join(heldout_prompts * 3))["input_ids"]
    rng = random.Random(0)
    started, running, peak, calls = 0, [], 0, 0
    while started < 1000 or running:
        while len(running) < 8 and started < 1000:
            at, length = rng.randrange(0, len(text) - 400), rng.randint(4, 200)
            running.append({"ids": text[at : at + length], "at": at + length, "steps": rng.randint(1, 12),
                            "abort": rng.random() < 0.2, "proposal": [], "new": text[at + length - 1 : at + length]})
            started += 1
        rows = np.zeros((len(running), 512), dtype=np.int64)
        for r, request in enumerate(running):
            rows[r, : len(request["ids"])] = request["ids"]
        out = proposer.propose([r["new"] for r in running], np.array([len(r["ids"]) for r in running]), rows)
        calls += 1
        counted = proposer.cache_bytes()
        held = sum(sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in
                       e.payload.state.kv.layer_tensors()) for e in proposer.table.entries
                   if e.payload is not None and e.payload.state is not None)
        assert held <= counted <= proposer.memory.bound, (held, counted)
        peak = max(peak, counted)
        survivors = []
        for request, proposal in zip(running, out, strict=True):
            request["steps"] -= 1
            if request["steps"] <= 0 or (request["abort"] and rng.random() < 0.3):
                continue
            accepted = rng.randint(0, len(proposal))
            new = text[request["at"] : request["at"] + accepted + 1]  # what the "target" commits
            request["at"] += len(new)
            request["ids"] = request["ids"] + new
            request["new"] = new
            survivors.append(request)
        running = survivors
    assert proposer.states <= proposer.table.max_states
    assert proposer.stats.evicted > 0 and proposer.stats.faults == 0
    print(f"{calls} calls, {proposer.stats.new_states} states built, {proposer.stats.evicted} evicted, peak "
          f"{peak / 2**20:.2f} MiB of {proposer.memory.bound / 2**20:.2f} ({position_bytes(proposer.draft_model)} bytes "
          "per position)")


@pytest.mark.slow
def test_a_trimmed_draft_head_drafts_from_its_kept_ids_and_leaves_the_output_the_targets(ja_target, heldout_prompts,
                                                                                        tmp_path):
    """`xtokspec_draft_vocab_text`: the draft's head keeps the 512 ids most frequent in the calibration file (plus
    EOS and single bytes); every id it drafts is a kept one, and the output is the target's."""
    from xtokspec.types import XTokSpecError

    model, tokenizer = ja_target
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("\n".join(heldout_prompts[8:]), encoding="utf-8")
    proposer = TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe", extra={
        "xtokspec_draft_vocab_text": str(calibration), "xtokspec_draft_vocab": 512}))
    keep = set(proposer.draft_vocab.keep.tolist())
    assert 512 <= len(keep) < proposer.draft_vocab.vocab_size
    drafted = []
    real_finish = RequestDraft.finish

    def finish(self, ids, room, healed=False):
        drafted.extend(ids)
        return real_finish(self, ids, room, healed)

    RequestDraft.finish = finish
    try:
        prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts[:4]]
        out = Engine(model, proposer, prompts, 24).run()
    finally:
        RequestDraft.finish = real_finish
    for n, prompt in enumerate(prompts):
        assert out[n] == greedy(model, prompt, 24), n
    assert drafted and set(drafted) <= keep
    with pytest.raises(XTokSpecError, match="xtokspec_draft_vocab_text"):
        TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe", extra={
            "xtokspec_draft_vocab_text": str(tmp_path / "missing.txt")}))


def test_requests_are_taken_to_wait_only_where_a_freed_slot_was_taken_at_once():
    """`requests.Queue`: at the scheduler's limit (4 here), a request that left and was replaced at the next step
    says requests wait, one that left a step with fewer says none does; before any such step none is taken to wait,
    and below the limit none can be."""
    queue = Queue(4)
    # a batch of 4 arrives together (4 new rows), runs, one request ends and nobody takes its slot
    assert [queue.observe(4, 0, 4), queue.observe(4, 4, 4), queue.observe(3, 3, 3)] == [False] * 3
    assert not queue.waiting
    # 4 again (a new batch): nothing left a step at the limit yet, the last evidence holds
    assert [queue.observe(4, 3, 4), queue.observe(4, 4, 4)] == [False, False]
    # a request leaves and a waiting one comes in at the next step (its row new, or still prefilling: no ids)
    assert queue.observe(4, 3, 3) is True and queue.observe(4, 4, 4) is True
    assert queue.observe(4, 3, 4) is True  # replaced again
    assert queue.observe(3, 3, 3) is False and not queue.waiting  # the queue ran dry
    assert queue.observe(2, 2, 2) is False  # below the limit: never


@pytest.mark.slow
def test_the_proposer_chooses_the_steps_throughput_only_while_requests_wait(ja_target, heldout_prompts):
    """Through the simulated engine with a limit of 4 running requests: 4 requests arriving together (their
    lengths apart) run at the slowest request's pace throughout (nobody takes a freed slot), while 7 requests
    queued for 4 slots run at the step's throughput once a freed slot was taken, and at the pace again when
    the queue has run dry. The output is the target's."""
    model, tokenizer = ja_target
    prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts[:7]]
    seen = []

    class Told(RowDraftLengths):
        def lengths(self, requests, rows, ways=("batched",), full=True):
            seen.append((rows, full))
            return super().lengths(requests, rows, ways, full)

    def run(prompts, ends):
        config = fake_vllm_config(MODELS / "ja-draft-bpe", extra={"xtokspec_adaptive": True})
        config.scheduler_config.max_num_seqs = 4
        proposer = TextBridgeProposer(config)
        proposer.policy = Told(3)
        engine = Engine(model, proposer, prompts, 24, running=4, finishing=True)
        for n, new in enumerate(ends):
            engine.ends[n] = len(prompts[n]) + new
        seen.clear()
        out = engine.run()
        for n, prompt in enumerate(prompts):
            assert out[n] == greedy(model, prompt, ends[n]), n
        return list(seen)

    together = run(prompts[:4], [6, 10, 14, 18])
    assert (4, False) in together and not any(full for _, full in together)
    queued = run(prompts, [6, 8, 10, 12, 14, 16, 18])
    fulls = [full for _, full in queued]
    first = fulls.index(True)
    # not before a freed slot was taken: the first request ends after its first steps (it commits 6 ids)
    assert first >= 2, queued
    assert queued[-1] == (queued[-1][0], False) and queued[-1][0] < 4  # the queue ran dry: the pace again


@pytest.mark.slow
def test_an_int8_draft_drafts_and_leaves_the_output_the_targets(ja_target, heldout_prompts, tmp_path):
    """`xtokspec_draft_linears="int8"`: every linear of the draft, its trimmed head included, runs in int8 and the
    output is the target's; without trimming, its proposals are accepted about as often as the float32 draft's (at
    least 70% as many over 8 prompts). A draft that is not float32, or another value, is refused by name."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    from xtokspec.runtime.vocab import TrimmedHead

    model, tokenizer = ja_target
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("\n".join(heldout_prompts[8:]), encoding="utf-8")
    proposer = TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe", extra={
        "xtokspec_draft_linears": "int8", "xtokspec_draft_vocab_text": str(calibration), "xtokspec_draft_vocab": 512}))
    modules = list(proposer.draft_model.modules())
    assert not any(type(m) is torch.nn.Linear for m in modules)
    assert sum(isinstance(m, DynamicLinear) for m in modules) >= 8
    head = proposer.draft_model.get_output_embeddings()
    assert isinstance(head, TrimmedHead) and isinstance(head.int8, DynamicLinear)
    prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts[:4]]
    out = Engine(model, proposer, prompts, 24).run()
    for n, prompt in enumerate(prompts):
        assert out[n] == greedy(model, prompt, 24), n
    accepted = {}
    prompts = [tokenizer(p)["input_ids"] for p in heldout_prompts[:8]]
    for linears in ("torch", "int8"):
        proposer = TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe",
                                                       extra={"xtokspec_draft_linears": linears}))
        Engine(model, proposer, prompts, 32).run()
        accepted[linears] = proposer.stats.accepted
    print("accepted proposals, float32 and int8 drafts:", accepted)
    assert accepted["int8"] >= 0.7 * accepted["torch"] and accepted["torch"] >= 10, accepted
    with pytest.raises(XTokSpecError, match="xtokspec_draft_dtype"):
        TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe", extra={
            "xtokspec_draft_linears": "int8", "xtokspec_draft_dtype": "bfloat16"}))
    with pytest.raises(XTokSpecError, match="xtokspec_draft_linears"):
        TextBridgeProposer(fake_vllm_config(MODELS / "ja-draft-bpe", extra={"xtokspec_draft_linears": "int4"}))


def test_an_int8_draft_is_refused_off_the_cpu():
    """`xtokspec_draft_linears="int8"` is torch's CPU quantization: a draft vLLM runs elsewhere is refused by name
    (before any module is touched)."""
    from xtokspec.vllm import build

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(XTokSpecError, match="xtokspec_draft_linears.*cuda"):
        build.int8(model, torch.device("cuda"))
    assert type(model[0]) is torch.nn.Linear
