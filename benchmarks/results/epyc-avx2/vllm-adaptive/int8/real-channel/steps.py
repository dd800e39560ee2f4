"""Where the engines' time went, step by step (`steps` in each process's results.json): per process and batch
size, the target alone's median decode step against the proposer's engine's median step in which nothing was
drafted nor verified, and the garbage collector's seconds inside each engine's steps (recorded in `more/` only).

    python benchmarks/results/epyc-avx2/vllm-adaptive/int8/real-channel/steps.py > output-steps.txt
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE / "process-1", HERE / "process-2", HERE / "more" / "process-1", HERE / "more" / "process-2"):
    data = json.loads((path / "results.json").read_text(encoding="utf-8"))
    alone, bridged = data["runs"]["alone"][0], data["runs"]["xtokspec_gemma_trim_int8"][0]
    first = "alone" if data["command"].split("--systems ")[1].startswith("alone") else "xtokspec"
    for batch in ("batch1", "batch4", "batch8"):
        # a batch of prompts' first step is its prefill; a quiet step follows a step that proposed nothing
        a = [s[0] for steps in alone[batch]["steps"] for s in steps[1:]]
        q = [s[0] for steps in bridged[batch]["steps"] for i, s in enumerate(steps)
             if i > 0 and s[1] == 0 and steps[i - 1][1] == 0]
        collected = [sum(s[2] for steps in run[batch]["steps"] for s in steps if len(s) > 2) for run in (alone, bridged)]
        print(f"{path.relative_to(HERE)} ({first} built first) {batch}: decode step {statistics.median(a) * 1e3:.0f} ms "
              f"alone, {statistics.median(q) * 1e3:.0f} ms quiet with the proposer ({statistics.median(q) / statistics.median(a):.3f}); "
              f"garbage collection {collected[0]:.3f} / {collected[1]:.3f} s")
