"""What a server's step costs, measured, and which draft lengths pay at given acceptance rates: the cost model of
the draft lengths of requests served together (`rows.RowDraftLengths`, which learns the rates and chooses when).

A server's step verifies every running request at once. Its time is the target's forward over all scheduled
positions (each request's next token plus its proposals), after the draft's forwards, batched over the requests
that draft (one forward per drafted position). With per-token acceptance a_i, K_i proposals commit
`expected_tokens(a_i, K_i)` tokens on average for request i, and the step commits the sum. The lengths chosen are
the K_i that maximise committed tokens per second:

    rate = sum_i expected_tokens(a_i, K_i) / (target(B, sum_i K_i) + k * draft(m) + readings)

with B the requests in the step, m the requests that draft, k = max K_i, target(B, p) the measured seconds of a
step of B requests that verified p proposals, draft(m) the measured seconds per draft forward over m requests
(all that a call that drafts costs beyond one that does not: drafting, bridging, readying the requests' caches),
and each drafting request's share of its draft's reading of its text (`rows`: `startup`). Where the requests may
also draft one at a time (each its own forwards, as captured CUDA graphs replay them), the step costs the cheaper
of k * draft(m) and sum_i K_i * alone(m), alone(m) the measured seconds of one request's forward while m draft
so; the proposer drafts that way. A step's cost has a slope per request and one per proposal: a server's costs
per request (scheduling, sampling, the output) and per proposal differ, and a step of 8 requests is not one of 2
requests with 6 proposals. For each k, request i drafts the most j <= k tokens whose last one is worth its target
position at the step's rate: a_i^j * rate >= the target's seconds per extra position. k = 0, no draft at all, is
one of the choices: where extra positions cost more than they return (a large batch, a poor draft), nothing is
drafted.

That rate is a full server's: while requests wait for a slot, a request that ends sooner lets the next one in.
Where no request waits (below the server's limit of running requests, vLLM's `max_num_seqs`, where the scheduler
would have admitted it; or at the limit where a request that left was not replaced at the next step, as when a
batch arrived together: `vllm.requests.Queue`) a request that ends sooner frees a slot nobody takes: the requests
running end when the slowest of them does, and a step's fixed cost, most of it at a few requests, is paid until
then. Drafting for some requests only then ends them apart and leaves steps of one or two requests at the end,
where the target alone would have run them together (BENCHMARKS.md, "vLLM", batch 8). So there the pace of the
slowest request is chosen instead, `rows * min_i expected_tokens(a_i, K_i)` per second (`slowest_at`): every
request drafts or none does, the one accepted least drafts k and each other the fewest ids that keep its pace,
and drafting is chosen only where it makes every request faster than the target alone would (no request is
slowed by another's drafts). With one request both rates are the same.

The costs are kept as recent samples per size (requests and proposals in a step; requests in a draft forward)
and fitted as a plane (a line) through the sizes' medians, each weighted by its samples (`measures.LinearCosts`):
a server's steps come at many sizes with few samples each, noisy one by one, and samples kept per size keep a
slope measured however long the sizes then stop varying (exponential forgetting would lose it). A step with
proposals is kept as what it took beyond the steps without proposals at its size just before it (their recent
median), and target(B, p) is the line of those steps plus the plane of what proposals added: the machine's speed
drifts by a fifth over minutes, and steps of different sizes measured minutes apart set a step without proposals
above one with three, which priced extra positions at nothing and drafted at 0.16-0.3 per-token acceptance (the
fixture pair at T=0.7, where vLLM's speculative path costs any step with a proposal 1-3 ms of a 17-21-ms step: the
plane's intercept holds that; `benchmarks/results/epyc-avx2/vllm-adaptive/fixtures-t07-excess/`). A slope the sizes
seen cannot show is taken as 0 (optimism: drafting is tried, then measured), but a batched draft forward not yet
measured costs what one request's forward measured: a batch costs no less than one of its rows, and taken as free
it had a fresh engine's first batch of requests draft, each first reading its prompt, at any rate. Most calls
where drafting does not pay end at a bound (`may_pay`), before any lengths are costed.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..types import expected_tokens
from .measures import LinearCosts


class StepCosts:
    """A server step's measured costs (the target's, the proposer's calls, the draft's forwards and readings) and
    the lengths that pay at given per-token acceptance rates (this module's docstring). The rates and the
    readings' charges are the caller's."""

    QUIET_SAMPLES = 32  # recent steps without proposals kept per size

    def __init__(self, cap: int):
        self.cap = cap
        # a step without proposals, by requests; its recent median is the level proposals are priced against
        # (`observe_step`), so more samples than a size of rarer steps keeps: they are most steps (32 stay recent),
        # and a median of 8 moved with a few slow steps among them and underpriced proposals (BENCHMARKS.md,
        # "vLLM", the T=0.7 runs)
        self.target = LinearCosts(1, samples=self.QUIET_SAMPLES)
        # a step's seconds beyond the steps without proposals at its size as they ran just before it (`observe_step`),
        # by (requests, proposals verified)
        self.extra = LinearCosts(2)
        self.quiet = LinearCosts(1)  # a call that drafted nothing, by requests in it
        self.draft = LinearCosts(1)  # a batched draft forward beyond a quiet call, by requests drafting in it
        # a request's own draft forward (eager, or its captured steps) beyond a quiet call, by requests drafting so
        self.draft_alone = LinearCosts(1)
        # a request's draft reading the ids it has not read, by those ids: prompts' lengths rarely repeat
        self.read = LinearCosts(1, each_size=False)
        self.drafted = 0  # drafting calls whose cost was measured

    def observe_step(self, rows: int, proposals: int, seconds: float) -> bool:
        """A step (no prefill in it) of `rows` requests that verified `proposals` took `seconds` -> whether it
        counts (a size's first step is held back: `LinearCosts`). A step with proposals counts as its seconds
        beyond the recent steps without (`quiet_level`); before any of those, not at all."""
        if not proposals:
            return self.target.observe((rows,), seconds)
        level = self.quiet_level(rows)
        if level is None:
            return False
        # NOTE: no proposal adds nothing: one sample there, so that until two counts of proposals are measured at a
        # size the line runs through it (what one count added is then a cost per id, not a fixed one: taken as
        # fixed, two ids measured priced one id as dear and kept a server from drafting it), and then pulls little
        self.extra.anchor((rows, 0), 0.0)
        return self.extra.observe((rows, proposals), seconds - level)

    def quiet_level(self, rows: int) -> float | None:
        """What a step without proposals of `rows` requests costs now: the median of the recent ones at that size
        (they are most steps: recent, they carry the machine's present speed), else the line through the sizes
        measured; None before any."""
        point = self.target.points.get((rows,))
        if point is not None:
            return point[1]
        return self.target(rows) if self.target.times else None

    def alone_measured(self) -> bool:
        """Whether a step without proposals has been measured."""
        return bool(self.target.times)

    def observe_call(self, rows: int, drafting: int, forwards: int, seconds: float, batched: bool = True) -> None:
        """A proposer's call over `rows` requests, `drafting` of them drafting in `forwards` draft forwards
        (`batched`: forwards over all of them at once; else each request's own), took `seconds` (no prefill in
        it)."""
        if not drafting or not forwards:
            self.quiet.observe((rows,), seconds)
            return
        costs = self.draft if batched and drafting > 1 else self.draft_alone
        costs.observe((drafting,), max(0.0, seconds - self.quiet(rows)) / forwards)
        self.drafted += 1

    def observe_read(self, ids: int, seconds: float) -> None:
        """A request's draft read `ids` target ids it had not read (built from them, or caught up) in `seconds`."""
        if self.reads(ids):
            self.read.observe((ids,), seconds)

    def read_measured(self) -> bool:
        """Whether a reading's cost has been measured (the first of all is held back: `LinearCosts`)."""
        return bool(self.read.times)

    def reads(self, ids: int) -> bool:
        """Whether `ids` unread ids are a reading of their own: more than a drafting request reads each step (its
        accepted proposals and one more, read with its draft forwards)."""
        return ids > self.cap + 1

    def step(self, rows: int, proposals: int) -> float:
        """target_B(p): a step's seconds: the line fitted to the steps without proposals, and for p > 0 the plane
        fitted to what proposals added to them (its intercept: what any proposal costs a step, vLLM's speculative
        path)."""
        return self.target(rows) + (self.extra(rows, proposals) if proposals else 0.0)

    def batched(self, drafting: int) -> float:
        """A batched draft forward's seconds over `drafting` requests: as measured, and before any batched forward
        is, one request's own forward (a batch costs no less than one of its rows). Taken as free instead, a fresh
        engine's first batch of 8 requests drafted at a per-token rate of 0.2 and each request's draft read its
        prompt first (SmolLM2-135M for the real target: 0.79-0.82x the target alone,
        `benchmarks/results/epyc-avx2/vllm-adaptive/cold-start/`)."""
        return self.draft(drafting) if self.draft.times else self.draft_alone(1)

    def forward(self, drafting: int, k: int, ids: int, ways: tuple[str, ...] = ("batched",)) -> tuple[float, str]:
        """The draft's seconds beyond a quiet call when `drafting` requests draft `ids` ids, at most k each, and
        the cheaper of `ways`: "batched" (k forwards over all of them at once) or "alone" (each request's own
        forwards, `ids` in all). One request drafts alone. A way not measured yet costs 0 (optimism: it is
        tried, then measured), except a batched forward where a lone one is measured (`batched`)."""
        if drafting <= 1 or "batched" not in ways:
            return ids * self.draft_alone(max(drafting, 1)), "alone"
        batched = k * self.batched(drafting)
        if "alone" not in ways:
            return batched, "batched"
        alone = ids * self.draft_alone(drafting)
        return (alone, "alone") if alone < batched else (batched, "batched")

    def way(self, lengths: Sequence[int], ways: tuple[str, ...]) -> str:
        """How the chosen `lengths` are drafted this step: the cheaper of `ways` (`forward`)."""
        return self.forward(sum(x > 0 for x in lengths), max(lengths, default=0), sum(lengths), ways)[1]

    def best_at(self, k: int, a: list[float], rows: int, base: float, rate: float,
                 ways: tuple[str, ...], start: list[float]) -> tuple[list[int], float, float]:
        """The lengths at most k, each request's chosen at `rate` (tokens per second; `start`: each request's
        reading before it drafts) -> (lengths, their rate, their seconds); twice, the second time at the rate the
        first choice gives."""
        top = self.step(rows, k * len(a))
        slope = max(0.0, (top - base) / (k * len(a)))
        last = None
        for _ in range(2):
            lengths = [self.length(ai, k, rate, slope, si) for ai, si in zip(a, start, strict=True)]
            if lengths == last:
                break  # the same choice again: the same rate
            drafting = sum(x > 0 for x in lengths)
            if not drafting:
                return lengths, 0.0, base
            cost = self.step(rows, sum(lengths)) + self.forward(drafting, k, sum(lengths), ways)[0] \
                + sum(si for si, x in zip(start, lengths, strict=True) if x)
            tokens = (rows - len(a)) + sum(expected_tokens(ai, x) for ai, x in zip(a, lengths, strict=True))
            rate = tokens / max(cost, 1e-9)
            last = lengths
        return lengths, rate, cost

    def slowest_at(self, k: int, a: list[float], rows: int, base: float,
                    ways: tuple[str, ...], start: list[float]) -> tuple[list[int], float, float]:
        """Lengths at most k where the slowest request sets the pace -> (lengths, `rows` times its tokens per
        second, their seconds): the request accepted least drafts k, every other the fewest whose expected tokens
        reach its (more would cost positions and keep no request ahead of it)."""
        if rows > len(a):  # a request that cannot draft commits one token a step, however the others draft
            return [0] * len(a), 0.0, base
        pace = expected_tokens(min(a), k)
        lengths = []
        for ai in a:  # NOTE: expected tokens summed position by position: a dozen calls fewer per request
            j, worth, tokens = 1, ai, 1.0 + ai
            while j < k and tokens < pace:
                worth *= ai
                tokens += worth
                j += 1
            lengths.append(j)
        ids = sum(lengths)
        cost = self.step(rows, ids) + self.forward(len(a), k, ids, ways)[0] + sum(start)
        return lengths, rows * pace / max(cost, 1e-9), cost

    def may_pay(self, a: list[float], rows: int, base: float, ways: tuple[str, ...], slowest: bool = False) -> bool:
        """False where no lengths can beat the target alone, by a bound on every choice's rate: S ids drafted
        commit at most S * max(a) more tokens (a proposal's j-th id adds a^j <= a), and cost at least S times
        the least that an id adds to the step (`slope`) and the draft's least seconds per id (one request alone at
        1 request, batched ones k forwards over m requests for at most m * k ids, the line's least per request at
        m = 2 or m = all); (rows + S max(a)) / (base + S (slope + least)) is then at most rows / base for every
        S >= 1.
        (rows times the slowest request's tokens is at most the step's, so the bound holds for that rate too.)
        `slowest`: the slowest request's pace, whose lengths are at most k for it and at least 1 for the n - 1
        others, so S >= k + n - 1 ids buy a pace of at most 1 + k min(a): none pays where base k min(a) <=
        (k + n - 1)(slope + least), checked at k = cap (the ratio k / (k + n - 1) grows with k)."""
        if base <= 0.0:
            return True
        least = self.draft_alone(1)
        n = len(a)
        if n > 1 and "batched" in ways:
            least = min(least, self.batched(2) / 2, self.batched(n) / n)
        # NOTE: what S ids add to a step is a line in S (a fixed cost, then one per id) held at 0 or above: its
        # share per id is least at one end, S = 1 or the most ids
        most = self.cap * n
        slope = min(self.step(rows, 1) - base, (self.step(rows, most) - base) / most)
        if slowest:
            if rows > n:
                return False  # a request that cannot draft holds the pace at one token a step
            if min(a) * base * self.cap < (self.cap + n - 1) * (slope + least) * (1 - 1e-9):
                return False
        return max(a) * base >= rows * (slope + least) * (1 - 1e-9)

    @staticmethod
    def length(a: float, k: int, rate: float, slope: float, start: float = 0.0) -> int:
        """The most j <= k whose j-th position is worth its seconds at `rate`: a^j tokens >= rate * slope (an
        earlier position is worth more); 0 where the j positions' tokens, a + ... + a^j, are not worth their
        seconds and the reading before them (`start`) at that rate."""
        if rate <= 0:
            return k
        j, worth, tokens = 0, 1.0, 0.0
        while j < k and worth * a >= rate * slope:
            j, worth = j + 1, worth * a
            tokens += worth
        if start > 0 and tokens < rate * (j * slope + start):
            return 0
        return j
