"""`steps.py` with the policy's view at each xtokspec call (a diagnostic, cd060f5's proposer): besides what
`steps.py` records, each call's entry ends with what the measured arms of its batch size held (target-alone
samples, their median with the call before, drafting's decayed tokens and seconds, its measured steps, whether
drafting loses there) and what the cost model predicted for it (a step without proposals, with one and with two
per request, a draft forward over all of them, a call without drafts, the pooled acceptance). `steps-arms.json`
as `steps.json`, the call entries with that pair appended; the printout in `steps-arms-output.txt`.

    python benchmarks/results/epyc-avx2/vllm-adaptive/fixtures-queued/steps_arms.py   (env as vllm_bench.py's, one core)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import steps  # noqa: E402


def arms_view(policy, rows: int) -> tuple:
    """(the measured arms at `rows` requests or None, the cost model's predictions there)."""
    m = policy.measured.get(rows)
    arms = None if m is None else (len(m.alone), sorted(m.alone)[len(m.alone) // 2] if m.alone else None,
                                   m.drafting.tokens, m.drafting.seconds, m.drafting.cycles, m.drafting_loses(rows))
    model = (policy.costs.step(rows, 0), policy.costs.step(rows, rows), policy.costs.step(rows, 2 * rows),
             policy.costs.draft(rows), policy.costs.quiet(rows), policy.pool.rate(0.5, 0.0))
    return arms, model


if __name__ == "__main__":
    steps.main(arms_view, "steps-arms.json")
