"""Where batch 8 loses, with the null proposer beside it (a diagnostic, 1f62af4's proposer): `steps_pace.py`'s
lockstep with the null proposer too (the target alone, the null proposer and xtokspec), batch 1 and 4 served first
as vllm_bench.py does, then batch 8 twice; every engine step timed with the requests in it and, for xtokspec, its
call (rows, ids proposed, seconds, what the policy chose, "/probe" for a probe). Prints each batch of prompts'
ratios and, per batch, what xtokspec's calls chose and steps and seconds by requests in a step
(`engine-steps-start.json`: [engine, requests, seconds, [rows, ids proposed, call seconds, chose] or None], and
[batch, first prompt, alone's seconds, xtokspec's, null's] after each batch; the printout in `output-start.txt`).

    python benchmarks/results/epyc-avx2/vllm-adaptive/b8-steps/steps_start.py   (env as vllm_bench.py's, one core)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from steps_pace import main  # noqa: E402

if __name__ == "__main__":
    main(null=True, output="engine-steps-start.json")
