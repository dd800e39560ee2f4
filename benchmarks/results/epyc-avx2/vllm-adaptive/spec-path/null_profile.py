"""Where vLLM's speculative path spends its time when nothing is proposed: the target alone and the target with a
proposer that never proposes (`common.NullProposer`), built in one process and stepped in turn over the same
prompts at batch 1 (32 prompts x up to 64 tokens), first timed, then again with each engine's steps profiled apart
(cProfile) -> the functions whose time differs most (`output-null-profile.txt`). SYSTEM (default `null`): another
of `vllm_bench.py`'s systems in the null proposer's place, e.g. `xtokspec`; `--quiet`: xtokspec's policy never finds
drafting to pay, so that its steps are quiet but for the cold start's and the probes'
(`../../../epyc-avx512bf16/vllm-adaptive/fixtures-t07-spread/`).

    python benchmarks/results/epyc-avx2/vllm-adaptive/spec-path/null_profile.py [SYSTEM] [--quiet]
    (env as vllm_bench.py's, one core)
"""

import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
SYSTEM = next((a for a in sys.argv[1:] if not a.startswith("--")), "null")
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
if "--quiet" in sys.argv:  # drafting never pays: only the cold start's and the probes' proposals, the rest quiet
    from xtokspec.decode.stepcosts import StepCosts

    StepCosts.may_pay = lambda self, *args, **kwargs: False
import vllm_bench as vb  # noqa: E402

for key, value in vb.ENV.items():
    os.environ.setdefault(key, value)
from vllm import SamplingParams  # noqa: E402

chosen = vb.preset("fixtures", 3)
prompts = vb.load_prompts("fixtures", 32)
engines = {name: vb.build_engine(chosen, name, 8, prompts[0], log_stats=False)[0] for name in ("alone", SYSTEM)}
profiles = {name: cProfile.Profile() for name in engines}
plain = {name: 0.0 for name in engines}
steps = dict.fromkeys(engines, 0)


def run(profiled: bool) -> None:
    for n, prompt in enumerate(prompts):
        for name, llm in engines.items():
            llm.llm_engine.add_request(f"{name}-{profiled}-{n}", prompt, SamplingParams(temperature=0.0, max_tokens=64))
        turn = 0
        while any(llm.llm_engine.has_unfinished_requests() for llm in engines.values()):
            names = list(engines)[turn % 2:] + list(engines)[:turn % 2]
            for name in names:
                engine = engines[name].llm_engine
                if not engine.has_unfinished_requests():
                    continue
                if profiled:
                    profiles[name].enable()
                    engine.step()
                    profiles[name].disable()
                else:
                    t0 = time.perf_counter()
                    engine.step()
                    plain[name] += time.perf_counter() - t0
                    steps[name] += 1
            turn += 1


run(False)
print("unprofiled, batch 1, 32 prompts x up to 64 tokens:", {k: f"{v:.3f} s over {steps[k]} steps "
      f"({1000 * v / steps[k]:.3f} ms a step)" for k, v in plain.items()})
run(True)
stats = {name: pstats.Stats(p) for name, p in profiles.items()}
rows = {}
for name, st in stats.items():
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():
        key = f"{Path(file).name}:{line}({func})" if "site-packages" not in file else \
            f"{file.split('site-packages/')[-1]}:{line}({func})"
        rows.setdefault(key, {"alone": (0, 0.0, 0.0), SYSTEM: (0, 0.0, 0.0)})[name] = (nc, tt, ct)
print("total profiled:", {name: f"{st.total_tt:.3f} s" for name, st in stats.items()})
print(f"\nby own time, {SYSTEM} - alone (top 40):")
for key, v in sorted(rows.items(), key=lambda kv: -(kv[1][SYSTEM][1] - kv[1]["alone"][1]))[:40]:
    print(f"{v[SYSTEM][1] - v['alone'][1]:+8.4f} s  calls {v['alone'][0]:>7} / {v[SYSTEM][0]:>7}  {key}")
print(f"\nby cumulative time, {SYSTEM} - alone (top 40):")
for key, v in sorted(rows.items(), key=lambda kv: -(kv[1][SYSTEM][2] - kv[1]["alone"][2]))[:40]:
    print(f"{v[SYSTEM][2] - v['alone'][2]:+8.4f} s  cum {v['alone'][2]:8.3f} / {v[SYSTEM][2]:8.3f}  {key}")
