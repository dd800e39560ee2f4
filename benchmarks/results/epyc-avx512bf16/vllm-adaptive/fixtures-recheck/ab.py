"""The cost of costing a quiet choice again every 8 steps rather than 4 (`RowDraftLengths.RECHECK`), in one run:
`vllm_bench.py` with a system `xtokspec_recheck4`, the `xtokspec` system whose policy costs it again every 4 steps
(set on its proposer once built), so that both meet the same prompts, rounds and machine. Arguments as
vllm_bench.py's; run from the repository root, as vllm_bench.py (its environment):

    python benchmarks/results/epyc-avx512bf16/vllm-adaptive/fixtures-recheck/ab.py --preset fixtures --systems alone,xtokspec,xtokspec_recheck4 --rounds 3 --batches 1 --prompts 32 --new-tokens 64 --lockstep --out benchmarks/results/epyc-avx512bf16/vllm-adaptive/fixtures-recheck/ab/results.json
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import vllm_bench as vb  # noqa: E402

preset, build_engine = vb.preset, vb.build_engine


def with_recheck4(name: str, k: int) -> dict:
    chosen = preset(name, k)
    chosen["systems"]["xtokspec_recheck4"] = chosen["systems"]["xtokspec"]
    return chosen


def build_recheck4(chosen: dict, name: str, *args, **kwargs) -> tuple:
    llm, proposers = build_engine(chosen, name, *args, **kwargs)
    if name == "xtokspec_recheck4":
        for proposer in proposers:
            proposer.policy.RECHECK = 4
    return llm, proposers


vb.preset, vb.build_engine = with_recheck4, build_recheck4
vb.main()
