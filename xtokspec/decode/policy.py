"""Decisions from measurements: how many tokens to draft, how many tree nodes to verify, whether to draft at all,
and which proposal kind a sampled chain across tokenizers uses.

Each policy learns from one `CycleRecord` per cycle (`observe`) with exponential forgetting, and decides before
the next cycle from earlier cycles only. None of them can change the output: every cycle is verified exactly for
what it proposed, so a decision costs speed at worst.
"""

from __future__ import annotations

import collections
import itertools
import math
import statistics
from dataclasses import dataclass

from ..types import CycleRecord, SpecConfig, expected_tokens

DECAY = 0.9  # the weight an earlier cycle keeps per later cycle
WARM_CYCLES = 3  # measured cycles before a policy departs from the configured setting


class VerifyCost:
    """Verification seconds for m proposals (nodes): a least-squares line over recent drafted cycles, with
    exponential forgetting. Its slope is 0 until the counts have spread (a variance of at least one proposal
    squared: a steeper line from nearly equal counts is noise), and at most the one through the origin (no
    negative fixed cost)."""

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        self.sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # decayed sums: n, m, m^2, t, m*t  (m = nodes, t = verify seconds)

    def observe(self, nodes: int, seconds: float) -> None:
        m = float(nodes)
        for i, v in enumerate((1.0, m, m * m, seconds, m * seconds)):
            self.sums[i] = self.decay * self.sums[i] + v

    def __call__(self, m: float) -> float:
        n, sm, smm, st, smt = self.sums
        if n <= 0:
            return 0.0
        mean_m, mean_t = sm / n, st / n
        var = smm / n - mean_m**2
        slope = max(0.0, (smt / n - mean_m * mean_t) / var) if var >= 1.0 else 0.0
        slope = min(slope, mean_t / mean_m) if mean_m > 0 else slope
        return mean_t + slope * (m - mean_m)


class DraftLength:
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

    def __init__(self, config: SpecConfig, verify_cost: VerifyCost | None = None, decay: float = DECAY):
        self.config, self.decay = config, decay
        self.k = config.num_draft_tokens
        self.tree = config.tree_width > 1
        self.verify_cost = VerifyCost(decay) if verify_cost is None else verify_cost
        self.successes, self.failures = 1.0, 1.0  # acceptance evidence (a Beta(1, 1) prior)
        self.first_successes, self.first_failures = 1.0, 1.0  # a tree's first level (Beta(1, 1) prior)
        self.draft_step = None  # seconds per draft forward
        self.proposals_per_draft = 1.0  # depth (proposals in a row) per draft step
        self.nodes_per_draft = 1.0  # tokens verified per draft step
        self.cycles = 0

    def observe(self, cycle: CycleRecord) -> None:
        """A drafted cycle's acceptance and costs; a prefilling cycle's verification time is not a proposal's."""
        if cycle.alone:
            return
        d, accepted = self.decay, cycle.accepted
        self.cycles += 1
        if self.tree:  # the first level apart; `successes`/`failures` count the levels below it
            self.first_successes = d * self.first_successes + (accepted >= 1)
            self.first_failures = d * self.first_failures + (accepted == 0 and cycle.rejected)
            self.successes = d * self.successes + max(0, accepted - 1)
            self.failures = d * self.failures + (1.0 if accepted >= 1 and cycle.rejected else 0.0)
        else:
            self.successes = d * self.successes + accepted
            self.failures = d * self.failures + (1.0 if cycle.rejected else 0.0)
        if cycle.draft_steps and not cycle.prefill:  # NOTE: a prefill's draft seconds are its whole context's
            step = cycle.draft_s / cycle.draft_steps
            self.draft_step = step if self.draft_step is None else d * self.draft_step + (1 - d) * step
            self.proposals_per_draft = d * self.proposals_per_draft + (1 - d) * cycle.depth / cycle.draft_steps
            self.nodes_per_draft = d * self.nodes_per_draft + (1 - d) * cycle.nodes / cycle.draft_steps
        if not cycle.prefill:
            self.verify_cost.observe(cycle.nodes, cycle.verify_s)

    def next_k(self) -> int:
        if not self.config.adaptive or self.cycles < WARM_CYCLES or self.draft_step is None:
            return self.k
        a = min(self.successes / (self.successes + self.failures), 0.999)
        a1 = min(self.first_successes / (self.first_successes + self.first_failures), 0.999)
        best, best_rate = 1, 0.0
        for k in range(1, self.config.max_draft_tokens + 1):
            depth, nodes = self.proposals_per_draft * k, self.nodes_per_draft * k
            tokens = 1 + a1 * expected_tokens(a, depth - 1) if self.tree else expected_tokens(a, depth)
            rate = tokens / (k * self.draft_step + max(self.verify_cost(nodes), 1e-6))
            if rate > best_rate:
                best, best_rate = k, rate
        self.k = best
        return best


class TreeBudget:
    """How many of a drafted trie's nodes to verify (SpecConfig.prune_tree, with adaptive)."""

    SIZE_SAMPLES = 8  # recent verification times kept per captured trie size

    def __init__(self, config: SpecConfig, verify_cost: VerifyCost, size_times: dict | None = None,
                 decay: float = DECAY):
        self.config, self.decay, self.verify_cost = config, decay, verify_cost
        self.cycles = 0
        self.predicted, self.realised = 1.0, 1.0  # node values vs accepted nodes (decayed sums)
        # captured tree verification: nodes a bucket carries -> its recent verification seconds (shared between
        # the generations of one XTokSpec: the costs are the models' and the device's, not the prompt's)
        self.size_times = {} if size_times is None else size_times

    def observe(self, cycle: CycleRecord) -> None:
        """A tree cycle's verified node values against the nodes it accepted, and a captured size's time."""
        if cycle.alone:
            return
        self.cycles += 1
        if cycle.predicted is not None:
            self.predicted = self.decay * self.predicted + cycle.predicted
            self.realised = self.decay * self.realised + cycle.accepted
        if not cycle.prefill and cycle.size is not None:
            times = self.size_times.setdefault(cycle.size, collections.deque(maxlen=self.SIZE_SAMPLES))
            times.append(cycle.verify_s)

    def nodes(self, values: list[float], spent_s: float, room=None) -> int:
        """How many nodes to verify, given their values largest first and the seconds this cycle has already
        spent: the n that maximises expected tokens per second, (1 + r * (v_1 + ... + v_n)) / (spent +
        verify(n)), with r the measured ratio of accepted nodes to predicted ones (draft probabilities are not
        acceptance chances; a weak draft is over-confident). All of them until costs are measured, and with
        adaptive=False or prune_tree=False.

        `room` (a compiled target's `ModelState.tree_room`): the verification runs padded to a bucket, so its
        cost is a step per bucket, not a line in n, and a bucket carries room(n) nodes for the price of n. Then
        each size the trie can be verified at is costed at the fastest of its recent verifications (a first
        call that compiled, or a slow moment of the host, does not stick), and a size seen fewer than twice is
        tried first, the largest first. A line fitted to captured cycles would keep every node for good: once
        the trie fills the largest bucket every cycle, the counts stop varying and the line has no slope."""
        if not (self.config.adaptive and self.config.prune_tree) or self.cycles < WARM_CYCLES or not values:
            return len(values)
        r = min(self.realised / self.predicted, 1.0 / max(max(values), 1e-6))  # a chance is at most 1
        if room is not None:
            return self._size(values, spent_s, r, room)
        best, best_rate, total = 1, 0.0, 0.0
        for n, v in enumerate(values, start=1):
            total += v
            rate = (1 + r * total) / (spent_s + max(self.verify_cost(n), 1e-6))
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def _size(self, values: list[float], spent_s: float, r: float, room) -> int:
        sizes = sorted({room(n) for n in range(1, len(values) + 1)})
        costs = {size: min(self.size_times[size]) for size in sizes if len(self.size_times.get(size, ())) >= 2}
        unseen = [size for size in sizes if size not in costs]
        if unseen:
            return min(unseen[-1], len(values))
        prefix = list(itertools.accumulate(values))
        rates = {size: (1 + r * prefix[min(size, len(values)) - 1]) / (spent_s + max(costs[size], 1e-6))
                 for size in sizes}
        return min(max(sizes, key=rates.__getitem__), len(values))


@dataclass
class DraftingCost:
    """What drafting has cost per committed token (decayed sums over measured drafted cycles) for one setting of
    one XTokSpec, and the fallback's probing schedule. Shared by the generations with that setting, so that a
    generation after the first starts from what the earlier ones measured (the costs are the models' and the
    device's; the acceptance is the pair's, on similar text)."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0  # the decayed count of cycles in the sums
    cycles: int = 0
    alone_run: int = 2  # target-alone cycles before the next drafted probe (Fallback.PROBE_DRAFT_FIRST)
    # the draft and bridge seconds of the last drafted cycle that fed the draft its whole context (a generation's
    # first drafted cycle: the draft's prefill of its window of the prompt)
    prefill_seconds: float = 0.0

    def add(self, tokens: float, seconds: float, decay: float = DECAY) -> None:
        """One more measured drafted cycle (or step): its committed tokens and seconds, earlier ones decayed."""
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.weight = decay * self.weight + 1.0
        self.cycles += 1

    def extra(self, alone: float) -> float:
        """Seconds a drafted cycle costs beyond what the target alone takes for the tokens it commits, on the
        decayed average; `alone`: the target alone's seconds per token."""
        return (self.seconds - alone * self.tokens) / max(self.weight, 1e-9)

    def loses_to(self, alone: float) -> bool:
        """Drafting has cost more per committed token than the target alone's `alone` seconds per token."""
        return alone * self.tokens < self.seconds


class Fallback:
    """Whether the next cycle runs the target alone (SpecConfig.fallback, with adaptive).

    A two-armed choice by measured seconds per committed token. A drafted cycle's seconds are all of it (draft,
    bridge, verification, commit) over the tokens it commits; the target alone commits one token per cycle."""

    ALONE_SAMPLES = 8  # recent target-alone cycle times kept
    PROBE_ALONE_EVERY = 64  # drafted cycles between two target-alone cycles while drafting pays
    # target-alone cycles between two drafted ones while drafting does not pay: 2 at first, doubled after each
    # drafted probe that loses too (a choice made on a few early cycles is soon tested again), up to 16, or up
    # to as many as keep a probe's extra seconds within PROBE_BUDGET of the target-alone time between probes
    # (where a drafted cycle costs several steps more than it commits), at most PROBE_DRAFT_CAP
    PROBE_DRAFT_FIRST, PROBE_DRAFT_MAX, PROBE_DRAFT_CAP = 2, 16, 256
    PROBE_BUDGET = 0.05

    def __init__(self, config: SpecConfig, alone_times: collections.deque | None = None,
                 drafting: DraftingCost | None = None, decay: float = DECAY, first_alone: bool = True):
        self.enabled = config.adaptive and config.fallback
        # the first cycle runs the target alone: the first token then costs the target's prefill only, and the
        # draft prefills its prompt in the next cycle (catching up), not before the first token
        self.first_alone = first_alone and self.enabled
        self.decay = decay
        # the target alone's recent cycle times, shared by the generations of one XTokSpec (a step costs what
        # the model and device make it)
        self.alone_times = collections.deque(maxlen=self.ALONE_SAMPLES) if alone_times is None else alone_times
        self.drafting = DraftingCost(alone_run=self.PROBE_DRAFT_FIRST) if drafting is None else drafting
        self.since_draft = 0  # target-alone cycles since the last drafted one
        self.since_alone = 0  # drafted cycles since the last target-alone one
        self.probing = False  # the last drafted cycle was a probe
        self.draft_fed = False  # a drafted cycle of this generation has fed the draft its context

    def observe(self, cycle: CycleRecord) -> None:
        """One cycle's committed tokens and seconds, from start to commit (not a prefilling one: its time is the
        prompt's)."""
        if cycle.prefill:
            if not cycle.alone:
                self.drafting.prefill_seconds = cycle.draft_s + cycle.bridge_s
                self.draft_fed = True
            return
        self.draft_fed = self.draft_fed or not cycle.alone
        if cycle.alone:
            self.alone_times.append(cycle.verify_s)
            self.since_draft += 1
            self.since_alone = 0
            return
        self.drafting.add(cycle.committed, cycle.draft_s + cycle.bridge_s + cycle.verify_s, self.decay)
        self.since_draft = 0
        self.since_alone += 1

    def run_alone(self) -> bool:
        """The first cycle (the prompt's) runs the target alone. Then drafting goes first: after 3 measured
        drafted cycles, one target-alone cycle measures a target step if none is known yet, and again after every
        PROBE_ALONE_EVERY drafted cycles. Then the cheaper arm runs, except that a run of target-alone cycles
        gives way to one drafted cycle (a probe, so that drafting is measured again as the text and its
        acceptance change) after `alone_run` of them: PROBE_DRAFT_FIRST, doubled after each probe that leaves the
        target alone cheaper, up to `_probe_cap()`, and back to the first once drafting wins. The drafting costs
        and the schedule carry over between generations with the same settings (DraftingCost): a later
        generation may start with the target alone. Its first probe would also feed the draft its context (a
        prefill that can cost more than the whole generation where the draft is no cheaper than the target): that
        probe waits until the target-alone time since the last drafted cycle is 1 / PROBE_BUDGET times the last
        measured such prefill."""
        cost = self.drafting
        if self.first_alone:
            self.first_alone = False
            return True
        if not self.enabled or cost.cycles < WARM_CYCLES:
            return False
        if not self.alone_times or self.since_alone >= self.PROBE_ALONE_EVERY:
            return True
        step = statistics.median(self.alone_times)
        if 0 < self.since_draft and self.since_draft >= cost.alone_run and (
                self.draft_fed or cost.prefill_seconds <= self.PROBE_BUDGET * step * self.since_draft):
            self.probing = True
            return False
        alone = cost.loses_to(step)
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
        extra = self.drafting.extra(step)
        need = math.ceil(round(extra / (self.PROBE_BUDGET * max(step, 1e-9)), 6))  # NOTE: 20.000000004 is 20
        return max(self.PROBE_DRAFT_MAX, min(need, self.PROBE_DRAFT_CAP))


class TargetAlone:
    """A fallback policy that runs the target alone at every cycle (XTokSpec.generate(..., alone=True))."""

    def observe(self, cycle: CycleRecord) -> None:
        """Nothing to learn."""

    def run_alone(self) -> bool:
        return True


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

    def __init__(self, start: str, decay: float = DECAY, margin: float = 0.02, estimates: dict | None = None):
        self.kind = start
        self.estimates = {} if estimates is None else estimates  # the scores after each update (a stats' dict)
        self.decay, self.margin = decay, margin
        self.first = dict.fromkeys(self.KINDS, 0.0)  # decayed sums of a0 estimates
        self.weight = 0.0
        self.accepted = dict.fromkeys(self.KINDS, self.PRIOR_DEPTH * self.PRIOR_WEIGHT)  # per kind: tokens
        self.reached = dict.fromkeys(self.KINDS, self.PRIOR_WEIGHT)  # ... over cycles whose first was accepted

    def observe(self, cycle: CycleRecord) -> None:
        """A verified cycle's first-position chances (a cycle without them, e.g. healed or target-alone, teaches
        nothing)."""
        if cycle.first_chances is not None:
            self.update(*cycle.first_chances, cycle.accepted)
            self.estimates.update(self.scores())

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
