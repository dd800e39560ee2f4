"""The proposer's own time at batch 1 on the real pair, by function (cProfile around `_propose` only): one engine
of the float32 target with the trimmed Gemma-3-270M, 8 held-out prompts in one batch to warm it, then four prompts
one at a time, 32 new tokens each (`profile-b1.txt`).

    python benchmarks/results/epyc-avx2/vllm-adaptive/cost-miss/why-real/profile_b1.py > profile-b1.txt   (env as vllm_bench.py's, one core)
"""

import cProfile
import os
import pstats
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import vllm_bench as vb  # noqa: E402

for key, value in vb.ENV.items():
    os.environ.setdefault(key, value)
chosen = vb.preset("real", 3)
chosen["dtype"] = "float32"
both = vb.load_prompts("real", 16)
prompts, warm = both[:8], both[8:]
vb.held_out(chosen, set(both), Path(tempfile.mkdtemp()))
llm, _ = vb.build_engine(chosen, "xtokspec_gemma_trim", 8, prompts[0], log_stats=False)
vb.run_batches(llm, [warm], 32)
from xtokspec.vllm.proposer import TextBridgeProposer  # noqa: E402

prof = cProfile.Profile()
orig = TextBridgeProposer._propose


def wrapped(self, *args, **kwargs):
    prof.enable()
    try:
        return orig(self, *args, **kwargs)
    finally:
        prof.disable()


TextBridgeProposer._propose = wrapped
vb.run_batches(llm, [[p] for p in prompts[:4]], 32)
st = pstats.Stats(prof)
st.sort_stats("cumulative").print_stats(45)
st.sort_stats("tottime").print_stats(25)
