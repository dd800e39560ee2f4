"""Where batch 8 loses, with the null proposer beside it (a diagnostic, 1f62af4's proposer): the target alone, the
null proposer and xtokspec in lockstep, batch 1 and 4 served first as vllm_bench.py does, then batch 8 twice; every
engine step timed with the requests in it and, for xtokspec, its call (rows, ids proposed, seconds, what the policy
chose, "/probe" for a probe). Prints each batch of prompts' ratios and, per batch, what xtokspec's calls chose and
steps and seconds by requests in a step (`engine-steps-start.json`: [engine, requests, seconds, [rows, ids
proposed, call seconds, chose] or None], and [batch, first prompt, alone's seconds, xtokspec's, null's] after each
batch; the printout in `output-start.txt`).

    python benchmarks/results/epyc-avx2/vllm-adaptive/b8-steps/steps_start.py   (env as vllm_bench.py's, one core)
"""

import collections
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import vllm_bench as vb  # noqa: E402

for key, value in vb.ENV.items():
    os.environ.setdefault(key, value)

from xtokspec.vllm.proposer import TextBridgeProposer  # noqa: E402


def report(log: list) -> None:
    """Per batch of prompts: steps and seconds by requests in a step, the target alone's against xtokspec's."""
    batches, steps = [], []
    for record in log:
        if record[0] == "batch":
            batches.append((record, steps))
            steps = []
        else:
            steps.append(record)
    for mark, batch in batches:
        by = {}
        for engine in ("alone", "null", "xtokspec"):
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
        print("batch", mark[1], f"alone {mark[2] * 1e3:.0f} ms, x {mark[3] * 1e3:.0f} ms, null {mark[4] * 1e3:.0f} ms")
        kinds = collections.Counter(call[3] for name, _rows, _seconds, call in batch if name == "xtokspec" and call)
        kind_s = collections.defaultdict(float)
        for name, _rows, seconds, call in batch:
            if name == "xtokspec" and call:
                kind_s[call[3]] += seconds
        print("   chose:", {k: (v, round(kind_s[k] * 1e3, 1)) for k, v in kinds.items()}, "no call:", sum(1 for n, r, s, c in batch if n == "xtokspec" and not c))
        for rows in sorted(set(by["alone"]) | set(by["xtokspec"]), reverse=True):
            a, x, nu = by["alone"].get(rows, [0, 0, 0, 0]), by["xtokspec"].get(rows, [0, 0, 0, 0]), by["null"].get(rows, [0, 0, 0, 0])
            line = (f"   rows {rows}: alone {a[0]:3d} steps {a[1] * 1e3:7.1f} ms | x {x[0]:3d} steps "
                    f"{x[1] * 1e3:7.1f} ms, ids {x[2]:3d}, calls {x[3] * 1e3:6.1f} ms")
            if a[0] and x[0]:
                line += f"  per step a {a[1] / a[0] * 1e3:5.1f} x {x[1] / x[0] * 1e3:5.1f}"
            if nu[0]:
                line += f" null {nu[0]:3d} steps {nu[1] * 1e3:7.1f} ms"
            print(line)


def main() -> None:
    chosen = vb.preset("fixtures", 3)
    both = vb.load_prompts("fixtures", 40)
    prompts, warm = both[:32], both[32:]
    engines = {name: vb.build_engine(chosen, name, 8, prompts[0], log_stats=False) for name in ("alone", "null", "xtokspec")}
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
        last["call"] = (len(out), sum(map(len, out)), time.perf_counter() - t0, self.policy.chose + ("/probe" if self.policy.probed else ""))
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
            log.append(("batch", i, result["alone"][0], result["xtokspec"][0], result["null"][0]))
            print("batch", i, f"x/a {result['alone'][0] / result['xtokspec'][0]:.3f} null/a {result['alone'][0] / result['null'][0]:.3f}", flush=True)
    (HERE / "engine-steps-start.json").write_text(json.dumps(log), encoding="utf-8")
    report(log)


if __name__ == "__main__":
    main()
