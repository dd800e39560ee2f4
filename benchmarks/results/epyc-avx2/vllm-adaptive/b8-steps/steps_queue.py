"""Where batch 8 still loses once a batch that arrived together runs at the slowest request's pace (a diagnostic,
ba19966's proposer: `vllm/requests.Queue`): `steps_start.py`'s lockstep (the target alone, the null proposer and
xtokspec; batch 1 and 4 served first as vllm_bench.py does, then batch 8 twice), every call's choice
(`engine-steps-queue.json`, the printout in `output-queue.txt`).

    python benchmarks/results/epyc-avx2/vllm-adaptive/b8-steps/steps_queue.py   (env as vllm_bench.py's, one core)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from steps_pace import main  # noqa: E402

if __name__ == "__main__":
    main(null=True, output="engine-steps-queue.json")
