"""Where the proposer's engine spends its time at T=0.7, batch 1, against the target alone's median decode step in
the same round (`steps` in results.json: each step's seconds and the ids proposed in the call after it): a prompt's
first step (its prefill and the proposer's first call for the request), the steps with nothing drafted nor verified,
and the steps that drafted or verified, whose extra seconds are set against what the ids accepted save (one target
step each). The same for the null proposer, which never drafts. Another run's results.json may be named.

    python benchmarks/results/epyc-avx2/vllm-adaptive/fixtures-t07-steps/steps.py [RESULTS] > output-steps.txt
"""

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
data = json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else HERE / "results.json").read_text(encoding="utf-8"))
for name in ("null", "xtokspec"):
    for n, (run, base) in enumerate(zip(data["runs"][name], data["runs"]["alone"], strict=True)):
        mine, theirs = run["batch1"], base["batch1"]
        step = statistics.median(s[0] for prompt in theirs["steps"] for s in prompt[1:])
        first = [prompt[0][0] - alone[0][0] for prompt, alone in zip(mine["steps"], theirs["steps"], strict=True)]
        quiet, busy = [], []
        for prompt in mine["steps"]:
            for i, (seconds, proposed, *_) in enumerate(prompt[1:], start=1):
                (busy if proposed or prompt[i - 1][1] else quiet).append(seconds)
        accepted = mine.get("proposer", {}).get("accepted", 0)
        print(f"{name} round {n + 1}: the target alone's step {step * 1e3:.2f} ms; a prompt's first step "
              f"{statistics.median(first) * 1e3:+.2f} ms (median over prompts); {len(quiet)} quiet steps "
              f"{statistics.median(quiet) * 1e3:.2f} ms (median), {sum(quiet) - step * len(quiet):+.2f} s in all; "
              f"{len(busy)} steps drafting or verifying {sum(busy) - step * len(busy):+.2f} s, against {accepted} "
              f"ids accepted, worth {accepted * step:.2f} s; {sum(mine['tokens'])} tokens in {sum(mine['times']):.1f} s "
              f"against {sum(theirs['tokens'])} in {sum(theirs['times']):.1f} s")
