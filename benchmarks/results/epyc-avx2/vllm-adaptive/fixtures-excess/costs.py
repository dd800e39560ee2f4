"""What the cost model priced steps and calls at, against what they measured, on the fixture pair greedy (one round of
`vllm_bench.py`: alone, xtokspec; batches 1, 4, 8; 32 prompts x 64 tokens; lockstep): for each size (requests in
the step, proposals verified) seen at least three times, the steps' measured seconds, the model's price for them
(`StepCosts.step`) and what a step without proposals was taken to cost then (`quiet level`, the size's own recent
median; `base`, the line through all sizes), medians over the run; and the drafting calls' seconds against the
model's price. Run from the repository root, as vllm_bench.py (its environment):

    python benchmarks/results/epyc-avx2/vllm-adaptive/fixtures-excess/costs.py > output-costs.txt
"""

import atexit
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

from xtokspec.decode import rows as policy_rows  # noqa: E402
from xtokspec.decode import stepcosts  # noqa: E402

steps = []  # (rows, proposals, seconds, priced, quiet level, base)
calls = []  # (rows, seconds, priced)
observe_step, observe_call = policy_rows.RowDraftLengths.observe_step, stepcosts.StepCosts.observe_call


def logged_step(self, rows, proposals, seconds, tokens=None):
    if self.costs.target.times:
        steps.append((rows, proposals, seconds, self.costs.step(rows, proposals), self.costs.quiet_level(rows),
                      self.costs.step(rows, 0)))
    return observe_step(self, rows, proposals, seconds, tokens)


def logged_call(self, rows, drafting, forwards, seconds, batched=True):
    if drafting and forwards:
        ways = ("batched",) if batched else ("alone",)
        calls.append((rows, seconds, self.quiet(rows) + self.forward(drafting, forwards if batched else 1, forwards,
                                                                      ways)[0]))
    return observe_call(self, rows, drafting, forwards, seconds, batched)


def report() -> None:
    def ms(values) -> str:
        return f"{1e3 * statistics.median(values):.2f}"

    for rows in (1, 2, 3, 4, 8):
        for p in sorted({s[1] for s in steps if s[0] == rows}):
            xs = [s for s in steps if s[0] == rows and s[1] == p]
            if len(xs) >= 3:
                print(f"rows {rows} p {p}: n {len(xs)} measured {ms(s[2] for s in xs)} predicted {ms(s[3] for s in xs)} "
                      f"quiet level {ms(s[4] for s in xs)} base {ms(s[5] for s in xs)}")
    for rows in (1, 2, 3, 4, 8):
        xs = [c for c in calls if c[0] == rows]
        if xs:
            print(f"calls rows {rows}: n {len(xs)} measured {ms(c[1] for c in xs)} predicted {ms(c[2] for c in xs)}")


policy_rows.RowDraftLengths.observe_step, stepcosts.StepCosts.observe_call = logged_step, logged_call
atexit.register(report)
if __name__ == "__main__":
    import vllm_bench

    sys.argv[1:] = ["--preset", "fixtures", "--systems", "alone,xtokspec", "--rounds", "1", "--batches", "1,4,8",
                    "--prompts", "32", "--new-tokens", "64", "--lockstep"]
    vllm_bench.main()
