"""What a server's steps measure, for the draft lengths of requests served together (`rows.RowDraftLengths`): a
step's and a draft forward's costs as a plane in their sizes (`LinearCosts`), each request's acceptance
(`Acceptance`, read from what vLLM committed after a proposal: `outcome`), and per batch size drafting against
the target alone as both ran (`Measured`, the arms `policy.Fallback` compares in the loop). The rules that use them:
stepcosts.py's and rows.py's module docstrings."""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .policy import DECAY, WARM_CYCLES, DraftingCost, Fallback


class LinearCosts:
    """Seconds as a line (a plane) in a few sizes, e.g. (requests, proposals): recent samples kept per size, each
    size's median weighted by its sample count, fitted by least squares. A slope the sizes seen cannot show
    (one value only) is held at 0, and no slope is negative: an unmeasured size is taken as cheap as the ones
    measured (optimism: it is tried, then measured). A size's first sample is held back: vLLM's first step at a
    new shape pays one-time costs (kernel selection, allocations: several times the next step's, BENCHMARKS.md,
    "vLLM"), and a size the policy then avoids would keep that figure as its median; held back, the size counts
    as unmeasured, hence cheap, and is tried again. With `each_size=False` only the first sample of all is held
    back: for a cost whose sizes rarely repeat (a draft reading a request's prompt, by its length), where holding
    back each size's first would hold back nearly every sample and leave the cost unmeasured for good, and whose
    one-time costs come once (the draft's first forwards in the process), not at each new size."""

    SAMPLES = 8  # recent samples kept per size
    RIDGE = 1e-6  # a slope's pull to 0, against each sample's weight of 1

    def __init__(self, features: int, each_size: bool = True, samples: int = SAMPLES):
        self.features, self.each_size, self.samples = features, each_size, samples
        self.times: dict[tuple, collections.deque] = {}
        # the weighted least-squares sums over the sizes' (1, *size) and medians, kept as samples come: a server's
        # steps come at many sizes, and a refit after each step then solves a (features + 1)-square system
        # instead of taking every size's median again. NOTE: Python floats, not NumPy: the system is at most 3 x 3
        # and is solved at every proposer call, where a NumPy call's fixed overhead outweighs the arithmetic
        self.points: dict[tuple, tuple[tuple[float, ...], float, int]] = {}  # size -> ((1, *size), median, count)
        self.gram = [[0.0] * (features + 1) for _ in range(features + 1)]  # sum of count * x x^T
        self.moment = [0.0] * (features + 1)  # sum of count * median * x
        self.coef: list[float] | None = None
        self.held: set[tuple] = set()  # sizes whose first sample was held back

    def observe(self, size: tuple, seconds: float) -> bool:
        """One more sample at `size` -> whether it counts (False: the size's first, held back)."""
        size = tuple(size)
        samples = self.times.get(size)
        if samples is None:
            if size not in self.held and (self.each_size or not self.held):
                self.held.add(size)
                return False
            samples = self.times[size] = collections.deque(maxlen=self.samples)
        samples.append(seconds)
        x, median, count = self.points.get(size) or ((1.0, *map(float, size)), 0.0, 0)
        ordered = sorted(samples)  # NOTE: the median by hand: statistics.median costs more on 8 values
        middle = len(ordered) // 2
        new = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
        # the size's share of the sums moves by its new count and median (one update a sample, not a removal and
        # an addition)
        grown, moved = len(samples) - count, len(samples) * new - count * median
        for i, xi in enumerate(x):
            if grown:
                row = self.gram[i]
                for j, xj in enumerate(x):
                    row[j] += grown * xi * xj
            self.moment[i] += moved * xi
        self.points[size] = x, new, len(samples)
        self.coef = None
        return True

    def anchor(self, size: tuple, seconds: float) -> None:
        """A point known rather than measured (one sample, not held back), where no sample at `size` is kept."""
        size = tuple(size)
        if size not in self.times:
            self.held.add(size)
            self.observe(size, seconds)

    def seen(self, where) -> bool:
        """Whether a size for which `where(size)` holds has been measured."""
        return any(where(size) for size in self.times)

    def __call__(self, *size) -> float:
        coef = self.coef
        if coef is None:
            if not self.times:
                return 0.0
            coef = self.coef = self._fit()
        if len(size) != self.features:
            raise ValueError(f"{self.features} sizes expected, got {size}")
        # NOTE: unrolled for one and two sizes: the policy evaluates the plane a dozen times per proposer call
        if self.features == 1:
            value = coef[0] + coef[1] * size[0]
        elif self.features == 2:
            value = coef[0] + coef[1] * size[0] + coef[2] * size[1]
        else:
            value = coef[0] + sum(c * x for c, x in zip(coef[1:], size, strict=True))
        return value if value > 0.0 else 0.0

    def _fit(self) -> list[float]:
        """The normal equations of the weighted fit (the ridge on the free slopes only); a negative slope is
        held at 0 and the rest refitted without it."""
        free = list(range(1, self.features + 1))
        while True:
            kept = [0, *free]
            system = [[self.gram[i][j] + (self.RIDGE if i == j and i else 0.0) for j in kept] for i in kept]
            solved = solve_small(system, [self.moment[i] for i in kept])
            if solved is None:  # singular (sums drifted by cancellation): the least-squares answer
                solved = np.linalg.lstsq(np.array(system), np.array([self.moment[i] for i in kept]),
                                         rcond=None)[0].tolist()
            coef = [0.0] * (self.features + 1)
            for i, c in zip(kept, solved, strict=True):
                coef[i] = c
            negative = [j for j in free if coef[j] < 0]
            if not negative:
                return coef
            free = [j for j in free if j not in negative]


def solve_small(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b for a small square system (Gaussian elimination, partial pivoting, as LAPACK's solve), or
    None where a pivot is exactly 0 (where NumPy's solve raises) or the answer is not finite."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if m[pivot][col] == 0.0:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x if all(math.isfinite(v) for v in x) else None


@dataclass
class Acceptance:
    """One request's acceptance evidence (decayed counts: accepted proposals, rejections)."""

    successes: float = 0.0
    failures: float = 0.0
    # the same evidence undecayed, over the request's life (how far requests' rates spread: `Spread`)
    accepted: int = 0
    rejected: int = 0
    idle: int = 0  # steps since it last drafted
    # target ids its draft must read before it drafts (a new request: all of them; else those committed while it
    # did not draft), and the ids it has committed so far, set by its caller before each choice: reading them is a
    # cost of its next proposal, spread over as many steps as it has lived (`RowDraftLengths.startup`)
    unread: int = 0
    age: int = 1
    run: int = 0  # the steps it has drafted since its draft last read its text (`RowDraftLengths.life`)
    run_chosen: bool = False  # the policy chose one of those steps (not a cold start's or a probe's)

    def observe(self, accepted: int, rejected: bool, decay: float = DECAY) -> None:
        self.successes = decay * self.successes + accepted
        self.failures = decay * self.failures + rejected
        self.accepted += accepted
        self.rejected += rejected
        self.idle = 0

    def rate(self, prior: float, weight: float) -> float:
        """The per-token acceptance: its evidence, with the prior worth `weight` proposals."""
        return (self.successes + weight * prior) / (self.successes + self.failures + weight)


class Spread:
    """How far requests' per-token acceptance rates spread around the rate pooled over them, from the requests
    served: the weight, in trials, that a request's prior (the pooled rate) is worth against its own evidence.

    Each request's rate is chosen on its own evidence, and requests are chosen to draft where that rate is high: with
    a weak prior, a request the draft follows as poorly as the rest but that was accepted in its first proposals looks
    good and drafts (at T=0.7 on the fixture pair, requests chosen at a per-token rate of 0.43 were accepted at 0.26,
    near the pooled rate: BENCHMARKS.md, "vLLM"). The prior's weight is therefore what the requests' spread says
    (empirical Bayes): with x_i accepted of n_i trials (accepted ids and rejections) per request, rates drawn from
    a Beta of weight w around p, the method of moments for the beta-binomial gives the intra-request correlation
    rho = 1 / (w + 1) from S = sum_i (x_i - n_i p)^2 / n_i, whose expectation is p (1 - p) ((m - 1) + rho (N -
    sum_i n_i^2 / N)) over m requests and N trials (Kleinman, 1973). Requests that share one rate (a sampled
    target that no draft follows well) lean on the pool; requests that differ (some near copies, some not) on their
    own evidence. Bounded in [LOWEST, HIGHEST]; LOWEST until `MIN_REQUESTS` requests have been seen."""

    KEPT = 64  # the most recent requests kept
    MIN_REQUESTS = 8  # requests (each with MIN_TRIALS) before the spread is estimated
    MIN_TRIALS = 2
    LOWEST = 2.0  # a prior worth two trials: the weight before the spread is known
    HIGHEST = 50.0  # requests alike: a request's own evidence (decayed: ~10 proposals' worth) barely moves it

    def __init__(self):
        self.requests: collections.deque = collections.deque(maxlen=self.KEPT)  # (accepted, trials)
        self._weight = self.LOWEST

    def observe(self, accepted: int, trials: int) -> None:
        """A request that has left: its ids accepted of its trials (accepted ids and rejections)."""
        if trials < self.MIN_TRIALS:
            return
        self.requests.append((accepted, trials))
        self._weight = self._estimate()

    def weight(self) -> float:
        """The prior's weight in trials (this class's docstring)."""
        return self._weight

    def _estimate(self) -> float:
        m = len(self.requests)
        if m < self.MIN_REQUESTS:
            return self.LOWEST
        total = sum(n for _, n in self.requests)
        p = sum(x for x, _ in self.requests) / total
        if p <= 0.0 or p >= 1.0:
            return self.HIGHEST  # every request alike: none accepted anything, or all everything
        spread = sum((x - n * p) ** 2 / n for x, n in self.requests) / (p * (1 - p))
        room = total - sum(n * n for _, n in self.requests) / total
        rho = (spread - (m - 1)) / room if room > 0 else 0.0
        if rho <= 0.0:
            return self.HIGHEST
        return min(self.HIGHEST, max(self.LOWEST, 1.0 / rho - 1.0))


def outcome(proposed: Sequence[int], new: Sequence[int]) -> tuple[int, bool]:
    """What vLLM did with a proposal, from the ids it committed next (the accepted proposals, then one it
    sampled) -> (accepted, rejected). A position where vLLM's own token equals the proposal's was not verified
    (the scheduler cut the proposal: a token budget, the context's end): no rejection, since a rejected position
    is resampled without the proposed token."""
    accepted = 0
    for p, n in zip(proposed, new, strict=False):
        if p != n:
            break
        accepted += 1
    if accepted >= len(new):  # every committed id matched: the last one was sampled, its position not verified
        return len(new) - 1, False
    if accepted == len(proposed):
        return accepted, False
    return accepted, True


@dataclass
class Measured:
    """What the steps of one batch size (requests in a step) have measured, whatever the model predicts: the
    target alone's recent step times (each commits one token per request), drafting's seconds per committed
    token (decayed sums, as `policy.Fallback` keeps them), and drafting steps' seconds against what the cost model
    predicted they would add to a step of the target alone; each step's seconds with the proposer's call before it.

    The verdict the policy acts on is the cost model's miss (`cost_miss`): drafting steps' seconds over the target
    alone's measured step plus the seconds the model predicted the drafts would add. It leaves acceptance out:
    a request's acceptance is learned from its own proposals, and a verdict in tokens per second (`drafting_loses`)
    at one request is one request's acceptance applied to the next (a poor prompt turned it against the good one
    that followed: BENCHMARKS.md, "vLLM")."""

    alone: collections.deque = field(default_factory=lambda: collections.deque(maxlen=Fallback.ALONE_SAMPLES))
    drafting: DraftingCost = field(default_factory=DraftingCost)
    # drafting steps whose added seconds the model predicted (decayed sums): their seconds, the predicted
    # additions, their weight, and their number
    real: float = 0.0
    added: float = 0.0
    weight: float = 0.0
    costed: int = 0

    ALONE_MIN = 2  # target-alone steps measured before a comparison

    def observe(self, drafted: bool, tokens: int, seconds: float, added: float | None = None) -> None:
        """A step of this size: whether it drafted, the tokens it committed, its seconds; `added`: what the cost
        model predicted its drafts add to a step of the target alone (None: not predicted)."""
        if not drafted:
            self.alone.append(seconds)
            return
        self.drafting.add(tokens, seconds)
        if added is not None:
            self.real = DECAY * self.real + seconds
            self.added = DECAY * self.added + added
            self.weight = DECAY * self.weight + 1.0
            self.costed += 1

    def alone_wanted(self) -> bool:
        """Drafting has been measured here, the target alone not yet enough for a comparison."""
        return self.drafting.cycles >= WARM_CYCLES and len(self.alone) < self.ALONE_MIN

    def per_token_alone(self, rows: int) -> float:
        """The target alone's seconds per token at this size (`rows` requests, one token each a step)."""
        return statistics.median(self.alone) / rows

    def cost_miss(self) -> float:
        """How much longer drafting steps have taken than predicted, >= 1: their seconds over the target alone's
        measured step plus the predicted additions (1 until both sides have been measured)."""
        if len(self.alone) < self.ALONE_MIN or self.costed < WARM_CYCLES:
            return 1.0
        predicted = self.added + self.weight * statistics.median(self.alone)
        return max(1.0, self.real / max(predicted, 1e-12))

    def drafting_loses(self, rows: int) -> bool:
        """Drafting has cost more per committed token than the target alone at this size (both measured): a
        verdict that mixes the requests' acceptance with the costs, reported by the studies' logs."""
        if len(self.alone) < self.ALONE_MIN or self.drafting.cycles < WARM_CYCLES:
            return False
        return self.drafting.loses_to(self.per_token_alone(rows))


UNMEASURED = Measured()  # a size no step has measured yet (read only)
