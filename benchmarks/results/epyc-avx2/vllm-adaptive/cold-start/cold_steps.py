"""The cold start step by step: the target alone and the target with xtokspec's proposer, fresh engines built in one
process, the 8 prompts of vllm_bench.py's cold start in one batch, stepped in turn (as `--lockstep`): each step's
seconds and, for the proposer, its call's seconds and the rows it drafted for (`output-*.txt`). As in `--lockstep`,
the proposer's clock skips the other engine's steps.

    python benchmarks/results/epyc-avx2/vllm-adaptive/cold-start/cold_steps.py [fixtures|real] [system]   (env as vllm_bench.py's, one core)
"""

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
PRESET = sys.argv[1] if len(sys.argv) > 1 else "fixtures"
SYSTEM = sys.argv[2] if len(sys.argv) > 2 else "xtokspec"
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import vllm_bench as vb  # noqa: E402

for key, value in vb.ENV.items():
    os.environ.setdefault(key, value)
from vllm import SamplingParams  # noqa: E402

chosen = vb.preset(PRESET, 3)
if PRESET == "real":
    chosen["dtype"] = "float32"
n = 8 if PRESET == "real" else 32
both = vb.load_prompts(PRESET, n + 8)
prompts, warm = both[:n], both[n:n + 8]
if PRESET == "real":
    import tempfile
    vb.held_out(chosen, set(both), Path(tempfile.mkdtemp()))
built = {name: vb.build_engine(chosen, name, 8, prompts[0], log_stats=False) for name in ("alone", SYSTEM)}
engines = {name: llm for name, (llm, _) in built.items()}
from xtokspec.vllm.proposer import TextBridgeProposer  # noqa: E402

orig = TextBridgeProposer._propose
calls = []


def wrapped(self, sampled, *args, **kwargs):
    t0 = time.perf_counter()
    out = orig(self, sampled, *args, **kwargs)
    calls.append((sum(bool(x) for x in out), time.perf_counter() - t0))
    return out


TextBridgeProposer._propose = wrapped
new = 32 if PRESET == "real" else 64
for name, llm in engines.items():
    for i, p in enumerate(warm):
        llm.llm_engine.add_request(f"{name}-{i}", p, SamplingParams(temperature=0.0, max_tokens=new))
times = {name: [] for name in engines}
step = 0
while any(llm.llm_engine.has_unfinished_requests() for llm in engines.values()):
    names = list(engines)[step % 2:] + list(engines)[:step % 2]
    for name in names:
        e = engines[name].llm_engine
        if e.has_unfinished_requests():
            before = len(calls)
            t0 = time.perf_counter()
            e.step()
            dt = time.perf_counter() - t0
            # NOTE: as vllm_bench.py's lockstep: a proposer times its target's step as the interval between its
            # calls, and the other engine's step in that interval is moved out of it
            for other, (_, proposers) in built.items():
                for proposer in proposers if other != name else ():
                    if proposer._last_end is not None:
                        proposer._last_end += dt
            c = calls[before:] if name == SYSTEM else []
            times[name].append((dt, c[0] if c else None, e.get_num_unfinished_requests()))
    step += 1
ta, tx = sum(t[0] for t in times["alone"]), sum(t[0] for t in times[SYSTEM])
print(f"{PRESET} cold batch: alone {ta:.3f} s over {len(times['alone'])} steps, {SYSTEM} {tx:.3f} s over "
      f"{len(times[SYSTEM])} steps ({ta / tx:.3f}x); proposer calls {sum(c[1] for c in calls):.3f} s")
for i in range(max(len(times["alone"]), len(times[SYSTEM]))):
    a = times["alone"][i] if i < len(times["alone"]) else None
    x = times[SYSTEM][i] if i < len(times[SYSTEM]) else None
    print(i, f"alone {1000 * a[0]:8.1f} ms running {a[2]}" if a else " " * 30,
          f"| {SYSTEM} {1000 * x[0]:8.1f} ms running {x[2]}" + (f", call {1000 * x[1][1]:.1f} ms drafting {x[1][0]}" if x and x[1] else "") if x else "")
