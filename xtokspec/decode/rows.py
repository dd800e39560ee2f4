"""Draft lengths for requests served together (xtokspec's vLLM proposer): per request and per step, how many
tokens to draft, none included, from measured costs and each request's measured acceptance.

Each step the policy chooses the lengths that maximise the committed tokens per second that a model of the step's
measured costs predicts at each request's acceptance rate (`stepcosts.StepCosts`: the rate, the slowest request's
pace where no request waits for a slot, the costs' fit and the bound that skips most costing). k = 0, no draft at
all, is one of the choices; where drafting is predicted less than `MARGIN` (5%) ahead of the target alone, within
what the model misses, drafting does not start (it goes on below it while it has just drafted, unless a request
must first read its text: that starts it). What the policy learns over the steps: below.

A request whose draft must first read text (a new request's prompt, or what it committed while it did not draft:
`Acceptance.unread`) pays that reading when it starts drafting, `StepCosts.read` seconds measured as the draft's other
costs are (from the first reading on, whatever its length: prompts' lengths rarely repeat), and the reading is worth
it over the steps the request will then draft. Those are not known ahead. A request can draft no longer than it
runs, and one that has committed n ids is taken to run about n more (its age; at 8 requests most of a batch's new
requests end within a few tokens, and reading them all at once cost 35-50 ms in one call, while those that have run
long run on: `b8-steps/steps_start.py`, BENCHMARKS.md "vLLM"); nor longer than drafting goes on paying, which the
runs of drafting steps that followed earlier readings measure (their mean over ~50 runs, ended by a new reading or
by the request leaving; runs the policy chose no step of, a cold start's or a probe's, left out: they drafted
because they were made to, and a policy that drew its runs' length from them would not start at all; before any run,
the age alone: a reading that drafting stopped after two or three steps was charged over a long life, and never
repaid: `b8-steps/output-why-real.txt`). So each step charges a request's reading over the lesser of the two
(`life`): it drafts only where the tokens its proposal is expected to add are worth its positions and that share of
the reading at the step's rate. A new request is read where one step repays it; where none would, it waits until it
has lived longer or a probe reads it.

Acceptance is learned per request from what vLLM accepted of its last proposal. A request starts from the rate pooled
over earlier requests' proposals made at its age (in bands of doubling length: 1, 2-3, 4-7, 8-15, ... committed ids; a
band leans on the rate pooled over all ages until it has its own evidence): how well a draft follows depends on where
in its text a request is, and a batch's new requests are accepted far less than the long answers that make most of the
proposals (at 4-8 requests on the fixtures, a rate pooled over all ages predicted 1.5-2x the tokens realized:
`b8-steps/output-why.txt`). Its own evidence is weighed against that prior by how far the rates of the requests served
have spread (`measures.Spread`, empirical Bayes): where requests are alike, a request accepted in its first few
proposals is still taken near the pool (on a prior worth two trials, requests chosen at a per-token rate of 0.43 at
T=0.7 were accepted at 0.26). A request that has not drafted for a while drifts back to its age's pooled rate (its own
evidence fades), so it is tried again. While nothing is drafted, one request in one step in `alone_run` drafts (a
probe, on `policy.Fallback`'s schedule: 2 steps, doubled after each probe that loses, up to 16, or more where a probe
costs more than 0.5% of the steps between probes; the request that has waited longest; and only while the probes so
far and one more, at the last one's cost, stay within 0.5% of the time served); while drafting pays, one step in
`Fallback.PROBE_ALONE_EVERY` drafts nothing, so that the target's cost without proposals stays measured.

Where nothing is chosen to draft at a size (by the model, its margin, or the measurement below), the choice is
costed again every `RECHECK` steps at that size, not at each: without proposals nothing it learns can change it
much, and costing it was most of a quiet call's time.
In the steps between (`quiet_ahead`) a caller need not even match its rows to requests (`skip`).

The model predicts; each batch size's steps also measure (`measures.Measured`): drafting steps' seconds, with
the proposer's call, against the target alone's measured step at that size plus the seconds the model predicted
the drafts would add (readings in full). Where drafting steps have taken longer than that (a cost the model misses:
a fit carried from other sizes, vLLM's own work per proposal), the model's predicted gain must exceed the miss
(`cost_miss`), and where it does not nothing is drafted at that size, the choice drafted again as a probe on the
schedule above. The measurement is of costs only: acceptance is each request's own, so a request the draft follows
poorly stops itself and leaves the next request's choice to that request's rate (compared in tokens per second,
the steps at one request turned one prompt's verdict against the next: BENCHMARKS.md, "vLLM"). A size where
drafting has run a few steps but the target alone has not is given target-alone steps first, so that the
comparison has both sides.

Like the loop's policies (policy.py) it decides from earlier steps only and cannot change the output: vLLM
verifies whatever is proposed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..types import expected_tokens
from .measures import UNMEASURED, Acceptance, Measured, Spread, outcome
from .policy import DECAY, WARM_CYCLES, Fallback
from .stepcosts import StepCosts


def age_band(age: int) -> int:
    """The band of a request's age in committed ids, in doublings: 1, 2-3, 4-7, 8-15, ..."""
    return max(1, age).bit_length()


class RowDraftLengths:
    """Each step: how many tokens each running request drafts (this module's docstring). One per proposer: the
    costs are the models' and the machine's, the pooled acceptance the pair's on the traffic served."""

    # a server runs for thousands of steps: probes may come more rarely than in one generation, at most 0.5% of
    # the time served (a probe of a new request first pays for its draft reading the request's text, so where
    # drafting rarely pays, probes are most of what the proposer costs: BENCHMARKS.md, "vLLM", T=0.7)
    PROBE_BUDGET = 0.005
    POOL_DECAY = 0.98  # per observed proposal: the pooled rate follows the traffic over ~50 proposals
    # drafting must be predicted to beat the target alone by this share before it starts: the model misses costs
    # of about that size (a proposal's bookkeeping in the calls after it), so a smaller predicted gain may be a
    # loss (BENCHMARKS.md, "vLLM", the T=0.7 runs)
    MARGIN = 0.05
    BAND_WEIGHT = 2.0  # an age band's pooled rate leans on the rate pooled over all ages by this many proposals
    # where nothing pays at a size, the choice is costed again after this many steps: a costing call matches every
    # row, a skipped one does not, and on a short target step the costing calls were most of the proposer's time
    # (BENCHMARKS.md, "vLLM", AVX512-BF16 EPYC)
    RECHECK = 8
    RUN_DECAY = 0.98  # per observed drafting run: their mean follows the traffic over ~50 runs

    def __init__(self, cap: int, adaptive: bool = True):
        self.cap, self.adaptive = cap, adaptive
        self.costs = StepCosts(cap)  # the measured costs, and the lengths that pay at given rates
        self.runs = self.run_steps = 0.0  # the drafting runs that followed a reading: decayed count and steps
        self.pool = Acceptance(1.0, 1.0)  # pooled over requests (a Beta(1, 1) prior)
        self.by_age: dict[int, Acceptance] = {}  # pooled over requests' proposals by their age (`age_band`)
        self.spread = Spread()  # how far requests' rates spread: the weight of a request's prior
        self.steps = 0  # steps whose time was measured
        self.since_draft = 0  # steps since the last one that drafted
        self.since_alone = 0  # drafting steps since the last one that drafted nothing
        self.alone_run = Fallback.PROBE_DRAFT_FIRST
        self.probing = False
        self.probes = 0
        self.elapsed = 0.0  # seconds served so far (steps and the proposer's calls)
        self.probe_spent = 0.0  # of those, what probes cost (their calls, and their steps' extra time)
        self.last_probe = 0.0  # what the last probe cost
        self.probed = False  # this call's lengths are a probe
        self.probed_before = False  # the last call's were
        # the measured arms by batch size (requests in a step): drafting as chosen against the target alone
        self.measured: dict[int, Measured] = {}
        self.added: float | None = None  # the seconds the model predicted the last lengths add to the step
        self.chose = "none"  # what the last lengths were: "drafting" (chosen, or a probe of the choice), "alone",
        # or neither ("cold", a one-request "probe", "none"), which the arms do not count
        self.last_call = 0.0  # the last call's seconds
        self.later: list[tuple] = []  # steps observed later (`observe_step_later`), with the call before each
        self.alone_seen = False  # a step without proposals has been measured
        self.quiet_size: tuple | None = None  # (rows, requests, full) where nothing was last chosen to draft
        self.quiet_left = 0  # steps at that size before it is costed again
        self.quiet_blocked = False  # there, the model chose drafting and only the measured cost miss stopped it

    # -------------------------------------------------------------------------------- what was measured
    def observe_step_later(self, rows: int, proposals: int, seconds: float, tokens: int | None = None) -> None:
        """`observe_step`, kept until the policy next chooses or observes (as it would have run now, with the call
        before it): a quiet step's caller returns at once. Costed right after a target's forward, a step is costed
        cache-cold; kept, the steps between two choices are costed together, most of them warm."""
        self.later.append((rows, proposals, seconds, tokens, self.last_call))

    def _observe_later(self) -> None:
        later, self.later = self.later, []
        for step in later:
            self._observe_step(*step)

    def observe_step(self, rows: int, proposals: int, seconds: float, tokens: int | None = None) -> None:
        """A step (no prefill in it) of `rows` requests that verified `proposals` took `seconds` and committed
        `tokens` (None: not known)."""
        if self.later:
            self._observe_later()
        self._observe_step(rows, proposals, seconds, tokens, self.last_call)

    def _observe_step(self, rows: int, proposals: int, seconds: float, tokens: int | None, call: float) -> None:
        """`observe_step`, `call` the proposer's call before the step (the arms count it with the step)."""
        if rows <= 0:
            return
        counted = self.costs.observe_step(rows, proposals, seconds)
        self.steps += 1
        # NOTE: the arms count the steps that ran what was chosen: drafting that proposed, the target alone; not
        # a size's first step, whose one-time costs LinearCosts holds back too
        if not counted:
            return
        if tokens is not None and (self.chose, proposals > 0) in (("drafting", True), ("alone", False)):
            self.measured.setdefault(rows, Measured()).observe(proposals > 0, tokens, seconds + call,
                                                               self.added if proposals else None)

    def startup(self, request: Acceptance) -> float:
        """What a request's next proposal costs before its draft forwards, per step it can expect to draft:
        reading its unread ids (where they are more than a drafting request reads each step, its accepted
        proposals and one more, read with its draft forwards), over its `life`."""
        if not self.costs.reads(request.unread):
            return 0.0
        return self.costs.read(request.unread) / self.life(request)

    def life(self, request: Acceptance) -> float:
        """The steps a request that reads now is expected to draft: its age in committed ids (one that has lived
        n steps is taken to live about n more: at 8 requests most of a batch's new requests end within a few
        tokens, while those that have lived long go on), and at most the mean run of drafting steps that followed
        the readings measured so far (drafting stops where it stops paying, and the reading is then spent)."""
        life = float(max(1, request.age))
        if self.runs > 0:
            life = min(life, max(1.0, self.run_steps / self.runs))
        return life

    def observe_run(self, steps: int) -> None:
        """A request drafted `steps` steps after its draft read its text, then stopped or left."""
        self.runs = self.RUN_DECAY * self.runs + 1.0
        self.run_steps = self.RUN_DECAY * self.run_steps + steps

    def forget(self, request: Acceptance) -> None:
        """A request has left (ended, aborted, or its state dropped): its drafting run, if any, has ended (and
        counts where the policy chose one of its steps); its acceptance joins the requests' spread (`Spread`)."""
        self._end_run(request)
        self.spread.observe(request.accepted, request.accepted + request.rejected)
        request.accepted = request.rejected = 0  # counted once

    def _end_run(self, request: Acceptance) -> None:
        """A request's drafting run has ended (it left, or its draft reads again after steps without drafting)."""
        if request.run > 0 and request.run_chosen:
            self.observe_run(request.run)
        request.run, request.run_chosen = 0, False

    def observe_time(self, rows: int, interval: float | None, call: float) -> None:
        """Where the time goes, for the probes' budget: `interval` since the last call (the step; None: unknown),
        of `rows` requests, then this `call`'s own seconds. A probe is charged its call and its step's time beyond
        a step without proposals."""
        if interval is not None:
            self.elapsed += interval
            if self.probed_before:  # the step verified the last call's probe
                extra = max(0.0, interval - self.costs.step(rows, 0))
                self.probe_spent += extra
                self.last_probe += extra
        self.elapsed += call
        self.last_call = call
        if self.probed:
            self.probe_spent += call
            self.last_probe = call
        self.probed_before = self.probed

    def observe_proposal(self, request: Acceptance, proposed: Sequence[int], new: Sequence[int]) -> int:
        """A request's last proposal against the ids vLLM committed for it next -> the proposals accepted."""
        if not proposed or not new:
            return 0
        accepted, rejected = outcome(proposed, new)
        request.observe(accepted, rejected)
        self.pool.observe(accepted, rejected, self.POOL_DECAY)
        # the request's age when it proposed: its ids now less those committed since
        band = self.by_age.setdefault(age_band(request.age - len(new)), Acceptance())
        band.observe(accepted, rejected, self.POOL_DECAY)
        return accepted

    def quiet_ahead(self) -> bool:
        """The next step, at the size of the last one, drafts nothing and probes nothing whatever its requests'
        rates: nothing was chosen to draft at this size and it is not due to be costed again (RECHECK), no probe
        is due. Its caller may leave that step's requests unmatched (`skip`): nothing it would learn there
        changes a choice before the size is costed again."""
        return (self.adaptive and self.chose == "alone" and self.quiet_size is not None and self.quiet_left > 0
                and not self.probing and not self._probe_due())

    def skip(self, requests: Sequence[Acceptance]) -> None:
        """A step its caller left unmatched where `quiet_ahead` held: the quiet step `lengths` would have
        chosen, its requests (those of the last step) aged as there."""
        self.quiet_left -= 1
        self._alone(len(requests), requests)

    # -------------------------------------------------------------------------------- the choice
    def rates(self, requests: Sequence[Acceptance]) -> list[float]:
        """Each request's per-token acceptance: its own evidence, and for a prior the rate pooled over earlier
        requests' proposals at its age (this module's docstring)."""
        pooled = self.pool.rate(0.5, 0.0)
        priors = {}
        for band, seen in self.by_age.items():
            priors[band] = seen.rate(pooled, self.BAND_WEIGHT)
        weight = self.spread.weight()
        return [min(r.rate(priors.get(age_band(r.age), pooled), weight), 0.999) for r in requests]

    def lengths(self, requests: Sequence[Acceptance], rows: int, ways: tuple[str, ...] = ("batched",),
                full: bool = True) -> list[int]:
        """K_i for each request that may draft (`requests`; `rows`: all requests in the next step, those that
        may not draft included): 0..cap each, each step's cost with the cheaper of the drafting `ways`. `full`:
        the batch is at the server's limit, so requests may be waiting for a slot (the step's committed tokens per
        second are chosen); else the slowest request's (this module's docstring)."""
        if self.later:
            self._observe_later()
        n = len(requests)
        self.probed, self.chose, self.added = False, "none", None
        if not self.adaptive or not n:
            return [self.cap] * n
        if self.steps < WARM_CYCLES or self.costs.drafted < WARM_CYCLES:  # cold: one request drafts one id
            return self._drafting(self._cold(requests), requests, "cold")
        rows = max(rows, n)
        if not self.alone_seen:
            self.alone_seen = self.costs.alone_measured()
        if not self.alone_seen or self.since_alone >= Fallback.PROBE_ALONE_EVERY:
            return self._alone(n, requests)  # the target's step without proposals is measured too
        # NOTE: where the model chose no drafting at this size, nothing it learns from the steps that follow
        # (no proposal: no acceptance; the target's cost at a size it has measured) can change that choice much:
        # it is costed again every RECHECK steps, not at each (a quiet call's largest part, BENCHMARKS.md, "vLLM")
        quiet = (rows, n, full)
        if self.quiet_size == quiet and self.quiet_left > 0 and not self.probing \
                and not (self.quiet_blocked and self._probe_due()):
            self.quiet_left -= 1
            return self._nothing_pays(n, requests)
        a = self.rates(requests)
        base = self.costs.step(rows, 0)
        alone = rows / max(base, 1e-9)
        best, best_rate, best_cost = [0] * n, alone, base
        slowest = not full and rows > 1  # one request: its rate is the step's
        # NOTE: most of the rest where drafting does not pay ends here, before the choices are costed one by one
        # (the bound holds whatever the readings cost: they only add)
        pays = self.costs.may_pay(a, rows, base, ways, slowest)
        start = [self.startup(r) for r in requests] if pays else []
        for k in range(1, self.cap + 1) if pays else ():
            lengths, rate, cost = self.costs.slowest_at(k, a, rows, base, ways, start) if slowest else \
                self.costs.best_at(k, a, rows, base, best_rate, ways, start)
            if rate > best_rate:
                best, best_rate, best_cost = lengths, rate, cost
        if not self.costs.read_measured():
            best = self._one_reading(best, requests)
        # NOTE: the margin to start drafting, not to go on: a request whose estimate wavers near it would stop and
        # start again, its evidence fading in between. A choice in which a request must first read its text starts
        # that request: its reading is paid in full at once, where the model charges a share a step, and the
        # largest misses measured were there (a batch's new requests at 4-8 requests: b8-steps/output-why*.txt)
        reads = any(x and si > 0 for x, si in zip(best, start, strict=False))
        margin = 0.0 if self.since_draft == 0 and not reads else self.MARGIN
        self.quiet_size = None
        blocked = None  # the lengths chosen, where drafting them has measured slower than the target alone
        if any(best) and best_rate >= (1 + margin) * alone:
            measured = self.measured.get(rows, UNMEASURED)
            if measured.alone_wanted():
                return self._alone(n, requests)  # the target alone measured at this size too
            # what the lengths add to the step as the step pays it: readings in full, not the share a step
            self.added = best_cost - base + sum(
                (self.costs.read(r.unread) if self.costs.reads(r.unread) else 0.0) - si
                for r, si, x in zip(requests, start, best, strict=True) if x)
            if best_rate >= (1 + margin) * alone * measured.cost_miss():
                if self.probing:
                    self.probing = False
                    self.alone_run = Fallback.PROBE_DRAFT_FIRST
                return self._drafting(best, requests)
            # NOTE: the model says drafting pays, the steps at this size say that it misses a cost here (a fit
            # carried from other sizes; vLLM's own work per proposal) by more than the gain: the measurement wins
            blocked = best
        # nothing pays: the target alone, but a probe drafts once every alone_run steps
        # NOTE: whatever stopped drafting here (the model, its margin, the measurement), the steps that follow at
        # this size change little until a probe: costed again after RECHECK steps, or where a probe of the lengths
        # the measurement blocked is due (so that the probe drafts them, fresh)
        self.quiet_size, self.quiet_left, self.quiet_blocked = quiet, self.RECHECK - 1, blocked is not None
        if self.probing:  # the probe was measured and lost
            self.probing = False
            self.alone_run = min(2 * self.alone_run, self._probe_cap(a, rows, base, blocked))
        return self._nothing_pays(n, requests, blocked)

    @staticmethod
    def _cold(requests: Sequence[Acceptance]) -> list[int]:
        """The cold start's lengths: one id for the request with the fewest ids left to read (after its first
        reading, the same request), none for the others. What the policy needs first is measured so, a step's
        cost with a proposal, a draft forward's, a reading's; a batched draft's is measured where one is first
        chosen. Were every request to draft, each would first read its text, a new request its prompt: a server
        started under a batch of requests would read them all in its first steps (`_one_reading`)."""
        first = min(range(len(requests)), key=lambda i: requests[i].unread)
        return [1 if i == first else 0 for i in range(len(requests))]

    def _one_reading(self, lengths: list[int], requests: Sequence[Acceptance]) -> list[int]:
        """`lengths` with at most one request that must first read its text, the one with the least to read, while
        no reading has been measured: an unmeasured cost counts as none (optimism: tried, then measured), and on
        that belief a fresh server's first batch of 8 read every prompt at once, 0.82x the target alone with
        SmolLM2-135M for the real target (BENCHMARKS.md, "vLLM")."""
        readers = [i for i, (x, r) in enumerate(zip(lengths, requests, strict=True)) if x and self.costs.reads(r.unread)]
        keep = min(readers, key=lambda i: requests[i].unread, default=None)
        return [0 if i in readers and i != keep else x for i, x in enumerate(lengths)]

    def _nothing_pays(self, n: int, requests: Sequence[Acceptance], blocked: list[int] | None = None) -> list[int]:
        """The target alone, or a probe where one is due (`blocked`: the lengths chosen where only the measurement
        stopped them, which the probe drafts)."""
        # a probe, where the probes so far and one more (costing what the last one did) stay within PROBE_BUDGET
        # of the time served: the lengths chosen where only the measurement stops them, else the request that has
        # waited longest drafts, alone (a probe may have to read its request's text first, which a step's count
        # misses: a second-long probe with a slow draft then waits for a hundred seconds served)
        if self._probe_due():
            self.probing, self.probes, self.probed = True, self.probes + 1, True
            if blocked is not None:
                return self._drafting(blocked, requests)
            probe = max(range(n), key=lambda i: requests[i].idle)
            return self._drafting([self.cap if i == probe else 0 for i in range(n)], requests, "probe")
        self.added = None  # the lengths the measurement blocked, if any, are not drafted
        return self._alone(n, requests)

    def _probe_due(self) -> bool:
        """A probe's turn has come (`alone_run` steps without drafting) and the budget allows one more."""
        return self.since_draft >= self.alone_run and \
            self.probe_spent + self.last_probe <= self.PROBE_BUDGET * self.elapsed

    def _probe_cap(self, a: list[float], rows: int, base: float, blocked: list[int] | None = None) -> int:
        """The longest run of steps without drafting between probes: PROBE_DRAFT_MAX, or more where a probe's
        extra seconds (its cost minus what the target alone takes for the tokens it commits; measured where the
        measurement stopped drafting, else predicted for one request drafting) exceed PROBE_BUDGET of the steps
        between probes; at most Fallback.PROBE_DRAFT_CAP."""
        measured = self.measured.get(rows)
        if blocked is not None and measured is not None:
            extra = measured.drafting.extra(measured.per_token_alone(rows))
        else:
            best = max(range(len(a)), key=a.__getitem__)
            cost = self.costs.step(rows, self.cap) + self.costs.forward(1, self.cap, self.cap)[0]
            tokens = rows - 1 + expected_tokens(a[best], self.cap)
            extra = cost - base * tokens / rows
        need = math.ceil(round(extra / (self.PROBE_BUDGET * max(base, 1e-9)), 6))
        return max(Fallback.PROBE_DRAFT_MAX, min(need, Fallback.PROBE_DRAFT_CAP))

    def _drafting(self, lengths: list[int], requests: Sequence[Acceptance], chose: str = "drafting") -> list[int]:
        self.chose = chose
        self.quiet_size = None  # a proposal: what its answer teaches may change the choice
        self.since_draft = 0
        self.since_alone += 1
        for length, request in zip(lengths, requests, strict=True):
            if length:
                # a reading after steps without drafting ends the run that followed the last one (a new request's
                # reading, or a long text read a chunk a step, goes on with its run)
                if self.costs.reads(request.unread) and request.idle > 0 and request.run > 0:
                    self._end_run(request)
                request.run += 1
                request.run_chosen = request.run_chosen or (chose == "drafting" and not self.probed)
            self._age(request, length)
        return lengths

    def _alone(self, n: int, requests: Sequence[Acceptance]) -> list[int]:
        self.chose = "alone"
        self.since_draft += 1
        self.since_alone = 0
        for request in requests:
            self._age(request, 0)
        return [0] * n

    @staticmethod
    def _age(request: Acceptance, length: int) -> None:
        """A request that does not draft forgets its own evidence by DECAY a step: it drifts back to its age's pooled
        rate and is tried again when that pays."""
        if length == 0:
            request.successes *= DECAY
            request.failures *= DECAY
            request.idle += 1
