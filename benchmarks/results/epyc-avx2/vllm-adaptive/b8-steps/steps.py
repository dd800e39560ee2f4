"""Where drafting loses at batch 8 (a diagnostic): the target alone and xtokspec's proposer in lockstep, batch 1 and
4 served first as vllm_bench.py does, then batch 8 twice over the 32 prompts; per step, xtokspec's (requests,
proposals, seconds with its call, ids committed, what the policy chose) as its policy observes them, and the
target alone's step seconds by requests. Prints each batch of prompts' ratio, seconds per committed id by
requests in a step (target alone; xtokspec's steps without and with drafts), and the measured arms.

    python benchmarks/results/epyc-avx2/vllm-adaptive/b8-steps/steps.py   (env as vllm_bench.py's, one core)
"""

import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import vllm_bench as vb  # noqa: E402

for key, value in vb.ENV.items():
    os.environ.setdefault(key, value)

from xtokspec.decode.rows import RowDraftLengths  # noqa: E402


def main() -> None:
    chosen = vb.preset("fixtures", 3)
    names = ["alone", "xtokspec"]
    both = vb.load_prompts("fixtures", 40)
    prompts, warm = both[:32], both[32:]
    engines = {name: vb.build_engine(chosen, name, 8, prompts[0]) for name in names}
    for name in names:
        vb.run_batches(engines[name][0], [warm], 64)
    for batch in (1, 4):
        for i in range(0, 32, batch):
            vb.run_lockstep({n: engines[n] for n in names}, prompts[i : i + batch], 64)
    proposer = engines["xtokspec"][1][0]
    log = []
    observe = RowDraftLengths.observe_step

    def record(self, rows, proposals, seconds, tokens=None):
        log.append(("x", rows, proposals, seconds + self.last_call, tokens, self.chose))
        return observe(self, rows, proposals, seconds, tokens)

    RowDraftLengths.observe_step = record
    alone = engines["alone"][0].llm_engine
    step = alone.step

    def timed_step():
        rows = alone.get_num_unfinished_requests()
        t0 = time.perf_counter()
        out = step()
        log.append(("a", rows, 0, time.perf_counter() - t0, rows, "alone"))
        return out

    alone.step = timed_step
    for _ in range(2):
        for i in range(0, 32, 8):
            r = vb.run_lockstep({n: engines[n] for n in names}, prompts[i : i + 8], 64)
            print("batch", i, f"x/a {r['alone'][0] / r['xtokspec'][0]:.3f}", flush=True)
    Path(__file__).with_name("steps.json").write_text(json.dumps(log), encoding="utf-8")
    by = collections.defaultdict(list)
    for kind, rows, proposals, seconds, tokens, _ in log:
        if tokens:
            by[(kind, rows, proposals > 0)].append((seconds, tokens))

    def per_token(samples):
        return 1e3 * sum(s for s, _ in samples) / max(sum(t for _, t in samples), 1)

    for rows in range(1, 9):
        a, xa, xd = by[("a", rows, False)], by[("x", rows, False)], by[("x", rows, True)]
        print(rows, f"alone {per_token(a):.2f} ms/tok ({len(a)})", f"x alone-steps {per_token(xa):.2f} ({len(xa)})",
              f"x drafting {per_token(xd):.2f} ({len(xd)})")
    for size, arm in sorted(proposer.policy.measured.items()):
        median = statistics.median(arm.alone) * 1e3 if arm.alone else 0.0
        print("arm", size, f"alone med {median:.1f} ms",
              f"drafting s/tok {arm.drafting.seconds / max(arm.drafting.tokens, 1e-9) * 1e3:.2f} ms",
              "loses", arm.drafting_loses(size))


if __name__ == "__main__":
    main()
