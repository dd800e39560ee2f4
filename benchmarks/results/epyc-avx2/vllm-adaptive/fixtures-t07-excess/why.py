"""Why the proposer drafted at T=0.7 on the fixture pair, batch 1: one round of `vllm_bench.py` (alone, xtokspec; 32
prompts x 64 tokens, lockstep) with the row policy (`decode.rows.RowDraftLengths`) logging what it saw at each call
that drafted, and each step it timed. Prints, for the calls that drafted: how many, by why (chosen, a probe, the
cold start), the rate they drafted at, and what the cost model priced the first proposal at (step(1, 1) - step(1, 0))
against what the steps measured (their medians by proposals verified, over the run and over the run's first and
second halves: the machine's speed drifts; and steps without proposals by whether the step before had some). Run from the repository root, as vllm_bench.py (its environment):

    python benchmarks/results/epyc-avx2/vllm-adaptive/fixtures-t07-excess/why.py > output-why.txt
"""

import atexit
import collections
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

from xtokspec.decode import rows as policy_rows  # noqa: E402

calls, timed = [], []
lengths, observe_step = policy_rows.RowDraftLengths.lengths, policy_rows.RowDraftLengths.observe_step


def logged_lengths(self, requests, rows, *args, **kwargs):
    out = lengths(self, requests, rows, *args, **kwargs)
    if any(out):
        rate = max(r for r, x in zip(self.rates(requests), out, strict=True) if x)
        kept = list(self.costs.target.times.get((rows,), ()))  # the samples the line through steps without is drawn from
        calls.append((self.chose, rate, self.costs.step(rows, 0), self.costs.step(rows, 1), kept))
    return out


def logged_step(self, rows, proposals, seconds, tokens=None):
    timed.append((proposals, seconds))
    return observe_step(self, rows, proposals, seconds, tokens)


def report() -> None:
    if not timed:
        return
    print(f"calls that drafted: {len(calls)}, by why: {dict(collections.Counter(c[0] for c in calls))}")
    chosen = [c for c in calls if c[0] == "drafting"]
    if chosen:
        print(f"chosen: per-token rate median {statistics.median(c[1] for c in chosen):.3f} "
              f"(lowest {min(c[1] for c in chosen):.3f}); the first proposal priced at "
              f"{statistics.median(1e3 * (c[3] - c[2]) for c in chosen):+.2f} ms median (lowest "
              f"{min(1e3 * (c[3] - c[2]) for c in chosen):+.2f}), on a step without proposals of "
              f"{statistics.median(1e3 * c[2] for c in chosen):.2f} ms")
        kept = [x for c in chosen for x in c[4]]
        if kept:
            print(f"the samples that line was drawn from at those calls: median {1e3 * statistics.median(kept):.2f} ms, "
                  f"{sum(x > 0.025 for x in kept) / len(kept):.0%} above 25 ms")
    after = {True: [], False: []}  # steps without proposals, by whether the step before them had some
    for before, (proposals, seconds) in zip(timed, timed[1:], strict=False):
        if not proposals:
            after[before[0] > 0].append(seconds)
    print("steps without proposals after one with: " + (f"{1e3 * statistics.median(after[True]):.2f} ms (x{len(after[True])})"
                                                        if after[True] else "-")
          + f"; after one without: {1e3 * statistics.median(after[False]):.2f} ms (x{len(after[False])})")
    half = len(timed) // 2
    for name, part in (("the run", timed), ("first half", timed[:half]), ("second half", timed[half:])):
        by = collections.defaultdict(list)
        for proposals, seconds in part:
            by[proposals].append(seconds)
        print(f"steps timed, {name}: " + ", ".join(f"{p} proposals {1e3 * statistics.median(v):.2f} ms (x{len(v)})"
                                                  for p, v in sorted(by.items())))


policy_rows.RowDraftLengths.lengths, policy_rows.RowDraftLengths.observe_step = logged_lengths, logged_step
atexit.register(report)
if __name__ == "__main__":
    import vllm_bench

    sys.argv[1:] = ["--preset", "fixtures", "--systems", "alone,xtokspec", "--rounds", "1", "--batches", "1",
                    "--prompts", "32", "--new-tokens", "64", "--temperature", "0.7", "--lockstep"]
    vllm_bench.main()
