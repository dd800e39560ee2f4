"""The policy's choices in the cold start, where it drafts for more than one request: `cold_steps.py` run with
`RowDraftLengths.lengths` wrapped to print each such choice with what it rested on (the requests' rates, unread ids,
ages and reading charges, the fitted step at the batch's size with no proposal and with 8, the batched and single
draft forward's costs, a reading's), then cold_steps.py's table (`output-smollm2-*.txt`, each at the commit its
name gives).

    python benchmarks/results/epyc-avx2/vllm-adaptive/cold-start/cold_choices.py real xtokspec_smollm2   (env as vllm_bench.py's, one core)
"""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))
from xtokspec.decode.rows import RowDraftLengths  # noqa: E402

original = RowDraftLengths.lengths


def lengths(self, requests, rows, ways=("batched",), full=True):
    out = original(self, requests, rows, ways, full)
    if any(out) and len(requests) > 1:
        print("CHOICE", self.chose, out, "full", full, "rates", [round(x, 3) for x in self.rates(requests)],
              "unread", [r.unread for r in requests], "age", [r.age for r in requests],
              "start", [round(self.startup(r), 4) for r in requests], "base", round(self.costs.step(rows, 0), 4),
              "step(rows,8)", round(self.costs.step(rows, 8), 4), "draft(8)", round(self.costs.draft(8), 4),
              "alone(1)", round(self.costs.draft_alone(1), 4), "read(60)", round(self.costs.read(60), 4),
              "runs", self.runs, "steps", self.steps, "drafted", self.costs.drafted,
              "pool", round(self.pool.rate(0.5, 0.0), 3), flush=True)
    return out


RowDraftLengths.lengths = lengths
runpy.run_path(str(Path(__file__).with_name("cold_steps.py")), run_name="__main__")
