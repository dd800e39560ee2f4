"""The vLLM proposer choosing each request's draft length (decode/rows.py) through the simulated engine of
tests/test_vllm.py: the output stays the target's whatever it chooses, a request that drafts nothing costs no
draft forward, and one that drafts again catches up on the text committed meanwhile."""

from __future__ import annotations

import pytest
import torch

from test_vllm import MODELS, Engine, fake_vllm_config
from xtokspec.decode.rows import RowDraftLengths
from xtokspec.vllm.proposer import TextBridgeProposer


class Scripted(RowDraftLengths):
    """Lengths from `pattern(call number, request index)`; what it is told it measures as the policy does."""

    def __init__(self, cap, pattern):
        super().__init__(cap)
        self.pattern, self.calls, self.decisions = pattern, 0, []

    def lengths(self, requests, rows, batched=True):
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
    assert proposer.policy.steps > 0 and proposer.policy.drafted > 0


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
