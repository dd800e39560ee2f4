"""Where batch 8 loses with the slowest request's pace (a diagnostic, 3c671a4's proposer): the target alone and
xtokspec in lockstep, batch 1 and 4 served first as vllm_bench.py does, then batch 8 twice; every engine step
timed with the requests in it and, for xtokspec, its call (rows, ids proposed, seconds, what the policy chose).
Prints each batch of prompts' ratio and, per batch, steps and seconds by requests in a step
(`engine-steps-pace.json`: [engine, requests, seconds, [rows, ids proposed, call seconds, chose] or None], and
[batch, first prompt, alone's seconds, xtokspec's] after each batch; the printout in `output-pace.txt`).
`main(null=True)` (`steps_start.py`) adds the null proposer to the lockstep, each call's probes and what the calls
chose per batch.

    python benchmarks/results/epyc-avx2/vllm-adaptive/b8-steps/steps_pace.py   (env as vllm_bench.py's, one core)
"""

import collections
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import vllm_bench as vb  # noqa: E402

for key, value in vb.ENV.items():
    os.environ.setdefault(key, value)

from xtokspec.vllm.proposer import TextBridgeProposer  # noqa: E402


def report(log: list, null: bool = False) -> None:
    """Per batch of prompts: steps and seconds by requests in a step, the target alone's against xtokspec's (and
    the null proposer's)."""
    names = ("alone", "null", "xtokspec") if null else ("alone", "xtokspec")
    batches, steps = [], []
    for record in log:
        if record[0] == "batch":
            batches.append((record, steps))
            steps = []
        else:
            steps.append(record)
    for mark, batch in batches:
        by = {}
        for engine in names:
            counts = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
            for name, rows, seconds, call in batch:
                if name == engine:
                    entry = counts[rows]
                    entry[0] += 1
                    entry[1] += seconds
                    if call:
                        entry[2] += call[1]
                        entry[3] += call[2]
            by[engine] = counts
        print("batch", mark[1], f"alone {mark[2] * 1e3:.0f} ms, x {mark[3] * 1e3:.0f} ms"
              + (f", null {mark[4] * 1e3:.0f} ms" if null else ""))
        if null:
            chose = collections.defaultdict(lambda: [0, 0.0])
            for name, _, seconds, call in batch:
                if name == "xtokspec" and call:
                    chose[call[3]][0] += 1
                    chose[call[3]][1] += seconds
            print("   chose:", {k: (v[0], round(v[1] * 1e3, 1)) for k, v in chose.items()},
                  "no call:", sum(1 for name, _, _, call in batch if name == "xtokspec" and not call))
        for rows in sorted(set(by["alone"]) | set(by["xtokspec"]), reverse=True):
            a, x = by["alone"].get(rows, [0, 0, 0, 0]), by["xtokspec"].get(rows, [0, 0, 0, 0])
            line = (f"   rows {rows}: alone {a[0]:3d} steps {a[1] * 1e3:7.1f} ms | x {x[0]:3d} steps "
                    f"{x[1] * 1e3:7.1f} ms, ids {x[2]:3d}, calls {x[3] * 1e3:6.1f} ms")
            if a[0] and x[0]:
                line += f"  per step a {a[1] / a[0] * 1e3:5.1f} x {x[1] / x[0] * 1e3:5.1f}"
            nu = by.get("null", {}).get(rows, [0, 0, 0, 0])
            if nu[0]:
                line += f" null {nu[0]:3d} steps {nu[1] * 1e3:7.1f} ms"
            print(line)


def main(null: bool = False, output: str = "engine-steps-pace.json") -> None:
    """`null`: the null proposer in the lockstep too, and each call's probes marked ("/probe"); `output`: the
    steps' file, beside this one."""
    names = ("alone", "null", "xtokspec") if null else ("alone", "xtokspec")
    chosen = vb.preset("fixtures", 3)
    both = vb.load_prompts("fixtures", 40)
    prompts, warm = both[:32], both[32:]
    engines = {name: vb.build_engine(chosen, name, 8, prompts[0], log_stats=False) for name in names}
    for name in engines:
        vb.run_batches(engines[name][0], [warm], 64)
    for batch in (1, 4):
        for i in range(0, 32, batch):
            vb.run_lockstep(engines, prompts[i : i + batch], 64)
    log, last = [], {}
    propose = TextBridgeProposer._propose

    def recorded(self, sampled, *args, **kwargs):
        t0 = time.perf_counter()
        out = propose(self, sampled, *args, **kwargs)
        probe = "/probe" if null and self.policy.probed else ""
        last["call"] = (len(out), sum(map(len, out)), time.perf_counter() - t0, self.policy.chose + probe)
        return out

    TextBridgeProposer._propose = recorded
    for name, (llm, _) in engines.items():
        engine = llm.llm_engine

        def timed(engine=engine, step=engine.step, name=name):
            rows = engine.get_num_unfinished_requests()
            last.pop("call", None)
            t0 = time.perf_counter()
            out = step()
            log.append((name, rows, time.perf_counter() - t0, last.get("call")))
            return out

        engine.step = timed
    for _ in range(2):
        for i in range(0, 32, 8):
            result = vb.run_lockstep(engines, prompts[i : i + 8], 64)
            log.append(("batch", i, *(result[engine][0] for engine in ("alone", "xtokspec", "null")[: len(names)])))
            ratios = f"x/a {result['alone'][0] / result['xtokspec'][0]:.3f}"
            if null:
                ratios += f" null/a {result['alone'][0] / result['null'][0]:.3f}"
            print("batch", i, ratios, flush=True)
    (HERE / output).write_text(json.dumps(log), encoding="utf-8")
    report(log, null)


if __name__ == "__main__":
    main()
