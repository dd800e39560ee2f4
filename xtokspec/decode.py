"""The speculative loop across tokenizers: `XTokSpec(large, small).generate(prompt)`.

One cycle (Leviathan et al. 2023, Algorithm 1, with a text bridge in the middle):
  1. draft K tokens with the small model (greedy, or sampled with the target's own logits processing);
  2. move them onto the target vocabulary: the same ids (same tokenizer), the ids with identical bytes
     ("intersection"), or the drafted text re-encoded as a fragment ("onehot" / greedy);
  3. one target forward over the uncommitted ids plus the proposals (K+1 logits rows);
  4. accept a prefix of the proposals, then emit one *recovered* (first rejection) or *bonus* token;
  5. commit; roll both KV caches back to the committed text (the draft keeps the drafted tokens whose
     bytes agree with it and re-encodes only the rest).
Invariant after every cycle: the target's ids are exactly what it would have produced alone (greedy: equal
ids; sampling: equal distribution), and the draft's context is the committed text up to its last complete
character (once it has caught up with the target-alone cycles, below).

Where drafting does not pay (a weak draft, or hardware on which verifying n tokens costs ~n steps), the
policy runs cycles of the target alone, one token each, and keeps probing drafting (SpecConfig.fallback).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import difflib
import inspect
import itertools
import math
import statistics
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from . import sampling, tree
from .bridge import TextSync, TokenCodec, build_token_map, byte_ends
from .cache import (
    COMPILE_BUCKETS,
    ModelState,
    choose_backend,
    compile_step,
    input_device,
    padded_length,
    select_rows,
    sliding_layers,
    takes_tree_masks,
    to_device,
)
from .models import DraftVocab, choose_draft_vocab, cpu_bf16_note, frozen_head_note, load, trimmed_draft
from .types import (
    GenerationResult,
    GenerationStats,
    SamplingParams,
    SpecConfig,
    XTokSpecError,
    check_prompt,
    expected_tokens,
)

# generation_config fields whose non-neutral values add logits processors xtokspec does not implement.
_NEUTRAL = {
    "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "sequence_bias": (None,),
    "min_p": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,),
    "num_beams": (None, 1),
}
# transformers' defaults for sampling fields a generation_config leaves unset.
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


def _eos_ids(model, tokenizer) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def unknown_options_message(names: list[str], known: tuple[str, ...]) -> str:
    """An error naming keywords that generate() / stream() do not take (`known`: those they do), with where
    each belongs if anywhere."""
    config_fields = tuple(field.name for field in dataclasses.fields(SpecConfig))
    parts = []
    for name in names:
        if name in config_fields:
            parts.append(f"{name!r} is set once per XTokSpec: XTokSpec(..., config=SpecConfig({name}=...))")
        else:
            close = difflib.get_close_matches(name, known + config_fields, n=1)
            parts.append(f"{name!r} is not an option" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unknown keyword for generate/stream: {'; '.join(parts)}. They take: {', '.join(known)}"


def keyword_only(function) -> tuple[str, ...]:
    """The keyword-only parameter names of `function`, in order."""
    return tuple(name for name, parameter in inspect.signature(function).parameters.items()
                 if parameter.kind is inspect.Parameter.KEYWORD_ONLY)


@dataclasses.dataclass
class DraftingCost:
    """What drafting has cost per committed token (decayed sums over measured drafted cycles) for one setting of
    one XTokSpec, and the fallback's probing schedule (DraftLengthPolicy.run_alone). Shared by the generations
    with that setting, so that a generation after the first starts from what the earlier ones measured (the
    costs are the models' and the device's; the acceptance is the pair's, on similar text)."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0  # the decayed count of cycles in the sums
    cycles: int = 0
    alone_run: int = 2  # target-alone cycles before the next drafted probe (DraftLengthPolicy.PROBE_DRAFT_FIRST)


class DraftLengthPolicy:
    """Chooses K each cycle to maximise expected committed tokens per second from measured costs.

    With per-token acceptance a and m proposals in a row, a cycle commits (1 - a^(m+1)) / (1 - a) tokens on
    average (Leviathan et al. 2023, eq. 1) and costs K draft steps plus one verification whose cost grows
    linearly with the number of tokens verified. For a chain both are the proposals. For a token tree, m is the
    tree's depth and the verification carries every node; the first level (the root's several candidates) is
    accepted far more often than the levels below it (a beam spends its width on the likeliest branch), so a
    tree has two rates: a1 for the first level and a for each level after it, and commits
    1 + a1 * (1 - a^m) / (1 - a) tokens on average. The acceptance rates, the cost of a draft step, the
    verification cost line, and the depth and nodes per draft step are all measured online with exponential
    forgetting.
    """

    SIZE_SAMPLES = 8  # recent verification times kept per captured trie size
    ALONE_SAMPLES = 8  # recent target-alone cycle times kept (SpecConfig.fallback)
    PROBE_ALONE_EVERY = 64  # drafted cycles between two target-alone cycles while drafting pays
    # target-alone cycles between two drafted ones while drafting does not pay: 2 at first, doubled after each
    # drafted probe that loses too (a choice made on a few early cycles is soon tested again), up to 16, or up
    # to as many as keep a probe's extra seconds within PROBE_BUDGET of the target-alone time between probes
    # (where a drafted cycle costs several steps more than it commits), at most PROBE_DRAFT_CAP
    PROBE_DRAFT_FIRST, PROBE_DRAFT_MAX, PROBE_DRAFT_CAP = 2, 16, 256
    PROBE_BUDGET = 0.05

    def __init__(self, config: SpecConfig, decay: float = 0.9, size_times: dict | None = None,
                 alone_times: collections.deque | None = None, drafting: DraftingCost | None = None):
        self.config = config
        self.decay = decay
        self.k = config.num_draft_tokens
        self.successes, self.failures = 1.0, 1.0  # acceptance evidence (a Beta(1, 1) prior)
        self.tree = config.tree_width > 1
        self.first_successes, self.first_failures = 1.0, 1.0  # a tree's first level (Beta(1, 1) prior)
        self.draft_step = None  # seconds per draft forward
        self.verify = [0.0, 0.0, 0.0, 0.0, 0.0]  # decayed sums: n, m, m^2, t, m*t  (m = nodes, t = verify seconds)
        self.proposals_per_draft = 1.0  # depth (proposals in a row) per draft step
        self.nodes_per_draft = 1.0  # tokens verified per draft step
        self.cycles = 0
        self.predicted, self.realised = 1.0, 1.0  # a tree's node values vs accepted nodes (decayed sums)
        # captured tree verification: nodes a bucket carries -> its recent verification seconds (shared between
        # the generations of one XTokSpec: the costs are the models' and the device's, not the prompt's)
        self.size_times = {} if size_times is None else size_times
        # SpecConfig.fallback: drafting vs the target alone, each arm's measured seconds per committed token. A
        # drafted cycle's seconds are all of it (draft, bridge, verification, commit) over the tokens it commits;
        # the target alone commits one token per cycle, whose recent times are shared like size_times.
        self.alone_times = collections.deque(maxlen=self.ALONE_SAMPLES) if alone_times is None else alone_times
        self.drafting = DraftingCost(alone_run=self.PROBE_DRAFT_FIRST) if drafting is None else drafting
        self.since_draft = 0  # target-alone cycles since the last drafted one
        self.since_alone = 0  # drafted cycles since the last target-alone one
        self.probing = False  # the last drafted cycle was a probe

    def update(self, drafted: int, proposed: int, accepted: int, draft_s: float, verify_s: float | None,
               nodes: int | None = None, rejected: bool | None = None, size: int | None = None) -> None:
        """One cycle: `drafted` draft steps, `proposed` proposals in a row (a tree's depth), `accepted` of them;
        for a tree also its `nodes` and whether the walk stopped at a rejection (a chain: accepted < proposed),
        and for a captured tree the `size` it was verified at (the nodes its bucket carries). verify_s None: the
        verification also carried the prompt (the first cycle), so its time says nothing about the cost of
        verifying proposals."""
        d = self.decay
        nodes = proposed if nodes is None else nodes
        rejected = accepted < proposed if rejected is None else rejected
        self.cycles += 1
        if self.tree:  # the first level apart; `successes`/`failures` count the levels below it
            self.first_successes = d * self.first_successes + (accepted >= 1)
            self.first_failures = d * self.first_failures + (accepted == 0 and rejected)
            self.successes = d * self.successes + max(0, accepted - 1)
            self.failures = d * self.failures + (1.0 if accepted >= 1 and rejected else 0.0)
        else:
            self.successes = d * self.successes + accepted
            self.failures = d * self.failures + (1.0 if rejected else 0.0)
        if drafted:
            step = draft_s / drafted
            self.draft_step = step if self.draft_step is None else d * self.draft_step + (1 - d) * step
            self.proposals_per_draft = d * self.proposals_per_draft + (1 - d) * proposed / drafted
            self.nodes_per_draft = d * self.nodes_per_draft + (1 - d) * nodes / drafted
        if verify_s is not None and size is not None:
            times = self.size_times.setdefault(size, collections.deque(maxlen=self.SIZE_SAMPLES))
            times.append(verify_s)
        if verify_s is not None:
            m = float(nodes)
            for i, v in enumerate((1.0, m, m * m, verify_s, m * verify_s)):
                self.verify[i] = d * self.verify[i] + v

    def record(self, committed: int, seconds: float, alone: bool) -> None:
        """One measured cycle (not the first, which also fed the prompt) for the fallback: the tokens it
        committed and its seconds, from start to commit; `alone`: it ran the target alone."""
        if alone:
            self.alone_times.append(seconds)
            self.since_draft += 1
            self.since_alone = 0
            return
        d, cost = self.decay, self.drafting
        cost.tokens = d * cost.tokens + committed
        cost.seconds = d * cost.seconds + seconds
        cost.weight = d * cost.weight + 1.0
        cost.cycles += 1
        self.since_draft = 0
        self.since_alone += 1

    def run_alone(self) -> bool:
        """Whether the next cycle runs the target alone (SpecConfig.fallback, with adaptive).

        A two-armed choice by measured seconds per committed token. Drafting goes first; after 3 measured
        drafted cycles, one target-alone cycle measures a target step if none is known yet (the times are
        shared by the generations of one XTokSpec: a step costs what the model and device make it) and again
        after every PROBE_ALONE_EVERY drafted cycles. Then the cheaper arm runs, except that a run of target-
        alone cycles gives way to one drafted cycle (a probe, so that drafting is measured again as the text
        and its acceptance change) after `alone_run` of them: PROBE_DRAFT_FIRST, doubled after each probe that
        leaves the target alone cheaper, up to `_probe_cap()`, and back to the first once drafting wins. The
        drafting costs and the schedule carry over between generations with the same settings (DraftingCost):
        a later generation may start with the target alone. Each arm's output is the target's own, so the
        choice costs speed at worst, never correctness: it is made before the cycle from earlier cycles'
        timings only."""
        cost = self.drafting
        if not (self.config.adaptive and self.config.fallback) or cost.cycles < 3:
            return False
        if not self.alone_times or self.since_alone >= self.PROBE_ALONE_EVERY:
            return True
        if 0 < self.since_draft and self.since_draft >= cost.alone_run:
            self.probing = True
            return False
        step = statistics.median(self.alone_times)
        alone = step * cost.tokens < cost.seconds
        if self.probing and self.since_draft == 0:  # the probe has been measured
            self.probing = False
            cost.alone_run = min(2 * cost.alone_run, self._probe_cap(step)) if alone else self.PROBE_DRAFT_FIRST
        elif not alone:
            cost.alone_run = self.PROBE_DRAFT_FIRST
        return alone

    def _probe_cap(self, step: float) -> int:
        """The longest run of target-alone cycles between drafted probes: PROBE_DRAFT_MAX, or more where a drafted
        cycle's measured extra seconds (its time minus what the target alone takes for the tokens it commits)
        would exceed PROBE_BUDGET of the target-alone time between probes; at most PROBE_DRAFT_CAP."""
        cost = self.drafting
        extra = (cost.seconds - step * cost.tokens) / max(cost.weight, 1e-9)
        need = math.ceil(round(extra / (self.PROBE_BUDGET * max(step, 1e-9)), 6))  # NOTE: 20.000000004 is 20
        return max(self.PROBE_DRAFT_MAX, min(need, self.PROBE_DRAFT_CAP))

    def _verify_cost(self, m: float) -> float:
        """Verification seconds for m proposals (nodes): a least-squares line over recent cycles. Its slope is
        0 until the counts have spread (a variance of at least one proposal squared: a steeper line from
        nearly equal counts is noise), and at most the one through the origin (no negative fixed cost)."""
        n, sm, smm, st, smt = self.verify
        if n <= 0:
            return 0.0
        mean_m, mean_t = sm / n, st / n
        var = smm / n - mean_m**2
        slope = max(0.0, (smt / n - mean_m * mean_t) / var) if var >= 1.0 else 0.0
        slope = min(slope, mean_t / mean_m) if mean_m > 0 else slope
        return mean_t + slope * (m - mean_m)

    def calibrate(self, predicted: float, accepted: int) -> None:
        """One tree cycle: the sum of its verified nodes' values (their expected number of accepted nodes, if
        the draft's probabilities were the acceptance chances) and the nodes it accepted."""
        self.predicted = self.decay * self.predicted + predicted
        self.realised = self.decay * self.realised + accepted

    def tree_nodes(self, values: list[float], spent_s: float, room=None) -> int:
        """How many of a drafted trie's nodes to verify, given their values largest first and the seconds this
        cycle has already spent: the n that maximises expected tokens per second,
        (1 + r * (v_1 + ... + v_n)) / (spent + verify(n)), with r the measured ratio of accepted nodes to
        predicted ones (draft probabilities are not acceptance chances; a weak draft is over-confident). All
        of them until costs are measured, and with adaptive=False or prune_tree=False.

        `room` (a compiled target's `ModelState.tree_room`): the verification runs padded to a bucket, so its
        cost is a step per bucket, not a line in n, and a bucket carries room(n) nodes for the price of n. Then
        each size the trie can be verified at is costed at the fastest of its recent verifications (a first
        call that compiled, or a slow moment of the host, does not stick), and a size seen fewer than twice is
        tried first, the largest first. A line fitted to captured cycles would keep every node for good: once
        the trie fills the largest bucket every cycle, the counts stop varying and the line has no slope."""
        if not (self.config.adaptive and self.config.prune_tree) or self.cycles < 3 or not values:
            return len(values)
        r = min(self.realised / self.predicted, 1.0 / max(max(values), 1e-6))  # a chance is at most 1
        if room is not None:
            return self._tree_size(values, spent_s, r, room)
        best, best_rate, total = 1, 0.0, 0.0
        for n, v in enumerate(values, start=1):
            total += v
            rate = (1 + r * total) / (spent_s + max(self._verify_cost(n), 1e-6))
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def _tree_size(self, values: list[float], spent_s: float, r: float, room) -> int:
        sizes = sorted({room(n) for n in range(1, len(values) + 1)})
        costs = {size: min(self.size_times[size]) for size in sizes if len(self.size_times.get(size, ())) >= 2}
        unseen = [size for size in sizes if size not in costs]
        if unseen:
            return min(unseen[-1], len(values))
        prefix = list(itertools.accumulate(values))
        rates = {size: (1 + r * prefix[min(size, len(values)) - 1]) / (spent_s + max(costs[size], 1e-6))
                 for size in sizes}
        return min(max(sizes, key=rates.__getitem__), len(values))

    def next_k(self) -> int:
        if not self.config.adaptive or self.cycles < 3 or self.draft_step is None:
            return self.k
        a = min(self.successes / (self.successes + self.failures), 0.999)
        a1 = min(self.first_successes / (self.first_successes + self.first_failures), 0.999)
        best, best_rate = 1, 0.0
        for k in range(1, self.config.max_draft_tokens + 1):
            depth, nodes = self.proposals_per_draft * k, self.nodes_per_draft * k
            tokens = 1 + a1 * expected_tokens(a, depth - 1) if self.tree else expected_tokens(a, depth)
            rate = tokens / (k * self.draft_step + max(self._verify_cost(nodes), 1e-6))
            if rate > best_rate:
                best, best_rate = k, rate
        self.k = best
        return best


class ProposalChooser:
    """proposal="auto" for sampled chains across tokenizers: which proposal kind the next cycle uses.

    A kind's expected accepted tokens per cycle is a0 * D: a0 its chance of acceptance at the cycle's first
    position, D its accepted tokens per cycle in which the first proposal was accepted. a0 is computable for
    both kinds after each verification, from the draft's distribution at the first position (q, the draft's own
    vocabulary) and the target's (p): the intersection proposal is accepted with sum_v min(p(v), Q(v)) (Q: q
    restricted to ids with the same bytes in both vocabularies), the one-hot proposal with
    sum_d q(d) p(first target token of d's text); both come from the same q and p, so they are compared paired.
    D differs between the kinds (a one-hot draft token may carry several target tokens; intersection restricts
    the draft to mapped ids) and is measured only while a kind runs, from a prior of PRIOR_DEPTH. The next cycle
    uses the kind with the larger a0 * D (running means, exponential forgetting); a switch needs a lead of
    `margin` tokens. Until a cycle has been measured the static rule decides (SpecConfig.min_mapped_mass).

    Lossless: the kind is chosen from cycles already verified, never from the draws of the cycle it is used in,
    and every cycle is verified exactly for the proposal it used (reference/exact.py, speculative_generate
    with a chooser; tests/test_stats.py, the switching case).
    """

    KINDS = ("onehot", "intersection")
    PRIOR_DEPTH, PRIOR_WEIGHT = 1.2, 2.0  # D before a kind has run: pseudo-cycles at 1.2 tokens each

    def __init__(self, start: str, decay: float = 0.9, margin: float = 0.02):
        self.kind = start
        self.decay, self.margin = decay, margin
        self.first = dict.fromkeys(self.KINDS, 0.0)  # decayed sums of a0 estimates
        self.weight = 0.0
        self.accepted = dict.fromkeys(self.KINDS, self.PRIOR_DEPTH * self.PRIOR_WEIGHT)  # per kind: tokens
        self.reached = dict.fromkeys(self.KINDS, self.PRIOR_WEIGHT)  # ... over cycles whose first was accepted

    def update(self, onehot: float, intersection: float, accepted: int) -> str:
        """One verified cycle: both kinds' first-position chances, and the tokens the running kind accepted ->
        the kind for the next cycle."""
        d = self.decay
        self.weight = d * self.weight + 1.0
        for kind, value in zip(self.KINDS, (onehot, intersection), strict=True):
            self.first[kind] = d * self.first[kind] + value
        if accepted:
            self.accepted[self.kind] = d * self.accepted[self.kind] + accepted
            self.reached[self.kind] = d * self.reached[self.kind] + 1.0
        scores = self.scores()
        other = self.KINDS[1 - self.KINDS.index(self.kind)]
        if scores[other] > scores[self.kind] + self.margin:
            self.kind = other
        return self.kind

    def scores(self) -> dict[str, float]:
        """Expected accepted tokens per cycle, a0 * D, per kind."""
        if not self.weight:
            return {}
        return {k: self.first[k] / self.weight * self.accepted[k] / self.reached[k] for k in self.KINDS}


class XTokSpec:
    """Lossless speculative decoding of `large` (the target) with `small` (the draft), any two tokenizers.

    `large` and `small` are each a local folder or hub id (loaded with `large_kwargs` / `small_kwargs`, e.g.
    dtype, device_map) or an already loaded `(model, tokenizer)` pair. The models may sit on different devices.
    """

    def __init__(self, large, small, *, config: SpecConfig | None = None, large_kwargs=None, small_kwargs=None):
        self.config = config or SpecConfig()
        self.target_model, self.target_tokenizer = load(large, "target (large)", **(large_kwargs or {}))
        self.draft_model, self.draft_tokenizer = load(small, "draft (small)", **(small_kwargs or {}))
        self.target = TokenCodec(self.target_tokenizer, self.target_model.config.vocab_size, "target tokenizer")
        self.draft = TokenCodec(self.draft_tokenizer, self.draft_model.config.vocab_size, "draft tokenizer")
        for model, role in ((self.target_model, "target (large)"), (self.draft_model, "draft (small)")):
            note = frozen_head_note(model, role)
            if note:
                warnings.warn(note, UserWarning, stacklevel=2)
        note = cpu_bf16_note(self.target_model, "the target (large)")
        if note:
            warnings.warn(note, UserWarning, stacklevel=2)
        self.target_eos = _eos_ids(self.target_model, self.target_tokenizer)
        self.draft_eos = _eos_ids(self.draft_model, self.draft_tokenizer)
        self.same_vocab = self.target_tokenizer.get_vocab() == self.draft_tokenizer.get_vocab()
        self._token_map = None
        self._first_pieces = None
        self._draft_to_target: dict[torch.device, torch.Tensor] = {}  # the token map as a tensor, per device
        self._full_draft_model = self.draft_model  # trim_draft_vocab replaces draft_model by a view of this
        self.draft_vocab: DraftVocab | None = None
        self._steps: dict[int, object] = {}  # id(model) -> compiled model (SpecConfig.compile)
        self._idle_kv: dict[int, object] = {}  # id(model) -> its static cache, between generations
        self._tree_size_times: dict = {}  # captured tree verification costs per size (DraftLengthPolicy)
        self._alone_times = collections.deque(maxlen=DraftLengthPolicy.ALONE_SAMPLES)  # target-alone cycle seconds
        self._drafting_costs: dict[tuple, DraftingCost] = {}  # per setting (config, sampling, kind): SpecConfig.fallback
        self._custom_generate = None
        self.last_stats: GenerationStats | None = None  # of the last custom_generate call (transformers' generate)

    # ---------------------------------------------------------------- public API
    def describe(self) -> str:
        """One line naming both models with their class, dtype and device (the CLI prints it)."""

        def one(role, model):
            name = Path(str(getattr(model, "name_or_path", "") or "?")).name
            dtype = str(model.dtype).removeprefix("torch.")
            return f"{role} {name} ({type(model).__name__}, {dtype}, {input_device(model)})"

        trimmed = f" [head: {self.draft_vocab.keep.numel()} of {self.draft_vocab.vocab_size} ids]" if self.draft_vocab else ""
        return f"{one('target', self.target_model)}; {one('draft', self.draft_model)}{trimmed}"

    def trim_draft_vocab(self, texts, size: int = 32768) -> DraftVocab | None:
        """Let the draft's output head compute only `size` ids: those most frequent in `texts` (calibration text
        like what you will generate, e.g. thousands of paragraphs, or the target's own outputs on your prompts),
        plus EOS and single-byte ids. `texts=None` restores the full head. -> what was kept.

        For drafts whose head is a large share of a step (Gemma-3-270M: 262k ids, 42% of a CPU step), this makes
        each draft step cheaper (FR-Spec, Zhao et al. 2025). The output stays lossless whatever is kept: the draft
        only proposes, and the verifier is given the trimmed draft's own distributions. Out-of-domain text costs
        acceptance wherever the target wants an id the head no longer scores (BENCHMARKS.md, "A trimmed draft
        head": with man pages and Python source for general Japanese prompts, as much as the cheaper step gains).
        """
        # NOTE: both may raise; nothing has changed yet, so bad input keeps the head as it was
        vocab = None if texts is None else choose_draft_vocab(self.draft, texts, size, self.draft_eos)
        model = self._full_draft_model if vocab is None else trimmed_draft(self._full_draft_model, vocab.keep)
        if self.draft_model is not self._full_draft_model:
            # NOTE: compiled steps are keyed by id(model); the old view is dropped here, and a new one could reuse its id
            self._steps.pop(id(self.draft_model), None)
            self._idle_kv.pop(id(self.draft_model), None)
        self.draft_model, self.draft_vocab = model, vocab
        return vocab

    def generate(self, prompt: str, max_new_tokens: int = 128, **kwargs) -> GenerationResult:
        """Continue `prompt`; greedy by default, or do_sample=True with temperature / top_k / top_p / seed.

        Other keywords: proposal ("auto" | "onehot" | "intersection"), num_draft_tokens, adaptive, tree_width;
        SpecConfig's other fields are the XTokSpec's, and passing one here is an error naming so.
        """
        stats = GenerationStats()
        token_ids: list[int] = []
        for new_ids in self._cycles(prompt, max_new_tokens, stats, **kwargs):
            token_ids += new_ids
        text = self._decode(token_ids)
        return GenerationResult(text=text, token_ids=token_ids, stats=stats, stop_reason=stats.stop_reason)

    def warmup(self, prompt: str, max_new_tokens: int = 128, *, tree_width: int | None = None,
               progress: bool = True) -> int:
        """With `SpecConfig(compile=True)`: compile now every shape that generations of this prompt's size can
        meet, so that none of them stops to compile (a first call of a new shape: seconds on a CPU, tens of
        seconds per shape for a 13B model on a GPU). Returns the number of shapes; 0 without compile=True.

        Compiled calls are specialised on the cache's size class (buffers of 256, 384, 512, 768, ... positions),
        which the prompt's length plus `max_new_tokens` decides: warm up with a prompt and a `max_new_tokens`
        like those you will serve (a generation in another class compiles its own shapes, once). The shapes: the
        draft's forwards in every bucket (1, 2, 4, 8, 16, 32 ids), and the target's, as a chain's verifications
        or, with `tree_width` > 1 (default: the config's), as tree-masked ones, with the draft's tree levels and
        the target's moves of an accepted path into place."""
        config = self.config if tree_width is None else dataclasses.replace(self.config, tree_width=tree_width)
        if not config.compile:
            return 0
        from tqdm.auto import tqdm

        target_ids, draft_ids = self._check_prompt(prompt, max_new_tokens)
        self._check_trees(config)
        target, draft = self._states(target_ids, draft_ids, max_new_tokens, config)
        trees = config.tree_width > 1

        def chain(state, n):  # n more ids fed after the prompt: a drafting step, a resync or a verification
            state.ids.extend([state.ids[-1]] * n)
            state.forward(keep=1)

        def trie(state, n):  # the last id and n - 1 trie nodes
            tokens = [0] + [state.ids[-1]] * (n - 1)
            state.forward_tree(tokens, [-1] + [(i - 1) // config.tree_width for i in range(1, n)])
            state.keep_path([], tokens)

        def level(state, n):  # a beam level of n nodes on the draft's cache
            state.grow_tree([state.ids[-1]] * n, [0] * n)

        def move(state, n):  # a kept path of n nodes that is not in place (node 1 is off it): keep_path's move
            tokens = [0] + [state.ids[-1]] * (n + 1)
            state.forward_tree(tokens, [-1, 0, 0] + list(range(2, n + 1)))
            state.keep_path(list(range(2, n + 2)), tokens)

        plan = [(draft, chain, n) for n in COMPILE_BUCKETS]
        plan += [(target, trie if trees else chain, n) for n in COMPILE_BUCKETS]
        if trees and draft.grows_trees:
            widths = {padded_length(w): w for w in range(1, config.tree_width + 1)}  # the widest per bucket
            plan += [(draft, level, w) for w in sorted(widths.values())]
        if trees and config.adaptive and config.fallback:  # a target-alone cycle feeds one id, as a chain does
            plan.append((target, chain, 1))
        if trees:  # an accepted path off the first branch: at most every node but one
            lengths = {padded_length(n): n for n in range(1, target.max_tree_nodes(config.max_tree_nodes))}
            plan += [(target, move, n) for n in sorted(lengths.values())]
        try:
            with torch.inference_mode():
                for state in (target, draft):
                    state.forward(keep=1)  # the prompt (eager: a cache's first forward always is)
                done = 0
                for state, call, n in tqdm(plan, desc="compiling", disable=not progress):
                    prompt_len = len(state.ids)
                    for _ in range(2):  # CUDA graphs are recorded on a shape's second call
                        call(state, n)
                        state.truncate(prompt_len)
                    done += 1
        finally:
            self._release(target)
            self._release(draft)
        return done

    def stream(self, prompt: str, max_new_tokens: int = 128, stats: GenerationStats | None = None, **kwargs) -> Iterator[str]:
        """Yield the continuation's text as soon as it is verified (whole characters only)."""
        token_ids: list[int] = []
        shown = ""
        for new_ids in self._cycles(prompt, max_new_tokens, stats or GenerationStats(), **kwargs):
            token_ids += new_ids
            text = self._decode(token_ids)
            stable = text.rstrip("\ufffd")  # an incomplete trailing character decodes to U+FFFD: wait for it
            if len(stable) > len(shown) and stable.startswith(shown):
                yield stable[len(shown) :]
                shown = stable
        text = self._decode(token_ids)
        if text != shown:
            yield text[len(shown) :] if text.startswith(shown) else text

    @property
    def custom_generate(self):
        """The decoding loop for transformers' generate on the target model (lossless, like `generate`):

            out = large_model.generate(**inputs, custom_generate=spec.custom_generate, max_new_tokens=64,
                                       streamer=streamer, do_sample=True, temperature=0.7, seed=0)

        It honours max_new_tokens / max_length, EOS, stop_strings (pass tokenizer=), stopping criteria and a
        streamer; xtokspec's own options (seed, proposal, num_draft_tokens, adaptive, tree_width) may be passed
        to generate too. The statistics of the last call are in `spec.last_stats`. See xtokspec/hf.py."""
        if self._custom_generate is None:
            from . import hf

            def custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
                return hf.hf_generate(self, model, input_ids, logits_processor, stopping_criteria, generation_config,
                                      **kwargs)

            hf.install(self.target_model, custom_generate)
            self._custom_generate = custom_generate
        return self._custom_generate

    def draft_prompt_ids(self, target_ids: list[int]) -> list[int]:
        """The draft's prompt for a prompt given as target ids: their text in the draft's own encoding."""
        limit = getattr(self.target_model.config, "max_position_embeddings", None)
        if limit and len(target_ids) >= limit:
            raise XTokSpecError(
                f"prompt is {len(target_ids)} target tokens, but the target's context is {limit} positions"
            )
        if self.same_vocab:
            return list(target_ids)
        text = self._decode(target_ids)
        if not text:
            raise XTokSpecError("the prompt ids stand for no text (only special tokens): give some text to continue")
        return self.draft.encode_prompt(text)

    def _decode(self, token_ids: list[int]) -> str:
        # NOTE: no clean-up: it deletes spaces before punctuation, and the text must be the tokens' own
        return self.target_tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @property
    def token_map(self):
        """Byte-normalized draft -> target token map (built on first use)."""
        if self._token_map is None:
            pairs = [(d, min(self.target_eos)) for d in self.draft_eos] if self.target_eos else []
            self._token_map = build_token_map(self.draft, self.target, pairs)
        return self._token_map

    @property
    def first_pieces(self) -> torch.Tensor:
        """(Vd,) draft id -> the target id of the first token of its text, -1 where none (built on first use,
        one batched encode: ~2 s for a 262k vocabulary)."""
        if self._first_pieces is None:
            self._first_pieces = torch.tensor(self.target.first_pieces(self.draft.token_bytes), dtype=torch.long)
        return self._first_pieces

    def root_groups(self) -> torch.Tensor:
        """(Vd,) draft id -> the target id a tree root's candidate drawn as that draft id stands for: the same id
        for one tokenizer, else the first target token of its text (`first_pieces`), the target's EOS for the
        draft's; -1 where none (SpecConfig.tree_root="sampled")."""
        target_vocab = self.target_model.config.vocab_size
        size = self.draft_model.config.vocab_size
        if self.same_vocab:
            groups = torch.arange(size)
            return torch.where(groups < target_vocab, groups, -1)
        groups = self.first_pieces.clone()
        if self.target_eos:
            groups[[d for d in self.draft_eos if d < size]] = min(self.target_eos)
        return groups

    def draft_to_target(self, device: torch.device) -> torch.Tensor:
        """(Vd,) the token map (draft id -> target id with the same bytes, -1 where none) on `device`, built once
        per device (~50 ms from the list for a 262k vocabulary, which every sampled call needs)."""
        device = torch.device(device)
        if device not in self._draft_to_target:
            self._draft_to_target[device] = torch.tensor(self.token_map.draft_to_target, device=device)
        return self._draft_to_target[device]

    def sampling_params(self, do_sample=None, temperature=None, top_k=None, top_p=None, seed=None) -> SamplingParams:
        """Sampling parameters as the target's `generate` would resolve them from its generation_config."""
        gc = self.target_model.generation_config
        bad = {k: getattr(gc, k, None) for k, ok in _NEUTRAL.items() if getattr(gc, k, None) not in ok}
        if bad:
            raise XTokSpecError(
                f"the target's generation_config sets {bad}, which add logits processors xtokspec does not "
                "implement; set them to neutral values (e.g. model.generation_config.repetition_penalty = 1.0)"
            )

        def pick(name, value):
            if value is not None:
                return value
            value = getattr(gc, name, None)
            return _SAMPLING_DEFAULTS[name] if value is None else value

        do_sample = bool(gc.do_sample) if do_sample is None else do_sample
        params = SamplingParams(
            do_sample=do_sample, temperature=pick("temperature", temperature), top_k=pick("top_k", top_k),
            top_p=pick("top_p", top_p), seed=seed,
        )
        given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        ignored = {k: v for k, v in given.items() if v is not None and not (k == "temperature" and v == 0)}
        if not do_sample and ignored:
            # NOTE: as transformers' generate does: greedy decoding ignores them, and says so.
            warnings.warn(
                f"{ignored} only apply when sampling, and do_sample is False (greedy decoding): they are ignored; "
                "pass do_sample=True to sample", UserWarning, stacklevel=4,  # user code -> generate -> _cycles
            )
        return params

    def _model_state(self, model, ids: list[int], config: SpecConfig, capacity: int, tree_nodes: int = 0) -> ModelState:
        """ids + KV cache with the configured backend (and the compiled step, compiled once per XTokSpec)."""
        backend = choose_backend(model, config.cache, config.compile)
        step, reuse = None, None
        if config.compile:
            step = self._steps.get(id(model))
            if step is None:
                role = "target" if model is self.target_model else "draft"
                step = self._steps[id(model)] = compile_step(model, role)
        if backend == "static":
            # NOTE: taken, not shared: a generation still running (another open stream) keeps its own cache
            reuse = self._idle_kv.pop(id(model), None)
        return ModelState(model, ids, backend, capacity, step, tree_nodes, reuse)

    def _states(self, target_ids: list[int], draft_ids: list[int], max_new_tokens: int,
                config: SpecConfig) -> tuple[ModelState, ModelState]:
        """Both models' ids and caches for a generation of `max_new_tokens`, sized as the loop needs them."""
        trees = config.tree_width > 1
        target = self._model_state(self.target_model, target_ids, config, len(target_ids) + max_new_tokens,
                                   config.max_tree_nodes if trees else 0)
        # the draft's beam: at most tree_width nodes per level, one level per draft step (grow_tree)
        draft = self._model_state(self.draft_model, draft_ids, config,
                                  len(draft_ids) + 3 * max_new_tokens + 2 * config.max_draft_tokens + 16,
                                  config.tree_width * config.max_draft_tokens if trees else 0)
        return target, draft

    def _release(self, state: ModelState) -> None:
        """A finished generation's static cache, kept for the next one (the larger, if two finish)."""
        if state.backend == "static":
            idle = self._idle_kv.get(id(state.model))
            if idle is None or idle.capacity < state.kv.capacity:
                self._idle_kv[id(state.model)] = state.kv

    # ---------------------------------------------------------------- the loop
    def _check_prompt(self, prompt, max_new_tokens) -> tuple[list[int], list[int]]:
        check_prompt(prompt)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise XTokSpecError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        target_ids = self.target.encode_prompt(prompt)
        limit = getattr(self.target_model.config, "max_position_embeddings", None)
        if limit and len(target_ids) >= limit:
            raise XTokSpecError(
                f"prompt is {len(target_ids)} target tokens, but the target's context is {limit} positions"
            )
        draft_ids = target_ids if self.same_vocab else self.draft.encode_prompt(prompt)
        return target_ids, draft_ids

    def _cycles(self, prompt, max_new_tokens, stats, *, do_sample=None, temperature=None, top_k=None,
                top_p=None, seed=None, **options) -> Iterator[list[int]]:
        unknown = sorted(set(options) - set(keyword_only(self._cycles_from_ids)))
        if unknown:  # NOTE: the keywords named are the ones these two signatures take, so they cannot drift apart
            known = keyword_only(self._cycles) + keyword_only(self._cycles_from_ids)
            raise XTokSpecError(unknown_options_message(unknown, known))
        target_ids, draft_ids = self._check_prompt(prompt, max_new_tokens)  # NOTE: the prompt's errors first
        params = self.sampling_params(do_sample, temperature, top_k, top_p, seed)
        yield from self._cycles_from_ids(target_ids, draft_ids, max_new_tokens, stats, params, **options)

    def _cycles_from_ids(self, target_ids: list[int], draft_ids: list[int], max_new_tokens: int,
                         stats: GenerationStats, params: SamplingParams, *, proposal=None, num_draft_tokens=None,
                         adaptive=None, tree_width=None) -> Iterator[list[int]]:
        """The loop over prepared prompt ids (`_cycles` and the transformers entry point, xtokspec/hf.py)."""
        config = self.config
        if num_draft_tokens is not None or adaptive is not None:
            k = config.num_draft_tokens if num_draft_tokens is None else num_draft_tokens  # NOTE: 0 is refused, not the default
            config = dataclasses.replace(
                config,
                num_draft_tokens=k,
                max_draft_tokens=max(config.max_draft_tokens, k) if isinstance(k, int) else config.max_draft_tokens,
                adaptive=config.adaptive if adaptive is None else adaptive,
            )
        if tree_width is not None:
            config = dataclasses.replace(config, tree_width=tree_width)
        self._check_trees(config)
        kind = self._proposal_kind(params, proposal or config.proposal, config.tree_width)
        stats.proposal = kind + (" tree" if config.tree_width > 1 else "")
        with torch.inference_mode():
            yield from _Run(self, params, config, kind, stats).cycles(target_ids, draft_ids, max_new_tokens)

    def _check_trees(self, config: SpecConfig) -> None:
        """Token trees need a target that can verify a trie in one forward."""
        if config.tree_width > 1 and sliding_layers(self.target_model):
            raise XTokSpecError(
                f"token trees (tree_width={config.tree_width}) need full-attention layers in the target; "
                f"{type(self.target_model).__name__} has {sliding_layers(self.target_model)} layers: use tree_width=1"
            )
        if config.tree_width > 1 and not takes_tree_masks(self.target_model):
            raise XTokSpecError(
                f"token trees (tree_width={config.tree_width}) verify with a tree attention mask, which the target's "
                f"attention implementation {self.target_model.config._attn_implementation!r} does not apply: load it "
                f"with attn_implementation='sdpa' (or 'eager'), or use tree_width=1"
            )

    def _proposal_kind(self, params: SamplingParams, proposal: str, tree_width: int = 1) -> str:
        if proposal not in ("auto", "onehot", "intersection"):
            raise XTokSpecError(f"proposal must be 'auto', 'onehot' or 'intersection', got {proposal!r}")
        if self.same_vocab:
            return "same-tokenizer"
        if not params.do_sample:
            return "greedy-bridge"
        if tree_width > 1:  # a tree's root draws from the draft (tree_root), its other nodes are one-hot
            if proposal == "intersection":
                raise XTokSpecError(
                    f"token trees (tree_width={tree_width}) choose their own proposals (SpecConfig.tree_root); "
                    "proposal='intersection' needs tree_width=1 (or use proposal='auto' / 'onehot')"
                )
            return "onehot"
        return proposal  # "auto": chosen each cycle (ProposalChooser)


class _Run:
    """State of one generate call: both models' ids and caches, the committed bytes, generators, stats."""

    def __init__(self, spec: XTokSpec, params: SamplingParams, config: SpecConfig, kind: str, stats: GenerationStats):
        self.spec, self.params, self.kind, self.stats = spec, params, kind, stats
        setting = (config, dataclasses.replace(params, seed=None), kind)
        drafting = spec._drafting_costs.setdefault(setting, DraftingCost(alone_run=DraftLengthPolicy.PROBE_DRAFT_FIRST))
        self.policy = DraftLengthPolicy(config, size_times=spec._tree_size_times, alone_times=spec._alone_times,
                                        drafting=drafting)
        self.unsynced: list[int] = []  # ids committed by target-alone cycles that the draft has not seen yet
        self.catch_up_s = 0.0  # seconds _catch_up spent, charged to the next drafted cycle
        self.config = config
        self.min_confidence = config.draft_confidence
        self.warpers = sampling.build_warpers(params) if params.do_sample else None
        self.target_limit = getattr(spec.target_model.config, "max_position_embeddings", None) or 1 << 30
        self.draft_limit = getattr(spec.draft_model.config, "max_position_embeddings", None) or 1 << 30
        self.sync = TextSync(spec.target, spec.draft, config.draft_lookbehind)
        if params.do_sample:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
            self.target_gen = self._generator(spec.target_model, seed)
            self.draft_gen = self._generator(spec.draft_model, seed + 1)
        self.chooser = None
        if kind == "auto":  # sampled chain across tokenizers: one-hot or intersection, chosen each cycle
            static = "intersection" if spec.token_map.mapped_draft_share >= config.min_mapped_mass else "onehot"
            self.chooser = ProposalChooser(static)
            self.kind = static
        self.first_row = None  # the chooser's q: the draft's distribution at a cycle's first position
        # a sampled tree root (SpecConfig.tree_root): each draft id's group, the target id its root candidate
        # stands for (the first target token of its text; the target's EOS for the draft's; -1: none)
        self.root_groups = None
        if config.tree_width > 1 and params.do_sample and config.tree_root == "sampled":
            self.root_groups = spec.root_groups().to(input_device(spec.draft_model))  # (Vd,)
        if self.kind == "intersection" or self.chooser:
            self.draft_to_target = spec.draft_to_target(input_device(spec.draft_model))  # (Vd,)
            self.mapped_mask = self.draft_to_target >= 0  # (Vd,)
        if self.chooser:  # the chooser scores on the target's device
            where = self._target_logits_device()
            self.estimate_map = spec.draft_to_target(where)  # (Vd,)
            self.estimate_first = spec.first_pieces.to(where)  # (Vd,)

    @staticmethod
    def _generator(model, seed: int) -> torch.Generator:
        return torch.Generator(device=input_device(model)).manual_seed(seed)

    def cycles(self, target_ids: list[int], draft_ids: list[int], max_new_tokens: int) -> Iterator[list[int]]:
        spec = self.spec
        # NOTE: proposals are capped at remaining - 1, so the target never holds more than prompt + max_new_tokens
        # ids; the draft's text in its own tokens is unknown in advance: at most 3 per target token is budgeted,
        # and a draft that fills its cache only stops drafting (self.draft_limit), which costs speed, not output.
        target, draft = spec._states(target_ids, draft_ids, max_new_tokens, self.config)
        self.max_tree_nodes = target.max_tree_nodes(self.config.max_tree_nodes)  # compiled: one captured call
        self.target_limit = min(self.target_limit, target.capacity)
        self.draft_limit = min(self.draft_limit, draft.capacity)
        self.stats.cache = f"{target.backend}/{draft.backend}" + ("+compile" if self.config.compile else "")
        self.draft_prompt_len = len(draft_ids)
        produced = 0
        start = time.perf_counter()
        try:
            while produced < max_new_tokens:
                remaining = max_new_tokens - produced
                if self.policy.run_alone():
                    new_ids = self._alone_cycle(target, remaining)
                else:
                    self._catch_up(draft)
                    k = min(self.policy.next_k(), remaining - 1, self.draft_limit - len(draft.ids) - 1)
                    cycle = self._tree_cycle if self.config.tree_width > 1 else self._chain_cycle
                    new_ids = cycle(target, draft, k, remaining)
                produced += len(new_ids)
                stop = self._finish(new_ids, produced, max_new_tokens, target, start)  # stats complete before the yield
                yield new_ids
                if stop:
                    return
        finally:  # also when a stream is closed early
            spec._release(target)
            spec._release(draft)

    def _chain_cycle(self, target: ModelState, draft: ModelState, k: int, remaining: int) -> list[int]:
        """Steps 1-5 for a chain of K drafted tokens -> the committed target ids."""
        t0 = time.perf_counter()
        drafted, draft_rows, eos_drafted = self._draft(draft, max(k, 0))
        t1 = time.perf_counter()
        proposals, proposal_probs = self._bridge(drafted, draft_rows, eos_drafted)
        proposals = proposals[: max(0, min(remaining - 1, self.target_limit - len(target.ids) - 1))]
        if proposal_probs is not None:
            proposal_probs = proposal_probs[: len(proposals)]
        t2 = time.perf_counter()
        prefill = len(target.ids) - target.cached > 1  # the first cycle also feeds the prompt
        num_accepted, next_token, target_probs = self._verify(target, proposals, proposal_probs)
        t3 = time.perf_counter()
        new_ids = self._committed(proposals[:num_accepted] + [next_token], remaining)
        target.truncate(len(target.ids) - len(proposals) + num_accepted)
        target.ids.append(next_token)
        self._resync(draft, drafted, new_ids)
        used = self.kind
        if self.chooser and self.first_row is not None:  # a sampled cycle: target_probs is there
            self._choose(target_probs[0], self.first_row.to(target_probs.device), num_accepted)
        t4 = time.perf_counter()
        self._account(len(drafted), len(proposals), num_accepted, len(new_ids), t1 - t0, (t2 - t1) + (t4 - t3), t3 - t2,
                      prefill=prefill, kind=used)
        return new_ids

    def _alone_cycle(self, target: ModelState, remaining: int) -> list[int]:
        """One target step with no draft (SpecConfig.fallback) -> the committed id. The draft is not fed: the
        ids wait in `unsynced` until a drafted cycle needs the draft again (`_catch_up`)."""
        t0 = time.perf_counter()
        prefill = len(target.ids) - target.cached > 1
        _, next_token, _ = self._verify(target, [], None)  # no proposals: the target's own next token
        target.ids.append(next_token)
        new_ids = self._committed([next_token], remaining)
        self.unsynced += new_ids
        self.stats.alone_cycles += 1
        self._account(0, 0, 0, len(new_ids), 0.0, 0.0, time.perf_counter() - t0, prefill=prefill, kind="alone")
        return new_ids

    def _catch_up(self, draft: ModelState) -> None:
        """Commit the target-alone cycles' ids to the draft's context (its forward feeds them when it next
        drafts); the time counts as the next drafted cycle's bridge time."""
        if self.unsynced:
            t0 = time.perf_counter()
            self._resync(draft, [], self.unsynced)
            self.unsynced = []
            self.catch_up_s = time.perf_counter() - t0

    def _committed(self, new_ids: list[int], remaining: int) -> list[int]:
        """A cycle's accepted tokens plus its next token, cut after the first EOS and at `remaining`."""
        for n, token in enumerate(new_ids):
            if token in self.spec.target_eos:
                return new_ids[: min(n + 1, remaining)]
        return new_ids[:remaining]

    def _finish(self, new_ids, produced, max_new_tokens, target, start) -> bool:
        """Record the wall time and why generation stops (if it does) -> whether it stops."""
        stats = self.stats
        stats.wall_seconds = time.perf_counter() - start
        if new_ids[-1] in self.spec.target_eos:
            stats.stop_reason = "eos"
        elif produced >= max_new_tokens:
            stats.stop_reason = "length"
        elif len(target.ids) >= self.target_limit:
            stats.stop_reason = "context"  # NOTE: the target alone could not go on either
        return bool(stats.stop_reason)

    def _account(self, drafted, proposed, accepted, committed, draft_s, bridge_s, verify_s, nodes=None,
                 rejected=None, prefill=False, kind=None, size=None) -> None:
        s = self.stats
        kind = kind or self.kind
        s.proposal_cycles[kind] = s.proposal_cycles.get(kind, 0) + 1
        rejected = accepted < proposed if rejected is None else rejected
        s.target_forwards += 1
        s.draft_forwards += drafted
        s.drafted += proposed if nodes is None else nodes
        s.accepted += accepted
        s.rejections += rejected
        s.new_tokens += committed
        s.draft_seconds += draft_s
        s.bridge_seconds += bridge_s
        s.verify_seconds += verify_s
        s.draft_lengths.append(drafted)
        s.proposal_lengths.append(proposed if nodes is None else nodes)
        s.accepted_lengths.append(accepted)
        alone = kind == "alone"
        if not alone:
            bridge_s += self.catch_up_s
            s.bridge_seconds += self.catch_up_s
            self.catch_up_s = 0.0
            self.policy.update(drafted, proposed, accepted, draft_s, None if prefill else verify_s, nodes, rejected, size)
        if not prefill:
            self.policy.record(committed, draft_s + bridge_s + verify_s, alone)

    # ---------------------------------------------------------------- 1. draft
    def _draft(self, draft: ModelState, k: int) -> tuple[list[int], list[torch.Tensor], bool]:
        """Sample k draft tokens -> (ids, their sampling distributions when needed, stopped at EOS)."""
        if not self.params.do_sample and self.min_confidence <= 0 and k > 1:
            return self._draft_greedy_on_device(draft, k)
        ids: list[int] = []
        rows: list[torch.Tensor] = []
        restrict = self.kind == "intersection" and not self.sync.pending
        keep_rows = self.kind in ("same-tokenizer", "intersection") and self.params.do_sample
        self.first_row = None
        for _ in range(k):
            logits = draft.forward(keep=1)  # (1, Vd)
            if not self.params.do_sample:
                token = int(torch.argmax(logits[0]))
                confident = self.min_confidence <= 0 or float(torch.softmax(logits[0].float(), -1)[token]) >= self.min_confidence
            else:
                probs = sampling.logits_to_probs(logits, self.warpers)[0]  # (Vd,)
                if self.chooser and not ids and not self.sync.pending:
                    self.first_row = probs  # both kinds' first proposal comes from this q (before restriction)
                if restrict:
                    probs = probs * self.mapped_mask
                    if float(probs.sum()) <= 0:
                        break  # NOTE: no mapped token has mass: stop drafting rather than divide by 0
                    probs = probs / probs.sum()
                noise = sampling.exponential_noise(probs.shape, self.draft_gen, probs.device)
                token = int(sampling.race(probs, noise))
                confident = float(probs[token]) >= self.min_confidence
                if keep_rows:
                    rows.append(probs)
            draft.ids.append(token)
            ids.append(token)
            if token in self.spec.draft_eos:
                return ids, rows, True
            if not confident:  # NOTE: a low-confidence guess is still proposed, but nothing is drafted after it
                break
        return ids, rows, False

    def _draft_greedy_on_device(self, draft: ModelState, k: int) -> tuple[list[int], list[torch.Tensor], bool]:
        """Greedy drafting with one host transfer: each argmax feeds the next step on the device, and the k ids
        come to the host once, for the bridge. Steps past a drafted EOS are rolled back afterwards."""
        base = len(draft.ids)
        token = torch.argmax(draft.forward(keep=1)[-1:], dim=-1)  # (1,)
        tokens = [token]
        for _ in range(k - 1):
            token = torch.argmax(draft.feed(token.view(1, 1)), dim=-1)  # (1,)
            tokens.append(token)
        ids = torch.cat(tokens).tolist()  # the one transfer
        draft.ids.extend(ids)
        for n, token_id in enumerate(ids):
            if token_id in self.spec.draft_eos:
                draft.truncate(base + n + 1)
                return ids[: n + 1], [], True
        return ids, [], False

    # ---------------------------------------------------------------- 2. bridge
    def _bridge(self, drafted: list[int], rows: list[torch.Tensor], eos: bool):
        """Drafted ids -> (target proposal ids, proposal distributions (K, Vt) or None for one-hot)."""
        spec = self.spec
        target_vocab = spec.target_model.config.vocab_size
        if self.kind == "same-tokenizer":
            probs = torch.stack(rows).to(self._target_logits_device()) if rows else None
            if probs is not None and probs.shape[-1] != target_vocab:
                probs = _resize_vocab(probs, target_vocab)
            return list(drafted), probs
        if self.kind == "intersection" and not self.sync.pending and rows:
            t_map = self.draft_to_target
            proposals = t_map[drafted[: len(rows)]].tolist()
            probs = sampling.map_to_target(torch.stack(rows), t_map, target_vocab)  # (K, Vt)
            return proposals, probs.to(self._target_logits_device())
        # NOTE: the draft's EOS becomes a target EOS candidate (BOS never appears mid-stream).
        eos_candidate = min(spec.target_eos) if eos and spec.target_eos else None
        return self.sync.propose(drafted[:-1] if eos else drafted, eos_candidate), None

    def _target_logits_device(self) -> torch.device:
        return self.spec.target_model.get_output_embeddings().weight.device

    # ---------------------------------------------------------------- 3-4. verify
    def _verify(self, target: ModelState, proposals: list[int], proposal_probs) -> tuple[int, int, torch.Tensor | None]:
        """-> (accepted proposals, next token, the target's warped distributions (K+1, Vt) when sampling)."""
        target.ids.extend(proposals)
        logits = target.forward(keep=len(proposals) + 1)  # (K+1, Vt)
        if not self.params.do_sample:
            return (*sampling.verify_greedy(logits, proposals), None)
        proposal_ids = to_device(proposals, logits.device)  # (K,)
        target_probs = sampling.logits_to_probs(logits, self.warpers)  # (K+1, Vt)
        gen = self.target_gen
        uniforms = torch.rand(len(proposals), generator=gen, device=gen.device).to(logits.device)
        num_accepted = sampling.count_accepted(target_probs, proposal_ids, uniforms, proposal_probs)
        dist = sampling.next_token_distribution(target_probs, proposal_ids, num_accepted, proposal_probs)
        noise = sampling.exponential_noise(dist.shape, gen, gen.device).to(dist.device)
        return num_accepted, int(sampling.race(dist, noise)), target_probs

    def _choose(self, p: torch.Tensor, q: torch.Tensor, accepted: int) -> None:
        """proposal="auto": both kinds' chance of acceptance at this cycle's first position (one transfer) -> the
        next cycle's kind."""
        onehot, intersection = torch.stack([
            sampling.onehot_acceptance(p, q, self.estimate_first[: q.shape[-1]]),
            sampling.intersection_acceptance(p, q, self.estimate_map[: q.shape[-1]]),
        ]).tolist()
        self.kind = self.chooser.update(onehot, intersection, accepted)
        self.stats.proposal_estimates = self.chooser.scores()

    # ---------------------------------------------------------------- token trees (steps 1-5 for a tree)
    def _tree_cycle(self, target: ModelState, draft: ModelState, k: int, remaining: int) -> list[int]:
        """Draft a tree, bridge its branches into a trie of target tokens, verify it in one forward, commit."""
        t0 = time.perf_counter()
        max_depth = max(0, min(remaining - 1, self.target_limit - len(target.ids) - 1))
        branches, steps, root = self._draft_tree(draft, max(k, 0), sample_root=max_depth > 0)
        t1 = time.perf_counter()
        trie = tree.Trie()
        if root is not None:  # the draws go first, in draw order, and are all verified
            for token in root[0][: self.max_tree_nodes]:
                trie.insert([token])
            trie.pinned = trie.size
        for path, eos, scores, first in branches:
            ids = self._bridge_branch(path, eos, first)
            trie.insert(ids, max_depth, self.max_tree_nodes, self._node_values(path, scores, ids))
        if root is not None and [trie.tokens[c] for c in trie.children[0]] != root[0][: trie.pinned]:
            raise RuntimeError("a sampled tree root gained a child that was not drawn (a bridge bug)")
        full = trie.size
        captured = target.step is not None
        keep = self.policy.tree_nodes([trie.values[n] for n in trie.ranked()], time.perf_counter() - t0,
                                      target.tree_room if captured else None)
        size = target.tree_room(max(keep, trie.pinned))  # compiled: the bucket's padding rows, as nodes, cost nothing
        trie = trie.pruned(size)
        t2 = time.perf_counter()
        prefill = len(target.ids) - target.cached > 1
        logits = target.forward_tree(trie.tokens, trie.parents)  # (N+1, Vt)
        if not self.params.do_sample:
            path, next_token = tree.verify_tree_greedy(logits, trie)
        else:
            probs = sampling.logits_to_probs(logits, self.warpers)  # (N+1, Vt)
            gen = self.target_gen
            uniforms = torch.rand((trie.size + 1, max(1, trie.max_children())), generator=gen, device=gen.device)
            noise = sampling.exponential_noise(probs.shape[-1:], gen, gen.device)
            root_q = root[1] if root is not None else None
            path, next_token = tree.verify_tree_sampled(probs, trie, uniforms, noise, root_q=root_q)
        t3 = time.perf_counter()
        target.keep_path(path, trie.tokens)
        target.ids.append(next_token)
        new_ids = self._committed(trie.path_tokens(path) + [next_token], remaining)
        self._resync(draft, [], new_ids)  # NOTE: drops the draft's tree; the new text is re-encoded
        t4 = time.perf_counter()
        rejected = bool(trie.children[path[-1] if path else 0])
        self.policy.calibrate(sum(trie.values[1:]), len(path))
        self.stats.pruned_nodes += full - trie.size
        self.stats.sampled_roots += root is not None
        self._account(steps, trie.depth, len(path), len(new_ids), t1 - t0, (t2 - t1) + (t4 - t3), t3 - t2,
                      nodes=trie.size, rejected=rejected, prefill=prefill, size=size if captured else None)
        return new_ids

    def _draft_tree(self, draft: ModelState, k: int, sample_root: bool = True):
        """A beam of `tree_width` draft paths grown for k steps -> (branches as (draft ids, ends at EOS, the
        path's log-probability under the draft after each id, the target id it must start with or None),
        forwards, the sampled root as (target ids in draw order, (Vt,) the distribution they were drawn from)
        or None).

        At each depth the candidates are the top tree_width tokens of every path's next-token distribution (the
        target's warpers applied when sampling), ranked by the path's probability under the draft; the draft's
        greedy chain goes on first, then the best candidates whose text differs from the others', up to
        tree_width paths. A path that no candidate continues is a branch. With a sampled root (SpecConfig.
        tree_root, when sampling and no incomplete character is pending) the first depth's tree_width
        candidates are instead drawn without replacement from the draft, grouped by the target id each stands
        for (`sampling.draw_groups_without_replacement`), and each branch starts with its group's target id.
        One forward per depth: the depth's nodes, tree-masked, on the draft's own cache (`grow_tree`; dropped by
        the resync), or, for a draft with sliding-window layers or an attention that takes no 4D mask, batch rows
        over a copy of its cache."""
        width = self.config.tree_width
        table = self.spec.draft.token_bytes
        probs = self._tree_probs(draft.forward(keep=1))  # (1, Vd)
        steps = 1
        paths, texts, cums = [[]], [b""], [[]]  # per path: draft ids, their text, log-probability after each id
        firsts: list[int | None] = [None]  # per path: the target id its bridged text must start with
        branches: list[tuple[list[int], bool, list[float], int | None]] = []
        cache = None
        nodes = [0]  # per path: its node in the draft's tree (grow_tree; 0 is the root, the last drafted-from id)
        root = None
        for depth in range(k):
            if depth == 0 and sample_root and self.root_groups is not None and not self.sync.pending:
                chosen, root = self._sample_root(probs[0])
            else:
                chosen = self._top_candidates(probs, cums, texts, table, width)
            continued = {r for _, r, _, _ in chosen}
            branches += [(paths[r], False, cums[r], firsts[r]) for r in range(len(paths))
                         if r not in continued and paths[r]]
            frontier = []
            for score, r, t, first in chosen:
                first = firsts[r] if first is None else first
                if t in self.spec.draft_eos:
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
            probs = self._tree_probs(logits)  # (B, Vd)
            paths = [paths[r] + [t] for _, r, t, _ in frontier]
            texts = [texts[r] + table[t] for _, r, t, _ in frontier]
            cums = [cums[r] + [score] for score, r, _, _ in frontier]
            firsts = [first for _, _, _, first in frontier]
        return branches, steps, root

    def _top_candidates(self, probs: torch.Tensor, cums, texts, table, width: int) -> list[tuple[float, int, int, None]]:
        """A depth's candidates: (path log-probability, row, draft id, None), the greedy chain's first."""
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
        target_vocab = self.spec.target_model.config.vocab_size
        noise = sampling.exponential_noise(probs.shape, self.draft_gen, probs.device)  # (Vd,)
        groups, draft_ids = sampling.draw_groups_without_replacement(probs, self.root_groups, target_vocab,
                                                                     self.config.tree_width, noise)
        root_q = sampling.grouped_distribution(probs, self.root_groups, target_vocab)  # (Vt,)
        scores = probs[to_device(draft_ids, probs.device)].log().tolist() if draft_ids else []
        chosen = [(score, 0, d, g) for score, d, g in zip(scores, draft_ids, groups, strict=True)]
        return chosen, (groups, root_q)

    def _tree_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's next-token probabilities that rank tree candidates: warped as the target's when sampling."""
        if self.params.do_sample:
            return sampling.logits_to_probs(logits, self.warpers)
        return torch.softmax(logits.float(), dim=-1)

    def _bridge_branch(self, path: list[int], eos: bool, first: int | None = None) -> list[int]:
        """A branch's draft ids -> target ids (the same ids for one tokenizer; the text bridge otherwise), starting
        with `first` when a sampled root drew that target id for the branch."""
        if self.kind == "same-tokenizer":
            return list(path)
        eos_candidate = min(self.spec.target_eos) if eos and self.spec.target_eos else None
        if first is None:
            return self.sync.propose(path[:-1] if eos else path, eos_candidate)
        if first in self.spec.target_eos:  # the draft's EOS drawn at the root
            return [first]
        return self.sync.propose_from(first, path[:-1] if eos else path, eos_candidate)

    def _node_values(self, path: list[int], scores: list[float], target_ids: list[int]) -> list[float]:
        """Each target id's estimated chance of acceptance: the draft's probability of the branch up to the
        draft id that completes the target id's bytes (the same ids for one tokenizer)."""
        if self.kind == "same-tokenizer":
            return [math.exp(x) for x in scores[: len(target_ids)]]
        draft_ends = byte_ends(self.spec.draft.token_bytes, path)
        end, out = len(self.sync.pending), []
        for t in target_ids:
            size = len(self.spec.target.token_bytes[t])
            end += size
            # NOTE: an EOS candidate (no bytes) stands for the draft's EOS, the branch's last id
            i = min(bisect.bisect_left(draft_ends, end), len(path) - 1) if size else len(path) - 1
            out.append(math.exp(scores[i]))
        return out

    # ---------------------------------------------------------------- 5. commit
    def _resync(self, draft: ModelState, drafted: list[int], new_ids: list[int]) -> None:
        """Bring the draft's context back to the committed text, keeping the drafted ids that agree with it."""
        if self.kind == "same-tokenizer":
            base = len(draft.ids) - len(drafted)
            agree = 0
            while agree < min(len(drafted), len(new_ids)) and drafted[agree] == new_ids[agree]:
                agree += 1
            draft.truncate(base + agree)
            draft.ids.extend(new_ids[agree:])
            return
        keep, extra = self.sync.commit(new_ids, drafted)
        draft.truncate(self.draft_prompt_len + keep)
        draft.ids.extend(extra)


def _last(scores: list[float]) -> float:
    """A draft path's log-probability: its last running score (0 for the empty path)."""
    return scores[-1] if scores else 0.0


def _resize_vocab(probs: torch.Tensor, size: int) -> torch.Tensor:
    """Pad (with zeros) or cut the last dimension to `size` (draft and target embeddings may be padded differently)."""
    if probs.shape[-1] >= size:
        return probs[..., :size]
    return torch.nn.functional.pad(probs, (0, size - probs.shape[-1]))
